"""Patterns the vendor compiler fuses into one op and computes safely only as one: normalizations
written out op by op (RMSNorm, LayerNorm) and attention.

A trained decoder's residual stream reaches values whose square leaves fp16 (SmolLM2-135M: 24,926,
squared 6.2e8). Whole, toolkit 2.5.0 fuses `x * 1/sqrt(mean(x^2) + eps)` into one normalization and
the simulator matches onnxruntime at 0.99999; cut inside it, the square is stored and reduced in fp16
and turns inf (cosine 0.038). So partition never cuts inside these, and scale_sandwich carries a
factor through a normalization by its epsilon, as it does for LayerNormalization.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_graphsurgeon as gs

from shard.passes.tile_attention import find_attention, only_consumer

# Between the mean of the squares and the division by their root: the epsilon, the root, a reciprocal.
TO_ROOT = ("Add", "Sqrt", "Reciprocal", "Div", "Cast")


@dataclass
class Norm:
    """x / sqrt(mean(x^2) + eps) written out (x the input, or its deviation from its own mean)."""

    kind: str                 # "rms" or "layer"
    input: gs.Tensor          # what the normalization reads
    nodes: list[gs.Node]      # every node of it, the one that divides x last
    eps: tuple[gs.Node, int] | None   # the Add of the epsilon and its constant's slot

    @property
    def name(self) -> str:
        return self.nodes[-1].name


def squared(node: gs.Node | None) -> gs.Tensor | None:
    """x where `node` is x^2 (Pow by a constant 2, or x * x), else None."""
    if node is None:
        return None
    if node.op == "Pow" and isinstance(node.inputs[1], gs.Constant) and np.all(node.inputs[1].values == 2):
        return node.inputs[0]
    if node.op == "Mul" and node.inputs[0] is node.inputs[1]:
        return node.inputs[0]
    return None


def normalizations(graph: gs.Graph) -> list[Norm]:
    """Every normalization written out op by op: a ReduceMean of x^2, then an epsilon, a root and a
    reciprocal in any order (one reader each), ending in the Mul or Div that reads x itself."""
    found = []
    for mean in (n for n in graph.nodes if n.op == "ReduceMean"):
        square = mean.inputs[0].inputs[0] if mean.inputs[0].inputs else None
        x = squared(square)
        if x is None:
            continue
        chain, t, last = [], mean.outputs[0], None
        while (user := only_consumer(t)) is not None:
            if user.op in ("Mul", "Div") and x in user.inputs:
                last = user
                break
            if user.op not in TO_ROOT:
                break
            chain.append(user)
            t = user.outputs[0]
        if last is None or not any(n.op == "Sqrt" for n in chain):
            continue
        eps = next(((n, i) for n in chain if n.op == "Add" for i, c in enumerate(n.inputs)
                    if isinstance(c, gs.Constant)), None)
        nodes, kind, source = [square, mean, *chain, last], "rms", x
        centre = x.inputs[0] if x.inputs else None   # LayerNorm: x - mean(x)
        if centre is not None and centre.op == "Sub" and centre.inputs[1].inputs \
                and centre.inputs[1].inputs[0].op == "ReduceMean" \
                and centre.inputs[1].inputs[0].inputs[0] is centre.inputs[0]:
            nodes, kind, source = [centre.inputs[1].inputs[0], centre, *nodes], "layer", centre.inputs[0]
        found.append(Norm(kind, source, nodes, eps))
    return found


def fused_regions(graph: gs.Graph) -> list[tuple[str, str, list[gs.Node]]]:
    """(kind, name, nodes) of every pattern a cut must not run through: normalizations and attention
    (scores, mask, softmax and the value product, which the vendor fuses into one exSDPAttention)."""
    regions = [(f"{n.kind} norm", n.name, n.nodes) for n in normalizations(graph)]
    regions += [("attention", a.softmax.name, [a.qk, *a.pre, a.softmax, *a.post, a.pv]) for a in find_attention(graph)]
    return regions
