"""`shard toolkit`: the vendor toolkit environments."""

from __future__ import annotations

import typer
from rich.table import Table

from shard.cli.common import console, err
from shard.targets.chips import DEFAULT_TARGET
from shard.targets.rknn.env import get_spec, install, read_marker, status

app = typer.Typer(help="The vendor toolkit environments (rknn-toolkit2 lives in its own venv).",
                          no_args_is_help=True, add_completion=False)


@app.command("install")
def toolkit_install(target: str = typer.Argument(DEFAULT_TARGET),
                    force: bool = typer.Option(False, help="Recreate it even if installed.")) -> None:
    """Create the vendor toolkit environment for TARGET (idempotent)."""

    spec = get_spec(target)
    if read_marker(target) and not force:
        console.print(f"{spec.package} {spec.version} already installed")
    else:
        with err.status(f"installing {spec.package} {spec.version}") as status:
            install(target, on_step=lambda step: status.update(f"installing {spec.package}: {step}"), force=force)
    toolkit_status()


@app.command("status")
def toolkit_status() -> None:
    """What toolkit environments are installed, their versions, and where."""

    table = Table(title="vendor toolkits")
    for col in ("target", "toolkit", "installed", "packages", "path"):
        table.add_column(col)
    for row in status():
        packages = ", ".join(f"{k} {v}" for k, v in row["packages"].items() if v)
        table.add_row(row["target"], f"{row['package']} {row['version']}", "yes" if row["installed"] else "no",
                      packages, row["path"])
    console.print(table)
