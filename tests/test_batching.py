"""--batch: a bundle compiled for B frames at once, fed single frames (shard.runtime.batching), and
--batch auto's choice from the GPU cost model (shard.compilation.batching)."""

import json

import numpy as np
import onnx
import pytest
from conftest import assert_one_line_error, cosine, run_ort, shard_cli

from shard.compilation import compile_model
from shard.compilation.batching import BATCHES, pick
from shard.errors import ModelError, RunError
from shard.options import CompileOptions
from shard.runtime import Session, random_inputs


@pytest.fixture(scope="module")
def dynamic_vit(tmp_path_factory):
    from shard.zoo import export_model

    root = tmp_path_factory.mktemp("batch")
    return export_model("vit-tiny", root / "vit.onnx", layers=1, image_size=64, dynamic_batch=True), root


def test_single_frames_stacked_into_batches_come_back_each_its_own(dynamic_vit):
    model, root = dynamic_vit
    result = compile_model(model, "thor", root / "b4.shard", CompileOptions(batch=4, shards=2))
    manifest = result.manifest
    assert manifest.batch == 4 and manifest.inputs[0].shape[0] == 4 and manifest.outputs[0].shape[0] == 4
    assert json.loads((result.bundle / "manifest.json").read_text())["batch"] == 4
    reference = onnx.load(str(model))
    with Session(result.bundle, "cpu") as session:
        frames = [random_inputs(session.batching.frame_inputs, seed=k) for k in range(6)]   # 4, then 2 filled out
        outputs = list(session.run_stream(frames))
        assert session.frames_run == 2   # two runs of the stages for six frames
        one = session.run(frames[5])   # one frame alone: filled out to a batch, its own part back
        whole = session.run({"pixel_values": np.concatenate([f["pixel_values"] for f in frames[:4]])})
    assert len(outputs) == 6
    for frame, got in zip(frames, outputs):
        want = run_ort(reference, frame)[0]
        assert got["last_hidden_state"].shape == want.shape == (1, *manifest.outputs[0].shape[1:])
        assert cosine(want, got["last_hidden_state"]) > 0.9999
    np.testing.assert_array_equal(one["last_hidden_state"], outputs[5]["last_hidden_state"])
    np.testing.assert_array_equal(whole["last_hidden_state"][:1], outputs[0]["last_hidden_state"])
    with Session(result.bundle, "cpu") as session, pytest.raises(RunError, match="batches of 4"):
        session.run({"pixel_values": np.zeros((2, 3, 64, 64), np.float32)})


def test_a_batched_fp8_compile_calibrates_on_frames_not_batches(dynamic_vit):
    # Seeded samples of a batched compile hold `batch` frames each: 8 frames' worth, at least two (one
    # to check the FP8 rounds on, one to rank the linears on), not 8 batches.
    from shard.calibration import RANDOM_SAMPLES, random_count

    assert [random_count(b) for b in (1, 3, 4, 16)] == [RANDOM_SAMPLES, 3, 2, 2]
    model, root = dynamic_vit
    result = compile_model(model, "thor", root / "b4-fp8.shard", CompileOptions(batch=4, precision="fp8",
                                                                                 min_cosine=0.99))
    fp8 = result.report["passes"]["fp8_linears"]
    assert fp8["samples"] == 2 and fp8["checked_on"] == 1 and fp8["kept"] is not None
    kept = next(r for r in fp8["rounds"] if r["round"] == fp8["kept"])
    assert kept["confirmed"] >= 0.99 and fp8["changes"]
    frame = random_inputs(result.manifest.inputs, seed=9)
    with Session(result.bundle, "cpu") as session:
        got = session.run(frame)["last_hidden_state"]
    assert cosine(run_ort(onnx.load(str(model)), frame)[0], got) > 0.99


def test_a_bundle_of_batch_one_writes_no_batch(dynamic_vit):
    model, root = dynamic_vit
    result = compile_model(model, "thor", root / "b1.shard", CompileOptions(input_shapes={"pixel_values": (1, 3, 64, 64)}))
    assert result.manifest.batch == 1
    assert "batch" not in json.loads((result.bundle / "manifest.json").read_text())   # older bundles keep their digest


def test_a_fixed_batch_axis_is_refused_in_one_line(tmp_path):
    from shard.zoo import export_model

    model = export_model("vit-tiny", tmp_path / "static.onnx", layers=1, image_size=64)
    with pytest.raises(ModelError, match="fixed at 1; export it with a dynamic batch axis"):
        compile_model(model, "thor", tmp_path / "b2.shard", CompileOptions(batch=2))


def test_auto_batch_weighs_each_size_on_the_cost_model(dynamic_vit):
    model, root = dynamic_vit
    result = compile_model(model, "thor", root / "auto.shard", CompileOptions(batch=None, shards=2))
    auto = result.report["batch_auto"]
    assert [c["batch"] for c in auto["candidates"]] == list(BATCHES)
    assert result.manifest.batch == auto["batch"] == pick(auto["candidates"], None)
    assert all(c["latency_s"] > 0 and c["fps"] > 0 for c in auto["candidates"])
    assert json.loads((result.bundle / "report.json").read_text())["batch_auto"] == auto


def test_pick_takes_the_smallest_batch_near_the_best_within_the_budget():
    rows = [{"batch": b, "latency_s": t, "fps": b / t} for b, t in ((1, 1.0), (2, 1.2), (4, 2.0), (8, 3.96))]
    assert pick(rows, None) == 4            # 8 frames/s at 2.02: within 3 % of batch 8's, at half its latency
    assert pick(rows, 1.5) == 2             # batch 4 and 8 take longer than the budget
    assert pick(rows, 0.5) == 1             # nothing fits: the smallest
    assert pick(rows[:2] + [{"batch": 4, "latency_s": 1.3, "fps": 4 / 1.3}], None) == 4


def test_the_command_line_streams_single_frames_through_a_batched_bundle(dynamic_vit):
    model, root = dynamic_vit
    bundle = root / "cli.shard"
    res = shard_cli("compile", model, "--target", "thor", "--batch", "2", "-o", bundle)
    assert res.returncode == 0, res.stderr
    assert "one batch of 2 frames" in res.stdout
    res = shard_cli("run", bundle, "--backend", "cpu", "--stream", "5")
    assert res.returncode == 0, res.stderr
    assert "5 frames in" in res.stdout
    assert "output last_hidden_state: shape [1, 17, 192]" in res.stdout   # the last frame's own, one image
    assert_one_line_error(shard_cli("compile", model, "--target", "thor", "--batch", "0", "-o", root / "x.shard"),
                          "--batch '0'")
