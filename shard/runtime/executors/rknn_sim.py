"""sim: rknn-toolkit2's simulator on x86, in one long-lived toolkit worker process.

The simulator only runs a model built in the same process, so the worker rebuilds every shard
from its ONNX file with the bundle's build options; arrays travel as .npy files in a scratch dir.
It is one process, so every core's thread shares this executor and takes turns (a lock).
"""

from __future__ import annotations

import shutil
import tempfile
import threading
from pathlib import Path
from typing import Callable

import numpy as np

from shard import scratch
from shard.bundle import Manifest, ShardSpec
from shard.errors import RunError
from shard.runtime.executors import npu_inputs, outputs_by_name
from shard.targets.rknn.env import find_python
from shard.targets.rknn.worker import ToolkitWorker, WorkerFailed, build_request, infer


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
                log = self.scratch / f"{shard.name}.build.log"
                build = shard.build_options or manifest.build  # int8 shards: quantized from their samples again
                dataset = [[(bundle / p).resolve() for p in sample] for sample in shard.dataset]
                answer = build_request(lambda **req: self._ask(shard, **req), (bundle / shard.onnx).resolve(), log,
                                       build, keep=shard.name, dataset=dataset, timeout=self.timeout)
                if not answer["ok"]:
                    raise RunError(f"{shard.name}: the simulator build failed ({answer.get('error') or answer['rc']}); "
                                   f"log: {log}")
                on_ready(shard.name)
        except BaseException:
            self.worker.kill()
            raise

    def _ask(self, shard: ShardSpec, **req) -> dict:
        try:
            return self.worker.request(**{"timeout": self.timeout, **req})
        except WorkerFailed as exc:
            raise RunError(f"{shard.name}: simulator {exc}; log: {exc.log}") from None

    def run(self, shard: ShardSpec, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        with self.lock:
            return self._run(shard, inputs)

    def _run(self, shard: ShardSpec, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        work = Path(tempfile.mkdtemp(prefix=f"{shard.name}-", dir=self.scratch))
        arrays, formats = npu_inputs(shard, inputs)
        try:
            outs = infer(lambda **req: self._ask(shard, **req), shard.name, arrays, work,
                         self.scratch / f"{shard.name}.run.log", formats)
        except RunError as exc:
            raise RunError(f"{shard.name}: {exc}") from None
        finally:
            shutil.rmtree(work, ignore_errors=True)
        return outputs_by_name(shard, outs)

    def close(self) -> None:
        self.worker.close()
        scratch.remove(self.scratch)
