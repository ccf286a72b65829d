"""int8_replica and the mixed search's ranking on small synthetic graphs: with its gates off the
replica is the graph; a gate on gives the vendor's int8 arithmetic for that linear (per-tensor
asymmetric input and output, per-channel weights), written here in numpy."""

from __future__ import annotations

import numpy as np
import pytest
import onnx_graphsurgeon as gs
from hypothesis import given
from hypothesis import strategies as st
from conftest import make_model, run_ort
from onnx import helper, numpy_helper

from shard.calibration import collect_stats
from shard.graph import infer_shapes
from shard.compilation.variants import HELD_OUT, IN_TURN, kept_before, next_count, sample_folds
from shard.precision import (GATES, bisect_prefix, int8_replica, is_int8_candidate, next_prefix, rank_linears,
                             worst_cosine)


def two_linears(seed: int = 0, loud: float = 1.0):
    """x -> MatMul(w1) + b1 -> Relu -> MatMul(w2): the second linear's weights scaled by `loud`."""
    rng = np.random.default_rng(seed)
    w1 = rng.standard_normal((16, 32)).astype(np.float32) / 4
    w2 = rng.standard_normal((32, 8)).astype(np.float32) * np.float32(loud) / 6
    b1 = rng.standard_normal(32).astype(np.float32)
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"], name="fc1"),
             helper.make_node("Add", ["h", "b1"], ["hb"], name="bias1"),
             helper.make_node("Relu", ["hb"], ["r"], name="relu"),
             helper.make_node("MatMul", ["r", "w2"], ["y"], name="fc2")]
    inits = [numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(b1, "b1"), numpy_helper.from_array(w2, "w2")]
    return make_model(nodes, [("x", [1, 6, 16])], [("y", [1, 6, 8])], inits), (w1, b1, w2)


def fake_int8(x: np.ndarray, low: float, high: float) -> np.ndarray:
    low, high = min(low, 0.0), max(high, 0.0)
    scale = np.float32((high - low) / 255)
    zero = np.clip(np.round(-low / scale), 0, 255)
    return ((np.clip(np.round(x / scale) + zero, 0, 255) - zero) * scale).astype(np.float32)


def test_replica_is_the_graph_with_gates_off_and_the_vendors_int8_with_a_gate_on():
    model, (w1, b1, w2) = two_linears()
    rng = np.random.default_rng(1)
    samples = [{"x": rng.standard_normal((1, 6, 16)).astype(np.float32)} for _ in range(3)]
    graph = gs.import_onnx(model)
    stats = collect_stats(model, samples)
    linears = [n for n in graph.nodes if is_int8_candidate(n)]
    replica = gs.export_onnx(int8_replica(graph, stats, linears))
    replica.ir_version = 8
    x = samples[0]["x"]
    off = run_ort(replica, {"x": x, GATES: np.zeros(2, np.float32)}, optimize=False)[0]
    np.testing.assert_array_equal(off, run_ort(model, {"x": x}, optimize=False)[0])
    # fc1 alone in int8: input and (bias-fused) output per tensor, weights per column
    q1 = fake_int8(x, stats["x"].min, stats["x"].max) @ (np.round(w1 / (np.abs(w1).max(0) / 127)) *
                                                         (np.abs(w1).max(0) / 127)) + b1
    expected = np.maximum(fake_int8(q1, stats["hb"].min, stats["hb"].max), 0) @ w2
    got = run_ort(replica, {"x": x, GATES: np.array([1, 0], np.float32)}, optimize=False)[0]
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4 * float(np.abs(expected).max()))
    assert not np.allclose(got, off, rtol=1e-3, atol=0)   # int8 does move the output


def test_ranking_orders_the_linears_by_their_int8_loss_per_mac():
    model, _ = two_linears()
    rng = np.random.default_rng(2)
    feeds = [{"x": rng.standard_normal((1, 6, 16)).astype(np.float32)} for _ in range(2)]
    ranking, every = rank_linears(infer_shapes(gs.import_onnx(model)), feeds)
    assert {c.node: c.macs for c in ranking} == {"fc1": 6 * 16 * 32, "fc2": 6 * 32 * 8}
    assert all(0 < c.error < 0.1 for c in ranking)
    per_mac = [c.error / c.macs for c in ranking]
    assert per_mac == sorted(per_mac, reverse=True)
    # the prefix curve: both in int8, then the first moved to fp16, then none in int8
    assert every < 1.0 - 1e-6 and ranking[-1].cosine_after == pytest.approx(1.0, abs=1e-12)
    assert ranking[0].cosine_after == pytest.approx(1.0 - ranking[1].error, abs=1e-12)   # the second alone in int8
    assert rank_linears(infer_shapes(gs.import_onnx(model)), feeds) == (ranking, every)   # deterministic


