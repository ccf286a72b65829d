"""What `shard compile` prints: a compile's report read once into typed records, and the summary's
lines made from their fields.

This module is the one place a report's keys are read outside the code that writes it: the compile
report (`Summary.of`, `StageSummary.of`, `totals_of`, `predicted_of`, `shards_of`) and the passes'
own reports (`passed`, `cut_of`, `stages_of`, `fp8_nodes`, `rewrite_delta`), for the CLI, inspect,
the compile's later stages and the generative compile alike. A field every compile writes is
required: a report without it is refused there, in one line naming the entry and the field, never
by a KeyError half way through the summary (a clean CLIP text encoder compile ended so, printing its
changes). What only some compiles write has a default. The printer (`summary_lines`, `shards_table`)
reads fields only, so any Summary prints: a property test hands it every kind of record.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from dataclasses import dataclass, field
from typing import Any

from rich.markup import escape
from rich.table import Table

from shard.bundle import step_inputs, step_outputs
from shard.errors import ShardError

SHOWN_LEFT = 5   # ops a pass left as is, printed one by one; the rest in one line
SHOWN_CHANGES = 4   # runs of a pass's changes printed one by one; the rest in one line
STEPS_ONE_BY_ONE = 3   # host steps printed one by one; more in one line (a decoder's rotary table)
# What a build's figures are called where its target has no word of its own (shard.targets.Target.words)
COMMON_WORDS = {"overflow_lines": "overflow lines", "error_lines": "error lines", "fallbacks": "fallbacks",
                "fallback": "runs in a lesser mode than asked"}


def said_in(words: dict[str, str], figure: str, common: dict[str, str] = COMMON_WORDS) -> str:
    """What a figure is called: the target's word for it (shard.targets.Target.words: "REGTASK lines"),
    else the common one."""
    return words.get(figure) or common[figure]


def record(cls, data: Any, where: str):
    """An instance of the dataclass `cls` from the dict `data`: each field from its key, or its default;
    a field typed as a record (or a list of them, or one or None) read as one in turn; a ShardError
    naming `where` and the field when a field without a default is missing."""
    if not isinstance(data, dict):
        raise ShardError(f"report {where}: not a mapping ({type(data).__name__})")
    values = {}
    for f in dataclasses.fields(cls):
        if f.name in data:
            values[f.name] = nested(hints(cls)[f.name], data[f.name], f"{where}.{f.name}")
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            take(data, f.name, where)
    return cls(**values)


def nested(kind, value: Any, where: str) -> Any:
    """`value` as the field type `kind` holds it: a record, a list of records, or as it is."""
    if dataclasses.is_dataclass(kind) and value is not None:
        return record(kind, value, where)
    args = [a for a in typing.get_args(kind) if a is not type(None)]
    if typing.get_origin(kind) is list and args and dataclasses.is_dataclass(args[0]):
        return [record(args[0], v, f"{where}[{k}]") for k, v in enumerate(value or [])]
    if len(args) == 1 and dataclasses.is_dataclass(args[0]) and isinstance(kind, types.UnionType):
        return nested(args[0], value, where)
    return value


@functools.cache
def hints(cls) -> dict:
    return typing.get_type_hints(cls)


def take(data: dict, key: str, where: str) -> Any:
    if key not in data:
        raise ShardError(f"report {where}: no {key!r}; the report was written by another version of shard, or damaged")
    return data[key]


def maybe(cls, data: Any, where: str):
    """The record of `data`, or None where the report has none."""
    return record(cls, data, where) if data else None


@dataclass(frozen=True)
class Change:
    """One rewrite of a pass: which node, why, what was done, and the cycles it moved where measured."""

    node: str
    op: str
    reason: str
    action: str
    before_cycles: int | None = None
    after_cycles: int | None = None
    before_cost: int | None = None       # with the ops the estimate leaves at 0 costed by bytes
    after_cost: int | None = None
    ddr_cycles_per_kb: float | None = None
    form: str | None = None              # scale_sandwich: range, outlier split, hidden split, mask clamp
    query_tiles: int | None = None       # tile_attention: the tiles made, and how many the vendor kept apart
    tiles_in_layer_table: int | None = None
    tiles_survived: bool | None = None

    def cycles(self) -> str:
        """The rewrite's cycles as the vendor estimates them, and with the ops it leaves at 0 costed."""
        if self.before_cycles is None or self.after_cycles is None:
            return ""
        note = f" ({self.before_cycles / 1e6:.2f} M -> {self.after_cycles / 1e6:.2f} M estimated cycles"
        if self.ddr_cycles_per_kb and self.before_cost is not None and self.after_cost is not None:
            note += (f"; {self.before_cost / 1e6:.2f} M -> {self.after_cost / 1e6:.2f} M with the ops the "
                     f"estimate leaves at 0 costed by bytes at {self.ddr_cycles_per_kb} cycles/KB")
        return note + ")"


@dataclass(frozen=True)
class Left:
    """An op a pass left as it was: `not_fixed` (a warning) or `tried` (failed alone; the build decides)."""

    node: str
    op: str
    reason: str
    action: str = "left as is"


