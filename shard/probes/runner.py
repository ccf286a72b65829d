"""`shard probe`: run the families' searches through the real vendor compiler and write a profile.

First the chip's peak rates (the compiler's own best cycle estimate over a few dense Convs, per
precision it builds) and the quantized dtypes it accepts; then each family@setting is one search
(double, then bisect; or, for a family whose verdict is not monotone in its size, every size in its
range); searches run `jobs` at a time, each build in a reused toolkit worker; every point is cached
on disk before the search moves on.
"""

from __future__ import annotations

import datetime
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from shard.errors import ShardError, TargetError
from shard.probes.families import Family, conv, conv_macs, limit_name, select
from shard.probes.handoff import measure_handoff
from shard.probes.search import Boundary, Point, find_boundary, sweep
from shard.profile import Limit, Profile, load_profile
from shard.targets.chips import CHIPS, chip_facts
from shard.targets.registry import get_target

DEFAULT_SLOW_FACTOR = 4.0
BUILD_TIMEOUT_S = 300.0


@dataclass
class Search:
    family: Family
    setting: str
    boundary: Boundary | None = None

    @property
    def name(self) -> str:
        return limit_name(self.family, self.setting)


def run_search(ops, search: Search, max_size: int | None, note: Callable[[str], None]) -> None:
    """One search's boundary, each point from the cache or built; `note` says which bracket it is at."""
    top = min(search.family.max_size, max_size or search.family.max_size)
    start = min(search.family.start, top)

    def test(size: int) -> Point:
        point = ops.cache.get(search.name, search.family.version, size)
        if point is None:
            point = probe_point(ops.prober, search.family, search.setting, size)
            ops.cache.put(search.name, search.family.version, point)
        return point

    def bracket(lo, hi) -> None:
        note(f"{search.name} [{lo or '-'}, {hi or '-'})")

    if search.family.sweep:    # not monotone: every size in the range
        search.boundary = sweep(test, range(start, top + 1), on_point=lambda size: bracket(size, None))
    else:
        search.boundary = find_boundary(test, start, top, on_bracket=bracket)


def probe(target: str, families: list[str] | None = None, jobs: int = 2, max_size: int | None = None,
          cache_dir: Path | None = None, read_cache: bool = True, base: Profile | None = None, slow_factor: float = DEFAULT_SLOW_FACTOR,
          timeout: float = BUILD_TIMEOUT_S, on_board: bool = False, ray: str | None = None,
          progress: Callable[..., None] = lambda *a, **k: None) -> tuple[Profile, list[Search]]:
    """Probe the families on `target`: a profile of their limits and the chip's measured rates (the
    other facts and cores from `base`, by default the shipped profile, else the chip's table) and
    the searches with every point they saw. A chip that builds only int8 is probed in int8, without
    the fp16 range (numeric) families."""
    if target not in CHIPS:
        raise TargetError(f"`shard probe` probes the Rockchip chips ({', '.join(CHIPS)}) and cuda; not {target!r}")
    tgt = get_target(target)
    chosen = select(families)
    base = base or starting_profile(target)
    fp16 = "fp16" in tgt.precisions
    ops = tgt.probe_toolkit(base, jobs=jobs, timeout=timeout, cache_dir=cache_dir, read_cache=read_cache,
                           slow_factor=slow_factor, on_board=on_board, ray=ray)
    searches = [Search(f, s) for f in chosen for s in f.settings if fp16 or not f.numeric]
    finished: list[str] = []
    lock = threading.Lock()

    def run(search: Search) -> None:
        run_search(ops, search, max_size, lambda note: progress("probe", len(finished), len(searches), note=note))
        with lock:
            finished.append(search.name)
            progress("probe", len(finished), len(searches), note=f"{search.name} done")

    failed = True
    try:
        measured = measure_rates(ops, tgt, progress)   # the `slow` class is judged against these
        if on_board and fp16:   # the board's own hand-off (shard.targets.chips.Handoff)
            progress("rates", 0, 1, note="hand-off on the board")
            measured.update(measure_handoff(ops.time_on_board, ops.toolkit))
        ops.prober.use_rates(measured)
        progress("probe", 0, len(searches), note="")
        with ThreadPoolExecutor(max_workers=max(1, jobs)) as executor:
            for future in [executor.submit(run, s) for s in searches]:
                future.result()
        failed = False
    finally:
        ops.close(kill=failed)
    toolkit = ops.toolkit
    today = datetime.date.today().isoformat()
    limits = {search.name: to_limit(search, toolkit, today, slow_factor) for search in searches}
    facts = {**base.facts, **measured, "slow_factor": slow_factor}
    derive_clock(facts, base.cores)
    return Profile(target=target, cores=base.cores, toolkit=toolkit, limits=limits, facts=facts), searches


