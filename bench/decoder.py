"""SmolLM2-135M-Instruct (trained, from the index) as fixed-shape steps over a static KV cache
(shard.zoo.decoder): greedy tokens of the chat prompts from the prefill and decode steps in
onnxruntime fp32, beside transformers' own greedy generate, and the teacher-forced logits of each
prompt and its answer beside one full forward.

    python bench/decoder.py [--chunk 16] [--capacity 128] [--new 32]

Ends with: RESULT prompts=... same_tokens=... min_cosine=... max_abs_diff=...
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from trained import PROMPTS, smollm2_file, smollm2_model  # noqa: E402


def main() -> None:
    import onnxruntime as ort
    import torch
    import transformers as tf

    from shard.compare import compare
    from shard.runtime.generate import Cache, generate, prefill
    from shard.zoo.decoder import export_step, step_names

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chunk", type=int, default=16, help="the prefill step's width")
    ap.add_argument("--capacity", type=int, default=128, help="the KV cache's capacity")
    ap.add_argument("--new", type=int, default=32, help="tokens to generate per prompt")
    args = ap.parse_args()
    gguf = smollm2_file()
    tokenizer = tf.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = smollm2_model()
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    names = step_names(config.num_hidden_layers)[1]
    with tempfile.TemporaryDirectory() as tmp:
        started = time.perf_counter()
        sessions = {w: ort.InferenceSession(str(export_step(model, Path(tmp) / f"step{w}.onnx", w, args.capacity)))
                    for w in (args.chunk, 1)}
        print(f"exported the {args.chunk}-token and 1-token steps in {time.perf_counter() - started:.1f} s")
        run = lambda feeds: dict(zip(names, sessions[feeds["input_ids"].shape[1]].run(None, feeds)))  # noqa: E731
        cache = lambda: Cache.empty(config.num_hidden_layers, config.num_key_value_heads, args.capacity, head_dim)  # noqa: E731
        same, cosines, diffs = 0, [], []
        for prompt in PROMPTS:
            text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                                 add_generation_prompt=True)
            ids = tokenizer(text)["input_ids"]
            ours = generate(run, ids, cache(), args.new, args.chunk)
            with torch.no_grad():
                theirs = model.generate(torch.tensor([ids]), max_new_tokens=args.new, min_new_tokens=args.new,
                                        do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
                want = model(torch.tensor([ids + theirs])).logits[0].numpy()
            got = prefill(run, cache(), ids + theirs, args.chunk)
            rows = [compare("logits", want[k], got[k]) for k in range(len(want))]
            same += ours == theirs
            cosines.append(min(r.cosine for r in rows))
            diffs.append(max(r.max_abs_diff for r in rows))
            print(f"{prompt!r}: {len(ids)} prompt tokens; {'same' if ours == theirs else 'DIFFERENT'} "
                  f"{args.new} tokens {tokenizer.decode(ours)!r}; teacher-forced logits over {len(want)} "
                  f"positions: worst cosine {cosines[-1]:.7f}, max abs diff {diffs[-1]:.2e}")
    print(f"RESULT prompts={len(PROMPTS)} same_tokens={same} min_cosine={min(cosines):.7f} "
          f"max_abs_diff={max(diffs):.2e}")


if __name__ == "__main__":
    main()
