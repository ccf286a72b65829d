"""Every Rockchip chip the toolkit builds for: shipped profiles from the probe, chip facts with their
sources, targets per chip, and compiles on the real toolkit for a chip other than rk3588."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
from conftest import make_model, shard_cli
from onnx import helper, numpy_helper

from shard.errors import RunError
from shard.profile import load_profile
from shard.targets.registry import get_target
from shard.targets.chips import CHIPS


@pytest.mark.parametrize("chip", list(CHIPS))
def test_each_chip_ships_a_probed_profile_with_sourced_facts(chip):
    profile = load_profile(chip)
    assert profile.cores == CHIPS[chip].cores and profile.toolkit == "rknn-toolkit2 2.5.0"
    assert profile.limits and all(lim.source.startswith("shard probe with rknn-toolkit2 2.5.0")
                                  for lim in profile.limits.values())
    facts = profile.facts
    assert facts["cores_source"] and facts["fp16"] is CHIPS[chip].fp16
    int8 = "w8a8" in facts["quantized_dtypes"]     # rk2118: the toolkit dies on a quantized build
    assert facts["quantized_dtypes_source"].startswith("shard probe") and (int8 or chip == "rk2118")
    rates = ["macs_per_cycle_int8"] * int8 + ["macs_per_cycle_fp16"] * CHIPS[chip].fp16
    for rate in rates:   # measured by the probe, not written by hand
        assert facts[rate] > 0 and facts[f"{rate}_source"].startswith("shard probe with rknn-toolkit2 2.5.0")
    if not CHIPS[chip].fp16:   # int8 only: the fp16 range families are not probed
        assert not [name for name in profile.limits if "magnitude" in name]


def test_a_derived_clock_follows_the_probed_peak_and_a_sourced_one_stays():
    from shard.probes.runner import derive_clock

    shipped = dict(load_profile("rk3576").facts)
    assert shipped["npu_clock_hz_source"].startswith("derived")
    again = {**shipped, "macs_per_cycle_int8": 2 * shipped["macs_per_cycle_int8"]}   # a new toolkit's peak
    derive_clock(again, 2)
    assert again["npu_clock_hz"] == round(shipped["npu_clock_hz"] / 2)
    sourced = {**load_profile("rk3588").facts, "macs_per_cycle_int8": 4096}
    derive_clock(sourced, 3)
    assert sourced["npu_clock_hz"] == load_profile("rk3588").facts["npu_clock_hz"]


def test_a_hand_off_is_the_line_through_the_published_points():
    """What the board's runtime takes to set a graph's inputs and get its outputs: each direction the
    line through its two published points, never under 0."""
    from shard.targets.chips import board_handoff, elements

    published = board_handoff("rk3588", {})
    assert published is CHIPS["rk3588"].handoff and "rknn_model_zoo issue 167" in published.source
    assert published.seconds(150_528, 1_000) == pytest.approx(1.802e-3 + 0.029e-3)
    assert published.seconds(1_228_800, 2_142_000) == pytest.approx(14.845e-3 + 1.226e-3)
    assert published.seconds(1_000, 1_000) == pytest.approx(0.029e-3)   # the inputs' line is under 0 there
    # SmolLM2's cache of 512 fed to a decode step: 30 layers x keys and values x [3, 512, 64]
    assert 70e-3 < published.seconds(elements([[1, 3, 512, 64]] * 60), 0) < 72e-3
    assert board_handoff("thor", {}) is None and board_handoff("rk3576", {}) is None   # no published figure


def test_the_chip_table_is_the_toolkit_support_list():
    from shard.targets.rknn.env import RKNN_TOOLKIT2, get_spec

    assert list(CHIPS) == list(RKNN_TOOLKIT2.targets)
    assert all(get_spec(chip) is RKNN_TOOLKIT2 for chip in CHIPS)   # one environment for every chip


def test_int8_only_chips_refuse_fp16_in_one_line(tmp_path):
    assert get_target("rv1106").precisions == ("int8",)
    model = make_model([helper.make_node("Relu", ["x"], ["y"])], [("x", [1, 4, 8, 8])], [("y", [1, 4, 8, 8])])
    path = tmp_path / "m.onnx"
    path.write_bytes(model.SerializeToString())
    res = shard_cli("compile", path, "--target", "rv1106")
    assert res.returncode == 1 and "Traceback" not in res.stderr
    assert "--precision fp16: target rv1106 builds int8 (pass --precision int8 with --calib FILE.npz)" in res.stderr
    # rk2118: the toolkit process dies on a quantized build, so its profile lists no int8
    res = shard_cli("compile", path, "--target", "rk2118", "--precision", "int8")
    assert res.returncode == 1 and "Traceback" not in res.stderr
    assert "the rk2118 profile's probe found no int8 (w8a8) build" in res.stderr and "exited with code -6" in res.stderr


def test_board_core_masks_follow_the_chip():
    from shard.runtime.executors.rknn_board import core_mask

    lite = SimpleNamespace(NPU_CORE_AUTO=0, NPU_CORE_0=1, NPU_CORE_1=2, NPU_CORE_2=4)   # rknnlite's constants
    assert [core_mask(lite, "rk3588", 3, c) for c in range(3)] == [1, 2, 4]
    assert [core_mask(lite, "rk3576", 2, c) for c in range(2)] == [1, 2]
    assert core_mask(lite, "rk3568", 1, 0) == 0      # a one-core chip takes the default mask
    with pytest.raises(RunError, match="rk3576 has NPU cores 0, 1; there is no core 2"):
        core_mask(lite, "rk3576", 2, 2)


def test_probe_diff_between_two_chips_names_each_side_evidence():
    res = shard_cli("probe", "--diff", "rk3588", "rk3576", env_extra={"COLUMNS": "250"})
    assert res.returncode == 0, res.stderr
    assert "fact cores: A 3, B 2" in res.stdout
    differ = [name for name, a in load_profile("rk3588").limits.items()
              if (b := load_profile("rk3576").limits.get(name)) and (a.value, a.failure, a.passing) != (b.value, b.failure, b.passing)]
    assert differ and f"{len(differ)} limits differ" in res.stdout
    assert all(name in res.stdout for name in differ)


@pytest.mark.toolkit
def test_a_small_cnn_compiles_and_verifies_on_rk3576_with_its_profile(tmp_path):
    """Another chip end to end: its profile, its toolkit target, two cores in the manifest."""
    model = conv_relu_model()
    path = tmp_path / "cnn.onnx"
    path.write_bytes(model.SerializeToString())
    res = shard_cli("compile", path, "--target", "rk3576", "-o", tmp_path / "c.shard", "--shards", "2")
    assert res.returncode == 0, res.stderr
    assert "target rk3576 (2 NPU cores), profile shipped: rknn-toolkit2 2.5.0, probed" in res.stdout
    manifest = json.loads((tmp_path / "c.shard" / "manifest.json").read_text())
    assert manifest["build"]["config"]["target_platform"] == "rk3576" and manifest["profile"]["cores"] == 2
    assert sorted(s["core"] for s in manifest["shards"]) == [0, 1]
    report = json.loads((tmp_path / "c.shard" / "report.json").read_text())
    assert report["totals"]["overflow_lines"] == 0 and report["totals"]["cpu_ops"] == 0
    assert report["totals"]["estimated_cycles"] > 0        # the layer table with RK3576's extra column is read
    res = shard_cli("verify", tmp_path / "c.shard", "--reference", path, "--backend", "sim", "--min-cosine", "0.9999")
    assert res.returncode == 0, res.stdout + res.stderr


@pytest.mark.toolkit
def test_int8_only_rv1106_compiles_a_cnn_from_calibration_and_verifies(tmp_path):
    model = conv_relu_model()
    path, calib = tmp_path / "cnn.onnx", tmp_path / "calib.npz"
    path.write_bytes(model.SerializeToString())
    rng = np.random.default_rng(0)
    np.savez(calib, x=rng.uniform(0, 1, (8, 1, 3, 32, 32)).astype(np.float32))
    res = shard_cli("compile", path, "--target", "rv1106", "--precision", "int8", "--calib", calib,
                    "-o", tmp_path / "q.shard")
    assert res.returncode == 0, res.stderr
    manifest = json.loads((tmp_path / "q.shard" / "manifest.json").read_text())
    assert manifest["build"]["config"]["target_platform"] == "rv1106"
    report = json.loads((tmp_path / "q.shard" / "report.json").read_text())
    assert report["totals"]["overflow_lines"] == 0 and report["totals"]["int8_mac_share"] == 1.0
    res = shard_cli("verify", tmp_path / "q.shard", "--reference", path, "--backend", "sim", "--inputs", calib,
                    "--min-cosine", "0.99")
    assert res.returncode == 0, res.stdout + res.stderr


def conv_relu_model():
    """Two 3x3 Conv + Relu blocks on a 32x32 image, seeded weights."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array((rng.standard_normal((16, 3, 3, 3)) * 0.3).astype(np.float32), "w1"),
             numpy_helper.from_array((rng.standard_normal((16, 16, 3, 3)) * 0.1).astype(np.float32), "w2")]
    nodes = [helper.make_node("Conv", ["x", "w1"], ["c1"], pads=[1, 1, 1, 1]), helper.make_node("Relu", ["c1"], ["r1"]),
             helper.make_node("Conv", ["r1", "w2"], ["c2"], pads=[1, 1, 1, 1]), helper.make_node("Relu", ["c2"], ["y"])]
    return make_model(nodes, [("x", [1, 3, 32, 32])], [("y", [1, 16, 32, 32])], inits)
