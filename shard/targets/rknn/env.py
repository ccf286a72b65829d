"""Create, find and describe the vendor toolkit environments.

rknn-toolkit2 pins old numpy/onnx/torch, so it gets a virtual environment of its own and shard
talks to it through a worker process (see worker.py); the user's environment stays modern.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from shard.errors import ShardError, ToolkitMissing
from shard.targets.chips import CHIPS

MARKER = "shard-toolkit.json"


@dataclass(frozen=True)
class ToolkitSpec:
    """How to build one toolkit environment: pip steps run in order, then an import check."""

    targets: tuple[str, ...]          # the chips it builds for (its support list; shard.targets.chips.CHIPS)
    package: str
    version: str
    steps: tuple[tuple[str, ...], ...]
    check: str

    @property
    def dirname(self) -> str:
        return f"{self.package}-{self.version}"


# The wheel's own pins pull a multi-GB CUDA torch and numpy<=1.26; this order installs the CPU
# torch first, then the toolkit without its pins, then the pins it really needs.
RKNN_TOOLKIT2 = ToolkitSpec(
    targets=tuple(CHIPS),
    package="rknn-toolkit2",
    version="2.5.0",
    steps=(
        ("torch==2.13.0",),
        ("--no-deps", "rknn-toolkit2==2.5.0"),
        ("numpy==1.26.4", "onnx==1.18.0", "protobuf==4.25.4", "onnxruntime<1.27", "setuptools<70",
         "opencv-python-headless", "scipy", "psutil", "ruamel.yaml", "tqdm", "fast-histogram"),
    ),
    check="from rknn.api import RKNN; RKNN()",
)

TOOLKITS = {target: spec for spec in (RKNN_TOOLKIT2,) for target in spec.targets}


def get_spec(target: str) -> ToolkitSpec:
    try:
        return TOOLKITS[target]
    except KeyError:
        raise ShardError(f"no vendor toolkit for target {target!r}; known: {', '.join(TOOLKITS)}") from None


def toolkit_home() -> Path:
    """Where toolkit environments live: $SHARD_TOOLKIT_HOME, else ~/.cache/shard/toolkits."""
    env = os.environ.get("SHARD_TOOLKIT_HOME")
    if env:
        return Path(env).expanduser().resolve()
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "shard" / "toolkits"


def toolkit_dir(target: str) -> Path:
    return toolkit_home() / get_spec(target).dirname


def _env_python(env: Path) -> Path:
    return env / "bin" / "python"


def read_marker(target: str) -> dict | None:
    """The install record of a complete environment, or None where there is none."""
    path = toolkit_dir(target) / MARKER
    if not path.is_file():
        return None
    return json.loads(path.read_text())


def installed_label(target: str) -> str:
    """The installed toolkit as profiles and caches name it, e.g. "rknn-toolkit2 2.5.0"."""
    spec, marker = get_spec(target), read_marker(target) or {}
    return f"{spec.package} {marker.get('packages', {}).get(spec.package) or marker.get('version', 'unknown')}"


def find_python(target: str) -> Path:
    """The toolkit environment's interpreter; ToolkitMissing with the install command if absent."""
    if read_marker(target) is None:
        raise ToolkitMissing(
            f"the {get_spec(target).package} environment for {target} is not installed "
            f"(looked in {toolkit_dir(target)}); run `shard toolkit install {target}`"
        )
    return _env_python(toolkit_dir(target))


def install(target: str, on_step: Callable[[str], None] = lambda msg: None, force: bool = False) -> Path:
    """Create the toolkit environment (idempotent); returns its directory.

    pip prints dependency-conflict ERROR lines about the toolkit's pins and still exits 0; they
    are expected. Set SHARD_TORCH_INDEX_URL to PyTorch's CPU wheel index on a machine where plain
    pip would pick a CUDA build of torch.
    """
    spec = get_spec(target)
    env = toolkit_dir(target)
    env.parent.mkdir(parents=True, exist_ok=True)
    with open(env.parent / f".{spec.dirname}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a second install waits, then finds it done
        if read_marker(target) is not None and not force:
            return env
        if env.exists():
            shutil.rmtree(env)
        log = env.parent / f"{spec.dirname}.install.log"
        started = time.monotonic()
        with open(log, "w") as out:
            def run(step: str, cmd: list[str]) -> None:
                on_step(step)
                out.write(f"$ {' '.join(cmd)}\n")
                out.flush()
                if subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT).returncode != 0:
                    raise ShardError(f"toolkit install failed at: {step}; see {log}")

            run("create virtual environment", [sys.executable, "-m", "venv", str(env)])
            pip = [str(_env_python(env)), "-m", "pip", "install", "--disable-pip-version-check"]
            for packages in spec.steps:
                extra = []
                index = os.environ.get("SHARD_TORCH_INDEX_URL")
                if index and any(p.startswith("torch") for p in packages):
                    extra = ["--index-url", index]
                run(f"pip install {' '.join(packages)}", pip + extra + list(packages))
            run(f"check: {spec.check}", [str(_env_python(env)), "-c", spec.check])
        versions = _installed_versions(env, ("rknn-toolkit2", "torch", "numpy", "onnx", "onnxruntime"))
        record = {"target": target, "package": spec.package, "version": spec.version,
                  "python": str(_env_python(env)), "packages": versions,
                  "install_seconds": round(time.monotonic() - started, 1), "log": str(log)}
        (env / MARKER).write_text(json.dumps(record, indent=2))
        return env


def _installed_versions(env: Path, names: tuple[str, ...]) -> dict[str, str]:
    code = ("import importlib.metadata as m, json, sys\n"
            "out = {}\n"
            "for n in sys.argv[1:]:\n"
            "    try: out[n] = m.version(n)\n"
            "    except m.PackageNotFoundError: out[n] = None\n"
            "print(json.dumps(out))")
    res = subprocess.run([str(_env_python(env)), "-c", code, *names], capture_output=True, text=True, check=True)
    return json.loads(res.stdout)


def status() -> list[dict]:
    """One row per known toolkit: installed or not, versions, where."""
    rows = []
    for spec in dict.fromkeys(TOOLKITS.values()):
        target = spec.targets[0]
        marker = read_marker(target)
        rows.append({"target": ", ".join(spec.targets), "package": spec.package, "version": spec.version,
                     "installed": marker is not None, "path": str(toolkit_dir(target)),
                     "packages": (marker or {}).get("packages", {})})
    return rows
