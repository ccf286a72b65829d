"""cuda: each stage's ONNX run as torch operations (shard.runtime.executors.torch_graph), captured as a
CUDA graph on its stream. Any NVIDIA GPU with torch runs a thor or cuda bundle this way, without
TensorRT: what is measured on a GPU machine, and the fallback on a Thor whose TensorRT mishandles
a precision."""

from __future__ import annotations

import os
from pathlib import Path

import onnx

from shard.bundle import Manifest, ShardSpec
from shard.runtime.executors import OnDevice, each_core
from shard.runtime.executors.gpu import StreamExecutor, require_cuda, stage_edges
from shard.runtime.executors.torch_graph import TorchGraph


def make(bundle: Path, manifest: Manifest, placements: dict[int, list[ShardSpec]],
         on_device: OnDevice = OnDevice()) -> dict:
    """A CUDA stream per core (pipeline stage), its stages captured as CUDA graphs, run by torch."""
    leaving, entering = stage_edges(manifest, on_device)
    return each_core(placements, lambda core, shards: CudaExecutor(bundle, shards, leaving, entering=entering,
                                                                   writes=on_device.writes))


COMPILE = "SHARD_TORCH_COMPILE"   # 0: the eager form only (loads in seconds; no torch.compile)
RECOMPILE_LIMIT = 1024


def compiles(device: str) -> bool:
    """Whether each stage is also tried through torch.compile (Triton kernels that fuse its elementwise
    ops), the faster of the two kept: on a GPU, unless SHARD_TORCH_COMPILE=0."""
    return device != "cpu" and os.environ.get(COMPILE, "1") != "0"


def compiled_form(graph: TorchGraph, order: list[int], fused: bool = True):
    """The stage through torch.compile (its fused steps as they are, or in plain ops: TorchGraph.unfused),
    called with the stage's inputs in the manifest's order."""
    import torch

    compiled = torch.compile(graph if fused else graph.unfused, dynamic=False)

    def run(inputs):
        # every stage is one more compile of TorchGraph.__call__: past dynamo's limit of 8 a code object,
        # later stages would silently run eager
        with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT):
            return compiled(*[inputs[k] for k in order])
    return run


class CudaExecutor(StreamExecutor):
    def __init__(self, bundle: Path, shards: list[ShardSpec], leaving: set[str], device: str = "cuda",
                 graphs: bool = True, entering: set[str] = frozenset(), writes: dict | None = None):
        if device == "cuda":
            require_cuda()

        def make_stage(shard: ShardSpec, buffers: list):
            graph = TorchGraph(onnx.load(str(bundle / shard.onnx)), device, shard.name)
            order = [[t.name for t in shard.inputs].index(name) for name in graph.inputs]
            forms = {"eager": lambda inputs: graph(*[inputs[k] for k in order])}
            if compiles(device):
                forms["compiled"] = compiled_form(graph, order)
                if graph.plain_steps:   # torch.compile's own attention can beat the fused kernel (few rows)
                    forms["compiled (attention as ops)"] = compiled_form(graph, order, fused=False)
            return forms

        super().__init__(bundle, shards, leaving, make_stage, device, graphs, entering, writes)
