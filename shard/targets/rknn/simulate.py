"""The toolkit's simulator, a shard at a time: it only runs what its own process built, so a shard is
built in a toolkit worker with the bundle's options, kept there, run, and released.

RknnSimExecutor (shard.runtime.executors.rknn_sim) holds every shard of a bundle in one worker, as a
session does; ShardByShard holds one shard per worker at a time, for a check that runs a bundle shard
by shard (shard.compilation.fidelity): its memory is one shard's session per worker, not the bundle's.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from shard import scratch
from shard.bundle import Manifest, ShardSpec
from shard.errors import RunError
from shard.runtime.executors import npu_inputs, outputs_by_name
from shard.targets.rknn.memory import onnx_weight_bytes, worker_build_bytes
from shard.targets.rknn.remote import worker_pool
from shard.targets.rknn.worker import WorkerFailed, build_request, infer

Request = Callable[..., dict]
Run = Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]]


def asking(request: Request, shard: ShardSpec, timeout: float) -> Request:
    """A worker's request method with the timeout, its failures as RunError naming the shard."""
    def ask(**req) -> dict:
        try:
            return request(**{"timeout": timeout, **req})
        except WorkerFailed as exc:
            raise RunError(f"{shard.name}: simulator {exc}; log: {exc.log}") from None
    return ask


def build_for_simulator(ask: Request, bundle: Path, manifest: Manifest, shard: ShardSpec, log: Path,
                        timeout: float) -> None:
    """The shard built from its ONNX file with the bundle's options (an int8 shard quantized from its
    samples again) and kept in the worker under its name; RunError if the build failed."""
    build = shard.build_options or manifest.build
    dataset = [[(bundle / p).resolve() for p in sample] for sample in shard.dataset]
    answer = build_request(ask, (bundle / shard.onnx).resolve(), log, build, keep=shard.name, dataset=dataset,
                           timeout=timeout)
    if not answer["ok"]:
        raise RunError(f"{shard.name}: the simulator build failed ({answer.get('error') or answer['rc']}); log: {log}")


def run_on_simulator(ask: Request, shard: ShardSpec, inputs: dict[str, np.ndarray], folder: Path
                     ) -> dict[str, np.ndarray]:
    """One run of a shard the worker keeps, its arrays handed over as files in `folder`."""
    return outputs_by_name(shard, run_kept(ask, shard.name, *npu_inputs(shard, inputs), folder))


def run_kept(ask: Request, key: str, arrays: list[np.ndarray], formats: list[str], folder: Path
             ) -> list[np.ndarray]:
    """One run of the model a worker keeps under `key` on the arrays (executors.npu_inputs gives
    them), handed over as files in `folder`: its outputs as the simulator gives them."""
    work = Path(tempfile.mkdtemp(prefix=f"{key}-", dir=folder))
    try:
        return infer(ask, key, arrays, work, folder / f"{key}.run.log", formats)
    except RunError as exc:
        raise RunError(f"{key}: {exc}") from None
    finally:
        shutil.rmtree(work, ignore_errors=True)


def runs_where_built(ask: Request, key: str, runs: list[tuple[list[np.ndarray], list[str]]], folder: Path
                     ) -> list[list[np.ndarray]] | None:
    """Each run of the model a worker keeps under `key` (built just now: shard.targets.SampleRuns), which
    is then released; None where the simulator failed: a check of the bundle builds it again and says
    why there."""
    try:
        outputs = [run_kept(ask, key, arrays, formats, folder) for arrays, formats in runs]
    except RunError:
        outputs = None
    except WorkerFailed:   # it died or timed out: nothing is kept
        return None
    try:
        ask(op="release", key=key)
    except WorkerFailed:   # it died since: nothing is kept
        pass
    return outputs


class ShardByShard:
    """At most `workers` toolkit workers, each holding one shard built for the simulator at a time:

        with simulator.loaded(bundle, manifest, shard) as run:
            outputs = run(*npu_inputs(shard, inputs))   # as the simulator gives them (run_kept)
    """

    backend = "sim"   # the runtime's name for what runs them (shard.runtime.frame_inputs)

    def __init__(self, chip: str, workers: int, timeout: float = 1800.0, pool=None):
        """`pool`: the compile's own toolkit workers (shard.targets.rknn.target.ToolkitBuilds), which have
        the toolkit loaded already; else `workers` of its own, started on first use."""
        self.folder = scratch.folder("sim")
        self.timeout, self.workers = timeout, workers
        self.owned = pool is None
        self.pool = worker_pool(chip, self.folder, workers) if pool is None else pool

    @contextmanager
    def loaded(self, bundle: Path, manifest: Manifest, shard: ShardSpec) -> Iterator[Run]:
        memory = worker_build_bytes(onnx_weight_bytes((bundle / shard.onnx).resolve()))
        with self.pool.worker(memory=memory) as worker:
            ask = asking(worker.request, shard, self.timeout)
            build_for_simulator(ask, bundle, manifest, shard, self.folder / f"{shard.name}.build.log", self.timeout)
            try:
                yield lambda arrays, formats: run_kept(ask, shard.name, arrays, formats, self.folder)
            finally:
                ask(op="release", key=shard.name)

    def close(self) -> None:
        if self.owned:
            self.pool.close()
        scratch.remove(self.folder)

    def kill(self) -> None:
        if self.owned:
            self.pool.kill_all()
        scratch.remove(self.folder)

    def __enter__(self) -> ShardByShard:
        return self

    def __exit__(self, kind, exc, tb) -> None:
        self.kill() if kind is not None else self.close()
