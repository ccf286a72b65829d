"""partition: cut the graph into shards at points where few bytes cross, balanced by estimated work."""

from __future__ import annotations

import math

import networkx as nx
import numpy as np
import onnx_graphsurgeon as gs

from shard.errors import ModelError
from shard.graph import constants, is_static, nbytes
from shard.macs import estimate_macs
from shard.passes.context import PassContext, ShardPlan
from shard.passes.fused import fused_regions


MIN_SHARD_MACS = 100_000_000  # about 0.2 ms of one core at its fp16 peak (512 MACs a cycle, 1 GHz)
JOB_MARGIN = 0.25             # a shard's predicted NPU time stays under this share of the driver's job limit


def build_dataflow(graph: gs.Graph) -> nx.DiGraph:
    """Nodes are graph nodes (by index in topological order); edges carry the tensor between them."""
    index = {id(n): i for i, n in enumerate(graph.nodes)}
    dag = nx.DiGraph()
    dag.add_nodes_from(range(len(graph.nodes)))
    for i, node in enumerate(graph.nodes):
        for tensor in node.outputs:
            for consumer in tensor.outputs:
                if id(consumer) in index:
                    dag.add_edge(i, index[id(consumer)], tensor=tensor)
    return dag


def live_bytes_after(graph: gs.Graph, dag: nx.DiGraph, cut_names: set[str] | None = None) -> list[float]:
    """For each position i, bytes of activations that cross a cut after node i (inf if a size is
    unknown, or if a tensor made inside the graph and not in `cut_names`, where given, crosses)."""
    n = len(graph.nodes)
    spans: dict[int, tuple[int, int, gs.Variable]] = {}  # tensor -> (producer, last consumer, tensor)
    for u, v, data in dag.edges(data=True):
        tensor = data["tensor"]
        spans[id(tensor)] = (u, max(v, spans.get(id(tensor), (u, v))[1]), tensor)
    for tensor in graph.inputs:
        consumers = [i for i, node in enumerate(graph.nodes) if tensor in node.inputs]
        if consumers:
            spans[id(tensor)] = (0, max(consumers), tensor)
    delta = np.zeros(n + 1)
    unknown = np.zeros(n + 1)
    inputs = {id(t) for t in graph.inputs}
    for start, end, tensor in spans.values():  # crosses every cut i with start <= i < end
        allowed = cut_names is None or id(tensor) in inputs or tensor.name in cut_names
        if allowed and is_static(tensor.shape) and tensor.dtype is not None:
            delta[start] += nbytes(tensor)
            delta[end] -= nbytes(tensor)
        else:
            unknown[start] += 1
            unknown[end] -= 1
    live, unk = np.cumsum(delta)[:n], np.cumsum(unknown)[:n]
    return [float("inf") if unk[i] > 0 else float(live[i]) for i in range(n)]


def choose_cuts(costs: list[int], live: list[float], shards: int) -> list[int]:
    """Positions to cut after, for each equal share of work: the nearest of the graph's cheapest
    crossings within half a share of it; else the cheapest crossing within a quarter share (a
    detector's narrow head must not take every cut from its backbone); else the nearest cheapest."""
    n = len(costs)
    interior = [i for i in range(n - 1) if math.isfinite(live[i]) and live[i] > 0]
    if shards <= 1 or not interior:
        return []
    floor = min(live[i] for i in interior)
    cheapest = [i for i in interior if live[i] <= 1.5 * floor]
    prefix = np.cumsum(costs)
    total = float(prefix[-1]) or 1.0
    cuts: list[int] = []
    for k in range(1, shards):
        target = total * k / shards
        share = total / shards
        later = [i for i in interior if not cuts or i > cuts[-1]]
        cheap = [i for i in cheapest if not cuts or i > cuts[-1]]
        distance = lambda i: abs(prefix[i] - target)  # noqa: E731
        if near := [i for i in cheap if distance(i) <= share / 2]:
            cuts.append(min(near, key=distance))
        elif near := [i for i in later if distance(i) <= share / 4]:
            cuts.append(min(near, key=lambda i: (live[i], distance(i))))
        elif cheap:
            cuts.append(min(cheap, key=distance))
        else:
            break
    return sorted(set(cuts))


def shard_boundaries(graph: gs.Graph, cuts: list[int]) -> list[ShardPlan]:
    """Turn cut positions into shards with their input and output tensors."""
    ranges, start = [], 0
    for cut in cuts + [len(graph.nodes) - 1]:
        ranges.append((start, cut + 1))
        start = cut + 1
    graph_outputs = set(id(t) for t in graph.outputs)
    plans = []
    for k, (lo, hi) in enumerate(ranges):
        nodes = graph.nodes[lo:hi]
        inside = set(id(n) for n in nodes)
        produced = {id(t): t for n in nodes for t in n.outputs}
        inputs: dict[int, gs.Variable] = {}
        for node in nodes:
            for t in node.inputs:
                if isinstance(t, gs.Variable) and id(t) not in produced and t.name:
                    inputs.setdefault(id(t), t)
        outputs = [t for t in produced.values()
                   if id(t) in graph_outputs or any(id(c) not in inside for c in t.outputs)]
        plans.append(ShardPlan(name=f"shard_{k:03d}", nodes=nodes, inputs=list(inputs.values()), outputs=outputs,
                               macs=sum(estimate_macs(n) for n in nodes), source_nodes=[n.name for n in nodes]))
    return plans


