"""Host steps: the layout work the runtime does in numpy at a bundle's edges.

A tensor at a shard's edge that is itself over a limit cannot be fixed on the NPU (splitting it
there overflows just the same), so the compiler moves the pure layout ops at the model's edges here:

    {"op": "slice", "input": X, "output": Y, "axis": A, "start": S, "end": E}
    {"op": "concat", "inputs": [X, ...], "output": Y, "axis": A}
    {"op": "reshape", "input": X, "output": Y, "shape": [...]}
    {"op": "transpose", "input": X, "output": Y, "perm": [...]}
    {"op": "gather", "input": INDICES, "output": Y, "table": "host/NAME.npy", "axis": A}
    {"op": "onnx", "type": "Where", "inputs": [...], "outputs": [...], ...}   (shard.runtime.host_ops)

Slices and reshapes are views; a transpose or concat makes one contiguous copy. A gather is an
embedding lookup: the vendor runs Gather on the CPU inside its graph anyway, and its table is a
plain array in the bundle. "onnx" steps are what the model computes from its integer inputs alone
(an attention mask made into an additive bias), which the vendor would also run on the CPU.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from shard.errors import BundleError
from shard.runtime.host_ops import run_onnx_step

HOST_OPS = ("slice", "concat", "reshape", "transpose", "gather", "onnx")


def step_inputs(step: dict) -> list[str]:
    """The tensors a step reads (its own constants aside)."""
    names = step.get("inputs") or [step["input"]]
    return [n for n in names if n not in step.get("constants", {})]


def step_outputs(step: dict) -> list[str]:
    return step.get("outputs") or [step["output"]]


def load_tables(bundle: Path, steps: list[dict]) -> dict[str, np.ndarray]:
    """The arrays the steps read (gather tables), memory-mapped from the bundle."""
    return {step["table"]: np.load(bundle / step["table"], mmap_mode="r", allow_pickle=False)
            for step in steps if "table" in step}


def run_host(steps: list[dict], tensors: dict[str, np.ndarray],
             tables: dict[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
    """Run the steps in order on `tensors` (updated in place and returned); `tables` from load_tables."""
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
            tensors[step["output"]] = np.ascontiguousarray(tensors[step["input"]].transpose(step["perm"]))
        elif op == "gather":
            tensors[step["output"]] = np.take(tables[step["table"]], tensors[step["input"]], axis=step["axis"])
        elif op == "onnx":
            run_onnx_step(step, tensors)
        else:
            raise BundleError(f"unknown host step {op!r}; this runtime knows {', '.join(HOST_OPS)}")
    return tensors
