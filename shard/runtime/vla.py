"""A vision-language-action bundle (a VLA's prefix-then-denoise loop: shard.zoo.vla) and VlaSession,
which runs it: an observation (each camera's pixels, the prompt's token ids, the robot's state) in,
a chunk of actions out.

    pi0.shard/vla.json         the shapes, each program's folder, the files it records by sha256
    pi0.shard/vision/          pixel_values [cameras, 3, S, S] -> image_features [cameras, patches, width]
    pi0.shard/prefix/          prefix_embeds [1, P, width] -> key.i, value.i, each layer's keys and values
    pi0.shard/step/            x_t, time, state, key.i, value.i -> velocity: one Euler step's
    pi0.shard/embeddings.npy   the prompt's token embeddings, looked up on the host

The prefix runs once per observation; its keys and values go into the step program's own input
buffers where its backend keeps tensors on a device (executors.traits_of: the GPU), and the step runs
`steps` times against them: on a GPU as one CUDA graph of the whole loop, elsewhere one run a step.
Where every program is one captured stage, the whole observation is one CUDA graph (ObservationGraph),
in which the steps read the keys and values where the prefix wrote them. numpy only, and the
executor's library.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from shard.bundle import read_manifest, read_versioned, sealed_digest
from shard.errors import BundleError, RunError
from shard.runtime.executors import to_host, traits_of
from shard.runtime.executors.gpu import copy_into, failure
from shard.runtime.generative_bundle import EMBEDDINGS, load_checked
from shard.runtime.session import OnDevice, Session, default_backend

VLA = "vla.json"
SCHEMA_VERSION = 1
PROGRAMS = ("vision", "prefix", "step")


@dataclass
class VlaSpec:
    name: str              # the zoo model it came from
    seed: int
    cameras: int
    image_size: int
    text_tokens: int
    width: int             # the prefix's
    layers: int            # the prefix's (each one key and value the step reads)
    kv_heads: int
    head_dim: int
    prefix_tokens: int
    horizon: int
    actions: int
    vocab: int
    files: dict = field(default_factory=dict)   # {"embeddings.npy": [bytes, sha256]} in a bundle
    schema_version: int = SCHEMA_VERSION
    digest: str = ""

    @classmethod
    def of(cls, config, name: str, seed: int) -> VlaSpec:
        """The spec of a zoo VlaConfig."""
        return cls(name=name, seed=seed, cameras=config.cameras, image_size=config.image_size,
                   text_tokens=config.text_tokens, width=config.prefix.width, layers=config.prefix.depth,
                   kv_heads=config.prefix.kv_heads, head_dim=config.prefix.head_dim,
                   prefix_tokens=config.prefix_tokens, horizon=config.horizon, actions=config.actions,
                   vocab=config.vocab)

    def to_json(self) -> str:
        self.digest = sealed_digest(asdict(self))
        return json.dumps(asdict(self), indent=2) + "\n"

    @property
    def observation_shapes(self) -> dict[str, tuple[int, ...]]:
        """What an observation holds, and its noise: each array's shape."""
        return {"pixel_values": (self.cameras, 3, self.image_size, self.image_size), "tokens": (self.text_tokens,),
                "state": (1, self.actions), "noise": (1, self.horizon, self.actions)}

    @property
    def cache_names(self) -> list[str]:
        return cache_names(self.layers)


def cache_names(layers: int) -> list[str]:
    """The prefix's outputs and the step's inputs: each layer's keys, then its values."""
    return [f"{kind}.{i}" for i in range(layers) for kind in ("key", "value")]


def seeded_observation(spec: VlaSpec, seed: int = 0) -> dict[str, np.ndarray]:
    """A seeded observation and its noise: each camera's pixels in [-1, 1], prompt ids, a state."""
    rng, shapes = np.random.default_rng(seed), spec.observation_shapes
    return {"pixel_values": rng.uniform(-1, 1, shapes["pixel_values"]).astype(np.float32),
            "tokens": rng.integers(0, spec.vocab, shapes["tokens"]).astype(np.int64),
            "state": rng.standard_normal(shapes["state"]).astype(np.float32),
            "noise": rng.standard_normal(shapes["noise"]).astype(np.float32)}


def euler(x, steps: int, velocity):
    """`steps` Euler steps from x, t from 1 to 0: velocity(x, its time [1] float32, k) each step; the last x."""
    dt = -1.0 / steps
    for k in range(steps):
        x = x + dt * velocity(x, np.full((1,), 1.0 + k * dt, np.float32), k)
    return x


