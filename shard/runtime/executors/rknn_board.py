"""board: rknn-toolkit-lite2 on an RK3588, each shard bound to the core the manifest assigns."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from shard.bundle import Manifest, ShardSpec
from shard.errors import RunError, TargetError
from shard.runtime.executors import outputs_by_name


def import_rknnlite():
    try:
        from rknnlite.api import RKNNLite
    except ImportError:
        raise TargetError("the board backend needs rknn-toolkit-lite2 on an RK3588 board "
                          "(pip install rknn-toolkit-lite2 there); on x86 use --backend sim") from None
    return RKNNLite


class RknnBoardExecutor:
    def __init__(self, bundle: Path, manifest: Manifest):
        RKNNLite = import_rknnlite()
        masks = [RKNNLite.NPU_CORE_0, RKNNLite.NPU_CORE_1, RKNNLite.NPU_CORE_2]
        self.runtimes = {}
        for shard in manifest.shards:
            rt = RKNNLite()
            if rt.load_rknn(str(bundle / shard.artifact)) != 0:
                raise RunError(f"{shard.name}: load_rknn failed for {shard.artifact}")
            if rt.init_runtime(core_mask=masks[shard.core % len(masks)]) != 0:
                raise RunError(f"{shard.name}: init_runtime failed on NPU core {shard.core}")
            self.runtimes[shard.name] = rt

    def run(self, shard: ShardSpec, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        arrays = [np.ascontiguousarray(inputs[t.name], dtype=t.dtype) for t in shard.inputs]
        formats = ["nchw"] * len(arrays)  # ONNX layout; the toolkit refuses None for other ranks
        outs = self.runtimes[shard.name].inference(inputs=arrays, data_format=formats)
        if outs is None:
            raise RunError(f"{shard.name}: inference on NPU core {shard.core} returned nothing")
        return outputs_by_name(shard, outs)

    def close(self) -> None:
        for rt in self.runtimes.values():
            rt.release()
        self.runtimes.clear()
