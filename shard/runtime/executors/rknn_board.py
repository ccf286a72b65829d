"""board: rknn-toolkit-lite2 on a Rockchip board; one executor per NPU core, each runtime bound with its
core mask. The chip's core count comes from the bundle (its profile's `cores`): RK3588 has 3,
RK3576 2, the others one core, whose runtime takes the default mask (NPU_CORE_AUTO)."""

from __future__ import annotations

import statistics
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from shard.bundle import Manifest, ShardSpec
from shard.errors import RunError, TargetError
from shard.runtime.executors import each_core, npu_inputs, outputs_by_name


def import_rknnlite():
    try:
        from rknnlite.api import RKNNLite
    except ImportError:
        raise TargetError("the board backend needs rknn-toolkit-lite2 on a Rockchip board "
                          "(pip install rknn-toolkit-lite2 there); on x86 use --backend sim") from None
    return RKNNLite


def core_mask(rknnlite, chip: str, cores: int, core: int):
    """The runtime's core mask for NPU core `core` of a chip with `cores` cores."""
    if not 0 <= core < cores:
        raise RunError(f"{chip} has NPU cores {', '.join(map(str, range(cores)))}; there is no core {core}")
    if cores == 1:
        return rknnlite.NPU_CORE_AUTO
    return [rknnlite.NPU_CORE_0, rknnlite.NPU_CORE_1, rknnlite.NPU_CORE_2][core]


@contextmanager
def loaded(artifact: Path, chip: str, cores: int, core: int = 0):
    """One .rknn loaded on NPU core `core` of this board, released after."""
    RKNNLite = import_rknnlite()
    rt = RKNNLite()
    try:
        if rt.load_rknn(str(artifact)) != 0 or rt.init_runtime(core_mask=core_mask(RKNNLite, chip, cores, core)) != 0:
            raise RunError("load_rknn/init_runtime failed on the board")
        yield rt
    finally:
        rt.release()


def run_loaded(rt, arrays: list[np.ndarray], formats: list[str] | None = None,
               what: str = "inference on the board") -> list[np.ndarray]:
    """One inference on `arrays`, each in its layout of `formats` (ONNX's, "nchw", unless given: the
    toolkit refuses None for other ranks); where one is float16 (npu_inputs), every array's dtype
    named (data_type), so that none is read as another type. `what` names the run where it fails."""
    halves = any(a.dtype == np.float16 for a in arrays)
    outs = rt.inference(inputs=arrays, data_type=[a.dtype.name for a in arrays] if halves else None,
                        data_format=formats or ["nchw"] * len(arrays))
    if outs is None:
        raise RunError(f"{what} returned nothing")
    return [np.asarray(out) for out in outs]


def infer_once(artifact: Path, arrays: list[np.ndarray], chip: str, cores: int, core: int = 0) -> list[np.ndarray]:
    """One .rknn loaded on NPU core `core` of this board and run once on `arrays` (ONNX layout): what
    `shard probe --on-board` checks each clean point with, here or on a Ray node that owns the board."""
    with loaded(artifact, chip, cores, core) as rt:
        return run_loaded(rt, arrays)


def time_inference(artifact: Path, arrays: list[np.ndarray], chip: str, cores: int, core: int = 0,
                   runs: int = 30) -> float:
    """The median seconds of one `inference` on `arrays` (ONNX layout) of one .rknn loaded on NPU core
    `core`, after a first run: the inputs set, the run and the outputs got, as a shard's run takes them
    (what `shard probe --on-board` times the hand-off with: shard.probes.handoff)."""
    with loaded(artifact, chip, cores, core) as rt:
        seconds = []
        for _ in range(runs + 1):
            start = time.perf_counter()
            run_loaded(rt, arrays)
            seconds.append(time.perf_counter() - start)
        return statistics.median(seconds[1:])


def make(bundle: Path, manifest: Manifest, placements: dict[int, list[ShardSpec]]) -> dict:
    """One RKNNLite runtime per shard and core, bound with that core's mask."""
    cores = manifest.profile.get("cores", 3)   # bundles made before profiles named it were RK3588's
    return each_core(placements, lambda core, shards: RknnBoardExecutor(bundle, shards, core, manifest.target, cores))


class RknnBoardExecutor:
    def __init__(self, bundle: Path, shards: list[ShardSpec], core: int, chip: str, cores: int):
        RKNNLite = import_rknnlite()
        mask = core_mask(RKNNLite, chip, cores, core)
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
        outs = run_loaded(self.runtimes[shard.name], *npu_inputs(shard, inputs),
                          what=f"{shard.name}: inference on NPU core {self.core}")
        return outputs_by_name(shard, outs)

    def close(self) -> None:
        for rt in self.runtimes.values():
            rt.release()
        self.runtimes.clear()
