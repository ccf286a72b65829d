"""What the board's runtime takes around the NPU at each run of a graph, timed on a board by
`shard probe --on-board`: the fixed cost of a run (the smallest graph), then what setting inputs and
getting outputs add per element. Three graphs at each of two sizes, each built clean by the vendor and
run many times on one loaded runtime (the median kept): a graph of 64 elements in and out (an Add of a
constant), one taking N elements and giving 64 (a Slice), one taking 64 and giving N (the Add of an
[N] constant). The lines are what shard.targets.chips.Handoff charges each shard on the board in place
of the chip's published figures; each holds the NPU's own time to read or write those elements too."""

from __future__ import annotations

from typing import Callable

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

SIZES = (65_536, 1_048_576)   # elements a side: a small edge tensor, and a large one (a cache)
ROW = 64                      # the innermost axis of every graph, as a head's width
GROUPS = 8                    # the channel axis of the 4-D tensors, as a cache's heads


def shape(elements: int) -> list[int]:
    return [1, GROUPS, elements // (GROUPS * ROW), ROW]


def graph(name: str, nodes: list, x: list[int], y: list[int], constants: list) -> onnx.ModelProto:
    made = helper.make_graph(nodes, name, [helper.make_tensor_value_info("x", TensorProto.FLOAT, x)],
                             [helper.make_tensor_value_info("y", TensorProto.FLOAT, y)], constants)
    return helper.make_model(made, opset_imports=[helper.make_opsetid("", 13)])


def base_model() -> onnx.ModelProto:
    """64 elements in and out: a run's fixed cost."""
    one = [1, 1, 1, ROW]
    return graph("handoff_base", [helper.make_node("Add", ["x", "c"], ["y"])], one, one,
                 [numpy_helper.from_array(np.zeros(one, np.float32), "c")])


def inputs_model(elements: int) -> onnx.ModelProto:
    """`elements` in, 64 out: what setting the inputs adds."""
    ints = [numpy_helper.from_array(np.array(v, np.int64), k)
            for k, v in (("starts", [0, 0, 0]), ("ends", [1, 1, ROW]), ("axes", [1, 2, 3]))]
    return graph(f"handoff_in_{elements}", [helper.make_node("Slice", ["x", "starts", "ends", "axes"], ["y"])],
                 shape(elements), [1, 1, 1, ROW], ints)


def outputs_model(elements: int) -> onnx.ModelProto:
    """64 in, `elements` out: what getting the outputs adds."""
    return graph(f"handoff_out_{elements}", [helper.make_node("Add", ["x", "c"], ["y"])], [1, 1, 1, ROW],
                 shape(elements), [numpy_helper.from_array(np.zeros(shape(elements), np.float32), "c")])


def measure_handoff(timed: Callable[[onnx.ModelProto], float], toolkit: str) -> dict:
    """The profile's `handoff` fact from `timed` (a graph built and run on the board: its median
    seconds a run): the fixed cost of a run, and per side the two points (elements, seconds past it)."""
    run = timed(base_model())
    points = {side: [[n, round(max(0.0, timed(make(n)) - run), 9)] for n in SIZES]
              for side, make in (("inputs", inputs_model), ("outputs", outputs_model))}
    return {"handoff": {**points, "run_s": round(run, 9),
                        "source": f"shard probe --on-board with {toolkit}: the median run of a graph of {ROW} "
                                  f"elements in and out ({1e3 * run:.3f} ms), and of graphs taking or giving "
                                  f"{' and '.join(f'{n:,}' for n in SIZES)} elements, past it"}}
