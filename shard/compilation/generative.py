"""A decoder compiled into a generative bundle (shard.runtime.generate): its step of `chunk` tokens
(the prompt) and its step of one token (the answer), each over a KV cache of `capacity` tokens,
exported from the checkpoint (shard.zoo.decoder) and compiled as any model is, each into its own
bundle; beside them the model's tokenizer, and what a step costs per chip.

    compile_generative(Path("SmolLM2-135M-Instruct.Q4_1.gguf"), "rk3588", Path("lm.shard"))
"""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

from shard import scratch
from shard.bundle import read_manifest
from shard.compilation.cached import compile_one_model
from shard.compilation.names import Progress
from shard.compilation.staging import check_options, check_output_path, replace_dir, staging_folder
from shard.errors import ShardError
from shard.options import CompileOptions
from shard.profile import load_profile
from shard.runtime.generate import time_row_writes
from shard.runtime.generative_bundle import (EMBEDDINGS, GENERATIVE, PREDICTION, PREFILL_TOKENS, TOKENIZER,
                                             GenerativeSpec, Program, record_files, refuse_custom_code)
from shard.runtime.scheduler import predict_stream
from shard.summary import Predicted, predicted_of, shards_of
from shard.targets.chips import CHIPS, GPU_TARGETS, Handoff, board_handoff
from shard.zoo import onnx_decoder as onnx_form

DEFAULT_CAPACITY = 512   # tokens of prompt and answer together (--max-context)
DEFAULT_CHUNK = 16       # the prompt's tokens a step (--chunk) where no prediction chooses it
CHUNKS = (16, 32, 64, 128, 256)   # the widths --chunk auto chooses among


def is_causal_lm(source: Path) -> bool:
    """A GGUF checkpoint, a transformers folder (a config.json), or an ONNX decoder with its KV cache as
    inputs (optimum's layout): what compile takes as a decoder."""
    return source.suffix == ".gguf" and source.is_file() or source.is_dir() and (source / "config.json").is_file() \
        or onnx_form.is_onnx_decoder(source)


@dataclass
class GenerativeResult:
    bundle: Path
    spec: GenerativeSpec
    reports: dict[str, dict]   # each program's compile report
    predicted: list[dict]      # per cache capacity
    chunk: ChunkChoice | None = None  # why --chunk auto chose the prompt step's width (choose_chunk)


@dataclass(frozen=True)
class ChunkChoice:
    """The prompt step's width --chunk auto chose, why, and the figures it was chosen by."""

    chunk: int
    why: str
    prefill_s: dict[str, float] | None = None   # a prompt of PREFILL_TOKENS, by step width
    step_s: float | None = None                 # a step that reads every weight once: the decode step's NPU time
    macs_per_token: float | None = None
    macs_per_s: float | None = None


MAX_CONTEXT = 1 << 17   # tokens a cache may hold, whatever the model (its config may say fewer)


@dataclass
class Decoder:
    """What a generative compile takes from a decoder, whichever form it came in."""
    layers: int
    kv_heads: int
    head_dim: int
    vocab: int
    export: Callable[[Path, int, int], Path]          # (path, width, capacity): the step written as ONNX
    samples: Callable[[Path, int, int], dict]         # (that ONNX, width, capacity): a real prompt's inputs
    table: np.ndarray                                 # the token embeddings the host looks steps up in
    save_tokenizer: Callable[[Path], None]
    stop: list[int]
    weight_bytes: int                                 # fp16 bytes a step reads (decoder_bytes)
    vision: tuple[dict, Callable[[Path], Path]] | None = None   # a VLM's: its spec entry, its export
    positions: int | None = None                      # the most positions the model was made for (its config)


def checkpoint_decoder(source: Path) -> Decoder:
    """A GGUF file or transformers folder (shard.zoo.decoder: torch and transformers, imported here)."""
    from shard.zoo.decoder import (VLM, embedding_table, export_step, export_vision, image_room, load_causal_lm,
                                   step_samples, stop_ids, text_parts)

    model, tokenizer = load_causal_lm(source)
    config = text_parts(model)[2]
    vision = None
    if model.config.model_type in VLM:
        vision = ({"program": "vision", "image_token": model.config.image_token_id,
                   "image_size": model.config.vision_config.image_size, "most": image_room(tokenizer)},
                  lambda path: export_vision(model, path))
    heads = config.num_attention_heads
    return Decoder(config.num_hidden_layers, config.num_key_value_heads,
                   getattr(config, "head_dim", None) or config.hidden_size // heads, config.vocab_size,
                   lambda path, width, capacity: export_step(model, path, width, capacity),
                   lambda path, width, capacity: step_samples(model, tokenizer, width, capacity),
                   embedding_table(model), tokenizer.save_pretrained, stop_ids(model, tokenizer),
                   decoder_bytes(model), vision, getattr(config, "max_position_embeddings", None))


