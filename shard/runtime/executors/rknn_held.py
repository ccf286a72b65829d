"""board, inputs held where the NPU reads them: librknnrt's C API (rknpu2's rknn_api.h) through ctypes,
for what rknn-toolkit-lite2's `inference` cannot do: bind an input to memory once (rknn_set_io_mem)
in the NPU's own type and layout (RKNN_QUERY_NATIVE_INPUT_ATTR, passed through with no conversion),
so that a run reads it in place. A decoder's cache lies there (shard.runtime.generate): each step
the host writes only its new rows, where rknn-toolkit-lite2 would convert the whole cache every token.

A held input's memory is one per name and shape for every context that reads it (every core's, the
prompt's step and the decode step alike: rknn_create_mem_from_fd), allocated non-cacheable so the
host's few row writes need no cache flush. The other inputs and the outputs are bound too, converted
by the runtime (pass_through off, float32 or float16 in ONNX's layout), as rknn_create_mem_demo does.

Only the layout helpers (`native_view`) run off the board; the rest needs librknnrt.so (aarch64)."""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np

from shard.bundle import Manifest, ShardSpec
from shard.errors import RunError, TargetError
from shard.runtime.executors import OnDevice, each_core, edge_input, outputs_by_name

MAX_DIMS, MAX_NAME = 16, 256                                # RKNN_MAX_DIMS, RKNN_MAX_NAME_LEN
QUERY_IN_OUT_NUM, QUERY_INPUT_ATTR, QUERY_OUTPUT_ATTR, QUERY_NATIVE_INPUT_ATTR = 0, 1, 2, 8
FLOAT32, FLOAT16 = 0, 1                                     # rknn_tensor_type
NCHW, NHWC, NC1HWC2 = 0, 1, 2                               # rknn_tensor_format
MEMORY_NON_CACHEABLE = 1 << 1                               # rknn_mem_alloc_flags
SYNC_FROM_DEVICE = 0x2                                      # rknn_mem_sync_mode
CORE_MASKS = (1, 2, 4)                                      # RKNN_NPU_CORE_0, _1, _2
TYPES = {FLOAT32: np.float32, FLOAT16: np.float16, 2: np.int8, 3: np.uint8, 4: np.int16, 6: np.int32, 8: np.int64}


class TensorAttr(ctypes.Structure):
    _fields_ = [("index", ctypes.c_uint32), ("n_dims", ctypes.c_uint32), ("dims", ctypes.c_uint32 * MAX_DIMS),
                ("name", ctypes.c_char * MAX_NAME), ("n_elems", ctypes.c_uint32), ("size", ctypes.c_uint32),
                ("fmt", ctypes.c_int), ("type", ctypes.c_int), ("qnt_type", ctypes.c_int), ("fl", ctypes.c_int8),
                ("zp", ctypes.c_int32), ("scale", ctypes.c_float), ("w_stride", ctypes.c_uint32),
                ("size_with_stride", ctypes.c_uint32), ("pass_through", ctypes.c_uint8), ("h_stride", ctypes.c_uint32)]


class TensorMem(ctypes.Structure):
    _fields_ = [("virt_addr", ctypes.c_void_p), ("phys_addr", ctypes.c_uint64), ("fd", ctypes.c_int32),
                ("offset", ctypes.c_int32), ("size", ctypes.c_uint32), ("flags", ctypes.c_uint32),
                ("priv_data", ctypes.c_void_p)]


class InOutNum(ctypes.Structure):
    _fields_ = [("n_input", ctypes.c_uint32), ("n_output", ctypes.c_uint32)]


def native_view(memory: np.ndarray, dims: list[int], shape: list[int], w_stride: int = 0) -> np.ndarray:
    """The [N, C, H, W] view, in ONNX's order, of a 4-D tensor held in the NPU's NC1HWC2 layout
    (`dims`: [N, C1, H, W, C2], as RKNN_QUERY_NATIVE_INPUT_ATTR gives them; W padded to `w_stride`
    where the runtime says so) in `memory` (its elements, flat): writing into the view writes where
    the NPU reads. One channel block only (C <= C2: a decoder's few key/value heads); the channels
    past C stay zero."""
    n, c1, h, w, c2 = dims
    if len(shape) != 4 or c1 != 1 or shape[1] > c2 or [n, h, w] != [shape[0], shape[2], shape[3]]:
        raise RunError(f"an input of {shape} held as NC1HWC2 {dims}: one channel block of at most C2 channels")
    row = max(w, w_stride)
    steps = np.array([c1 * h * row * c2, 1, row * c2, c2]) * memory.itemsize
    return np.lib.stride_tricks.as_strided(memory, shape=tuple(shape), strides=tuple(int(s) for s in steps))


