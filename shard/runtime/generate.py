"""Greedy generation over fixed-shape steps and a static KV cache (the form of shard.zoo.decoder): the
prompt in chunks of the prefill step's width, then one token a step. Each step's new keys and values
are written into the cache in place; nothing grows. numpy only.

    cache = Cache.empty(layers=30, kv_heads=3, capacity=512, head_dim=64)
    tokens = generate(run, prompt_ids, cache, max_new=32, chunk=64, stop={2})

`run(feeds) -> outputs` runs the step whose width is feeds["input_ids"].shape[1] (an onnxruntime
session per width, or a bundle per program) and names its outputs: logits, key.i, value.i.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from shard.errors import RunError

# The mask's "not seen": exp(-1e4) is 0 in fp32 and fp16 alike, and -1e4 itself stays inside fp16's range.
MASKED = np.float32(-1e4)

Step = Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]]


@dataclass
class Cache:
    """Each layer's keys and values, [1, kv_heads, capacity, head_dim]; the first `length` are filled."""

    keys: list[np.ndarray]
    values: list[np.ndarray]
    length: int = 0

    @classmethod
    def empty(cls, layers: int, kv_heads: int, capacity: int, head_dim: int, dtype=np.float32) -> Cache:
        shape = (1, kv_heads, capacity, head_dim)
        return cls([np.zeros(shape, dtype) for _ in range(layers)], [np.zeros(shape, dtype) for _ in range(layers)])

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[2]

    def feeds(self) -> dict[str, np.ndarray]:
        return {f"past_{kind}.{i}": arrays[i] for i in range(len(self.keys))
                for kind, arrays in (("key", self.keys), ("value", self.values))}

    def write(self, outputs: dict[str, np.ndarray], count: int) -> None:
        """The first `count` new tokens' keys and values, in place after the filled ones."""
        end = self.length + count
        for i in range(len(self.keys)):
            self.keys[i][:, :, self.length:end] = outputs[f"key.{i}"][:, :, :count]
            self.values[i][:, :, self.length:end] = outputs[f"value.{i}"][:, :, :count]
        self.length = end


def step_mask(length: int, width: int, capacity: int) -> np.ndarray:
    """[1, 1, width, capacity + width]: each new token sees the `length` filled cache entries and the
    new tokens up to itself (so never the padding after the last real one); empty entries are masked."""
    mask = np.full((1, 1, width, capacity + width), MASKED, np.float32)
    mask[..., :length] = 0
    rows, cols = np.tril_indices(width)
    mask[0, 0, rows, capacity + cols] = 0
    return mask


def advance(run: Step, cache: Cache, ids: list[int], width: int) -> np.ndarray:
    """Run `ids` (at most `width`, padded to it) through the step of that width at the cache's length,
    write their keys and values; their logits, [len(ids), vocab]."""
    valid = len(ids)
    if not 0 < valid <= width:
        raise RunError(f"a step of width {width} takes 1 to {width} tokens, not {valid}")
    if cache.length + valid > cache.capacity:
        raise RunError(f"the context reaches {cache.length + valid} tokens, past the cache's capacity of "
                       f"{cache.capacity} (compile with a larger --max-context)")
    padded = np.zeros((1, width), np.int64)
    padded[0, :valid] = ids
    feeds = {"input_ids": padded, "position_ids": (cache.length + np.arange(width, dtype=np.int64))[None],
             "mask": step_mask(cache.length, width, cache.capacity), **cache.feeds()}
    outputs = run(feeds)
    cache.write(outputs, valid)
    return outputs["logits"][0, :valid]


def prefill(run: Step, cache: Cache, prompt: list[int], chunk: int) -> np.ndarray:
    """The prompt through the cache `chunk` tokens a step; every token's logits, [len(prompt), vocab]."""
    return np.concatenate([advance(run, cache, prompt[k:k + chunk], chunk) for k in range(0, len(prompt), chunk)])


def generate(run: Step, prompt: list[int], cache: Cache, max_new: int, chunk: int,
             stop: set[int] = frozenset()) -> list[int]:
    """Greedy: the prompt's last logits pick the first new token, each new token's the next; stops
    after `max_new` tokens or at a token of `stop` (kept)."""
    logits = prefill(run, cache, prompt, chunk)[-1]
    tokens: list[int] = []
    while True:
        tokens.append(int(np.argmax(logits)))
        if tokens[-1] in stop or len(tokens) == max_new:
            return tokens
        logits = advance(run, cache, tokens[-1:], 1)[-1]
