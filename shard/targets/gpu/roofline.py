"""Roofline cost of ops and stages on a GPU, from its profile: the floor each op cannot beat (FLOPs
over the peak rate of its precision, bytes over DRAM bandwidth) and the predicted time, which uses
what `shard probe --target cuda` measured where the profile has it: each op's own kernel where its
signature (op, operand shapes and types, attributes) was timed (`--ops BUNDLE`; an op the cuda
executor runs inside a fused kernel is charged its share of that kernel's measured time). Without
`--ops`, the kernels of the form the cuda executor runs (node_seconds: attention as one sdpa, a
linear with its bias, sibling linears as one product, GELU as one kernel), each at matrix-product
rates by size, its operands moved once, and at least the shortest kernel; the floor where the
profile has no rates.

Why measured kernels: on an H100 the floor missed SigLIP-so400m's attention products (head size 72:
37 us against 8), its LayerNorms (12 us against 1.4) and cuDNN's patch convolution (89.5 us against
5), and the stage predictions were 1.43-1.75x short of the measured stages. Why the fused form's
kernels: each op charged as a kernel of its own predicted Pi0's programs 1.29-1.88x the measured
stages on an H100.

A node's precision is its output's float type; a MatMul/Gemm whose operands both come out of
DequantizeLinear runs in fp8 (TensorRT fuses the pair into the product). Reshapes are views: free.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import ml_dtypes
import numpy as np
import onnx
import onnx_graphsurgeon as gs
from onnx import helper
from onnx_graphsurgeon.exporters.onnx_exporter import OnnxExporter

from shard.graph import is_static, numpy_dtype
from shard.macs import estimate_macs
from shard.runtime.executors.torch_graph import TorchGraph

PRODUCTS = ("MatMul", "Gemm", "Conv")
VIEWS = ("Reshape", "Squeeze", "Unsqueeze", "Flatten", "Identity")
FLOAT_NAMES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "float64": "fp32"}


@dataclass
class Cost:
    flops: float = 0.0
    bytes: float = 0.0           # DRAM traffic: operands read (weights included) and results written
    weight_bytes: float = 0.0
    floor_s: float = 0.0         # the roofline: neither the peak rate nor the bandwidth can do better
    predicted_s: float = 0.0     # with the measured rates and the shortest kernel, where the profile has them
    compute_s: float = 0.0       # FLOPs over the peak (the compute side of the floor)
    memory_s: float = 0.0        # bytes over the bandwidth (the memory side)
    kernels: int = 0

    def __iadd__(self, other: Cost) -> Cost:
        for name in self.__dataclass_fields__:
            setattr(self, name, getattr(self, name) + getattr(other, name))
        return self

    @property
    def bound(self) -> str:
        return "compute" if self.compute_s >= self.memory_s else "memory"


FOUR_BITS = {np.dtype(ml_dtypes.int4), np.dtype(ml_dtypes.uint4)}   # two values a byte (w4a16's weights)


def tensor_bytes(tensor: gs.Tensor) -> float:
    if not is_static(tensor.shape) or tensor.dtype is None:
        return 0.0
    dtype = numpy_dtype(tensor)   # None: fp8 constants graphsurgeon keeps as ONNX types, one byte each
    size = 0.5 if dtype in FOUR_BITS else dtype.itemsize if dtype is not None else 1
    return float(np.prod(tensor.shape, dtype=np.int64)) * size


def node_precision(node: gs.Node) -> str:
    if node.op in PRODUCTS and all(t.inputs and t.inputs[0].op == "DequantizeLinear" for t in node.inputs[:2]):
        return "fp8"
    out = node.outputs[0] if node.outputs else None
    if out is None or out.dtype is None:
        return "fp32"
    dtype = numpy_dtype(out)
    return FLOAT_NAMES.get(dtype.name, "fp32") if dtype is not None else "fp8"


def weight_of(tensor: gs.Tensor) -> gs.Constant | None:
    """The constant behind an operand: itself, or what a DequantizeLinear of a constant reads."""
    if isinstance(tensor, gs.Constant):
        return tensor
    if tensor.inputs and tensor.inputs[0].op == "DequantizeLinear" and isinstance(tensor.inputs[0].inputs[0], gs.Constant):
        return tensor.inputs[0].inputs[0]
    return None


def op_signature(node: gs.Node) -> str:
    """What decides an op's kernel time: its type, operand shapes and types, and attributes (not names)."""
    def operand(t: gs.Tensor) -> str:
        try:
            dtype = np.dtype(t.dtype).name if t.dtype is not None else "?"
        except TypeError:
            dtype = str(t.dtype)
        return f"{dtype}{list(t.shape) if t.shape is not None else '?'}"

    attrs = {k: v for k, v in sorted(node.attrs.items()) if isinstance(v, (int, float, str, list, tuple))}
    return f"{node.op}({', '.join(operand(t) for t in node.inputs)}){attrs or ''}"


