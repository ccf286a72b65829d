"""scale_sandwich on small synthetic graphs: numerics (onnxruntime before and after, fp32 rounding)
and structure (no tensor past the range, the factors and clamps are there, undone when inexact)."""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs
import pytest
from conftest import make_model
from conftest import run_ort as conftest_run_ort
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

from shard.calibration import collect_stats
from shard.options import CompileOptions
from shard.graph import infer_shapes
from shard.passes import PassContext
from shard.passes.host_edges import host_edges
from shard.passes.scale_sandwich import FP16_RANGE, MASK_FLOOR, scale_sandwich
from shard.profile import Limit, Profile
from shard.runtime.host import run_host

FINFO_MIN = float(np.finfo(np.float32).min)


def sandwiched(model, samples: list[dict], safe: float = 64.0, precision: str = "int8"):
    """The pass on `model`, then host_edges (the host's restores): (graph, ctx, report)."""
    graph = infer_shapes(gs.import_onnx(model))
    limit = Limit(value=int(safe * 2), failure="numeric", evidence="test", source="test")   # margin 4: safe = 2N/4
    ctx = PassContext(profile=Profile("rk3588", 3, "test", limits={FP16_RANGE: limit}, facts={"fp16_range_margin": 4.0}),
                      options=CompileOptions(precision=precision, calib="given"))
    ctx.samples = samples
    graph, report = scale_sandwich(graph, ctx)
    graph.cleanup().toposort()
    graph, ctx.reports["host_edges"] = host_edges(graph, ctx)
    graph.cleanup().toposort()
    return graph, ctx, report


def run_rewritten(graph: gs.Graph, ctx: PassContext, feeds: dict) -> dict:
    """As the runtime runs it: host steps, the graph, host steps."""
    tensors = run_host(ctx.host_pre, dict(feeds))
    model = gs.export_onnx(graph.copy())
    model.ir_version = 8
    tensors.update(zip([t.name for t in graph.outputs], run_ort(model, {t.name: tensors[t.name] for t in graph.inputs})))
    return run_host(ctx.host_post, tensors)


def run_ort(model, feeds: dict) -> list[np.ndarray]:
    """Without graph fusions: the graphs before and after a power-of-two rescale then round alike, so
    the comparison can be tight (fusions reorder sums by a few ulps of the largest intermediate,
    which a saturating op after it can turn into 1e-3 of its output)."""
    return conftest_run_ort(model, feeds, optimize=False)


def assert_same(before: np.ndarray, after: np.ndarray) -> None:
    assert np.all(np.isfinite(after))
    np.testing.assert_allclose(after, before, rtol=0, atol=1e-6 * float(np.max(np.abs(before))))


def conv(name, x, out, cin, cout, gain, rng, inits, nodes):
    w = rng.standard_normal((cout, cin, 3, 3)).astype(np.float32) * np.float32(gain * np.sqrt(2 / (9 * cin)))
    inits += [numpy_helper.from_array(w, f"{name}_w"),
              numpy_helper.from_array(rng.standard_normal(cout).astype(np.float32), f"{name}_b")]
    nodes.append(helper.make_node("Conv", [x, f"{name}_w", f"{name}_b"], [out], pads=[1, 1, 1, 1], name=name))


