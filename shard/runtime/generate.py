"""Generation over fixed-shape steps and a static KV cache (the form of shard.zoo.decoder): the prompt
in chunks of the prefill step's width, then one token a step. Each step's new keys and values are
written into the cache in place; nothing grows. numpy only (transformers and Pillow read text and
images, imported when a prompt is text or has an image).

    cache = Cache.empty(layers=30, kv_heads=3, capacity=512, head_dim=64)
    tokens = generate(run, table, table[prompt_ids], cache, max_new=32, chunk=64, stop={2})

`run(feeds) -> outputs` runs the step whose width is feeds["inputs_embeds"].shape[1] (an onnxruntime
session per width, or a bundle per program) and names its outputs: logits, key.i, value.i; `table`
is the token embeddings (shard.zoo.decoder.embedding_table), looked up here on the host.

A generative bundle holds one ordinary bundle per step width, and the model's tokenizer (its format:
shard.runtime.generative_bundle; its prompts: shard.runtime.prompts).

GenerativeSession opens it: shard.load("lm.shard").generate("What is ...?", chat=True).
"""

from __future__ import annotations

import math
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from shard.bundle import read_manifest
from shard.errors import RunError
from shard.runtime.executors import held_nhwc, to_host, traits_of
from shard.runtime.executors.rknn_held import Held, native_view
from shard.runtime.generative_bundle import EMBEDDINGS, check_files, load_checked, read_generative
from shard.runtime.prompts import Prompts, Sight
from shard.runtime.session import OnDevice, Session, default_backend

# The mask's "not seen": exp(-1e4) is 0 in fp32 and fp16 alike, and -1e4 itself stays inside fp16's range.
MASKED = np.float32(-1e4)
PICK = "pick"   # a step's input saying which of its tokens' logits it returns (step_feeds)

Step = Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]]


@dataclass
class Cache:
    """Each layer's keys and values, [1, kv_heads, capacity, head_dim]; the first `length` are filled."""

    keys: list[np.ndarray]
    values: list[np.ndarray]
    length: int = 0
    buckets: tuple[int, ...] = ()   # larger capacities it may grow to (a program compiled for each)
    storage: Callable[[int], tuple[list, list]] | None = None   # a capacity's keys and values, where given

    @classmethod
    def empty(cls, layers: int, kv_heads: int, capacity: int, head_dim: int, dtype=np.float32,
              buckets: tuple[int, ...] = (), device: str | None = None, nhwc: bool = False) -> Cache:
        """Zeros, in numpy; or, with `device`, torch tensors there (a GPU backend's steps then read the
        cache where it lies and hand back their new entries there: nothing crosses to the host).
        nhwc: each held as [1, capacity, head_dim, kv_heads] and seen in the order above, the layout the
        board's runtime takes a 4-D input in (executors.npu_inputs hands it over with no transpose)."""
        shape = (1, kv_heads, capacity, head_dim)
        return cls(*([zeros(shape, dtype, device, nhwc) for _ in range(layers)] for _ in ("keys", "values")),
                   buckets=tuple(sorted(buckets)))

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[2]

    def make_room(self, tokens: int) -> None:
        """Room for `tokens` more: the smallest bucket that holds them, the filled entries copied over;
        a context past the largest stops in one line."""
        need = self.length + tokens
        if need <= self.capacity:
            return
        larger = [c for c in self.buckets if c >= need]
        if not larger:
            raise RunError(f"the context reaches {need} tokens, past the cache's capacity of "
                           f"{max((self.capacity, *self.buckets))} (compile with a larger --max-context)")
        given = self.storage(larger[0]) if self.storage else None
        for k, arrays in enumerate((self.keys, self.values)):
            for i, old in enumerate(arrays):
                arrays[i] = given[k][i] if given else grown(old, larger[0])
                arrays[i][:, :, :self.length] = old[:, :, :self.length]
        settle(self.keys[0])

    def feeds(self) -> dict[str, np.ndarray]:
        return {f"past_{kind}.{i}": arrays[i] for i in range(len(self.keys))
                for kind, arrays in (("key", self.keys), ("value", self.values))}

    def write(self, outputs: dict[str, np.ndarray], count: int) -> None:
        """The first `count` new tokens' keys and values, in place after the filled ones (those the step
        wrote there itself, IN_PLACE, left as they are)."""
        end, wrote = self.length + count, False
        for i in range(len(self.keys)):
            for arrays, name in ((self.keys, f"key.{i}"), (self.values, f"value.{i}")):
                if outputs[name] is IN_PLACE:
                    continue
                new = outputs[name][:, :, :count]
                arrays[i][:, :, self.length:end] = new if isinstance(new, type(arrays[i])) else like(new, arrays[i])
                wrote = True
        if wrote:
            settle(self.keys[0])
        self.length = end


