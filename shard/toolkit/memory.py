"""What one vendor build takes in memory, predicted from the weight bytes it holds, and how many
shards keep a compile's builds within half of the whole model's.

rknn-toolkit2 2.5.0, fp16, measured on a 2-core x86 machine: a one-MatMul model peaks at 0.34 GB
(the toolkit's own imports: torch alone is 0.19 GB), SigLIP-512's 346 MB of weights at 2.44 GB,
all-mpnet-base-v2's 436 MB at 2.74 GB, one SigLIP layer (28 MB) at 0.53 GB. The compile's own
process holds 0.14 GB while the toolkit builds (the weights are released once the shards are written).
"""

from __future__ import annotations

import math

TOOLKIT_BYTES = 0.34e9
BUILD_BYTES_PER_WEIGHT_BYTE = 6.1   # the steeper of the two whole models: the guess errs towards more memory
COMPILE_BYTES = 0.15e9              # the compile's own process beside its builds


def build_bytes(weight_bytes: int) -> int:
    """The peak memory of one vendor build holding `weight_bytes` of weights."""
    return int(TOOLKIT_BYTES + BUILD_BYTES_PER_WEIGHT_BYTE * weight_bytes)


def shards_for_memory(weight_bytes: int, jobs: int) -> int:
    """The fewest shards whose builds, `jobs` at once beside the compile's own process, are predicted
    to take at most half of one vendor build of the whole model; 0 where no count does (below about
    200 MB of weights with 2 jobs: the toolkit's own memory is most of every build, and more of them
    at once only add it up). SigLIP-512, 2 jobs: 11."""
    per_build = (build_bytes(weight_bytes) / 2 - COMPILE_BYTES) / max(1, jobs) - TOOLKIT_BYTES
    return math.ceil(BUILD_BYTES_PER_WEIGHT_BYTE * weight_bytes / per_build) if per_build > 0 else 0