def onnx_decoder(source: Path) -> Decoder:
    """An ONNX decoder in optimum's layout, its tokenizer beside it (shard.zoo.onnx_decoder)."""
    found = onnx_form.read_onnx_decoder(source)
    tokenizer = onnx_form.load_tokenizer(source)
    return Decoder(found.layers, found.kv_heads, found.head_dim, found.vocab,
                   lambda path, width, capacity: onnx_form.export_onnx_step(found, path, width, capacity),
                   lambda path, width, capacity: onnx_form.step_samples(found, path, tokenizer, width, capacity),
                   found.table, tokenizer.save_pretrained, onnx_form.stop_ids(source, tokenizer), found.weight_bytes)


def compile_generative(source: Path, target: str, output: Path, options: CompileOptions | None = None,
                       capacity: int | Sequence[int] = DEFAULT_CAPACITY, chunk: int | None = None,
                       one_step: bool = False, progress: Progress = lambda *a: None) -> GenerativeResult:
    """A GGUF checkpoint or a transformers folder of a Llama-family decoder, or an ONNX decoder in
    optimum's layout (shard.zoo.onnx_decoder), into a generative bundle at `output`: a program per step
    width and cache capacity (several capacities: buckets the cache moves up through as the context
    grows); `one_step`: only the step of `chunk` tokens, the answer's tokens too (one copy of the
    weights per capacity); `chunk` None: chosen by the decode step's prediction (choose_chunk), the
    decode steps compiled first. Nothing left at `output` on failure."""
    from shard.zoo.decoder import checkpoint_record

    options = options or CompileOptions()
    check_options(options)
    capacities = sorted({capacity} if isinstance(capacity, int) else set(capacity))
    if chunk is None and one_step:   # the answer's step too: no decode step to choose it by
        chunk = DEFAULT_CHUNK
    check_context(capacities, chunk or 1)
    check_output_path(output, source)
    progress("read the checkpoint", 0, 1)
    # an ONNX file is a decoder's only where read_onnx_decoder finds its layout (it says what is missing)
    decoder = onnx_decoder(source) if source.suffix == ".onnx" else checkpoint_decoder(source)
    if decoder.positions and capacities[-1] > decoder.positions:
        raise ShardError(f"--max-context {capacities[-1]}: {source.name} was made for at most {decoder.positions} "
                         f"positions (its config's max_position_embeddings)")
    staging, exports = staging_folder(output), scratch.folder("export")
    try:
        programs, reports, why = compile_steps(decoder, capacities, chunk, one_step, target, options, staging,
                                               exports, progress)
        decoder.save_tokenizer(staging / TOKENIZER)
        refuse_custom_code(staging / TOKENIZER)   # a checkpoint whose tokenizer asks for code of its own
        np.save(staging / EMBEDDINGS, decoder.table)
        spec = GenerativeSpec(layers=decoder.layers, kv_heads=decoder.kv_heads, head_dim=decoder.head_dim,
                              capacity=capacities[-1], vocab=decoder.vocab, programs=programs, stop=decoder.stop,
                              source=checkpoint_record(source), files=record_files(staging),
                              vision=decoder.vision[0] if decoder.vision else None)
        handoff = board_handoff(target, load_profile(target, options.profile).facts)
        predicted = predict(spec, reports, decoder.weight_bytes, target, staging, handoff)
        (staging / GENERATIVE).write_text(spec.to_json())
        report = {"predicted": predicted, "chunk": why and asdict(why)}
        (staging / PREDICTION).write_text(json.dumps(report, indent=2) + "\n")
        replace_dir(staging, output)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        scratch.remove(exports)
    return GenerativeResult(output, spec, reports, predicted, why)


