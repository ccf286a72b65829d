"""shard.graph.relayout: a shard's edges in the vendor's 4-D layout, the model's own shapes reshaped inside."""

import numpy as np
import onnx
import pytest
from conftest import make_model, run_ort
from onnx import helper, numpy_helper

import shard
from shard.options import CompileOptions
from shard.graph import relayout


def linear_model():
    w = numpy_helper.from_array(np.random.default_rng(0).standard_normal((10, 8)).astype(np.float32), "w")
    return make_model([helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Relu", ["h"], ["y"])],
                      [("x", [4, 10])], [("y", [4, 8])], [w])


def test_relaid_edges_compute_the_same_on_views_of_the_inputs():
    model = linear_model()
    relaid = relayout(model, {"x": [1, 4, 1, 10]}, {"y": [1, 4, 1, 8]})
    onnx.checker.check_model(relaid, full_check=True)
    shapes = {v.name: [d.dim_value for d in v.type.tensor_type.shape.dim] for v in [*relaid.graph.input, *relaid.graph.output]}
    assert shapes == {"x": [1, 4, 1, 10], "y": [1, 4, 1, 8]}
    x = np.random.default_rng(1).standard_normal((4, 10)).astype(np.float32)
    want = run_ort(model, {"x": x})[0]
    got = run_ort(relaid, {"x": x.reshape(1, 4, 1, 10)})[0]
    np.testing.assert_array_equal(got.reshape(4, 8), want)


@pytest.mark.toolkit
def test_a_2d_linear_runs_with_no_op_on_the_cpu(save, tmp_path):
    # The vendor alone reshapes the [4,10] input on the CPU; shard hands it over in the vendor's layout.
    path = save(linear_model())
    result = shard.compile(path, "rk3588", tmp_path / "l.shard", CompileOptions())
    versus = result.report["versus_vendor"]
    assert versus["vendor"]["cpu_ops"] == 1 and versus["shard"]["cpu_ops"] == 0 and versus["verdict"] == "better"
    (spec,) = result.manifest.shards
    assert spec.edge_shapes == {"x": [1, 4, 1, 10]} and spec.inputs[0].shape == [4, 10]
    for backend in ("sim", "cpu"):
        report = shard.verify(result.bundle, path, backend=backend)
        assert report.outputs[0].cosine >= 0.9999, backend
