"""legalize, host_edges and slow_paths on small synthetic graphs: numerics (onnxruntime before and
after) and structure (no op over the limit; the pieces and host steps are there)."""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import pytest
from conftest import make_model, run_ort
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx import helper, numpy_helper

import shard
from shard.options import CompileOptions
from shard.graph import infer_shapes, small_model
from shard.passes import PassContext
from shard.passes.fit import Legality, OpSpec, WidthLimit
from shard.passes.host_edges import host_edges
from shard.passes.legalize import CHECKED, legalize, node_label
from shard.profile import Limit, Profile
from shard.runtime.host import run_host

EMPTY = Profile("cpu", 1, "none")


def legalized(model: onnx.ModelProto, width: int) -> tuple[gs.Graph, PassContext]:
    graph = infer_shapes(gs.import_onnx(model))
    ctx = PassContext(profile=EMPTY, legality=Legality(EMPTY, WidthLimit(width)))
    graph, ctx.reports["legalize"] = legalize(graph, ctx)
    graph.cleanup().toposort()
    graph, ctx.reports["host_edges"] = host_edges(graph, ctx)
    graph.cleanup().toposort()
    return graph, ctx


def run_legalized(graph: gs.Graph, ctx: PassContext, feeds: dict) -> dict:
    """The rewritten graph as the runtime runs it: host steps, the NPU graph, host steps."""
    tensors = run_host(ctx.host_pre, dict(feeds), ctx.host_tables)
    model = gs.export_onnx(graph.copy())
    model.ir_version = 8
    names = [t.name for t in graph.outputs]
    inputs = {t.name: np.ascontiguousarray(tensors[t.name]) for t in graph.inputs}
    tensors.update(zip(names, run_ort(model, inputs)))
    return run_host(ctx.host_post, tensors)


def const(name, array):
    return numpy_helper.from_array(np.asarray(array, np.float32), name)


def test_oversize_add_is_split_and_its_edges_go_to_the_host():
    model = make_model([helper.make_node("Add", ["x", "x"], ["y"], name="add")], [("x", [1, 1, 1, 200])],
                       [("y", [1, 1, 1, 200])])
    graph, ctx = legalized(model, 64)
    assert [n.op for n in graph.nodes] == ["Add"] * 4  # 200 = 4 pieces of at most 64 (50 each)
    assert all(int(t.shape[-1]) <= 64 for t in [*graph.inputs, *graph.outputs])
    assert [s["op"] for s in ctx.host_pre] == ["slice"] * 4 and [s["op"] for s in ctx.host_post] == ["concat"]
    x = np.random.default_rng(0).standard_normal((1, 1, 1, 200)).astype(np.float32)
    assert np.array_equal(run_legalized(graph, ctx, {"x": x})["y"], x + x)
    change = ctx.reports["legalize"]["changes"][0]
    assert change["node"] == "add" and "split into 4 along axis 3" in change["action"]


def test_chains_stay_split_inside_the_graph():
    """Sigmoid(Add(x, b)) with both over the limit: the Concat/Slice pair between them folds away."""
    model = make_model([helper.make_node("Add", ["x", "b"], ["a"]), helper.make_node("Sigmoid", ["a"], ["y"])],
                       [("x", [2, 96])], [("y", [2, 96])], [const("b", np.arange(96) / 96)])
    graph, ctx = legalized(model, 32)
    assert ctx.reports["legalize"]["slices_folded"] == 3
    assert sorted(n.op for n in graph.nodes) == ["Add"] * 3 + ["Sigmoid"] * 3
    x = np.random.default_rng(1).standard_normal((2, 96)).astype(np.float32)
    np.testing.assert_allclose(run_legalized(graph, ctx, {"x": x})["y"], run_ort(model, {"x": x})[0], rtol=0, atol=0)


OPS = st.sampled_from(["add_const", "mul_self", "sigmoid", "softmax_rows", "softmax_last", "matmul_n", "matmul_k",
                       "transpose", "concat_rows", "slice_rows", "reshape_split"])


