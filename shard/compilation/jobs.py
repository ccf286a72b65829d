"""What the vendor builds: each shard's file and job (its unrewritten twin, its edges relaid, the vendor
alone's model as it came), and the quantization samples they are built from."""

from __future__ import annotations

import gc
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from shard.calibration import calibration_samples, run_each
from shard.compilation.names import RELAID, UNREWRITTEN, VENDOR_ALONE, Progress
from shard.graph import as_model, relayout, release_weights, save_onnx, tensor_spec
from shard.passes import PassContext
from shard.precision import float16_names
from shard.runtime.host import run_host
from shard.targets import ShardJob


def quantization_values(ctx: PassContext, graph: gs.Graph, canonical: gs.Graph | None, plans: list,
                        originals: list, progress: Progress) -> tuple[dict[str, list[np.ndarray]], list[dict]]:
    """Every shard input's value on each calibration sample, from onnxruntime: the rewritten graph
    (after the host's steps) for the shards, the canonical one for inputs only the unrewritten twins
    have; the model's inputs themselves for the vendor alone. Also the rewritten graph's inputs per
    sample (the host's steps run), which mixed precision ranks its linears on."""
    samples = calibration_samples(ctx, ctx.model_inputs or [tensor_spec(t) for t in graph.inputs])
    progress("calibration values of the shards' inputs", 0, 1)
    values = {name: [s[name] for s in samples] for name in samples[0]}
    feeds = [run_host(ctx.host_pre, dict(sample), ctx.host_tables) for sample in samples]
    wanted = [t.name for plan in plans for t in plan.inputs]
    for runs, graph_, wanted_ in ((feeds, graph, wanted), (samples, canonical, [
            t.name for plan in originals if plan is not None for t in plan.inputs])):
        names = [n for n in dict.fromkeys(wanted_) if n not in values]
        if not names or graph_ is None:
            continue
        known = {t.name for t in graph_.inputs}
        for name in names:
            if name in known:
                values[name] = [run[name] for run in runs]
        names = [n for n in names if n not in values]
        if names:
            model = gs.export_onnx(graph_.copy(), do_type_check=False)
            for got in run_each(model, runs, names):
                for name, value in got.items():
                    values.setdefault(name, []).append(value)
    progress("calibration values of the shards' inputs", 1, 1)
    return values, feeds


@dataclass
class Datasets:
    """Quantization samples of shard inputs as .npy files (the vendor's list file names them), one
    set per tensor and shape, written once however many builds take the tensor."""

    root: Path
    values: dict[str, list[np.ndarray]]
    precision: str
    promoted: set[str] = field(default_factory=set)   # mixed: linears kept in fp16
    written: dict[tuple, list[Path]] = field(default_factory=dict)

    def files(self, inputs: list[tuple[str, list[int]]]) -> list[list[Path]]:
        """[sample][input] paths for a shard's inputs in order, each value in the given shape."""
        columns = []
        for name, shape in inputs:
            key = (name, tuple(shape))
            if key not in self.written:
                folder = self.root / str(len(self.written))
                folder.mkdir()
                self.written[key] = []
                for k, value in enumerate(self.values[name]):
                    value = np.asarray(value).reshape(shape)
                    self.written[key].append(folder / f"{k}.npy")
                    np.save(self.written[key][-1], value.astype(np.float32) if value.dtype == np.float64 else value)
            columns.append(self.written[key])
        return [list(sample) for sample in zip(*columns)]


def write_vendor_alone(model: onnx.ModelProto, staging: Path, keep: bool = True) -> None:
    """The model as it came (its input shapes fixed) as the vendor alone's file. keep: a model whose
    weights the file took into external data (past 2 GiB) reads them back, for the passes."""
    if save_onnx(model, staging / "shards" / f"{VENDOR_ALONE}.onnx") and keep:
        onnx.load_external_data_for_model(model, str(staging / "shards"))