def time_row_writes(layers: int, kv_heads: int, head_dim: int, capacity: int, width: int, c2: int = 8,
                    runs: int = 30) -> float:
    """The median seconds Cache.write takes to write one step's new keys and values (`width` tokens,
    float32 as a step gives them) into a cache held in the NPU's layout (rknn_held.native_view over
    NC1HWC2 memory with `c2` channels a block), on this machine's CPU."""
    memory = [np.zeros(capacity * head_dim * c2, np.float16) for _ in range(2 * layers)]
    views = [native_view(m, [1, 1, capacity, head_dim, c2], [1, kv_heads, capacity, head_dim]) for m in memory]
    rows = np.ones((1, kv_heads, width, head_dim), np.float32)
    outputs = {f"{kind}.{i}": rows for i in range(layers) for kind in ("key", "value")}
    seconds = []
    for _ in range(runs):
        cache = Cache(views[:layers], views[layers:], length=capacity - width)
        started = time.perf_counter()
        cache.write(outputs, width)
        seconds.append(time.perf_counter() - started)
    return float(np.median(seconds))


IN_PLACE = "written into the cache by the step itself"   # an output the step's graph wrote (Session.written)


def settle(array) -> None:
    """Where the cache is on a GPU: the copies just queued on this thread's stream done, before a
    program's stream (another) reads the cache."""
    if getattr(array, "is_cuda", False):
        import torch

        torch.cuda.current_stream(array.device).synchronize()


def zeros(shape: tuple, dtype, device: str | None, nhwc: bool = False):
    """np.zeros (with `nhwc`, a 4-D view of NHWC memory: executors.held_nhwc), or torch.zeros on
    `device` (a numpy dtype)."""
    if device is None and nhwc:
        return np.zeros((shape[0], *shape[2:], shape[1]), dtype).transpose(0, 3, 1, 2)
    if device is None:
        return np.zeros(shape, dtype)
    import torch

    return torch.zeros(shape, dtype=getattr(torch, np.dtype(dtype).name), device=device)


def grown(old, capacity: int):
    """Zeros of `old`'s kind, type, layout and device, `capacity` entries long (axis 2)."""
    shape = (*old.shape[:2], capacity, old.shape[3])
    return zeros(shape, old.dtype, None, held_nhwc(old)) if isinstance(old, np.ndarray) else old.new_zeros(shape)


def like(value, array):
    """`value` (numpy, or a torch tensor) as `array` holds its kind: numpy, or a tensor on its device."""
    if isinstance(array, np.ndarray):
        return to_host(value)
    import torch

    return torch.as_tensor(value).to(array.device, array.dtype)


def step_mask(length: int, width: int, capacity: int) -> np.ndarray:
    """[1, 1, width, capacity + width]: each new token sees the `length` filled cache entries and the
    new tokens up to itself (so never the padding after the last real one); empty entries are masked."""
    mask = np.full((1, 1, width, capacity + width), MASKED, np.float32)
    mask[..., :length] = 0
    mask[0, 0, :, capacity:][np.tri(width, dtype=bool)] = 0
    return mask