@st.composite
def chains(draw):
    rank = draw(st.integers(2, 4))
    shape = [1] * (rank - 2) + [draw(st.integers(1, 6)), draw(st.integers(2, 200))]
    ops = draw(st.lists(OPS, min_size=1, max_size=4))
    return shape, ops, draw(st.integers(2, 64))


def chain_model(shape, ops, seed=0):
    rng = np.random.default_rng(seed)
    nodes, inits, x, cur = [], [], "x", list(shape)
    for i, op in enumerate(ops):
        out = f"t{i}"
        if op == "add_const":
            inits.append(const(f"b{i}", rng.standard_normal(cur[-1:])))
            nodes.append(helper.make_node("Add", [x, f"b{i}"], [out]))
        elif op == "mul_self":
            nodes.append(helper.make_node("Mul", [x, x], [out]))
        elif op == "sigmoid":
            nodes.append(helper.make_node("Sigmoid", [x], [out]))
        elif op == "softmax_rows":  # normalise over the second-last axis: the last axis splits safely
            nodes.append(helper.make_node("Softmax", [x], [out], axis=len(cur) - 2))
        elif op == "softmax_last":  # over the last axis itself: two passes where it is too wide
            nodes.append(helper.make_node("Softmax", [x], [out], axis=-1))
        elif op in ("matmul_n", "matmul_k"):  # k: a narrow output from a wide K
            n = int(rng.integers(2, 150)) if op == "matmul_n" else int(rng.integers(1, 4))
            inits.append(const(f"w{i}", rng.standard_normal((cur[-1], n)) / np.sqrt(cur[-1])))
            nodes.append(helper.make_node("MatMul", [x, f"w{i}"], [out]))
            cur = cur[:-1] + [n]
        elif op == "concat_rows":  # [.., R, W] with itself along the rows
            nodes.append(helper.make_node("Concat", [x, x], [out], axis=len(cur) - 2))
            cur = cur[:-2] + [2 * cur[-2], cur[-1]]
        elif op == "slice_rows" and cur[-2] < 2:
            nodes.append(helper.make_node("Sigmoid", [x], [out]))
        elif op == "slice_rows":
            inits += [numpy_helper.from_array(np.array(v, np.int64), f"{p}{i}")
                      for p, v in (("st", [1]), ("en", [cur[-2]]), ("ax", [len(cur) - 2]))]
            nodes.append(helper.make_node("Slice", [x, f"st{i}", f"en{i}", f"ax{i}"], [out]))
            cur = cur[:-2] + [cur[-2] - 1, cur[-1]]
        elif op == "reshape_split":  # [.., W] -> [.., W, 1]: the leading axes are kept
            cur = cur + [1]
            inits.append(numpy_helper.from_array(np.array(cur, np.int64), f"sh{i}"))
            nodes.append(helper.make_node("Reshape", [x, f"sh{i}"], [out]))
        elif op == "transpose":
            perm = list(range(len(cur) - 2)) + [len(cur) - 1, len(cur) - 2]
            nodes.append(helper.make_node("Transpose", [x], [out], perm=perm))
            cur = [cur[p] for p in perm]
        x = out
    nodes[-1].output[0] = "y"
    return make_model(nodes, [("x", shape)], [("y", cur)], inits)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(chains())
def test_legalize_keeps_numerics_and_every_op_within_the_limit(case):
    shape, ops, width = case
    model = chain_model(shape, ops)
    graph, ctx = legalized(model, width)
    x = np.random.default_rng(2).standard_normal(shape).astype(np.float32)
    # Exact pieces except the reduced-axis splits, which sum in another order: fp32 rounding.
    np.testing.assert_allclose(run_legalized(graph, ctx, {"x": x})["y"], run_ort(model, {"x": x})[0],
                               rtol=1e-4, atol=1e-5)
    stuck = {c["node"] for c in ctx.reports["legalize"]["tried"]}
    limit = WidthLimit(width)
    for node in graph.nodes:
        if node.op in CHECKED and node_label(node) not in stuck and not node.name.endswith("/legalize/concat") \
                and "/legalize/slice" not in node.name:
            assert limit.check(OpSpec.of(node)).ok, (node.op, [t.shape for t in node.outputs])
    for t in [*graph.inputs, *graph.outputs]:  # what crosses into and out of the NPU graph fits
        assert int(t.shape[-1]) <= width or any(c["node"] for c in ctx.reports["legalize"]["tried"])