def prompt_embeddings(table: np.ndarray, tokens: np.ndarray, width: int) -> np.ndarray:
    """The prompt's rows of the embedding table [T, width], times sqrt(width) as Gemma scales them."""
    return np.asarray(table[tokens], np.float32) * np.float32(math.sqrt(width))


def joined_prefix(features: np.ndarray, text: np.ndarray, width: int) -> np.ndarray:
    """The prefix's input on the host [1, P, width]: the images' features, then the prompt's embeddings."""
    return np.concatenate([features.reshape(1, -1, width), text[None]], axis=1)


def read_observations(path: str | Path, spec: VlaSpec, flag: str, samples: bool = False) -> list[dict[str, np.ndarray]]:
    """The observation in the .npz at `path` (`samples`: N of them, each array with a leading sample axis,
    as a --calib file holds them), each array checked against `spec`'s shapes; noise optional."""
    try:
        with np.load(path, allow_pickle=False) as data:
            arrays = {k: data[k] for k in data.files}
    except (OSError, ValueError) as exc:
        raise RunError(f"{flag} {path}: not an .npz numpy reads ({exc})") from None
    lead, counts = int(samples), set()
    for name, shape in spec.observation_shapes.items():
        if name == "noise" and name not in arrays:
            continue
        got = tuple(np.shape(arrays[name])) if name in arrays else None
        if got is None or got[lead:] != shape or len(got) != len(shape) + lead:
            raise RunError(f"{flag} {path}: {name} of shape {['N'] * lead + list(shape)} expected; "
                           f"got {list(got) if got is not None else 'none'}")
        counts.add(got[0] if samples else 1)
    tokens = arrays["tokens"]
    if tokens.dtype.kind not in "iu" or tokens.size and (tokens.min() < 0 or tokens.max() >= spec.vocab):
        raise RunError(f"{flag} {path}: tokens: integer ids expected, below {spec.vocab}; got {tokens.dtype}"
                       + (f" from {tokens.min()} to {tokens.max()}" if tokens.size else ""))
    if len(counts) > 1 or 0 in counts:
        raise RunError(f"{flag} {path}: every array holds the same number of observations, at least one; got "
                       + ", ".join(f"{k} {np.shape(v)[0]}" for k, v in arrays.items() if k in spec.observation_shapes))
    if not samples:
        return [arrays]
    return [{k: v[i] for k, v in arrays.items() if k in spec.observation_shapes} for i in range(counts.pop())]


def is_vla(path: str | Path) -> bool:
    return (Path(path) / VLA).is_file()


def read_vla(folder: str | Path) -> VlaSpec:
    path = Path(folder) / VLA
    spec = read_versioned(path, SCHEMA_VERSION, "vla", lambda data: VlaSpec(**data))
    if spec.digest != sealed_digest(asdict(spec)):
        raise BundleError(f"{path}: its digest differs: it was changed after it was written")
    for name in PROGRAMS:
        if not (Path(folder) / name).is_dir() or (Path(folder) / name).is_symlink():
            raise BundleError(f"{path}: no {name} program folder beside it")
    return spec


@dataclass
class Act:
    actions: np.ndarray                     # [1, horizon, actions]
    seconds: dict[str, float]               # vision, prefix, steps: each part's time, host to host
                                            # (GPU time inside the observation's graph, where it is one)