def derive_clock(facts: dict, cores: int) -> None:
    """Where no source gives the NPU clock, derive it from the marketed int8 rate over the probed
    int8 peak; a clock derived by an earlier probe is derived again from this probe's peak."""
    derived = str(facts.get("npu_clock_hz_source", "")).startswith("derived")
    if (derived or "npu_clock_hz" not in facts) and facts.get("int8_tops") and facts.get("macs_per_cycle_int8"):
        facts["npu_clock_hz"] = round(facts["int8_tops"] * 1e12 / (2 * facts["macs_per_cycle_int8"] * cores))
        facts["npu_clock_hz_source"] = ("derived: int8_tops / (2 x macs_per_cycle_int8 x cores), the marketed rate "
                                        "over the probed peak")


def starting_profile(target: str) -> Profile:
    """The shipped profile of `target` (its facts and cores; its limits are probed again), or a new one
    from the chip's table (shard.targets.chips.CHIPS)."""
    cores, facts = chip_facts(target)
    try:
        shipped = load_profile(target)
    except ShardError:
        return Profile(target=target, cores=cores, toolkit="", facts=facts)
    return Profile(target=target, cores=shipped.cores, toolkit=shipped.toolkit, facts={**facts, **shipped.facts})


def probe_point(prober, family: Family, setting: str, size: int) -> Point:
    params = family.settings[setting]
    return prober.run_model(family.build(size, params), f"{limit_name(family, setting)}-{size}", size,
                            family.macs(size, params) if family.macs else None,
                            family.input_range(size, params) if family.numeric else None)


# Dense 3x3 Convs at sizes real models use: the best estimated MACs per cycle among them is the peak
# rate a `slow` point is judged against. (On RK3588, fp16: 512, as its datasheet says.)
PEAK_CONVS = ((64, 64, 128, 128), (128, 128, 64, 64), (256, 256, 32, 32), (32, 32, 256, 256))
QUANTIZED_DTYPES = ("w8a8", "w8a16", "w16a16i_dfp", "w4a16")   # what toolkit 2.5.0 names
RATES_VERSION = 1


