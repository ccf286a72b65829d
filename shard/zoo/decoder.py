"""A causal LM's decoder as fixed-shape steps over a static KV cache: the form a generative bundle
takes (the peers' design, FACTS-generative). One step reads T new tokens (T: the prefill chunk, or 1
to decode) beside a cache of fixed capacity C, and writes only the new tokens' keys and values; the
caller puts them in place (shard.runtime.generate). Positions and the mask are inputs: nothing in
the graph grows with the context, so one static-shape build serves every step.

    input_ids [1, T] int64, position_ids [1, T] int64, mask [1, 1, T, C + T] float32 (0: seen),
    past_key.i, past_value.i [1, kv_heads, C, head_dim] per layer
        -> logits [1, T, vocab], key.i, value.i [1, kv_heads, T, head_dim] per layer

For the Llama family in transformers (Llama, SmolLM2, Mistral, Qwen2: pre-norm layers, rotary
positions, grouped-query attention); eager attention, written out so every op is in the graph.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb, repeat_kv


class CachedStep(torch.nn.Module):
    """T new tokens against a cache of capacity C; the model's own weights and modules."""

    def __init__(self, model):
        super().__init__()
        self.model = model
        config = model.config
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads

    def forward(self, input_ids, position_ids, mask, *cache):
        body = self.model.model
        hidden = body.embed_tokens(input_ids)
        cos, sin = body.rotary_emb(hidden, position_ids)
        new = []
        for i, layer in enumerate(body.layers):
            attended, key, value = self.attend(layer.self_attn, layer.input_layernorm(hidden), cos, sin, mask,
                                               cache[2 * i], cache[2 * i + 1])
            new += [key, value]
            hidden = hidden + attended
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        return (self.model.lm_head(body.norm(hidden)), *new)

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


def step_names(layers: int) -> tuple[list[str], list[str]]:
    """The step's input and output names, in order."""
    cache = [f"{kind}.{i}" for i in range(layers) for kind in ("key", "value")]
    return (["input_ids", "position_ids", "mask", *(f"past_{name}" for name in cache)], ["logits", *cache])


def export_step(model, path: Path, steps: int, capacity: int, opset: int = 17) -> Path:
    """Write the step of `steps` new tokens over a cache of `capacity` as ONNX (weights in the file, or
    beside it past protobuf's 2 GiB)."""
    step = CachedStep(model).eval()
    config = model.config
    inputs, outputs = step_names(config.num_hidden_layers)
    cache = [torch.zeros(1, step.kv_heads, capacity, step.head_dim) for _ in range(2 * config.num_hidden_layers)]
    args = (torch.zeros(1, steps, dtype=torch.int64), torch.arange(steps)[None], torch.zeros(1, 1, steps, capacity + steps),
            *cache)
    with torch.no_grad():
        torch.onnx.export(step, args, str(path), opset_version=opset, dynamo=False, input_names=inputs,
                          output_names=outputs)
    return path
