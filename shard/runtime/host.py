"""Host steps: the layout work the runtime does in numpy at a bundle's edges.

A tensor at a shard's edge that is itself over a limit cannot be fixed on the NPU (splitting it
there overflows just the same), so the compiler moves the pure layout ops at the model's edges here:

    {"op": "slice", "input": X, "output": Y, "axis": A, "start": S, "end": E}
    {"op": "concat", "inputs": [X, ...], "output": Y, "axis": A}
    {"op": "reshape", "input": X, "output": Y, "shape": [...]}
    {"op": "transpose", "input": X, "output": Y, "perm": [...]}

Slices and reshapes are views; a transpose or concat makes one contiguous copy.
"""

from __future__ import annotations

import numpy as np

from shard.errors import BundleError

HOST_OPS = ("slice", "concat", "reshape", "transpose")


def run_host(steps: list[dict], tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Run the steps in order on `tensors` (updated in place and returned)."""
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
        else:
            raise BundleError(f"unknown host step {op!r}; this runtime knows {', '.join(HOST_OPS)}")
    return tensors
