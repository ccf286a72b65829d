"""Calibration and test inputs, and what onnxruntime measures on them.

A sample file is an `.npz` whose arrays are named after the model's inputs, each with a leading
sample axis: `input_ids` of shape `[N, 1, 128]` holds N samples of a `[1, 128]` input, in the
dtype the model takes (token ids stay integers). `shard compile --calib` quantizes with them and
sizes the scale sandwiches from them; `shard verify --inputs` runs each of them. Without a file,
seeded random samples stand in: their ranges are those of unit normals and {0, 1} ids, not the
model's real inputs, so int8 scales and range sandwiches sized from them may not fit real data.

Statistics are collected one sample at a time (every float tensor of a transformer at once would
not fit in memory): per tensor its min, max and the absolute max of each channel of the last axis.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import onnx

from shard.errors import ShardError

RANDOM_SAMPLES = 8
RANDOM_WARNING = ("no --calib file: {n} seeded random samples stand in (unit normals, ids of 0 and 1); "
                  "ranges measured on them may not be those of real inputs, so int8 scales and range "
                  "sandwiches can be off. Pass --calib FILE.npz with real samples.")


@dataclass
class TensorStats:
    """What the samples made of one tensor: its range and the absolute max of each last-axis channel."""

    name: str
    min: float
    max: float
    channel_absmax: np.ndarray

    @property
    def absmax(self) -> float:
        return max(abs(self.min), abs(self.max))

    def update(self, value: np.ndarray) -> None:
        self.min = min(self.min, float(value.min()))
        self.max = max(self.max, float(value.max()))
        self.channel_absmax = np.maximum(self.channel_absmax, channel_absmax(value))


def channel_absmax(value: np.ndarray) -> np.ndarray:
    flat = np.abs(value.reshape(-1, value.shape[-1])) if value.ndim else np.abs(value.reshape(1, 1))
    return flat.max(axis=0).astype(np.float64) if flat.size else np.zeros(flat.shape[-1])


def load_samples(path: str | Path, inputs: list, flag: str = "--calib") -> list[dict[str, np.ndarray]]:
    """The samples of an .npz file, checked against the model's input specs (name, shape, dtype);
    one clear ShardError for the first thing wrong."""
    path = Path(path)
    try:
        with np.load(path, allow_pickle=False) as npz:
            arrays = {name: npz[name] for name in npz.files}
    except (OSError, ValueError) as exc:
        raise ShardError(f"{flag} {path}: cannot read it as .npz ({str(exc).splitlines()[0]})") from None
    expected = {spec.name: spec for spec in inputs}
    missing = [name for name in expected if name not in arrays]
    if missing:
        raise ShardError(f"{flag} {path}: no array named {missing[0]!r}; the model's inputs are "
                         f"{', '.join(expected)}, and the file has {', '.join(arrays) or 'no arrays'}")
    unknown = [name for name in arrays if name not in expected]
    if unknown:
        raise ShardError(f"{flag} {path}: array {unknown[0]!r} is not an input of the model "
                         f"(inputs: {', '.join(expected)})")
    counts = set()
    for name, spec in expected.items():
        array = arrays[name]
        if list(array.shape[1:]) != list(spec.shape) or array.ndim != len(spec.shape) + 1:
            raise ShardError(f"{flag} {path}: {name} has shape {list(array.shape)}; expected "
                             f"[N, {', '.join(str(d) for d in spec.shape)}] (N samples of the input's shape "
                             f"{list(spec.shape)})")
        if array.dtype != np.dtype(spec.dtype):
            raise ShardError(f"{flag} {path}: {name} is {array.dtype}; the model takes {spec.dtype} "
                             f"(save it with .astype(np.{spec.dtype}))")
        counts.add(array.shape[0])
    if len(counts) > 1:
        raise ShardError(f"{flag} {path}: the arrays hold different numbers of samples "
                         f"({', '.join(f'{n}: {arrays[n].shape[0]}' for n in expected)})")
    if counts == {0}:
        raise ShardError(f"{flag} {path}: no samples (the leading axis is 0)")
    return [{name: arrays[name][k] for name in expected} for k in range(counts.pop())]


def random_samples(inputs: list, n: int = RANDOM_SAMPLES, seed: int = 0) -> list[dict[str, np.ndarray]]:
    from shard.runtime import random_inputs

    return [random_inputs(inputs, seed + k) for k in range(n)]


def ort_session(model: onnx.ModelProto, extra_outputs: list[str] = (), optimize: bool = True):
    """onnxruntime over a model, also returning the named intermediate tensors; a model over 2 GB
    goes through a temporary file with its weights beside it. optimize=False: no graph fusions, so
    two graphs that differ by exact rewrites round alike."""
    import onnxruntime as ort

    model = onnx.ModelProto.FromString(model.SerializeToString()) if model.ByteSize() < 1_800_000_000 else model
    present = {o.name for o in model.graph.output}
    model.graph.output.extend(onnx.ValueInfoProto(name=n) for n in dict.fromkeys(extra_outputs) if n not in present)
    ort.set_default_logger_severity(3)  # its graph optimiser's warnings are not the user's business
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    if not optimize:
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    if model.ByteSize() < 1_800_000_000:
        return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    with tempfile.TemporaryDirectory(prefix="shard-ort-") as tmp:
        onnx.save(model, f"{tmp}/model.onnx", save_as_external_data=True, location="model.onnx.data")
        return ort.InferenceSession(f"{tmp}/model.onnx", opts, providers=["CPUExecutionProvider"])


def run_each(model: onnx.ModelProto, samples: list[dict[str, np.ndarray]], names: list[str],
             optimize: bool = True) -> Iterator[dict[str, np.ndarray]]:
    """For each sample, the named tensors (outputs or intermediate) of the model in onnxruntime."""
    session = ort_session(model, names, optimize)
    feeds = {i.name for i in session.get_inputs()}
    wanted = [n for n in dict.fromkeys(names) if n in {o.name for o in session.get_outputs()}]
    for sample in samples:
        yield dict(zip(wanted, session.run(wanted, {k: v for k, v in sample.items() if k in feeds})))


def float_tensors(model: onnx.ModelProto) -> list[str]:
    """The names of every float tensor a node makes (what range statistics are kept for)."""
    inferred = onnx.shape_inference.infer_shapes(model) if model.ByteSize() < 1_800_000_000 else model
    floats = {v.name for v in (*inferred.graph.value_info, *inferred.graph.output)
              if v.type.tensor_type.elem_type in (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16)}
    return [o for node in model.graph.node for o in node.output if o in floats]


def collect_stats(model: onnx.ModelProto, samples: list[dict[str, np.ndarray]],
                  names: list[str] | None = None) -> dict[str, TensorStats]:
    """Range statistics of the named tensors (default: every float tensor, the inputs included) over
    the samples."""
    every = names is None
    names = float_tensors(model) if every else names
    stats: dict[str, TensorStats] = {}
    for sample, values in zip(samples, run_each(model, samples, names)):
        inputs = {k: v for k, v in sample.items() if every or k in names}
        for name, value in {**inputs, **values}.items():
            if not isinstance(value, np.ndarray) or value.dtype.kind != "f" or not value.size:
                continue
            if name in stats:
                stats[name].update(value)
            else:
                stats[name] = TensorStats(name, float(value.min()), float(value.max()), channel_absmax(value))
    return stats


def calibration_samples(ctx, inputs: list) -> list[dict[str, np.ndarray]]:
    """The compile's samples (kept in the pass context): the --calib file checked against the model's
    inputs, or seeded random ones (RANDOM_SAMPLES where the precision quantizes, else one) and, for
    a quantized compile, a warning that says what that costs."""
    if ctx.samples is None:
        options = ctx.options
        if getattr(options, "calib", None):
            ctx.samples = load_samples(options.calib, inputs)
        elif getattr(options, "precision", "fp16") == "fp16":
            ctx.samples = random_samples(inputs, 1)
        else:
            ctx.samples = random_samples(inputs)
            ctx.warnings.append(RANDOM_WARNING.format(n=len(ctx.samples)))
    return ctx.samples