class VlaSession:
    """A VLA bundle ready to run: a Session per program. Where the backend keeps tensors on a device (the
    GPU), the images' features stay there and are joined to the prompt's embeddings in the prefix's own
    input buffer, the prefix's keys and values are copied once into the step's own input buffers, and
    the denoising steps run as one CUDA graph (the step's stage captured `steps` times, the action chunk
    updated in place between them): no host work between the steps."""

    def __init__(self, bundle: str | Path, backend: str | None = None, **session_args):
        self.bundle = Path(bundle)
        self.spec = read_vla(self.bundle)
        self.table = load_checked(self.bundle, self.spec.files, EMBEDDINGS)   # the one file it records
        self.backend = backend or default_backend(read_manifest(self.bundle / "vision"))
        self.device = traits_of(self.backend).device   # where tensors stay
        kept = {"vision": ["image_features"], "prefix": self.spec.cache_names, "step": ["velocity"]}
        self.sessions: dict[str, Session] = {}
        self.loops: dict[int, tuple] = {}   # steps -> (the loop's CUDA graph, its action chunk), once captured
        self.wholes: dict[int, ObservationGraph] = {}   # steps -> the observation as one CUDA graph
        try:
            for name in PROGRAMS:
                self.sessions[name] = Session(self.bundle / name, self.backend, **session_args,
                                              on_device=OnDevice(outputs=frozenset(kept[name] if self.device else ())))
        except BaseException:
            self.close()
            raise
        self.buffers = {name: self.sessions[name].input_buffers() if self.device else {} for name in ("prefix", "step")}
        step = self.buffers["step"]
        self.cache = {name: step[name] for name in self.spec.cache_names if name in step}
        self.passed_over = ""   # why the observation is not one CUDA graph, where its capture failed

    def act(self, pixel_values: np.ndarray, tokens: np.ndarray, state: np.ndarray, noise: np.ndarray | None = None,
            steps: int = 10, seed: int = 0) -> Act:
        """An action chunk for one observation: `steps` Euler steps from `noise` (seeded normal where
        none is given), t from 1 to 0."""
        s = self.spec
        tokens = np.asarray(tokens).reshape(-1)
        if tokens.dtype.kind not in "iu":
            raise RunError(f"tokens: integer ids expected; got {tokens.dtype}")
        if steps < 1 or len(tokens) != s.text_tokens or tokens.min() < 0 or tokens.max() >= s.vocab:
            raise RunError(f"an observation takes {s.text_tokens} token ids below {s.vocab} and steps >= 1; "
                           f"got {len(tokens)} ids and {steps} steps")
        want = s.observation_shapes
        if noise is None:
            noise = np.random.default_rng(seed).standard_normal(want["noise"]).astype(np.float32)
        for name, value in (("pixel_values", pixel_values), ("state", state), ("noise", noise)):
            if np.asarray(value).dtype.kind not in "biuf":
                raise RunError(f"{name}: real numbers expected; got {np.asarray(value).dtype}")
            if np.size(value) != math.prod(want[name]):
                raise RunError(f"{name}: {list(want[name])} expected; got {list(np.shape(value))}")
        text = prompt_embeddings(self.table, tokens, s.width)
        state = np.asarray(state, np.float32).reshape(1, s.actions)
        whole = self.whole(steps)
        if whole is not None:
            return whole.act(np.asarray(pixel_values, np.float32), text, state, noise)
        timer = Timer(self.device)
        features = self.sessions["vision"].run({"pixel_values": np.asarray(pixel_values, np.float32)})["image_features"]
        timer.mark("vision")
        cache = self.sessions["prefix"].run({"prefix_embeds": self.prefix_embeds(features, text)})
        for name, buffer in self.cache.items():   # once: each step reads them where they are
            buffer.copy_(cache[name].reshape(buffer.shape))
        cache = {**cache, **self.cache}
        timer.mark("prefix")
        loop = self.loop(steps) if "x_t" in self.buffers["step"] else None
        if loop is None:
            actions = self.steps_one_by_one(noise, state, cache, steps)
        else:
            graph, chunk = loop
            chunk.copy_(self.on_device(noise))
            self.buffers["step"]["state"].copy_(self.on_device(state).reshape(self.buffers["step"]["state"].shape))
            graph.replay()
            actions = to_host(chunk)
        timer.mark("steps")
        return Act(actions, timer.seconds)

    def prefix_embeds(self, features, text: np.ndarray):
        """The prefix's input: the images' features, then the prompt's embeddings; on a device, written in
        place into the prefix's own input buffer (the features never leave it)."""
        buffer = self.buffers["prefix"].get("prefix_embeds")
        if buffer is None:
            return joined_prefix(to_host(features), text, self.spec.width)
        join_prefix(buffer[0], features, self.on_device(text))
        return buffer

    def steps_one_by_one(self, noise: np.ndarray, state: np.ndarray, cache: dict, steps: int) -> np.ndarray:
        """The Euler steps as a loop over the step program's runs (a backend without CUDA graphs)."""
        step = self.sessions["step"]
        return to_host(euler(self.on_device(noise), steps, lambda x, now, k: step.run(
            {"x_t": x, "time": now, "state": state, **cache})["velocity"]))

    def loop(self, steps: int) -> tuple | None:
        """The denoising loop of `steps` steps as one CUDA graph on the step's stream (`denoise`), and the
        action chunk it updates; None where the step program is not one captured stage."""
        if steps not in self.loops:
            step = captured_stage(self.sessions["step"])
            if step is None:
                self.loops[steps] = None   # a step of several stages: run one by one
                return None
            import torch

            executor, spec, prepared = step
            chunk = torch.zeros(self.spec.observation_shapes["noise"], device=self.device)
            graph = executor.capture(lambda: denoise(prepared, spec, chunk, steps))
            self.loops[steps] = (graph, chunk)
        return self.loops[steps]

    def whole(self, steps: int) -> ObservationGraph | None:
        """The whole observation as one CUDA graph, where every program is one captured stage; captured
        on first use for each step count. Where its capture fails, the programs run one after another
        (as each stage whose faster form fails is passed over) and `passed_over` says why."""
        if steps not in self.wholes:
            stages = {name: captured_stage(self.sessions[name]) for name in PROGRAMS} if self.device else {}
            self.wholes[steps] = None
            if stages and all(stages.values()):
                try:
                    self.wholes[steps] = ObservationGraph(self.spec, stages, steps)
                except RuntimeError as exc:   # torch's errors of capture
                    self.passed_over = f"the observation as one CUDA graph: {failure(exc)}"
        return self.wholes[steps]

    def on_device(self, array: np.ndarray):
        if self.device is None:
            return array
        import torch

        return torch.from_numpy(array).to(self.device)

    def close(self) -> None:
        for session in self.sessions.values():
            session.close()
        self.sessions.clear()
        self.loops.clear()
        self.wholes.clear()

    def __enter__(self) -> VlaSession:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def captured_stage(session: Session) -> tuple | None:
    """(its executor, its stage's spec, the stage as prepared) of a session of one stage captured as a
    CUDA graph (StreamExecutor.captured); None for any other."""
    executors, shards = session.distinct_executors, session.manifest.shards
    if len(shards) != 1 or len(executors) != 1 or not hasattr(executors[0], "captured"):
        return None
    prepared = executors[0].captured(shards[0].name)
    return (executors[0], shards[0], prepared) if prepared is not None else None


