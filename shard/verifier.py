"""verify_bundle: the bundle against the original model, end to end and shard by shard."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import onnx

from shard.bundle import read_manifest
from shard.calibration import ort_session, run_each
from shard.compare import Comparison, compare, worst_of
from shard.errors import VerifyError
from shard.graph import fix_input_values, give_back_freed, load_model, sha256_file
from shard.passes.canonicalize import prepare_model
from shard.runtime import Session, random_inputs
from shard.runtime.generate import GenerativeSession, generate, teacher_forced
from shard.runtime.host import load_tables, run_host
from shard.zoo.onnx_decoder import OnnxReference, is_onnx_decoder


@dataclass
class VerifyReport:
    backend: str
    min_cosine: float
    outputs: list[Comparison]
    shards: dict[str, list[Comparison]] = field(default_factory=dict)    # each fed the reference's tensors
    chained: dict[str, list[Comparison]] = field(default_factory=dict)   # the same outputs, end to end
    reference_is_source: bool = True
    skipped_shards: dict[str, str] = field(default_factory=dict)
    samples: list[list[Comparison]] = field(default_factory=list)   # every output, per input sample
    files: dict[str, str] = field(default_factory=dict)   # each file the run read, against its recorded sha256

    @property
    def passed(self) -> bool:
        return all(c.cosine >= self.min_cosine for c in self.outputs)  # NaN never passes


def unjoin(manifest, expected: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The reference's values of the shard outputs the runtime concatenates or transposes into graph
    outputs on the host."""
    shapes = {t.name: t.shape for s in manifest.shards for t in s.outputs}
    pieces = {}
    for step in manifest.host_post:
        if step["op"] == "transpose" and step["output"] in expected and step["input"] in shapes:
            pieces[step["input"]] = expected[step["output"]].transpose(np.argsort(step["perm"]))
        if step["op"] == "reshape" and step["output"] in expected and step["input"] in shapes:
            pieces[step["input"]] = expected[step["output"]].reshape(shapes[step["input"]])
        if step["op"] != "concat" or step["output"] not in expected or not all(n in shapes for n in step["inputs"]):
            continue
        edges = np.cumsum([shapes[n][step["axis"]] for n in step["inputs"]])[:-1]
        for name, part in zip(step["inputs"], np.split(expected[step["output"]], edges, axis=step["axis"])):
            pieces[name] = part
    return pieces


