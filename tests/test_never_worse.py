"""shard.never_worse on small graphs: the unrewritten twins, the host steps they keep, the verdicts."""

from functools import partial

import numpy as np
import onnx_graphsurgeon as gs
from conftest import make_model, mlp_chain, run_ort
from onnx import helper, numpy_helper

from shard.options import CompileOptions
from shard.graph import infer_shapes
from shard.never_worse import AXES, Figures, fidelity_worse, original_plans, per_axis, prune_host_steps, verdict
from shard.passes import PassContext, run_pipeline
from shard.passes.fit import Legality, WidthLimit
from shard.profile import Profile

EMPTY = Profile("cpu", 1, "none")


def run_plans(plans, feeds: dict) -> dict:
    """Run shard plans one after another in onnxruntime, each on the tensors the ones before made."""
    values = dict(feeds)
    for plan in plans:
        graph = gs.Graph(nodes=plan.nodes, inputs=plan.inputs, outputs=plan.outputs, opset=17)
        model = gs.export_onnx(graph, do_type_check=False)
        model.ir_version = 8
        names = [t.name for t in plan.outputs]
        values.update(zip(names, run_ort(model, {t.name: values[t.name] for t in plan.inputs})))
    return values


def test_twins_are_the_canonical_regions_between_the_same_cuts_and_compute_the_model():
    model = mlp_chain(4, width=16)
    ctx = PassContext(profile=EMPTY, options=CompileOptions(shards=2),
                      legality=Legality(EMPTY, WidthLimit(8)))
    graph = run_pipeline(infer_shapes(gs.import_onnx(model)), ctx, disable=("slow_paths", "tile_attention"),
                         snapshot=("canonicalize",))
    canonical, plans = ctx.snapshots["canonicalize"], ctx.plan
    assert ctx.reports["legalize"]["changes"] and len(plans) == 2
    twins = original_plans(canonical, plans, ctx.host_post)
    assert all(twin is not None for twin in twins)  # every shard was rewritten, and has its own twin
    # Together the twins are the canonical graph, each node once, cut where the rewritten shards are.
    names = [n for twin in twins for n in twin.source_nodes]
    assert sorted(names) == sorted(n.name for n in canonical.nodes)
    assert [t.name for t in twins[0].outputs] == [t.name for t in plans[0].outputs if t.name in canonical.tensors()]
    x = np.random.default_rng(0).standard_normal((1, 8, 16)).astype(np.float32)
    want = run_ort(model, {"x": x})[0]
    np.testing.assert_allclose(run_plans(twins, {"x": x})["y"], want, rtol=1e-5, atol=1e-5)
    # Each twin stands in for its rewritten shard: mix them and the model still comes out.
    tensors = {"x": x}
    from shard.runtime.host import run_host

    run_host(ctx.host_pre, tensors)
    mixed = run_plans([twins[0], plans[1]], tensors)
    run_host(ctx.host_post, mixed)
    np.testing.assert_allclose(mixed["y"], want, rtol=1e-5, atol=1e-5)


def test_host_steps_no_kept_shard_needs_are_dropped():
    pre = [{"op": "slice", "input": "x", "output": "x0", "axis": 3, "start": 0, "end": 4},
           {"op": "slice", "input": "x", "output": "x1", "axis": 3, "start": 4, "end": 8}]
    post = [{"op": "concat", "inputs": ["y0", "y1"], "output": "y", "axis": 3}]
    # The rewritten shard is kept: it reads the pieces and makes them.
    assert prune_host_steps(pre, post, {"x0", "x1"}, {"y0", "y1"}, {"y"}) == (pre, post)
    # Its twin is kept: it reads x and makes y itself.
    assert prune_host_steps(pre, post, {"x"}, {"y"}, {"y"}) == ([], [])


def test_verdicts_go_by_the_axes_in_order():
    clean = Figures(builds=True, cost_cycles=100)
    assert verdict(Figures(builds=True, cpu_ops=1), Figures(builds=True, cost_cycles=10**9)) == "worse"
    assert verdict(Figures(builds=False), Figures(builds=True, cpu_ops=9)) == "worse"
    assert verdict(clean, Figures(builds=True, cost_cycles=200)) == "better"
    axes = per_axis(Figures(builds=True, cpu_ops=0, cost_cycles=300), Figures(builds=True, cpu_ops=2, cost_cycles=100))
    assert axes["cpu_ops"] == "better" and axes["cost_cycles"] == "worse" and axes["builds"] == "equal"
    assert fidelity_worse(float("nan"), 1.0) and fidelity_worse(0.9993, 0.99985)
    assert not fidelity_worse(0.99995, 1.0) and not fidelity_worse(1.0, 0.5)
    assert not fidelity_worse(float("nan"), float("nan")) and fidelity_worse(float("nan"), 0.2)
    assert not fidelity_worse(0.2, float("nan"))


