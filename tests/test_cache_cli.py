"""The caches without the toolkit: `shard cache info` and `shard cache clear` on caches made for the
test, eviction, and the build cache's structure keys."""

import numpy as np
import pytest
from conftest import mlp_chain, shard_cli
from onnx import numpy_helper


def shard_caches(tmp_path):
    """A build cache with two builds and a bundle, a probe cache with one point, as shard writes them."""
    from shard.cache_folder import TAG_TEXT, mark_entry

    builds, probes = tmp_path / "builds", tmp_path / "probes"
    for key in ("a1", "b2"):
        (builds / key).mkdir(parents=True)
        (builds / key / "build.json").write_text("{}")
        (builds / key / "artifact").write_bytes(b"\0" * 500_000)
        mark_entry(builds / key)
    (builds / "bundle-c3").mkdir()
    (builds / "bundle-c3" / "bundle.json").write_text("{}")
    mark_entry(builds / "bundle-c3")
    (probes / "rknn-toolkit2-2.5.0" / "rk3588" / "add-width@h1").mkdir(parents=True)
    (probes / "rknn-toolkit2-2.5.0" / "rk3588" / "add-width@h1" / "v1-64.json").write_text("{}")
    for folder in (builds, probes):
        (folder / "CACHEDIR.TAG").write_text(TAG_TEXT)
    return builds, probes


def test_cache_info_and_clear(tmp_path):
    builds, probes = shard_caches(tmp_path)
    env = {"SHARD_BUILD_CACHE": str(builds), "SHARD_PROBE_CACHE": str(probes), "COLUMNS": "200"}
    info = shard_cli("cache", "info", env_extra=env)
    assert info.returncode == 0, info.stderr
    rows = {line.split("│")[1].strip(): line for line in info.stdout.splitlines() if line.count("│") > 3}
    assert "│       2 │ 1.0 │" in rows["builds"] and "│       1 │ 0.0 │" in rows["probes"], info.stdout
    assert "builds: at most 10 GiB" in info.stdout and "it holds 1 whole bundles" in info.stdout
    cleared = shard_cli("cache", "clear", "--no-probes", env_extra=env)
    assert cleared.returncode == 0 and "builds: removed 3 entries, 1.0 MB" in cleared.stdout, cleared.stdout
    assert not builds.exists() and probes.exists()
    cleared = shard_cli("cache", "clear", env_extra=env)
    assert cleared.returncode == 0 and "probes: removed 1 entries" in cleared.stdout and not probes.exists()


def test_clear_removes_only_shards_entries_and_refuses_a_folder_that_is_not_a_cache(tmp_path):
    # $SHARD_BUILD_CACHE pointed at a folder of the user's: clear deleted all of it, then said "removed 0 entries".
    mine = tmp_path / "mine"
    (mine / "photos").mkdir(parents=True)
    (mine / "photos" / "a.jpg").write_bytes(b"jpeg")
    (mine / "notes.txt").write_text("keep me")
    res = shard_cli("cache", "clear", env_extra={"SHARD_BUILD_CACHE": str(mine), "SHARD_PROBE_CACHE": str(mine)})
    assert res.returncode == 1 and "Traceback" not in res.stderr
    assert "is not a shard cache" in res.stderr and "SHARD_BUILD_CACHE" in res.stderr
    assert (mine / "photos" / "a.jpg").read_bytes() == b"jpeg" and (mine / "notes.txt").read_text() == "keep me"
    builds, probes = shard_caches(tmp_path)   # a shard cache with a user's file put in it
    (builds / "mine").mkdir()
    (builds / "mine" / "keep.txt").write_text("keep")
    (probes / "notes.json").write_text("{}")
    res = shard_cli("cache", "clear", env_extra={"SHARD_BUILD_CACHE": str(builds), "SHARD_PROBE_CACHE": str(probes)})
    assert res.returncode == 0 and "builds: removed 3 entries" in res.stdout and "probes: removed 1 entries" in res.stdout
    assert sorted(p.name for p in builds.iterdir()) == ["CACHEDIR.TAG", "mine"] and (builds / "mine" / "keep.txt").exists()
    assert sorted(p.name for p in probes.iterdir()) == ["CACHEDIR.TAG", "notes.json"]


