"""Does rknn-toolkit2's dynamic_input let a decoder's prefill and decode steps share one copy of the
weights? SmolLM2-135M-Instruct's first layers (trained, from the index) as one step ONNX whose token
count is dynamic, built three ways for rk3588 fp16 by the real toolkit: at 16 tokens, at 1 token,
and once with dynamic_input=[16 tokens, 1 token]; the artifacts' sizes side by side, and the
dynamic build run on the simulator at both shapes against onnxruntime.

    python bench/dynamic_input.py [--layers 4] [--capacity 256]

Ends with: RESULT layers=... static_16_mb=... static_1_mb=... dynamic_mb=... dynamic_over_sum=...
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from trained import smollm2_file  # noqa: E402

# Run by the toolkit's own interpreter: each build, its size and seconds; the dynamic one simulated.
BUILD = r"""
import json, sys, time
import numpy as np
from rknn.api import RKNN
job = json.loads(sys.argv[1])
out = {}
for name, shapes in job["builds"].items():
    r = RKNN(verbose=False)
    config = {"target_platform": "rk3588"}
    if shapes:
        config["dynamic_input"] = shapes
    r.config(**config)
    assert r.load_onnx(job["onnx"]) == 0
    started = time.time()
    assert r.build(do_quantization=False) == 0, name
    path = job["folder"] + f"/{name}.rknn"
    assert r.export_rknn(path) == 0
    out[name] = {"seconds": time.time() - started, "path": path}
    if len(shapes) > 1:
        assert r.init_runtime() == 0
        for k, feeds in enumerate(job["feeds"]):
            arrays = [np.load(f) for f in feeds]
            got = r.inference(inputs=arrays, data_format=["nchw"] * len(arrays))
            np.save(job["folder"] + f"/sim{k}.npy", got[0])
    r.release()
print("RESULT " + json.dumps(out))
"""


def main() -> None:
    import onnxruntime as ort
    import torch

    from shard.compare import compare
    from shard.runtime.generate import step_mask
    from shard.targets.rknn.env import find_python
    from shard.zoo.decoder import CachedStep, load_causal_lm, step_names

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=4, help="the decoder's first layers kept")
    ap.add_argument("--capacity", type=int, default=256, help="the KV cache's capacity")
    args = ap.parse_args()
    model, _ = load_causal_lm(smollm2_file())
    model.model.layers = model.model.layers[:args.layers]
    model.config.num_hidden_layers = args.layers
    step, config = CachedStep(model).eval(), model.config
    inputs, outputs = step_names(args.layers)
    cache = [torch.zeros(1, step.kv_heads, args.capacity, step.head_dim) for _ in range(2 * args.layers)]
    axes = {"inputs_embeds": {1: "t"}, "position_ids": {1: "t"}, "mask": {2: "t", 3: "ct"}, "logits": {1: "t"},
            **{name: {2: "t"} for name in outputs[1:]}}

    def shapes(t: int) -> list[list[int]]:
        return [[1, t, config.hidden_size], [1, t], [1, 1, t, args.capacity + t]] + [list(c.shape) for c in cache]

    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        with torch.no_grad():
            torch.onnx.export(step, (torch.zeros(1, 16, config.hidden_size), torch.arange(16)[None],
                                     torch.zeros(1, 1, 16, args.capacity + 16), *cache), str(folder / "step.onnx"),
                              opset_version=17, dynamo=False, input_names=inputs, output_names=outputs,
                              dynamic_axes=axes)
        feeds = []
        for t in (16, 1):   # a real-looking step: the cache half full of small values
            arrays = [rng.standard_normal((1, t, config.hidden_size)).astype(np.float32),
                      (100 + np.arange(t, dtype=np.int64))[None], step_mask(100, t, args.capacity)]
            arrays += [(0.5 * rng.standard_normal(c.shape)).astype(np.float32) for c in cache]
            feeds.append([])
            for k, a in enumerate(arrays):
                feeds[-1].append(str(folder / f"in{t}_{k}.npy"))
                np.save(feeds[-1][-1], a)
        job = {"onnx": str(folder / "step.onnx"), "folder": tmp, "feeds": feeds,
               "builds": {"static_16": [shapes(16)], "static_1": [shapes(1)], "dynamic": [shapes(16), shapes(1)]}}
        # The static builds: the dynamic ONNX fixed to one shape by dynamic_input of one entry.
        res = subprocess.run([str(find_python("rk3588")), "-I", "-c", BUILD, json.dumps(job)], capture_output=True,
                             text=True)
        line = next((x for x in res.stdout.splitlines() if x.startswith("RESULT ")), None)
        if line is None:
            sys.exit(f"the toolkit's builds failed:\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}")
        built = json.loads(line[len("RESULT "):])
        sizes = {name: Path(b["path"]).stat().st_size / 1e6 for name, b in built.items()}
        session = ort.InferenceSession(str(folder / "step.onnx"))
        for k, t in enumerate((16, 1)):
            want = session.run(["logits"], {n: np.load(f) for n, f in zip(inputs, feeds[k])})[0]
            got = np.load(folder / f"sim{k}.npy").reshape(want.shape)
            print(f"dynamic build on the simulator at {t} tokens: cosine {compare('logits', want, got).cosine:.7f}")
    for name, b in built.items():
        print(f"{name}: {sizes[name]:.1f} MB, built in {b['seconds']:.1f} s")
    ratio = sizes["dynamic"] / (sizes["static_16"] + sizes["static_1"])
    print(f"RESULT layers={args.layers} static_16_mb={sizes['static_16']:.1f} static_1_mb={sizes['static_1']:.1f} "
          f"dynamic_mb={sizes['dynamic']:.1f} dynamic_over_sum={ratio:.2f}")


if __name__ == "__main__":
    main()
