"""cpu: the shard ONNX files are the artifacts; onnxruntime runs them. The reference target."""

from __future__ import annotations

from shard.passes import PIPELINE
from shard.passes.canonicalize import MIN_OPSET
from shard.targets import LogsOnly


class CpuTarget:
    name = "cpu"
    executors = ("cpu",)
    artifact_suffix = None
    vendor = False
    precisions = ("fp32",)
    pipeline = tuple(PIPELINE)
    min_opset = MIN_OPSET
    stage_streams = False
    build_memory = False   # nothing to build: onnxruntime runs the shard files

    def build_options(self, options) -> dict:
        return {}

    def build_for(self, build: dict, precision: str, float16=None) -> dict:
        return build

    def check_environment(self) -> None:
        pass

    def toolchain(self) -> str:
        return ""   # onnxruntime runs the shard files as they are

    def pass_toolkit(self, profile, options):
        return None

    def edge_layouts(self, log, inputs, outputs) -> tuple[dict, dict]:
        return {}, {}  # onnxruntime takes any shape as it is

    def builds(self, workers: int, timeout: float, cache, log_dir) -> LogsOnly:
        return LogsOnly("cpu target: the shard ONNX file is run as is by onnxruntime")