def vendor_alone_job(staging: Path, logs: Path, tgt, inputs: list, datasets: Datasets | None = None) -> ShardJob:
    """The build of the model as it came (its file already written, with `inputs`); mixed is shard's
    own recipe, so the vendor alone quantizes the whole model to int8. A crash is not recovered."""
    job = shard_job(staging, logs, tgt, VENDOR_ALONE, inputs, datasets)
    job.recover = False   # what the vendor alone gives: its crash stands
    if job.precision == "mixed":
        job.precision, job.float16 = "int8", None
    return job


def write_jobs(staging: Path, logs: Path, tgt, plans: list, originals: list, opset: int, progress: Progress,
               datasets: Datasets | None = None, release: tuple[gs.Graph, ...] = ()) -> Iterator[ShardJob]:
    """The shard builds to make, each as soon as its file is written: each shard and, where the
    passes changed it, its unrewritten twin; quantized builds get their inputs' samples. release:
    the graphs whose weights go as the shards are written (graph.release_weights), each once no
    shard still to be written reads it."""
    versions = [[v for v in pair if v is not None] for pair in zip(plans, originals)]
    if release:   # the passes' discarded graphs still hold weights: collected once, not once a shard
        gc.collect()
    for k, (plan, original) in enumerate(zip(plans, originals)):
        progress("write shards", k, len(plans))
        for name, version in ((plan.name, plan), (f"{plan.name}{UNREWRITTEN}", original)):
            if version is not None:
                sub = gs.Graph(nodes=version.nodes, inputs=version.inputs, outputs=version.outputs, opset=opset,
                               name=plan.name)
                yield write_job(staging, logs, tgt, name, as_model(sub, tgt.max_opset), datasets, version.nodes)
        if release:
            release_weights(*release, still_read=[v.nodes for later in versions[k + 1:] for v in later])


def write_job(staging: Path, logs: Path, tgt, name: str, model, datasets: Datasets | None = None,
              nodes: list | None = None) -> ShardJob:
    save_onnx(model, staging / "shards" / f"{name}.onnx")
    if nodes is None and datasets is not None and datasets.precision == "mixed":
        nodes = gs.import_onnx(model).nodes
    return shard_job(staging, logs, tgt, name, data_inputs(model.graph), datasets, nodes)


def data_inputs(graph: onnx.GraphProto) -> list[tuple[str, list[int]]]:
    """(name, shape) of each input a graph is fed (old exports list their weights as inputs too)."""
    weights = {t.name for t in graph.initializer}
    return [(i.name, [d.dim_value for d in i.type.tensor_type.shape.dim]) for i in graph.input if i.name not in weights]


def shard_job(staging: Path, logs: Path, tgt, name: str, inputs: list[tuple[str, list[int]]],
              datasets: Datasets | None = None, nodes: list | None = None) -> ShardJob:
    """The build of staging/shards/NAME.onnx, fed `inputs` (data_inputs); `nodes`, its nodes, for
    mixed precision's fp16 list."""
    onnx_path = staging / "shards" / f"{name}.onnx"
    artifact = staging / "shards" / f"{name}{tgt.artifact_suffix}" if tgt.artifact_suffix else None
    job = ShardJob(name=name, onnx=onnx_path, artifact=artifact, log=logs / f"{name}.log")
    if datasets is not None:
        job.precision, job.dataset = datasets.precision, datasets.files(inputs)
        if datasets.precision == "mixed":
            job.float16 = float16_names(nodes or [], datasets.promoted, [name for name, _ in inputs])
    return job


def relayout_jobs(staging: Path, logs: Path, tgt, chosen: list, datasets: Datasets | None = None
                  ) -> list[tuple[ShardJob, dict]]:
    """For each kept build whose log shows the vendor reshaping an edge on the CPU: a job building the
    shard with that edge in the vendor's 4-D layout, and the input shapes the runtime then feeds."""
    relaid = []
    for built, plan in chosen:
        inputs, outputs = tgt.edge_layouts(logs / f"{built}.log", {t.name: [int(d) for d in t.shape] for t in plan.inputs},
                                           {t.name: [int(d) for d in t.shape] for t in plan.outputs})
        if inputs or outputs:
            model = relayout(onnx.load(str(staging / "shards" / f"{built}.onnx")), inputs, outputs)
            relaid.append((write_job(staging, logs, tgt, f"{built}{RELAID}", model, datasets), inputs))
    return relaid
