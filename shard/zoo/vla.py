"""A Pi0-shaped vision-language-action model, built offline from a config with seeded weights, as
Physical-Intelligence/openpi's PyTorch model (PI0Pytorch, models_pytorch/pi0_pytorch.py) computes it:
a SigLIP vision tower for each camera and a linear projection into a Gemma-2B-shaped prefix (the
images' features, then the prompt's token embeddings times sqrt(width)), whose keys and values are
computed once per observation; then an action expert (Gemma-300M-shaped, the prefix's heads and head
size) run `steps` Euler steps of flow matching against that cache. Its tokens, the suffix, are the
robot's state and the noisy action chunk with the timestep mixed in by an MLP; the state sees the
prefix and itself, each action the prefix, the state and every action. From t = 1 (noise) to 0:
x <- x - v(x, t) / steps.

Written out here rather than through openpi's patched transformers: Gemma's RMSNorm (times 1 + w),
rotary positions, one key and value head for all eight query heads, a GeGLU (tanh) MLP, no scaling of
the prefix by sqrt(width) inside the model (openpi's Gemma has it removed; the prompt's embeddings
carry it). The vision tower is transformers' own SiglipVisionModel.

Three programs, as a VLA bundle runs them (export_programs):

    vision(pixel_values [cameras, 3, S, S]) -> image_features [cameras, patches, width]
    prefix(prefix_embeds [1, P, width]) -> key.i, value.i [1, kv_heads, P, head_dim], each layer
    step(x_t [1, horizon, actions], time [1], state [1, actions], key.i, value.i) -> velocity
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn
from transformers import SiglipVisionConfig, SiglipVisionModel

from shard.runtime.vla import VLA, VlaSpec, cache_names, seeded_observation


@dataclass(frozen=True)
class Gemma:
    width: int
    depth: int
    mlp: int
    heads: int = 8
    kv_heads: int = 1
    head_dim: int = 256


@dataclass(frozen=True)
class VlaConfig:
    """Pi0's shapes (openpi: gemma_2b and gemma_300m, SigLIP-so400m/14 at 224, 3 cameras, 48 prompt
    tokens, 50 actions of 32)."""

    vision_width: int = 1152
    vision_layers: int = 27
    vision_heads: int = 16
    vision_mlp: int = 4304
    image_size: int = 224
    patch: int = 14
    prefix: Gemma = field(default_factory=lambda: Gemma(2048, 18, 16384))
    expert: Gemma = field(default_factory=lambda: Gemma(1024, 18, 4096))
    cameras: int = 3
    text_tokens: int = 48
    vocab: int = 257152
    actions: int = 32
    horizon: int = 50

    @property
    def patches(self) -> int:
        return (self.image_size // self.patch) ** 2

    @property
    def prefix_tokens(self) -> int:
        return self.cameras * self.patches + self.text_tokens


PI0 = VlaConfig()
# a few layers of every part, small: the CPU test's
FEW = VlaConfig(vision_width=64, vision_layers=2, vision_heads=4, vision_mlp=128, image_size=56,
                prefix=Gemma(64, 2, 128, heads=4, kv_heads=1, head_dim=16),
                expert=Gemma(32, 2, 64, heads=4, kv_heads=1, head_dim=16), cameras=2, text_tokens=8, vocab=97,
                horizon=10, actions=8)
CONFIGS = {"pi0": PI0, "pi0-few": FEW}


class RMSNorm(nn.Module):
    def __init__(self, width: int, eps: float = 1e-6):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.zeros(width)), eps

    def forward(self, x):
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.float())).type_as(x)


def rotary(positions: torch.Tensor, head_dim: int, theta: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [T, head_dim] of Gemma's rotary embedding at `positions`."""
    inverse = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = positions.float()[:, None] * inverse[None]
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def rotate(x, cos, sin):
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


