"""The chips shard compiles for, as data: the one place a chip is named. The CLI's help, the vendor
toolkit's environment (shard.targets.rknn.env) and the Rockchip target read this table; a new Rockchip
chip is one row here and a probe run (`shard probe --target CHIP`). Standard library only: every
layer may read it.
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_TARGET = "rk3588"
GPU_TARGETS = ("thor", "cuda")


@dataclass(frozen=True)
class Chip:
    """What no probe measures about one chip, each figure with where it comes from."""

    cores: int
    int8_tops: float | None       # marketed dense int8 rate, all cores (None: no public figure found)
    source: str
    fp16: bool = True             # False: the toolkit builds this chip only quantized
    dram_gbs: float | None = None   # peak DRAM bandwidth, GB/s: what bounds a decoder's tokens/s
    dram_source: str = ""
    decoder_figures: dict | None = None   # a published decoder's prefill and decode speed on this chip


TOOLKIT_FP16 = "seen here with rknn-toolkit2 2.5.0: a one-Conv fp16 model builds and simulates"
INT8_ONLY = ("seen here with rknn-toolkit2 2.5.0: build() logs `Current target_platform(rv1106) not support "
             "do_quantization = False!`")
FP16_RANGE_MARGIN = ("scale_sandwich keeps activations under the probed fp16 range (add-magnitude: the largest "
                     "output the NPU holds) divided by this: rounding inside an op (a sum, a LayerNorm's variance) "
                     "and the board's own conversions may reach past what the simulator shows")
CHIPS = {
    "rk3588": Chip(3, 6.0, "RK3588 datasheet: 3-core NPU, 6 TOPS int8", dram_gbs=33.8,
                   dram_source="RK3588 datasheet: a 64-bit bus (4 x 16-bit LPDDR4X or LPDDR5); at "
                   "LPDDR4X's 4224 MT/s, as most boards run it, a peak of 33.8 GB/s",
                   # SmolVLM-256M's decoder is SmolLM2-135M: what a user of the vendor's closed runtime gets.
                   decoder_figures={"label": "rknn-llm, SmolVLM-256M w8a8 (published)", "prefill_128_ms": 77.0,
                                    "decode_tokens_per_s": 78.0, "vision_ms": 842.0,
                                    "source": "rknn-llm's RK3588 benchmark of SmolVLM-256M in w8a8: vision 842 ms at "
                                              "512x512, prefill 77 ms for 128 tokens, decode 78 tokens/s"}),
    "rk3576": Chip(2, 6.0, "RK3576 datasheet: 2-core NPU, 6 TOPS int8 (rknn core masks NPU_CORE_0/1)"),
    "rk3568": Chip(1, 0.8, "RK3568 datasheet: 1-core NPU, 0.8 TOPS int8"),
    "rk3566": Chip(1, 0.8, "RK3566 datasheet: 1-core NPU, 0.8 TOPS int8 (the RK3568's NPU)"),
    "rk3562": Chip(1, 1.0, "RK3562 datasheet: 1-core NPU, 1 TOPS int8"),
    "rk2118": Chip(1, None, "rknn-toolkit2 support list: RK2118, 1 NPU core; no public TOPS figure found"),
    "rv1126b": Chip(1, 3.0, "RV1126B product brief: 1-core NPU, 3 TOPS int8"),
    "rv1106": Chip(1, 1.0, "RV1106 datasheet: 1-core NPU, up to 1 TOPS int8 (RV1106G3; G2: 0.5)", fp16=False),
    "rv1103": Chip(1, 0.5, "RV1103 datasheet: 1-core NPU, 0.5 TOPS int8", fp16=False),
}


def chip_facts(name: str) -> tuple[int, dict]:
    """The core count and the facts a new profile of `name` starts from (the probe adds its rates)."""
    chip = CHIPS[name]
    facts = {"cores_source": chip.source, "fp16": chip.fp16,
             "fp16_source": TOOLKIT_FP16 if chip.fp16 else INT8_ONLY,
             "job_timeout_s": 6.0,
             "job_timeout_s_source": "rknpu driver: a job is killed after about 6 s (FACTS-rk3588, upstream reports)"}
    if chip.fp16:
        facts.update(fp16_range_margin=4.0, fp16_range_margin_source=FP16_RANGE_MARGIN)
    if chip.int8_tops is not None:
        facts.update(int8_tops=chip.int8_tops, int8_tops_source=chip.source)
    return chip.cores, facts


def targets_help() -> str:
    """What --target takes, in words."""
    both = [name for name, chip in CHIPS.items() if chip.fp16]
    int8 = [name for name, chip in CHIPS.items() if not chip.fp16]
    return (f"A Rockchip chip ({', '.join(both)}; {' and '.join(int8)} in int8), {GPU_TARGETS[0]}, "
            f"{GPU_TARGETS[1]} (a GPU profiled by `shard probe --target {GPU_TARGETS[1]}`) or cpu.")