def test_the_verdict_words_count_fidelity_first_and_a_nan_equals_nothing():
    from shard.never_worse import comparison_line, fidelity_verdict

    nan = float("nan")
    assert fidelity_verdict(1.0, nan) == "better" and fidelity_verdict(nan, 0.2) == "worse"
    assert fidelity_verdict(nan, nan) == "both NaN" and fidelity_verdict(0.99995, 1.0) == "equal"
    ours, theirs = Figures(builds=True, cpu_ops=0, cost_cycles=300), Figures(builds=True, cpu_ops=2, cost_cycles=100)
    line = comparison_line(ours, theirs, fidelity=(1.0, nan))
    assert ": better (better on the simulator's cosine, better on CPU ops, worse on est. Mcycles)" in line
    assert "simulator cosine 1.0000000 / nan" in line
    assert ": worse (worse on the simulator's cosine, better on CPU ops" in comparison_line(ours, theirs, fidelity=(0.5, 1.0))
    assert "no better: both NaN on the simulator" in comparison_line(ours, theirs, fidelity=(nan, nan))
    # Beside a build that failed (the vendor's SIGFPE), only that is named: its other figures are of no build.
    beside_none = comparison_line(Figures(builds=True, cpu_ops=1, error_lines=2), Figures(builds=False))
    assert beside_none.endswith(": better (better on builds)")


def test_a_comparison_names_the_axes_in_the_targets_words_where_it_has_them():
    from shard.never_worse import comparison_line, labels_in

    ours, theirs = Figures(builds=True, overflow_lines=0, fallbacks=1), Figures(builds=True, overflow_lines=3)
    line = comparison_line(ours, theirs, labels=labels_in({"overflow_lines": "REGTASK lines", "fallback": "one core"}))
    assert "REGTASK lines 0 / 3" in line and "fallbacks 1 / 0" in line and "better on REGTASK lines" in line
    assert "overflow lines 0 / 3" in comparison_line(ours, theirs)   # the common words where none are given


def test_an_output_overflowed_only_where_the_reference_is_finite():
    from shard.compare import compare

    ref = np.ones((2, 3), np.float32)
    assert compare("y", ref, np.full((2, 3), np.inf, np.float32)).overflowed
    assert not compare("y", ref, ref).overflowed
    assert not compare("y", np.full((2, 3), np.nan, np.float32), np.full((2, 3), np.nan, np.float32)).overflowed


def test_the_worst_comparison_is_the_lowest_cosine_and_a_nan_before_any():
    from shard.compare import Comparison, worst_of

    seen = [Comparison("a", 0.9, 0.1), Comparison("b", 0.5, 0.3), Comparison("c", 0.99, 0.0)]
    assert worst_of(seen).name == "b" and worst_of(reversed(seen)).name == "b"
    assert worst_of([*seen, Comparison("d", float("nan"), float("inf"))]).name == "d"
    assert worst_of([Comparison("d", float("nan"), float("inf")), *seen]).name == "d"


def test_the_vendor_alone_is_built_whole_where_it_fits_and_does_not_double_the_compile():
    from shard.never_worse import weight_bytes, whole_build_fits
    from shard.targets.registry import get_target

    rk = get_target("rk3588")
    predicted_build_bytes = lambda model: rk.build_bytes(weight_bytes(model))  # noqa: E731

    model = mlp_chain(2, width=64)   # 2 x 2 x 64 x 128 float weights: 131 kB
    need = predicted_build_bytes(model)
    assert need == int(0.34e9 + 6.1 * 4 * 2 * 2 * 64 * 128)
    assert whole_build_fits(model, "auto", rk, available=2 * need, jobs=2, cores=3)[0]
    fits, why = whole_build_fits(model, "auto", rk, available=2 * need - 1, jobs=2, cores=3)
    assert not fits and "more than half of the 0.7 GB available" in why
    assert whole_build_fits(model, "auto", rk, available=2 * need, jobs=2, cores=2)[0]   # small: seconds to build
    # 419 MB of weights, every core building shards: the whole build would add its time to the compile's.
    weight = numpy_helper.from_array(np.zeros((10240, 10240), np.float32), "w")
    large = make_model([helper.make_node("MatMul", ["x", "w"], ["y"])], [("x", [1, 10240])], [("y", [1, 10240])], [weight])
    room = 2 * predicted_build_bytes(large)
    fits, why = whole_build_fits(large, "auto", rk, available=room, jobs=2, cores=2)
    assert not fits and why.startswith("2 cores for --jobs 2, a large model's shard builds: the whole build of 419 MB")
    assert whole_build_fits(large, "auto", rk, available=room, jobs=1, cores=2)[0]
    assert whole_build_fits(large, "auto", rk, available=room, jobs=2, cores=2, quantized=True)[0]   # fidelity needs it
    assert whole_build_fits(model, "whole", rk, available=0, cores=1) == (True, "--vendor-alone whole")
    assert whole_build_fits(model, "shards", rk, available=10**12, cores=64) == (False, "--vendor-alone shards")


