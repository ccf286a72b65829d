"""sim: rknn-toolkit2's simulator on x86, in one long-lived toolkit worker process.

The simulator only runs a model built in the same process, so the worker rebuilds every shard
from its ONNX file with the bundle's build options (shard.targets.rknn.simulate); arrays travel as
.npy files in a scratch dir. It is one process, so every core's thread shares this executor and takes
turns (a lock).
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Callable

import numpy as np

from shard import scratch
from shard.bundle import Manifest, ShardSpec
from shard.targets.rknn.env import find_python
from shard.targets.rknn.simulate import asking, build_for_simulator, run_on_simulator
from shard.targets.rknn.worker import ToolkitWorker


def make(bundle: Path, manifest: Manifest, placements: dict[int, list[ShardSpec]]) -> dict:
    """The simulator is a single process: all cores share it and take turns."""
    shared = RknnSimExecutor(bundle, manifest)
    return {core: shared for core in placements}


class RknnSimExecutor:
    def __init__(self, bundle: Path, manifest: Manifest, timeout: float = 1800.0,
                 on_ready: Callable[[str], None] = lambda name: None):
        self.scratch = scratch.folder("sim")
        self.timeout = timeout
        self.lock = threading.Lock()
        self.worker = ToolkitWorker(find_python(manifest.target), self.scratch / "worker.log")
        try:
            for shard in manifest.shards:
                build_for_simulator(asking(self.worker.request, shard, timeout), bundle, manifest, shard,
                                    self.scratch / f"{shard.name}.build.log", timeout)
                on_ready(shard.name)
        except BaseException:
            self.worker.kill()
            raise

    def run(self, shard: ShardSpec, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        with self.lock:
            return run_on_simulator(asking(self.worker.request, shard, self.timeout), shard, inputs, self.scratch)

    def close(self) -> None:
        self.worker.close()
        scratch.remove(self.scratch)