def growing_net(layers: list[str], gain: float, seed: int, channels: int = 4):
    """A chain of layers over [1, C, 8, 8]: conv (x gain), relu, residual (x + conv(x), by Add or Sum),
    batch norm (x gain), pool, sigmoid (not homogeneous); its activations grow by about `gain` per conv."""
    rng = np.random.default_rng(seed)
    nodes, inits, x = [], [], "x"
    for k, kind in enumerate(layers):
        out = f"t{k}"
        if kind == "conv":
            conv(f"conv{k}", x, out, channels, channels, gain, rng, inits, nodes)
        elif kind in ("residual", "sum"):   # Sum: old opsets' residual (Caffe2's ResNet-50)
            conv(f"res{k}", x, f"{out}_c", channels, channels, gain, rng, inits, nodes)
            nodes.append(helper.make_node("Add" if kind == "residual" else "Sum", [x, f"{out}_c"], [out], name=f"add{k}"))
        elif kind == "bn":
            params = [rng.uniform(0.5, 2.0, channels) * gain, rng.standard_normal(channels) * 4,
                      rng.standard_normal(channels), rng.uniform(0.2, 3.0, channels)]
            names = [f"bn{k}_{p}" for p in ("scale", "bias", "mean", "var")]
            inits += [numpy_helper.from_array(v.astype(np.float32), n) for v, n in zip(params, names)]
            nodes.append(helper.make_node("BatchNormalization", [x, *names], [out], epsilon=1e-5, name=f"bn{k}"))
        elif kind == "relu":
            nodes.append(helper.make_node("Relu", [x], [out], name=f"relu{k}"))
        elif kind == "pool":
            nodes.append(helper.make_node("MaxPool", [x], [out], kernel_shape=[3, 3], pads=[1, 1, 1, 1], name=f"pool{k}"))
        elif kind == "sigmoid":
            nodes.append(helper.make_node("Sigmoid", [x], [out], name=f"sig{k}"))
        x = out
    nodes.append(helper.make_node("Identity", [x], ["y"], name="out"))
    return make_model(nodes, [("x", [1, channels, 8, 8])], [("y", [1, channels, 8, 8])], inits)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layers=st.lists(st.sampled_from(["conv", "conv", "residual", "sum", "bn", "relu", "pool", "sigmoid"]), min_size=2,
                      max_size=9),
       gain=st.sampled_from([2.0, 4.0, 8.0]), seed=st.integers(0, 1000))
def test_range_sandwich_is_exact_and_keeps_every_foldable_tensor_in_range(layers, gain, seed):
    model = growing_net(layers, gain, seed)
    samples = [{"x": np.random.default_rng(seed + k).standard_normal((1, 4, 8, 8)).astype(np.float32)} for k in range(2)]
    before = [run_ort(model, s)[0] for s in samples]
    graph, ctx, report = sandwiched(model, samples, safe=64.0)
    for sample, expected in zip(samples, before):
        assert_same(expected, run_rewritten(graph, ctx, sample)["y"])
    if any(c["op"] == "range rescale" for c in report["not_fixed"]):   # a constant past fp16 (or fp32 on the host) would carry it
        assert report["changes"] == [] and "compiled as it came" in report["not_fixed"][0]["action"]
        return
    # Structure: on the NPU side every tensor is under the range but those the report names.
    stats = collect_stats(gs.export_onnx(graph.copy()), [run_host(ctx.host_pre, dict(s)) for s in samples])
    unfixed = {c["tensor"] for c in report["not_fixed"]}
    over = [t for t in graph.tensors().values() if t.name in stats and stats[t.name].absmax > 64.0
            and t.name not in unfixed]
    assert not over, [(t.name, stats[t.name].absmax) for t in over]


def test_growing_chain_gets_a_chain_of_factors_and_its_output_is_restored_on_the_host():
    model = growing_net(["conv", "relu"] * 5, 4.0, seed=1)
    sample = {"x": np.random.default_rng(0).standard_normal((1, 4, 8, 8)).astype(np.float32)}
    graph, ctx, report = sandwiched(model, [sample], safe=64.0)
    factors = [c["factor"] for c in report["changes"] if c["op"] == "Conv"]
    assert len(factors) >= 2 and factors == sorted(factors) and factors[-1] > factors[0]  # grows with the net
    assert all(np.log2(f).is_integer() for f in factors)                                   # powers of two
    assert [s["type"] for s in ctx.host_post] == ["Mul"]                                    # fp32, on the host
    assert_same(run_ort(model, sample)[0], run_rewritten(graph, ctx, sample)["y"])


def test_batchnorm_takes_the_factor_in_its_constants():
    """Caffe2's ResNet-50 (the onnx package's light model): BatchNormalization between the convs; before,
    every one got its true input back by a Mul and overflowed fp16."""
    model = growing_net(["conv", "bn", "relu", "conv", "bn", "sum"], 8.0, seed=3)
    sample = {"x": np.random.default_rng(0).standard_normal((1, 4, 8, 8)).astype(np.float32)}
    graph, ctx, report = sandwiched(model, [sample], safe=64.0)
    assert not report["not_fixed"] and "BatchNormalization" in {c["op"] for c in report["changes"]}
    assert not any(n.op == "Mul" and n.outputs[0].outputs[0].op == "BatchNormalization" for n in graph.nodes)
    assert_same(run_ort(model, sample)[0], run_rewritten(graph, ctx, sample)["y"])


