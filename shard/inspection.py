"""inspect: what breaks the target's limits in a model, and what compile will do about each.

Runs the rewriting passes (not the partition, not the builds) and gathers their findings, with the
same reason sentences the passes write into a bundle's report; with calibration samples, what the
scale sandwich would do with the ranges they give.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import onnx_graphsurgeon as gs

from shard.compilation.stages import run_passes
from shard.graph import load_model, quiet_graphsurgeon
from shard.options import CompileOptions
from shard.passes.canonicalize import prepare_model
from shard.profile import load_profile
from shard.summary import Stage, passed, stages_of
from shard.targets.chips import DEFAULT_TARGET
from shard.targets.registry import get_target


@dataclass
class Finding:
    node: str
    op: str
    reason: str          # which limit, with its evidence
    action: str          # what compile does
    kind: str            # rewrite | not fixed | cpu | host


@dataclass
class Inspection:
    target: str
    profile: str
    findings: list[Finding] = field(default_factory=list)
    host_pre: list[dict] = field(default_factory=list)
    host_post: list[dict] = field(default_factory=list)
    stages: list[Stage] = field(default_factory=list)   # GPU targets: each pipeline stage's roofline


def inspect_model(model: str | Path, target: str = DEFAULT_TARGET, options=None) -> Inspection:
    options = options or CompileOptions()
    profile = load_profile(target, options.profile)
    quiet_graphsurgeon()
    tgt = get_target(target)
    proto, _ = prepare_model(load_model(model), tgt.min_opset)
    _, ctx = run_passes(gs.import_onnx(proto), tgt, profile, options, until=None if tgt.stage_streams else "partition")
    result = Inspection(target, f"{profile.target} ({profile.toolkit})", host_pre=ctx.host_pre, host_post=ctx.host_post,
                        stages=stages_of(ctx.reports))
    for name in ("slow_paths", "scale_sandwich", "legalize"):
        report = passed(ctx.reports, name)
        for change in report.changes:
            result.findings.append(Finding(change.node, change.op, change.reason, change.action + change.cycles(),
                                           "rewrite"))
        for left in report.not_fixed + report.tried:
            result.findings.append(Finding(left.node, left.op, left.reason, left.action, "not fixed"))
        for cpu in report.reported:
            result.findings.append(Finding(cpu.node, cpu.op, cpu.reason, "left to the vendor compiler (alone it runs on the CPU; in the model "
                                           "it may fuse: the compile counts what stays there)",
                                           "cpu"))
    return result
