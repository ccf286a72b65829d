"""npu_forms: Softmax rewritten into NPU ops on chips whose profile finds no Softmax on the NPU;
numerics in onnxruntime before and after, structure, and the real rk3568 build."""

from __future__ import annotations

import json

import numpy as np
import onnx_graphsurgeon as gs
import pytest
from conftest import make_model, run_ort, shard_cli
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import helper, numpy_helper

from shard.graph import infer_shapes
from shard.passes import PassContext
from shard.passes.npu_forms import npu_forms
from shard.profile import Limit, Profile, load_profile

NO_SOFTMAX = Profile("rk3568", 1, "test", {
    "softmax-width@r1": Limit(0, "cpu-fallback", "N=1 fails (cpu-fallback)", "test", failing=1),
    "softmax-rows@w64": Limit(0, "cpu-fallback", "N=1 fails (cpu-fallback)", "test", failing=1)})


def rewritten(model, profile=NO_SOFTMAX):
    graph = infer_shapes(gs.import_onnx(model))
    graph, report = npu_forms(graph, PassContext(profile=profile, options=None))
    graph.cleanup().toposort()
    out = gs.export_onnx(graph)
    out.ir_version = 8
    return out, report


@settings(max_examples=25, deadline=None)
@given(shape=st.sampled_from([[7, 33], [2, 5, 64], [1, 3, 16, 100], [1, 12, 8, 1024]]),
       scale=st.sampled_from([0.1, 1.0, 8.0, 30.0]), seed=st.integers(0, 1000))
def test_the_npu_form_equals_softmax_in_fp32(shape, scale, seed):
    model = make_model([helper.make_node("Softmax", ["x"], ["y"], axis=-1)], [("x", shape)], [("y", shape)])
    out, report = rewritten(model)
    ops = [n.op_type for n in out.graph.node]
    assert "Softmax" not in ops and {"MaxPool", "Sigmoid", "AveragePool", "Div"} <= set(ops)
    assert len(report["changes"]) == 1 and "on the CPU" in report["changes"][0]["reason"]
    x = (np.random.default_rng(seed).standard_normal(shape) * scale).astype(np.float32)
    np.testing.assert_allclose(run_ort(out, {"x": x})[0], run_ort(model, {"x": x})[0], rtol=2e-5, atol=1e-6)


def test_left_alone_where_the_npu_runs_softmax_or_the_axis_is_not_the_last():
    model = make_model([helper.make_node("Softmax", ["x"], ["y"], axis=-1)], [("x", [1, 4, 8, 64])], [("y", [1, 4, 8, 64])])
    out, report = rewritten(model, load_profile("rk3588"))
    assert [n.op_type for n in out.graph.node] == ["Softmax"] and report["changes"] == []
    model = make_model([helper.make_node("Softmax", ["x"], ["y"], axis=1)], [("x", [1, 4, 8, 64])], [("y", [1, 4, 8, 64])])
    out, report = rewritten(model)
    assert [n.op_type for n in out.graph.node] == ["Softmax"] and "only the last axis" in report["not_fixed"][0]["reason"]


def test_attention_softmax_is_left_to_the_compiler():
    shape = [1, 2, 16, 16]
    model = make_model([helper.make_node("MatMul", ["q", "k"], ["s"]), helper.make_node("Softmax", ["s"], ["p"], axis=-1),
                        helper.make_node("MatMul", ["p", "v"], ["y"])],
                       [("q", shape), ("k", shape), ("v", shape)], [("y", shape)])
    out, report = rewritten(model)
    assert "Softmax" in [n.op_type for n in out.graph.node] and report["changes"] == []
    assert "attention's Softmax" in report["not_fixed"][0]["reason"]


def test_the_shipped_rk3568_and_rk3566_profiles_find_no_softmax_on_the_npu():
    from shard.passes.npu_forms import softmax_never_on_npu

    assert softmax_never_on_npu(load_profile("rk3568")) and softmax_never_on_npu(load_profile("rk3566"))
    assert softmax_never_on_npu(load_profile("rk3588")) is None and softmax_never_on_npu(load_profile("rk3576")) is None


@pytest.mark.toolkit
def test_a_softmax_runs_on_the_rk3568_npu_and_verifies(tmp_path):
    """The vendor alone puts the Softmax on the CPU of an RK3568; shard's build has 0 CPU ops."""
    shape = [1, 4, 64, 64]
    scale = lambda name, v: numpy_helper.from_array(np.full([1, 4, 1, 1], v, np.float32), name)  # noqa: E731
    model = make_model([helper.make_node("Mul", ["x", "a"], ["s"]), helper.make_node("Softmax", ["s"], ["p"], axis=-1),
                        helper.make_node("Mul", ["p", "b"], ["y"])], [("x", shape)], [("y", shape)],
                       [scale("a", 0.5), scale("b", 2.0)])
    path = tmp_path / "softmax.onnx"
    path.write_bytes(model.SerializeToString())
    res = shard_cli("compile", path, "--target", "rk3568", "-o", tmp_path / "a.shard")
    assert res.returncode == 0, res.stderr
    report = json.loads((tmp_path / "a.shard" / "report.json").read_text())
    assert report["passes"]["npu_forms"]["changes"][0]["op"] == "Softmax"
    assert report["totals"]["cpu_ops"] == 0 and report["totals"]["regtask_lines"] == 0
    assert [op.split()[0] for op in report["vendor_alone"]["diagnostics"]["cpu_ops"]] == ["exSoftmax13"]
    res = shard_cli("verify", tmp_path / "a.shard", "--reference", path, "--backend", "sim", "--min-cosine", "0.9999")
    assert res.returncode == 0, res.stdout + res.stderr
