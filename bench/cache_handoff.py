"""What a decode step hands an rknn runtime for its KV cache, two ways side by side in one run: the
cache as float32 in ONNX's layout (as generate.Cache holds it for the simulator and every other
backend), and as GenerativeSession holds it for the board's runtime (float16, its memory NHWC:
executors.npu_inputs hands it over as it lies, with data_format "nhwc").

    python bench/cache_handoff.py                      # SmolLM2-135M's cache: 30 layers, 3 x 512 x 64
    python bench/cache_handoff.py --bundle lm.shard    # and its decode step on the simulator, each way

Host, each way: npu_inputs over the cache's tensors (what the sim and board executors call every
step) and, for float32 in ONNX's layout, the transpose to NHWC that rknn-toolkit-lite2 makes on the
host each run where the model's input is NHWC (its message: "The input[..] need NHWC data format,
but NCHW set, the data format and data buffer will be changed to NHWC"); the bytes handed over. What
the board's rknn_inputs_set then does with either is not measured here (no board).
Simulator (--bundle, a generative rk3588 bundle): the median of --steps decode steps through
GenerativeSession.run, the two caches taking turns.

Ends with: RESULT capacity=... tensors=... bytes_ratio=... host_ms_float32=... host_ms_held=...
           [sim_step_s_float32=... sim_step_s_held=...]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np


def median_ms(work, repeats: int = 7) -> float:
    seconds = []
    for _ in range(repeats):
        started = time.perf_counter()
        work()
        seconds.append(time.perf_counter() - started)
    return 1e3 * statistics.median(seconds)


def cache_shard(cache):
    """A shard that reads every tensor of `cache` as a decode step's program does."""
    from shard.bundle import ShardSpec, TensorSpec

    return ShardSpec("cache", "", None, None, [TensorSpec(name, list(a.shape), "float32")
                                               for name, a in cache.feeds().items()], [], 0, "fp16")


def filled(cache, length: int, seed: int = 0):
    """`cache` with its first `length` entries seeded, as float16 numbers (what the NPU hands back)."""
    rng = np.random.default_rng(seed)
    for arrays in (cache.keys, cache.values):
        for a in arrays:
            a[:, :, :length] = rng.standard_normal((*a.shape[:2], length, a.shape[3])).astype(np.float16)
    cache.length = length
    return cache


def host(layers: int, kv_heads: int, capacity: int, head_dim: int) -> dict:
    from shard.runtime.executors import npu_inputs
    from shard.runtime.generate import Cache

    plain = filled(Cache.empty(layers, kv_heads, capacity, head_dim), capacity // 2)
    held = filled(Cache.empty(layers, kv_heads, capacity, head_dim, np.float16, nhwc=True), capacity // 2)
    shard = cache_shard(plain)

    def lite2_plain():   # npu_inputs, then rknn-toolkit-lite2's own transpose of each 4-D "nchw" input
        arrays, _ = npu_inputs(shard, plain.feeds())
        return [np.ascontiguousarray(a.transpose(0, 2, 3, 1)) for a in arrays]

    arrays, formats = npu_inputs(shard, held.feeds())
    assert set(formats) == {"nhwc"} and all(np.shares_memory(a, k) for a, k in zip(arrays, held.feeds().values()))
    np.testing.assert_array_equal(np.stack(lite2_plain()), np.stack(arrays).astype(np.float32))
    return {"tensors": len(arrays), "host_ms_float32": median_ms(lite2_plain),
            "host_ms_held": median_ms(lambda: npu_inputs(shard, held.feeds())),
            "bytes_float32": sum(a.nbytes for a in plain.feeds().values()),
            "bytes_held": sum(a.nbytes for a in held.feeds().values())}


def simulated(bundle: Path, steps: int) -> dict:
    from shard.runtime.generate import Cache, GenerativeSession, step_feeds

    with GenerativeSession(bundle, backend="sim") as session:
        s = session.spec
        shape = (s.layers, s.kv_heads, s.capacities[0], s.head_dim)
        held = filled(Cache.empty(*shape, np.float16, nhwc=True), s.capacities[0] // 2)
        plain = filled(Cache.empty(*shape), s.capacities[0] // 2)
        rows = session.table[[1]]
        seconds: dict[str, list[float]] = {"float32": [], "held": []}
        logits = {}
        for _ in range(steps):
            for name, cache in (("float32", plain), ("held", held)):
                feeds = {**step_feeds(rows, cache.length, s.decode_width, cache.capacity), **cache.feeds()}
                started = time.perf_counter()
                logits[name] = session.run(feeds)["logits"]
                seconds[name].append(time.perf_counter() - started)
        np.testing.assert_array_equal(logits["float32"], logits["held"])
    for name, times in seconds.items():
        print(f"decode steps on the simulator, {name}: " + ", ".join(f"{t:.3f}" for t in times) + " s")
    return {f"sim_step_s_{name}": statistics.median(times) for name, times in seconds.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--capacity", type=int, default=512)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--bundle", type=Path, help="a generative rk3588 bundle: its decode step on the simulator too")
    ap.add_argument("--steps", type=int, default=6, help="--bundle: decode steps each way")
    args = ap.parse_args()
    shape = (args.layers, args.kv_heads, args.capacity, args.head_dim)
    if args.bundle:
        from shard.runtime.generative_bundle import read_generative

        s = read_generative(args.bundle)
        shape = (s.layers, s.kv_heads, s.capacities[0], s.head_dim)
    got = host(*shape)
    print(f"the cache of {shape[0]} layers, [1, {shape[1]}, {shape[2]}, {shape[3]}] each of keys and values: "
          f"{got['bytes_float32'] / 1e6:.1f} MB handed over a step as float32, {got['bytes_held'] / 1e6:.1f} MB as held "
          f"for the board; the host {got['host_ms_float32']:.2f} ms a step as float32 (npu_inputs and "
          f"rknn-toolkit-lite2's transpose), {got['host_ms_held']:.3f} ms as held (npu_inputs)")
    sim = simulated(args.bundle, args.steps) if args.bundle else {}
    if sim:
        print(f"decode step on the simulator (median of {args.steps}, the same logits to the bit): "
              f"{sim['sim_step_s_float32']:.3f} s as float32, {sim['sim_step_s_held']:.3f} s as held")
    print(f"RESULT capacity={shape[2]} tensors={got['tensors']} bytes_ratio={got['bytes_held'] / got['bytes_float32']:.2f} "
          f"host_ms_float32={got['host_ms_float32']:.2f} host_ms_held={got['host_ms_held']:.3f}"
          + "".join(f" {k}={v:.3f}" for k, v in sim.items()))


if __name__ == "__main__":
    main()