@dataclass(frozen=True)
class PassReport:
    LISTS: typing.ClassVar = ("changes", "not_fixed", "tried", "reported")

    name: str
    changes: list[Change] = field(default_factory=list)
    not_fixed: list[Left] = field(default_factory=list)
    tried: list[Left] = field(default_factory=list)
    reported: list[Left] = field(default_factory=list)   # left to the vendor compiler: it runs them on the CPU


@dataclass(frozen=True)
class Choice:
    """Which build of a shard was kept, and the rewrites that choice undid."""

    shard: str
    what: str
    line: str
    dropped_nodes: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class ShardRow:
    name: str
    core: int
    nodes: int
    macs: int
    build_seconds: float = 0.0
    cached: bool = False
    build_peak_bytes: int | None = None
    overflow_lines: int = 0           # the shard's diagnostics, from here on (shard.targets.ShardBuild)
    cpu_ops: list[str] = field(default_factory=list)
    fallbacks: list[str] = field(default_factory=list)
    estimated_cycles: int = 0
    disabled_rules: list[str] = field(default_factory=list)
    crashes: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Totals:
    shards: int
    overflow_lines: int
    cpu_ops: int
    fallbacks: int
    estimated_cycles: int
    estimated_cycles_before_passes: int | None = None
    int8_mac_share: float | None = None


@dataclass(frozen=True)
class ProfileLine:
    target: str
    cores: int
    file: str
    toolkit: str = ""
    probed: str = ""


@dataclass(frozen=True)
class MixedRound:
    round: int
    promoted: list[str]
    cosine: float
    cosine_calibration: float
    int8_mac_share: float
    estimated_cycles: int
    predicted: float | None = None


@dataclass(frozen=True)
class Mixed:
    """--precision mixed: how its rounds were judged, and each round."""

    calibration: int = 0
    held_out: int = 0
    folds: int = 1
    bundle_cosine: float | None = None
    rounds: list[MixedRound] = field(default_factory=list)
    kept: int | None = None


@dataclass(frozen=True)
class Cut:
    """How partition cut: for the builds' memory, and the fused patterns no cut runs through."""

    shards: int = 0
    by_memory: bool = False
    weight_bytes: int = 0
    for_memory: int = 0
    builds_at_once: int | None = None
    kept_whole: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Predicted:
    latency_s: float
    stream_fps: dict[str, float]
    handoff_seconds: list[float] | None = None    # per shard, on the board
    shard_seconds: list[float] = field(default_factory=list)
    npu_seconds: list[float] = field(default_factory=list)
    vendor_handoff_s: float = 0.0
    npu_clock_hz: float | None = None


@dataclass(frozen=True)
class Versus:
    """The bundle beside the vendor alone."""

    line: str
    bundle: str
    vendor_alone: str = "vendor alone"    # what stood for it: its whole build, or shard by shard
    why: str = ""
    shard_cosine: float | None = None
    vendor_cosine: float | None = None
    fidelity_run: bool = False
    vendor_estimated_cycles: int | None = None


@dataclass(frozen=True)
class CacheHit:
    seconds: float
    compiled_in: float


@dataclass(frozen=True)
class Summary:
    shards: list[ShardRow]
    totals: Totals
    precision: str = "fp16"
    warnings: list[str] = field(default_factory=list)
    profile: ProfileLine | None = None
    seconds: float = 0.0
    builds_from_cache: int = 0
    builds_total: int = 0
    from_bundle_cache: CacheHit | None = None
    mixed: Mixed = field(default_factory=Mixed)
    cut: Cut = field(default_factory=Cut)
    predicted: Predicted | None = None
    batch: int = 1
    choices: list[Choice] = field(default_factory=list)
    passes: list[PassReport] = field(default_factory=list)
    host_pre: list[dict] = field(default_factory=list)    # host steps, in the manifest's own form
    host_post: list[dict] = field(default_factory=list)
    host_ms: float | None = None
    host_post_ms: float | None = None
    versus: Versus | None = None
    compared: bool = False            # the vendor alone stood beside it (else --no-vendor-baseline, or none)
    vendor_figures_only: bool = False
    vendor_only: bool = False
    words: dict[str, str] = field(default_factory=dict)   # the target's words for the figures (Target.words)

    def said(self, figure: str) -> str:
        """What the summary calls a figure: the target's word for it, else the common one."""
        return said_in(self.words, figure)

    @classmethod
    def of(cls, report: dict) -> Summary:
        """The summary of a compile's report (one precision, one bucket): its records, each checked."""
        shards = shards_of(report)
        builds, seconds = report.get("builds", {}), report.get("seconds", {})
        versus = report.get("versus_vendor")
        return cls(shards=shards, totals=totals_of(report),
                   precision=report.get("precision", "fp16"), warnings=list(report.get("warnings", [])),
                   profile=maybe(ProfileLine, report.get("profile"), "profile"),
                   seconds=seconds.get("total", 0.0), builds_from_cache=builds.get("from_cache", 0),
                   builds_total=builds.get("total", 0),
                   from_bundle_cache=maybe(CacheHit, report.get("from_bundle_cache"), "from_bundle_cache"),
                   mixed=mixed_of(report.get("mixed") or {}), cut=cut_of(report.get("passes", {})),
                   predicted=predicted_of(report),
                   batch=report.get("batch", 1),
                   choices=[record(Choice, c, f"choices[{k}]") for k, c in enumerate(report.get("choices", []))],
                   passes=[pass_of(name, its) for name, its in report.get("passes", {}).items()],
                   host_pre=list(report.get("host_pre", [])), host_post=list(report.get("host_post", [])),
                   host_ms=report.get("host_ms"), host_post_ms=report.get("host_post_ms"),
                   versus=versus_of(versus) if versus else None, compared=report.get("vendor_alone") is not None,
                   vendor_figures_only=bool((report.get("vendor_alone") or {}).get("figures_only")),
                   vendor_only=bool(report.get("vendor_only")), words=dict(report.get("words") or {}))