@pytest.mark.parametrize("after", [[], ["Reshape"], ["Transpose", "Reshape"]])
def test_a_last_softmax_past_the_range_moves_to_the_host_with_the_layout_ops_after_it(after):
    """Caffe2's SqueezeNet (the onnx package's light model): its opset-9 Softmax comes back from the
    version converter wrapped in Reshapes, so the Softmax past fp16 is not itself the graph output."""
    model = growing_net(["conv", "relu", "conv"], 16.0, seed=2)
    graph = gs.import_onnx(model)
    out = graph.outputs[0]
    last = out.inputs[0]                          # the Identity that ends growing_net
    probs = gs.Variable("probs", np.float32, [1, 4, 8, 8])
    last.outputs = [probs]
    tail = gs.Node("Softmax", "softmax", {"axis": 1}, [probs], [out] if not after else [gs.Variable("p0", np.float32)])
    graph.nodes.append(tail)
    for k, op in enumerate(after):
        source = tail.outputs[0]
        target = out if k == len(after) - 1 else gs.Variable(f"p{k + 1}", np.float32)
        if op == "Reshape":
            tail = gs.Node("Reshape", f"reshape{k}", {}, [source, gs.Constant(f"s{k}", np.array([1, 4, 8, 8], np.int64))],
                           [target])
        else:
            tail = gs.Node("Transpose", f"transpose{k}", {"perm": [0, 1, 3, 2]}, [source], [target])
        graph.nodes.append(tail)
    model = gs.export_onnx(graph.cleanup().toposort())
    sample = {"x": np.random.default_rng(0).standard_normal((1, 4, 8, 8)).astype(np.float32)}
    graph, ctx, report = sandwiched(model, [sample], safe=64.0, precision="fp16")
    assert [s.get("type", s["op"]) for s in ctx.host_post] == ["Mul", "Softmax", *[op.lower() for op in after]]
    assert "Softmax" not in [n.op for n in graph.nodes] and not report["not_fixed"]
    np.testing.assert_allclose(run_rewritten(graph, ctx, sample)["y"], run_ort(model, sample)[0], rtol=1e-5, atol=1e-7)


def test_layernorm_absorbs_the_factor_in_its_epsilon():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((16, 16)).astype(np.float32) * 50
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"], name="fc"),
             helper.make_node("LayerNormalization", ["h", "g", "b"], ["y"], epsilon=1e-5, axis=-1, name="ln")]
    inits = [numpy_helper.from_array(w, "w"), numpy_helper.from_array(np.ones(16, np.float32), "g"),
             numpy_helper.from_array(np.zeros(16, np.float32), "b")]
    model = make_model(nodes, [("x", [1, 8, 16])], [("y", [1, 8, 16])], inits)
    sample = {"x": rng.standard_normal((1, 8, 16)).astype(np.float32) * 10}
    graph, ctx, report = sandwiched(model, [sample], safe=64.0)
    ln = next(n for n in graph.nodes if n.op == "LayerNormalization")
    factor = next(c["factor"] for c in report["changes"] if c["node"] == "fc")
    assert np.isclose(ln.attrs["epsilon"], 1e-5 / factor ** 2) and not ctx.host_post  # no restore: LN ends it
    assert_same(run_ort(model, sample)[0], run_rewritten(graph, ctx, sample)["y"])


def attention_with_mask(fill: str, seq: int = 8, dim: int = 4):
    """Scores q·kᵀ, masked by an additive input mask (as BERT exporters write it) or by a Where with a
    constant fill (masked_fill), then Softmax and ·v."""
    nodes = [helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 2, 1], name="kt"),
             helper.make_node("MatMul", ["q", "kt"], ["s"], name="qk")]
    inputs = [("q", [1, seq, dim]), ("k", [1, seq, dim]), ("v", [1, seq, dim])]
    inits = []
    if fill == "additive":
        nodes.append(helper.make_node("Add", ["s", "mask"], ["m"], name="mask_add"))
        inputs.append(("mask", [1, 1, seq]))
    else:
        nodes += [helper.make_node("Less", ["s", "zero"], ["cond"], name="cond"),
                  helper.make_node("Where", ["cond", "fill", "s"], ["m"], name="masked_fill")]
        inits = [numpy_helper.from_array(np.float32(-1.0), "zero"), numpy_helper.from_array(np.float32(FINFO_MIN), "fill")]
    nodes += [helper.make_node("Softmax", ["m"], ["p"], axis=-1, name="softmax"),
              helper.make_node("MatMul", ["p", "v"], ["y"], name="pv")]
    return make_model(nodes, inputs, [("y", [1, seq, dim])], inits)


