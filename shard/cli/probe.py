"""`shard probe`: a chip (or a GPU) learnt into a profile."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from shard.cli.common import RAY_HELP, console, progress_bar
from shard.errors import ShardError
from shard.probes.cuda import add_measured_ops, probe_cuda
from shard.probes.families import FAMILIES
from shard.probes.runner import compact, merge_into, probe
from shard.profile import diff_profiles, load_profile, profile_at
from shard.targets.chips import CHIPS, DEFAULT_TARGET
from shard.targets.rknn.cache import default_cache_dir

app = typer.Typer(add_completion=False)


@app.command("probe")
def probe_command(
    target: str = typer.Option(DEFAULT_TARGET, help="The chip whose compiler is probed (any Rockchip chip the toolkit "
                                              "builds for: its peak rates, quantized dtypes and limits; int8-only "
                                              "chips in int8; several: C1,C2,...; all: every one, each to "
                                              "./CHIP.profile.json); cuda measures the GPU at hand (bandwidth, "
                                              "matrix-product rates) for the roofline."),
    families: Optional[str] = typer.Option(None, help="Comma-separated families [default: all]; see --list."),
    jobs: int = typer.Option(2, "--jobs", "-j", help="Builds at a time (one toolkit worker each)."),
    ray: Optional[str] = typer.Option(None, "--ray", help=RAY_HELP),
    max_size: Optional[int] = typer.Option(None, help="Probe no size above this (caps every family)."),
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="Profile to write [default: ./TARGET.profile.json]. "
                                                                "An existing profile there keeps the limits not probed now."),
    replace: bool = typer.Option(False, help="Do not keep the limits of an existing --out profile."),
    cache_dir: Optional[Path] = typer.Option(None, help="Where probed points are kept [default: ~/.cache/shard/probes "
                                                        "or $SHARD_PROBE_CACHE]."),
    no_cache: bool = typer.Option(False, help="Build every point again (the cache is still written)."),
    slow_factor: float = typer.Option(4.0, help="A point is `slow` when the compiler's estimated cycles per MAC "
                                                "exceed the peak rate by this factor."),
    timeout: float = typer.Option(300.0, help="Seconds one probe build may take; past it the point fails (timeout)."),
    on_board: bool = typer.Option(False, help="Also run each clean point on NPU core 0 with rknn-toolkit-lite2 "
                                              "(on a board of the target chip); a failure there is class `board`."),
    list_families: bool = typer.Option(False, "--list", help="List the families and exit."),
    diff: Optional[tuple[str, str]] = typer.Option(None, "--diff", help="A B: the limits and facts that differ "
                                                                        "between two profiles (files, or shipped "
                                                                        "ones by target name), and exit."),
    ops: Optional[Path] = typer.Option(None, "--ops", help="--target cuda: also time every distinct op of this "
                                                           "thor/cuda bundle on the GPU, and each step of its "
                                                           "fused form (added to --out)."),
) -> None:
    """Learn a target's real limits: tiny ONNX graphs through the real compiler, double then bisect."""

    if diff:
        return print_profile_diff(*diff)
    if list_families:
        table = Table(title="probe families")
        for col in ("family", "graph (N is swept)", "settings", "kind"):
            table.add_column(col)
        for f in FAMILIES.values():
            kind = ("numeric (simulator)" if f.numeric else "slow + build" if f.macs else "build") \
                + (f", every N in {f.start}..{f.max_size} (not monotone)" if f.sweep else "")
            table.add_row(f.name, f.what, ", ".join(f.settings), kind)
        console.print(table)
        return
    if jobs < 1 or (max_size is not None and max_size < 1):
        raise ShardError("--jobs and --max-size must be at least 1")
    if target == "cuda":   # a GPU: measured rates and bandwidth, no compiler limits to search
        return probe_gpu(out or Path("cuda.profile.json"), ops)

    chips = list(CHIPS) if target == "all" else target.split(",")
    if len(chips) > 1 and out is not None:
        raise ShardError("-o names one profile: with several chips each goes to ./CHIP.profile.json")
    for chip in chips:
        if len(chips) > 1:
            console.rule(chip)
        probe_chip(chip, out or Path(f"{chip}.profile.json"), replace, default_cache_dir() if cache_dir is None else
                   cache_dir, families=families.split(",") if families else None, jobs=jobs, max_size=max_size,
                   read_cache=not no_cache, slow_factor=slow_factor, timeout=timeout, on_board=on_board, ray=ray)


