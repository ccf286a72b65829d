"""GPU targets (thor, cuda) on this CPU machine: the stage files' types and Q/DQ, their numerics in
onnxruntime and in the cuda executor's torch form (run on the CPU), the roofline, the stage cuts,
and the engine precision check on engine information in TensorRT's JSON format."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import pytest
from conftest import DATA, cosine, mlp_chain, run_ort, shard_cli
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper

from shard.compilation import compile_model
from shard.options import CompileOptions
from shard.passes import PassContext, run_pipeline
from shard.passes.canonicalize import prepare_model
from shard.profile import load_profile
from shard.targets.gpu import MIN_OPSET, PIPELINE

torch = pytest.importorskip("torch")


def gpu_graph(model: onnx.ModelProto, precision: str = "fp16", until: str | None = None, **options):
    ctx = PassContext(profile=load_profile("thor"), options=CompileOptions(precision=precision, **options))
    model, _ = prepare_model(model, MIN_OPSET)   # as compile does: opset 19, where FP8 Q/DQ exists
    graph = run_pipeline(gs.import_onnx(model), ctx, pipeline=PIPELINE, until=until)
    return graph, ctx


def float_types(graph: gs.Graph) -> dict[str, str]:
    out = {}
    for name, tensor in graph.tensors().items():
        try:
            out[name] = np.dtype(tensor.dtype).name if tensor.dtype is not None else "?"
        except TypeError:
            out[name] = str(tensor.dtype)
    return out


# strong_types


def test_strong_types_makes_every_inner_float_fp16_and_keeps_the_edges():
    model = mlp_chain(3)
    graph, ctx = gpu_graph(model, until="fp8_linears")
    types = float_types(graph)
    edges = {"x", "y"}
    assert {types[n] for n in edges} == {"float32"}
    inner = {n: t for n, t in types.items() if n not in edges and t.startswith("float")}
    assert inner and set(inner.values()) == {"float16"}, inner
    assert ctx.reports["strong_types"]["edge_casts"] == 2
    x = np.random.default_rng(0).standard_normal((1, 8, 16)).astype(np.float32)
    want = run_ort(model, {"x": x})[0]
    got = run_ort(gs.export_onnx(graph), {"x": x}, optimize=False)[0]
    assert got.dtype == np.float32
    assert cosine(want, got) > 0.9999


def test_strong_types_saturates_mask_constants_and_keeps_resize_scales():
    mask = helper.make_tensor("mask", TensorProto.FLOAT, [1, 4], [0, -3.4e38, 0, -3.4e38])
    scales = helper.make_tensor("scales", TensorProto.FLOAT, [4], [1, 1, 2, 2])
    model = helper.make_model(helper.make_graph(
        [helper.make_node("Add", ["x", "mask"], ["s"], name="mask_add"),
         helper.make_node("Softmax", ["s"], ["p"], name="softmax"),
         helper.make_node("Reshape", ["p", "shape"], ["p4"], name="to4d"),
         helper.make_node("Resize", ["p4", "", "scales"], ["y"], name="up", mode="nearest")],
        "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 1, 2, 8])],
        [mask, scales, helper.make_tensor("shape", TensorProto.INT64, [4], [1, 1, 1, 4])]),
        opset_imports=[helper.make_opsetid("", 19)])
    model.ir_version = 9
    graph, ctx = gpu_graph(model, until="fp8_linears")
    assert ctx.reports["strong_types"]["saturated_constants"] == 2
    assert np.asarray(graph.tensors()["scales"].values).dtype == np.float32
    x = np.array([[1.0, 2.0, 3.0, 4.0]], np.float32)
    got = run_ort(gs.export_onnx(graph), {"x": x}, optimize=False)[0]
    np.testing.assert_allclose(got, run_ort(model, {"x": x})[0], atol=1e-3)


@settings(max_examples=12, deadline=None)
@given(blocks=st.integers(1, 3), width=st.sampled_from([8, 16, 24]), seed=st.integers(0, 1000))
def test_strong_types_on_random_chains(blocks, width, seed):
    model = mlp_chain(blocks, width, seed)
    graph, _ = gpu_graph(model, until="fp8_linears")
    x = np.random.default_rng(seed).standard_normal((1, 8, width)).astype(np.float32)
    assert cosine(run_ort(model, {"x": x})[0], run_ort(gs.export_onnx(graph), {"x": x}, optimize=False)[0]) > 0.999


# fp8_linears


def test_fp8_linears_quantize_every_linear_and_keep_the_model():
    model = mlp_chain(2)   # unit-normal weights: all four linears in FP8 keep cosine 0.9986
    graph, ctx = gpu_graph(model, precision="fp8", until="stages", min_cosine=0.995)
    report = ctx.reports["fp8_linears"]
    assert {c["node"] for c in report["changes"]} == {"fc1_0", "fc2_0", "fc1_1", "fc2_1"}
    assert report["rounds"][-1]["cosine"] >= 0.995 and report["fp8_linear_macs"] == 1.0
    for node in graph.nodes:
        if node.op == "MatMul":   # both operands come out of a DequantizeLinear, the weight from an FP8 constant
            assert [t.inputs[0].op for t in node.inputs] == ["DequantizeLinear"] * 2
            weight = node.inputs[1].inputs[0].inputs[0]
            assert isinstance(weight, gs.Constant) and weight.dtype == onnx.TensorProto.FLOAT8E4M3FN
    assert sum(n.op == "QuantizeLinear" for n in graph.nodes) == 4   # one per activation, none for weights
    x = np.random.default_rng(1).standard_normal((1, 8, 16)).astype(np.float32)
    assert cosine(run_ort(model, {"x": x})[0], run_ort(gs.export_onnx(graph), {"x": x}, optimize=False)[0]) > 0.995


def test_fp8_linears_keep_the_most_fp8_the_target_allows_in_the_ranking_order():
    graph, ctx = gpu_graph(mlp_chain(6), precision="fp8", until="stages", min_cosine=0.999)
    report = ctx.reports["fp8_linears"]
    ranking = report["ranking"]
    assert len(ranking) == 12 and all(c["error"] > 0 for c in ranking)
    per_mac = [c["error"] / c["macs"] for c in ranking]
    assert per_mac == sorted(per_mac, reverse=True)   # the most harmful per MAC goes back to fp16 first
    kept = next(r for r in report["rounds"] if r["round"] == report["kept"])
    assert kept["promoted"] == [c["node"] for c in ranking[:len(kept["promoted"])]]
    assert kept["cosine"] >= 0.999 and 0 < report["fp8_linear_macs"] == kept["fp8_linear_macs"] < 1
    # the replica chose it, the real Q/DQ graph in onnxruntime confirmed it, and the two agree
    assert kept["confirmed"] >= 0.999 and abs(kept["confirmed"] - kept["cosine"]) < 1e-4
    assert all(min(r["cosine"], r.get("confirmed", 1.0)) < 0.999
               for r in report["rounds"] if r["fp8_linear_macs"] > kept["fp8_linear_macs"])
    fp8 = {n.name for n in graph.nodes if n.op == "MatMul" and n.inputs[0].inputs[0].op == "DequantizeLinear"}
    assert fp8 == {c["node"] for c in report["changes"]} == {c["node"] for c in ranking} - set(kept["promoted"])
    x = np.random.default_rng(1).standard_normal((1, 8, 16)).astype(np.float32)
    fp16, _ = gpu_graph(mlp_chain(6), until="stages")
    assert cosine(run_ort(gs.export_onnx(fp16), {"x": x}, optimize=False)[0],
                  run_ort(gs.export_onnx(graph), {"x": x}, optimize=False)[0]) > 0.998


def test_fp8_search_is_read_back_from_the_build_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARD_BUILD_CACHE", str(tmp_path))
    first, ctx = gpu_graph(mlp_chain(3), precision="fp8", until="stages", min_cosine=0.999)
    second, again = gpu_graph(mlp_chain(3), precision="fp8", until="stages", min_cosine=0.999)
    one, two = ctx.reports["fp8_linears"], again.reports["fp8_linears"]
    assert "cached" not in one and two["cached"] is True
    assert {k: two[k] for k in ("rounds", "kept", "ranking", "changes")} == \
        {k: one[k] for k in ("rounds", "kept", "ranking", "changes")}
    assert gs.export_onnx(first).SerializeToString() == gs.export_onnx(second).SerializeToString()
    _, other = gpu_graph(mlp_chain(3), precision="fp8", until="stages", min_cosine=0.9995)   # another target
    assert "cached" not in other.reports["fp8_linears"]


def test_fp8_linears_keep_every_linear_fp16_where_no_share_holds():
    graph, ctx = gpu_graph(mlp_chain(2), precision="fp8", until="stages", min_cosine=1.0)
    report = ctx.reports["fp8_linears"]
    assert report["kept"] is None and report["fp8_linear_macs"] == 0.0 and report["changes"] == []
    assert not any(n.op == "QuantizeLinear" for n in graph.nodes)
    assert any("every linear stays fp16" in w for w in ctx.warnings)


def test_fp8_holds_the_target_on_every_calibration_sample_but_the_ranked_one(tmp_path, monkeypatch):
    # One calibration sample far smaller than the rest (its activations near E4M3's subnormals at
    # the scales the others set) loses the most in FP8. Checked on the first 4 samples alone, every
    # linear stayed FP8 and that sample came out at 0.99303 for a target of 0.995.
    monkeypatch.setenv("SHARD_BUILD_CACHE", str(tmp_path / "cache"))
    xs = np.random.default_rng(0).standard_normal((8, 1, 8, 16)).astype(np.float32)
    xs[5] *= 1e-4
    np.savez(tmp_path / "calib.npz", x=xs)
    graph, ctx = gpu_graph(mlp_chain(3), precision="fp8", until="stages", min_cosine=0.995,
                           calib=str(tmp_path / "calib.npz"))
    report = ctx.reports["fp8_linears"]
    assert report["checked_on"] == 7 and 0 < report["fp8_linear_macs"] < 1
    fp16, _ = gpu_graph(mlp_chain(3), until="stages")
    for x in xs[:7]:
        assert cosine(run_ort(gs.export_onnx(fp16), {"x": x}, optimize=False)[0],
                      run_ort(gs.export_onnx(graph), {"x": x}, optimize=False)[0]) >= 0.995


def test_a_batched_fp8_check_counts_each_frame_on_its_own(tmp_path, monkeypatch):
    # At --batch 8 a sample holds 8 frames. One of them far smaller than the rest loses the most in
    # FP8; pooled into one cosine with the other seven it is averaged away (every linear stayed FP8).
    monkeypatch.setenv("SHARD_BUILD_CACHE", str(tmp_path / "cache"))
    model = mlp_chain(3)
    for value in (*model.graph.input, *model.graph.output):
        value.type.tensor_type.shape.dim[0].dim_value = 8
    xs = np.random.default_rng(0).standard_normal((2, 8, 8, 16)).astype(np.float32)
    xs[0, 5] *= 1e-4
    np.savez(tmp_path / "calib.npz", x=xs)
    graph, ctx = gpu_graph(model, precision="fp8", until="stages", min_cosine=0.995, batch=8,
                           calib=str(tmp_path / "calib.npz"))
    report = ctx.reports["fp8_linears"]
    assert report["frames"] == 8 and report["checked_on"] == 1 and 0 < report["fp8_linear_macs"] < 1
    fp16, _ = gpu_graph(model, until="stages")
    want, got = (run_ort(gs.export_onnx(g), {"x": xs[0]}, optimize=False)[0] for g in (fp16, graph))
    assert min(cosine(w, g) for w, g in zip(want, got)) >= 0.995


def test_fp8_kept_round_is_the_most_fp8_the_real_qdq_graph_confirms():
    # The replica only stands in for the real Q/DQ graph: a round it passes that onnxruntime does not
    # is passed over for the next most FP8 that onnxruntime holds.
    from shard.calibration import graph_stats, lifted
    from shard.passes.fp8_linears import confirmed_round, linears

    graph, _ = gpu_graph(mlp_chain(2), until="fp8_linears")   # all four linears in FP8: cosine 0.9986
    found = linears(graph)
    check = [{"x": np.random.default_rng(s).standard_normal((1, 8, 16)).astype(np.float32)} for s in (1, 2)]
    stats = graph_stats(graph, check, [n.inputs[0].name for n, _ in found])
    names = [n.name for n, _ in found]
    rounds = [{"round": 1, "promoted": [], "cosine": 1.0, "fp8_linear_macs": 1.0},
              {"round": 2, "promoted": names[1:], "cosine": 1.0, "fp8_linear_macs": 0.25},
              {"round": 3, "promoted": names[2:], "cosine": 0.5, "fp8_linear_macs": 0.5}]
    model, weights = lifted(graph)
    before = gs.export_onnx(graph.copy()).SerializeToString()
    assert confirmed_round(graph, found, stats, rounds, model, weights, check, 0.999) == 2
    assert rounds[0]["confirmed"] < 0.999 <= rounds[1]["confirmed"] and "confirmed" not in rounds[2]
    assert confirmed_round(graph, found, stats, rounds, model, weights, check, 0.99999999) is None
    assert gs.export_onnx(graph.copy()).SerializeToString() == before   # left as it came


def test_fp8_replica_with_one_gate_on_is_that_linear_in_fp8():
    # The replica's arithmetic is the pass's own: gates off, the fp16 graph; gate k on, the graph
    # with only linear k quantized as quantize_linears writes it.
    from shard.calibration import graph_stats
    from shard.passes.fp8_linears import fp8_replica, linears, quantize_linears
    from shard.precision import GATES

    graph, _ = gpu_graph(mlp_chain(2), until="fp8_linears")
    x = np.random.default_rng(3).standard_normal((1, 8, 16)).astype(np.float32)
    found = linears(graph)
    stats = graph_stats(graph, [{"x": x}], [n.inputs[0].name for n, _ in found])
    replica = gs.export_onnx(fp8_replica(graph, stats, found), do_type_check=False)
    plain = run_ort(gs.export_onnx(graph.copy()), {"x": x}, optimize=False)[0]
    off = run_ort(replica, {"x": x, GATES: np.zeros(len(found), np.float16)}, optimize=False)[0]
    np.testing.assert_array_equal(off, plain)
    for k in range(len(found)):
        one = graph.copy()
        quantize_linears(one, [(n, a) for n, a in linears(one) if n.name == found[k][0].name], stats)
        want = run_ort(gs.export_onnx(one, do_type_check=False), {"x": x}, optimize=False)[0]
        got = run_ort(replica, {"x": x, GATES: np.eye(len(found), dtype=np.float16)[k]}, optimize=False)[0]
        assert cosine(want, got) > 0.99999 and cosine(plain, got) < 0.99999


# stages and the roofline


def test_stages_balance_predicted_time_and_never_cut_an_fp8_tensor():
    graph, ctx = gpu_graph(mlp_chain(6), precision="fp8", shards=3)
    plans = ctx.plan
    assert len(plans) == 3
    for plan in plans:
        for t in (*plan.inputs, *plan.outputs):
            assert t.dtype in (np.float16, np.float32) and not (t.inputs and t.inputs[0].op == "DequantizeLinear")
    predicted = [s["predicted_s"] for s in ctx.reports["stages"]["stages"]]
    assert max(predicted) < 1.6 * min(predicted)


def test_roofline_uses_measured_kernels_where_the_profile_has_them():
    from shard.targets.gpu.roofline import measured_rate, node_cost, op_signature

    facts = json.loads((DATA / "h100.cuda.profile.json").read_text())["facts"]
    graph, _ = gpu_graph(mlp_chain(1, 64), until="fp8_linears")
    matmul = next(n for n in graph.nodes if n.op == "MatMul")
    cost = node_cost(matmul, facts)
    assert cost.flops == 2 * 8 * 64 * 128 and cost.weight_bytes == 64 * 128 * 2
    assert cost.floor_s == max(cost.compute_s, cost.memory_s) and cost.predicted_s >= facts["min_kernel_s"]
    measured = {**facts, "op_seconds": {op_signature(matmul): 1e-3}}
    assert node_cost(matmul, measured).predicted_s == 1e-3
    # inside a fused kernel the op is charged its share of that kernel, not its time alone
    fused = {**measured, "fused_op_seconds": {op_signature(matmul): 4e-4}}
    assert node_cost(matmul, fused).predicted_s == 4e-4
    low, high = measured_rate(facts, "fp16", 1e8), measured_rate(facts, "fp16", 1e11)
    assert 0 < low < high <= facts["peak_tflops"]["fp16"] * 1e12


# the cuda executor's torch form, on the CPU


@pytest.fixture(scope="module")
def vit_bundles(tmp_path_factory):
    from shard.zoo import export_model

    root = tmp_path_factory.mktemp("thor")
    model = export_model("vit-tiny", root / "vit.onnx", layers=3)
    bundles = {p: compile_model(model, "thor", root / f"vit-{p}.shard",
                                CompileOptions(precision=p, shards=2)).bundle for p in ("fp16", "fp8")}
    return model, bundles


def test_quantizes_are_charged_what_the_kept_form_takes_beyond_the_other_ops():
    # An FP8 stage's quantizes fold into the op before them once torch.compile'd: measured over
    # predicted was 0.70 on SigLIP-base's FP8 stages while they were charged their eager kernels.
    from shard.probes.cuda import charge_quantizes

    shares, counts = {"ln": 1.0, "mm": 3.0, "q": 2.0}, {"ln": 2, "mm": 4, "q": 2}   # eager: 2 + 12 + 4 = 18
    charged = charge_quantizes(shares, counts, {"q"}, stage=15.0)
    assert charged == {"ln": 1.0, "mm": 3.0, "q": 0.5}
    assert sum(charged[n] * c for n, c in counts.items()) == 15.0
    assert charge_quantizes(shares, counts, {"q"}, stage=12.0)["q"] == 0.0   # the others take it all


def test_thor_bundle_holds_typed_stages_and_a_recipe(vit_bundles):
    from shard.bundle import read_manifest

    model, bundles = vit_bundles
    for precision, bundle in bundles.items():
        manifest = read_manifest(bundle)
        assert manifest.target == "thor" and [s.core for s in manifest.shards] == [0, 1]
        assert manifest.build["tensorrt"]["strongly_typed"] and manifest.build["precision"] == precision
        ops = {n.op_type for s in manifest.shards for n in onnx.load(str(bundle / s.onnx)).graph.node}
        assert ("QuantizeLinear" in ops) == (precision == "fp8")
        if precision == "fp8":
            assert all(s.build_options["fp8_nodes"] for s in manifest.shards)


def test_thor_bundle_verifies_in_onnxruntime(vit_bundles):
    from shard.verifier import verify_bundle

    model, bundles = vit_bundles
    for bundle in bundles.values():
        report = verify_bundle(bundle, model, backend="cpu")
        assert report.outputs[0].cosine >= 0.999, report.outputs
        assert len(report.shards) == 2   # each stage checked alone too: cuts only at the model's own tensors


def test_torch_form_of_each_stage_matches_onnxruntime(vit_bundles):
    from shard.bundle import read_manifest
    from shard.runtime import random_inputs
    from shard.runtime.executors.cuda import CudaExecutor

    model, bundles = vit_bundles
    for precision, bundle in bundles.items():
        manifest = read_manifest(bundle)
        x = random_inputs(manifest.inputs)
        want = run_ort(onnx.load(str(model)), x)[0]
        executor = CudaExecutor(Path(bundle), manifest.shards, {t.name for t in manifest.outputs}, device="cpu")
        tensors = dict(x)
        for shard in manifest.shards:
            tensors.update(executor.run(shard, tensors))
        got = tensors["last_hidden_state"]
        assert isinstance(got, np.ndarray) and got.dtype == np.float32
        assert cosine(want, got) > (0.9999 if precision == "fp16" else 0.999), precision
        assert isinstance(executor.run(manifest.shards[0], x)[manifest.shards[0].outputs[0].name], torch.Tensor)


def test_cpu_executor_runs_qdq_stages_as_written(vit_bundles):
    """onnxruntime's Q/DQ propagation quantized the other readers of a Reshape's input: ViT-tiny's FP8
    stages fell from cosine 0.99965 to 0.931 in the cpu executor."""
    import onnxruntime as ort

    from shard.bundle import read_manifest
    from shard.runtime import random_inputs
    from shard.runtime.executors.cpu import CpuExecutor

    bundle = vit_bundles[1]["fp8"]
    shard = read_manifest(bundle).shards[0]
    x = random_inputs(shard.inputs)
    plain = ort.SessionOptions()
    plain.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    path, name = str(bundle / shard.onnx), shard.outputs[0].name
    exact = ort.InferenceSession(path, plain, providers=["CPUExecutionProvider"]).run([name], x)[0]
    propagated = ort.InferenceSession(path, providers=["CPUExecutionProvider"]).run([name], x)[0]
    ours = CpuExecutor(bundle, [shard]).run(shard, x)[name]
    assert cosine(propagated, exact) < 0.999 < 0.99999 < cosine(ours, exact), (cosine(propagated, exact),
                                                                              cosine(ours, exact))


def test_patch_convolution_as_one_product():
    from shard.runtime.executors.torch_graph import patches

    x, w, b = torch.randn(2, 3, 390, 384), torch.randn(8, 3, 14, 14), torch.randn(8)
    torch.testing.assert_close(patches(x, w, b), torch.nn.functional.conv2d(x, w, b, 14), atol=1e-3, rtol=1e-4)


def test_inspect_thor_prints_the_stage_roofline(vit_bundles, tmp_path):
    model, _ = vit_bundles
    res = shard_cli("inspect", model, "--target", "thor")
    assert res.returncode == 0, res.stderr
    assert "pipeline stages" in res.stdout and "floor ms" in res.stdout and "shard_001" in res.stdout


# engines: the precision check, and a clear refusal without TensorRT


@pytest.mark.parametrize("fixture, problems, unseen", [("fp8_good", 0, 0), ("fp8_fallback", 3, 0),
                                                       ("fp8_myelin", 0, 2), ("names_only", 1, 0)])
def test_engine_precision_check(fixture, problems, unseen):
    """Engine information in TensorRT's DETAILED JSON layout (the developer guide's engine inspector
    examples), written for these cases: a good FP8 engine, one whose FP8 requests came out FP16 and
    FP32, one fused into a Myelin region, and one built without detailed verbosity."""
    from shard.targets.gpu.engines import check_engine

    info = json.loads((DATA / "engines" / f"{fixture}.json").read_text())
    result = check_engine(info, "shard_000", "fp8", ["fc1_0", "fc2_0"])
    assert len(result.problems) == problems, result.problems
    assert len(result.unseen) == unseen
    if fixture == "fp8_fallback":
        text = " ".join(result.problems)
        assert "'fc1_0'" in text and "FP16" in text and "fc2_0" in text and "FP32" in text


@pytest.mark.parametrize("args", [["build-engines", "{bundle}"], ["run", "{bundle}", "--backend", "tensorrt"]])
def test_tensorrt_missing_is_one_line(vit_bundles, args):
    _, bundles = vit_bundles
    res = shard_cli(*[a.format(bundle=bundles["fp16"]) for a in args])
    assert res.returncode == 1 and "Traceback" not in res.stderr
    errors = [line for line in res.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "TensorRT" in errors[0], res.stderr


def test_cuda_without_a_profile_says_how_to_make_one(tmp_path):
    onnx.save(mlp_chain(1), str(tmp_path / "m.onnx"))
    res = shard_cli("compile", tmp_path / "m.onnx", "--target", "cuda")
    assert res.returncode == 1 and "shard probe --target cuda" in res.stderr


def test_strong_types_casts_a_float64_output_back_to_float64():
    """Found on the onnx package's pytorch-operator models (add_broadcast: double inputs): the output's
    Cast said float32 and onnxruntime refused the stage."""
    graph = helper.make_graph([helper.make_node("Add", ["a", "b"], ["y"], name="add")], "g",
                              [helper.make_tensor_value_info("a", TensorProto.DOUBLE, [2, 3]),
                               helper.make_tensor_value_info("b", TensorProto.DOUBLE, [3])],
                              [helper.make_tensor_value_info("y", TensorProto.DOUBLE, [2, 3])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    typed, _ = gpu_graph(model, until="fp8_linears")
    feeds = {"a": np.arange(6.0).reshape(2, 3), "b": np.array([0.5, 1.5, 2.5])}
    got = run_ort(gs.export_onnx(typed), feeds, optimize=False)[0]
    assert got.dtype == np.float64
    np.testing.assert_allclose(got, feeds["a"] + feeds["b"])


def test_strong_types_folds_batchnorm_statistics_fp16_cannot_hold():
    """PP-OCRv4's detector: running variances of 1e7-1e8 saturated at 65504 in fp16, cosine 0.005."""
    rng = np.random.default_rng(0)
    var = rng.uniform(1e7, 1e8, 4).astype(np.float32)
    params = {"gamma": rng.uniform(0.7, 1.1, 4), "beta": rng.uniform(-0.4, 0.4, 4),
              "mean": rng.uniform(-500, 300, 4), "var": var}
    graph = helper.make_graph([helper.make_node("BatchNormalization", ["x", *params], ["y"], name="bn")], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 8, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 8, 8])],
                              [onnx.numpy_helper.from_array(np.asarray(v, np.float32), k) for k, v in params.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    typed, ctx = gpu_graph(model, until="fp8_linears")
    assert ctx.reports["strong_types"]["batchnorms_folded"] == 1
    assert ctx.reports["strong_types"]["saturated_constants"] == 0 and not ctx.warnings
    x = (rng.standard_normal((1, 4, 8, 8)) * np.sqrt(var)[None, :, None, None]).astype(np.float32)
    assert cosine(run_ort(model, {"x": x})[0], run_ort(gs.export_onnx(typed), {"x": x}, optimize=False)[0]) > 0.9999


def test_strong_types_warns_of_a_constant_past_fp16():
    graph = helper.make_graph([helper.make_node("Mul", ["x", "big"], ["y"], name="scale_up")], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])],
                              [onnx.numpy_helper.from_array(np.full(4, 1e5, np.float32), "big")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    _, ctx = gpu_graph(model, until="fp8_linears")
    assert any("big" in w and "scale_up" in w for w in ctx.warnings)


def test_large_host_copies_split_over_threads_give_what_one_copy_gives(monkeypatch):
    # The float32 frames in and out of a batch are the host's work between a stage's replays
    from shard.runtime.executors import gpu

    monkeypatch.setenv(gpu.COPY_THREADS, "4")
    rng = np.random.default_rng(0)
    big = rng.standard_normal((1, 3, 1024, 1024))            # float64, 24 MB, one frame: split flat
    cases = [(np.empty(big.shape, np.float32), big),
             (np.empty((1024, 3, 1024), np.float32), big[0].transpose(1, 0, 2)),   # not contiguous: split by rows
             (np.empty((16, 3, 256, 256), np.float16), np.float32(2.5)),            # broadcast
             (np.empty((4, 8), np.float32), rng.standard_normal((4, 8)))]          # small: one copy
    for dst, src in cases:
        want = np.empty_like(dst)
        np.copyto(want, src, casting="unsafe")
        gpu.copy_into(dst, src)
        np.testing.assert_array_equal(dst, want)
    assert gpu.copy_pool(4)._max_workers == 4 and any(t.name.startswith("shard-copy") for t in gpu.copy_pool(4)._threads)


def test_a_capture_runs_after_a_collection_with_the_collector_paused():
    # Pi0's GPU test aborted on an H100: the collector ran inside the denoising loop's capture and
    # finalized something whose release calls the driver (with the collector off, it passed)
    import gc

    from shard.runtime.executors.gpu import collector_paused

    finalized, capturing = [], [False]

    class Cycle:
        def __init__(self):
            self.me = self

        def __del__(self):
            finalized.append(capturing[0])

    Cycle()
    with collector_paused():
        capturing[0] = True
        assert finalized == [False] and not gc.isenabled()
        for _ in range(20 * gc.get_threshold()[0]):   # enough to start many collections, were it on
            Cycle()
        assert finalized == [False]
        capturing[0] = False
    assert gc.isenabled()
    with pytest.raises(ValueError), collector_paused():
        raise ValueError("a capture that failed")
    assert gc.isenabled()
    gc.disable()
    try:
        with collector_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()
    gc.collect()
    assert len(finalized) > 1 and not any(finalized)   # every one finalized, none while capturing


def test_every_form_that_fails_is_passed_over_with_what_failed_inside(vit_bundles):
    # SigLIP-so400m's compiled form was passed over on an H100 as "BackendCompilerFailed: backend='inductor'
    # raised:", the line that only introduces the cause
    from shard.bundle import read_manifest
    from shard.runtime.executors.gpu import StreamExecutor
    from shard.runtime.executors.torch_graph import TorchGraph

    def broken(gm, example_inputs):
        raise ValueError("no kernel for this shape")

    bundle = Path(vit_bundles[1]["fp16"])
    shard = read_manifest(bundle).shards[0]
    graph = TorchGraph(onnx.load(str(bundle / shard.onnx)), "cpu", shard.name)
    order = [[t.name for t in shard.inputs].index(name) for name in graph.inputs]
    eager = lambda inputs: graph(*[inputs[k] for k in order])   # noqa: E731
    executor = StreamExecutor(bundle, [shard], set(), lambda shard, buffers: {
        "eager": eager, "compiled": torch.compile(eager, backend=broken), "other": lambda inputs: 1 / 0}, device="cpu")
    assert executor.prepared[shard.name].form == "eager"
    why = executor.passed_over[shard.name]
    assert why.startswith("compiled: BackendCompilerFailed: ValueError: no kernel for this shape; "), why
    assert why.endswith("other: ZeroDivisionError: division by zero"), why


def test_the_default_prediction_charges_the_fused_form_s_kernels():
    # Pi0 on an H100, its programs' stages as the cuda executor keeps them: ops one by one predicted
    # 1.29-1.88x the measured stages (GELU's eight ops as eight kernels, attention's scores written out)
    import tempfile

    from shard.targets.gpu.roofline import fused_steps, node_cost, node_seconds, step_seconds
    from shard.zoo import export_model

    measured = json.loads((DATA / "h100.cuda.profile.json").read_text())["facts"]
    facts = {k: v for k, v in measured.items() if k != "op_seconds"}   # the default: no ops measured
    with tempfile.TemporaryDirectory() as tmp:
        model = export_model("siglip-base-512", Path(tmp) / "s.onnx", layers=2, image_size=64)
        graph, _ = gpu_graph(onnx.load(str(model)), until="stages")
    steps = fused_steps(graph.nodes, graph.outputs)
    runs = [sorted(n.op for n in step) for step in steps if len(step) > 1]
    # as the executor fuses this stage: 2 attentions, 2 q-k-v products, 6 linears with a bias, 2 GELUs
    assert sum("Softmax" in ops for ops in runs) == 2 and sum("Tanh" in ops for ops in runs) == 2
    assert len(runs) == 12 and sum(ops == ["Add"] * 3 + ["MatMul"] * 3 for ops in runs) == 2
    placed = [id(n) for step in steps for n in step]
    assert len(placed) == len(set(placed)) and set(placed) <= {id(n) for n in graph.nodes}
    seconds = node_seconds(graph.nodes, graph.outputs, facts)
    for step in steps:
        assert math.isclose(sum(seconds[id(n)] for n in step), step_seconds(step, facts), rel_tol=1e-9)
        assert step_seconds(step, facts) >= facts["min_kernel_s"] or all(n.op in ("Reshape", "Squeeze", "Unsqueeze",
                                                                                  "Flatten", "Identity") for n in step)
    one_by_one = {id(n): node_cost(n, facts).predicted_s for n in graph.nodes}
    gelu = next(step for step in steps if any(n.op == "Tanh" for n in step))
    assert step_seconds(gelu, facts) < sum(one_by_one[id(n)] for n in gelu)   # one kernel, not eight
    assert sum(seconds.values()) < sum(one_by_one.values())
    # an FP8 stage is planned too (its weights FP8 meta tensors), each weight's dequantize done at load
    fp8, _ = gpu_graph(mlp_chain(2, 64), precision="fp8", until="stages")
    planned = fused_steps(fp8.nodes, fp8.outputs)
    assert planned is not None and any(n.op == "QuantizeLinear" for step in planned for n in step)
    assert not any(n.op == "DequantizeLinear" and isinstance(n.inputs[0], gs.Constant) for step in planned for n in step)
    # ops measured (shard probe --ops): each op's own, as measured
    assert node_seconds(graph.nodes, graph.outputs, measured) == {id(n): node_cost(n, measured).predicted_s
                                                                   for n in graph.nodes}


def test_an_op_the_executor_has_no_torch_form_of_is_predicted_op_by_op():
    from onnx import numpy_helper

    from shard.targets.gpu.roofline import fused_steps, node_cost, node_seconds

    facts = {k: v for k, v in json.loads((DATA / "h100.cuda.profile.json").read_text())["facts"].items()
             if k != "op_seconds"}   # no ops measured: the fused form, where it can be planned
    w = np.ones((16, 16), np.float16)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Einsum", ["h", "h"], ["y"], equation="ij,ij->ij")]
    graph = gs.import_onnx(helper.make_model(helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT16, [16, 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT16, [16, 16])], [numpy_helper.from_array(w, "w")],
        value_info=[helper.make_tensor_value_info("h", TensorProto.FLOAT16, [16, 16])])))
    assert fused_steps(graph.nodes, graph.outputs) is None
    assert node_seconds(graph.nodes, graph.outputs, facts) == {id(n): node_cost(n, facts).predicted_s for n in graph.nodes}
