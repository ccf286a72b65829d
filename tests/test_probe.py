"""shard probe: the search, the failure classifier, the cache, and families through the real compiler."""

from __future__ import annotations

import json
import math

import pytest
from conftest import DATA, shard_cli
from hypothesis import given, settings
from hypothesis import strategies as st

from shard.errors import ShardError
from shard.probes.search import Point, find_boundary, sweep
from shard.profile import profile_at
from shard.targets.rknn.cache import PointCache
from shard.targets.rknn.classify import classify_build, classify_numeric
from shard.targets.rknn.log import parse_build_log


def oracle(boundary: int, calls: list[int]):
    def test(size: int) -> Point:
        calls.append(size)
        return Point(size, size <= boundary, None if size <= boundary else "regtask")
    return test


@settings(max_examples=300, deadline=None)
@given(boundary=st.integers(1, 1 << 20), start=st.sampled_from([1, 64, 1024, 4096]))
def test_search_finds_the_exact_boundary_in_logarithmic_builds(boundary, start):
    calls: list[int] = []
    found = find_boundary(oracle(boundary, calls), start, 1 << 21)
    assert (found.largest_ok, found.smallest_failing) == (boundary, boundary + 1)
    assert len(calls) == len(set(calls))  # no size built twice
    assert len(calls) <= 2 * math.ceil(math.log2(1 << 21)) + 2