def pass_of(name: str, passed: dict) -> PassReport:
    """A pass's changes and what it left (a pass's own other keys are its report's, not the summary's)."""
    if not isinstance(passed, dict):
        return PassReport(name)
    return record(PassReport, {"name": name, **{key: passed.get(key) for key in PassReport.LISTS}}, f"passes.{name}")


def passed(passes: dict, name: str) -> PassReport:
    """The pass `name`'s report among a compile's (a PassContext's reports, or the report's "passes"); an
    empty one where that pass did not run."""
    return pass_of(name, passes.get(name))


def shards_of(report: dict) -> list[ShardRow]:
    return [record(ShardRow, {**s, **s.get("diagnostics", {})}, f"shards[{k}]")
            for k, s in enumerate(take(report, "shards", "the report"))]


def totals_of(report: dict) -> Totals:
    return record(Totals, take(report, "totals", "the report"), "totals")


def predicted_of(report: dict) -> Predicted | None:
    """The compile's prediction of a run (the vendor's cycle estimates, a board's hand-offs), or None."""
    return maybe(Predicted, report.get("predicted"), "predicted")


def cut_of(passes: dict) -> Cut:
    return record(Cut, passes.get("partition") or {}, "passes.partition")


def stages_of(passes: dict) -> list[Stage]:
    """A GPU target's pipeline stages (its stages pass); [] where there are none."""
    stages = (passes.get("stages") or {}).get("stages", [])
    return [record(Stage, s, f"passes.stages.stages[{k}]") for k, s in enumerate(stages)]


def staged(report: dict) -> bool:
    """A GPU target's compile: pipeline stages (StageSummary), not the NPU's shards (Summary)."""
    return "stages" in take(report, "passes", "the report")


def fp8_nodes(passes: dict) -> set[str]:
    """The linears fp8_linears put in FP8."""
    return {take(c, "node", "passes.fp8_linears.changes") for c in (passes.get("fp8_linears") or {}).get("changes", [])}


def rewrite_delta(passes: dict) -> int:
    """Cycles the rewrites saved, each measured by building its region before and after alone (the
    changes with cycles before and after)."""
    return sum((c.before_cycles or 0) - (c.after_cycles or 0)
               for name, report in passes.items() if isinstance(report, dict)
               for c in (record(Change, change, f"passes.{name}.changes")
                         for change in report.get("changes", []) if "before_cycles" in change))


def mixed_of(mixed: dict) -> Mixed:
    """--precision mixed's rounds, with how they were judged (its samples' counts) beside them."""
    return record(Mixed, {**mixed.get("samples", {}), **mixed}, "mixed")


def versus_of(versus: dict) -> Versus:
    fidelity = versus.get("fidelity")
    return Versus(line=take(versus, "line", "versus_vendor"), bundle=take(versus, "bundle", "versus_vendor"),
                  vendor_alone=versus.get("vendor_alone", "vendor alone"), why=versus.get("why") or "",
                  shard_cosine=(fidelity or {}).get("shard"), vendor_cosine=(fidelity or {}).get("vendor"),
                  fidelity_run=fidelity is not None,
                  vendor_estimated_cycles=(versus.get("vendor") or {}).get("estimated_cycles"))


def shards_table(summary: Summary) -> Table:
    table = Table(title="shards")
    for col in ("shard", "core", "nodes", "GMACs", "build s", "build GB", summary.said("overflow_lines"), "CPU ops",
                summary.said("fallbacks"), "est. Mcycles"):
        table.add_column(col, justify="right" if col != "shard" else "left")
    for s in summary.shards:
        table.add_row(s.name, str(s.core), str(s.nodes), f"{s.macs / 1e9:.2f}",
                      "cached" if s.cached else f"{s.build_seconds:.1f}",
                      f"{s.build_peak_bytes / 1e9:.2f}" if s.build_peak_bytes else "-", str(s.overflow_lines),
                      str(len(s.cpu_ops)), str(len(s.fallbacks)), f"{s.estimated_cycles / 1e6:.1f}")
    return table


