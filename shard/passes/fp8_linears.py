"""fp8_linears: with `--precision fp8` (GPU targets), every linear (MatMul or Gemm with a constant 2-D
weight) gets explicit QuantizeLinear/DequantizeLinear in FP8 E4M3; norms, softmax, attention's own
products and residual adds stay fp16.

Explicit Q/DQ is the only form TensorRT 11 takes (strongly typed), and on Thor the builder's FP8 flag
silently gives FP32 engines (NVIDIA/TensorRT#4590): the ONNX must say it. The activation gets one
scale (its calibrated absolute maximum over 448, E4M3's largest value), shared by every linear that
reads it (Q, K and V read one LayerNorm); the weight is stored in FP8 with one scale per output
channel, as TensorRT's FP8 GEMMs take it. Runs after strong_types, so scales are fp16 like the
activations they scale.

Precision that is checked: E4M3 keeps 3 mantissa bits, so each linear adds about 5 % noise to its
output whatever the scales (measured: ViT-tiny with seeded weights, every linear in FP8, cosine
0.93 end to end in onnxruntime). The pass runs the graph in onnxruntime on the calibration samples
before and after, and while the cosine is under `--min-cosine` it moves a growing share of the
linears back to fp16, the smallest first (each costs about the same noise, so the FP8 FLOPs kept
are the most for the fidelity bought), as mixed precision does on RK3588. Every round is reported.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx
import onnx_graphsurgeon as gs
from onnx_graphsurgeon.ir.tensor import LazyValues

from shard.calibration import calibration_samples, collect_stats, lifted, run_each, stats_cache
from shard.compare import compare
from shard.errors import ModelError
from shard.graph import float_ranks, tensor_spec
from shard.passes.context import PassContext
from shard.macs import estimate_macs
from shard.precision import MIXED_ROUNDS, is_linear, promote_share, weight_axis

E4M3_MAX = 448.0
CHECK_SAMPLES = 4                       # calibration samples the cosine is measured on
FP8 = onnx.TensorProto.FLOAT8E4M3FN


def linears(graph: gs.Graph) -> list[tuple[gs.Node, int]]:
    """(node, axis of its weight's output channels) for each product of an activation and a 2-D constant."""
    return [(node, weight_axis(node)) for node in graph.nodes
            if is_linear(node) and node.op != "Conv" and len(node.inputs[1].shape) == 2
            and not node.attrs.get("transA", 0)]


def fp8_constant(name: str, values: np.ndarray) -> gs.Constant:
    """An FP8 E4M3 initializer (graphsurgeon keeps it as its ONNX type, unread)."""
    saturated = np.clip(values, -E4M3_MAX, E4M3_MAX)   # E4M3FN has no infinity: past 448 is NaN
    proto = onnx.numpy_helper.from_array(saturated.astype(ml_dtypes.float8_e4m3fn), name)
    return gs.Constant(name, LazyValues(proto))


def fp8_variable(name: str, shape) -> gs.Variable:
    return gs.Variable(name, dtype=FP8, shape=shape)


def fp8_linears(graph: gs.Graph, ctx: PassContext) -> tuple[gs.Graph, dict]:

    if ctx.options.precision != "fp8":
        return graph, {"skipped": f"precision {ctx.options.precision}"}
    found = linears(graph)
    if not found:
        return graph, {"changes": []}
    if graph.opset < 19:
        raise ModelError(f"--precision fp8 needs opset 19 (QuantizeLinear to FP8); the onnx version converter could "
                         f"not lift this model from opset {graph.opset}")
    samples = calibration_samples(ctx, [tensor_spec(t) for t in graph.inputs])
    model, weights = lifted(graph)
    stats = collect_stats(model, samples, sorted({node.inputs[0].name for node, _ in found}), ranks=float_ranks(graph),
                          cache=stats_cache(ctx), weights=weights)
    check = samples[:CHECK_SAMPLES]
    outputs = [t.name for t in graph.outputs]
    expected = list(run_each(model, [{**s, **weights} for s in check], outputs, optimize=False))
    del model, weights
    macs = {node.name: estimate_macs(node) for node, _ in found}
    # the smallest first: each adds about the same E4M3 noise, so the FP8 FLOPs kept are the most
    order = [{"node": n, "macs": m} for n, m in sorted(macs.items(), key=lambda item: (item[1], item[0]))]
    total = sum(macs.values()) or 1
    kept = {id(node): list(node.inputs) for node, _ in found}
    rounds, changes = [], []
    for share in MIXED_ROUNDS:
        promoted = promote_share(order, share)
        if rounds and promoted == rounds[-1]["promoted"]:
            continue
        restore(graph, found, kept)
        changes = quantize_linears(graph, [(n, a) for n, a in found if n.name not in set(promoted)], stats)
        got = list(run_each(gs.export_onnx(graph.copy(), do_type_check=False), check, outputs, optimize=False))
        cosine = min(compare(name, e[name], g[name]).cosine for e, g in zip(expected, got) for name in outputs)
        rounds.append({"fp16_share_of_linears": share, "promoted": promoted, "cosine": cosine,
                       "fp8_linear_macs": 1 - sum(macs[n] for n in promoted) / total})
        if cosine >= ctx.options.min_cosine:
            break
    if not changes:
        ctx.warnings.append(f"fp8: every linear in FP8 gives cosine {rounds[0]['cosine']:.5f} on the calibration "
                            f"samples (onnxruntime), and no share of them in FP8 keeps --min-cosine "
                            f"{ctx.options.min_cosine}: every linear stays fp16")
    return graph, {"changes": changes, "rounds": rounds, "samples": len(samples), "checked_on": len(check),
                   "format": "FP8 E4M3: activations per tensor, weights per output channel",
                   "fp8_linear_macs": rounds[-1]["fp8_linear_macs"]}


def restore(graph: gs.Graph, found: list, kept: dict) -> None:
    """Every linear reads its fp16 operands again (the Q/DQ of a previous round become dead nodes)."""
    for node, _ in found:
        for k, tensor in enumerate(kept[id(node)]):
            node.inputs[k] = tensor
    graph.cleanup()


def quantize_linears(graph: gs.Graph, found: list, stats: dict) -> list[dict]:
    """Q/DQ on each linear's activation and an FP8 weight with its DequantizeLinear."""
    dequantized: dict[str, gs.Variable] = {}
    changes = []
    for node, axis in found:
        x, w = node.inputs[0], node.inputs[1]
        amax = stats[x.name].absmax if x.name in stats else 0.0
        if not np.isfinite(amax) or amax <= 0:
            continue
        if x.name not in dequantized:
            dequantized[x.name] = quantize_activation(graph, x, amax, graph.nodes.index(node))
        weight = np.asarray(w.values, dtype=np.float32)
        scale = (np.abs(weight).max(axis=1 - axis) / E4M3_MAX).astype(np.float16)
        scale[scale == 0] = 1.0
        shaped = scale.astype(np.float32).reshape((1, -1) if axis == 1 else (-1, 1))
        w8 = fp8_constant(f"{w.name}/fp8", weight / shaped)
        wd = gs.Variable(f"{w.name}/dq", dtype=np.float16, shape=list(w.shape))
        # each new node goes right before its first reader: the stable toposort keeps it there, and
        # stages can then cut between layers (a weight's DQ at the graph's start would be live throughout)
        graph.nodes.insert(graph.nodes.index(node), gs.Node("DequantizeLinear", f"{node.name}/weight_dq", {"axis": axis},
                                   inputs=[w8, gs.Constant(f"{w.name}/fp8_scale", scale)], outputs=[wd]))
        node.inputs[0], node.inputs[1] = dequantized[x.name], wd
        changes.append({"node": node.name, "op": node.op, "input": x.name, "input_absmax": amax,
                        "input_scale": amax / E4M3_MAX, "weight": list(w.shape)})
    return changes


def quantize_activation(graph: gs.Graph, x: gs.Variable, amax: float, at: int) -> gs.Variable:
    """x through QuantizeLinear and DequantizeLinear at one scale: the tensor the linears read."""
    scale = gs.Constant(f"{x.name}/fp8_scale", np.array(amax / E4M3_MAX, dtype=np.float16))
    zero = fp8_constant(f"{x.name}/fp8_zero", np.zeros((), np.float32))
    q = fp8_variable(f"{x.name}/q", x.shape)
    dq = gs.Variable(f"{x.name}/dq", dtype=x.dtype, shape=x.shape)
    graph.nodes[at:at] = [gs.Node("QuantizeLinear", f"{x.name}/quantize", inputs=[x, scale, zero], outputs=[q]),
                          gs.Node("DequantizeLinear", f"{x.name}/dequantize", inputs=[q, scale], outputs=[dq])]
    return dq
