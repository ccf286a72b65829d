"""cpu: onnxruntime over the shard ONNX files."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from shard.bundle import Manifest, ShardSpec
from shard.errors import RunError
from shard.runtime.executors import each_core, edge_input, outputs_by_name


def make(bundle: Path, manifest: Manifest, placements: dict[int, list[ShardSpec]]) -> dict:
    """One onnxruntime session per shard and core, one thread each (a core of the host stands in for
    an NPU core)."""
    return each_core(placements, lambda core, shards: CpuExecutor(bundle, shards, threads=1))


class CpuExecutor:
    def __init__(self, bundle: Path, shards: list[ShardSpec], threads: int = 1):
        import onnxruntime as ort

        missing = [s.name for s in shards if s.onnx is None]
        if missing:
            raise RunError(f"shards {', '.join(missing)} have no ONNX file here (a pack made without --with-onnx): "
                           f"the cpu executor cannot run them; pack again with --with-onnx, or run on the board")
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = threads
        opts.inter_op_num_threads = 1
        opts.log_severity_level = 3
        # Q/DQ propagation moves a QuantizeLinear past a Reshape or Transpose whose input has other
        # readers, and so quantizes those too: on ViT-tiny's FP8 stages it took the end-to-end cosine
        # from 0.99965 to 0.931. A Q/DQ stage means exactly the Q/DQ it holds, as TensorRT reads it.
        self.sessions = {s.name: ort.InferenceSession(str(bundle / s.onnx), opts, providers=["CPUExecutionProvider"],
                                                      disabled_optimizers=["QDQPropagationTransformer"])
                         for s in shards}

    def run(self, shard: ShardSpec, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        names = [t.name for t in shard.outputs]
        feeds = {t.name: edge_input(shard, t, inputs[t.name]) for t in shard.inputs}
        return outputs_by_name(shard, self.sessions[shard.name].run(names, feeds))

    def close(self) -> None:
        self.sessions.clear()
