"""w4a16_linears: with `--precision w4a16` (GPU targets), every linear's weight (MatMul by a constant
2-D [K, N], K a multiple of 16) is stored in 4-bit integers read through a blocked DequantizeLinear
(opset 21); activations, norms, softmax and attention stay fp16.

The form is the one TensorRT takes for weight-only INT4 and NVIDIA's ModelOpt writes: symmetric
(no zero point: TensorRT's IDequantizeLayer takes none for INT4), one fp16 scale per BLOCK rows of
each output column (128, ModelOpt's default block; 64, 32 or 16 where K is no multiple of 128, as
SigLIP-so400m's 4,304), the weight the DequantizeLinear's input, so the
engine keeps the packed weight and dequantizes in the product's prologue. What it buys is bytes: a
weight read each pass is a quarter of its fp16 size plus its scales (1/64 more at BLOCK 128), which
is where a pass reads its weights slower than it computes (a denoising step's 51 rows on Thor's 273
GB/s; docs/DESIGN.md has the arithmetic for Pi0).

Precision: the rounding to 15 levels a block is the loss, and how much of it reaches the outputs
differs by linear. So, as fp8_linears does, the linears are ranked on a replica (each linear's weight
alone in int4 behind a gate) and rounds move the most harmful per MAC back until --min-cosine holds
against the graph itself on the calibration samples, confirmed with the real DequantizeLinear in
onnxruntime; where no round holds it, every weight stays as it was, with a warning. A VLA is judged
again on its action chunk (compilation.vla.check_actions): its loop compounds what each program lost.
"""

from __future__ import annotations

from functools import partial

import ml_dtypes
import numpy as np
import onnx
import onnx_graphsurgeon as gs
from onnx_graphsurgeon.ir.tensor import LazyValues

from shard.calibration import calibration_samples, lifted, stats_cache
from shard.graph import tensor_spec
from shard.passes.context import PassContext
from shard.passes.fp8_linears import (CHECK_SAMPLES, cached_search, closest_round, not_promoted, search_linears,
                                      search_samples)
from shard.precision import gated_weight, gates_input, is_linear, named

BLOCKS = (128, 64, 32, 16)   # rows of K under one scale: the first that divides K
INT4_MAX = 7         # symmetric: -7..7 of int4's -8..7, so no value saturates
OPSET = 21           # DequantizeLinear takes INT4 and block_size from opset 21
SEARCH_FILE, SEARCH_VERSION = "w4a16_search.json", 1   # the build cache's entry of a search
SHARE = "int4_linear_macs"   # a round's share of the linears' MACs reading int4 weights


def block_of(rows: int) -> int | None:
    return next((b for b in BLOCKS if rows % b == 0), None)


