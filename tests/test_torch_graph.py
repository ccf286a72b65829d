"""The cuda executor's torch form of ONNX ops against onnxruntime, op by op, on the CPU. The ops here
are the ones the real-model corpus (bench/corpus_gpu.py) found missing or wrong."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from conftest import run_ort
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper

torch = pytest.importorskip("torch")

from shard.runtime.executors.torch_graph import TorchGraph  # noqa: E402


def one_op(op: str, inputs: list[tuple], output_shape: list[int], inits: dict[str, np.ndarray] = (), opset=19,
           **attrs) -> onnx.ModelProto:
    """A model of one op: `inputs` are (name, shape) graph inputs, `inits` constant inputs, in order."""
    inits = dict(inits)
    names = [name for name, _ in inputs] + list(inits)
    graph = helper.make_graph(
        [helper.make_node(op, names, ["y"], name="op", **attrs)], "g",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in inputs],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, output_shape)],
        [onnx.numpy_helper.from_array(v, n) for n, v in inits.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 9
    return model


def check(model: onnx.ModelProto, feeds: dict[str, np.ndarray], atol=1e-4):
    want = run_ort(model, feeds, optimize=False)[0]
    graph = TorchGraph(model, "cpu")
    with torch.no_grad():
        got = graph(*[torch.from_numpy(feeds[n]) for n in graph.inputs])[0].numpy()
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, atol=atol, rtol=1e-4)


rng = np.random.default_rng(0)
x4 = rng.standard_normal((1, 3, 6, 7)).astype(np.float32)


@pytest.mark.parametrize("mode", ["constant", "reflect", "edge"])
def test_pad(mode):
    pads = np.array([0, 0, 1, 2, 0, 0, 2, 1], np.int64)
    inits = {"pads": pads, **({"value": np.array(1.5, np.float32)} if mode == "constant" else {})}
    check(one_op("Pad", [("x", [1, 3, 6, 7])], [1, 3, 9, 10], inits, mode=mode), {"x": x4})


def test_conv_transpose():
    w = rng.standard_normal((3, 4, 3, 3)).astype(np.float32)
    model = one_op("ConvTranspose", [("x", [1, 3, 6, 7])], [1, 4, 12, 14], {"w": w, "b": np.ones(4, np.float32)},
                   strides=[2, 2], pads=[1, 1, 1, 1], output_padding=[1, 1])
    check(model, {"x": x4})


def test_prelu_selu_instance_norm():
    check(one_op("PRelu", [("x", [1, 3, 6, 7])], [1, 3, 6, 7], {"s": np.array([[[0.1]], [[0.2]], [[0.3]]], np.float32)}),
          {"x": x4})
    check(one_op("Selu", [("x", [1, 3, 6, 7])], [1, 3, 6, 7]), {"x": x4})
    check(one_op("Shrink", [("x", [1, 3, 6, 7])], [1, 3, 6, 7], lambd=0.7, bias=0.2), {"x": x4})
    check(one_op("InstanceNormalization", [("x", [1, 3, 6, 7])], [1, 3, 6, 7],
                 {"s": np.array([1.0, 2.0, 0.5], np.float32), "b": np.array([0.0, 1.0, -1.0], np.float32)}), {"x": x4})


def test_fp16_op_without_a_cpu_kernel_runs_through_fp32():
    x = rng.standard_normal((1, 2, 4, 6, 6)).astype(np.float16)
    graph = helper.make_graph([helper.make_node("AveragePool", ["x"], ["y"], kernel_shape=[2, 2, 2], strides=[2, 2, 2])],
                              "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT16, [1, 2, 4, 6, 6])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT16, [1, 2, 2, 3, 3])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)])
    model.ir_version = 9
    got = TorchGraph(model, "cpu")(torch.from_numpy(x))[0]
    assert got.dtype == torch.float16
    np.testing.assert_allclose(got.float().numpy(), run_ort(model, {"x": x}, optimize=False)[0].astype(np.float32),
                               atol=2e-3)


@settings(max_examples=25, deadline=None)
@given(pads=st.lists(st.integers(0, 3), min_size=4, max_size=4), mode=st.sampled_from(["constant", "reflect", "edge"]))
def test_pad_random(pads, mode):
    full = np.array([0, 0, pads[0], pads[1], 0, 0, pads[2], pads[3]], np.int64)
    shape = [1, 3, 6 + pads[0] + pads[2], 7 + pads[1] + pads[3]]
    check(one_op("Pad", [("x", [1, 3, 6, 7])], shape, {"pads": full}, mode=mode), {"x": x4})


@settings(max_examples=25, deadline=None)
@given(patch=st.integers(2, 8), extra=st.integers(0, 3), channels=st.integers(1, 4))
def test_patch_convolution_random(patch, extra, channels):
    """A convolution whose kernel is its stride runs as one product over the patches (a remainder dropped)."""
    side = 3 * patch + extra
    x = rng.standard_normal((1, channels, side, side)).astype(np.float32)
    w = rng.standard_normal((5, channels, patch, patch)).astype(np.float32)
    model = one_op("Conv", [("x", [1, channels, side, side])], [1, 5, 3, 3], {"w": w, "b": np.arange(5, dtype=np.float32)},
                   kernel_shape=[patch, patch], strides=[patch, patch])
    check(model, {"x": x}, atol=1e-3)


@pytest.mark.parametrize("transform", ["align_corners", "half_pixel"])
def test_resize_linear_by_its_coordinate_transform(transform):
    """DPT's align_corners resizes came out at cosine 0.806 when the transform was ignored."""
    model = one_op("Resize", [("x", [1, 3, 6, 7])], [1, 3, 12, 14],
                   {"roi": np.zeros(0, np.float32), "scales": np.array([1, 1, 2, 2], np.float32)},
                   mode="linear", coordinate_transformation_mode=transform)
    check(model, {"x": x4})


@pytest.mark.parametrize("exclusive, reverse", [(0, 0), (1, 0), (0, 1), (1, 1)])
def test_cumsum(exclusive, reverse):
    check(one_op("CumSum", [("x", [1, 3, 6, 7])], [1, 3, 6, 7], {"axis": np.array(2, np.int64)},
                 exclusive=exclusive, reverse=reverse), {"x": x4})


def test_gather_elements_with_negative_indices():
    idx = rng.integers(-7, 7, (1, 3, 6, 2)).astype(np.int64)
    graph = helper.make_graph([helper.make_node("GatherElements", ["x", "i"], ["y"], axis=3)], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 6, 7])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 3, 6, 2])],
                              [onnx.numpy_helper.from_array(idx, "i")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)])
    model.ir_version = 9
    check(model, {"x": x4})


def test_gather_of_one_element_by_a_scalar_index():
    # fp8_replica reads each linear's gate so: a vector's element by a constant scalar index, a scalar
    check(one_op("Gather", [("x", [5])], [], {"k": np.array(3, np.int64)}, axis=0),
          {"x": rng.standard_normal(5).astype(np.float32)})
