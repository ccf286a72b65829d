"""legalize: split every op that breaks a limit along an axis where the pieces are independent, and
join the results; the graph computes exactly what it did (slicing and concatenating are exact).

Which axes are safe, per op:
  elementwise and unary ops   any output axis (broadcast inputs are passed whole)
  Softmax, LayerNormalization any axis but the normalised ones
  MatMul                      M (rows of A), N (columns of B), batch axes
  Transpose                   any output axis (the matching input axis is sliced)
  Concat                      any axis but the concatenated one
  Slice                       any axis it does not slice
  Gather                      any output axis of its data's (the indices are passed whole)
  Reshape                     the leading axes it keeps as they are (the target shape is rewritten)
Where no such split fits, the reduced axis: MatMul's K as partial products summed, Softmax's own
axis in two passes (max and sum over the pieces, then exp(x - max) / sum per piece).
The piece count is the smallest that makes one piece fit (checked by ctx.legality). Where no one
split fits (a MatMul too wide in M, K and N), a first split is chosen after which a piece can be made
to fit by further splits (up to three axes), and the pieces are legalized in turn. The Slices and
Concats are marked for the host: where they sit at the model's edges, host_edges moves them to the
runtime, since an oversize tensor at a shard's edge cannot be split on the NPU. A Slice that takes
back exactly one piece of a Concat is folded away, so chains of split ops stay split.
"""

from __future__ import annotations

import math

import numpy as np
import onnx_graphsurgeon as gs

from shard.graph import replace_uses
from shard.passes.context import PassContext
from shard.passes.fit import OpSpec, Verdict
from shard.passes.rewrite import Rewriter

ELEMENTWISE = {"Add", "Sub", "Mul", "Div", "Pow", "Max", "Min", "Where", "Equal", "Less", "Greater", "And", "Or",
               "Relu", "Sigmoid", "Tanh", "Exp", "Log", "Erf", "Sqrt", "Reciprocal", "Neg", "Abs", "Clip",
               "LeakyRelu", "HardSigmoid", "HardSwish", "Gelu", "Softplus", "Cast", "Sin", "Cos"}
CHECKED = ELEMENTWISE | {"Softmax", "LayerNormalization", "MatMul", "Transpose", "Concat", "Slice", "Reshape", "Gather"}
MAX_PIECES = 64
NESTED_DEPTH = 2   # splits of splits: three axes at most


def checked(node: gs.Node) -> bool:
    """Whether legalize checks the node: a Gather only where it selects rows of an activation by
    constant indices (a lookup in a constant table is the host's, host_edges)."""
    return node.op in CHECKED and (node.op != "Gather" or isinstance(node.inputs[0], gs.Variable)
                                   and isinstance(node.inputs[1], gs.Constant))


def split_axes(node: gs.Node) -> list[int]:
    """Output axes along which the node splits into independent pieces, the last axis first."""
    rank = len(node.outputs[0].shape)
    if node.op in ELEMENTWISE:
        axes = range(rank)
    elif node.op == "Softmax":
        axes = [a for a in range(rank) if a != node.attrs.get("axis", -1) % rank]
    elif node.op == "LayerNormalization":
        axes = range(node.attrs.get("axis", -1) % rank)
    elif node.op == "MatMul" and rank >= 2 and all(len(t.shape) >= 2 for t in node.inputs):
        axes = range(rank)
    elif node.op == "Transpose":
        axes = range(rank)
    elif node.op == "Concat":
        axes = [a for a in range(rank) if a != node.attrs["axis"] % rank]
    elif node.op == "Slice" and all(isinstance(t, gs.Constant) for t in node.inputs[1:]):
        axes = [a for a in range(rank) if a not in sliced_axes(node)]
    elif node.op == "Gather" and isinstance(node.inputs[1], gs.Constant):   # rows of an activation
        axes = [a for a in range(rank) if gathered_axis(node, a) is not None]
    elif node.op == "Reshape" and isinstance(node.inputs[1], gs.Constant):
        src = list(node.inputs[0].shape)
        axes = [a for a in range(min(rank, len(src))) if src[:a + 1] == list(node.outputs[0].shape[:a + 1])]
    else:
        return []
    return sorted(axes, reverse=True)