def as_attention_mask(feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A step's feeds for a decoder exported with an attention_mask (shard.zoo.onnx_decoder): in place of
    the mask, [1, C + T] int64, 1 for each entry some new token sees. A padded token sees itself
    only, and no real token sees it."""
    feeds = dict(feeds)
    feeds["attention_mask"] = (feeds.pop("mask")[0, 0] == 0).any(axis=0)[None].astype(np.int64)
    return feeds


def step_feeds(rows: np.ndarray, length: int, width: int, capacity: int) -> dict[str, np.ndarray]:
    """A step's inputs but the cache: the embeddings of up to `width` new tokens (rows [n, hidden], padded
    to width) after `length` tokens in a cache of `capacity`, their positions and mask, and, for a step
    of more than one token, `pick`: [1, 1, width], 1 at the last real token, whose logits the step
    returns (its LM head reads that row alone)."""
    valid = len(rows)
    if not 0 < valid <= width:
        raise RunError(f"a step of width {width} takes 1 to {width} tokens, not {valid}")
    padded = np.zeros((1, width, rows.shape[1]), np.float32)
    padded[0, :valid] = rows
    feeds = {"inputs_embeds": padded, "position_ids": (length + np.arange(width, dtype=np.int64))[None],
             "mask": step_mask(length, width, capacity)}
    if width > 1:
        feeds[PICK] = np.zeros((1, 1, width), np.float32)
        feeds[PICK][0, 0, valid - 1] = 1
    return feeds


def advance(run: Step, cache: Cache, rows: np.ndarray, width: int) -> np.ndarray:
    """Run the embeddings of up to `width` new tokens (rows [n, hidden]) through the step of that width
    at the cache's length, write their keys and values; the last one's logits, [vocab]."""
    cache.make_room(len(rows))
    outputs = run({**step_feeds(rows, cache.length, width, cache.capacity), **cache.feeds()})
    cache.write(outputs, len(rows))
    return outputs["logits"][0, -1]


def prefill(run: Step, cache: Cache, rows: np.ndarray, chunk: int) -> np.ndarray:
    """The prompt's embeddings (rows [n, hidden]) through the cache `chunk` at a step; the last token's
    logits, [vocab]."""
    if not len(rows):
        raise RunError("a prompt of at least one token")
    for k in range(0, len(rows), chunk):
        logits = advance(run, cache, rows[k:k + chunk], chunk)
    return logits


def teacher_forced(run: Step, cache: Cache, rows: np.ndarray, start: int, chunk: int, decode: int = 1) -> np.ndarray:
    """The logits of every position of `rows` [n, hidden] from `start` on, [n - start, vocab]: the rows
    up to `start` prefilled, then one a step through the step of width `decode`, as an answer's go."""
    first = prefill(run, cache, rows[:start + 1], chunk)
    return np.stack([first] + [advance(run, cache, rows[[k]], decode) for k in range(start + 1, len(rows))])


def greedy(logits: np.ndarray) -> int:
    return int(np.argmax(logits))


def sampler(temperature: float, top_p: float = 1.0, seed: int = 0) -> Callable[[np.ndarray], int]:
    """Greedy at temperature 0; else a token drawn from softmax(logits / temperature) cut to the
    smallest set of most likely tokens whose probability reaches top_p, from a generator seeded once."""
    if not (0 <= temperature < math.inf and 0 < top_p <= 1):   # NaN fails both
        raise RunError(f"temperature must be a number of at least 0 and top-p in (0, 1]; got {temperature} and {top_p}")
    if not 0 <= seed < 2**63:
        raise RunError(f"the seed must be a whole number from 0 to 2^63 - 1; got {seed}")
    if temperature == 0:
        return greedy
    rng = np.random.default_rng(seed)

    def pick(logits: np.ndarray) -> int:
        z = logits.astype(np.float64) / temperature
        p = np.exp(z - z.max())
        p /= p.sum()
        order = np.argsort(-p, kind="stable")
        kept = order[:int(np.searchsorted(np.cumsum(p[order]), top_p)) + 1]
        return int(rng.choice(kept, p=p[kept] / p[kept].sum()))

    return pick


