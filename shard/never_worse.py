"""Never worse than the vendor alone, by construction.

A rewrite the passes make is a nomination, not a decision: a one-op build or a profile limit can
be wrong about the op inside its real graph (an Add [1,40,6625] logs an error line alone and builds
clean inside the model). So where the passes changed a shard, compile builds it twice: as
rewritten, and as the vendor would take the same region (the canonical graph's own nodes between
the same boundary tensors), and keeps the better build by AXES, in order of weight (shards joined by
an edge the rewritten graph holds scaled, together: shard.compilation.choice.bound_groups). Then the whole
result stands beside the vendor toolkit alone on the whole model as it came; if shard is worse
there, the bundle holds the vendor's own build. Where that build would not fit the machine
(whole_build_fits), the vendor alone is each shard built without its rewrites.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import onnx
import onnx_graphsurgeon as gs

from shard.bundle import step_inputs, step_outputs
from shard.macs import estimate_macs
from shard.passes.context import ShardPlan
from shard.summary import COMMON_WORDS, said_in
from shard.targets.chips import Handoff

# The measured axes, most important first; "worse" compares them in this order: whether it builds, lines
# saying a hardware limit overflows (the build returned 0; the board would fail), ops left on the CPU,
# layers run in a lesser mode than asked (on one core of several), the cost, and the build's other error
# lines ("Unkown op target: 0"), last: the vendor's own DPT build logs 4 and runs. A build reports them
# in these words (shard.targets.ShardBuild).
AXES = ("builds", "overflow_lines", "cpu_ops", "fallbacks", "cost_cycles", "error_lines")
# What a rewrite the user forced (--tile-attention force) must not make worse: tiles cost cycles on
# one core and are there to run on several, which the compiler's estimate cannot see.
HARD_AXES = ("builds", "overflow_lines", "cpu_ops", "fallbacks")
LABELS = {"builds": "builds", **COMMON_WORDS, "cpu_ops": "CPU ops", "cost_cycles": "est. Mcycles"}


@dataclass
class Figures:
    """What one build (or the sum of a bundle's builds) measured on each axis."""

    builds: bool
    overflow_lines: int = 0
    error_lines: int = 0
    cpu_ops: int = 0
    fallbacks: int = 0
    cost_cycles: int = 0          # the compiler's estimate, plus the ops it leaves at 0 costed by bytes,
                                  # plus handoff_cycles
    estimated_cycles: int = 0     # the compiler's estimate alone
    handoff_cycles: int = 0       # each graph's inputs set and outputs got on the board (handoff_cycles())

    @classmethod
    def of(cls, builds: list) -> Figures:
        """The sum over builds (shard.targets.ShardBuild); builds is True only if every one built."""
        d = [b.diagnostics for b in builds]
        count = lambda key: sum(len(x.get(key, [])) for x in d)  # noqa: E731 - lists of findings
        return cls(builds=all(b.error is None for b in builds),
                   overflow_lines=sum(x.get("overflow_lines", 0) for x in d),
                   error_lines=sum(max(0, x.get("error_lines", 0) - x.get("overflow_lines", 0)) for x in d),
                   cpu_ops=count("cpu_ops"), fallbacks=count("fallbacks"),
                   cost_cycles=sum(x.get("cost_cycles", 0) for x in d),
                   estimated_cycles=sum(x.get("estimated_cycles", 0) for x in d))

    def with_handoffs(self, cycles: int) -> Figures:
        """These figures with `cycles` of hand-offs in their cost."""
        return replace(self, cost_cycles=self.cost_cycles + cycles, handoff_cycles=self.handoff_cycles + cycles)

    def key(self, axes: tuple[str, ...] = AXES) -> tuple:
        return tuple(not v if axis == "builds" else v for axis, v in ((a, getattr(self, a)) for a in axes))

    def show(self, axis: str) -> str:
        value = getattr(self, axis)
        if axis == "cost_cycles":
            return f"{value / 1e6:.1f}" + (f" ({self.handoff_cycles / 1e6:.1f} hand-offs)" if self.handoff_cycles else "")
        return ("yes" if value else "no") if axis == "builds" else str(value)


def handoff_cycles(plans: list, handoff: Handoff | None, clock_hz: float | None) -> int:
    """What the graphs of `plans` (each with inputs and outputs of static shapes) hand off on the board,
    in cycles of the NPU clock: every graph has its inputs set and its outputs got on the host
    (shard.targets.chips.Handoff), so a cut pays for its edge twice where one graph never hands it off. 0
    where the board's hand-off or the clock is unknown."""
    if handoff is None or not clock_hz:
        return 0
    return round(sum(handoff.between(p.inputs, p.outputs) for p in plans) * clock_hz)


def no_handoffs(plans: list) -> int:
    """No hand-off charged (a target without a board's figures, or a cut the user fixed)."""
    return 0


def verdict(ours: Figures, theirs: Figures, axes: tuple[str, ...] = AXES) -> str:
    """better, equal or worse, by `axes` in order (the first axis that differs decides)."""
    a, b = ours.key(axes), theirs.key(axes)
    return "better" if a < b else "worse" if a > b else "equal"


FIDELITY_SLACK = 1e-4   # cosine: less than this under the vendor alone's is not worse


def fidelity_worse(ours: float, theirs: float) -> bool:
    """Is shard's simulator cosine worse than the vendor alone's (both against onnxruntime)? NaN is
    worse than any number, and equal to NaN (a reference with NaN in it, pow of a negative base)."""
    if theirs != theirs:
        return False
    return not ours >= theirs - FIDELITY_SLACK


def fidelity_verdict(ours: float, theirs: float) -> str:
    """better, equal or worse on the simulator's cosine (FIDELITY_SLACK apart). A NaN is worse than any
    number and equal to nothing: beside a NaN, a NaN is "both NaN"."""
    if ours != ours or theirs != theirs:
        return "both NaN" if ours != ours and theirs != theirs else "worse" if ours != ours else "better"
    return "worse" if fidelity_worse(ours, theirs) else "better" if fidelity_worse(theirs, ours) else "equal"


def per_axis(ours: Figures, theirs: Figures) -> dict[str, str]:
    return {axis: verdict(Figures(**{**asdict(theirs), axis: getattr(ours, axis)}), theirs) for axis in AXES}


def labels_in(words: dict[str, str]) -> dict[str, str]:
    """LABELS in a target's own words where it has them (shard.targets.Target.words: "REGTASK lines")."""
    return {axis: said_in(words, axis, LABELS) for axis in LABELS}


def comparison_line(ours: Figures, theirs: Figures, sides: str = "shard / vendor alone",
                    fidelity: tuple[float, float] | None = None, labels: dict[str, str] = LABELS) -> str:
    """One line: the simulator's cosines where measured (`fidelity`: ours, theirs), which decide first,
    then each axis as ours / theirs (`sides` names them; `labels` each axis), and the verdict. Beside a
    build that failed, only that is named: its other figures are of no build."""
    cells = ", ".join(f"{labels[a]} {ours.show(a)} / {theirs.show(a)}" for a in AXES)
    axes = per_axis(ours, theirs)
    why = [f"{w} on {labels[a]}" for a, w in axes.items() if w != "equal" and (a == "builds" or ours.builds
                                                                                == theirs.builds)]
    word = verdict(ours, theirs)
    if fidelity is not None:
        cells = f"simulator cosine {fidelity[0]:.7f} / {fidelity[1]:.7f}, {cells}"
        said = fidelity_verdict(*fidelity)
        if said != "equal":
            why.insert(0, f"{said} on the simulator's cosine")
            word = said if said != "both NaN" else "no better: both NaN on the simulator"
    return f"{sides}: {cells}: {word}" + (f" ({', '.join(why)})" if why else "")


BASELINES = ("auto", "whole", "shards")   # --vendor-alone: how the vendor alone is built (whole_build_fits)


def weight_bytes(model: onnx.ModelProto) -> int:
    """The bytes of a model's initializers."""
    return sum(math.prod(t.dims) * onnx.helper.tensor_dtype_to_np_dtype(t.data_type).itemsize
               for t in model.graph.initializer)


def available_bytes() -> int | None:
    """The memory this machine has available now (Linux' MemAvailable), None where unknown."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def whole_build_fits(model: onnx.ModelProto, how: str, tgt, available: int | None = None, jobs: int = 2,
                     cores: int | None = None, quantized: bool = False) -> tuple[bool, str]:
    """Is the vendor alone built as the whole model (True) or shard by shard, from the builds of each
    shard without its rewrites (False)? `how`: whole, shards, or auto: whole where its predicted peak
    memory is at most half of what is available (the compile's own builds run beside it), and where
    it does not add one whole vendor build to the compile's time for build figures alone: a core is
    free for it beside the compile's `jobs` builds, or the model is not large (no shards take less
    memory than its whole build: shards_for_memory; it builds in seconds to a few tens of them), or
    the compile quantizes (its fidelity against the vendor's own quantized build is the comparison
    that matters, and needs the whole). The memory as the target `tgt` predicts it. With why."""
    if how != "auto":
        return how == "whole", f"--vendor-alone {how}"
    weights = weight_bytes(model)
    need, have = tgt.build_bytes(weights), available_bytes() if available is None else available
    cores = len(os.sched_getaffinity(0)) if cores is None else cores
    gb = f"the whole model's build predicted at {need / 1e9:.1f} GB"
    if have is not None and need > have / 2:
        return False, f"{gb}, more than half of the {have / 1e9:.1f} GB available"
    if cores <= jobs and tgt.shards_for_memory(weights, jobs) and not quantized:
        return False, (f"{cores} cores for --jobs {jobs}, a large model's shard builds: the whole build of "
                       f"{weights / 1e6:.0f} MB of weights would add its own time to the compile's")
    return True, gb + ("" if have is None else f", {have / 1e9:.1f} GB available") + f", {cores} cores"


def fix_input_shapes(model: onnx.ModelProto, input_shapes: dict[str, tuple[int, ...]]) -> None:
    """The given input shapes written into the model (as a user hands it to the vendor toolkit)."""
    for value in model.graph.input:
        if value.name in input_shapes:
            dims = value.type.tensor_type.shape.dim
            del dims[:]
            dims.extend(onnx.TensorShapeProto.Dimension(dim_value=int(d)) for d in input_shapes[value.name])


def host_sources(host_post: list[dict]) -> dict[str, str]:
    """For every tensor the runtime turns into a graph output on the host: that graph output."""
    step_of = {}
    for step in host_post:
        for name in step_inputs(step):
            step_of[name] = step_outputs(step)[0]
    final = {}
    for name in step_of:
        out = name
        while out in step_of:
            out = step_of[out]
        final[name] = out
    return final


def original_plans(canonical: gs.Graph, plans: list[ShardPlan], host_post: list[dict]) -> list[ShardPlan | None]:
    """For each rewritten shard, the same region of the canonical graph (what the vendor would build
    there), or None where the passes left the shard as it was or the region is not its own."""
    tensors = canonical.tensors()
    to_output = host_sources(host_post)
    order = {id(n): i for i, n in enumerate(canonical.nodes)}
    graph_inputs = {t.name for t in canonical.inputs}
    regions: list[ShardPlan | None] = []
    for plan in plans:
        names = list(dict.fromkeys(to_output.get(t.name, t.name) for t in plan.outputs))
        if any(n not in tensors for n in names):
            regions.append(None)
            continue
        stop = {t.name for t in plan.inputs if t.name in tensors} | graph_inputs
        nodes, inputs, stack, seen = {}, {}, [tensors[n] for n in names], set()
        while stack:
            tensor = stack.pop()
            if tensor.name in seen or isinstance(tensor, gs.Constant) or not tensor.name:
                continue
            seen.add(tensor.name)
            if tensor.name in stop or not tensor.inputs:
                inputs[tensor.name] = tensor
                continue
            producer = tensor.inputs[0]
            nodes[id(producer)] = producer
            stack.extend(producer.inputs)
        ordered = sorted(nodes.values(), key=lambda n: order[id(n)])
        region = ShardPlan(name=plan.name, nodes=ordered, inputs=list(inputs.values()),
                           outputs=[tensors[n] for n in names], macs=sum(estimate_macs(n) for n in ordered),
                           source_nodes=[n.name for n in ordered])
        same = [n.name for n in plan.nodes] == region.source_nodes and \
            sorted(t.name for t in plan.inputs) == sorted(inputs)
        regions.append(None if same else region)
    # A region must be the shard's own: a canonical node in two regions means the cut runs through a
    # rewrite, and neither shard has an unrewritten twin.
    owner: dict[int, int] = {}
    for k, region in enumerate(regions):
        for node in region.nodes if region else ():
            if owner.setdefault(id(node), k) != k:
                regions[k] = regions[owner[id(node)]] = None
    return regions


def prune_host_steps(pre: list[dict], post: list[dict], consumed: set[str], produced: set[str],
                     outputs: set[str]) -> tuple[list[dict], list[dict]]:
    """The host steps the chosen shards still need: a step before the shards is kept if a shard (or a
    kept step) reads its output, or it makes a model output no shard makes; a step after them if
    every input is made by a shard or a kept step and no shard already makes its output."""
    kept_pre, need = [], set(consumed) | (outputs - produced)   # a model output the host makes from its inputs
    for step in reversed(pre):
        if need & set(step_outputs(step)):
            kept_pre.insert(0, step)
            need.update(step_inputs(step))
    kept_post, have = [], set(produced) | {name for step in kept_pre for name in step_outputs(step)}
    for step in post:
        if all(n in have for n in step_inputs(step)) and not produced & set(step_outputs(step)):
            kept_post.append(step)
            have.update(step_outputs(step))
    assert outputs <= have, f"graph outputs {sorted(outputs - have)} made by no shard or host step"
    return kept_pre, kept_post
