"""Vendor builds on a Ray cluster (--ray): the same bundle as the local process pool, a worker
killed mid-build asked again, and Ray imported only when asked for."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import assert_one_line_error, shard_cli

pytestmark = pytest.mark.toolkit
ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'shard[ray]')")


@pytest.fixture(scope="module")
def vit(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("ray") / "vit.onnx"
    assert shard_cli("zoo", "export", "vit-tiny", "--layers", "2", "-o", path).returncode == 0
    return path


def compile_with(model: Path, out: Path, cache: Path, *flags: str) -> subprocess.Popen:
    env = {**os.environ, "SHARD_BUILD_CACHE": str(cache)}
    return subprocess.Popen([sys.executable, "-m", "shard", "compile", str(model), "--target", "rk3588", "-o", str(out),
                             "--no-vendor-baseline", *flags], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def as_written(bundle: Path) -> dict:
    """The manifest, less the vendor's artifacts' digests: rknn-toolkit2 writes uninitialised memory
    into every .rknn (heap addresses; two builds of one shard in two processes differ in about 1,600
    of its 1,083,862 bytes), so no two builds are byte-identical, on Ray or not. Everything shard
    writes (the shards' ONNX files, the profile, the manifest) and the artifacts' sizes must be."""
    manifest = json.loads((bundle / "manifest.json").read_text())
    for shard in manifest["shards"]:
        shard["built_from"].pop("artifact")
        manifest["files"][shard["artifact"]].pop("sha256")
    manifest.pop("digest")
    return manifest


def actor_processes() -> list[int]:
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and (proc / "cmdline").read_bytes().startswith(b"ray::ToolkitActor"):
                pids.append(int(proc.name))
        except OSError:
            continue
    return pids


def busy(pid: int) -> bool:
    """Whether the actor runs a toolkit worker process (its child) that has built for a while."""
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        return False
    return bool(children)


def test_builds_on_ray_make_the_bundle_the_process_pool_makes(vit, tmp_path):
    local = compile_with(vit, tmp_path / "local.shard", tmp_path / "c1")
    out, err = local.communicate(timeout=600)
    assert local.returncode == 0, err
    remote = compile_with(vit, tmp_path / "ray.shard", tmp_path / "c2", "--ray", "local")
    out, err = remote.communicate(timeout=600)
    assert remote.returncode == 0, err
    assert "0 REGTASK lines, 0 ops on the CPU" in out
    assert as_written(tmp_path / "ray.shard") == as_written(tmp_path / "local.shard")


def test_a_worker_killed_mid_build_is_asked_again(vit, tmp_path):
    clean = compile_with(vit, tmp_path / "clean.shard", tmp_path / "c1")
    assert clean.wait(timeout=600) == 0, clean.stderr.read()
    before = set(actor_processes())
    run = compile_with(vit, tmp_path / "killed.shard", tmp_path / "c2", "--ray", "local", "--jobs", "1")
    killed = []

    def kill_one_mid_build() -> None:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and run.poll() is None:
            for pid in set(actor_processes()) - before:
                if busy(pid):   # its toolkit worker is up: a build is under way
                    time.sleep(1.5)
                    os.kill(pid, signal.SIGKILL)
                    killed.append(pid)
                    return
            time.sleep(0.1)

    killer = threading.Thread(target=kill_one_mid_build)
    killer.start()
    out, err = run.communicate(timeout=900)
    killer.join()
    assert killed, "no Ray actor ran a build"
    assert run.returncode == 0, err
    log = (tmp_path / "killed.shard" / "logs" / "ray-workers.log").read_text()
    assert "Ray actor died" in log and "asked again" in log, log
    assert as_written(tmp_path / "killed.shard") == as_written(tmp_path / "clean.shard")


def test_a_compile_without_ray_imports_no_ray(vit, tmp_path):
    script = ("import sys, shard; from shard.options import CompileOptions; "
              f"shard.compile({str(vit)!r}, 'rk3588', {str(tmp_path / 'm.shard')!r}, "
              "CompileOptions(vendor_baseline=False)); print('ray' in sys.modules)")
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip().splitlines()[-1] == "False"


def test_ray_asked_for_where_it_is_not_installed_says_so_in_one_line(vit, tmp_path):
    script = ("import sys; sys.modules['ray'] = None; from shard.cli import main; "
              f"sys.argv = ['shard', 'compile', {str(vit)!r}, '--target', 'rk3588', '--ray', 'local', "
              f"'-o', {str(tmp_path / 'm.shard')!r}]; main()")
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert_one_line_error(res, "--ray needs Ray: pip install 'shard[ray]'")
    assert not (tmp_path / "m.shard").exists()
