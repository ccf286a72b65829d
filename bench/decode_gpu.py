"""A decoder's generative bundle on the GPU (`--target cuda`, run by the cuda executor) beside
transformers' own `generate` on the same GPU, in the same run: decode tokens/s and the greedy tokens.

    python bench/decode_gpu.py [--layers 30] [--capacity 512] [--chunk 64] [--new 64]

The decoder is SmolLM2-135M's architecture (its config: 30 layers, 576 wide, 9 heads over 3 of keys
and values, a 49152-token vocabulary) with seeded weights, saved as a transformers folder with a
word-level tokenizer made here (nothing downloaded: a decode step's time does not depend on what its
weights learned). The same prompt of 40 token ids for every side:

  ours:     shard compile of the folder with --target cuda (fp16, one stage a step; the prefill of
            --chunk tokens and the one-token decode, the cache of --capacity tokens), then
            GenerativeSession.generate with --backend cuda: the cache on the GPU in the decode step's
            own input buffers, the step's new entries written there inside its CUDA graph; and the
            same with the host writing them (in_place=False), and with --also-stages K, the steps cut
            into K stages;
  eager:    transformers' LlamaForCausalLM in fp16 on the GPU (sdpa), generate with its dynamic cache,
            in a process of its own (as is the next);
  compiled: the same with cache_implementation="static", with which generate compiles its
            one-token step (compile_config: torch.compile fullgraph, mode="reduce-overhead"): the
            baseline a PyTorch user would pick for speed.

Decode tokens/s from wall time: (N - 1) over the time of a generation of N new tokens less that of
one (so the prompt's prefill drops out), each the best of 3 after a warm-up; for ours also a decode
step's CUDA graphs replayed alone (the rest of a step's time is the host's). Tokens: how many of the
first --new greedy tokens agree with the eager fp16 side (fp16 on both: a near tie may go either way).
Ends with: RESULT layers=L capacity=C ours_tps=... eager_tps=... compiled_tps=... vs_eager=... vs_compiled=...
same_tokens=K/N
"""

from __future__ import annotations

import argparse
import multiprocessing
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from thor import stage_seconds  # noqa: E402

PROMPT = [(7 * k + 3) % 49000 + 100 for k in range(40)]


def checkpoint(folder: Path, layers: int):
    """SmolLM2-135M's architecture with seeded weights and a word-level tokenizer, saved in `folder`."""
    import torch
    import transformers as tf
    from tokenizers import Tokenizer, models, pre_tokenizers

    torch.manual_seed(0)
    config = tf.LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=layers,
                            num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                            rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=1,
                            eos_token_id=2)
    model = tf.LlamaForCausalLM(config).eval()
    model.save_pretrained(folder)
    words = ["<pad>", "<s>", "</s>"] + [f"w{k}" for k in range(config.vocab_size - 3)]
    core = Tokenizer(models.WordLevel({w: k for k, w in enumerate(words)}, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tf.PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                               unk_token="<pad>").save_pretrained(folder)
    return model


def rate(generate, new: int) -> tuple[float, list[int]]:
    """(decode tokens/s, the tokens of the longer run) of `generate(n) -> tokens`, timed on the wall."""
    import torch

    def timed(n: int) -> tuple[float, list[int]]:
        best, tokens = float("inf"), []
        for _ in range(3):
            torch.cuda.synchronize()
            started = time.perf_counter()
            tokens = generate(n)
            torch.cuda.synchronize()
            best = min(best, time.perf_counter() - started)
        return best, tokens

    generate(new)   # warm: kernels, CUDA graphs, torch.compile
    one, _ = timed(1)
    full, tokens = timed(new)
    return (new - 1) / (full - one), tokens


def transformers_side(folder: Path, new: int, compiled: bool) -> tuple[float, list[int]]:
    """(decode tokens/s, tokens) of transformers' generate over the checkpoint in `folder` (run in a
    process of its own: torch.compile's caches and CUDA graphs start empty, whatever ran before)."""
    import torch
    import transformers as tf

    model = tf.LlamaForCausalLM.from_pretrained(folder, dtype=torch.float16).cuda().eval()
    options = {"do_sample": False, "eos_token_id": None, "pad_token_id": 0}
    if compiled:   # generate compiles its one-token step itself over a static cache
        options.update(cache_implementation="static", compile_config=tf.CompileConfig(fullgraph=True,
                                                                                       mode="reduce-overhead"))
    ids = torch.tensor([PROMPT], device="cuda")

    def generate(n: int) -> list[int]:
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, **options)
        return out[0, len(PROMPT):].tolist()
    return rate(generate, new)