def compile_steps(decoder: Decoder, capacities: list[int], chunk: int | None, one_step: bool, target: str,
                  options: CompileOptions, staging: Path, exports: Path, progress: Progress
                  ) -> tuple[list[Program], dict[str, dict], ChunkChoice | None]:
    """Every step program compiled: (the programs, {name: report}, why the chunk is what it is where
    --chunk auto chose it). The chunk None: the decode steps first, then the prompt's at the width
    choose_chunk takes from the first of them."""
    def named(kind: str, width: int, c: int) -> Program:
        return Program(f"{kind}-{c}" if len(capacities) > 1 else kind, width, c)

    if one_step:
        programs = [named("step", chunk, c) for c in capacities]
        return programs, compile_programs(decoder, programs, target, options, staging, exports, progress), None
    decodes = [named("decode", 1, c) for c in capacities]
    why = None
    if chunk is None:
        reports = compile_programs(decoder, decodes, target, options, staging, exports, progress)
        why = choose_chunk(reports[decodes[0].name], capacities[0], options.precision,
                           load_profile(target, options.profile).facts)
        chunk = why.chunk
    else:
        reports = {}
    prompts = [named("prefill", chunk, c) for c in capacities if chunk > 1]
    order = prompts + decodes if why is None else prompts
    reports.update(compile_programs(decoder, order, target, options, staging, exports, progress,
                                    vision=why is None))
    programs = [p for c in capacities for p in prompts + decodes if p.capacity == c]
    return programs, reports, why


def choose_chunk(decode: dict, capacity: int, precision: str, facts: dict) -> ChunkChoice:
    """The prompt step's width for the fewest seconds over a prompt of PREFILL_TOKENS: a step of w
    tokens takes the decode step's NPU time (reading every weight once, which a one-token step is
    bound by) or its MACs for w tokens at the NPU's peak rate, whichever is longer (the decode step's
    MACs a token, its LM head included, where the prompt's step computes the head for one token
    only: an upper bound). The smallest such width among CHUNKS within the cache; DEFAULT_CHUNK
    where the decode step has no NPU prediction (`decode`: its compile report)."""
    predicted = predicted_of(decode)
    npu, clock = (predicted.npu_seconds, predicted.npu_clock_hz) if predicted else (None, None)
    rate = facts.get(f"macs_per_cycle_{'int8' if precision in ('int8', 'mixed') else 'fp16'}")
    widths = [w for w in CHUNKS if w <= capacity] or [capacity]
    if not npu or not clock or not rate:
        return ChunkChoice(min(DEFAULT_CHUNK, capacity), "no NPU prediction of the decode step")
    step, macs = sum(npu), sum(s.macs for s in shards_of(decode))
    seconds = {w: math.ceil(PREFILL_TOKENS / w) * max(step, w * macs / (rate * clock)) for w in widths}
    best = min(widths, key=lambda w: (round(seconds[w], 6), w))
    return ChunkChoice(
        best, prefill_s={str(w): round(t, 5) for w, t in seconds.items()}, step_s=round(step, 5),
        macs_per_token=macs, macs_per_s=rate * clock,
        why=f"a {PREFILL_TOKENS}-token prompt in {math.ceil(PREFILL_TOKENS / best)} steps of {best}, predicted "
            f"{1e3 * seconds[best]:.1f} ms against {1e3 * seconds[min(widths)]:.1f} ms in steps of "
            f"{min(widths)}: a step reads every weight once ({1e3 * step:.1f} ms, the decode step's NPU time) "
            f"or computes its tokens' MACs ({macs / 1e6:.0f} M a token at {rate:.0f} MACs a cycle), "
            f"whichever is longer")


def check_context(capacities: list[int], chunk: int) -> None:
    """--max-context and --chunk, before anything is read: a prompt step within the smallest cache, and
    no cache past MAX_CONTEXT."""
    if not capacities or not 1 <= chunk <= capacities[0]:
        raise ShardError(f"--chunk {chunk}: the prompt's step takes 1 to the smallest --max-context "
                         f"({capacities[0] if capacities else '?'}) tokens")
    if capacities[-1] > MAX_CONTEXT:   # a cache of 10,000,000 tokens took 9.7 GB in seconds
        raise ShardError(f"--max-context {capacities[-1]}: at most {MAX_CONTEXT} tokens")


