"""Calibration and test inputs, and what onnxruntime measures on them.

A sample file is an `.npz` whose arrays are named after the model's inputs, each with a leading
sample axis: `input_ids` of shape `[N, 1, 128]` holds N samples of a `[1, 128]` input, in the
dtype the model takes (token ids stay integers). `shard compile --calib` quantizes with them and
sizes the scale sandwiches from them; `shard verify --inputs` runs each of them. Without a file,
seeded random samples stand in: their ranges are those of unit normals and {0, 1} ids, not the
model's real inputs, so int8 scales and range sandwiches sized from them may not fit real data.

Statistics are reductions added to the graph, so onnxruntime returns a few numbers per tensor (every
float tensor of a transformer at once would not fit in memory): per tensor its min, max and the
absolute max of each channel of the last axis.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import onnx

from shard import scratch
from shard.cache_folder import default_cache_dir, entry_file, store_entry
from shard.errors import ShardError
from shard.graph import fits_protobuf, float_ranks
from shard.options import CompileOptions
from shard.runtime import random_inputs

RANDOM_SAMPLES = 8
RANDOM_WARNING = ("no --calib file: {n} seeded random samples stand in (unit normals, ids of 0 and 1); "
                  "ranges measured on them may not be those of real inputs, so int8 and fp8 scales and range "
                  "sandwiches can be off. Pass --calib FILE.npz with real samples.")


@dataclass
class TensorStats:
    """What the samples made of one tensor: its range and the absolute max of each last-axis channel
    (one value, the whole tensor's, where collect_stats was asked for no channels)."""

    name: str
    min: float
    max: float
    channel_absmax: np.ndarray

    @property
    def absmax(self) -> float:
        return max(abs(self.min), abs(self.max))


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
    return [random_inputs(inputs, seed + k) for k in range(n)]


# Ops an integer input passes through on its way to a lookup table (the ids' dtype and layout).
TO_TABLE = ("Cast", "Reshape", "Unsqueeze", "Squeeze", "Flatten")


def table_rows(tensor, depth: int = 4) -> int | None:
    """The rows of the constant table a tensor indexes (a Gather's indices, through casts and
    reshapes), or None where it indexes none."""
    import onnx_graphsurgeon as gs

    for user in tensor.outputs:
        if user.op == "Gather" and user.inputs[1] is tensor and isinstance(user.inputs[0], gs.Constant):
            return int(user.inputs[0].shape[user.attrs.get("axis", 0)])
        if depth and user.op in TO_TABLE and user.outputs:
            rows = table_rows(user.outputs[0], depth - 1)
            if rows is not None:
                return rows
    return None


def domain_samples(graph, inputs: list, n: int, seed: int = 0) -> list[dict[str, np.ndarray]]:
    """Seeded inputs of the model's own domain: token ids drawn from the table they index (its
    vocabulary: ids of 0 and 1 are special tokens a trained model rarely sees), other integers (an
    attention mask) ones, floats unit normals."""
    tensors = graph.tensors()
    samples = random_samples(inputs, n, seed)   # floats as the seeded calibration samples have them
    for k, sample in enumerate(samples):
        rng = np.random.default_rng(seed + k)
        for spec in inputs:
            dtype = np.dtype(spec.dtype)
            if dtype.kind in "iub":
                rows = table_rows(tensors[spec.name]) if spec.name in tensors and dtype.kind != "b" else None
                sample[spec.name] = rng.integers(0, rows, spec.shape).astype(dtype) if rows else np.ones(spec.shape, dtype)
    return samples


def ort_session(model: onnx.ModelProto | Path, extra_outputs: list[str] = (), optimize: bool = True):
    """onnxruntime over a model, also returning the named intermediate tensors; a model over 2 GB
    goes through a temporary file with its weights beside it; a model's file (a Path) is read by
    onnxruntime itself, its outputs only (no proto and no serialized copy beside onnxruntime's own).
    optimize=False: no graph fusions, so two graphs that differ by exact rewrites round alike."""
    import onnxruntime as ort

    on_disk = isinstance(model, Path)
    present = set() if on_disk else {o.name for o in model.graph.output}
    extra = [n for n in dict.fromkeys(extra_outputs) if n not in present]
    if on_disk and extra:
        raise ValueError("a model read from its file gives its own outputs only")
    small = on_disk or fits_protobuf(model)
    if extra:  # on a copy: the caller's model keeps its outputs
        copy = onnx.ModelProto()
        copy.CopyFrom(model)
        model = copy
        model.graph.output.extend(onnx.ValueInfoProto(name=n) for n in extra)
    ort.set_default_logger_severity(3)  # its graph optimiser's warnings are not the user's business
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    opts.enable_cpu_mem_arena = False  # one pass over a large model: no arena sized for its peak to keep
    # Each tensor's statistics as soon as it exists (stats_model): with the default order the
    # reductions of SigLIP-512's 455 tensors ran late and held their inputs, 6.4 GB against 2.5 GB.
    opts.execution_order = ort.ExecutionOrder.PRIORITY_BASED
    if not optimize:
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    if small:
        source = str(model) if on_disk else model.SerializeToString()
        return ort.InferenceSession(source, opts, providers=["CPUExecutionProvider"])
    with scratch.temporary("ort") as tmp:
        onnx.save(model, f"{tmp}/model.onnx", save_as_external_data=True, location="model.onnx.data")
        return ort.InferenceSession(f"{tmp}/model.onnx", opts, providers=["CPUExecutionProvider"])


def run_each(model: onnx.ModelProto, samples: list[dict[str, np.ndarray]], names: list[str],
             optimize: bool = True) -> Iterator[dict[str, np.ndarray]]:
    """For each sample, the named tensors (outputs or intermediate) of the model in onnxruntime."""
    session = ort_session(model, names, optimize)
    feeds = {i.name for i in session.get_inputs()}
    made = {o.name for o in session.get_outputs()}
    wanted = [n for n in dict.fromkeys(names) if n in made]
    for sample in samples:   # nothing wanted (a model of sequences and strings): nothing to run
        yield dict(zip(wanted, session.run(wanted, {k: v for k, v in sample.items() if k in feeds}))) if wanted else {}


def float_tensors(model: onnx.ModelProto) -> dict[str, int]:
    """Every float tensor a node makes, with its rank (-1 where shape inference does not know it)."""
    inferred = onnx.shape_inference.infer_shapes(model) if fits_protobuf(model) else model
    ranks = {v.name: len(v.type.tensor_type.shape.dim) if v.type.tensor_type.HasField("shape") else -1
             for v in (*inferred.graph.value_info, *inferred.graph.output)
             if v.type.tensor_type.elem_type in (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16)}
    return {o: ranks[o] for node in model.graph.node for o in node.output if o in ranks}


def stats_model(model: onnx.ModelProto, tensors: dict[str, int], channels: bool = True
                ) -> tuple[onnx.ModelProto, dict[str, tuple]]:
    """The model with its outputs replaced by each tensor's min, max and per-channel absolute max
    (reductions added to the graph): onnxruntime then returns a few numbers per tensor instead of
    every activation (a SigLIP-512 forward pass holds gigabytes of them). channels=False: no
    per-channel maximum (TensorStats.channel_absmax is then the tensor's absolute maximum alone):
    onnxruntime's reductions over the leading axes are the slow part, SigLIP-512's statistics take
    3.5 s without them against 6 s (the forward pass alone: 2 s)."""
    from onnx import helper

    out = onnx.ModelProto()
    out.CopyFrom(model)
    opset = next((o.version for o in out.opset_import if o.domain in ("", "ai.onnx")), 13)
    nodes, outputs, names = [], [], {}

    def reduce(op: str, src: str, dst: str, axes: list[int] | None) -> None:
        if axes is None or opset < 18:
            attrs = {"keepdims": 0, **({"axes": axes} if axes is not None else {})}
            nodes.append(helper.make_node(op, [src], [dst], **attrs))
        else:
            const = f"{dst}/axes"
            out.graph.initializer.append(onnx.numpy_helper.from_array(np.array(axes, np.int64), const))
            nodes.append(helper.make_node(op, [src, const], [dst], keepdims=0))

    for k, (name, rank) in enumerate(tensors.items()):
        low, high, chan, magnitude = (f"shard.stats/{k}/{what}" for what in ("min", "max", "chan", "abs"))
        reduce("ReduceMin", name, low, None)
        reduce("ReduceMax", name, high, None)
        if channels:
            nodes.append(helper.make_node("Abs", [name], [magnitude]))
            reduce("ReduceMax", magnitude, chan, list(range(rank - 1)) if rank >= 2 else None)
        names[name] = (low, high, chan) if channels else (low, high)
        outputs += [onnx.ValueInfoProto(name=n) for n in names[name]]
    out.graph.node.extend(nodes)
    del out.graph.output[:]
    out.graph.output.extend(outputs)
    return out, names


LIFTED_BYTES = 1 << 20   # constants this large are fed to onnxruntime as inputs (lifted)


def lifted(graph) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """The graph as a model whose large constants are inputs, and their arrays (the graph's own, not
    copies), to feed with every sample. onnxruntime reads a fed array where it lies; a model holding
    the weights costs their bytes again in the model, its serialized form and onnxruntime's copy
    (SigLIP-512: its compile peaks at 1.25 GB through the statistics against 2.76 GB)."""
    import onnx_graphsurgeon as gs

    # Reading .values loads a lazily imported weight into the graph itself: the copy then shares it.
    large = {t.name for t in graph.tensors().values() if isinstance(t, gs.Constant) and t.values.nbytes >= LIFTED_BYTES}
    copy = graph.copy()   # tensors copied, their arrays shared
    weights, inputs = {}, {}
    for node in copy.nodes:
        for k, tensor in enumerate(node.inputs):
            if isinstance(tensor, gs.Constant) and tensor.name in large:
                if tensor.name not in inputs:
                    weights[tensor.name] = tensor.values
                    inputs[tensor.name] = gs.Variable(tensor.name, tensor.values.dtype, list(tensor.values.shape))
                node.inputs[k] = inputs[tensor.name]
    copy.inputs.extend(inputs.values())
    return gs.export_onnx(copy, do_type_check=False), weights


def graph_stats(graph, samples: list[dict[str, np.ndarray]], names: list[str] | None = None,
                cache: Path | None = None, channels: bool = True) -> dict[str, TensorStats]:
    """collect_stats over a graphsurgeon graph: its large constants lifted (fed, not copied), the
    ranks from the shapes on the graph."""
    model, weights = lifted(graph)
    return collect_stats(model, samples, names, ranks=float_ranks(graph), cache=cache, weights=weights,
                         channels=channels)


def collect_stats(model: onnx.ModelProto, samples: list[dict[str, np.ndarray]],
                  names: list[str] | None = None, ranks: dict[str, int] | None = None,
                  cache: Path | None = None, weights: dict[str, np.ndarray] | None = None,
                  channels: bool = True) -> dict[str, TensorStats]:
    """Range statistics of the named tensors (default: every float tensor, the inputs included) over
    the samples, reduced inside onnxruntime. ranks: {float tensor a node makes: rank} where the caller
    knows them (else onnx's shape inference, a copy of the model, finds them). cache: a folder of the
    build cache (shard.targets.build_cache) where the statistics are kept by the hash of the model
    with its reductions and of the samples: a recompile of an unchanged model runs nothing.
    weights: the arrays of a lifted model's inputs that are constants (`lifted`). channels: also each
    tensor's per-channel absolute maximum (stats_model)."""
    every = names is None
    weights = weights or {}
    made = float_tensors(model) if ranks is None else ranks
    wanted = made if every else {n: made[n] for n in names if n in made}
    reduced, outs = stats_model(model, wanted, channels)
    key = stats_key(reduced, names, samples, weights) if cache is not None and fits_protobuf(reduced) else None
    found = key and entry_file(cache, key, STATS_FILE)
    if found:
        with np.load(found) as data:
            return {str(n): TensorStats(str(n), float(lo), float(hi), data[f"c{k}"])
                    for k, (n, lo, hi) in enumerate(zip(data["names"], data["min"], data["max"]))}
    stats = measure_stats(reduced, outs, samples, names, weights, channels)
    if key:
        store_entry(cache, key, lambda folder: np.savez(
            folder / STATS_FILE, names=np.array(list(stats), dtype=str),
            min=np.array([t.min for t in stats.values()], np.float64),
            max=np.array([t.max for t in stats.values()], np.float64),
            **{f"c{k}": t.channel_absmax for k, t in enumerate(stats.values())}))
    return stats


STATS_FILE = "stats.npz"
STATS_VERSION = 3   # 2: the key hashes the model part by part; 3: and the lifted weights


def stats_key(reduced: onnx.ModelProto, names: list[str] | None, samples: list[dict[str, np.ndarray]],
              weights: dict[str, np.ndarray]) -> str:
    return content_key(f"stats {STATS_VERSION} {sorted(names) if names is not None else '*'}", reduced, samples,
                       weights, "stats")


def content_key(what: str, model: onnx.ModelProto, samples: list[dict[str, np.ndarray]],
                weights: dict[str, np.ndarray], prefix: str) -> str:
    """A build cache key, `prefix`-..., for `what` computed from a (lifted) model, its weights and samples."""
    import hashlib

    digest = hashlib.sha256(what.encode())
    graph = model.graph   # part by part: the model's bytes are never all copied at once
    for parts in (model.opset_import, graph.initializer, graph.node, graph.input, graph.output):
        digest.update(len(parts).to_bytes(8, "little"))
        for part in parts:
            data = part.SerializeToString()
            digest.update(len(data).to_bytes(8, "little") + data)
    for sample in [weights, *samples]:
        for name in sorted(sample):
            value = np.ascontiguousarray(sample[name])
            digest.update(f"{name} {value.dtype.str} {value.shape}".encode())
            digest.update(memoryview(value).cast("B"))
    return f"{prefix}-" + digest.hexdigest()[:32]


def measure_stats(reduced: onnx.ModelProto, outs: dict[str, tuple], samples: list[dict[str, np.ndarray]],
                  names: list[str] | None, weights: dict[str, np.ndarray], channels: bool = True
                  ) -> dict[str, TensorStats]:
    """collect_stats' onnxruntime run of the model with its reductions (stats_model)."""
    every = names is None
    stats: dict[str, TensorStats] = {}

    def add(name: str, low: float, high: float, chan: np.ndarray | None) -> None:
        chan = np.array([max(-low, high)]) if chan is None else chan   # no channels: the tensor's absmax
        if name in stats:
            s = stats[name]
            s.min, s.max = min(s.min, low), max(s.max, high)
            s.channel_absmax = np.maximum(s.channel_absmax, chan)
        else:
            stats[name] = TensorStats(name, low, high, chan)

    flat = [n for reductions in outs.values() for n in reductions]
    for sample, values in zip(samples, run_each(reduced, [{**s, **weights} for s in samples], flat)):
        for name, value in sample.items():
            if (every or name in names) and value.dtype.kind == "f" and value.size:
                add(name, float(value.min()), float(value.max()), channel_absmax(value) if channels else None)
        for name, (low, high, *chan) in outs.items():
            if values[low].size:
                add(name, float(values[low]), float(values[high]),
                    np.atleast_1d(values[chan[0]]).astype(np.float64) if chan else None)
    return stats


def compile_samples(options: CompileOptions, inputs: list) -> tuple[list[dict[str, np.ndarray]], str | None]:
    """A compile's samples: the --calib file checked against the model's inputs, or seeded random ones
    (RANDOM_SAMPLES where the precision quantizes, else one) and, for a quantized compile, the
    warning that says what that costs."""
    if options.calib:
        return load_samples(options.calib, inputs), None
    if options.precision == "fp16":
        return random_samples(inputs, 1), None
    samples = random_samples(inputs, random_count(options.batch))
    return samples, RANDOM_WARNING.format(n=len(samples))


def random_count(batch: int) -> int:
    """How many seeded random samples a quantized compile at `batch` frames a sample takes: RANDOM_SAMPLES
    frames' worth, at least two samples (one to check on, one to rank on). A sample of a batched
    compile holds `batch` frames: 8 of them at batch 4 made 172 s of onnxruntime (ranges and the
    check) in an FP8 compile of SigLIP-so400m on 16 cores, and would make four times that at 16."""
    return max(2, -(-RANDOM_SAMPLES // batch))


def stats_cache(ctx) -> Path | None:
    """Where a compile keeps range statistics: the build cache, unless --no-cache."""
    return default_cache_dir() if ctx.options.build_cache else None


def calibration_samples(ctx, inputs: list) -> list[dict[str, np.ndarray]]:
    """compile_samples, loaded once and kept in the pass context (its warning in ctx.warnings)."""
    if ctx.samples is None:
        ctx.samples, warning = compile_samples(ctx.options, inputs)
        if warning:
            ctx.warnings.append(warning)
    return ctx.samples