def summary_lines(s: Summary) -> list[str]:
    """The summary under the shards' table, in rich markup, in the order `shard compile` prints it."""
    return [*totals_lines(s), *mixed_lines(s), *cut_lines(s.cut), *prediction_lines(s), *change_lines(s),
            *host_lines(s), *versus_lines(s), *fallback_lines(s)]


def warning(text: str) -> str:
    return f"[yellow]warning[/]: {escape(text)}"


def totals_lines(s: Summary) -> list[str]:
    """The warnings, the profile, the totals."""
    lines = [warning(w) for w in s.warnings]
    t, p = s.totals, s.profile
    if p is not None:
        lines.append(escape(f"target {p.target} ({p.cores} NPU core{'s' * (p.cores > 1)}), profile {p.file}: "
                            f"{p.toolkit or 'no toolkit'}" + (f", probed {p.probed}" if p.probed else "")))
    lines.append(f"{t.shards} {escape(s.precision)} shards, {t.overflow_lines} {escape(s.said('overflow_lines'))}, "
                 f"{t.cpu_ops} ops on the CPU, {t.fallbacks} {escape(s.said('fallbacks'))}, "
                 f"{t.estimated_cycles / 1e6:.1f} M estimated cycles; "
                 f"{escape(compile_time(s))}")
    if t.int8_mac_share is not None and s.precision != "fp16":
        lines.append(f"int8 share of the MACs (Conv and MatMul layers, from the vendor's layer tables): "
                     f"{100 * t.int8_mac_share:.1f} %")
    return lines


def compile_time(s: Summary) -> str:
    hit = s.from_bundle_cache
    if hit is not None:
        return (f"the bundle came from the cache in {hit.seconds:.1f} s (the same model, options, profile, "
                f"toolchain and shard; compiled in {hit.compiled_in:.1f} s)")
    return f"compiled in {s.seconds:.1f} s ({s.builds_from_cache} of {s.builds_total} vendor builds from the cache)"


def mixed_lines(s: Summary) -> list[str]:
    """--precision mixed: how the rounds were judged, then one line each, under 160 columns."""
    m, lines = s.mixed, []
    if m.rounds and m.folds > 1:
        refit = f" (cosine {m.bundle_cosine:.5f})" if m.bundle_cosine is not None else ""
        lines.append(f"mixed precision: {m.folds} folds, each round's cosine the worst of the {m.held_out} samples, "
                     f"each held out of the int8 ranges once; the bundle's ranges from all {m.calibration}{refit}")
    elif m.rounds:
        lines.append(f"mixed precision: int8 ranges from {m.calibration} calibration samples, each round accepted on "
                     f"{m.held_out} held out (the simulator against onnxruntime, worst output cosine)")
    for r in m.rounds:
        replica = "" if r.predicted is None else f" (replica {r.predicted:.5f})"
        kept = " (kept)" if r.round == m.kept and len(m.rounds) > 1 else ""
        lines.append(f"mixed precision, round {r.round}{kept}: {len(r.promoted)} linears in fp16, cosine "
                     f"{r.cosine:.5f} held out, {r.cosine_calibration:.5f} calibration{replica}, int8 "
                     f"{100 * r.int8_mac_share:.1f} % of the MACs, {r.estimated_cycles / 1e6:.1f} M cycles")
    return lines


def cut_lines(cut: Cut) -> list[str]:
    """How partition cut for the builds' memory, and the fused patterns it kept whole."""
    lines = []
    if cut.by_memory:
        lines.append(f"{cut.shards} shards for the builds' memory: {cut.weight_bytes / 1e6:.0f} MB of weights, cut so "
                     f"that its builds, {cut.builds_at_once or 1} at a time, stay within half of the vendor's build "
                     f"of the whole model; no finer, as each shard is one more hand-off a frame on the board "
                     f"(--shards sets the count)")
    elif cut.for_memory > cut.shards and cut.builds_at_once is not None:
        lines.append(f"{cut.shards} shards where the builds' memory asked for {cut.for_memory} (each one more hand-off "
                     f"a frame: a step of few MACs, or --shards, keeps them few): built {cut.builds_at_once} at a "
                     f"time instead, nearer half of the vendor's build of the whole model")
    if cut.kept_whole:
        lines.append(escape(f"partition: no cut through what the vendor fuses (the cheapest cut ran through "
                            f"{len(cut.kept_whole)}): {', '.join(cut.kept_whole[:3])}"
                            f"{' ...' if len(cut.kept_whole) > 3 else ''}"))
    return lines


def one_run(batch: int) -> str:
    """What one run of a bundle takes: a frame, or a batch of them (--batch)."""
    return f"one batch of {batch} frames" if batch > 1 else "one frame"


