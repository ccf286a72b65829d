"""Shard executions as a Chrome trace (open it in Perfetto: ui.perfetto.dev) and per-core utilisation."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from shard.runtime.scheduler import Execution


@dataclass
class CoreUse:
    core: int
    busy: float                   # seconds spent running shards
    span: float                   # seconds from the first start to the last end, over all cores
    runs: int

    @property
    def utilisation(self) -> float:
        return self.busy / self.span if self.span > 0 else 0.0


def core_use(executions: list[Execution], cores: list[int]) -> list[CoreUse]:
    """Busy time of each core over the span of all executions."""
    if not executions:
        return [CoreUse(c, 0.0, 0.0, 0) for c in cores]
    span = max(e.end for e in executions) - min(e.start for e in executions)
    return [CoreUse(c, sum(e.end - e.start for e in executions if e.core == c), span,
                    sum(1 for e in executions if e.core == c)) for c in cores]


def chrome_trace(executions: list[Execution], cores: list[int], title: str) -> dict:
    """Trace-event JSON: one process, one thread (track) per core, one complete event per shard run."""
    origin = min((e.start for e in executions), default=0.0)
    us = lambda seconds: round(seconds * 1e6, 3)  # noqa: E731
    events: list[dict] = [{"ph": "M", "pid": 1, "tid": 0, "name": "process_name", "args": {"name": title}}]
    for c in cores:
        events.append({"ph": "M", "pid": 1, "tid": c, "name": "thread_name", "args": {"name": f"core {c}"}})
        events.append({"ph": "M", "pid": 1, "tid": c, "name": "thread_sort_index", "args": {"sort_index": c}})
    for e in executions:
        events.append({"ph": "X", "pid": 1, "tid": e.core, "name": e.shard, "cat": "shard",
                       "ts": us(e.start - origin), "dur": us(e.end - e.start),
                       "args": {"frame": e.frame, "bytes_in": e.bytes_in, "bytes_out": e.bytes_out}})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_trace(path: str | Path, executions: list[Execution], cores: list[int], title: str) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(chrome_trace(executions, cores, title)) + "\n")
    return path
