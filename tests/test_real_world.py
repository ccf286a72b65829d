"""What models exported by other tools did to shard, each as a small model that reproduces it."""

from pathlib import Path

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import pytest
from conftest import make_model, run_ort
from onnx import TensorProto, helper, numpy_helper

from shard.options import CompileOptions
from shard.errors import ModelError
from shard.graph import small_model
from shard.passes import PassContext, run_pipeline
from shard.passes.canonicalize import canonicalize, prepare_model
from shard.passes.fit import Legality, OpSpec, Verdict, WidthLimit
from shard.passes.legalize import legalize
from shard.profile import load_profile


def old_model(opset: int = 7) -> onnx.ModelProto:
    """As exporters wrote them years ago: IR 3, initializers listed as graph inputs, Dropout left in."""
    w = numpy_helper.from_array(np.arange(12, dtype=np.float32).reshape(4, 3) / 10, "w")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Dropout", ["h"], ["d"], ratio=0.5),
         helper.make_node("Relu", ["d"], ["y"])], "old",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4]),
         helper.make_tensor_value_info("w", TensorProto.FLOAT, [4, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])], [w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 3
    return model


def test_old_opset_is_upgraded_and_initializer_inputs_dropped():
    x = np.random.default_rng(0).standard_normal((2, 4)).astype(np.float32)
    want = run_ort(old_model(), {"x": x})[0]
    model, notes = prepare_model(old_model())
    assert notes == {"opset": "7 -> 13", "initializer_inputs_removed": 1}
    assert [i.name for i in model.graph.input] == ["x"] and model.ir_version >= 7
    onnx.checker.check_model(model, full_check=True)
    graph, report = canonicalize(gs.import_onnx(model), PassContext(load_profile("cpu"), CompileOptions()))
    assert "Dropout" not in [n.op for n in graph.nodes] and report["identities_removed"] == 1
    np.testing.assert_allclose(run_ort(gs.export_onnx(graph), {"x": x})[0], want, rtol=1e-6)


def test_dropout_whose_mask_is_read_stays():
    model = make_model([helper.make_node("Dropout", ["x"], ["y", "mask"]),
                        helper.make_node("Cast", ["mask"], ["m"], to=TensorProto.FLOAT),
                        helper.make_node("Add", ["y", "m"], ["z"])], [("x", [2, 3])], [("z", [2, 3])])
    graph, _ = canonicalize(gs.import_onnx(model), PassContext(load_profile("cpu"), CompileOptions()))
    assert "Dropout" in [n.op for n in graph.nodes]


def test_legalize_in_an_opset_9_model_emits_valid_slices():
    # legalize's Slice takes its bounds as inputs (opset >= 10); an opset-9 model is upgraded first.
    nodes = [helper.make_node("Add", ["x", "x"], ["y"], name="add0")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1, 4, 64])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 1, 4, 64])])
    old = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 9)])
    old.ir_version = 4
    model, _ = prepare_model(old)
    ctx = PassContext(load_profile("rk3588"), CompileOptions(), legality=Legality(load_profile("cpu"), WidthLimit(16)))
    out = run_pipeline(gs.import_onnx(model), ctx, disable=("slow_paths", "tile_attention", "host_edges"),
                       until="host_edges")
    assert ctx.reports["legalize"]["changes"], "the Add is over the limit and must be split"
    result = gs.export_onnx(out)
    onnx.checker.check_model(result, full_check=True)
    x = np.random.default_rng(1).standard_normal((1, 1, 4, 64)).astype(np.float32)
    np.testing.assert_array_equal(run_ort(result, {"x": x})[0], x + x)


