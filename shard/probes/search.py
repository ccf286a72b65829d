"""Find the largest size that passes: double until the first failure, then bisect to the exact boundary.

The oracle is any function size -> Point; the search assumes that past the boundary every size fails
(it reports the boundary it found, and the points it saw, so a non-monotone family shows itself).
A family known not to be monotone is swept instead: every size, and the set of those that pass.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from shard.profile import Point


@dataclass
class Boundary:
    largest_ok: int | None         # None: even the smallest size tried failed
    smallest_failing: int | None   # None: nothing failed up to the maximum
    points: list[Point]
    passing: list[int] | None = None   # a swept (non-monotone) family: every size that passed

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


def sweep(test: Callable[[int], Point], sizes, on_point: Callable[[int], None] = lambda size: None) -> Boundary:
    """Every size tested, for a family whose verdict is not monotone in its size (a patch Conv is
    fast at stride 7 and 9 and slow at 8): the boundary of the sizes that pass, and their set."""
    points = []
    for size in sizes:
        on_point(size)
        points.append(test(size))
    passing = [p.size for p in points if p.ok]
    failing = [p.size for p in points if not p.ok]
    return Boundary(max(passing, default=None), min(failing, default=None), points, passing)
