"""A folder shard keeps a cache in, and what of it is shard's: clearing and evicting touch nothing else.

The folder carries a cache directory tag (CACHEDIR.TAG, https://bford.info/cachedir/: backup tools
skip it) written when shard makes the folder, finds it empty, or it is shard's default location; an
entry is a file or folder shard marked as its own when it wrote it. `$SHARD_BUILD_CACHE` pointed at
`~/.cache` made `shard cache clear` delete the whole folder, and eviction any folder in it.

The helpers every cache shares live here too (the build cache, the bundle cache and the point cache;
the calibration statistics keep their entries in the build cache's folder): entries written whole
or not at all, a hit marking its entry used, eviction by least recent use under a size cap.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable

from shard.errors import CompileError, ShardError

TAG = "CACHEDIR.TAG"
SIGNATURE = "Signature: 8a477f597d28d172789f06886806bc55"
TAG_TEXT = f"{SIGNATURE}\n# A cache of shard: `shard cache clear` removes the entries shard wrote here, nothing else.\n"
ENTRY = ".shard-entry"   # inside each entry folder shard wrote
DEFAULT_SIZE = "10G"
UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def shard_home() -> Path:
    """shard's own folder of caches, whose folders are shard's whatever they hold (~/.cache/shard)."""
    return Path.home() / ".cache" / "shard"


def mark_folder(root: Path, variable: str = "SHARD_BUILD_CACHE") -> None:
    """Create the cache folder if need be, and tag it as shard's where it is new, empty or below
    shard_home(); a folder holding anything else untagged (`$variable` at $HOME), a file, or a folder
    shard cannot write, is refused in one line: a tag there would make backup tools skip it all."""
    where = f"${variable} names {root}" if os.environ.get(variable) else f"the cache folder {root}"
    if root.exists() and not root.is_dir():
        raise ShardError(f"{where}, which is not a folder; name a folder of shard's own for the cache")
    try:
        root.mkdir(parents=True, exist_ok=True)
        if not is_owned(root):
            if any(root.iterdir()) and not root.resolve().is_relative_to(shard_home().resolve()):
                raise ShardError(f"{where}, which holds files that are not shard's cache; name an empty folder "
                                 f"or one of its own (shard tags its cache folder with {TAG}, which backup tools skip)")
            (root / TAG).write_text(TAG_TEXT)
    except OSError as exc:
        raise ShardError(f"{where}, which shard cannot write ({exc.strerror}); name a folder shard can write") from None
    if not os.access(root, os.W_OK | os.X_OK):
        raise ShardError(f"{where}, which shard cannot write (read-only); name a folder shard can write")


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
    seen, removed, gone = set(), 0, []
    for entry in entries:
        size = disk_bytes(entry, seen)
        try:
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink(missing_ok=True)
        except OSError as exc:   # a read-only cache: say so rather than count what is still there
            raise ShardError(f"{root}: cannot remove {entry.name} ({exc.strerror}); {len(gone)} entries removed "
                             f"before it") from None
        removed += size
        gone.append(entry)
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


def default_cache_dir() -> Path:
    return Path(os.environ.get("SHARD_BUILD_CACHE") or Path.home() / ".cache" / "shard" / "builds")


def size_limit() -> int:
    """The cache's cap in bytes, from $SHARD_BUILD_CACHE_SIZE (`10G`, `500M`, `0` keeps nothing)."""
    text = (os.environ.get("SHARD_BUILD_CACHE_SIZE") or DEFAULT_SIZE).strip().upper().removesuffix("B")
    unit = text[-1:] if text[-1:] in UNITS else ""
    try:
        return int(float(text[:len(text) - len(unit)]) * UNITS[unit])
    except ValueError:
        raise CompileError(f"SHARD_BUILD_CACHE_SIZE={text!r}: expected bytes with an optional K, M, G or T "
                           f"suffix, like 10G") from None


def prune(root: Path, limit: int, keep: set[str]) -> tuple[int, int]:
    """Evict a cache folder's least recently used entries, none named in `keep`, until it holds at
    most `limit` bytes; returns what was evicted (entries, bytes)."""
    entries = []
    for folder in entry_folders(root):   # shard's own entries only; an entry's last use: its newest file
        try:
            used = max((f.stat().st_mtime for f in folder.iterdir()), default=0.0)
            entries.append((used, folder, disk_bytes(folder)))
        except OSError:   # another compile evicted it first
            continue
    total = sum(size for _, _, size in entries)
    evicted = [0, 0]
    for _, folder, size in sorted(entries, key=lambda e: e[0]):
        if total <= limit:
            break
        if folder.name in keep:
            continue
        shutil.rmtree(folder, ignore_errors=True)
        total -= size
        evicted[0] += 1
        evicted[1] += size
    return evicted[0], evicted[1]


def store_entry(root: Path, key: str, write: Callable[[Path], None]) -> None:
    """Write an entry whole or not at all: `write` fills a staging folder, renamed to `root/key`."""
    mark_folder(root)
    staging = Path(tempfile.mkdtemp(prefix=f".{key}-", dir=root))
    try:
        write(staging)
        mark_entry(staging)
        staging.rename(root / key)
    except OSError:  # another compile stored the same entry first, or the disk is full: no entry
        shutil.rmtree(staging, ignore_errors=True)


def entry_file(root: Path, key: str, name: str) -> Path | None:
    """A cache entry's file, marked used now (the last to be evicted); None on a miss."""
    path = Path(root) / key / name
    try:
        os.utime(path)
    except OSError:
        return None
    return path


def link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copyfile(src, dst)


def folder_size(root: Path, entry: str) -> tuple[int, int]:
    """(entries: files matching the glob `entry`, bytes of every file below, hard links once) of a cache."""
    if not Path(root).is_dir():
        return 0, 0
    return sum(1 for _ in Path(root).glob(entry)), disk_bytes(Path(root))
