"""A compile stopped half-way leaves nothing behind: no bundle, no staging folder, no toolkit worker."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shard.compilation.staging import remove_stale_staging
from shard.targets.rknn.worker import live as alive

pytestmark = pytest.mark.toolkit


def descendants_running(root: int, needle: str) -> list[int]:
    """Live processes under `root` (its children, theirs, ...) whose command line holds `needle` (from
    /proc): a pool's first worker forks the others."""
    parents, cmdlines = {}, {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()   # after "pid (comm) ": state, ppid, ...
        if fields[0] != "Z":
            parents[int(entry.name)], cmdlines[int(entry.name)] = int(fields[1]), cmdline
    found = []
    for pid, cmdline in cmdlines.items():
        ancestor = parents[pid]
        while ancestor not in (root, 0, 1) and ancestor in parents:
            ancestor = parents[ancestor]
        if ancestor == root and needle in cmdline:
            found.append(pid)
    return found


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    from shard.zoo import export_model

    # two SigLIP layers at 512: each shard's vendor build takes seconds, long enough to stop one mid-way
    return export_model("siglip-base-512", tmp_path_factory.mktemp("interrupt") / "s2.onnx", layers=2)


def compile_until_builds(model: Path, out: Path, scratch: Path) -> tuple[subprocess.Popen, list[int]]:
    """`shard compile` with TMPDIR=scratch, returned once its vendor builds run in two workers."""
    # A shell without job control starts background commands with SIGINT ignored, and children inherit
    # that (a CI runner may start the suite so): the compile gets SIGINT's default, as at a terminal.
    scratch.mkdir()
    proc = subprocess.Popen([sys.executable, "-m", "shard", "compile", str(model), "-o", str(out), "--no-cache"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "TMPDIR": str(scratch)},
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    workers: list[int] = []
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        workers = descendants_running(proc.pid, "rknn_worker")
        staging = list(out.parent.glob(f".{out.name}.tmp-*"))
        if len(workers) >= 2 and staging and list((staging[0] / "shards").glob("*.onnx")):
            break   # shards written, vendor builds under way in both workers (the second forked by the first)
        time.sleep(0.2)
    assert len(workers) >= 2 and proc.poll() is None, "the compile never reached its vendor builds"
    return proc, workers


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_stopped_compile_leaves_nothing(model, tmp_path, signum):
    scratch = tmp_path.with_name(f"{tmp_path.name}-tmp")   # the compile's temporary folder (TMPDIR)
    proc, workers = compile_until_builds(model, tmp_path / "s2.shard", scratch)
    proc.send_signal(signum)
    proc.wait(timeout=120)
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr.read()
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    assert not [pid for pid in workers if alive(pid)]
    # what stays is the build logs the error names; the workers' own folders went with them. (`.ses` is
    # onnxruntime's: 1.32 writes it into TMPDIR when a process first starts a session, and keeps it.)
    left = [p for p in scratch.iterdir() if p.name != ".ses"]
    assert {(p.name.split("-") + [p.name])[1] for p in left} <= {"logs"}, left


def test_what_a_killed_compile_left_in_tmpdir_goes_with_the_next_command(model, tmp_path):
    # SIGKILL runs no cleanup: shard-worker-*, shard-ops-* and shard-logs-* stayed in TMPDIR for good.
    scratch = tmp_path.with_name(f"{tmp_path.name}-tmp")
    proc, workers = compile_until_builds(model, tmp_path / "s2.shard", scratch)
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 60   # the workers end when their stdin closes
    while [pid for pid in workers if alive(pid)] and time.monotonic() < deadline:
        time.sleep(0.2)
    kinds = lambda: sorted({p.name.split("-")[1] for p in scratch.glob("shard-*")})  # noqa: E731
    assert {"ops", "worker", "logs"} <= set(kinds())
    import onnx
    from conftest import add_model

    onnx.save(add_model([1, 8]), tmp_path / "small.onnx")
    res = subprocess.run([sys.executable, "-m", "shard", "compile", str(tmp_path / "small.onnx"), "--target", "cpu"],
                         capture_output=True, text=True, env={**os.environ, "TMPDIR": str(scratch)})
    assert res.returncode == 0, res.stderr
    assert kinds() == []


def test_a_later_compile_removes_what_a_killed_one_left(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    left = tmp_path / f".m.shard.tmp-{dead.pid}-abc123"
    (left / "shards").mkdir(parents=True)
    ours = tmp_path / f".m.shard.tmp-{os.getpid()}-def456"   # a live compile's: kept
    ours.mkdir()
    other = tmp_path / f".n.shard.tmp-{dead.pid}-abc123"     # another output's: kept
    other.mkdir()
    assert remove_stale_staging(tmp_path / "m.shard") == [left]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([ours.name, other.name])


def test_a_worker_interrupted_while_it_starts_or_dropped_unheld_leaves_nothing(tmp_path, monkeypatch):
    """Ctrl-C can land after a worker made its folder and before any pool holds it (seen once in a
    full run: a shard-worker-* folder left by a stopped compile); the folder and the process go
    with the object."""
    import gc
    import tempfile

    from shard.targets.rknn import worker as workers

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(workers.subprocess, "Popen", interrupted)
    with pytest.raises(KeyboardInterrupt):
        workers.ToolkitWorker(Path(sys.executable), tmp_path / "logs" / "w.log")
    gc.collect()
    assert not list(tmp_path.glob("shard-worker-*"))
    monkeypatch.undo()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    dropped = workers.ToolkitWorker(Path(sys.executable), tmp_path / "logs" / "w.log")   # a process that exits
    pid, folder = dropped.proc.pid, dropped.tmp
    assert folder.is_dir()
    del dropped
    gc.collect()
    assert not folder.exists() and not alive(pid)


def test_the_passes_toolkit_folder_goes_when_its_start_is_interrupted(tmp_path, monkeypatch):
    """SIGTERM landing while the passes start their toolkit (after its scratch folder is made, before
    the object exists for run_passes to close) left a shard-ops-* folder behind (seen once in a full run)."""
    import gc
    import tempfile

    from shard.profile import load_profile
    from shard.targets.rknn import ops

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(ops, "worker_pool", interrupted)
    with pytest.raises(KeyboardInterrupt):
        ops.ToolkitOps("rk3588", load_profile("rk3588"), {})
    gc.collect()
    assert not list(tmp_path.glob("shard-ops-*"))


def test_a_pool_started_ahead_serves_its_requests_from_those_workers_and_kills_them(tmp_path):
    """A compile starts its build workers before the passes (they load the toolkit meanwhile): the
    builds reuse exactly those, and a compile stopped before any build still ends them."""
    from shard.targets.rknn.worker import WorkerPool

    pool = WorkerPool(Path(sys.executable), tmp_path / "logs", 2)
    pool.start()
    started = list(pool.started)
    assert len(started) == 2 and all(w.alive() for w in started)
    with pool.worker() as first, pool.worker() as second:
        assert {id(first), id(second)} == {id(w) for w in started}
    pool.start()   # already running: nothing more
    assert pool.started == started
    pool.kill_all()
    assert not any(alive(w.proc.pid) for w in started) and not any(w.tmp.exists() for w in started)


def test_a_stop_that_a_finalizer_swallowed_still_leaves_no_bundle(tmp_path):
    """A signal that lands in a finalizer (a gc run, say) is only recorded (shard.cli.common.terminate), and the
    command stops at its next progress step (stop_point): the compile's last one comes before the bundle
    takes the output's place, so even a stop recorded after every build has finished leaves nothing."""
    import onnx

    import shard
    from shard.options import CompileOptions
    from conftest import mlp_chain

    model = tmp_path / "m.onnx"
    onnx.save(mlp_chain(2), model)
    steps = []

    def stop_at_the_end(step, done, total, note=""):
        steps.append(step)
        if step == "write the bundle":
            raise KeyboardInterrupt()

    with pytest.raises(KeyboardInterrupt):
        shard.compile(model, "cpu", tmp_path / "m.shard", CompileOptions(build_cache=False), progress=stop_at_the_end)
    assert steps[-1] == "write the bundle" and "write shards" in steps
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx"]


STALLED_BUILD = """
import numpy as np, onnx, sys
from onnx import TensorProto, helper, numpy_helper
from shard.options import CompileOptions
from shard.profile import load_profile
from shard.targets.registry import get_target
w = numpy_helper.from_array(np.ones((97, 64), np.float32), "w")
graph = helper.make_graph([helper.make_node("MatMul", ["w", "x"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64, 1])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 97, 1])], [w])
model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
ops = get_target("rk3588").pass_toolkit(load_profile("rk3588"), CompileOptions())
ops.cache.read = False
print("building", flush=True)
ops.build(model)
"""


def test_a_worker_stalled_in_a_build_ends_with_its_killed_client(tmp_path):
    """rknn-toolkit2 2.5.0's op fusion spins without end on the one-row product W [97, 64] @ x [64, 1];
    a worker in that build reads no request, so a client killed meanwhile (SIGKILL, OOM) left it
    holding a core until reboot. It now exits within seconds of its client."""
    proc = subprocess.Popen([sys.executable, "-c", STALLED_BUILD], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "TMPDIR": str(tmp_path), "SHARD_BUILD_CACHE": str(tmp_path / "cache")})
    assert proc.stdout.readline() == "building\n"
    time.sleep(5)   # the worker started and inside the build
    workers = descendants_running(proc.pid, "rknn_worker")
    assert workers and proc.poll() is None
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 20
    while [pid for pid in workers if alive(pid)] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [pid for pid in workers if alive(pid)]
