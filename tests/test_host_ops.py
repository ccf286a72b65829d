"""The ONNX ops the runtime runs in numpy (shard.runtime.host_ops) against onnxruntime, and the
integer-input preprocessing host_edges moves there."""

import numpy as np
import onnx
import pytest
from conftest import run_ort
from onnx import TensorProto, helper, numpy_helper

import shard
from shard.bundle import HOST_ONNX_OPS
from shard.options import CompileOptions
from shard.runtime.host_ops import OPS, run_onnx_step

I64, F32, BOOL = TensorProto.INT64, TensorProto.FLOAT, TensorProto.BOOL
rng = np.random.default_rng(0)
MASK = rng.integers(0, 2, (2, 6)).astype(np.int64)
FLOATS = rng.standard_normal((2, 6)).astype(np.float32)

# (op, attrs, [(name, array)] inputs, constants [(name, array)], opset)
CASES = [
    ("Cast", {"to": BOOL}, [MASK], [], 17),
    ("Cast", {"to": F32}, [MASK], [], 17),
    ("Not", {}, [MASK.astype(bool)], [], 17),
    ("And", {}, [MASK.astype(bool), MASK[::-1].astype(bool)], [], 17),
    ("Or", {}, [MASK.astype(bool), MASK[::-1].astype(bool)], [], 17),
    ("Xor", {}, [MASK.astype(bool), MASK[::-1].astype(bool)], [], 17),
    ("Equal", {}, [MASK], [np.array(0, np.int64)], 17),
    ("Less", {}, [MASK], [np.array(1, np.int64)], 17),
    ("LessOrEqual", {}, [MASK], [np.array(0, np.int64)], 17),
    ("Greater", {}, [MASK], [np.array(0, np.int64)], 17),
    ("GreaterOrEqual", {}, [MASK], [np.array(1, np.int64)], 17),
    ("Where", {}, [MASK.astype(bool)], [np.array(-3.4e38, np.float32), np.array(0, np.float32)], 17),
    ("Add", {}, [FLOATS], [np.array([1.0], np.float32)], 17),
    ("Sub", {}, [FLOATS], [np.full((1, 6), 2.0, np.float32)], 17),
    ("Mul", {}, [MASK], [np.array(7, np.int64)], 17),
    ("Neg", {}, [FLOATS], [], 17),
    ("Cos", {}, [FLOATS], [], 17),   # rotary positions: cos and sin of positions times frequencies
    ("Sin", {}, [FLOATS], [], 17),
    ("Min", {}, [FLOATS], [np.array(0.5, np.float32)], 17),
    ("Max", {}, [FLOATS], [np.array(0.5, np.float32)], 17),
    ("Unsqueeze", {}, [MASK], [np.array([1, -1], np.int64)], 17),
    ("Unsqueeze", {"axes": [0, 2]}, [MASK], [], 11),
    ("Squeeze", {}, [MASK[:1]], [np.array([0], np.int64)], 17),
    ("Squeeze", {"axes": [0]}, [MASK[:1]], [], 11),
    ("Reshape", {}, [MASK], [np.array([0, 3, -1], np.int64)], 17),
    ("Expand", {}, [MASK[:1]], [np.array([3, 1, 6], np.int64)], 17),
    ("CumSum", {}, [MASK], [np.array(1, np.int64)], 17),
    ("CumSum", {"exclusive": 1, "reverse": 1}, [MASK], [np.array(-1, np.int64)], 17),
    ("Gather", {}, [MASK], [rng.standard_normal((5, 3)).astype(np.float32)], 17),   # a table by ids, below
    ("Gather", {"axis": 1}, [np.array([[0, -1]], np.int64)], [rng.standard_normal((2, 4)).astype(np.float32)], 17),
    ("GatherElements", {"axis": 1}, [MASK], [rng.standard_normal((2, 6)).astype(np.float32)], 17),
    ("Flatten", {"axis": 2}, [MASK.reshape(1, 2, 3, 2)], [], 17),
    ("Flatten", {}, [MASK], [], 17),
    ("Slice", {}, [MASK], [np.array([0, 1], np.int64), np.array([9, -1], np.int64), np.array([0, 1], np.int64),
                           np.array([1, 2], np.int64)], 17),
    ("Slice", {}, [MASK], [np.array([5], np.int64), np.array([-100], np.int64), np.array([-1], np.int64),
                           np.array([-2], np.int64)], 17),
    ("Concat", {"axis": 0}, [MASK, MASK[::-1]], [], 17),
    ("Transpose", {"perm": [1, 0]}, [MASK], [], 17),
    ("Div", {}, [FLOATS], [np.array(3.0, np.float32)], 17),
    ("Div", {}, [MASK * 7 - 3], [np.array(2, np.int64)], 17),
    ("ReduceSum", {}, [FLOATS], [np.array([1], np.int64)], 17),
    ("ReduceSum", {"keepdims": 0}, [MASK], [], 17),
    ("ReduceSum", {"axes": [0]}, [MASK], [], 11),
    ("ReduceMean", {"axes": [-1]}, [FLOATS], [], 17),
    ("ReduceMax", {"axes": [1], "keepdims": 0}, [MASK], [], 17),
    ("ReduceMin", {}, [FLOATS], [np.array([0], np.int64)], 18),
    ("Clip", {}, [FLOATS], [np.array(-0.5, np.float32), np.array(0.5, np.float32)], 17),
    ("Clip", {"min": 1e-9}, [FLOATS], [], 6),
    ("Softmax", {"axis": -1}, [FLOATS * 30], [], 17),
    ("Softmax", {"axis": 0}, [FLOATS], [], 17),
    ("LogSoftmax", {"axis": 1}, [FLOATS * 30], [], 17),
    ("ArgMax", {"axis": 1, "keepdims": 0}, [MASK * rng.integers(0, 50, (2, 6))], [], 17),   # a pooled token's place
    ("ArgMax", {"axis": 1, "select_last_index": 1}, [MASK], [], 17),   # ties: the last
    ("ArgMin", {"axis": 0}, [FLOATS], [], 17),
]


