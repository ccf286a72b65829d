"""strong_types: every float tensor inside the graph becomes fp16, so the ONNX alone says what each op
runs in (GPU targets).

TensorRT 11 builds strongly typed networks only: the builder's precision flags are gone and each
layer runs in the type its ONNX tensors have. So the stage files carry their precision: weights and
activations in fp16, the model's own float inputs and outputs kept fp32 by a Cast at each edge (the
bundle's interface does not change), Casts to float retargeted to fp16. Constants past fp16's range
(the -3.4e38 of additive masks) saturate at +-65504, which changes nothing a softmax or a max
computes; any other constant past it is a warning. BatchNormalization's statistics are folded into
its scale and bias first (running variances of 1e7 are real). Resize's scales stay fp32, as the
operator requires.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from shard.errors import ModelError
from shard.graph import numpy_dtype, replace_uses
from shard.passes.context import PassContext

FLOAT = (np.float32, np.float64)
KEEP_FP32 = {("Resize", 2)}   # (op, input index) that the operator defines as float32
FP16_MAX = float(np.finfo(np.float16).max)
MASK_SENTINEL = 1e30   # -3.4e38 and the like: a mask's "minus infinity", which 65504 stands in for


def is_float32(tensor: gs.Tensor) -> bool:
    """float32 or float64: what becomes fp16 (fp8, an ONNX-only type, has no numpy dtype)."""
    dtype = numpy_dtype(tensor)
    return dtype is not None and dtype.type in FLOAT


def strong_types(graph: gs.Graph, ctx: PassContext) -> tuple[gs.Graph, dict]:
    refuse_non_tensors(graph)
    normalized = fold_batchnorm_statistics(graph)
    kept = {id(node.inputs[i]) for node in graph.nodes for op, i in KEEP_FP32
            if node.op == op and len(node.inputs) > i}
    edges = cast_edges(graph)
    kept |= {id(t) for t in (*graph.inputs, *graph.outputs)}
    saturated = 0
    for tensor in graph.tensors().values():
        if id(tensor) in kept or not is_float32(tensor):
            continue
        if isinstance(tensor, gs.Constant):
            values = np.asarray(tensor.values)
            over = np.abs(values) > FP16_MAX
            saturated += int(np.count_nonzero(over))
            if np.any(over & (np.abs(values) < MASK_SENTINEL)):
                readers = ", ".join(sorted({n.name or n.op for n in tensor.outputs}))
                ctx.warnings.append(f"strong_types: constant {tensor.name} (read by {readers}) holds values up to "
                                    f"{np.abs(values).max():.3g}, past fp16's 65504; they saturate and the "
                                    f"result can change (verify the bundle)")
            tensor.values = np.asarray(np.clip(values, -FP16_MAX, FP16_MAX), dtype=np.float16)
        else:
            tensor.dtype = np.float16
    retyped = 0
    for node in graph.nodes:
        if node.op == "Cast" and node.attrs.get("to") in (onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE) \
                and all(node.outputs[0] is not t for t in graph.outputs):
            node.attrs["to"] = onnx.TensorProto.FLOAT16
            retyped += 1
        if node.op == "ConstantOfShape" and isinstance(node.attrs.get("value"), gs.Constant) \
                and is_float32(node.attrs["value"]):
            node.attrs["value"].values = np.asarray(node.attrs["value"].values).astype(np.float16)
    return graph, {"dtype": "float16", "edge_casts": edges, "casts_retyped": retyped,
                   "saturated_constants": saturated, "batchnorms_folded": normalized}


def refuse_non_tensors(graph: gs.Graph) -> None:
    """Sequences and strings have no place in a TensorRT engine or a CUDA graph: say so at compile."""
    ops = sorted({n.op for n in graph.nodes if "Sequence" in n.op or n.op in ("StringNormalizer", "RegexFullMatch")})
    strings = sorted(t.name for t in graph.tensors().values() if t.dtype is not None and str(t.dtype) in ("object", "<U0"))
    if ops or strings:
        what = f"ops {', '.join(ops)}" if ops else f"string tensors {', '.join(strings[:3])}"
        raise ModelError(f"the GPU targets run tensors of numbers only; this model has {what}: compile it for "
                         f"--target cpu, or cut that part out of the model")


def fold_batchnorm_statistics(graph: gs.Graph) -> int:
    """Each BatchNormalization of constant parameters as scale and bias alone (mean 0, variance 1 - eps),
    computed in float64: the same function, and parameters fp16 holds. PP-OCRv4's detector keeps running
    variances of 1e7 to 1e8, which fp16 would saturate at 65504 (cosine 0.005 end to end)."""
    count = 0
    for node in graph.nodes:
        params = node.inputs[1:5]
        if node.op != "BatchNormalization" or len(params) != 4 or len(node.outputs) != 1 \
                or not all(isinstance(p, gs.Constant) for p in params):
            continue
        gamma, beta, mean, var = (np.asarray(p.values, np.float64) for p in params)
        eps = float(node.attrs.get("epsilon", 1e-5))
        scale = gamma / np.sqrt(var + eps)
        dtype = np.asarray(params[0].values).dtype
        folded = (("scale", scale), ("bias", beta - mean * scale), ("mean", np.zeros_like(mean)),
                  ("var", np.full_like(var, 1 - eps)))
        for k, (what, value) in enumerate(folded, start=1):
            node.inputs[k] = gs.Constant(f"{node.name or node.outputs[0].name}/{what}", np.asarray(value, dtype))
        count += 1
    return count


def cast_edges(graph: gs.Graph) -> int:
    """A Cast to fp16 behind each float32 (or float64) graph input and one back to its own type before
    each such output; returns how many."""
    count = 0
    for tensor in [t for t in graph.inputs if is_float32(t)]:
        half = gs.Variable(f"{tensor.name}/fp16", dtype=np.float16, shape=tensor.shape)
        replace_uses(tensor, half)
        graph.nodes.insert(0, gs.Node("Cast", f"{tensor.name}/to_fp16", {"to": onnx.TensorProto.FLOAT16},
                                      inputs=[tensor], outputs=[half]))
        count += 1
    for tensor in [t for t in graph.outputs if is_float32(t)]:
        producer = tensor.inputs[0] if tensor.inputs else None
        if producer is None:
            continue
        half = gs.Variable(f"{tensor.name}/fp16", dtype=np.float16, shape=tensor.shape)
        replace_uses(tensor, half)
        producer.outputs[producer.outputs.index(tensor)] = half
        to = onnx.helper.np_dtype_to_tensor_dtype(np.dtype(tensor.dtype))   # float32, or float64 as it was
        graph.nodes.append(gs.Node("Cast", f"{tensor.name}/to_fp32", {"to": to}, inputs=[half], outputs=[tensor]))
        count += 1
    return count
