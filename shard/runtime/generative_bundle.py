"""A generative bundle's format: generative.json (GenerativeSpec: the cache's shape, each program's
folder and width, the stop tokens) and the files it records by size and sha256 (the embeddings, every
file of the tokenizer folder), checked when the bundle is opened. Standard library and numpy.

    lm.shard/generative.json   the cache's shape, each program's folder and width, the stop tokens
    lm.shard/prefill/          the step of N tokens (the prompt, N at a time)
    lm.shard/decode/           the step of 1 token
                               (prefill-C/, decode-C/ per capacity C where several: the cache
                               starts in the smallest and moves up as the context grows)
    lm.shard/step/             compile --one-step: in their place, the step of N tokens for the
                               prompt and the answer alike (one copy of the weights; step-C/ per C)
    lm.shard/tokenizer/        the model's own tokenizer and chat template (read with transformers;
                               a VLM's processor)
    lm.shard/embeddings.npy    the token embeddings, looked up on the host for every step
    lm.shard/vision/           a VLM's image -> image features program
"""

from __future__ import annotations

import hashlib
import io
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from shard.bundle import read_versioned, sealed_digest
from shard.errors import BundleError

GENERATIVE = "generative.json"
EMBEDDINGS = "embeddings.npy"
TOKENIZER = "tokenizer"
PREDICTION = "report.json"   # the compile's prediction (tokens/s, prefill) per cache capacity, as it printed it
PREFILL_TOKENS = 128         # the prompt length published prefill times are stated at (and predicted, and timed)
# 2: a step of more than one token returns its last real token's logits (PICK); 3: every file of the
# tokenizer folder recorded beside the embeddings (a replaced tokenizer.json changed the text, exit 0)
SCHEMA_VERSION = 3
CUSTOM_CODE = ("tokenizer_config.json", "processor_config.json", "preprocessor_config.json", "config.json")


def record_files(bundle: Path) -> dict[str, list]:
    """{path in the bundle: [bytes, sha256]} of the embeddings and every file of the tokenizer folder,
    as generative.json records them."""
    names = [EMBEDDINGS] + sorted(p.relative_to(bundle).as_posix() for p in (bundle / TOKENIZER).rglob("*")
                                  if p.is_file())
    return {name: [len(data), hashlib.sha256(data).hexdigest()] for name in names
            for data in [(bundle / name).read_bytes()]}


def check_files(bundle: Path, files: dict) -> None:
    """Every file generative.json records, as recorded (the embeddings: by load_checked, which reads
    them); nothing in the tokenizer folder it does not record, no link, no code of its own."""
    folder = bundle / TOKENIZER
    if folder.is_symlink() or not folder.is_dir():
        raise BundleError(f"{folder}: missing, or not a folder of the bundle; recompile the model")
    found = set()
    for root, dirs, names in os.walk(folder):
        for name in dirs + names:
            path = Path(root) / name
            if path.is_symlink():
                raise BundleError(f"{path}: a link, not a file the compile wrote; recompile the model")
            if path.is_file():
                found.add(path.relative_to(bundle).as_posix())
    unrecorded = sorted(found - set(files))
    if unrecorded:
        raise BundleError(f"{bundle / unrecorded[0]}: not a file the compile wrote (generative.json records no "
                          f"hash of it); recompile the model")
    for name in files:
        if name != EMBEDDINGS:   # read once, by load_checked
            read_checked(bundle, files, name)
    refuse_custom_code(folder)


def refuse_custom_code(tokenizer: Path) -> None:
    """A tokenizer folder whose configs ask for code of their own (auto_map) is refused: transformers
    would offer to run Python shipped with it."""
    for name in CUSTOM_CODE:
        config = tokenizer / name
        if config.is_file() and "auto_map" in json.loads(config.read_text() or "{}"):
            raise BundleError(f"{config}: asks for code of its own (auto_map), which shard never runs; "
                              f"recompile from a checkpoint whose tokenizer is transformers' own")


def read_checked(bundle: Path, files: dict, name: str) -> bytes:
    """A file of the bundle, refused unless its size and sha256 are those generative.json records."""
    path = bundle / name
    try:
        size, digest = files[name]
        data = path.read_bytes()
    except (KeyError, TypeError, ValueError):
        raise BundleError(f"{path}: generative.json records no size and sha256 for it; recompile the model") from None
    except OSError as exc:
        raise BundleError(f"{path}: unreadable ({exc.strerror}); recompile the model") from None
    if len(data) != size or hashlib.sha256(data).hexdigest() != digest:
        raise BundleError(f"{path}: not the file the compile wrote ({len(data)} bytes, sha256 "
                          f"{hashlib.sha256(data).hexdigest()[:12]}; recorded {size} bytes, {str(digest)[:12]})")
    return data


