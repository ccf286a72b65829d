"""cpu: the shard ONNX files are the artifacts; onnxruntime runs them. The reference target."""

from __future__ import annotations

from shard.passes import NPU_PIPELINE
from shard.passes.canonicalize import MIN_OPSET
from shard.targets import Target


class CpuTarget(Target):
    name = "cpu"
    pipeline = NPU_PIPELINE
    min_opset = MIN_OPSET
    build_note = "the shard ONNX file is run as is by onnxruntime"
