"""w4a16_linears (GPU targets, --precision w4a16): linear weights in int4 behind a blocked
DequantizeLinear, activations fp16; the stage files onnxruntime and the cuda executor's torch form
run, and the cost model's bytes."""
from __future__ import annotations

import json

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import pytest
import torch
from conftest import make_model, run_ort
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import helper, numpy_helper

from shard.compilation import compile_model
from shard.options import CompileOptions
from shard.passes.w4a16_linears import BLOCKS, int4_weight
from shard.runtime.executors.torch_graph import TorchGraph


def dequantized(q: np.ndarray, scale: np.ndarray) -> np.ndarray:
    return q.astype(np.float32) * np.repeat(scale.astype(np.float32), q.shape[0] // scale.shape[0], axis=0)


@settings(max_examples=40, deadline=None)
@given(blocks=st.integers(1, 4), block=st.sampled_from(BLOCKS), columns=st.integers(1, 12),
       spread=st.floats(1e-3, 1e2), seed=st.integers(0, 2 ** 16))
def test_int4_weights_are_within_half_a_step_of_the_weight(blocks, block, columns, spread, seed):
    """Each block of a column over its absolute maximum / 7: values in -7..7, fp16 scales one a block, every
    weight within half a step of its own; a column of zeros stays zero."""
    w = np.random.default_rng(seed).standard_normal((blocks * block, columns)).astype(np.float32) * spread
    w[:, 0] = 0.0
    q, scale = int4_weight(w, block)
    assert q.dtype == np.int8 and np.abs(q).max() <= 7 and scale.dtype == np.float16
    assert scale.shape == (blocks, columns)
    step = np.repeat(scale.astype(np.float32), block, axis=0)
    assert np.all(np.abs(dequantized(q, scale) - w) <= 0.5 * step * (1 + 1e-3))
    assert not q[:, 0].any()
    assert columns == 1 or np.abs(q[:, 1:]).max() == 7   # the scale spends the range


def mlp(seed: int = 0) -> tuple[onnx.ModelProto, dict]:
    """x [2, 256] through W1 [256, 64] (read by two products), W2 [64, 40], and W3 [40, 24], whose 40 rows
    no block divides."""
    rng = np.random.default_rng(seed)
    weights = {"w1": rng.standard_normal((256, 64)) / 16, "w2": rng.standard_normal((64, 40)) / 8,
               "w3": rng.standard_normal((40, 24)) / 6}
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["a"]), helper.make_node("Mul", ["x", "two"], ["x2"]),
             helper.make_node("MatMul", ["x2", "w1"], ["b"]), helper.make_node("Add", ["a", "b"], ["c"]),
             helper.make_node("Relu", ["c"], ["r"]), helper.make_node("MatMul", ["r", "w2"], ["d"]),
             helper.make_node("Relu", ["d"], ["e"]), helper.make_node("MatMul", ["e", "w3"], ["y"])]
    inits = [numpy_helper.from_array(v.astype(np.float32), k) for k, v in weights.items()]
    inits.append(numpy_helper.from_array(np.array(2.0, np.float32), "two"))
    return make_model(nodes, [("x", [2, 256])], [("y", [2, 24])], inits, opset=17), weights


@pytest.fixture(scope="module")
def w4a16_stage(tmp_path_factory):
    root = tmp_path_factory.mktemp("w4a16")
    model, weights = mlp()
    onnx.save(model, str(root / "mlp.onnx"))
    result = compile_model(root / "mlp.onnx", "thor", root / "mlp.shard",
                           CompileOptions(precision="w4a16", shards=1, min_cosine=0.9))   # every weight int4 holds it
    stage = onnx.load(str(result.bundle / result.manifest.shards[0].onnx))
    report = json.loads((result.bundle / "report.json").read_text())["passes"]["w4a16_linears"]
    return model, weights, stage, report


def test_each_weight_a_block_divides_is_stored_once_in_int4(w4a16_stage):
    """W1 (two readers) and W2 each one INT4 initializer behind a DequantizeLinear with its block (128 for
    256 rows, 64 for 64), the stage at opset 21; W3's 40 rows are left in fp16, and the report says why."""
    model, weights, stage, report = w4a16_stage
    assert next(o.version for o in stage.opset_import if o.domain in ("", "ai.onnx")) == 21
    dequantize = [n for n in stage.graph.node if n.op_type == "DequantizeLinear"]
    blocks = sorted(helper.get_attribute_value(a) for n in dequantize for a in n.attribute if a.name == "block_size")
    assert blocks == [64, 128]
    int4 = [t for t in stage.graph.initializer if t.data_type == onnx.TensorProto.INT4]
    assert sorted(tuple(t.dims) for t in int4) == [(64, 40), (256, 64)]
    assert len(report["changes"]) == 3 and len(report["left"]) == 1 and "[40, 24]" in report["left"][0]["why"]
    assert report["weight_bytes_before"] == 2 * (256 * 64 + 64 * 40)   # fp16
    assert report["weight_bytes_after"] == (256 * 64 + 64 * 40) // 2 + 2 * (2 * 64 + 1 * 40)


