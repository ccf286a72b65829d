"""SmolLM2-135M-Instruct (trained, from the index) as fixed-shape steps over a static KV cache, beside
transformers fp32: the first greedy tokens of 8 chat prompts, and teacher-forced logits (the prompt,
then transformers' own answer fed one token a step) against transformers' one full forward.

    python bench/decoder.py                                   # the steps in onnxruntime fp32
    python bench/decoder.py --bundle lm.shard --backend sim   # a generative bundle (shard compile of the GGUF)

Ends with: RESULT prompts=... same_tokens=... fp16_ties=... forced_steps=... top1=... min_cosine=... mean_cosine=...
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from trained import PROMPTS, smollm2_file, smollm2_model  # noqa: E402

# Two beyond the corpus's six (whose samples stay as they were).
CHAT = PROMPTS + ["Name a planet with rings.", "What is two plus three?"]


def onnxruntime_steps(model, folder: Path, chunk: int, capacity: int):
    """(run, new cache) of the model's steps in onnxruntime fp32."""
    import onnxruntime as ort

    from shard.runtime.generate import Cache
    from shard.zoo.decoder import export_step, step_names

    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    names = step_names(config.num_hidden_layers)[1]
    sessions = {w: ort.InferenceSession(str(export_step(model, folder / f"step{w}.onnx", w, capacity)))
                for w in (chunk, 1)}
    run = lambda feeds: dict(zip(names, sessions[feeds["inputs_embeds"].shape[1]].run(None, feeds)))  # noqa: E731
    return run, lambda: Cache.empty(config.num_hidden_layers, config.num_key_value_heads, capacity, head_dim)


SENTENCES = ["The lighthouse keeper logged every ship that passed the northern cape.",
             "In winter the harbour froze, and the ferries stopped until March.",
             "The village school had one classroom, a stove and a map of the world.",
             "Fishermen mended their nets on the pier while the gulls waited."]


def document(tokenizer, tokens: int) -> str:
    """Sentences in turn until about `tokens` tokens: a long context that reads as text."""
    text, k = "", 0
    while len(tokenizer(text)["input_ids"]) < tokens:
        text += ("" if not text else " ") + SENTENCES[k % len(SENTENCES)]
        k += 1
    return text


def main() -> None:
    import transformers as tf

    from shard.compare import lowest
    from shard.runtime.generate import GenerativeSession
    from shard.verifier import check_prompt
    from shard.zoo.decoder import embedding_table

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bundle", type=Path, help="a generative bundle of the GGUF [default: its steps in onnxruntime]")
    ap.add_argument("--backend", help="the bundle's backend [default: its target's first]")
    ap.add_argument("--chunk", type=int, default=16, help="onnxruntime: the prefill step's width")
    ap.add_argument("--capacity", type=int, default=256, help="onnxruntime: the KV cache's capacity")
    ap.add_argument("--new", type=int, default=32, help="greedy tokens to compare per prompt")
    ap.add_argument("--forced", type=int, default=16, help="teacher-forced decode steps per prompt")
    ap.add_argument("--prompts", type=int, default=len(CHAT), help="how many of the chat prompts")
    ap.add_argument("--document", type=int, default=0, help="put a document of about this many tokens before each "
                                                           "prompt (a long context)")
    args = ap.parse_args()
    gguf = smollm2_file()
    tokenizer = tf.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = smollm2_model()
    with tempfile.TemporaryDirectory() as tmp:
        if args.bundle:
            session = GenerativeSession(args.bundle, backend=args.backend)
            run, cache, chunk, decode = session.run, session.cache, session.spec.chunk, session.spec.decode_width
            where = f"{args.bundle} on {session.backend}"
        else:
            run, cache = onnxruntime_steps(model, Path(tmp), args.chunk, args.capacity)
            chunk, decode, where = args.chunk, 1, "the steps in onnxruntime fp32"
        table = embedding_table(model)
        checks, started = [], time.perf_counter()
        for prompt in CHAT[:args.prompts]:
            text = f"{document(tokenizer, args.document)}\n\n{prompt}" if args.document else prompt
            ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=True,
                                                add_generation_prompt=True, return_dict=False)
            checks.append(check_prompt(run, table, cache, chunk, model, ids, args.new, args.forced, decode))
            c = checks[-1]
            parted = f"DIFFERENT {c.parting}" if c.parting else "same"
            print(f"{prompt!r}: {len(ids)} prompt tokens; {parted}; {args.new} tokens "
                  f"{tokenizer.decode(c.tokens)!r}; {c.steps} teacher-forced steps: top-1 {c.top1:.4f}, worst cosine "
                  f"{c.min_cosine:.7f}", flush=True)
        if args.bundle:
            session.close()
    print(f"{where}: {time.perf_counter() - started:.0f} s")
    steps = sum(c.steps for c in checks)
    ties = sum(bool(c.parting and c.parting.fp16_tie) for c in checks)
    print(f"RESULT prompts={len(checks)} same_tokens={sum(c.same_tokens for c in checks)} fp16_ties={ties} "
          f"forced_steps={steps} "
          f"top1={sum(c.top1 * c.steps for c in checks) / steps:.4f} min_cosine={lowest(c.min_cosine for c in checks):.7f} "
          f"mean_cosine={sum(c.mean_cosine * c.steps for c in checks) / steps:.7f}")


if __name__ == "__main__":
    main()
