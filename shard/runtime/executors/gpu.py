"""The pipeline machinery the GPU executors share: one CUDA stream per "core" (pipeline stage), each
stage's inputs and outputs in fixed device buffers, and the stage captured once as a CUDA graph.

The scheduler gives every stream its own thread, so stage k of frame t+1 is enqueued while stage
k+1 of frame t runs on its own stream; a thread waits only for its own stream. Tensors passed
between stages stay on the GPU (a device-to-device copy out of the stage's fixed buffers, so the
next replay cannot overwrite what a later stage has not read yet); only the bundle's outputs come
back to the host as numpy. Imports torch, which the cuda and tensorrt executors need anyway.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from shard.bundle import Manifest, ShardSpec, step_inputs, step_outputs
from shard.errors import RunError
from shard.runtime.executors import OnDevice, edge_input, to_host

Stage = Callable[[list], list]   # fixed input buffers -> output tensors (the same buffers every call)


def stage_edges(manifest: Manifest, on_device: OnDevice = OnDevice()) -> tuple[set[str], set[str]]:
    """(the tensors that leave the stages for the host, those that enter them from it); the outputs
    on_device names stay on the GPU (a decoder's new keys and values, for a cache that lives there)."""
    kept = set(on_device.outputs) | set(on_device.writes)
    leaving = {t.name for t in manifest.outputs} - kept | {n for step in manifest.host_post for n in step_inputs(step)}
    entering = {t.name for t in manifest.inputs} | {n for step in manifest.host_pre for n in step_outputs(step)}
    return leaving, entering


@dataclass
class Prepared:
    inputs: list          # the stage's fixed input buffers
    outputs: list         # its output tensors (the graph's own, where captured)
    stage: Stage          # kept alive with it: a CUDA graph holds only raw pointers to the weights it reads
    graph: object = None  # torch.cuda.CUDAGraph, or None to call the stage each time
    host: dict = None     # {tensor: page-locked host buffer} for what crosses to or from numpy
    written: frozenset = frozenset()   # the outputs the stage writes into its own input buffers (OnDevice.writes)
    form: str = "eager"   # which of the stage's forms this is (eager torch ops, torch.compile'd)
    seconds: float | None = None   # one replay, where forms were timed against each other


@contextlib.contextmanager
def collector_paused():
    """Python's cyclic garbage collector run now, then paused until the block ends: for a CUDA graph's
    capture. An object it finalized mid-capture (a CUDA graph or a Triton kernel left in a reference
    cycle) calls the driver, which a capturing stream forbids, and the process aborts; torch no longer
    collects before a capture (pytorch/pytorch PR 161037). Pi0's GPU test aborted so on an H100, the
    collector running inside the denoising loop's capture; with the collector off, it passed."""
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@contextlib.contextmanager
def capturing(torch, graph, stream=None):
    """torch.cuda.graph(graph, stream=stream) with the collector paused (collector_paused): every CUDA
    graph shard and its benches capture goes through here."""
    with collector_paused(), torch.cuda.graph(graph, stream=stream):
        yield


def failure(exc: BaseException, width: int = 200) -> str:
    """One line for why `exc` was raised: its type and first line, and where that line only introduces
    what was raised inside (torch.compile's "backend='inductor' raised:"), the inner error's."""
    inner = getattr(exc, "inner_exception", None) or exc.__cause__
    first = next((line.strip() for line in str(exc).splitlines() if line.strip()), "")
    if inner is not None and inner is not exc and (not first or first.endswith(":")):
        return f"{type(exc).__name__}: {failure(inner, width)}"
    return f"{type(exc).__name__}: {first[:width]}"


def replay_seconds(torch, graph, stream, repeats: int = 10) -> float:
    """One replay of a captured graph, the median of `repeats` timed with CUDA events."""
    times = []
    with torch.cuda.stream(stream):
        graph.replay()
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def require_cuda(who: str = "the cuda and tensorrt backends", instead: str = "run this bundle with --backend cpu"):
    try:
        import torch
    except ImportError:
        raise RunError(f"{who}: torch with CUDA is required (pip install torch)") from None
    if not torch.cuda.is_available():
        raise RunError(f"{who}: no NVIDIA GPU here (torch.cuda.is_available() is False); {instead}")
    return torch


class StreamExecutor:
    """The stages one stream runs. make_stage(shard, input buffers) returns the stage's callable."""

    def __init__(self, bundle: Path, shards: list[ShardSpec], leaving: set[str],
                 make_stage: Callable[[ShardSpec, list], Stage], device: str = "cuda", graphs: bool = True,
                 entering: set[str] = frozenset(), writes: dict[str, tuple[str, str]] | None = None):
        import torch

        self.torch = torch
        self.leaving = leaving              # tensors that leave the bundle (outputs, host steps): numpy
        self.entering = set(entering)       # tensors that come from the host (its inputs, host steps)
        self.writes = dict(writes or {})    # output -> (input, positions), written in the stage's graph
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        self.prepared: dict[str, Prepared] = {}
        self.lock = threading.Lock()   # a run on the caller's thread (Scheduler.run_here) and a core's never overlap
        self.passed_over: dict[str, str] = {}   # stage -> why a faster form of it could not be used
        self.form_seconds: dict[str, dict[str, float]] = {}   # stage -> {form: one replay}, where timed
        for shard in shards:
            self.prepared[shard.name] = self._prepare(shard, make_stage, graphs and self.cuda)

    def _prepare(self, shard: ShardSpec, make_stage, capture: bool) -> Prepared:
        """The stage in fixed buffers, captured. make_stage may offer several forms of it ({form: stage},
        the plainest first): each is captured and timed, and the fastest kept; a form that fails to
        build or capture is passed over (the plainest must not fail)."""
        torch = self.torch
        inputs = [torch.zeros(shard.edge_shapes.get(t.name, t.shape), dtype=getattr(torch, t.dtype), device=self.device)
                  for t in shard.inputs]
        forms = make_stage(shard, inputs)
        forms = forms if isinstance(forms, dict) else {"eager": forms}
        written = self._writes(shard)
        if written:
            forms = {form: self._writing(stage, written) for form, stage in forms.items()}
        written_names = frozenset(shard.outputs[k].name for k, _, _ in written)
        best = None
        for k, (form, stage) in enumerate(forms.items()):
            try:
                prepared = self._capture(shard, stage, inputs, capture)
            except Exception as exc:   # noqa: BLE001 - a faster form that does not build is not used
                if k == 0:
                    raise
                why = f"{form}: {failure(exc)}"
                self.passed_over[shard.name] = "; ".join(filter(None, [self.passed_over.get(shard.name), why]))
                continue
            prepared.form, prepared.written = form, written_names
            if len(forms) > 1 and prepared.graph is not None:
                prepared.seconds = replay_seconds(torch, prepared.graph, self.stream)
                self.form_seconds.setdefault(shard.name, {})[form] = prepared.seconds
            if best is None or (prepared.seconds or 0) < (best.seconds or 0):
                best = prepared
        return best

    def _writes(self, shard: ShardSpec) -> list[tuple[int, int, int]]:
        """(output, input, positions) of the writes this stage holds all three tensors of, by index."""
        ins, outs = [t.name for t in shard.inputs], [t.name for t in shard.outputs]
        return [(outs.index(out), ins.index(into), ins.index(at)) for out, (into, at) in self.writes.items()
                if out in outs and into in ins and at in ins]

    def _writing(self, stage: Stage, written: list[tuple[int, int, int]]) -> Stage:
        """The stage, then each written output copied into its input's buffer at the positions (axis 2),
        in the same stream: captured with it, after the stage has read that buffer."""
        def run(inputs: list) -> list:
            outputs = stage(inputs)
            for out, into, at in written:
                inputs[into].index_copy_(2, inputs[at].reshape(-1), outputs[out].to(inputs[into].dtype))
            return outputs
        return run

    def _capture(self, shard: ShardSpec, stage, inputs: list, capture: bool) -> Prepared:
        torch = self.torch
        with torch.no_grad(), self._on_stream():
            outputs = stage(inputs)          # warm-up: kernels chosen, lazy initialisation done
            outputs = stage(inputs)
        # Page-locked host buffers for the bundle's inputs and outputs: a copy from pageable numpy memory
        # is staged and synchronous (SigLIP-base on an H100: 3.57 ms a frame for 2.56 ms of stage)
        host = {t.name: torch.empty(t.shape, dtype=getattr(torch, t.dtype), pin_memory=True)
                for t in (*shard.inputs, *shard.outputs) if self.cuda and t.name in self.leaving | self.entering}
        if not capture:
            return Prepared(inputs, outputs, stage, None, host)
        self.stream.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.no_grad(), capturing(torch, graph, self.stream):
            outputs = stage(inputs)
        return Prepared(inputs, outputs, stage, graph, host)

    def captured(self, stage: str) -> Prepared | None:
        """The stage as prepared, where it was captured: its fixed buffers and the callable of its kept
        form, for a caller that captures it again inside a larger graph (`capture`)."""
        prepared = self.prepared.get(stage)
        return prepared if prepared is not None and prepared.graph is not None else None

    def capture(self, work: Callable[[], None]):
        """`work` as one CUDA graph on this executor's stream, after one warm run: stages' callables and
        in-place copies on fixed buffers (a denoising loop: the step's stage run N times, its time set and
        its input copied before each, its velocity added to the action chunk after). Its replay runs
        them with no host work and no synchronization between them."""
        torch = self.torch
        with torch.no_grad(), self._on_stream():
            work()   # the work's own ops warmed before capture
        self.stream.synchronize()
        graph = torch.cuda.CUDAGraph()
        with self.lock, torch.no_grad(), capturing(torch, graph, self.stream):
            work()
        return graph

    def _on_stream(self):
        return self.torch.cuda.stream(self.stream) if self.cuda else contextlib.nullcontext()

    def run(self, shard: ShardSpec, inputs: dict) -> dict:
        with self.lock:
            return self._run(shard, inputs)

    def _run(self, shard: ShardSpec, inputs: dict) -> dict:
        torch = self.torch
        prepared = self.prepared[shard.name]
        with torch.no_grad(), self._on_stream():
            for buffer, spec in zip(prepared.inputs, shard.inputs):
                value = inputs[spec.name]
                if not isinstance(value, np.ndarray) and value.data_ptr() == buffer.data_ptr():
                    continue   # written in place by the caller (Session.input_buffers)
                if isinstance(value, np.ndarray):
                    value = np.reshape(edge_input(shard, spec, value), spec.shape)
                    if spec.name in prepared.host:   # the previous frame's copy ended with its synchronize
                        copy_into(prepared.host[spec.name].numpy(), value)
                        value = prepared.host[spec.name]
                    else:
                        value = torch.from_numpy(np.ascontiguousarray(value))
                buffer.copy_(value.reshape(buffer.shape), non_blocking=True)
            if prepared.graph is not None:
                prepared.graph.replay()
                produced = prepared.outputs
            else:
                produced = prepared.stage(prepared.inputs)
            results = {}
            for spec, value in zip(shard.outputs, produced):
                if spec.name in prepared.host:   # read before the next replay: this call synchronizes first
                    results[spec.name] = prepared.host[spec.name].copy_(value.reshape(spec.shape), non_blocking=True)
                elif spec.name not in prepared.written:   # the next replay writes over the graph's own
                    results[spec.name] = value.clone()
        if self.cuda:
            self.stream.synchronize()
        return {spec.name: to_numpy(results[spec.name], spec) if spec.name in self.leaving
                else results[spec.name].reshape(spec.shape) for spec in shard.outputs if spec.name in results}

    @property
    def written(self) -> frozenset[str]:
        """The outputs its stages write in place (OnDevice.writes) and hand back to no one."""
        return frozenset().union(*(p.written for p in self.prepared.values()))

    def close(self) -> None:
        self.prepared.clear()


def to_numpy(value, spec) -> np.ndarray:
    """A copy in numpy, in the manifest's shape and type (a page-locked buffer is reused by the next frame)."""
    host = to_host(value)
    out = np.empty(host.shape, host.dtype)
    copy_into(out, host)
    return out.reshape(spec.shape).astype(spec.dtype, copy=False)


COPY_THREADS = "SHARD_COPY_THREADS"   # threads a large host copy is split over (default: up to 8)
SPLIT_BYTES = 8 << 20   # a copy at least this large is split


@functools.cache
def copy_pool(threads: int) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(threads, thread_name_prefix="shard-copy")


def copy_into(dst: np.ndarray, src: np.ndarray) -> None:
    """np.copyto(dst, src, casting="unsafe"), split over threads when large (numpy copies without the
    GIL): the float32 frames in and out of a batch are the host's work between a stage's replays
    (SigLIP-base at batch 16, 50 MB each way: 32.6 ms a batch for 6.7 ms on an H200, one thread)."""
    if dst.nbytes < SPLIT_BYTES:   # a few rows of a decoder's step: one copy, nothing to split
        np.copyto(dst, src, casting="unsafe")
        return
    threads = int(os.environ.get(COPY_THREADS, min(8, os.cpu_count() or 1)))
    src = np.broadcast_to(np.asarray(src), dst.shape)
    if src.flags.c_contiguous and dst.flags.c_contiguous:   # split anywhere: a batch of one frame too
        dst, src = dst.reshape(-1), src.reshape(-1)
    rows = dst.shape[0] if dst.ndim else 0
    if threads < 2 or rows < 2:
        np.copyto(dst, src, casting="unsafe")
        return
    bounds = np.linspace(0, rows, min(threads, rows) + 1).astype(int)
    parts = [copy_pool(threads).submit(np.copyto, dst[a:b], src[a:b], casting="unsafe")
             for a, b in zip(bounds[:-1], bounds[1:]) if b > a]
    for part in parts:
        part.result()
