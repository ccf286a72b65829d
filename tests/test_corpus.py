"""A fast subset of the real-model corpus (bench/corpus.py): models nobody on the team wrote, through
the real compiler and simulator, shard beside the vendor alone."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "bench"))
import corpus  # noqa: E402

pytestmark = pytest.mark.toolkit


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    models = corpus.corpus("ci", None, tmp_path_factory.mktemp("models"))
    assert len(models) >= 8 and len({family for _, family, _ in models}) >= 3
    return [corpus.evaluate(name, family, make()) for name, family, make in models]


def test_no_model_ends_in_a_traceback(rows):
    bugs = {r.name: (r.shard.traceback or r.vendor.traceback) for r in rows if r.shard.traceback or r.vendor.traceback}
    assert not bugs, bugs


def test_shard_is_never_worse_than_the_vendor_alone(rows):
    worse = {r.name: (corpus.describe(r.shard), corpus.describe(r.vendor), r.shard.figures.get("line"))
             for r in rows if r.verdict == "worse"}
    assert not worse, worse


def test_shard_is_clean_wherever_the_vendor_alone_is(rows):
    # Clean: builds, 0 REGTASK, 0 CPU ops in the rknn graphs, simulator cosine >= 0.9999. Ops the
    # vendor puts on the CPU in a model of nothing else (an Embedding alone; PixelShuffle) stay there.
    unclean = {r.name: r.shard.error or corpus.describe(r.shard) for r in rows if r.vendor.clean and not r.shard.clean}
    assert not unclean, unclean
    assert sum(r.shard.clean for r in rows) >= 10 and sum(r.shard.clean for r in rows) > sum(r.vendor.clean for r in rows)
    assert all(r.shard.cpu_ops <= r.vendor.cpu_ops for r in rows if r.shard.builds and r.vendor.builds)


def test_the_detection_head_keeps_the_vendors_whole_graph(rows):
    # Split by one-op verdicts (`E` lines alone) it had CPU joins; now those nominate no split, and
    # what is left (its last linear as a transposed product) the real build keeps or undoes.
    head = next(r for r in rows if r.name == "head40")
    assert head.shard.cpu_ops == 0 and head.shard.figures["verdict"] in ("equal", "better")


def test_ops_the_vendor_puts_on_the_cpu_run_on_the_npu(rows):
    # Selu on a 3-D tensor (Elu and Mul, its edges relaid in the vendor's 4-D layout) and Tile (Concats).
    for name in ("test_SELU", "test_operator_repeat"):
        row = next(r for r in rows if r.name == name)
        assert row.vendor.cpu_ops >= 1 and row.shard.clean and row.verdict == "better", (name, row.shard.figures.get("line"))


def test_a_vendor_crash_in_a_named_rule_is_built_again_without_it(rows):
    # The toolkit's rule raises and its build() crashes; its log names the rule to disable. The
    # vendor alone stops there; shard builds the shard again with that rule off and ships it so.
    for name, rule in (("fused_qkv", "seperate_exmatmul_rs_split"), ("two_heads", "fuse_conv_conv_add")):
        row = next(r for r in rows if r.name == name)
        assert not row.vendor.builds and row.shard.clean and row.verdict == "better", (name, row.shard.error)
        assert row.shard.rules == [rule], (name, row.shard.rules)


def test_control_flow_the_vendor_cannot_build_compiles_clean(rows):
    # a model inside an If, with the input it chooses by fixed; a denoising Loop of 8 steps, unrolled
    for name in ("rate_switch", "euler_loop"):
        row = next(r for r in rows if r.name == name)
        assert not row.vendor.builds and row.shard.clean and row.verdict == "better", (name, row.shard.error)


def test_a_gather_at_host_computed_indices_a_float_mask_a_value_pad_a_detection_head_and_repeat_kv_leave_the_cpu(rows):
    # ArgMax of the ids on the host, the row picked by a one-hot product on the NPU; a mask's Greater
    # and Cast on the host; a pad of ones as a pad of zeros plus a constant; the head's edges relaid;
    # one key/value head's 5-D Expand as a Concat of its copies.
    for name in ("eos_pool", "float_mask", "value_pad", "yolo_head", "qwen2-mqa"):
        row = next(r for r in rows if r.name == name)
        assert row.vendor.cpu_ops >= 1 and row.shard.clean and row.verdict == "better", (name, row.shard.figures.get("line"))
