"""A bundle's session: its shards' executors on their cores, the host's steps between them, frames
run one by one or pipelined (run_stream). shard.runtime.load opens one."""

from __future__ import annotations

import collections
import importlib.util
import itertools
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from shard.bundle import Manifest, ShardSpec, check_files, read_manifest
from shard.errors import RunError, TargetError
from shard.runtime.batching import Batching
from shard.runtime.executors import STAGE_BACKENDS, OnDevice, as_float16, make_executors, to_host, traits_of
from shard.runtime.host import check_dataflow, load_tables, run_host
from shard.runtime.scheduler import DEFAULT_SCHEDULE, Execution, Scheduler, placements
from shard.runtime.trace import CoreUse, core_use, write_trace


@dataclass
class ShardTiming:
    name: str
    cores: list[int] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)


class Session:
    """A bundle ready to run: every shard prepared once per core that may run it.

    cores: the NPU cores to spread shards over (default: those the manifest assigns); one thread and
    one executor bound to each. schedule: balanced (list scheduling on the shards' cost estimates:
    any free core takes the most urgent ready shard, so every core loads every shard) or round-robin
    (the manifest's placement, dealt over the given cores when they differ; each shard loaded once).
    timeout: seconds one shard may run before the session stops with an error. On a GPU backend an
    input may be given as a torch tensor already on the GPU, and `on_device` names the outputs that
    come back as such tensors, and those written in place instead (a decoder's cache, kept there:
    shard.runtime.generate), which come back to no one (`written`).
    """

    def __init__(self, bundle: str | Path, backend: str | None = None, cores: list[int] | None = None,
                 schedule: str | None = None, timeout: float | None = None, on_device: OnDevice = OnDevice()):
        self.bundle = Path(bundle)
        self.manifest: Manifest = read_manifest(self.bundle)
        self.files = check_files(self.bundle, self.manifest)   # {path: "ok ..."}: every file as compile wrote it
        check_dataflow(self.manifest)
        self.tables = load_tables(self.bundle, self.manifest.host_pre)
        self.batching = Batching.of(self.manifest)   # --batch B: single frames stacked B to a run
        self.host_seconds = 0.0   # all frames' host steps, before and after the shards
        self.frames_run = 0
        self.backend = backend or default_backend(self.manifest)
        if self.manifest.executors and self.backend not in self.manifest.executors:
            raise TargetError(f"{self.bundle}: a {self.manifest.target} bundle runs on "
                              f"{', '.join(self.manifest.executors)}; not on {self.backend}")
        self.cores = check_cores(cores if cores is not None else default_cores(self.manifest, self.backend))
        # GPU stages keep a stream each (each loaded once); NPU shards go to any free core by default
        self.schedule = schedule or ("round-robin" if self.backend in STAGE_BACKENDS else DEFAULT_SCHEDULE)
        self.placements = placements(self.schedule, self.manifest.shards, self.cores)
        self.executors = make_executors(self.backend, self.bundle, self.manifest, self.placements, on_device)
        try:
            self.scheduler = Scheduler(self.manifest.shards, self.executors, self.schedule, timeout)
        except BaseException:
            self._close_executors()
            raise
        self._frames = itertools.count()
        # one GPU stage on one stream, no timeout asked for: run() calls it on the caller's thread
        # (Scheduler.run_here: a decoder's step took 2.10 ms through a core's thread, 1.68 ms in its executor)
        self.here = self.backend in STAGE_BACKENDS and len(self.manifest.shards) == 1 and len(self.cores) == 1 \
            and timeout is None
        # the outputs written in place (on_device.writes) by the stages that hold what they need
        self.written = frozenset().union(*(getattr(e, "written", frozenset()) for e in self.executors.values()))

    def check_inputs(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The graph inputs, complete and of the compiled shapes and dtypes (frame_inputs)."""
        return frame_inputs(self.manifest, self.backend, inputs)

    def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run one frame: every shard in dependency order, independent shards on different cores at once.
        On a bundle compiled for batches (--batch B), one frame (leading axis 1) or a whole batch."""
        if self.batching.single(inputs):
            return self.batching.split(self.run(self.batching.stack([inputs] * self.batching.size)), 1)[0]
        if self.here:
            return self._outputs(self.scheduler.run_here(*self._host_before(inputs)))
        return self._outputs(self.scheduler.wait(self._submit(inputs)))

    def run_all(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run one frame as `run` does; return every tensor the frame made, shard edges included."""
        tensors = self.scheduler.wait(self._submit(inputs))
        self._outputs(tensors)
        return {name: to_host(value) for name, value in tensors.items()}

    def run_stream(self, frames: Iterable[dict[str, np.ndarray]], depth: int | None = None) -> Iterator[dict[str, np.ndarray]]:
        """Pipeline frames through the cores; yield each frame's outputs in input order.

        At most `depth` runs (default two per core) are in flight, counting those finished but not
        yet taken: the next frame is read from `frames` only when one leaves. On a bundle compiled
        for batches of B (--batch B), frames of one item each are stacked B to a run
        (shard.runtime.batching) and each gets its own outputs back.
        """
        frames = iter(frames)
        first = next(frames, None)
        if first is None:
            return
        frames = itertools.chain([first], frames)
        if not self.batching.single(first):
            yield from self._stream(frames, depth)
            return
        counts: collections.deque[int] = collections.deque()
        for outputs in self._stream(self.batching.group(frames, counts), depth):
            yield from self.batching.split(outputs, counts.popleft())

    def _stream(self, frames: Iterator[dict[str, np.ndarray]], depth: int | None) -> Iterator[dict[str, np.ndarray]]:
        depth = depth or 2 * len(self.cores)
        pending: collections.deque[int] = collections.deque()
        exhausted = False
        try:
            while True:
                while not exhausted and len(pending) < depth:
                    inputs = next(frames, None)
                    if inputs is None:
                        exhausted = True
                    else:
                        pending.append(self._submit(inputs))
                if not pending:
                    return
                yield self._outputs(self.scheduler.wait(pending[0]))
                pending.popleft()
        finally:
            for frame in pending:
                self.scheduler.forget(frame)

    def input_buffers(self) -> dict:
        """{input: the fixed buffer a GPU stage reads it from} for each bundle input that one stage alone
        reads, and on the board each input held in NPU memory (OnDevice.held): a caller that writes
        there and hands the buffer itself over as the input spares the copy (a decoder's cache, kept
        in the decode step's own buffers: shard.runtime.generate). Empty on the other backends."""
        graph_inputs = {t.name: t for t in self.manifest.inputs}
        readers = collections.Counter(t.name for shard in self.manifest.shards for t in shard.inputs)
        found = {}
        for executor in self.distinct_executors:
            found.update(getattr(executor, "held_views", dict)())
            for shard in self.manifest.shards:
                prepared = getattr(executor, "prepared", {}).get(shard.name)
                for buffer, spec in zip(prepared.inputs if prepared else [], shard.inputs):
                    if spec.name in graph_inputs and readers[spec.name] == 1:
                        found[spec.name] = buffer.view(graph_inputs[spec.name].shape)
        return found

    def run_shard(self, shard: ShardSpec, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run one shard alone on the first core that holds it, outside the scheduler (for verify)."""
        core = next(c for c in self.cores if shard in self.placements[c])
        return {name: to_host(value) for name, value in self.executors[core].run(shard, inputs).items()}

    @property
    def executions(self) -> list[Execution]:
        return self.scheduler.executions

    @property
    def timings(self) -> dict[str, ShardTiming]:
        out = {s.name: ShardTiming(s.name) for s in self.manifest.shards}
        for e in self.executions:
            t = out[e.shard]
            t.seconds.append(e.end - e.start)
            if e.core not in t.cores:
                t.cores.append(e.core)
        return out

    def core_use(self) -> list[CoreUse]:
        return core_use(self.executions, self.cores)

    def write_trace(self, path: str | Path) -> Path:
        title = f"{self.bundle.name} ({self.backend}, {self.schedule}, cores {','.join(map(str, self.cores))})"
        return write_trace(path, self.executions, self.cores, title)

    def _host_before(self, inputs: dict[str, np.ndarray]) -> tuple[int, dict[str, np.ndarray]]:
        """A new frame's number and its tensors: the inputs checked, the host steps before the shards run."""
        frame = next(self._frames)
        started = time.perf_counter()
        tensors = run_host(self.manifest.host_pre, self.check_inputs(inputs), self.tables)
        self.host_seconds += time.perf_counter() - started
        self.frames_run += 1
        return frame, tensors

    def _submit(self, inputs: dict[str, np.ndarray]) -> int:
        frame, tensors = self._host_before(inputs)
        self.scheduler.submit(frame, tensors)
        return frame

    def _outputs(self, tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        started = time.perf_counter()
        run_host(self.manifest.host_post, tensors, contiguous=False)
        self.host_seconds += time.perf_counter() - started
        return {t.name: tensors[t.name] for t in self.manifest.outputs if t.name not in self.written}

    @property
    def distinct_executors(self) -> list:
        """Each executor once, in core order (one may serve several cores: executors maps core -> it)."""
        return list({id(e): e for e in self.executors.values()}.values())

    def _close_executors(self) -> None:
        for executor in self.distinct_executors:
            executor.close()

    def close(self) -> None:
        self.scheduler.close()
        if not self.scheduler.busy_cores():
            self._close_executors()
        # else a shard ran past its timeout and its core's thread is still inside the executor;
        # releasing the executor under it could crash the process, so the process exit cleans up

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def frame_inputs(manifest: Manifest, backend: str, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The graph inputs, complete and of the compiled shapes and dtypes (on an rknn runtime, a float16
    array for a float32 input as it is: executors.npu_inputs)."""
    expected = {t.name: t for t in manifest.inputs}
    inputs = without_fixed(manifest, inputs, expected)
    missing = set(expected) - set(inputs)
    extra = set(inputs) - set(expected)
    if missing or extra:
        raise RunError(f"inputs must be exactly {', '.join(expected)}; "
                       f"missing {sorted(missing) or 'none'}, unknown {sorted(extra) or 'none'}")
    checked = {}
    for name, spec in expected.items():
        given = inputs[name]
        kept = getattr(given, "is_cuda", False) and backend in STAGE_BACKENDS   # on the GPU: stays there
        array = given if kept else np.asarray(to_host(given) if hasattr(given, "detach") else given)
        if list(array.shape) != spec.shape:
            raise RunError(f"input {name}: shape {list(array.shape)}, the bundle was compiled for {spec.shape}")
        halves = traits_of(backend).takes_float16 and as_float16(array, spec.dtype)
        checked[name] = array if kept or halves else array.astype(spec.dtype, copy=False)
    return checked


def without_fixed(manifest: Manifest, inputs: dict[str, np.ndarray], expected: dict) -> dict[str, np.ndarray]:
    """The inputs less those the compile fixed (--input-value), each checked to hold that value."""
    fixed = {name: value for name, value in manifest.input_values.items() if name not in expected}
    for name, value in fixed.items():
        if name in inputs and not np.array_equal(np.asarray(inputs[name]).reshape(-1), np.asarray(value)):
            raise RunError(f"input {name}: this bundle was compiled for {name}={','.join(map(str, value))} "
                           f"(--input-value); got {np.asarray(inputs[name]).reshape(-1).tolist()[:8]}")
    return {name: array for name, array in inputs.items() if name not in fixed}


def check_cores(cores: list[int]) -> list[int]:
    cores = list(cores)
    if not cores or any(not isinstance(c, int) or c < 0 for c in cores) or len(set(cores)) != len(cores):
        raise RunError(f"cores must be distinct non-negative core numbers, got {cores}")
    return sorted(cores)


def default_cores(manifest: Manifest, backend: str) -> list[int]:
    """The manifest's cores; one where the backend runs them all in one process, in which more cores only
    take turns (the simulator)."""
    return [0] if traits_of(backend).one_process else sorted({s.core for s in manifest.shards})


def installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def pick_backend(manifest: Manifest) -> str:
    """The backend that runs the bundle on this machine: the board where rknn-toolkit-lite2 is (an
    RK3588), TensorRT where its engines are built, cuda where torch sees a GPU, else cpu."""
    if manifest.rknn and installed("rknnlite"):
        return "board"
    if manifest.target in ("thor", "cuda"):
        if installed("tensorrt") and all(s.artifact for s in manifest.shards):
            return "tensorrt"
        if installed("torch"):
            import torch

            if torch.cuda.is_available():
                return "cuda"
    return "cpu"


def default_backend(manifest: Manifest) -> str:
    """The first backend the bundle's target names (its executors)."""
    if manifest.executors:
        return manifest.executors[0]
    return {"cpu": "cpu", "thor": "cuda", "cuda": "cuda"}.get(manifest.target, "sim")   # written before they were named


def random_inputs(specs, seed: int = 0) -> dict[str, np.ndarray]:
    """Seeded inputs for a bundle's or model's input specs: normal floats, small non-negative ints."""
    rng = np.random.default_rng(seed)
    out = {}
    for spec in specs:
        dtype = np.dtype(spec.dtype)
        if dtype.kind == "f":
            out[spec.name] = rng.standard_normal(spec.shape).astype(dtype)
        else:  # ids, masks, flags: 0 and 1 are valid for any vocabulary
            out[spec.name] = rng.integers(0, 2, spec.shape).astype(dtype)
    return out