def test_shards_joined_by_an_edge_held_scaled_keep_the_same_version():
    # SmolLM2-135M's prefill step as transformers exports it holds its residual divided by 2 from layer
    # 11 (scale_sandwich's range rescale). Chosen shard by shard, the unrewritten shard before the final
    # norm handed the residual at full scale to the rewritten norm: cosine 0.620 on the simulator.
    from shard.compilation.choice import bound_groups, choose_versions
    from shard.compilation.names import UNREWRITTEN
    from shard.passes.partition import ShardPlan
    from shard.targets import ShardBuild

    x, h, r, y = (gs.Variable(name, np.float32, [1, 4]) for name in ("x", "h", "r", "y"))
    plans = [ShardPlan("a", [], [x], [h], 0), ShardPlan("b", [], [h], [r], 0), ShardPlan("c", [], [r], [y], 0)]
    cpu_ops = {"a": 0, f"a{UNREWRITTEN}": 0, "b": 4, f"b{UNREWRITTEN}": 0, "c": 0, f"c{UNREWRITTEN}": 1}
    builds = {name: ShardBuild(name, 0.0, {"cpu_ops": ["op"] * n}) for name, n in cpu_ops.items()}
    assert bound_groups(plans, {"r"}) == [[0], [1, 2]]
    # Alone, b goes back to its twin (4 CPU ops against 0) and c keeps its rewrite (0 against 1).
    chosen, _ = choose_versions(plans, plans, builds)
    assert [name for name, _ in chosen] == ["a", f"b{UNREWRITTEN}", "c"]
    # Joined by r, held scaled, they go together: 4 CPU ops against 1, both back to their twins.
    chosen, choices = choose_versions(plans, plans, builds, scaled={"r"})
    assert [name for name, _ in chosen] == ["a", f"b{UNREWRITTEN}", f"c{UNREWRITTEN}"]
    assert "judged with c" in choices[1]["what"] and choices[2]["unrewritten"]["cpu_ops"] == 1
    # A shard without a twin keeps its group rewritten.
    chosen, _ = choose_versions(plans, [plans[0], plans[1], None], builds, scaled={"r"})
    assert [name for name, _ in chosen] == ["a", "b", "c"]


def test_a_cut_pays_its_hand_offs_beside_the_vendors_one_graph():
    # Each graph run on the board has its inputs set and outputs got on the host; two shards of the
    # same cycles as the vendor's one graph hand their [1, 1024, 768] edge off twice more, and are worse.
    from shard.compilation.choice import against_vendor_alone
    from shard.compilation.names import VENDOR_ALONE
    from shard.never_worse import handoff_cycles
    from shard.passes.partition import ShardPlan
    from shard.targets import ShardBuild
    from shard.targets.chips import RK3588_HANDOFF

    x, h, y = (gs.Variable(name, np.float32, [1, 1024, 768]) for name in ("x", "h", "y"))
    plans = [ShardPlan("a", [], [x], [h], 0), ShardPlan("b", [], [h], [y], 0)]
    whole = gs.Graph(nodes=[], inputs=[x], outputs=[y])
    board = partial(handoff_cycles, handoff=RK3588_HANDOFF, clock_hz=1e9)
    one = RK3588_HANDOFF.between([x], [y])
    assert board(plans) == round(2 * one * 1e9) and board(plans) > 2 * 9.5e6   # 12.1 ns an element set
    assert handoff_cycles(plans, None, 1e9) == 0 and handoff_cycles(plans, RK3588_HANDOFF, None) == 0
    builds = {name: ShardBuild(name, 0.0, {"cost_cycles": 50_000_000 if name == VENDOR_ALONE else 24_000_000})
              for name in ("a", "b", VENDOR_ALONE)}
    chosen = [(p.name, p) for p in plans]
    kept, versus = against_vendor_alone(chosen, builds, AXES, False, whole)
    assert kept == chosen and versus["verdict"] == "better"            # cycles alone: 48 M against 50 M
    kept, versus = against_vendor_alone(chosen, builds, AXES, False, whole, board)
    assert [name for name, _ in kept] == [VENDOR_ALONE] and versus["bundle"] == "vendor alone"
    assert versus["rewritten"]["handoff_cycles"] == board(plans) and versus["vendor"]["handoff_cycles"] == board([
        ShardPlan(VENDOR_ALONE, [], [x], [y], 0)])
    assert "hand-offs)" in versus["line"]
