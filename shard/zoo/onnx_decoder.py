"""A decoder exported to ONNX with its KV cache as inputs and outputs (optimum's layout for
text-generation-with-past) as the fixed-shape steps of a generative bundle (shard.zoo.decoder's form):

    input_ids [1, T], attention_mask [1, P + T], position_ids [1, T],
    past_key_values.i.key, past_key_values.i.value [1, kv_heads, P, head_dim]
        -> logits [1, T, vocab], present.i.key, present.i.value [1, kv_heads, P + T, head_dim]

A step fixes T (the prefill chunk, or 1) and P (the cache's capacity C); the token lookup (the Gather
of input_ids) leaves the graph, its table becomes the bundle's embeddings and its output the step's
input inputs_embeds; the cache inputs are renamed past_key.i, past_value.i, and each present output
is cut to its last T entries (key.i, value.i): only the new tokens' keys and values come back; a step
of several tokens takes `pick` [1, 1, T], the row its LM head reads (logits [1, 1, vocab]). The
attention_mask stays an input (the runtime makes it from the step's mask: shard.runtime.generate);
a NaN guard after attention's Softmax, for rows that mask every key, is dropped (drop_nan_guards).
The tokenizer and the end-of-answer tokens come from the ONNX file's folder, as the exporter leaves
them there.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from shard.errors import ShardError
from shard.graph import load_model, quiet_graphsurgeon, replace_uses, save_onnx
from shard.runtime.generate import PICK, Cache, as_attention_mask, prefill

PAST = re.compile(r"past_key_values\.(\d+)\.(key|value)$")
SCAN_BYTES = 64 << 20   # the graph's nodes come first in the file; the cache's first reader is early among them


def is_onnx_decoder(source: Path) -> bool:
    """An ONNX file whose inputs hold a KV cache in optimum's names. The file is parsed only where its
    first SCAN_BYTES name such an input: every ONNX compile asks."""
    if source.suffix != ".onnx" or not source.is_file():
        return False
    with open(source, "rb") as f:
        if b"past_key_values." not in f.read(SCAN_BYTES):
            return False
    try:
        model = onnx.load(str(source), load_external_data=False)
    except Exception:   # not ONNX: the ordinary compile says so
        return False
    return any(PAST.match(i.name) for i in model.graph.input)


@dataclass
class OnnxDecoder:
    path: Path
    layers: int
    kv_heads: int
    head_dim: int
    hidden: int
    vocab: int
    table: np.ndarray   # the token embeddings, [vocab, hidden] float32
    lookup: str         # the Gather's output: where inputs_embeds comes in
    weight_bytes: int   # fp16 bytes of the weights a step reads (the table only where the LM head shares it)


def read_onnx_decoder(source: Path) -> OnnxDecoder:
    """The decoder's shape and token table, or ShardError naming what its layout lacks."""
    model = load_model(source)
    names = {i.name: i for i in model.graph.input}
    layers = sorted({int(PAST.match(n).group(1)) for n in names if PAST.match(n)})
    missing = [n for n in ("input_ids", "attention_mask", "position_ids") if n not in names]
    missing += [f"past_key_values.{i}.{k}" for i in range(len(layers)) for k in ("key", "value")
                if f"past_key_values.{i}.{k}" not in names]
    outputs = {o.name for o in model.graph.output}
    missing += [n for n in ["logits"] + [f"present.{i}.{k}" for i in range(len(layers)) for k in ("key", "value")]
                if n not in outputs]
    if missing:
        raise ShardError(f"{source}: an ONNX decoder with a KV cache needs optimum's inputs and outputs; "
                         f"missing {', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''}")
    dims = [d.dim_value for d in names["past_key_values.0.key"].type.tensor_type.shape.dim]
    if len(dims) != 4 or not dims[1] or not dims[3]:
        raise ShardError(f"{source}: past_key_values.0.key should be [batch, kv_heads, past, head_dim] with "
                         f"kv_heads and head_dim fixed; it is {dims}")
    weights = {t.name: t for t in model.graph.initializer}
    lookups = [n for n in model.graph.node if n.op_type == "Gather" and n.input[1] == "input_ids"
               and n.input[0] in weights and len(weights[n.input[0]].dims) == 2]
    if len(lookups) != 1:
        raise ShardError(f"{source}: expected one token lookup (a Gather of a [vocab, hidden] table by input_ids); "
                         f"found {len(lookups)}")
    table = onnx.numpy_helper.to_array(weights[lookups[0].input[0]]).astype(np.float32)
    read = {name for node in model.graph.node if node is not lookups[0] for name in node.input}
    elements = sum(int(np.prod(t.dims)) for t in model.graph.initializer if t.name in read)
    return OnnxDecoder(source, len(layers), dims[1], dims[3], table.shape[1], table.shape[0], table,
                       lookups[0].output[0], 2 * elements)


