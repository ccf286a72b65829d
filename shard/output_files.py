"""A file a command writes where the user named it (--json, pack -o): never inside the bundle the
command reads, never over a file already there unless --force, and only into a folder that exists;
checked before the work, so a long generation's result is not lost to a path it cannot write."""

from __future__ import annotations

from pathlib import Path

from shard.errors import ShardError


def check_output_file(path: Path, option: str, reading: Path | None = None, force: bool = False) -> None:
    """One line (ShardError) where `path` cannot take what `option` writes."""
    if reading is not None and path.resolve().is_relative_to(Path(reading).resolve()):
        raise ShardError(f"{option} {path}: inside the bundle {reading}, which this reads; write it elsewhere")
    if path.is_dir():
        raise ShardError(f"{option} {path}: a folder is there; name a file")
    if not path.parent.is_dir():
        raise ShardError(f"{option} {path}: no folder {path.parent} to write it in")
    if path.exists() and not force:
        raise ShardError(f"{option} {path}: a file is there; pass --force to replace it")
