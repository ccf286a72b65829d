"""`shard inspect`: what compile would do to a model, without building."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from shard.cli.common import console, parse_shape, progress_bar
from shard.compilation.staging import check_options
from shard.inspection import inspect_model
from shard.options import CompileOptions
from shard.summary import describe_step, stage_table
from shard.targets.chips import DEFAULT_TARGET, targets_help

app = typer.Typer(add_completion=False)


@app.command("inspect")
def inspect_command(
    model: Path = typer.Argument(..., help="An ONNX model."),
    target: str = typer.Option(DEFAULT_TARGET, help=targets_help()),
    input_shape: list[str] = typer.Option([], "--input-shape", help="NAME=D0,D1,... for a dynamic input."),
    profile: Optional[Path] = typer.Option(None, help="A profile from `shard probe` [default: the shipped one]."),
    disable: list[str] = typer.Option([], "--disable", help="Skip an optional pass (repeatable)."),
    precision: str = typer.Option("fp16", help="fp16, int8 or mixed: which scale sandwiches apply (thor, cuda: fp16, fp8 or w4a16)."),
    calib: Optional[Path] = typer.Option(None, help="Calibration samples (.npz, as compile takes them): the ranges "
                                                    "the scale sandwich works from [default: seeded random]."),
) -> None:
    """List every op that breaks a limit of the target, its evidence, and what compile does about it
    (with --calib: the ranges, and where the scale sandwich would rescale, clamp or smooth)."""

    options = CompileOptions(input_shapes=dict(parse_shape(s) for s in input_shape),
                             profile=str(profile) if profile else None, disable=tuple(disable),
                             precision=precision, calib=str(calib) if calib else None)
    check_options(options)
    with progress_bar() as progress:
        progress("inspect (rewriting passes, one-op builds)", 0, 1)
        result = inspect_model(model, target, options)
        progress("inspect (rewriting passes, one-op builds)", 1, 1)
    if result.stages:
        console.print(stage_table(result.stages, f"{model.name} on {target}: pipeline stages (profile {result.profile})"))
        return
    table = Table(title=f"{model.name} on {target}: ops over a limit (profile {result.profile})")
    for col in ("node", "op", "limit and evidence", "what compile does"):
        table.add_column(col, overflow="fold")
    order = {"rewrite": 0, "not fixed": 1, "cpu": 2}
    for f in sorted(result.findings, key=lambda f: order[f.kind]):
        style = {"rewrite": "", "not fixed": "red", "cpu": "yellow"}[f.kind]
        table.add_row(f.node, f.op, f.reason, f"[{style}]{f.action}[/]" if style else f.action)
    console.print(table)
    for when, steps in (("before the first shard", result.host_pre), ("after the last shard", result.host_post)):
        for step in steps:
            console.print(f"host step {when}: {describe_step(step)}")
    counts = {k: sum(1 for f in result.findings if f.kind == k) for k in order}
    console.print(f"{counts['rewrite']} rewrites, {counts['not fixed']} over a limit and not fixed, "
                  f"{counts['cpu']} ops that run on the CPU when built alone (`shard compile` counts those that "
                  f"still do in the whole model's build)")
