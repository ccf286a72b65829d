"""Toolkit workers on a Ray cluster (`--ray ADDRESS`, or `--ray local` to start one here): the same
pool as WorkerPool (shard.targets.rknn.worker), each worker a Ray actor that holds a toolkit
worker process on whichever node Ray places it, so every vendor build that a compile or a probe
asks for (shard builds, the passes' one-op builds, probe points, simulator runs) goes to the
cluster without its caller changing.

A request carries its content: the files it reads (the ONNX, its external data, the calibration
samples, the inputs of a simulator run) travel with it, and what it writes (the build log, the
.rknn, the outputs) comes back to the paths the caller named, so a node needs no folder shared
with the caller, and a request asked again leaves what one asked once would (not the same bytes
of .rknn: the toolkit writes uninitialised memory into each, docs/DESIGN.md). An actor whose
process dies (SIGKILL, a node lost) is restarted by Ray and its request asked again, up to
RETRIES times; the toolkit's own failures (a crash, a timeout) come back as they do locally.

Boards are Ray resources: a node that owns a board of a chip advertises it (`ray start ...
--resources '{"rk3588_board": 1}'`), and what runs on a board (`shard probe --on-board --ray`, `shard
run --backend board --ray`) goes to such a node as a task that holds the board while it runs, so one
board runs one thing at a time (several processes on one NPU can panic its kernel). Such a node has
shard and rknn-toolkit-lite2 installed.

Ray is imported only here, and only when asked for.
"""

from __future__ import annotations

import os
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
from contextlib import contextmanager
from pathlib import Path

from shard import scratch
from shard.errors import RunError, ShardError
from shard.runtime.executors.rknn_board import infer_once, time_inference
from shard.targets.rknn.env import find_python
from shard.targets.rknn.memory import WORKER_BYTES
from shard.targets.rknn.worker import ToolkitWorker, WorkerFailed, WorkerPool

RETRIES = 3   # a request whose actor died is asked again this many times, each on the restarted actor
CONNECTING = threading.Lock()   # threads that connect at once connect once


def ray_module():
    """ray, or a ShardError in one line where the extra is not installed."""
    try:
        import ray
    except ImportError:
        raise ShardError("--ray needs Ray: pip install 'shard[ray]'") from None
    return ray


def connect(address: str, cpus: int | None = None):
    """Ray, connected to the cluster at `address` ("local": one started on this machine with `cpus`
    CPUs, ended with this process, listening on the loopback address only), once per process."""
    if address == "local":   # read when ray is imported: a local node's own address is then 127.0.0.1
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    ray = ray_module()
    with CONNECTING:
        if not ray.is_initialized():
            options = {"include_dashboard": False, "log_to_driver": False, "logging_level": "ERROR"}
            if address == "local":
                ray.init(address="local", num_cpus=cpus, **options)   # a new one, whatever else runs here
            else:
                ray.init(address=address, **options)
    return ray


class ToolkitActor:
    """A toolkit worker process on a Ray node: takes a request with the files it reads, answers with
    the files it wrote (made a Ray actor by RayPool)."""

    def __init__(self, target: str):
        self.python = find_python(target)
        self.tmp = scratch.folder("ray")   # swept by a later process once this one is gone, killed or not
        self.worker = None
        self.count = 0

    def request(self, req: dict, files: dict[str, bytes], timeout: float | None) -> tuple[dict, dict[str, bytes]]:
        self.count += 1
        here = self.tmp / f"r{self.count}"
        here.mkdir()
        for name, data in files.items():   # the request's own files, under their names
            (here / name).write_bytes(data)
        req = local_paths(req, here)
        if self.worker is None or not self.worker.alive():
            self.worker = ToolkitWorker(self.python, self.tmp / "worker.log")
        try:
            answer = self.worker.request(timeout=timeout, **req)
        except WorkerFailed as exc:
            self.worker = None
            shutil.rmtree(here, ignore_errors=True)
            return {"worker_failed": str(exc), "timed_out": exc.timed_out}, {}
        back = {}
        for key in ("log", "rknn"):
            if req.get(key) and Path(req[key]).is_file():
                back[key] = Path(req[key]).read_bytes()
        for k, path in enumerate(answer.get("outputs") or []):
            back[f"out{k}"] = Path(path).read_bytes()
        shutil.rmtree(here, ignore_errors=True)
        return answer, back