def load_checked(bundle: Path, files: dict, name: str) -> np.ndarray:
    """A numpy file of the bundle, refused unless its size and sha256 are those generative.json records."""
    return np.load(io.BytesIO(read_checked(bundle, files, name)))


@dataclass
class Program:
    name: str       # its folder in the bundle: an ordinary bundle
    width: int      # new tokens a step
    capacity: int   # the cache's tokens it reads


@dataclass
class GenerativeSpec:
    layers: int
    kv_heads: int
    head_dim: int
    capacity: int                  # the cache's largest: prompt and answer together
    vocab: int
    programs: list[Program]        # per capacity, smallest first: the widest prefills, width 1 decodes
    stop: list[int]                # tokens that end an answer
    source: dict = field(default_factory=dict)   # the checkpoint: file name, sha256
    files: dict = field(default_factory=dict)    # {"embeddings.npy" and each tokenizer/ file: [bytes, sha256]}
    vision: dict | None = None     # a VLM's: its program's folder, its image token, the image's side
    schema_version: int = SCHEMA_VERSION
    digest: str = ""   # the sha256 of this spec's JSON with digest empty: a changed byte shows (as a manifest's)

    def to_json(self) -> str:
        """The spec as written, sealed first."""
        self.digest = self.own_digest()
        return json.dumps(asdict(self), indent=2) + "\n"

    def own_digest(self) -> str:
        return sealed_digest(asdict(self))

    @property
    def chunk(self) -> int:
        return max(p.width for p in self.programs)

    @property
    def decode_width(self) -> int:
        """The width of the step each answer token goes through: 1, or the prompt's where the bundle
        has one program per capacity (compile --one-step)."""
        return 1 if any(p.width == 1 for p in self.programs) else self.chunk

    @property
    def capacities(self) -> list[int]:
        return sorted({p.capacity for p in self.programs})


def is_generative(bundle: str | Path) -> bool:
    return (Path(bundle) / GENERATIVE).is_file()


def read_generative(bundle: str | Path) -> GenerativeSpec:
    path = Path(bundle) / GENERATIVE
    spec = read_versioned(path, SCHEMA_VERSION, "generative",
                          lambda data: GenerativeSpec(**{**data, "programs": [Program(**p) for p in data["programs"]]}))
    wrong = spec_error(spec) or (None if spec.digest == spec.own_digest() else
                                 "its digest differs: it was changed after the compile wrote it")
    if wrong:
        raise BundleError(f"{path}: malformed generative spec ({wrong}); recompile the model")
    for name in [p.name for p in spec.programs] + ([spec.vision["program"]] if spec.vision else []):
        folder = Path(bundle) / name
        if folder.is_symlink() or not folder.resolve().is_relative_to(Path(bundle).resolve()):
            raise BundleError(f"{path}: program {name!r} is not a folder of the bundle")
    have = {(p.width, p.capacity) for p in spec.programs}
    missing = [f"{w} at {c}" for c in spec.capacities for w in {spec.decode_width, spec.chunk} if (w, c) not in have]
    if not spec.programs or missing:
        raise BundleError(f"{path}: no program of width {', '.join(missing) or 1} to run steps with")
    return spec


def spec_error(spec: GenerativeSpec) -> str | None:
    """What in a generative spec is not of its schema's types and ranges (None: nothing)."""
    count = lambda v: type(v) is int and v > 0  # noqa: E731 - bool is no count
    plain = lambda v: isinstance(v, str) and v not in ("", ".", "..") and "/" not in v and "\\" not in v  # noqa: E731
    for field_name in ("layers", "kv_heads", "head_dim", "capacity", "vocab"):
        if not count(getattr(spec, field_name)):
            return f"{field_name} {getattr(spec, field_name)!r}: expected a positive whole number"
    if not isinstance(spec.stop, list) or not all(type(t) is int and 0 <= t < spec.vocab for t in spec.stop):
        return f"stop {spec.stop!r}: expected a list of token ids"
    if not isinstance(spec.files, dict) or not isinstance(spec.source, dict):
        return "files and source: expected objects"
    for p in spec.programs:
        if not (plain(p.name) and count(p.width) and count(p.capacity) and p.width <= p.capacity <= spec.capacity):
            return f"program {p.name!r}: expected a folder name, a width and a capacity within the cache's"
    if spec.vision is not None and not (isinstance(spec.vision, dict) and plain(spec.vision.get("program"))
                                        and type(spec.vision.get("image_token")) is int):
        return f"vision {spec.vision!r}: expected its program's folder and its image token"
    return None
