"""Building blocks the rewriting passes share: new nodes with named outputs, slices made once per
(tensor, axis, range), reductions in the form the graph's opset wants, joins."""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs


class Rewriter:
    """Adds nodes to `graph`. Where `host` is given, the Slices and joins it makes are named there,
    so host_edges may move those at the model's edges to the runtime."""

    def __init__(self, graph: gs.Graph, host: set[str] | None = None):
        self.graph, self.host = graph, host
        self.opset = graph.opset or 17
        self.slices: dict[tuple, gs.Tensor] = {}
        self.count = 0

    def node(self, op: str, name: str, inputs: list, shape: list[int], like: gs.Tensor, **attrs) -> gs.Variable:
        """One node named `name` whose output `{name}_out` has `shape` and the dtype of `like`."""
        self.count += 1
        out = gs.Variable(f"{name}_out", dtype=like.dtype if like.dtype is not None else np.float32,
                          shape=[int(d) for d in shape])
        self.graph.nodes.append(gs.Node(op, name, attrs, inputs, [out]))
        return out

    def take(self, tensor: gs.Tensor, axis: int, lo: int, hi: int, name: str) -> gs.Tensor:
        """Rows [lo, hi) of `tensor` along `axis`: the tensor itself when that is all of it, a sliced
        constant, or a Slice node made once per range."""
        if hi - lo == int(tensor.shape[axis]):
            return tensor
        if isinstance(tensor, gs.Constant):
            return gs.Constant(f"{tensor.name}__{axis}_{lo}_{hi}", np.take(tensor.values, range(lo, hi), axis=axis))
        key = (id(tensor), axis, lo, hi)
        if key not in self.slices:
            shape = [int(d) for d in tensor.shape]
            shape[axis] = hi - lo
            params = [gs.Constant(f"{name}/{p}", np.array([v], np.int64))
                      for p, v in (("starts", lo), ("ends", hi), ("axes", axis))]
            self.slices[key] = self.node("Slice", name, [tensor, *params], shape, tensor)
            self._mark(name)
        return self.slices[key]

    def reduce(self, op: str, tensor: gs.Tensor, axis: int, name: str) -> gs.Variable:
        """ReduceMax or ReduceSum over one axis, kept as size 1. ReduceSum takes its axes as an input
        from opset 13, ReduceMax only from opset 18."""
        shape = [int(d) for d in tensor.shape]
        shape[axis] = 1
        axes = gs.Constant(f"{name}/axes", np.array([axis], np.int64))
        if op == "ReduceSum" or self.opset >= 18:
            return self.node(op, name, [tensor, axes], shape, tensor, keepdims=1)
        return self.node(op, name, [tensor], shape, tensor, axes=[axis], keepdims=1)

    def join(self, parts: list[gs.Tensor], out: gs.Variable, axis: int, name: str) -> None:
        """Concat the parts along `axis` into the existing tensor `out`."""
        self.graph.nodes.append(gs.Node("Concat", name, {"axis": axis}, parts, [out]))
        self._mark(name)

    def _mark(self, name: str) -> None:
        if self.host is not None:
            self.host.add(name)
