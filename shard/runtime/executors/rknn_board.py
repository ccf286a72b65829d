"""board: rknn-toolkit-lite2 on an RK3588; one executor per NPU core, each runtime bound with its core mask."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from shard.bundle import ShardSpec
from shard.errors import RunError, TargetError
from shard.runtime.executors import npu_inputs, outputs_by_name


def import_rknnlite():
    try:
        from rknnlite.api import RKNNLite
    except ImportError:
        raise TargetError("the board backend needs rknn-toolkit-lite2 on an RK3588 board "
                          "(pip install rknn-toolkit-lite2 there); on x86 use --backend sim") from None
    return RKNNLite


NPU_CORES = 3


class RknnBoardExecutor:
    def __init__(self, bundle: Path, shards: list[ShardSpec], core: int):
        if not 0 <= core < NPU_CORES:
            raise RunError(f"the RK3588 has NPU cores 0, 1 and 2; there is no core {core}")
        RKNNLite = import_rknnlite()
        mask = [RKNNLite.NPU_CORE_0, RKNNLite.NPU_CORE_1, RKNNLite.NPU_CORE_2][core]
        self.core = core
        self.runtimes = {}
        try:
            for shard in shards:
                rt = RKNNLite()
                self.runtimes[shard.name] = rt
                if rt.load_rknn(str(bundle / shard.artifact)) != 0:
                    raise RunError(f"{shard.name}: load_rknn failed for {shard.artifact}")
                if rt.init_runtime(core_mask=mask) != 0:
                    raise RunError(f"{shard.name}: init_runtime failed on NPU core {core}")
        except BaseException:
            self.close()
            raise

    def run(self, shard: ShardSpec, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        arrays = npu_inputs(shard, inputs)
        formats = ["nchw"] * len(arrays)  # ONNX layout; the toolkit refuses None for other ranks
        outs = self.runtimes[shard.name].inference(inputs=arrays, data_format=formats)
        if outs is None:
            raise RunError(f"{shard.name}: inference on NPU core {self.core} returned nothing")
        return outputs_by_name(shard, outs)

    def close(self) -> None:
        for rt in self.runtimes.values():
            rt.release()
        self.runtimes.clear()
