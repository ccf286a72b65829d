"""Executors run shards on one core each. They never import the compile side; vendor SDKs load lazily."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import numpy as np

from shard.bundle import Manifest, ShardSpec
from shard.errors import TargetError

BACKENDS = ("cpu", "sim", "board", "cuda", "tensorrt")
STAGE_BACKENDS = ("cuda", "tensorrt")   # a stream per pipeline stage: each stage loaded once, on its stream


class Executor(Protocol):
    """Prepare a core's shards once, then run any of them; each executor is used by one thread at a time."""

    def run(self, shard: ShardSpec, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]: ...

    def close(self) -> None: ...


def make_executors(backend: str, bundle: Path, manifest: Manifest,
                   placements: dict[int, list[ShardSpec]]) -> dict[int, Executor]:
    """One executor per core holding the shards that core may run.

    cpu: one onnxruntime session per shard and core, one thread each (a core of the host stands in
    for an NPU core). sim: the simulator is a single process, so all cores share it and take turns.
    board: one RKNNLite runtime per shard and core, bound with that core's mask. cuda, tensorrt: a
    CUDA stream per core (pipeline stage), its stages captured as CUDA graphs.
    """
    if backend == "cpu":
        from shard.runtime.executors.cpu import CpuExecutor
        return _each_core(placements, lambda core, shards: CpuExecutor(bundle, shards, threads=1))
    if backend == "sim":
        from shard.runtime.executors.rknn_sim import RknnSimExecutor
        shared = RknnSimExecutor(bundle, manifest)
        return {core: shared for core in placements}
    if backend == "board":
        from shard.runtime.executors.rknn_board import RknnBoardExecutor
        cores = manifest.profile.get("cores", 3)   # bundles made before profiles named it were RK3588's
        return _each_core(placements, lambda core, shards: RknnBoardExecutor(bundle, shards, core, manifest.target, cores))
    if backend in STAGE_BACKENDS:
        from shard.runtime.host import step_inputs, step_outputs

        leaving = {t.name for t in manifest.outputs} | {n for step in manifest.host_post for n in step_inputs(step)}
        entering = {t.name for t in manifest.inputs} | {n for step in manifest.host_pre for n in step_outputs(step)}
        if backend == "cuda":
            from shard.runtime.executors.cuda import CudaExecutor
            return _each_core(placements, lambda core, shards: CudaExecutor(bundle, shards, leaving, entering=entering))
        from shard.runtime.executors.tensorrt import TensorRTExecutor
        return _each_core(placements, lambda core, shards: TensorRTExecutor(bundle, shards, leaving, entering))
    raise TargetError(f"unknown backend {backend!r}; backends: {', '.join(BACKENDS)}")


def _each_core(placements: dict[int, list[ShardSpec]], make) -> dict[int, Executor]:
    made: dict[int, Executor] = {}
    try:
        for core, shards in placements.items():
            made[core] = make(core, shards)
    except BaseException:
        for executor in made.values():
            executor.close()
        raise
    return made


def to_host(value) -> np.ndarray:
    """A tensor as numpy: GPU executors pass tensors between stages on the device."""
    return value if isinstance(value, np.ndarray) else value.detach().cpu().numpy()


def npu_inputs(shard: ShardSpec, inputs: dict[str, np.ndarray]) -> list[np.ndarray]:
    """The arrays an rknn runtime takes, in the shard's input order: float64 as float32 (the NPU has no
    fp64, and the toolkit's runtimes return nothing for it), each in the shape its graph declares."""
    return [np.ascontiguousarray(edge_input(shard, spec, inputs[spec.name]),
                                 dtype=np.float32 if spec.dtype == "float64" else spec.dtype) for spec in shard.inputs]


def edge_input(shard: ShardSpec, spec, value: np.ndarray) -> np.ndarray:
    """An input in the shape the shard's graph declares at its edge: the manifest's own, or the 4-D
    shape compile gave the edge so the vendor needs no reshape of its own there (a free view here)."""
    return np.reshape(value, shard.edge_shapes.get(spec.name, spec.shape))


def outputs_by_name(shard: ShardSpec, arrays: list[np.ndarray]) -> dict[str, np.ndarray]:
    """Name an executor's positional outputs, restoring the manifest's shapes and dtypes."""
    return {spec.name: np.asarray(a).reshape(spec.shape).astype(spec.dtype, copy=False)
            for spec, a in zip(shard.outputs, arrays)}
