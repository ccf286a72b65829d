"""Precision end to end with the real toolkit: int8 from calibration samples, mixed precision's
search, and fp16's range sandwich on a model the vendor alone turns into NaN."""

from __future__ import annotations

import json

from dataclasses import replace

import numpy as np
import pytest
from conftest import make_model, mlp_chain, shard_cli
from onnx import helper, numpy_helper

import shard
from shard.bundle import read_manifest
from shard.options import CompileOptions
from shard.targets import ShardJob
from shard.targets.build_cache import BuildCache

pytestmark = pytest.mark.toolkit


def calib_file(tmp_path, n=6, width=16, seed=0):
    rng = np.random.default_rng(seed)
    path = tmp_path / "calib.npz"
    np.savez(path, x=rng.standard_normal((n, 1, 8, width)).astype(np.float32))
    return path


def test_int8_bundle_keeps_its_samples_and_verifies_on_the_simulator(tmp_path, save):
    model = save(mlp_chain(2, width=16))
    calib = calib_file(tmp_path)
    out = shard_cli("compile", model, "--precision", "int8", "--calib", calib, "-o", tmp_path / "m.shard")
    assert out.returncode == 0, out.stderr
    assert "int8 share of the MACs" in out.stdout and "simulator cosine, shard / vendor alone" in out.stdout
    manifest = read_manifest(tmp_path / "m.shard")
    (spec,) = manifest.shards
    assert spec.precision == "int8" and spec.build_options["config"]["quantized_dtype"] == "w8a8"
    assert len(spec.dataset) == 6 and all((tmp_path / "m.shard" / p).is_file() for s in spec.dataset for p in s)
    first = np.load(tmp_path / "m.shard" / spec.dataset[0][0])
    assert np.array_equal(first, np.load(calib)["x"][0])   # the reference's own tensor at the shard's input
    report = json.loads((tmp_path / "m.shard" / "report.json").read_text())
    assert report["precision"] == "int8" and report["totals"]["int8_mac_share"] == 1.0
    held_back = tmp_path / "test.npz"
    np.savez(held_back, x=np.random.default_rng(9).standard_normal((2, 1, 8, 16)).astype(np.float32))
    out = shard_cli("verify", tmp_path / "m.shard", "-r", model, "--inputs", held_back, "--min-cosine", "0.99")
    assert out.returncode == 0 and "2 samples from test.npz" in out.stdout, out.stdout + out.stderr
    # groups of samples in one simulator session (mixed precision's held-out and fitted samples) measure
    # as each group alone does
    from shard.compilation.choice import bundle_cosine_of, bundle_cosines

    samples = [{"x": x} for x in np.load(calib)["x"]]
    apart = [bundle_cosine_of(tmp_path / "m.shard", model, group) for group in (samples[:1], samples[1:])]
    assert bundle_cosines(tmp_path / "m.shard", model, samples[:1], samples[1:]) == apart
    assert apart[0] != apart[1]   # the groups' own worst, not one worst over both