@pytest.mark.parametrize("boundary, start", [(65536, 1024), (8192, 256), (8, 1)])
def test_power_of_two_boundaries_cost_one_build_past_the_doubling(boundary, start):
    calls: list[int] = []
    found = find_boundary(oracle(boundary, calls), start, 1 << 20)
    assert found.largest_ok == boundary
    doubling = int(math.log2(boundary // start)) + 2  # start .. boundary, then 2 x boundary fails
    assert calls == [start << k for k in range(doubling)] + [boundary + 1]


def test_search_reports_no_failure_up_to_the_maximum_and_total_failure():
    calls: list[int] = []
    clean = find_boundary(oracle(10 ** 9, calls), 1024, 50000)
    assert (clean.largest_ok, clean.smallest_failing) == (50000, None)
    broken = find_boundary(oracle(0, []), 1024, 50000)
    assert (broken.largest_ok, broken.smallest_failing) == (None, 1)
    below = find_boundary(oracle(300, []), 1024, 50000)  # the start already fails: search below it
    assert (below.largest_ok, below.smallest_failing) == (300, 301)


def test_a_sweep_keeps_the_passing_set_of_a_non_monotone_family():
    fast = {1, 2, 3, 4, 5, 6, 7, 12, 14}   # conv-stride@cin64 on rk3588, toolkit 2.5.0
    calls: list[int] = []
    found = sweep(lambda size: calls.append(size) or Point(size, size in fast, None if size in fast else "slow"),
                  range(1, 33))
    assert calls == list(range(1, 33))
    assert found.passing == sorted(fast) and (found.largest_ok, found.smallest_failing) == (14, 8)
    from shard.probes.families import FAMILIES
    from shard.probes.runner import Search, compact, to_limit

    search = Search(FAMILIES["conv-stride"], "cin64", found)
    limit = to_limit(search, "rknn-toolkit2 2.5.0", "2026-11-26", 4.0)
    assert limit.passing == sorted(fast) and (limit.value, limit.failing, limit.failure) == (14, 8, "slow")
    assert "passes at 1-7, 12, 14; fails at 8-11, 13, 15-32" in limit.evidence
    assert compact([3]) == "3" and compact([]) == ""


def test_classifier_on_a_real_regtask_log():
    diag = parse_build_log((DATA / "regtask-add-131072.txt").read_text())
    point = classify_build(131072, {"ok": True, "rc": {"build": 0}}, diag)
    assert (point.ok, point.failure) == (False, "overflow")
    assert "REGTASK lines, first: E RKNN:" in point.evidence and "limit: 0x1fff" in point.evidence


def test_classifier_finds_the_slow_strided_conv_in_real_logs():
    macs = 32 * 32 * 64 * 16 * 8 * 8  # stride 8: 32x32 outputs, 64 channels, 16 in, 8x8 kernel
    slow = classify_build(8, {"ok": True}, parse_build_log((DATA / "conv-stride8-cin16.txt").read_text()), macs)
    assert (slow.ok, slow.failure) == (False, "slow")
    assert slow.figures["estimated_cycles"] == 1019904 + 27025  # the stride-4 Conv_split + the subsampling select
    assert "7.99x the peak rate" in slow.evidence
    macs7 = 36 * 36 * 64 * 16 * 7 * 7
    fast = classify_build(7, {"ok": True}, parse_build_log((DATA / "conv-stride7-cin16.txt").read_text()), macs7)
    assert fast.ok and fast.figures["cycles_per_peak"] == pytest.approx(2.0, abs=0.05)


def test_classifier_orders_crash_build_error_cpu_and_numeric():
    clean = parse_build_log("")
    crash = classify_build(1, {"ok": False, "error": "Traceback...\nIndexError: list index out of range"}, clean)
    assert (crash.failure, crash.evidence) == ("crash", "IndexError: list index out of range")
    failed = classify_build(1, {"ok": False, "rc": {"config": 0, "load_onnx": -1}},
                            parse_build_log("E load_onnx: opset 21 unsupported\n"))
    assert failed.failure == "build-error" and "load_onnx() returned -1" in failed.evidence
    cpu = classify_build(1, {"ok": True}, parse_build_log(
        "D RKNN: [00:21:01.771] 1    exSoftmax13        FLOAT16  CPU    (1,1,1,8193)                             "
        "(1,1,1,8193)           0/0/0                    64           exSoftmax13:y\n"))
    assert cpu.failure == "cpu-fallback" and "exSoftmax13" in cpu.evidence
    assert classify_numeric(Point(4, True), 0.9).failure == "numeric"
    assert classify_numeric(Point(4, True), float("nan")).failure == "numeric"
    assert classify_numeric(Point(4, True), 0.99995).ok


def test_e_lines_naming_neither_an_overflow_nor_a_fallback_are_a_class_of_their_own():
    """error-alone: what the passes do not rewrite for (`Unkown op target: 0` on RK3568's 3-D ops alone);
    an `E` line naming a register task or a CPU fallback stays an error."""
    said = lambda line: classify_build(1, {"ok": True}, parse_build_log(f"E RKNN: {line}\n")).failure
    assert said("Unkown op target: 0") == "error-alone"
    assert said("emitC1HWC2_CHW_16: surf_len overflow!") == "error-alone"
    assert said("channel is too large, may produce thousands of regtask, fallback to cpu!") == "error"
    assert said("emitUnpackRegtasks: equiv_channels(8196) > limitations(8192)") == "error"


def test_points_cached_in_the_old_words_are_read_in_the_new(tmp_path):
    """A probe cache written before the classes were renamed: "regtask" is "overflow", an error of lines
    naming neither an overflow nor a fallback is "error-alone", and the profile it makes is the new one's."""
    cache = PointCache(tmp_path, "rknn-toolkit2 2.5.0", "rk3588")
    old = {"regtask": "132 REGTASK lines, first: E RKNN: REGTASK: The bit width of field value exceeds the limit",
           "error": "1 error lines, first: E RKNN: Unkown op target: 0"}
    for size, (failure, evidence) in enumerate(old.items()):
        cache.put("add-width@h1", 1, Point(size, False, failure, evidence))
    assert [cache.get("add-width@h1", 1, size).failure for size in range(2)] == ["overflow", "error-alone"]
    cache.put("add-width@h1", 1, Point(2, False, "error", "1 error lines, first: E RKNN: fallback to cpu"))
    assert cache.get("add-width@h1", 1, 2).failure == "error"


def test_a_profile_of_the_old_schema_is_refused_with_what_to_do(tmp_path):
    path = tmp_path / "old.json"
    path.write_text(json.dumps({"schema_version": 1, "target": "rk3588", "cores": 3, "toolkit": "t", "limits": {}}))
    with pytest.raises(ShardError, match=r"written by an older shard; probe again \(`shard probe --target rk3588"):
        profile_at(str(path))


def test_cache_round_trip_keyed_by_version(tmp_path):
    cache = PointCache(tmp_path, "rknn-toolkit2 2.5.0", "rk3588")
    cache.put("add-width@h1", 1, Point(65537, False, "overflow", "E RKNN: ...", {"estimated_cycles": 0}))
    got = cache.get("add-width@h1", 1, 65537)
    assert got.cached and (got.ok, got.failure, got.evidence) == (False, "overflow", "E RKNN: ...")
    assert cache.get("add-width@h1", 2, 65537) is None  # a changed builder does not reuse old points
    assert PointCache(tmp_path, "rknn-toolkit2 2.5.0", "rk3588", read=False).get("add-width@h1", 1, 65537) is None


def test_unknown_family_and_target_are_refused(tmp_path):
    out = shard_cli("probe", "--families", "add-width,bogus-width", "--cache-dir", tmp_path)
    assert out.returncode == 1 and "unknown probe family bogus-width" in out.stderr
    out = shard_cli("probe", "--target", "cpu", "--cache-dir", tmp_path)
    assert out.returncode == 1 and "probes the Rockchip chips (rk3588, rk3576" in out.stderr


@pytest.mark.toolkit
@pytest.mark.skipif(__import__("importlib.util").util.find_spec("rknnlite") is not None,
                    reason="rknn-toolkit-lite2 is installed (on a board)")
def test_on_board_probing_says_it_needs_a_board(tmp_path):
    out = shard_cli("probe", "--families", "add-width", "--on-board", "--cache-dir", tmp_path)
    assert out.returncode == 1 and "rknn-toolkit-lite2 on a Rockchip board" in out.stderr


@pytest.mark.toolkit
def test_probe_finds_65536_then_serves_the_cache(tmp_path):
    out, cache = tmp_path / "p.json", tmp_path / "cache"
    args = ["probe", "--families", "add-width,conv-stride", "--cache-dir", cache, "-o", out]
    first = shard_cli(*args)
    assert first.returncode == 0, first.stderr
    profile = json.loads(out.read_text())
    h1 = profile["limits"]["add-width@h1"]
    assert (h1["value"], h1["failing"], h1["failure"]) == (65536, 65537, "overflow")
    assert "REGTASK" in h1["evidence"] and h1["toolkit"] == "rknn-toolkit2 2.5.0" and h1["date"]
    assert int(h1["source"].split(", ")[1].split()[0]) <= 20  # new builds for this limit
    stride = profile["limits"]["conv-stride@cin16"]
    assert (stride["value"], stride["failing"], stride["failure"]) == (7, 8, "slow")
    assert stride["passing"] == [1, 2, 3, 4, 5, 6, 7] and "estimated cycles" in stride["evidence"]
    wide = profile["limits"]["conv-stride@cin64"]   # not monotone: fast again at 12 and 14
    assert wide["passing"] == [1, 2, 3, 4, 5, 6, 7, 12, 14] and wide["failing"] == 8

    again = shard_cli(*args)
    assert again.returncode == 0, again.stderr
    assert " 0 builds," in again.stdout
    assert json.loads(out.read_text())["limits"]["add-width@h1"]["value"] == 65536

    numeric = shard_cli("probe", "--families", "softmax-magnitude", "--max-size", "64", "--cache-dir", cache, "-o", out)
    assert numeric.returncode == 0, numeric.stderr
    assert "kept 5 limits" in numeric.stdout  # add-width x3 and conv-stride x2 stay in the profile
    limits = json.loads(out.read_text())["limits"]
    assert limits["softmax-magnitude@h12"]["failure"] == "none" and limits["softmax-magnitude@h12"]["value"] == 64
    assert len(limits) == 6


@pytest.mark.toolkit
@pytest.mark.parametrize("chip", ["rk3588", "rk3568"])
def test_the_shipped_profile_is_what_the_probe_measures(tmp_path, chip):
    """Every shipped limit and measured rate comes out of a fresh probe unchanged (a new toolkit
    fails this): rk3588, and rk3568, a chip with a quarter of its fp16 rate."""
    from shard.probes.runner import probe
    from shard.profile import load_profile

    shipped = load_profile(chip)
    fresh, _ = probe(chip, jobs=2, cache_dir=tmp_path)
    assert set(fresh.limits) == set(shipped.limits)
    for rate in ("macs_per_cycle_fp16", "macs_per_cycle_int8", "quantized_dtypes"):
        assert fresh.facts[rate] == shipped.facts[rate], rate
    for name, limit in shipped.limits.items():
        got = fresh.limits[name]
        assert (got.value, got.failing, got.failure, got.passing) == (limit.value, limit.failing, limit.failure,
                                                                       limit.passing), name
        assert limit.toolkit == fresh.toolkit and limit.evidence.split(": ")[0] == got.evidence.split(": ")[0]


@pytest.mark.toolkit
def test_the_hand_off_graphs_build_clean_and_compute_what_they_say():
    """The graphs `shard probe --on-board` times a board's hand-off with (shard.probes.handoff): each
    built by the real toolkit without a CPU op or a REGTASK line, each run on the simulator as
    onnxruntime runs it, and shaped as their sizes say."""
    from shard.options import CompileOptions
    from shard.probes.handoff import SIZES, base_model, inputs_model, outputs_model
    from shard.profile import load_profile
    from shard.targets.registry import get_target

    ops = get_target("rk3588").pass_toolkit(load_profile("rk3588"), CompileOptions())
    try:
        for model in (base_model(), *(make(n) for n in SIZES for make in (inputs_model, outputs_model))):
            dims = [[d.dim_value for d in v.type.tensor_type.shape.dim]
                    for v in (*model.graph.input, *model.graph.output)]
            assert sorted(math.prod(d) for d in dims) in ([64, 64], *([64, n] for n in SIZES)), model.graph.name
            point = ops.prober.run_model(model, model.graph.name, simulate_range=1.0)
            assert point.ok and point.figures["cosine"] >= 0.9999, (model.graph.name, point)
    finally:
        ops.close()


def test_a_profile_that_timed_its_board_charges_that_hand_off():
    from shard.probes.handoff import SIZES, measure_handoff, outputs_model
    from shard.targets.chips import board_handoff

    seconds = {"handoff_base": 2e-4, "handoff_in_65536": 9e-4, "handoff_in_1048576": 1.3e-2,
               "handoff_out_65536": 3e-4, "handoff_out_1048576": 1.1e-3}
    facts = measure_handoff(lambda model: seconds[model.graph.name], "rknn-toolkit2 2.5.0")
    assert facts["handoff"]["run_s"] == 2e-4 and facts["handoff"]["inputs"] == [[SIZES[0], 7e-4], [SIZES[1], 1.28e-2]]
    measured = board_handoff("rk3588", facts)
    assert measured.source.startswith("shard probe --on-board with rknn-toolkit2 2.5.0")
    assert measured.seconds(SIZES[1], SIZES[0]) == pytest.approx(2e-4 + 1.28e-2 + 1e-4)
    outputs_at_0 = 1e-4 - (1.1e-3 - 3e-4) / (SIZES[1] - SIZES[0]) * SIZES[0]
    assert measured.seconds(0, 0) == pytest.approx(2e-4 + outputs_at_0)   # the inputs' line is under 0 there
    assert outputs_model(SIZES[0]).graph.output[0].type.tensor_type.shape.dim[2].dim_value == SIZES[0] // 512


@pytest.mark.skipif(__import__("importlib.util").util.find_spec("rknnlite") is None,
                    reason="needs rknn-toolkit-lite2 on a Rockchip board")
def test_the_hand_off_is_timed_on_the_board():
    from shard.options import CompileOptions
    from shard.probes.handoff import measure_handoff
    from shard.profile import load_profile
    from shard.runtime.executors.rknn_board import time_inference
    from shard.targets.registry import get_target

    ops = get_target("rk3588").pass_toolkit(load_profile("rk3588"), CompileOptions())
    try:
        facts = measure_handoff(lambda model: ops.time_on_board(model, time_inference), ops.toolkit)["handoff"]
    finally:
        ops.close()
    assert facts["run_s"] > 0 and facts["inputs"][1][1] > facts["inputs"][0][1] >= 0
    assert facts["outputs"][1][1] > facts["outputs"][0][1] >= 0
