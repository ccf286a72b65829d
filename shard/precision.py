"""Mixed precision: which ops of a shard run in int8 and which stay in fp16.

On RK3588 the MACs of a transformer are in its constant-weight linears (a MatMul with constant
weights lowers to a Conv: per-channel int8 weights), about 95 % at sequence 128. Measured on
all-mpnet-base-v2's first four layers, on the simulator fed the reference's tensors (8 sentences):
every op in int8, cosine 0.50-0.63; residual adds and LayerNorms in fp16, 0.74-0.87; only the
linears in int8, 0.75-0.88. What remains is the linears' int8 itself (numpy, the same layers:
per-tensor int8 of the input costs 3.8 % of the output's norm at the median linear, 12 % at the
worst; per-channel int8 weights 0.5 %). Smoothing their inputs did not help the real build
(shard.passes.scale_sandwich's docstring has the numbers).

So `mixed` starts from the linears in int8 and everything else in fp16, and moves linears to fp16
in the order of their input's int8 error (measured on the calibration samples) until the bundle's
simulator cosine on those samples reaches the target: a proxy orders the candidates, the simulator
decides (shard.compiler.compile_mixed).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_graphsurgeon as gs

LINEAR_OPS = ("MatMul", "Gemm", "Conv")
MIXED_ROUNDS = (0.0, 0.125, 0.25, 0.5, 1.0)   # shares of the linears' MACs moved to fp16, round by round


def is_linear(node: gs.Node) -> bool:
    """A constant-weight linear: what the vendor quantizes per channel, and where the MACs are."""
    return node.op in LINEAR_OPS and len(node.inputs) > 1 and isinstance(node.inputs[1], gs.Constant) \
        and isinstance(node.inputs[0], gs.Variable)


def float16_names(nodes: list[gs.Node], promoted: set[str] = frozenset(), inputs: list[str] = ()) -> list[str]:
    """The names (node and output tensor) of every op kept in fp16: all but the linears, which are
    int8 unless `promoted` (node names) moves them to fp16 too; and the shard's `inputs`, which the
    toolkit would otherwise take in int8 (measured: worst cosine 0.747 -> 0.780 on the first four
    layers of all-mpnet-base-v2)."""
    names = list(inputs)
    for node in nodes:
        if is_linear(node) and node.name not in promoted:
            continue
        names += [node.name, *(t.name for t in node.outputs if t.name)]
    return sorted(set(names))


def promote_share(ranking: list[dict], share: float) -> list[str]:
    """The first linears of `ranking` ({"node", "macs"}, most sensitive first) whose MACs make up at most
    `share` of the total: the ones a round of mixed precision (int8 or fp8) moves to fp16."""
    total = sum(c["macs"] for c in ranking) or 1
    promoted, macs = [], 0
    for candidate in ranking:
        if macs + candidate["macs"] > share * total + 1e-9:
            break
        promoted.append(candidate["node"])
        macs += candidate["macs"]
    return promoted


@dataclass
class Candidate:
    node: str
    macs: int
    error: float      # the int8 error of its input: |q(x) - x| / |x| over the samples


def int8_error(x: np.ndarray) -> float:
    """Relative error of per-tensor asymmetric 8-bit quantization, the vendor's activation scheme."""
    x = np.asarray(x, np.float64)
    low, high = min(float(x.min()), 0.0), max(float(x.max()), 0.0)
    if high == low:
        return 0.0
    scale = (high - low) / 255
    zero = np.round(-low / scale)
    q = (np.clip(np.round(x / scale) + zero, 0, 255) - zero) * scale
    return float(np.linalg.norm(q - x) / max(np.linalg.norm(x), 1e-30))


def rank_linears(graph: gs.Graph, feeds: list[dict[str, np.ndarray]]) -> list[Candidate]:
    """The graph's linears, the most int8-sensitive first (their input's error on the samples, the
    range taken over all samples as the vendor's calibration does)."""
    from shard.calibration import run_each
    from shard.passes.partition import estimate_macs

    linears = [n for n in graph.nodes if is_linear(n)]
    names = list(dict.fromkeys(n.inputs[0].name for n in linears))
    values: dict[str, list[np.ndarray]] = {}
    graph_inputs = {t.name for t in graph.inputs}
    model = gs.export_onnx(graph.copy(), do_type_check=False)
    for feed, got in zip(feeds, run_each(model, feeds, [n for n in names if n not in graph_inputs])):
        for name in names:
            values.setdefault(name, []).append(feed[name] if name in graph_inputs else got[name])
    ranked = [Candidate(n.name, estimate_macs(n), int8_error(np.concatenate([v.ravel() for v in values[x]])))
              for n in linears if (x := n.inputs[0].name) in values]
    return sorted(ranked, key=lambda c: (-c.error, c.node))