def test_mixed_search_is_deterministic_and_records_every_round(tmp_path, save):
    model = save(mlp_chain(3, width=32))
    calib = calib_file(tmp_path, n=16, width=32)
    options = CompileOptions(precision="mixed", calib=str(calib), min_cosine=0.9999)
    first = shard.compile(model, "rk3588", tmp_path / "a.shard", options).report
    second = shard.compile(model, "rk3588", tmp_path / "b.shard", options).report
    assert first["mixed"]["rounds"] == second["mixed"]["rounds"]
    assert first["mixed"]["ranking"] == second["mixed"]["ranking"]
    rounds = first["mixed"]["rounds"]
    if rounds[0]["cosine"] < 0.9999:   # ranked by the int8 replica only where the first round falls short
        ranking = first["mixed"]["ranking"]["linears"]
        assert sorted(c["node"] for c in ranking) == sorted(f"fc{k}_{b}" for k in (1, 2) for b in range(3))
        assert all(r["predicted"] is not None for r in rounds)
    reached = [r for r in rounds if r["cosine"] >= 0.9999]
    before = rounds[:rounds.index(reached[0]) + 1] if reached else rounds
    assert [len(r["promoted"]) for r in before] == sorted(len(r["promoted"]) for r in before)   # growing till one reaches it
    kept = next((r for r in rounds if r["round"] == first["mixed"]["kept"]), None)   # None: compiled in fp16
    assert first["mixed"]["reached"] == bool(reached)
    if reached:   # then bisected towards more int8: the one kept has the most int8 of those that reached it
        assert first["mixed"]["cosine"] == kept["cosine"] and kept["int8_mac_share"] == max(
            r["int8_mac_share"] for r in reached)
    # ranges from 12 of the 16 samples, each round accepted on the last 4, which no range saw
    assert first["mixed"]["samples"] == {"calibration": 12, "held_out": 4, "compared": 4, "folds": 1}
    assert all(0 < r["cosine_calibration"] <= 1 and 0 < r["cosine"] <= 1 for r in rounds)
    assert "bundle_cosine" not in first["mixed"]   # the bundle is the kept round's own
    (spec,) = read_manifest(tmp_path / "a.shard").shards
    if spec.build != "vendor_alone" and kept is None:   # (never worse: the vendor's own int8 may win)
        assert spec.precision == "fp16"
    elif spec.build != "vendor_alone":
        assert spec.precision == "mixed" and set(kept["promoted"]) <= set(spec.build_options["float16"])
        held = np.load(calib)["x"][12:]
        assert len(spec.dataset) == 12 and not any(np.array_equal(np.load(tmp_path / "a.shard" / s[0]), h)
                                                   for s in spec.dataset for h in held)


def test_mixed_holds_few_samples_out_in_turn_and_keeps_ranges_from_all(tmp_path, save):
    # 6 samples are few: one held out would say little about the next input, so each round is
    # compiled once a fold, with ranges from the others, and accepted on the worst of the 6; the
    # bundle is the kept round's linears with ranges from all 6
    model = save(mlp_chain(1, width=16))
    calib = calib_file(tmp_path, n=6)
    steps = []
    options = CompileOptions(precision="mixed", calib=str(calib), min_cosine=0.99, vendor_baseline=False)
    report = shard.compile(model, "rk3588", tmp_path / "m.shard", options,
                           progress=lambda step, done, total: steps.append((step, done, total))).report
    mixed = report["mixed"]
    assert mixed["samples"] == {"calibration": 6, "held_out": 6, "compared": 6, "folds": 4}
    assert [r["round"] for r in mixed["rounds"]] == [1] and mixed["kept"] == 1 and mixed["reached"]
    assert [(done, total) for step, done, total in steps if step == "mixed precision, round 1: 0 linears in fp16"] \
        == [(0, 4), (1, 4), (2, 4), (3, 4)]   # a compile a fold, on the round's own bar
    assert mixed["cosine"] >= 0.99 and 0.99 <= mixed["bundle_cosine"] <= 1
    (spec,) = read_manifest(tmp_path / "m.shard").shards
    assert spec.precision == "mixed"
    assert [np.load(tmp_path / "m.shard" / s[0]).tolist() for s in spec.dataset] == np.load(calib)["x"].tolist()
    from shard.cli.common import console
    from shard.cli.compile import print_compile_report

    with console.capture() as seen:
        print_compile_report(report)
    assert ("4 folds, each round's cosine the worst of the 6 samples, each held out of the int8 ranges once; the "
            f"bundle's ranges from all 6 (cosine {mixed['bundle_cosine']:.5f})") in seen.get()
    assert "mixed precision, round 1: 0 linears in fp16, cosine" in seen.get()


def test_mixed_where_no_round_with_int8_reaches_the_target_is_the_fp16_compile(tmp_path, save):
    # a target no round reaches: the most faithful round has every linear in fp16, and its outlier
    # splits only cost cycles, so the bundle is the model compiled in fp16
    model = save(mlp_chain(1, width=32))
    options = CompileOptions(precision="mixed", calib=str(calib_file(tmp_path, n=16, width=32)), min_cosine=1.0,
                             vendor_baseline=False)
    report = shard.compile(model, "rk3588", tmp_path / "m.shard", options).report
    rounds = report["mixed"]["rounds"]
    assert report["mixed"]["kept"] is None and not report["mixed"]["reached"]
    assert rounds[0]["int8_mac_share"] > 0 and min(r["int8_mac_share"] for r in rounds) == 0
    assert report["precision"] == "fp16" and {s.precision for s in read_manifest(tmp_path / "m.shard").shards} == {"fp16"}
    assert any("the bundle is fp16" in w for w in report["warnings"])