def sliced_axes(node: gs.Node) -> set[int]:
    rank = len(node.inputs[0].shape)
    starts = node.inputs[1].values.ravel()
    axes = node.inputs[3].values.ravel() if len(node.inputs) > 3 else range(len(starts))
    return {int(a) % rank for a in axes}


def gathered_axis(node: gs.Node, out_axis: int) -> int | None:
    """The data axis of a Gather's output axis; None for the axes its indices make."""
    axis = node.attrs.get("axis", 0) % len(node.inputs[0].shape)
    made = len(node.inputs[1].shape)
    if out_axis < axis:
        return out_axis
    return None if out_axis < axis + made else out_axis - made + 1


def input_axis(node: gs.Node, k: int, out_axis: int) -> int | None:
    """The axis of input k to slice for a split along `out_axis`; None: the input is passed whole."""
    out_rank = len(node.outputs[0].shape)
    shape = list(node.inputs[k].shape)
    if node.op == "Transpose":
        return node.attrs["perm"][out_axis]
    if node.op == "Gather":
        return gathered_axis(node, out_axis) if k == 0 else None
    if node.op in ("Slice", "Reshape"):  # the parameters are passed whole (Reshape's shape is rewritten)
        return out_axis if k == 0 else None
    if node.op == "MatMul":
        if out_axis == out_rank - 2:
            return len(shape) - 2 if k == 0 else None
        if out_axis == out_rank - 1:
            return len(shape) - 1 if k == 1 else None
    axis = out_axis - (out_rank - len(shape))  # numpy broadcasting aligns the right ends
    if axis < 0 or shape[axis] == 1:
        return None
    return axis


def piece_spec(node: gs.Node, out_axis: int, start: int, stop: int) -> OpSpec:
    """The OpSpec of one piece [start, stop) of the node along out_axis."""
    spec = OpSpec.of(node)
    inputs = []
    for k, (shape, value) in enumerate(spec.inputs):
        axis = input_axis(node, k, out_axis) if shape is not None else None   # None: an omitted input
        if axis is not None:
            shape = shape[:axis] + [stop - start] + shape[axis + 1:]
            if value is not None:
                value = np.take(value, range(start, stop), axis=axis)
        inputs.append((shape, value))
    outputs = [s[:out_axis] + [stop - start] + s[out_axis + 1:] for s in spec.outputs]
    if node.op == "Reshape":
        inputs[1] = ([len(outputs[0])], np.array(outputs[0], np.int64))
    return spec.with_shapes(inputs, outputs)


def fits(piece: Verdict) -> bool:
    """A piece fits if it builds, and not on the CPU: a split whose pieces run on the CPU anyway only
    adds joins there."""
    return piece.ok and piece.failure != "cpu-fallback"


def bounds(dim: int, pieces: int) -> list[tuple[int, int]]:
    size = math.ceil(dim / pieces)
    return [(lo, min(lo + size, dim)) for lo in range(0, dim, size)]


def choose_split(node: gs.Node, check, skip: int | None = None) -> tuple[int, int, Verdict] | None:
    """(axis, pieces, verdict of a piece) with the fewest pieces that fit, trying axes last first."""
    shape = list(node.outputs[0].shape)
    for axis in [a for a in split_axes(node) if a != skip]:
        for pieces in range(2, min(shape[axis], MAX_PIECES) + 1):
            lo, hi = bounds(shape[axis], pieces)[0]
            if len(bounds(shape[axis], pieces)) < pieces:
                continue  # same piece size as a smaller count
            verdict = check(piece_spec(node, axis, lo, hi))
            if fits(verdict):
                return axis, pieces, verdict
    return None


