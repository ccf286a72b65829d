"""int4-weight matrix products against fp16 at the Pi0-shaped VLA's linear shapes (shard.zoo.vla), on
the GPU at hand: whether an int4 product in the cuda executor could make `--precision w4a16` faster
than the fp16 it runs at now (the executor dequantizes w4a16's weights once, at load). Needs an NVIDIA
GPU (sm80 or later) and torch.

    python bench/int4_products.py

The int4 product is torch's tinygemm kernel (torch._weight_int4pack_mm: bf16 activations, weights
packed by torch._convert_weight_to_int4pack, one scale per 128 rows of a column, the zero point 0 as
w4a16_linears writes them). Per shape [M, K] x [K, N] (M: the step's 51 rows, the prefix's 816, the
vision tower's 3 x 256), each form captured in a CUDA graph and replayed as the probe times its
kernels (shard.probes.cuda.time_graph): fp16 F.linear, bf16 F.linear, the int4 product; the int4
product's largest difference from bf16 F.linear on the dequantized weight, over that output's largest
magnitude. Then one layer of each program (its seven linears: q, k, v, o, gate, up, down; the vision
tower's two MLP linears of a width int4pack takes). Ends with
    RESULT program=... fp16_us=... bf16=... int4=...   (fp16 time over each)
"""

from __future__ import annotations

from shard.zoo.vla import PI0

def layer(rows: int, g) -> list[tuple[int, int, int, int]]:
    """One Gemma layer's linears over `rows` rows: (rows, K, N, how many in the layer)."""
    q, kv = g.heads * g.head_dim, g.kv_heads * g.head_dim
    return [(rows, g.width, q, 1), (rows, g.width, kv, 2), (rows, q, g.width, 1), (rows, g.width, g.mlp, 2),
            (rows, g.mlp, g.width, 1)]


PROGRAMS = {"step": layer(1 + PI0.horizon, PI0.expert), "prefix": layer(PI0.prefix_tokens, PI0.prefix),
            "vision": [(PI0.cameras * PI0.patches, PI0.vision_width, PI0.vision_mlp, 1)]}


def main() -> None:
    import torch

    from shard.probes.cuda import time_graph

    print(f"GPU: {torch.cuda.get_device_name()}; torch {torch.__version__}")
    gen = torch.Generator(device="cuda").manual_seed(0)
    for program, shapes in PROGRAMS.items():
        totals = {"fp16": 0.0, "bf16": 0.0, "int4": 0.0}
        for m, k, n, count in shapes:
            x = torch.randn(m, k, device="cuda", dtype=torch.float16, generator=gen)
            codes = torch.randint(0, 16, (n, k), device="cuda", dtype=torch.int32, generator=gen)
            scales = torch.rand(k // 128, n, device="cuda", generator=gen) / k ** 0.5
            weight = (codes - 8).float() * scales.repeat_interleave(128, 0).t()   # [N, K], dequantized
            packed = torch._convert_weight_to_int4pack((codes[:, ::2] << 4 | codes[:, 1::2]).to(torch.uint8), 8)
            scale_zero = torch.stack([scales, torch.zeros_like(scales)], -1).to(torch.bfloat16).contiguous()
            xb, w16, wb = x.bfloat16(), weight.half(), weight.bfloat16()
            forms = {"fp16": lambda: torch.nn.functional.linear(x, w16),
                     "bf16": lambda: torch.nn.functional.linear(xb, wb),
                     "int4": lambda: torch._weight_int4pack_mm(xb, packed, 128, scale_zero)}
            want = forms["bf16"]().float()
            off = float((forms["int4"]().float() - want).abs().max() / want.abs().max())
            seconds = {name: time_graph(torch, fn) for name, fn in forms.items()}
            for name, s in seconds.items():
                totals[name] += count * s
            print(f"  {program} {m}x{k}x{n} (x{count}): " + ", ".join(f"{name} {1e6 * s:.1f} us"
                                                                       for name, s in seconds.items())
                  + f"; int4 off bf16 by {off:.1e} of its largest output", flush=True)
        print(f"RESULT program={program} fp16_us={1e6 * totals['fp16']:.1f} "
              + " ".join(f"{name}={totals['fp16'] / s:.2f}" for name, s in totals.items() if name != "fp16"),
              flush=True)


if __name__ == "__main__":
    main()
