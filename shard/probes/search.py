"""Find the largest size that passes: double until the first failure, then bisect to the exact boundary.

The oracle is any function size -> Point; the search assumes that past the boundary every size fails
(it reports the boundary it found, and the points it saw, so a non-monotone family shows itself).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable


@dataclass
class Point:
    """One probed size: did it pass, and if not, how it failed (class) and the line that says so."""

    size: int
    ok: bool
    failure: str | None = None
    evidence: str = ""
    figures: dict = field(default_factory=dict)   # e.g. estimated cycles, MACs, cosine
    cached: bool = False


@dataclass
class Boundary:
    largest_ok: int | None         # None: even the smallest size tried failed
    smallest_failing: int | None   # None: nothing failed up to the maximum
    points: list[Point]

    @property
    def failing_point(self) -> Point | None:
        return next((p for p in self.points if p.size == self.smallest_failing), None)

    @property
    def builds(self) -> int:
        return sum(1 for p in self.points if not p.cached)


def find_boundary(test: Callable[[int], Point], start: int, max_size: int, min_size: int = 1,
                  on_bracket: Callable[[int | None, int | None], None] = lambda lo, hi: None) -> Boundary:
    """The largest passing size in [min_size, max_size], in O(log) calls of `test`.

    From `start`, double while sizes pass; if `start` itself fails, halve down to `min_size`. Between
    the last pass and the first failure, try last-pass + 1 first (limits are often exact powers of
    two, which then cost one build instead of a bisection), then bisect.
    """
    if not min_size <= start <= max_size:
        raise ValueError(f"start {start} is outside [{min_size}, {max_size}]")
    seen: dict[int, Point] = {}

    def at(size: int) -> Point:
        if size not in seen:
            seen[size] = test(size)
        return seen[size]

    lo: int | None = None
    hi: int | None = None
    size = start
    while True:
        on_bracket(lo, hi)
        if at(size).ok:
            lo = size
            if size >= max_size:
                break
            size = min(2 * size, max_size)
        else:
            hi = size
            break
    while lo is None and hi > min_size:  # the start failed: look below it
        on_bracket(lo, hi)
        size = max(hi // 2, min_size)
        if at(size).ok:
            lo = size
        else:
            hi = size
    if lo is not None and hi is not None and hi - lo > 1:
        on_bracket(lo, hi)
        if at(lo + 1).ok:
            lo += 1
        else:
            hi = lo + 1
    while lo is not None and hi is not None and hi - lo > 1:
        on_bracket(lo, hi)
        mid = (lo + hi) // 2
        if at(mid).ok:
            lo = mid
        else:
            hi = mid
    return Boundary(lo, hi, [seen[s] for s in sorted(seen)])
