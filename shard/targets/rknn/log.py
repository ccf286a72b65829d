"""Read what rknn-toolkit2 really said: error lines, the per-layer table, fallbacks, cycle estimates.

The build returns 0 on models that will crash on the board; the truth is in its verbose log.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field

ANSI = re.compile(r"\x1b\[[0-9;]*m")
LAYER_ROW = re.compile(
    r"^D RKNN: \[[^\]]*\]\s+(?P<id>\d+)\s+(?P<op>\S+)\s+(?P<dtype>\S+)\s+(?P<target>NPU|CPU)\s+"
    r"(?P<inshape>\S+)\s+(?P<outshape>\S+)\s+(?P<ddr>\d+)/(?P<npu>\d+)/(?P<total>\d+)\s+"
    r"(?:(?P<sparse>\d+)%\s+)?(?P<rw>\d+)\s+(?P<name>.+?)\s*$"     # RK3576 and RV1126B add a SparseRatio column
)
SINGLE_CORE = re.compile(r"Failed to config layer: '(?P<layer>[^']+)' using \d+Core fallback to single core mode")
MEMORY = re.compile(r"Total (?P<kind>Internal|Weight) Memory Size: (?P<kb>\d+)KB")
HOST_OPS = {"InputOperator", "OutputOperator"}
# what the toolkit logs when one of its graph rules raised: "You can add disable_rules=['NAME'] in rknn.config()"
CRASHED_RULE = re.compile(r"disable_rules=\[['\"](?P<rule>\w+)['\"]\]")


@dataclass
class Layer:
    id: int
    op: str
    target: str
    output_shape: str
    cycles: int
    name: str
    ddr_cycles: int = 0
    rw_kb: int = 0
    input_shape: str = ""
    dtype: str = ""                # INT8, FLOAT16...: the precision the layer runs in

    def macs(self) -> int:
        """Multiply-accumulates of a Conv (a linear lowers to one, fused or not) or exMatMul layer;
        0 for other layers."""
        shapes = [[int(d) for d in m.split(",") if d] for m in SHAPE.findall(self.input_shape)]
        out = first_shape(self.output_shape)
        if not out or not shapes:
            return 0
        if self.op.startswith("Conv") and len(shapes) > 1 and len(shapes[1]) == 4:   # ConvAdd, ConvExGelu...
            return math.prod(out) * math.prod(shapes[1][1:])      # weights [Cout, Cin/groups, kh, kw]
        if self.op == "exMatMul" and len(shapes[0]) > 1:
            return math.prod(out) * shapes[0][1]                  # K: the first operand's axis 1
        return 0


@dataclass
class BuildDiagnostics:
    """Everything shard reads out of one build log."""

    regtask_lines: int = 0
    first_regtask: str | None = None
    error_lines: int = 0
    first_error: str | None = None
    cpu_ops: list[str] = field(default_factory=list)
    single_core_fallbacks: list[str] = field(default_factory=list)
    cpu_fallback_warnings: list[str] = field(default_factory=list)
    layers: list[Layer] = field(default_factory=list)
    estimated_cycles: int = 0
    internal_memory_kb: int | None = None
    weight_memory_kb: int | None = None

    def summary(self) -> dict:
        """The diagnostics without the full layer table (that stays in the log), in the words every
        target's builds report in (shard.targets.ShardBuild): REGTASK lines are overflow lines, a
        layer that falls back to one core of several is a fallback."""
        data = asdict(self)
        data.pop("layers")
        data["layer_count"] = len(self.layers)
        return in_common_words(data)


RENAMED = {"regtask_lines": "overflow_lines", "first_regtask": "first_overflow",
                "single_core_fallbacks": "fallbacks"}


def in_common_words(diagnostics: dict) -> dict:
    """A build's diagnostics with this toolkit's terms renamed to the common ones (RENAMED): what
    summary() writes, and what a build kept before (the build cache's) is read as."""
    return {RENAMED.get(key, key): value for key, value in diagnostics.items()}


def macs_by_dtype(layers: list[Layer]) -> dict[str, int]:
    """The MACs of the Conv and exMatMul layers by the precision they run in: {"INT8": ..., "FLOAT16": ...}."""
    totals: dict[str, int] = {}
    for layer in layers:
        if layer.macs():
            totals[layer.dtype] = totals.get(layer.dtype, 0) + layer.macs()
    return totals


def unestimated_cost(layers: list[Layer], cycles_per_kb: float | None = None) -> tuple[int, float | None]:
    """Cycles for the ops the estimate leaves at 0 (Transpose, Reshape, exWindow...), costed by the
    bytes they move at the DDR rate the same table shows for the ops it does estimate.
    Returns (cycles, cycles per KB used); (0, None) when no rate is known."""
    if cycles_per_kb is None:
        rw = sum(layer.rw_kb for layer in layers if layer.ddr_cycles)
        cycles_per_kb = sum(layer.ddr_cycles for layer in layers if layer.ddr_cycles) / rw if rw else None
    if cycles_per_kb is None:
        return 0, None
    zero = [layer for layer in layers if layer.cycles == 0 and layer.op not in HOST_OPS]
    return round(sum(layer.rw_kb for layer in zero) * cycles_per_kb), cycles_per_kb


SHAPE = re.compile(r"\(([\d,]+)\)")


def first_shape(text: str) -> list[int] | None:
    """The first shape in a layer table cell: '(4,10),(4)' -> [4, 10]."""
    m = SHAPE.search(text)
    return [int(d) for d in m.group(1).split(",") if d] if m else None


def edge_reshapes(layers: list[Layer], inputs: dict[str, list[int]], outputs: dict[str, list[int]]
                  ) -> tuple[dict[str, list[int]], dict[str, list[int]]]:
    """The vendor reshapes a graph input or output that is not in its 4-D layout, and runs that Reshape
    on the CPU. From the layer table: {input: the 4-D shape it wants}, {output: the 4-D shape it has}.
    A shape two edges share is left alone (the table does not say which edge a row belongs to)."""
    cpu = [layer for layer in layers if layer.op == "Reshape" and layer.target == "CPU"]
    found_in, found_out = {}, {}
    for edges, found, side in ((inputs, found_in, "in"), (outputs, found_out, "out")):
        for name, shape in edges.items():
            if list(edges.values()).count(shape) != 1:
                continue
            for layer in cpu:
                src, dst = first_shape(layer.input_shape), first_shape(layer.output_shape)
                mine, other = (src, dst) if side == "in" else (dst, src)
                if mine == shape and other and len(other) == 4 and other != shape:
                    found[name] = other
                    break
    return found_in, found_out


def parse_build_log(text: str) -> BuildDiagnostics:
    diag = BuildDiagnostics()
    for raw in text.splitlines():
        line = ANSI.sub("", raw).rstrip()
        if "REGTASK" in line:
            diag.regtask_lines += 1
            diag.first_regtask = diag.first_regtask or line
        if line.startswith("E "):
            diag.error_lines += 1
            diag.first_error = diag.first_error or line
        if row := LAYER_ROW.match(line):
            layer = Layer(id=int(row["id"]), op=row["op"], target=row["target"], output_shape=row["outshape"],
                          cycles=int(row["total"]), name=row["name"], ddr_cycles=int(row["ddr"]), rw_kb=int(row["rw"]),
                          input_shape=row["inshape"], dtype=row["dtype"])
            diag.layers.append(layer)
            diag.estimated_cycles += layer.cycles
            if layer.target == "CPU" and layer.op not in HOST_OPS:
                diag.cpu_ops.append(f"{layer.op} {layer.name}")
        elif m := SINGLE_CORE.search(line):
            diag.single_core_fallbacks.append(m["layer"])
        elif "fallback to CPU" in line or "fallback to cpu" in line:
            diag.cpu_fallback_warnings.append(line)
        elif m := MEMORY.search(line):
            setattr(diag, f"{m['kind'].lower()}_memory_kb", int(m["kb"]))
    return diag


def crashed_rule(text: str) -> str | None:
    """The fusion rule a build log says raised, where the toolkit names one to disable."""
    found = CRASHED_RULE.search(ANSI.sub("", text))
    return found["rule"] if found else None
