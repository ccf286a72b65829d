"""Multiply-accumulates of a node: what partition balances shards by, the GPU roofline costs and
precision ranks linears per. graphsurgeon and numpy only."""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from shard.graph import is_static


def estimate_macs(node: gs.Node) -> int:
    """Multiply-accumulates of one node (MatMul/Gemm/Conv exactly, anything else one per output element)."""
    out = node.outputs[0] if node.outputs else None
    if out is None or not is_static(out.shape):
        return 0
    out_elems = int(np.prod(out.shape, dtype=np.int64))
    if node.op in ("MatMul", "Gemm") and is_static(node.inputs[0].shape):
        k = node.inputs[0].shape[-1] if node.op == "MatMul" or not node.attrs.get("transA") else node.inputs[0].shape[0]
        return out_elems * int(k)
    if node.op == "Conv" and is_static(node.inputs[1].shape):
        return out_elems * int(np.prod(node.inputs[1].shape[1:], dtype=np.int64))
    return out_elems
