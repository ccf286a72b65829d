"""What every pass takes and leaves: PassContext. A pass is `fn(graph, ctx) -> (graph, report)`, named by
its function's name."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from shard.options import CompileOptions
from shard.passes.fit import Legality
from shard.profile import Point, Profile

PassFn = Callable[[gs.Graph, "PassContext"], tuple[gs.Graph, dict]]


@dataclass
class ShardPlan:
    """One shard as partition cut it: its nodes, the tensors it takes and gives, its MACs, and the
    model's nodes it came from."""

    name: str
    nodes: list[gs.Node]
    inputs: list[gs.Variable]
    outputs: list[gs.Variable]
    macs: int
    source_nodes: list[str] = field(default_factory=list)


class VendorBuilds(Protocol):
    """What the passes may ask of a vendor target while they run: small builds, kept by content
    (shard.targets.rknn.ops.ToolkitOps). A build's point says `ok`, its `failure` and its `figures`."""

    def build(self, model: onnx.ModelProto, macs: int | None = None, build: dict | None = None) -> Point: ...

    def cost(self, point: Point, cycles_per_kb: float | None = None) -> tuple[int, int, float | None]:
        """(total cycles, the part costed by bytes, DDR cycles per KB) of a build."""
        ...


@dataclass
class PassContext:
    """What passes read (profile: hardware facts; options: the user's choices) and what they leave."""

    profile: Profile
    options: CompileOptions = field(default_factory=CompileOptions)
    legality: Legality | None = None   # None where the target has no limits
    ops: VendorBuilds | None = None    # None where the target has no vendor compiler
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
    plan: list[ShardPlan] | None = None   # set by partition
    # The shards a model of so many weight bytes needs for its builds, `jobs` at once, to fit in memory
    # (Target.shards_for_memory; 0: its builds do not grow with their weights).
    shards_for_memory: Callable[[int, int], int] = lambda weight_bytes, jobs: 0
    # (model, outputs) -> a runner of fp8_linears' gated replica faster than onnxruntime (the GPU target's:
    # torch on the GPU), or None (Target.replica_runner)
    replica: Callable[[onnx.ModelProto, list[str]], Callable | None] = lambda model, outputs: None