def scaled_edges(manifest, expected: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The reference's values of the edges scale_sandwich holds divided by 2^k (as the shards pass them)."""
    return {name: expected[source] * np.float32(2.0 ** -k) for shard in manifest.shards
            for name, (source, k) in shard.edge_scales.items() if source in expected}


def check_reference(reference: str | Path, model, manifest) -> None:
    """The reference takes the bundle's inputs, in their ranks and static sizes, and makes its outputs;
    else one line (onnxruntime raised on the first sample, or on the outputs verify asks of it)."""
    weights = {t.name for t in model.graph.initializer}
    takes = {v.name: v for v in model.graph.input if v.name not in weights}
    makes = {v.name for v in model.graph.output}
    wanted, missing = [t.name for t in manifest.inputs], [t.name for t in manifest.outputs if t.name not in makes]
    if set(wanted) != set(takes) or missing:
        raise VerifyError(f"{reference} is not the model this bundle was compiled from: it takes "
                          f"{sorted(takes)} and makes {sorted(makes)}; the bundle takes {wanted} and makes "
                          f"{[t.name for t in manifest.outputs]}")
    for spec in manifest.inputs:
        dims = takes[spec.name].type.tensor_type.shape.dim
        # a dimension of 0 or less is as dynamic as a named one (exporters write -1)
        if len(dims) != len(spec.shape) or any(d.dim_value > 0 and d.dim_value != n for d, n in zip(dims, spec.shape)):
            shape = [d.dim_value if d.dim_value > 0 else d.dim_param or "?" for d in dims]
            raise VerifyError(f"{reference}: input {spec.name} has shape {shape}; the bundle's is {list(spec.shape)}")


def prepared_reference(reference: str | Path, manifest) -> tuple[onnx.ModelProto, bool]:
    """The reference model as compile read it (the inputs it fixed, fixed as it fixed them; an old opset
    upgraded), checked to take the bundle's inputs and make its outputs (check_reference); and whether
    that is the model its file holds (nothing fixed, upgraded or renumbered)."""
    model = load_model(reference)
    ir_version = model.ir_version
    fix_input_values(model, manifest.input_values)
    model, notes = prepare_model(model)
    check_reference(reference, model, manifest)
    return model, not (manifest.input_values or notes or model.ir_version != ir_version)


def reference_session(reference: str | Path, manifest):
    """onnxruntime over the reference as compile read it, its outputs only: over its file where that
    is the model (SigLIP-512: 0.74 GB at its peak, against 1.10 GB with its proto and a serialized copy
    beside onnxruntime's), and the memory read for the check handed back."""
    model, as_filed = prepared_reference(reference, manifest)
    if not as_filed:
        return ort_session(model)
    del model
    give_back_freed()
    return ort_session(Path(reference))


def reference_tensors(bundle: str | Path, reference: str | Path, manifest, samples: list[dict[str, np.ndarray]],
                      progress: Callable[[str, int, int], None] = lambda *a: None) -> list[dict[str, np.ndarray]]:
    """Per sample, the reference's (onnxruntime's) values of the bundle's outputs and of every shard edge
    the model has, as the bundle holds them (the host steps before the shards run, the pieces the host
    joins after them, edges held scaled)."""
    model, _ = prepared_reference(reference, manifest)
    known = {v.name for v in model.graph.value_info} | {o.name for o in model.graph.output} | \
        {n_out for node in model.graph.node for n_out in node.output}
    graph_inputs = {t.name for t in manifest.inputs}
    edges = [t.name for s in manifest.shards for t in (*s.inputs, *s.outputs) if t.name not in graph_inputs]
    edges = list(dict.fromkeys(e for e in edges if e in known))
    tables = load_tables(Path(bundle), manifest.host_pre)

    progress("reference (onnxruntime)", 0, len(samples))
    wanted = [*(t.name for t in manifest.outputs), *edges]
    references = []
    for k, (inputs, expected) in enumerate(zip(samples, run_each(model, samples, wanted))):
        expected.update(inputs)
        run_host(manifest.host_pre, expected, tables)  # the tensors the first shards take, as the runtime makes them
        expected.update(unjoin(manifest, expected))
        expected.update(scaled_edges(manifest, expected))
        references.append(expected)
        progress("reference (onnxruntime)", k + 1, len(samples))
    return references


def compared(outputs, references: list[dict[str, np.ndarray]], runs: list[dict[str, np.ndarray]]
             ) -> tuple[list[list[Comparison]], list[Comparison]]:
    """Every output against the reference's on every sample, and each output's worst sample."""
    per_sample = [[compare(t.name, expected[t.name], actual[t.name]) for t in outputs]
                  for expected, actual in zip(references, runs)]
    return per_sample, [worst_of(comps[i] for comps in per_sample) for i in range(len(outputs))]


def verify_bundle(bundle: str | Path, reference: str | Path, backend: str | None = None, min_cosine: float = 0.999,
                  seed: int = 0, session: Session | None = None,
                  progress: Callable[[str, int, int], None] = lambda *a: None,
                  samples: list[dict[str, np.ndarray]] | None = None, shards: bool = True) -> VerifyReport:
    """Run inputs through the reference (onnxruntime) and the bundle; compare every output. The inputs
    are `samples` (shard.calibration's format) or one seeded random sample; `outputs` holds each
    output's worst sample, and the shards are checked alone on the first sample (where `shards`)."""
    manifest = read_manifest(bundle)
    samples = samples or [random_inputs(manifest.inputs, seed)]
    references = reference_tensors(bundle, reference, manifest, samples, progress)
    own_session = session is None
    session = session or Session(bundle, backend)
    try:
        runs = []
        for k, inputs in enumerate(samples):
            progress("bundle end to end", k, len(samples))
            runs.append(session.run_all(inputs))
        per_sample, worst = compared(manifest.outputs, references, runs)
        report = VerifyReport(backend=session.backend, min_cosine=min_cosine, outputs=worst,
                              reference_is_source=sha256_file(reference) == manifest.source["sha256"],
                              samples=per_sample, files=dict(session.files))
        if shards:
            check_shards(report, session, manifest, references[0], runs[0], progress)
    finally:
        if own_session:
            session.close()
    return report


def check_shards(report: VerifyReport, session: Session, manifest, expected: dict, actual: dict,
                 progress: Callable[[str, int, int], None]) -> None:
    """Each shard fed the reference's tensors (`expected`, of the first sample) beside the same outputs
    in the end-to-end run (`actual`), into report.shards and report.chained."""
    for k, shard in enumerate(manifest.shards):
        progress("shards, fed the reference's tensors", k, len(manifest.shards))
        missing = [t.name for t in (*shard.inputs, *shard.outputs) if t.name not in expected]
        if missing:
            report.skipped_shards[shard.name] = f"reference has no tensor {missing[0]}"
            continue
        # in the shard's own types: a GPU bundle's stages pass fp16 between them
        got = session.run_shard(shard, {t.name: expected[t.name].astype(t.dtype, copy=False) for t in shard.inputs})
        report.shards[shard.name] = [compare(t.name, expected[t.name], got[t.name]) for t in shard.outputs]
        # The same outputs in the end-to-end run, where each shard took the bundle's own upstream
        # values: where this falls below the line above, error arrives from the shards before.
        report.chained[shard.name] = [compare(t.name, expected[t.name], actual[t.name]) for t in shard.outputs]


# What `shard verify` of a generative bundle asks when given no --prompt.
PROMPTS = ("What is the capital of France?", "Write a haiku about the sea.")


@dataclass
class PromptCheck:
    prompt: str
    prompt_tokens: int
    tokens: list[int]                # the bundle's greedy answer
    reference_tokens: list[int]      # the reference's
    steps: int                       # teacher-forced steps compared
    top1: float                      # the share of those steps whose most likely token is the reference's
    min_cosine: float
    mean_cosine: float
    parting: Parting | None = None   # where the greedy answers part, if they do

    @property
    def same_tokens(self) -> bool:
        return self.tokens == self.reference_tokens[:len(self.tokens)]


@dataclass
class Parting:
    """Where a greedy answer leaves the reference's: the token, and the reference's own margin there
    (its top two logits) beside fp16's spacing at that logit. A margin under the spacing is a tie in
    fp16: an error of half a spacing, fp16's own rounding of each, can make the two one value, and
    argmax then takes the lower id."""
    token: int
    margin: float
    spacing: float

    @property
    def fp16_tie(self) -> bool:
        return self.margin < self.spacing

    def __str__(self) -> str:
        return (f"from token {self.token}: the reference's top two differ by {self.margin:.4f}, fp16's spacing there "
                f"is {self.spacing:.4f}{' (a tie in fp16)' if self.fp16_tie else ''}")


def parting(ours: list[int], theirs: list[int], logits: np.ndarray) -> Parting | None:
    """Where `ours` leaves `theirs`, with the reference's margin there (`logits`: the reference's, a row
    per token of `theirs`); None where they agree."""
    k = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
    if k is None:
        return None
    top = np.sort(logits[k].astype(np.float32))[-2:]
    return Parting(k, float(top[1] - top[0]), float(np.spacing(np.float16(top[1]))))


@dataclass
class GenerativeReport:
    backend: str
    min_cosine: float
    min_top1: float
    prompts: list[PromptCheck]
    files: dict[str, str]            # every program's files, against their recorded sha256
    reference_is_source: bool
    reference: str = "transformers fp32"   # what the bundle was held against

    @property
    def passed(self) -> bool:
        return all(p.min_cosine >= self.min_cosine and p.top1 >= self.min_top1 for p in self.prompts)


class TransformersReference:
    """A transformers causal LM in fp32 as shard.zoo.onnx_decoder.OnnxReference answers: greedy tokens, and
    a forward's logits."""
    name = "transformers fp32"

    def __init__(self, model):
        self.model = model

    def logits(self, ids: list[int]) -> np.ndarray:
        import torch

        with torch.no_grad():
            return self.model(torch.tensor([ids])).logits[0].numpy()

    def greedy(self, ids: list[int], new: int) -> list[int]:
        import torch

        prompt = torch.tensor([ids])
        with torch.no_grad():   # every prompt token attended: without a mask, generate hides those equal to the pad id
            return self.model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new,
                                       min_new_tokens=new, do_sample=False, eos_token_id=None,
                                       pad_token_id=0)[0, len(ids):].tolist()


