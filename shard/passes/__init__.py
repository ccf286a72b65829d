"""Graph passes: `fn(graph, ctx) -> report`, registered by name, run in one explicit order."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import onnx_graphsurgeon as gs

from shard.errors import ShardError
from shard.graph import toposort
from shard.options import CompileOptions
from shard.profile import Profile

PassFn = Callable[[gs.Graph, "PassContext"], tuple[gs.Graph, dict]]
PASSES: dict[str, PassFn] = {}


def register(name: str) -> Callable[[PassFn], PassFn]:
    def wrap(fn: PassFn) -> PassFn:
        PASSES[name] = fn
        return fn
    return wrap


@dataclass
class PassContext:
    """What passes read (profile: hardware facts; options: the user's choices) and what they leave."""

    profile: Profile
    options: CompileOptions = field(default_factory=CompileOptions)
    legality: object = None          # shard.passes.fit.Legality; None where the target has no limits
    ops: object = None               # small vendor builds (shard.toolkit.ops.ToolkitOps) or None
    reports: dict[str, dict] = field(default_factory=dict)
    host_candidates: set[str] = field(default_factory=set)   # layout nodes that may run on the host
    host_pre: list[dict] = field(default_factory=list)       # set by host_edges
    host_tables: dict[str, np.ndarray] = field(default_factory=dict)   # {bundle path: array} host steps read
    host_post: list[dict] = field(default_factory=list)
    model_inputs: list = field(default_factory=list)         # the model's own inputs and outputs
    model_outputs: list = field(default_factory=list)
    build_config: dict = field(default_factory=dict)          # extra toolkit config(...) for every shard
    snapshots: dict[str, gs.Graph] = field(default_factory=dict)   # {pass: a copy of the graph after it}
    samples: list[dict[str, np.ndarray]] | None = None       # calibration samples (shard.calibration)
    scales: dict[str, tuple[str, int]] = field(default_factory=dict)   # tensor: (the reference's, k), held / 2^k
    warnings: list[str] = field(default_factory=list)         # for the user, in the report and the summary
    plan: object = None  # set by partition
    build_memory: bool = False   # the target's builds' memory grows with their weights: partition sizes them


# The order of the RK3588 pipeline; every name is a module in this package.
PIPELINE = ["canonicalize", "slow_paths", "tile_attention", "npu_forms", "fusion_barrier", "scale_sandwich",
            "legalize", "host_edges", "partition"]
REQUIRED = ("canonicalize", "partition", "stages")   # the compile cannot go on without these


def run_pipeline(graph: gs.Graph, ctx: PassContext, disable: tuple[str, ...] = (),
                 on_pass: Callable[[str], None] = lambda name: None,
                 dump_after: dict[str, str] | None = None, until: str | None = None,
                 snapshot: tuple[str, ...] = (), pipeline: tuple[str, ...] | list[str] = tuple(PIPELINE)) -> gs.Graph:
    """Run each enabled pass of `pipeline` (the target's; RK3588's by default) in order; each must leave
    a valid, toposorted graph.
    dump_after: {pass name: directory} to write the graph after that pass as ONNX.
    until: stop before this pass (inspect runs the rewrites without partitioning).
    snapshot: passes after which a copy of the graph goes into ctx.snapshots (weights shared)."""
    from shard.passes import (canonicalize, fp8_linears, fusion_barrier, host_edges, legalize,  # noqa: F401
                              npu_forms, partition, scale_sandwich, slow_paths, stages, strong_types,
                              tile_attention)

    for flag, names in (("--disable", disable), ("--dump-after", dump_after or {})):
        unknown = set(names) - set(pipeline)
        if unknown:
            raise ShardError(f"{flag}: unknown pass {', '.join(sorted(unknown))}; passes: {', '.join(pipeline)}")
    required = set(disable) & set(REQUIRED)
    if required:
        raise ShardError(f"--disable: {', '.join(sorted(required))} cannot be disabled; "
                         f"optional passes: {', '.join(p for p in pipeline if p not in REQUIRED)}")
    for name in pipeline:
        if name == until:
            break
        if name in disable:
            ctx.reports[name] = {"disabled": True}
            continue
        on_pass(name)
        graph, ctx.reports[name] = PASSES[name](graph, ctx)
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
