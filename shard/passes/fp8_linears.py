"""fp8_linears: with `--precision fp8` (GPU targets), every linear (MatMul or Gemm with a constant 2-D
weight) gets explicit QuantizeLinear/DequantizeLinear in FP8 E4M3; norms, softmax, attention's own
products and residual adds stay fp16.

Explicit Q/DQ is the only form TensorRT 11 takes (strongly typed), and on Thor the builder's FP8 flag
silently gives FP32 engines (NVIDIA/TensorRT#4590): the ONNX must say it. The activation gets one
scale (its calibrated absolute maximum over 448, E4M3's largest value), shared by every linear that
reads it (Q, K and V read one LayerNorm); the weight is stored in FP8 with one scale (fp8_weight:
per output channel where a tensor-wide one would leave many weights subnormal), both forms
TensorRT's FP8 GEMMs take. Runs after strong_types, so scales are fp16 like the
activations they scale.

Precision that is checked: E4M3 keeps 3 mantissa bits, so each linear adds noise to its output
whatever the scales (ViT-tiny with seeded weights, every linear in FP8: cosine 0.93 end to end in
onnxruntime). How much of it reaches the output differs by linear: SigLIP-base-512 (seeded weights),
each linear alone in FP8: 1e-7 of cosine lost for a Q or K projection (softmax hardly moves), 2.5-7e-5
for V, the output projection and the MLP's, 1.2-1.6e-4 for the first two layers' second MLP linear;
the losses add up (every sixth prefix of the order below within 3 % of their sum). So the pass ranks
the linears once on fp8_replica (each linear alone in FP8 behind a gate, on a calibration sample the
check does not use, where there are more than it uses), the most harmful per MAC first, and moves
to fp16 the fewest whose loss, as the sum of the rest predicts it, leaves the target a margin; the
replica, gated as each round asks, run on the calibration samples against every gate off, decides,
round by round as mixed precision does on RK3588 (shard.precision.next_count); of the rounds that
hold `--min-cosine`, the one with the most FP8 whose graph with the real Q/DQ holds it too in
onnxruntime, against the fp16 graph, is kept. Every round is reported. The replica runs in torch on
the GPU where there is one: the rounds of SigLIP-base at batch 16 took most of a 348 s compile in
onnxruntime on 16 cores. Ordered by size alone (the smallest back
first), SigLIP-base-512 held 0.999 with half of the linears' MACs in FP8.
"""

from __future__ import annotations

import json
from functools import partial
from typing import Callable

import ml_dtypes
import numpy as np
import onnx
import onnx_graphsurgeon as gs
from onnx_graphsurgeon.ir.tensor import LazyValues

from shard.cache_folder import entry_file, store_entry
from shard.calibration import (calibration_samples, collect_stats, content_key, lifted, ort_session, run_each,
                               stats_cache)
from shard.errors import ModelError
from shard.graph import float_ranks, tensor_spec
from shard.macs import estimate_macs
from shard.passes.context import PassContext
from shard.precision import (GATES, SAFETY, by_frame, gated_quantize, gated_weight, gates_input, is_linear, named,
                             next_count, next_prefix, single_errors, weight_axis, worst_cosine)

E4M3_MAX = 448.0
E4M3_MIN_NORMAL = 2.0 ** -6
MAX_SUBNORMAL = 1e-3   # a weight's share under E4M3's normal range past which it is scaled per channel
# The cosine is measured on every calibration sample but the last (the linears are ranked on it), at
# most this many: on all-mpnet-base-v2, FP8 kept at 0.99932 on 4 of its 32 calibration sentences
# gave 0.99427 on another and 0.99853 on an unseen one (a short sentence averages fewer tokens).
CHECK_SAMPLES = 32
SEARCH_FILE, SEARCH_VERSION = "fp8_search.json", 4   # the build cache's entry of a search (search_fp8)
SHARE = "fp8_linear_macs"   # a round's share of the linears' MACs in FP8
FP8 = onnx.TensorProto.FLOAT8E4M3FN


