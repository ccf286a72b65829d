"""build-engines: each stage's TensorRT engine, built on the device that runs it, and a check of what
the engine really runs.

On Thor the builder's FP8/FP4 requests can come out as FP32 or FP16 layers with no error
(NVIDIA/TensorRT#4590, #4833). So every engine is built with detailed profiling verbosity, its
layer table is read back through the engine inspector, and a layer that holds a node the stage
asked for in FP8 but reads and writes only FP16/BF16/FP32 tensors, or an fp16 stage's layer that
runs wholly in FP32, fails the build with the stage and the layers named: the Thor twin of reading
a vendor log's overflow lines. Layers TensorRT fuses into one opaque Myelin region ("ForeignNode[a...b]")
report only their edges; the check counts the asked nodes it could not see.

Written against TensorRT 10's Python API (FACTS-thor, "TensorRT 10 Python API names"); the
precision check is plain JSON and tested here.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from shard.bundle import MANIFEST, read_manifest, record_files
from shard.errors import CompileError, ShardError
from shard.runtime.executors.gpu import require_cuda
from shard.runtime.executors.tensorrt import import_tensorrt

BOOKKEEPING = ("Reformat", "NoOp", "Constant", "Shuffle", "Identity")   # layers that move data, compute nothing
LOW = ("FP32", "FP16", "BF16")


def datatype(text: str) -> str | None:
    """The precision a "Format/Datatype" string (or a tactic name) names, if any."""
    t = text.lower()
    for needle, name in (("fp8", "FP8"), ("e4m3", "FP8"), ("fp4", "FP4"), ("e2m1", "FP4"), ("int8", "INT8"),
                         ("bf16", "BF16"), ("bfloat", "BF16"), ("half", "FP16"), ("fp16", "FP16"),
                         ("fp32", "FP32"), ("float", "FP32")):
        if needle in t:
            return name
    return None


def layer_precisions(layer: dict) -> set[str]:
    tensors = [*layer.get("Inputs", []), *layer.get("Outputs", [])]
    found = {datatype(str(t.get("Format/Datatype", ""))) for t in tensors if isinstance(t, dict)}
    weights = layer.get("Weights")
    if isinstance(weights, dict):
        found.add(datatype(str(weights.get("Type", ""))))
    tactic = str(layer.get("TacticName", "")).lower()
    if "fp8" in tactic or "e4m3" in tactic:   # a kernel named for FP8 runs FP8, whatever its edges are
        found.add("FP8")
    return {p for p in found if p}


@dataclass
class EngineCheck:
    stage: str
    problems: list[str] = field(default_factory=list)   # layers that run below what was asked
    unseen: list[str] = field(default_factory=list)     # asked FP8 nodes inside opaque (Myelin) layers
    layers: int = 0
    by_precision: dict[str, int] = field(default_factory=dict)


def check_engine(info: dict, stage: str, precision: str, fp8_nodes: list[str]) -> EngineCheck:
    """What the engine information (the inspector's JSON) says against what the stage asked for."""
    layers = info.get("Layers", [])
    result = EngineCheck(stage, layers=len(layers))
    if layers and not isinstance(layers[0], dict):
        result.problems.append("the engine was built without detailed profiling verbosity: its layers' "
                               "precisions cannot be read (rebuild with ProfilingVerbosity.DETAILED)")
        return result
    asked = set(fp8_nodes)
    seen: set[str] = set()
    for layer in layers:
        name = str(layer.get("Name", ""))
        precisions = layer_precisions(layer)
        for p in precisions:
            result.by_precision[p] = result.by_precision.get(p, 0) + 1
        if layer.get("LayerType") in BOOKKEEPING:
            continue
        holds = {n for n in asked if n and re.search(rf"(^|[\s+\[]){re.escape(n)}($|[\s+\]])", name)}
        seen |= holds
        if holds and precisions and precisions <= set(LOW):
            result.problems.append(f"layer {name!r} holds {', '.join(sorted(holds))}, asked FP8, and runs "
                                   f"{'/'.join(sorted(precisions))}")
        elif precision != "fp32" and precisions == {"FP32"}:
            result.problems.append(f"layer {name!r} runs FP32 in an {precision} stage")
    result.unseen = sorted(asked - seen)
    return result


def import_builder():
    trt = import_tensorrt("shard build-engines")
    require_cuda("shard build-engines", "engines are built on the device that runs them")
    return trt


def build_engines(bundle: str | Path, progress: Callable[[str, int, int], None] = lambda *a: None) -> list[EngineCheck]:
    """Build every stage's engine with the bundle's recipe, read each back, and fail (CompileError,
    naming the stage and its layers) where a layer runs below its asked precision. Engines go to
    engines/NAME.engine, their layer tables to engines/NAME.layers.json, the manifest names them."""
    bundle = Path(bundle)
    manifest = read_manifest(bundle)
    recipe = manifest.build.get("tensorrt")
    if recipe is None:
        raise ShardError(f"{bundle}: a {manifest.target} bundle has no TensorRT recipe; compile with --target thor "
                         f"or --target cuda")
    trt = import_builder()
    logger = trt.Logger(trt.Logger.WARNING)
    builder, runtime = trt.Builder(logger), trt.Runtime(logger)
    (bundle / "engines").mkdir(exist_ok=True)
    cache_file = bundle / recipe["timing_cache"]
    probe_config = builder.create_builder_config()
    cache = probe_config.create_timing_cache(cache_file.read_bytes() if cache_file.exists() else b"")
    checks = []
    for k, shard in enumerate(manifest.shards):
        progress("build engines", k, len(manifest.shards))
        strongly = recipe.get("strongly_typed", True) and hasattr(trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED")
        network = builder.create_network(1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED) if strongly else 0)
        parser = trt.OnnxParser(network, logger)
        if not parser.parse_from_file(str(bundle / shard.onnx)):
            errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
            raise CompileError(f"stage {shard.name}: TensorRT's ONNX parser refused {shard.onnx}: {errors}")
        config = builder.create_builder_config()
        config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, recipe["workspace_bytes"])
        config.profiling_verbosity = trt.ProfilingVerbosity.DETAILED
        config.set_timing_cache(cache, False)
        if not strongly:   # TensorRT 10 without strong typing: the flags ask for the same precisions
            for flag in recipe.get("weakly_typed_flags", []):
                config.set_flag(getattr(trt.BuilderFlag, flag))
        blob = builder.build_serialized_network(network, config)
        if blob is None:
            raise CompileError(f"stage {shard.name}: TensorRT could not build an engine (its log above)")
        engine = runtime.deserialize_cuda_engine(blob)
        info = json.loads(engine.create_engine_inspector().get_engine_information(trt.LayerInformationFormat.JSON))
        (bundle / "engines" / f"{shard.name}.engine").write_bytes(bytes(blob))
        (bundle / "engines" / f"{shard.name}.layers.json").write_text(json.dumps(info, indent=1) + "\n")
        checks.append(check_engine(info, shard.name, shard.precision, shard.build_options.get("fp8_nodes", [])))
        shard.artifact = f"engines/{shard.name}.engine"
    cache_file.write_bytes(bytes(cache.serialize()))
    progress("build engines", len(manifest.shards), len(manifest.shards))
    failed = [c for c in checks if c.problems]
    if failed:
        lines = [f"stage {c.stage}: {p}" for c in failed for p in c.problems]
        raise CompileError("an engine runs below the precision its stage asked for (TensorRT on Thor can drop "
                           "FP8 requests silently):\n  " + "\n  ".join(lines[:20]) +
                           ("\n  ..." if len(lines) > 20 else "") + "\nrun it with --backend cuda meanwhile")
    record_files(bundle, manifest)
    (bundle / MANIFEST).write_text(manifest.to_json())
    return checks
