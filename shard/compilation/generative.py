"""A decoder compiled into a generative bundle (shard.runtime.generate): its step of `chunk` tokens
(the prompt) and its step of one token (the answer), each over a KV cache of `capacity` tokens,
exported from the checkpoint (shard.zoo.decoder) and compiled as any model is, each into its own
bundle; beside them the model's tokenizer, and what a step costs per chip.

    compile_generative(Path("SmolLM2-135M-Instruct.Q4_1.gguf"), "rk3588", Path("lm.shard"))
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from shard import scratch
from shard.compilation.cached import compile_one_model
from shard.compilation.staging import check_options, check_output_path, replace_dir, staging_folder
from shard.compilation.state import Progress
from shard.errors import ShardError
from shard.options import CompileOptions
from shard.runtime.generate import EMBEDDINGS, GENERATIVE, GenerativeSpec, Program
from shard.targets.chips import CHIPS, GPU_TARGETS

DEFAULT_CAPACITY = 512   # tokens of prompt and answer together (--max-context)
DEFAULT_CHUNK = 16       # the prompt's tokens a step (--chunk)
PREFILL_TOKENS = 128     # the prompt length published prefill times are stated at


def is_causal_lm(source: Path) -> bool:
    """A GGUF checkpoint, or a transformers folder (a config.json): what compile takes as a decoder."""
    return source.suffix == ".gguf" and source.is_file() or source.is_dir() and (source / "config.json").is_file()


@dataclass
class GenerativeResult:
    bundle: Path
    spec: GenerativeSpec
    reports: dict[str, dict]   # each program's compile report
    predicted: list[dict]      # per cache capacity


def compile_generative(source: Path, target: str, output: Path, options: CompileOptions | None = None,
                       capacity: int | Sequence[int] = DEFAULT_CAPACITY, chunk: int = DEFAULT_CHUNK,
                       progress: Progress = lambda *a: None) -> GenerativeResult:
    """A GGUF checkpoint or a transformers folder of a Llama-family decoder into a generative bundle
    at `output`: a program per step width and cache capacity (several capacities: buckets the
    cache moves up through as the context grows); nothing left at `output` on failure."""
    # torch and transformers: imported only when a decoder is compiled
    from shard.zoo.decoder import (VLM, checkpoint_record, embedding_table, export_step, export_vision, load_causal_lm,
                                   step_samples, stop_ids, text_parts)

    options = options or CompileOptions()
    check_options(options)
    capacities = sorted({capacity} if isinstance(capacity, int) else set(capacity))
    if not capacities or not 1 <= chunk <= capacities[0]:
        raise ShardError(f"--chunk {chunk}: the prompt's step takes 1 to the smallest --max-context "
                         f"({capacities[0] if capacities else '?'}) tokens")
    check_output_path(output, source)
    progress("read the checkpoint", 0, 1)
    model, tokenizer = load_causal_lm(source)
    config = text_parts(model)[2]
    programs = [Program(f"{kind}-{c}" if len(capacities) > 1 else kind, width, c) for c in capacities
                for kind, width in (("prefill", chunk), ("decode", 1)) if width > 1 or kind == "decode"]
    staging, exports = staging_folder(output), scratch.folder("export")
    steps = {p.name: lambda path, p=p: export_step(model, path, p.width, p.capacity) for p in programs}
    samples = {p.name: lambda p=p: step_samples(model, tokenizer, p.width, p.capacity) for p in programs}
    vision = None
    if model.config.model_type in VLM:   # the image's program first: the one a VLM runs first
        steps = {"vision": lambda path: export_vision(model, path), **steps}
        vision = {"program": "vision", "image_token": model.config.image_token_id,
                  "image_size": model.config.vision_config.image_size}
    reports = {}
    try:
        for name, export in steps.items():
            progress(f"{name}: export", 0, 1)
            given = options
            if name in samples and target in GPU_TARGETS and not options.shards:
                # one stage: a step waits for the one before it, so stages could never overlap, and each
                # hand-off between them costs the host (bench/decode_gpu.py)
                given = replace(given, shards=1)
            if name in samples and not options.calib:   # the check's inputs: a real prompt's, not random ones
                np.savez(exports / f"{name}.npz", **samples[name]())
                given = replace(given, calib=str(exports / f"{name}.npz"))
            result = compile_one_model(export(exports / f"{name}.onnx"), target, staging / name, given,
                                       lambda what, *a, name=name: progress(f"{name}: {what}", *a))
            reports[name] = result.report
            (exports / f"{name}.onnx").unlink()
        tokenizer.save_pretrained(staging / "tokenizer")
        np.save(staging / EMBEDDINGS, embedding_table(model))
        data = (staging / EMBEDDINGS).read_bytes()
        heads = config.num_attention_heads
        spec = GenerativeSpec(layers=config.num_hidden_layers, kv_heads=config.num_key_value_heads,
                              head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
                              capacity=capacities[-1], vocab=config.vocab_size, programs=programs,
                              stop=stop_ids(model, tokenizer), source=checkpoint_record(source),
                              files={EMBEDDINGS: [len(data), hashlib.sha256(data).hexdigest()]}, vision=vision)
        predicted = predict(spec, reports, decoder_bytes(model), target)
        (staging / GENERATIVE).write_text(spec.to_json())
        (staging / "report.json").write_text(json.dumps({"predicted": predicted}, indent=2) + "\n")
        replace_dir(staging, output)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        scratch.remove(exports)
    return GenerativeResult(output, spec, reports, predicted)


def decoder_bytes(model) -> int:
    """Weight bytes a step reads in fp16: every layer, the final norm and the LM head (the embedding
    is a lookup of one row on the host)."""
    from shard.zoo.decoder import text_parts

    body, head, _ = text_parts(model)
    params = sum(p.numel() for p in body.layers.parameters()) + sum(p.numel() for p in body.norm.parameters())
    return 2 * (params + head.weight.numel())


def predict(spec: GenerativeSpec, reports: dict[str, dict], weight_bytes: int, target: str) -> list[dict]:
    """Per cache capacity: prefill time for PREFILL_TOKENS and decode tokens/s from the vendor's cycle
    estimates (each program's predicted latency: the sum of its shards'; hand-offs are not charged)
    and, for decode, from DRAM bandwidth (the fp16 weights and the whole cache read once a token:
    decode at batch 1 is bound by it)."""
    chip = CHIPS.get(target)
    rows = []
    for capacity in spec.capacities:
        latency = {p.width: (reports[p.name].get("predicted") or {}).get("latency_s")
                   for p in spec.programs if p.capacity == capacity}
        decode, prefill = latency[1], latency[max(latency)]
        cache_bytes = 2 * spec.layers * spec.kv_heads * spec.head_dim * capacity * 2   # keys and values, fp16
        row = {"capacity": capacity,
               "prefill_128_ms": round(1e3 * prefill * math.ceil(PREFILL_TOKENS / spec.chunk), 2) if prefill else None,
               "decode_tokens_per_s": round(1 / decode, 1) if decode else None,
               "weight_bytes": weight_bytes, "cache_bytes": cache_bytes,
               "from": f"the vendor's cycle estimates of each program's shards (prefill: ceil({PREFILL_TOKENS} / "
                       f"{spec.chunk}) steps)"}
        if chip is not None and chip.dram_gbs:
            bound = (weight_bytes + cache_bytes) / (chip.dram_gbs * 1e9)
            row.update(bandwidth_tokens_per_s=round(1 / bound, 1), dram_gbs=chip.dram_gbs,
                       dram_source=chip.dram_source, decode_over_bound=round(decode / bound, 2) if decode else None)
        if "vision" in reports:
            seconds = (reports["vision"].get("predicted") or {}).get("latency_s")
            row["vision_ms"] = round(1e3 * seconds, 1) if seconds else None
        if chip is not None and chip.decoder_figures:
            row["published"] = chip.decoder_figures
        rows.append(row)
    return rows
