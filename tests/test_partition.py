"""partition: cuts where one tensor crosses, balanced by work; shards run in order equal the model."""

import numpy as np
import onnx_graphsurgeon as gs
from conftest import add_model, make_model, mlp_chain, run_ort
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx import helper, numpy_helper

import shard
from shard.options import CompileOptions
from shard.passes import PassContext, run_pipeline
from shard.targets.registry import get_target
from shard.passes.partition import choose_cuts
from shard.graph import infer_shapes
from shard.profile import load_profile


def plan(model, **options):
    ctx = PassContext(profile=load_profile("rk3588"), options=CompileOptions(**options))
    run_pipeline(gs.import_onnx(model), ctx)
    return ctx


def test_cuts_between_blocks_and_balances_work():
    ctx = plan(mlp_chain(6), shards=3)
    shards = ctx.plan
    assert len(shards) == 3
    # Every cut carries exactly the residual stream, [1, 8, 16] float32.
    assert ctx.reports["partition"]["cut_bytes"] == [8 * 16 * 4] * 2
    assert [len(s.inputs) for s in shards] == [1, 1, 1]
    assert [s.outputs[0].name for s in shards] == ["r1", "r3", "y"]
    assert len({s.macs for s in shards}) == 1
    names = [n for s in shards for n in s.source_nodes]
    assert sorted(names) == sorted(n.name for n in mlp_chain(6).graph.node)


def test_max_ops_adds_shards():
    assert len(plan(mlp_chain(6), shards=1, max_ops=8).plan) == 3


def test_single_op_is_one_shard():
    assert len(plan(add_model([1, 4]), shards=3).plan) == 1


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(blocks=st.integers(1, 7), shards=st.integers(1, 5), width=st.sampled_from([4, 8, 16]))
def test_cpu_bundle_equals_model(tmp_path_factory, blocks, shards, width):
    model = mlp_chain(blocks, width)
    tmp = tmp_path_factory.mktemp("chain")
    import onnx

    onnx.save(model, str(tmp / "m.onnx"))
    result = shard.compile(tmp / "m.onnx", "cpu", tmp / "m.shard", CompileOptions(shards=shards))
    count = len(result.manifest.shards)
    assert 1 <= count <= shards
    if blocks >= shards:  # enough one-tensor cuts: every shard gets exactly one input
        assert count == shards and all(len(s.inputs) == 1 for s in result.manifest.shards)
    x = np.random.default_rng(blocks).standard_normal((1, 8, width)).astype(np.float32)
    with shard.load(tmp / "m.shard") as session:
        got = session.run({"x": x})["y"]
    np.testing.assert_array_equal(got, run_ort(model, {"x": x})[0])


def test_a_narrow_head_does_not_take_every_cut_from_the_backbone():
    # A detector: wide feature maps carry all the work, the head's small tensors cross cheaply.
    costs = [100] * 12 + [1] * 4
    live = [1000.0] * 12 + [10.0] * 3 + [0.0]
    cuts = choose_cuts(costs, live, 3)
    prefix = np.cumsum(costs)
    shares = np.diff([0, *[prefix[c] for c in cuts], prefix[-1]])
    assert len(cuts) == 2 and min(shares) >= prefix[-1] / 3 * 0.7, shares


def test_shards_predicted_over_the_job_limit_are_split():
    """One shard is one NPU job, which the driver kills after job_timeout_s: a profile whose limit is
    tiny makes partition cut more, each shard predicted under a quarter of the limit."""
    from dataclasses import replace

    from shard.passes.partition import JOB_MARGIN, npu_seconds_per_mac

    base = load_profile("rk3588")
    total = sum(n.macs for n in plan(mlp_chain(6), shards=1).plan) * npu_seconds_per_mac(base.facts)
    tight = replace(base, facts={**base.facts, "job_timeout_s": total / (3 * JOB_MARGIN)})
    ctx = PassContext(profile=tight, options=CompileOptions(shards=1))
    run_pipeline(gs.import_onnx(mlp_chain(6)), ctx)
    report = ctx.reports["partition"]
    assert len(ctx.plan) == 3 and report["requested"] == 3
    assert max(report["predicted_s"]) <= report["job_limit_s"] * (1 + 1e-9)
    assert not ctx.warnings


def test_a_large_model_is_cut_so_that_its_builds_one_at_a_time_take_half_of_the_whole_models():
    """A vendor build's memory grows with the weights it holds (shard.targets.rknn.memory): by default a
    large model is cut into the fewest shards whose builds, one at a time beside the compile, are
    predicted at half of one build of the whole model, not the more that two at once would need: each
    cut is a hand-off on the board every frame. A small one is not cut for memory (the toolkit's own
    memory is most of every build)."""
    from shard.passes.partition import partition
    from shard.targets.rknn.memory import (BUILD_BYTES_PER_WEIGHT_BYTE, COMPILE_BYTES, MIN_SHARD_WEIGHT_BYTES,
                                      WORKER_BYTES, build_bytes, shards_for_memory)

    def compile_bytes(weights, shards, jobs=2):
        return COMPILE_BYTES + jobs * (WORKER_BYTES + BUILD_BYTES_PER_WEIGHT_BYTE * weights / shards)

    assert shards_for_memory(345_733_832, 2) == 22 and shards_for_memory(345_733_832, 1) == 4   # SigLIP-512
    assert shards_for_memory(100e6, 2) == 0 and shards_for_memory(100e6, 1) == 0 and shards_for_memory(300e6, 1) > 0
    assert shards_for_memory(300e6, 2) == 0   # half would need shards of under MIN_SHARD_WEIGHT_BYTES
    for weights in (345e6, 419e6, 1e9, 4e9):
        for jobs in (1, 2):
            k = shards_for_memory(weights, jobs)
            assert compile_bytes(weights, k, jobs) <= build_bytes(weights) / 2 < compile_bytes(weights, k - 1, jobs)
            assert weights / k >= MIN_SHARD_WEIGHT_BYTES

    # Sixteen products, [T, 2560] x [2560, 2112] and back by [2112, 2560]: 346 MB of weights, for which
    # memory asks 22 shards with two builds at once and 4 with one. At T = 8, 692 M MACs: the 4, one at
    # a time. At T = 3, 260 M MACs: 2 at most (MIN_SHARD_MACS), one at a time. Builds that do not grow:
    # one shard, 2 builds at once.
    weights = [numpy_helper.from_array(np.zeros((2560, 2112) if k % 2 == 0 else (2112, 2560), np.float32), f"w{k}")
               for k in range(16)]
    nodes = [helper.make_node("MatMul", ["x" if k == 0 else f"h{k - 1}", f"w{k}"], ["y" if k == 15 else f"h{k}"])
             for k in range(16)]
    for rows, build_memory, expected, at_once in ((8, True, 4, 1), (3, True, 2, 1), (8, False, 1, 2)):
        model = make_model(nodes, [("x", [1, rows, 2560])], [("y", [1, rows, 2560])], weights)
        sizing = get_target("rk3588" if build_memory else "cpu").shards_for_memory   # builds that grow, or none
        ctx = PassContext(profile=load_profile("rk3588"), options=CompileOptions(), shards_for_memory=sizing)
        _, report = partition(infer_shapes(gs.import_onnx(model)), ctx)
        assert len(ctx.plan) == expected and report["weight_bytes"] == 16 * 2560 * 2112 * 4
        assert sum(report["shard_weight_bytes"]) == report["weight_bytes"]
        if build_memory:
            assert report["for_memory"] == 4
        assert report["by_memory"] == (expected == 4) and report["builds_at_once"] == at_once, rows
