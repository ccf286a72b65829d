"""`shard generate`: text from a generative bundle."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from shard.cli.common import console, err, parse_ids
from shard.errors import ShardError
from shard.options import check_seconds
from shard.output_files import check_output_file
from shard.runtime.generate import GenerativeSession
from shard.runtime.generative_bundle import is_generative

app = typer.Typer(add_completion=False)


@app.command("generate")
def generate_command(
    bundle: Path = typer.Argument(..., help="A generative bundle: `shard compile` of a decoder."),
    prompt: Optional[str] = typer.Option(None, "--prompt", "-p", help="The prompt, as text."),
    ids: Optional[str] = typer.Option(None, help="The prompt as token ids, comma-separated, instead of text."),
    chat: bool = typer.Option(False, help="Wrap the prompt in the model's own chat template."),
    image: list[Path] = typer.Option([], "--image", help="A VLM's bundle: an image the prompt is about (repeatable)."),
    max_new_tokens: int = typer.Option(32, help="Stop after this many new tokens (or at a stop token)."),
    temperature: float = typer.Option(0.0, help="0: greedy; above 0: sampled at this temperature."),
    top_p: float = typer.Option(1.0, help="Sample from the most likely tokens whose probability reaches this."),
    seed: int = typer.Option(0, help="Seed of the sampling."),
    backend: Optional[str] = typer.Option(None, help="cpu, sim (rknn simulator), board, cuda "
                                                     "[default: the bundle's target's first]."),
    timeout: Optional[float] = typer.Option(None, help="Stop with an error if one shard runs longer (seconds)."),
    json_out: Optional[Path] = typer.Option(None, "--json", help="Write the prompt's and the answer's token ids, "
                                                                 "the text and every step's time here."),
    force: bool = typer.Option(False, "--force", help="Replace the --json file if one is there."),
    hand_cache: bool = typer.Option(False, "--hand-cache", help="board: hand the cache to rknn-toolkit-lite2 every "
                                                                "step rather than hold it in NPU memory."),
) -> None:
    """Generate text with a decoder's bundle: the prompt in chunks, then a token a step, streamed."""

    if json_out:
        check_output_file(json_out, "--json", bundle, force)
    check_seconds(timeout)
    if (prompt is None) == (ids is None):
        raise ShardError("give the prompt as --prompt TEXT or as --ids 1,2,3 (one of the two)")
    if not bundle.exists():
        raise ShardError(f"{bundle}: no such bundle (nothing there); compile a decoder (a GGUF file or a transformers "
                         f"folder) with `shard compile`")
    if not is_generative(bundle):
        raise ShardError(f"{bundle} is not a generative bundle (compile a decoder: a GGUF file or a transformers "
                         f"folder); run it with `shard run`")
    given = prompt if ids is None else parse_ids(ids)
    with GenerativeSession(bundle, backend=backend, timeout=timeout, held=not hand_cache) as session:
        show = (lambda text: print(text, end="", flush=True)) if prompt is not None else None
        out = session.generate(given, max_new_tokens, chat, temperature, top_p, seed, images=image or None,
                               on_text=show)
    if prompt is None:
        console.print(" ".join(map(str, out.tokens)))
    else:
        print()
    if out.full:
        err.print(f"[yellow]warning[/]: stopped after {len(out.tokens)} new tokens of --max-new-tokens {max_new_tokens}: "
                  f"the prompt's {len(out.prompt)} and they fill the cache's capacity of {out.full} (compile with a "
                  f"larger --max-context)")
    seen = f"image {sum(out.vision_ms):.1f} ms, " if out.vision_ms else ""
    err.print(f"{len(out.prompt)} prompt tokens, {len(out.tokens)} new; {seen}prefill {sum(out.prefill_ms):.1f} ms "
              f"in {len(out.prefill_ms)} steps, decode {out.decode_tokens_per_s} tokens/s ({session.backend})")
    if json_out:
        json_out.write_text(json.dumps(out.to_json(), indent=2) + "\n")