def test_shapes_onnx_cannot_infer_come_from_one_onnxruntime_run():
    # A com.microsoft op (onnxruntime's own, found in models it optimised): onnx knows no shape for it.
    nodes = [helper.make_node("Relu", ["x"], ["r"]), helper.make_node("Gelu", ["r"], ["g"], domain="com.microsoft"),
             helper.make_node("Add", ["g", "g"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 8
    out, report = canonicalize(gs.import_onnx(model), PassContext(load_profile("cpu"), CompileOptions(input_shapes={"x": (3, 8)})))
    assert report["shapes_from_onnxruntime"] >= 2
    assert out.outputs[0].shape == [3, 8] and np.dtype(out.outputs[0].dtype) == np.float32


def test_unrunnable_model_with_unknown_output_is_one_clear_error():
    nodes = [helper.make_node("Frobnicate", ["x"], ["y"], domain="example.unknown")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("example.unknown", 1)])
    with pytest.raises(ModelError, match="onnxruntime could not run the model"):
        canonicalize(gs.import_onnx(model), PassContext(load_profile("cpu"), CompileOptions()))


@pytest.mark.parametrize("op,attrs,ins,out", [
    ("Cast", {"to": TensorProto.BOOL}, ["int64"], "bool"),
    ("And", {}, ["bool", "bool"], "bool"),
    ("Where", {}, ["bool", "float32", "float32"], "float32"),
    ("Equal", {}, ["int64", "int64"], "bool"),
])
def test_one_op_models_keep_the_ops_dtypes(op, attrs, ins, out):
    # The one-op harness built every input as float32: onnxruntime (and the toolkit) refused the model.
    shape = [1, 1, 8]
    tensors = [gs.Variable(f"i{k}", dtype=np.dtype(d), shape=shape) for k, d in enumerate(ins)]
    node = gs.Node(op, "n", attrs, tensors, [gs.Variable("o", dtype=np.dtype(out), shape=shape)])
    model = OpSpec.of(node).model()
    onnx.checker.check_model(model, full_check=True)
    rng = np.random.default_rng(0)
    feeds = {f"in{k}": (rng.integers(0, 2, shape).astype(d)) for k, d in enumerate(ins)}
    (result,) = run_ort(model, feeds)
    assert result.dtype == np.dtype(out)


def test_a_one_op_model_keeps_an_omitted_optional_input_omitted():
    # Resize [X, '', scales] (DPT's upsampling): the harness read the omitted roi's shape and raised.
    x = gs.Variable("x", np.float32, [1, 2, 4, 4])
    scales = gs.Constant("scales", np.array([1, 1, 2, 2], np.float32))
    node = gs.Node("Resize", "r", {"mode": "linear"}, [x, gs.Variable(""), scales],
                   [gs.Variable("y", np.float32, [1, 2, 8, 8])])
    model = OpSpec.of(node).model()
    assert list(model.graph.node[0].input) == ["in0", "", "in2"]
    (result,) = run_ort(model, {"in0": np.ones((1, 2, 4, 4), np.float32)})
    assert result.shape == (1, 2, 8, 8)


def test_float_one_op_models_are_unchanged():
    node = gs.Node("Relu", "r", {}, [gs.Variable("x", np.float32, [1, 4])], [gs.Variable("y", np.float32, [1, 4])])
    spec = OpSpec.of(node)
    assert spec.dtypes is None
    assert spec.model().SerializeToString() == small_model(
        [helper.make_node("Relu", ["in0"], ["out0"])], [("in0", [1, 4])], [("out0", [1, 4])]).SerializeToString()


class CpuPieces:
    """The whole op breaks a build; every piece builds, but on the CPU (a one-op build's verdict)."""

    def check(self, spec: OpSpec) -> Verdict:
        if spec.outputs[0][-1] > 32:
            return Verdict(False, "error", "E RKNN alone")
        return Verdict(True, "cpu-fallback", "piece on the CPU")


def test_quantized_one_op_samples_stay_in_the_ops_domain(tmp_path):
    """A one-op build in int8 is calibrated on seeded samples; Sqrt's normal samples gave NaN ranges
    and the toolkit's quantizer crashed (`cannot convert float NaN to integer`)."""
    from shard.targets.rknn.ops import write_samples

    for op, negative in (("Sqrt", False), ("Relu", True)):
        model = small_model([helper.make_node(op, ["in0"], ["out0"])], [("in0", [1, 4, 8])], [("out0", [1, 4, 8])])
        for sample in write_samples(model, tmp_path / op):
            x = np.load(sample[0])
            assert (x < 0).any() == negative
            assert not np.isnan(run_ort(model, {"in0": x})[0]).any()


@pytest.mark.toolkit
def test_a_quantized_one_op_build_of_sqrt_does_not_crash():
    from shard.targets.registry import get_target

    tgt = get_target("rk3588")
    ops = tgt.pass_toolkit(load_profile("rk3588"), CompileOptions())
    try:
        model = small_model([helper.make_node("Sqrt", ["in0"], ["out0"])], [("in0", [1, 8, 16, 16])],
                            [("out0", [1, 8, 16, 16])])
        point = ops.build(model, build=tgt.build_for(tgt.build_options(CompileOptions()), "int8"))
    finally:
        ops.close()
    assert point.failure != "crash", point.evidence


def test_split_whose_pieces_land_on_the_cpu_is_not_made():
    model = make_model([helper.make_node("Softmax", ["x"], ["y"], axis=-1, name="sm")], [("x", [1, 8, 64])],
                       [("y", [1, 8, 64])])
    ctx = PassContext(load_profile("rk3588"), CompileOptions(), legality=Legality(load_profile("cpu"), CpuPieces()))
    graph, report = legalize(gs.import_onnx(model), ctx)
    assert report["changes"] == [] and [n.op for n in graph.nodes] == ["Softmax"]
    assert report["tried"][0]["node"] == "sm"   # left to the model's build, no warning


@pytest.mark.parametrize("rank", [3, 5])
def test_conv1d_and_conv3d_patch_shapes_are_left_alone(rank):
    # slow_paths unpacked every patch Conv's input as 4-D: Conv1d and Conv3d ended in a traceback.
    from shard.passes.slow_paths import slow_paths

    k = [4] * (rank - 2)
    shape = [1, 2] + [16] * (rank - 2)
    w = numpy_helper.from_array(np.ones([3, 2] + k, np.float32), "w")
    model = make_model([helper.make_node("Conv", ["x", "w"], ["y"], kernel_shape=k, strides=k, name="conv")],
                       [("x", shape)], [("y", [1, 3] + [4] * (rank - 2))], [w])
    ctx = PassContext(load_profile("rk3588"), CompileOptions())
    graph, report = slow_paths(gs.import_onnx(model), ctx)
    assert report["changes"] == [] and [n.op for n in graph.nodes] == ["Conv"]


def embedding_model() -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    table = numpy_helper.from_array(rng.standard_normal((100, 16)).astype(np.float32), "table")
    w = numpy_helper.from_array((rng.standard_normal((16, 16)) / 4).astype(np.float32), "w")
    graph = helper.make_graph([helper.make_node("Gather", ["table", "ids"], ["e"], name="embed"),
                               helper.make_node("MatMul", ["e", "w"], ["y"], name="fc")], "emb",
                              [helper.make_tensor_value_info("ids", TensorProto.INT64, [1, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8, 16])], [table, w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def test_embedding_lookup_is_a_host_step_with_its_table_in_the_bundle(save, tmp_path):
    import shard

    path = save(embedding_model())
    result = shard.compile(path, "cpu", tmp_path / "e.shard")
    (step,) = result.manifest.host_pre
    assert step["type"] == "Gather" and step["inputs"] == ["table", "ids"]
    assert (tmp_path / "e.shard" / step["constants"]["table"]["file"]).is_file()
    assert all(n != "embed" for s in result.manifest.shards for n in s.source_nodes)
    ids = np.array([[3, 99, 0, 7, 7, 42, 1, 5]], np.int64)
    got = shard.load(result.bundle, backend="cpu").run({"ids": ids})["y"]
    np.testing.assert_allclose(got, run_ort(embedding_model(), {"ids": ids})[0], rtol=1e-6)


@pytest.mark.parametrize("name", ["test_PReLU_1d_multiparam", "test_PReLU_3d_multiparam"])
def test_an_opset_6_per_channel_prelu_keeps_its_meaning_when_upgraded(name):
    # Before opset 7 PRelu's slope [C] meant one slope per channel (axis 1); the version converter
    # keeps [C], which broadcasts from the last axis after it: onnxruntime refused the model.
    folder = Path(onnx.__file__).parent / "backend" / "test" / "data" / "pytorch-converted" / name
    model, notes = prepare_model(onnx.load(str(folder / "model.onnx")))
    assert notes["prelu_slopes_per_channel"] == 1 and notes["opset"] == "6 -> 13"
    x, want = (numpy_helper.to_array(onnx.load_tensor(str(folder / "test_data_set_0" / f))) for f in
               ("input_0.pb", "output_0.pb"))
    np.testing.assert_allclose(run_ort(model, {model.graph.input[0].name: x})[0], want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["test_sequence_model1", "test_sequence_model5"])
def test_a_model_of_onnx_sequences_is_canonicalized_without_a_traceback(name):
    # graphsurgeon's constant folding raised on sequence values, and onnxruntime returns sequences as
    # lists: the onnx package's own `simple` models ended in tracebacks. Now they reach the vendor,
    # which refuses them in one line (SequenceConstruct is not supported).
    folder = Path(onnx.__file__).parent / "backend" / "test" / "data" / "simple" / name
    model, _ = prepare_model(onnx.load(str(folder / "model.onnx")))
    graph, report = canonicalize(gs.import_onnx(model), PassContext(load_profile("cpu"), CompileOptions()))
    assert graph.nodes and "shapes_from_onnxruntime" in report


@pytest.mark.parametrize("name", ["test_sequence_model6", None])
def test_scale_sandwich_measures_what_onnxruntime_can_run_and_says_why_not_otherwise(name):
    # The onnx package's sequence models hold no float tensor (onnxruntime was asked for no output),
    # and a string model whose kernel needs a locale could not be run at all: both ended in tracebacks.
    from shard.passes.scale_sandwich import scale_sandwich

    if name:
        folder = Path(onnx.__file__).parent / "backend" / "test" / "data" / "simple" / name
        model, _ = prepare_model(onnx.load(str(folder / "model.onnx")))
    else:   # an op of a domain onnxruntime does not have
        model = helper.make_model(helper.make_graph(
            [helper.make_node("Frobnicate", ["x"], ["y"], domain="com.example")], "g",
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])]),
            opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.example", 1)])
    ctx = PassContext(load_profile("rk3588"), CompileOptions())
    graph = canonicalize(gs.import_onnx(model), ctx)[0] if name else gs.import_onnx(model)
    graph, report = scale_sandwich(graph, ctx)
    assert graph.nodes and (report.get("changes") == [] if name else "onnxruntime cannot run" in report["skipped"])


@pytest.mark.toolkit
def test_a_model_past_protobufs_2_gib_compiles_with_its_weights_beside_it(tmp_path, monkeypatch):
    """A 2 GiB MLP (8 linears 4096 <-> 16384, external data) ended in an EncodeError: the vendor
    alone's copy, and every size check, serialized the whole model. The same path, with the limit
    at 1 kB so a small model takes it: weights in NAME.onnx.data wherever a file is written, the
    kept shards' files renamed with their weights, and the bundle verifies."""
    import shard
    import shard.graph

    monkeypatch.setattr(shard.graph, "PROTO_LIMIT", 1000)
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array((rng.standard_normal((64, 64)) / 8).astype(np.float32), f"w{k}") for k in range(4)]
    nodes = [node for k in range(4) for node in (helper.make_node("MatMul", ["x" if k == 0 else f"r{k - 1}", f"w{k}"], [f"m{k}"]),
                                                 helper.make_node("Relu", [f"m{k}"], [f"r{k}"]))]
    model = make_model(nodes, [("x", [1, 32, 64])], [("r3", [1, 32, 64])], inits)
    path = tmp_path / "mlp.onnx"
    onnx.save(model, str(path), save_as_external_data=True, location="mlp.onnx.data")
    result = shard.compile(path, "rk3588", tmp_path / "m.shard", CompileOptions(shards=2))
    for spec in result.manifest.shards:
        onnx_file = result.bundle / spec.onnx
        header = onnx.load(str(onnx_file), load_external_data=False)
        locations = {e.value for t in header.graph.initializer for e in t.external_data if e.key == "location"}
        assert locations == {f"{onnx_file.name}.data"} and (result.bundle / f"{spec.onnx}.data").is_file()
    report = shard.verify(result.bundle, path, backend="sim", min_cosine=0.9999)
    assert min(o.cosine for o in report.outputs) >= 0.9999