def test_mixed_runs_every_linear_with_its_exported_bias_in_int8(tmp_path):
    """A transformer's Linear exports as MatMul + Add(bias). The vendor folds the bias into its Conv,
    and with the bias Add marked fp16 it also fused the residual Add after it (ConvAdd), the whole in
    fp16: two layers of vit-tiny, 4 of 12 linears in fp16, 57 % of the MACs in int8. The bias goes
    with its linear (precision.int8_owner): every linear int8."""
    from shard.targets.rknn.log import parse_build_log

    model = tmp_path / "vit.onnx"
    out = shard_cli("zoo", "export", "vit-tiny", "--layers", "2", "-o", model)
    assert out.returncode == 0, out.stderr
    result = shard.compile(model, "rk3588", tmp_path / "m.shard",
                           CompileOptions(precision="mixed", promote=(), shards=1, vendor_baseline=False))
    layers = parse_build_log((tmp_path / "m.shard" / "logs" / "shard_000.log").read_text()).layers
    linears = [(layer.op, layer.dtype) for layer in layers if layer.op.startswith("Conv")]
    assert len(linears) == 13 and set(linears) == {("Conv", "INT8")}, linears   # 12 linears and the patches
    assert result.report["totals"]["int8_mac_share"] == 1.0


def test_range_sandwich_rescues_a_model_the_vendor_alone_turns_into_nan(tmp_path):
    model = tmp_path / "grow.onnx"
    out = shard_cli("zoo", "export", "growing-cnn", "-o", model)
    assert out.returncode == 0, out.stderr
    out = shard_cli("compile", model, "--shards", "2", "-o", tmp_path / "g.shard")   # fidelity checked by default
    assert out.returncode == 0, out.stderr
    report = json.loads((tmp_path / "g.shard" / "report.json").read_text())
    fidelity = report["versus_vendor"]["fidelity"]
    assert fidelity["vendor"] != fidelity["vendor"] or fidelity["vendor"] < 0.99   # NaN, or far off
    assert fidelity["shard"] >= 0.9999 and report["versus_vendor"]["bundle"] == "shard"
    changes = report["passes"]["scale_sandwich"]["changes"]
    assert len([c for c in changes if c["op"] == "Conv"]) >= 2   # a chain of factors, one per layer that needs one
    assert [s["type"] for s in report["host_post"]] == ["Mul"]
    scaled = [e for s in read_manifest(tmp_path / "g.shard").shards for e in s.edge_scales.values()]
    assert scaled and all(k > 0 for _, k in scaled)      # the edge between the shards is held scaled
    out = shard_cli("verify", tmp_path / "g.shard", "-r", model, "--min-cosine", "0.9999")
    assert out.returncode == 0 and "not checked alone" not in out.stdout, out.stdout + out.stderr
    rows = [line for line in out.stdout.splitlines() if line.startswith("│ shard_00")]
    assert len(rows) == 2                                # both checked fed the reference's (scaled) tensors
    assert out.stdout.count("file shards/shard_00") == 4 and "ok (sha256" in out.stdout   # .onnx, .rknn each


def growing_to_softmax(save, tail: bool):
    """Caffe2's ResNet-50 in small (the onnx package's light model: every weight 0.02): activations
    past fp16 through a residual Sum into a Softmax, which ends the model or (not tail) feeds a Mul."""
    rng = np.random.default_rng(0)
    weights = [numpy_helper.from_array((rng.standard_normal((8, 8, 1, 1)) * 3e3).astype(np.float32), f"w{k}")
               for k in range(2)] + [numpy_helper.from_array(np.array(2.0, np.float32), "two")]
    nodes = [helper.make_node("Conv", ["x", "w0"], ["a"]), helper.make_node("Relu", ["a"], ["b"]),
             helper.make_node("Conv", ["b", "w1"], ["c"]), helper.make_node("Sum", ["b", "c"], ["d"]),
             helper.make_node("Softmax", ["d"], ["y" if tail else "p"], axis=1)]   # the Sum's sides: one scaled by a Mul
    nodes += [] if tail else [helper.make_node("Mul", ["p", "two"], ["y"])]
    return save(make_model(nodes, [("x", [1, 8, 16, 16])], [("y", [1, 8, 16, 16])], weights))


