"""Control flow: a Loop of a known trip count unrolled (numerics against onnxruntime on the model
as it came, and no Loop left), one decided at run time refused in one line."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import onnxruntime as ort
import pytest
from conftest import assert_one_line_error, shard_cli
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import helper

from shard.passes.control_flow import trip_count, unroll_loops

sys.path.insert(0, str(Path(__file__).parents[1] / "bench"))
import corpus  # noqa: E402


def run(model: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)


def unrolled(path: Path) -> tuple[onnx.ModelProto, list[dict]]:
    graph = gs.import_onnx(onnx.load(path))
    changes = unroll_loops(graph)
    return gs.export_onnx(graph), changes


@settings(max_examples=12, deadline=None)
@given(steps=st.integers(1, 12), width=st.sampled_from([4, 16, 64]), seed=st.integers(0, 2**16))
def test_an_unrolled_loop_computes_what_the_loop_did(tmp_path_factory, steps, width, seed):
    path = corpus.euler_loop(tmp_path_factory.mktemp("loop") / "euler.onnx", steps=steps, width=width)
    model, changes = unrolled(path)
    assert changes == [{"node": "denoise", "op": "Loop", "reason": f"a trip count of {steps}, known at compile",
                        "action": f"unrolled: {steps} iterations of its 11 nodes"}]
    ops = [n.op_type for n in model.graph.node]
    assert "Loop" not in ops and ops.count("MatMul") == 2 * steps and ops.count("Tanh") == steps
    x = np.random.default_rng(seed).standard_normal((1, width)).astype(np.float32)
    for got, want in zip(run(model, {"x": x}), run(onnx.load(path), {"x": x})):
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_a_loop_that_can_end_early_or_runs_an_unknown_count_is_left(tmp_path):
    graph = gs.import_onnx(onnx.load(corpus.euler_loop(tmp_path / "e.onnx", trips="steps")))
    (loop,) = [n for n in graph.nodes if n.op == "Loop"]
    assert trip_count(loop) is None and unroll_loops(graph) == []   # the count is an input
    graph = gs.import_onnx(onnx.load(corpus.euler_loop(tmp_path / "f.onnx")))
    (loop,) = [n for n in graph.nodes if n.op == "Loop"]
    assert trip_count(loop) == 8
    body = loop.attrs["body"]
    stop = gs.Variable("stop", dtype=np.bool_, shape=[])   # the body decides when to stop: a while loop
    body.nodes.append(gs.Node("Less", inputs=[body.nodes[1].outputs[0], gs.Constant("half", np.array(0.5, np.float32))],
                              outputs=[stop]))
    body.outputs[0] = stop
    assert trip_count(loop) is None


def test_a_loop_is_compiled_once_its_trip_count_is_fixed(tmp_path):
    model = corpus.euler_loop(tmp_path / "flow.onnx", steps=6, trips="steps")
    res = shard_cli("compile", model, "--target", "cpu", "-o", tmp_path / "a.shard")
    assert_one_line_error(res, "Loop node 'denoise' decides at run time", "--input-value NAME=VALUE (steps)")
    res = shard_cli("compile", model, "--target", "cpu", "-o", tmp_path / "b.shard", "--input-value", "steps=6")
    assert res.returncode == 0, res.stderr
    assert "denoise (Loop): a trip count of 6, known at compile; unrolled: 6 iterations of its 11 nodes" in res.stdout
    res = shard_cli("verify", tmp_path / "b.shard", "--reference", model, "--backend", "cpu", "--min-cosine", "0.99999")
    assert res.returncode == 0 and "PASS" in res.stdout, res.stdout + res.stderr


@pytest.mark.parametrize("steps", [1, 3])
def test_a_loop_carried_value_that_is_the_body_input_itself_passes_through(tmp_path, steps):
    # a carried value the body hands on unchanged, beside one it updates
    f = onnx.TensorProto.FLOAT
    body = helper.make_graph([helper.make_node("Add", ["a_in", "b_in"], ["a_out"]),
                              helper.make_node("Identity", ["c"], ["c_out"])], "b",
                             [helper.make_tensor_value_info("i", onnx.TensorProto.INT64, [1]),
                              helper.make_tensor_value_info("c", onnx.TensorProto.BOOL, [1]),
                              helper.make_tensor_value_info("a_in", f, [2]), helper.make_tensor_value_info("b_in", f, [2])],
                             [helper.make_tensor_value_info("c_out", onnx.TensorProto.BOOL, [1]),
                              helper.make_tensor_value_info("a_out", f, [2]), helper.make_tensor_value_info("b_in", f, [2])])
    graph = helper.make_graph([helper.make_node("Loop", ["n", "", "a", "b"], ["ya", "yb"], body=body, name="acc")], "g",
                              [helper.make_tensor_value_info("a", f, [2]), helper.make_tensor_value_info("b", f, [2])],
                              [helper.make_tensor_value_info("ya", f, [2]), helper.make_tensor_value_info("yb", f, [2])],
                              [onnx.numpy_helper.from_array(np.array([steps], np.int64), "n")])
    path = tmp_path / "acc.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), path)
    model, changes = unrolled(path)
    assert len(changes) == 1 and "Loop" not in [n.op_type for n in model.graph.node]
    feeds = {"a": np.array([1.0, 2.0], np.float32), "b": np.array([0.5, -1.0], np.float32)}
    got = run(model, feeds)
    np.testing.assert_allclose(got[0], feeds["a"] + steps * feeds["b"])
    np.testing.assert_allclose(got[1], feeds["b"])
    for g, w in zip(got, run(onnx.load(path), feeds)):
        np.testing.assert_allclose(g, w)
