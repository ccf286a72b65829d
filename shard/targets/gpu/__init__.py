"""GPU targets: Jetson Thor (`thor`, TensorRT on the board) and any NVIDIA GPU with torch (`cuda`).

Compile writes, per pipeline stage, a strongly typed ONNX (fp16, explicit FP8 Q/DQ or INT4 weights
behind a blocked DequantizeLinear where the precision asks for it) and the recipe its TensorRT engine is built with; engines are built on the
device that runs them (`shard build-engines`, shard.targets.gpu.engines). The `cuda` executor runs
the same stage files through torch, so a bundle runs, and is measured, without TensorRT.

The two targets differ only in their profile: thor.json holds Thor's published figures, a `cuda`
profile what `shard probe --target cuda` measured on the GPU at hand (shard.probes.cuda).
"""

from __future__ import annotations

from shard.passes import canonicalize, fp8_linears, strong_types, w4a16_linears
from shard.targets import Target
from shard.targets.gpu import stages
from shard.targets.gpu.replica import torch_runner

# Its passes, in order: strongly typed stages of equal predicted time.
PIPELINE = (canonicalize.canonicalize, strong_types.strong_types, fp8_linears.fp8_linears,
            w4a16_linears.w4a16_linears, stages.stages)

MIN_OPSET = 19            # QuantizeLinear takes FP8 from opset 19
WORKSPACE_BYTES = 4 << 30


class GpuTarget(Target):
    executors = ("cuda", "tensorrt", "cpu")
    artifact_suffix = None     # engines are built on the device: shard build-engines
    vendor = False             # no vendor build at compile time to stand beside
    precisions = ("fp16", "fp8", "w4a16")
    pipeline = PIPELINE
    min_opset = MIN_OPSET
    max_opset = w4a16_linears.OPSET   # w4a16's blocked INT4 DequantizeLinear; a newer model is lowered to 21
    #                                   (TensorRT 11's ONNX parser takes opsets up to 25)
    stage_streams = True       # one stream per stage: shard k runs on "core" (stream) k
    # compiling needs no TensorRT (check_environment, toolchain: none); building engines does
    build_note = ("stage ONNX written; its TensorRT engine is built on the device by `shard build-engines` "
                  "with the recipe in the manifest")

    def __init__(self, name: str):
        self.name = name

    def replica_runner(self, model, outputs: list[str]):
        """A search's replica (fp8_linears', w4a16_linears') in torch on the GPU, where this machine has one."""
        return torch_runner(model, outputs)

    def build_options(self, options) -> dict:
        """The engine recipe every stage shares: a strongly typed network (what TensorRT 11 requires and
        10 accepts), so the ONNX's types and Q/DQ decide each layer's precision; for TensorRT 10
        weakly typed builds, the flags that ask for the same. One timing cache for all stages."""
        precision = options.precision if options is not None else "fp16"
        return {"precision": precision,
                "tensorrt": {"strongly_typed": True, "workspace_bytes": WORKSPACE_BYTES,
                             "timing_cache": "engines/timing.cache", "profiling_verbosity": "DETAILED",
                             "weakly_typed_flags": ["FP16", "FP8"] if precision == "fp8" else ["FP16"]}}