def test_eviction_removes_only_shards_entries(tmp_path, monkeypatch):
    # A cache folder past its cap evicted every non-hidden folder in it, other programs' caches included.
    from shard.targets import ShardBuild, ShardJob
    from shard.targets.build_cache import BuildCache

    from shard.cache_folder import TAG_TEXT

    monkeypatch.setenv("SHARD_BUILD_CACHE_SIZE", "1.5M")
    (tmp_path / "cache" / "other-program").mkdir(parents=True)   # put in shard's cache folder by someone
    (tmp_path / "cache" / "CACHEDIR.TAG").write_text(TAG_TEXT)
    (tmp_path / "cache" / "other-program" / "data").write_bytes(b"\0" * 2**21)
    cache = BuildCache(tmp_path / "cache", "rk3588", "toolkit")
    for k in range(2):
        job = ShardJob(f"s{k}", tmp_path / f"s{k}.onnx", tmp_path / f"s{k}.rknn", tmp_path / f"s{k}.log")
        job.log.write_text("log")
        job.artifact.write_bytes(b"\0" * 2**20)
        cache.put(job, f"k{k}", ShardBuild(job.name, 1.0))
    cache.used = set()
    assert cache.prune()[0] == 1   # the two entries hold 2 MiB: one goes, the other program's data stays
    assert (tmp_path / "cache" / "other-program" / "data").stat().st_size == 2**21


@pytest.mark.parametrize("variable", ["SHARD_BUILD_CACHE", "SHARD_PROBE_CACHE"])
def test_a_cache_variable_naming_a_folder_of_the_users_is_refused_and_never_tagged(tmp_path, monkeypatch, variable):
    # SHARD_BUILD_CACHE=$HOME got a CACHEDIR.TAG written into it: backup tools then skip the whole folder.
    from shard.cache_folder import TAG, mark_folder
    from shard.errors import ShardError

    home = tmp_path / "home"
    (home / "Documents").mkdir(parents=True)
    monkeypatch.setenv(variable, str(home))
    with pytest.raises(ShardError, match=f"\\${variable} names .*holds files that are not shard's cache"):
        mark_folder(home, variable)
    assert not (home / TAG).exists()
    mark_folder(tmp_path / "new", variable)   # an empty or new folder is taken, and tagged
    assert (tmp_path / "new" / TAG).is_file()
    (tmp_path / "file").write_text("x")
    with pytest.raises(ShardError, match="which is not a folder"):
        mark_folder(tmp_path / "file", variable)


def test_a_compile_with_the_cache_at_a_users_folder_stops_in_one_line_before_any_work(save, tmp_path):
    home = tmp_path / "home"
    (home / "Documents").mkdir(parents=True)
    res = shard_cli("compile", save(mlp_chain(1)), "--target", "cpu", "-o", tmp_path / "m.shard",
                    env_extra={"SHARD_BUILD_CACHE": str(home)})
    assert res.returncode == 1 and "Traceback" not in res.stderr, res.stderr
    assert "holds files that are not shard's cache" in res.stderr and not (home / "CACHEDIR.TAG").exists()
    assert not (tmp_path / "m.shard").exists()


def test_build_cache_evicts_the_least_recently_used_down_to_its_cap(tmp_path, monkeypatch):
    import os

    import pytest

    from shard.errors import CompileError
    from shard.targets import ShardBuild, ShardJob
    from shard.targets.build_cache import BuildCache

    monkeypatch.setenv("SHARD_BUILD_CACHE_SIZE", "3.5M")
    cache = BuildCache(tmp_path / "cache", "rk3588", "toolkit")
    assert cache.limit == int(3.5 * 2**20)
    for k in range(4):   # four entries of 1 MiB, the first written longest ago
        job = ShardJob(f"s{k}", tmp_path / f"s{k}.onnx", tmp_path / f"s{k}.rknn", tmp_path / f"s{k}.log")
        job.log.write_text("log")
        job.artifact.write_bytes(b"\0" * 2**20)
        cache.put(job, f"k{k}", ShardBuild(job.name, 1.0))
        os.utime(cache.root / f"k{k}" / "build.json", (1000 + k, 1000 + k))
    cache.used = {"k0"}   # a compile that used the oldest entry, and a hit that makes k1 the newest
    job = ShardJob("s1", tmp_path / "s1.onnx", tmp_path / "x.rknn", tmp_path / "x.log")
    assert cache.get(job, "k1").cached and job.artifact.read_bytes() == b"\0" * 2**20
    assert cache.prune() == (1, 2**20 + len("log") + len((cache.root / "k0" / "build.json").read_text()))
    assert sorted(p.name for p in cache.root.iterdir()) == ["CACHEDIR.TAG", "k0", "k1", "k3"]   # k2: the least recently used
    monkeypatch.setenv("SHARD_BUILD_CACHE_SIZE", "lots")
    with pytest.raises(CompileError, match="SHARD_BUILD_CACHE_SIZE='LOTS': expected bytes"):
        BuildCache(tmp_path / "cache", "rk3588", "toolkit")


