"""`shard cache`: the caches of vendor builds and probe points."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.table import Table

from shard.bundle_cache import MARKER
from shard.cache_folder import clear, entry_folders, folder_size, size_limit
from shard.cache_folder import default_cache_dir as build_cache
from shard.cli.common import console
from shard.targets.rknn.cache import POINTS
from shard.targets.rknn.cache import default_cache_dir as probe_cache

app = typer.Typer(help="The caches of vendor builds and probe points.", no_args_is_help=True, add_completion=False)


def cache_folders() -> dict[str, tuple[Path, str]]:
    """{cache: (folder, glob of one entry)}."""

    return {"builds": (build_cache(), "*/build.json"), "probes": (probe_cache(), POINTS)}


@app.command("info")
def cache_info() -> None:
    """Where the caches are and what they hold (vendor builds by content; probe points by toolkit and target)."""

    table = Table(title="shard caches")
    for col in ("cache", "folder", "entries", "MB"):
        table.add_column(col, justify="right" if col in ("entries", "MB") else "left")
    folders = cache_folders()
    for name, (folder, entry) in folders.items():
        entries, size = folder_size(folder, entry)
        table.add_row(name, str(folder), str(entries), f"{size / 1e6:.1f}")
    console.print(table)
    builds, _ = folders["builds"]
    bundles = sum(1 for _ in builds.glob(f"bundle-*/{MARKER}")) if builds.is_dir() else 0
    console.print(f"builds: at most {size_limit() / 2**30:g} GiB ($SHARD_BUILD_CACHE_SIZE), the least recently "
                  f"used go first; beside vendor builds, range statistics and the fidelity check's shard runs it holds "
                  f"{bundles} whole bundles "
                  "(a recompile of an unchanged model takes its bundle from there); $SHARD_BUILD_CACHE, "
                  "$SHARD_PROBE_CACHE move them; `shard cache clear` empties them")


@app.command("clear")
def cache_clear(builds: bool = typer.Option(True, "--builds/--no-builds", help="Remove the vendor builds."),
                probes: bool = typer.Option(True, "--probes/--no-probes", help="Remove the probe points.")) -> None:
    """Remove cached vendor builds and probe points (the next compile or probe builds again); only what
    shard wrote, and only in a folder shard made its cache."""

    folders = cache_folders()
    for name, variable in (("builds", "SHARD_BUILD_CACHE"), ("probes", "SHARD_PROBE_CACHE")):
        if {"builds": builds, "probes": probes}[name]:
            folder, entry = folders[name]
            entries = entry_folders(folder) if name == "builds" else sorted(folder.glob(entry))
            count, size = clear(folder, entries, variable)
            console.print(f"{name}: removed {count} entries, {size / 1e6:.1f} MB ({folder})")
