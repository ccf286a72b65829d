"""scale_sandwich: keep every activation in the range the NPU's number formats hold, exactly in fp32.

Three forms, all sized from calibration samples (onnxruntime's ranges of every float tensor):

- mask clamps (int8 and mixed). Exporters write "minus infinity" into additive attention masks as -3.4e38 (the
  float32 minimum) or fill masked scores with it. In fp32 that is a zero after the softmax; in int8
  it is the per-tensor range of the scores, so every real score rounds to one step (the vendor's
  int8 of a trained BERT encoder: cosine 0.46-0.50, 0.86-0.87 with the constant at -30, measured).
  The fill is clamped to the smallest value that changes nothing after the softmax in fp32: below
  every calibrated score by MASK_MARGIN (exp(-32) = 1.3e-14, under fp32's rounding of a sum of ones).
- range rescales. Where a calibrated activation leaves the fp16 range the probe found
  (`add-magnitude`: x + x stays finite up to N = 32760 on toolkit 2.5.0, so 65520) over the
  profile's `fp16_range_margin` (4: the simulator may be kinder than the board), tensors
  are carried divided by powers of two: Conv/Gemm/MatMul with constant weights fold the factor into
  their weights and biases, positively homogeneous ops (ReLU, pooling, layout ops, constant Mul)
  pass it on, Add/Sub/Sum bring both sides to one factor, LayerNormalization absorbs it (epsilon
  divided by the factor squared), BatchNormalization in its constants (mean, scale and bias by
  powers of two), and any other op gets its true input back by a Mul. A model
  whose activations grow through the whole network gets a chain of factors, one per layer that
  needs a larger one. A graph output still carried scaled is multiplied back on the host (fp32), and so
  is the input of a Softmax that ends the model where its true values leave fp16 (the Softmax then
  runs on the host too).
- outlier splits (mixed). A trained transformer's linears read and write a few channels far past
  the rest (all-mpnet-base-v2: a LayerNorm output channel at 56 where the median channel reaches
  1.1, FFN outputs at 356 against 2.1). Per-tensor int8 of such a tensor leaves the other
  channels a few steps. Those channels move to small fp16 side linears and the int8 linear keeps
  the rest (split_outliers).

Not here: SmoothQuant-style smoothing of the int8 linears' inputs (a Mul dividing outlier channels
by powers of two, the weights' rows taking them back). Exact, and in numpy it halves the median
linear's input int8 error on all-mpnet-base-v2 (3.8 % -> 1.9 %), but the real build did not get
better: its first four layers fed the reference's tensors, linears int8 and the rest fp16, worst
cosine 0.780 without and 0.787 with (0.788 with the toolkit's Mul fusions disabled, which
otherwise fold half the Muls back into the linears). Nor a block Hadamard rotation of the int8
linears' inputs (QuaRot's idea: x @ W = (x @ R) @ (R^T @ W), R orthonormal in blocks of 64, the
rotation a Reshape, one 64 x 64 MatMul and a Reshape in fp16, on the NPU at 5.6 % of an FFN's
cycles). Exact, and the int8 replica on all-mpnet-base-v2 (after the outlier splits, every linear
not fed by a Reshape) reached 0.999 on the held-back sentences with 84-90 % of the linears' MACs
in int8 against 67 % unrotated; the simulator did not follow: mixed precision's rounds measured
0.99696 at 90.5 % int8, 0.99872 at 72.2 % and 0.99951 at 53.4 % (held back: worst 0.99928, 21.8 M
cycles), where without it 0.99935 at 53 % (worst 0.99920, 20.8 M cycles): the same share, more
cycles.

Every change is checked: the graph before and after runs in onnxruntime on the samples, and if an
output moves by more than fp32 rounding the pass undoes everything and says so.
"""

from __future__ import annotations

import math
from functools import partial

import numpy as np
import onnx_graphsurgeon as gs

from shard.calibration import calibration_samples, collect_stats, graph_stats, lifted, run_each, stats_cache
from shard.graph import float_ranks, tensor_spec, toposort
from shard.passes.context import PassContext
from shard.passes.fused import normalizations
from shard.precision import SIDE, is_int8_candidate

MASK_FLOOR = -1e4     # a value below this in a mask is the exporter's minus infinity, not a logit
MINUS_INFINITY = -1e30   # a value at or below this stands for -inf (masks), never for a range to keep
MASK_MARGIN = 32.0    # masked logits end this far below every calibrated score: exp(-32) = 1.3e-14
CLAMP = "/clamp"      # the name ending of a mask clamp's Max
CHECK_RTOL = 1e-5     # outputs may move by this, relative to their largest value (unfused onnxruntime)
# The powers of two a constant on the NPU can be: fp16 holds 2^-24 (its smallest step) to 2^15. A
# factor a tensor is carried at has no such cap where it passes through linear and ReLU-like ops alone
# (vgg19: 2^91, folded into each layer's weights a few powers at a time and multiplied back on the
# host in fp32); only the constants the NPU multiplies by, and the host's fp32, bound it.
FP16_POWERS = (-24, 15)
FP32_POWERS = (-126, 127)
# A tensor carried past its own need (its values shrank since the factor was taken) is renormalized
# where its held values would fall under safe / 2^HELD_SPAN (1.0 on RK3588: fp16 then keeps 14 powers of
# two of steps under its largest value): free at a linear (its weights take the factor back), a Mul
# before a product of two carried tensors (where factors would otherwise add up layer after layer).
HELD_SPAN = 14

WEIGHTED = ("Conv", "ConvTranspose", "Gemm", "MatMul")
PASS_THROUGH = ("Relu", "MaxPool", "AveragePool", "GlobalAveragePool", "GlobalMaxPool", "Reshape", "Transpose",
                "Flatten", "Squeeze", "Unsqueeze", "Slice", "Identity", "ReduceMean", "ReduceSum", "ReduceMax",
                "ReduceMin", "Split", "Expand", "Tile", "DepthToSpace", "SpaceToDepth", "LeakyRelu", "Resize",
                "Gather", "Concat", "Pad")
HOST_TAILS = ("Softmax", "LogSoftmax")   # a model's last op the host runs where its input leaves fp16
TO_SOFTMAX = ("Add", "Reshape", "Transpose", "Squeeze", "Unsqueeze", "Identity")


