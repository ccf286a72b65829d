"""Executors run one shard each. They never import the compile side; vendor SDKs load lazily."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import numpy as np

from shard.bundle import Manifest, ShardSpec
from shard.errors import TargetError


class Executor(Protocol):
    """Prepare every shard of a bundle once, then run any of them by name."""

    def run(self, shard: ShardSpec, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]: ...

    def close(self) -> None: ...


def make_executor(backend: str, bundle: Path, manifest: Manifest, cores: list[int] | None = None) -> Executor:
    if backend == "cpu":
        from shard.runtime.executors.cpu import CpuExecutor
        return CpuExecutor(bundle, manifest)
    if backend == "sim":
        from shard.runtime.executors.rknn_sim import RknnSimExecutor
        return RknnSimExecutor(bundle, manifest)
    if backend == "board":
        from shard.runtime.executors.rknn_board import RknnBoardExecutor
        return RknnBoardExecutor(bundle, manifest)
    raise TargetError(f"unknown backend {backend!r}; backends: cpu, sim, board")


def outputs_by_name(shard: ShardSpec, arrays: list[np.ndarray]) -> dict[str, np.ndarray]:
    """Name an executor's positional outputs, restoring the manifest's shapes and dtypes."""
    return {spec.name: np.asarray(a).reshape(spec.shape).astype(spec.dtype, copy=False)
            for spec, a in zip(shard.outputs, arrays)}
