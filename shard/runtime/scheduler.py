"""Dispatch shard executions over NPU cores: one thread per core, dependency order, frames pipelined.

A frame is one set of graph inputs. Each shard of a frame becomes ready when the shards producing
its inputs are done; a core's thread takes the best ready task it may run (lowest frame first, then
the longest remaining path). Shards that do not depend on each other run on different cores at
once, and frame t+1's first shards start while frame t's later shards still run.

Policies:
- round-robin: the manifest's placement where the cores in use are the ones it names; otherwise
  shards are dealt round-robin over the given cores, continuing from frame to frame (task (frame t, shard k)
  runs on cores[(k + t * n_shards) % n_cores]) so that every core gets its share.
- balanced: list scheduling. Any idle core takes the ready task with the highest priority, the
  priority being the shard's cost estimate plus the longest chain of costs after it.

Standard library and numpy only.
"""

from __future__ import annotations

import heapq
import threading
import time
from dataclasses import dataclass

import numpy as np

from shard import scratch
from shard.bundle import ShardSpec
from shard.errors import RunError

SCHEDULES = ("balanced", "round-robin")
DEFAULT_SCHEDULE = "balanced"  # measured faster in every case in bench/runtime.py; round-robin needs less memory


@dataclass
class Execution:
    """One shard run on one core: the unit of the trace."""

    shard: str
    core: int
    frame: int
    start: float                  # seconds on the session's clock
    end: float
    bytes_in: int
    bytes_out: int


@dataclass
class _Frame:
    tensors: dict[str, np.ndarray]
    waiting_on: list[int]         # per shard: producers not yet done
    left: int                     # shards not yet done


@dataclass(order=True)
class _Task:
    frame: int
    neg_rank: float
    shard: int


def shard_dependencies(shards: list[ShardSpec]) -> list[set[int]]:
    """For each shard, the indices of the shards that produce its inputs."""
    producer = {t.name: k for k, s in enumerate(shards) for t in s.outputs}
    return [{producer[t.name] for t in s.inputs if t.name in producer} for s in shards]


def shard_users(deps: list[set[int]]) -> list[list[int]]:
    """For each shard, the indices of the shards that take one of its outputs."""
    return [[j for j in range(len(deps)) if k in deps[j]] for k in range(len(deps))]


def upward_ranks(shards: list[ShardSpec], users: list[list[int]]) -> list[float]:
    """Each shard's cost plus the costliest chain of shards that depend on it (the list-scheduling priority)."""
    cost = [float(s.macs or 1) for s in shards]
    rank = [0.0] * len(shards)
    for k in reversed(range(len(shards))):  # the manifest lists shards in dependency order
        rank[k] = cost[k] + max((rank[j] for j in users[k]), default=0.0)
    return rank


def take_task(ready: dict[int | None, list[_Task]], core: int) -> _Task | None:
    """The task `core` runs next: the better of its own queue's head and the shared queue's."""
    own, shared = ready[core], ready[None]
    if own and (not shared or own[0] < shared[0]):
        return heapq.heappop(own)
    return heapq.heappop(shared) if shared else None


def core_for(schedule: str, shards: list[ShardSpec], cores: list[int], frame: int, k: int) -> int | None:
    """The core task (frame, shard k) must run on, or None where any core may take it."""
    if schedule == "balanced":
        return None
    if {s.core for s in shards} == set(cores):
        return shards[k].core
    return cores[(k + frame * len(shards)) % len(cores)]


def placements(schedule: str, shards: list[ShardSpec], cores: list[int]) -> dict[int, list[ShardSpec]]:
    """For each core, the shards it may ever run: what its executor has to load."""
    check_schedule(schedule)
    if schedule == "balanced":
        return {c: list(shards) for c in cores}
    out: dict[int, list[ShardSpec]] = {c: [] for c in cores}
    for frame in range(len(cores)):  # the rotation repeats after n_cores frames
        for k, shard in enumerate(shards):
            core = core_for(schedule, shards, cores, frame, k)
            if shard not in out[core]:
                out[core].append(shard)
    return out


def check_schedule(schedule: str) -> None:
    if schedule not in SCHEDULES:
        raise RunError(f"unknown schedule {schedule!r}; schedules: {', '.join(SCHEDULES)}")