def node_cost(node: gs.Node, facts: dict) -> Cost:
    signature = op_signature(node) if "op_seconds" in facts else None
    measured = facts.get("fused_op_seconds", {}).get(signature, facts.get("op_seconds", {}).get(signature))
    if node.op in VIEWS or (node.op == "DequantizeLinear" and isinstance(node.inputs[0], gs.Constant)):
        # a view, or a weight's dequantization folded into its product (a reshape of a transposed
        # tensor is a copy in torch: measured where the profile has it)
        return Cost(predicted_s=measured or 0.0, kernels=int(bool(measured)))
    precision = node_precision(node)
    flops = 2.0 * estimate_macs(node) if node.op in PRODUCTS else float(estimate_macs(node))
    weights = [w for w in (weight_of(t) for t in node.inputs) if w is not None]
    weight_bytes = sum(tensor_bytes(w) for w in weights)
    activations = [t for t in node.inputs if isinstance(t, gs.Variable) and weight_of(t) is None]
    moved = weight_bytes + sum(tensor_bytes(t) for t in (*activations, *node.outputs))
    peak = facts["peak_tflops"].get(precision, facts["peak_tflops"]["fp16"]) * 1e12
    bandwidth = facts["bandwidth_gbs"] * 1e9
    compute, memory = flops / peak, moved / bandwidth
    rate = measured_rate(facts, precision, flops) if node.op in PRODUCTS else None
    predicted = measured if measured is not None else \
        max(flops / rate if rate else compute, memory, facts.get("min_kernel_s", 0.0))
    return Cost(flops=flops, bytes=moved, weight_bytes=weight_bytes, floor_s=max(compute, memory),
                predicted_s=predicted, compute_s=compute, memory_s=memory, kernels=1)


def measured_rate(facts: dict, precision: str, flops: float) -> float | None:
    """FLOP/s of a matrix product of this many FLOPs, interpolated (log-log) between the sizes the
    probe measured; None where the profile has no measurement for the precision."""
    points = sorted(facts.get("gemm_tflops", {}).get(precision, []))
    if not points or flops <= 0:
        return None
    x = math.log(flops / 1e9)
    xs = [math.log(g) for g, _ in points]
    ys = [math.log(t * 1e12) for _, t in points]
    return math.exp(float(np.interp(x, xs, ys)))


def fused_steps(nodes: list[gs.Node], outputs: list[gs.Tensor]) -> list[list[gs.Node]] | None:
    """The runs of `nodes` the cuda executor computes as one kernel each (its fused form:
    shard.runtime.executors.torch_fusions: attention as one sdpa, a linear with its bias, sibling
    linears as one product, an elementwise function of one tensor), each other node alone, and none
    of those it computes once at load (constants only); planned over the graph's shapes with its
    weights as meta tensors (nothing copied). None where the executor cannot plan them (an op it has
    no torch form of)."""
    import torch

    constants, variables, made = {}, {}, {}
    for node in nodes:
        for t in node.inputs:
            if isinstance(t, gs.Constant) and t.name not in constants:
                constants[t.name] = as_torch(torch, t)
            elif isinstance(t, gs.Variable):
                variables[t.name] = t
        made.update({o.name: node for o in node.outputs})
        variables.update({o.name: o for o in node.outputs})
    if any(value is None for value in constants.values()):
        return None
    info = functools.partial(OnnxExporter.export_value_info_proto, do_type_check=False)
    graph = helper.make_graph([OnnxExporter.export_node(n) for n in nodes], "stage",
                              [info(t) for name, t in variables.items() if name not in made],
                              [info(t) for t in outputs],
                              value_info=[info(t) for name, t in variables.items() if name in made])
    try:
        planned = TorchGraph(helper.make_model(graph), "meta", fuse=True, constants=constants)
    except Exception:   # noqa: BLE001 - an op, or a fusion's check, the meta form cannot take: ops one by one
        return None
    return [[made[n.output[0]] for n in covers] for covers in planned.covers]


def as_torch(torch, constant: gs.Constant):
    """A constant as the cost model's planning needs it: its data where small (a scale, a shape), a meta
    tensor of its shape and type where large (a weight) or FP8 (a type numpy has not); None where torch
    has no such type."""
    dtype = numpy_dtype(constant)
    shape = tuple(constant.shape or ())
    if not is_static(shape):
        return None
    if dtype is None:
        fp8 = constant.dtype == onnx.TensorProto.FLOAT8E4M3FN
        return torch.empty(shape, dtype=torch.float8_e4m3fn, device="meta") if fp8 else None
    if dtype in FOUR_BITS:   # as the executor holds them: one int8 a value
        return torch.empty(shape, dtype=torch.int8, device="meta")
    if dtype.kind not in "fc" or np.prod(shape, dtype=np.int64) <= 4096:
        return torch.from_numpy(np.ascontiguousarray(constant.values))
    try:
        return torch.empty(shape, dtype=getattr(torch, dtype.name), device="meta")
    except AttributeError:
        return None


