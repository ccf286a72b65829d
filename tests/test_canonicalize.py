"""canonicalize: static shapes, folded constants, no Identity; numerics unchanged."""

import numpy as np
import onnx_graphsurgeon as gs
import pytest
from conftest import make_model, run_ort
from onnx import TensorProto, helper

from shard.options import CompileOptions
from shard.errors import ModelError
from shard.passes import PassContext
from shard.passes.canonicalize import canonicalize
from shard.profile import load_profile


def ctx(**options):
    return PassContext(profile=load_profile("rk3588"), options=CompileOptions(**options))


def dynamic_model():
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])
    g = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g", [x], [y])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    return m


def test_dynamic_dim_names_input_dim_and_flag():
    with pytest.raises(ModelError) as err:
        canonicalize(gs.import_onnx(dynamic_model()), ctx())
    msg = str(err.value)
    assert "'x'" in msg and "dimension 0" in msg and "'batch'" in msg and "--input-shape x=N,4" in msg


def test_input_shape_fixes_dynamic_dim():
    graph, report = canonicalize(gs.import_onnx(dynamic_model()), ctx(input_shapes={"x": (3, 4)}))
    assert graph.inputs[0].shape == [3, 4] and graph.outputs[0].shape == [3, 4]
    assert report["fixed_inputs"] == ["x"]


def test_input_shape_for_unknown_input_lists_inputs():
    with pytest.raises(ModelError, match="inputs are: x"):
        canonicalize(gs.import_onnx(dynamic_model()), ctx(input_shapes={"pixels": (3, 4)}))


def test_folds_shape_arithmetic_and_removes_identity():
    # y = Reshape(Identity(x), Shape(x)) + 1: the Shape feeds a Reshape and folds once shapes are known.
    one = helper.make_tensor("one", TensorProto.FLOAT, [1], [1.0])
    nodes = [helper.make_node("Identity", ["x"], ["xi"]),
             helper.make_node("Shape", ["x"], ["s"]),
             helper.make_node("Reshape", ["xi", "s"], ["r"]),
             helper.make_node("Add", ["r", "one"], ["y"])]
    model = make_model(nodes, [("x", [2, 3])], [("y", [2, 3])], [one])
    graph, report = canonicalize(gs.import_onnx(model), ctx())
    ops = [n.op for n in graph.nodes]
    assert "Identity" not in ops and "Shape" not in ops
    assert report["identities_removed"] == 1
    x = np.random.default_rng(0).standard_normal((2, 3)).astype(np.float32)
    before = run_ort(model, {"x": x})[0]
    after = run_ort(gs.export_onnx(graph), {"x": x})[0]
    np.testing.assert_array_equal(before, after)


def test_noop_casts_are_removed_and_real_ones_kept():
    model = make_model([helper.make_node("Cast", ["x"], ["c"], to=TensorProto.FLOAT),
                        helper.make_node("Cast", ["c"], ["h"], to=TensorProto.FLOAT16),
                        helper.make_node("Cast", ["h"], ["y"], to=TensorProto.FLOAT)], [("x", [2, 3])], [("y", [2, 3])])
    graph, report = canonicalize(gs.import_onnx(model), PassContext(load_profile("cpu")))
    assert [n.op for n in graph.nodes] == ["Cast", "Cast"] and report["identities_removed"] == 1


def test_the_models_node_order_survives_the_pipeline_where_it_is_valid():
    # The vendor compiler fuses by walking the nodes in order: a model merely re-sorted by
    # graphsurgeon (DPT from transformers) put 6 more GELUs on the CPU.
    from shard.graph import toposort

    # One branch, then the other, as exporters write it (a valid order, not by depth).
    nodes = [helper.make_node("Relu", ["x"], ["a"], name="a"), helper.make_node("Neg", ["a"], ["c"], name="c"),
             helper.make_node("Sigmoid", ["x"], ["b"], name="b"), helper.make_node("Abs", ["b"], ["d"], name="d"),
             helper.make_node("Add", ["c", "d"], ["y"], name="y")]
    model = make_model(nodes, [("x", [2, 3])], [("y", [2, 3])])
    graph, _ = canonicalize(gs.import_onnx(model), ctx())
    assert [n.name for n in graph.nodes] == ["a", "c", "b", "d", "y"]
    assert [n.name for n in gs.import_onnx(model).toposort().nodes] != ["a", "c", "b", "d", "y"]  # why ours
    # A node out of order (a rewrite appends its nodes) moves just before its first consumer.
    graph = gs.import_onnx(model)
    graph.nodes = [graph.nodes[k] for k in (1, 2, 3, 4, 0)]
    assert [n.name for n in toposort(graph).nodes] == ["b", "d", "a", "c", "y"]
