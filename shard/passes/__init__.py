"""Graph passes: `fn(graph, ctx) -> (graph, report)`, each named by its function, run in a target's order."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import onnx_graphsurgeon as gs

from shard.errors import ShardError
from shard.graph import toposort
from shard.passes import (canonicalize, fusion_barrier, host_edges, legalize, npu_forms, partition,
                          scale_sandwich, slow_paths, tile_attention)
from shard.passes.context import PassContext, PassFn

__all__ = ["NPU_PIPELINE", "PassContext", "PassFn", "run_pipeline"]

# The NPU targets' passes (RK3588 and the other Rockchip chips, and cpu), in order.
NPU_PIPELINE: tuple[PassFn, ...] = (
    canonicalize.canonicalize,      # one opset, static shapes, constants folded, the model's own forms
    slow_paths.slow_paths,          # ops the vendor runs on a slow path, in forms it runs fast
    tile_attention.tile_attention,  # attention cut into query tiles where one op is past a limit
    npu_forms.npu_forms,            # ops the NPU lacks, in ops it has
    fusion_barrier.fusion_barrier,  # what keeps the vendor from fusing the tiles back
    scale_sandwich.scale_sandwich,  # activations kept inside fp16's range
    legalize.legalize,              # every op inside the probed limits (split, or sent to the host)
    host_edges.host_edges,          # layout steps at the model's edges, on the host
    partition.partition)            # the shards
REQUIRED = ("canonicalize", "partition", "stages")   # the compile cannot go on without these (stages: GPU)


def run_pipeline(graph: gs.Graph, ctx: PassContext, disable: tuple[str, ...] = (),
                 on_pass: Callable[[str], None] = lambda name: None,
                 dump_after: dict[str, str] | None = None, until: str | None = None,
                 snapshot: tuple[str, ...] = (), pipeline: tuple[PassFn, ...] = NPU_PIPELINE) -> gs.Graph:
    """Run each enabled pass of `pipeline` (the target's; RK3588's by default) in order; each must leave
    a valid, toposorted graph.
    dump_after: {pass name: directory} to write the graph after that pass as ONNX.
    until: stop before this pass (inspect runs the rewrites without partitioning).
    snapshot: passes after which a copy of the graph goes into ctx.snapshots (weights shared)."""
    passes = {fn.__name__: fn for fn in pipeline}
    for flag, names in (("--disable", disable), ("--dump-after", dump_after or {})):
        unknown = set(names) - set(passes)
        if unknown:
            raise ShardError(f"{flag}: unknown pass {', '.join(sorted(unknown))}; passes: {', '.join(passes)}")
    required = set(disable) & set(REQUIRED)
    if required:
        raise ShardError(f"--disable: {', '.join(sorted(required))} cannot be disabled; "
                         f"optional passes: {', '.join(p for p in passes if p not in REQUIRED)}")
    for name, fn in passes.items():
        if name == until:
            break
        if name in disable:
            ctx.reports[name] = {"disabled": True}
            continue
        on_pass(name)
        graph, ctx.reports[name] = fn(graph, ctx)
        toposort(graph.cleanup())
        if name in snapshot:
            ctx.snapshots[name] = graph.copy()
        if dump_after and name in dump_after:
            dump_graph(graph, Path(dump_after[name]) / f"after-{name}.onnx")
    return graph


def dump_graph(graph: gs.Graph, path: Path) -> None:
    import onnx

    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(gs.export_onnx(graph.copy()), path, save_as_external_data=True, location=f"{path.name}.data")