def export_onnx_step(decoder: OnnxDecoder, path: Path, steps: int, capacity: int) -> Path:
    """The decoder's step of `steps` new tokens over a cache of `capacity`, in shard.zoo.decoder's
    names, written to `path` (weights beside it past protobuf's 2 GiB)."""
    model = load_model(decoder.path)
    shapes = {"input_ids": [1, steps], "attention_mask": [1, capacity + steps], "position_ids": [1, steps]}
    for value in model.graph.input:
        match = PAST.match(value.name)
        dims = [1, decoder.kv_heads, capacity, decoder.head_dim] if match else shapes.get(value.name)
        if dims is not None:
            del value.type.tensor_type.shape.dim[:]
            value.type.tensor_type.shape.dim.extend(onnx.TensorShapeProto.Dimension(dim_value=d) for d in dims)
    for value in model.graph.output:   # the exporter's symbolic sizes; shape inference writes the fixed ones
        value.type.tensor_type.ClearField("shape")
    quiet_graphsurgeon()
    graph = gs.import_onnx(model)
    del model
    graph.fold_constants().cleanup()   # the Shapes of the fixed inputs become constants
    tensors = graph.tensors()
    embeds = gs.Variable("inputs_embeds", np.float32, [1, steps, decoder.hidden])
    for node in graph.nodes:
        if decoder.lookup in (o.name for o in node.outputs):
            node.outputs.clear()
        node.inputs = [embeds if t is tensors[decoder.lookup] else t for t in node.inputs]
    inputs = [embeds]
    for value in graph.inputs:
        match = PAST.match(value.name)
        if match:
            value.name = f"past_{match.group(2)}.{match.group(1)}"
        if value.name != "input_ids":
            inputs.append(value)
    graph.inputs = inputs
    outputs = [t for t in graph.outputs if t.name == "logits"]
    for i in range(decoder.layers):
        for kind in ("key", "value"):
            present = tensors[f"present.{i}.{kind}"]
            present.name = f"present.{i}.{kind}/all"
            new = gs.Variable(f"{kind}.{i}", np.float32, [1, decoder.kv_heads, steps, decoder.head_dim])
            bounds = [gs.Constant(f"present.{i}.{kind}/{what}", np.array([value])) for what, value in
                      (("start", capacity), ("end", capacity + steps), ("axis", 2))]
            graph.layer(op="Slice", name=f"present.{i}.{kind}/new", inputs=[present, *bounds], outputs=[new])
            outputs.append(new)
    graph.outputs = outputs
    if steps > 1:
        pick_row(graph, decoder.path, steps)
    drop_nan_guards(graph)
    graph.cleanup().toposort()
    if any(t.name == "input_ids" for n in graph.nodes for t in n.inputs):
        raise ShardError(f"{decoder.path}: input_ids is read by more than the token lookup; shard takes "
                         f"decoders whose ids only select embeddings")
    save_onnx(gs.export_onnx(graph), path)
    return path


def pick_row(graph: gs.Graph, source: Path, steps: int) -> None:
    """The LM head (the MatMul that writes logits) fed the row the step's PICK input chooses
    ([1, 1, steps], one-hot: shard.runtime.generate.step_feeds) instead of every new token's."""
    logits = graph.tensors()["logits"]
    head = logits.inputs[0] if logits.inputs else None
    if head is None or head.op != "MatMul":
        raise ShardError(f"{source}: its logits come from {head.op if head else 'no op'}, not the LM head's MatMul; "
                         f"shard takes decoders whose logits are a MatMul of the last hidden state")
    pick = gs.Variable(PICK, np.float32, [1, 1, steps])
    picked = graph.layer(op="MatMul", name="pick/MatMul", inputs=[pick, head.inputs[0]],
                         outputs=[gs.Variable("pick/row", np.float32)])[0]
    head.inputs[0] = picked
    logits.shape = None
    graph.inputs.append(pick)


