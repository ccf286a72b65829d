"""canonicalize: fixed input shapes, folded constants, no Identity or no-op Cast, every tensor's shape known."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from shard.errors import ModelError
from shard.graph import infer_shapes, is_static, replace_uses
from shard.passes import PassContext, register


def format_shape(shape) -> str:
    return "[" + ",".join(str(d) if d is not None else "?" for d in shape) + "]"


def fix_input_shapes(graph: gs.Graph, overrides: dict[str, tuple[int, ...]]) -> list[str]:
    """Apply `--input-shape` overrides; a dimension still dynamic afterwards is a ModelError."""
    names = [t.name for t in graph.inputs]
    for name in overrides:
        if name not in names:
            raise ModelError(f"--input-shape names {name!r}, but the model's inputs are: {', '.join(names)}")
    changed = []
    for tensor in graph.inputs:
        if tensor.name in overrides:
            new = list(overrides[tensor.name])
            if tensor.shape is not None and len(tensor.shape) != len(new):
                raise ModelError(f"--input-shape {tensor.name}: model input has rank {len(tensor.shape)}, "
                                 f"given {format_shape(new)}")
            tensor.shape = new
            changed.append(tensor.name)
        if tensor.shape is None:
            raise ModelError(f"input {tensor.name!r} has no shape; give one with --input-shape {tensor.name}=1,3,224,224")
        for axis, dim in enumerate(tensor.shape):
            if not (isinstance(dim, int) and dim >= 0):
                example = ",".join(str(d) if isinstance(d, int) and d >= 0 else "N" for d in tensor.shape)
                raise ModelError(f"input {tensor.name!r} has a dynamic dimension {axis} ({dim!r}) in shape "
                                 f"{format_shape(tensor.shape)}; fix it with --input-shape {tensor.name}={example}")
    return changed


def is_noop(node: gs.Node) -> bool:
    """Identity, or a Cast to the dtype its input already has (exporters leave these in)."""
    if node.op == "Identity":
        return True
    if node.op == "Cast" and node.inputs and node.inputs[0].dtype is not None:
        to = onnx.helper.tensor_dtype_to_np_dtype(node.attrs["to"])
        return np.dtype(node.inputs[0].dtype) == to
    return False


def remove_identities(graph: gs.Graph) -> int:
    """Bypass Identity nodes and no-op Casts, keeping the output's name where it is a graph output."""
    outputs = set(id(t) for t in graph.outputs)
    removed = 0
    for node in [n for n in graph.nodes if is_noop(n)]:
        src, dst = node.inputs[0], node.outputs[0]
        if id(dst) in outputs:
            continue
        replace_uses(dst, src)
        node.outputs.clear()
        removed += 1
    return removed


@register("canonicalize")
def canonicalize(graph: gs.Graph, ctx: PassContext) -> tuple[gs.Graph, dict]:
    nodes_before = len(graph.nodes)
    fixed = fix_input_shapes(graph, getattr(ctx.options, "input_shapes", {}) or {})
    graph = infer_shapes(graph)
    # Shape ops fold only once shapes are known, and folding them reveals more shapes: iterate.
    for _ in range(4):
        count = len(graph.nodes)
        graph.toposort().fold_constants(fold_shapes=True, error_ok=True).cleanup()
        graph = infer_shapes(graph)
        if len(graph.nodes) == count:
            break
    # Bypassing an Identity changes no shape: the shapes inferred above still hold.
    identities = remove_identities(graph)
    graph.cleanup().toposort()
    unknown = [t.name for t in graph.outputs if not is_static(t.shape)]
    if unknown:
        raise ModelError(f"cannot infer a static shape for output(s) {', '.join(unknown)}")
    return graph, {"fixed_inputs": fixed, "nodes_before": nodes_before, "nodes_after": len(graph.nodes),
                   "identities_removed": identities}