def compile_programs(decoder: Decoder, programs: list[Program], target: str, options: CompileOptions, staging: Path,
                     exports: Path, progress: Progress, vision: bool = True) -> dict[str, dict]:
    """Each program exported and compiled into staging/NAME (a VLM's image program first, where
    `vision`: the one it runs first); {name: its compile report}."""
    steps = {p.name: p for p in programs}
    if decoder.vision and vision:
        steps = {"vision": None, **steps}
    reports = {}
    for name, program in steps.items():
        progress(f"{name}: export", 0, 1)
        path = exports / f"{name}.onnx"
        if program is None:
            decoder.vision[1](path)
        else:
            decoder.export(path, program.width, program.capacity)
        reports[name] = compile_one_model(path, target, staging / name, program_options(
            options, target, program and (lambda: decoder.samples(path, program.width, program.capacity)),
            exports / f"{name}.npz"), lambda what, *a, name=name: progress(f"{name}: {what}", *a)).report
        for done in exports.glob(f"{name}.*"):
            done.unlink()
    return reports


def program_options(options: CompileOptions, target: str, samples: Callable[[], dict] | None,
                    calib: Path) -> CompileOptions:
    """A step's compile options (`samples`: its real prompt's inputs; None for the vision program)."""
    if samples is None:
        return options
    if target in GPU_TARGETS and not options.shards:
        # one stage: a step waits for the one before it, so stages could never overlap, and each
        # hand-off between them costs the host (bench/decode_gpu.py)
        options = replace(options, shards=1)
    if not options.calib:   # the check's inputs: a real prompt's, not random ones
        np.savez(calib, **samples())
        options = replace(options, calib=str(calib))
    return options


def decoder_bytes(model) -> int:
    """Weight bytes a step reads in fp16: every layer, the final norm and the LM head (the embedding
    is a lookup of one row on the host)."""
    from shard.zoo.decoder import text_parts

    body, head, _ = text_parts(model)
    params = sum(p.numel() for p in body.layers.parameters()) + sum(p.numel() for p in body.norm.parameters())
    return 2 * (params + head.weight.numel())


def vision_time(vision: dict, predicted: Predicted | None, bundle: Path | None) -> dict:
    """vision_ms: one square through the vision program; image_ms: the most squares an image splits
    into, run as a stream of frames over the cores (the scheduler's own policy replayed)."""
    seconds = predicted and predicted.latency_s
    times = {"vision_ms": round(1e3 * seconds, 1) if seconds else None}
    squares = vision.get("most", {}).get("squares", 1)
    if seconds and squares > 1 and bundle is not None:
        cores = list(range(max(int(n) for n in predicted.stream_fps)))
        fps = predict_stream(read_manifest(bundle / vision["program"]).shards, predicted.shard_seconds, cores,
                             frames=squares)[1]
        times.update(image_ms=round(1e3 * squares / fps, 1), image_squares=squares, cores=len(cores))
    return times