def test_rescales_that_leave_both_nan_do_not_cost_cycles(tmp_path, save):
    """The Softmax overflows fp16 in shard's bundle and the vendor's alike; the Muls shard spent on
    range rescales then bought nothing, the cycles count again, and the bundle is the vendor's
    (written under the fidelity floor only where asked, saying so)."""
    result = shard.compile(growing_to_softmax(save, tail=False), "rk3588", tmp_path / "n.shard",
                           CompileOptions(allow_low_fidelity=True))
    assert result.report["under_the_floor"]
    assert any("written anyway (--allow-low-fidelity)" in w for w in result.report["warnings"])
    versus = result.report["versus_vendor"]
    assert any(c["form"] == "range" for c in result.report["passes"]["scale_sandwich"]["changes"])
    assert versus["fidelity"]["shard"] != versus["fidelity"]["shard"] and versus["fidelity"]["vendor"] != versus["fidelity"]["vendor"]
    assert "cost_cycles" in versus["judged_on"]
    assert versus["bundle"] == "vendor alone" and "both NaN on the simulator, so the cycles count" in versus["line"]


def test_a_bundle_that_overflows_on_the_simulator_is_not_written(tmp_path, save):
    """The same model without --allow-low-fidelity: both bundles hold NaN, so the compile stops in one
    line naming the first output to overflow, exit 1, and nothing is left at the output."""
    out = shard_cli("compile", growing_to_softmax(save, tail=False), "-o", tmp_path / "n.shard")
    assert out.returncode == 1, out.stdout + out.stderr
    lines = [line for line in out.stderr.splitlines() if line.startswith("error:")]   # the rest: progress bars
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr
    assert "under the fidelity floor: its output y holds a NaN or an Inf" in lines[0]
    assert "the vendor alone's build does no better" in lines[0]
    assert "the first to overflow, fed onnxruntime's tensors: y, an output of shard_000" in lines[0]
    assert "(Softmax): it takes d, which reaches" in lines[0]   # scale_sandwich names the tensor past fp16
    assert "--allow-low-fidelity" in lines[0]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith((".n.shard", "n.shard"))]


def test_a_conv_relu_chain_growing_past_1e19_compiles_to_a_faithful_bundle(tmp_path, save):
    """16 Conv/Relu layers, 16x or more each: activations pass 1e19 (1e21 at the end; onnx's legacy CNNs:
    vgg19 at 1e31). The range rescale carries the chain divided by 2^57 at its end, a few powers of two
    at a time in each layer's weights, and the host multiplies it back in fp32."""
    rng = np.random.default_rng(0)
    layers, nodes, weights, x = 16, [], [], "x"
    for k in range(layers):
        w = rng.standard_normal((8, 8, 1, 1)) * 16 * np.sqrt(2 / 8) * 1.7
        weights.append(numpy_helper.from_array(w.astype(np.float32), f"w{k}"))
        nodes += [helper.make_node("Conv", [x, f"w{k}"], [f"c{k}"], name=f"conv{k}"),
                  helper.make_node("Relu", [f"c{k}"], [f"r{k}" if k < layers - 1 else "y"], name=f"relu{k}")]
        x = f"r{k}"
    model = save(make_model(nodes, [("x", [1, 8, 8, 8])], [("y", [1, 8, 8, 8])], weights))
    result = shard.compile(model, "rk3588", tmp_path / "c.shard", CompileOptions())
    sandwich = result.report["passes"]["scale_sandwich"]
    assert not sandwich["not_fixed"] and max(c.get("factor", 0) for c in sandwich["changes"]) >= 2.0 ** 50
    fidelity = result.report["versus_vendor"]["fidelity"]
    assert fidelity["shard"] >= 0.999 and result.report["versus_vendor"]["bundle"] == "shard"
    assert result.report["totals"]["cpu_ops"] == 0
    assert shard.verify(result.bundle, model, backend="sim", min_cosine=0.999).passed