def int4_weight(weight: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
    """A [K, N] weight as (int8 values in -7..7, fp16 scales [K / block, N]): each block of `block` rows of
    a column over its absolute maximum / 7, rounded to nearest. The scale is rounded to fp16 first, so
    the values are those of the scale the graph holds."""
    w = np.asarray(weight, np.float32)
    k, n = w.shape
    blocks = w.reshape(k // block, block, n)
    scale = (np.abs(blocks).max(axis=1) / INT4_MAX).astype(np.float16)
    scale[scale == 0] = 1.0
    q = np.clip(np.rint(blocks / scale.astype(np.float32)[:, None, :]), -INT4_MAX, INT4_MAX).astype(np.int8)
    return q.reshape(k, n), scale


def int4_constant(name: str, values: np.ndarray) -> gs.Constant:
    """An INT4 initializer (two values a byte in the file; graphsurgeon keeps it as its ONNX type)."""
    return gs.Constant(name, LazyValues(onnx.numpy_helper.from_array(values.astype(ml_dtypes.int4), name)))


def w4a16_linears(graph: gs.Graph, ctx: PassContext) -> tuple[gs.Graph, dict]:
    """The linears whose weights go to int4 as the search keeps them (fp8_linears.search_linears on
    int4_replica: the most harmful per MAC back in the weight's type until --min-cosine holds against
    the graph itself on the calibration samples; a search of the same graph, samples and target is read
    back from the build cache), each weight through a DequantizeLinear of its INT4 values and scales."""
    if ctx.options.precision != "w4a16":
        return graph, {"skipped": f"precision {ctx.options.precision}"}
    found, left = candidates(graph)
    if not found:
        return graph, {"changes": [], "left": left}
    samples = calibration_samples(ctx, [tensor_spec(t) for t in graph.inputs])
    frames = ctx.options.batch or 1
    model, weights = lifted(graph)
    rounded = Rounded()   # each weight's int4 values and scales, made once for the replica and every rewrite
    search = cached_search(stats_cache(ctx), f"w4a16 search {SEARCH_VERSION} {ctx.options.min_cosine} {CHECK_SAMPLES} "
                           f"{BLOCKS}", model, samples, weights, "w4a16", SEARCH_FILE,
                           partial(search_w4a16, graph, found, samples, model, weights, ctx, rounded))
    del model, weights
    best = next((r for r in search["rounds"] if r["round"] == search["kept"]), None)
    changes = quantize_int4(graph, not_promoted(found, best["promoted"]), rounded) if best else []
    if not changes:
        ctx.warnings.append(f"w4a16: no share of the linears' weights in int4 keeps --min-cosine "
                            f"{ctx.options.min_cosine} on the calibration samples{closest_round(search, SHARE, 'int4')}: "
                            f"every weight stays as it was")
    stored = {c["weight"]: c for c in changes}
    before = sum(c["shape"][0] * c["shape"][1] * c["itemsize"] for c in stored.values())
    after = sum(c["shape"][0] * c["shape"][1] // 2 + c["shape"][0] // c["block"] * c["shape"][1] * c["itemsize"]
                for c in stored.values())
    return graph, {**search, "changes": changes, "left": left, "samples": len(samples),
                   "checked_on": len(search_samples(samples)[0]), "frames": frames,
                   SHARE: best[SHARE] if best else 0.0, "cosine": best.get("confirmed", best["cosine"]) if best else None,
                   "weight_bytes_before": before, "weight_bytes_after": after}


def search_w4a16(graph: gs.Graph, found: list, samples: list[dict], model: onnx.ModelProto, weights: dict,
                 ctx: PassContext, rounded: Rounded) -> dict:
    """search_linears with int4_replica and quantize_int4: which linears' weights go to int4."""
    return search_linears(graph, found, samples, model, weights, ctx.options.min_cosine, ctx.options.batch or 1,
                          ctx.replica, int4_replica(graph, found, rounded),
                          lambda subset: quantize_int4(graph, subset, rounded), SHARE)


def candidates(graph: gs.Graph) -> tuple[list, list]:
    """([(MatMul, its block)] whose constant weight int4 can hold, [{"node", "why"} of the others]), each
    named apart (precision.named)."""
    found, left = [], []
    for node in named(graph, [n for n in graph.nodes if is_linear(n) and n.op == "MatMul"], "w4a16_linear_"):
        weight = node.inputs[1]
        block = block_of(weight.shape[0]) if len(weight.shape) == 2 else None
        if block is None or np.dtype(weight.dtype).kind != "f":
            left.append({"node": node.name, "why": f"weight {list(weight.shape)} {np.dtype(weight.dtype).name}: "
                         f"int4 takes a 2-D float weight whose K is a multiple of {BLOCKS[-1]}"})
        else:
            found.append((node, block))
    return found, left


class Rounded(dict):
    """{a weight's name: (its int4 values, its scales)}, each made once (int4_weight) however often a pass
    asks: the replica, and the rewrite of every round the search confirms, read the same rounding."""

    def of(self, weight: gs.Constant, block: int) -> tuple[np.ndarray, np.ndarray]:
        if weight.name not in self:
            self[weight.name] = int4_weight(weight.values, block)
        return self[weight.name]


def int4_replica(graph: gs.Graph, found: list, rounded: Rounded) -> gs.Graph:
    """A copy of the graph whose linear k reads its weight as int4 gives it back (dequantized) where its gate
    (input GATES, one fp16 per linear, 0 or 1) says so; with every gate at 0, the graph itself."""
    graph = graph.copy()
    by_name = {n.name: n for n in graph.nodes}
    wheres = [f"shard.w4a16/{k}" for k in range(len(found))]
    for (node, block), gate, where in zip(found, gates_input(graph, wheres, np.float16), wheres):
        node = by_name[node.name]
        weight = np.asarray(node.inputs[1].values)
        q, scale = rounded.of(node.inputs[1], block)
        back = q.astype(np.float32) * np.repeat(scale.astype(np.float32), block, axis=0)
        gated_weight(graph, node, gate, (back - weight).astype(weight.dtype), where)
    return graph.toposort()


def quantize_int4(graph: gs.Graph, found: list, rounded: Rounded) -> list[dict]:
    """Each linear of `found` reads its weight through DequantizeLinear of its INT4 values and scales (one
    per weight, whatever reads it; `rounded` holds them), the graph at opset 21."""
    changes, read = [], {}
    for node, block in found:
        weight = node.inputs[1]
        if weight.name not in read:   # the scales in the weight's own type: the product's operands agree
            q, scale = rounded.of(weight, block)
            out = gs.Variable(f"{weight.name}_w4a16", dtype=weight.dtype, shape=list(weight.shape))
            # right before its first reader (the stable toposort keeps it there), so stages can cut between
            # layers: a weight's DequantizeLinear at the graph's start would be live throughout
            graph.nodes.insert(graph.nodes.index(node), gs.Node(
                "DequantizeLinear", name=f"{weight.name}_dequantize", attrs={"axis": 0, "block_size": block},
                inputs=[int4_constant(f"{weight.name}_int4", q),
                        gs.Constant(f"{weight.name}_scale", scale.astype(weight.dtype))], outputs=[out]))
            read[weight.name] = out
        node.inputs[1] = read[weight.name]
        changes.append({"node": node.name, "weight": weight.name, "shape": list(weight.shape), "block": block,
                        "itemsize": np.dtype(weight.dtype).itemsize})
    if changes:
        graph.opset = max(graph.opset, OPSET)
        graph.import_domains = [onnx.helper.make_opsetid("", graph.opset) if d.domain in ("", "ai.onnx") else d
                                for d in graph.import_domains or []] or None
        graph.cleanup()
    return changes
