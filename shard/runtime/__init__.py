"""Load a bundle and run it. Imports numpy and the chosen executor's library, nothing else.

    session = shard.load("model.shard", backend="board", cores=[0, 1, 2])
    outputs = session.run({"pixel_values": x})
    for outputs in session.run_stream(frames): ...
"""

from __future__ import annotations

from pathlib import Path

from shard.runtime.buckets import BucketedSession, is_bucketed
from shard.runtime.generate import GenerativeSession
from shard.runtime.generative_bundle import is_generative
from shard.runtime.session import (STAGE_BACKENDS, OnDevice, Session, ShardTiming, default_backend, frame_inputs,
                                   random_inputs)

__all__ = ["STAGE_BACKENDS", "BucketedSession", "GenerativeSession", "OnDevice", "Session", "ShardTiming",
           "default_backend", "frame_inputs", "load", "random_inputs"]


def load(bundle: str | Path, backend: str | None = None, cores: list[int] | None = None,
         schedule: str | None = None, timeout: float | None = None) -> Session:
    """Open a bundle for running; backend is cpu, sim (rknn simulator), board (on an RK3588), cuda (any
    NVIDIA GPU with torch) or tensorrt (engines from `shard build-engines`). A bundle of shape buckets
    gives a BucketedSession (shard.runtime.buckets): each input runs on the smallest bucket it fits; a
    decoder's bundle a GenerativeSession (shard.runtime.generate), whose generate() writes text."""
    if is_generative(bundle):
        return GenerativeSession(bundle, backend=backend, cores=cores, schedule=schedule, timeout=timeout)
    if is_bucketed(bundle):
        return BucketedSession(bundle, backend=backend, cores=cores, schedule=schedule, timeout=timeout)
    return Session(bundle, backend, cores, schedule, timeout)
