"""`shard cache info` and `shard cache clear` on caches made for the test."""

from conftest import shard_cli


def test_cache_info_and_clear(tmp_path):
    builds, probes = tmp_path / "builds", tmp_path / "probes"
    for key in ("a1", "b2"):
        (builds / key).mkdir(parents=True)
        (builds / key / "build.json").write_text("{}")
        (builds / key / "artifact").write_bytes(b"\0" * 500_000)
    (probes / "rknn-toolkit2-2.5.0" / "rk3588" / "add-width@h1").mkdir(parents=True)
    (probes / "rknn-toolkit2-2.5.0" / "rk3588" / "add-width@h1" / "v1-64.json").write_text("{}")
    env = {"SHARD_BUILD_CACHE": str(builds), "SHARD_PROBE_CACHE": str(probes), "COLUMNS": "200"}
    info = shard_cli("cache", "info", env_extra=env)
    assert info.returncode == 0, info.stderr
    rows = {line.split("│")[1].strip(): line for line in info.stdout.splitlines() if line.count("│") > 3}
    assert "│       2 │ 1.0 │" in rows["builds"] and "│       1 │ 0.0 │" in rows["probes"], info.stdout
    cleared = shard_cli("cache", "clear", "--no-probes", env_extra=env)
    assert cleared.returncode == 0 and "builds: removed 2 entries, 1.0 MB" in cleared.stdout
    assert not builds.exists() and probes.exists()
