"""`shard run`: a bundle run on a backend (here, on a board over Ray, or bucket by bucket)."""

from __future__ import annotations

import io
import time
from pathlib import Path
from typing import Optional

import numpy as np
import typer
from rich.table import Table

from shard import scratch
from shard.bundle import TensorSpec, read_manifest
from shard.cli.common import console, progress_bar
from shard.errors import RunError, ShardError
from shard.options import check_seconds
from shard.pack import pack_bundle
from shard.runtime import Session, load, random_inputs
from shard.runtime.__main__ import check_save, read_inputs, save_outputs
from shard.runtime.buckets import is_bucketed
from shard.targets.rknn.remote import on_board, run_pack

app = typer.Typer(add_completion=False)


RUN_HELP = {   # the longer option helps of `shard run`
    "input": 'NAME=FILE.npy (FILE.npy for a model with one input); seeded random inputs if absent.',
    "backend": 'cpu, sim (rknn simulator), board (a Rockchip board), cuda (any NVIDIA GPU with torch) or tensorrt '
        '(engines from build-engines) [default: sim for Rockchip chips, cuda for thor and cuda].',
    "schedule": "balanced (any free core takes the most urgent ready shard) or round-robin (the manifest's placement;"
        ' less memory) [default: balanced; round-robin, a stream per stage, on GPUs].',
    "ray": "--backend board on a node of this Ray cluster that owns a board of the bundle's chip, one run per "
        'board at a time.',
}


@app.command("run")
def run_command(
    bundle: Path = typer.Argument(..., help="A bundle from `shard compile`."),
    input: list[str] = typer.Option([], "--input", "-i", help=RUN_HELP["input"]),
    backend: Optional[str] = typer.Option(None, help=RUN_HELP["backend"]),
    repeat: int = typer.Option(1, help="Run this many frames one after another (timings are per run)."),
    stream: int = typer.Option(0, help="Pipeline this many frames over the cores instead (throughput)."),
    cores: Optional[str] = typer.Option(None, help="NPU cores to use, e.g. 0,1,2 [default: the manifest's]."),
    schedule: Optional[str] = typer.Option(None, help=RUN_HELP["schedule"]),
    timeout: Optional[float] = typer.Option(None, help="Stop with an error if one shard runs longer (seconds)."),
    trace: Optional[Path] = typer.Option(None, help="Write every shard execution as a Chrome trace (Perfetto)."),
    seed: int = typer.Option(0, help="Seed of the random inputs (frame t of a stream uses seed + t)."),
    save: Optional[Path] = typer.Option(None, help="Directory to write the last frame's outputs as NAME.npy."),
    ray: Optional[str] = typer.Option(None, "--ray", help=RUN_HELP["ray"]),
) -> None:
    """Run a bundle; print the time of each shard, each core's utilisation and the outputs' shapes."""

    check_run_options(repeat, stream, timeout)
    check_save(save, bundle)
    if ray:
        return run_on_board_node(bundle, ray, input, repeat, save, timeout,
                                 others=backend not in (None, "board") or bool(stream or trace or cores or schedule))
    if is_bucketed(bundle):
        if stream or trace:   # a stream and its trace are one bucket's (its cores, its shards)
            raise ShardError(f"--stream and --trace run one bucket of a bundle of shape buckets: shard run "
                             f"{bundle}/b0 ... (the buckets are {bundle}/b0, b1, ...)")
        return run_buckets(bundle, input, backend, repeat, seed, save,
                           dict(cores=parse_cores(cores), schedule=schedule, timeout=timeout))
    frames = stream or repeat
    with progress_bar() as progress:
        progress(f"load ({backend or 'default backend'})", 0, 1)
        session = Session(bundle, backend, parse_cores(cores), schedule, timeout)
        try:
            given = read_inputs(input, [t.name for t in session.manifest.inputs]) if input else None
            specs = session.batching.frame_inputs if stream else session.manifest.inputs   # --batch B: stacked
            outputs, wall = run_frames(session, (given or random_inputs(specs, seed + t) for t in range(frames)),
                                       frames, bool(stream), progress)
        finally:
            session.close()
    print_run(session, frames, outputs, trace)
    if save:
        save_outputs(outputs, save)
    if stream:
        console.print(f"{frames} frames in {wall:.2f} s: {frames / wall:.2f} frames/s")
    else:
        console.print(f"{1000 * wall / frames:.1f} ms per run")


def run_frames(session, inputs, frames: int, stream: bool, progress) -> tuple[dict, float]:
    """The last frame's outputs and the wall seconds of `frames` run one after another, or pipelined
    over the cores (`stream`)."""
    started = time.perf_counter()
    if stream:
        for k, outputs in enumerate(session.run_stream(inputs)):
            progress(f"stream over cores {','.join(map(str, session.cores))}", k + 1, frames)
    else:
        for k, frame in enumerate(inputs):
            progress("run", k, frames)
            outputs = session.run(frame)
        progress("run", frames, frames)
    return outputs, time.perf_counter() - started