def generate(run: Step, table: np.ndarray, prompt: np.ndarray, cache: Cache, max_new: int, chunk: int,
             stop: set[int] = frozenset(), choose: Callable[[np.ndarray], int] = greedy,
             on_token: Callable[[int], None] | None = None, decode: int = 1) -> list[int]:
    """The prompt's embeddings (rows [n, hidden]: table[ids], a VLM's image features among them)
    prefilled; its last logits pick the first new token (greedy unless `choose` says otherwise), each
    new token's (looked up in `table`, through the step of width `decode`) the next; stops after
    `max_new` tokens or at a token of `stop` (kept)."""
    if max_new < 1:
        raise RunError(f"max new tokens must be at least 1, got {max_new}")
    logits = prefill(run, cache, prompt, chunk)
    tokens: list[int] = []
    while True:
        tokens.append(choose(logits))
        if on_token:
            on_token(tokens[-1])
        if tokens[-1] in stop or len(tokens) == max_new:
            return tokens
        logits = advance(run, cache, table[tokens[-1:]], decode)


@dataclass
class Generation:
    prompt: list[int]                 # the prompt's token ids, chat template applied
    tokens: list[int]                 # the new ones
    text: str                         # the new tokens as text ("" without a tokenizer)
    steps: list[tuple[int, float]]    # (width, seconds) of every program run, in order; width 0: an image's
    prefill_steps: int = 0            # how many of the text steps were the prompt's
    full: int | None = None           # the cache's capacity, where it filled before max_new_tokens or a stop

    @property
    def vision_ms(self) -> list[float]:
        return [round(1e3 * s, 3) for w, s in self.steps if w == 0]

    @property
    def prefill_ms(self) -> list[float]:
        return [round(1e3 * s, 3) for s in self.text_seconds[:self.prefill_steps]]

    @property
    def decode_ms(self) -> list[float]:
        return [round(1e3 * s, 3) for s in self.text_seconds[self.prefill_steps:]]

    @property
    def decode_tokens_per_s(self) -> float | None:
        decode = self.text_seconds[self.prefill_steps:]
        return round(len(decode) / sum(decode), 2) if decode else None

    @property
    def text_seconds(self) -> list[float]:
        return [s for w, s in self.steps if w > 0]

    def to_json(self) -> dict:
        return {"prompt_ids": self.prompt, "ids": self.tokens, "text": self.text, "vision_ms": self.vision_ms,
                "prefill_ms": self.prefill_ms, "decode_ms": self.decode_ms,
                "decode_tokens_per_s": self.decode_tokens_per_s}


