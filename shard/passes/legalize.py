"""legalize: split every op that breaks a limit along an axis where the pieces are independent, and
join the results; the graph computes exactly what it did (slicing and concatenating are exact).

Which axes are safe, per op:
  elementwise and unary ops   any output axis (broadcast inputs are passed whole)
  Softmax, LayerNormalization any axis before the normalised ones
  MatMul                      M (rows of A), N (columns of B), batch axes
  Transpose                   any output axis (the matching input axis is sliced)
The piece count is the smallest that makes one piece fit (checked by ctx.legality). The Slices and
Concats are marked for the host: where they sit at the model's edges, host_edges moves them to the
runtime, since an oversize tensor at a shard's edge cannot be split on the NPU. A Slice that takes
back exactly one piece of a Concat is folded away, so chains of split ops stay split.
"""

from __future__ import annotations

import math

import numpy as np
import onnx_graphsurgeon as gs

from shard.passes import PassContext, register
from shard.passes.fit import OpSpec, Verdict

ELEMENTWISE = {"Add", "Sub", "Mul", "Div", "Pow", "Max", "Min", "Where", "Equal", "Less", "Greater", "And", "Or",
               "Relu", "Sigmoid", "Tanh", "Exp", "Log", "Erf", "Sqrt", "Reciprocal", "Neg", "Abs", "Clip",
               "LeakyRelu", "HardSigmoid", "HardSwish", "Gelu", "Softplus", "Cast", "Sin", "Cos"}
CHECKED = ELEMENTWISE | {"Softmax", "LayerNormalization", "MatMul", "Transpose", "Concat"}
MAX_PIECES = 64


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
    else:
        return []
    return sorted(axes, reverse=True)


def input_axis(node: gs.Node, k: int, out_axis: int) -> int | None:
    """The axis of input k to slice for a split along `out_axis`; None: the input is passed whole."""
    out_rank = len(node.outputs[0].shape)
    shape = list(node.inputs[k].shape)
    if node.op == "Transpose":
        return node.attrs["perm"][out_axis]
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
        axis = input_axis(node, k, out_axis)
        if axis is not None:
            shape = shape[:axis] + [stop - start] + shape[axis + 1:]
            if value is not None:
                value = np.take(value, range(start, stop), axis=axis)
        inputs.append((shape, value))
    outputs = [s[:out_axis] + [stop - start] + s[out_axis + 1:] for s in spec.outputs]
    return OpSpec(spec.op, spec.attrs, inputs, outputs)


def bounds(dim: int, pieces: int) -> list[tuple[int, int]]:
    size = math.ceil(dim / pieces)
    return [(lo, min(lo + size, dim)) for lo in range(0, dim, size)]


def choose_split(node: gs.Node, check) -> tuple[int, int, Verdict] | None:
    """(axis, pieces, verdict of a piece) with the fewest pieces that fit, trying axes last first."""
    shape = list(node.outputs[0].shape)
    for axis in split_axes(node):
        for pieces in range(2, min(shape[axis], MAX_PIECES) + 1):
            lo, hi = bounds(shape[axis], pieces)[0]
            if len(bounds(shape[axis], pieces)) < pieces:
                continue  # same piece size as a smaller count
            verdict = check(piece_spec(node, axis, lo, hi))
            if verdict.ok:
                return axis, pieces, verdict
    return None