def scale_sandwich(graph: gs.Graph, ctx: PassContext) -> tuple[gs.Graph, dict]:

    safe = fp16_safe_absmax(ctx.profile)
    if safe is None:
        return graph, {"skipped": f"profile {ctx.profile.target} has no {FP16_RANGE} limit (a target computing in "
                                  f"fp32, or a profile probed before that family)"}
    samples = calibration_samples(ctx, [tensor_spec(t) for t in graph.inputs])
    model, weights = lifted(graph)
    channels = ctx.options.precision == "mixed"   # split_outliers and split_hidden read them; nothing else does
    try:
        stats = collect_stats(model, samples, ranks=float_ranks(graph), cache=stats_cache(ctx), weights=weights,
                              channels=channels)
    except Exception as exc:  # noqa: BLE001 - onnxruntime raises its own exception types
        return graph, {"skipped": f"onnxruntime cannot run the model to measure its ranges: "
                                  f"{str(exc).splitlines()[0][:200]}"}
    before = graph.copy()
    quantized = ctx.options.precision != "fp16"
    clamps = clamp_masks(graph, stats) if quantized else []   # fp16 holds the masks' -inf as it is
    if clamps:  # the ranges with the masks clamped (masked scores were -3.4e38 before)
        toposort(graph.cleanup())
        stats = graph_stats(graph, samples, cache=stats_cache(ctx), channels=channels)
    splits = split_outliers(graph, stats) if ctx.options.precision == "mixed" else []
    if splits:
        toposort(graph)
    candidates = set(ctx.host_candidates)
    try:
        rescaled, over = rescale_ranges(graph, stats, safe, ctx)
    except Unscalable as exc:
        ctx.host_candidates, ctx.scales = candidates, {}
        return before, {"changes": [], "samples": len(samples), "safe_absmax": safe,
                        "not_fixed": [{"node": exc.tensor, "op": "range rescale", "reason": str(exc),
                                       "action": "no range rescale made: the model is compiled as it came"}]}
    changes = clamps + splits + rescaled
    report = {"changes": changes, "not_fixed": over, "samples": len(samples), "safe_absmax": safe}
    if changes and not ctx.options.calib:
        ctx.warnings.append(f"scale_sandwich sized its {len(changes)} changes from seeded random inputs; "
                            "pass --calib with real samples to size them for real data")
    if not changes:
        return graph, report
    toposort(graph.cleanup())
    moved = largest_change((model, weights), lifted(graph), samples, [t.name for t in graph.outputs])
    report["max_relative_change"] = moved
    if moved > CHECK_RTOL:
        ctx.host_candidates -= {c["node"] for c in changes}
        ctx.scales.clear()
        return before, {**report, "changes": [], "undone": changes,
                        "not_fixed": over + [{"node": c["node"], "op": c["op"], "reason": c["reason"],
                                       "action": f"undone: the outputs moved by {moved:.2g} of their range in fp32"}
                                      for c in changes]}
    return graph, report


FP16_RANGE = "add-magnitude@r64"   # the probe family that finds the largest value the NPU's fp16 holds


def fp16_safe_absmax(profile) -> float | None:
    """The largest activation the sandwich lets through: the probed fp16 range (x + x is finite up
    to N = add-magnitude's limit, so 2N) over the profile's margin."""
    limit = profile.limits.get(FP16_RANGE)
    if limit is None or not limit.value:
        return None
    return 2.0 * limit.value / float(profile.facts.get("fp16_range_margin", 4.0))


def largest_change(before: tuple, after: tuple, samples: list, outputs: list[str]) -> float:
    """The largest change of an output over the samples, relative to that output's largest value;
    before and after: lifted models with their weights (shard.calibration.lifted)."""
    def run(model, weights):
        return run_each(model, [{**s, **weights} for s in samples], outputs, optimize=False)

    worst = 0.0
    for old, new in zip(run(*before), run(*after)):
        for name, value in old.items():
            a, b = np.asarray(value, np.float64), np.asarray(new[name], np.float64)
            if a.dtype.kind != "f" or not a.size:
                continue
            scale = max(float(np.max(np.abs(a))), 1e-30)
            with np.errstate(invalid="ignore"):
                diff = float(np.max(np.abs(a - b)))
            worst = max(worst, diff / scale if diff == diff else math.inf)
    return worst


# --- mask clamps -----------------------------------------------------------------------------

def lowest(tensor: gs.Tensor, stats: dict) -> float | None:
    if isinstance(tensor, gs.Constant):
        return float(tensor.values.min()) if tensor.values.size and tensor.values.dtype.kind == "f" else None
    return stats[tensor.name].min if tensor.name in stats else None


def score_span(tensor: gs.Tensor, stats: dict) -> float | None:
    if isinstance(tensor, gs.Constant):
        return float(np.ptp(tensor.values)) if tensor.values.size else 0.0
    return stats[tensor.name].max - stats[tensor.name].min if tensor.name in stats else None


def feeds_softmax(tensor: gs.Tensor, depth: int = 6) -> bool:
    """Does the tensor reach a Softmax through additions and layout ops only?"""
    for user in tensor.outputs:
        if user.op == "Softmax":
            return True
        if depth and user.op in TO_SOFTMAX and user.outputs and feeds_softmax(user.outputs[0], depth - 1):
            return True
    return False


