"""Control flow, which no NPU graph has: a Loop of a known, small trip count unrolled into its
iterations; anything still deciding at run time refused in one line.

An If whose condition folds to a constant (a constant, or an input fixed with --input-value) is
inlined by graphsurgeon's folding in canonicalize. A Loop is a model's fixed count of steps (a
denoising loop's Euler steps, a recurrent cell run over a fixed length): where its trip count is a
constant, its condition true and its body does not end it early, its body is written out once per
iteration (the iteration number a constant in each), the carried values chained from one to the
next, and each scan output the iterations' values stacked. What follows folds and is rewritten as
any feed-forward graph.
"""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from shard.errors import ModelError

CONTROL_FLOW = ("If", "Loop", "Scan")
MAX_UNROLLED_NODES = 20_000   # a Loop is unrolled only where its iterations' nodes stay within this


def constant_value(tensor: gs.Tensor) -> np.ndarray | None:
    return np.asarray(tensor.values) if isinstance(tensor, gs.Constant) else None


def always_true(cond: gs.Tensor, cond_in: gs.Tensor) -> bool:
    """Whether a Loop body's condition output is true whenever its condition input is: the input
    itself (through Identity), or a true constant."""
    while not isinstance(cond, gs.Constant) and cond is not cond_in and len(cond.inputs) == 1 \
            and cond.inputs[0].op == "Identity":
        cond = cond.inputs[0].inputs[0]
    value = constant_value(cond)
    return cond is cond_in or (value is not None and bool(value.all()))


def trip_count(node: gs.Node) -> int | None:
    """The iterations of a Loop that unrolls (a constant trip count, a true or absent condition, a body
    that never ends it early and holds no graph of its own); else None."""
    body = node.attrs["body"]
    trips = constant_value(node.inputs[0]) if node.inputs and node.inputs[0].name else None
    cond = node.inputs[1] if len(node.inputs) > 1 else None
    cond_value = constant_value(cond) if cond is not None and cond.name else np.array(True)
    if trips is None or trips.size != 1 or cond_value is None or not bool(cond_value.all()):
        return None
    count = int(trips.reshape(-1)[0])
    if count < 1 or count * len(body.nodes) > MAX_UNROLLED_NODES or not always_true(body.outputs[0], body.inputs[1]):
        return None
    if any(isinstance(v, gs.Graph) for n in body.nodes for v in n.attrs.values()):
        return None
    return count


def unroll(graph: gs.Graph, node: gs.Node, trips: int) -> None:
    """Write the Loop `node`'s body out `trips` times into `graph` in its place."""
    body = node.attrs["body"]
    carried_count = len(node.inputs) - 2
    carried = list(node.inputs[2:])
    stacked: list[list[gs.Tensor]] = [[] for _ in body.outputs[1 + carried_count:]]
    for k in range(trips):
        prefix = f"{node.name}/iter{k}/"
        mapping = {id(body.inputs[0]): gs.Constant(f"{prefix}iteration", shaped(np.int64(k), body.inputs[0])),
                   id(body.inputs[1]): gs.Constant(f"{prefix}cond", shaped(np.bool_(True), body.inputs[1]))}
        mapping.update({id(t): c for t, c in zip(body.inputs[2:], carried)})
        for inner in body.toposort().nodes:
            outputs = [gs.Variable(prefix + t.name, dtype=t.dtype, shape=t.shape) if t.name else gs.Variable.empty()
                       for t in inner.outputs]
            mapping.update({id(t): o for t, o in zip(inner.outputs, outputs)})
            graph.nodes.append(gs.Node(inner.op, name=prefix + (inner.name or inner.op), attrs=dict(inner.attrs),
                                       inputs=[mapping.get(id(t), t) for t in inner.inputs], outputs=outputs,
                                       domain=inner.domain))
        results = [mapping.get(id(t), t) for t in body.outputs[1:]]
        carried = results[:carried_count]
        for values, value in zip(stacked, results[carried_count:]):
            values.append(value)
    finals = carried + [stack(graph, f"{node.name}/scan{j}", values) for j, values in enumerate(stacked)]
    for final, out in zip(finals, list(node.outputs)):
        graph.nodes.append(gs.Node("Identity", name=f"{node.name}/{out.name}", inputs=[final], outputs=[out]))
    node.inputs.clear()
    node.outputs.clear()


def shaped(value: np.generic, like: gs.Tensor) -> np.ndarray:
    """A scalar in the shape a body input declares (a scalar, or [1])."""
    shape = like.shape if like.shape is not None and all(isinstance(d, int) for d in like.shape) else ()
    return np.full(shape, value, dtype=value.dtype)


def stack(graph: gs.Graph, name: str, values: list[gs.Tensor]) -> gs.Variable:
    """The scan output of a Loop: each iteration's value with a new leading axis, concatenated."""
    axes = gs.Constant(f"{name}/axes", np.array([0], np.int64))
    rows = []
    for k, value in enumerate(values):
        row = gs.Variable(f"{name}/{k}", dtype=value.dtype)
        graph.nodes.append(gs.Node("Unsqueeze", name=f"{name}/unsqueeze{k}", inputs=[value, axes], outputs=[row]))
        rows.append(row)
    out = gs.Variable(f"{name}/stacked", dtype=values[0].dtype)
    graph.nodes.append(gs.Node("Concat", name=f"{name}/concat", attrs={"axis": 0}, inputs=rows, outputs=[out]))
    return out


def unroll_loops(graph: gs.Graph) -> list[dict]:
    """Unroll every Loop of the graph whose trip count is known (trip_count); what was unrolled."""
    done = []
    for node in [n for n in graph.nodes if n.op == "Loop"]:
        trips = trip_count(node)
        if trips is not None:
            done.append({"node": node.name, "op": "Loop", "reason": f"a trip count of {trips}, known at compile",
                         "action": f"unrolled: {trips} iterations of its {len(node.attrs['body'].nodes)} nodes"})
            unroll(graph, node, trips)
    if done:
        graph.cleanup().toposort()
    return done


def refuse_control_flow(graph: gs.Graph) -> None:
    """Control flow still here decides at run time, which no NPU graph does: one line naming the node
    and the inputs its decision reads (fixed with --input-value)."""
    node = next((n for n in graph.nodes if n.op in CONTROL_FLOW), None)
    if node is None:
        return
    deciding = {"If": node.inputs[:1], "Loop": node.inputs[:2]}.get(node.op, node.inputs)   # a Loop's count and condition
    reads, stack_, seen = set(), [t for t in deciding if isinstance(t, gs.Variable)], set()
    graph_inputs = {id(t) for t in graph.inputs}
    while stack_:   # the graph inputs the node's own inputs come from
        t = stack_.pop()
        if id(t) in seen:
            continue
        seen.add(id(t))
        if id(t) in graph_inputs:
            reads.add(t.name)
        stack_ += [i for producer in t.inputs for i in producer.inputs if isinstance(i, gs.Variable)]
    hint = f"fix {'it' if len(reads) == 1 else 'them'} with --input-value NAME=VALUE ({', '.join(sorted(reads))})" \
        if reads else "it depends on no input that could be fixed"
    why = ""
    if node.op == "Loop":
        why = (" (a Loop unrolls where its trip count is a constant, its condition true, its body never ends it "
               f"early and holds no graph of its own, and its iterations stay within {MAX_UNROLLED_NODES} nodes)")
    raise ModelError(f"{node.op} node {node.name!r} decides at run time ({', '.join(t.name for t in node.inputs)}): "
                     f"an NPU graph has no control flow{why}; {hint}")