def denoise(prepared, spec, chunk, steps: int, inputs: list | None = None) -> None:
    """`steps` Euler steps on the step stage's fixed buffers (or `inputs`, the same with some read from
    elsewhere), t from 1 to 0, in place: before step k its time is set (as a step run one by one is
    handed it) and the action chunk (float32, as the steps one by one keep it) copied into its x_t;
    after it, dt times its velocity is added to the chunk."""
    names, inputs, dt = [t.name for t in spec.inputs], inputs or prepared.inputs, -1.0 / steps
    x, now = names.index("x_t"), names.index("time")
    for k in range(steps):
        inputs[now].fill_(float(np.float32(1.0 + k * dt)))
        inputs[x].copy_(chunk.reshape(inputs[x].shape))
        chunk.add_((dt * prepared.stage(inputs)[0]).reshape(chunk.shape))


def join_prefix(embeds, features, text) -> None:
    """The prefix's input rows written in place (`embeds`: [rows, width]): the images' features first,
    then the prompt's embeddings (a device tensor, or a page-locked one copied up without waiting)."""
    image = embeds.shape[0] - text.shape[0]
    embeds[:image].copy_(features.reshape(image, embeds.shape[1]))
    embeds[image:].copy_(text, non_blocking=True)


def handed_over(made: dict, buffers: dict, names: list[str]) -> dict:
    """The prefix's keys and values as the steps read them: each where the prefix wrote it, where it has
    the step's buffer's shape, dtype and strides and no other of them shares its memory (the steps' kept
    form then reads it as it would its own buffer); the others copied into the step's own buffers."""
    read, storages = {}, [made[name].untyped_storage().data_ptr() for name in names]
    for name, storage in zip(names, storages):
        buffer = buffers[name]
        tensor = made[name].reshape(buffer.shape)
        if (tensor.dtype == buffer.dtype and tensor.stride() == buffer.stride() and tensor.storage_offset() == 0
                and storages.count(storage) == 1):
            read[name] = tensor
        else:
            buffer.copy_(tensor)
    return read