def clamp_masks(graph: gs.Graph, stats: dict) -> list[dict]:
    """Clamp the minus-infinity of additive masks and masked fills before a Softmax."""
    floors: dict[str, tuple[float, list[tuple[gs.Node, int]]]] = {}
    tensors = {}
    for node in graph.nodes:
        if node.op not in ("Add", "Where") or not node.outputs or not feeds_softmax(node.outputs[0]):
            continue
        slots = (0, 1) if node.op == "Add" else (1, 2)
        for k in slots:
            mask, other = node.inputs[k], node.inputs[slots[1] if k == slots[0] else slots[0]]
            low, span = lowest(mask, stats), score_span(other, stats)
            if low is None or span is None or low >= MASK_FLOOR or (lowest(other, stats) or 0.0) < MASK_FLOOR:
                continue
            if node.op == "Add":   # masked logits: score + floor <= every real score - margin
                floor = -(span + MASK_MARGIN)
            else:                  # masked logits are the fill itself
                floor = stats[other.name].min - MASK_MARGIN if other.name in stats else None
                if floor is None:
                    continue
            floor = -float(2.0 ** math.ceil(math.log2(-floor))) if floor < 0 else floor
            old, users = floors.get(mask.name, (0.0, []))
            floors[mask.name] = (min(old, floor), [*users, (node, k)])
            tensors[mask.name] = mask
    changes = []
    for name, (floor, users) in floors.items():
        mask = tensors[name]
        if isinstance(mask, gs.Constant):
            clamped = gs.Constant(f"{name}/clamped", np.asarray(np.maximum(mask.values, mask.values.dtype.type(floor))))
        else:
            clamped = gs.Variable(f"{name}/clamped", dtype=mask.dtype, shape=mask.shape)
            graph.nodes.append(gs.Node("Max", name=f"{name}{CLAMP}", inputs=[
                mask, gs.Constant(f"{name}/floor", np.asarray(floor, np.dtype(mask.dtype or np.float32)))],
                outputs=[clamped]))
        for node, k in users:
            node.inputs[k] = clamped
        low = lowest(mask, {}) if isinstance(mask, gs.Constant) else stats[name].min
        changes.append({"node": users[0][0].name, "op": users[0][0].op, "form": "mask clamp", "tensor": name,
                        "reason": f"its mask {name} holds {low:.3g} (minus infinity to the model), which sets the "
                                  f"int8 range of the scores and is -inf in fp16",
                        "action": f"clamped at {floor:g}, {MASK_MARGIN:g} below every calibrated score "
                                  f"(no change after the softmax in fp32)",
                        "range_before": [low], "range_after": [floor], "users": [n.name for n, _ in users]})
    return changes


# --- outlier splits --------------------------------------------------------------------------

# A side of a linear (its input or its output) is split where one of its channels' calibrated absmax
# passes OUTLIER_TRIGGER medians; the split then takes every channel past OUTLIER_RATIO medians,
# MAX_OUTLIERS at most (the largest). all-mpnet-base-v2, the int8 replica with every linear in int8,
# 4 held-back sentences: 0.99747 taking what passes 4 medians (32 channels a side, ranges from 8
# sentences), 0.99803 taking what passes 2 (64 a side) and 0.99784 with the trigger at 4, ranges
# from 32 sentences; from 8, taking what passes 2 gave 0.99620 (ranges that narrow need more
# sentences to hold for unseen ones). The trigger keeps a tensor with no real outlier whole:
# SigLIP-512's random weights have channels past 2 medians and none past 4. The side linears'
# cycles go with the width of the tensors they add into, not with theirs.
OUTLIER_TRIGGER = 4.0
OUTLIER_RATIO = 2.0
MAX_OUTLIERS = 64


def outliers(absmax: np.ndarray) -> list[int]:
    """Where a channel's absmax passes OUTLIER_TRIGGER medians: the channels (at most MAX_OUTLIERS,
    the largest) past OUTLIER_RATIO medians; else none."""
    median = float(np.median(absmax)) if absmax.size else 0.0
    if median <= 0.0 or not absmax.max() > OUTLIER_TRIGGER * median:
        return []
    top = np.argsort(-absmax, kind="stable")[:MAX_OUTLIERS]
    return sorted(int(c) for c in top if absmax[c] > OUTLIER_RATIO * median)


def split_outliers(graph: gs.Graph, stats: dict) -> list[dict]:
    """Mixed precision's int8 linears, with the few channels that set a per-tensor int8 range moved
    to fp16. The vendor quantizes a linear's input and output per tensor, so one channel at 56 among
    channels near 1 (a trained encoder's LayerNorm, its FFN output) leaves the rest a few steps.

    For y = x @ W, with input outliers I and output outliers O (W: K x N), exactly in fp32:
      xi   = x @ S_I                  the channels I (S_I: K x |I| one-hot), fp16
      xm   = x - xi @ S_I^T           x with the channels I at zero: a Sub, as the vendor folds a
                                      constant Mul into W
      main = xm @ W'                  W' = W without rows I and columns O: int8, narrow in and out
      y    = main + xi @ W[I, :]' + (x @ W[:, O]) @ E_O     fp16 side linears (E_O puts the
                                      outputs at O; W[I, :]' without columns O)
    Measured on all-mpnet-base-v2's linears, the vendor's int8 fed fp16: output error 0.0735 -> 0.0130
    (layer 5's FFN in, input outliers), 0.178 -> 0.019 (layer 0's FFN out, both kinds).
    xi and xm are made once per input tensor, and xi always feeds a side linear as well: toolkit
    2.5.0 fuses a lone x @ S_I @ S_I^T into the Sub wrongly (the int8 linear then reads zeros;
    cosine 0.62 on that FFN in). The side linears are named with precision.SIDE, which keeps them
    fp16. Two linears joined by per-channel ops alone (an FFN) take the outliers of W1's output and
    of W2's input together first, in a hidden split (split_hidden): the channels I and O above are
    then what is left, the FFN's input and output."""
    changes, hidden = split_hidden(graph, stats)
    handled = {(c["node"], "out") for c in changes} | {(c["second"], "in") for c in changes}
    picked: dict[str, tuple[gs.Variable, gs.Variable]] = {}   # input tensor: (xi, xm)

    for node in list(graph.nodes):
        if not is_split_candidate(node):
            continue
        x, y = node.inputs[0], node.outputs[0]
        n_in, n_out = node.inputs[1].values.shape
        sx, sy = channel_stats(stats, x, n_in), channel_stats(stats, y, n_out)
        if sx is None or sy is None:
            continue
        ins = [] if (node.name, "in") in handled else outliers(sx.channel_absmax)
        outs = [] if (node.name, "out") in handled else outliers(sy.channel_absmax)
        if not ins and not outs:
            continue
        if ins and x.name not in picked:
            picked[x.name] = pick_channels(graph, x, ins, node.inputs[1].values, y.dtype)
        split_linear(graph, node, ins, outs, picked.get(x.name))
        changes.append(split_record(node, ins, outs, sx, sy))
    for side in hidden:   # after the per-linear splits: their side linears read the hidden sides' inputs
        side()
    return changes


