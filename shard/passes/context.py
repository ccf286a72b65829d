"""What every pass takes and leaves: PassContext. A pass is `fn(graph, ctx) -> (graph, report)`, named by
its function's name."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import onnx_graphsurgeon as gs

from shard.options import CompileOptions
from shard.profile import Profile

PassFn = Callable[[gs.Graph, "PassContext"], tuple[gs.Graph, dict]]


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