def step_seconds(step: list[gs.Node], facts: dict, costs: dict[int, Cost] | None = None) -> float:
    """One kernel of the fused form: its products at the measured rates, its weights, inputs and
    outputs moved once (what it makes and reads itself never reaches memory), the shortest kernel.
    `costs`: node_costs of its nodes, where the caller has them."""
    if all(node.op in VIEWS for node in step):
        return 0.0
    costs = costs or node_costs(step, facts)
    made = {o.name for node in step for o in node.outputs}
    compute = 0.0
    for node in step:
        cost = costs[id(node)]
        rate = measured_rate(facts, node_precision(node), cost.flops) if node.op in PRODUCTS else None
        compute += cost.flops / rate if rate else cost.compute_s
    inside = {id(node) for node in step}
    read = {t.name: t for node in step for t in node.inputs if t.name and t.name not in made}
    written = {o.name: o for node in step for o in node.outputs
               if not o.outputs or any(id(reader) not in inside for reader in o.outputs)}
    moved = sum(stored_bytes(t, facts) for t in read.values()) + sum(tensor_bytes(t) for t in written.values())
    return max(compute, moved / (facts["bandwidth_gbs"] * 1e9), facts.get("min_kernel_s", 0.0))


def stored_bytes(tensor: gs.Tensor, facts: dict) -> float:
    """What a kernel reads of an operand: on a target that runs TensorRT (its profile names it), a weight
    dequantized from constants (w4a16's INT4 and scales) as stored, the dequantization in the product's
    prologue; elsewhere the tensor (the cuda executor dequantizes a weight once, at load)."""
    made = tensor.inputs[0] if tensor.inputs else None
    if "tensorrt" in facts and made is not None and made.op == "DequantizeLinear" \
            and all(isinstance(t, gs.Constant) for t in made.inputs):
        return sum(tensor_bytes(t) for t in made.inputs)
    return tensor_bytes(tensor)


def node_costs(nodes: list[gs.Node], facts: dict) -> dict[int, Cost]:
    """{id(node): node_cost}: each node's roofline, computed once for every sum that reads it."""
    return {id(node): node_cost(node, facts) for node in nodes}


def node_seconds(nodes: list[gs.Node], outputs: list[gs.Tensor], facts: dict,
                 costs: dict[int, Cost] | None = None) -> dict[int, float]:
    """{id(node): its predicted seconds}. Where `shard probe --ops` measured the ops (op_seconds), each
    op's own; else the fused form's kernels (fused_steps, step_seconds), each shared among its ops in
    proportion to their roofline alone (an op the executor computes at load costs 0); where the form
    cannot be planned, each op as one kernel of its own.

    Why the fused form: Pi0 on an H100 (this GPU's profile, its three programs' stages as the cuda
    executor keeps them), ops one by one predicted 1.29-1.88x the measured stages (GELU's eight ops,
    eight kernels; attention's scores written out); the fused form's kernels 0.87-1.20x."""
    costs = costs or node_costs(nodes, facts)
    each = {key: cost.predicted_s for key, cost in costs.items()}
    steps = None if "op_seconds" in facts else fused_steps(nodes, outputs)
    if steps is None:
        return each
    seconds = dict.fromkeys(each, 0.0)
    for step in steps:
        total, alone = step_seconds(step, facts, costs), sum(each[id(n)] for n in step)
        for node in step:
            seconds[id(node)] = total * (each[id(node)] / alone if alone else 1.0 / len(step))
    return seconds


def stage_cost(nodes: list[gs.Node], facts: dict, costs: dict[int, Cost] | None = None) -> Cost:
    total = Cost()
    for node in nodes:
        total += costs[id(node)] if costs else node_cost(node, facts)
    return total


def stage_floor(nodes: list[gs.Node], inputs: list[gs.Tensor], outputs: list[gs.Tensor], facts: dict,
                ops: Cost | None = None) -> dict:
    """What no implementation of the stage can beat, however its ops are fused: its FLOPs at the peak
    rate, and its weights plus its own inputs and outputs moved once over DRAM (stage_cost's floor
    sums every op's operands and results, which fused kernels never write)."""
    ops = ops or stage_cost(nodes, facts)
    compute = ops.compute_s   # each op's FLOPs at its precision's peak
    memory = (ops.weight_bytes + sum(tensor_bytes(t) for t in (*inputs, *outputs))) / (facts["bandwidth_gbs"] * 1e9)
    return {"floor_s": max(compute, memory), "bound": "compute" if compute >= memory else "memory",
            "ops_floor_s": ops.floor_s}