def pick_channels(graph: gs.Graph, x: gs.Tensor, ins: list[int], w: np.ndarray,
                  out_dtype) -> tuple[gs.Variable, gs.Variable]:
    """(xi, xm) of split_outliers for the input x of a linear of weights w: its channels `ins` (a one-hot
    MatMul) and x with them at zero (a Sub of their scatter back)."""
    pick = np.zeros((w.shape[0], len(ins)), w.dtype)
    pick[ins, np.arange(len(ins))] = 1
    xi = gs.Variable(f"{x.name}{SIDE}in", dtype=out_dtype)
    back = gs.Variable(f"{x.name}{SIDE}in_back", dtype=out_dtype, shape=x.shape)
    xm = gs.Variable(f"{x.name}{SIDE}rest", dtype=out_dtype, shape=x.shape)
    graph.nodes += [matmul(f"{x.name}{SIDE}gather", x, pick, xi), matmul(f"{x.name}{SIDE}scatter", xi, pick.T, back),
                    gs.Node("Sub", name=f"{x.name}{SIDE}sub", inputs=[x, back], outputs=[xm])]
    return xi, xm


def split_linear(graph: gs.Graph, node: gs.Node, ins: list[int], outs: list[int],
                 picked: tuple[gs.Variable, gs.Variable] | None) -> None:
    """x @ W as the int8 linear of xm (or x) by W without rows `ins` and columns `outs`, plus the fp16
    side linears of those rows and columns (split_outliers' formula)."""
    x, weight, y = node.inputs[0], node.inputs[1], node.outputs[0]
    w = weight.values
    var = lambda name, shape=None: gs.Variable(name, dtype=y.dtype, shape=shape)  # noqa: E731
    rest = w.copy()
    rest[ins, :] = 0
    rest[:, outs] = 0
    node.inputs = [picked[1] if ins else x, gs.Constant(f"{weight.name}{SIDE}rest", rest)]
    total = node.outputs[0] = var(f"{y.name}{SIDE}main", y.shape)
    parts = []
    if ins:
        rows = w[ins, :].copy()
        rows[:, outs] = 0
        parts.append((f"{node.name}{SIDE}in", [(picked[0], rows)]))
    if outs:
        place = np.zeros((len(outs), w.shape[1]), w.dtype)
        place[np.arange(len(outs)), outs] = 1
        parts.append((f"{node.name}{SIDE}out", [(x, w[:, outs]), (None, place)]))
    add_side_linears(graph, parts, total, y, var)


def split_record(node: gs.Node, ins: list[int], outs: list[int], sx, sy) -> dict:
    """The report's record of one outlier split."""
    rest_in = float(np.delete(sx.channel_absmax, ins).max()) if ins else None
    named = [f"{side} channels {channels} (up to {s.channel_absmax.max():.3g})"
             for side, channels, s in (("input", ins, sx), ("output", outs, sy)) if channels]
    return {"node": node.name, "op": node.op, "form": "outlier split", "input_channels": ins, "output_channels": outs,
            "reason": f"{' and '.join(named)} pass {OUTLIER_RATIO:g} times their tensor's median channel: "
                      f"they would set the per-tensor int8 ranges",
            "action": "they run in fp16 side linears" + (f"; the int8 linear's input reaches {rest_in:.3g}" if ins else ""),
            "range_before": [sx.absmax, sy.absmax], "input_range_after": rest_in}


def channel_stats(stats: dict, tensor: gs.Tensor, width: int):
    """The tensor's statistics where they hold one absolute maximum for each of its `width` channels."""
    found = stats.get(tensor.name)
    return found if found is not None and found.channel_absmax.size == width else None


def is_split_candidate(node: gs.Node) -> bool:

    return node.op == "MatMul" and is_int8_candidate(node) and node.inputs[1].values.ndim == 2


def matmul(name: str, x: gs.Tensor, w: np.ndarray, out: gs.Variable) -> gs.Node:
    return gs.Node("MatMul", name=name, inputs=[x, gs.Constant(f"{name}/w", np.ascontiguousarray(w))], outputs=[out])


# Ops that act on each channel alone: between two linears (an FFN's activation), a channel of the
# first's output reaches only the same channel of the second's input.
PER_CHANNEL = ("Add", "Sub", "Mul", "Div", "Erf", "Tanh", "Relu", "Sigmoid", "Gelu", "Pow", "Sqrt", "Exp", "Neg",
               "Abs", "LeakyRelu", "HardSigmoid", "HardSwish", "Softplus", "Identity")
MAX_BETWEEN = 16   # ops of the activation between the linears of a hidden split (an exported GELU: 5)


def between(graph: gs.Graph, first: gs.Node, width: int,
            order: dict[int, int]) -> tuple[gs.Node | None, list[gs.Node], gs.Node] | None:
    """What joins `first` (a linear with `width` output channels) to the next linear where nothing
    but per-channel ops lie between: (its bias, a constant Add, or None; the ops between, in graph
    order, which `order` gives by node id; the second linear). None where anything else reads a
    tensor on the way, or the second linear reads anything but the last of them."""
    def per_channel(t: gs.Tensor) -> bool:
        return isinstance(t, gs.Constant) and (t.values.size == 1 or t.values.size == width == t.values.shape[-1])

    y, bias = first.outputs[0], None
    users = list(y.outputs)
    if len(users) == 1 and users[0].op == "Add" and sum(per_channel(t) for t in users[0].inputs) == 1:
        bias = users[0]
        y = bias.outputs[0]
    outputs = {t.name for t in graph.outputs}
    if first.outputs[0].name in outputs:
        return None
    region, seen, inside, frontier, second = [], set(), {y.name}, [y], None
    while frontier:
        t = frontier.pop()
        if t.name in outputs:
            return None
        for user in t.outputs:
            if id(user) in seen:
                continue
            if is_split_candidate(user) and user.inputs[0] is t and user.inputs[1].values.shape[0] == width:
                if second is not None and second is not user:
                    return None
                second = user
                continue
            if user.op not in PER_CHANNEL or len(region) == MAX_BETWEEN or len(user.outputs) != 1:
                return None
            seen.add(id(user))
            region.append(user)
            inside.add(user.outputs[0].name)
            frontier.append(user.outputs[0])
    if second is None or not all(i.name in inside or per_channel(i) for n in region for i in n.inputs if i.name):
        return None
    region.sort(key=lambda n: order[id(n)])
    # one way out: every op's output read (by the ops between, or by the second linear as the last)
    if second.inputs[0] is not (region[-1].outputs[0] if region else y) or any(
            not n.outputs[0].outputs or any(u is not second and id(u) not in seen for u in n.outputs[0].outputs)
            for n in region):
        return None
    return bias, region, second


