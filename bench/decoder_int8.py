"""Would int8 decode steps keep SmolLM2-135M-Instruct's tokens? The decoder in torch with its linears as
the vendor's int8 computes them (shard.precision.int8_replica's arithmetic: weights per output channel,
symmetric; each linear's input and output per tensor, asymmetric uint8, in ranges calibrated once), the
prompt's cache made in fp32 (the prefill step stays fp16) and only the decode steps in int8, against
transformers fp32 on bench/decoder.py's 8 chat prompts: the first 32 greedy tokens, and teacher-forced
top-1 over the reference's own answers.

    python bench/decoder_int8.py                          # every linear int8
    python bench/decoder_int8.py --keep down_proj,lm_head # those linears left in fp32
    python bench/decoder_int8.py --only q_proj            # only those int8
    python bench/decoder_int8.py --parts w                # only the weights rounded (w, in, out)
    python bench/decoder_int8.py --per-token              # each token scaled to [-1, 1] before its linears

The ranges come from 8 other chat prompts' answers, decode tokens only (the prompt's first token holds
the activations past any shared range, and the prefill step does not run in int8 here).
Ends with: RESULT int8_linears=... same_tokens=... top1=... forced_steps=...
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from decoder import CHAT  # noqa: E402
from trained import smollm2_file, smollm2_model  # noqa: E402

from shard.precision import per_channel_int8, uint8_range  # noqa: E402

CALIBRATION = ["Write a short poem about the sea.", "How do I boil an egg?", "Explain what a computer is.",
               "List three colours.", "What is the weather like on Mars?", "Tell me a joke about cats.",
               "Why do birds migrate?", "Translate 'good morning' into French."]


class Int8Linear(torch.nn.Module):
    """A linear as the vendor's int8 runs it, once its ranges are observed (mode "observe", then "int8";
    "fp32" is the linear itself)."""

    def __init__(self, linear: torch.nn.Linear, parts: set[str], per_token: bool):
        super().__init__()
        self.linear, self.parts, self.per_token, self.mode = linear, parts, per_token, "fp32"
        self.low, self.high = {"in": 0.0, "out": 0.0}, {"in": 0.0, "out": 0.0}
        w = linear.weight.detach()   # [out, in]: a scale per row
        self.weight = torch.from_numpy(per_channel_int8(w.numpy(), 0)) if "w" in parts else w

    def quantized(self, x: torch.Tensor, where: str) -> torch.Tensor:
        if where not in self.parts:
            return x
        scale, zero = (float(v) for v in uint8_range(self.low[where], self.high[where]))
        return (torch.clamp(torch.round(x / scale) + zero, 0, 255) - zero) * scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.mode == "fp32":
            return self.linear(x)
        peak = x.abs().amax(-1, keepdim=True).clamp_min(1e-6) if self.per_token else None
        x = x if peak is None else x / peak
        if self.mode == "observe":
            y = self.linear(x)
            for where, t in (("in", x), ("out", y)):
                self.low[where], self.high[where] = min(self.low[where], t.min().item()), max(self.high[where], t.max().item())
        else:
            y = self.quantized(torch.nn.functional.linear(self.quantized(x, "in"), self.weight, self.linear.bias), "out")
        return y if peak is None else y * peak


def main() -> None:
    import transformers as tf

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--keep", default="", help="linears left in fp32: parts of their names, comma-separated")
    ap.add_argument("--only", default="", help="only these linears int8: parts of their names, comma-separated")
    ap.add_argument("--parts", default="w,in,out", help="what is quantized: w (weights), in, out (activations)")
    ap.add_argument("--per-token", action="store_true", help="each token scaled to [-1, 1] before a linear")
    ap.add_argument("--forced", type=int, default=128, help="teacher-forced decode steps per prompt, at most")
    args = ap.parse_args()
    keep, only = [k for k in args.keep.split(",") if k], [k for k in args.only.split(",") if k]
    gguf = smollm2_file()
    tokenizer = tf.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    reference = smollm2_model().eval()
    model = copy.deepcopy(reference)
    linears = []
    for parent_name, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            full = f"{parent_name}.{name}".lstrip(".")
            if isinstance(child, torch.nn.Linear) and not any(k in full for k in keep) \
                    and (not only or any(o in full for o in only)):
                linears.append(Int8Linear(child, set(args.parts.split(",")), args.per_token))
                setattr(parent, name, linears[-1])

    def mode(m: str) -> None:
        for linear in linears:
            linear.mode = m

    def chat(prompt: str) -> list[int]:
        return tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=True,
                                             add_generation_prompt=True, return_dict=False)

    def decode_logits(ids: list[int], fed: list[int], m: str) -> torch.Tensor:
        """The logits of the decode steps fed ids[-1], then `fed`, over the prompt's cache made in fp32."""
        cache = tf.DynamicCache()
        mode("fp32")
        model(torch.tensor([ids[:-1]]), past_key_values=cache, use_cache=True)
        mode(m)
        logits = model(torch.tensor([[ids[-1], *fed]]), past_key_values=cache, use_cache=True).logits[0]
        mode("fp32")
        return logits

    def greedy(ids: list[int], count: int) -> list[int]:
        out: list[int] = []
        while len(out) < count and (not out or out[-1] != tokenizer.eos_token_id):
            out.append(int(decode_logits(ids, out, "int8")[-1].argmax()))
        return out

    def answer(ids: list[int], count: int) -> list[int]:
        return reference.generate(torch.tensor([ids]), max_new_tokens=count, do_sample=False)[0, len(ids):].tolist()

    with torch.no_grad():
        for prompt in CALIBRATION:
            ids = chat(prompt)
            decode_logits(ids, answer(ids, 48), "observe")
        same, hits, steps = 0, 0, 0
        for prompt in CHAT:
            ids = chat(prompt)
            theirs = answer(ids, args.forced)
            want, got = decode_logits(ids, theirs[:-1], "fp32"), decode_logits(ids, theirs[:-1], "int8")
            top1 = (want.argmax(-1) == got.argmax(-1)).float()
            ours = greedy(ids, 32)
            same += ours == theirs[:32]
            hits, steps = hits + int(top1.sum()), steps + len(top1)
            parting = next((k for k, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
            print(f"{prompt!r}: {'same' if ours == theirs[:32] else f'parts at token {parting}'}; "
                  f"top-1 {top1.mean():.4f} over {len(top1)} steps", flush=True)
    print(f"RESULT int8_linears={len(linears)} same_tokens={same} top1={hits / steps:.4f} forced_steps={steps}")


if __name__ == "__main__":
    main()
