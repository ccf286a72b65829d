"""compare: one output against its reference (cosine, largest difference), for every layer that checks
numerics (verify, the passes' probes, precision's rankings). numpy only."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np


@dataclass
class Comparison:
    name: str
    cosine: float
    max_abs_diff: float
    finite: bool = True             # the values compared hold no NaN and no Inf
    reference_finite: bool = True   # nor do the reference's

    @property
    def overflowed(self) -> bool:
        """A NaN or an Inf where the reference has none: the output left its number format."""
        return self.reference_finite and not self.finite


def compare(name: str, expected: np.ndarray, actual: np.ndarray) -> Comparison:
    """Cosine and largest difference of two arrays of one shape; another shape (or size) is NaN, never
    a pass (flattened, a [1, 16, 8] output matched a [1, 8, 16] reference)."""
    if np.shape(expected) != np.shape(actual):
        return Comparison(name, math.nan, math.inf)
    a = np.asarray(expected, dtype=np.float64).ravel()
    b = np.asarray(actual, dtype=np.float64).ravel()
    with np.errstate(invalid="ignore", over="ignore"):  # inf or NaN in an output: cosine NaN, never a pass
        na, nb = np.linalg.norm(a), np.linalg.norm(b)
        cosine = 1.0 if na == nb == 0 else float(a @ b / (na * nb)) if na and nb else 0.0
        diff = float(np.max(np.abs(a - b))) if a.size else 0.0
    return Comparison(name, cosine, diff, bool(np.isfinite(b).all()), bool(np.isfinite(a).all()))


def nan_first(cosine: float) -> tuple[bool, float]:
    """The key that orders cosines from the worst: a NaN before any number (min over floats keeps a
    NaN only where it comes first)."""
    return cosine == cosine, cosine


def worst_of(comparisons: Iterable[Comparison]) -> Comparison:
    """The comparison with the lowest cosine; one with a NaN before any number."""
    return min(comparisons, key=lambda c: nan_first(c.cosine))


def lowest(cosines: Iterable[float]) -> float:
    """The lowest of these cosines; a NaN before any number."""
    return min(cosines, key=nan_first)