def split_hidden(graph: gs.Graph, stats: dict) -> tuple[list[dict], list]:
    """Two linears joined only by per-channel ops (an FFN: x @ W1 + b1, GELU, @ W2) whose hidden
    channels hold outliers, in W1's output or W2's input: those channels J move to an fp16 side FFN,
    exactly in fp32,
      FFN(x) = sum over channels j of f(x @ W1[:, j] + b1[j]) W2[j, :]
             = main(x) (W1, b1 without J; W2 without rows J: int8, narrow ranges) + side(x) (J, fp16).
    The per-linear split of the same channels would add a MatMul that picks them out of the hidden
    tensor, one that puts them back and one that places W1's outlier outputs; the side FFN holds
    |J| x 2 x d MACs a token (all-mpnet-base-v2: side linears 12.0 % of the model's MACs split one by
    one, 7.2 % with the FFNs split this way). Returns the changes (W1's output and W2's input, which
    the per-linear splits then leave) and for each the step that adds its side FFN, run after the
    per-linear splits (whose side linears then read the main path)."""
    changes, steps, taken = [], [], set()   # taken: one split a linear (a chain of MLPs: every other pair)
    order = {id(n): k for k, n in enumerate(graph.nodes)}
    for first in [n for n in graph.nodes if is_split_candidate(n)]:
        width = first.inputs[1].values.shape[1]
        found = None if first.name in taken else between(graph, first, width, order)
        if found is None or found[2].name in taken:
            continue
        bias, region, second = found
        sy, sx = channel_stats(stats, first.outputs[0], width), channel_stats(stats, second.inputs[0], width)
        if sy is None or sx is None:
            continue
        hidden = sorted(set(outliers(sy.channel_absmax)) | set(outliers(sx.channel_absmax)))
        if not hidden:
            continue
        w1, w2 = first.inputs[1].values, second.inputs[1].values
        b = None
        if bias is not None:
            k = next(i for i, t in enumerate(bias.inputs) if isinstance(t, gs.Constant))
            given = bias.inputs[k].values
            b = np.broadcast_to(given, (width,)).astype(given.dtype)
            main_b = b.copy()
            main_b[hidden] = 0
            bias.inputs[k] = gs.Constant(f"{bias.name}{SIDE}main/b", main_b.reshape(given.shape if given.size == width
                                                                                     else (width,)))
        main_w1, main_w2 = w1.copy(), w2.copy()
        main_w1[:, hidden] = 0
        main_w2[hidden, :] = 0
        first.inputs[1] = gs.Constant(f"{first.inputs[1].name}{SIDE}main", main_w1)
        second.inputs[1] = gs.Constant(f"{second.inputs[1].name}{SIDE}main", main_w2)
        start = (first if bias is None else bias).outputs[0]
        steps.append(partial(side_ffn, graph, first, second, first.inputs[0], start, region, hidden, w1[:, hidden],
                             None if b is None else b[hidden], w2[hidden, :], second.outputs[0]))
        taken |= {first.name, second.name}
        changes.append({"node": first.name, "op": first.op, "form": "hidden split", "hidden_channels": hidden,
                        "second": second.name, "between": [n.op for n in region],
                        "reason": f"hidden channels {hidden} (up to {max(sy.channel_absmax.max(), sx.channel_absmax.max()):.3g}) "
                                  f"pass {OUTLIER_RATIO:g} times their tensor's median channel: they would set the "
                                  f"per-tensor int8 ranges of both linears",
                        "action": f"they run in an fp16 side copy of {first.name} -> {second.name}",
                        "range_before": [sy.absmax, sx.absmax]})
    return changes, steps


def side_ffn(graph: gs.Graph, first: gs.Node, second: gs.Node, x: gs.Tensor, start: gs.Tensor, region: list[gs.Node],
             hidden: list[int], w1: np.ndarray, b: np.ndarray | None, w2: np.ndarray, y: gs.Variable) -> None:
    """x @ w1 (+ b), the ops between (from `start`) on the hidden channels, @ w2, added into y (the
    second linear's whole output). The side's ops go in one block right before the second linear:
    the vendor fuses an activation by walking the nodes in order, and with the two GELUs' ops
    interleaved it fused neither (all-mpnet-base-v2: every Erf on the CPU)."""
    name = f"{first.name}{SIDE}hidden"
    var = lambda suffix: gs.Variable(f"{name}/{suffix}", dtype=start.dtype)  # noqa: E731
    value = var("in")
    block = [matmul(f"{name}/in", x, w1, value)]
    if b is not None:
        biased = var("b")
        block.append(gs.Node("Add", name=f"{name}/b", inputs=[value, gs.Constant(f"{name}/b/c", b)], outputs=[biased]))
        value = biased
    copies = {start.name: value}
    for k, node in enumerate(region):
        inputs = [copies[t.name] if t.name in copies else t if t.values.size == 1
                  else gs.Constant(f"{name}/between/{k}/c", np.ascontiguousarray(t.values[..., hidden])) for t in node.inputs]
        out = var(f"between/{k}")
        block.append(gs.Node(node.op, name=f"{name}/between/{k}", attrs=dict(node.attrs), inputs=inputs, outputs=[out]))
        copies[node.outputs[0].name] = out
    side = var("out")
    block.append(matmul(f"{second.name}{SIDE}hidden/out", copies[region[-1].outputs[0].name if region else start.name],
                        w2, side))
    at = next(k for k, n in enumerate(graph.nodes) if n is second)
    graph.nodes[at:at] = block
    total = gs.Variable(f"{y.name}{SIDE}before_hidden", dtype=y.dtype, shape=y.shape)
    y.inputs[0].outputs[0] = total
    graph.nodes.append(gs.Node("Add", name=f"{second.name}{SIDE}hidden/add", inputs=[total, side], outputs=[y]))


