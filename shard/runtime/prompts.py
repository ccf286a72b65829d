"""A generative bundle's prompts: text (the model's own tokenizer and chat template, from the bundle)
and images (its processor) to token ids and pixels, and those to the rows the decoder's steps take
(the host's embedding table, each image token's place taken by the image's features). transformers
and Pillow are imported when a prompt is text or has an image."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from shard.errors import RunError, ShardError
from shard.runtime.generative_bundle import TOKENIZER, GenerativeSpec

MAX_PIXELS = 8192 * 8192   # an image's pixels at most (the processor shrinks it to a few hundred a side)


def read_image(image):
    """A PIL image, from a path or as given."""
    if not isinstance(image, (str, Path)):
        return image
    from PIL import Image

    try:
        with Image.open(image) as opened:
            if opened.width * opened.height > MAX_PIXELS:   # a header may declare 20000 x 20000
                raise RunError(f"{image}: {opened.width} x {opened.height} pixels, more than an image shard reads "
                               f"({MAX_PIXELS} at most); shrink it first")
            return opened.convert("RGB")
    except (OSError, Image.DecompressionBombError, ValueError) as exc:
        raise RunError(f"{image}: not an image this can read ({exc})") from None


@dataclass
class Sight:
    features: list[np.ndarray]   # per square of an image (the processor may split one), [tokens, hidden]
    seconds: list[float]         # per square, the time its features took after the one before's


class Prompts:
    """A bundle's tokenizer (a VLM's processor) and embedding table: what a prompt becomes."""

    def __init__(self, bundle: Path, spec: GenerativeSpec, table: np.ndarray):
        self.bundle, self.spec, self.table = bundle, spec, table
        self._processor = None

    @property
    def processor(self):
        """The model's own tokenizer (a VLM's processor: its tokenizer and image processor), from the
        bundle (transformers)."""
        if self._processor is None:
            try:
                import transformers
            except ImportError:
                raise RunError("text prompts need transformers (pip install transformers); or give token ids") from None
            kind = transformers.AutoProcessor if self.spec.vision else transformers.AutoTokenizer
            # the bundle's own files, checked when it was opened: never the Hub, never code of its own
            self._processor = kind.from_pretrained(self.bundle / TOKENIZER, local_files_only=True,
                                                   trust_remote_code=False)
        return self._processor

    @property
    def tokenizer(self):
        return getattr(self.processor, "tokenizer", self.processor)

    def encode(self, prompt: str | list[int], chat: bool = False, images: list | None = None
               ) -> tuple[list[int], np.ndarray | None]:
        """The prompt's token ids (the chat template applied if `chat`) and, for a VLM given images
        (PIL images or paths), their pixel values [images, 3, S, S] (the processor's)."""
        if images and not self.spec.vision:
            raise RunError(f"{self.bundle} is a text-only model's bundle: it takes no image")
        if not isinstance(prompt, str):
            return [int(t) for t in prompt], None
        try:
            return self.tokenized(prompt, chat, images)
        except ShardError:
            raise
        except Exception as exc:  # noqa: BLE001 - the model's tokenizer and chat template (jinja2) raise their own
            first = str(exc).splitlines()[0] if str(exc) else ""
            raise RunError(f"{self.bundle / TOKENIZER}: the model's tokenizer or chat template failed on the prompt "
                           f"({type(exc).__name__}: {first})") from None

    def tokenized(self, prompt: str, chat: bool, images: list | None) -> tuple[list[int], np.ndarray | None]:
        if not images:
            if chat:
                return list(self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=True,
                                                               add_generation_prompt=True, return_dict=False)), None
            return list(self.tokenizer(prompt)["input_ids"]), None
        images = [read_image(image) for image in images]
        content = [{"type": "image"} for _ in images] + [{"type": "text", "text": prompt}]
        text = (self.processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
                if chat else "<image>" * len(images) + prompt)
        encoded = self.processor(text=text, images=[images], return_tensors="np")
        return [int(t) for t in encoded["input_ids"][0]], np.asarray(encoded["pixel_values"][0], np.float32)

    def check_room(self, ids: list[int]) -> None:
        """A prompt past the largest cache stops in one line before its images go through the vision
        program."""
        capacity = max(self.spec.capacities)
        if len(ids) > capacity:
            seen = ids.count(self.spec.vision["image_token"]) if self.spec.vision else 0
            raise RunError(f"the prompt is {len(ids)} tokens" + (f" ({seen} of them image features)" if seen else "")
                           + f", past the cache's capacity of {capacity} (compile with a larger --max-context)")

    def embed(self, ids: list[int], sight: Sight | None = None) -> np.ndarray:
        """The prompt's rows for the decoder: each token's embedding, each image token's place taken by
        the image features in order."""
        if not ids or max(ids) >= self.spec.vocab or min(ids) < 0:
            raise RunError(f"a prompt of 1 or more token ids below the vocabulary's {self.spec.vocab}; got {ids[:8]}")
        rows = np.array(self.table[ids], np.float32)
        if not sight or not sight.features:
            return rows
        features = np.concatenate(sight.features)
        places = np.flatnonzero(np.asarray(ids) == self.spec.vision["image_token"])
        if len(places) != len(features):
            raise RunError(f"the prompt holds {len(places)} image tokens for {len(features)} image features")
        rows[places] = features
        return rows