class GenerativeSession:
    """A generative bundle ready to run: a Session per program (shard.runtime), the cache in numpy, or
    on the GPU where the programs run there (a GPU backend: each step reads the cache in place, its new
    keys and values stay there, and only its logits cross to the host; a decode step whose stage
    holds the cache writes its new entries there inside its own CUDA graph, unless `in_place` is
    False); on the board, where every step is fp16, held in NPU memory that every step reads in place
    and the host writes only new rows into (rknn_held), unless `held` is False (rknn-toolkit-lite2,
    handed the whole cache every step)."""

    def __init__(self, bundle: str | Path, in_place: bool = True, held: bool = True, **session_args):
        self.bundle = Path(bundle)
        self.spec = read_generative(self.bundle)
        self.sessions: dict[tuple[int, int], Session] = {}   # (width, capacity) -> its program's
        self.vision = None
        manifests = [read_manifest(self.bundle / program.name) for program in self.spec.programs]
        self.traits = traits_of(session_args.get("backend") or default_backend(manifests[0]))
        self.device = self.traits.device   # where the cache lives
        entries = frozenset(f"{kind}.{i}" for i in range(self.spec.layers) for kind in ("key", "value"))
        writes = {name: (f"past_{name}", "position_ids") for name in entries} if in_place else {}
        # where inputs can be bound once (the board), an fp16 cache held where every step reads it (rknn_held)
        self.halves = all(shard.precision == "fp16" for m in manifests for shard in m.shards)
        self.held = OnDevice(held=frozenset(f"past_{name}" for name in entries), memory=Held()) \
            if held and self.traits.binds_inputs and self.halves else None
        try:
            for program in self.spec.programs:   # a decode step writes at its one position, inside the cache
                kept = OnDevice(entries, writes if program.width == 1 else {}) if self.device else \
                    self.held or OnDevice()
                self.sessions[program.width, program.capacity] = Session(self.bundle / program.name, **session_args,
                                                                         on_device=kept)
            self.vision = Session(self.bundle / self.spec.vision["program"], **session_args) if self.spec.vision else None
        except BaseException:
            self.close()
            raise
        self.attention_masked = [s for s in self.sessions.values() if "attention_mask" in
                                 {t.name for t in s.manifest.inputs}]   # an ONNX decoder's steps
        check_files(self.bundle, self.spec.files)
        self.table = load_checked(self.bundle, self.spec.files, EMBEDDINGS)
        self.prompts = Prompts(self.bundle, self.spec, self.table)
        self.backend = next(iter(self.sessions.values())).backend
        self.steps: list[tuple[int, float]] = []

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        width = feeds["inputs_embeds"].shape[1]
        started = time.perf_counter()
        session = self.sessions[width, feeds["past_key.0"].shape[2]]
        if session in self.attention_masked:
            feeds = as_attention_mask(feeds)
        outputs = {**session.run(feeds), **dict.fromkeys(session.written, IN_PLACE)}
        self.steps.append((width, time.perf_counter() - started))
        return outputs

    def cache(self) -> Cache:
        """An empty cache where the steps read it: on the GPU, the decode step's own input buffers; on
        the board, where every step is fp16, NPU memory in the NPU's layout (`held`: each step writes
        only its new rows there); else, for rknn-toolkit-lite2, in numpy as it takes a 4-D input (NHWC
        memory, handed over with no transpose: executors.npu_inputs), and in float16 where every step
        is built in fp16 (the NPU reads the cache as fp16 whatever it is handed, and its new entries
        come back as fp16 numbers: the same logits, half the bytes a step hands over); else float32 in
        ONNX's layout (on the simulator the held form measured no faster: bench/cache_handoff.py)."""
        s = self.spec
        if self.device or self.held:   # the decode step's own input memory, which it reads without a copy
            keys, values = self.stored(s.capacities[0])
            return Cache(keys, values, buckets=tuple(s.capacities[1:]), storage=self.stored)
        converts = self.traits.converts_inputs
        return Cache.empty(s.layers, s.kv_heads, s.capacities[0], s.head_dim,
                           np.float16 if converts and self.halves else np.float32, buckets=tuple(s.capacities[1:]),
                           nhwc=converts)

    def stored(self, capacity: int) -> tuple[list, list]:
        """The keys and values of a cache of `capacity` on the GPU: each the decode step's own input
        buffer where one stage alone reads it (Session.input_buffers: where it writes its new entry
        in place), else a new tensor; on the board, its NPU memory (every step binds the same)."""
        s = self.spec
        buffers = self.sessions[s.decode_width, capacity].input_buffers()
        shape = (1, s.kv_heads, capacity, s.head_dim)
        names = [[f"past_{kind}.{i}" for i in range(s.layers)] for kind in ("key", "value")]
        return tuple([buffers[n] if n in buffers else zeros(shape, np.float32, self.device) for n in kind]
                     for kind in names)

    def look(self, pixels: np.ndarray | None) -> Sight:
        """The images' features from the vision program: one pass per square where the processor split
        an image, the squares pipelined over the cores as frames (Session.run_stream); the seconds
        each square's features took after the one before's."""
        sight = Sight([], [])
        if pixels is None or not len(pixels):
            return sight
        last = time.perf_counter()
        for out in self.vision.run_stream({"pixel_values": square[None]} for square in pixels):
            sight.features.append(out["image_features"][0])
            now = time.perf_counter()
            sight.seconds.append(now - last)
            last = now
        return sight

    def generate(self, prompt: str | list[int], max_new_tokens: int = 32, chat: bool = False, temperature: float = 0.0,
                 top_p: float = 1.0, seed: int = 0, stop: set[int] | None = None, images: list | None = None,
                 on_text: Callable[[str], None] | None = None, sight: Future | None = None,
                 encoded: tuple[list[int], np.ndarray | None] | None = None) -> Generation:
        """New tokens after `prompt` (text, with the chat template if `chat`, or token ids) and, for a
        VLM, its images: greedy at temperature 0, else sampled (seeded); until a stop token or
        max_new_tokens. on_text gets the text as it grows, piece by piece. `sight`: the images'
        features under way elsewhere, and `encoded` the prompt's encode() already made (generate_each)."""
        ids, pixels = encoded or self.prompts.encode(prompt, chat, images)
        self.prompts.check_room(ids)
        choose = sampler(temperature, top_p, seed)
        seen = sight.result() if sight else self.look(pixels)
        rows = self.prompts.embed(ids, seen)
        self.steps = [(0, seconds) for seconds in seen.seconds]
        shown: list[str] = [""]
        tokens: list[int] = []

        def on_token(token: int) -> None:
            tokens.append(token)
            if on_text:
                text = self.prompts.tokenizer.decode(tokens, skip_special_tokens=True)
                if text.startswith(shown[0]) and len(text) > len(shown[0]):
                    on_text(text[len(shown[0]):])
                    shown[0] = text

        stops = set(self.spec.stop) if stop is None else stop
        capacity = max(self.spec.capacities)
        room = capacity - len(ids) + 1   # the last new token is not fed back: it takes no entry
        out = generate(self.run, self.table, rows, self.cache(), min(max_new_tokens, room), self.spec.chunk, stops,
                       choose, on_token, self.spec.decode_width)
        text = self.prompts.tokenizer.decode(out, skip_special_tokens=True) if isinstance(prompt, str) else ""
        full = capacity if len(out) == room < max_new_tokens and out[-1] not in stops else None
        return Generation(ids, out, text, list(self.steps), -(-len(ids) // self.spec.chunk), full)

    def generate_each(self, requests: list[dict], **common) -> Iterator[Generation]:
        """generate() of each request (a dict of its arguments, over `common`) in turn; every image
        goes through the vision program on a thread of its own from the start, so the next prompt's
        image is seen while this one decodes (each program has its own executors; on the simulator
        its own process). Tokenizing stays on this thread."""
        requests = [{**common, **r} for r in requests]
        encoded = [self.prompts.encode(r["prompt"], r.get("chat", False), r.get("images")) for r in requests]
        for ids, _ in encoded:
            self.prompts.check_room(ids)
        with ThreadPoolExecutor(1) as pool:
            sights = [pool.submit(self.look, pixels) for _, pixels in encoded]
            for request, sight, done in zip(requests, sights, encoded):
                yield self.generate(**request, sight=sight, encoded=done)

    def logits(self, ids: list[int], pixels: np.ndarray | None = None, start: int = 0) -> np.ndarray:
        """Teacher-forced: the logits of every position from `start` on, [len(ids) - start, vocab]: the
        ids up to `start` prefilled, then one a step as an answer's tokens go."""
        return teacher_forced(self.run, self.cache(), self.prompts.embed(list(ids), self.look(pixels)), start,
                              self.spec.chunk, self.spec.decode_width)

    def close(self) -> None:
        for session in [*self.sessions.values(), *([self.vision] if getattr(self, "vision", None) else [])]:
            session.close()
        self.sessions.clear()
        self.vision = None

    def __enter__(self) -> GenerativeSession:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