def test_profile_limits_drive_a_cpu_compile_with_host_steps(tmp_path, save):
    """A profile says Add fits up to 64 wide at H=1: compile for cpu splits, the runtime joins."""
    profile = Profile("cpu", 1, "test", {"add-width@h1": Limit(64, "overflow", "synthetic", "test")})
    profile.save(tmp_path / "p.json")
    model = make_model([helper.make_node("Add", ["x", "x"], ["y"], name="add")], [("x", [1, 1, 1, 150])],
                       [("y", [1, 1, 1, 150])])
    result = shard.compile(save(model), "cpu", tmp_path / "a.shard", CompileOptions(profile=str(tmp_path / "p.json")))
    manifest = json.loads((result.bundle / "manifest.json").read_text())
    assert [s["op"] for s in manifest["host_pre"]] == ["slice"] * 3 and manifest["inputs"][0]["shape"] == [1, 1, 1, 150]
    x = np.random.default_rng(3).standard_normal((1, 1, 1, 150)).astype(np.float32)
    with shard.load(result.bundle, backend="cpu") as session:
        assert np.array_equal(session.run({"x": x})["y"], x + x)
    report = shard.verify(result.bundle, tmp_path / "model.onnx", backend="cpu")
    assert report.passed and not report.skipped_shards  # the shards are checked alone too