def check_prompt(run, table: np.ndarray, cache, chunk: int, model, ids: list[int], new: int, forced: int,
                 decode: int = 1) -> PromptCheck:
    """One prompt's token ids through steps `run` (shard.runtime.generate, embeddings from `table`; the
    answer's tokens through the step of width `decode`) beside the reference `model` (a transformers
    model, or one that answers as TransformersReference does): the greedy answer of `new` tokens, and
    `forced` teacher-forced steps (the prompt, then the reference's own answer a token a step) against
    the reference's one full forward."""
    ours = generate(run, table, table[ids], cache(), new, chunk, decode=decode)
    count = max(new, forced)
    reference = model if hasattr(model, "greedy") else TransformersReference(model)
    theirs = reference.greedy(ids, count)
    want = reference.logits(ids + theirs)[len(ids) - 1:]
    got = teacher_forced(run, cache(), table[ids + theirs[:forced - 1]], len(ids) - 1, chunk, decode)
    rows = [compare("logits", want[k], g) for k, g in enumerate(got)]
    top1 = float(np.mean([np.argmax(g) == np.argmax(want[k]) for k, g in enumerate(got)]))
    return PromptCheck("", len(ids), ours, theirs[:new], len(got), top1, worst_of(rows).cosine,
                       float(np.mean([r.cosine for r in rows])), parting(ours, theirs, want))


