"""Whole bundles kept by content: compiling an unchanged model again puts its bundle back, building
and rewriting nothing.

The key is the hash of all a compile reads: the model file (its name, its bytes and the external
data files it names), the options that shape the bundle, the profile file when one is given, the
calibration samples, the target's toolchain and shard's own code (its shipped profiles included).
A hit links the bundle's large files from the cache, copies the small ones and marks the report;
after a miss, the finished bundle is stored. Entries (`bundle-KEY`) share the build cache's folder
and cap (shard.targets.build_cache), and are evicted with its entries, least recently used first.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from dataclasses import asdict
from functools import cache
from pathlib import Path

import onnx

import shard
from shard.errors import ModelError
from shard.graph import external_data_files, sha256_file
from shard.cache_folder import entry_file, prune, size_limit, store_entry

VERSION = 1
MARKER = "bundle.json"     # an entry's record, touched on each hit
IGNORED = ("jobs", "build_cache", "ray", "latency_budget")   # options that do not change the bundle (the
                                                              # budget only picks --batch auto's batch)


@cache
def code_digest() -> str:
    """The hash of shard's package files: a new version or an edited pass misses every entry."""
    digest = hashlib.sha256()
    root = Path(shard.__file__).parent
    for path in sorted(p for p in root.rglob("*") if p.is_file() and "__pycache__" not in p.parts):
        digest.update(str(path.relative_to(root)).encode() + b"\0")
        sha256_file(path, digest)
    return digest.hexdigest()


def model_digest(model: Path, digest) -> None:
    """The model's name and bytes, and those of each external data file it names, into `digest`."""
    digest.update(model.name.encode() + b"\0")
    named, tail = False, b""   # does "location" occur: some tensor may keep its bytes in a file beside it
    with open(model, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
            named = named or b"location" in tail + block[:16] or b"location" in block
            tail = block[-8:]
    if named:
        try:
            proto = onnx.load(str(model), load_external_data=False)
        except Exception as exc:  # noqa: BLE001 - protobuf's decode errors; load_model names them
            raise ModelError(f"{model}: not an ONNX model ({type(exc).__name__}: {exc})") from None
        for path in external_data_files(model, proto):
            digest.update(str(path.relative_to(model.parent.resolve())).encode() + b"\0")
            sha256_file(path, digest)


def bundle_key(model: Path, target: str, toolchain: str, options) -> str | None:
    """The key of this compile's bundle; None where the compile must run (no cache, --dump-after)."""
    if not options.build_cache or options.dump_after:
        return None
    digest = hashlib.sha256(json.dumps([VERSION, target, toolchain, code_digest()]).encode())
    # The profile's and samples' content is hashed below, not where they lie (a decoder's samples are
    # written to a new temporary folder by each compile).
    chosen = {k: bool(v) if k in ("profile", "calib") else v for k, v in asdict(options).items() if k not in IGNORED}
    digest.update(json.dumps(chosen, sort_keys=True, default=str).encode())
    for path in (options.profile, options.calib):
        if path:
            sha256_file(path, digest)
    model_digest(Path(model), digest)
    return digest.hexdigest()[:32]


def entry_name(key: str) -> str:
    return f"bundle-{key}"


def copy_tree(src: Path, dst: Path) -> None:
    """The files under src at the same places under dst, copied: a bundle shares no file with the
    cache, so an edit of one never reaches the other (hard-linked, truncating an entry truncated the
    bundles made from it). The restored bundle is checked against its manifest's hashes."""
    for path in sorted(src.rglob("*")):
        target = dst / path.relative_to(src)
        if path.is_dir():
            target.mkdir(parents=True, exist_ok=True)
        elif path.is_file() and not path.is_symlink():
            shutil.copyfile(path, target)


def restore(root: Path, key: str, staging: Path) -> dict | None:
    """Fill `staging` with the stored bundle; its record, or None on a miss."""
    marker = entry_file(root, entry_name(key), MARKER)   # marks it used
    if marker is None:
        return None
    try:
        record = json.loads(marker.read_text())
        copy_tree(marker.parent / "bundle", staging)
    except (OSError, json.JSONDecodeError):   # evicted under our feet
        return None
    return record


def store(root: Path, key: str, bundle: Path, seconds: float) -> None:
    """Keep a finished bundle, then bring the cache back under its cap (this entry kept)."""
    def write(staging: Path) -> None:
        copy_tree(bundle, staging / "bundle")
        (staging / MARKER).write_text(json.dumps({"seconds": round(seconds, 2), "stored": time.time()}))

    store_entry(root, entry_name(key), write)
    prune(root, size_limit(), keep={entry_name(key)})


def discard(root: Path, key: str) -> None:
    shutil.rmtree(Path(root) / entry_name(key), ignore_errors=True)
