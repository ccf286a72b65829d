"""Client side of a toolkit worker process (see rknn_worker.py): spawn, ask, time out, kill.

Imports nothing beyond the standard library, numpy and shard.errors, so the runtime's simulator
executor can use it.
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import subprocess
import tempfile
import threading
import weakref
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

import numpy as np

from shard.errors import RunError

WORKER_SCRIPT = Path(__file__).with_name("rknn_worker.py")


class WorkerFailed(Exception):
    """The worker process died or timed out; `log` is where its own output went."""

    def __init__(self, message: str, log: Path, timed_out: bool = False):
        super().__init__(message)
        self.log = log
        self.timed_out = timed_out


class ToolkitWorker:
    """One long-lived worker process in a toolkit environment; requests are answered in order.

    The process gets a temporary folder of its own (TMPDIR): the build's scratch and whatever the
    toolkit writes there go with it when the process ends, killed or not."""

    def __init__(self, python: Path, log: Path):
        self.log = Path(log)
        self.log.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = Path(tempfile.mkdtemp(prefix="shard-worker-"))
        # The process and the folder also end with this object: a compile interrupted while it
        # starts a worker, before any pool holds it, leaves neither behind.
        procs: list[subprocess.Popen] = []
        self._end = weakref.finalize(self, end_worker, procs, self.tmp)
        # -I: the user's PYTHONPATH and site-packages must not leak into the toolkit's environment.
        self.proc = subprocess.Popen(
            [str(python), "-I", str(WORKER_SCRIPT), str(self.log)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=open(self.log, "ab"), text=True,
            env={**os.environ, "TMPDIR": str(self.tmp)},
        )
        procs.append(self.proc)
        self._answers: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=read_answers, args=(self.proc.stdout, self._answers), daemon=True).start()

    def request(self, timeout: float | None = None, **req) -> dict:
        """Send one request and wait for its answer; WorkerFailed if the process dies or times out."""
        try:
            self.proc.stdin.write(json.dumps(req) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            pass  # the process is gone; reading the answer says how
        try:
            line = self._answers.get(timeout=timeout)
        except queue.Empty:
            self.kill()
            raise WorkerFailed(f"timed out (no answer within {timeout:g} s; killed)", self.log, timed_out=True) from None
        if line is None:
            code = self.proc.wait()
            raise WorkerFailed(f"died (the toolkit process exited with code {code})", self.log)
        return json.loads(line)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        self._end()

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"op": "exit"}) + "\n")
                self.proc.stdin.close()
                self.proc.wait(timeout=30)
            except (BrokenPipeError, subprocess.TimeoutExpired):
                pass
        self.kill()

    def __enter__(self) -> ToolkitWorker:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_answers(stdout, answers: queue.Queue) -> None:
    """A worker's answers, line by line, then None when its process ends (holding no reference to
    the worker, so a dropped one is collected and ended)."""
    for line in stdout:
        answers.put(line)
    answers.put(None)


def end_worker(procs: list[subprocess.Popen], tmp: Path) -> None:
    """Kill a worker's process if it runs and remove its temporary folder."""
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    shutil.rmtree(tmp, ignore_errors=True)


class WorkerPool:
    """At most `size` toolkit workers shared by threads; each started on first use (or all by
    start()), reused after.

        with pool.worker() as worker:
            worker.request(op="build", ...)

    A worker that died or timed out is killed and its slot starts a new one on next use.
    """

    def __init__(self, python: Path, log_dir: Path, size: int):
        self.python = python
        self.log_dir = Path(log_dir)
        self._slots: queue.Queue[ToolkitWorker | None] = queue.Queue()
        for _ in range(max(1, size)):
            self._slots.put(None)
        self.started: list[ToolkitWorker] = []
        self._lock = threading.Lock()
        self.stopped = False

    @contextmanager
    def worker(self):
        worker = self._slots.get()
        if worker is None:
            with self._lock:
                if self.stopped:   # killed: a job that starts now must not start a worker
                    self._slots.put(None)
                    raise WorkerFailed("stopped (the compile is ending)", self.log_dir)
                worker = self._new_worker()
        try:
            yield worker
        except BaseException:
            worker.kill()
            self._slots.put(None)
            raise
        self._slots.put(worker if worker.alive() else None)

    def start(self) -> None:
        """Start every worker now rather than on first use: each loads the toolkit (seconds) while
        the caller prepares what it will ask."""
        with self._lock:
            for _ in range(self._slots.qsize()):   # the slots free now; one in use keeps its worker
                try:
                    worker = self._slots.get_nowait()
                except queue.Empty:
                    break
                if worker is None and not self.stopped:
                    worker = self._new_worker()
                self._slots.put(worker)

    def _new_worker(self) -> ToolkitWorker:   # under self._lock
        worker = ToolkitWorker(self.python, self.log_dir / f"worker-{len(self.started)}.log")
        self.started.append(worker)
        return worker

    def kill_all(self) -> None:
        with self._lock:
            self.stopped = True
        for worker in self.started:
            worker.kill()

    def close(self) -> None:
        for worker in self.started:
            worker.close()


def infer(request: Callable[..., dict], key: str, arrays: list[np.ndarray], workdir: Path, log: Path) -> list[np.ndarray]:
    """Run the model a toolkit worker keeps under `key` on `arrays`, handed over as .npy files in
    `workdir`; RunError if the simulator fails."""
    paths = []
    for k, array in enumerate(arrays):
        paths.append(str(workdir / f"in{k}.npy"))
        np.save(paths[-1], array)
    # The simulator reads 4-D inputs as NHWC unless told; shard tensors keep the ONNX layout
    # (the toolkit ignores the format of other ranks but refuses None).
    answer = request(op="infer", key=key, inputs=paths, data_format=["nchw"] * len(paths), outdir=str(workdir),
                     log=str(log))
    if not answer["ok"]:
        raise RunError(f"simulator inference failed ({answer['error']}); log: {log}")
    return [np.load(p) for p in answer["outputs"]]