class Scheduler:
    """Runs frames through a bundle's shards on a set of cores; thread-safe submit/wait."""

    def __init__(self, shards: list[ShardSpec], executors: dict[int, object], schedule: str = DEFAULT_SCHEDULE,
                 timeout: float | None = None, clock=time.perf_counter):
        check_schedule(schedule)
        if not executors:
            raise RunError("no cores to run on")
        self.shards = shards
        self.cores = sorted(executors)
        self.executors = executors
        self.schedule = schedule
        self.timeout = timeout
        self.clock = clock
        self.deps = shard_dependencies(shards)
        self.users = shard_users(self.deps)
        self.rank = upward_ranks(shards, self.users)
        self.executions: list[Execution] = []
        self.error: RunError | None = None
        self._frames: dict[int, _Frame] = {}
        self._ready: dict[int | None, list[_Task]] = {c: [] for c in [*self.cores, None]}
        self._running: dict[int, tuple[_Task, float]] = {}
        self._cond = threading.Condition()
        self._stopping = False
        self._threads = [threading.Thread(target=self._core_loop, args=(c,), name=f"shard-core-{c}", daemon=True)
                         for c in self.cores]
        for t in self._threads:
            t.start()

    # -- frames --------------------------------------------------------------------------------

    def submit(self, frame: int, inputs: dict[str, np.ndarray]) -> None:
        with self._cond:
            self._raise_if_failed()
            state = _Frame(dict(inputs), [len(d) for d in self.deps], len(self.shards))
            self._frames[frame] = state
            for k, waiting in enumerate(state.waiting_on):
                if waiting == 0:
                    self._make_ready(frame, k)
            self._cond.notify_all()

    def wait(self, frame: int) -> dict[str, np.ndarray]:
        """Block until every shard of the frame is done; return and forget its tensors."""
        with self._cond:
            while True:
                self._raise_if_failed()
                state = self._frames[frame]
                if state.left == 0:
                    del self._frames[frame]
                    return state.tensors
                self._check_timeouts()
                self._cond.wait(self._until_next_deadline())

    def run_here(self, frame: int, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """A frame of a one-shard bundle run on the calling thread: no hand-off to its core's thread and
        back, which a short GPU step (a decoder's) would spend more time in than in its executor;
        recorded as any run is. A failure raises here and leaves the session usable."""
        if len(self.shards) != 1:
            raise RunError(f"a frame runs on the calling thread only through one shard; this bundle has {len(self.shards)}")
        shard, core = self.shards[0], core_for(self.schedule, self.shards, self.cores, frame, 0)
        core = self.cores[0] if core is None else core   # balanced: any core will do
        with self._cond:
            self._raise_if_failed()
        given = {t.name: inputs[t.name] for t in shard.inputs}
        started = self.clock()
        try:
            outputs = self.executors[core].run(shard, given)
        except Exception as exc:  # noqa: BLE001 - as a core's thread reports it: with the frame and core
            raise failure(exc, shard, frame, core) from exc
        ended = self.clock()
        with self._cond:
            self.executions.append(execution(shard, core, frame, started, ended, given, outputs))
        return {**inputs, **outputs}

    def forget(self, frame: int) -> None:
        """Drop a frame nobody will wait for; its remaining shards are skipped."""
        with self._cond:
            self._frames.pop(frame, None)

    def busy_cores(self) -> list[int]:
        with self._cond:
            return sorted(self._running)

    def close(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(timeout=0 if self.error else None)  # a hung executor cannot be joined

    # -- internals (called with the lock held unless noted) ------------------------------------

    def _make_ready(self, frame: int, k: int) -> None:
        heapq.heappush(self._ready[core_for(self.schedule, self.shards, self.cores, frame, k)],
                       _Task(frame, -self.rank[k], k))

    def _pick(self, core: int) -> _Task | None:
        return take_task(self._ready, core)

    def _raise_if_failed(self) -> None:
        if self.error is not None:
            raise self.error

    def _check_timeouts(self) -> None:
        if self.timeout is None:
            return
        now = self.clock()
        for core, (task, started) in self._running.items():
            if now - started > self.timeout:
                shard = self.shards[task.shard]
                self._fail(RunError(f"{shard.name} (frame {task.frame}, core {core}) ran past its "
                                    f"{self.timeout:g} s timeout; the session is stopped"))
                self._raise_if_failed()

    def _until_next_deadline(self) -> float | None:
        """Seconds until the earliest running shard reaches its timeout (None: no deadline)."""
        if self.timeout is None or not self._running:
            return None
        first = min(started for _, started in self._running.values())
        return max(first + self.timeout - self.clock(), 0.001)

    def _fail(self, error: RunError) -> None:
        if self.error is None:
            self.error = error
        self._stopping = True
        self._cond.notify_all()

    def _core_loop(self, core: int) -> None:  # runs on the core's own thread, takes the lock itself
        executor = self.executors[core]
        while True:
            with self._cond:
                while not self._stopping and (task := self._pick(core)) is None:
                    self._cond.wait()
                if self._stopping:
                    return
                frame = self._frames.get(task.frame)
                if frame is None:  # forgotten by a consumer that stopped early
                    continue
                shard = self.shards[task.shard]
                missing = [t.name for t in shard.inputs if t.name not in frame.tensors]
                if missing:   # a manifest that check_dataflow did not see: stop, never wait forever
                    self._fail(RunError(f"{shard.name}: no tensor {missing[0]} to run on (frame {task.frame})"))
                    return
                inputs = {t.name: frame.tensors[t.name] for t in shard.inputs}
                started = self.clock()
                self._running[core] = (task, started)
                self._cond.notify_all()  # a waiter now has a deadline to watch
            try:
                outputs = executor.run(shard, inputs)
            except Exception as exc:  # noqa: BLE001 - any executor failure stops the session with its message
                with self._cond:
                    self._running.pop(core, None)
                    self._fail(failure(exc, shard, task.frame, core))
                return
            ended = self.clock()
            with self._cond:
                self._running.pop(core, None)
                if self._stopping:
                    return
                self.executions.append(execution(shard, core, task.frame, started, ended, inputs, outputs))
                frame.tensors.update(outputs)
                frame.left -= 1
                for j in self.users[task.shard]:
                    frame.waiting_on[j] -= 1
                    if frame.waiting_on[j] == 0:
                        self._make_ready(task.frame, j)
                self._cond.notify_all()


def failure(exc: Exception, shard: ShardSpec, frame: int, core: int) -> RunError:
    """An executor's failure as the session reports it: the shard, the message, the frame and core."""
    message = str(exc) if isinstance(exc, RunError) else f"{shard.name}: {type(exc).__name__}: {exc}"
    return RunError(f"{message} (frame {frame}, core {core})")


def execution(shard: ShardSpec, core: int, frame: int, started: float, ended: float, inputs: dict,
              outputs: dict) -> Execution:
    return Execution(shard.name, core, frame, started, ended, sum(a.nbytes for a in inputs.values()),
                     sum(a.nbytes for a in outputs.values()))


def exit_now_if_stuck(code: int) -> None:
    """Leave the process at once where a core's thread is still inside an executor (a shard past its
    timeout): the interpreter's exit would abort in the executor's C++ runtime ("terminate called
    without an active exception", exit 134) instead of ending with `code`. The OS reclaims the rest;
    the temporary folders go first (no finalizer runs)."""
    import os
    import sys

    if any(t.name.startswith("shard-core-") and t.is_alive() for t in threading.enumerate()):
        scratch.remove_all()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def predict_stream(shards: list[ShardSpec], seconds: list[float], cores: list[int], schedule: str = DEFAULT_SCHEDULE,
                   frames: int = 400, depth: int | None = None) -> tuple[float, float]:
    """(one frame's latency, frames per second of run_stream) if each shard took `seconds[k]` on any core:
    the Scheduler's own policy replayed as events (placements, ready order, at most `depth` frames in
    flight, the next frame read when the oldest leaves). What the report predicts from cycle estimates
    and bench/runtime.py checks against measured streams."""
    check_schedule(schedule)
    deps = shard_dependencies(shards)
    users = shard_users(deps)
    rank = upward_ranks(shards, users)
    depth = depth or 2 * len(cores)

    def simulate(count: int) -> list[float]:
        ready: dict[int | None, list[_Task]] = {c: [] for c in [*cores, None]}
        waiting: dict[int, list[int]] = {}
        left: dict[int, int] = {}
        finish: dict[int, float] = {}
        running: list[tuple[float, int, int, int]] = []   # (end, core, frame, shard)
        busy: set[int] = set()
        submitted, oldest, now = 0, 0, 0.0

        def make_ready(frame: int, k: int) -> None:   # as Scheduler._make_ready
            heapq.heappush(ready[core_for(schedule, shards, cores, frame, k)], _Task(frame, -rank[k], k))

        def submit() -> None:
            nonlocal submitted
            waiting[submitted], left[submitted] = [len(d) for d in deps], len(shards)
            for k, w in enumerate(waiting[submitted]):
                if w == 0:
                    make_ready(submitted, k)
            submitted += 1

        while submitted < min(depth, count):
            submit()
        while oldest < count:
            for core in cores:   # every idle core takes what the Scheduler's _pick would give it
                if core not in busy and (task := take_task(ready, core)) is not None:
                    busy.add(core)
                    heapq.heappush(running, (now + seconds[task.shard], core, task.frame, task.shard))
            now, core, frame, k = heapq.heappop(running)
            busy.discard(core)
            left[frame] -= 1
            for j in users[k]:
                waiting[frame][j] -= 1
                if waiting[frame][j] == 0:
                    make_ready(frame, j)
            if left[frame] == 0:
                finish[frame] = now
            while oldest in finish:   # run_stream takes the oldest frame, then reads the next input
                oldest += 1
                if submitted < count:
                    submit()
        return [finish[f] for f in range(count)]

    latency = simulate(1)[0]
    # frames over the whole run: the pipeline's filling and draining cost under 1 % at 400 frames, and
    # the estimate never exceeds what the cores can do (a window between two finishes can)
    return latency, frames / max(simulate(frames))