def probe_chip(target: str, out: Path, replace: bool, cache: Path, **how) -> None:
    """One chip's probe (shard.probes.runner.probe with `how`): its limits printed, its profile written."""

    started = time.perf_counter()
    with progress_bar() as progress:
        profile, searches = probe(target, cache_dir=cache, progress=progress, **how)
    table = Table(title=f"{target} limits ({profile.toolkit})")
    for col in ("limit", "largest ok", "first failing", "class", "builds", "evidence"):
        table.add_column(col, justify="right" if col in ("largest ok", "first failing", "builds") else "left",
                         overflow="fold")
    builds = cached = 0
    for s in searches:
        b = s.boundary
        builds += b.builds
        cached += len(b.points) - b.builds
        lim = profile.limits[s.name]
        table.add_row(s.name, str(b.largest_ok), str(b.smallest_failing or "-"), lim.failure,
                      f"{b.builds}/{len(b.points)}", (b.failing_point.evidence if b.failing_point else "clean")[:160])
    console.print(table)
    if not replace:
        profile, kept = merge_into(out, profile)
        if kept:
            console.print(f"kept {kept} limits of {out} that this run did not probe")
    profile.save(out)
    console.print(f"{len(searches)} limits, {builds} builds, {cached} points from the cache ({cache}); "
                  f"{time.perf_counter() - started:.1f} s")
    console.print(f"profile: {out}")


def print_profile_diff(a_spec: str, b_spec: str) -> None:
    """`shard probe --diff A B`: what a user checks after a toolkit upgrade or on a new chip."""

    a, b = profile_at(a_spec), profile_at(b_spec)
    limits, facts = diff_profiles(a, b)
    table = Table(title=f"limits that differ: A = {a_spec} ({a.target}, {a.toolkit}), B = {b_spec} ({b.target}, "
                        f"{b.toolkit})")
    for col in ("limit", "A", "B", "A's evidence", "B's evidence"):
        table.add_column(col, overflow="fold", justify="right" if col in ("A", "B") else "left")

    def show(lim) -> str:
        if lim is None:
            return "-"
        return f"{lim.value} ({lim.failure})" if lim.passing is None else f"passes at {compact(lim.passing)} ({lim.failure})"
    for d in limits:
        table.add_row(d.name, show(d.a), show(d.b), d.a.evidence if d.a else "not probed",
                      d.b.evidence if d.b else "not probed")
    console.print(table)
    for name, (x, y) in facts.items():
        console.print(f"fact {name}: A {x!r}, B {y!r}")
    same = len({*a.limits, *b.limits}) - len(limits)
    console.print(f"{len(limits)} limits differ, {same} agree; {len(facts)} facts differ")


def probe_gpu(out: Path, ops: Path | None) -> None:

    with progress_bar() as progress:
        profile = load_profile("cuda", out) if ops and out.exists() else probe_cuda(progress)
        if ops:
            console.print(f"{add_measured_ops(profile, ops, progress)} distinct ops of {ops} timed")
    f = profile.facts
    console.print(f"{f['gpu']}: {f['sms']} SMs, DRAM {f['bandwidth_gbs']:.0f} GB/s, shortest kernel "
                  f"{1e6 * f['min_kernel_s']:.2f} us")
    table = Table(title="matrix products, TFLOP/s by size")
    table.add_column("precision")
    for gflop, _ in next(iter(f["gemm_tflops"].values())):
        table.add_column(f"{gflop:g} GFLOP", justify="right")
    for precision, points in f["gemm_tflops"].items():
        table.add_row(precision, *(f"{t:.1f}" for _, t in points))
    console.print(table)
    profile.save(out)
    console.print(f"profile: {out} (use it with --target cuda --profile {out})")