def test_a_last_softmax_past_fp16_runs_on_the_host_in_fp32(tmp_path, save):
    """Where the Softmax ends the model, the NPU hands over its input held scaled and the host
    multiplies it back and runs the Softmax in fp32: NaN for the vendor alone, the reference for shard."""
    model = growing_to_softmax(save, tail=True)
    result = shard.compile(model, "rk3588", tmp_path / "t.shard", CompileOptions())
    fidelity = result.report["versus_vendor"]["fidelity"]
    # The worst of 4 samples: logits near 1e7 keep fp16's step (about 1e4) from the NPU, which can swap
    # near-tied channels of the softmax (0.99902 on one); the seeded sample verify runs below, 0.9999.
    assert fidelity["vendor"] != fidelity["vendor"] and fidelity["shard"] >= 0.999
    assert [s["type"] for s in result.report["host_post"]] == ["Mul", "Softmax"]
    out = shard_cli("verify", tmp_path / "t.shard", "-r", model, "--min-cosine", "0.9999")
    assert out.returncode == 0, out.stdout + out.stderr


def test_build_cache_key_covers_the_quantization_samples(tmp_path, save):
    model = save(mlp_chain(1))
    data = [tmp_path / f"{k}.npy" for k in range(2)]
    for k, path in enumerate(data):
        np.save(path, np.full((1, 8, 16), k, np.float32))
    cache = BuildCache(tmp_path / "cache", "rk3588", "toolkit")
    job = lambda dataset: ShardJob("s", model, None, tmp_path / "s.log", "int8", dataset)  # noqa: E731
    assert cache.key(job([[data[0]]]), {}) != cache.key(job([[data[1]]]), {})
    assert cache.key(job([[data[0]]]), {}) == cache.key(job([[data[0]]]), {})
    assert cache.key(job([[data[0]]]), {"float16": ["a"]}) != cache.key(job([[data[0]]]), {"float16": ["b"]})


def test_range_sandwich_carries_a_residual_stream_past_fp16(tmp_path):
    # A ViT whose residual stream has a 1e5 channel (zoo --outliers), past fp16's 65504: every
    # residual add is held divided by a power of two, the LayerNorms absorb it.
    model = tmp_path / "vit.onnx"
    out = shard_cli("zoo", "export", "vit-tiny", "--layers", "2", "--outliers", "100000", "-o", model)
    assert out.returncode == 0, out.stderr
    result = shard.compile(model, "rk3588", tmp_path / "v.shard", CompileOptions())   # fidelity checked by default
    fidelity = result.report["versus_vendor"]["fidelity"]
    assert not fidelity["vendor"] >= 0.99 and fidelity["shard"] >= 0.9999
    adds = [c for c in result.report["passes"]["scale_sandwich"]["changes"] if c["op"] == "Add"]
    assert len(adds) >= 4                                   # both residual adds of both layers


def outlier_mlp(seed: int = 0, seq: int = 32, dim: int = 64, hidden: int = 256):
    """LayerNorm -> MatMul + bias -> Relu -> MatMul, as a trained encoder's FFN: two LayerNorm
    channels at 60 times the rest, two hidden channels at 80 times the rest."""
    rng = np.random.default_rng(seed)
    gamma = np.ones(dim, np.float32)
    gamma[[5, 40]] = 60.0
    w1 = (rng.standard_normal((dim, hidden)) / np.sqrt(dim)).astype(np.float32)
    w1[:, [7, 100]] *= 80.0
    w2 = (rng.standard_normal((hidden, dim)) / np.sqrt(hidden)).astype(np.float32)
    inits = [numpy_helper.from_array(gamma, "gamma"), numpy_helper.from_array(np.zeros(dim, np.float32), "beta"),
             numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(w2, "w2"),
             numpy_helper.from_array(rng.standard_normal(hidden).astype(np.float32) * 0.1, "b1")]
    nodes = [helper.make_node("LayerNormalization", ["x", "gamma", "beta"], ["xn"], axis=-1, epsilon=1e-5,
                              name="norm"),
             helper.make_node("MatMul", ["xn", "w1"], ["h"], name="fc1"),
             helper.make_node("Add", ["h", "b1"], ["hb"], name="bias1"),
             helper.make_node("Relu", ["hb"], ["r"], name="relu"),
             helper.make_node("MatMul", ["r", "w2"], ["y"], name="fc2")]
    return make_model(nodes, [("x", [1, seq, dim])], [("y", [1, seq, dim])], inits)


