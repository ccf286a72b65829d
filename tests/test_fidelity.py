"""The simulator's fidelity check shard by shard (shard.compilation.fidelity), with the real toolkit:
a session's figures, one simulator build per artifact, and a failed build ends it at once."""

import shutil

import numpy as np
import onnx
import pytest
from conftest import mlp_chain, run_ort

import shard
from shard.bundle import Manifest, ShardSpec, TensorSpec, read_manifest
from shard.calibration import random_samples
from shard.compilation.choice import bundle_worst
from shard.compilation.fidelity import (Chains, Runs, Side, composed_worst, digest, groups, reference_outputs,
                                        run_in_order)
from shard.compilation.names import FIDELITY_SAMPLES
from shard.errors import RunError
from shard.options import CompileOptions
from shard.runtime import Session, random_inputs
from shard.targets.rknn.simulate import ShardByShard
from shard.verifier import prepared_reference


def manifest_of(artifacts: list[str | None]) -> Manifest:
    x = [TensorSpec("x", [1, 4], "float32")]
    shards = [ShardSpec(f"shard_{k:03d}", f"shards/shard_{k:03d}.onnx", None, None, x, x, 0, "fp16",
                        built_from={"artifact": a} if a else {}) for k, a in enumerate(artifacts)]
    return Manifest("rk3588", {}, {}, {}, x, x, shards)


def test_one_simulator_build_serves_each_bundle_holding_the_same_artifact_at_the_same_place():
    ours = Side(None, manifest_of(["a0", "a1", "a2"]), [])
    theirs = Side(None, manifest_of(["t0", "a1", None]), [])
    work = groups([ours, theirs])
    assert [[(side is ours, k) for side, k in group] for group in work] == [
        [(True, 0)], [(False, 0)], [(True, 1), (False, 1)], [(True, 2)], [(False, 2)]]
    # in the shards' order, so a group only ever waits on groups before it
    assert [group[0][1] for group in work] == sorted(group[0][1] for group in work)


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    root = tmp_path_factory.mktemp("fidelity")
    model = root / "mlp.onnx"
    model.write_bytes(mlp_chain(4, width=32).SerializeToString())
    shard.compile(model, "rk3588", root / "m.shard", CompileOptions(shards=2, check_fidelity=False))
    return root / "m.shard", model


@pytest.mark.toolkit
def test_shard_by_shard_makes_what_a_session_makes(bundle):
    path, model = bundle
    manifest = read_manifest(path)
    assert len(manifest.shards) == 2
    samples = [random_inputs(manifest.inputs, seed) for seed in range(3)]
    sides = [Side(path, m, [dict(s) for s in samples]) for m in (manifest, read_manifest(path))]
    with ShardByShard("rk3588", workers=2) as simulator:
        run_in_order(sides, simulator, lambda *a: None, Runs(None, ""))
        worst = composed_worst([path], model, samples, simulator)
    with Session(path, "sim") as session:
        for k, sample in enumerate(samples):
            made = session.run_all(sample)
            for side in sides:   # the same bundle twice: one build per shard served both, bit for bit
                for name, value in made.items():
                    np.testing.assert_array_equal(side.frames[k][name], value)
    assert worst[0].cosine == pytest.approx(bundle_worst(path, model, samples).cosine, abs=1e-7)
    assert worst[0].cosine > 0.999


@pytest.mark.toolkit
def test_a_shard_the_simulator_cannot_build_ends_the_check_with_its_name(bundle, tmp_path):
    path, model = bundle
    broken = tmp_path / "broken.shard"
    shutil.copytree(path, broken)
    (broken / "shards" / "shard_000.onnx").write_bytes(b"not a model")
    manifest = read_manifest(path)
    samples = [random_inputs(manifest.inputs, 0)]
    with ShardByShard("rk3588", workers=2) as simulator, pytest.raises(RunError, match="shard_000"):
        composed_worst([broken], model, samples, simulator)   # shard_001 waited on it, and was woken


