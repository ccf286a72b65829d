"""The user's choices for one compile (hardware facts live in the target's profile)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from shard.errors import ShardError


@dataclass
class CompileOptions:
    """What `shard compile`'s flags set; shard.compilation.compile_model takes it, and every pass reads it
    as PassContext.options."""

    input_shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    input_values: dict[str, list] = field(default_factory=dict)   # inputs fixed at compile: constants
    shards: int | None = None       # default: one, more for a large model's build memory
                                    # (shard.targets.rknn.memory.shards_for_memory)
    max_ops: int | None = None      # more shards if any would hold more ops than this
    jobs: int = 2                   # vendor builds in parallel
    ray: str | None = None          # a Ray cluster the vendor builds run on ("local": one started here)
    timeout: float = 1800.0         # seconds one vendor build may take
    profile: str | None = None      # a profile file instead of the shipped one
    disable: tuple[str, ...] = ()   # optional passes to skip
    tile_attention: str = "auto"    # auto (only where a limit requires it), off, force
    fusion_barrier: str = "check"   # check, rules (with disable_rules), pill
    disable_rules: tuple[str, ...] = ()   # toolkit fusion rules to switch off (--fusion-barrier rules)
    dump_after: dict[str, str] = field(default_factory=dict)   # {pass: directory} for the graph after it
    vendor_baseline: bool = True    # also build the model as it came, compare, and never be worse
    vendor_alone: str = "auto"      # how: whole (the model as it came), shards (each shard without its
                                    # rewrites), auto (whole where its memory fits and, for a large fp16
                                    # model, a core is free for it: never_worse.whole_build_fits)
    vendor_only: bool = False       # a bundle of the vendor alone: the model as it came, no rewrites
    build_cache: bool = True        # reuse vendor builds of the same shard bytes (shard.targets.build_cache)
    check_fidelity: bool | None = None   # also run shard's bundle and the vendor alone's on the simulator
                                         # (None: only where the precision is not the target's default)
    precision: str = "fp16"         # fp16, int8 or mixed (rk3588)
    calib: str | None = None        # calibration samples (.npz, shard.calibration); seeded random without
    min_cosine: float = 0.999       # fp16: the floor under the bundle's simulator cosine (where it is
                                    # checked); mixed: the cosine on the calibration samples to reach
    allow_low_fidelity: bool = False   # write a bundle under the floor (NaN, Inf, or under min_cosine)
    promote: tuple[str, ...] | None = None   # mixed: linears kept in fp16 (None: search, compile_mixed)
    buckets: list[dict[str, tuple[int, ...]]] = field(default_factory=list)   # input shapes per bucket
    batch: int | None = 1           # frames a run takes at once (the inputs' leading axis); None: the GPU
                                    # cost model picks it (shard.compilation.batching)
    latency_budget: float | None = None   # --batch auto: seconds one batch may take through the stages


def check_seconds(seconds: float | None, option: str = "--timeout") -> None:
    """A time limit the user gave: a number of seconds above 0 (0, -1 and nan were taken and ignored)."""
    if seconds is not None and not 0.0 < seconds < math.inf:
        raise ShardError(f"{option} {seconds}: expected a number of seconds above 0")
