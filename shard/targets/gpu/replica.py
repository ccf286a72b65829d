"""The GPU target's runner of a search's replica (fp8_linears' and w4a16_linears': a graph whose linears each go
to the lower precision behind a gate): torch on the GPU, where a round of the search takes seconds that
onnxruntime on a CPU takes minutes."""

from __future__ import annotations

import numpy as np
import onnx

from shard.errors import RunError
from shard.runtime.executors.gpu import require_cuda
from shard.runtime.executors.torch_graph import TorchGraph


def torch_runner(model: onnx.ModelProto, outputs: list[str]):
    """(gates, samples) -> [the model's outputs, for each sample] in torch on the GPU, `.where` saying
    so; None where there is no GPU or an op has no torch form (the pass then runs onnxruntime)."""
    try:
        torch = require_cuda()
        graph = TorchGraph(model, "cuda", "fp8 ranking", fuse=False)
    except RunError:
        return None
    picked = [graph.outputs.index(o) for o in outputs]

    def on_gpu(gates: np.ndarray, samples: list[dict]) -> list[list[np.ndarray]]:
        with torch.no_grad():
            gated = torch.from_numpy(gates).to("cuda")
            got = [graph(*(torch.from_numpy(np.ascontiguousarray(s[n])).to("cuda") for n in graph.inputs[:-1]), gated)
                   for s in samples]
        return [[g[k].float().cpu().numpy() for k in picked] for g in got]
    on_gpu.where = "torch on the GPU"
    return on_gpu
