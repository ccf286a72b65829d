"""The names the stages of a compile share: precisions, build suffixes, the progress callback."""

from __future__ import annotations

from typing import Callable

Progress = Callable[[str, int, int], None]  # (step, done, total)
PRECISIONS = ("fp16", "int8", "mixed", "fp8", "w4a16")
QUANTIZED = ("int8", "mixed")   # precisions that need calibration samples
VENDOR_ALONE = "vendor_alone"     # the job building the model as it came, as the vendor alone would
SHARD_BY_SHARD = "vendor alone shard by shard"   # its figures where the whole model's build is not made
UNREWRITTEN = ".unrewritten"      # a shard's twin without the passes' rewrites
RELAID = ".edges"                 # a shard built with its edges in the target's layout (Target.edge_layouts)
FIDELITY_SAMPLES = 4              # calibration samples the quantized bundle and the vendor's are compared on
LOW_FIDELITY = 0.99               # a quantized bundle below this simulator cosine gets a warning
