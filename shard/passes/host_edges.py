"""host_edges: pure layout ops at the model's edges, marked by earlier passes, move to the runtime;
so does what the model computes from its integer inputs alone (embedding lookups, an attention mask
made into an additive bias, RoBERTa's position ids: Gather, Cast, Not, Where, CumSum...) or from a
comparison of its float inputs (a mask given as floats, Greater then Cast to float), which the
vendor runs on the CPU inside its graph (seen: the onnx conformance model test_Embedding; RoBERTa
from transformers, 10 of its 17 CPU ops), and a model output made so (a sentence encoder that gives
back its input_ids and attention_mask, reshaped: 2 CPU ops).

A marked Slice, Reshape or Transpose whose data input is a graph input (or made on the host
already) runs in numpy before the first shard; a marked Concat, Reshape or Transpose whose output
is a graph output runs after the last. Their NPU-side tensors become the graph's new inputs and
outputs, so no shard edge carries the oversize tensor (FACTS: splitting an oversize graph input
on the NPU overflows just the same). The bundle keeps the model's own inputs and outputs.
"""

from __future__ import annotations

import re

import numpy as np
import onnx_graphsurgeon as gs

from shard.bundle import HOST_ONNX_OPS
from shard.graph import tensor_spec
from shard.passes.context import PassContext

PRE_OPS = ("Slice", "Reshape", "Transpose")
POST_OPS = ("Concat", "Reshape", "Transpose", "Mul", "Softmax", "LogSoftmax")
ONNX_POST = ("Mul", "Softmax", "LogSoftmax")   # scale_sandwich's fp32 restore of an output, a last Softmax past fp16


def const(node: gs.Node, k: int) -> np.ndarray | None:
    t = node.inputs[k] if k < len(node.inputs) else None
    return t.values if isinstance(t, gs.Constant) else None


def host_step(node: gs.Node) -> dict | None:
    """The runtime step for a node, or None if this node cannot run on the host as it is."""
    data, out = node.inputs[0], node.outputs[0]
    if node.op == "Slice":
        starts, ends, axes = (const(node, k) for k in (1, 2, 3))
        steps = const(node, 4)
        if starts is None or ends is None or axes is None or starts.size != 1 or (steps is not None and steps.ravel()[0] != 1):
            return None
        rank = len(data.shape)
        return {"op": "slice", "input": data.name, "output": out.name, "axis": int(axes.ravel()[0]) % rank,
                "start": int(starts.ravel()[0]), "end": min(int(ends.ravel()[0]), int(data.shape[int(axes.ravel()[0])]))}
    if node.op == "Reshape":
        return {"op": "reshape", "input": data.name, "output": out.name, "shape": [int(d) for d in out.shape]}
    if node.op == "Transpose":
        return {"op": "transpose", "input": data.name, "output": out.name, "perm": list(node.attrs["perm"])}
    if node.op == "Concat":
        return {"op": "concat", "inputs": [t.name for t in node.inputs], "output": out.name,
                "axis": node.attrs["axis"] % len(out.shape)}
    return None


SMALL_CONSTANT = 64  # elements a moved node's constant may have in the manifest; larger ones are files


COMPARISONS = ("Equal", "Less", "LessOrEqual", "Greater", "GreaterOrEqual")


def host_computed(node: gs.Node, derived: set[str], inputs: set[str]) -> bool:
    """Whether the host computes the node from the model's integer inputs alone (every variable input
    in `derived`), in an op the runtime has in numpy; a comparison also of the model's float inputs
    (a mask given as floats, turned to booleans)."""
    variables = [t for t in node.inputs if isinstance(t, gs.Variable) and t.name]
    return node.op in HOST_ONNX_OPS and bool(variables) and all(
        t.name in derived or node.op in COMPARISONS and t.name in inputs for t in variables)


def integer_step(node: gs.Node, derived: set[str], files: dict[str, np.ndarray], inputs: set[str]) -> dict | None:
    """The host step for a node host_computed; None otherwise. Its large constants (an embedding
    table) go into `files`, which compile writes into the bundle."""
    if not host_computed(node, derived, inputs) or len(node.outputs) != 1:
        return None
    return onnx_step(node, files)


def host_made(out: gs.Tensor, outputs: list[gs.Tensor]) -> bool:
    """Whether the host may make `out`: a node reads it, or it is one of several model outputs (input_ids
    given back); never the model's only output, which would leave the NPU nothing to make."""
    return out not in outputs and bool(out.outputs) or out in outputs and len(outputs) > 1