def linears(graph: gs.Graph) -> list[tuple[gs.Node, int]]:
    """(node, axis of its weight's output channels) for each product of an activation and a 2-D constant,
    each named apart (precision.named)."""
    found = named(graph, [node for node in graph.nodes if is_linear(node) and node.op != "Conv"
                          and len(node.inputs[1].shape) == 2 and not node.attrs.get("transA", 0)], "fp8_linear_")
    return [(node, weight_axis(node)) for node in found]


def e4m3(values: np.ndarray) -> np.ndarray:
    """Values in E4M3, saturated (E4M3FN has no infinity: past 448 is NaN)."""
    return np.clip(values, -E4M3_MAX, E4M3_MAX).astype(ml_dtypes.float8_e4m3fn)


def fp8_constant(name: str, values: np.ndarray) -> gs.Constant:
    """An FP8 E4M3 initializer (graphsurgeon keeps it as its ONNX type, unread) of `values`, saturated
    unless they are E4M3 already."""
    values = values if values.dtype == ml_dtypes.float8_e4m3fn else e4m3(values)
    return gs.Constant(name, LazyValues(onnx.numpy_helper.from_array(values, name)))


def fp8_weight(weight: np.ndarray, axis: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A linear's weight in E4M3: (the E4M3 values, the fp16 scales, the scales shaped to multiply the
    weight). One scale for the whole weight: E4M3 is floating point, so a channel of small weights
    keeps its 3 mantissa bits at the tensor's scale (SigLIP-base, every linear FP8: cosine lost
    0.00234 against 0.00236 with a scale per channel), and the product then takes its bias in the
    same kernel (on an H200, SigLIP's shapes: 1.07-1.52x the per-channel product at batch 1,
    0.95-1.09x at 16; bench/fp8_products.py). One per output channel where more than MAX_SUBNORMAL of the weights would
    fall under E4M3's smallest normal value at the tensor's scale (SigLIP-base: 3.5e-5)."""
    w = np.asarray(weight, np.float32)
    whole = np.float16(np.abs(w).max() / E4M3_MAX)
    small = (np.abs(w) < np.float32(whole) * E4M3_MIN_NORMAL) & (w != 0)
    if whole > 0 and small.mean() <= MAX_SUBNORMAL:
        return e4m3(w / np.float32(whole)), np.array(whole), np.float32(whole)
    scale = (np.abs(w).max(axis=1 - axis) / E4M3_MAX).astype(np.float16)
    scale[scale == 0] = 1.0
    shaped = scale.astype(np.float32).reshape((1, -1) if axis == 1 else (-1, 1))
    return e4m3(w / shaped), scale, shaped


def activation_scale(stats: dict, x: gs.Tensor) -> float | None:
    """The per-tensor scale of a linear's input, its calibrated absolute maximum over 448; None where
    it has no usable range."""
    amax = stats[x.name].absmax if x.name in stats else 0.0
    return amax / E4M3_MAX if np.isfinite(amax) and amax > 0 else None


def fp8_variable(name: str, shape) -> gs.Variable:
    return gs.Variable(name, dtype=FP8, shape=shape)


def fp8_linears(graph: gs.Graph, ctx: PassContext) -> tuple[gs.Graph, dict]:
    """The linears in FP8 that search_fp8 keeps (a search of the same graph, samples and target is read
    back from the build cache), Q/DQ written in."""
    if ctx.options.precision != "fp8":
        return graph, {"skipped": f"precision {ctx.options.precision}"}
    found = linears(graph)
    if not found:
        return graph, {"changes": []}
    if graph.opset < 19:
        raise ModelError(f"--precision fp8 needs opset 19 (QuantizeLinear to FP8); the onnx version converter could "
                         f"not lift this model from opset {graph.opset}")
    samples = calibration_samples(ctx, [tensor_spec(t) for t in graph.inputs])
    frames = ctx.options.batch or 1   # a sample's frames: each checked on its own
    model, weights = lifted(graph)
    cache = stats_cache(ctx)
    stats = collect_stats(model, samples, sorted({node.inputs[0].name for node, _ in found}), ranks=float_ranks(graph),
                          cache=cache, weights=weights)
    search = cached_search(cache, f"fp8 search {SEARCH_VERSION} {ctx.options.min_cosine} {CHECK_SAMPLES}", model,
                           samples, weights, "fp8", SEARCH_FILE,
                           partial(search_fp8, graph, found, stats, samples, model, weights, ctx.options.min_cosine,
                                   frames, ctx.replica))
    del model, weights
    best = next((r for r in search["rounds"] if r["round"] == search["kept"]), None)
    changes = quantize_linears(graph, not_promoted(found, best["promoted"]), stats) if best else []
    if not changes:
        ctx.warnings.append(f"fp8: no share of the linears in FP8 keeps --min-cosine {ctx.options.min_cosine} on the "
                            f"calibration samples{closest_round(search, SHARE, 'FP8')}: every linear stays fp16")
    return graph, {**search, "changes": changes, "samples": len(samples),
                   "checked_on": len(search_samples(samples)[0]), "ranked_on": 1,
                   "frames": frames,
                   "format": "FP8 E4M3: activations per tensor, weights per tensor (per output channel where many "
                             "would be subnormal)",
                   "fp8_linear_macs": best["fp8_linear_macs"] if best else 0.0}


def cached_search(cache, what: str, model: onnx.ModelProto, samples: list[dict], weights: dict, precision: str,
                  file: str, search: Callable[[], dict]) -> dict:
    """search(), or, where the same graph, samples and target were searched before (`what` names the
    search and its settings), its rounds read back from the build cache (`cache`: stats_cache's), nothing
    run."""
    key = content_key(what, model, samples, weights, precision) if cache is not None else None
    entry = key and entry_file(cache, key, file)
    if entry:
        return {**json.loads(entry.read_text()), "cached": True}
    result = search()
    if key:
        store_entry(cache, key, lambda folder: (folder / file).write_text(json.dumps(result)))
    return result


def closest_round(search: dict, share: str, precision: str) -> str:
    """Where no round held: the one that came closest (its cosine, onnxruntime's where it confirmed one),
    as " (at best C with S% of their MACs in PRECISION)"; "" where no round lowered anything."""
    held = {r["round"]: min(r["cosine"], r.get("confirmed", 1.0)) for r in search["rounds"]}
    tried = max((r for r in search["rounds"] if r[share] > 0), key=lambda r: held[r["round"]], default=None)
    return f" (at best {held[tried['round']]:.5f} with {tried[share]:.0%} of their MACs in {precision})" if tried else ""


def search_fp8(graph: gs.Graph, found: list, stats: dict, samples: list[dict], model: onnx.ModelProto,
               weights: dict, target: float, frames: int = 1, faster: Callable | None = None) -> dict:
    """search_linears with fp8_replica and quantize_linears: which linears go to FP8."""
    return search_linears(graph, found, samples, model, weights, target, frames, faster,
                          fp8_replica(graph, stats, found), lambda subset: quantize_linears(graph, subset, stats),
                          SHARE)


def search_linears(graph: gs.Graph, found: list, samples: list[dict], model: onnx.ModelProto, weights: dict,
                   target: float, frames: int, faster: Callable | None, replica: gs.Graph,
                   quantize: Callable[[list], list], share: str) -> dict:
    """The linears ranked (rank_fp8), then rounds of `replica` (each linear's gate on: that linear in the
    lower precision), gated as each round asks, on the samples search_samples checks on against every
    gate off, as many as next_count asks (in torch on the GPU where there is one: seconds a round where
    onnxruntime on a CPU takes minutes at batch 16); the real graph (`quantize` of a subset of `found`
    rewrites it) in onnxruntime against the graph itself then confirms the round kept (confirmed). Each
    of a sample's `frames` frames (a `--batch` compile's) is checked on its own (by_frame). `faster`:
    the target's own runner of the replica (PassContext.replica), where it has one for this graph.
    `share` names each round's share of the linears' MACs in the lower precision.
    {"ranking", "rounds", "kept" (None where no round holds `target`), "rounds_on"}. The graph is left
    as it came."""
    (check, ranked), outputs = search_samples(samples), [t.name for t in graph.outputs]
    replica = gs.export_onnx(replica, do_type_check=False)
    runner = (faster and faster(replica, outputs)) or ort_runner(replica, outputs)
    del replica
    ranking = rank_fp8(found, lambda gates: by_frame(runner(gates, [ranked]), frames), outputs)

    def run(gates: np.ndarray) -> list[list[np.ndarray]]:
        return by_frame(runner(gates, check), frames)
    index = {n.name: k for k, (n, _) in enumerate(found)}
    plain = run(np.zeros(len(found), np.float16))
    total = sum(c["macs"] for c in ranking) or 1
    allowed = 1.0 - target
    count = 0 if 1.0 - ranking[0]["cosine_before"] <= SAFETY * allowed else next_prefix(ranking, allowed, 1.0, 1.0, 0)
    rounds = []
    while count is not None:
        promoted = [c["node"] for c in ranking[:count]]
        gates = np.ones(len(found), np.float16)
        gates[[index[p] for p in promoted]] = 0
        rounds.append({"round": len(rounds) + 1, "promoted": promoted,
                       "cosine": worst_cosine(outputs, plain, run(gates)),
                       "predicted": float(ranking[count - 1]["cosine_after"] if count else ranking[0]["cosine_before"]),
                       share: 1 - sum(c["macs"] for c in ranking[:count]) / total})
        count = next_count(rounds, ranking, target)
    return {"ranking": [{"node": c["node"], "macs": int(c["macs"]), "error": float(c["error"])} for c in ranking],
            "rounds": rounds, "rounds_on": runner.where,
            "kept": confirmed(graph, found, quantize, rounds, model, weights, check, target, frames, share)}


def search_samples(samples: list) -> tuple[list, dict]:
    """(the calibration samples the search checks on, the one it ranks the linears on): all but the
    last (at most CHECK_SAMPLES), and the last; one sample does both."""
    check = samples[:min(CHECK_SAMPLES, max(1, len(samples) - 1))]
    return check, samples[len(check) % len(samples)]


def not_promoted(found: list, promoted: list[str]) -> list:
    """The linears of `found` ((node, its detail) pairs) not promoted back: those left in the lower precision."""
    back = set(promoted)
    return [(n, a) for n, a in found if n.name not in back]


def confirmed_round(graph: gs.Graph, found: list, stats: dict, rounds: list[dict], model: onnx.ModelProto,
                    weights: dict, check: list[dict], target: float, frames: int = 1) -> int | None:
    """confirmed, each round's linears in FP8 as quantize_linears writes them."""
    return confirmed(graph, found, lambda subset: quantize_linears(graph, subset, stats), rounds, model, weights,
                     check, target, frames, SHARE)


def confirmed(graph: gs.Graph, found: list, quantize: Callable[[list], list], rounds: list[dict],
              model: onnx.ModelProto, weights: dict, check: list[dict], target: float, frames: int,
              share: str) -> int | None:
    """Of the rounds whose replica holds `target`, the one with the largest `share` whose real graph
    (`quantize` of its linears), in onnxruntime on `check` against the graph itself, holds it too (each
    one run gets its "confirmed" cosine): the reference the replica is only a fast stand-in for. None
    where none does. The graph is left as it came."""
    outputs = [t.name for t in graph.outputs]
    held = sorted((r for r in rounds if r["cosine"] >= target and r[share] > 0), key=lambda r: -r[share])
    expected = by_frame([[e[n] for n in outputs] for e in run_each(model, [{**s, **weights} for s in check], outputs,
                                                                   optimize=False)], frames) if held else []
    inputs = {id(n): list(n.inputs) for n, _ in found}
    for r in held:
        quantize(not_promoted(found, r["promoted"]))
        got = list(run_each(gs.export_onnx(graph.copy(), do_type_check=False), check, outputs, optimize=False))
        restore(graph, found, inputs)
        r["confirmed"] = worst_cosine(outputs, expected, by_frame([[g[n] for n in outputs] for g in got], frames))
        if r["confirmed"] >= target:
            return r["round"]
    return None


def rank_fp8(found: list, run, outputs: list[str]) -> list[dict]:
    """The linears, the most harmful per MAC first: {"node", "macs", "error" (1 - the outputs' cosine
    with it alone in FP8: `run`, fp8_replica's runner), "cosine_after" (predicted with it and every
    linear before it back in fp16: 1 - the errors of the rest, summed), "cosine_before"}."""
    errors = single_errors(run, outputs, len(found), np.float16)
    ranking = sorted(({"node": n.name, "macs": estimate_macs(n), "error": e} for (n, _), e in zip(found, errors)),
                     key=lambda c: (-c["error"] / max(c["macs"], 1), c["node"]))
    rest = np.cumsum([0.0] + [c["error"] for c in reversed(ranking)])[::-1]   # rest[k]: errors of ranking[k:]
    for k, c in enumerate(ranking):
        c["cosine_before"], c["cosine_after"] = 1.0 - rest[k], 1.0 - rest[k + 1]
    return ranking


def fp8_replica(graph: gs.Graph, stats: dict, found: list) -> gs.Graph:
    """A copy of the graph that runs each linear of `found` in FP8 as quantize_linears writes it (its
    input and its weight as fp8_weight scales them), where its gate (input GATES, one fp16 per
    linear, 0 or 1) says so; with every gate at 0, the graph itself."""
    graph = graph.copy()
    by_name = {n.name: n for n in graph.nodes}
    wheres = [f"shard.fp8/{k}" for k in range(len(found))]
    for (node, axis), gate, where in zip(found, gates_input(graph, wheres, np.float16), wheres):
        node = by_name[node.name]
        x, weight = node.inputs[0], np.asarray(node.inputs[1].values)
        scale = activation_scale(stats, x)
        if scale is not None:
            consts = [gs.Constant(f"{where}/scale", np.array(scale, dtype=np.float16)),
                      fp8_constant(f"{where}/zero", np.zeros((), np.float32))]
            node.inputs[0] = gated_quantize(graph, x, gate, consts, FP8, f"{where}/in")
        w8, _, shaped = fp8_weight(weight, axis)
        gated_weight(graph, node, gate, (w8.astype(np.float32) * shaped - weight).astype(weight.dtype), where)
    return graph.toposort()


def ort_runner(model: onnx.ModelProto, outputs: list[str]):
    """(gates, samples) -> [the model's outputs, for each sample] in onnxruntime; `.where` says so."""
    session = ort_session(model, optimize=False)
    names = [i.name for i in session.get_inputs() if i.name != GATES]

    def on_cpu(gates: np.ndarray, samples: list[dict]) -> list[list[np.ndarray]]:
        return [session.run(outputs, {**{n: s[n] for n in names}, GATES: gates}) for s in samples]
    on_cpu.where = "onnxruntime"
    return on_cpu


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
        scale = activation_scale(stats, x)
        if scale is None:
            continue
        if x.name not in dequantized:
            dequantized[x.name] = quantize_activation(graph, x, scale, graph.nodes.index(node))
        values, scale_w, _ = fp8_weight(np.asarray(w.values, dtype=np.float32), axis)
        w8 = fp8_constant(f"{w.name}/fp8", values)
        wd = gs.Variable(f"{w.name}/dq", dtype=np.float16, shape=list(w.shape))
        # each new node goes right before its first reader: the stable toposort keeps it there, and
        # stages can then cut between layers (a weight's DQ at the graph's start would be live throughout)
        graph.nodes.insert(graph.nodes.index(node), gs.Node("DequantizeLinear", f"{node.name}/weight_dq", {"axis": axis},
                                   inputs=[w8, gs.Constant(f"{w.name}/fp8_scale", scale_w)], outputs=[wd]))
        node.inputs[0], node.inputs[1] = dequantized[x.name], wd
        changes.append({"node": node.name, "op": node.op, "input": x.name, "input_absmax": scale * E4M3_MAX,
                        "input_scale": scale, "weight": list(w.shape)})
    return changes


def quantize_activation(graph: gs.Graph, x: gs.Variable, value: float, at: int) -> gs.Variable:
    """x through QuantizeLinear and DequantizeLinear at one scale: the tensor the linears read."""
    scale = gs.Constant(f"{x.name}/fp8_scale", np.array(value, dtype=np.float16))
    zero = fp8_constant(f"{x.name}/fp8_zero", np.zeros((), np.float32))
    q = fp8_variable(f"{x.name}/q", x.shape)
    dq = gs.Variable(f"{x.name}/dq", dtype=x.dtype, shape=x.shape)
    graph.nodes[at:at] = [gs.Node("QuantizeLinear", f"{x.name}/quantize", inputs=[x, scale, zero], outputs=[q]),
                          gs.Node("DequantizeLinear", f"{x.name}/dequantize", inputs=[q, scale], outputs=[dq])]
    return dq
