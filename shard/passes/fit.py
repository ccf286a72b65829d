"""Does one op, at its real shapes, fit the target? The profile first; where it cannot decide, a
one-op build of exactly that op in the toolkit worker (cached on disk).

Only failures that make a build unusable count here (HARD_FAILURES: overflow, error, build-error,
crash; the target's probes name them): an op that would land on the CPU still runs, and in isolation
that verdict is often wrong (the compiler fuses Softmax into its attention kernel), so it is
reported, not rewritten; so are error lines alone that name neither an overflow nor a CPU fallback
(error-alone).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np
import onnx
import onnx_graphsurgeon as gs
from onnx import helper

from shard.graph import dtype_name, small_model
from shard.profile import Profile

HARD_FAILURES = ("overflow", "error", "build-error", "crash")

# The probe family whose limits speak for an op, and the setting key its [1,1,H,N] shape selects.
FAMILY_OF = {"Add": ("add-width", "h"), "Sub": ("add-width", "h"), "Mul": ("mul-width", "h"),
             "Div": ("mul-width", "h"), "Sigmoid": ("sigmoid-width", "h"), "Exp": ("exp-width", "h"),
             "Softmax": ("softmax-width", "r"), "Concat": ("concat-width", "h")}


@dataclass
class Verdict:
    ok: bool
    failure: str | None = None
    reason: str = ""            # one sentence: which limit or build says so


@dataclass
class OpSpec:
    """One op at concrete shapes, detached from its graph."""

    op: str
    attrs: dict
    inputs: list[tuple[list[int] | None, np.ndarray | None]]   # (shape, value if constant); None: omitted
    outputs: list[list[int]]
    dtypes: list[str] | None = None       # numpy names of the inputs' then the outputs' dtypes; None: float32

    @classmethod
    def of(cls, node: gs.Node) -> OpSpec:
        ins = [(list(t.shape), t.values if isinstance(t, gs.Constant) else None) if t.name else (None, None)
               for t in node.inputs]
        dtypes = [dtype_name(t.dtype) if t.dtype is not None else "float32" for t in (*node.inputs, *node.outputs)
                  if t.name or t in node.outputs]
        return cls(node.op, dict(node.attrs), ins, [list(t.shape) for t in node.outputs],
                   None if set(dtypes) == {"float32"} else dtypes)

    def with_shapes(self, inputs: list, outputs: list[list[int]]) -> OpSpec:
        """The same op (attributes, dtypes) at other shapes: one piece of a split."""
        return OpSpec(self.op, self.attrs, inputs, outputs, self.dtypes)

    def key(self) -> str:
        consts = [None if v is None else (v.tolist() if v.size <= 16 else f"{v.dtype}{list(v.shape)}")
                  for _, v in self.inputs]
        return repr((self.op, sorted(self.attrs.items()), [s for s, _ in self.inputs], consts, self.outputs,
                     self.dtypes))

    def model(self) -> onnx.ModelProto:
        """This op alone; large float constants become seeded noise of their shape (values do not
        change legality, and zeros would let the compiler fold the op away)."""
        present = [(f"in{k}", shape, value) for k, (shape, value) in enumerate(self.inputs) if shape is not None]
        names = [f"in{k}" if shape is not None else "" for k, (shape, _) in enumerate(self.inputs)]
        dtypes = self.dtypes or ["float32"] * (len(present) + len(self.outputs))
        inputs, inits = [], []
        for (name, shape, value), dtype in zip(present, dtypes):
            if value is None:
                inputs.append((name, shape, dtype))
            else:
                inits.append((name, value if value.size <= 1024 or value.dtype.kind != "f" else
                              np.random.default_rng(0).standard_normal(value.shape).astype(value.dtype)))
        outputs = [(f"out{k}", s, d) for k, (s, d) in enumerate(zip(self.outputs, dtypes[len(present):]))]
        node = helper.make_node(self.op, names, [output[0] for output in outputs], **self.attrs)
        return small_model([node], inputs, outputs, inits)


class OpBuilder(Protocol):
    def check(self, spec: OpSpec) -> Verdict: ...


@runtime_checkable
class ModelBuilder(Protocol):
    def cpu_layers(self, model: onnx.ModelProto) -> int | None: ...


class Legality:
    """Verdicts per op spec: from the profile's limits where a family and setting match the shape,
    else from `builder` (a one-op vendor build), else (no builder) the op is taken to fit."""

    def __init__(self, profile: Profile, builder: OpBuilder | None = None):
        self.profile = profile
        self.builder = builder
        self.seen: dict[str, Verdict] = {}

    def cpu_layers(self, model: onnx.ModelProto) -> int | None:
        """How many layers a build of this small model (an op in the context it needs) places on the
        CPU; None where the build fails or nothing here builds models."""
        return self.builder.cpu_layers(model) if isinstance(self.builder, ModelBuilder) else None

    def check(self, spec: OpSpec) -> Verdict:
        key = spec.key()
        if key not in self.seen:
            self.seen[key] = self._from_profile(spec) or (self.builder.check(spec) if self.builder else Verdict(True))
        return self.seen[key]

    def _from_profile(self, spec: OpSpec) -> Verdict | None:
        found = rows_setting(spec) if spec.op in ("Gather", "Slice") else width_setting(spec)
        if found is None:
            return None
        name, size = found
        limit = self.profile.limits.get(name)
        if limit is None or not limit.speaks_for(size):
            return None  # not measured at this setting, or only up to a smaller size
        within = "in the passing set" if limit.passing is not None else f"<= {limit.value}"
        if limit.allows(size):
            return Verdict(True, None, f"{name}: N={size} {within}")
        past = "not in the passing set" if limit.passing is not None else f"> {limit.value}"
        if limit.failure not in HARD_FAILURES:
            return Verdict(True, limit.failure, f"{name}: N={size} {past} ({limit.failure}, not rewritten)")
        return Verdict(False, limit.failure, f"{name}: N={size} {past} ({limit.failure})")


def width_setting(spec: OpSpec) -> tuple[str, int] | None:
    """(family@setting, N) of an op on [1,1,H,N] whose family has a width limit (FAMILY_OF)."""
    family = FAMILY_OF.get(spec.op)
    shape = spec.outputs[0]
    if spec.op == "Concat":  # concat-width probes two equal inputs: N is each input's width
        if len(spec.inputs) != 2 or spec.inputs[0][0] != spec.inputs[1][0] or spec.attrs.get("axis") not in (-1, 3):
            return None
        shape = spec.inputs[0][0]
    if family is None or len(shape) != 4 or shape[:2] != [1, 1]:
        return None
    return f"{family[0]}@{family[1]}{shape[2]}", shape[3]


def rows_setting(spec: OpSpec) -> tuple[str, int] | None:
    """(family@setting, N) of a Gather of one row, or a Slice along one axis, of a [N,1,W] (axis 0) or
    [1,N,W] (axis 1) sequence: gather-rows, slice-rows (shard.probes.families.rows)."""
    data, params = spec.inputs[0][0], [value for _, value in spec.inputs[1:]]
    if data is None or len(data) != 3 or any(value is None for value in params):
        return None
    if spec.op == "Gather":
        axis = spec.attrs.get("axis", 0) % 3
        if params[0].size != 1:
            return None
    else:
        axes = params[2].ravel() if len(params) > 2 else np.arange(params[0].size)
        if axes.size != 1 or len(params) > 3 and int(params[3].ravel()[0]) != 1:
            return None
        axis = int(axes[0]) % 3
    if axis > 1 or data[1 - axis] != 1:
        return None
    return f"{spec.op.lower()}-rows@axis{axis}-w{data[2]}", data[axis]


class WidthLimit:
    """A stand-in limit for tests and what-ifs: every tensor's last axis at most `width`, and at
    most `elements` elements per tensor."""

    def __init__(self, width: int, elements: int | None = None):
        self.width, self.elements = width, elements

    def check(self, spec: OpSpec) -> Verdict:
        for shape in [s for s, v in spec.inputs if v is None] + spec.outputs:
            if shape and shape[-1] > self.width:
                return Verdict(False, "overflow", f"last axis {shape[-1]} > {self.width}")
            if self.elements and int(np.prod(shape)) > self.elements:
                return Verdict(False, "overflow", f"{int(np.prod(shape))} elements > {self.elements}")
        return Verdict(True)


class OnCpu:
    """A stand-in for tests and what-ifs: these ops land on the CPU at every shape, the rest fit."""

    def __init__(self, *ops: str):
        self.ops = set(ops)

    def check(self, spec: OpSpec) -> Verdict:
        if spec.op in self.ops:
            return Verdict(True, "cpu-fallback", f"{spec.op} on the CPU (stand-in)")
        return Verdict(True)


class OneOpBuilds:
    """Verdicts from one-op vendor builds (`ops`: shard.targets.rknn.ops.ToolkitOps) where the profile
    cannot decide: only a hard failure makes an op illegal."""

    def __init__(self, ops):
        self.ops = ops

    def check(self, spec: OpSpec) -> Verdict:
        point = self.ops.build(spec.model())
        where = f"one-op build of {spec.op} {spec.outputs[0]}"
        if point.ok or point.failure not in HARD_FAILURES:
            # A CPU placement or a slow estimate in isolation often differs inside the real graph
            # (the compiler fuses Softmax into its attention kernel): the shard build reports those.
            alone = f", not rewritten: {point.evidence[:200]}" if point.failure == "error-alone" else ""
            return Verdict(True, point.failure, f"{where}: {point.failure or 'clean'}{alone}")
        return Verdict(False, point.failure, f"{where}: {point.failure}: {point.evidence[:300]}")

    def cpu_layers(self, model: onnx.ModelProto) -> int | None:
        point = self.ops.build(model)
        if point.failure in ("crash", "build-error", "timeout", "overflow"):
            return None
        return sum(layer[1] == "CPU" for layer in point.figures.get("layers", []))
