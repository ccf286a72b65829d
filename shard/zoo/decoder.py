"""A causal LM's decoder as fixed-shape steps over a static KV cache: the form a generative bundle
takes (the peers' design, FACTS-generative). One step reads T new tokens (T: the prefill chunk, or 1
to decode) beside a cache of fixed capacity C, and writes only the new tokens' keys and values; the
caller puts them in place (shard.runtime.generate). Positions and the mask are inputs: nothing in
the graph grows with the context, so one static-shape build serves every step.

    inputs_embeds [1, T, hidden] float32, position_ids [1, T] int64, mask [1, 1, T, C + T] float32
    (0: seen), past_key.i, past_value.i [1, kv_heads, C, head_dim] per layer
        -> logits [1, T, vocab], key.i, value.i [1, kv_heads, T, head_dim] per layer

The token embeddings come in, looked up on the host (embedding_table): one table for every step,
and the place a VLM puts its image features. For the Llama family in transformers (Llama, SmolLM2,
Mistral, Qwen2: pre-norm layers, rotary positions, grouped-query attention) and Idefics3 (SmolVLM:
such a decoder after a SigLIP vision tower and a pixel-shuffle connector, VisionStep); eager
attention, written out so every op is in the graph.
"""

from __future__ import annotations

import math

import hashlib
from pathlib import Path

import numpy as np
import torch
import transformers as tf
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb, repeat_kv

from shard.errors import ShardError
from shard.runtime.generate import PICK, step_feeds, step_mask

# Pre-norm layers, rotary positions, q/k/v/o projections and a gated MLP: what CachedStep writes out.
FAMILY = ("llama", "mistral", "qwen2")
VLM = ("idefics3",)   # a decoder of the family after a vision tower


def load_causal_lm(source: Path):
    """(model, tokenizer) of a GGUF file (dequantized to float32) or a transformers folder, eager
    attention; of an Idefics3 folder (model, processor); ShardError for any other model, and for a
    checkpoint missing a tensor its architecture needs (transformers fills one with random values).
    Read from the disk alone: never the Hub, never a checkpoint's own code."""
    gguf = {"gguf_file": source.name} if source.suffix == ".gguf" else {}
    folder = source.parent if gguf else source
    local = {"local_files_only": True, "trust_remote_code": False}
    try:
        config = tf.AutoConfig.from_pretrained(folder, **gguf, **local)
        tokenizer = tf.AutoTokenizer.from_pretrained(folder, **gguf, **local)
    except Exception as exc:  # noqa: BLE001 - transformers and its readers raise many kinds for a file it cannot read
        raise ShardError(f"{source}: not a model transformers reads ({first_line(exc)})") from None
    if config.model_type not in FAMILY and config.model_type not in VLM or config.model_type in VLM and gguf:
        raise ShardError(f"{source}: a {config.model_type} model; shard compiles decoders of the Llama family "
                         f"({', '.join(FAMILY)}) and VLMs built on them ({', '.join(VLM)})")
    if not gguf:
        kind = tf.AutoModelForImageTextToText if config.model_type in VLM else tf.AutoModelForCausalLM
        try:
            model, info = kind.from_pretrained(folder, attn_implementation="eager", dtype=torch.float32,
                                               output_loading_info=True, **local)
        except Exception as exc:  # noqa: BLE001 - as above
            raise ShardError(f"{source}: not a checkpoint transformers reads ({first_line(exc)})") from None
        check_complete(source, model, info["missing_keys"], info["unexpected_keys"],
                       [str(k[0]) if isinstance(k, tuple) else str(k) for k in info.get("mismatched_keys", ())])
        if config.model_type in VLM:
            return model.eval(), tf.AutoProcessor.from_pretrained(folder, **local)
        return model.eval(), tokenizer
    # from_pretrained(gguf_file=...) asks for accelerate; the checkpoint reader alone does not.
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    try:
        model = tf.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
        weights = load_gguf_checkpoint(str(source), return_tensors=True, model_to_load=model)["tensors"]
        loaded = model.load_state_dict({k: torch.as_tensor(v) for k, v in weights.items()}, strict=False)
    except RuntimeError as exc:   # a tensor of another shape than the config implies
        raise ShardError(f"{source}: a tensor does not fit the architecture its metadata describes "
                         f"({' '.join(str(exc).split())[:300]})") from None
    except Exception as exc:  # noqa: BLE001 - as above (a truncated file, heads that do not divide the width)
        raise ShardError(f"{source}: not a checkpoint transformers reads ({first_line(exc)})") from None
    check_complete(source, model, loaded.missing_keys, loaded.unexpected_keys, [])
    model.tie_weights()
    return model, tokenizer