def prediction_lines(s: Summary) -> list[str]:
    """The prediction on the board (or the NPU), then the whole model's cycles before and after the passes."""
    lines, p, t = [], s.predicted, s.totals
    if p is not None:
        where = "on the board" if p.handoff_seconds is not None else "on the NPU"
        lines.append(escape(f"predicted {where} (estimated cycles at the NPU clock, host steps aside): "
                            f"{one_run(s.batch)} {1e3 * p.latency_s:.1f} ms; run_stream "
                            + ", ".join(f"{s.batch * fps:.1f}" for fps in p.stream_fps.values())
                            + f" frames/s on {'/'.join(map(str, p.stream_fps))} cores"))
        if p.handoff_seconds is not None:
            lines.append(handoff_line(p, s.versus))
    before = t.estimated_cycles if t.estimated_cycles_before_passes is None else t.estimated_cycles_before_passes
    lines.append(f"estimated cycles, whole model: {before / 1e6:.1f} M before the passes, "
                 f"{t.estimated_cycles / 1e6:.1f} M after")
    return lines


def handoff_line(p: Predicted, versus: Versus | None) -> str:
    """What the shards' hand-offs add on the board, against the vendor's one graph."""
    moves = p.handoff_seconds or []
    vendor = f"{1e3 * p.vendor_handoff_s:.1f} ms of hand-offs"
    cycles = versus.vendor_estimated_cycles if versus is not None else None
    if cycles and p.npu_clock_hz:
        vendor = (f"{1e3 * (cycles / p.npu_clock_hz + p.vendor_handoff_s):.1f} ms, "
                  f"{1e3 * p.vendor_handoff_s:.1f} ms of it hand-offs")
    return (f"  of it: the NPU {1e3 * sum(p.npu_seconds):.1f} ms, hand-offs {1e3 * sum(moves):.1f} ms "
            f"(each of {len(moves)} shard(s) has its inputs set and outputs got on the host; the vendor's one graph "
            f"{vendor}; rates: report.json's predicted.handoff_source)")


def change_lines(s: Summary) -> list[str]:
    """Each shard's choice, and each pass's changes (those a choice undid marked) and the ops it left."""
    lines, dropped = [], {}
    for choice in s.choices:
        lines.append(escape(f"{choice.shard}: {choice.what}; {choice.line}"))
        dropped.update(dict.fromkeys(choice.dropped_nodes, choice.shard))
    for passed in s.passes:
        lines += pass_lines(passed, dropped)
    return lines


def pass_lines(passed: PassReport, dropped: dict[str, str]) -> list[str]:
    name, lines = passed.name, []
    groups = alike(passed.changes, dropped)
    for group in groups[:SHOWN_CHANGES]:
        c = group[0]
        undone = f" [yellow](undone: {escape(dropped[c.node])} built better without it)[/]" if c.node in dropped else ""
        nodes = c.node if len(group) == 1 else f"{len(group)} ops: {c.node} ... {group[-1].node}"
        lines.append(escape(f"{name}: {nodes} ({c.op}): {c.reason}; {c.action}{c.cycles()}") + undone)
        if c.tiles_survived is not None:
            verdict = "not fused back" if c.tiles_survived else "[red]fused back[/] (see --fusion-barrier)"
            lines.append(f"  vendor layer table: {c.tiles_in_layer_table} of {c.query_tiles} tiles are layers of "
                         f"their own: {verdict}")
    if len(groups) > SHOWN_CHANGES:   # mixed precision's per-linear splits: one line, each in the report
        ops = sorted({c.op for group in groups[SHOWN_CHANGES:] for c in group})
        lines.append(escape(f"{name}: {sum(map(len, groups[SHOWN_CHANGES:]))} more changes ({', '.join(ops)}); "
                            f"report.json lists each under passes.{name}.changes"))
    left = passed.not_fixed
    lines += [warning(f"{name}: {c.node} ({c.op}): {c.reason}; {c.action}") for c in left[:SHOWN_LEFT]]
    if len(left) > SHOWN_LEFT:
        ops = sorted({c.op for c in left[SHOWN_LEFT:]})
        lines.append(warning(f"{name}: {len(left) - SHOWN_LEFT} more ops left as is ({', '.join(ops)}); "
                             f"report.json lists each under passes.{name}.not_fixed"))
    if passed.tried:   # what failed built alone and was left whole: the model's build (the figures above) decides
        ops = ", ".join(sorted({c.op for c in passed.tried}))
        lines.append(escape(f"{name}: {len(passed.tried)} {ops} {'regions' if name == 'tile_attention' else 'ops'} "
                            f"fail built alone and were left whole ({passed.tried[0].reason[:120]}); the model's "
                            f"build decides; report.json lists each under passes.{name}.tried"))
    return lines


def alike(changes: list[Change], dropped: dict) -> list[list[Change]]:
    """Runs of changes that differ only in their node (a decoder's 61 norms): one line each run;
    report.json keeps every one."""
    groups: list[list[Change]] = []
    same = lambda c: (dataclasses.replace(c, node=""), c.node in dropped)  # noqa: E731
    for c in changes:
        if groups and c.tiles_survived is None and same(c) == same(groups[-1][0]):
            groups[-1].append(c)
        else:
            groups.append([c])
    return groups


def describe_step(step: dict) -> str:
    """A host step in one line: its op, what it reads and what it makes."""
    return f"{step.get('type', step.get('op', '?'))} {', '.join(step_inputs(step))} -> {', '.join(step_outputs(step))}"


