"""cpu: onnxruntime over the shard ONNX files."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from shard.bundle import ShardSpec


class CpuExecutor:
    def __init__(self, bundle: Path, shards: list[ShardSpec], threads: int = 1):
        import onnxruntime as ort

        opts = ort.SessionOptions()
        opts.intra_op_num_threads = threads
        opts.inter_op_num_threads = 1
        opts.log_severity_level = 3
        self.sessions = {s.name: ort.InferenceSession(str(bundle / s.onnx), opts, providers=["CPUExecutionProvider"])
                         for s in shards}

    def run(self, shard: ShardSpec, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        names = [t.name for t in shard.outputs]
        return dict(zip(names, self.sessions[shard.name].run(names, {t.name: inputs[t.name] for t in shard.inputs})))

    def close(self) -> None:
        self.sessions.clear()
