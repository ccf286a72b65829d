"""Shape buckets: one bundle holding a compiled variant per input shape (`--input-shape
input_ids=1,64|1,128|1,256`), since the NPU compilers take static shapes only.

    model.shard/buckets.json      which inputs each bucket takes, which output axes to crop
    model.shard/b0/, b1/, ...     one ordinary bundle per bucket

An input runs on the smallest bucket it fits: padded up to it with 0 (so an attention mask masks
the padding out), run, and each output cut back along the axes that follow a padded input axis.
Models without an attention mask see the padding: their outputs at real positions can change,
which `shard verify` on the bucket shows. Standard library and numpy.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from shard.bundle import read_versioned
from shard.errors import RunError
from shard.runtime.session import Session

BUCKETS = "buckets.json"
PAD_VALUE = 0   # ids, masks and features alike: a 0 in the attention mask hides the padding
SCHEMA_VERSION = 1


@dataclass
class Bucket:
    name: str                               # its folder in the bundle
    inputs: dict[str, list[int]]            # the shape of every input
    outputs: dict[str, list[int]]


@dataclass
class Buckets:
    buckets: list[Bucket]                   # smallest first
    crop: dict[str, dict[str, list]] = field(default_factory=dict)   # output: {axis: [input, axis]}
    schema_version: int = SCHEMA_VERSION

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2) + "\n"


def is_bucketed(bundle: str | Path) -> bool:
    return (Path(bundle) / BUCKETS).is_file()


def read_buckets(bundle: str | Path) -> Buckets:
    return read_versioned(Path(bundle) / BUCKETS, SCHEMA_VERSION, "buckets",
                          lambda data: Buckets(**{**data, "buckets": [Bucket(**b) for b in data["buckets"]]}))


def crop_axes(buckets: list[Bucket]) -> dict[str, dict[str, list]]:
    """For each output axis whose size follows one input axis in every bucket (the two differ between
    buckets and are equal in each), that input axis: the axes cropped after a padded run."""
    crop: dict[str, dict[str, list]] = {}
    first = buckets[0]
    varying = [(name, axis) for name, shape in first.inputs.items() for axis in range(len(shape))
               if len({tuple(b.inputs[name])[axis] for b in buckets}) > 1]
    for out, shape in first.outputs.items():
        for axis in range(len(shape)):
            sizes = [b.outputs[out][axis] for b in buckets]
            if len(set(sizes)) < 2:
                continue
            for name, in_axis in varying:
                if sizes == [b.inputs[name][in_axis] for b in buckets]:
                    crop.setdefault(out, {})[str(axis)] = [name, in_axis]
                    break
    return crop


class BucketedSession:
    """Session's run/run_stream over a bucketed bundle; each bucket's Session is opened on first use."""

    def __init__(self, bundle: str | Path, **session_args):
        self.bundle = Path(bundle)
        self.spec = read_buckets(self.bundle)
        self.session_args = session_args
        self.sessions: dict[str, object] = {}
        self.runs: dict[str, int] = {b.name: 0 for b in self.spec.buckets}

    def pick(self, inputs: dict[str, np.ndarray]) -> Bucket:
        """The smallest bucket every input fits in."""
        shapes = {name: np.shape(value) for name, value in inputs.items()}
        for bucket in self.spec.buckets:
            if set(shapes) == set(bucket.inputs) and all(
                    len(shapes[n]) == len(s) and all(a <= b for a, b in zip(shapes[n], s))
                    for n, s in bucket.inputs.items()):
                return bucket
        sizes = "; ".join(", ".join(f"{n}={s}" for n, s in b.inputs.items()) for b in self.spec.buckets)
        raise RunError(f"inputs {', '.join(f'{n}={list(s)}' for n, s in shapes.items())} fit no bucket of this "
                       f"bundle ({sizes}); compile a larger bucket")

    def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        bucket = self.pick(inputs)
        padded = {name: pad_to(np.asarray(value), bucket.inputs[name], PAD_VALUE)
                  for name, value in inputs.items()}
        outputs = self.session(bucket).run(padded)
        self.runs[bucket.name] += 1
        return {name: self.cut(name, value, inputs) for name, value in outputs.items()}

    def run_stream(self, frames: Iterable[dict[str, np.ndarray]], depth: int | None = None
                   ) -> Iterator[dict[str, np.ndarray]]:
        """Frames one after another, each on its own bucket (frames of one bucket do not overlap yet)."""
        for frame in frames:
            yield self.run(frame)

    def cut(self, name: str, value: np.ndarray, inputs: dict[str, np.ndarray]) -> np.ndarray:
        index = [slice(None)] * value.ndim
        for axis, (source, source_axis) in self.spec.crop.get(name, {}).items():
            index[int(axis)] = slice(0, np.shape(inputs[source])[source_axis])
        return value[tuple(index)]

    def session(self, bucket: Bucket):
        if bucket.name not in self.sessions:
            self.sessions[bucket.name] = Session(self.bundle / bucket.name, **self.session_args)
        return self.sessions[bucket.name]

    def close(self) -> None:
        for session in self.sessions.values():
            session.close()
        self.sessions.clear()

    def __enter__(self) -> BucketedSession:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def pad_to(value: np.ndarray, shape: list[int], fill: float) -> np.ndarray:
    if list(value.shape) == list(shape):
        return value
    return np.pad(value, [(0, b - a) for a, b in zip(value.shape, shape)], constant_values=fill)