def host_lines(s: Summary) -> list[str]:
    lines = []
    for when, steps in (("before", s.host_pre), ("after", s.host_post)):
        if len(steps) > STEPS_ONE_BY_ONE:   # a decoder's rotary table: one line; report.json lists each
            lines.append(escape(f"host steps {when} the shards (numpy, not NPU or CPU ops): {len(steps)} steps, "
                                f"{', '.join(step.get('type', step.get('op', '?')) for step in steps)}; "
                                f"first {describe_step(steps[0])}"))
        else:
            lines += [escape(f"host step {when} the shards (numpy, not an NPU or CPU op): {describe_step(step)}")
                      for step in steps]
    for when, ms in (("before", s.host_ms), ("after", s.host_post_ms)):
        if ms is not None:
            lines.append(f"host steps {when} the shards: {ms:.3f} ms per frame on this machine")
    return lines


def versus_lines(s: Summary) -> list[str]:
    v = s.versus
    if v is None:
        return [] if s.compared else ["shard / vendor alone: not compared (--no-vendor-baseline, or a target "
                                      "without a vendor compiler)"]
    lines = [escape(v.line)]
    if v.vendor_alone != "vendor alone":
        lines.append(escape(f"{v.vendor_alone}: its whole build is not made ({v.why})"))
    if s.vendor_figures_only:
        lines.append("vendor alone: the figures of its earlier build of this graph with other weights (build cache); "
                     "built again only where its artifact is needed")
    if v.fidelity_run:
        shown = ["not run" if c is None else f"{c:.7f}" for c in (v.shard_cosine, v.vendor_cosine)]
        lines.append(f"simulator cosine, shard / vendor alone: {shown[0]} / {shown[1]}")
    if v.bundle != "shard" and not s.vendor_only:
        held = ("its build of the model as it came" if v.bundle == "vendor alone"
                else "each shard's build without its rewrites")
        lines.append(warning(f"the vendor toolkit alone built this model better; the bundle holds {held} "
                             f"(shard / vendor alone: equal)"))
    return lines


def fallback_lines(s: Summary) -> list[str]:
    lines = []
    for shard in s.shards:
        if shard.disabled_rules:
            crash = shard.crashes[0].split(": ", 1)[-1] if shard.crashes else "the toolkit crashed"
            lines.append(escape(f"{shard.name}: {crash}; built again with the toolkit's "
                                f"disable_rules={shard.disabled_rules} (where the vendor alone stops)"))
        lines += [warning(f"{shard.name}: {op} runs on the CPU") for op in shard.cpu_ops]
        lines += [warning(f"{shard.name}: {layer} {s.said('fallback')}") for layer in shard.fallbacks]
    return lines


@dataclass(frozen=True)
class Published:
    """A chip's published figures for the same decoder (shard.targets.chips: decoder_figures)."""

    label: str
    prefill_128_ms: float
    decode_tokens_per_s: float
    vision_ms: float | None = None


@dataclass(frozen=True)
class SpeedRow:
    """A generative bundle's predicted speed at one cache capacity (compilation.generative.predict)."""

    capacity: int
    prefill_128_ms: float | None = None
    decode_tokens_per_s: float | None = None
    weight_bytes: int = 0
    cache_bytes: int = 0
    one_step_tokens_per_s: float | None = None
    bandwidth_tokens_per_s: float | None = None
    dram_gbs: float | None = None
    decode_handoff_ms: float | None = None
    decode_npu_tokens_per_s: float | None = None
    vision_ms: float | None = None
    image_ms: float | None = None
    image_squares: int | None = None
    cores: int | None = None
    published: Published | None = None
    held_prefill_128_ms: float | None = None      # the cache held where the NPU reads it (rknn_held)
    held_decode_tokens_per_s: float | None = None
    held_handoff_ms: float | None = None
    held_write_ms: float | None = None
    held_source: str | None = None

    @classmethod
    def of(cls, row: dict, where: str) -> SpeedRow:
        return record(cls, row, where)


def figure(value: float | None, digits: int | None = None) -> str:
    """A predicted figure, or '-' where none was predicted."""
    if value is None:
        return "-"
    return f"{value:.{digits}f}" if digits is not None else f"{value}"