def local_paths(req: dict, here: Path) -> dict:
    """The request with its paths moved into the actor's folder `here` (the files its caller sent lie
    there under their travel names: travel_files)."""
    req = dict(req)
    if req.get("onnx"):   # under its own name: the model names its external data file by it
        req["onnx"] = str(here / Path(req["onnx"]).name)
    if req.get("dataset"):
        req["dataset"] = [[str(here / f"s{k}_{i}.npy") for i in range(len(sample))]
                          for k, sample in enumerate(req["dataset"])]
    if req.get("inputs"):
        req["inputs"] = [str(here / f"in{k}.npy") for k in range(len(req["inputs"]))]
    for key in ("log", "rknn"):
        if req.get(key):
            req[key] = str(here / Path(key).with_suffix(".out"))
    if req.get("outdir"):
        req["outdir"] = str(here)
    return req


def travel_files(req: dict) -> dict[str, bytes]:
    """The files a request reads, by the names local_paths gives them on the actor's side."""
    files = {}
    if req.get("onnx"):
        onnx = Path(req["onnx"])
        files[onnx.name] = onnx.read_bytes()
        data = onnx.with_name(f"{onnx.name}.data")   # a shard's external weights, as shard writes them
        if data.is_file():
            files[data.name] = data.read_bytes()
    for k, sample in enumerate(req.get("dataset") or []):
        for i, path in enumerate(sample):
            files[f"s{k}_{i}.npy"] = Path(path).read_bytes()
    for k, path in enumerate(req.get("inputs") or []):
        files[f"in{k}.npy"] = Path(path).read_bytes()
    return files


class RemoteWorker:
    """What a RayPool lends: the request method of a toolkit worker, sent to a Ray actor."""

    def __init__(self, pool: RayPool, actor):
        self.pool, self.actor = pool, actor
        self.log = pool.log_dir / "ray-workers.log"

    def request(self, timeout: float | None = None, **req) -> dict:
        ray = self.pool.ray
        files = travel_files(req)
        for attempt in range(RETRIES + 1):
            ref = self.actor.request.remote(req, files, timeout)
            try:
                answer, back = ray.get(ref, timeout=None if timeout is None else timeout + 60)
                break
            except ray.exceptions.GetTimeoutError:
                ray.kill(self.actor, no_restart=False)
                raise WorkerFailed(f"timed out (no answer within {timeout:g} s; its actor killed)", self.log,
                                   timed_out=True) from None
            except ray.exceptions.RayActorError as exc:   # its process died: Ray restarts it; ask again
                with open(self.log, "a") as log:
                    log.write(f"a {req.get('op')} request's Ray actor died ({str(exc).splitlines()[0][:200]}); "
                              f"{'asked again' if attempt < RETRIES else 'given up'}\n")
                if attempt == RETRIES:
                    raise WorkerFailed(f"died on its Ray node {RETRIES + 1} times ({str(exc).splitlines()[0]})",
                                       self.log) from None
        if "worker_failed" in answer:
            raise WorkerFailed(answer["worker_failed"], self.log, timed_out=answer["timed_out"])
        for key in ("log", "rknn"):
            if req.get(key) and key in back:
                with open(req[key], "ab" if key == "log" else "wb") as f:   # the log as a local worker appends to it
                    f.write(back[key])
        if answer.get("outputs"):
            outdir = Path(req["outdir"])
            answer["outputs"] = [str(outdir / f"out{k}.npy") for k in range(len(answer["outputs"]))]
            for k, path in enumerate(answer["outputs"]):
                Path(path).write_bytes(back[f"out{k}"])
        return answer


