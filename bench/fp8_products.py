"""FP8 matrix products against fp16 at the linear shapes of the zoo's vision models, on the GPU at
hand: what the cuda executor's fp8_linear fusion can gain per product, and which FP8 form is fastest.
Needs an NVIDIA GPU with FP8 (Hopper, Blackwell) and torch.

    python bench/fp8_products.py

Per shape [M, K] x [K, N] (M = tokens x batch), each captured in a CUDA graph and replayed as the
probe times its kernels (shard.probes.cuda.time_graph):
fp16 F.linear with its bias; torch._scaled_mm with a scale per row and per column, fp16 out, the
bias in its epilogue; the same with fast accumulation (the form the executor uses where torch
takes it); one scale per tensor, then the column scales and the bias in one addcmul (the
executor's other form); one scale per tensor for the weight too, the bias in the epilogue, fast
accumulation (pertensor_fast: no scale per column at all). Ends with one line per shape:
    RESULT m=... k=... n=... fp16_us=... rowwise=... rowwise_fast=... tensorwise=... pertensor_fast=...
        (fp16 time over each)
"""

from __future__ import annotations

import argparse

# SigLIP-base-512 (1024 tokens, 768 wide, MLP 3072) and SigLIP-so400m-384 (729 tokens, 1152, 4304)
SHAPES = [(1024, 768, 768), (1024, 768, 3072), (1024, 3072, 768), (729, 1152, 1152), (729, 1152, 4304),
          (729, 4304, 1152)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,4", help="M is tokens x each of these")
    args = ap.parse_args()
    import torch

    from shard.probes.cuda import time_graph

    print(f"GPU: {torch.cuda.get_device_name()}; torch {torch.__version__}")
    for batch in [int(b) for b in args.batches.split(",")]:
        for tokens, k, n in SHAPES:
            m = tokens * batch
            x = torch.randn(m, k, device="cuda", dtype=torch.float16)
            w = torch.randn(n, k, device="cuda", dtype=torch.float16) / k ** 0.5
            bias = torch.randn(n, device="cuda", dtype=torch.float16)
            q = (x / (x.abs().max() / 448)).to(torch.float8_e4m3fn)
            w8 = (w / (w.abs().amax(1, keepdim=True) / 448)).to(torch.float8_e4m3fn).t()   # column-major [K, N]
            rows, cols = torch.full((m, 1), 0.01, device="cuda"), torch.rand(1, n, device="cuda") / 100
            one, least = torch.tensor(0.01, device="cuda"), cols.min().reshape(())
            ratio = (cols / least).reshape(-1).half()
            forms = {
                "fp16": lambda: torch.nn.functional.linear(x, w, bias),
                "rowwise": lambda: torch._scaled_mm(q, w8, rows, cols, bias=bias, out_dtype=torch.float16),
                "rowwise_fast": lambda: torch._scaled_mm(q, w8, rows, cols, bias=bias, out_dtype=torch.float16,
                                                         use_fast_accum=True),
                "tensorwise": lambda: torch.addcmul(bias, torch._scaled_mm(q, w8, one, least, out_dtype=torch.float16),
                                                    ratio),
                "pertensor_fast": lambda: torch._scaled_mm(q, w8, one, least, bias=bias, out_dtype=torch.float16,
                                                           use_fast_accum=True),
            }
            seconds = {}
            for name, fn in forms.items():
                try:
                    seconds[name] = time_graph(torch, fn)
                except Exception as exc:   # noqa: BLE001 - a form this torch lacks is said, not fatal
                    print(f"  {name} at {m}x{k}x{n}: did not run ({type(exc).__name__}: {str(exc)[:120]})")
            base = seconds["fp16"]
            tflops = 2 * m * k * n / base / 1e12
            print(f"RESULT m={m} k={k} n={n} fp16_us={1e6 * base:.1f} ({tflops:.0f} TFLOP/s) " + " ".join(
                f"{name}={base / s:.2f}" for name, s in seconds.items() if name != "fp16"), flush=True)


if __name__ == "__main__":
    main()