def print_run(session, frames: int, outputs: dict, trace: Path | None) -> None:
    """Each shard's mean time, the host steps', each core's use, the trace and the outputs' shapes."""
    table = Table(title=f"per-shard time ({session.backend}, {session.schedule}, mean of {frames})")
    for col in ("shard", "cores", "ms"):
        table.add_column(col, justify="left" if col == "shard" else "right")
    for t in session.timings.values():
        table.add_row(t.name, ",".join(map(str, sorted(t.cores))), f"{1000 * sum(t.seconds) / len(t.seconds):.1f}")
    console.print(table)
    steps = session.manifest.host_pre + session.manifest.host_post
    if steps:
        console.print(f"host steps ({', '.join(s.get('type', s['op']) for s in steps)}): "
                      f"{1000 * session.host_seconds / max(1, session.frames_run):.2f} ms per frame")
    for use in session.core_use():
        console.print(f"core {use.core}: {100 * use.utilisation:.1f}% busy ({use.runs} shard runs, "
                      f"{use.busy:.3f} s of {use.span:.3f} s)")
    if trace:
        console.print(f"trace: {session.write_trace(trace)} (open in ui.perfetto.dev)")
    for name, array in outputs.items():
        console.print(f"output {name}: shape {list(array.shape)} {array.dtype}")


def run_on_board_node(bundle: Path, address: str, input: list[str], repeat: int, save: Path | None,
                      timeout: float | None = None, others: bool = False) -> None:
    """`shard run --backend board --ray`: the bundle packed and run by the runtime's own command on a
    node of the cluster that owns a board of its chip (shard.targets.rknn.remote.run_pack), each shard
    stopped past `timeout` seconds there; what it printed shown here, its outputs saved here. `others`:
    whether options it cannot pass on were given."""

    if others:
        raise ShardError("--ray runs the bundle on a board's node as `python -m shard.runtime` does: "
                         "--backend board with --input, --repeat, --save and --timeout only")
    manifest = read_manifest(bundle)
    given = read_inputs(input, [t.name for t in manifest.inputs]) if input else {}
    with scratch.temporary("board-pack") as tmp:
        pack = Path(tmp) / f"{bundle.resolve().name.removesuffix('.shard') or 'model'}.tar.gz"
        data = pack_bundle(bundle, pack).read_bytes()
    sent = {}
    for name, array in given.items():
        buffer = io.BytesIO()
        np.save(buffer, array)
        sent[name] = buffer.getvalue()
    with console.status(f"running on a {manifest.target} board of the Ray cluster at {address}"):
        code, out, err, outputs = on_board(address, manifest.target, run_pack, data, sent, repeat, timeout)
    if code != 0:
        lines = [line.removeprefix("error: ") for line in err.splitlines() if line.strip()]
        raise RunError(f"on the {manifest.target} board's Ray node: {lines[-1] if lines else f'exit code {code}'}")
    console.print(out.rstrip(), highlight=False)
    if save:
        save.mkdir(parents=True, exist_ok=True)
        for name, npy in outputs.items():
            (save / f"{name}.npy").write_bytes(npy)


def run_buckets(bundle: Path, input: list[str], backend: str | None, repeat: int, seed: int, save: Path | None,
                session_args: dict) -> None:
    """`shard run` on a bundle of shape buckets: each frame on the smallest bucket its inputs fit (each
    bucket's session with the cores, schedule and timeout asked for)."""

    with load(bundle, backend=backend, **session_args) as session:
        largest = session.spec.buckets[-1]
        names = list(largest.inputs)
        given = read_inputs(input, names) if input else None
        if given is None:   # seeded inputs of the largest bucket's shapes

            dtypes = {t.name: t.dtype for t in session.session(largest).manifest.inputs}
            given = random_inputs([TensorSpec(n, s, dtypes[n]) for n, s in largest.inputs.items()], seed)
        bucket = session.pick(given)
        started = time.perf_counter()
        for _ in range(repeat):
            outputs = session.run(given)
        wall = time.perf_counter() - started
    console.print(f"bucket {bucket.name} ({', '.join(f'{k}={v}' for k, v in bucket.inputs.items())}) for inputs "
                  f"{', '.join(f'{k}={list(v.shape)}' for k, v in given.items())}")
    for name, array in outputs.items():
        console.print(f"output {name}: shape {list(array.shape)} {array.dtype}")
    if save:
        save_outputs(outputs, save)
    console.print(f"{1000 * wall / repeat:.1f} ms per run")


def parse_cores(text: str | None) -> list[int] | None:
    if text is None:
        return None
    try:
        return [int(c) for c in text.split(",")]
    except ValueError:
        raise ShardError(f"--cores {text!r}: expected core numbers such as 0,1,2") from None


def check_run_options(repeat: int, stream: int, timeout: float | None) -> None:
    if repeat < 1 or stream < 0:
        raise ShardError("--repeat must be at least 1 and --stream at least 0")
    check_seconds(timeout)
