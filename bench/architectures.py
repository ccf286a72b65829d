"""Transformer architectures nobody on the team wrote: built offline by `transformers` from their
configs (hidden sizes, heads and vocabularies of the released models; fewer layers, so the corpus
runs in minutes), seeded random weights (convolutions He-initialised, as training leaves them
alive), exported to ONNX the way users export them (torch.onnx.export, opset 17, eager attention).
Used by bench/corpus.py."""

from __future__ import annotations

from pathlib import Path


def vision(cls, config, size=224, pooled=False, channels=3):
    return lambda t: (cls(config(t)), {"pixel_values": t.randn(1, channels, size, size)})


def text(cls, config, seq=128, mask=True):
    def build(t):
        inputs = {"input_ids": t.randint(0, 1000, (1, seq))}
        if mask:
            inputs["attention_mask"] = t.ones(1, seq, dtype=t.int64)
        return cls(config(t)), inputs
    return build


def configs():
    import transformers as tf

    def eager(cfg):
        cfg._attn_implementation = "eager"
        return cfg

    return {
        "vit-base": vision(tf.ViTModel, lambda t: eager(tf.ViTConfig(num_hidden_layers=2))),
        "deit-small": vision(tf.DeiTModel, lambda t: eager(tf.DeiTConfig(hidden_size=384, num_attention_heads=6,
                                                                         intermediate_size=1536, num_hidden_layers=2))),
        "swin-tiny": vision(tf.SwinModel, lambda t: eager(tf.SwinConfig(depths=[2, 2, 2, 2]))),
        "convnext-tiny": vision(tf.ConvNextModel, lambda t: tf.ConvNextConfig(depths=[1, 1, 3, 1])),
        "dinov2-small": vision(tf.Dinov2Model, lambda t: eager(tf.Dinov2Config(hidden_size=384, num_attention_heads=6,
                                                                               num_hidden_layers=2, image_size=224))),
        "clip-vision-b32": vision(tf.CLIPVisionModel, lambda t: eager(tf.CLIPVisionConfig(num_hidden_layers=2,
                                                                                          patch_size=32))),
        "siglip-vision-224": vision(tf.SiglipVisionModel, lambda t: eager(tf.SiglipVisionConfig(num_hidden_layers=2,
                                                                                                image_size=224))),
        "mobilevit-small": vision(tf.MobileViTModel, lambda t: tf.MobileViTConfig(), size=256),
        "segformer-b0": vision(tf.SegformerModel, lambda t: tf.SegformerConfig(), size=256),
        "yolos-tiny": vision(tf.YolosModel, lambda t: eager(tf.YolosConfig(hidden_size=192, num_attention_heads=3,
                                                                           intermediate_size=768, num_hidden_layers=2,
                                                                           image_size=[256, 256])), size=256),
        "dpt-depth": vision(tf.DPTForDepthEstimation, lambda t: eager(tf.DPTConfig(
            hidden_size=384, num_attention_heads=6, intermediate_size=1536, num_hidden_layers=4,
            backbone_out_indices=[0, 1, 2, 3], neck_hidden_sizes=[48, 96, 192, 384], fusion_hidden_size=64))),
        "bert-base": text(tf.BertModel, lambda t: eager(tf.BertConfig(num_hidden_layers=2))),
        "bert-tiny": text(tf.BertModel, lambda t: eager(tf.BertConfig(hidden_size=128, num_hidden_layers=2,
                                                                      num_attention_heads=2, intermediate_size=512))),
        "clip-text": text(tf.CLIPTextModel, lambda t: eager(tf.CLIPTextConfig(num_hidden_layers=2)), seq=77),
        "distilbert-base": text(tf.DistilBertModel, lambda t: eager(tf.DistilBertConfig(n_layers=2))),
        "roberta-base": text(tf.RobertaModel, lambda t: eager(tf.RobertaConfig(num_hidden_layers=2))),
        "t5-small-encoder": text(tf.T5EncoderModel, lambda t: eager(tf.T5Config(num_layers=2))),
        "gpt2-lm-head": text(tf.GPT2LMHeadModel, lambda t: eager(tf.GPT2Config(n_layer=2)), seq=64, mask=False),
        "qwen2-layer-lm-head": text(tf.Qwen2ForCausalLM, lambda t: eager(tf.Qwen2Config(
            hidden_size=896, intermediate_size=4864, num_attention_heads=14, num_key_value_heads=2,
            num_hidden_layers=1, vocab_size=151936, tie_word_embeddings=True)), seq=32, mask=False),
        "qwen2-mqa": text(tf.Qwen2ForCausalLM, lambda t: eager(tf.Qwen2Config(   # one key/value head: repeat_kv's Expand
            hidden_size=256, intermediate_size=512, num_attention_heads=8, num_key_value_heads=1,
            num_hidden_layers=1, vocab_size=1000)), seq=32),
        "whisper-tiny-encoder": lambda t: (tf.WhisperModel(eager(tf.WhisperConfig(
            d_model=384, encoder_layers=2, decoder_layers=1, encoder_attention_heads=6,
            decoder_attention_heads=6))).get_encoder(), {"input_features": t.randn(1, 80, 3000)}),
        "wav2vec2-base": lambda t: (tf.Wav2Vec2Model(eager(tf.Wav2Vec2Config(num_hidden_layers=2))),
                                    {"input_values": t.randn(1, 16000)}),
    }


def export(name: str, path: Path) -> Path:
    """Build and export one architecture (first output only, as `last_hidden_state` or `logits`)."""
    import torch

    torch.manual_seed(0)
    model, inputs = configs()[name](torch)
    model.eval()
    with torch.no_grad():  # trained convolutions keep activations alive; an init of std 0.02 through
        for module in model.modules():  # MobileViT's 30 of them leaves 1e-40, below fp16 and fp32 alike
            if isinstance(module, torch.nn.Conv2d):
                torch.nn.init.kaiming_normal_(module.weight)
            elif isinstance(module, torch.nn.BatchNorm2d):
                module.reset_parameters()  # unit scale and statistics, as a trained network's are about

    class First(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, *args):
            out = self.inner(**dict(zip(inputs, args)), return_dict=True)
            return out[0] if not hasattr(out, "logits") and not hasattr(out, "predicted_depth") else \
                (out.logits if hasattr(out, "logits") else out.predicted_depth)

    with torch.no_grad():
        torch.onnx.export(First(model), tuple(inputs.values()), str(path), opset_version=17, dynamo=False,
                          input_names=list(inputs), output_names=["output"])
    return path