def attention_samples(n: int, seq: int = 8, dim: int = 4, masked_from: int = 5):
    rng = np.random.default_rng(3)
    mask = np.zeros((1, 1, seq), np.float32)
    mask[..., masked_from:] = FINFO_MIN
    return [{"q": rng.standard_normal((1, seq, dim)).astype(np.float32) * 3,
             "k": rng.standard_normal((1, seq, dim)).astype(np.float32),
             "v": rng.standard_normal((1, seq, dim)).astype(np.float32), "mask": mask} for _ in range(n)]


def test_additive_mask_is_clamped_and_the_softmax_does_not_move():
    model = attention_with_mask("additive")
    samples = attention_samples(4)
    graph, ctx, report = sandwiched(model, samples, safe=1e4)
    clamp = next(n for n in graph.nodes if n.op == "Max")
    floor = float(clamp.inputs[1].values)
    scores = collect_stats(model, samples, ["s"])["s"]
    assert MASK_FLOOR < floor <= -(scores.max - scores.min + 32)     # far below every score, far above -3.4e38
    assert report["changes"][0]["form"] == "mask clamp"
    for sample in samples:
        assert_same(run_ort(model, sample)[0], run_rewritten(graph, ctx, sample)["y"])


def test_masked_fill_constant_is_clamped():
    model = attention_with_mask("where")
    samples = [{k: v for k, v in s.items() if k != "mask"} for s in attention_samples(3)]
    graph, ctx, report = sandwiched(model, samples, safe=1e4)
    where = next(n for n in graph.nodes if n.op == "Where")
    assert MASK_FLOOR < float(where.inputs[1].values.min()) < -32
    for sample in samples:
        assert_same(run_ort(model, sample)[0], run_rewritten(graph, ctx, sample)["y"])


def test_a_clamp_that_would_change_the_output_is_undone():
    # Every key masked: in fp32 the softmax of -3.4e38 everywhere is uniform, after a clamp it is not.
    model = attention_with_mask("additive")
    samples = attention_samples(2, masked_from=0)
    graph, ctx, report = sandwiched(model, samples, safe=1e4)
    assert not any(n.op == "Max" for n in graph.nodes)
    assert report["undone"] and report["changes"] == [] and report["max_relative_change"] > 1e-5
    for sample in samples:
        assert_same(run_ort(model, sample)[0], run_rewritten(graph, ctx, sample)["y"])


def test_nothing_changes_in_range():
    model = growing_net(["conv", "relu", "conv"], 1.0, seed=0)
    sample = {"x": np.random.default_rng(0).standard_normal((1, 4, 8, 8)).astype(np.float32)}
    graph, ctx, report = sandwiched(model, [sample], safe=1e4)
    assert report["changes"] == [] and [n.op for n in graph.nodes] == ["Conv", "Relu", "Conv", "Identity"]