def patch_embed_model(c=3, o=8, hw=32, k=8, seed=0):
    rng = np.random.default_rng(seed)
    w, b = rng.standard_normal((o, c, k, k)) / k, rng.standard_normal(o)
    node = helper.make_node("Conv", ["x", "w", "b"], ["y"], kernel_shape=[k, k], strides=[k, k], name="patch")
    return make_model([node], [("x", [1, c, hw, hw])], [("y", [1, o, hw // k, hw // k])], [const("w", w), const("b", b)])


def test_patch_conv_becomes_host_patches_and_a_matmul(tmp_path, save):
    profile = Profile("cpu", 1, "test", {"conv-stride@cin16": Limit(7, "slow", "synthetic", "test")})
    profile.save(tmp_path / "p.json")
    model = patch_embed_model()
    result = shard.compile(save(model), "cpu", tmp_path / "c.shard", CompileOptions(profile=str(tmp_path / "p.json")))
    manifest = json.loads((result.bundle / "manifest.json").read_text())
    assert [s["op"] for s in manifest["host_pre"]] == ["reshape", "transpose", "reshape"]
    ops = [n.op_type for n in onnx.load(result.bundle / manifest["shards"][0]["onnx"]).graph.node]
    assert "Conv" not in ops and "MatMul" in ops
    x = np.random.default_rng(4).standard_normal((1, 3, 32, 32)).astype(np.float32)
    with shard.load(result.bundle, backend="cpu") as session:
        np.testing.assert_allclose(session.run({"x": x})["y"], run_ort(model, {"x": x})[0], rtol=1e-4, atol=1e-5)
    assert result.report["passes"]["slow_paths"]["changes"][0]["node"] == "patch"
    disabled = shard.compile(save(model), "cpu", tmp_path / "d.shard",
                             CompileOptions(profile=str(tmp_path / "p.json"), disable=("slow_paths",)))
    assert disabled.report["passes"]["slow_paths"] == {"disabled": True}
    assert json.loads((disabled.bundle / "manifest.json").read_text())["host_pre"] == []


@pytest.mark.parametrize("passing", [None, [2, 3, 4, 5, 6, 7, 12, 14, 16]])
@pytest.mark.parametrize("stride", [4, 8, 16])
def test_only_strides_the_profile_marks_slow_are_rewritten(tmp_path, save, stride, passing):
    """A limit found by the search: strides past 7 are slow. A swept limit (not monotone): strides
    outside its passing set are slow, 16 among them or not as measured."""
    profile = Profile("cpu", 1, "test", {"conv-stride@cin16": Limit(7 if passing is None else 16, "slow", "synthetic",
                                                                    "test", failing=8, passing=passing)})
    rewritten = stride > 7 if passing is None else stride not in passing
    profile.save(tmp_path / "p.json")
    result = shard.compile(save(patch_embed_model(k=stride)), "cpu", tmp_path / "c.shard",
                           CompileOptions(profile=str(tmp_path / "p.json")))
    assert bool(result.report["passes"]["slow_paths"]["changes"]) is rewritten


def test_dump_after_writes_the_graph_after_a_pass(tmp_path, save):
    profile = Profile("cpu", 1, "test", {"add-width@h1": Limit(64, "overflow", "synthetic", "test")})
    profile.save(tmp_path / "p.json")
    model = make_model([helper.make_node("Add", ["x", "x"], ["y"])], [("x", [1, 1, 1, 100])], [("y", [1, 1, 1, 100])])
    shard.compile(save(model), "cpu", tmp_path / "a.shard",
                  CompileOptions(profile=str(tmp_path / "p.json"), dump_after={"legalize": str(tmp_path / "dump")}))
    dumped = onnx.load(tmp_path / "dump" / "after-legalize.onnx")
    assert [n.op_type for n in dumped.graph.node].count("Add") == 2


def test_reduced_axes_split_as_partial_sums_and_two_pass_softmax():
    rng = np.random.default_rng(5)
    x = rng.standard_normal((3, 100)).astype(np.float32)
    wide_k = make_model([helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")], [("x", [3, 100])], [("y", [3, 4])],
                        [const("w", rng.standard_normal((100, 4)))])
    graph, ctx = legalized(wide_k, 32)
    assert "partial products summed" in ctx.reports["legalize"]["changes"][0]["action"]
    assert [n.op for n in graph.nodes].count("MatMul") == 4 and all(int(t.shape[-1]) <= 32 for t in graph.inputs)
    np.testing.assert_allclose(run_legalized(graph, ctx, {"x": x})["y"], run_ort(wide_k, {"x": x})[0], rtol=1e-5, atol=1e-5)
    wide_softmax = make_model([helper.make_node("Softmax", ["x"], ["y"], axis=-1, name="sm")], [("x", [3, 100])],
                              [("y", [3, 100])])
    graph, ctx = legalized(wide_softmax, 32)
    assert "two-pass" in ctx.reports["legalize"]["changes"][0]["action"]
    assert {"ReduceMax", "ReduceSum", "Exp"} <= {n.op for n in graph.nodes} and "Softmax" not in {n.op for n in graph.nodes}
    np.testing.assert_allclose(run_legalized(graph, ctx, {"x": 30 * x})["y"], run_ort(wide_softmax, {"x": 30 * x})[0],
                               rtol=1e-5, atol=1e-7)


def test_profile_verdicts_read_each_family_in_its_own_terms():
    """concat-width's N is each input's width, not the output's; unknown settings are undecided."""
    profile = Profile("cpu", 1, "test", {"concat-width@h1": Limit(64, "overflow", "synthetic", "test"),
                                         "add-width@h1": Limit(64, "overflow", "synthetic", "test")})
    legality = Legality(profile)  # no builder: what the profile cannot decide is taken to fit
    concat = OpSpec("Concat", {"axis": -1}, [([1, 1, 1, 64], None)] * 2, [[1, 1, 1, 128]])
    assert legality.check(concat).ok
    assert not legality.check(OpSpec("Concat", {"axis": -1}, [([1, 1, 1, 65], None)] * 2, [[1, 1, 1, 130]])).ok
    assert not legality.check(OpSpec("Add", {}, [([1, 1, 1, 65], None)] * 2, [[1, 1, 1, 65]])).ok
    assert legality.check(OpSpec("Add", {}, [([1, 1, 7, 65], None)] * 2, [[1, 1, 7, 65]])).ok  # no h7 setting


class TwoAxes:
    """A stand-in limit no one split meets: the last two axes of every tensor (weights aside) at most
    `size` each."""

    def __init__(self, size: int):
        self.size = size

    def check(self, spec: OpSpec):
        from shard.passes.fit import Verdict

        for shape in [s for s, v in spec.inputs if v is None] + spec.outputs:
            if len(shape) >= 2 and max(shape[-2:]) > self.size:
                return Verdict(False, "overflow", f"{shape[-2:]} over {self.size}")
        return Verdict(True)


@pytest.mark.parametrize("op,shapes", [
    ("Add", {"x": [1, 1, 96, 80]}),
    ("MatMul", {"x": [1, 40, 96], "w": [96, 72]}),   # M, K and N too wide: M and N split, K summed
])
def test_an_op_over_a_limit_in_several_axes_is_split_along_each(op, shapes):
    rng = np.random.default_rng(0)
    names = list(shapes)
    out = [1, 1, 96, 80] if op == "Add" else [1, 40, 72]
    inputs = [(n, s) for n, s in shapes.items() if n == "x"]
    inits = [const(n, rng.standard_normal(s)) for n, s in shapes.items() if n != "x"]
    model = make_model([helper.make_node(op, [names[0], names[-1]] if op == "MatMul" else ["x", "x"], ["y"],
                                         name="op")], inputs, [("y", out)], inits)
    graph = infer_shapes(gs.import_onnx(model))
    ctx = PassContext(profile=EMPTY, legality=Legality(EMPTY, TwoAxes(32)))
    graph, report = legalize(graph, ctx)
    graph.cleanup().toposort()
    assert report["tried"] == [] and "each piece split again" in report["changes"][0]["action"]
    checker = TwoAxes(32)
    for node in graph.nodes:
        if node.op == op:
            assert checker.check(OpSpec.of(node)).ok, [list(t.shape) for t in node.outputs]
    x = rng.standard_normal(shapes["x"]).astype(np.float32)
    exported = gs.export_onnx(graph)
    exported.ir_version = 8
    np.testing.assert_allclose(run_ort(exported, {"x": x})[0], run_ort(model, {"x": x})[0], rtol=1e-5, atol=1e-5)


class FailsAtEverySize:
    """A stand-in for a one-op build that fails whatever the shape (rk3568's `Unkown op target: 0` on
    3-D elementwise ops built alone), counting the builds asked for."""

    def __init__(self):
        self.asked = 0

    def check(self, spec: OpSpec):
        from shard.passes.fit import Verdict

        self.asked += 1
        return Verdict(False, "error", "Unkown op target: 0")


@pytest.mark.parametrize("op,shape", [("Add", [1, 1024, 768]), ("Softmax", [1, 12, 64, 1024])])
def test_a_failure_no_split_can_fix_costs_two_checks_not_a_search(op, shape):
    model = make_model([helper.make_node(op, ["x", "x"] if op == "Add" else ["x"], ["y"], name="op")],
                       [("x", shape)], [("y", shape)])
    builds = FailsAtEverySize()
    ctx = PassContext(profile=EMPTY, legality=Legality(EMPTY, builds))
    graph, report = legalize(infer_shapes(gs.import_onnx(model)), ctx)
    assert builds.asked == 2 and report["changes"] == []
    assert "the smallest piece a split makes fails too" in report["tried"][0]["action"]
    assert [n.op for n in graph.nodes] == [op]


@pytest.mark.parametrize("bias", [True, False])
def test_a_patch_conv_after_in_graph_normalisation_reads_the_input_with_the_affine_folded(tmp_path, save, bias):
    # Models that normalise inside: (x - mean) / std, then the patch Conv. Exact: no padding.
    profile = Profile("cpu", 1, "test", {"conv-stride@cin16": Limit(7, "slow", "synthetic", "test")})
    profile.save(tmp_path / "p.json")
    inner = patch_embed_model()
    if not bias:
        del inner.graph.node[0].input[2]
    rng = np.random.default_rng(5)
    nodes = [helper.make_node("Sub", ["x", "mean"], ["centred"]), helper.make_node("Div", ["centred", "std"], ["xn"]),
             helper.make_node("Mul", ["xn", "two"], ["x2"]), *inner.graph.node]
    nodes[-1].input[0] = "x2"
    model = make_model(nodes, [("x", [1, 3, 32, 32])], [("y", [1, 8, 4, 4])],
                       [*inner.graph.initializer, const("mean", rng.uniform(0, 1, (1, 3, 1, 1))),
                        const("std", rng.uniform(0.2, 0.5, (3, 1, 1))), const("two", 2.0)])
    result = shard.compile(save(model), "cpu", tmp_path / "n.shard", CompileOptions(profile=str(tmp_path / "p.json")))
    change = result.report["passes"]["slow_paths"]["changes"][0]
    assert "normalisation folded" in change["action"]
    manifest = json.loads((result.bundle / "manifest.json").read_text())
    assert manifest["host_pre"][0]["input"] == "x"
    ops = [n.op_type for n in onnx.load(result.bundle / manifest["shards"][0]["onnx"]).graph.node]
    assert "Conv" not in ops and "Sub" not in ops and "Div" not in ops
    x = rng.standard_normal((1, 3, 32, 32)).astype(np.float32)
    with shard.load(result.bundle, backend="cpu") as session:
        np.testing.assert_allclose(session.run({"x": x})["y"], run_ort(model, {"x": x})[0], rtol=1e-4, atol=1e-4)


def test_a_normalisation_that_is_not_per_channel_is_not_folded(tmp_path, save):
    profile = Profile("cpu", 1, "test", {"conv-stride@cin16": Limit(7, "slow", "synthetic", "test")})
    profile.save(tmp_path / "p.json")
    inner = patch_embed_model()
    nodes = [helper.make_node("Sub", ["x", "bg"], ["xc"]), *inner.graph.node]
    nodes[-1].input[0] = "xc"
    model = make_model(nodes, [("x", [1, 3, 32, 32])], [("y", [1, 8, 4, 4])],
                       [*inner.graph.initializer, const("bg", np.ones((1, 3, 32, 32)))])
    result = shard.compile(save(model), "cpu", tmp_path / "m.shard", CompileOptions(profile=str(tmp_path / "p.json")))
    assert result.report["passes"]["slow_paths"]["changes"] == []


class LogsErrorLines:
    """A stand-in for the toolkit's builds: a one-op model wider than `width` returns 0 and logs `line`
    as an `E` line; narrower ones build clean."""

    def __init__(self, width: int, line: str):
        self.width, self.line = width, line

    def build(self, model):
        from shard.profile import Point
        from shard.targets.rknn.classify import error_alone

        wide = model.graph.output[0].type.tensor_type.shape.dim[-1].dim_value > self.width
        evidence = f"1 error lines, first: E RKNN: {self.line}"
        return Point(0, False, "error-alone" if error_alone(evidence) else "error", evidence) if wide else Point(0, True)


@pytest.mark.parametrize("line,split", [
    ("emitC1HWC2_CHW_16: surf_len overflow!", False),                 # RK2118, each 3-D elementwise op alone
    ("Unkown op target: 0", False),                                    # RK3568, the same
    ("channel is too large, may produce thousands of regtask, fallback to cpu!", True),
    ("emitUnpackRegtasks: equiv_channels(8196) > limitations(8192)", True)])
def test_e_lines_alone_split_an_op_only_where_they_name_a_register_overflow_or_a_cpu_fallback(line, split):
    """A one-op build whose only complaint is an `E` line that names neither a register overflow nor a
    CPU fallback (the toolkit's class error-alone) nominates no split: on RK2118 that split 330 ops of SigLIP-512, whose whole build logs
    10 such lines, and the toolkit then ran for more than 8 minutes."""
    from shard.passes.fit import OneOpBuilds

    model = make_model([helper.make_node("Add", ["x", "x"], ["y"], name="add")], [("x", [1, 16, 64])], [("y", [1, 16, 64])])
    ctx = PassContext(profile=EMPTY, legality=Legality(EMPTY, OneOpBuilds(LogsErrorLines(32, line))))
    graph, report = legalize(infer_shapes(gs.import_onnx(model)), ctx)
    assert bool(report["changes"]) == split
    if not split:
        assert [n.op for n in graph.nodes] == ["Add"] and "error-alone, not rewritten" in report["reported"][0]["reason"]


@st.composite
def gathers(draw):
    """A Gather of constant indices from an activation: data of rank 2-4, any axis but the last (the
    one the width limit is on: no split narrows the axis a Gather selects from), indices a scalar or
    a vector, a width limit under the last axis."""
    rank = draw(st.integers(2, 4))
    shape = [draw(st.integers(1, 6)) for _ in range(rank - 1)] + [draw(st.integers(8, 40))]
    axis = draw(st.integers(0, rank - 2)) - (rank if draw(st.booleans()) else 0)   # as ONNX allows, negative too
    count = shape[axis]
    indices = draw(st.one_of(st.integers(-count, count - 1).map(np.int64),
                             st.lists(st.integers(0, count - 1), min_size=1, max_size=3).map(np.array)))
    return shape, axis, np.asarray(indices, np.int64), draw(st.integers(4, 7))


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(gathers())
def test_a_gather_over_a_limit_is_split_along_its_datas_axes(case):
    """Gather(Sigmoid(x), constant indices) with the limit under the last axis: each piece gathers a
    slice of the data along an axis the indices do not make, the result is exact, and no op is over
    the limit (the Sigmoid is split too)."""
    shape, axis, indices, width = case
    out = shape[:axis % len(shape)] + list(indices.shape) + shape[axis % len(shape) + 1:]
    nodes = [helper.make_node("Sigmoid", ["x"], ["s"]), helper.make_node("Gather", ["s", "i"], ["y"], axis=axis)]
    model = make_model(nodes, [("x", shape)], [("y", out)], [numpy_helper.from_array(indices, "i")])
    graph, ctx = legalized(model, width)
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    want = run_ort(model, {"x": x})[0]
    assert np.array_equal(run_legalized(graph, ctx, {"x": x})["y"], want)
    limit = WidthLimit(width)
    assert all(limit.check(OpSpec.of(n)).ok for n in graph.nodes), [n.op for n in graph.nodes]
    assert any(ch["op"] == "Gather" and "along axis" in ch["action"] for ch in ctx.reports["legalize"]["changes"])


def test_a_lookup_in_a_constant_table_is_not_checked():
    """An embedding lookup (a constant table, variable indices) is the host's, not a one-op build's."""
    table = np.random.default_rng(0).standard_normal((500, 300)).astype(np.float32)
    model = small_model([helper.make_node("Gather", ["table", "ids"], ["y"], axis=0)], [("ids", [1, 8], "int64")],
                        [("y", [1, 8, 300])], [("table", table)])
    seen = []

    class Seen(WidthLimit):
        def check(self, spec):
            seen.append(spec.op)
            return super().check(spec)

    ctx = PassContext(profile=EMPTY, legality=Legality(EMPTY, Seen(64)))
    legalize(infer_shapes(gs.import_onnx(model)), ctx)
    assert seen == []


def rows_limit(passing: list[int], failure: str = "overflow", evidence: str = "15 REGTASK lines") -> Limit:
    return Limit(max(passing), failure, evidence, "test", failing=min(set(range(2, 33)) - set(passing)), passing=passing,
                 swept_to=32)


def test_the_rows_families_decide_a_gather_or_slice_of_a_sequence_by_their_passing_set():
    """gather-rows and slice-rows (shard.probes.families.rows): a row of [N,1,W] on axis 0 or [1,N,W]
    on axis 1, decided by the swept set; past the largest size swept, or another width, undecided."""
    passing = [*range(2, 17), *range(24, 33)]
    profile = Profile("cpu", 1, "test", {f"{op}-rows@axis{a}-w4096": rows_limit(passing)
                                         for op in ("gather", "slice") for a in (0, 1)})
    legality = Legality(profile)   # no builder: what the profile cannot decide is taken to fit
    index = np.array(0, np.int64)
    gather = lambda shape, axis: OpSpec("Gather", {"axis": axis}, [(shape, None), ([], index)], [[1, 4096]])  # noqa: E731
    assert not legality.check(gather([20, 1, 4096], 0)).ok and legality.check(gather([16, 1, 4096], 0)).ok
    assert not legality.check(gather([1, 20, 4096], 1)).ok and legality.check(gather([1, 24, 4096], 1)).ok
    assert legality.check(gather([40, 1, 4096], 0)).ok      # past the sweep: undecided
    assert legality.check(gather([20, 1, 2048], 0)).ok      # no w2048 setting: undecided
    assert legality.check(gather([20, 2, 4096], 0)).ok      # not one row per step: undecided
    one = lambda v: ([1], np.array([v], np.int64))  # noqa: E731
    slice_rows = OpSpec("Slice", {}, [([20, 1, 4096], None), one(0), one(1), one(0)], [[1, 1, 4096]])
    verdict = legality.check(slice_rows)
    assert not verdict.ok and verdict.reason.startswith("slice-rows@axis0-w4096: N=20 not in the passing set")


def test_a_limit_whose_evidence_is_an_e_line_alone_nominates_no_split():
    """RK3568's rows limits fail with `Unkown op target: 0` alone, which one-op builds report and do
    not rewrite (the class error-alone); a limit that fails so is read the same way."""
    profile = Profile("cpu", 1, "test", {"gather-rows@axis0-w4096": rows_limit(
        [2, 3], "error-alone", "1 error lines, first: E RKNN: Unkown op target: 0")})
    verdict = Legality(profile).check(OpSpec("Gather", {"axis": 0}, [([20, 1, 4096], None), ([], np.array(0))],
                                             [[1, 4096]]))
    assert verdict.ok and verdict.failure == "error-alone" and "not rewritten" in verdict.reason


def test_a_model_output_made_from_integer_inputs_alone_is_made_on_the_host():
    """A sentence encoder that gives back its input_ids and attention_mask (reshaped) kept those two
    Reshapes on the vendor's CPU; the host makes them, and the NPU graph keeps the embedding's linear."""
    rng = np.random.default_rng(0)
    nodes = [helper.make_node("Gather", ["table", "ids"], ["e"], axis=0), helper.make_node("MatMul", ["e", "w"], ["y"]),
             helper.make_node("Reshape", ["ids", "flat"], ["ids_out"]),
             helper.make_node("Reshape", ["mask", "flat"], ["mask_out"])]
    model = small_model(nodes, [("ids", [1, 16], "int64"), ("mask", [1, 16], "int64")],
                        [("y", [1, 16, 32]), ("ids_out", [16], "int64"), ("mask_out", [16], "int64")],
                        [("table", rng.standard_normal((100, 64)).astype(np.float32)),
                         ("w", rng.standard_normal((64, 32)).astype(np.float32)), ("flat", np.array([16], np.int64))])
    graph, ctx = legalized(model, 1 << 20)
    assert [n.op for n in graph.nodes] == ["MatMul"] and [t.name for t in graph.outputs] == ["y"]
    assert [(s["type"], s["outputs"]) for s in ctx.host_pre] == [("Gather", ["e"]), ("Reshape", ["ids_out"]),
                                                                 ("Reshape", ["mask_out"])]
    feeds = {"ids": rng.integers(0, 100, (1, 16)), "mask": np.ones((1, 16), np.int64)}
    got, want = run_legalized(graph, ctx, feeds), dict(zip(["y", "ids_out", "mask_out"], run_ort(model, feeds)))
    assert all(np.array_equal(got[name], want[name]) for name in ("ids_out", "mask_out"))
    assert np.allclose(got["y"], want["y"], rtol=1e-6, atol=1e-6)
    from shard.never_worse import prune_host_steps

    kept, _ = prune_host_steps(ctx.host_pre, ctx.host_post, consumed={"e"}, produced={"y"},
                               outputs={"y", "ids_out", "mask_out"})
    assert kept == ctx.host_pre   # kept for the outputs they make, which no shard makes