def test_a_nan_in_any_output_of_any_sample_is_the_worst_cosine():
    # min() over floats keeps a NaN only where it comes first: a round whose second output went NaN
    # read as that of its first
    good, same = np.ones(4, np.float32), np.ones(4, np.float32)
    nan = np.array([1, np.nan, 1, 1], np.float32)
    assert worst_cosine(["a", "b"], [[good, good]], [[same, same]]) == pytest.approx(1.0)
    assert worst_cosine(["a", "b"], [[good, good]], [[same, nan]]) == -1.0
    assert worst_cosine(["a", "b"], [[good, good], [good, good]], [[same, same], [nan, same]]) == -1.0


def test_next_round_takes_the_fewest_linears_the_replica_says_suffice():
    ranking = [{"cosine_after": c} for c in (0.9990, 0.9995, 0.99985, 0.99995, 1.0)]
    # target 0.999 allows 1e-3 of loss; aim at 0.8e-3 as predicted
    assert next_prefix(ranking, 1e-3, predicted=2e-3, measured=2e-3, done=0) == 2
    # the last round lost twice what the replica said: aim at 0.4e-3
    assert next_prefix(ranking, 1e-3, predicted=2e-3, measured=4e-3, done=0) == 3
    assert next_prefix(ranking, 1e-3, predicted=2e-3, measured=1e-3, done=3) == 4   # always at least one more
    assert next_prefix(ranking, 1e-5, predicted=1e-3, measured=1e-3, done=0) == 5   # none suffices: all


def test_after_a_round_reaches_the_target_the_next_bisects_by_macs():
    ranking = [{"macs": m} for m in (10, 10, 40, 20, 20)]   # cumulative 0, 10, 20, 60, 80, 100
    assert bisect_prefix(ranking, failed=0, passed=5) == 3      # halfway in MACs (50) is nearest 60
    assert bisect_prefix(ranking, failed=1, passed=3) == 2
    assert bisect_prefix(ranking, failed=2, passed=3) is None   # no count between
    assert bisect_prefix(ranking, failed=0, passed=2) == 1


def round_of(promoted: int, cosine: float, share: float = 0.5, predicted: float = 0.998) -> dict:
    return {"promoted": tuple(range(promoted)), "cosine": cosine, "int8_mac_share": share, "predicted": predicted}


def test_mixed_rounds_search_for_the_most_int8_that_reaches_the_target():
    linears = [{"macs": 10, "cosine_after": c} for c in (0.9985, 0.999, 0.9993, 0.9995, 0.9997, 0.9999, 1.0, 1.0)]
    first = round_of(0, 0.998, predicted=0.998)
    assert next_count([first], linears, 0.999) == 3                 # the fewest predicted under 0.8 of the loss allowed
    assert next_count([first], [], 0.999) is None                    # nothing ranked: the first round reached it
    reached = round_of(3, 0.9993)
    assert next_count([first, reached], linears, 0.999) == 1         # halfway in MACs between 0 (short) and 3
    short = round_of(1, 0.9985)
    assert next_count([first, reached, short], linears, 0.999) == 2
    assert next_count([first, reached, short, round_of(2, 0.9991)], linears, 0.999) is None   # 1 short, 2 reached
    missing = [first, round_of(1, 0.9982), round_of(2, 0.9984), round_of(3, 0.9986)]
    assert next_count(missing, linears, 0.999) == len(linears)       # the last round: every linear in fp16
    assert next_count([*missing, round_of(8, 0.9999)], linears, 0.999) is None   # no rounds left
    # which round is kept: one that reaches the target, the most int8 among those; else the most faithful
    assert kept_before(round_of(3, 0.9991, share=0.6), round_of(4, 0.9995, share=0.5), 0.999)
    assert not kept_before(round_of(2, 0.9989, share=0.8), round_of(4, 0.9991, share=0.5), 0.999)
    assert kept_before(round_of(2, 0.9989), round_of(0, 0.998), 0.999)


@given(st.integers(1, 3 * IN_TURN))
def test_mixed_precision_holds_out_a_quarter_of_many_samples_and_every_one_of_few_in_turn(n):
    samples = [{"x": np.full(1, k)} for k in range(n)]
    folds = sample_folds(samples)
    ids = [([int(s["x"][0]) for s in fit], [int(s["x"][0]) for s in held]) for fit, held in folds]
    if n == 1:   # one sample both sets the ranges and accepts
        assert ids == [([0], [0])]
    elif n >= IN_TURN:   # the last quarter held out of the ranges
        assert ids == [(list(range(n - n // HELD_OUT)), list(range(n - n // HELD_OUT, n)))]
    else:   # each sample accepts once, in a fold whose ranges come from all the others
        assert len(folds) == min(n, HELD_OUT)
        assert sorted(k for _, held in ids for k in held) == list(range(n))
        assert all(held and sorted(fit + held) == list(range(n)) for fit, held in ids)
