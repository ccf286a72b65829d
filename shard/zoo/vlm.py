"""SmolVLM's architecture built offline: Idefics3 (a SigLIP vision tower, a pixel-shuffle connector, a
SmolLM2 decoder) with a trained decoder from a GGUF checkpoint and a seeded vision tower and connector,
saved as a transformers folder with its processor, for `shard compile`.

    build_smolvlm(Path("SmolLM2-135M-Instruct.Q4_1.gguf"), Path("smolvlm"))

The shape is SmolVLM-256M's: SigLIP base at 512 x 512 (patch 16, 12 layers, hidden 768), a pixel
shuffle of 4 (1024 patches -> 64 image tokens), and the tokens Idefics3 marks images with added to
the decoder's vocabulary (their embeddings seeded). An image is one square of the vision tower's size,
or with `tiles` > 1 split as SmolVLM's processor splits it: resized to at most `tiles` squares along its
longer edge, each square one pass of the vision tower, then the whole image shrunk to one more square
(SmolVLM-256M's own processor: 4; a 2 x 2 split is 5 x 64 = 320 image tokens).
"""

from __future__ import annotations

from pathlib import Path

import torch
import transformers as tf

from shard.zoo.decoder import load_causal_lm

VISION = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12, image_size=512,
              patch_size=16)
SCALE = 4
# SmolVLM's chat template: an image as <image> in the user's turn (the processor expands it).
TEMPLATE = ("<|im_start|>{% for message in messages %}{{ message['role'] | capitalize }}"
            "{% if message['content'][0]['type'] == 'image' %}{{ ':' }}{% else %}{{ ': ' }}{% endif %}"
            "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{ line['text'] }}"
            "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}<end_of_utterance>\n"
            "{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}")


def build_smolvlm(decoder: Path, folder: Path, seed: int = 0, vision_layers: int = VISION["num_hidden_layers"],
                  image_size: int = VISION["image_size"], tiles: int = 1) -> Path:
    """An Idefics3 model whose decoder is `decoder` (a Llama-family GGUF file or transformers folder),
    vision tower and connector seeded; written to `folder` with its processor, which splits an image
    into up to `tiles` squares a side (1: not split)."""
    lm, tokenizer = load_causal_lm(decoder)
    places = [f"<row_{row}_col_{col}>" for row in range(1, tiles + 1) for col in range(1, tiles + 1)] if tiles > 1 else []
    tokenizer.add_tokens(["<global-img>", *places], special_tokens=True)
    image_tokens = (image_size // VISION["patch_size"]) ** 2 // SCALE ** 2
    images = tf.Idefics3ImageProcessor(do_image_splitting=tiles > 1, size={"longest_edge": tiles * image_size},
                                       max_image_size={"longest_edge": image_size})
    processor = tf.Idefics3Processor(images, tokenizer, image_seq_len=image_tokens, chat_template=TEMPLATE)
    vision = tf.Idefics3VisionConfig(**{**VISION, "num_hidden_layers": vision_layers, "image_size": image_size})
    config = tf.Idefics3Config(vision_config=vision.to_dict(), text_config=lm.config.to_dict(), scale_factor=SCALE,
                               image_token_id=processor.image_token_id, tie_word_embeddings=True)
    torch.manual_seed(seed)
    model = tf.Idefics3ForConditionalGeneration(config).eval()
    model.model.text_model.load_state_dict(lm.model.state_dict())
    model.resize_token_embeddings(len(tokenizer), mean_resizing=False)   # the new tokens' rows: seeded
    model.tie_weights()
    model.generation_config.eos_token_id = lm.generation_config.eos_token_id
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    return folder
