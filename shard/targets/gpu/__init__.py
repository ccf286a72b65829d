"""GPU targets: Jetson Thor (`thor`, TensorRT on the board) and any NVIDIA GPU with torch (`cuda`).

Compile writes, per pipeline stage, a strongly typed ONNX (fp16, explicit FP8 Q/DQ where the
precision asks for it) and the recipe its TensorRT engine is built with; engines are built on the
device that runs them (`shard build-engines`, shard.targets.gpu.engines). The `cuda` executor runs
the same stage files through torch, so a bundle runs, and is measured, without TensorRT.

The two targets differ only in their profile: thor.json holds Thor's published figures, a `cuda`
profile what `shard probe --target cuda` measured on the GPU at hand (shard.probes.cuda).
"""

from __future__ import annotations

from shard.targets import LogsOnly

PIPELINE = ("canonicalize", "strong_types", "fp8_linears", "stages")
MIN_OPSET = 19            # QuantizeLinear takes FP8 from opset 19
WORKSPACE_BYTES = 4 << 30


class GpuTarget:
    executors = ("cuda", "tensorrt", "cpu")
    artifact_suffix = None     # engines are built on the device: shard build-engines
    vendor = False             # no vendor build at compile time to stand beside
    precisions = ("fp16", "fp8")
    pipeline = PIPELINE
    min_opset = MIN_OPSET
    stage_streams = True       # one stream per stage: shard k runs on "core" (stream) k
    build_memory = False       # engines are built on the device, one at a time

    def __init__(self, name: str):
        self.name = name

    def build_options(self, options) -> dict:
        """The engine recipe every stage shares: a strongly typed network (what TensorRT 11 requires and
        10 accepts), so the ONNX's types and Q/DQ decide each layer's precision; for TensorRT 10
        weakly typed builds, the flags that ask for the same. One timing cache for all stages."""
        precision = options.precision if options is not None else "fp16"
        return {"precision": precision,
                "tensorrt": {"strongly_typed": True, "workspace_bytes": WORKSPACE_BYTES,
                             "timing_cache": "engines/timing.cache", "profiling_verbosity": "DETAILED",
                             "weakly_typed_flags": ["FP16", "FP8"] if precision == "fp8" else ["FP16"]}}

    def build_for(self, build: dict, precision: str, float16=None) -> dict:
        return build

    def check_environment(self) -> None:
        pass   # compiling needs no TensorRT; building engines does (shard build-engines says so)

    def toolchain(self) -> str:
        return ""   # engines are built on the device

    def pass_toolkit(self, profile, options):
        return None

    def edge_layouts(self, log, inputs, outputs) -> tuple[dict, dict]:
        return {}, {}

    def builds(self, workers: int, timeout: float, cache, log_dir) -> LogsOnly:
        return LogsOnly(f"{self.name}: stage ONNX written; its TensorRT engine is built on the device by "
                        f"`shard build-engines` with the recipe in the manifest")
