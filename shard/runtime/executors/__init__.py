"""Executors run shards on one core each. They never import the compile side; vendor SDKs load lazily.

A backend is a module of this package found by name (MODULES), imported when a session first asks
for it: a board with only rknn-toolkit-lite2 never imports torch, a GPU host never imports the
toolkit's client.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np

from shard.bundle import Manifest, ShardSpec
from shard.errors import TargetError

# backend -> the module of this package that runs it; each exports make(bundle, manifest, placements)
MODULES = {"cpu": "cpu", "sim": "rknn_sim", "board": "rknn_board", "cuda": "cuda", "tensorrt": "tensorrt"}
BACKENDS = tuple(MODULES)


@dataclass(frozen=True)
class Traits:
    """What a backend's executors do with what they are handed: the runtime places a decoder's cache by
    these (shard.runtime.generate), never by the backend's name."""

    device: str | None = None       # where its tensors stay between runs ("cuda"), else the host
    binds_inputs: bool = False      # an input can be bound once where the device reads it (OnDevice.held)
    converts_inputs: bool = False   # converts each input's type and layout on the host at every run, so an
    #                                 input handed over as float16 NHWC memory saves it that (rknn-toolkit-lite2
    #                                 on the board; the simulator measured no faster: bench/cache_handoff.py)
    takes_float16: bool = False     # a float16 array for a float32 input goes as it is (as_float16)
    one_process: bool = False       # every core in one process, where more cores only take turns


TRAITS = {"cpu": Traits(), "sim": Traits(takes_float16=True, one_process=True),
          "board": Traits(binds_inputs=True, converts_inputs=True, takes_float16=True),
          "cuda": Traits(device="cuda"), "tensorrt": Traits(device="cuda")}
# a stream per pipeline stage, each stage loaded once on its stream: the backends that keep tensors on a device
STAGE_BACKENDS = tuple(name for name, traits in TRAITS.items() if traits.device)


@dataclass(frozen=True)
class OnDevice:
    """What a backend keeps where its device reads it (shard.runtime.generate's cache lives there). A GPU
    backend: the outputs handed back as torch tensors there rather than in numpy (`outputs`), and those
    a stage writes inside its own captured graph into one of its input buffers, along axis 2 at the
    positions another of its inputs holds (`writes`: output -> (input, positions); a decode step's new
    key and value into the cache it reads), which then come back to no one (Session.written). The
    board: the inputs bound once in NPU memory, in its own layout (`held`, in `memory`)."""

    outputs: frozenset[str] = frozenset()
    writes: Mapping[str, tuple[str, str]] = field(default_factory=dict)
    held: frozenset[str] = frozenset()   # the board: inputs bound once where the NPU reads them (rknn_held)
    memory: object = field(default=None, compare=False)   # their memories, shared by every session (rknn_held.Held)


class Executor(Protocol):
    """Prepare a core's shards once, then run any of them; each executor is used by one thread at a time."""

    def run(self, shard: ShardSpec, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]: ...

    def close(self) -> None: ...


def traits_of(backend: str) -> Traits:
    """The backend's Traits; TargetError in one line for a backend there is none of."""
    if backend not in TRAITS:
        raise TargetError(f"unknown backend {backend!r}; backends: {', '.join(BACKENDS)}")
    return TRAITS[backend]


def make_executors(backend: str, bundle: Path, manifest: Manifest, placements: dict[int, list[ShardSpec]],
                   on_device: OnDevice = OnDevice()) -> dict[int, Executor]:
    """One executor per core holding the shards that core may run: the backend's module (MODULES),
    imported only now, makes them (its `make`). on_device: what a GPU backend leaves on the GPU, or the
    inputs the board holds in NPU memory (then rknn_held, the board's C API, makes them)."""
    held = traits_of(backend).binds_inputs and on_device.held   # the board's C API, where inputs are held in NPU memory
    module = importlib.import_module(f"{__name__}.{'rknn_held' if held else MODULES[backend]}")
    return module.make(bundle, manifest, placements, on_device) if backend in STAGE_BACKENDS or held else \
        module.make(bundle, manifest, placements)


def each_core(placements: dict[int, list[ShardSpec]], make) -> dict[int, Executor]:
    made: dict[int, Executor] = {}
    try:
        for core, shards in placements.items():
            made[core] = make(core, shards)
    except BaseException:
        for executor in made.values():
            executor.close()
        raise
    return made


def to_host(value) -> np.ndarray:
    """A tensor as numpy: GPU executors pass tensors between stages on the device."""
    return value if isinstance(value, np.ndarray) else value.detach().cpu().numpy()


def npu_inputs(shard: ShardSpec, inputs: dict[str, np.ndarray]) -> tuple[list[np.ndarray], list[str]]:
    """The arrays an rknn runtime takes, in the shard's input order, each in the shape its graph declares,
    and each one's layout for the runtime's `data_format`:
    - float64 as float32 (the NPU has no fp64, and the toolkit's runtimes return nothing for it);
    - a float16 array for a float32 input as it is (the runtime converts it to the graph's input type
      as it does float32; an fp16 graph's is float16: the same numbers, half the bytes to hand over);
    - a 4-D array held in NHWC (`held_nhwc`: a decoder's cache for the board) as that memory, "nhwc"
      (given "nchw" where the model's input is NHWC, rknn-toolkit-lite2 transposes it on the host at
      every run: bench/cache_handoff.py times that);
    - the rest contiguous, "nchw" (ONNX's layout)."""
    arrays, formats = [], []
    for spec in shard.inputs:
        array = edge_input(shard, spec, inputs[spec.name])
        dtype = array.dtype if as_float16(array, spec.dtype) else np.float32 if spec.dtype == "float64" else spec.dtype
        nhwc = held_nhwc(array)
        arrays.append(np.ascontiguousarray(array.transpose(0, 2, 3, 1) if nhwc else array, dtype=dtype))
        formats.append("nhwc" if nhwc else "nchw")
    return arrays, formats


def as_float16(array, dtype: str) -> bool:
    """A float16 array for a float32 input, which an rknn runtime takes as it is (npu_inputs)."""
    return array.dtype == np.float16 and dtype == "float32"


def held_nhwc(array: np.ndarray) -> bool:
    """A 4-D array in ONNX's order whose memory is NHWC: a view of [N, H, W, C], as generate.Cache holds
    a cache for the board (Cache.empty's `nhwc`)."""
    return array.ndim == 4 and not array.flags.c_contiguous and array.transpose(0, 2, 3, 1).flags.c_contiguous


def edge_input(shard: ShardSpec, spec, value: np.ndarray) -> np.ndarray:
    """An input in the shape the shard's graph declares at its edge: the manifest's own, or the 4-D
    shape compile gave the edge so the vendor needs no reshape of its own there (a free view here)."""
    return np.reshape(value, shard.edge_shapes.get(spec.name, spec.shape))


def outputs_by_name(shard: ShardSpec, arrays: list[np.ndarray]) -> dict[str, np.ndarray]:
    """Name an executor's positional outputs, restoring the manifest's shapes and dtypes."""
    return {spec.name: np.asarray(a).reshape(spec.shape).astype(spec.dtype, copy=False)
            for spec, a in zip(shard.outputs, arrays)}
