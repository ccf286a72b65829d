"""Calibration and test samples (.npz with a leading sample axis): checked against the model's inputs,
one clear line for each thing wrong; range statistics from onnxruntime."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import make_model, shard_cli
from onnx import helper

from shard.bundle import TensorSpec
from shard.calibration import collect_stats, load_samples, random_samples
from shard.errors import ShardError

INPUTS = [TensorSpec("input_ids", [1, 6], "int64"), TensorSpec("pixels", [1, 2, 3], "float32")]


def npz(tmp_path, name="s.npz", **arrays):
    path = tmp_path / name
    np.savez(path, **arrays)
    return path


def good(n=3):
    return {"input_ids": np.arange(n * 6, dtype=np.int64).reshape(n, 1, 6),
            "pixels": np.ones((n, 1, 2, 3), np.float32)}


def test_samples_come_back_one_dict_per_sample_in_the_models_dtypes(tmp_path):
    samples = load_samples(npz(tmp_path, **good(3)), INPUTS)
    assert len(samples) == 3 and samples[2]["input_ids"].tolist() == [[12, 13, 14, 15, 16, 17]]
    assert samples[0]["input_ids"].dtype == np.int64 and samples[0]["pixels"].shape == (1, 2, 3)


@pytest.mark.parametrize("change, message", [
    (lambda a: a.pop("pixels"), "no array named 'pixels'; the model's inputs are input_ids, pixels"),
    (lambda a: a.update(extra=np.zeros(3)), "array 'extra' is not an input of the model"),
    (lambda a: a.update(pixels=np.ones((1, 2, 3), np.float32)), "pixels has shape [1, 2, 3]; expected [N, 1, 2, 3]"),
    (lambda a: a.update(pixels=np.ones((3, 1, 2, 4), np.float32)), "pixels has shape [3, 1, 2, 4]; expected [N, 1, 2, 3]"),
    (lambda a: a.update(input_ids=a["input_ids"].astype(np.float32)), "input_ids is float32; the model takes int64"),
    (lambda a: a.update(pixels=np.ones((2, 1, 2, 3), np.float32)), "different numbers of samples (input_ids: 3, pixels: 2)"),
])
def test_each_format_error_is_one_line_naming_what_is_wrong(tmp_path, change, message):
    arrays = good(3)
    change(arrays)
    with pytest.raises(ShardError) as info:
        load_samples(npz(tmp_path, **arrays), INPUTS, "--inputs")
    assert message in str(info.value) and "\n" not in str(info.value) and str(info.value).startswith("--inputs ")


def test_unreadable_file_is_an_error(tmp_path):
    path = tmp_path / "not.npz"
    path.write_text("hello")
    with pytest.raises(ShardError, match="cannot read it as .npz"):
        load_samples(path, INPUTS)


def test_random_samples_are_seeded_and_typed():
    a, b = random_samples(INPUTS, 2), random_samples(INPUTS, 2)
    assert np.array_equal(a[1]["pixels"], b[1]["pixels"]) and not np.array_equal(a[0]["pixels"], a[1]["pixels"])
    assert a[0]["input_ids"].dtype == np.int64


def test_stats_are_ranges_and_channel_maxima_over_all_samples():
    model = make_model([helper.make_node("Mul", ["x", "x"], ["sq"]), helper.make_node("Neg", ["sq"], ["y"])],
                       [("x", [2, 3])], [("y", [2, 3])])
    samples = [{"x": np.array([[1, -2, 3], [0, 1, 0]], np.float32)}, {"x": np.array([[0, 0, -4], [1, 1, 1]], np.float32)}]
    stats = collect_stats(model, samples)
    assert (stats["sq"].min, stats["sq"].max) == (0.0, 16.0) and stats["y"].min == -16.0
    assert stats["x"].channel_absmax.tolist() == [1.0, 2.0, 4.0] and stats["y"].absmax == 16.0
    assert stats["sq"].channel_absmax.tolist() == [1.0, 4.0, 16.0]
    # Without the per-channel reductions: the same ranges, and the tensor's absolute maximum alone.
    ranges = collect_stats(model, samples, channels=False)
    assert {n: (s.min, s.max) for n, s in ranges.items()} == {n: (s.min, s.max) for n, s in stats.items()}
    assert [ranges[n].channel_absmax.tolist() for n in ("x", "sq", "y")] == [[4.0], [16.0], [16.0]]


def test_stats_are_kept_by_the_hash_of_model_and_samples(tmp_path, monkeypatch):
    import shard.calibration as calibration

    model = make_model([helper.make_node("Mul", ["x", "x"], ["sq"]), helper.make_node("Neg", ["sq"], ["y"])],
                       [("x", [2, 3])], [("y", [2, 3])])
    samples = [{"x": np.array([[1, -2, 3], [0, 1, 0]], np.float32)}]
    first = collect_stats(model, samples, cache=tmp_path)
    assert len(list(tmp_path.glob("stats-*/stats.npz"))) == 1

    def no_run(*args):
        raise AssertionError("onnxruntime ran on a cache hit")

    monkeypatch.setattr(calibration, "measure_stats", no_run)
    again = collect_stats(model, samples, cache=tmp_path)
    assert {n: (t.min, t.max, t.channel_absmax.tolist()) for n, t in again.items()} == \
        {n: (t.min, t.max, t.channel_absmax.tolist()) for n, t in first.items()}
    with pytest.raises(AssertionError, match="onnxruntime ran"):   # other samples: another key
        collect_stats(model, [{"x": samples[0]["x"] * 2}], cache=tmp_path)
    with pytest.raises(AssertionError, match="onnxruntime ran"):   # other tensors asked for: another key
        collect_stats(model, samples, names=["sq"], cache=tmp_path)


def test_lifted_weights_give_the_same_stats_without_copies_and_key_the_cache(tmp_path, monkeypatch):
    """A weight past LIFTED_BYTES is fed to onnxruntime as an input (the graph's own array); the
    statistics equal those of the model holding it, and another weight misses the cache."""
    import onnx_graphsurgeon as gs
    from onnx import numpy_helper

    import shard.calibration as calibration

    rng = np.random.default_rng(0)
    w = rng.standard_normal((256, 1024)).astype(np.float32)   # 1 MiB: lifted
    b = rng.standard_normal(1024).astype(np.float32)          # 4 KiB: stays a constant
    model = make_model([helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Add", ["h", "b"], ["y"])],
                       [("x", [4, 256])], [("y", [4, 1024])],
                       [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")])
    graph = gs.import_onnx(model)
    light, weights = calibration.lifted(graph)
    assert list(weights) == ["w"] and np.shares_memory(weights["w"], graph.tensors()["w"].values)
    assert [t.name for t in light.graph.initializer] == ["b"] and "w" in [i.name for i in light.graph.input]
    samples = [{"x": rng.standard_normal((4, 256)).astype(np.float32)} for _ in range(2)]
    whole = collect_stats(model, samples)
    stats = collect_stats(light, samples, cache=tmp_path, weights=weights)
    assert set(stats) == set(whole) == {"x", "h", "y"}
    for name in ("h", "y"):
        assert np.isclose(stats[name].max, whole[name].max, rtol=1e-5)
        assert np.allclose(stats[name].channel_absmax, whole[name].channel_absmax, rtol=1e-5)
    monkeypatch.setattr(calibration, "measure_stats", lambda *a: (_ for _ in ()).throw(AssertionError("ran")))
    collect_stats(light, samples, cache=tmp_path, weights=weights)   # a hit
    with pytest.raises(AssertionError, match="ran"):   # other weights: another key
        collect_stats(light, samples, cache=tmp_path, weights={"w": w * 2})


def test_cli_rejects_a_bad_calibration_file_in_one_line(tmp_path, save):
    model = save(make_model([helper.make_node("Relu", ["x"], ["y"])], [("x", [1, 4])], [("y", [1, 4])]))
    bad = npz(tmp_path, x=np.zeros((2, 1, 4), np.float64))
    out = shard_cli("compile", model, "--target", "cpu", "--precision", "int8", "--calib", bad, "-o", tmp_path / "b")
    assert out.returncode == 1 and "--precision int8: target cpu builds fp32" in out.stderr
    out = shard_cli("compile", model, "--target", "cpu", "-o", tmp_path / "b.shard")
    assert out.returncode == 0, out.stderr
    out = shard_cli("verify", tmp_path / "b.shard", "-r", model, "--backend", "cpu", "--inputs", bad)
    assert out.returncode == 1 and "x is float64; the model takes float32" in out.stderr
    assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1
    ok = npz(tmp_path, "ok.npz", x=np.random.default_rng(0).standard_normal((3, 1, 4)).astype(np.float32))
    out = shard_cli("verify", tmp_path / "b.shard", "-r", model, "--backend", "cpu", "--inputs", ok)
    assert out.returncode == 0 and "3 samples from ok.npz" in out.stdout, out.stdout + out.stderr


def test_domain_samples_draw_token_ids_from_the_table_they_index_and_masks_of_ones():
    import onnx_graphsurgeon as gs
    from onnx import TensorProto, helper, numpy_helper

    from shard.bundle import TensorSpec
    from shard.calibration import domain_samples

    table = numpy_helper.from_array(np.ones((50, 4), np.float32), "table")
    nodes = [helper.make_node("Cast", ["ids"], ["ids32"], to=TensorProto.INT32),
             helper.make_node("Gather", ["table", "ids32"], ["e"]),
             helper.make_node("Cast", ["mask"], ["m"], to=TensorProto.FLOAT),
             helper.make_node("Unsqueeze", ["m", "axis"], ["mu"]), helper.make_node("Mul", ["e", "mu"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("ids", TensorProto.INT64, [1, 64]),
                                           helper.make_tensor_value_info("mask", TensorProto.INT64, [1, 64])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 64, 4])],
                              initializer=[table, numpy_helper.from_array(np.array([2], np.int64), "axis")])
    specs = [TensorSpec("ids", [1, 64], "int64"), TensorSpec("mask", [1, 64], "int64")]
    samples = domain_samples(gs.import_onnx(helper.make_model(graph)), specs, 3)
    ids = np.stack([s["ids"] for s in samples])
    assert ids.min() >= 0 and ids.max() < 50 and len(np.unique(ids)) > 10   # the vocabulary, not 0 and 1
    assert all(np.array_equal(s["mask"], np.ones((1, 64), np.int64)) for s in samples)
    assert np.array_equal(domain_samples(gs.import_onnx(helper.make_model(graph)), specs, 3)[1]["ids"], samples[1]["ids"])
