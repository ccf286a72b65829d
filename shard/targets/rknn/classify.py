"""Decide whether one probe build passed, and if not, which way it failed.

Failure classes, the first that applies:
  timeout       no answer within the per-build time limit (the worker is killed)
  crash         the toolkit raised, or its process died
  build-error   a toolkit call returned non-zero
  overflow      REGTASK lines: a register field overflows; the build returned 0, the board would fail
  error         other `E RKNN` lines although the build returned 0, naming a register task or a fallback
                to the CPU ("channel is too large, may produce thousands of regtask, fallback to cpu",
                "emitUnpackRegtasks: equiv_channels(8196) > limitations(8192)")
  error-alone   `E RKNN` lines naming neither (error_alone): they say little about the op in its graph
  cpu-fallback  an op of the probe graph was placed on the CPU
  slow          the compiler's cycle estimate per MAC exceeds slow_factor x the peak rate
  numeric       (simulator families) output cosine against onnxruntime below the threshold
"""

from __future__ import annotations

from shard.profile import Point
from shard.targets.rknn.log import BuildDiagnostics
from shard.targets.rknn.worker import build_failure

MIN_COSINE = 0.999


def classify_build(size: int, answer: dict, diag: BuildDiagnostics, macs: int | None = None,
                   macs_per_cycle: float = 512, slow_factor: float = 4.0) -> Point:
    """A point from one build's answer and its parsed log."""
    figures = {"estimated_cycles": diag.estimated_cycles}
    if not answer.get("ok"):
        stage, rc, raised = build_failure(answer)
        if raised:
            return Point(size, False, "crash", raised, figures)
        return Point(size, False, "build-error", f"{stage}() returned {rc}: {diag.first_error or 'no error line'}",
                     figures)
    if diag.regtask_lines:
        return Point(size, False, "overflow", f"{diag.regtask_lines} REGTASK lines, first: {diag.first_regtask}",
                     figures)
    if diag.error_lines:
        evidence = f"{diag.error_lines} error lines, first: {diag.first_error}"
        return Point(size, False, "error-alone" if error_alone(evidence) else "error", evidence, figures)
    if diag.cpu_ops or diag.cpu_fallback_warnings:
        where = diag.cpu_ops[0] if diag.cpu_ops else diag.cpu_fallback_warnings[0]
        return Point(size, False, "cpu-fallback", f"on the CPU: {where}", figures)
    if macs:
        ratio = diag.estimated_cycles * macs_per_cycle / macs
        figures.update(macs=macs, cycles_per_peak=round(ratio, 2))
        summary = f"{diag.estimated_cycles:,} estimated cycles for {macs:,} MACs ({ratio:.2f}x the peak rate)"
        if ratio > slow_factor:
            return Point(size, False, "slow", summary, figures)
        return Point(size, True, None, summary, figures)
    return Point(size, True, None, "clean", figures)


def error_alone(evidence: str) -> bool:
    """`E` lines naming neither a register overflow nor a CPU fallback. Alone, such lines say little
    about the op in its graph: every [1, 1024, 768] elementwise op of SigLIP-512 logs `surf_len
    overflow!` built alone on RK2118 (330 ops; split, the model grew to 4304 nodes and the toolkit ran
    for more than 8 minutes), the whole model 10, and it simulates at 0.9999992; RK3568 logs `Unkown op
    target: 0` for 3-D elementwise ops alone. The passes do not rewrite for them; they rank last among
    the measured axes (shard.never_worse), after the cycles a split costs, so the shard's own build
    reports them instead."""
    said = evidence.lower()
    return "regtask" not in said and "fallback" not in said


def in_current_words(point: Point) -> Point:
    """A point classified before the failure classes were renamed (a probe cache's): "regtask" is
    "overflow", and an "error" of lines naming neither an overflow nor a fallback is "error-alone"."""
    if point.failure == "regtask":
        point.failure = "overflow"
    elif point.failure == "error" and error_alone(point.evidence):
        point.failure = "error-alone"
    return point


def classify_numeric(point: Point, cosine: float) -> Point:
    """A point that built clean, judged again by its simulator output."""
    point.figures["cosine"] = round(float(cosine), 7) if cosine == cosine else None
    if not cosine >= MIN_COSINE:  # NaN fails too
        return Point(point.size, False, "numeric", f"simulator cosine {cosine:.6f} < {MIN_COSINE} vs onnxruntime fp32",
                     point.figures)
    point.evidence = f"simulator cosine {cosine:.7f}"
    return point