def single(op, attrs, inputs, constants, opset):
    names = [f"x{k}" for k in range(len(inputs))]
    inits = [numpy_helper.from_array(c, f"c{k}") for k, c in enumerate(constants)]
    order = [i.name for i in inits] + names if op.startswith("Gather") else names + [i.name for i in inits]
    node = helper.make_node(op, order, ["y"], **attrs)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(a.dtype), a.shape)
                                           for n, a in zip(names, inputs)],
                              [onnx.ValueInfoProto(name="y")], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 7
    return model, names, inits


def node_inputs(model):
    return model.graph.node[0].input


@pytest.mark.parametrize("op,attrs,inputs,constants,opset", CASES, ids=[f"{c[0]}-{c[4]}" for c in CASES])
def test_each_host_op_matches_onnxruntime(op, attrs, inputs, constants, opset):
    model, names, inits = single(op, attrs, inputs, constants, opset)
    (want,) = run_ort(model, dict(zip(names, inputs)))
    step = {"op": "onnx", "type": op, "inputs": list(node_inputs(model)), "outputs": ["y"], "attrs": attrs,
            "constants": {i.name: {"dtype": c.dtype.name, "shape": list(c.shape), "values": c.ravel().tolist()}
                          for i, c in zip(inits, constants)}}
    tensors = dict(zip(names, inputs))
    run_onnx_step(step, tensors, {})
    assert tensors["y"].dtype == want.dtype and tensors["y"].shape == want.shape
    if op in ("Softmax", "LogSoftmax", "Cos", "Sin"):   # exp, log, cos, sin: numpy's against onnxruntime's
        np.testing.assert_allclose(tensors["y"], want, rtol=1e-5, atol=1e-7)
    else:
        np.testing.assert_array_equal(tensors["y"], want)


def test_the_runtime_runs_every_op_the_format_lets_a_host_step_hold():
    """shard.bundle.HOST_ONNX_OPS is what compile may move to the host; the runtime's table runs each,
    and every op of it has a case here against onnxruntime."""
    assert set(OPS) == HOST_ONNX_OPS
    assert {case[0] for case in CASES} == HOST_ONNX_OPS


