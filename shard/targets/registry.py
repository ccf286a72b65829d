"""get_target: a target by its name (a chip of shard.targets.chips, a GPU target, or cpu)."""

from __future__ import annotations

from shard.errors import TargetError
from shard.targets import Target
from shard.targets.chips import CHIPS, GPU_TARGETS
from shard.targets.cpu import CpuTarget
from shard.targets.gpu import GpuTarget
from shard.targets.rknn.target import RknnTarget


def get_target(name: str) -> Target:
    targets = {t.name: t for t in (*map(RknnTarget, CHIPS), *map(GpuTarget, GPU_TARGETS), CpuTarget())}
    try:
        return targets[name]
    except KeyError:
        raise TargetError(f"unknown target {name!r}; known targets: {', '.join(targets)}") from None