# --- range rescales ----------------------------------------------------------------------------

def needed(tensor: gs.Tensor, stats: dict, safe: float) -> int:
    """The power of two a tensor must be divided by to stay under `safe` (0: none)."""
    s = stats.get(tensor.name)
    if s is None:
        return 0
    # A mask's minus infinity (-3.4e38, -1e30...) is meant to saturate: -inf in fp16 is its value.
    absmax = max(abs(s.max), abs(s.min) if s.min > MINUS_INFINITY else 0.0)
    if not math.isfinite(absmax) or absmax <= safe:
        return 0
    return math.ceil(math.log2(absmax / safe))


def is_float(tensor: gs.Tensor) -> bool:
    return tensor.dtype is not None and np.dtype(tensor.dtype).kind == "f"


def scaled(graph: gs.Graph, tensor: gs.Tensor, k: int, where: str, on_host: bool = False) -> gs.Variable:
    """A Mul by 2^-k of `tensor` (k < 0 multiplies back up): on the NPU 2^-k must be a number fp16 holds,
    on the host (`on_host`) one fp32 holds."""
    low, high = FP32_POWERS if on_host else FP16_POWERS
    if not low <= -k <= high:
        raise Unscalable(tensor.name, f"would need a Mul by 2^{-k} on the {'host' if on_host else 'NPU'}, past "
                                      f"what {'fp32' if on_host else 'fp16'} holds (2^{low} to 2^{high})")
    out = gs.Variable(f"{tensor.name}/x2^{-k}", dtype=tensor.dtype, shape=tensor.shape)
    graph.nodes.append(gs.Node("Mul", name=f"{where}/x2^{-k}", inputs=[
        tensor, gs.Constant(f"{where}/x2^{-k}/factor", np.asarray(2.0 ** -k, np.dtype(tensor.dtype or np.float32)))],
        outputs=[out]))
    return out


def add_side_linears(graph: gs.Graph, parts: list, total: gs.Variable, y: gs.Variable, var) -> None:
    """y = total + each part, a part being a chain of constant matmuls [(source or None: the link
    before, matrix)] named by its name."""
    for k, (name, chain) in enumerate(parts):
        value = None
        for j, (source, m) in enumerate(chain):
            out = var(f"{name}/{j}")
            graph.nodes.append(matmul(f"{name}/{j}", source if source is not None else value, m, out))
            value = out
        added = y if k == len(parts) - 1 else var(f"{name}/sum", y.shape)
        graph.nodes.append(gs.Node("Add", name=f"{name}/add", inputs=[total, value], outputs=[added]))
        total = added


def rescale_ranges(graph: gs.Graph, stats: dict, safe: float, ctx: PassContext) -> tuple[list[dict], list[dict]]:
    """Carry tensors divided by 2^k where a calibrated activation leaves the safe fp16 range: the
    changes, and what no factor could keep in range."""
    if not any(needed(t, stats, safe) for t in graph.tensors().values() if isinstance(t, gs.Variable)):
        return [], []
    return Rescaler(graph, stats, safe, ctx).run()


JOINS = ("Add", "Sub", "Max", "Min", "Concat", "Sum")          # every side at one factor
ELEMENTWISE = ("Add", "Sub", "Clip", "Max", "Min", "Mul", "Div")   # with one variable input
WITH_CONSTANTS = ("Add", "Sub", "Clip", "Max", "Min")          # their constants move with the data


