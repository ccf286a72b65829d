"""`shard verify`: a bundle (or a generative one) against its reference."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from shard.bundle import read_manifest
from shard.calibration import load_samples
from shard.cli.common import bucket_title, console, err, progress_bar
from shard.compare import lowest, worst_of
from shard.errors import ShardError
from shard.output_files import check_output_file
from shard.runtime.buckets import is_bucketed, read_buckets
from shard.runtime.generative_bundle import is_generative
from shard.verifier import PROMPTS, verify_bundle, verify_generative

app = typer.Typer(add_completion=False)


@app.command("verify")
def verify_command(
    bundle: Path = typer.Argument(..., help="A bundle from `shard compile`."),
    reference: Path = typer.Option(..., "--reference", "-r", help="The original ONNX model."),
    backend: Optional[str] = typer.Option(None, help="cpu, sim, cuda or tensorrt [default: sim for Rockchip chips, cuda for "
                                                     "thor and cuda]."),
    min_cosine: float = typer.Option(0.999, help="Fail (exit 1) if an output's cosine is below this."),
    seed: int = typer.Option(0, help="Seed of the random inputs."),
    inputs: Optional[Path] = typer.Option(None, "--inputs", help="Samples to run, an .npz of arrays named after "
                                          "the model's inputs with a leading sample axis [default: one seeded "
                                          "random sample]."),
    json_out: Optional[Path] = typer.Option(None, "--json", help="Also write the report here."),
    force: bool = typer.Option(False, "--force", help="Replace the --json file if one is there."),
    prompt: list[str] = typer.Option([], "--prompt", help="A generative bundle: a chat prompt to check (repeatable) "
                                                          "[default: two built-in prompts]."),
    new: int = typer.Option(32, help="A generative bundle: greedy tokens compared per prompt."),
    forced: int = typer.Option(32, help="A generative bundle: teacher-forced steps per prompt."),
    min_top1: float = typer.Option(0.99, help="A generative bundle: fail below this share of teacher-forced steps "
                                              "whose most likely token is the reference's."),
) -> None:
    """Check a bundle against the original model: end to end, and each shard fed the reference's tensors
    (the last column: the same tensor in the end-to-end run, so where along the shards fidelity drops).
    A bundle of shape buckets is checked bucket by bucket; a generative bundle against its checkpoint
    (GGUF or transformers folder), prompt by prompt: greedy tokens and teacher-forced logits."""

    if json_out:
        check_output_file(json_out, "--json", bundle, force)
    if is_generative(bundle):
        return verify_decoder(bundle, reference, backend, prompt, new, forced, min_cosine, min_top1, json_out)
    if not is_bucketed(bundle):
        reports = {"": verify_one(bundle, reference, backend, min_cosine, seed, inputs)}
    else:
        reports = {}
        for b in read_buckets(bundle).buckets:
            console.rule(bucket_title(b))
            reports[b.name] = verify_one(bundle / b.name, reference, backend, min_cosine, seed, inputs)
    if json_out:
        data = {name: {**asdict(r), "passed": r.passed} for name, r in reports.items()}
        json_out.write_text(json.dumps(data[""] if "" in data else data, indent=2) + "\n")
    worst = worst_of(c for r in reports.values() for c in r.outputs).cosine
    if not all(r.passed for r in reports.values()):
        err.print(f"[red]FAIL[/]: end-to-end cosine {worst:.7f} < {min_cosine}")
        raise typer.Exit(1)
    console.print(f"[green]PASS[/]: end-to-end cosine {worst:.7f} >= {min_cosine}"
                  + (f" on every bucket ({len(reports)})" if len(reports) > 1 else ""))


def verify_decoder(bundle: Path, reference: Path, backend, prompts: list[str], new: int, forced: int,
                   min_cosine: float, min_top1: float, json_out: Path | None) -> None:
    """verify_generative with its table printed; exit 1 below either threshold."""

    if new < 1 or forced < 1:
        raise ShardError("--new and --forced must be at least 1")
    with progress_bar() as progress:
        report = verify_generative(bundle, reference, prompts or PROMPTS, new, forced, backend, min_cosine, min_top1,
                                   progress)
    for rel, check in report.files.items():
        console.print(f"file {rel}: {check}")
    table = Table(title=f"verify ({report.backend}) vs {report.reference}, chat prompts")
    for col in ("prompt", "tokens", f"greedy {new}", "forced steps", "top-1", "worst cosine", "mean cosine"):
        table.add_column(col, justify="left" if col == "prompt" else "right")
    for p in report.prompts:
        table.add_row(p.prompt, str(p.prompt_tokens), "same" if p.same_tokens else "[yellow]differ[/]", str(p.steps),
                      f"{p.top1:.4f}", f"{p.min_cosine:.7f}", f"{p.mean_cosine:.7f}")
    console.print(table)
    for p in report.prompts:
        if p.parting:
            console.print(f"{p.prompt!r} parts {p.parting}")
    if not report.reference_is_source:
        console.print("[yellow]warning[/]: the reference is not the checkpoint this bundle was compiled from (sha256 differs)")
    if json_out:
        json_out.write_text(json.dumps({**asdict(report), "passed": report.passed}, indent=2) + "\n")
    worst = lowest(p.min_cosine for p in report.prompts)
    top1 = min(p.top1 for p in report.prompts)
    line = f"worst teacher-forced cosine {worst:.7f}, top-1 agreement {top1:.4f}"
    if not report.passed:
        err.print(f"[red]FAIL[/]: {line} (at least {min_cosine} and {min_top1} asked)")
        raise typer.Exit(1)
    console.print(f"[green]PASS[/]: {line}; greedy tokens the same on "
                  f"{sum(p.same_tokens for p in report.prompts)} of {len(report.prompts)} prompts")


def verify_one(bundle: Path, reference: Path, backend, min_cosine: float, seed: int, inputs: Path | None):
    """verify_bundle with its tables printed."""

    samples = load_samples(inputs, read_manifest(bundle).inputs, "--inputs") if inputs else None
    with progress_bar() as progress:
        report = verify_bundle(bundle, reference, backend, min_cosine, seed, progress=progress, samples=samples)
    for rel, check in report.files.items():
        console.print(f"file {rel}: {check}")
    if len(report.samples) > 1:
        per_sample = Table(title=f"{len(report.samples)} samples from {inputs.name}")
        for col in ("sample", "output", "cosine", "max abs diff"):
            per_sample.add_column(col, justify="right")
        for k, comps in enumerate(report.samples):
            for c in comps:
                per_sample.add_row(str(k), c.name, f"{c.cosine:.7f}", f"{c.max_abs_diff:.3g}")
        console.print(per_sample)
    table = Table(title=f"verify ({report.backend}) vs onnxruntime fp32")
    for col in ("where", "tensor", "cosine", "max abs diff", "end to end so far"):
        table.add_column(col, justify="left" if col in ("where", "tensor") else "right")
    for c in report.outputs:
        where = "end to end" if len(report.samples) < 2 else "end to end, worst sample"
        table.add_row(where, c.name, f"{c.cosine:.7f}", f"{c.max_abs_diff:.3g}", "")
    for shard, comps in report.shards.items():  # fed the reference's tensors; then as chained end to end
        for c, chained in zip(comps, report.chained.get(shard, [None] * len(comps))):
            table.add_row(shard, c.name, f"{c.cosine:.7f}", f"{c.max_abs_diff:.3g}",
                          f"{chained.cosine:.7f}" if chained else "")
    console.print(table)
    for shard, why in report.skipped_shards.items():
        console.print(f"[yellow]warning[/]: {shard} not checked alone: {why}")
    if not report.reference_is_source:
        console.print("[yellow]warning[/]: the reference is not the model this bundle was compiled from (sha256 differs)")
    return report