def reference_model(reference: Path):
    """(the reference, its layers, its vocabulary): an ONNX decoder in onnxruntime, else a checkpoint in
    transformers, fp32 (TransformersReference)."""
    if is_onnx_decoder(reference):
        model = OnnxReference(reference)
        return model, model.layers, model.vocab
    from shard.zoo.decoder import load_causal_lm, text_parts

    model, _ = load_causal_lm(reference)
    config = text_parts(model)[2]
    return TransformersReference(model), config.num_hidden_layers, config.vocab_size


def verify_generative(bundle: str | Path, reference: str | Path, prompts=PROMPTS, new: int = 32, forced: int = 32,
                      backend: str | None = None, min_cosine: float = 0.999, min_top1: float = 0.99,
                      progress: Callable = lambda *a: None) -> GenerativeReport:
    """A generative bundle against its checkpoint in transformers fp32 (or its ONNX decoder in
    onnxruntime fp32): per chat prompt, the greedy tokens and the teacher-forced logits of every step
    (check_prompt)."""
    from shard.zoo.decoder import checkpoint_record

    progress("read the reference", 0, 1)
    model, layers, vocab = reference_model(Path(reference))
    with GenerativeSession(bundle, backend=backend) as session:
        if session.spec.vocab != vocab or session.spec.layers != layers:
            raise VerifyError(f"{reference} is not the model this bundle was compiled from: {layers} "
                              f"layers and {vocab} tokens; the bundle's {session.spec.layers} and "
                              f"{session.spec.vocab}")
        programs = [(p.name, session.sessions[p.width, p.capacity]) for p in session.spec.programs]
        if session.vision:
            programs.append((session.spec.vision["program"], session.vision))
        files = {f"{name}/{rel}": check for name, s in programs for rel, check in s.files.items()}
        files.update({name: f"ok (sha256 {digest[:12]}, {size} bytes)" for name, (size, digest) in
                      session.spec.files.items()})   # checked as the session read them
        checks = []
        for k, prompt in enumerate(prompts):
            progress(f"prompts ({session.backend})", k, len(prompts))
            ids, _ = session.prompts.encode(prompt, chat=True)
            check = check_prompt(session.run, session.table, session.cache, session.spec.chunk, model, ids, new, forced,
                                 session.spec.decode_width)
            check.prompt = prompt
            checks.append(check)
        progress(f"prompts ({session.backend})", len(prompts), len(prompts))
        same = checkpoint_record(Path(reference))["sha256"] == session.spec.source.get("sha256")
        return GenerativeReport(session.backend, min_cosine, min_top1, checks, files, same, model.name)
