"""The pipeline machinery the GPU executors share: one CUDA stream per "core" (pipeline stage), each
stage's inputs and outputs in fixed device buffers, and the stage captured once as a CUDA graph.

The scheduler gives every stream its own thread, so stage k of frame t+1 is enqueued while stage
k+1 of frame t runs on its own stream; a thread waits only for its own stream. Tensors passed
between stages stay on the GPU (a device-to-device copy out of the stage's fixed buffers, so the
next replay cannot overwrite what a later stage has not read yet); only the bundle's outputs come
back to the host as numpy. Imports torch, which the cuda and tensorrt executors need anyway.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np

from shard.bundle import ShardSpec
from shard.errors import RunError
from shard.runtime.executors import edge_input

Stage = Callable[[list], list]   # fixed input buffers -> output tensors (the same buffers every call)


def require_cuda(who: str = "the cuda and tensorrt backends", instead: str = "run this bundle with --backend cpu"):
    try:
        import torch
    except ImportError:
        raise RunError(f"{who} need torch with CUDA: pip install torch") from None
    if not torch.cuda.is_available():
        raise RunError(f"{who} need an NVIDIA GPU: torch.cuda.is_available() is False here; {instead}")
    return torch


class StreamExecutor:
    """The stages one stream runs. make_stage(shard, input buffers) returns the stage's callable."""

    def __init__(self, bundle: Path, shards: list[ShardSpec], leaving: set[str],
                 make_stage: Callable[[ShardSpec, list], Stage], device: str = "cuda", graphs: bool = True):
        import torch

        self.torch = torch
        self.leaving = leaving              # tensors that leave the bundle (outputs, host steps): numpy
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        self.prepared: dict[str, tuple[list, list, object]] = {}
        for shard in shards:
            self.prepared[shard.name] = self._prepare(shard, make_stage, graphs and self.cuda)

    def _prepare(self, shard: ShardSpec, make_stage, capture: bool) -> tuple[list, list, object]:
        torch = self.torch
        inputs = [torch.zeros(shard.edge_shapes.get(t.name, t.shape), dtype=getattr(torch, t.dtype), device=self.device)
                  for t in shard.inputs]
        stage = make_stage(shard, inputs)
        with torch.no_grad(), self._on_stream():
            outputs = stage(inputs)          # warm-up: kernels chosen, lazy initialisation done
            outputs = stage(inputs)
        if not capture:
            return inputs, outputs, stage
        self.stream.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.no_grad(), torch.cuda.graph(graph, stream=self.stream):
            outputs = stage(inputs)
        return inputs, outputs, graph

    def _on_stream(self):
        import contextlib

        return self.torch.cuda.stream(self.stream) if self.cuda else contextlib.nullcontext()

    def run(self, shard: ShardSpec, inputs: dict) -> dict:
        torch = self.torch
        buffers, outputs, replay = self.prepared[shard.name]
        with torch.no_grad(), self._on_stream():
            for buffer, spec in zip(buffers, shard.inputs):
                value = inputs[spec.name]
                if isinstance(value, np.ndarray):
                    value = torch.from_numpy(np.ascontiguousarray(edge_input(shard, spec, value)))
                buffer.copy_(value.reshape(buffer.shape), non_blocking=True)
            if isinstance(replay, torch.cuda.CUDAGraph):
                replay.replay()
                results = [o.clone() for o in outputs]
            else:
                results = [o.clone() for o in replay(buffers)]
        if self.cuda:
            self.stream.synchronize()
        return {spec.name: to_numpy(r, spec) if spec.name in self.leaving else r.reshape(spec.shape)
                for spec, r in zip(shard.outputs, results)}

    def close(self) -> None:
        self.prepared.clear()


def to_numpy(value, spec=None) -> np.ndarray:
    array = value.detach().cpu().numpy()
    return array.reshape(spec.shape).astype(spec.dtype, copy=False) if spec is not None else array

