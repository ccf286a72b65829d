"""Graph passes: `fn(graph, ctx) -> report`, registered by name, run in one explicit order."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import onnx_graphsurgeon as gs

from shard.errors import ShardError
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
    options: object
    reports: dict[str, dict] = field(default_factory=dict)
    plan: object = None  # set by partition


# The order of the RK3588 pipeline; every name is a module in this package.
PIPELINE = ["canonicalize", "partition"]


def run_pipeline(graph: gs.Graph, ctx: PassContext, disable: tuple[str, ...] = (),
                 on_pass: Callable[[str], None] = lambda name: None) -> gs.Graph:
    """Run each enabled pass in order; each must leave a valid, toposorted graph."""
    from shard.passes import canonicalize, partition  # noqa: F401  (registers the passes)

    unknown = set(disable) - set(PIPELINE)
    if unknown:
        raise ShardError(f"unknown pass {', '.join(sorted(unknown))}; passes: {', '.join(PIPELINE)}")
    for name in PIPELINE:
        if name in disable:
            continue
        on_pass(name)
        graph, ctx.reports[name] = PASSES[name](graph, ctx)
        graph.cleanup().toposort()
    return graph