@pytest.mark.toolkit
def test_shard_runs_kept_in_the_cache_build_nothing_the_next_time(bundle, tmp_path):
    path, model = bundle
    manifest = read_manifest(path)
    samples = [random_inputs(manifest.inputs, seed) for seed in range(2)]
    runs = Runs(tmp_path / "cache", "rk3588 test")
    with ShardByShard("rk3588", workers=1) as simulator:
        first = composed_worst([path], model, samples, simulator, runs=runs)
        assert simulator.pool.started and runs.built_again == 2   # built and ran
    kept = Runs(tmp_path / "cache", "rk3588 test")
    with ShardByShard("rk3588", workers=1) as simulator:
        again = composed_worst([path], model, samples, simulator, runs=kept)
        assert simulator.pool.started == [] and kept.built_again == 0   # no worker, so nothing built
    assert again[0].cosine == first[0].cosine and again[0].max_abs_diff == first[0].max_abs_diff
    # another build, other inputs or another toolkit are another entry
    fed = digest(([samples[0]["x"]], ["nchw"]))
    assert len({runs.key("a", fed), runs.key("b", fed), runs.key("a", digest(([samples[1]["x"]], ["nchw"]))),
                Runs(None, "rk3588 other").key("a", fed)}) == 4
    assert runs.key(None, fed) is None   # no artifact to name the build by: nothing kept


def test_the_whole_builds_runs_are_kept_where_the_models_outputs_have_no_shape():
    # a model with a dynamic axis: after its inputs are fixed, its outputs still have none (and a
    # decoder's may have no rank); the run is kept as the simulator gave it, for its bundle's shapes
    x = onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 16, 128])
    y = onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["batch", "seq", 128])
    z = onnx.helper.make_tensor_value_info("z", onnx.TensorProto.FLOAT, None)
    relus = [onnx.helper.make_node("Relu", ["x"], [out]) for out in ("y", "z")]
    graph = onnx.helper.make_graph(relus, "g", [x], [y, z])
    chains = Chains(Runs(None, ""))
    whole = chains.whole(graph)
    sample = {"x": np.ones((1, 16, 128), np.float32)}
    chains.start([sample], [], {})
    with whole.building():
        fed = whole.wanted("artifact")
        assert len(fed) == 1
        made = [np.ones(2048, np.float32), np.ones(97, np.float32)]
        whole.made("artifact", [made])
    kept = chains.runs.get(chains.runs.key("artifact", digest(fed[0])))
    assert [a.shape for a in kept] == [(2048,), (97,)]


@pytest.mark.toolkit
def test_the_check_takes_the_runs_made_where_each_shard_built(tmp_path):
    model = tmp_path / "mlp.onnx"
    model.write_bytes(mlp_chain(4, width=32).SerializeToString())
    result = shard.compile(model, "rk3588", tmp_path / "m.shard",
                           CompileOptions(shards=2, jobs=2, check_fidelity=True, vendor_baseline=False, build_cache=False))
    assert len(result.manifest.shards) == 2
    assert result.report["fidelity_builds"] == 0   # no shard built again for the check
    # the figure is the check's with every shard built again on the simulator, on the same samples
    samples = random_samples([TensorSpec("x", [1, 8, 32], "float32")], FIDELITY_SAMPLES)
    with ShardByShard("rk3588", workers=1) as simulator:
        runs = Runs(None, "")
        again = composed_worst([tmp_path / "m.shard"], model, samples, simulator, runs=runs)
        assert runs.built_again == 2
    assert result.report["fidelity"]["bundle"] == again[0].cosine


@pytest.mark.toolkit
def test_the_reference_is_read_from_its_file_where_compile_read_it_as_it_is(bundle, tmp_path):
    path, model = bundle
    manifest = read_manifest(path)
    samples = [random_inputs(manifest.inputs, 0)]
    assert prepared_reference(model, manifest)[1]   # nothing fixed, upgraded or renumbered
    want = run_ort(onnx.load(model), samples[0])[0]
    np.testing.assert_array_equal(reference_outputs(model, manifest, samples)[0]["y"], want)
    older = onnx.load(model)   # an old opset is upgraded first: onnxruntime then runs that model, not the file
    older.opset_import[0].version = 11
    onnx.save(older, tmp_path / "old.onnx")
    assert not prepared_reference(tmp_path / "old.onnx", manifest)[1]
    np.testing.assert_allclose(reference_outputs(tmp_path / "old.onnx", manifest, samples)[0]["y"], want, rtol=1e-6)
