"""What every command of `shard` shares: the consoles, the progress bar, the parsers of common
options and their helps, and the signal that stops a command."""

from __future__ import annotations

import sys
import threading
from contextlib import contextmanager
from typing import Iterator

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from shard.errors import ShardError

# Piped output (logs, CI) gets wide tables rather than rich's default of 80 columns.
console = Console(width=None if sys.stdout.isatty() else 160)
err = Console(stderr=True, width=None if sys.stderr.isatty() else 160)


@contextmanager
def progress_bar() -> Iterator:
    """A callback (step, done, total, note="") drawing one bar per step, on stderr; the note (what is
    happening within the step) is shown after the bar. A step named "GROUP: DETAIL" draws on GROUP's
    bar, DETAIL in its note: a compile's passes, a round of mixed precision or a generative
    program's steps take one line each."""
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), TextColumn("{task.fields[note]}"), console=err, transient=False) as bar:
        tasks: dict[str, int] = {}

        def update(step: str, done: int, total: int, note: str = "") -> None:
            stop_point()
            group, _, detail = step.partition(": ")
            note = ", ".join(part for part in (detail, note) if part)
            for name, task in tasks.items():  # a new step means the earlier ones are finished
                if name != group:
                    bar.update(task, completed=bar.tasks[task].total)
            if group not in tasks:
                tasks[group] = bar.add_task(group, total=total, note=note)
            bar.update(tasks[group], completed=done, total=total, note=note)

        yield update
        for task in tasks.values():
            bar.update(task, completed=bar.tasks[task].total)


def parse_shape(text: str) -> tuple[str, tuple[int, ...]]:
    name, sep, dims = text.rpartition("=")
    try:
        if not sep or not name:
            raise ValueError
        shape = tuple(int(d) for d in dims.split(","))
        if min(shape) < 1:
            raise ShardError(f"--input-shape {text!r}: every dimension must be at least 1")
        return name, shape
    except ValueError:
        raise ShardError(f"--input-shape {text!r}: expected NAME=D0,D1,... such as pixel_values=1,3,224,224") from None


def parse_value(text: str) -> tuple[str, list[float]]:
    """--input-value NAME=V0,V1,...: the numbers an input is fixed to."""
    name, sep, values = text.rpartition("=")
    try:
        if not sep or not name:
            raise ValueError
        return name, [int(v) if v.strip().lstrip("-").isdigit() else float(v) for v in values.split(",")]
    except ValueError:
        raise ShardError(f"--input-value {text!r}: expected NAME=V0,V1,... such as sr=16000") from None


def parse_batch(text: str) -> int | None:
    """--batch: a number of frames, or auto (None: the cost model picks)."""
    if text == "auto":
        return None
    if not text.isdigit() or int(text) < 1:
        raise ShardError(f"--batch {text!r}: expected a number of frames of at least 1, or auto")
    return int(text)


RAY_HELP = ("Run the vendor builds on this Ray cluster (ADDRESS, as `ray start` printed it), or on one started "
            "here (local); --jobs of them at a time. Needs `pip install 'shard[ray]'`.")


FIDELITY_HELP = ("Run the bundle and the vendor alone's on the simulator (the first --calib samples, else seeded "
                 "inputs of the model's domain); where shard's cosine is lower, the bundle holds the vendor's. "
                 "--check-fidelity builds the vendor alone whole for it; without the whole build the vendor alone "
                 "is each shard unrewritten. Costs a simulator build of both [default: on wherever the vendor alone "
                 "is compared].")


MIN_COSINE_HELP = ("fp16: the floor under the bundle's simulator cosine wherever fidelity is checked (a bundle under "
                   "it, or with a NaN or an Inf in any precision, is not written); --precision mixed, fp8 or w4a16: the "
                   "cosine on the calibration samples that their search holds.")


def parse_ids(text: str, option: str = "--ids") -> list[int]:
    """Comma-separated non-negative integers (--ids, --max-context)."""
    try:
        ids = [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise ShardError(f"{option} {text!r}: expected numbers such as 1,2,3") from None
    if not ids or min(ids) < 0:
        raise ShardError(f"{option} {text!r}: expected at least one non-negative number")
    return ids

STOPPED: list[int] = []   # the signals terminate() took


def terminate(signum, frame) -> None:
    """SIGTERM, raised where the process is as Ctrl-C would be: every command cleans up as it does then
    (a compile removes its staging folder and kills its toolkit workers). Raised while the process runs
    a finalizer (a `__del__` the garbage collector calls), Python prints it and goes on: stop_point()
    raises it again at the next progress step."""
    STOPPED.append(signum)
    raise KeyboardInterrupt()


def stop_point() -> None:
    """Raise the interrupt a signal asked for, on the main thread, if a finalizer swallowed it."""
    if STOPPED and threading.current_thread() is threading.main_thread():
        raise KeyboardInterrupt()


def bucket_title(bucket) -> str:
    return f"bucket {bucket.name}: {', '.join(f'{k}={v}' for k, v in bucket.inputs.items())}"