class Rescaler:
    """rescale_ranges' walk over the graph in order: `k` holds each tensor's factor (held / 2^k), and
    each node either carries its inputs' factors on (homogeneous ops, weights and constants scaled by
    powers of two: exact) or gets its inputs back at their true scale."""

    def __init__(self, graph: gs.Graph, stats: dict, safe: float, ctx: PassContext):
        self.graph, self.stats, self.safe, self.ctx = graph, stats, safe, ctx
        self.k: dict[str, int] = {}
        self.changes: list[dict] = []
        self.over: list[dict] = []
        # A normalization written out is scale-invariant: x held / 2^k needs its epsilon / 4^k, and what
        # it makes carries no factor (as LayerNormalization). Its own tensors (x^2) are the fused op's.
        self.norms = {id(n): norm for norm in normalizations(graph) for n in norm.nodes}

    def run(self) -> tuple[list[dict], list[dict]]:
        for node in list(self.graph.nodes):
            self.visit(node)
        self.ctx.scales.update({name: (name, v) for name, v in self.k.items() if v})
        for out in list(self.graph.outputs):
            if self.k.get(out.name):
                self.changes.append(restore_output(self.graph, out, self.k[out.name], self.ctx))
        self.over += [{"node": t.inputs[0].name, "op": t.inputs[0].op, "tensor": t.name,
                       "reason": f"{t.name} reaches {self.stats[t.name].absmax:.3g}, over the fp16 range "
                                 f"({self.safe:g} with the profile's margin)",
                       "action": "no factor can be folded into the op that makes it; it may overflow"}
                      for t in self.graph.tensors().values() if isinstance(t, gs.Variable) and t.inputs
                      and id(t.inputs[0]) not in self.norms and self.needed(t) > self.k.get(t.name, 0)
                      and not all(u.op == "Max" and u.name.endswith(CLAMP) for u in t.outputs)]
        return self.changes, self.over

    def needed(self, tensor: gs.Tensor) -> int:
        return needed(tensor, self.stats, self.safe)

    def visit(self, node: gs.Node) -> None:
        variables = [(i, t) for i, t in enumerate(node.inputs) if isinstance(t, gs.Variable) and t.name]
        ks = {i: self.k.get(t.name, 0) for i, t in variables}
        if id(node) in self.norms:
            return self.normalization(node, self.norms[id(node)])
        outs = [t for t in node.outputs if t.name]
        weight = node.inputs[1] if node.op in WEIGHTED and len(node.inputs) > 1 else None
        if node.op in WEIGHTED and isinstance(weight, gs.Constant) and len(variables) == 1 and variables[0][0] == 0:
            return self.weighted(node, weight, ks[0], outs)
        want = max((self.needed(t) for t in outs), default=0)   # what its own output needs
        if not any(ks.values()) and not want:
            return
        single = variables[0] if len(variables) == 1 and is_float(variables[0][1]) else None
        floats = all(is_float(t) for _, t in variables)
        if node.op in JOINS and len(variables) >= 2 and floats:
            self.joined(node, variables, ks, want, outs)
        elif single and node.op == "Div" and single[0] == 1:   # c / x carries the inverse factor
            self.k[outs[0].name] = -ks[1]
        elif single and (node.op in ELEMENTWISE or node.op in PASS_THROUGH):
            self.elementwise(node, single, variables, ks, want, outs)
        elif node.op in ("Mul", "MatMul", "Div") and len(variables) == 2 and floats:
            self.product(node, variables, ks, want, outs[0])
        elif node.op == "BatchNormalization" and len(variables) == 1 and variables[0][0] == 0 \
                and all(isinstance(c, gs.Constant) for c in node.inputs[1:5]) and len(outs) == 1:
            self.batch_normalization(node, ks[0], want, outs[0])
        elif node.op == "LayerNormalization" and variables[0][0] == 0 and len(variables) == 1:
            if ks[0]:
                node.attrs["epsilon"] = float(node.attrs.get("epsilon", 1e-5)) * 4.0 ** -ks[0]
        else:
            self.restore_inputs(node, variables, ks)

    def most(self, tensor: gs.Tensor) -> float:
        """The largest factor `tensor` can be held at with its largest value at or over safe / 2^HELD_SPAN."""
        s = self.stats.get(tensor.name)
        if s is None or not s.absmax or not math.isfinite(s.absmax):
            return math.inf
        return math.floor(math.log2(s.absmax * 2.0 ** HELD_SPAN / self.safe))

    def product(self, node: gs.Node, variables: list, ks: dict, want: int, out: gs.Tensor) -> None:
        """x * y (or x @ y, x / y) of two variables carries both factors: where that sum is past what the
        product's own values can be held at, the inputs carrying more than they need are multiplied back
        up first (a Mul each), so factors never compound through chains of products."""
        sign = -1 if node.op == "Div" else 1
        carried = ks[0] + sign * ks[1]
        if want > carried:  # the product itself leaves the range: the first operand takes more
            self.scale_down(node, 0, node.inputs[0], want - carried, want)
            self.k[out.name] = want
            return
        self.k[out.name] = carried
        if carried <= self.most(out) or sign < 0:
            return
        target, before = max(want, sum(self.needed(t) for _, t in variables)), dict(ks)
        made: dict[tuple[str, int], gs.Variable] = {}   # x * x: one Mul
        for i, t in variables:
            back = min(ks[i] - self.needed(t), carried - target)
            if back > 0:
                if (t.name, back) not in made:
                    made[t.name, back] = scaled(self.graph, t, -back, f"{node.name}/in{i}")
                node.inputs[i] = made[t.name, back]
                ks[i], carried = ks[i] - back, carried - back
        self.k[out.name] = carried
        names = " and ".join(f"{t.name} (held divided by 2^{before[i]})" for i, t in variables)
        self.changes.append({"node": node.name, "op": node.op, "form": "range",
                             "reason": f"its inputs {names} would make a product held divided by "
                                       f"2^{before[0] + before[1]}, far under fp16's steps",
                             "action": f"renormalized before the product (its inputs multiplied back up to "
                                       f"2^{ks[0]} and 2^{ks[1]}), its output held divided by 2^{carried}",
                             "factor": 2.0 ** carried})

    def normalization(self, node: gs.Node, norm) -> None:
        kx = self.k.get(norm.input.name, 0)
        if norm.eps and norm.eps[0] is node and kx:
            node.inputs[norm.eps[1]] = times(node.inputs[norm.eps[1]], -2 * kx)

    def weighted(self, node: gs.Node, weight: gs.Constant, kx: int, outs: list) -> None:
        """A linear with a constant weight: the weight (and bias) carry the factor change."""
        ky = max(kx, self.needed(outs[0])) if outs else kx
        if outs and ky > self.most(outs[0]):   # its values shrank: the weights take the excess back,
            top = largest(weight)   # as far as fp16 holds them
            room = math.floor(math.log2(float(np.finfo(np.float16).max) / top)) if top else ky
            ky = min(ky, max(self.needed(outs[0]), int(self.most(outs[0])), kx - room))
        if not (kx or ky):
            return
        node.inputs[1] = fp16_weights(times(weight, kx - ky), weight, node.name)
        if len(node.inputs) > 2 and isinstance(node.inputs[2], gs.Constant):
            node.inputs[2] = times(node.inputs[2], -ky)
        self.k[outs[0].name] = ky
        if ky != kx:
            self.held(node, outs[0], ky, f"its weights carry 2^{kx - ky}")

    def joined(self, node: gs.Node, variables: list, ks: dict, want: int, outs: list) -> None:
        top = max(*ks.values(), want)       # every side at one factor, large enough for the result
        for i, t in variables:
            if ks[i] < top:
                self.scale_down(node, i, t, top - ks[i], top)
        self.k[outs[0].name] = top

    def elementwise(self, node: gs.Node, single: tuple, variables: list, ks: dict, want: int, outs: list) -> None:
        if node.op == "Pad" and len(node.inputs) > 2 and isinstance(node.inputs[2], gs.Constant) \
                and np.any(node.inputs[2].values):
            return self.restore_inputs(node, variables, ks)
        i, t = single
        kx = max(ks[i], want)
        if kx > ks[i]:
            self.scale_down(node, i, t, kx - ks[i], kx)
        if node.op in WITH_CONSTANTS:
            for j, c in enumerate(node.inputs):
                if isinstance(c, gs.Constant) and c.values.dtype.kind == "f":
                    node.inputs[j] = times(c, -kx)
        for t in outs:
            self.k[t.name] = kx

    def batch_normalization(self, node: gs.Node, kx: int, want: int, out: gs.Tensor) -> None:
        # gamma (x - mean) / sqrt(var + eps) + beta, with x held / 2^kx and y / 2^ky: mean / 2^kx,
        # gamma * 2^(kx - ky), beta / 2^ky (powers of two: exact).
        ky = max(kx, want)
        for j, e in ((1, kx - ky), (2, -ky), (3, -kx)):
            if e:
                node.inputs[j] = times(node.inputs[j], e)
        self.k[out.name] = ky
        if ky != kx:
            self.held(node, out, ky, f"its scale carries 2^{kx - ky} and its bias 2^{-ky}")

    def restore_inputs(self, node: gs.Node, variables: list, ks: dict) -> None:
        """Give a node its inputs at their true scale (a Mul by 2^k before it); where the true value
        is itself past the range, the model's last Softmax runs on the host in fp32 (with the Mul), and
        otherwise the report says so."""
        for i, t in variables:
            if not ks[i]:
                continue
            tail = to_output(node, self.graph) if node.op in HOST_TAILS and len(variables) == 1 \
                and self.needed(t) else None
            node.inputs[i] = scaled(self.graph, t, -ks[i], f"{node.name}/in{i}", on_host=tail is not None)
            if not self.needed(t):
                continue
            past = (f"it takes {t.name}, which reaches {self.stats[t.name].absmax:.3g}, over the fp16 range "
                    f"({self.safe:g} with the profile's margin)")
            if tail is not None:
                self.ctx.host_candidates.update({node.name, node.inputs[i].inputs[0].name, *tail})
                self.changes.append({"node": node.name, "op": node.op, "form": "range",
                                     "reason": f"{past}, and ends the model",
                                     "action": f"it runs on the host in fp32 after the shards, its input multiplied "
                                               f"back by 2^{ks[i]} there", "factor": 1.0})
            else:
                self.over.append({"node": node.name, "op": node.op, "tensor": node.inputs[i].name,
                                  "reason": f"{past}, at its true scale",
                                  "action": f"{node.op} is not homogeneous, so no factor can pass it; it may overflow"})

    def held(self, node: gs.Node, out: gs.Tensor, total: int, how: str) -> None:
        """Report that `out` is now held divided by 2^total, `how` (what the node carries for it)."""
        s = self.stats[out.name]
        self.changes.append({"node": node.name, "op": node.op, "form": "range",
                             "reason": f"{out.name} reaches {s.absmax:.3g}, over the fp16 range ({self.safe:g} with "
                                       f"the profile's margin)", "action": f"{how}, its output is held divided by 2^{total}",
                             "factor": 2.0 ** total, "range_before": [s.min, s.max],
                             "range_after": [s.min / 2.0 ** total, s.max / 2.0 ** total]})

    def scale_down(self, node: gs.Node, i: int, t: gs.Tensor, e: int, total: int) -> None:
        """A Mul by 2^-e before input i, so that the node works at a factor 2^total."""
        node.inputs[i] = scaled(self.graph, t, e, f"{node.name}/in{i}")
        if self.needed(node.outputs[0]):
            self.held(node, node.outputs[0], total, f"its input {t.name} is divided by 2^{e} before it (a Mul)")


