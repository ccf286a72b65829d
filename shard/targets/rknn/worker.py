"""Client side of a toolkit worker process (see rknn_worker.py): spawn, ask, time out, kill.

Imports nothing beyond the standard library, numpy and shard.errors, so the runtime's simulator
executor can use it.
"""

from __future__ import annotations

import json
import os
import queue
import select
import signal
import subprocess
import threading
import time
import weakref
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

import numpy as np

from shard import scratch
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
    toolkit writes there go with it when the process ends, killed or not.

    With `sibling_logs`, the process also forks one more worker per log once it has imported the
    toolkit (self.siblings, in that order): they share the import's pages and skip its seconds.
    Each is a worker like this one; a sibling outlives the process that forked it."""

    def __init__(self, python: Path, log: Path, sibling_logs: list[Path] = ()):
        self._prepare(log)
        self.siblings: list[ToolkitWorker] = []
        fds: list[int] = []   # the siblings' ends of their pipes, handed to the process
        try:
            specs = []
            for sibling_log in sibling_logs:
                (requests, to_sibling), (from_sibling, answers) = os.pipe(), os.pipe()
                fds += [requests, answers]
                sibling = ToolkitWorker.__new__(ToolkitWorker)
                sibling._prepare(sibling_log)
                status = sibling.tmp / "exit-code"   # goes with its folder
                sibling.proc = Forked(os.fdopen(to_sibling, "w"), os.fdopen(from_sibling), status)
                self.siblings.append(sibling)
                specs.append(json.dumps({"requests": requests, "answers": answers, "log": str(sibling.log),
                                         "tmp": str(sibling.tmp), "status": str(status)}))
            # -I: the user's PYTHONPATH and site-packages must not leak into the toolkit's environment.
            self.proc = subprocess.Popen(
                [str(python), "-I", str(WORKER_SCRIPT), str(self.log), *specs],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=open(self.log, "ab"), text=True,
                env={**os.environ, "TMPDIR": str(self.tmp)}, pass_fds=fds,
            )
        finally:
            for fd in fds:
                os.close(fd)
        self._procs.append(self.proc)
        self._listen()
        for sibling in self.siblings:   # theirs to end from now on: they exist once this process forks them
            sibling._procs.append(sibling.proc)
            sibling._listen()

    def _prepare(self, log: Path) -> None:
        self.log = Path(log)
        self.log.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = scratch.folder("worker")
        # The process and the folder also end with this object: a compile interrupted while it
        # starts a worker, before any pool holds it, leaves neither behind.
        self._procs: list[subprocess.Popen | Forked] = []
        self._end = weakref.finalize(self, end_worker, self._procs, self.tmp)

    def _listen(self) -> None:
        self._answers: queue.Queue[str | None] = queue.Queue()
        hello = self.proc.introduce if isinstance(self.proc, Forked) else None
        threading.Thread(target=read_answers, args=(self.proc.stdout, self._answers, hello), daemon=True).start()

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
            self._answers.put(None)   # said again for the next request, which would wait for ever
            code = self.proc.wait()
            how = f"exited with code {code}" if code is not None else "ended: its log says how"
            raise WorkerFailed(f"died (the toolkit process {how})", self.log)
        return json.loads(line)

    def alive(self) -> bool:
        return running(self.proc)

    def family(self) -> list[ToolkitWorker]:
        """This worker and the siblings it forks."""
        return [self, *self.siblings]

    def kill(self) -> None:
        self._end()

    def close(self) -> None:
        if running(self.proc):
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


def read_answers(stdout, answers: queue.Queue, hello: Callable[[dict | None], None] | None = None) -> None:
    """A worker's answers, line by line, then None when its process ends (holding no reference to
    the worker, so a dropped one is collected and ended). A sibling's first line is its pid, for
    `hello` (None if it ended before it said)."""
    for line in stdout:
        if hello is not None:
            hello(json.loads(line))
            hello = None
            continue
        answers.put(line)
    if hello is not None:
        hello(None)
    answers.put(None)


class Forked:
    """The process of a sibling worker (forked by another worker, not by this process): the part of
    subprocess.Popen a worker uses, by its pid, watched through a pidfd (or, on a kernel before
    Linux 5.3, through /proc). Its exit code is the forking worker's to collect, which writes it to
    `status` (and to the sibling's log)."""

    def __init__(self, stdin, stdout, status: Path):
        self.stdin, self.stdout, self.status = stdin, stdout, status
        self.pid: int | None = None
        self.returncode: int | None = None
        self._pidfd: int | None = None
        self._said = threading.Event()
        self._ended = False
        self._asked, self._asking = False, threading.Lock()   # has wait() looked for the exit code

    def introduce(self, hello: dict | None) -> None:
        if hello is None:   # ended before it said
            self._ended = True
        else:
            self.pid = hello["pid"]
            try:
                self._pidfd = os.pidfd_open(self.pid)
            except ProcessLookupError:   # gone already
                self._ended = True
            except (AttributeError, OSError):   # no pidfd here: /proc tells
                pass
        self._said.set()

    def running(self) -> bool:
        """True while it runs, or is still being forked."""
        if not self._ended and self._said.is_set():
            self._ended = self._exited(0)
        return not self._ended

    def _exited(self, timeout: float | None) -> bool:
        if self._pidfd is not None:
            return bool(select.select([self._pidfd], [], [], timeout)[0])
        deadline = None if timeout is None else time.monotonic() + timeout
        while live(self.pid):
            if deadline is not None and time.monotonic() >= deadline:
                return False
            time.sleep(0.02)
        return True

    def wait(self, timeout: float | None = None) -> int | None:
        """Its exit code once it has ended; None where the forking worker did not say (it ended first)."""
        if not self._said.wait(timeout) or not (self._ended or self._exited(timeout)):
            raise subprocess.TimeoutExpired(f"sibling worker {self.pid}", timeout)
        self._ended = True
        with self._asking:   # reaped, and its code written, a moment after it ends: looked for once
            for _ in range(0 if self._asked else 50):
                if self.status.exists():
                    self.returncode = int(self.status.read_text())
                    break
                time.sleep(0.02)
            self._asked = True
        return self.returncode

    def __del__(self) -> None:   # not in wait(): another thread may poll it still
        if self._pidfd is not None:
            os.close(self._pidfd)

    def kill(self) -> None:
        self._said.wait(120)   # the forking worker is still importing the toolkit: its pid comes then
        if self.pid is not None and not self._ended:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def live(pid: int) -> bool:
    """Does the process run (not ended, nor a zombie waiting to be reaped)?"""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def end_worker(procs: list[subprocess.Popen | Forked], tmp: Path) -> None:
    """Kill a worker's process if it runs and remove its temporary folder."""
    for proc in procs:
        if running(proc):
            proc.kill()
            proc.wait()
    scratch.remove(tmp)


def running(proc: subprocess.Popen | Forked) -> bool:
    return proc.running() if isinstance(proc, Forked) else proc.poll() is None


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
    def worker(self, memory: int | None = None):
        """A worker for one request or a few (`memory`: what they are predicted to take, which a Ray
        pool reserves; processes here take what they take)."""
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
        """Start every worker now rather than on first use, while the caller prepares what it will
        ask: one process loads the toolkit (seconds) and forks the others from it."""
        with self._lock:
            free = []
            for _ in range(self._slots.qsize()):   # the slots free now; one in use keeps its worker
                try:
                    free.append(self._slots.get_nowait())
                except queue.Empty:
                    break
            empty = 0 if self.stopped else free.count(None)
            new = self._new_worker(siblings=empty - 1).family() if empty else []
            for worker in free:
                self._slots.put(worker if worker is not None or not new else new.pop())

    def _new_worker(self, siblings: int = 0) -> ToolkitWorker:   # under self._lock
        logs = [self.log_dir / f"worker-{len(self.started) + k}.log" for k in range(1 + siblings)]
        worker = ToolkitWorker(self.python, logs[0], logs[1:])
        self.started += worker.family()
        return worker

    def kill_all(self) -> None:
        with self._lock:
            self.stopped = True
        for worker in reversed(self.started):   # siblings first: the worker that forked them reaps them
            worker.kill()

    def close(self) -> None:
        for worker in reversed(self.started):
            worker.close()


def build_request(request: Callable[..., dict], onnx: Path, log: Path, options: dict, rknn: Path | None = None,
                  keep: str | None = None, dataset=(), timeout: float | None = None) -> dict:
    """One vendor build in a worker, the one request every builder sends (compile, the passes' and the
    probe's small builds, the simulator): `request` is a worker's request method or a wrapper of it;
    `options` as Target.build_for gives them ({"config", "build"} and, mixed, "float16"); `rknn`: where
    the artifact goes, if anywhere; `keep`: the built model stays loaded in the worker under this key
    (to run it); `dataset`: the quantization samples, per sample one .npy file per input."""
    return request(op="build", onnx=str(onnx), rknn=str(rknn) if rknn else None, log=str(log),
                   config=options["config"], build=options["build"], keep=keep,
                   dataset=[[str(path) for path in sample] for sample in dataset], float16=options.get("float16"),
                   timeout=timeout)


BUILD_STAGES = ("config", "load_onnx", "build", "export_rknn")


def build_failure(answer: dict) -> tuple[str, object, str | None]:
    """Where a failed build's answer says it stopped: the first stage that returned non-zero or never
    ran, what it returned ("?" where it never did), and the toolkit's last error line where it raised
    (the exception's own line). The one reader of a failed build, for compile and probe alike."""
    rc = answer.get("rc", {})
    stage = next((s for s in BUILD_STAGES if rc.get(s, 0) != 0 or s not in rc), "build")
    lines = [line.strip() for line in (answer.get("error") or "").splitlines() if line.strip()]
    return stage, rc.get(stage, "?"), lines[-1] if lines else None


def infer(request: Callable[..., dict], key: str, arrays: list[np.ndarray], workdir: Path, log: Path,
          formats: list[str] | None = None) -> list[np.ndarray]:
    """Run the model a toolkit worker keeps under `key` on `arrays`, handed over as .npy files in
    `workdir`, each in its layout of `formats` ("nchw", ONNX's, unless given); RunError if the
    simulator fails."""
    paths = []
    for k, array in enumerate(arrays):
        paths.append(str(workdir / f"in{k}.npy"))
        np.save(paths[-1], array)
    # The simulator reads 4-D inputs as NHWC unless told; shard tensors keep the ONNX layout unless
    # `formats` says otherwise (the toolkit ignores the format of other ranks but refuses None).
    answer = request(op="infer", key=key, inputs=paths, data_format=formats or ["nchw"] * len(paths),
                     outdir=str(workdir), log=str(log))
    if not answer["ok"]:
        raise RunError(f"simulator inference failed ({answer['error']}); log: {log}")
    return [np.load(p) for p in answer["outputs"]]
