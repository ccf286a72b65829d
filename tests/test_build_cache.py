"""Vendor builds kept by content (shard.targets.build_cache), with the real toolkit."""

import pytest
from conftest import make_model, mlp_chain
from onnx import helper, numpy_helper

import shard
from shard.options import CompileOptions
from shard.errors import CompileError
from shard.targets.build_cache import structure_key

pytestmark = pytest.mark.toolkit


def test_unchanged_shards_come_from_the_cache_and_changed_ones_build(save, tmp_path, monkeypatch):
    monkeypatch.setenv("SHARD_BUILD_CACHE", str(tmp_path / "cache"))
    # Without the fidelity check: the vendor alone's figures stand in only where its artifact is not needed.
    options = CompileOptions(shards=2, check_fidelity=False)
    first = shard.compile(save(mlp_chain(4)), "rk3588", tmp_path / "a.shard", options)
    assert first.report["builds"]["from_cache"] == 0
    # Each build's peak memory, measured in its worker: at least the toolkit's own imports (torch alone is 0.19 GB).
    assert all(0.2e9 < s["build_peak_bytes"] < 2e9 for s in first.report["shards"])
    again = shard.compile(save(mlp_chain(4), "same.onnx"), "rk3588", tmp_path / "b.shard", options)
    assert again.report["builds"] == {"total": first.report["builds"]["total"], "from_cache": first.report["builds"]["total"]}
    assert all(s["build_peak_bytes"] is None for s in again.report["shards"])   # nothing built
    for spec in first.manifest.shards:
        assert (tmp_path / "a.shard" / spec.artifact).read_bytes() == (tmp_path / "b.shard" / spec.artifact).read_bytes()
    # New weights in the last block: its shard builds again, the first shard does not, and the vendor
    # alone's figures are those of the model it was built from (the same graph, other weights).
    changed = mlp_chain(4)
    last = changed.graph.initializer[-1]
    last.CopyFrom(numpy_helper.from_array(-numpy_helper.to_array(last), last.name))
    third = shard.compile(save(changed, "changed.onnx"), "rk3588", tmp_path / "c.shard", options)
    cached = {s["name"]: s["cached"] for s in third.report["shards"]}
    assert cached == {"shard_000": True, "shard_001": False}
    assert third.report["builds"]["from_cache"] == third.report["builds"]["total"] - 1
    assert third.report["vendor_alone"]["figures_only"] and not (tmp_path / "c.shard" / "shards" / "vendor_alone.rknn").exists()
    assert shard.verify(third.bundle, tmp_path / "changed.onnx", backend="sim").passed
    # ... and they are the figures of its own build: the changed model built with nothing cached.
    monkeypatch.setenv("SHARD_BUILD_CACHE", str(tmp_path / "empty"))
    fresh = shard.compile(tmp_path / "changed.onnx", "rk3588", tmp_path / "d.shard", options)
    assert not fresh.report["vendor_alone"]["figures_only"]
    assert fresh.report["vendor_alone"]["diagnostics"] == third.report["vendor_alone"]["diagnostics"]
    assert fresh.report["versus_vendor"]["vendor"] == third.report["versus_vendor"]["vendor"]


def test_figures_of_the_same_structure_give_way_to_a_build_where_its_artifact_is_needed(save, tmp_path, monkeypatch):
    monkeypatch.setenv("SHARD_BUILD_CACHE", str(tmp_path / "cache"))
    options = CompileOptions(shards=3)   # three shards of two blocks cost more cycles than the whole
    first = shard.compile(save(mlp_chain(2, width=32), "a.onnx"), "rk3588", tmp_path / "a.shard", options)
    assert first.report["versus_vendor"]["bundle"] == "vendor alone"
    assert structure_key(mlp_chain(2, width=32)) == structure_key(mlp_chain(2, width=32, seed=1))
    other = shard.compile(save(mlp_chain(2, width=32, seed=1), "b.onnx"), "rk3588", tmp_path / "b.shard", options)
    assert other.report["versus_vendor"]["bundle"] == "vendor alone"   # so its build, not its figures
    assert not other.report["vendor_alone"]["figures_only"]
    # compared again once built, and still saying why the whole build was made
    assert other.report["versus_vendor"]["why"].startswith("the whole model's build predicted at")
    assert shard.verify(other.bundle, tmp_path / "b.onnx", backend="sim").passed


def test_a_cached_failure_names_this_compiles_shard_and_log(save, tmp_path, monkeypatch):
    monkeypatch.setenv("SHARD_BUILD_CACHE", str(tmp_path / "cache"))
    nodes = [helper.make_node("MatMul", ["q", "k"], ["s"]), helper.make_node("Softmax", ["s"], ["p"], axis=-1),
             helper.make_node("MatMul", ["p", "v"], ["y"])]
    path = save(make_model(nodes, [("q", [1, 2, 16, 8]), ("k", [1, 2, 8, 16]), ("v", [1, 2, 16, 8])],
                           [("y", [1, 2, 16, 8])]))
    messages = []
    for name in ("one", "two"):   # the vendor alone keeps its crash (shard's own builds turn the rule off)
        with pytest.raises(CompileError) as err:
            shard.compile(path, "rk3588", tmp_path / f"{name}.shard", CompileOptions(vendor_only=True))
        messages.append(str(err.value))
    assert all(m.startswith("vendor_alone: the vendor build crashed in build()") for m in messages)
    first_log, second_log = (m.rsplit("log: ", 1)[1] for m in messages)
    assert first_log != second_log and "Traceback" in open(second_log).read()