def linears_with_outliers(seed: int, seq: int, dim: int, hidden: int, in_outliers: list[int], out_outliers: list[int],
                          shared: bool, act: str = "none"):
    """LayerNorm -> MatMul + bias (and a second MatMul on the same input when `shared`) -> `act`
    (none, relu, or gelu as exporters write it: x * 0.5 * (1 + erf(x / sqrt 2))) -> MatMul, as in a
    transformer layer: LayerNorm weights make `in_outliers` large, the first weights make
    `out_outliers` of its output large."""
    rng = np.random.default_rng(seed)
    gamma = np.ones(dim, np.float32)
    gamma[in_outliers] = 60.0
    w1 = (rng.standard_normal((dim, hidden)) / np.sqrt(dim)).astype(np.float32)
    w1[:, out_outliers] *= 80.0
    w2 = (rng.standard_normal((hidden, dim)) / np.sqrt(hidden)).astype(np.float32)
    inits = [numpy_helper.from_array(gamma, "gamma"), numpy_helper.from_array(np.zeros(dim, np.float32), "beta"),
             numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(w2, "w2"),
             numpy_helper.from_array(rng.standard_normal(hidden).astype(np.float32), "b1")]
    nodes = [helper.make_node("LayerNormalization", ["x", "gamma", "beta"], ["ln"], axis=-1, name="ln"),
             helper.make_node("MatMul", ["ln", "w1"], ["h"], name="fc1"),
             helper.make_node("Add", ["h", "b1"], ["hb"], name="bias1")]
    if act == "relu":
        nodes.append(helper.make_node("Relu", ["hb"], ["a"], name="relu"))
    elif act == "gelu":
        inits += [numpy_helper.from_array(np.array(v, np.float32), k) for k, v in
                  (("sqrt2", np.sqrt(2.0)), ("one", 1.0), ("half", 0.5))]
        nodes += [helper.make_node("Div", ["hb", "sqrt2"], ["g0"], name="gelu/div"),
                  helper.make_node("Erf", ["g0"], ["g1"], name="gelu/erf"),
                  helper.make_node("Add", ["g1", "one"], ["g2"], name="gelu/add"),
                  helper.make_node("Mul", ["hb", "g2"], ["g3"], name="gelu/mul"),
                  helper.make_node("Mul", ["g3", "half"], ["a"], name="gelu/half")]
    nodes.append(helper.make_node("MatMul", ["a" if act != "none" else "hb", "w2"], ["y"], name="fc2"))
    outputs = [("y", [1, seq, dim])]
    if shared:
        inits.append(numpy_helper.from_array(w1[:, ::-1].copy(), "w3"))
        nodes.append(helper.make_node("MatMul", ["ln", "w3"], ["z"], name="fc3"))
        outputs.append(("z", [1, seq, hidden]))
    return make_model(nodes, [("x", [1, seq, dim])], outputs, inits)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 1000), seq=st.sampled_from([8, 16]), dim=st.sampled_from([16, 32, 48]),
       hidden=st.sampled_from([24, 64]), n_in=st.integers(0, 3), n_out=st.integers(0, 3), shared=st.booleans(),
       act=st.sampled_from(["none", "relu", "gelu"]))
