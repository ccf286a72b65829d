"""Decide whether one probe build passed, and if not, which way it failed.

Failure classes, the first that applies:
  timeout       no answer within the per-build time limit (the worker is killed)
  crash         the toolkit raised, or its process died
  build-error   a toolkit call returned non-zero
  regtask       REGTASK lines: a register field overflows; the build returned 0, the board would fail
  error         other `E RKNN` lines although the build returned 0
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
        return Point(size, False, "regtask", f"{diag.regtask_lines} REGTASK lines, first: {diag.first_regtask}", figures)
    if diag.error_lines:
        return Point(size, False, "error", f"{diag.error_lines} error lines, first: {diag.first_error}", figures)
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


def classify_numeric(point: Point, cosine: float) -> Point:
    """A point that built clean, judged again by its simulator output."""
    point.figures["cosine"] = round(float(cosine), 7) if cosine == cosine else None
    if not cosine >= MIN_COSINE:  # NaN fails too
        return Point(point.size, False, "numeric", f"simulator cosine {cosine:.6f} < {MIN_COSINE} vs onnxruntime fp32",
                     point.figures)
    point.evidence = f"simulator cosine {cosine:.7f}"
    return point