def speed_table(rows: list[SpeedRow]) -> Table:
    """Predicted prefill and decode speed per cache capacity, beside the DRAM bound and the chip's
    published figures."""
    table = Table(title="predicted speed (fp16)")
    vision = any(r.vision_ms is not None for r in rows)
    moves = any(r.decode_handoff_ms is not None for r in rows)
    for col in ("", "cache", *(["image ms"] if vision else []), "prefill 128 tokens ms", "decode tokens/s",
                *(["of a token: hand-offs ms", "the NPU alone tokens/s"] if moves else []), "DRAM-bound tokens/s"):
        table.add_column(col, justify="left" if not col else "right")
    for r in rows:
        bound = (f"{r.bandwidth_tokens_per_s} ({(r.weight_bytes + r.cache_bytes) / 1e6:.0f} MB a token at "
                 f"{r.dram_gbs} GB/s)" if r.bandwidth_tokens_per_s is not None else "")
        table.add_row("shard, from the vendor's cycle estimates" + (" and the board's hand-offs" if moves else ""),
                      str(r.capacity), *([figure(r.vision_ms)] if vision else []), figure(r.prefill_128_ms, 1),
                      figure(r.decode_tokens_per_s),
                      *([figure(r.decode_handoff_ms), figure(r.decode_npu_tokens_per_s)] if moves else []),
                      escape(bound))
        if r.held_decode_tokens_per_s is not None:
            table.add_row("shard, the cache held where the NPU reads it", str(r.capacity),
                          *([""] if vision else []), figure(r.held_prefill_128_ms, 1),
                          figure(r.held_decode_tokens_per_s),
                          *([figure(held_ms(r)), ""] if moves else []), "")
    published = rows[0].published if rows else None
    if published is not None:
        table.add_row(escape(published.label), "", *([figure(published.vision_ms, 0)] if vision else []),
                      figure(published.prefill_128_ms, 0), figure(published.decode_tokens_per_s, 0),
                      *(["", ""] if moves else []), "")
    return table


def held_ms(r: SpeedRow) -> float | None:
    """Of a token with the cache held: the hand-offs and the host's writes of its new rows."""
    parts = (r.held_handoff_ms, r.held_write_ms)
    return None if None in parts else round(sum(parts), 3)


def speed_lines(rows: list[SpeedRow]) -> list[str]:
    """What the speed table's figures hold, and what --one-step would give."""
    lines = []
    if any(r.decode_handoff_ms is not None for r in rows):
        lines.append("hand-offs: each step's inputs, the whole cache among them, set on the host through the board's "
                     "runtime every token (rates in each program's report.json: predicted.handoff_source)")
    held = next((r for r in rows if r.held_decode_tokens_per_s is not None), None)
    if held is not None:
        lines.append(f"the cache held (shard generate --backend board, every step fp16): of a token, "
                     f"{held.held_handoff_ms} ms hand-offs of the other inputs and the outputs, "
                     f"{held.held_write_ms} ms writing the new keys and values; from {held.held_source}")
    one = [r for r in rows if (r.one_step_tokens_per_s or 0) > (r.decode_tokens_per_s or 0)]
    if one:
        lines.append(f"--one-step: the answer's tokens through the prompt's step would decode at "
                     f"{', '.join(str(r.one_step_tokens_per_s) for r in one)} tokens/s by the same estimates (cache "
                     f"{', '.join(str(r.capacity) for r in one)}), with one copy of the weights where this bundle "
                     f"holds two; each token a step of --chunk, whose larger inputs and keys and values the "
                     f"estimates do not count")
    return lines


def image_room_lines(squares: int, tokens: int, size: int, capacity: int, row: SpeedRow) -> list[str]:
    """How much of the context an image takes at most (its processor may split it into `squares`),
    and the vision program's predicted time for that many squares."""
    split = f"up to {squares} squares of {size} x {size} (its processor splits it), " if squares > 1 else ""
    lines = [f"an image: {split}{tokens} image tokens of the context's {capacity}"]
    if row.image_ms:
        lines.append(f"predicted: {row.image_squares} squares in {row.image_ms} ms, pipelined over {row.cores} cores "
                     f"({row.image_squares} x {row.vision_ms} ms one by one)")
    if tokens >= capacity:
        lines.append(warning(f"the largest images leave no room in --max-context {capacity} for the prompt's text and "
                             f"the answer: give it more than {tokens}"))
    return lines


@dataclass(frozen=True)
class Stage:
    """One pipeline stage of a GPU target: its roofline floor, the predicted time, what bounds it."""

    stage: str
    nodes: int
    flops: float
    weight_bytes: int
    bytes: int
    floor_s: float
    predicted_s: float
    bound: str


@dataclass(frozen=True)
class Fp8Round:
    round: int
    fp8_linear_macs: float
    cosine: float
    predicted: float
    confirmed: float | None = None


@dataclass(frozen=True)
class Fp8:
    """fp8_linears: the search's rounds, and how many linears went to FP8."""

    rounds: list[Fp8Round] = field(default_factory=list)
    kept: int | None = None
    frames: int = 1
    checked_on: int = 0
    linears: int = 0
    samples: int = 0


@dataclass(frozen=True)
class W4a16:
    """w4a16_linears: how many linears read int4 weights, the weights' bytes before and after, and those
    left in the model's type."""

    linears: int = 0
    left: int = 0
    weight_bytes_before: int = 0
    weight_bytes_after: int = 0
    int4_linear_macs: float = 0.0
    cosine: float | None = None      # the kept round's, against the graph itself on the calibration samples
    checked_on: int = 0


@dataclass(frozen=True)
class BatchChoice:
    batch: int
    fps: float
    latency_s: float


@dataclass(frozen=True)
class BatchAuto:
    batch: int
    candidates: list[BatchChoice] = field(default_factory=list)
    latency_budget_s: float | None = None


