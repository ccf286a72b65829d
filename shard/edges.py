"""Shard edges in the vendor's own layout.

rknn-toolkit2 computes in a 4-D layout. A graph input or output of another shape (a [4,10] linear
input, a [3,2,5] activation, a [1,2,4] reduction) goes through a Reshape that it runs on the CPU,
next to the Input/OutputOperator (seen in 30 of the onnx package's pytorch conformance models).
The same reshape is a free view in numpy. So compile reads from a shard's layer table which edges
the vendor reshaped and to what 4-D shape (the target's `edge_layouts`), gives the shard's graph
those edges in that shape with a Reshape to the model's own shape inside (the vendor folds the two),
builds it again, and keeps it only where that build is better (shard.never_worse). The manifest
records the edge shapes; executors reshape inputs to them, and outputs back to the manifest's.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from shard.graph import replace_uses, toposort

SUFFIX = ".edges"   # the build of a shard with its edges in the vendor's layout


def relayout(model: onnx.ModelProto, inputs: dict[str, list[int]], outputs: dict[str, list[int]]) -> onnx.ModelProto:
    """The model with the named inputs and outputs in the given (4-D) shapes, reshaped inside."""
    graph = gs.import_onnx(model)
    for tensor in graph.inputs:
        if tensor.name in inputs:
            logical = gs.Variable(f"{tensor.name}__logical", dtype=tensor.dtype, shape=list(tensor.shape))
            replace_uses(tensor, logical)
            graph.nodes.append(reshape(tensor, logical, list(tensor.shape)))
            tensor.shape = list(inputs[tensor.name])
    for tensor in graph.outputs:
        if tensor.name in outputs and tensor.inputs:
            logical = gs.Variable(f"{tensor.name}__logical", dtype=tensor.dtype, shape=list(tensor.shape))
            replace_uses(tensor, logical)
            producer = tensor.inputs[0]
            producer.outputs[producer.outputs.index(tensor)] = logical
            graph.nodes.append(reshape(logical, tensor, list(outputs[tensor.name])))
            tensor.shape = list(outputs[tensor.name])
    result = gs.export_onnx(toposort(graph), do_type_check=False)
    result.ir_version = model.ir_version
    return result


def reshape(src: gs.Tensor, dst: gs.Tensor, shape: list[int]) -> gs.Node:
    target = gs.Constant(f"{dst.name}__shape", np.array(shape, np.int64))
    return gs.Node("Reshape", f"{dst.name}__reshape", inputs=[src, target], outputs=[dst])