def predict(spec: GenerativeSpec, reports: dict[str, dict], weight_bytes: int, target: str,
            bundle: Path | None = None, rates: Handoff | None = None) -> list[dict]:
    """Per cache capacity: prefill time for PREFILL_TOKENS and decode tokens/s from the vendor's cycle
    estimates and the board's hand-offs (each program's predicted latency: the sum of its shards',
    writer.npu_prediction; the NPU's share of a decode step apart) and, for decode, from DRAM
    bandwidth (the fp16 weights and the whole cache read once a token: decode at batch 1 is bound by
    it; decode_over_bound compares the NPU's share with it); a VLM's vision time a square and, where
    an image splits into several, for the most squares pipelined over the cores (the vision program
    in `bundle`); and, on a board whose hand-off is known (`rates`), the same with the cache held
    where the NPU reads it (held_speed)."""
    chip = CHIPS.get(target)
    seen = vision_time(spec.vision, predicted_of(reports["vision"]), bundle) if "vision" in reports else {}
    rows = []
    for capacity in spec.capacities:
        steps = {w: predicted_of(reports[p.name]) for w, p in widths(spec, capacity).items()}
        prompt_step = steps[max(steps)]
        decode_step = steps.get(1, prompt_step)   # --one-step: the answer's tokens through the prompt's step
        prefill, decode = prompt_step and prompt_step.latency_s, decode_step and decode_step.latency_s
        handoff = sum(decode_step.handoff_seconds or []) if decode_step else 0.0
        cache_bytes = 2 * spec.layers * spec.kv_heads * spec.head_dim * capacity * 2   # keys and values, fp16
        row = {"capacity": capacity,
               "prefill_128_ms": round(1e3 * prefill * math.ceil(PREFILL_TOKENS / spec.chunk), 2) if prefill else None,
               "decode_tokens_per_s": round(1 / decode, 1) if decode else None,
               "weight_bytes": weight_bytes, "cache_bytes": cache_bytes,
               "from": f"the vendor's cycle estimates of each program's shards (prefill: ceil({PREFILL_TOKENS} / "
                       f"{spec.chunk}) steps)"}
        if 1 in steps and len(steps) > 1 and prefill:
            row["one_step_tokens_per_s"] = round(1 / prefill, 1)   # decoding through the prompt's step (--one-step)
        if chip is not None and chip.dram_gbs:
            bound = (weight_bytes + cache_bytes) / (chip.dram_gbs * 1e9)
            row.update(bandwidth_tokens_per_s=round(1 / bound, 1), dram_gbs=chip.dram_gbs, dram_source=chip.dram_source,
                       decode_over_bound=round((decode - handoff) / bound, 2) if decode else None)
        if handoff and decode:
            # the step's inputs (the whole cache) set on the host every token: the NPU alone beside it
            row.update(decode_handoff_ms=round(1e3 * handoff, 2),
                       decode_npu_tokens_per_s=round(1 / (decode - handoff), 1))
        if rates and bundle is not None:
            row.update(held_speed(spec, capacity, {w: (p, steps[w]) for w, p in widths(spec, capacity).items()},
                                  rates, bundle))
        row.update(seen)   # the vision program's times: the same for every capacity
        if chip is not None and chip.decoder_figures:
            row["published"] = chip.decoder_figures
        rows.append(row)
    return rows


def widths(spec: GenerativeSpec, capacity: int) -> dict[int, Program]:
    """The programs of one cache capacity, by step width."""
    return {p.width: p for p in spec.programs if p.capacity == capacity}


def held_speed(spec: GenerativeSpec, capacity: int, steps: dict[int, tuple[Program, Predicted | None]],
               handoff: Handoff, bundle: Path) -> dict:
    """Prefill and decode with the cache held in NPU memory (shard.runtime.executors.rknn_held), where
    every shard is fp16: each shard the NPU's time and the hand-off of its other inputs and of its
    outputs (the logits, the new keys and values), and the host's writes of the new keys and values
    into the held cache (time_row_writes: measured on the compiling machine's CPU, taken as the
    board's). {} where a program has no NPU time or a shard is not fp16."""
    held = {f"past_{kind}.{i}" for i in range(spec.layers) for kind in ("key", "value")}
    times = {}
    for width, (program, predicted) in steps.items():
        shards = read_manifest(bundle / program.name).shards
        npu = predicted and predicted.npu_seconds
        if not npu or any(shard.precision != "fp16" for shard in shards):
            return {}
        moves = [handoff.between([t for t in shard.inputs if t.name not in held], shard.outputs) for shard in shards]
        write = time_row_writes(spec.layers, spec.kv_heads, spec.head_dim, capacity, width)
        step = predict_stream(shards, [a + b for a, b in zip(npu, moves)], [0])[0] + write
        times[width] = (step, sum(moves), write)
    prompt = times[max(times)]
    decode = times.get(1, prompt)
    return {"held_prefill_128_ms": round(1e3 * prompt[0] * math.ceil(PREFILL_TOKENS / spec.chunk), 2),
            "held_decode_tokens_per_s": round(1 / decode[0], 1), "held_handoff_ms": round(1e3 * decode[1], 2),
            "held_write_ms": round(1e3 * decode[2], 3),
            "held_source": "each shard's vendor cycle estimate; the hand-off of its inputs but the cache, and of its "
                           f"outputs ({handoff.source}; assumed: an input bound with rknn_set_io_mem converts at "
                           "rknn_inputs_set's rate"
                           + ("" if handoff.run_s else "; a run's fixed cost not counted: no published figure "
                              "separates it, `shard probe --on-board` measures it")
                           + "); the new keys and values written into the held cache by the host: measured on the "
                             "compiling machine's CPU (time_row_writes), assumed: the board's the same"}
