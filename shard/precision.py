"""Mixed precision: which ops of a shard run in int8 and which stay in fp16.

On RK3588 the MACs of a transformer are in its constant-weight linears (a MatMul with constant
weights lowers to a Conv: per-channel int8 weights), about 95 % at sequence 128. `mixed` runs them
in int8 and everything else in fp16. On a trained encoder that alone is not enough: its linears
read and write a few channels far past the rest, and the vendor quantizes activations per tensor
(all-mpnet-base-v2's first four layers fed the reference's tensors: cosine 0.78).
scale_sandwich's outlier splits move those channels to fp16 side linears (the same four layers:
0.9954, with 96 % of the MACs in int8).

What is left is moved to fp16 linear by linear. The order comes from int8_replica, the graph in
onnxruntime with the vendor's int8 arithmetic written in per linear (it gives the simulator's
error of one linear to 3 digits; the whole mpnet bundle's cosine within 6e-4: 0.99752 against
0.99696): each linear alone in int8, the output's loss per MAC. The replica's cosine for each
prefix of that order says how many to move; the bundle's simulator cosine on the calibration
samples held out of the ranges decides, round by round (next_prefix, shard.compilation.variants.
compile_mixed); once a round reaches the target, the rounds left bisect between it and the last that
fell short (bisect_prefix), for the most int8 that still reaches it.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np
import onnx_graphsurgeon as gs

from shard.calibration import graph_stats, ort_session
from shard.compare import compare, worst_of
from shard.macs import estimate_macs

LINEAR_OPS = ("MatMul", "Gemm", "Conv")
SIDE = "/outlier/"   # in the name of an outlier split's fp16 side linears (shard.passes.scale_sandwich)
MAX_MIXED_ROUNDS = 5   # rounds of mixed precision (int8 on the simulator, fp8 in onnxruntime); the last all fp16


def is_linear(node: gs.Node) -> bool:
    """A constant-weight linear: what the vendor quantizes per channel, and where the MACs are."""
    return node.op in LINEAR_OPS and len(node.inputs) > 1 and isinstance(node.inputs[1], gs.Constant) \
        and isinstance(node.inputs[0], gs.Variable)


def is_int8_candidate(node: gs.Node) -> bool:
    """A linear mixed precision runs in int8 unless promoted: every one but an outlier split's side
    linears, which carry the channels int8 cannot hold and stay fp16."""
    return is_linear(node) and SIDE not in node.name


def int8_owner(node: gs.Node) -> str | None:
    """The int8 linear an op runs with: the linear itself, and a constant it alone adds to the
    linear's output (an exported bias, which the vendor folds into the Conv). With the bias Add
    marked fp16 the vendor ran the linear in fp16 as well, fused with the residual Add after it into
    an fp16 ConvAdd (vit-tiny, two layers: 4 of 12 linears, 57 % of the MACs in int8 against 100 %;
    SigLIP-512, one layer: 11.8 M estimated cycles against 7.7 M). The Add joining an outlier split's
    side linears stays fp16: in int8 the main linear's output is quantized once more before it
    (all-mpnet-base-v2: 0.99696 -> 0.99556 at the same int8 share). None for every other op."""
    if is_int8_candidate(node):
        return node.name
    if node.op != "Add" or len(node.inputs) != 2:
        return None
    variables = [t for t in node.inputs if not isinstance(t, gs.Constant)]
    if len(variables) != 1 or len(variables[0].inputs) != 1 or len(variables[0].outputs) != 1:
        return None
    return int8_owner(variables[0].inputs[0])


def float16_names(nodes: list[gs.Node], promoted: set[str] = frozenset(), inputs: list[str] = ()) -> list[str]:
    """The names (node and output tensor) of every op kept in fp16: all but the linears and their
    bias Adds (int8_owner), which are int8 unless `promoted` (the linears' node names) moves them to
    fp16 too; and the shard's `inputs`, which the toolkit would otherwise take in int8 (measured:
    worst cosine 0.747 -> 0.780 on the first four layers of all-mpnet-base-v2)."""
    names = list(inputs)
    for node in nodes:
        owner = int8_owner(node)
        if owner is not None and owner not in promoted:
            continue
        names += [node.name, *(t.name for t in node.outputs if t.name)]
    return sorted(set(names))


@dataclass
class Candidate:
    node: str
    macs: int
    error: float          # 1 - the output's cosine when this linear alone runs in int8 (int8_replica)
    cosine_after: float = 1.0   # the replica's cosine with this linear and every one before it in fp16


def named(graph: gs.Graph, nodes: list[gs.Node], prefix: str) -> list[gs.Node]:
    """`nodes`, each with a name no other node of the graph has (a search ranks and promotes linears by
    name: a model's unnamed ones would all be one); a node named so already keeps its name."""
    taken = Counter(n.name for n in graph.nodes)
    for k, node in enumerate(nodes):
        if not node.name or taken[node.name] > 1:
            taken[node.name] -= 1
            node.name = next(f"{prefix}{k}_{j}" for j in range(len(graph.nodes) + 1) if f"{prefix}{k}_{j}" not in taken)
            taken[node.name] += 1
    return nodes


def weight_axis(node: gs.Node) -> int:
    """The axis of a linear's weight that holds its output channels (the vendor's per-channel scales)."""
    if node.op == "Conv":
        return 0
    return 0 if node.op == "Gemm" and node.attrs.get("transB", 0) else 1


def per_channel_int8(w: np.ndarray, axis: int) -> np.ndarray:
    """Symmetric 8-bit weights, one scale per output channel: the vendor's weights (quantized_method
    'channel')."""
    reduce = tuple(i for i in range(w.ndim) if i != axis)
    scale = np.max(np.abs(w), axis=reduce, keepdims=True) / 127.0
    scale = np.where(scale > 0, scale, 1.0)
    return (np.clip(np.round(w / scale), -127, 127) * scale).astype(w.dtype)


def uint8_range(low: float, high: float) -> tuple[np.float32, np.uint8] | None:
    """The vendor's per-tensor activation quantization of a calibrated range: (scale, zero point) of
    asymmetric 8 bits over the range widened to hold 0; None for a range of one value."""
    low, high = min(low, 0.0), max(high, 0.0)
    if not high > low:
        return None
    scale = np.float32((high - low) / 255.0)
    return scale, np.uint8(np.clip(np.round(-low / scale), 0, 255))


GATES = "shard.int8_gates"


def quantized_tensors(node: gs.Node) -> tuple[gs.Tensor, gs.Tensor]:
    """The two activations the vendor quantizes per tensor around an int8 linear: its input, and its
    output after a bias Add it fuses."""
    y = node.outputs[0]
    users = list(y.outputs)
    if len(users) == 1 and users[0].op == "Add" and any(isinstance(i, gs.Constant) for i in users[0].inputs):
        y = users[0].outputs[0]
    return node.inputs[0], y


def gates_input(graph: gs.Graph, wheres: list[str], dtype=np.float32) -> list[gs.Variable]:
    """Input GATES (one float per entry of `wheres`, 0 or 1) and a scalar gate for each, named after it."""
    gates = gs.Variable(GATES, dtype=dtype, shape=[len(wheres)])
    graph.inputs.append(gates)
    scalars = []
    for k, where in enumerate(wheres):
        gate = gs.Variable(f"{where}/g", dtype=dtype)
        graph.nodes.append(gs.Node("Gather", f"{where}/g", inputs=[gates, gs.Constant(f"{where}/k", np.asarray(k))],
                                   outputs=[gate]))
        scalars.append(gate)
    return scalars


def gated_quantize(graph: gs.Graph, t: gs.Variable, gate: gs.Variable, consts: list[gs.Constant], qtype,
                   where: str) -> gs.Variable:
    """t + gate x (DequantizeLinear(QuantizeLinear(t)) - t): t itself where the gate is 0, its
    quantized form where it is 1. `consts`: the scale and zero point; `qtype`: the quantized type."""
    q = gs.Variable(f"{where}/q", dtype=qtype)
    dq, delta, gated, out = (gs.Variable(f"{where}/{k}", dtype=t.dtype) for k in ("dq", "delta", "gated", "out"))
    graph.nodes += [gs.Node("QuantizeLinear", f"{where}/quantize", inputs=[t, *consts], outputs=[q]),
                    gs.Node("DequantizeLinear", f"{where}/dequantize", inputs=[q, *consts], outputs=[dq]),
                    gs.Node("Sub", f"{where}/sub", inputs=[dq, t], outputs=[delta]),
                    gs.Node("Mul", f"{where}/gate", inputs=[delta, gate], outputs=[gated]),
                    gs.Node("Add", f"{where}/add", inputs=[t, gated], outputs=[out])]
    return out


def gated_weight(graph: gs.Graph, node: gs.Node, gate: gs.Variable, delta: np.ndarray, where: str) -> None:
    """The linear reads weight + gate x `delta` (the quantized weight less the weight): a weight-sized
    elementwise op, where a second product would double the replica's MACs."""
    weight = node.inputs[1]
    step, effective = (gs.Variable(f"{where}/{n}", dtype=weight.dtype) for n in ("wgated", "weight"))
    graph.nodes += [gs.Node("Mul", f"{where}/wgate", inputs=[gs.Constant(f"{where}/wdelta", delta), gate],
                            outputs=[step]),
                    gs.Node("Add", f"{where}/wadd", inputs=[weight, step], outputs=[effective])]
    node.inputs[1] = effective


def int8_replica(graph: gs.Graph, stats: dict, linears: list[gs.Node]) -> gs.Graph:
    """A copy of the graph that runs each of `linears` as the vendor's int8 does, where its gate
    (input GATES, one float per linear, 0 or 1) says so: the input and the output fake-quantized
    per tensor (asymmetric, 8 bits, the calibrated range with 0 in it; the output after a bias Add
    the vendor fuses), the weights per output channel. With every gate at 0 it is the graph itself.
    On all-mpnet-base-v2's linears this arithmetic gives the simulator's error to 3 digits (0.1777
    against 0.1777, 0.0735 against 0.0737)."""
    graph = graph.copy()
    by_name = {n.name: n for n in graph.nodes}
    chosen = [by_name[n.name] for n in linears]   # gate k is linears[k]
    wheres = [f"shard.int8/{k}" for k in range(len(chosen))]
    gates = gates_input(graph, wheres)

    def quantized(t: gs.Variable, gate: gs.Variable, where: str) -> gs.Variable | None:
        s = stats.get(t.name)
        quantization = uint8_range(s.min, s.max) if s is not None else None
        if quantization is None:
            return None
        scale, zero = quantization
        consts = [gs.Constant(f"{where}/scale", np.asarray(scale)), gs.Constant(f"{where}/zero", np.asarray(zero))]
        return gated_quantize(graph, t, gate, consts, np.uint8, where)

    for node, gate, where in zip(chosen, gates, wheres):
        x, y = quantized_tensors(node)
        x = quantized(x, gate, f"{where}/in")
        if x is not None:
            node.inputs[0] = x
        weight = node.inputs[1].values
        gated_weight(graph, node, gate, per_channel_int8(weight, weight_axis(node)) - weight, where)
        out = quantized(y, gate, f"{where}/out")
        if out is not None:
            for user in [u for u in y.outputs if not u.name.startswith(f"{where}/out/")]:
                user.inputs = [out if i is y else i for i in user.inputs]
            graph.outputs = [out if o is y else o for o in graph.outputs]
    return graph.toposort()


def worst_cosine(outputs: list[str], expected: list[list[np.ndarray]], got: list[list[np.ndarray]]) -> float:
    """The lowest cosine of any output of any sample (a NaN counts as worse than any cosine)."""
    worst = worst_of(compare(o, e, g) for es, gs_ in zip(expected, got) for o, e, g in zip(outputs, es, gs_)).cosine
    return worst if worst == worst else -1.0


def by_frame(per_sample: list[list[np.ndarray]], frames: int) -> list[list[np.ndarray]]:
    """Each sample's outputs cut into its `frames` frames (their leading axis, as a `--batch` compile
    makes them), so that a check counts every frame on its own, as a run of one frame would: pooled,
    a frame far off among 16 is averaged away."""
    if frames == 1:
        return per_sample
    return [[o[k] for o in outs] for outs in per_sample for k in range(frames)]


def single_errors(run, outputs: list[str], count: int, dtype, expected: list | None = None) -> list[float]:
    """For each of a replica's `count` gates alone on: 1 - the worst cosine of `run(gates)` (outputs per
    sample) against every gate off (`expected`, else run here)."""
    expected = run(np.zeros(count, dtype)) if expected is None else expected
    return [1.0 - worst_cosine(outputs, expected, run(gate)) for gate in np.eye(count, dtype=dtype)]


def rank_linears(graph: gs.Graph, feeds: list[dict[str, np.ndarray]], samples: int = 2) -> tuple[list[Candidate], float]:
    """The graph's int8 candidates, the most harmful per MAC first, and the replica's cosine with all
    of them in int8. A candidate's error: 1 - the outputs' worst cosine (against fp32, over the first
    `samples` feeds) when it alone runs in int8 in int8_replica; its cosine_after: the same with it
    and every candidate before it moved to fp16, the search's prediction for that prefix. A linear's
    own int8 error is a poor guide: on all-mpnet-base-v2 the output projections' inputs lose the most,
    yet moving them and the FFN outputs (half of the linears' MACs) to fp16 took the simulator only
    from 0.9953 to 0.9977; ranked by the replica, a quarter of the MACs took it to 0.9984. Not on the
    held-out samples a round is accepted on: ranked on them too, all-mpnet-base-v2 kept 64.5 % int8
    at 0.99912 held out, and its 4 unseen test sentences came out at 0.99864 (what chooses a round
    must not be what accepts it)."""

    linears = [n for n in graph.nodes if is_int8_candidate(n)]
    if not linears:
        return [], 1.0
    stats = graph_stats(graph, feeds, sorted({t.name for n in linears for t in quantized_tensors(n)}))
    replica = gs.export_onnx(int8_replica(graph, stats, linears), do_type_check=False)
    session = ort_session(replica)
    outputs = [o.name for o in session.get_outputs()]
    inputs = {i.name for i in session.get_inputs()}
    feeds = [{k: v for k, v in f.items() if k in inputs} for f in feeds[:samples]]

    def run(gates: np.ndarray) -> list[list[np.ndarray]]:
        return [session.run(outputs, {**f, GATES: gates}) for f in feeds]

    expected = run(np.zeros(len(linears), np.float32))

    def cosine(gates: np.ndarray) -> float:
        return worst_cosine(outputs, expected, run(gates))

    index = {n.name: k for k, n in enumerate(linears)}
    ranked = sorted((Candidate(n.name, estimate_macs(n), e) for n, e in
                     zip(linears, single_errors(run, outputs, len(linears), np.float32, expected))),
                    key=lambda c: (-c.error / max(c.macs, 1), c.node))
    gates = np.ones(len(linears), np.float32)
    every = cosine(gates)
    for c in ranked:
        gates[index[c.node]] = 0.0
        c.cosine_after = cosine(gates)
    return ranked, every


SAFETY = 0.8   # a round aims at this share of the loss the target allows, as the replica predicts it


def next_prefix(ranking: list[dict], allowed: float, predicted: float, measured: float, done: int) -> int:
    """How many of the ranking's linears the next round moves to fp16: the fewest (more than `done`)
    whose predicted loss (1 - cosine_after), scaled by how far the last round's measurement passed
    its prediction, stays under SAFETY x `allowed` (the loss the target allows); all of them if none."""
    factor = max(measured / predicted, 1.0) if predicted > 0 else 1.0
    for k in range(done, len(ranking)):
        if (1.0 - ranking[k]["cosine_after"]) * factor <= SAFETY * allowed:
            return k + 1
    return len(ranking)


def bisect_prefix(ranking: list[dict], failed: int, passed: int) -> int | None:
    """Once a round has reached the target: a count of the ranking's linears between `failed` (a
    prefix that fell short) and `passed` (one that reached it) whose MACs lie halfway between theirs,
    the next round's try at more int8; None where no count lies between."""
    if passed - failed < 2:
        return None
    macs = np.cumsum([0] + [c["macs"] for c in ranking])
    middle = (macs[failed] + macs[passed]) / 2
    return int(np.clip(np.argmin(np.abs(macs - middle)), failed + 1, passed - 1))


def next_count(rounds: list[dict], linears: list[dict], target: float) -> int | None:
    """How many of the ranked linears the next round of mixed precision (int8 or fp8) moves to fp16; None
    to stop. `rounds`: {"promoted", "cosine", "predicted"} each.
    Until a round reaches the target, the replica's prediction scaled by the last miss (next_prefix),
    and all of them in the last round; after, the count halfway in MACs between the fewest that
    reached it and the most that fell short (bisect_prefix), while rounds are left."""
    if len(rounds) == MAX_MIXED_ROUNDS or not linears:
        return None
    counts = {len(r["promoted"]): r["cosine"] >= target for r in rounds}
    passed = [c for c, ok in counts.items() if ok]
    if passed:
        fewest = min(passed)
        return bisect_prefix(linears, max((c for c in counts if c < fewest), default=0), fewest)
    last = rounds[-1]
    if len(last["promoted"]) == len(linears):
        return None
    if len(rounds) + 1 == MAX_MIXED_ROUNDS:
        return len(linears)
    return next_prefix(linears, 1.0 - target, 1.0 - last["predicted"], 1.0 - last["cosine"], len(last["promoted"]))
