"""The chips shard compiles for, as data: the one place a chip is named. The CLI's help, the vendor
toolkit's environment (shard.targets.rknn.env) and the Rockchip target read this table; a new Rockchip
chip is one row here and a probe run (`shard probe --target CHIP`). Standard library only: every
layer may read it.
"""

from __future__ import annotations

import math
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
    handoff: Handoff | None = None  # what the board's runtime takes to set a graph's inputs and get its outputs


@dataclass(frozen=True)
class Handoff:
    """The host's share of one run of a compiled graph on the board, beside the NPU's: setting its inputs
    (rknn_inputs_set converts each into the NPU's type and layout) and getting its outputs
    (rknn_outputs_get, back to float32). Each direction is the line through two points, (elements,
    seconds), never under 0: the chip's published ones, or a board's (`shard probe --on-board`, which
    also times a run's fixed cost; no published figure separates that)."""

    inputs: tuple[tuple[int, float], tuple[int, float]]
    outputs: tuple[tuple[int, float], tuple[int, float]]
    source: str
    run_s: float = 0.0   # a run's fixed cost, where a board measured it (shard.probes.handoff)

    def seconds(self, input_elements: int, output_elements: int) -> float:
        return self.run_s + through(self.inputs, input_elements) + through(self.outputs, output_elements)

    def between(self, inputs, outputs) -> float:
        """A run of a graph taking `inputs` and giving `outputs` (anything with a `shape`)."""
        return self.seconds(elements(t.shape for t in inputs), elements(t.shape for t in outputs))


def through(points: tuple[tuple[int, float], tuple[int, float]], x: int) -> float:
    (x0, y0), (x1, y1) = points
    return max(0.0, y0 + (y1 - y0) * (x - x0) / (x1 - x0))


def board_handoff(target: str, facts: dict) -> Handoff | None:
    """The hand-off a board measured (the profile's `handoff` fact), else the chip's published one."""
    if "handoff" in facts:
        measured = facts["handoff"]
        return Handoff(tuple(map(tuple, measured["inputs"])), tuple(map(tuple, measured["outputs"])),
                       measured["source"], measured["run_s"])
    chip = CHIPS.get(target)
    return chip.handoff if chip else None


def elements(shapes) -> int:
    """How many elements tensors of these shapes hold together."""
    return sum(math.prod(shape) for shape in shapes)


# rknn_model_zoo issue 167 (RK3588, the zoo's C benchmark, averages over its runs): mobilenet_v2, one
# 224 x 224 x 3 input and 1,000 outputs; yolov5s_relu, one 640 x 640 x 3 input and three outputs of
# 255 x (80^2 + 40^2 + 20^2). Both int8 models fed uint8 images: an fp16 shard's float32 inputs may
# convert at another rate: `shard probe --on-board` times the board's own.
RK3588_HANDOFF = Handoff(
    inputs=((150_528, 1.802e-3), (1_228_800, 14.845e-3)), outputs=((1_000, 0.029e-3), (2_142_000, 1.226e-3)),
    source="rknn_model_zoo issue 167, RK3588: rknn_inputs_set 1.802 ms for mobilenet_v2's 150,528 input "
           "elements and 14.845 ms for yolov5s's 1,228,800 (12.1 ns an element); rknn_outputs_get 0.029 ms for "
           "1,000 and 1.226 ms for 2,142,000 (0.56 ns an element); int8 models fed uint8 images")

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
                                              "512x512, prefill 77 ms for 128 tokens, decode 78 tokens/s"},
                   handoff=RK3588_HANDOFF),
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
