"""stages: cut the graph into pipeline stages (GPU targets) of equal predicted time on the profile's GPU.

The runtime gives each stage its own CUDA stream, so frame t+1's first stage runs while frame t is in
a later one; throughput is then set by the slowest stage, and the cuts balance the roofline cost
model's predicted times (shard.targets.gpu.roofline), not MACs: a stage of big products and one of
softmaxes over long sequences cost differently per MAC. Cuts go where few bytes cross, as in
partition, and never through an FP8 tensor (a QuantizeLinear and its DequantizeLinear stay together).
No scratchpad tiling: a GPU takes any op whole.
"""

from __future__ import annotations

from dataclasses import asdict

import networkx as nx
import onnx_graphsurgeon as gs

from shard.errors import ModelError
from shard.graph import numpy_dtype
from shard.passes.context import PassContext
from shard.passes.partition import build_dataflow, choose_cuts, live_bytes_after, shard_boundaries
from shard.targets.gpu.roofline import node_costs, node_seconds, stage_cost, stage_floor

DEFAULT_STAGES = 2   # the seed's two-stream pipeline; --shards K asks for K


def cuttable(tensor: gs.Tensor) -> bool:
    """A tensor the runtime can pass between stages that the model itself has (so verify can feed
    each stage alone): not FP8, not what a DequantizeLinear made of it."""
    if tensor.inputs and tensor.inputs[0].op in ("QuantizeLinear", "DequantizeLinear"):
        return False
    dtype = numpy_dtype(tensor)   # None for fp8, an ONNX-only type: numpy cannot hold it between stages
    return dtype is not None and dtype.kind in "fiub"


def stages(graph: gs.Graph, ctx: PassContext) -> tuple[gs.Graph, dict]:
    if not graph.nodes:
        raise ModelError("the model has no operators left after constant folding")
    facts = ctx.profile.facts
    rooflines = node_costs(graph.nodes, facts)   # each node's, once: the cuts, the table and the floors read them
    seconds = node_seconds(graph.nodes, graph.outputs, facts, rooflines)
    costs = [seconds[id(node)] for node in graph.nodes]
    wanted = ctx.options.shards or DEFAULT_STAGES
    dag = build_dataflow(graph)
    if not nx.is_directed_acyclic_graph(dag):
        raise ModelError("the graph has a cycle")
    live = live_bytes_after(graph, dag, {name for name, t in graph.tensors().items() if cuttable(t)})
    cuts = choose_cuts(costs, live, min(wanted, len(graph.nodes)))
    ctx.plan = shard_boundaries(graph, cuts)
    totals = [stage_cost(plan.nodes, facts, rooflines) for plan in ctx.plan]
    table = [{"stage": plan.name, "nodes": len(plan.nodes),
              **asdict(ops), "predicted_s": sum(seconds[id(n)] for n in plan.nodes),
              **stage_floor(plan.nodes, plan.inputs, plan.outputs, facts, ops)} for plan, ops in zip(ctx.plan, totals)]
    return graph, {"requested": wanted, "shards": len(ctx.plan), "cut_bytes": [live[c] for c in cuts],
                   "stages": table, "macs": [p.macs for p in ctx.plan]}
