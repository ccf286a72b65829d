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
from conftest import add_model, assert_one_line_error, shard_cli

from shard.errors import RunError

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


def test_board_runs_go_one_at_a_time_to_the_node_that_owns_the_board(save, tmp_path, monkeypatch):
    """A node that owns a board advertises it (rk3588_board: 1): what runs on a board goes there and
    holds it, so two runs asked at once take their turns; a cluster without one says so in one line.
    No board is here: `shard run --backend board --ray` reaches the board's node and stops there, in
    one line, at the missing rknn-toolkit-lite2."""
    from ray.cluster_utils import Cluster

    from shard.targets.rknn import remote

    bundle = tmp_path / "add.shard"
    assert shard_cli("compile", save(add_model([1, 8, 16, 16])), "--target", "rk3588", "-o", bundle,
                     "--no-vendor-baseline").returncode == 0
    monkeypatch.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")   # every node on 127.0.0.1
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    board_node = cluster.add_node(num_cpus=1, resources={"rk3588_board": 1})
    try:
        def turn(seconds: float) -> tuple[str, float, float]:
            import time

            import ray
            started = time.time()
            time.sleep(seconds)
            return ray.get_runtime_context().get_node_id(), started, time.time()

        turns = []
        threads = [threading.Thread(target=lambda: turns.append(remote.on_board(cluster.address, "rk3588", turn, 1.0)))
                   for _ in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
        assert [node for node, _, _ in turns] == [board_node.node_id] * 2
        (_, start_a, end_a), (_, start_b, end_b) = sorted(turns, key=lambda t: t[1])
        assert end_a <= start_b, turns   # one after the other
        # A run past its timeout is stopped, and the board is free for the next at once.
        started = time.monotonic()
        with pytest.raises(RunError, match="on the rk3588 board's Ray node: no answer within 3 s; stopped"):
            remote.on_board(cluster.address, "rk3588", turn, 600.0, timeout=3)
        node, _, _ = remote.on_board(cluster.address, "rk3588", turn, 0.1, timeout=60)
        assert node == board_node.node_id and time.monotonic() - started < 60
        res = shard_cli("run", bundle, "--backend", "board", "--ray", cluster.address)
        assert_one_line_error(res, "on the rk3588 board's Ray node", "rknn-toolkit-lite2")
    finally:
        ray.shutdown()
        cluster.shutdown()
    alone = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    try:
        for args in (["run", bundle], ["probe", "--target", "rk3588", "--families", "add-width", "--on-board",
                                       "-o", tmp_path / "p.json"]):
            assert_one_line_error(shard_cli(*args, "--ray", alone.address),
                                  f"no node of the Ray cluster at {alone.address} owns an rk3588 board")
    finally:
        alone.shutdown()


def test_an_actor_reserves_what_its_build_is_predicted_to_take(tmp_path, monkeypatch):
    """Each toolkit actor reserves, as Ray memory, what the build it is lent for is predicted to take
    (memory.worker_build_bytes of the shard's weights, at least an idle worker's); one that reserved
    less than the next build needs is replaced, and a build no node has the memory for stops in one
    line instead of waiting for ever."""
    from shard.errors import ShardError
    from shard.targets.rknn.memory import WORKER_BYTES, worker_build_bytes
    from shard.targets.rknn.remote import RayPool

    monkeypatch.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    pool = RayPool("rk3588", tmp_path, 1, "local", int(WORKER_BYTES))
    try:
        def reserved(want: int) -> int:
            """The Ray memory the cluster's actors hold, once it is `want` (Ray's count lags a moment)."""
            deadline = time.monotonic() + 30
            while True:
                held = round(ray.cluster_resources()["memory"] - ray.available_resources().get("memory", 0))
                if held == want or time.monotonic() > deadline:
                    return held
                time.sleep(0.2)

        with pool.worker() as worker:
            assert worker.request(op="version", timeout=120)["ok"]
        assert reserved(int(WORKER_BYTES)) == int(WORKER_BYTES)
        shard = worker_build_bytes(300_000_000)   # a shard of 300 MB of weights: 2.27 GB
        with pool.worker(memory=shard) as worker:
            assert worker.request(op="version", timeout=120)["ok"]
        assert reserved(shard) == shard   # replaced, not added: the pool holds one
        with pool.worker(memory=int(WORKER_BYTES)) as worker:   # a smaller build keeps the larger actor
            assert worker.request(op="version", timeout=120)["ok"]
        assert reserved(shard) == shard
        with pytest.raises(ShardError, match=r"predicted to take 10000\.00 GB; no node of the Ray cluster"):
            with pool.worker(memory=int(1e13)):
                pass
    finally:
        pool.close()
        ray.shutdown()
