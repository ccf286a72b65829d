"""Probe points on disk, one JSON file each, keyed by (toolkit version, target, family, setting, size).

A rerun, or a run that was interrupted, is served from here; a family's `version` is in the key,
so changing a builder invalidates its old points.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import asdict
from pathlib import Path

from shard.cache_folder import mark_folder
from shard.profile import Point
from shard.targets.rknn.classify import in_current_words

POINTS = "*/*/*/v*-*.json"   # a point's file below the cache folder: toolkit/target/limit/v{version}-{size}.json


def default_cache_dir() -> Path:
    return Path(os.environ.get("SHARD_PROBE_CACHE") or Path.home() / ".cache" / "shard" / "probes")


class PointCache:
    def __init__(self, root: Path | None, toolkit: str, target: str, read: bool = True):
        self.root = None if root is None else Path(root)
        self.dir = None if root is None else self.root / toolkit.replace(" ", "-") / target
        self.read = read

    def get(self, limit: str, version: int, size: int | str) -> Point | None:
        """The cached point for a family's size, or (size a digest) for one model under `limit`."""
        if self.dir is None or not self.read:
            return None
        try:
            data = json.loads((self.dir / limit / f"v{version}-{size}.json").read_text())
        except (OSError, json.JSONDecodeError):
            return None
        return in_current_words(Point(**{**data, "cached": True}))

    def put(self, limit: str, version: int, point: Point, size: int | str | None = None) -> None:
        if self.dir is None:
            return
        path = self.dir / limit / f"v{version}-{point.size if size is None else size}.json"
        mark_folder(self.root, "SHARD_PROBE_CACHE")
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump({**asdict(point), "cached": False}, f)
        os.replace(tmp, path)  # a point is on disk whole or not at all