def partition(graph: gs.Graph, ctx: PassContext) -> tuple[gs.Graph, dict]:
    opts = ctx.options
    n = len(graph.nodes)
    if n == 0:
        raise ModelError("the model has no operators left after constant folding")
    costs = [estimate_macs(node) for node in graph.nodes]
    # By default one shard: a cut is a hand-off on the board every frame (its inputs set and outputs got
    # on the host: shard.targets.chips.Handoff), and buys no speed of its own: one frame's shards run one
    # after the other, and a stream of frames spreads a one-shard bundle over the cores as well (the
    # scheduler's balanced policy). More where a limit asks: the target's builds grow with their
    # weights and that many, built one at a time, keep the compile within half of the whole model's
    # build (the target's shards_for_memory: a large model on a vendor target only, one that some count holds there
    # with --jobs builds at once; fewer at once rather than cut finer), though none under
    # MIN_SHARD_MACS; the driver's job limit, --max-ops, --shards.
    weights = sum(nbytes(t) for t in constants(graph))
    for_memory = ctx.shards_for_memory(weights, 1) if ctx.shards_for_memory(weights, opts.jobs) else 0
    shards = max(1, getattr(opts, "shards", None) or min(for_memory, sum(costs) // MIN_SHARD_MACS))
    max_ops = getattr(opts, "max_ops", None)
    if max_ops:
        shards = max(shards, math.ceil(n / max_ops))
    # The driver kills a job after job_timeout_s: no shard may come near it (one shard is one job).
    per_mac = npu_seconds_per_mac(ctx.profile.facts)
    limit = ctx.profile.facts.get("job_timeout_s")
    if per_mac and limit:
        shards = max(shards, math.ceil(sum(costs) * per_mac / (limit * JOB_MARGIN)))
    dag = build_dataflow(graph)
    if not nx.is_directed_acyclic_graph(dag):
        raise ModelError("the graph has a cycle")
    # Cut only where the canonical graph has the same tensors, so every shard has an unrewritten twin
    # that the compile can build beside it (shard.never_worse).
    canonical = ctx.snapshots.get("canonicalize")
    live = live_bytes_after(graph, dag, set(canonical.tensors()) if canonical is not None else None)
    inside = inside_fused(graph)
    cuts = choose_cuts(costs, [math.inf if i in inside else b for i, b in enumerate(live)], min(shards, n))
    avoided = sorted({inside[i] for i in choose_cuts(costs, live, min(shards, n)) if i in inside})
    ctx.plan = shard_boundaries(graph, cuts)
    # Fewer shards than the builds' memory asks for (a step of few MACs, or --shards): fewer builds at once.
    at_once = next((j for j in range(opts.jobs, 0, -1) if ctx.shards_for_memory(weights, j) <= len(ctx.plan)), 1)
    report = {"requested": shards, "shards": len(ctx.plan), "cut_bytes": [live[c] for c in cuts], "weight_bytes": weights,
              "kept_whole": avoided,   # where the cheapest cut ran through a fused pattern
              "macs": [p.macs for p in ctx.plan], "for_memory": for_memory, "builds_at_once": at_once,
              "by_memory": not getattr(opts, "shards", None) and shards == for_memory > 1,
              "shard_weight_bytes": [sum(nbytes(t) for t in constants(p.nodes)) for p in ctx.plan]}
    if per_mac and limit:
        predicted = [p.macs * per_mac for p in ctx.plan]
        report.update(predicted_s=predicted, job_limit_s=limit * JOB_MARGIN)
        over = [p.name for p, s in zip(ctx.plan, predicted) if s > limit * JOB_MARGIN]
        if over:
            ctx.warnings.append(f"partition: {', '.join(over)} predicted over {JOB_MARGIN:g} of the NPU's "
                                f"{limit:g} s job limit (no cheaper cut was found); the board may kill them")
    return graph, report


def inside_fused(graph: gs.Graph) -> dict[int, str]:
    """The cut positions (after node i) that would run through a pattern the vendor fuses, each with
    the pattern's kind and name: a cut inside a normalization stores x^2 in fp16 (shard.passes.fused)."""
    index = {id(node): i for i, node in enumerate(graph.nodes)}
    inside = {}
    for kind, name, nodes in fused_regions(graph):
        at = [index[id(n)] for n in nodes if id(n) in index]
        for i in range(min(at, default=0), max(at, default=0)):
            inside.setdefault(i, f"{kind} {name}")
    return inside


def npu_seconds_per_mac(facts: dict) -> float | None:
    """One core at its fp16 peak (int8's on a chip without fp16; the profile's MACs a cycle and clock):
    the floor a shard's NPU time is predicted by before any build (the vendor's cycle estimate
    replaces it after)."""
    rate = (facts.get("macs_per_cycle_fp16") or facts.get("macs_per_cycle_int8", 0)) * facts.get("npu_clock_hz", 0)
    return 1.0 / rate if rate else None