class ObservationGraph:
    """One observation as one CUDA graph: the images and the prompt's embeddings copied up from
    page-locked buffers, the vision stage, its features written into the prefix's input before the
    prompt's rows, the prefix stage, the denoising steps (`denoise`) reading the prefix's keys and
    values where it wrote them (`handed_over`), the action chunk copied down. The host fills the
    page-locked buffers, replays and waits once: no host work and no synchronization between the
    programs (each program run on its own, then the next, left the GPU idle while the host handed
    over). Timing events recorded inside the graph (where torch records them there) give each
    program's GPU time."""

    def __init__(self, spec: VlaSpec, stages: dict[str, tuple], steps: int):
        import torch

        self.torch = torch
        (executor, step_spec, step), device = stages["step"], stages["step"][2].inputs[0].device
        buffers = {name: dict(zip((t.name for t in stage_spec.inputs), prepared.inputs))
                   for name, (_, stage_spec, prepared) in stages.items()}
        embeds = buffers["prefix"]["prefix_embeds"].view(-1, spec.width)   # the images' rows, then the prompt's
        self.stream = executor.stream   # None where the stages run on the CPU (torch's, in a test)
        pinned = lambda shape, dtype: torch.empty(shape, dtype=dtype, pin_memory=self.stream is not None)  # noqa: E731
        self.host = {"pixels": pinned(buffers["vision"]["pixel_values"].shape, buffers["vision"]["pixel_values"].dtype),
                     "text": pinned((spec.text_tokens, spec.width), embeds.dtype),
                     "state": pinned(buffers["step"]["state"].shape, buffers["step"]["state"].dtype),
                     "noise": pinned(spec.observation_shapes["noise"], torch.float32),
                     "actions": pinned(spec.observation_shapes["noise"], torch.float32)}
        chunk = torch.zeros(spec.observation_shapes["noise"], device=device)
        outputs = {name: [t.name for t in stage_spec.outputs] for name, (_, stage_spec, _) in stages.items()}
        host, cache = self.host, spec.cache_names
        vision, prefix = stages["vision"][2], stages["prefix"][2]

        def observation(marks: list) -> None:
            mark = (lambda k: marks[k].record()) if marks else (lambda k: None)
            mark(0)
            buffers["vision"]["pixel_values"].copy_(host["pixels"], non_blocking=True)
            join_prefix(embeds, vision.stage(vision.inputs)[outputs["vision"].index("image_features")], host["text"])
            mark(1)
            made = dict(zip(outputs["prefix"], prefix.stage(prefix.inputs)))
            read = handed_over(made, buffers["step"], cache)
            mark(2)
            chunk.copy_(host["noise"], non_blocking=True)
            buffers["step"]["state"].copy_(host["state"], non_blocking=True)
            denoise(step, step_spec, chunk, steps, [read.get(t.name, b) for t, b in zip(step_spec.inputs, step.inputs)])
            mark(3)
            host["actions"].copy_(chunk, non_blocking=True)
        self.work = lambda: observation(self.marks)
        self.marks, self.graph = timing_marks(torch, 4) if self.stream is not None else [], None
        if self.stream is not None:
            try:
                self.graph = executor.capture(self.work)
            except RuntimeError:   # a torch or driver that records no timing event inside a graph
                if not self.marks:
                    raise
                self.marks = []
                self.graph = executor.capture(self.work)

    def replay(self) -> None:
        """The graph queued on its stream over what its page-locked buffers hold, not waited for:
        replays queued back to back time the GPU's work alone."""
        with self.torch.cuda.stream(self.stream):
            self.graph.replay()

    def act(self, pixel_values: np.ndarray, text: np.ndarray, state: np.ndarray, noise: np.ndarray) -> Act:
        started = time.perf_counter()
        for name, value in (("pixels", pixel_values), ("text", text), ("state", state), ("noise", noise)):
            copy_into(self.host[name].numpy(), np.reshape(value, self.host[name].shape))
        if self.graph is None:   # no GPU: the same work, run as it is
            with self.torch.no_grad():
                self.work()
        else:
            self.replay()
            self.stream.synchronize()
        actions = self.host["actions"].numpy().copy()
        seconds = {"observation": time.perf_counter() - started}
        if self.marks:
            try:
                seconds = {part: self.marks[k].elapsed_time(self.marks[k + 1]) / 1e3
                           for k, part in enumerate(("vision", "prefix", "steps"))}
            except RuntimeError:   # a driver that keeps no time for events recorded inside a graph
                self.marks = []
        return Act(actions, seconds)


def timing_marks(torch, count: int) -> list:
    """CUDA events that time work inside a graph (recorded there as event nodes: `external`); none
    where this torch has no such events."""
    try:
        return [torch.cuda.Event(enable_timing=True, external=True) for _ in range(count)]
    except TypeError:
        return []


class Timer:
    """Seconds between marks, host to host (the device synchronized at each mark where there is one)."""

    def __init__(self, device: str | None):
        self.device, self.last, self.seconds = device, time.perf_counter(), {}

    def mark(self, name: str) -> None:
        if self.device:
            import torch

            torch.cuda.synchronize()
        now = time.perf_counter()
        self.seconds[name] = now - self.last
        self.last = now