class Layer(nn.Module):
    """A Gemma decoder layer, its attention over keys and values handed to it (the prefix's and its own);
    `sdpa`: that attention through torch's scaled_dot_product_attention (as_sdpa), the same function."""

    sdpa = False

    def __init__(self, g: Gemma):
        super().__init__()
        self.g = g
        self.norm1, self.norm2 = RMSNorm(g.width), RMSNorm(g.width)
        self.q = nn.Linear(g.width, g.heads * g.head_dim, bias=False)
        self.k = nn.Linear(g.width, g.kv_heads * g.head_dim, bias=False)
        self.v = nn.Linear(g.width, g.kv_heads * g.head_dim, bias=False)
        self.o = nn.Linear(g.heads * g.head_dim, g.width, bias=False)
        self.gate = nn.Linear(g.width, g.mlp, bias=False)
        self.up = nn.Linear(g.width, g.mlp, bias=False)
        self.down = nn.Linear(g.mlp, g.width, bias=False)

    def qkv(self, x, cos, sin):
        """q [B, heads, T, d], and this layer's own k and v [B, kv_heads, T, d], rotated to their positions."""
        b, t, _ = x.shape
        h = self.norm1(x)
        q = self.q(h).view(b, t, self.g.heads, self.g.head_dim).transpose(1, 2)
        k = self.k(h).view(b, t, self.g.kv_heads, self.g.head_dim).transpose(1, 2)
        v = self.v(h).view(b, t, self.g.kv_heads, self.g.head_dim).transpose(1, 2)
        return rotate(q, cos, sin), rotate(k, cos, sin), v

    def finish(self, x, q, k, v, mask):
        """The layer's output: attention of q over k and v (one key head serves every query head),
        then the MLP, each added to the residual stream."""
        b, _, t, _ = q.shape
        groups = self.g.heads // self.g.kv_heads
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        if self.sdpa:
            attended = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.g.head_dim ** -0.5)
        else:
            scores = q @ k.transpose(-1, -2) * self.g.head_dim ** -0.5
            attended = (scores if mask is None else scores + mask).softmax(-1) @ v
        attended = attended.transpose(1, 2).reshape(b, t, -1)
        x = x + self.o(attended)
        h = self.norm2(x)
        return x + self.down(F.gelu(self.gate(h), approximate="tanh") * self.up(h))