def measure_rates(ops, tgt, progress: Callable[..., None]) -> dict:
    """Facts the probe measures about the chip itself: `macs_per_cycle_fp16` / `_int8` (peak estimated
    rate, with the Conv that reached it) and `quantized_dtypes` (what a quantized build accepts)."""
    int8 = tgt.build_for(tgt.build_options(None), "int8") if "int8" in tgt.precisions else None
    quantized = [(dtype, {**int8, "config": {**int8["config"], "quantized_dtype": dtype}})
                 for dtype in QUANTIZED_DTYPES] if int8 else []
    precisions = [("fp16", tgt.build_options(None))] if "fp16" in tgt.precisions else []
    precisions += [("int8", int8)] if int8 else []
    total, done = len(precisions) * len(PEAK_CONVS) + len(quantized), 0
    facts: dict = {}
    for precision, build in precisions:
        best = None
        for cin, cout, h, w in PEAK_CONVS:
            progress("rates", done, total, note=f"{precision} Conv {cin}->{cout} {h}x{w}")
            macs = conv_macs(cin, cout, h, w, 3, 1, 1)
            point = ops.build(conv(cin, cout, h, w, 3, 1, 1), build=build)
            done += 1
            cycles = point.figures.get("estimated_cycles", 0)
            if point.ok and cycles and (best is None or macs / cycles > best[0]):
                best = (macs / cycles, f"Conv 3x3 {cin}->{cout} on {h}x{w}: {macs:,} MACs in {cycles:,} estimated cycles")
        if best is not None:
            facts[f"macs_per_cycle_{precision}"] = round(best[0], 1)
            facts[f"macs_per_cycle_{precision}_source"] = (f"shard probe with {ops.toolkit}: the best of "
                                                           f"{len(PEAK_CONVS)} dense Convs, {best[1]}")
    accepted, refused = [], []
    for dtype, build in quantized:
        progress("rates", done, total, note=f"quantized_dtype {dtype}")
        point = ops.build(conv(16, 16, 32, 32, 3, 1, 1), build=build)
        done += 1
        (accepted if point.ok else refused).append(dtype if point.ok else f"{dtype} ({point.evidence[:120]})")
    if quantized:
        facts["quantized_dtypes"] = accepted
        facts["quantized_dtypes_source"] = (f"shard probe with {ops.toolkit}: a quantized Conv built with each; "
                                            f"refused: {'; '.join(refused) or 'none'}")
    progress("rates", total, total, note="done")
    return facts


def to_limit(search: Search, toolkit: str, date: str, slow_factor: float) -> Limit:
    b, what = search.boundary, f"{search.family.what}, setting {search.setting}"
    source = f"shard probe with {toolkit}, {b.builds} new builds of {len(b.points)} points"
    if b.passing is not None and b.smallest_failing is not None:   # a swept family: the passing set
        fail = b.failing_point
        failing = [p.size for p in b.points if not p.ok]
        evidence = (f"{what}: of N={b.points[0].size}..{b.points[-1].size}, passes at {compact(b.passing) or 'none'}; "
                    f"fails at {compact(failing)}; N={fail.size} ({fail.failure}): {fail.evidence}")
        return Limit(value=b.largest_ok or 0, failure=fail.failure, evidence=evidence, source=source, toolkit=toolkit,
                     date=date, failing=fail.size, passing=b.passing, swept_to=b.points[-1].size)
    if b.smallest_failing is None:
        return Limit(value=b.largest_ok, failure="none", evidence=f"{what}: every size up to N={b.largest_ok} passes",
                     source=source, toolkit=toolkit, date=date)
    fail = b.failing_point
    passed = f"N={b.largest_ok} passes" if b.largest_ok is not None else "no size tried passes"
    evidence = f"{what}: {passed}; N={fail.size} fails ({fail.failure}): {fail.evidence}"
    if fail.failure == "slow":
        evidence += f" [slow: more than {slow_factor:g}x the peak rate]"
    return Limit(value=b.largest_ok or 0, failure=fail.failure, evidence=evidence, source=source, toolkit=toolkit,
                 date=date, failing=fail.size)


def compact(sizes: list[int]) -> str:
    """1, 2, 3, 5, 7, 8 -> "1-3, 5, 7-8"."""
    runs: list[list[int]] = []
    for size in sorted(sizes):
        if runs and size == runs[-1][-1] + 1:
            runs[-1].append(size)
        else:
            runs.append([size])
    return ", ".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs)


def merge_into(path: Path, profile: Profile) -> tuple[Profile, int]:
    """The new profile, keeping limits of an existing profile file at `path` that this run did not probe."""
    if not path.exists():
        return profile, 0
    old = load_profile(profile.target, path)
    kept = {k: v for k, v in old.limits.items() if k not in profile.limits}
    if not kept:
        return profile, 0
    return Profile(profile.target, profile.cores, profile.toolkit, {**kept, **profile.limits},
                   {**old.facts, **profile.facts}), len(kept)
