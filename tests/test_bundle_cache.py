"""Whole bundles kept by content (shard.bundle_cache): an unchanged compile comes back from the cache,
any change to what the compile reads misses it."""

import json

import numpy as np
import onnx
from conftest import mlp_chain
from onnx import numpy_helper

import shard
from shard import bundle_cache
from shard.options import CompileOptions


def files(bundle):
    """Every file of a bundle with its bytes, the report (which says where it came from) aside."""
    return {p.relative_to(bundle): p.read_bytes() for p in sorted(bundle.rglob("*"))
            if p.is_file() and p.name != "report.json"}


def compile_cpu(model, out, **options):
    return shard.compile(model, "cpu", out, CompileOptions(shards=2, **options))


def test_an_unchanged_compile_comes_back_from_the_cache(save, tmp_path, monkeypatch):
    monkeypatch.setenv("SHARD_BUILD_CACHE", str(tmp_path / "cache"))
    model = save(mlp_chain(4))
    first = compile_cpu(model, tmp_path / "a.shard")
    assert "from_bundle_cache" not in first.report
    again = compile_cpu(model, tmp_path / "b.shard")
    hit = again.report["from_bundle_cache"]
    assert hit["compiled_in"] > 0 and hit["seconds"] >= 0
    assert files(tmp_path / "a.shard") == files(tmp_path / "b.shard")
    assert again.manifest == first.manifest
    assert shard.verify(again.bundle, model, backend="cpu").passed
    # A damaged entry is dropped and the model compiled again.
    entry, = (tmp_path / "cache").glob("bundle-*")
    (entry / "bundle" / "manifest.json").unlink()
    mended = compile_cpu(model, tmp_path / "m.shard")
    assert "from_bundle_cache" not in mended.report and files(mended.bundle) == files(tmp_path / "a.shard")
    assert "from_bundle_cache" in compile_cpu(model, tmp_path / "n.shard").report
    # The restored report is a copy: rewriting it leaves the stored one as it was.
    (again.bundle / "report.json").write_text("{}")
    third = compile_cpu(model, tmp_path / "c.shard")
    assert third.report["shards"] == first.report["shards"] and "from_bundle_cache" in third.report


def test_a_change_to_what_the_compile_reads_misses(save, tmp_path, monkeypatch):
    monkeypatch.setenv("SHARD_BUILD_CACHE", str(tmp_path / "cache"))
    model = save(mlp_chain(4))
    compile_cpu(model, tmp_path / "a.shard")
    assert "from_bundle_cache" not in compile_cpu(model, tmp_path / "b.shard", max_ops=6).report   # an option
    changed = mlp_chain(4)
    w = changed.graph.initializer[0]
    w.CopyFrom(numpy_helper.from_array(-numpy_helper.to_array(w), w.name))
    assert "from_bundle_cache" not in compile_cpu(save(changed), tmp_path / "c.shard").report        # the weights
    assert "from_bundle_cache" not in compile_cpu(save(mlp_chain(4), "other.onnx"), tmp_path / "d.shard").report  # the name
    assert "from_bundle_cache" not in compile_cpu(model, tmp_path / "e.shard", build_cache=False).report  # --no-cache
    monkeypatch.setattr(bundle_cache, "code_digest", lambda: "another version of shard")
    assert "from_bundle_cache" not in compile_cpu(model, tmp_path / "f.shard").report                # the code


def test_external_data_is_part_of_the_key(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARD_BUILD_CACHE", str(tmp_path / "cache"))
    model = tmp_path / "ext.onnx"
    proto = mlp_chain(2)
    for w in proto.graph.initializer:   # as raw bytes, which external data holds
        w.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(w), w.name))
    onnx.save(proto, str(model), save_as_external_data=True, location="ext.onnx.data", size_threshold=0)
    first = compile_cpu(model, tmp_path / "a.shard")
    assert "from_bundle_cache" in compile_cpu(model, tmp_path / "b.shard").report
    data = tmp_path / "ext.onnx.data"
    weights = np.frombuffer(data.read_bytes(), np.float32).copy()
    data.write_bytes((weights * 2).tobytes())   # the same .onnx file, other weights
    again = compile_cpu(model, tmp_path / "c.shard")
    assert "from_bundle_cache" not in again.report and first.report["shards"][0]["macs"] == again.report["shards"][0]["macs"]


def test_a_bucketed_bundle_comes_back_whole(save, tmp_path, monkeypatch):
    monkeypatch.setenv("SHARD_BUILD_CACHE", str(tmp_path / "cache"))
    from shard.runtime.buckets import read_buckets

    chain = mlp_chain(2)
    for value in (chain.graph.input[0], chain.graph.output[0]):   # the tokens' axis dynamic, as buckets need
        value.type.tensor_type.shape.dim[1].dim_param = "seq"
    model = save(chain)
    buckets = [{"x": (1, 4, 16)}, {"x": (1, 8, 16)}]
    first = compile_cpu(model, tmp_path / "a.shard", buckets=buckets)
    again = compile_cpu(model, tmp_path / "b.shard", buckets=buckets)
    assert set(again.report["buckets"]) == {b.name for b in read_buckets(again.bundle).buckets}
    assert all("from_bundle_cache" in r for r in again.report["buckets"].values())
    assert files(first.bundle) == files(again.bundle)
    assert json.loads((again.bundle / "b0" / "report.json").read_text())["from_bundle_cache"]