def main() -> None:
    import torch

    from shard.compilation.generative import compile_generative
    from shard.options import CompileOptions
    from shard.probes.cuda import probe_cuda
    from shard.runtime.generate import GenerativeSession

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--capacity", type=int, default=512)
    parser.add_argument("--chunk", type=int, default=64)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--also-stages", type=lambda text: [int(k) for k in text.split(",")], default=[],
                        help="also compile the steps cut into these many stages (comma-separated), their cache "
                             "written by the host")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="shard-decode-gpu-") as tmp:   # its bundles and models: hundreds of MB
        work = Path(tmp)
        checkpoint(work / "model", args.layers)
        probe_cuda().save(work / "cuda.profile.json")   # this GPU's rates and bandwidth, as `shard probe --target cuda`
        rates = {}
        for stages in sorted({1, *args.also_stages}):
            started = time.perf_counter()
            result = compile_generative(work / "model", "cuda", work / f"lm{stages}.shard", CompileOptions(
                profile=str(work / "cuda.profile.json"), shards=stages), capacity=args.capacity, chunk=args.chunk)
            print(f"GPU: {torch.cuda.get_device_name()}; compiled for cuda in {time.perf_counter() - started:.0f} s: "
                  f"{', '.join(f'{p.name} ({p.width} tokens)' for p in result.spec.programs)}, {stages} stage(s) each",
                  flush=True)
            for in_place in (True, False) if stages == 1 else (False,):
                with GenerativeSession(result.bundle, in_place=in_place, backend="cuda") as session:
                    tps, tokens = rate(lambda n: session.generate(PROMPT, max_new_tokens=n, stop=set()).tokens, args.new)
                    steps = session.generate(PROMPT, max_new_tokens=args.new, stop=set()).decode_ms
                    device = 1e3 * sum(stage_seconds(session.sessions[1, args.capacity]).values())
                    written = len(session.sessions[1, args.capacity].written)
                rates[stages, in_place] = tps, tokens
                print(f"ours, {stages} stage(s), {written:2d} cache entries written in the step's graph: {tps:7.1f} "
                      f"tokens/s; a decode step {sorted(steps)[len(steps) // 2]:.2f} ms (median, host to host), its CUDA "
                      f"graphs {device:.2f} ms of it on the GPU", flush=True)
        ours, ours_tokens = rates[1, True]
        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
            eager, eager_tokens = pool.submit(transformers_side, work / "model", args.new, False).result()
        print(f"transformers, eager:      {eager:7.1f} tokens/s", flush=True)
        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
            compiled, _ = pool.submit(transformers_side, work / "model", args.new, True).result()
        print(f"transformers, compiled:   {compiled:7.1f} tokens/s (static cache, torch.compile reduce-overhead)",
              flush=True)
        same = next((k for k, (a, b) in enumerate(zip(ours_tokens, eager_tokens)) if a != b), len(ours_tokens))
        print(f"RESULT layers={args.layers} capacity={args.capacity} ours_tps={ours:.1f} eager_tps={eager:.1f} "
              f"compiled_tps={compiled:.1f} vs_eager={ours / eager:.3f} vs_compiled={ours / compiled:.3f} "
              f"same_tokens={same}/{args.new}")


if __name__ == "__main__":
    main()
