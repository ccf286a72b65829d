"""--batch: a bundle that runs B frames at once, fed one frame at a time (run_stream stacks them:
shard.runtime.batching); for a GPU target, --batch auto lets its cost model pick B.

The model's inputs need a dynamic leading axis (a fixed one is held by its Reshapes and would be read
wrongly at another size); compile fixes it at B, and the bundle's outputs must lead with B too, so
each frame's outputs can be cut back out.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import onnx
import onnx_graphsurgeon as gs
from google.protobuf.message import DecodeError

from shard.compilation.names import Progress
from shard.compilation.stages import run_passes
from shard.errors import ModelError, ShardError
from shard.graph import load_model, quiet_graphsurgeon
from shard.summary import stages_of
from shard.options import CompileOptions
from shard.passes.canonicalize import prepare_model
from shard.profile import load_profile
from shard.targets.registry import get_target

BATCHES = (1, 2, 4, 8, 16, 32)   # what --batch auto weighs
NEAR_BEST = 0.97                 # --batch auto: the smallest batch within this share of the best frames/s


def batched(model: Path, target: str, options: CompileOptions, progress: Progress) -> tuple[CompileOptions, dict | None]:
    """The options with the batch fixed (the inputs' leading axes set to it), and --batch auto's
    choice: {"batch", "latency_budget_s", "candidates": [{batch, latency_s, fps}]}, else None."""
    if options.batch is not None and options.batch < 1:
        raise ShardError(f"--batch {options.batch}: expected a number of frames of at least 1, or auto")
    inputs = model_inputs(model, options)
    choice = None
    if options.batch is None:
        choice = choose_batch(model, inputs, target, options, progress)
        options = replace(options, batch=choice["batch"])
    return replace(options, input_shapes=batch_shapes(inputs, options.batch, options)), choice


def model_inputs(model: Path, options: CompileOptions) -> list:
    """The model's graph inputs (ValueInfo) that take frames: not its weights, not --input-value's;
    none where the file does not read as ONNX (the compile's own load then says why, in one line)."""
    try:
        graph = onnx.load(str(model), load_external_data=False).graph
    except (DecodeError, ValueError, RuntimeError, OSError):
        return []
    weights = {t.name for t in graph.initializer}
    return [v for v in graph.input if v.name not in weights and v.name not in options.input_values]


def batch_shapes(inputs: list, batch: int, options: CompileOptions) -> dict[str, tuple[int, ...]]:
    """--input-shape with every input's leading axis at `batch` (its other axes as the model or
    --input-shape has them); at the default batch 1, only a dynamic leading axis whose other axes
    are fixed is set, and nothing is refused."""
    shapes = dict(options.input_shapes)
    for value in inputs:
        name = value.name
        dims = value.type.tensor_type.shape.dim
        lead = dims[0] if dims else None
        if batch == 1 and (name in shapes or lead is None or lead.HasField("dim_value") and lead.dim_value > 0
                           or not all(d.HasField("dim_value") and d.dim_value > 0 for d in dims[1:])):
            continue   # the default: only a dynamic leading axis, the rest fixed, is set (to 1)
        if lead is None:
            raise ModelError(f"--batch {batch}: input {name} has no axes, so no batch axis to set")
        if lead.HasField("dim_value") and lead.dim_value not in (0, batch):
            raise ModelError(f"--batch {batch}: the model's input {name} has its leading axis fixed at "
                             f"{lead.dim_value}; export it with a dynamic batch axis (torch.onnx.export(..., "
                             f"dynamic_axes={{'{name}': {{0: 'batch'}}}}))")
        if name in shapes:
            if shapes[name][0] != batch:
                raise ShardError(f"--batch {batch} and --input-shape {name}={','.join(map(str, shapes[name]))} "
                                 f"disagree on its leading axis")
            continue
        rest = [d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else None for d in dims[1:]]
        if None in rest:
            raise ModelError(f"--batch {batch}: input {name} has dynamic axes past the first; give its shape "
                             f"with --input-shape {name}={batch},...")
        shapes[name] = (batch, *rest)
    return shapes


def choose_batch(model: Path, inputs: list, target: str, options: CompileOptions, progress: Progress) -> dict:
    """--batch auto: each of BATCHES through the target's passes in fp16 (no calibration), the
    stages' predicted times giving one batch's latency (their sum) and the pipeline's frames/s (the
    batch over the slowest stage); the smallest batch within NEAR_BEST of the most frames/s among
    those whose latency fits options.latency_budget."""
    tgt = get_target(target)
    if not tgt.stage_streams:
        raise ShardError(f"--batch auto picks the batch from a GPU target's cost model; for {target} give "
                         f"--batch N")
    quiet_graphsurgeon()
    profile = load_profile(target, options.profile)
    proto, _ = prepare_model(load_model(model), tgt.min_opset)   # once: each batch imports its own graph of it
    candidates = []
    for k, batch in enumerate(BATCHES):
        progress(f"--batch auto: the cost model at batch {batch}", k, len(BATCHES))
        try:
            fixed = replace(options, batch=batch, precision="fp16", input_shapes=batch_shapes(inputs, batch, options))
        except ModelError:
            if batch == 1:
                raise
            raise ModelError(f"--batch auto: {model.name} takes one batch size only (its inputs' leading axes are "
                             f"fixed); export it with a dynamic batch axis") from None
        _, ctx = run_passes(gs.import_onnx(proto), tgt, profile, fixed)
        seconds = [s.predicted_s for s in stages_of(ctx.reports)]
        candidates.append({"batch": batch, "latency_s": sum(seconds), "fps": batch / max(seconds)})
    progress("--batch auto", len(BATCHES), len(BATCHES))
    return {"batch": pick(candidates, options.latency_budget), "latency_budget_s": options.latency_budget,
            "candidates": candidates}


def pick(candidates: list[dict], budget: float | None) -> int:
    """The smallest batch within NEAR_BEST of the most frames/s among the candidates (smallest batch
    first) whose latency fits `budget`; the first where none fits."""
    fitting = [c for c in candidates if budget is None or c["latency_s"] <= budget] or candidates[:1]
    best = max(c["fps"] for c in fitting)
    return next(c["batch"] for c in fitting if c["fps"] >= NEAR_BEST * best)