def bert_mask_model() -> onnx.ModelProto:
    """The additive attention mask as transformers exports it, then used by a float op."""
    nodes = [helper.make_node("Unsqueeze", ["attention_mask", "a1"], ["m1"]),
             helper.make_node("Unsqueeze", ["m1", "a2"], ["m2"]),
             helper.make_node("Cast", ["m2"], ["mf"], to=F32),
             helper.make_node("Sub", ["one", "mf"], ["inv"]),
             helper.make_node("Mul", ["inv", "big"], ["bias"]),
             helper.make_node("MatMul", ["x", "w"], ["scores"]),
             helper.make_node("Add", ["scores", "bias"], ["masked"]),
             helper.make_node("Softmax", ["masked"], ["y"], axis=-1)]
    inits = [numpy_helper.from_array(np.array([1], np.int64), "a1"), numpy_helper.from_array(np.array([2], np.int64), "a2"),
             numpy_helper.from_array(np.array(1.0, np.float32), "one"),
             numpy_helper.from_array(np.array(np.finfo(np.float32).min, np.float32), "big"),
             numpy_helper.from_array(rng.standard_normal((16, 8)).astype(np.float32), "w")]
    graph = helper.make_graph(nodes, "mask", [helper.make_tensor_value_info("attention_mask", I64, [1, 8]),
                                              helper.make_tensor_value_info("x", F32, [1, 2, 8, 16])],
                              [helper.make_tensor_value_info("y", F32, [1, 2, 8, 8])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def test_the_integer_mask_preparation_runs_on_the_host(save, tmp_path):
    model = bert_mask_model()
    path = save(model)
    result = shard.compile(path, "cpu", tmp_path / "m.shard", CompileOptions())
    assert [s.get("type") for s in result.manifest.host_pre] == ["Unsqueeze", "Unsqueeze", "Cast", "Sub", "Mul"]
    (spec,) = result.manifest.shards
    assert {t.name for t in spec.inputs} == {"x", "bias"}  # the NPU takes the finished bias, not the int64 mask
    mask = np.array([[1, 1, 1, 1, 1, 0, 0, 0]], np.int64)
    x = rng.standard_normal((1, 2, 8, 16)).astype(np.float32)
    got = shard.load(result.bundle, backend="cpu").run({"attention_mask": mask, "x": x})["y"]
    np.testing.assert_allclose(got, run_ort(model, {"attention_mask": mask, "x": x})[0], rtol=1e-6)
    assert shard.verify(result.bundle, path, backend="cpu").passed


def test_a_mean_poolings_token_count_runs_on_the_host(save, tmp_path):
    # all-mpnet-base-v2's pooling: sum(h * mask) / clip(sum(mask), 1e-9). Left on the NPU, the
    # ReduceSum of the (host-made) float mask sends toolkit 2.5.0 into an endless fuse_rs_conv loop.
    nodes = [helper.make_node("Unsqueeze", ["attention_mask", "a2"], ["m"]),
             helper.make_node("Cast", ["m"], ["mf"], to=F32),
             helper.make_node("Mul", ["x", "mf"], ["masked"]),
             helper.make_node("ReduceSum", ["masked", "a1"], ["total"], keepdims=0),
             helper.make_node("ReduceSum", ["mf", "a1"], ["count"], keepdims=0),
             helper.make_node("Clip", ["count", "tiny", ""], ["safe"]),
             helper.make_node("Div", ["total", "safe"], ["y"])]
    inits = [numpy_helper.from_array(np.array([2], np.int64), "a2"), numpy_helper.from_array(np.array([1], np.int64), "a1"),
             numpy_helper.from_array(np.array(1e-9, np.float32), "tiny")]
    graph = helper.make_graph(nodes, "pool", [helper.make_tensor_value_info("attention_mask", I64, [1, 8]),
                                              helper.make_tensor_value_info("x", F32, [1, 8, 16])],
                              [helper.make_tensor_value_info("y", F32, [1, 16])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path = save(model)
    result = shard.compile(path, "cpu", tmp_path / "p.shard", CompileOptions())
    assert [s.get("type") for s in result.manifest.host_pre] == ["Unsqueeze", "Cast", "ReduceSum", "Clip"]
    mask = np.array([[1, 1, 1, 0, 0, 0, 0, 0]], np.int64)
    x = rng.standard_normal((1, 8, 16)).astype(np.float32)
    got = shard.load(result.bundle, backend="cpu").run({"attention_mask": mask, "x": x})["y"]
    np.testing.assert_allclose(got, run_ort(model, {"attention_mask": mask, "x": x})[0], rtol=1e-6)


def test_a_transpose_after_the_shards_is_a_view_and_before_them_a_contiguous_copy():
    from shard.runtime.host import run_host

    x = np.arange(24, dtype=np.float32).reshape(1, 4, 6)
    step = [{"op": "transpose", "input": "x", "output": "y", "perm": [0, 2, 1]}]
    before = run_host(step, {"x": x})["y"]
    after = run_host(step, {"x": x}, contiguous=False)["y"]
    assert np.array_equal(before, after) and np.array_equal(after, x.transpose(0, 2, 1))
    assert before.flags.c_contiguous and not np.shares_memory(before, x)
    assert np.shares_memory(after, x)
