"""`shard pack` and `shard build-engines`: a bundle made ready for the machine that runs it."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from shard.cli.common import console, progress_bar
from shard.output_files import check_output_file
from shard.pack import pack_bundle
from shard.runtime.generative_bundle import is_generative
from shard.targets.gpu.engines import build_engines

app = typer.Typer(add_completion=False)


@app.command("pack")
def pack_command(bundle: Path = typer.Argument(..., help="A bundle from `shard compile`."),
                 output: Optional[Path] = typer.Option(None, "--output", "-o", help="The pack [default: BUNDLE's "
                                                                                    "name .tar.gz]."),
                 with_onnx: bool = typer.Option(False, "--with-onnx", help="Also the shard ONNX files, so the pack "
                                                                          "runs anywhere with --backend cpu."),
                 force: bool = typer.Option(False, "--force", help="Replace the pack if one is there.")) -> None:
    """One .tar.gz with what a board needs: the artifacts, the manifest, the host steps, the runtime
    itself, run.py and a README (a generative bundle: each program so, beside its tokenizer, embeddings
    and prediction). The same bundle packs to the same bytes."""

    output = output or bundle.with_name(f"{bundle.stem}.tar.gz")
    check_output_file(output, "-o", bundle, force)
    path = pack_bundle(bundle, output, with_onnx)
    run = "--prompt \"...\" (or --bench)" if is_generative(bundle) else "--input x.npy"
    console.print(f"pack: {path} ({path.stat().st_size / 1e6:.1f} MB); on the board: tar xzf {path.name} && "
                  f"python {path.name[:-len('.tar.gz')]}/run.py {run}")


@app.command("build-engines")
def build_engines_command(bundle: Path = typer.Argument(..., help="A bundle from `shard compile --target thor` "
                                                                  "(or cuda).")) -> None:
    """Build each stage's TensorRT engine here (on the device that will run it), then read back what
    every engine really runs and fail where a layer asked for FP8 came out FP16 or FP32."""

    with progress_bar() as progress:
        checks = build_engines(bundle, progress)
    table = Table(title=f"{bundle.name}: engines, what their layers run")
    for col in ("stage", "layers", "by precision", "FP8 nodes not visible (Myelin regions)"):
        table.add_column(col)
    for c in checks:
        table.add_row(c.stage, str(c.layers), ", ".join(f"{k} {v}" for k, v in sorted(c.by_precision.items())),
                      str(len(c.unseen)))
    console.print(table)
    console.print(f"engines in {bundle / 'engines'}; run with `shard run {bundle} --backend tensorrt`")