def piece_node(node: gs.Node, axis: int, lo: int, hi: int) -> gs.Node:
    """A detached copy of the node at the shapes of one piece: what a further split would start from."""
    spec = piece_spec(node, axis, lo, hi)
    ins = [gs.Constant(f"in{k}", value) if value is not None else gs.Variable(f"in{k}", t.dtype, shape)
           for k, ((shape, value), t) in enumerate(zip(spec.inputs, node.inputs))]
    outs = [gs.Variable(f"out{k}", t.dtype, shape) for k, (shape, t) in enumerate(zip(spec.outputs, node.outputs))]
    return gs.Node(node.op, node.name, dict(node.attrs), ins, outs)


def choose_nested_split(node: gs.Node, check, depth: int = NESTED_DEPTH) -> tuple[int, int] | None:
    """Where no one split fits (a MatMul too wide in M, K and N): the first split, (axis, pieces),
    after which a piece has a split of its own that fits (along another axis or the reduced one), or,
    `depth` levels down, a nested split again. Piece counts double, to bound the builds this costs."""
    shape = [int(d) for d in node.outputs[0].shape]
    for axis in split_axes(node):
        pieces = 2
        while pieces <= min(shape[axis], MAX_PIECES):
            piece = piece_node(node, axis, *bounds(shape[axis], pieces)[0])
            if choose_split(piece, check, skip=axis) or choose_reduction_split(piece, check) \
                    or (depth > 1 and choose_nested_split(piece, check, depth - 1)):
                return axis, pieces
            pieces *= 2
    return None


def unsplittable(node: gs.Node, check) -> Verdict | None:
    """The verdict of the smallest piece the splits below could make (MAX_PIECES along every axis they
    cut, and along the reduced axis), when even that does not fit: the failure does not shrink with
    the size, so no split is searched for. (On rk3568 a one-op build of a 3-D Add fails with `Unkown
    op target: 0` at every size, and a MatMul's pieces land on the CPU: the search tried thousands of
    splits, none of which could be kept.)"""
    piece = node
    for axis in split_axes(node):
        dim = int(piece.outputs[0].shape[axis])
        piece = piece_node(piece, axis, *bounds(dim, min(dim, MAX_PIECES))[0])
    total = reduced_width(node)
    spec = reduction_piece(piece, bounds(total, min(total, MAX_PIECES))[0][1]) if total else None
    smallest = check(spec or OpSpec.of(piece))
    return None if fits(smallest) else smallest


def split_node(rw: Rewriter, node: gs.Node, axis: int, pieces: int) -> None:
    """Replace `node` by `pieces` copies on slices of its inputs, joined by a Concat into its output."""
    out = node.outputs[0]
    base = node_label(node)
    parts = []
    for i, (lo, hi) in enumerate(bounds(int(out.shape[axis]), pieces)):
        ins = []
        for k, tensor in enumerate(node.inputs):
            in_axis = input_axis(node, k, axis)
            ins.append(tensor if in_axis is None else rw.take(tensor, in_axis, lo, hi, f"{base}/legalize/slice{k}_{i}"))
        shape = [int(d) for d in out.shape]
        shape[axis] = hi - lo
        if node.op == "Reshape":
            ins[1] = gs.Constant(f"{base}/shape{i}", np.array(shape, np.int64))
        parts.append(rw.node(node.op, f"{base}/part{i}", ins, shape, out, **node.attrs))
    node.outputs.clear()
    rw.join(parts, out, axis, f"{base}/legalize/concat")