def integer_inputs(graph: gs.Graph) -> set[str]:
    """The model's integer (and boolean) inputs: ids, masks, what host_computed starts from."""
    return {t.name for t in graph.inputs if t.dtype is not None and np.dtype(t.dtype).kind in "biu"}


def integer_derived(graph: gs.Graph) -> set[str]:
    """The tensors computed from the model's integer inputs alone in ops the host runs (what this pass
    moves to the runtime), without moving them."""
    derived = integer_inputs(graph)
    inputs = {t.name for t in graph.inputs}
    grown = True
    while grown:   # in any node order
        grown = False
        for node in graph.nodes:
            if host_computed(node, derived, inputs) and not all(t.name in derived for t in node.outputs):
                derived.update(t.name for t in node.outputs)
                grown = True
    return derived


def onnx_step(node: gs.Node, files: dict[str, np.ndarray]) -> dict | None:
    """A node as a host step of its ONNX op (shard.runtime.host_ops), its constants in the step or
    in `files`; None if its attributes are not plain values."""
    attrs = {k: (list(v) if isinstance(v, (list, tuple)) else v) for k, v in node.attrs.items()}
    if not all(isinstance(v, (int, float, str)) or isinstance(v, list) and all(isinstance(x, (int, float)) for x in v)
               for v in attrs.values()):
        return None
    constants = {}
    for t in node.inputs:
        if isinstance(t, gs.Constant) and t.values.size > SMALL_CONSTANT:
            constants[t.name] = {"file": f"host/{len(files)}_{re.sub(r'[^A-Za-z0-9_.-]', '_', t.name)}.npy"}
            files[constants[t.name]["file"]] = t.values
        elif isinstance(t, gs.Constant):
            constants[t.name] = {"dtype": t.values.dtype.name, "shape": list(t.values.shape),
                                 "values": t.values.ravel().tolist()}
    return {"op": "onnx", "type": node.op, "inputs": [t.name for t in node.inputs],
            "outputs": [node.outputs[0].name], "attrs": attrs, "constants": constants}


def host_edges(graph: gs.Graph, ctx: PassContext) -> tuple[gs.Graph, dict]:
    ctx.model_inputs = [tensor_spec(t) for t in graph.inputs]
    ctx.model_outputs = [tensor_spec(t) for t in graph.outputs]
    pre, post = [], []
    on_host = {t.name for t in graph.inputs}
    derived = integer_inputs(graph)
    inputs = {t.name for t in graph.inputs}
    moved = True
    while moved:  # inputs side: in dependency order, each step's input is already on the host
        moved = False
        for node in graph.nodes:
            if node.outputs and host_made(node.outputs[0], graph.outputs) \
                    and (step := integer_step(node, derived, ctx.host_tables, inputs)):
                derived.add(node.outputs[0].name)
            elif not (node.name in ctx.host_candidates and node.op in PRE_OPS and node.outputs
                      and node.inputs[0].name in on_host and (step := host_step(node))):
                continue
            out = node.outputs[0]  # the node's output becomes an input the host makes
            pre.append(step)
            on_host.add(out.name)
            node.outputs.clear()
            node.inputs.clear()
            if out in graph.outputs and len(graph.outputs) > 1:   # a model output the host makes (ids given back)
                graph.outputs.remove(out)
            if out.outputs or out in graph.outputs:
                graph.inputs.append(out)
            moved = True
    graph_outputs = {t.name for t in graph.outputs}
    moved = True
    while moved:  # outputs side, last step first
        moved = False
        for node in reversed(graph.nodes):
            if node.name in ctx.host_candidates and node.op in POST_OPS and node.outputs \
                    and node.outputs[0].name in graph_outputs and not node.outputs[0].outputs \
                    and isinstance(node.inputs[0], gs.Variable) \
                    and (step := onnx_step(node, ctx.host_tables) if node.op in ONNX_POST else host_step(node)):
                out = node.outputs[0]
                post.insert(0, step)
                graph.outputs = [t for t in graph.outputs if t is not out]
                node.outputs.clear()
                for t in node.inputs:
                    if isinstance(t, gs.Variable) and t.name not in {o.name for o in graph.outputs}:
                        graph.outputs.append(t)
                graph_outputs = {t.name for t in graph.outputs}
                node.inputs.clear()
                moved = True
    used = {t.name for n in graph.nodes for t in n.inputs}
    graph.inputs = [t for t in graph.inputs if t.name in used or t.name in graph_outputs]
    ctx.host_pre, ctx.host_post = pre, post
    return graph, {"host_pre": pre, "host_post": post}
