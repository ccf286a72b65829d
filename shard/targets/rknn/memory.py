"""What one vendor build takes in memory, predicted from the weight bytes it holds, and how many
shards keep a compile's builds within half of the whole model's.

rknn-toolkit2 2.5.0, fp16, measured on a 2-core x86 machine: a one-MatMul model peaks at 0.34 GB
(the toolkit's own imports: torch alone is 0.19 GB), SigLIP-512's 346 MB of weights at 2.44 GB,
all-mpnet-base-v2's 436 MB at 2.74 GB, one SigLIP layer (28 MB) at 0.53 GB. The compile's own
process holds 0.14 GB while the toolkit builds (the weights are released once the shards are written).

A shard build in a compile's worker starts higher: the worker has built before (onnxruntime, which the
toolkit imports in its first build, and what its allocator keeps), and each build has brief peaks (the
toolkit runs the shard's operators in onnxruntime, attention's activations included) that the two
workers now and then reach at once. SigLIP-512 compiled with 11, 16, 20 and 22 shards, 2 jobs, peaked
at 1.37-1.39, 1.26-1.33, 1.21 and 1.20-1.25 GB over all its processes: per worker 0.44 GB plus about
6 bytes per weight byte of its shard (each build's own peak is in the report: build_peak_bytes).
Those runs had each worker import the toolkit itself; now the first worker forks the others
(toolkit.worker), which share its import, and 11, 16 and 22 shards peak at 1.30, 1.21 and
1.11-1.16 GB: WORKER_BYTES errs towards more shards, as the builds' own guess does.
"""

from __future__ import annotations

import math
from pathlib import Path

TOOLKIT_BYTES = 0.34e9              # a whole build in a process of its own
WORKER_BYTES = 0.44e9               # a shard build in a compile's worker, at the compile's peak
BUILD_BYTES_PER_WEIGHT_BYTE = 6.1   # the steeper of the two whole models: the guess errs towards more memory
COMPILE_BYTES = 0.15e9              # the compile's own process beside its builds
MIN_SHARD_WEIGHT_BYTES = 8e6        # a smaller shard's build is nearly all the toolkit's own memory


def build_bytes(weight_bytes: int) -> int:
    """The peak memory of one vendor build holding `weight_bytes` of weights."""
    return int(TOOLKIT_BYTES + BUILD_BYTES_PER_WEIGHT_BYTE * weight_bytes)


def worker_build_bytes(weight_bytes: int) -> int:
    """The peak memory of a toolkit worker while it builds a model holding `weight_bytes` of weights
    (what a Ray actor reserves for it: shard.targets.rknn.remote)."""
    return int(WORKER_BYTES + BUILD_BYTES_PER_WEIGHT_BYTE * weight_bytes)


def onnx_weight_bytes(onnx: Path) -> int:
    """The bytes of an ONNX file and its external data (shard writes NAME.data beside it): its weights,
    near enough (the graph itself is small beside them)."""
    data = onnx.with_name(f"{onnx.name}.data")
    return onnx.stat().st_size + (data.stat().st_size if data.is_file() else 0)


def shards_for_memory(weight_bytes: int, jobs: int) -> int:
    """The fewest shards whose builds, `jobs` at once beside the compile's own process, are predicted
    to take at most half of one vendor build of the whole model; 0 where no count does with shards of
    MIN_SHARD_WEIGHT_BYTES or more (below about 320 MB of weights with 2 jobs: the toolkit's own
    memory is most of every build, and more of them at once only add it up). SigLIP-512, 2 jobs: 22."""
    per_build = (build_bytes(weight_bytes) / 2 - COMPILE_BYTES) / max(1, jobs) - WORKER_BYTES
    per_shard = per_build / BUILD_BYTES_PER_WEIGHT_BYTE   # the weights one shard may hold
    return math.ceil(weight_bytes / per_shard) if per_shard >= MIN_SHARD_WEIGHT_BYTES else 0