def reduction_piece(node: gs.Node, width: int) -> OpSpec | None:
    """One piece of a split along the axis the node reduces: MatMul's K, Softmax's own axis."""
    if node.op == "MatMul" and all(len(t.shape) >= 2 for t in node.inputs):
        spec = OpSpec.of(node)
        (a, av), (b, bv) = spec.inputs
        a = a[:-1] + [width]
        b = b[:-2] + [width, b[-1]]
        return spec.with_shapes([(a, None if av is None else av[..., :width]),
                                 (b, None if bv is None else bv[..., :width, :])], spec.outputs)
    if node.op == "Softmax":
        shape = [int(d) for d in node.outputs[0].shape]
        shape[node.attrs.get("axis", -1) % len(shape)] = width
        return OpSpec("Exp", {}, [(shape, None)], [shape])
    return None


def reduced_width(node: gs.Node) -> int | None:
    """The length of the axis the node reduces and a split may cut: MatMul's K, Softmax's own axis."""
    if node.op == "MatMul":
        return int(node.inputs[0].shape[-1])
    if node.op == "Softmax":
        return int(node.outputs[0].shape[node.attrs.get("axis", -1) % len(node.outputs[0].shape)])
    return None


def choose_reduction_split(node: gs.Node, check) -> tuple[int, Verdict] | None:
    """The fewest pieces along the reduced axis that fit (summed partials, or a two-pass softmax)."""
    total = reduced_width(node)
    if total is None:
        return None
    for pieces in range(2, min(total, MAX_PIECES) + 1):
        if len(bounds(total, pieces)) < pieces:
            continue
        spec = reduction_piece(node, bounds(total, pieces)[0][1])
        verdict = check(spec)
        if fits(verdict):
            return pieces, verdict
    return None


def split_reduction(rw: Rewriter, node: gs.Node, pieces: int) -> None:
    """MatMul: sum of A[..., K_j] @ B[K_j, :]. Softmax: max and sum over the pieces, then each piece
    exp(x_j - max) / sum, joined. Both exact up to fp32 rounding of the summation order."""
    out, base = node.outputs[0], node_label(node)
    shape = [int(d) for d in out.shape]
    if node.op == "MatMul":
        a, b = node.inputs
        parts = []
        for i, (lo, hi) in enumerate(bounds(int(a.shape[-1]), pieces)):
            ai = rw.take(a, len(a.shape) - 1, lo, hi, f"{base}/legalize/sliceA{i}")
            bi = rw.take(b, len(b.shape) - 2, lo, hi, f"{base}/legalize/sliceB{i}")
            parts.append(rw.node("MatMul", f"{base}/k{i}", [ai, bi], shape, out))
        node.outputs.clear()
        total = parts[0]
        for i, part in enumerate(parts[1:], 1):
            if i == len(parts) - 1:
                rw.graph.nodes.append(gs.Node("Add", f"{base}/k{i}/sum", inputs=[total, part], outputs=[out]))
            else:
                total = rw.node("Add", f"{base}/k{i}/sum", [total, part], shape, out)
        return
    x = node.inputs[0]
    axis = node.attrs.get("axis", -1) % len(shape)
    ranges = bounds(shape[axis], pieces)
    xs = [rw.take(x, axis, lo, hi, f"{base}/legalize/slice{i}") for i, (lo, hi) in enumerate(ranges)]
    maxes = [rw.reduce("ReduceMax", xi, axis, f"{base}/max{i}") for i, xi in enumerate(xs)]
    m = rw.node("Max", f"{base}/max", maxes, list(maxes[0].shape), out)
    exps, total = [], None
    for i, xi in enumerate(xs):
        piece = list(xi.shape)
        ei = rw.node("Exp", f"{base}/exp{i}", [rw.node("Sub", f"{base}/sub{i}", [xi, m], piece, out)], piece, out)
        si = rw.reduce("ReduceSum", ei, axis, f"{base}/sum{i}")
        total = si if total is None else rw.node("Add", f"{base}/sum{i}/acc", [total, si], list(si.shape), out)
        exps.append(ei)
    parts = [rw.node("Div", f"{base}/part{i}", [ei, total], list(ei.shape), out) for i, ei in enumerate(exps)]
    node.outputs.clear()
    rw.join(parts, out, axis, f"{base}/legalize/concat")