def test_outlier_split_is_exact_and_leaves_the_int8_linears_a_narrow_range(seed, seq, dim, hidden, n_in, n_out, shared,
                                                                           act):
    from shard.precision import SIDE, float16_names, is_int8_candidate

    rng = np.random.default_rng(seed)
    ins = sorted(rng.choice(dim, n_in, replace=False).tolist())
    outs = sorted(rng.choice(hidden, n_out, replace=False).tolist())
    model = linears_with_outliers(seed, seq, dim, hidden, ins, outs, shared, act)
    samples = [{"x": rng.standard_normal((1, seq, dim)).astype(np.float32)} for _ in range(3)]
    graph, ctx, report = sandwiched(model, samples, safe=1e6, precision="mixed")
    for sample in samples:
        expected = run_ort(model, sample)
        got = run_rewritten(graph, ctx, sample)
        for name, value in zip(("y", "z"), expected):
            np.testing.assert_allclose(got[name], value, rtol=0, atol=2e-6 * float(np.max(np.abs(value))))
    splits = {c["node"]: c for c in report["changes"] if c["form"] == "outlier split"}
    hidden = {c["node"]: c for c in report["changes"] if c["form"] == "hidden split"}
    # fc1's outputs reach fc2 through its bias and per-channel ops alone: their outliers move to a
    # side copy of fc1 -> fc2, the ops between included
    assert ("fc1" in hidden) >= bool(outs) and set(outs) <= set(hidden.get("fc1", {}).get("hidden_channels", []))
    assert all(c["between"] == {"none": [], "relu": ["Relu"], "gelu": ["Div", "Erf", "Add", "Mul", "Mul"]}[act]
               for c in hidden.values())
    assert ("fc1" in splits) == bool(ins) and ("fc3" in splits) == bool(shared and (ins or outs))
    if "fc1" in splits:
        assert splits["fc1"]["input_channels"] == ins and splits["fc1"]["output_channels"] == []
    # The int8 linears see and make only the ordinary channels: the outliers are on fp16 side linears.
    after = collect_stats(gs.export_onnx(graph.copy()), samples)
    nodes = {n.name: n for n in graph.nodes}
    for name, change in splits.items():
        node = nodes[name]
        x, y = node.inputs[0].name, node.outputs[0].name
        assert is_int8_candidate(node)
        assert x.endswith(f"{SIDE}rest") == bool(change["input_channels"])
        assert not change["input_channels"] \
            or after[x].absmax <= change["input_range_after"] * (1 + 1e-6) < change["range_before"][0]
        # (an input-only split can leave the output a little wider: the outlier channels' share may have
        # cancelled part of the rest)
        assert after[y].absmax < change["range_before"][1] or not change["output_channels"]
    for change in hidden.values():
        first, second = nodes[change["node"]], nodes[change["second"]]
        assert is_int8_candidate(first) and is_int8_candidate(second)
        # Neither range widens, and the one whose outliers chose the channels narrows (the other may
        # keep its own largest channel: an output's largest value negative, which a Relu drops).
        ranges = after[first.outputs[0].name].absmax, after[second.inputs[0].name].absmax
        assert all(now <= before for now, before in zip(ranges, change["range_before"]))
        assert any(now < before for now, before in zip(ranges, change["range_before"]))
    sides = [n for n in graph.nodes if SIDE in n.name and n.op == "MatMul"]
    assert bool(sides) == bool(splits or hidden)
    kept = float16_names(graph.nodes)
    assert all(n.name in kept for n in sides) and not any(name in kept for name in splits)
    # The Adds that join the side linears stay fp16 (in int8, the linear's output would be quantized
    # once more before them).
    assert all(n.name in kept for n in graph.nodes if n.op == "Add" and SIDE in n.name)
    for gather in (n for n in graph.nodes if n.name.endswith(f"{SIDE}gather")):
        # never a lone x @ S @ S^T before the Sub: toolkit 2.5.0 fuses that chain wrongly
        assert len(gather.outputs[0].outputs) >= 2
    if shared and ins:   # one masked copy of the input both linears read
        assert sum(n.op == "Sub" and n.inputs[0].name == "ln" for n in graph.nodes) == 1


def test_a_side_is_split_only_past_the_trigger_and_then_loses_every_channel_past_the_ratio():
    from shard.passes.scale_sandwich import MAX_OUTLIERS, OUTLIER_RATIO, OUTLIER_TRIGGER, outliers

    absmax = np.ones(256, np.float32)
    absmax[[3, 9]] = 0.99 * OUTLIER_TRIGGER    # past the ratio, short of the trigger: kept whole
    assert outliers(absmax) == []
    absmax[200] = 1.01 * OUTLIER_TRIGGER       # a real outlier: it and the channels past the ratio go
    absmax[50] = 0.99 * OUTLIER_RATIO
    assert outliers(absmax) == [3, 9, 200]
    absmax[:] = 1.0
    absmax[100:202] = 1.5 * OUTLIER_RATIO      # more past the ratio than a side may take: the largest
    absmax[255] = 2 * OUTLIER_TRIGGER
    assert outliers(absmax) == [*range(100, 100 + MAX_OUTLIERS - 1), 255]


@pytest.mark.parametrize("change", ["softmax", "read_twice"])
def test_a_hidden_split_needs_per_channel_ops_between_that_nothing_else_reads(change):
    """fc1 -> bias -> Relu -> fc2 with outliers in fc1's output: no side FFN where the op between
    mixes channels (Softmax) or the Relu's output is also a model output; the linears are split one
    by one instead, exactly as well."""
    model = linears_with_outliers(3, 8, 32, 64, [], [5, 9], shared=False, act="relu")
    relu = next(n for n in model.graph.node if n.name == "relu")
    if change == "softmax":
        relu.op_type = "Softmax"
        relu.attribute.append(helper.make_attribute("axis", -1))
    else:
        model.graph.output.append(helper.make_tensor_value_info("a", TensorProto.FLOAT, [1, 8, 64]))
    rng = np.random.default_rng(3)
    samples = [{"x": rng.standard_normal((1, 8, 32)).astype(np.float32)} for _ in range(3)]
    graph, ctx, report = sandwiched(model, samples, safe=1e6, precision="mixed")
    forms = {(c["form"], c["node"]) for c in report["changes"]}
    assert not any(form == "hidden split" for form, _ in forms) and ("outlier split", "fc1") in forms
    for sample in samples:
        got = run_rewritten(graph, ctx, sample)
        for output, expected in zip(model.graph.output, run_ort(model, sample)):
            np.testing.assert_allclose(got[output.name], expected, rtol=0, atol=2e-6 * float(np.max(np.abs(expected))))


