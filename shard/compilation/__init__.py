"""compile_model: ONNX in, bundle out.

A compile is a short list of named stages, each handing its record to the next (stages.py, state.py);
around it, the bundle cache (cached.py: a model compiled the same way again comes back from it), and the
variants that run it more than once (variants.py: a bundle per bucket of input shapes, the rounds of mixed
precision). The rooms: jobs.py writes what the vendor builds, choice.py keeps the better build and stands the whole
beside the vendor alone, writer.py writes the bundle, staging.py keeps a failed compile from leaving
anything at the output, generative.py compiles a decoder's checkpoint as several programs, each
through cached.py.
"""

from __future__ import annotations

import json
from pathlib import Path

from shard.compilation.batching import batched
from shard.compilation.cached import compile_one_model, default_output
from shard.compilation.generative import compile_generative, is_causal_lm
from shard.compilation.names import Progress
from shard.compilation.staging import check_options
from shard.compilation.state import CompileResult
from shard.errors import ShardError
from shard.options import CompileOptions
from shard.targets.chips import DEFAULT_TARGET


def compile_model(model: str | Path, target: str = DEFAULT_TARGET, output: str | Path | None = None,
                  options: CompileOptions | None = None, progress: Progress = lambda *a: None) -> CompileResult:
    """Compile an ONNX model into a bundle directory; on failure nothing is left at `output`. The same
    model compiled again the same way comes back from the bundle cache (shard.bundle_cache). A
    decoder's checkpoint (GGUF, transformers folder) becomes a generative bundle (generative.py)."""
    options = options or CompileOptions()
    check_options(options)
    model = Path(model)
    output = Path(output) if output else default_output(model)
    if is_causal_lm(model):   # a decoder's checkpoint: a generative bundle, its default context and chunk
        if options.batch != 1:
            raise ShardError("--batch is for models that take frames; a decoder generates one sequence")
        return compile_generative(model, target, output, options, progress=progress)
    options, choice = batched(model, target, options, progress)
    result = compile_one_model(model, target, output, options, progress)
    if choice:   # the cost model's weighing, in the report beside what it chose
        result.report["batch_auto"] = choice
        (result.bundle / "report.json").write_text(json.dumps(result.report, indent=2) + "\n")
    return result