def node_label(node: gs.Node) -> str:
    """A node's name, or for an unnamed node its op and first output: unique either way."""
    return node.name or f"{node.op}({node.outputs[0].name})"


def fold_slices_of_concats(graph: gs.Graph, joins: set[str]) -> int:
    """Slice(Concat(parts), axis, a, b) where [a, b) is exactly one part and the Concat is one of
    legalize's own joins: use that part."""
    folded = 0
    outputs = {id(t) for t in graph.outputs}
    for node in [n for n in graph.nodes if n.op == "Slice" and len(n.inputs) >= 4 and n.outputs]:
        src = node.inputs[0]
        producer = src.inputs[0] if src.inputs else None
        if producer is None or producer.op != "Concat" or producer.name not in joins \
                or id(node.outputs[0]) in outputs or not all(isinstance(t, gs.Constant) for t in node.inputs[1:4]):
            continue
        start, end, axis = (int(t.values.ravel()[0]) for t in node.inputs[1:4])
        rank = len(src.shape)
        if axis % rank != producer.attrs["axis"] % rank:
            continue
        offset = 0
        for part in producer.inputs:
            width = int(part.shape[axis % rank])
            if (offset, offset + width) == (start, end):
                replace_uses(node.outputs[0], part)
                node.outputs.clear()
                folded += 1
                break
            offset += width
    return folded


def legalize(graph: gs.Graph, ctx: PassContext) -> tuple[gs.Graph, dict]:
    legality = ctx.legality
    changes, stuck, noted = [], [], []
    rw = Rewriter(graph, ctx.host_candidates)
    if legality is None:
        return graph, {"changes": changes, "note": "the target has no limits"}
    pending = list(graph.nodes)
    while pending:
        node = pending.pop(0)
        if not checked(node) or not node.outputs or node.name in ctx.host_candidates \
                or any(t.shape is None for t in (*node.inputs, *node.outputs)):
            continue
        verdict = legality.check(OpSpec.of(node))
        if verdict.ok:
            if verdict.failure:
                noted.append({"node": node_label(node), "op": node.op, "reason": verdict.reason})
            continue
        shape, label = [int(d) for d in node.outputs[0].shape], node_label(node)
        if (smallest := unsplittable(node, legality.check)) is not None:
            stuck.append({"node": label, "op": node.op, "reason": verdict.reason,
                          "action": f"left as is: the smallest piece a split makes fails too ({smallest.reason})"})
            continue
        choice = choose_split(node, legality.check)
        if choice is not None:
            axis, pieces, piece = choice
            split_node(rw, node, axis, pieces)
            action = f"split into {pieces} along axis {axis} ({piece.reason})"
        elif (reduction := choose_reduction_split(node, legality.check)) is not None:
            pieces, piece = reduction
            split_reduction(rw, node, pieces)
            how = "partial products summed" if node.op == "MatMul" else "two-pass max and sum"
            action = f"split into {pieces} along the reduced axis, {how} ({piece.reason})"
        elif (first := choose_nested_split(node, legality.check)) is not None:
            axis, pieces = first
            count = len(graph.nodes)
            split_node(rw, node, axis, pieces)
            pending[:0] = [n for n in graph.nodes[count:] if n.op == node.op]  # each piece is split again
            action = f"split into {pieces} along axis {axis}, each piece split again (below)"
        else:
            stuck.append({"node": label, "op": node.op, "reason": verdict.reason,
                          "action": "left as is: no split along up to three safe axes fits"})
            continue
        changes.append({"node": label, "op": node.op, "shape": shape, "reason": verdict.reason, "action": action})
    folded = fold_slices_of_concats(graph, ctx.host_candidates)
    # What fails alone and no split fixes is left to the model's build, which reports what it hits
    # (a Mul of a constant zero crashes the toolkit alone; in the model it folds away).
    return graph, {"changes": changes, "tried": stuck, "reported": noted, "slices_folded": folded}