class RayPool:
    """At most `size` toolkit workers as Ray actors (WorkerPool's interface): each started on first
    use, placed by Ray on a node with a CPU and the memory its request is predicted to take (at least
    `memory`, what an idle worker holds: shard.targets.rknn.memory); an actor that reserved less than
    the next request needs is ended and one that reserves enough started in its place. Ray restarts
    an actor whose process dies."""

    def __init__(self, target: str, log_dir: Path, size: int, address: str, memory: int = 0):
        # local: this machine's CPUs, and one more than the pool's actors for the passes' own worker,
        # which is alive beside the vendor alone's build (an actor holds its CPU while it lives)
        self.ray = connect(address, cpus=max(os.cpu_count() or 1, size + 1))
        self.target, self.log_dir, self.memory, self.address = target, Path(log_dir), memory, address
        self._slots: queue.Queue = queue.Queue()   # (actor, the memory it reserved) or None
        for _ in range(max(1, size)):
            self._slots.put(None)
        self.actors: list = []
        self._lock = threading.Lock()
        self.stopped = False

    def _new_actor(self, memory: int):
        largest = max((node["Resources"].get("memory", 0) for node in self.ray.nodes() if node["Alive"]), default=0)
        if memory > largest:   # Ray would wait for such a node for ever
            raise ShardError(f"a toolkit worker for this build is predicted to take {memory / 1e9:.2f} GB; no node "
                             f"of the Ray cluster at {self.address} has that much memory (the most: "
                             f"{largest / 1e9:.2f} GB)")
        options = {"num_cpus": 1, "max_restarts": RETRIES, "max_task_retries": 0, "memory": memory}
        actor = self.ray.remote(ToolkitActor).options(**options).remote(self.target)
        self.actors.append(actor)
        return actor

    @contextmanager
    def worker(self, memory: int | None = None):
        """A worker whose actor reserved at least `memory` bytes (and the pool's least)."""
        slot = self._slots.get()
        need = max(self.memory, memory or 0)
        try:
            with self._lock:
                if self.stopped:
                    raise WorkerFailed("stopped (the compile is ending)", self.log_dir)
                if slot is not None and slot[1] < need:   # too little reserved: one that reserves enough
                    self.ray.kill(slot[0], no_restart=True)
                    self.actors.remove(slot[0])
                    slot = None
                if slot is None:
                    slot = (self._new_actor(need), need)
            yield RemoteWorker(self, slot[0])
        finally:
            self._slots.put(slot)

    def start(self) -> None:
        """Actors start on first use: Ray places each where a CPU and its memory are free then."""

    def kill_all(self) -> None:
        with self._lock:
            self.stopped = True
        for actor in self.actors:
            self.ray.kill(actor, no_restart=True)

    def close(self) -> None:
        for actor in self.actors:
            self.ray.kill(actor, no_restart=True)
        self.actors = []


def worker_pool(target: str, log_dir: Path, size: int, ray: str | None = None):
    """The toolkit workers a compile or a probe builds on: local processes (WorkerPool), or Ray actors
    where `ray` names a cluster (each reserving what its builds take, at least a worker's memory:
    shard.targets.rknn.memory)."""
    return RayPool(target, log_dir, size, ray, int(WORKER_BYTES)) if ray else WorkerPool(find_python(target), log_dir, size)


def board_resource(chip: str) -> str:
    """The Ray resource a node that owns a board of `chip` advertises, one per board."""
    return f"{chip}_board"


def require_board(address: str, chip: str) -> str:
    """The board resource of `chip`; ShardError in one line where no node of the cluster owns one."""
    key = board_resource(chip)
    if not connect(address).cluster_resources().get(key):
        raise ShardError(f"no node of the Ray cluster at {address} owns an {chip} board: start one on the board with "
                         f"`ray start --address ADDRESS --resources '{{\"{key}\": 1}}'`")
    return key


