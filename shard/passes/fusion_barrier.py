"""fusion_barrier: keep the vendor compiler from fusing attention tiles back into one op.

Modes (--fusion-barrier):
  check  (default) insert nothing; after the build the compile reads the vendor layer table and
         reports, per attention, how many tiles are still layers of their own (rknn-toolkit2 2.5.0
         keeps every tile: measured on SigLIP-base-512, 16 of 16 per layer).
  rules  also pass the toolkit's own switch, config(disable_rules=[...]) with the rule names given
         by --disable-rule, recorded in the bundle's build options so the simulator replays them.
  pill   add a poison pill to every tile output: out + sigmoid(x0) * eps, x0 one element of the
         tile's own query rows. It depends on the tile's input, so no rule can merge two tiles, and
         it moves each output element by less than eps (sigmoid < 1): the bound is reported.
"""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from shard.passes.context import PassContext
from shard.passes.tile_attention import TILE_MARK

MODES = ("check", "rules", "pill")
PILL_EPS = 2.0 ** -14   # the smallest fp16 normal: below the NPU's own rounding of attention outputs


def tile_outputs(graph: gs.Graph) -> list[tuple[gs.Node, gs.Node]]:
    """(tile output node, the Slice of Q feeding the tile) for every attention tile in the graph."""
    pairs, by_name = [], {n.name: n for n in graph.nodes}
    for node in graph.nodes:
        query_tile_out = node.name.endswith("/pv") and "/key" not in node.name
        if TILE_MARK not in node.name or not (query_tile_out or node.name.endswith("/lse/out")):
            continue
        tile = node.name.rsplit("/", 2 if node.name.endswith("/lse/out") else 1)[0]
        pairs.append((node, by_name.get(f"{tile}/q")))
    return pairs


def add_pill(graph: gs.Graph, out_node: gs.Node, source: gs.Tensor, eps: float) -> None:
    out = out_node.outputs[0]
    rank = len(source.shape)
    name = out_node.name + "/pill"
    starts, ends = [0] * rank, [1] * rank
    params = [gs.Constant(f"{name}/{p}", np.array(v, np.int64)) for p, v in
              (("starts", starts), ("ends", ends), ("axes", list(range(rank))))]
    x0 = gs.Variable(f"{name}/x0", dtype=out.dtype, shape=[1] * rank)
    sig = gs.Variable(f"{name}/sig", dtype=out.dtype, shape=[1] * rank)
    scaled = gs.Variable(f"{name}/scaled", dtype=out.dtype, shape=[1] * rank)
    inner = gs.Variable(f"{name}/in", dtype=out.dtype, shape=list(out.shape))
    out_node.outputs[0] = inner
    graph.nodes += [gs.Node("Slice", f"{name}/slice", inputs=[source, *params], outputs=[x0]),
                    gs.Node("Sigmoid", f"{name}/sigmoid", inputs=[x0], outputs=[sig]),
                    gs.Node("Mul", f"{name}/mul", inputs=[sig, gs.Constant(f"{name}/eps", np.array(eps, np.float32))],
                            outputs=[scaled]),
                    gs.Node("Add", f"{name}/add", inputs=[inner, scaled], outputs=[out])]


def fusion_barrier(graph: gs.Graph, ctx: PassContext) -> tuple[gs.Graph, dict]:
    mode = ctx.options.fusion_barrier
    rules = list(ctx.options.disable_rules)
    report: dict = {"mode": mode}
    if mode == "rules":
        ctx.build_config["disable_rules"] = rules
        report["disable_rules"] = rules
    if mode == "pill":
        pairs = [(o, q) for o, q in tile_outputs(graph) if q is not None]
        for out_node, q in pairs:
            add_pill(graph, out_node, q.outputs[0], PILL_EPS)
        report.update(pills=len(pairs), eps=PILL_EPS,
                      worst_case=f"each attention output element moves by less than {PILL_EPS:.3g} (sigmoid < 1)")
    return graph, report
