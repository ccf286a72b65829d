"""`shard probe --target cuda`: measure the GPU at hand the way thor.json states Thor's published
figures, so the roofline (shard.targets.gpu.roofline) is checked against a real GPU.

Measured with torch on the current device, CUDA events around CUDA-graph replays (no launch gaps):
DRAM bandwidth (a device-to-device copy, bytes read plus written), the rate of square matrix
products per precision and size (fp16, bf16; fp8 through torch._scaled_mm where the GPU has it),
the peak of each, and the time of the shortest kernel (an add of one element), which is what every
small op costs however few bytes it moves. With `--ops BUNDLE`, also every distinct op of a thor or
cuda bundle's stages, each kernel captured alone and replayed (the cost model then sums measured
kernels instead of guessing their efficiency).
"""

from __future__ import annotations

import collections
import datetime
from pathlib import Path
from typing import Callable

import onnx
import onnx_graphsurgeon as gs

from shard.bundle import read_manifest
from shard.profile import Profile
from shard.runtime import Session, random_inputs
from shard.runtime.executors.gpu import capturing, replay_seconds, require_cuda
from shard.runtime.executors.torch_graph import TorchGraph
from shard.targets.gpu.roofline import op_signature

SIZES = (256, 512, 1024, 2048, 4096, 8192)
REPEATS = 20


