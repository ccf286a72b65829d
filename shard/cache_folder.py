"""A folder shard keeps a cache in, and what of it is shard's: clearing and evicting touch nothing else.

The folder carries a cache directory tag (CACHEDIR.TAG, https://bford.info/cachedir/: backup tools
skip it) written when shard makes the folder, finds it empty, or it is shard's default location; an
entry is a file or folder shard marked as its own when it wrote it. `$SHARD_BUILD_CACHE` pointed at
`~/.cache` made `shard cache clear` delete the whole folder, and eviction any folder in it.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from shard.errors import ShardError

TAG = "CACHEDIR.TAG"
SIGNATURE = "Signature: 8a477f597d28d172789f06886806bc55"
TAG_TEXT = f"{SIGNATURE}\n# A cache of shard: `shard cache clear` removes the entries shard wrote here, nothing else.\n"
ENTRY = ".shard-entry"   # inside each entry folder shard wrote


def mark_folder(root: Path, default: Path | None = None) -> None:
    """Create the cache folder if need be, and tag it as shard's where it is new, empty or the default."""
    root.mkdir(parents=True, exist_ok=True)
    if not (root / TAG).is_file() and (root == default or not any(root.iterdir())):
        (root / TAG).write_text(TAG_TEXT)


def is_owned(root: Path) -> bool:
    try:
        return (root / TAG).read_text().startswith(SIGNATURE)
    except OSError:
        return False


def mark_entry(folder: Path) -> None:
    (folder / ENTRY).write_text("")


def entry_folders(root: Path) -> list[Path]:
    """The entry folders shard wrote in a cache folder (hidden ones are entries still being written)."""
    return [p for p in Path(root).glob("[!.]*/") if (p / ENTRY).is_file()] if Path(root).is_dir() else []


def disk_bytes(path: Path, seen: set | None = None) -> int:
    """The bytes of a file, or of every file below a folder, a hard-linked file counted once."""
    seen = set() if seen is None else seen
    total = 0
    for item in [path] if path.is_file() else path.rglob("*"):
        if item.is_file() and not item.is_symlink():
            stat = item.stat()
            if (stat.st_dev, stat.st_ino) not in seen:
                seen.add((stat.st_dev, stat.st_ino))
                total += stat.st_size
    return total


def clear(root: Path, entries: list[Path], variable: str) -> tuple[int, int]:
    """Remove the given entries of a cache folder shard owns, the folders they leave empty, and the
    tag and the root where nothing else is left; returns (entries, bytes) removed. A folder that is
    not shard's is refused in one line, and nothing is removed."""
    root = Path(root)
    if not root.exists():
        return 0, 0
    if not is_owned(root):
        raise ShardError(f"{root} is not a shard cache (no {TAG} of shard's in it): nothing removed; "
                         f"${variable} should name a folder of its own (an old shard cache: remove it by hand)")
    seen, removed = set(), 0
    for entry in entries:
        removed += disk_bytes(entry, seen)
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)
    for folder in sorted({parent for entry in entries for parent in entry.parents if parent.is_relative_to(root)
                          and parent != root}, key=lambda p: len(p.parts), reverse=True):
        try:
            folder.rmdir()   # the folders the entries leave empty
        except OSError:
            pass
    if [p.name for p in root.iterdir()] == [TAG]:
        (root / TAG).unlink()
        root.rmdir()
    return len(entries), removed
