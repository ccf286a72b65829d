"""Load a bundle and run it. Imports numpy and the chosen executor's library, nothing else.

    session = shard.load("model.shard", backend="sim")
    outputs = session.run({"pixel_values": x})
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from shard.bundle import Manifest, read_manifest
from shard.errors import RunError
from shard.runtime.executors import Executor, make_executor


@dataclass
class ShardTiming:
    name: str
    core: int
    seconds: list[float] = field(default_factory=list)


class Session:
    """A bundle ready to run: every shard prepared once by one executor."""

    def __init__(self, bundle: str | Path, backend: str | None = None, executor: Executor | None = None):
        self.bundle = Path(bundle)
        self.manifest: Manifest = read_manifest(self.bundle)
        self.backend = backend or default_backend(self.manifest)
        self.executor = executor or make_executor(self.backend, self.bundle, self.manifest)
        self.timings = {s.name: ShardTiming(s.name, s.core) for s in self.manifest.shards}

    def check_inputs(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The graph inputs, complete and of the compiled shapes and dtypes."""
        expected = {t.name: t for t in self.manifest.inputs}
        missing = set(expected) - set(inputs)
        extra = set(inputs) - set(expected)
        if missing or extra:
            raise RunError(f"inputs must be exactly {', '.join(expected)}; "
                           f"missing {sorted(missing) or 'none'}, unknown {sorted(extra) or 'none'}")
        checked = {}
        for name, spec in expected.items():
            array = np.asarray(inputs[name])
            if list(array.shape) != spec.shape:
                raise RunError(f"input {name}: shape {list(array.shape)}, the bundle was compiled for {spec.shape}")
            checked[name] = array.astype(spec.dtype, copy=False)
        return checked

    def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run every shard in dependency order (the manifest's order) and return the graph outputs."""
        tensors = self.check_inputs(inputs)
        for shard in self.manifest.shards:
            started = time.perf_counter()
            tensors.update(self.executor.run(shard, tensors))
            self.timings[shard.name].seconds.append(time.perf_counter() - started)
        return {t.name: tensors[t.name] for t in self.manifest.outputs}

    def close(self) -> None:
        self.executor.close()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def default_backend(manifest: Manifest) -> str:
    return "cpu" if manifest.target == "cpu" else "sim"


def load(bundle: str | Path, backend: str | None = None) -> Session:
    """Open a bundle for running; backend is cpu, sim (rknn simulator) or board (on an RK3588)."""
    return Session(bundle, backend)


def random_inputs(specs, seed: int = 0) -> dict[str, np.ndarray]:
    """Seeded inputs for a bundle's or model's input specs: normal floats, small non-negative ints."""
    rng = np.random.default_rng(seed)
    out = {}
    for spec in specs:
        dtype = np.dtype(spec.dtype)
        if dtype.kind == "f":
            out[spec.name] = rng.standard_normal(spec.shape).astype(dtype)
        else:  # ids, masks, flags: 0 and 1 are valid for any vocabulary
            out[spec.name] = rng.integers(0, 2, spec.shape).astype(dtype)
    return out
