"""`shard zoo`: real architectures with seeded random weights."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from shard.cli.common import console, err
from shard.errors import ShardError
from shard.zoo import MODELS, VLAS, export_model

app = typer.Typer(help="Real architectures with seeded random weights, exported offline.", no_args_is_help=True,
                  add_completion=False)


@app.command("list")
def zoo_list() -> None:
    """The models `shard zoo export` builds."""

    table = Table(title="zoo")
    for col in ("name", "layers", "image", "what"):
        table.add_column(col)
    for m in MODELS.values():
        table.add_row(m.name, str(m.layers), str(m.image_size), m.description)
    for name, description in VLAS.items():
        table.add_row(name, "", "", description)
    console.print(table)


@app.command("export")
def zoo_export(
    name: str = typer.Argument(..., help="A name from `shard zoo list`."),
    output: Path = typer.Option(..., "--output", "-o", help="The ONNX file to write (a VLA: the folder)."),
    layers: Optional[int] = typer.Option(None, help="Encoder layers (a VLA: the prefix's and the expert's) "
                                                    "[default: the real model's]."),
    image_size: Optional[int] = typer.Option(None, help="Input image side, at least one patch (16; 14 for so400m)."),
    outliers: float = typer.Option(0.0, help="Plant a massive-activation channel of this magnitude."),
    seed: int = typer.Option(0, help="Seed of the random weights."),
    dynamic_batch: bool = typer.Option(False, help="Leave the batch axis dynamic (for `shard compile --batch`)."),
) -> None:
    """Export a zoo model (seeded random weights, eager attention, opset 17) to ONNX, offline."""

    if name in VLAS:
        return export_vla_folder(name, output, layers, seed)
    with err.status(f"exporting {name}"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        path = export_model(name, output, layers=layers, image_size=image_size, outliers=outliers, seed=seed,
                            dynamic_batch=dynamic_batch)
    console.print(f"wrote {path} ({path.stat().st_size / 1e6:.1f} MB)")


def export_vla_folder(name: str, output: Path, layers: int | None, seed: int) -> None:
    """A VLA: its three programs, embedding table and vla.json into the folder `output`."""
    from shard.zoo.vla import export_vla  # torch and transformers: only for this

    if output.exists() and (not output.is_dir() or any(output.iterdir())):
        raise ShardError(f"{output} exists and is not an empty folder; a VLA is exported into a folder of its own")
    if layers is not None and layers < 1:
        raise ShardError(f"--layers {layers}: at least 1")
    with err.status(f"exporting {name}"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        export_vla(name, output, seed=seed, depth=layers)
    size = sum(p.stat().st_size for p in output.rglob("*") if p.is_file())
    console.print(f"wrote {output} ({size / 1e6:.1f} MB): compile it with `shard compile {output} --target thor` "
                  f"(or `--target cuda --profile P`, P this GPU's from `shard probe --target cuda`)")
