"""SmolVLM's architecture (Idefics3: SigLIP-512, a pixel-shuffle connector, the trained SmolLM2-135M-
Instruct decoder from the index; the vision tower and connector seeded, shard.zoo.vlm) as a generative
bundle, beside transformers fp32: the first greedy tokens for 4 images x 2 chat prompts, run one by
one and again with each next image seen by the vision program while the one before decodes; and the
teacher-forced logits of each answer (the reference's tokens fed back) against the reference's.
With --tiles N the folder's processor splits each image as SmolVLM's does (up to N x N squares of 512
and the whole image shrunk to one more: at N = 2 these pictures are 5 squares, 320 image tokens).

    python bench/vlm.py --folder smolvlm [--tiles 2]          # build the model folder (once)
    shard compile smolvlm --target rk3588 -o vlm.shard
    python bench/vlm.py --folder smolvlm --bundle vlm.shard --backend sim

Ends with: RESULT images=... prompts=... same_tokens=... of ... fp16_ties=... forced_steps=... top1=...
           min_cosine=... overlap_speedup=... squares_stream_speedup=...
(squares_stream_speedup: each image's squares through the vision program as a stream of frames over
the cores, as the session runs them, against one at a time; on the simulator, one process, the cores
take turns, so about 1)
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from trained import smollm2_file  # noqa: E402

PROMPTS = ["Describe the image.", "What colors are in this picture?"]


def images(folder: Path) -> list[Path]:
    """Four seeded pictures of different kinds and sizes: a gradient, stripes, disks, noise."""
    from PIL import Image

    rng = np.random.default_rng(0)
    y, x = np.mgrid[0:384, 0:512] / 512.0
    gradient = np.stack([x, y, 1 - x], -1)
    stripes = np.stack([(np.sin(40 * x) > 0) * 0.9, 0.3 + 0 * x, (np.cos(25 * y) > 0) * 0.8], -1)
    disks = np.zeros((384, 512, 3))
    for cx, cy, r, color in ((150, 200, 90, (1, 0.2, 0.1)), (360, 150, 70, (0.1, 0.6, 1)), (300, 300, 50, (1, 1, 0))):
        disks[(x * 512 - cx) ** 2 + (y * 512 - cy) ** 2 < r ** 2] = color
    noise = rng.uniform(0, 1, (300, 300, 3))
    paths = []
    for name, array in (("gradient", gradient), ("stripes", stripes), ("disks", disks), ("noise", noise)):
        paths.append(folder / f"{name}.png")
        Image.fromarray((255 * np.clip(array, 0, 1)).astype(np.uint8)).save(paths[-1])
    return paths


def main() -> None:
    import torch
    from PIL import Image

    from shard.compare import compare, lowest
    from shard.runtime.generate import GenerativeSession
    from shard.verifier import parting
    from shard.zoo.decoder import load_causal_lm
    from shard.zoo.vlm import build_smolvlm

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--folder", type=Path, required=True, help="the model folder (built here if absent)")
    ap.add_argument("--bundle", type=Path, help="its generative bundle (shard compile FOLDER)")
    ap.add_argument("--backend", help="the bundle's backend [default: its target's first]")
    ap.add_argument("--new", type=int, default=32, help="greedy tokens to compare")
    ap.add_argument("--tiles", type=int, default=1, help="when building the folder: squares an image is split "
                                                         "into along its longer edge, at most (1: not split)")
    args = ap.parse_args()
    if not (args.folder / "config.json").is_file():
        build_smolvlm(smollm2_file(), args.folder, tiles=args.tiles)
        print(f"built {args.folder}")
    if not args.bundle:
        return
    model, processor = load_causal_lm(args.folder)
    with tempfile.TemporaryDirectory() as tmp, GenerativeSession(args.bundle, backend=args.backend) as session:
        requests = [{"prompt": prompt, "images": [image]} for image in images(Path(tmp)) for prompt in PROMPTS]
        session.generate(**requests[0], max_new_tokens=2, chat=True)   # every program run once before timing
        started = time.perf_counter()
        outs = [session.generate(**r, max_new_tokens=args.new, chat=True, stop=set()) for r in requests]
        one_by_one = time.perf_counter() - started
        started = time.perf_counter()   # again, each next image seen while the one before decodes
        overlapped = list(session.generate_each(requests, max_new_tokens=args.new, chat=True, stop=set()))
        ahead = time.perf_counter() - started
        looks = [vision_times(session, session.prompts.encode(PROMPTS[0], True, r["images"])[1]) for r in requests[::2]]
        same, ties, agree, cosines = 0, 0, [], []
        for request, out, again in zip(requests, outs, overlapped):
            image, prompt = request["images"][0], request["prompt"]
            content = [{"type": "image"}, {"type": "text", "text": prompt}]
            text = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
            encoded = processor(text=text, images=[[Image.open(image).convert("RGB")]], return_tensors="pt")
            with torch.no_grad():
                theirs = model.generate(**encoded, max_new_tokens=args.new, min_new_tokens=args.new, do_sample=False,
                                        eos_token_id=None, pad_token_id=0)[0, encoded["input_ids"].shape[1]:].tolist()
                ids = encoded["input_ids"][0].tolist() + theirs
                want = model(input_ids=torch.tensor([ids]), pixel_values=encoded["pixel_values"],
                             pixel_attention_mask=encoded["pixel_attention_mask"]).logits[0, len(out.prompt) - 1:].numpy()
            got = session.logits(ids, session.prompts.encode(prompt, True, [image])[1], len(out.prompt) - 1)   # teacher-forced
            agree += [int(np.argmax(g) == np.argmax(w)) for g, w in zip(got, want)]
            cosines += [compare("logits", w, g).cosine for g, w in zip(got, want)]
            same += out.tokens == theirs == again.tokens
            note = "same" if out.tokens == theirs == again.tokens else "DIFFERENT"
            parted = parting(out.tokens, theirs, want)
            ties += bool(parted and parted.fp16_tie)
            note += f" {parted}" if parted else ""
            times = out.to_json()
            print(f"{image.stem} / {prompt!r}: {len(out.prompt)} prompt tokens; {note}; {args.new} tokens "
                  f"{out.text!r}; image {sum(times['vision_ms']):.0f} ms ({len(times['vision_ms'])} squares), "
                  f"prefill {sum(times['prefill_ms']):.0f} ms, decode {times['decode_tokens_per_s']} tokens/s "
                  f"({session.backend})", flush=True)
    print(f"{len(requests)} requests on {session.backend}: {one_by_one:.1f} s one by one, {ahead:.1f} s with each next "
          f"image seen while the one before decodes ({one_by_one / ahead:.2f}x)")
    alone, streamed = (sum(t[k] for t in looks) for k in (0, 1))
    print(f"vision of {sum(t[2] for t in looks)} squares (4 images): {alone:.1f} s a square at a time, {streamed:.1f} s "
          f"as a stream over the cores ({alone / streamed:.2f}x)")
    print(f"RESULT images=4 prompts={len(PROMPTS)} same_tokens={same} of {len(requests)} fp16_ties={ties} "
          f"forced_steps={len(agree)} top1={np.mean(agree):.4f} min_cosine={lowest(cosines):.7f} "
          f"overlap_speedup={one_by_one / ahead:.2f} squares_stream_speedup={alone / streamed:.2f}")


def vision_times(session, pixels: np.ndarray) -> tuple[float, float, int]:
    """An image's squares through the vision program one at a time, then as the session streams them
    (seconds each way, alternated twice, the best of each), and the square count; the same features."""
    best = [float("inf"), float("inf")]
    for _ in range(2):
        started = time.perf_counter()
        alone = [session.vision.run({"pixel_values": square[None]})["image_features"][0] for square in pixels]
        best[0] = min(best[0], time.perf_counter() - started)
        started = time.perf_counter()
        streamed = session.look(pixels).features
        best[1] = min(best[1], time.perf_counter() - started)
        assert all(np.array_equal(a, b) for a, b in zip(alone, streamed)), "streamed squares differ"
    return best[0], best[1], len(pixels)

if __name__ == "__main__":
    main()