def split_node(graph: gs.Graph, node: gs.Node, axis: int, pieces: int, host: set[str],
               slices: dict | None = None) -> None:
    """Replace `node` by `pieces` copies on slices of its inputs, joined by a Concat into its output.
    `slices` remembers the slices made so far, so a tensor is sliced once per range."""
    slices = {} if slices is None else slices
    out = node.outputs[0]
    base = node_label(node)
    parts = []
    for i, (lo, hi) in enumerate(bounds(int(out.shape[axis]), pieces)):
        ins = []
        for k, tensor in enumerate(node.inputs):
            in_axis = input_axis(node, k, axis)
            if in_axis is None:
                ins.append(tensor)
            elif isinstance(tensor, gs.Constant):
                ins.append(gs.Constant(f"{tensor.name}__{axis}_{lo}", np.take(tensor.values, range(lo, hi), axis=in_axis)))
            else:
                key = (id(tensor), in_axis, lo, hi)
                if key not in slices:
                    shape = list(tensor.shape)
                    shape[in_axis] = hi - lo
                    piece = gs.Variable(f"{tensor.name}__{in_axis}_{lo}_{hi}", dtype=tensor.dtype, shape=shape)
                    params = [gs.Constant(f"{piece.name}/{p}", np.array([v], np.int64))
                              for p, v in (("starts", lo), ("ends", hi), ("axes", in_axis))]
                    name = f"{base}/legalize/slice{k}_{i}"
                    graph.nodes.append(gs.Node("Slice", name, inputs=[tensor, *params], outputs=[piece]))
                    host.add(name)
                    slices[key] = piece
                ins.append(slices[key])
        shape = list(out.shape)
        shape[axis] = hi - lo
        part = gs.Variable(f"{out.name}__{axis}_{lo}_{hi}", dtype=out.dtype, shape=shape)
        graph.nodes.append(gs.Node(node.op, f"{base}/part{i}", dict(node.attrs), ins, [part]))
        parts.append(part)
    node.outputs.clear()
    name = f"{base}/legalize/concat"
    graph.nodes.append(gs.Node("Concat", name, {"axis": axis}, parts, [out]))
    host.add(name)


def node_label(node: gs.Node) -> str:
    """A node's name, or for an unnamed node its op and first output: unique either way."""
    return node.name or f"{node.op}({node.outputs[0].name})"


def fold_slices_of_concats(graph: gs.Graph) -> int:
    """Slice(Concat(parts), axis, a, b) where [a, b) is exactly one part: use that part."""
    folded = 0
    for node in [n for n in graph.nodes if n.op == "Slice" and len(n.inputs) >= 4]:
        src = node.inputs[0]
        producer = src.inputs[0] if src.inputs else None
        if producer is None or producer.op != "Concat" or not all(isinstance(t, gs.Constant) for t in node.inputs[1:4]):
            continue
        start, end, axis = (int(t.values.ravel()[0]) for t in node.inputs[1:4])
        rank = len(src.shape)
        if axis % rank != producer.attrs["axis"] % rank:
            continue
        offset = 0
        for part in producer.inputs:
            width = int(part.shape[axis % rank])
            if (offset, offset + width) == (start, end):
                out = node.outputs[0]
                for consumer in list(out.outputs):
                    for k, t in enumerate(consumer.inputs):
                        if t is out:
                            consumer.inputs[k] = part
                node.outputs.clear()
                folded += 1
                break
            offset += width
    return folded


@register("legalize")
def legalize(graph: gs.Graph, ctx: PassContext) -> tuple[gs.Graph, dict]:
    legality = ctx.legality
    changes, stuck, noted, slices = [], [], [], {}
    if legality is None:
        return graph, {"changes": changes, "note": "the target has no limits"}
    for node in list(graph.nodes):
        if node.op not in CHECKED or not node.outputs or node.name in ctx.host_candidates \
                or any(t.shape is None for t in (*node.inputs, *node.outputs)):
            continue
        verdict = legality.check(OpSpec.of(node))
        if verdict.ok:
            if verdict.failure:
                noted.append({"node": node_label(node), "op": node.op, "reason": verdict.reason})
            continue
        choice = choose_split(node, legality.check)
        if choice is None:
            stuck.append({"node": node_label(node), "op": node.op, "reason": verdict.reason,
                          "action": "left as is: no split along a safe axis fits"})
            continue
        axis, pieces, piece = choice
        shape, label = [int(d) for d in node.outputs[0].shape], node_label(node)
        split_node(graph, node, axis, pieces, ctx.host_candidates, slices)
        changes.append({"node": label, "op": node.op, "shape": shape, "reason": verdict.reason,
                        "action": f"split into {pieces} along axis {axis} ({piece.reason})"})
    folded = fold_slices_of_concats(graph)
    return graph, {"changes": changes, "not_fixed": stuck, "reported": noted, "slices_folded": folded}