def on_board(address: str, chip: str, fn, *args, timeout: float | None = None):
    """fn(*args) run on a node of the Ray cluster at `address` that owns a board of `chip` (fn as Ray
    sends a function: by reference where it is a module's, so that node has shard installed), holding
    that board while it runs; what fn raised there is raised here (a ShardError as it was, anything
    else as a RunError naming the node). ShardError in one line where no node owns such a board.
    `timeout`: seconds it may take, board included; past them its process there is ended (the board
    free for the next) and a RunError says so."""
    ray, key = connect(address), require_board(address, chip)
    task = ray.remote(fn).options(num_cpus=0, resources={key: 1}, max_retries=0)
    ref = task.remote(*args)
    try:
        return ray.get(ref, timeout=timeout)
    except ray.exceptions.GetTimeoutError:
        ray.cancel(ref, force=True)   # its worker process ends, and with it what it held of the board
        raise RunError(f"on the {chip} board's Ray node: no answer within {timeout:g} s; stopped") from None
    except ray.exceptions.RayTaskError as exc:
        cause = exc.cause
        if isinstance(cause, ShardError):
            raise cause from None
        raise RunError(f"on the {chip} board's Ray node: {type(cause).__name__}: {cause}") from None
    except ray.exceptions.RayError as exc:   # the node or its worker lost
        raise RunError(f"on the {chip} board's Ray node: {str(exc).splitlines()[0]}") from None


def board_inference(address: str, chip: str, timeout: float | None = None):
    """rknn_board.infer_once, run on a node of the cluster that owns a board of `chip` (the artifact
    sent to it), stopped past `timeout` seconds: what `shard probe --on-board --ray` checks each clean
    point with."""
    return on_board_with(address, chip, infer_sent, timeout)


def board_timing(address: str, chip: str, timeout: float | None = None):
    """rknn_board.time_inference the same way: what `shard probe --on-board --ray` times the hand-off
    with."""
    return on_board_with(address, chip, time_sent, timeout)


def on_board_with(address: str, chip: str, sent, timeout: float | None):
    """(artifact, arrays, platform, cores) -> sent(the artifact's bytes, ...) on a node that owns a
    board of `chip`; the board asked for now, before the first build."""
    require_board(address, chip)

    def run(artifact: Path, arrays: list, platform: str, cores: int):
        return on_board(address, chip, sent, Path(artifact).read_bytes(), arrays, platform, cores, timeout=timeout)
    return run


def infer_sent(rknn: bytes, arrays: list, platform: str, cores: int) -> list:
    """infer_once on an artifact sent as bytes (on a board's node)."""
    return on_sent_artifact(rknn, infer_once, arrays, platform, cores)


def time_sent(rknn: bytes, arrays: list, platform: str, cores: int) -> float:
    """time_inference on an artifact sent as bytes (on a board's node)."""
    return on_sent_artifact(rknn, time_inference, arrays, platform, cores)


def on_sent_artifact(rknn: bytes, fn, *args):
    """fn(artifact, *args) with the artifact's bytes written to a file of its own."""
    with tempfile.TemporaryDirectory(prefix="shard-board-") as tmp:
        artifact = Path(tmp) / "point.rknn"
        artifact.write_bytes(rknn)
        return fn(artifact, *args)


def run_pack(pack: bytes, inputs: dict[str, bytes], repeat: int, timeout: float | None = None
             ) -> tuple[int, str, str, dict[str, bytes]]:
    """A pack (shard pack) run on this node's board by the runtime's own command (python -m
    shard.runtime PACK --backend board, each shard stopped past `timeout` seconds), in a process of its
    own: (exit code, what it printed, its errors, the last frame's outputs as .npy bytes by name)."""
    with tempfile.TemporaryDirectory(prefix="shard-board-") as tmp:
        here = Path(tmp)
        (here / "model.tar.gz").write_bytes(pack)
        args = [sys.executable, "-m", "shard.runtime", str(here / "model.tar.gz"), "--backend", "board",
                "--repeat", str(repeat), "--save", str(here / "out"), *(["--timeout", str(timeout)] if timeout else [])]
        for k, (name, data) in enumerate(inputs.items()):   # numbered: a tensor's name may hold a slash
            (here / f"in{k}.npy").write_bytes(data)
            args += ["--input", f"{name}={here / f'in{k}.npy'}"]
        run = subprocess.run(args, capture_output=True, text=True)
        outputs = {path.stem: path.read_bytes() for path in sorted((here / "out").glob("*.npy"))}
        return run.returncode, run.stdout, run.stderr, outputs
