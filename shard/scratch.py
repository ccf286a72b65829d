"""Temporary folders that a killed process cannot leave behind for good.

Each folder (TMPDIR/shard-KIND-*) holds a lock file that its process keeps locked for as long as it
lives; the kernel lets go of the lock when the process dies, SIGKILL included. The first folder a later
process makes sweeps every shard folder whose lock is free. A folder kept on purpose (build logs that
an error message names) gives up its lock file, so that no sweep takes it. The folders a process still
holds when it exits normally go then (atexit), such as a simulator's that its session left open
because a core was still inside it when the session closed.

    work = scratch.folder("ops")
    ...
    scratch.remove(work)
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import os
import shutil
import tempfile
import threading
from pathlib import Path

LOCK = ".shard-owner"
_held: dict[str, int] = {}   # folder -> the descriptor holding its lock
_guard = threading.Lock()
_swept = False
_at_exit = 0   # the process whose exit removes the folders it still holds


def folder(kind: str) -> Path:
    """A new private folder TMPDIR/shard-KIND-*, locked by this process until remove() or keep()."""
    sweep_once()
    path = Path(tempfile.mkdtemp(prefix=f"shard-{kind}-"))
    fd = os.open(path / LOCK, os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    global _at_exit
    with _guard:
        if _at_exit != os.getpid():
            _at_exit = os.getpid()
            atexit.register(_remove_at_exit, _at_exit)
        _held[str(path)] = fd
    return path


def _remove_at_exit(pid: int) -> None:
    if os.getpid() == pid:   # not a forked child's exit: the folders are its parent's
        remove_all()


def remove(path: str | Path) -> None:
    """Remove a folder made by folder() (or kept by keep()), then let go of its lock."""
    shutil.rmtree(path, ignore_errors=True)
    _release(path)


def remove_all() -> None:
    """Remove every folder this process holds (for an exit that runs no finalizer: os._exit)."""
    for path in list(_held):
        remove(path)


def keep(path: str | Path) -> None:
    """Keep the folder past this process: its lock file goes, so no later sweep removes it."""
    with contextlib.suppress(OSError):
        (Path(path) / LOCK).unlink()
    _release(path)


@contextlib.contextmanager
def temporary(kind: str):
    """folder() for the length of a with block."""
    path = folder(kind)
    try:
        yield path
    finally:
        remove(path)


def _release(path: str | Path) -> None:
    with _guard:
        fd = _held.pop(str(path), None)
    if fd is not None:
        os.close(fd)


def sweep_once() -> None:
    global _swept
    if not _swept:
        _swept = True
        sweep()


def sweep(root: str | Path | None = None) -> list[Path]:
    """Remove the shard folders in `root` (TMPDIR) whose process is gone: those whose lock file no
    process holds. Folders without one (kept, or another program's) are not touched."""
    try:
        entries = list(os.scandir(root or tempfile.gettempdir()))
    except OSError:
        return []
    removed = []
    for entry in entries:
        if not entry.name.startswith("shard-") or str(entry.path) in _held:
            continue
        try:
            fd = os.open(os.path.join(entry.path, LOCK), os.O_RDWR | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)   # held: its process runs
            continue
        shutil.rmtree(entry.path, ignore_errors=True)
        os.close(fd)
        removed.append(Path(entry.path))
    return removed