def time_graph(torch, fn: Callable[[], object], repeats: int = REPEATS) -> float:
    """Seconds per call of fn, replayed `repeats` times as one CUDA graph (after a warm-up)."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with capturing(torch, graph, stream):
        for _ in range(repeats):
            fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()   # once untimed: the first replay uploads the graph
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(3):
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3 / repeats)
    return best


def gemm(torch, n: int, precision: str) -> Callable[[], object]:
    if precision == "fp8":
        a = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn)
        b = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn).t()   # _scaled_mm wants B column-major
        one = torch.ones((), device="cuda")
        return lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[precision]
    a, b = torch.randn(n, n, device="cuda", dtype=dtype), torch.randn(n, n, device="cuda", dtype=dtype)
    return lambda: a @ b


def probe_cuda(progress: Callable[[str, int, int], None] = lambda *a: None) -> Profile:
    torch = require_cuda("shard probe --target cuda", "run it on the machine whose GPU the profile is for")
    props = torch.cuda.get_device_properties(0)
    source = (f"shard probe --target cuda on {props.name}, torch {torch.__version__}, CUDA {torch.version.cuda}, "
              f"{datetime.date.today()}")
    precisions = ["fp16", "bf16"] + (["fp8"] if torch.cuda.get_device_capability() >= (8, 9) else [])
    steps = 2 + len(precisions) * len(SIZES)
    progress("bandwidth", 0, steps)
    x = torch.empty(1 << 28, device="cuda", dtype=torch.float32)   # 1 GiB
    y = torch.empty_like(x)
    copy_s = time_graph(torch, lambda: y.copy_(x), repeats=5)
    bandwidth = 2 * x.numel() * x.element_size() / copy_s / 1e9
    del x, y
    progress("shortest kernel", 1, steps)
    tiny = torch.zeros(1, device="cuda")
    min_kernel = time_graph(torch, lambda: tiny.add_(1), repeats=200)
    curves: dict[str, list[list[float]]] = {}
    done = 2
    for precision in precisions:
        for n in SIZES:
            progress(f"matrix products, {precision}", done, steps)
            seconds = time_graph(torch, gemm(torch, n, precision), repeats=max(3, REPEATS * 512 // n))
            flops = 2.0 * n ** 3
            curves.setdefault(precision, []).append([round(flops / 1e9, 3), round(flops / seconds / 1e12, 2)])
            done += 1
    torch.cuda.empty_cache()
    progress("done", steps, steps)
    peaks = {p: max(t for _, t in points) for p, points in curves.items()}
    peaks["fp32"] = peaks["fp16"] / 2   # roofline needs a rate for any fp32 op; tf32 tensor cores run at half
    facts = {
        "gpu": props.name, "gpu_source": source,
        "sms": props.multi_processor_count, "sms_source": source,
        "memory_bytes": props.total_memory, "memory_bytes_source": source,
        "bandwidth_gbs": round(bandwidth, 1),
        "bandwidth_gbs_source": f"{source}: a 1 GiB device-to-device copy, bytes read plus written",
        "peak_tflops": peaks, "peak_tflops_source": f"{source}: the fastest square matrix product of each "
                                                   f"precision ({', '.join(map(str, SIZES))}); fp32: half of fp16",
        "gemm_tflops": curves, "gemm_tflops_source": f"{source}: [GFLOP, TFLOP/s] of square products",
        "min_kernel_s": min_kernel, "min_kernel_s_source": f"{source}: one-element adds replayed in a CUDA graph",
        "dla": False, "dla_source": "a discrete NVIDIA GPU has no DLA",
    }
    return Profile(target="cuda", cores=1, toolkit=f"torch {torch.__version__} (CUDA {torch.version.cuda})",
                   facts=facts)


def measure_ops(bundle: str | Path, progress: Callable[[str, int, int], None] = lambda *a: None
                ) -> tuple[dict[str, float], dict[str, float]]:
    """For every distinct op of the bundle's stages (shard.targets.gpu.roofline.op_signature), as the
    cuda executor runs it: ({signature: seconds} op by op, {signature: its share of the stage as it
    runs}). Each step of the stage's fused form is captured alone in a CUDA graph and replayed, and
    its time shared among its ops in proportion to their times alone (an op no step needs once fused
    costs 0). An FP8 stage's quantizes (four kernels each in that form) go into the op before them in
    the torch.compile'd form the executor keeps: they are charged what the stage takes in the form
    kept beyond its other ops, in proportion to their own times."""
    torch = require_cuda("shard probe --target cuda --ops", "run it on the machine whose GPU the profile is for")
    bundle = Path(bundle)
    manifest = read_manifest(bundle)
    alone: dict[str, float] = {}
    shares: dict[str, float] = {}
    kept = None
    for k, shard in enumerate(manifest.shards):
        progress(f"ops of {shard.name}", k, len(manifest.shards))
        model = onnx.load(str(bundle / shard.onnx))
        nodes = {t.name: n for n in gs.import_onnx(model).nodes for t in n.outputs}
        signature = lambda node: op_signature(nodes[node.output[0]])  # noqa: E731
        for covers, seconds in timed_steps(torch, TorchGraph(model, "cuda", shard.name, fuse=False), shard.inputs,
                                           lambda covers: signature(covers[0]) in alone):
            alone[signature(covers[0])] = seconds
        fused = TorchGraph(model, "cuda", shard.name)
        mine: dict[str, float] = {}
        for covers, seconds in timed_steps(torch, fused, shard.inputs,
                                           lambda covers: all(signature(n) in mine for n in covers)):
            parts = [alone[signature(n)] for n in covers]
            for node, part in zip(covers, parts):
                mine.setdefault(signature(node), seconds * part / (sum(parts) or 1.0))
        mine.update({signature(n): 0.0 for n in fused.dropped if signature(n) not in mine})
        counts = collections.Counter(signature(n) for nodes_ in fused.covers for n in nodes_)
        quantizes = {signature(n) for nodes_ in fused.covers for n in nodes_ if n.op_type == "QuantizeLinear"}
        if quantizes:
            if kept is None:
                progress("loading the bundle", k, len(manifest.shards))
                kept = kept_seconds(torch, bundle)
            mine = charge_quantizes(mine, counts, quantizes, kept[shard.name])
        for name, seconds in mine.items():
            shares.setdefault(name, seconds)
        del fused
    progress("ops", len(manifest.shards), len(manifest.shards))
    return alone, shares


def charge_quantizes(shares: dict[str, float], counts: dict[str, int], quantizes: set[str], stage: float
                     ) -> dict[str, float]:
    """`shares` with the quantizes' scaled so that the stage's ops (each signature `counts` times) sum to
    `stage` seconds: they get what the stage takes beyond the other ops, in proportion to their own
    shares, and nothing where the others already take it all."""
    rest = sum(shares[name] * count for name, count in counts.items() if name not in quantizes)
    eager = sum(shares[name] * counts[name] for name in quantizes)
    factor = max(stage - rest, 0.0) / eager if eager else 0.0
    return {name: seconds * factor if name in quantizes else seconds for name, seconds in shares.items()}


def kept_seconds(torch, bundle: Path) -> dict[str, float]:
    """{stage: one replay of it as the cuda executor runs it}: the bundle loaded, each stage in the form
    the executor keeps (the faster of its forms), its CUDA graph replayed alone."""
    with Session(bundle, backend="cuda") as session:
        return {name: seconds for name, (_, seconds) in stage_replays(torch, session).items()}


def stage_replays(torch, session: Session) -> dict[str, tuple[str, float]]:
    """{stage: (the form its executor kept, one replay of its CUDA graph alone)} of a loaded session."""
    out = {}
    for shard in session.manifest.shards:
        executor = session.executors[shard.core]
        prepared = executor.prepared[shard.name]
        out[shard.name] = (prepared.form, replay_seconds(torch, prepared.graph, executor.stream))
    return out


def timed_steps(torch, graph, inputs, seen: Callable) -> list[tuple[list, float]]:
    """(the nodes a step computes, its seconds captured alone) for each step of a TorchGraph that
    `seen(nodes)` does not already have, run in order on seeded inputs."""
    env = dict(graph.values)
    env.update({name: torch.from_numpy(value).to("cuda") for name, value in random_inputs(inputs).items()})
    timed = []
    with torch.no_grad():
        for (fn, ins, outs), covers in zip(graph.steps, graph.covers):
            args = [env[i] if i else None for i in ins]
            if not seen(covers):
                timed.append((covers, time_graph(torch, lambda: fn(*args))))
            results = fn(*args)
            env.update(zip(outs, results if isinstance(results, tuple) else (results,)))
    return timed


def add_measured_ops(profile: Profile, bundle: str | Path, progress: Callable[[str, int, int], None] = lambda *a: None
                     ) -> int:
    """measure_ops into the profile's facts (kept beside the ops measured before); returns how many."""
    alone, shares = measure_ops(bundle, progress)
    profile.facts["op_seconds"] = {**profile.facts.get("op_seconds", {}), **alone}
    profile.facts["op_seconds_source"] = ("shard probe --target cuda --ops: each op of a bundle alone, captured in "
                                          "a CUDA graph and replayed")
    profile.facts["fused_op_seconds"] = {**profile.facts.get("fused_op_seconds", {}), **shares}
    profile.facts["fused_op_seconds_source"] = ("shard probe --target cuda --ops: each step of the cuda executor's "
                                                "fused form alone, captured and replayed, shared among the ops it "
                                                "computes in proportion to their times alone; an FP8 stage's "
                                                "quantizes charged what it takes in the form the executor keeps "
                                                "beyond its other ops")
    return len(alone)