def first_line(exc: BaseException) -> str:
    """An exception's message in one line: its last non-empty line (a validator's reason comes last)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[-1][:300] if lines else type(exc).__name__


def check_complete(source: Path, model, missing, unexpected, mismatched: list[str]) -> None:
    """One line where the checkpoint lacks a tensor the architecture needs (one it ties to another,
    the LM head to the embeddings, excepted), holds one it has no place for, or one of another shape."""
    tied = set(getattr(model, "_tied_weights_keys", None) or ())
    missing = sorted(set(missing) - tied)
    for what, names in (("lacks", missing), ("holds tensors its architecture has no place for:", sorted(unexpected)),
                        ("holds tensors of other shapes than its config implies:", sorted(mismatched))):
        if names:
            detail = f"{len(names)} of the tensors its architecture needs, first {names[0]}" if what == "lacks" \
                else f"{len(names)}, first {names[0]}"
            raise ShardError(f"{source}: an incomplete checkpoint: it {what} {detail}; nothing is compiled "
                             f"(transformers would fill a missing one with random values)")


def checkpoint_record(source: Path) -> dict:
    """The checkpoint's name and the sha256 of its weights (a GGUF file, or a folder's files)."""
    files = [source] if source.is_file() else sorted(p for p in source.rglob("*") if p.is_file())
    digest = hashlib.sha256()
    for path in files:
        digest.update(path.relative_to(source.parent if source.is_file() else source).as_posix().encode())
        with open(path, "rb") as f:
            while block := f.read(1 << 22):
                digest.update(block)
    return {"name": source.name, "sha256": digest.hexdigest()}


def text_parts(model):
    """(the decoder's body, its LM head, its config): of a causal LM, or of a VLM's text model."""
    if model.config.model_type in VLM:
        return model.model.text_model, model.lm_head, model.config.text_config
    return model.model, model.lm_head, model.config


def embedding_table(model) -> np.ndarray:
    """The token embeddings, [vocab, hidden] float32: what the host looks a step's tokens up in."""
    return text_parts(model)[0].embed_tokens.weight.detach().float().numpy()


def stop_ids(model, tokenizer) -> list[int]:
    """The tokens that end an answer: the tokenizer's end of sequence and the model's own."""
    tokenizer = getattr(tokenizer, "tokenizer", tokenizer)   # a processor's
    ids = {tokenizer.eos_token_id}
    for source in (model.config, getattr(model, "generation_config", None)):
        found = getattr(source, "eos_token_id", None)
        ids.update(found if isinstance(found, list) else [found])
    return sorted(i for i in ids if i is not None)


class CachedStep(torch.nn.Module):
    """T new tokens against a cache of capacity C; the model's own weights and modules."""

    def __init__(self, model, pick: bool = False):
        super().__init__()
        self.body, self.head, config = text_parts(model)
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.pick = pick   # a step of several tokens: a `pick` input [1, 1, T] chooses the row the head reads

    def forward(self, inputs_embeds, position_ids, mask, *rest):
        pick, cache = (rest[0], rest[1:]) if self.pick else (None, rest)
        body, hidden = self.body, inputs_embeds
        cos, sin = body.rotary_emb(hidden, position_ids)
        new = []
        lost = torch.zeros_like(hidden)
        for i, layer in enumerate(body.layers):
            attended, key, value = self.attend(layer.self_attn, layer.input_layernorm(hidden), cos, sin, mask,
                                               cache[2 * i], cache[2 * i + 1])
            new += [key, value]
            hidden, lost = compensated(hidden, lost, attended)
            hidden, lost = compensated(hidden, lost, layer.mlp(layer.post_attention_layernorm(hidden)))
        hidden = body.norm(hidden)
        return (self.head(hidden if pick is None else torch.matmul(pick, hidden)), *new)

    def attend(self, attn, x, cos, sin, mask, past_key, past_value):
        """One layer's attention over the cache and the new tokens; with the new tokens' key and value."""
        steps = x.shape[1]
        q = attn.q_proj(x).view(1, steps, self.heads, self.head_dim).transpose(1, 2)
        k = attn.k_proj(x).view(1, steps, self.kv_heads, self.head_dim).transpose(1, 2)
        v = attn.v_proj(x).view(1, steps, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        groups = self.heads // self.kv_heads
        keys = repeat_kv(torch.cat([past_key, k], dim=2), groups)
        values = repeat_kv(torch.cat([past_value, v], dim=2), groups)
        scores = torch.matmul(q, keys.transpose(2, 3)) * self.head_dim ** -0.5 + mask
        out = torch.matmul(torch.softmax(scores, dim=-1), values)
        return attn.o_proj(out.transpose(1, 2).reshape(1, steps, self.heads * self.head_dim)), k, v


def compensated(total, lost, value):
    """total + value with the rounding error carried (Kahan): (the new total, what it lost). The
    residual stream of a decoder in fp16 rounds at each of its 2 x layers sums; carried, the VLM's
    logits came 16 % nearer fp32 on average, twice as near at the worst step (docs/DESIGN.md)."""
    y = value - lost
    t = total + y
    return t, (t - total) - y


def step_names(layers: int, steps: int = 1) -> tuple[list[str], list[str]]:
    """The step's input and output names, in order (a step of several tokens takes PICK)."""
    cache = [f"{kind}.{i}" for i in range(layers) for kind in ("key", "value")]
    return (["inputs_embeds", "position_ids", "mask", *[PICK] * (steps > 1), *(f"past_{name}" for name in cache)],
            ["logits", *cache])


def export_step(model, path: Path, steps: int, capacity: int, opset: int = 17) -> Path:
    """Write the step of `steps` new tokens over a cache of `capacity` as ONNX (weights in the file, or
    beside it past protobuf's 2 GiB): logits [1, 1, vocab], the picked token's."""
    step = CachedStep(model, pick=steps > 1).eval()
    config = text_parts(model)[2]
    inputs, outputs = step_names(config.num_hidden_layers, steps)
    cache = [torch.zeros(1, step.kv_heads, capacity, step.head_dim) for _ in range(2 * config.num_hidden_layers)]
    pick = [torch.zeros(1, 1, steps)] if steps > 1 else []
    args = (torch.zeros(1, steps, config.hidden_size), torch.arange(steps)[None],
            torch.zeros(1, 1, steps, capacity + steps), *pick, *cache)
    with torch.no_grad():
        torch.onnx.export(step, args, str(path), opset_version=opset, dynamo=False, input_names=inputs,
                          output_names=outputs)
    return path


class VisionStep(torch.nn.Module):
    """A VLM's image into the decoder's embedding space: pixel_values [1, 3, S, S] -> image_features
    [1, tokens, hidden] (Idefics3: SigLIP, its positions those of a whole image, then the connector's
    pixel shuffle and projection)."""

    def __init__(self, model):
        super().__init__()
        self.vision, self.connector = model.model.vision_model, model.model.connector

    def forward(self, pixel_values):
        embeddings = self.vision.embeddings
        patches = embeddings.patch_embedding(pixel_values).flatten(2).transpose(1, 2)
        hidden = self.vision.encoder(inputs_embeds=patches + embeddings.position_embedding.weight[None]).last_hidden_state
        return self.connector(self.vision.post_layernorm(hidden))


def export_vision(model, path: Path, opset: int = 17) -> Path:
    size = model.config.vision_config.image_size
    with torch.no_grad():
        torch.onnx.export(VisionStep(model).eval(), (torch.zeros(1, 3, size, size),), str(path), opset_version=opset,
                          dynamo=False, input_names=["pixel_values"], output_names=["image_features"])
    return path


def image_room(processor) -> dict[str, int]:
    """How much of the context an image takes at most: an Idefics3 processor that splits images cuts one
    into up to n x n squares of the vision tower's size (n: its longest edge over the square's), and
    adds the whole image shrunk to one more; each square is `image_seq_len` image tokens."""
    images = processor.image_processor
    side = math.ceil(images.size["longest_edge"] / images.max_image_size["longest_edge"]) \
        if images.do_image_splitting else 0
    squares = side * side + 1 if side > 1 else 1
    return {"squares": squares, "tokens": squares * processor.image_seq_len}


SAMPLE_PROMPT = "What is the capital of France? Answer in one sentence, then name two of its museums."


def step_samples(model, tokenizer, width: int, capacity: int, count: int = 2) -> dict[str, np.ndarray]:
    """prompt_samples of the checkpoint's step, the cache holding transformers' own keys and values."""
    step = CachedStep(model).eval()
    layers = len(step.body.layers)

    def cache_after(rows: np.ndarray) -> dict[str, np.ndarray]:
        cache = [torch.zeros(1, step.kv_heads, capacity, step.head_dim) for _ in range(2 * layers)]
        if len(rows):
            mask = torch.as_tensor(step_mask(0, len(rows), capacity))
            with torch.no_grad():
                written = step(torch.as_tensor(rows)[None], torch.arange(len(rows))[None], mask, *cache)[1:]
            for c, new in zip(cache, written):
                c[:, :, :len(rows)] = new
        return {f"past_{kind}.{i // 2}": c.numpy() for i, (kind, c) in enumerate(zip(["key", "value"] * layers, cache))}

    return prompt_samples(tokenizer, embedding_table(model), width, capacity, cache_after, count)


def prompt_samples(tokenizer, table: np.ndarray, width: int, capacity: int, cache_after,
                   count: int = 2, finish=lambda feeds: feeds) -> dict[str, np.ndarray]:
    """Inputs of the step of `width` over `capacity` as a real prompt gives them (shard.calibration's
    format: a leading sample axis), for the compile's fidelity check and calibration: the prompt's
    next tokens after its first 0, then more, tokens already in the cache (`cache_after(rows)`: the
    past_* feeds of a cache holding those tokens' embeddings; `finish`: the step's own form of a
    sample's feeds)."""
    tokenizer = getattr(tokenizer, "tokenizer", tokenizer)
    ids = tokenizer(SAMPLE_PROMPT)["input_ids"]
    ids = (ids * (-(-(capacity + width) // len(ids))))[:capacity + width]
    samples: dict[str, list] = {}
    for k in range(count):
        length = (capacity - width) * k // max(count - 1, 1) if capacity > width else 0
        feeds = finish({**step_feeds(table[ids[length:length + width]], length, width, capacity),
                        **cache_after(table[ids[:length]])})
        for name, value in feeds.items():
            samples.setdefault(name, []).append(value)
    return {name: np.stack(values) for name, values in samples.items()}