@dataclass(frozen=True)
class StageSummary:
    """What a GPU target's compile prints: its stages, the FP8 search, the prediction, --batch auto."""

    stages: list[Stage]
    precision: str = "fp16"
    warnings: list[str] = field(default_factory=list)
    fp8: Fp8 = field(default_factory=Fp8)
    w4a16: W4a16 = field(default_factory=W4a16)
    batch: int = 1
    batch_auto: BatchAuto | None = None

    @property
    def lowered(self) -> float:
        """The share of the linears' MACs in the lower precision (fp8: the kept round's; w4a16: int4 weights)."""
        if self.precision == "w4a16":
            return self.w4a16.int4_linear_macs
        return next((r.fp8_linear_macs for r in self.fp8.rounds if r.round == self.fp8.kept), 0.0)

    @classmethod
    def of(cls, report: dict) -> StageSummary:
        passes = take(report, "passes", "the report")
        take(passes.get("stages", {}), "stages", "passes.stages")
        fp8, w4a16 = passes.get("fp8_linears") or {}, passes.get("w4a16_linears") or {}
        return cls(stages=stages_of(passes),
                   precision=report.get("precision", "fp16"), warnings=list(report.get("warnings", [])),
                   fp8=record(Fp8, {**fp8, "linears": len(fp8.get("changes", []))}, "passes.fp8_linears"),
                   w4a16=record(W4a16, {**w4a16, "linears": len(w4a16.get("changes", [])),
                                        "left": len(w4a16.get("left", []))}, "passes.w4a16_linears"),
                   batch=report.get("batch", 1), batch_auto=maybe(BatchAuto, report.get("batch_auto"), "batch_auto"))


def stage_table(stages: list[Stage], title: str) -> Table:
    """The roofline of each pipeline stage (GPU targets): its floor, the predicted time, the bound."""
    table = Table(title=escape(title))
    for col in ("stage", "nodes", "GFLOP", "weights MB", "DRAM MB", "floor ms", "predicted ms", "bound"):
        table.add_column(col, justify="left" if col in ("stage", "bound") else "right")
    for s in stages:
        table.add_row(escape(s.stage), str(s.nodes), f"{s.flops / 1e9:.1f}", f"{s.weight_bytes / 1e6:.1f}",
                      f"{s.bytes / 1e6:.1f}", f"{1e3 * s.floor_s:.3f}", f"{1e3 * s.predicted_s:.3f}", escape(s.bound))
    return table


def stage_lines(s: StageSummary, engines: bool = True) -> list[str]:
    """The warnings, the FP8 rounds, the prediction (the slowest stage paces a pipeline), --batch auto;
    `engines`: the bundle runs on TensorRT too, and the prediction says how to build its engines (a VLA's
    and a decoder's programs run on the cuda and cpu backends only)."""
    lines = [warning(w) for w in s.warnings]
    frames = f" of {s.fp8.frames} frames, each frame on its own" if s.fp8.frames > 1 else ""
    for r in s.fp8.rounds:
        lines.append(f"fp8 round {r.round}: {r.fp8_linear_macs:.1%} of the linears' MACs in FP8, cosine "
                     f"{r.cosine:.5f} on {s.fp8.checked_on} calibration samples{frames} (predicted {r.predicted:.5f})"
                     + (f", {r.confirmed:.5f} with the real Q/DQ in onnxruntime" if r.confirmed is not None else "")
                     + (" [green](kept)[/]" if r.round == s.fp8.kept else ""))
    if s.fp8.linears:
        lines.append(f"fp8_linears: {s.fp8.linears} linears in FP8 E4M3 with explicit Q/DQ "
                     f"({s.fp8.samples} calibration samples); the rest fp16")
    if s.w4a16.linears:
        w = s.w4a16
        lines.append(f"w4a16_linears: {w.linears} linears read int4 weights, {w.int4_linear_macs:.1%} of the "
                     f"linears' MACs ({w.weight_bytes_before / 1e6:.1f} MB of weights -> {w.weight_bytes_after / 1e6:.1f}"
                     f" MB)" + (f", cosine {w.cosine:.5f} on {w.checked_on} calibration samples" if w.cosine is not None
                                else "") + "; the rest as they were"
                     + (f" ({w.left} whose rows no block of 16 to 128 divides)" if w.left else ""))
    if s.stages:
        slowest = max(stage.predicted_s for stage in s.stages)
        pipelined = f"{s.batch / slowest:.1f} frames/s" if slowest > 0 else "- frames/s"
        lines.append(f"predicted: {one_run(s.batch)} {1e3 * sum(stage.predicted_s for stage in s.stages):.3f} ms, "
                     f"pipelined {pipelined} (the slowest stage)"
                     + ("; engines: `shard build-engines BUNDLE` on the device" if engines else ""))
    auto = s.batch_auto
    if auto is not None:
        budget = auto.latency_budget_s
        lines.append("--batch auto, predicted per batch size: " + ", ".join(
            f"{c.batch}: {c.fps:.0f} frames/s, {1e3 * c.latency_s:.2f} ms" for c in auto.candidates)
            + f"; chose {auto.batch}" + (f" (latency budget {1e3 * budget:g} ms)" if budget else ""))
    return lines
