"""Micro-batching: a bundle compiled for B frames at once (`shard compile --batch B`) fed one frame
at a time. run_stream stacks B frames into one run of the stages and gives each frame its own
outputs back, in order; a last group short of B is filled with copies of its last frame, whose
outputs are dropped.
"""

from __future__ import annotations

import collections
import functools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np

from shard.bundle import Manifest, TensorSpec
from shard.errors import RunError


@dataclass(frozen=True)
class Batching:
    """How frames of one item map onto a bundle compiled for `size` (every input and output leads
    with that axis: the compile checked it)."""

    size: int
    inputs: tuple[TensorSpec, ...]

    @classmethod
    def of(cls, manifest: Manifest) -> Batching:
        return cls(manifest.batch, tuple(manifest.inputs))

    @functools.cached_property
    def names(self) -> frozenset[str]:
        """The inputs' names, read on every frame."""
        return frozenset(t.name for t in self.inputs)

    @property
    def frame_inputs(self) -> list[TensorSpec]:
        """The inputs of one frame: the bundle's, their leading axis 1 where it takes batches."""
        if self.size == 1:
            return list(self.inputs)
        return [TensorSpec(t.name, [1, *t.shape[1:]], t.dtype) for t in self.inputs]

    def single(self, frame: dict) -> bool:
        """Whether `frame` holds one item where the bundle takes `size` (so it is grouped)."""
        if self.size == 1:
            return False
        leads = {name: np.shape(value)[0] if np.ndim(value) else None for name, value in frame.items()
                 if name in self.names}
        if leads and all(lead == 1 for lead in leads.values()):
            return True
        if leads and all(lead == self.size for lead in leads.values()):
            return False
        raise RunError(f"this bundle was compiled for batches of {self.size} (--batch): give each input one frame "
                       f"(leading axis 1) or a whole batch ({self.size}); got leading axes "
                       + ", ".join(f"{name} {lead}" for name, lead in leads.items()))

    def group(self, frames: Iterable[dict], counts: collections.deque) -> Iterator[dict]:
        """Batches of `size` frames stacked on their leading axis; each batch's count of real frames
        goes onto `counts` as it is made (the last batch is filled with copies of its last frame)."""
        group: list[dict] = []
        for frame in frames:
            if not self.single(frame):
                raise RunError(f"a stream of single frames on a bundle of batch {self.size} got a whole batch; "
                               f"give every frame with leading axis 1")
            group.append(frame)
            if len(group) == self.size:
                counts.append(len(group))
                yield self.stack(group)
                group = []
        if group:
            counts.append(len(group))
            yield self.stack(group + [group[-1]] * (self.size - len(group)))

    def stack(self, frames: list[dict]) -> dict:
        """The frames' inputs joined on their leading axis (torch tensors on a GPU stay there); what
        is not a batched input (a value fixed at compile) as the first frame gives it."""
        out = dict(frames[0])
        for name in self.names & set(out):
            values = [f[name] for f in frames]
            if hasattr(values[0], "detach"):
                import torch

                out[name] = torch.cat(values)
            else:
                out[name] = np.concatenate(values)
        return out

    @staticmethod
    def split(outputs: dict, count: int) -> list[dict]:
        """Each of the first `count` frames' outputs from one batch's (leading axis 1 each)."""
        return [{name: value[k:k + 1] for name, value in outputs.items()} for k in range(count)]

