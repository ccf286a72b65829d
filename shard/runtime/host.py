"""Host steps: the layout work the runtime does in numpy at a bundle's edges.

A tensor at a shard's edge that is itself over a limit cannot be fixed on the NPU (splitting it
there overflows just the same), so the compiler moves the pure layout ops at the model's edges here:

    {"op": "slice", "input": X, "output": Y, "axis": A, "start": S, "end": E}
    {"op": "concat", "inputs": [X, ...], "output": Y, "axis": A}
    {"op": "reshape", "input": X, "output": Y, "shape": [...]}
    {"op": "transpose", "input": X, "output": Y, "perm": [...]}
    {"op": "onnx", "type": "Gather", "inputs": [...], "outputs": [...], ...}   (shard.runtime.host_ops)

Slices and reshapes are views; a concat makes one contiguous copy, and so does a transpose before
the shards (what an NPU reads); after them a transpose stays a view of the shard's output (a
50257-word LM head's: 7 ms of copying saved per frame on x86). "onnx" steps are
what the model computes from its integer inputs alone (embedding lookups, an attention mask made
into an additive bias, position ids), which the vendor would run on the CPU; their large constants
(embedding tables) are plain arrays in the bundle.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from shard.bundle import step_inputs, step_outputs
from shard.errors import BundleError
from shard.runtime.host_ops import run_onnx_step

HOST_OPS = ("slice", "concat", "reshape", "transpose", "onnx")


def check_dataflow(manifest) -> None:
    """Every tensor a shard or host step reads is made before it, by the graph's inputs, a host step or
    a shard, once, and the shards depend on each other without a cycle; else a BundleError naming the
    tensor (a run would otherwise wait forever for what nothing makes)."""
    made = {t.name: "a graph input" for t in manifest.inputs}

    def read(reader: str, names) -> None:
        for name in names:
            if name and name not in made:   # "": an optional input left out
                raise BundleError(f"{reader} reads {name}, which no graph input, host step or shard makes: "
                                  f"the manifest is damaged; compile the model again")

    def make(maker: str, names) -> None:
        for name in names:
            if name in made:
                raise BundleError(f"{name} is made by {made[name]} and by {maker}: the manifest is damaged")
            made[name] = maker

    for step in manifest.host_pre:
        read(f"host step {step.get('type', step.get('op'))}", step_inputs(step))
        make(f"host step {step.get('type', step.get('op'))}", step_outputs(step))
    for shard in manifest.shards:
        make(f"shard {shard.name}", [t.name for t in shard.outputs])
    for shard in manifest.shards:
        read(f"shard {shard.name}", [t.name for t in shard.inputs])
    producer = {t.name: k for k, s in enumerate(manifest.shards) for t in s.outputs}
    waiting = [{producer[t.name] for t in s.inputs if t.name in producer} for s in manifest.shards]
    done: set[int] = set()
    while len(done) < len(waiting):
        ready = [k for k, deps in enumerate(waiting) if k not in done and deps <= done]
        if not ready:
            cycle = sorted(manifest.shards[k].name for k in range(len(waiting)) if k not in done)
            raise BundleError(f"shards {', '.join(cycle)} wait on each other's outputs (a cycle): the manifest "
                              f"is damaged; compile the model again")
        done.update(ready)
    for step in manifest.host_post:
        read(f"host step {step.get('type', step.get('op'))}", step_inputs(step))
        make(f"host step {step.get('type', step.get('op'))}", step_outputs(step))
    read("the bundle's outputs", [t.name for t in manifest.outputs])


def step_files(step: dict) -> list[str]:
    """The bundle files a step reads (an embedding table), relative to the bundle."""
    return [c["file"] for c in step.get("constants", {}).values() if "file" in c]


def load_tables(bundle: Path, steps: list[dict]) -> dict[str, np.ndarray]:
    """The arrays the steps read from the bundle, memory-mapped."""
    return {f: np.load(bundle / f, mmap_mode="r", allow_pickle=False) for step in steps for f in step_files(step)}


def run_host(steps: list[dict], tensors: dict[str, np.ndarray],
             tables: dict[str, np.ndarray] | None = None, contiguous: bool = True) -> dict[str, np.ndarray]:
    """Run the steps in order on `tensors` (updated in place and returned); `tables` from load_tables.
    contiguous=False (the steps after the shards): a transpose is a view, not a copy."""
    for step in steps:
        op = step["op"]
        if op == "slice":
            index = [slice(None)] * tensors[step["input"]].ndim
            index[step["axis"]] = slice(step["start"], step["end"])
            tensors[step["output"]] = tensors[step["input"]][tuple(index)]
        elif op == "concat":
            tensors[step["output"]] = np.concatenate([tensors[name] for name in step["inputs"]], axis=step["axis"])
        elif op == "reshape":
            tensors[step["output"]] = tensors[step["input"]].reshape(step["shape"])
        elif op == "transpose":
            moved = tensors[step["input"]].transpose(step["perm"])
            tensors[step["output"]] = np.ascontiguousarray(moved) if contiguous else moved
        elif op == "onnx":
            run_onnx_step(step, tensors, tables or {})
        else:
            raise BundleError(f"unknown host step {op!r}; this runtime knows {', '.join(HOST_OPS)}")
    return tensors
