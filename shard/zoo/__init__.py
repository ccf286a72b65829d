"""Real architectures with seeded random weights, exported offline to ONNX for tests, demos, benchmarks."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from shard.errors import ShardError


@dataclass(frozen=True)
class ZooModel:
    name: str
    description: str
    layers: int
    image_size: int
    build: Callable  # (layers, image_size) -> torch.nn.Module taking pixel_values
    residual_writer: str  # a Linear whose output is added to the residual stream in the first layer ("" if none)
    patch: int = 16       # the patch side; a remainder of the image side is dropped (so400m: 384 = 27 x 14 + 6)


def _siglip(layers: int, image_size: int, hidden=768, heads=12, mlp=3072, patch=16):
    from transformers import SiglipVisionConfig, SiglipVisionModel

    cfg = SiglipVisionConfig(hidden_size=hidden, intermediate_size=mlp, num_hidden_layers=layers,
                             num_attention_heads=heads, image_size=image_size, patch_size=patch)
    cfg._attn_implementation = "eager"
    return SiglipVisionModel(cfg)


def _vit(layers: int, image_size: int):
    from transformers import ViTConfig, ViTModel

    cfg = ViTConfig(hidden_size=192, intermediate_size=768, num_hidden_layers=layers, num_attention_heads=3,
                    image_size=image_size, patch_size=16)
    cfg._attn_implementation = "eager"
    return ViTModel(cfg, add_pooling_layer=False)


def _growing_cnn(layers: int, image_size: int, channels=16, gain=4.0):
    """Convolutions and ReLUs whose activations grow `gain` times a layer (He initialisation times
    the gain), as a network without normalisation can: past fp16's 65504 after about 8 layers."""
    import torch

    convs = []
    for k in range(layers):
        conv = torch.nn.Conv2d(3 if k == 0 else channels, channels, 3, padding=1)
        torch.nn.init.kaiming_normal_(conv.weight)
        with torch.no_grad():
            conv.weight.mul_(gain)
        convs += [conv, torch.nn.ReLU()]
    return torch.nn.Sequential(*convs, torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten())


MODELS = {m.name: m for m in (
    ZooModel("siglip-base-512", "SigLIP-base-patch16-512 vision encoder: hidden 768, 12 heads, MLP 3072, 1024 tokens",
             12, 512, _siglip, "encoder.layers.0.mlp.fc2"),
    ZooModel("siglip-so400m-384", "SigLIP-so400m-patch14-384 vision encoder shape: hidden 1152, 16 heads, MLP 4304, "
             "27 layers, 729 tokens (400 M parameters: the GPU pipeline's large model)", 27, 384,
             lambda layers, size: _siglip(layers, size, hidden=1152, heads=16, mlp=4304, patch=14),
             "encoder.layers.0.mlp.fc2", patch=14),
    ZooModel("vit-tiny", "ViT-tiny/16 encoder: hidden 192, 3 heads, MLP 768, 197 tokens (seconds to compile)",
             12, 224, _vit, "layers.0.mlp.fc2"),
    ZooModel("growing-cnn", "3x3 convolutions and ReLUs, activations 4x larger each layer: out of fp16's range "
             "after 8 layers (the scale sandwich's test)", 9, 64, _growing_cnn, ""),
)}


# vision-language-action models (shard.zoo.vla, which imports torch): `shard zoo export NAME -o FOLDER`
VLAS = {"pi0": "Pi0's shapes: SigLIP-so400m/14 at 224 for each of 3 cameras, a Gemma-2B-shaped prefix, a "
               "Gemma-300M-shaped action expert, 10 Euler steps to 50 actions of 32 (a folder of 3 programs)",
        "pi0-few": "pi0's architecture with 2 layers of everything and small widths (seconds; the CPU test's)"}


def get_model(name: str) -> ZooModel:
    try:
        return MODELS[name]
    except KeyError:
        raise ShardError(f"unknown zoo model {name!r}; known: {', '.join([*MODELS, *VLAS])}") from None


def export_model(name: str, output: str | Path, layers: int | None = None, image_size: int | None = None,
                 outliers: float = 0.0, seed: int = 0, opset: int = 17, batch: int = 1,
                 dynamic_batch: bool = False) -> Path:
    """Export a zoo model's encoder (input pixel_values, output last_hidden_state) to ONNX, for
    `batch` images at a time, or any number with `dynamic_batch` (for `shard compile --batch`). The
    weights are build_model's with the same seed."""
    try:
        import torch
    except ImportError:
        raise ShardError("the zoo needs torch and transformers: pip install 'shard[zoo]'") from None
    spec = get_model(name)
    layers = layers or spec.layers
    image_size = image_size or spec.image_size
    if layers < 1 or image_size < spec.patch or batch < 1:
        raise ShardError(f"need --layers >= 1, a batch >= 1 and --image-size of at least one patch, {spec.patch} "
                         f"(got {layers}, {batch}, {image_size})")
    model = build_model(name, layers, image_size, seed)
    if outliers and not spec.residual_writer:
        raise ShardError(f"{name} has no residual stream to plant an outlier channel in")
    if outliers:
        plant_outlier_channel(model.get_submodule(spec.residual_writer), outliers)

    class Encoder(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, pixel_values):
            out = self.inner(pixel_values) if isinstance(self.inner, torch.nn.Sequential) else \
                self.inner(pixel_values=pixel_values)
            return getattr(out, "last_hidden_state", out)

    output = Path(output)
    x = torch.randn(batch, 3, image_size, image_size)
    with torch.no_grad():
        torch.onnx.export(Encoder(model), (x,), str(output), opset_version=opset, dynamo=False,
                          input_names=["pixel_values"], output_names=["last_hidden_state"],
                          dynamic_axes={"pixel_values": {0: "batch"}, "last_hidden_state": {0: "batch"}}
                          if dynamic_batch else None)
    return output


def build_model(name: str, layers: int | None = None, image_size: int | None = None, seed: int = 0):
    """A zoo model in torch, its weights seeded: what export_model writes, and the baseline a
    PyTorch user would run instead (bench/thor.py)."""
    import torch

    spec = get_model(name)
    torch.manual_seed(seed)
    return spec.build(layers or spec.layers, image_size or spec.image_size).eval()


def plant_outlier_channel(linear, magnitude: float, channel: int = 7) -> None:
    """Give one residual-stream channel a massive activation from the first layer on, as trained ViTs have.

    The bias of a Linear that writes into the residual stream adds `magnitude` to one channel of
    every token; the following LayerNorms normalise it away, so the blocks see ordinary values.
    """
    import torch

    with torch.no_grad():
        linear.bias[channel] += magnitude