def times(c: gs.Constant, e: int) -> gs.Constant:
    """A constant times 2^e (exact)."""
    return gs.Constant(f"{c.name}/x2^{e}", np.asarray(c.values * c.values.dtype.type(2.0 ** e)))


class Unscalable(Exception):
    """A factor no constant can carry (past fp16 on the NPU, past fp32 on the host); the pass leaves the
    graph as it was."""

    def __init__(self, tensor: str, why: str):
        super().__init__(f"{tensor} {why}")
        self.tensor = tensor


def fp16_weights(scaled_weight: gs.Constant, weight: gs.Constant, node: str) -> gs.Constant:
    """A linear's weights times a power of two, where fp16 still holds their largest value (neither inf
    nor under its smallest step) as it held the weights before."""
    low, high = 2.0 ** FP16_POWERS[0], float(np.finfo(np.float16).max)
    if low <= largest(weight) <= high and not low <= largest(scaled_weight) <= high:
        raise Unscalable(node, f"would need its weights times a power of two that takes their largest value to "
                               f"{largest(scaled_weight):.3g}, past what fp16 holds")
    return scaled_weight


def largest(c: gs.Constant) -> float:
    """A constant's largest magnitude (0 for an empty one)."""
    return float(np.max(np.abs(c.values))) if c.values.size else 0.0


def to_output(node: gs.Node, graph: gs.Graph) -> list[str] | None:
    """The names of the layout ops (Reshape, Transpose: the version converter wraps an opset-9 Softmax
    in them) between a node and the graph output it ends in, where it ends in one alone; else None."""
    chain = []
    while len(node.outputs) == 1 and node.outputs[0] not in graph.outputs:
        users = node.outputs[0].outputs
        if len(users) != 1 or users[0].op not in ("Reshape", "Transpose"):
            return None
        node = users[0]
        chain.append(node.name)
    return chain if len(node.outputs) == 1 and not node.outputs[0].outputs else None


def restore_output(graph: gs.Graph, out: gs.Variable, k: int, ctx: PassContext) -> dict:
    """A graph output carried divided by 2^k: the NPU side ends at the scaled tensor, and a Mul
    marked for the host (fp32) gives back the true values under the output's own name."""
    if not FP32_POWERS[0] <= k <= FP32_POWERS[1]:
        raise Unscalable(out.name, f"would be held divided by 2^{k}, past what the host's fp32 multiplies back")
    held = gs.Variable(f"{out.name}/x2^{-k}", dtype=out.dtype, shape=out.shape)
    ctx.scales[held.name] = (out.name, k)
    for user in list(out.outputs):   # ops inside the graph took it scaled already
        user.inputs[user.inputs.index(out)] = held
    producer = out.inputs[0]
    producer.outputs[producer.outputs.index(out)] = held
    name = f"{out.name}/restore"
    graph.nodes.append(gs.Node("Mul", name=name, inputs=[
        held, gs.Constant(f"{name}/factor", np.asarray(2.0 ** k, np.dtype(out.dtype or np.float32)))], outputs=[out]))
    ctx.host_candidates.add(name)
    return {"node": name, "op": "Mul", "form": "range", "reason": f"output {out.name} is held divided by 2^{k}",
            "action": f"multiplied back by 2^{k} on the host, in fp32", "factor": 2.0 ** k}
