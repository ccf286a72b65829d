"""The main process's hold on a model's weights: own_values at import, release_weights once the
shards are written."""

import gc

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import pytest
from conftest import make_model, run_ort
from onnx import helper, numpy_helper

from shard.graph import RELEASED_BYTES, Released, constants, own_values, release_weights

BIG = RELEASED_BYTES // 4   # float32 elements of a constant release_weights drops


def model_with_constants() -> onnx.ModelProto:
    """x @ W + b, then + c, where c comes from a Constant node (an attribute tensor, not an input)."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((BIG // 64, 64)).astype(np.float32)
    b = rng.standard_normal(64).astype(np.float32)
    c = helper.make_node("Constant", [], ["c"], value=numpy_helper.from_array(np.full(64, 0.5, np.float32), "c_value"))
    return make_model([c, helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Add", ["h", "b"], ["hb"]),
                       helper.make_node("Add", ["hb", "c"], ["y"])],
                      [("x", [2, BIG // 64])], [("y", [2, 64])],
                      [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")])


def live_protos() -> int:
    gc.collect()
    return sum(1 for o in gc.get_objects() if type(o).__name__ in ("ModelProto", "GraphProto", "TensorProto"))


def test_own_values_lets_the_model_message_go_and_keeps_the_graph_exact():
    model = model_with_constants()
    x = {"x": np.random.default_rng(1).standard_normal((2, BIG // 64)).astype(np.float32)}
    want = run_ort(model, x)
    before = live_protos()
    graph = gs.import_onnx(model)
    assert any(isinstance(t._values, gs.ir.tensor.LazyValues) for t in constants(graph))
    assert len(list(constants(graph))) == 3   # w, b and the Constant node's attribute
    own_values(graph)
    del model
    # Nothing of the model's message is left: a lazily read constant, or the opset list, would
    # each keep all of it (and every weight in it) alive.
    assert live_protos() < before
    assert all(isinstance(t._values, np.ndarray) for t in constants(graph))
    np.testing.assert_array_equal(run_ort(gs.export_onnx(graph), x)[0], want[0])


def test_release_weights_drops_the_large_constants_and_keeps_their_shapes():
    graph = own_values(gs.import_onnx(model_with_constants()))
    w = next(t for t in constants(graph) if t.name == "w")
    b = next(t for t in constants(graph) if t.name == "b")
    nbytes = w.values.nbytes
    assert release_weights(graph) == nbytes
    assert release_weights(graph) == 0   # nothing left to drop
    assert isinstance(w._values, Released) and w.shape == (BIG // 64, 64) and np.dtype(w.dtype) == np.float32
    assert isinstance(b._values, np.ndarray)   # under RELEASED_BYTES: kept
    with pytest.raises(RuntimeError, match="constant w: its values were released"):
        w.values
    with pytest.raises(RuntimeError, match="constant w"):
        gs.export_onnx(graph)


def test_release_weights_counts_each_shared_constant_once():
    graph = own_values(gs.import_onnx(model_with_constants()))
    nbytes = next(t for t in constants(graph) if t.name == "w").values.nbytes
    assert release_weights(graph, graph.nodes, graph.nodes[1:2]) == nbytes


def test_release_weights_keeps_what_shards_still_to_be_written_read_in_any_copy():
    """A compile releases as each shard is written: an array a later shard reads stays, also where
    the canonical graph (a copy, its arrays shared) holds it."""
    graph = own_values(gs.import_onnx(model_with_constants()))
    copy = graph.copy()   # as the canonical snapshot: other Constant objects, the same arrays
    matmul = next(n for n in copy.nodes if n.op == "MatMul")
    assert release_weights(graph, copy, still_read=[[matmul]]) == 0   # w is read by a shard still to write
    w, w_copy = (next(t for t in constants(g) if t.name == "w") for g in (graph, copy))
    assert w._values is w_copy._values and isinstance(w._values, np.ndarray)
    nbytes = w.values.nbytes   # counted once: one array
    assert release_weights(graph, copy, still_read=[[n for n in graph.nodes if n.op == "Add"]]) == nbytes
    assert isinstance(w._values, Released) and isinstance(w_copy._values, Released)