class Pi0(nn.Module):
    def __init__(self, config: VlaConfig = PI0):
        super().__init__()
        c = self.config = config
        if (c.prefix.heads, c.prefix.kv_heads, c.prefix.head_dim) != (c.expert.heads, c.expert.kv_heads,
                                                                       c.expert.head_dim):
            raise ValueError("the action expert attends over the prefix's keys: the same heads and head size")
        vision = SiglipVisionConfig(hidden_size=c.vision_width, intermediate_size=c.vision_mlp,
                                    num_hidden_layers=c.vision_layers, num_attention_heads=c.vision_heads,
                                    image_size=c.image_size, patch_size=c.patch)
        vision._attn_implementation = "eager"
        self.vision = SiglipVisionModel(vision)
        self.projector = nn.Linear(c.vision_width, c.prefix.width)
        self.embed = nn.Embedding(c.vocab, c.prefix.width)
        self.prefix_layers = nn.ModuleList(Layer(c.prefix) for _ in range(c.prefix.depth))
        self.expert_layers = nn.ModuleList(Layer(c.expert) for _ in range(c.expert.depth))
        self.expert_norm = RMSNorm(c.expert.width)
        w = c.expert.width
        self.state_proj, self.action_in = nn.Linear(c.actions, w), nn.Linear(c.actions, w)
        self.time_in, self.time_out = nn.Linear(2 * w, w), nn.Linear(w, w)
        self.action_out = nn.Linear(w, c.actions)
        p, h = c.prefix_tokens, c.horizon
        self.register_buffer("prefix_rotary", torch.stack(rotary(torch.arange(p), c.prefix.head_dim)), persistent=False)
        self.register_buffer("suffix_rotary", torch.stack(rotary(torch.arange(p, p + 1 + h), c.expert.head_dim)),
                             persistent=False)
        mask = torch.zeros(1 + h, p + 1 + h)
        mask[0, p + 1:] = -1e4   # the state sees the prefix and itself, not the actions
        self.register_buffer("suffix_mask", mask, persistent=False)

    def image_features(self, pixel_values):
        """[cameras, patches, width]: each camera's image through SigLIP and the projection."""
        return self.projector(self.vision(pixel_values=pixel_values).last_hidden_state)

    def prefix_embeds(self, features, tokens):
        """[1, P, width]: the images' features, then the prompt's token embeddings times sqrt(width)."""
        text = self.embed(tokens) * math.sqrt(self.config.prefix.width)
        return torch.cat([features.reshape(1, -1, features.shape[-1]), text.reshape(1, -1, text.shape[-1])], dim=1)

    def prefix_cache(self, embeds) -> tuple[list, list]:
        """Each prefix layer's keys and values (the prefix attends to all of itself)."""
        cos, sin = self.prefix_rotary
        x, keys, values = embeds, [], []
        for layer in self.prefix_layers:
            q, k, v = layer.qkv(x, cos, sin)
            keys.append(k)
            values.append(v)
            if len(keys) < len(self.prefix_layers):   # the last layer's output reads nothing on
                x = layer.finish(x, q, k, v, None)
        return keys, values

    def velocity(self, x_t, time, state, keys, values):
        """v(x_t, t) [1, horizon, actions]: the suffix (state, then the actions with the time mixed in)
        through the expert, each layer attending over the prefix's keys and values and its own."""
        w = self.config.expert.width
        fraction = torch.linspace(0.0, 1.0, w // 2, device=x_t.device)
        period = 4e-3 * (4.0 / 4e-3) ** fraction
        angles = time.float()[:, None] * (2 * math.pi / period)[None]
        timing = torch.cat([angles.sin(), angles.cos()], dim=1).to(x_t.dtype)   # [1, w]
        actions = self.action_in(x_t)
        mixed = self.time_out(F.silu(self.time_in(torch.cat([actions, timing[:, None].expand_as(actions)], dim=2))))
        x = torch.cat([self.state_proj(state)[:, None], mixed], dim=1)
        cos, sin = self.suffix_rotary
        for layer, past_k, past_v in zip(self.expert_layers, keys, values):
            q, k, v = layer.qkv(x, cos, sin)
            x = layer.finish(x, q, torch.cat([past_k, k], dim=2), torch.cat([past_v, v], dim=2), self.suffix_mask)
        return self.action_out(self.expert_norm(x)[:, 1:])

    @torch.no_grad()
    def sample_actions(self, pixel_values, tokens, state, noise, steps: int = 10):
        """An action chunk [1, horizon, actions] for one observation: `steps` Euler steps from `noise`."""
        keys, values = self.prefix_cache(self.prefix_embeds(self.image_features(pixel_values), tokens))
        x, dt = noise, -1.0 / steps
        for k in range(steps):
            time = torch.full((1,), 1.0 + k * dt, dtype=x.dtype, device=x.device)
            x = x + dt * self.velocity(x, time, state, keys, values)
        return x


def build_vla(config: VlaConfig = PI0, seed: int = 0) -> Pi0:
    """The model with seeded weights, in eval mode, fp32: transformers' own initialisation for the
    vision tower; elsewhere each weight normal with a standard deviation of 1 / sqrt(its inputs) (so
    activations keep their scale and attention does not average the prefix away: at 0.02 a changed
    image moved the actions by 1e-4), the norms' weights and biases drawn at 0.1, the embeddings at 1."""
    torch.manual_seed(seed)
    model = Pi0(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.startswith("vision."):
                continue
            p.normal_(0.0, 0.1 if p.ndim == 1 else 1.0 if name == "embed.weight" else p.shape[1] ** -0.5)
    return model


def as_sdpa(model: Pi0) -> Pi0:
    """The model with every attention through torch's scaled_dot_product_attention (the vision tower's
    transformers' own "sdpa", the Gemma layers' Layer.sdpa): what a PyTorch user runs for speed."""
    model.vision.config._attn_implementation = "sdpa"
    for layer in model.modules():
        if isinstance(layer, Layer):
            layer.sdpa = True
    return model


def observation(config: VlaConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """The seeded observation and noise a bundle of this config takes (shard.runtime.vla.seeded_observation)."""
    return seeded_observation(VlaSpec.of(config, "", seed), seed)


class Prefix(nn.Module):
    def __init__(self, model: Pi0):
        super().__init__()
        self.model = model

    def forward(self, prefix_embeds):
        keys, values = self.model.prefix_cache(prefix_embeds)
        return tuple(t for pair in zip(keys, values) for t in pair)


class Step(nn.Module):
    def __init__(self, model: Pi0):
        super().__init__()
        self.model = model

    def forward(self, x_t, time, state, *cache):
        return self.model.velocity(x_t, time, state, list(cache[0::2]), list(cache[1::2]))


class Vision(nn.Module):
    def __init__(self, model: Pi0):
        super().__init__()
        self.model = model

    def forward(self, pixel_values):
        return self.model.image_features(pixel_values)


def export_programs(model: Pi0, folder: Path, opset: int = 19) -> dict[str, Path]:
    """The three programs as ONNX files, each in a folder of its own (its weights beside it where it is
    past protobuf's 2 GB): folder/vision/vision.onnx, prefix/prefix.onnx, step/step.onnx; fp32, every
    shape fixed; opset 19, the GPU target's own (the version converter would have to hold the 7.5 GB
    prefix in one message). {name: path}."""
    c, folder = model.config, Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    names = cache_names(c.prefix.depth)
    cache = [torch.zeros(1, c.prefix.kv_heads, c.prefix_tokens, c.prefix.head_dim) for _ in names]
    programs = {
        "vision": (Vision(model), (torch.zeros(c.cameras, 3, c.image_size, c.image_size),), ["pixel_values"],
                   ["image_features"]),
        "prefix": (Prefix(model), (torch.zeros(1, c.prefix_tokens, c.prefix.width),), ["prefix_embeds"], names),
        "step": (Step(model), (torch.zeros(1, c.horizon, c.actions), torch.ones(1), torch.zeros(1, c.actions), *cache),
                 ["x_t", "time", "state", *names], ["velocity"]),
    }
    paths = {}
    for name, (module, args, inputs, outputs) in programs.items():
        paths[name] = folder / name / f"{name}.onnx"
        paths[name].parent.mkdir(exist_ok=True)
        with torch.no_grad():
            torch.onnx.export(module, args, str(paths[name]), opset_version=opset, dynamo=False,
                              input_names=inputs, output_names=outputs)
    return paths


def with_depth(config: VlaConfig, depth: int) -> VlaConfig:
    """The config with `depth` layers in the prefix and the expert (and the vision tower's share)."""
    return replace(config, prefix=replace(config.prefix, depth=depth), expert=replace(config.expert, depth=depth),
                   vision_layers=max(1, round(config.vision_layers * depth / config.prefix.depth)))


def export_vla(name: str, folder: Path, seed: int = 0, depth: int | None = None) -> Path:
    """A zoo VLA (CONFIGS: pi0, pi0-few) as a folder `shard compile` takes: its three programs as ONNX,
    the prompt's embedding table (looked up on the host) and vla.json (shard.runtime.vla.VlaSpec)."""
    config = CONFIGS[name] if depth is None else with_depth(CONFIGS[name], depth)
    model = build_vla(config, seed)
    folder = Path(folder)
    export_programs(model, folder)
    np.save(folder / "embeddings.npy", model.embed.weight.detach().numpy())
    spec = VlaSpec.of(config, name, seed)
    (folder / VLA).write_text(spec.to_json())
    return folder