def test_outlier_splits_keep_int8_linears_accurate_on_the_simulator(tmp_path, save, monkeypatch):
    """The same linears in int8 (promote nothing), with and without the outlier splits."""
    import shard.passes.scale_sandwich as sandwich

    model = save(outlier_mlp())
    rng = np.random.default_rng(1)
    calib, held_back = (tmp_path / "calib.npz", tmp_path / "test.npz")
    np.savez(calib, x=rng.standard_normal((8, 1, 32, 64)).astype(np.float32))
    np.savez(held_back, x=rng.standard_normal((3, 1, 32, 64)).astype(np.float32))
    samples = [{"x": x} for x in np.load(held_back)["x"]]
    options = CompileOptions(precision="mixed", calib=str(calib), promote=(), vendor_baseline=False,
                             check_fidelity=False)

    def worst(out: str) -> tuple[float, dict]:
        # no cache: the bundle cache's key holds shard's files, not a constant changed in this process
        result = shard.compile(model, "rk3588", tmp_path / out, replace(options, build_cache=False))
        report = shard.verify(result.bundle, model, backend="sim", samples=samples)
        return min(c[0].cosine for c in report.samples), result.report

    split, report = worst("split.shard")
    changes = {(c["form"], c["node"]): c for c in report["passes"]["scale_sandwich"]["changes"]}
    assert changes["outlier split", "fc1"]["input_channels"] == [5, 40]
    assert {7, 100} <= set(changes["hidden split", "fc1"]["hidden_channels"])
    # A side with an outlier loses every channel past 2 medians (at most 64): the two 60x input
    # channels spread fc1's outputs, and so fc2's inputs, past 2 medians in many channels (22 of
    # 256). Their fp16 side copy of fc1 -> Relu -> fc2 costs 64 + 64 MACs a token a channel; split
    # linear by linear, 64 + 256 (fc1's outputs made and placed) and 256 + 256 + 64 (fc2's inputs
    # picked out, put back, multiplied). Measured: 0.90 of the MACs in int8 (this bound was 0.6
    # split linear by linear)
    assert report["totals"]["int8_mac_share"] > 0.85
    monkeypatch.setattr(sandwich, "OUTLIER_TRIGGER", float("inf"))   # no side has an outlier
    plain, report = worst("plain.shard")
    assert not any(c["form"] == "outlier split" for c in report["passes"]["scale_sandwich"]["changes"])
    print(f"outlier splits: worst cosine {split:.6f}, without them {plain:.6f}")
    assert split >= 0.999 and plain < split - 0.002, (split, plain)


def test_linears_a_search_ranks_are_named_apart():
    """A model's unnamed products (and two of one name) get names of their own for the FP8 and int4
    searches, which rank and promote linears by name; a name no other node has is kept."""
    import onnx_graphsurgeon as gs

    from shard.passes.fp8_linears import linears

    rng = np.random.default_rng(0)
    nodes = [helper.make_node("MatMul", ["x", "w0"], ["a"]), helper.make_node("MatMul", ["a", "w1"], ["b"]),
             helper.make_node("MatMul", ["b", "w2"], ["c"], name="same"),
             helper.make_node("MatMul", ["c", "w3"], ["d"], name="same"),
             helper.make_node("MatMul", ["d", "w4"], ["y"], name="mine")]
    inits = [numpy_helper.from_array(rng.standard_normal((4, 4)).astype(np.float32), f"w{k}") for k in range(5)]
    graph = gs.import_onnx(make_model(nodes, [("x", [2, 4])], [("y", [2, 4])], inits))
    names = [n.name for n, _ in linears(graph)]
    assert len(set(names)) == 5 and names[-1] == "mine" and "" not in names