def drop_nan_guards(graph: gs.Graph) -> int:
    """Where(IsNaN(p), 0, p) after a Softmax p (transformers' attention writes it for rows with every key
    masked) read as p: a step's mask never masks a whole row (each new token sees itself:
    shard.runtime.generate.step_mask), and the vendor runs IsNaN on the CPU (2 ops in a 2-layer
    decoder's step on RK3588, toolkit 2.5.0). Returns how many."""
    dropped = 0
    for node in list(graph.nodes):
        if node.op != "Where" or len(node.inputs) != 3 or not node.inputs[0].inputs:
            continue
        test, probs = node.inputs[0].inputs[0], node.inputs[2]
        if test.op == "IsNaN" and test.inputs[0] is probs and probs.inputs and probs.inputs[0].op == "Softmax":
            replace_uses(node.outputs[0], probs)
            node.outputs.clear()
            dropped += 1
    return dropped


def load_tokenizer(source: Path):
    """The tokenizer the exporter left beside the ONNX file (transformers)."""
    import transformers

    try:
        return transformers.AutoTokenizer.from_pretrained(source.parent)
    except (OSError, ValueError) as exc:
        raise ShardError(f"{source}: no tokenizer beside it in {source.parent} (the exporter writes tokenizer.json "
                         f"there; {str(exc).splitlines()[0]})") from None


def ort_session(path: Path):
    """onnxruntime on the CPU over an ONNX file, its graph optimiser's warnings kept from the terminal."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])


def step_samples(decoder: OnnxDecoder, path: Path, tokenizer, width: int, capacity: int,
                 count: int = 2) -> dict[str, np.ndarray]:
    """shard.zoo.decoder.prompt_samples of the step at `path` (export_onnx_step), the cache holding the
    step's own keys and values (in onnxruntime)."""
    from shard.zoo.decoder import prompt_samples

    session = ort_session(path)
    names = [o.name for o in session.get_outputs()]

    def run(feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return dict(zip(names, session.run(None, as_attention_mask(feeds))))

    def cache_after(rows: np.ndarray) -> dict[str, np.ndarray]:
        cache = Cache.empty(decoder.layers, decoder.kv_heads, capacity, decoder.head_dim)
        if len(rows):
            prefill(run, cache, rows, width)
        return cache.feeds()

    return prompt_samples(tokenizer, decoder.table, width, capacity, cache_after, count, as_attention_mask)


def stop_ids(source: Path, tokenizer) -> list[int]:
    """The tokenizer's end of sequence and those the folder's config.json and generation_config.json name."""
    ids = {tokenizer.eos_token_id}
    for name in ("config.json", "generation_config.json"):
        path = source.parent / name
        if path.is_file():
            found = json.loads(path.read_text()).get("eos_token_id")
            ids.update(found if isinstance(found, list) else [found])
    return sorted(i for i in ids if i is not None)


class OnnxReference:
    """The ONNX decoder itself in onnxruntime fp32, the reference `shard verify` holds a bundle of it
    against: each answer computed again from the whole sequence (no cache)."""
    name = "onnxruntime fp32"

    def __init__(self, source: Path):
        found = read_onnx_decoder(source)
        self.layers, self.vocab = found.layers, found.vocab
        self.empty = {f"past_key_values.{i}.{kind}": np.zeros((1, found.kv_heads, 0, found.head_dim), np.float32)
                      for i in range(found.layers) for kind in ("key", "value")}
        self.session = ort_session(source)

    def logits(self, ids: list[int]) -> np.ndarray:
        """[len(ids), vocab]: each position's next-token logits."""
        n = len(ids)
        feeds = {"input_ids": np.array([ids], np.int64), "attention_mask": np.ones((1, n), np.int64),
                 "position_ids": np.arange(n, dtype=np.int64)[None], **self.empty}
        return self.session.run(["logits"], feeds)[0][0]

    def greedy(self, ids: list[int], new: int) -> list[int]:
        out = list(ids)
        for _ in range(new):
            out.append(int(np.argmax(self.logits(out)[-1])))
        return out[len(ids):]