def test_a_chain_of_hidden_splits_takes_every_other_pair_and_stays_exact():
    """x -> fc1 -> Relu -> fc2 -> Relu -> fc3, outliers in both hidden tensors: fc2 cannot be the
    second linear of one side FFN and the first of the next (the second side would miss what the
    first adds to fc2's output), so fc1 -> fc2 is split as an FFN and fc2's output one linear at a time."""
    rng = np.random.default_rng(5)
    w = [(rng.standard_normal(shape) / np.sqrt(shape[0])).astype(np.float32) for shape in ((32, 64), (64, 64), (64, 32))]
    w[0][:, [3, 40]] *= 60.0
    w[1][:, [7, 50]] *= 60.0
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h1"], name="fc1"), helper.make_node("Relu", ["h1"], ["a1"]),
             helper.make_node("MatMul", ["a1", "w2"], ["h2"], name="fc2"), helper.make_node("Relu", ["h2"], ["a2"]),
             helper.make_node("MatMul", ["a2", "w3"], ["y"], name="fc3")]
    model = make_model(nodes, [("x", [1, 8, 32])], [("y", [1, 8, 32])],
                       [numpy_helper.from_array(v, f"w{k + 1}") for k, v in enumerate(w)])
    samples = [{"x": rng.standard_normal((1, 8, 32)).astype(np.float32)} for _ in range(3)]
    graph, ctx, report = sandwiched(model, samples, safe=1e6, precision="mixed")
    forms = {(c["form"], c["node"]) for c in report["changes"]}
    assert {f for f in forms if f[0] == "hidden split"} == {("hidden split", "fc1")}
    assert ("outlier split", "fc2") in forms
    for sample in samples:
        expected = run_ort(model, sample)[0]
        np.testing.assert_allclose(run_rewritten(graph, ctx, sample)["y"], expected, rtol=0,
                                   atol=2e-6 * float(np.max(np.abs(expected))))


def test_a_linears_bias_add_stays_int8_with_it_and_other_adds_stay_fp16():
    # fc1 + bias (folded into the vendor's Conv: int8 with it), a residual Add (fp16), fc2 whose
    # output a second op also reads (its bias Add cannot fold: fp16)
    w = numpy_helper.from_array(np.ones((8, 8), np.float32), "w")
    b = numpy_helper.from_array(np.ones(8, np.float32), "b")
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"], name="fc1"), helper.make_node("Add", ["h", "b"], ["hb"], name="bias1"),
             helper.make_node("Add", ["hb", "x"], ["r"], name="residual"),
             helper.make_node("MatMul", ["r", "w"], ["g"], name="fc2"), helper.make_node("Add", ["b", "g"], ["gb"], name="bias2"),
             helper.make_node("Mul", ["g", "gb"], ["y"], name="mul")]
    graph = gs.import_onnx(make_model(nodes, [("x", [1, 4, 8])], [("y", [1, 4, 8])], [w, b]))
    from shard.precision import float16_names

    kept = float16_names(graph.nodes)
    assert {"fc1", "bias1", "hb", "fc2"}.isdisjoint(kept) and {"residual", "bias2", "mul"} <= set(kept)
    assert {"fc1", "bias1", "hb"} <= set(float16_names(graph.nodes, promoted={"fc1"}))


def test_outlier_split_only_in_mixed_precision():
    model = linears_with_outliers(0, 8, 32, 64, [3], [5], shared=False)
    samples = [{"x": np.random.default_rng(0).standard_normal((1, 8, 32)).astype(np.float32)}]
    for precision in ("fp16", "int8"):
        graph, ctx, report = sandwiched(model, samples, safe=1e6, precision=precision)
        assert not any(c["form"] == "outlier split" for c in report["changes"])