def test_the_stage_computes_the_model_with_its_int4_weights(w4a16_stage):
    """onnxruntime on the stage against the fp32 model whose weights are their int4 values times their
    scales (the rounding is the only change, to fp16's tolerance); the cuda executor's torch form on the
    CPU (the blocked DequantizeLinear computed at load) against onnxruntime on the stage."""
    model, weights, stage, _ = w4a16_stage
    rounded = onnx.ModelProto()
    rounded.CopyFrom(model)
    for t in rounded.graph.initializer:
        if t.name in ("w1", "w2"):
            block = {256: 128, 64: 64}[weights[t.name].shape[0]]
            t.CopyFrom(numpy_helper.from_array(dequantized(*int4_weight(weights[t.name], block)), t.name))
    x = np.random.default_rng(1).standard_normal((2, 256)).astype(np.float32)
    want = run_ort(rounded, {"x": x}, optimize=False)[0]
    name = stage.graph.input[0].name
    feed = x.astype(np.float16) if stage.graph.input[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT16 else x
    got = run_ort(stage, {name: feed}, optimize=False)[0].astype(np.float32)
    np.testing.assert_allclose(got, want, atol=2e-2 * np.abs(want).max(), rtol=0)
    exact = run_ort(model, {"x": x}, optimize=False)[0]
    assert np.abs(want - exact).max() > 1e-3   # the int4 rounding is there to see
    with torch.no_grad():
        torch_out = TorchGraph(stage, "cpu")(torch.from_numpy(feed))[0].float().numpy()
    np.testing.assert_allclose(torch_out, got, atol=2e-3 * np.abs(got).max(), rtol=0)


def test_thor_reads_the_int4_weight_where_the_cuda_executor_reads_fp16(w4a16_stage):
    """The cost model: on a TensorRT target (Thor: the dequantization in the product's prologue) a
    w4a16 weight is read as stored (int4 and its scales); elsewhere (the cuda executor dequantizes once, at
    load) as the fp16 tensor it becomes."""
    from shard.targets.gpu.roofline import stored_bytes
    from shard.profile import load_profile

    _, _, stage, _ = w4a16_stage
    graph = gs.import_onnx(stage)
    thor = load_profile("thor").facts
    weight = next(t for t in graph.tensors().values() if t.inputs and t.inputs[0].op == "DequantizeLinear"
                  and list(t.shape) == [256, 64])
    assert stored_bytes(weight, thor) == 256 * 64 / 2 + 2 * 2 * 64
    assert stored_bytes(weight, {k: v for k, v in thor.items() if k != "tensorrt"}) == 256 * 64 * 2


def test_the_search_keeps_in_int4_what_holds_min_cosine(tmp_path):
    """The model's linears are unnamed (each named apart for the search). At --min-cosine 0.99 a share of
    their MACs reads int4 and the rest stays fp16, the kept round's cosine at or over 0.99; at 0.999 none
    holds, every weight stays fp16 and the compile warns with the closest it came."""
    model, _ = mlp()
    onnx.save(model, str(tmp_path / "mlp.onnx"))
    for floor in (0.99, 0.999):
        result = compile_model(tmp_path / "mlp.onnx", "thor", tmp_path / f"{floor}.shard",
                               CompileOptions(precision="w4a16", shards=1, min_cosine=floor))
        report = json.loads((result.bundle / "report.json").read_text())
        search = report["passes"]["w4a16_linears"]
        assert len({c["node"] for c in search["ranking"]}) == 3   # three products, three names
        stage = onnx.load(str(result.bundle / result.manifest.shards[0].onnx))
        int4 = [t for t in stage.graph.initializer if t.data_type == onnx.TensorProto.INT4]
        if floor == 0.99:
            assert 0 < search["int4_linear_macs"] < 1 and search["cosine"] >= 0.99 and int4
            assert len(search["changes"]) < 3
        else:
            assert search["kept"] is None and not search["changes"] and not int4
            assert any("w4a16: no share of the linears' weights in int4 keeps --min-cosine 0.999" in w
                       for w in report["warnings"])