def test_a_models_structure_is_its_graph_with_weights_by_shape_and_kind():
    from shard.targets.build_cache import structure_key

    def variant(edit=None, blocks=2):
        model = mlp_chain(blocks, width=32)
        if edit:
            edit({t.name: t for t in model.graph.initializer})
        return structure_key(model)

    def scaled(name, factor):
        def edit(weights):
            w = weights[name]
            w.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(w) * np.float32(factor), name))
        return edit

    base = variant()
    assert variant(scaled("w2_1", 1.01)) == base            # other values: the same structure
    assert variant(scaled("w2_1", 0.0)) != base             # all zeros, which a compiler may fold away
    assert variant(scaled("w2_1", 1e6)) != base             # past fp16's range
    assert variant(blocks=3) != base
    small = mlp_chain(2, width=2)                            # 2 x 4 weights are constants, by value
    before = structure_key(small)
    w = small.graph.initializer[0]
    w.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(w) * np.float32(1.01), w.name))
    assert structure_key(small) != before


@pytest.mark.parametrize("damage", ["truncated", "flipped", "another shard's"])
def test_a_damaged_cached_build_is_built_again_and_bundles_share_no_file_with_the_cache(tmp_path, damage):
    # Truncated, byte-flipped or replaced entries were reused ("1 of 1 vendor builds from the cache"),
    # and bundles hard-linked them: editing a bundle poisoned the cache.
    from shard.targets import ShardBuild, ShardJob
    from shard.targets.build_cache import BuildCache

    cache = BuildCache(tmp_path / "cache", "rk3588", "toolkit")
    for k, fill in enumerate((b"\1", b"\2")):
        job = ShardJob(f"s{k}", tmp_path / f"s{k}.onnx", tmp_path / f"s{k}.rknn", tmp_path / f"s{k}.log")
        job.log.write_text("log")
        job.artifact.write_bytes(fill * 4096)
        cache.put(job, f"k{k}", ShardBuild(job.name, 1.0))
    job = ShardJob("s0", tmp_path / "s0.onnx", tmp_path / "got.rknn", tmp_path / "got.log")
    assert cache.get(job, "k0").cached and job.artifact.read_bytes() == b"\1" * 4096
    assert job.artifact.stat().st_ino != (cache.root / "k0" / "artifact").stat().st_ino   # a copy
    job.artifact.write_bytes(b"edited")   # an edit of the bundle's file leaves the entry as it was
    assert (cache.root / "k0" / "artifact").read_bytes() == b"\1" * 4096
    stored = cache.root / "k0" / "artifact"
    if damage == "truncated":
        stored.write_bytes(b"\1" * 100)
    elif damage == "flipped":
        stored.write_bytes(b"\1" * 4095 + b"\3")
    else:
        stored.write_bytes((cache.root / "k1" / "artifact").read_bytes())
    assert cache.get(job, "k0") is None and not (cache.root / "k0").exists()   # a miss: built and kept anew


def test_a_damaged_build_record_is_dropped_so_the_build_is_kept_anew(tmp_path):
    # A bad build.json was detected but never rewritten: that build was made again on every compile.
    from shard.targets import ShardBuild, ShardJob
    from shard.targets.build_cache import BuildCache

    cache = BuildCache(tmp_path / "cache", "rk3588", "toolkit")
    job = ShardJob("s", tmp_path / "s.onnx", tmp_path / "s.rknn", tmp_path / "s.log")
    job.log.write_text("log")
    job.artifact.write_bytes(b"\1" * 64)
    cache.put(job, "k", ShardBuild(job.name, 1.0))
    (cache.root / "k" / "build.json").write_text("{not json")
    assert cache.get(job, "k") is None and not (cache.root / "k").exists()
    cache.put(job, "k", ShardBuild(job.name, 1.0))
    assert cache.get(job, "k").cached
