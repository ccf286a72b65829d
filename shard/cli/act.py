"""`shard act`: an action chunk from a VLA bundle for one observation."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import numpy as np
import typer
from rich.markup import escape

from shard.cli.common import console
from shard.errors import ShardError
from shard.output_files import check_output_file
from shard.runtime.vla import VlaSession, is_vla, read_observations, seeded_observation

app = typer.Typer(add_completion=False)


@app.command("act")
def act_command(
    bundle: Path = typer.Argument(..., help="A VLA bundle: `shard compile` of a VLA folder (shard zoo export pi0)."),
    observation: Optional[Path] = typer.Option(None, help="An .npz of pixel_values [cameras, 3, S, S], tokens [T] "
                                                          "and state [1, actions] (noise optional) [default: seeded]."),
    steps: int = typer.Option(10, help="Euler steps of the denoising loop."),
    backend: Optional[str] = typer.Option(None, help="cuda or cpu [default: the bundle's target's first]."),
    seed: int = typer.Option(0, help="Seed of the observation (without --observation) and of the noise."),
    repeat: int = typer.Option(1, help="Run the observation this many times; print the median times."),
    save: Optional[Path] = typer.Option(None, help="Write the action chunk here (.npy)."),
    force: bool = typer.Option(False, "--force", help="Replace the --save file if one is there."),
) -> None:
    """Run one observation through a VLA bundle: its images' features, the prefix's cache, then STEPS
    denoising steps against it; print the action chunk and each part's time."""
    if not is_vla(bundle):
        raise ShardError(f"{bundle}: not a VLA bundle (no vla.json); compile a VLA folder with `shard compile`")
    if save is not None:
        check_output_file(save, "--save", bundle, force)
    if repeat < 1:
        raise ShardError(f"--repeat {repeat}: at least 1")
    with VlaSession(bundle, backend=backend) as session:
        obs = read_observation(observation, session.spec, seed)
        acts = [session.act(obs["pixel_values"], obs["tokens"], obs["state"], obs.get("noise"), steps, seed)
                for _ in range(repeat)]
    actions = acts[-1].actions
    parts = {k: float(np.median([a.seconds[k] for a in acts])) for k in acts[0].seconds}
    first = np.array2string(actions[0, 0, :6], precision=3)
    console.print(f"actions {list(actions.shape)} on {session.backend}: the first's first six {escape(first)}")
    console.print(", ".join(f"{k} {1e3 * v:.2f} ms" for k, v in parts.items())
                  + f"; {1e3 * sum(parts.values()):.2f} ms in all ({steps} steps)")
    if save is not None:
        np.save(save, actions)
        console.print(f"wrote {save}")


def read_observation(path: Path | None, spec, seed: int) -> dict[str, np.ndarray]:
    """The observation in `path`, each array checked against the bundle's shapes; seeded without one."""
    return seeded_observation(spec, seed) if path is None else read_observations(path, spec, "--observation")[0]
