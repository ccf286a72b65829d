"""tensorrt: each stage a TensorRT engine built on this device (`shard build-engines`), one execution
context per stage on its stream, its enqueue captured as a CUDA graph.

Written against TensorRT 10's Python API (tensor-address execution, execute_async_v3); never run
here: no machine this project reaches can install TensorRT. It shares the stream machinery with the
cuda executor (shard.runtime.executors.gpu)."""

from __future__ import annotations

from pathlib import Path

from shard.bundle import Manifest, ShardSpec
from shard.errors import RunError
from shard.runtime.executors import OnDevice, each_core
from shard.runtime.executors.gpu import StreamExecutor, require_cuda, stage_edges


def import_tensorrt(who: str = "the tensorrt backend"):
    try:
        import tensorrt
    except ImportError:
        raise RunError(f"{who} needs TensorRT's Python package (on Thor: JetPack's python3-libnvinfer; elsewhere "
                       f"NVIDIA's tensorrt wheel); without it run the bundle with --backend cuda") from None
    return tensorrt


def make(bundle: Path, manifest: Manifest, placements: dict[int, list[ShardSpec]],
         on_device: OnDevice = OnDevice()) -> dict:
    """A CUDA stream per core (pipeline stage), each stage a TensorRT engine built on this device."""
    leaving, entering = stage_edges(manifest, on_device)
    return each_core(placements, lambda core, shards: TensorRTExecutor(bundle, shards, leaving, entering,
                                                                       on_device.writes))


class TensorRTExecutor(StreamExecutor):
    def __init__(self, bundle: Path, shards: list[ShardSpec], leaving: set[str], entering: set[str] = frozenset(),
                 writes: dict | None = None):
        trt = import_tensorrt()
        torch = require_cuda()
        runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
        self.engines = []   # engines and contexts live as long as the executor

        def make_stage(shard: ShardSpec, buffers: list):
            if not shard.artifact:
                raise RunError(f"stage {shard.name} has no engine: run `shard build-engines {bundle}` on this device")
            engine = runtime.deserialize_cuda_engine((bundle / shard.artifact).read_bytes())
            if engine is None:
                raise RunError(f"stage {shard.name}: TensorRT cannot load {shard.artifact} (built by another "
                               f"TensorRT version or on another GPU); run `shard build-engines {bundle}` again here")
            context = engine.create_execution_context()
            outputs = [torch.empty(t.shape, dtype=getattr(torch, t.dtype), device="cuda") for t in shard.outputs]
            for spec, buffer in zip(shard.inputs, buffers):
                context.set_input_shape(spec.name, tuple(buffer.shape))
                context.set_tensor_address(spec.name, buffer.data_ptr())
            for spec, buffer in zip(shard.outputs, outputs):
                context.set_tensor_address(spec.name, buffer.data_ptr())
            self.engines.append((engine, context))

            def run(inputs: list) -> list:
                if not context.execute_async_v3(torch.cuda.current_stream().cuda_stream):
                    raise RunError(f"stage {shard.name}: TensorRT's execute_async_v3 failed")
                return outputs
            return run

        super().__init__(bundle, shards, leaving, make_stage, entering=entering, writes=writes)

    def close(self) -> None:
        super().close()
        self.engines.clear()