def same_memory(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether two arrays are one view of one memory (a held input handed back as it is)."""
    return a.__array_interface__["data"][0] == b.__array_interface__["data"][0] and a.strides == b.strides \
        and a.shape == b.shape


class Runtime:
    """librknnrt.so's functions (the board's runtime), loaded once."""

    def __init__(self):
        try:
            lib = ctypes.CDLL("librknnrt.so")
        except OSError:
            raise TargetError("holding the cache where the NPU reads it needs librknnrt.so (rknpu2's runtime, on "
                              "a Rockchip board); `shard generate --hand-cache` hands it to rknn-toolkit-lite2 "
                              "every step instead") from None
        ctx, ptr, mem = ctypes.c_uint64, ctypes.c_void_p, ctypes.POINTER(TensorMem)
        for name, args, result in (
                ("rknn_init", [ctypes.POINTER(ctx), ptr, ctypes.c_uint32, ctypes.c_uint32, ptr], ctypes.c_int),
                ("rknn_destroy", [ctx], ctypes.c_int),
                ("rknn_query", [ctx, ctypes.c_int, ptr, ctypes.c_uint32], ctypes.c_int),
                ("rknn_set_core_mask", [ctx, ctypes.c_int], ctypes.c_int), ("rknn_run", [ctx, ptr], ctypes.c_int),
                ("rknn_create_mem", [ctx, ctypes.c_uint32], mem),
                ("rknn_create_mem2", [ctx, ctypes.c_uint64, ctypes.c_uint64], mem),
                ("rknn_create_mem_from_fd", [ctx, ctypes.c_int32, ptr, ctypes.c_uint32, ctypes.c_int32], mem),
                ("rknn_destroy_mem", [ctx, mem], ctypes.c_int),
                ("rknn_set_io_mem", [ctx, mem, ctypes.POINTER(TensorAttr)], ctypes.c_int),
                ("rknn_mem_sync", [ctx, mem, ctypes.c_int], ctypes.c_int)):
            function = getattr(lib, name)
            function.argtypes, function.restype = args, result
        self.lib = lib

    def check(self, code: int, what: str) -> None:
        if code != 0:
            raise RunError(f"{what} failed on the board (error {code})")


class Held:
    """The memories of held inputs, one per (name, shape), shared by every context that binds them."""

    def __init__(self):
        self.made: dict[tuple[str, tuple], tuple[Context, object, TensorAttr]] = {}   # the first context's mem

    def bind(self, context: Context, attr: TensorAttr, shape: list[int]) -> np.ndarray:
        """Bind the held input `attr` (its native attributes) of `context`; its [N, C, H, W] view."""
        key = (attr.name.decode(), tuple(shape))
        if key not in self.made:
            mem = context.rt.lib.rknn_create_mem2(context.ctx.value, attr.size_with_stride, MEMORY_NON_CACHEABLE)
            if not mem:
                raise RunError(f"{key[0]}: no NPU memory of {attr.size_with_stride} bytes")
            ctypes.memset(mem.contents.virt_addr, 0, attr.size_with_stride)
            context.mems.append(mem)   # destroyed with the context that made it
            self.made[key] = (context, mem, attr)
        owner, first, _ = self.made[key]
        mem = first if owner is context else context.imported(first)
        attr.pass_through = 1
        context.rt.check(context.rt.lib.rknn_set_io_mem(context.ctx.value, mem, ctypes.byref(attr)),
                         f"{key[0]}: rknn_set_io_mem")
        return self.view(key)

    def view(self, key: tuple[str, tuple]) -> np.ndarray:
        _, mem, attr = self.made[key]
        dtype = np.dtype(TYPES[attr.type])   # float16 for an fp16 step's input
        memory = np.ctypeslib.as_array(ctypes.cast(mem.contents.virt_addr, ctypes.POINTER(ctypes.c_uint8)),
                                       shape=(attr.size_with_stride,)).view(dtype)
        return native_view(memory, list(attr.dims[:5]), list(key[1]), attr.w_stride)


class Context:
    """One .rknn loaded on one NPU core with every input and output bound to memory (rknn_set_io_mem)."""

    def __init__(self, rt: Runtime, artifact: Path, shard: ShardSpec, core: int, cores: int, held: set[str],
                 memories: Held):
        self.rt, self.ctx, self.shard, self.mems = rt, ctypes.c_uint64(0), shard, []
        rt.check(rt.lib.rknn_init(ctypes.byref(self.ctx), str(artifact).encode(), 0, 0, None),
                 f"{shard.name}: rknn_init")
        if cores > 1:
            rt.check(rt.lib.rknn_set_core_mask(self.ctx.value, CORE_MASKS[core]), f"{shard.name}: rknn_set_core_mask")
        self.views: dict[str, np.ndarray] = {}    # held inputs
        self.inputs: list[tuple[np.ndarray, object]] = []    # the others: (their memory as numpy, mem)
        for k, spec in enumerate(shard.inputs):
            if spec.name in held:
                self.views[spec.name] = memories.bind(self, self.attr(QUERY_NATIVE_INPUT_ATTR, k), spec.shape)
            else:
                shape = shard.edge_shapes.get(spec.name, spec.shape)
                self.inputs.append(self.bound(self.attr(QUERY_INPUT_ATTR, k), spec.dtype,
                                              list(shape) if len(shape) == 4 else None))
        self.outputs = [self.bound(self.attr(QUERY_OUTPUT_ATTR, k), "float32") for k in range(len(shard.outputs))]

    def attr(self, query: int, index: int) -> TensorAttr:
        attr = TensorAttr(index=index)
        self.rt.check(self.rt.lib.rknn_query(self.ctx.value, query, ctypes.byref(attr), ctypes.sizeof(attr)),
                      f"{self.shard.name}: rknn_query")
        return attr

    def bound(self, attr: TensorAttr, dtype: str, nchw: list[int] | None = None) -> tuple[np.ndarray, object]:
        """Memory of its own for a converted input or output, in `dtype` (float16 where the step is fed
        float16): flat in ONNX's layout, or, for a 4-D input of shape `nchw`, NHWC with each row padded
        to the runtime's w_stride (the one layout it converts from there, as rknn_create_mem_demo
        copies it); its numpy array (the rows' view, for a 4-D input)."""
        dtype = np.dtype(np.float16 if dtype == "float16" else np.float32 if "float" in dtype else dtype)
        attr.type, attr.fmt, attr.pass_through = (FLOAT16 if dtype == np.float16 else FLOAT32
                                                  if dtype == np.float32 else attr.type), NHWC if nchw else NCHW, 0
        n, c, h, w = nchw or (1, 1, 1, attr.n_elems)
        stride = max(w, attr.w_stride) if nchw else w
        size = n * h * stride * c * dtype.itemsize
        mem = self.rt.lib.rknn_create_mem(self.ctx.value, max(size, attr.size_with_stride))
        self.mems.append(mem)
        self.rt.check(self.rt.lib.rknn_set_io_mem(self.ctx.value, mem, ctypes.byref(attr)),
                      f"{self.shard.name}: rknn_set_io_mem of {attr.name.decode()}")
        array = np.ctypeslib.as_array(ctypes.cast(mem.contents.virt_addr, ctypes.POINTER(ctypes.c_uint8)),
                                      shape=(size,)).view(dtype)
        return (array.reshape(n, h, stride, c)[:, :, :w] if nchw else array), mem

    def imported(self, mem) -> object:
        """Another context's memory, bound in this one (rknn_create_mem_from_fd)."""
        m = mem.contents
        made = self.rt.lib.rknn_create_mem_from_fd(self.ctx.value, m.fd, m.virt_addr, m.size, m.offset)
        self.mems.append(made)
        return made

    def run(self, inputs: dict[str, np.ndarray]) -> list[np.ndarray]:
        """Write the converted inputs (and a held one handed over as another array) and run; the outputs."""
        others = iter(self.inputs)
        for spec in self.shard.inputs:
            value = edge_input(self.shard, spec, inputs[spec.name])
            if spec.name in self.views:
                if not same_memory(value, self.views[spec.name]):
                    self.views[spec.name][...] = value   # not the cache's own view: copied in
                continue
            array, _ = next(others)
            value = np.asarray(value)
            np.copyto(array, value.transpose(0, 2, 3, 1) if array.ndim == 4 else value.reshape(-1), casting="same_kind")
        self.rt.check(self.rt.lib.rknn_run(self.ctx.value, None), f"{self.shard.name}: rknn_run")
        for array, mem in self.outputs:
            self.rt.check(self.rt.lib.rknn_mem_sync(self.ctx.value, mem, SYNC_FROM_DEVICE), "rknn_mem_sync")
        return [array.copy() for array, _ in self.outputs]

    def close(self) -> None:
        for mem in self.mems:
            self.rt.lib.rknn_destroy_mem(self.ctx.value, mem)
        self.mems = []
        if self.ctx.value:
            self.rt.lib.rknn_destroy(self.ctx.value)
            self.ctx = ctypes.c_uint64(0)


class RknnHeldExecutor:
    """A core's shards on the board through the C API, the held inputs bound once in NPU memory."""

    def __init__(self, rt: Runtime, bundle: Path, shards: list[ShardSpec], core: int, cores: int, held: set[str],
                 memories: Held):
        self.contexts: dict[str, Context] = {}
        try:
            for shard in shards:
                self.contexts[shard.name] = Context(rt, bundle / shard.artifact, shard, core, cores, held, memories)
        except BaseException:
            self.close()
            raise

    def held_views(self) -> dict[str, np.ndarray]:
        return {name: view for context in self.contexts.values() for name, view in context.views.items()}

    def run(self, shard: ShardSpec, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return outputs_by_name(shard, self.contexts[shard.name].run(inputs))

    def close(self) -> None:
        for context in self.contexts.values():
            context.close()
        self.contexts.clear()


def make(bundle: Path, manifest: Manifest, placements: dict[int, list[ShardSpec]], on_device: OnDevice) -> dict:
    """One executor per core, the inputs `on_device.held` names bound in `on_device.memory` (a Held)."""
    rt, cores = Runtime(), manifest.profile.get("cores", 3)
    return each_core(placements, lambda core, shards: RknnHeldExecutor(rt, bundle, shards, core, cores,
                                                                       set(on_device.held), on_device.memory))

