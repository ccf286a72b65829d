"""RknnTarget: the Rockchip NPUs' compile side; ToolkitBuilds: shard builds on the toolkit's workers."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Callable, ClassVar

from shard.passes import NPU_PIPELINE
from shard.passes.canonicalize import MIN_OPSET
from shard.runtime.executors.rknn_board import import_rknnlite, infer_once, time_inference
from shard.targets import ShardBuild, ShardJob, Target
from shard.targets.build_cache import BuildCache
from shard.targets.chips import CHIPS
from shard.targets.rknn.env import find_python, installed_label
from shard.targets.rknn.log import (crashed_rule, edge_reshapes, in_common_words, macs_by_dtype, parse_build_log,
                                   unestimated_cost)
from shard.targets.rknn.memory import build_bytes, onnx_weight_bytes, shards_for_memory, worker_build_bytes
from shard.targets.rknn.ops import ToolkitOps
from shard.targets.rknn.remote import board_inference, board_timing, worker_pool
from shard.targets.rknn.simulate import ShardByShard, runs_where_built
from shard.targets.rknn.worker import ToolkitWorker, WorkerFailed, build_failure, build_request

ONE_OP_TIMEOUT = 300.0   # seconds a pass's small build may take (the whole model's builds: --timeout)
RULE_RETRIES = 3         # fusion rules turned off, one per crash, before a shard's build is given up


class RknnTarget(Target):
    executors = ("sim", "cpu", "board")
    artifact_suffix = ".rknn"
    vendor = True
    pipeline = NPU_PIPELINE
    words: ClassVar[dict[str, str]] = {"overflow_lines": "REGTASK lines", "error_lines": "E lines",
                                       "fallbacks": "single-core fallbacks", "fallback": "falls back to one NPU core"}
    min_opset = MIN_OPSET
    max_opset = 19         # rknn-toolkit2 2.5.0 loads opset <= 19 (and the IR versions its onnx 1.18 reads)
    stage_streams = False

    def __init__(self, chip: str):
        self.name = chip
        self.chip = CHIPS[chip]
        # An int8-only chip's shards are quantized from calibration samples; mixed needs fp16 ops.
        self.precisions = ("fp16", "int8", "mixed") if self.chip.fp16 else ("int8",)

    def build_options(self, options) -> dict:
        """The toolkit calls every shard is built with; the simulator replays them."""
        fp16 = {"config": {"target_platform": self.name}, "build": {"do_quantization": False}, "precision": "fp16"}
        return fp16 if self.chip.fp16 else self.build_for(fp16, "int8")

    def build_for(self, build: dict, precision: str, float16: list[str] | None = None,
                  disable_rules: list[str] = ()) -> dict:
        """int8: the vendor's w8a8 (activations per tensor, Conv and constant-weight MatMul weights
        per channel), ranges from the shard's calibration samples (FACTS-rk3588, quantization).
        mixed: the same, with the ops named in `float16` kept in fp16 (the toolkit's hybrid
        quantization)."""
        if disable_rules:   # the toolkit's own switch, config(disable_rules=[...]), beside any given
            given = build["config"].get("disable_rules", [])
            build = {**build, "config": {**build["config"], "disable_rules": [*given, *(
                r for r in disable_rules if r not in given)]}}
        if precision == "fp16":
            return build
        if precision not in self.precisions:
            raise ValueError(f"{self.name} builds {', '.join(self.precisions)}, not {precision}")
        quantized = {"config": {**build["config"], "quantized_dtype": "w8a8", "quantized_algorithm": "normal",
                                "quantized_method": "channel"},
                     "build": {**build["build"], "do_quantization": True}, "precision": precision}
        return {**quantized, "float16": sorted(float16 or [])} if precision == "mixed" else quantized

    def check_environment(self) -> None:
        find_python(self.name)

    def toolchain(self) -> str:
        return installed_label(self.name)

    def edge_layouts(self, log: Path, inputs: dict[str, list[int]], outputs: dict[str, list[int]]
                     ) -> tuple[dict[str, list[int]], dict[str, list[int]]]:
        """Edges the vendor reshaped on the CPU, with the 4-D shape it wanted. rknn-toolkit2 computes in
        a 4-D layout: a graph input or output of another shape (a [4,10] linear input, a [3,2,5]
        activation) goes through a Reshape it runs on the CPU beside the Input/OutputOperator (30 of
        the onnx package's pytorch conformance models), where the same reshape is a free view in
        numpy. Its layer table says which edges and to what shape; compile builds the shard again
        with those edges so (shard.graph.relayout) and keeps it where better (shard.never_worse)."""
        return edge_reshapes(parse_build_log(log.read_text(errors="replace")).layers, inputs, outputs)

    def build_bytes(self, weight_bytes: int) -> int:
        return build_bytes(weight_bytes)

    def shards_for_memory(self, weight_bytes: int, jobs: int) -> int:
        """The toolkit's build memory grows with a shard's weights (memory.py)."""
        return shards_for_memory(weight_bytes, jobs)

    def layer_names(self, log: Path) -> list[str]:
        return [layer.name for layer in parse_build_log(log.read_text(errors="replace")).layers]

    def pass_toolkit(self, profile, options):
        # The passes' builds are of one op or a few: seconds each. One the compiler stalls on
        # is a failed build after ONE_OP_TIMEOUT, not a compile held for a whole build's timeout.
        return ToolkitOps(self.name, profile, self.build_options(options), jobs=1,
                          timeout=min(options.timeout, ONE_OP_TIMEOUT), ray=options.ray)

    def probe_toolkit(self, base, jobs: int, timeout: float, cache_dir: Path | None = None, read_cache: bool = True,
                      slow_factor: float | None = None, on_board: bool = False, ray: str | None = None) -> ToolkitOps:
        board, timer = board_runners(self.name, on_board, ray, timeout)
        return ToolkitOps(self.name, base, self.build_options(None), jobs, timeout, cache_dir, read_cache, slow_factor,
                          board, ray, timer)

    def builds(self, workers: int, timeout: float, cache: Path | None, log_dir: Path,
               ray: str | None = None) -> ToolkitBuilds:
        return ToolkitBuilds(self, workers, timeout, cache, log_dir, ray)


def board_runners(chip: str, on_board: bool, ray: str | None, timeout: float) -> tuple:
    """(run once, time) of a clean point on a board of the chip: on a node of the Ray cluster that owns
    one, or here (rknn-toolkit-lite2, checked before the first build); (None, None) off the board."""
    if on_board and ray:
        return board_inference(ray, chip, timeout), board_timing(ray, chip, timeout)
    if on_board:
        import_rknnlite()
        return infer_once, time_inference
    return None, None


class ToolkitBuilds:
    """Vendor builds on at most `workers` toolkit worker processes, each started on first use or by
    start(), and reused for many builds (shard.targets.Builds). Jobs start in the order submitted:
    put the longest first. Builds seen before come from the cache, which is pruned to its cap when
    all went well."""

    def __init__(self, target: RknnTarget, workers: int, timeout: float, cache: Path | None, log_dir: Path,
                 ray: str | None = None):
        self.target, self.timeout = target, timeout
        self.pool = worker_pool(target.name, log_dir, workers, ray)
        self.executor = ThreadPoolExecutor(max_workers=max(1, workers))
        self.store = BuildCache(cache, target.name, target.toolchain()) if cache else None
        self.gate = threading.Condition()
        self.limit, self.running = max(1, workers), 0   # builds allowed at once, and under way

    def at_once(self, builds: int) -> None:
        with self.gate:
            self.limit = max(1, builds)
            self.gate.notify_all()

    def start(self) -> None:
        self.pool.start()

    def submit(self, jobs: list[ShardJob], build: dict, on_done: Callable[[ShardBuild], None]) -> list[Future]:
        return [self.executor.submit(self._build, job, build, on_done) for job in jobs]

    def _build(self, job: ShardJob, build: dict, on_done: Callable[[ShardBuild], None]) -> ShardBuild:
        """The job's build; where it crashed in a fusion rule its log names, built again with that rule
        off (up to RULE_RETRIES rules), the crash and the rules kept in its diagnostics."""
        crashes = []
        while True:
            result = self._build_once(job, self.target.build_for(build, job.precision, job.float16, job.disable_rules))
            rule = crashed_rule(job.log.read_text(errors="replace")) if result.error and job.log.is_file() else None
            if not (job.recover and rule and rule not in job.disable_rules and len(crashes) < RULE_RETRIES):
                break
            crashes.append(result.error.split("; log: ")[0])   # the retry's log takes the file's place
            job.disable_rules.append(rule)
        if job.disable_rules:
            result.diagnostics = {**result.diagnostics, "disabled_rules": list(job.disable_rules), "crashes": crashes}
        on_done(result)
        return result

    def _build_once(self, job: ShardJob, options: dict) -> ShardBuild:
        """The job's build, from the cache where it was made before; where the job asks for runs
        (job.runs: the fidelity check's), they are made in the worker that built it, right after."""
        key = self.store.key(job, options) if self.store else None
        result = self.store.get(job, key) if self.store else None
        if result is not None:
            result.diagnostics = in_common_words(result.diagnostics)
        if result is None:
            with self.slot(job) as worker, job.runs.building() if job.runs else nullcontext():
                result = build_shard(worker, job, options, self.timeout, keep=job.runs is not None)
                if job.artifact and result.error is None:
                    result.built_from = job.built_from()
                # asked once built: the inputs may come from the shard before, built beside it
                runs = job.runs.wanted(None) if job.runs and result.built_from.get("artifact") else []
                outputs = self.run_where_built(worker, job, runs) if job.runs else None   # releases it
                if outputs:
                    job.runs.made(result.built_from["artifact"], outputs)
            if self.store:
                self.store.put(job, key, result, self.store.figures_key(job, options))
            return result
        if job.artifact and result.error is None and not result.built_from:   # kept before builds recorded it
            result.built_from = job.built_from()
        self.cached_runs(job, options, result)
        return result

    def cached_runs(self, job: ShardJob, options: dict, result: ShardBuild) -> None:
        """The runs a cached build's job asks for that no earlier build ran: the simulator runs only what
        its own process built, so the shard is built again for them (not exported)."""
        artifact = result.built_from.get("artifact")
        runs = job.runs.wanted(artifact) if job.runs and artifact and result.error is None else []
        if not runs:
            return
        with self.slot(job) as worker, job.runs.building():
            try:
                answer = build_request(worker.request, job.onnx, job.log.with_suffix(".sim.log"), options,
                                       keep=job.name, dataset=job.dataset or [], timeout=self.timeout)
            except WorkerFailed:   # the check builds it again and says why
                return
            outputs = self.run_where_built(worker, job, runs) if answer["ok"] else None
            if outputs:
                job.runs.made(artifact, outputs)

    @contextmanager
    def slot(self, job: ShardJob) -> Iterator[ToolkitWorker]:
        """A worker for the job's build, once fewer builds than the limit run (at_once)."""
        with self.gate:
            self.gate.wait_for(lambda: self.running < self.limit)
            self.running += 1
        try:
            with self.pool.worker(memory=worker_build_bytes(onnx_weight_bytes(job.onnx))) as worker:
                yield worker
        finally:
            with self.gate:
                self.running -= 1
                self.gate.notify_all()

    def run_where_built(self, worker: ToolkitWorker, job: ShardJob, runs: list) -> list | None:
        """The job's runs on the model its worker keeps (simulate.runs_where_built), their files and
        log beside its build log."""
        return runs_where_built(lambda **req: worker.request(**{"timeout": self.timeout, **req}), job.name,
                                runs, job.log.parent)

    def simulator(self) -> ShardByShard:
        """The simulator on these workers, one shard each at a time, as many at once as builds may run."""
        with self.gate:
            return ShardByShard(self.target.name, self.limit, self.timeout, pool=self.pool)

    def figures(self, job: ShardJob, build: dict) -> ShardBuild | None:
        found = self.store.figures(job, self.target.build_for(build, job.precision, job.float16, job.disable_rules)) \
            if self.store else None
        if found is not None:
            found.diagnostics = in_common_words(found.diagnostics)
        return found

    def results(self, futures: list[Future]) -> list[ShardBuild]:
        wait(futures, return_when=FIRST_EXCEPTION)
        failed = next((f for f in futures if f.done() and f.exception()), None)
        if failed is not None:  # a bug, not a failed build: __exit__ stops the others
            raise failed.exception()
        return [f.result() for f in futures]

    def __enter__(self) -> ToolkitBuilds:
        return self

    def __exit__(self, kind, exc, tb) -> None:
        if kind is not None:   # a bug, SIGINT or SIGTERM (shard.cli): the builds under way end now
            self.pool.kill_all()
        self.executor.shutdown(wait=True, cancel_futures=True)
        self.pool.close()
        if kind is None and self.store:
            self.store.prune()


def build_shard(worker: ToolkitWorker, job: ShardJob, build: dict, timeout: float, keep: bool = False) -> ShardBuild:
    """One vendor build and what its log says; `error` set if it failed, crashed, timed out, or logged
    REGTASK errors (the caller decides whether that ends the compile). keep: the built model stays in
    the worker under the job's name, to run on the simulator (released by the caller)."""
    started = time.monotonic()
    job.log.write_text("")
    answer = {}   # the worker's, once it came: every result below carries the build's peak memory
    done = lambda diag, error=None: ShardBuild(  # noqa: E731
        name=job.name, seconds=round(time.monotonic() - started, 2), diagnostics=diag, error=error,
        peak_bytes=answer.get("peak_bytes"))
    try:
        answer = build_request(worker.request, job.onnx, job.log, build, job.artifact, keep=job.name if keep else None,
                               dataset=job.dataset or [], timeout=timeout)
    except WorkerFailed as exc:
        return done({}, f"{job.name}: the vendor build {exc}; log: {job.log}")
    parsed = parse_build_log(job.log.read_text(errors="replace"))
    diag = {**parsed.summary(), "cost_cycles": parsed.estimated_cycles + unestimated_cost(parsed.layers)[0],
            "macs_by_dtype": macs_by_dtype(parsed.layers)}
    if not answer["ok"]:
        with open(job.log, "a") as log:
            log.write(answer.get("traceback") or "")
        stage, returned, raised = build_failure(answer)
        if raised:  # the toolkit raised: its last line names the exception
            return done(diag, f"{job.name}: the vendor build crashed in {stage}() ({raised}); log: {job.log}")
        detail = parsed.first_error or "no error line in the log"
        return done(diag, f"{job.name}: the vendor build failed ({stage}() returned {returned}): {detail}; "
                          f"log: {job.log}")
    if parsed.regtask_lines:
        return done(diag, f"{job.name}: the vendor build returned 0 but logged {parsed.regtask_lines} REGTASK errors "
                          f"(a register field overflows; this shard would fail on the board): {parsed.first_regtask}; "
                          f"log: {job.log}")
    return done(diag)
