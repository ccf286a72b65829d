"""A decoder compiled into a generative bundle (shard.compilation.generative) and run by
GenerativeSession / `shard generate`: the tokens and logits are transformers' own, on onnxruntime
(cpu) and on the rknn simulator."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers as tf
from conftest import cosine, shard_cli

from shard.bundle import read_manifest
from shard.compilation.generative import compile_generative, vision_time
from shard.errors import RunError, ShardError
from shard.runtime import load
from shard.runtime.executors import held_nhwc
from shard.runtime.generate import Cache, GenerativeSession, sampler, step_mask, teacher_forced
from shard.runtime.generative_bundle import read_generative
from shard.summary import Predicted
from shard.verifier import parting

WORDS = ["<pad>", "<s>", "</s>", "<|user|>", "<|assistant|>"] + [f"w{k}" for k in range(92)]   # 97 tokens
TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} </s> {% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
PROMPT = [5, 17, 3, 88, 41, 9, 60]   # 7 tokens: a full chunk of 4 and one of 3


def tiny_tokenizer() -> tf.PreTrainedTokenizerFast:
    """A word-level tokenizer over WORDS, with a chat template: built here, nothing downloaded."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    core = Tokenizer(models.WordLevel({w: k for k, w in enumerate(WORDS)}, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return tf.PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                      unk_token="<pad>", chat_template=TEMPLATE)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A 2-layer Llama with grouped-query attention (4 heads, 2 of keys and values), seeded weights,
    saved as a transformers folder with its tokenizer."""
    torch.manual_seed(0)
    config = tf.LlamaConfig(vocab_size=len(WORDS), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                            tie_word_embeddings=True, initializer_range=0.2, eos_token_id=2, bos_token_id=1)
    model = tf.LlamaForCausalLM(config).eval()
    folder = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder, model


def test_the_reference_s_greedy_attends_to_every_prompt_token(checkpoint):
    # transformers' generate without a mask hides the prompt's tokens equal to the pad id: verify's
    # reference answered a prompt of the tiny tokenizer's unknown words (id 0) as if they were not there,
    # and every greedy answer "differed" from token 1 while the teacher-forced logits agreed
    from shard.verifier import TransformersReference

    _, model = checkpoint
    ids, seq = [0, 5, 0, 17, 0], [0, 5, 0, 17, 0]
    with torch.no_grad():
        for _ in range(4):
            seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
    assert TransformersReference(model).greedy(ids, 4) == seq[len(ids):]


def transformers_greedy(model, ids: list[int], new: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=new, min_new_tokens=new, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()


@pytest.fixture(scope="module")
def cpu_bundle(checkpoint, tmp_path_factory):
    folder, _ = checkpoint
    return compile_generative(folder, "cpu", tmp_path_factory.mktemp("cpu") / "lm.shard", capacity=32, chunk=4)


def test_a_cpu_bundle_generates_transformers_own_tokens_and_logits(checkpoint, cpu_bundle):
    _, model = checkpoint
    assert [(p.name, p.width, p.capacity) for p in cpu_bundle.spec.programs] == [("prefill", 4, 32), ("decode", 1, 32)]
    assert cpu_bundle.spec.stop == [2]
    with load(cpu_bundle.bundle) as session:
        assert isinstance(session, GenerativeSession)
        out = session.generate(PROMPT, max_new_tokens=16, stop=set())
        assert out.tokens == transformers_greedy(model, PROMPT, 16)
        assert [w for w, _ in out.steps] == [4, 4] + [1] * 15   # the prompt in 2 chunks, then 15 decode steps
        ids = PROMPT + list(range(20, 36))
        with torch.no_grad():
            want = model(torch.tensor([ids])).logits[0].numpy()
        assert np.abs(session.logits(ids) - want).max() < 1e-4


def test_the_cache_moves_up_through_its_buckets_as_the_context_grows(checkpoint, tmp_path):
    """--max-context 8,32: the 7-token prompt and the first token in the cache of 8, then the cache
    copied into one of 32 and the programs compiled for it; the tokens stay transformers' own."""
    folder, model = checkpoint
    result = compile_generative(folder, "cpu", tmp_path / "lm.shard", capacity=[32, 8], chunk=4)
    assert [p.name for p in result.spec.programs] == ["prefill-8", "decode-8", "prefill-32", "decode-32"]
    assert [row["capacity"] for row in result.predicted] == [8, 32]
    with load(result.bundle) as session:
        assert session.generate(PROMPT, max_new_tokens=16, stop=set()).tokens == transformers_greedy(model, PROMPT, 16)
        runs = {key: s.frames_run for key, s in session.sessions.items()}
        assert runs == {(4, 8): 2, (1, 8): 1, (4, 32): 0, (1, 32): 14}, runs
        # 25 prompt tokens and 12 asked for: 8 fill the cache of 32 (the last is not fed back), then it
        # stops, saying so, where it streamed text and then raised
        full = session.generate(list(range(5, 30)), max_new_tokens=12, stop=set())
        assert full.tokens == transformers_greedy(model, list(range(5, 30)), 8) and full.full == 32
        assert session.generate(list(range(5, 30)), max_new_tokens=8, stop=set()).full is None


def test_one_step_program_per_capacity_takes_the_answer_too(checkpoint, tmp_path):
    """compile --one-step: the step of --chunk tokens alone, per cache capacity, one copy of the
    weights where two programs hold two; each answer token goes through it with the rest of the
    step padded, and the tokens and logits stay transformers' own."""
    from shard.verifier import check_prompt

    folder, model = checkpoint
    res = shard_cli("compile", str(folder), "--target", "cpu", "--max-context", "8,32", "--chunk", "4", "--one-step",
                    "-o", str(tmp_path / "lm.shard"))
    assert res.returncode == 0, res.stderr
    assert "program step-8: 4 tokens a step over a cache of 8" in res.stdout
    spec = read_generative(tmp_path / "lm.shard")
    assert [(p.name, p.width) for p in spec.programs] == [("step-8", 4), ("step-32", 4)] and spec.decode_width == 4
    two = compile_generative(folder, "cpu", tmp_path / "two.shard", capacity=[8, 32], chunk=4)
    weights = lambda bundle: sum(f.stat().st_size for f in bundle.rglob("*.onnx*"))  # noqa: E731
    assert weights(tmp_path / "lm.shard") < 0.55 * weights(two.bundle)
    with load(tmp_path / "lm.shard") as session:
        out = session.generate(PROMPT, max_new_tokens=16, stop=set())
        assert out.tokens == transformers_greedy(model, PROMPT, 16)
        assert [w for w, _ in out.steps] == [4] * 17   # the prompt in 2 steps, then 15 answer tokens a step each
        assert {key: s.frames_run for key, s in session.sessions.items()} == {(4, 8): 3, (4, 32): 14}
        check = check_prompt(session.run, session.table, session.cache, spec.chunk, model, PROMPT, 8, 12,
                             spec.decode_width)
        assert check.same_tokens and check.top1 == 1.0 and check.min_cosine > 0.99999


def test_a_nan_in_a_later_steps_logits_is_the_prompts_worst_cosine(checkpoint, cpu_bundle):
    """The teacher-forced steps' worst cosine is NaN where any step's logits are, not only the first
    (min over floats kept a NaN only where it came first): such a prompt never passes verify."""
    from shard.compare import lowest
    from shard.verifier import check_prompt

    _, model = checkpoint
    with load(cpu_bundle.bundle) as session:
        decodes = []

        def faulty(feeds):   # the bundle's own step; from the second decode step on, its logits NaN
            outputs = session.run(feeds)
            decodes.extend([1] if feeds["inputs_embeds"].shape[1] == 1 else [])
            return {**outputs, "logits": outputs["logits"] * np.nan} if len(decodes) >= 2 else outputs

        spec = session.spec
        clean = check_prompt(session.run, session.table, session.cache, spec.chunk, model, PROMPT, 1, 6)
        # one greedy token (the prompt's steps alone), then 6 teacher-forced: the prompt's, 5 decode steps
        check = check_prompt(faulty, session.table, session.cache, spec.chunk, model, PROMPT, 1, 6)
    assert len(decodes) == 5 and clean.min_cosine > 0.99999 and np.isnan(check.min_cosine)
    assert np.isnan(lowest([0.9, float("nan"), 0.5])) and lowest([0.9, 0.5, 0.99]) == 0.5


def test_an_npu_runtime_is_handed_the_cache_as_held_with_no_copy():
    """A cache held as the board's runtime takes it (float16, NHWC memory) goes to an rknn runtime as
    that memory with data_format "nhwc", through the buckets too; float64 goes as float32, and
    ONNX's layout as "nchw"."""
    from shard.bundle import ShardSpec, TensorSpec
    from shard.runtime.executors import npu_inputs
    from shard.runtime.generate import grown

    cache = Cache.empty(layers=1, kv_heads=2, capacity=8, head_dim=4, dtype=np.float16, buckets=(16,), nhwc=True)
    cache.write({"key.0": np.ones((1, 2, 3, 4), np.float32), "value.0": np.full((1, 2, 3, 4), 2.0)}, 3)
    cache.make_room(9)
    key = cache.keys[0]
    assert key.shape == (1, 2, 16, 4) and key.dtype == np.float16 and held_nhwc(key)
    assert key[:, :, :3].min() == key[:, :, :3].max() == 1 and not key[:, :, 3:].any()
    shard = ShardSpec("s", "s.onnx", None, None, [TensorSpec("past_key.0", [1, 2, 16, 4], "float32"),
                                                  TensorSpec("mask", [1, 1, 1, 16], "float32"),
                                                  TensorSpec("x", [1, 4], "float64")], [], 0, "fp16")
    mask, x = np.zeros((1, 1, 1, 16), np.float32), np.arange(4.0)[None]
    arrays, formats = npu_inputs(shard, {"past_key.0": key, "mask": mask, "x": x})
    assert formats == ["nhwc", "nchw", "nchw"]
    assert arrays[0].shape == (1, 16, 4, 2) and arrays[0].dtype == np.float16 and np.shares_memory(arrays[0], key)
    np.testing.assert_array_equal(arrays[0], key.transpose(0, 2, 3, 1))
    assert np.shares_memory(arrays[1], mask) and arrays[2].dtype == np.float32
    plain = grown(Cache.empty(layers=1, kv_heads=2, capacity=8, head_dim=4).keys[0], 16)
    assert npu_inputs(shard, {"past_key.0": plain, "mask": mask, "x": x})[1][0] == "nchw"


def test_the_compile_says_where_one_step_would_decode_faster():
    from rich.console import Console

    from shard.summary import SpeedRow, speed_lines, speed_table

    row = {"capacity": 512, "prefill_128_ms": 112.5, "decode_tokens_per_s": 64.9, "one_step_tokens_per_s": 71.1,
           "weight_bytes": 269_000_000, "cache_bytes": 12_000_000}
    lines = speed_lines([SpeedRow.of(row, "predicted[0]")])
    assert any("--one-step: the answer's tokens through the prompt's step would decode at 71.1 tokens/s" in line
               for line in lines)
    rows = [SpeedRow.of({**row, "one_step_tokens_per_s": 60.2}, "predicted[0]")]
    console = Console(width=160)
    with console.capture() as seen:
        console.print(speed_table(rows))
    assert not any("--one-step" in line for line in speed_lines(rows)) and "64.9" in seen.get()


def test_a_cache_of_torch_tensors_takes_the_steps_own_entries_through_its_buckets(checkpoint, tmp_path):
    """The cache a GPU backend keeps on the GPU (Cache.empty with a device), here torch tensors on the
    CPU: the steps' feeds are those tensors (Session.check_inputs takes them), their new entries are
    written in, it moves up a bucket as the context grows, and the tokens stay transformers' own."""
    from shard.runtime.generate import Cache, generate

    folder, model = checkpoint
    result = compile_generative(folder, "cpu", tmp_path / "lm.shard", capacity=[32, 8], chunk=4)
    with load(result.bundle) as session:
        spec = session.spec
        cache = Cache.empty(spec.layers, spec.kv_heads, 8, spec.head_dim, buckets=(32,), device="cpu")
        tokens = generate(session.run, session.table, session.table[PROMPT], cache, 16, spec.chunk)
        assert tokens == transformers_greedy(model, PROMPT, 16)
        assert isinstance(cache.keys[0], torch.Tensor) and cache.capacity == 32 and cache.length == 7 + 15
        with torch.no_grad():
            want = model(torch.tensor([PROMPT + tokens[:-1]]), use_cache=True).past_key_values
        keys = want.layers[0].keys if hasattr(want, "layers") else want[0][0]
        assert torch.allclose(cache.keys[0][:, :, :cache.length], keys, atol=1e-4)   # rotated, as transformers keeps them


def export_with_past(model, folder):
    """The model as optimum exports a decoder with its KV cache (text-generation-with-past): input_ids,
    attention_mask, position_ids and past_key_values.i.key/value in; logits and present.i.key/value
    out; every length dynamic. Its tokenizer and config beside it, as the exporter leaves them."""
    from transformers import DynamicCache

    layers, kv = model.config.num_hidden_layers, model.config.num_key_value_heads
    head_dim = model.config.hidden_size // model.config.num_attention_heads

    class WithPast(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, input_ids, attention_mask, position_ids, *past):
            cache = DynamicCache()
            for i in range(layers):
                cache.update(past[2 * i], past[2 * i + 1], i)
            out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                        past_key_values=cache, use_cache=True)
            return (out.logits, *[t for layer in out.past_key_values.layers for t in (layer.keys, layer.values)])

    cache = [f"{i}.{kind}" for i in range(layers) for kind in ("key", "value")]
    inputs = ["input_ids", "attention_mask", "position_ids", *(f"past_key_values.{c}" for c in cache)]
    outputs = ["logits", *(f"present.{c}" for c in cache)]
    axes = {"input_ids": {1: "new"}, "attention_mask": {1: "total"}, "position_ids": {1: "new"}, "logits": {1: "new"},
            **{n: {2: "past"} for n in inputs[3:]}, **{n: {2: "total"} for n in outputs[1:]}}
    args = (torch.zeros(1, 3, dtype=torch.int64), torch.ones(1, 8, dtype=torch.int64), torch.arange(5, 8)[None],
            *[torch.zeros(1, kv, 5, head_dim) for _ in cache])
    with torch.no_grad():
        torch.onnx.export(WithPast().eval(), args, str(folder / "model.onnx"), input_names=inputs, output_names=outputs,
                          dynamic_axes=axes, opset_version=17, dynamo=False)
    model.config.save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder / "model.onnx"


def test_an_onnx_decoder_with_its_cache_as_inputs_generates_transformers_own_tokens(checkpoint, tmp_path):
    # optimum's layout: the token lookup leaves the graph for the host's table, the cache inputs take
    # the steps' names, the present outputs are cut to the new entries, attention_mask stays an input.
    _, model = checkpoint
    onnx_file = export_with_past(model, tmp_path)
    res = shard_cli("compile", str(onnx_file), "--target", "cpu", "--max-context", "32", "--chunk", "4", "-o",
                    str(tmp_path / "lm.shard"))
    assert res.returncode == 0, res.stderr
    spec = read_generative(tmp_path / "lm.shard")
    assert (spec.layers, spec.kv_heads, spec.head_dim, spec.vocab, spec.stop) == (2, 2, 16, len(WORDS), [2])
    with load(tmp_path / "lm.shard") as session:
        assert {t.name for t in session.sessions[4, 32].manifest.inputs} == {
            "inputs_embeds", "attention_mask", "position_ids", "pick", "past_key.0", "past_value.0", "past_key.1",
            "past_value.1"}
        assert session.generate(PROMPT, max_new_tokens=16, stop=set()).tokens == transformers_greedy(model, PROMPT, 16)
        ids = PROMPT + list(range(20, 36))
        with torch.no_grad():
            want = model(torch.tensor([ids])).logits[0].numpy()
        assert np.abs(session.logits(ids) - want).max() < 1e-4
        assert session.generate("w3 w7 w9", chat=True, max_new_tokens=4, stop=set()).tokens == transformers_greedy(
            model, tiny_tokenizer().apply_chat_template([{"role": "user", "content": "w3 w7 w9"}], tokenize=True,
                                                        add_generation_prompt=True, return_dict=False), 4)
    # shard verify holds it against the ONNX file itself, in onnxruntime fp32
    res = shard_cli("verify", str(tmp_path / "lm.shard"), "--reference", str(onnx_file), "--prompt", "w3 w7 w9",
                    "--new", "6", "--forced", "8", "--json", str(tmp_path / "v.json"))
    assert res.returncode == 0, res.stderr
    report = json.loads((tmp_path / "v.json").read_text())
    assert report["passed"] and report["reference_is_source"] and report["reference"] == "onnxruntime fp32"
    assert "vs onnxruntime fp32" in res.stdout
    assert all(p["tokens"] == p["reference_tokens"] and p["top1"] == 1.0 and p["min_cosine"] > 0.99999
               for p in report["prompts"])


def test_an_onnx_decoder_runs_on_the_simulator_with_no_op_on_the_cpu(checkpoint, tmp_path):
    # The exporter's NaN guard after each attention Softmax (IsNaN, which the vendor runs on the CPU)
    # is dropped: a step never masks every key of a row.
    _, model = checkpoint
    result = compile_generative(export_with_past(model, tmp_path), "rk3588", tmp_path / "lm.shard", capacity=16, chunk=4)
    for name, report in result.reports.items():
        assert report["totals"]["cpu_ops"] == 0 and report["totals"]["overflow_lines"] == 0, name
    with load(result.bundle, backend="sim") as session:
        out = session.generate(PROMPT, max_new_tokens=8, stop=set())
        assert out.tokens == transformers_greedy(model, PROMPT, 8)
        ids = PROMPT + out.tokens
        with torch.no_grad():
            want = model(torch.tensor([ids])).logits[0].numpy()
        got = session.logits(ids)
        assert min(cosine(got[k], want[k]) for k in range(len(ids))) >= 0.999


def test_text_chat_and_the_cli(checkpoint, cpu_bundle, tmp_path):
    _, model = checkpoint
    ids = tiny_tokenizer().apply_chat_template([{"role": "user", "content": "w3 w7 w9"}], tokenize=True,
                                               add_generation_prompt=True, return_dict=False)
    want = transformers_greedy(model, ids, 6)
    res = shard_cli("generate", str(cpu_bundle.bundle), "--prompt", "w3 w7 w9", "--chat", "--max-new-tokens", "6",
                    "--json", str(tmp_path / "out.json"))
    assert res.returncode == 0, res.stderr
    written = json.loads((tmp_path / "out.json").read_text())
    assert written["prompt_ids"] == ids
    assert written["ids"] and written["ids"] == want[:len(written["ids"])]
    assert len(written["ids"]) == 6 or written["ids"][-1] == 2   # all 6, or up to the stop token
    assert written["text"] in res.stdout and len(written["decode_ms"]) == len(written["ids"]) - 1
    assert "prompt tokens" in res.stderr and "tokens/s (cpu)" in res.stderr
    res = shard_cli("generate", str(cpu_bundle.bundle), "--ids", "5,17,3", "--max-new-tokens", "4")
    printed = res.stdout.split()   # up to a stop token
    assert res.returncode == 0 and printed and printed == [str(t) for t in transformers_greedy(model, [5, 17, 3], 4)][
        :len(printed)]


def test_a_generative_pack_answers_as_the_bundle_does_and_times_its_steps(checkpoint, cpu_bundle, tmp_path):
    """shard pack of a generative bundle: each program packed as a bundle is, beside the spec, the
    embeddings, the tokenizer and the compile's prediction. Unpacked, its run.py answers a chat prompt with
    the bundle's own tokens, and --bench times prefill and decode beside the prediction."""
    _, model = checkpoint
    res = shard_cli("pack", str(cpu_bundle.bundle), "-o", str(tmp_path / "lm.tar.gz"))
    assert res.returncode == 0, res.stderr
    with tarfile.open(tmp_path / "lm.tar.gz") as tar:
        names = set(tar.getnames())
        tar.extractall(tmp_path / "board", filter="data")
    assert {"lm/run.py", "lm/bundle/generative.json", "lm/bundle/embeddings.npy", "lm/bundle/report.json",
            "lm/bundle/prefill/manifest.json", "lm/bundle/decode/manifest.json", "lm/bundle/tokenizer/tokenizer.json",
            "lm/shard/runtime/generate.py"} <= names
    run = [sys.executable, "run.py", "--backend", "cpu"]
    answered = subprocess.run([*run, "--prompt", "w3 w7 w9", "--max-new", "6"], cwd=tmp_path / "board" / "lm",
                              capture_output=True, text=True)
    assert answered.returncode == 0, answered.stderr
    with GenerativeSession(cpu_bundle.bundle, backend="cpu") as session:
        done = session.generate("w3 w7 w9", max_new_tokens=6, chat=True)
    assert done.tokens == transformers_greedy(model, done.prompt, 6)[:len(done.tokens)]
    assert f"{done.text}\n{len(done.prompt)} prompt tokens in" in answered.stdout
    timed = subprocess.run([*run, "--bench"], cwd=tmp_path / "board" / "lm", capture_output=True, text=True)
    assert timed.returncode == 0, timed.stderr
    assert "measured on cpu (capacity 32): prefill of 24 tokens" in timed.stdout   # 32 less 8 new
    assert "decode" in timed.stdout and "predicted by the compile" in timed.stdout


def test_sampling_is_seeded_and_top_p_narrows_it_to_greedy():
    logits = np.random.default_rng(0).standard_normal(97).astype(np.float32)
    draws = lambda seed, p=1.0: [sampler(1.0, p, seed)(logits) for _ in range(20)]  # noqa: E731
    assert draws(3) == draws(3) and draws(3) != draws(4)
    assert set(draws(5, 1e-6)) == {int(np.argmax(logits))}
    with pytest.raises(RunError, match="top-p"):
        sampler(1.0, 0.0)


def test_where_greedy_answers_part_says_whether_fp16_could_tell_the_two_tokens_apart():
    logits = np.zeros((3, 5), np.float32)
    logits[1, [2, 4]] = 31.118, 31.105   # the trained SmolLM2's spider prompt, token 6: a margin of 0.013
    logits[2, [0, 1]] = 24.0, 23.9
    assert parting([7, 2, 1], [7, 2, 1], logits) is None
    tie = parting([7, 4, 1], [7, 2, 0], logits)
    assert (tie.token, tie.spacing, tie.fp16_tie) == (1, 2 ** -6, True) and "a tie in fp16" in str(tie)
    assert np.float16(31.118) != np.float16(31.105)   # neighbours: an error over 0.006 can make them one value
    clear = parting([7, 2, 1], [7, 2, 0], logits)
    assert clear.token == 2 and not clear.fp16_tie and abs(clear.margin - 0.1) < 1e-5


def test_generate_past_the_cache_stops_where_it_is_full_and_says_so(cpu_bundle):
    """30 prompt tokens and --max-new-tokens 8 in a cache of 32: 3 new tokens, exit 0, one warning line
    (it streamed the answer, then raised)."""
    res = shard_cli("generate", str(cpu_bundle.bundle), "--ids", ",".join(map(str, range(5, 35))),
                    "--max-new-tokens", "8")
    assert res.returncode == 0, res.stderr
    assert len(res.stdout.split()) == 3
    assert ("stopped after 3 new tokens of --max-new-tokens 8: the prompt's 30 and they fill the cache's capacity "
            "of 32") in " ".join(res.stderr.split())


def test_what_generate_refuses_is_one_line(checkpoint, cpu_bundle, tmp_path):
    with load(cpu_bundle.bundle) as session:
        with pytest.raises(RunError, match="the prompt is 33 tokens, past the cache's capacity of 32"):
            session.generate(list(range(5, 38)), max_new_tokens=8, stop=set())
        with pytest.raises(RunError, match="below the vocabulary's 97"):
            session.generate([5, 400])
    for args, says in ((["--ids", "1,x"], "expected numbers"), ([], "one of the two"),
                       (["--ids", "1", "--top-p", "0"], "top-p")):
        res = shard_cli("generate", str(cpu_bundle.bundle), *args)
        assert res.returncode == 1 and says in res.stderr and "Traceback" not in res.stderr, res.stderr
    folder, _ = checkpoint
    res = shard_cli("generate", str(folder), "--ids", "1")
    assert res.returncode == 1 and "not a generative bundle" in res.stderr
    res = shard_cli("run", str(cpu_bundle.bundle))
    assert res.returncode == 1 and "write text with `shard generate`" in res.stderr and "Traceback" not in res.stderr
    gpt2 = tmp_path / "gpt2"
    tf.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=len(WORDS)).save_pretrained(gpt2)
    tiny_tokenizer().save_pretrained(gpt2)
    with pytest.raises(ShardError, match="a gpt2 model; shard compiles decoders of the Llama family"):
        compile_generative(gpt2, "cpu", tmp_path / "g.shard")


@pytest.mark.toolkit
def test_an_rk3588_bundle_generates_transformers_own_tokens_on_the_simulator(checkpoint, tmp_path):
    """Prefill in chunks of 4, decode, the cache written in place and moved from its bucket of 16 to
    32: on the simulator, greedy tokens as transformers', logits at cosine >= 0.999, and no op on
    the CPU in any program."""
    folder, model = checkpoint
    result = compile_generative(folder, "rk3588", tmp_path / "lm.shard", capacity=[16, 32], chunk=4)
    assert len(result.reports) == 4   # prefill and decode, for a cache of 16 and one of 32
    for name, report in result.reports.items():
        assert report["totals"]["cpu_ops"] == 0 and report["totals"]["overflow_lines"] == 0, name
    assert all(row["decode_tokens_per_s"] > 0 and row["bandwidth_tokens_per_s"] > 0 and row["one_step_tokens_per_s"] > 0
               for row in result.predicted)
    # the cache held where the NPU reads it: no step hands it over. The host's row writes are timed on this
    # machine (a few microseconds, noisy), so the step is compared without them: its NPU time and
    # hand-offs below the step that hands the cache over
    for row in result.predicted:
        assert row["held_handoff_ms"] < row["decode_handoff_ms"] and row["held_write_ms"] > 0, row
        assert 1e3 / row["held_decode_tokens_per_s"] - row["held_write_ms"] < 1e3 / row["decode_tokens_per_s"], row
        assert 0 < row["held_prefill_128_ms"], row
    with load(result.bundle, backend="sim") as session:
        out = session.generate(PROMPT, max_new_tokens=12, stop=set())   # 19 tokens: past the cache of 16
        assert out.tokens == transformers_greedy(model, PROMPT, 12)
        assert session.sessions[1, 16].frames_run and session.sessions[1, 32].frames_run
        ids = PROMPT + out.tokens
        with torch.no_grad():
            want = model(torch.tensor([ids])).logits[0].numpy()
        got = session.logits(ids)
        assert min(cosine(got[k], want[k]) for k in range(len(ids))) >= 0.999
        # The cache as the board's runtime is handed it (float16, its memory NHWC, given with no
        # transpose), through both buckets: the logits of a float32 cache in ONNX's layout, to the bit.
        s = session.spec
        assert not held_nhwc(session.cache().keys[0]) and session.cache().keys[0].dtype == np.float32
        held = Cache.empty(s.layers, s.kv_heads, s.capacities[0], s.head_dim, np.float16,
                           buckets=tuple(s.capacities[1:]), nhwc=True)
        np.testing.assert_array_equal(teacher_forced(session.run, held, session.prompts.embed(ids), 0, s.chunk), got)
        assert held.capacity == 32 and all(a.dtype == np.float16 and held_nhwc(a) for a in held.keys + held.values)


def test_verify_checks_a_generative_bundle_against_its_checkpoint(checkpoint, cpu_bundle, tmp_path):
    folder, _ = checkpoint
    res = shard_cli("verify", str(cpu_bundle.bundle), "--reference", str(folder), "--prompt", "w3 w7 w9",
                    "--prompt", "w11", "--new", "6", "--forced", "8", "--json", str(tmp_path / "v.json"))
    assert res.returncode == 0, res.stderr
    report = json.loads((tmp_path / "v.json").read_text())
    assert report["passed"] and report["reference_is_source"] and len(report["prompts"]) == 2
    assert all(p["steps"] == 8 and p["top1"] == 1.0 and p["min_cosine"] > 0.99999 for p in report["prompts"])
    assert "file decode/shards/shard_000.onnx: ok (sha256" in res.stdout and "file embeddings.npy: ok (sha256" in res.stdout
    assert "PASS: worst teacher-forced cosine" in res.stdout
    # Another checkpoint of the same shape (other seeded weights): a warning, and the logits fail.
    torch.manual_seed(1)
    other = tmp_path / "other"
    tf.LlamaForCausalLM(tf.LlamaConfig.from_pretrained(folder)).save_pretrained(other)
    tiny_tokenizer().save_pretrained(other)
    res = shard_cli("verify", str(cpu_bundle.bundle), "--reference", str(other), "--prompt", "w3", "--new", "2",
                    "--forced", "4")
    assert res.returncode == 1 and "FAIL: worst teacher-forced cosine" in res.stderr
    assert "not the checkpoint this bundle was compiled from" in res.stdout


def test_a_decoder_compiled_again_comes_from_the_bundle_cache_over_its_old_bundle(checkpoint, tmp_path, monkeypatch):
    # The steps export to the same bytes each time, so each program is a bundle-cache hit; the old
    # generative bundle at the output is replaced, anything else there is refused.
    monkeypatch.setenv("SHARD_BUILD_CACHE", str(tmp_path / "cache"))
    folder, _ = checkpoint
    first = compile_generative(folder, "cpu", tmp_path / "lm.shard", capacity=16, chunk=2)
    again = compile_generative(folder, "cpu", tmp_path / "lm.shard", capacity=16, chunk=2)
    assert "from_bundle_cache" not in first.reports["decode"]
    assert all("from_bundle_cache" in report for report in again.reports.values())
    (tmp_path / "other").mkdir()
    with pytest.raises(ShardError, match="exists and is not a bundle shard wrote"):
        compile_generative(folder, "cpu", tmp_path / "other", capacity=16, chunk=2)


def test_a_changed_embeddings_file_is_refused(cpu_bundle, tmp_path):
    copy = tmp_path / "lm.shard"
    shutil.copytree(cpu_bundle.bundle, copy)
    table = np.load(copy / "embeddings.npy")
    table[3, 0] += 1.0
    np.save(copy / "embeddings.npy", table)
    res = shard_cli("generate", str(copy), "--ids", "5,17", "--max-new-tokens", "2")
    assert res.returncode == 1 and "embeddings.npy: not the file the compile wrote" in res.stderr, res.stderr


def shift_ids(tokenizer: Path) -> None:
    data = json.loads((tokenizer / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    first, second = sorted(vocab, key=vocab.get)[5:7]
    vocab[first], vocab[second] = vocab[second], vocab[first]
    (tokenizer / "tokenizer.json").write_text(json.dumps(data))


def link_template_out(tokenizer: Path) -> None:
    outside = tokenizer.parent.parent / "elsewhere.jinja"
    outside.write_text("{{ messages }}")
    config = tokenizer / "tokenizer_config.json"
    template = tokenizer / "chat_template.jinja"
    if template.exists():
        template.unlink()
    template.symlink_to(outside)
    config.write_text(config.read_text())   # unchanged: only the link is new


TAMPERINGS = {
    "tokenizer.json with two ids swapped": (shift_ids, "tokenizer.json: not the file the compile wrote"),
    "a chat template added": (lambda t: (t / "chat_template.jinja").write_text("{{ 'hi' }}") if not
                              (t / "chat_template.jinja").exists() else (t / "chat_template.jinja").write_text("x"),
                              "chat_template.jinja: not the file the compile wrote"),
    "a chat template linked out of the bundle": (link_template_out, "chat_template.jinja: a link"),
    "an auto_map in tokenizer_config.json": (
        lambda t: (t / "tokenizer_config.json").write_text(json.dumps({
            **json.loads((t / "tokenizer_config.json").read_text()), "auto_map": {"AutoTokenizer": ["evil.Tok", None]}})),
        "tokenizer_config.json: not the file the compile wrote"),
    "the tokenizer folder removed": (lambda t: shutil.rmtree(t), "tokenizer: missing"),
}


@pytest.mark.parametrize("tamper", sorted(TAMPERINGS))
def test_every_file_of_the_tokenizer_is_held_to_its_recorded_hash(checkpoint, cpu_bundle, tmp_path, tamper):
    # Only embeddings.npy had a hash: a replaced tokenizer.json changed the text with exit 0, a chat
    # template linked out of the bundle was read, an auto_map offered to run the bundle's own Python.
    copy = tmp_path / "lm.shard"
    shutil.copytree(cpu_bundle.bundle, copy)
    change, fragment = TAMPERINGS[tamper]
    change(copy / "tokenizer")
    for args in (("generate", str(copy), "--prompt", "Hi", "--max-new-tokens", "2"),
                 ("verify", str(copy), "--reference", str(checkpoint[0]))):
        res = shard_cli(*args)
        assert res.returncode == 1 and "Traceback" not in res.stderr, res.stderr
        assert fragment in res.stderr, res.stderr


def test_a_tokenizer_asking_for_code_of_its_own_is_refused_even_with_its_hash(cpu_bundle, tmp_path):
    from shard.errors import BundleError
    from shard.runtime.generative_bundle import GENERATIVE, check_files, record_files

    copy = tmp_path / "lm.shard"
    shutil.copytree(cpu_bundle.bundle, copy)
    config = copy / "tokenizer" / "tokenizer_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "auto_map": {"AutoTokenizer": ["evil.Tok", None]}}))
    spec = json.loads((copy / GENERATIVE).read_text())
    spec["files"] = record_files(copy)   # as a compile from such a checkpoint would record it
    with pytest.raises(BundleError, match="asks for code of its own"):
        check_files(copy, spec["files"])


def test_max_context_is_bounded_by_the_model_and_by_the_machine(checkpoint, tmp_path):
    # --max-context 10000000 took 9.7 GB in seconds
    for context, fragment in (("10000000", "at most 131072 tokens"), ("128", "made for at most 64 positions")):
        res = shard_cli("compile", str(checkpoint[0]), "--target", "cpu", "--max-context", context, "-o",
                        str(tmp_path / "lm.shard"))
        assert res.returncode == 1 and "Traceback" not in res.stderr and fragment in res.stderr, res.stderr
        assert not (tmp_path / "lm.shard").exists()


def edit_spec(change):
    def edit(bundle: Path) -> None:
        data = json.loads((bundle / "generative.json").read_text())
        change(data)
        (bundle / "generative.json").write_text(json.dumps(data))
    return edit


def link_program_out(bundle: Path) -> None:
    shutil.move(bundle / "decode", bundle.parent / "decode-elsewhere")
    (bundle / "decode").symlink_to(bundle.parent / "decode-elsewhere")


SPEC_DAMAGE = {
    "a list": (lambda b: (b / "generative.json").write_text("[1, 2]"), "not a JSON object"),
    "not UTF-8": (lambda b: (b / "generative.json").write_bytes(b'{"layers": "\xff\xfe"}'), "unreadable generative"),
    "negative layers": (edit_spec(lambda d: d.update(layers=-2)), "layers -2: expected a positive whole number"),
    "stop: null": (edit_spec(lambda d: d.update(stop=None)), "stop None: expected a list of token ids"),
    "a program out of the bundle": (edit_spec(lambda d: d["programs"][1].update(name="../../etc")),
                                    "program '../../etc': expected a folder name"),
    "an absolute program": (edit_spec(lambda d: d["programs"][1].update(name="/tmp")), "program '/tmp'"),
    "a program linked out": (link_program_out, "program 'decode' is not a folder of the bundle"),
    "a stop token changed": (edit_spec(lambda d: d.update(stop=[3])), "its digest differs"),
}


@pytest.mark.parametrize("damage", sorted(SPEC_DAMAGE))
def test_a_damaged_generative_spec_stops_in_one_line(cpu_bundle, tmp_path, damage):
    # Each was a traceback (a list, non-UTF-8, wrong types), or was loaded (a program outside the bundle).
    copy = tmp_path / "lm.shard"
    shutil.copytree(cpu_bundle.bundle, copy)
    change, fragment = SPEC_DAMAGE[damage]
    change(copy)
    res = shard_cli("generate", str(copy), "--ids", "5,17", "--max-new-tokens", "2")
    assert res.returncode == 1 and "Traceback" not in res.stderr, res.stderr
    assert fragment in res.stderr, res.stderr


def test_json_never_writes_into_the_bundle_or_over_a_file_and_is_checked_before_the_generation(
        checkpoint, cpu_bundle, tmp_path):
    # --json lm.shard/generative.json overwrote the bundle's own spec; --json into a missing folder
    # failed after the whole generation, losing it.
    copy = tmp_path / "lm.shard"
    shutil.copytree(cpu_bundle.bundle, copy)
    spec = (copy / "generative.json").read_bytes()
    generate = ("generate", str(copy), "--ids", "5,17", "--max-new-tokens", "2", "--json")
    for path, fragment in ((copy / "generative.json", "inside the bundle"), (copy / "decode" / "x.json", "inside the bundle"),
                           (tmp_path / "nowhere" / "out.json", "no folder"), (tmp_path, "a folder is there")):
        res = shard_cli(*generate, str(path))
        assert res.returncode == 1 and "Traceback" not in res.stderr and fragment in res.stderr, res.stderr
        assert "new;" not in res.stderr   # refused before the generation ran
    assert (copy / "generative.json").read_bytes() == spec
    (tmp_path / "out.json").write_text("mine")
    res = shard_cli(*generate, str(tmp_path / "out.json"))
    assert res.returncode == 1 and "pass --force" in res.stderr and (tmp_path / "out.json").read_text() == "mine"
    res = shard_cli(*generate, str(tmp_path / "out.json"), "--force")
    assert res.returncode == 0 and json.loads((tmp_path / "out.json").read_text())["prompt_ids"] == [5, 17]
    res = shard_cli("verify", str(copy), "--reference", str(checkpoint[0]), "--json", str(copy / "generative.json"))
    assert res.returncode == 1 and "inside the bundle" in res.stderr and (copy / "generative.json").read_bytes() == spec


@pytest.fixture(scope="module")
def vlm(checkpoint, tmp_path_factory):
    """SmolVLM's architecture (Idefics3) around the 2-layer Llama: one SigLIP layer at 128 x 128 (64
    patches, 4 image tokens after the pixel shuffle), seeded, its processor splitting an image into up
    to 2 x 2 squares as SmolVLM's does; and one image (2 x 2 squares and the whole image shrunk)."""
    from PIL import Image

    from shard.zoo.decoder import load_causal_lm
    from shard.zoo.vlm import build_smolvlm

    folder = build_smolvlm(checkpoint[0], tmp_path_factory.mktemp("vlm") / "smolvlm", vision_layers=1, image_size=128,
                           tiles=2)
    image = tmp_path_factory.mktemp("images") / "a.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (90, 120, 3), dtype=np.uint8)).save(image)
    return folder, load_causal_lm(folder), image


def transformers_vlm_greedy(model, processor, image, prompt: str, new: int) -> list[int]:
    from PIL import Image

    content = [{"type": "image"}, {"type": "text", "text": prompt}]
    text = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
    encoded = processor(text=text, images=[[Image.open(image).convert("RGB")]], return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**encoded, max_new_tokens=new, min_new_tokens=new, do_sample=False, eos_token_id=None,
                             pad_token_id=0)
    return out[0, encoded["input_ids"].shape[1]:].tolist()


def test_a_vlm_bundle_generates_transformers_own_tokens_about_an_image(vlm, cpu_bundle, tmp_path):
    folder, (model, processor), image = vlm
    result = compile_generative(folder, "cpu", tmp_path / "vlm.shard", capacity=64, chunk=8)
    assert list(result.reports) == ["vision", "prefill", "decode"] and result.spec.vision["image_token"]
    assert result.spec.vision["most"] == {"squares": 5, "tokens": 20}
    # The vision program is one shard: 5 squares of 0.1 s each, pipelined over 3 cores, take 2 rounds.
    assert len(read_manifest(result.bundle / "vision").shards) == 1
    one = Predicted(latency_s=0.1, shard_seconds=[0.1], stream_fps={"1": 10.0, "2": 20.0, "3": 30.0})
    assert vision_time(result.spec.vision, one, result.bundle) == {"vision_ms": 100.0, "image_ms": 200.0,
                                                                    "image_squares": 5, "cores": 3}
    with load(result.bundle) as session:
        out = session.generate("w3 w7", max_new_tokens=8, chat=True, images=[image], stop=set())
        assert out.tokens == transformers_vlm_greedy(model, processor, image, "w3 w7", 8)
        assert out.prompt.count(result.spec.vision["image_token"]) == 5 * 4   # 4 squares and the whole image
        assert len(out.to_json()["vision_ms"]) == 5   # each square one pass of the vision program
        # Two prompts in turn, the second's image seen while the first decodes: the same tokens.
        each = list(session.generate_each([{"prompt": "w3 w7", "images": [image]}, {"prompt": "w5", "images": [image]}],
                                          max_new_tokens=8, chat=True, stop=set()))
        assert each[0].tokens == out.tokens and each[1].tokens == transformers_vlm_greedy(model, processor, image, "w5", 8)
        assert len(each[1].to_json()["vision_ms"]) == 5
        # A prompt past the cache stops in one line before its image goes through the vision program.
        with pytest.raises(RunError, match=r"the prompt is 76 tokens \(20 of them image features\), past the "
                                           r"cache's capacity of 64"):
            session.generate(" ".join(["w3"] * 42), chat=True, images=[image])
        assert session.steps == each[1].steps
    res = shard_cli("generate", str(result.bundle), "--prompt", "w3 w7", "--chat", "--image", str(image),
                    "--max-new-tokens", "8", "--json", str(tmp_path / "out.json"))
    assert res.returncode == 0, res.stderr
    written = json.loads((tmp_path / "out.json").read_text())["ids"]   # up to a stop token
    assert written and written == out.tokens[:len(written)]
    with load(cpu_bundle.bundle) as session, pytest.raises(RunError, match="takes no image"):
        session.generate("w3", images=[image])
    res = shard_cli("compile", str(folder), "--target", "cpu", "--max-context", "16", "--chunk", "4", "-o",
                    str(tmp_path / "small.shard"))
    assert res.returncode == 0, res.stderr
    printed = " ".join(res.stdout.split())
    assert "an image: up to 5 squares of 128 x 128 (its processor splits it), 20 image tokens of the context's 16" \
        in printed and "leave no room in --max-context 16" in printed, res.stdout
    (tmp_path / "not.png").write_text("text")
    res = shard_cli("generate", str(result.bundle), "--prompt", "w3", "--image", str(tmp_path / "not.png"))
    assert res.returncode == 1 and "not.png: not an image this can read" in res.stderr, res.stderr


def test_a_generations_times_are_split_by_program():
    from shard.runtime.generate import Generation

    out = Generation([1] * 7, [5, 6, 7], "", [(0, 0.5), (4, 0.2), (4, 0.2), (1, 0.1), (1, 0.1)], prefill_steps=2)
    times = out.to_json()
    assert times["vision_ms"] == [500.0] and times["prefill_ms"] == [200.0, 200.0] and times["decode_ms"] == [100.0, 100.0]
    assert times["decode_tokens_per_s"] == 10.0
    one = Generation([1, 2], [5, 6], "", [(1, 0.1), (1, 0.1), (1, 0.2)], prefill_steps=2)   # a bundle of width 1 only
    assert one.to_json()["prefill_ms"] == [100.0, 100.0] and one.to_json()["decode_ms"] == [200.0]


def test_the_same_bundle_format_for_thor(checkpoint, tmp_path):
    """--target thor: each program one fp16 stage (the GPU targets' passes; a step waits for the one
    before it, so more stages would only hand off); here run by onnxruntime (the cuda backend needs a
    GPU), the tokens transformers' own. The decode step's stage writes its new keys and values into
    the cache it reads, inside its own graph (OnDevice.writes): the cuda executor's torch form, on the
    CPU here."""
    from shard.bundle import read_manifest
    from shard.runtime.executors.cuda import CudaExecutor

    folder, model = checkpoint
    result = compile_generative(folder, "thor", tmp_path / "lm.shard", capacity=32, chunk=4)
    assert [report["passes"]["stages"]["shards"] for report in result.reports.values()] == [1, 1]
    with load(result.bundle, backend="cpu") as session:
        assert session.generate(PROMPT, max_new_tokens=8, stop=set()).tokens == transformers_greedy(model, PROMPT, 8)
    manifest = read_manifest(result.bundle / "decode")
    (stage,) = manifest.shards
    entries = [f"{kind}.{i}" for i in range(2) for kind in ("key", "value")]
    rng = np.random.default_rng(0)
    feeds = {t.name: rng.standard_normal(t.shape).astype(np.float32) for t in manifest.inputs}
    feeds.update(position_ids=np.array([[11]]), mask=step_mask(11, 1, 32))
    plain = CudaExecutor(result.bundle / "decode", [stage], {t.name for t in manifest.outputs}, device="cpu")
    want = plain.run(stage, feeds)
    writing = CudaExecutor(result.bundle / "decode", [stage], {"logits"}, device="cpu",
                           writes={name: (f"past_{name}", "position_ids") for name in entries})
    buffers = dict(zip([t.name for t in stage.inputs], writing.prepared[stage.name].inputs))
    for name, value in feeds.items():
        buffers[name].copy_(torch.from_numpy(value).reshape(buffers[name].shape))
    got = writing.run(stage, {name: buffers[name] for name in feeds})
    assert writing.written == set(entries) and set(got) == {"logits"}
    assert np.array_equal(got["logits"], want["logits"])
    for name in entries:
        cache = buffers[f"past_{name}"].numpy()
        assert np.array_equal(cache[:, :, 11:12], want[name])   # the new entry, at position 11
        cache[:, :, 11] = feeds[f"past_{name}"][:, :, 11]
        assert np.array_equal(cache, feeds[f"past_{name}"])   # and nothing else changed


def test_chunk_auto_takes_the_fewest_prompt_steps_the_decode_steps_prediction_allows():
    """A step reads every weight once (the decode step's NPU time) or computes its tokens' MACs at the
    peak, whichever is longer: SmolLM2's figures (15.4 ms, 130 M MACs a token, 512 MACs a cycle at
    1 GHz) make 64 tokens a step the fastest prefill of 128, two steps of 16.3 ms; 128 ties and the
    smaller is kept; a cache of 32 caps it; no NPU prediction keeps the default."""
    from shard.compilation.generative import choose_chunk

    facts = {"macs_per_cycle_fp16": 512.0, "macs_per_cycle_int8": 1024.0}
    decode = {"predicted": {"latency_s": 0.02, "stream_fps": {"1": 50.0}, "npu_seconds": [9.3e-3, 6.1e-3],
                            "npu_clock_hz": 1e9},
              "shards": [{"name": "s0", "core": 0, "nodes": 9, "macs": 80e6},
                         {"name": "s1", "core": 1, "nodes": 7, "macs": 50e6}]}
    why = choose_chunk(decode, 512, "fp16", facts)
    assert why.chunk == 64 and why.prefill_s["16"] == pytest.approx(8 * 15.4e-3)
    assert why.prefill_s["64"] == pytest.approx(2 * 64 * 130e6 / 512e9, rel=1e-4) and "2 steps of 64" in why.why
    assert choose_chunk(decode, 512, "int8", facts).chunk == 128   # twice the rate: 128 tokens in one read
    assert choose_chunk(decode, 32, "fp16", facts).chunk == 32
    assert choose_chunk({"predicted": None, "shards": []}, 512, "fp16", facts).chunk == 16


@pytest.mark.toolkit
def test_chunk_auto_compiles_the_decode_step_first_and_the_prompts_at_its_choice(checkpoint, tmp_path):
    """`--chunk auto` on the RK3588: the 2-layer model's steps are bound by reading their weights, so
    the widest prompt step the cache holds prefills fastest; the compile says why, and the bundle
    generates transformers' own tokens with it."""
    folder, model = checkpoint
    res = shard_cli("compile", folder, "--target", "rk3588", "-o", tmp_path / "lm.shard", "--max-context", "32",
                    "--chunk", "auto")
    assert res.returncode == 0, res.stderr
    assert "--chunk auto: 32 tokens a prompt step: a 128-token prompt in 4 steps of 32" in res.stdout
    spec = read_generative(tmp_path / "lm.shard")
    assert sorted(p.width for p in spec.programs) == [1, 32]
    assert json.loads((tmp_path / "lm.shard" / "report.json").read_text())["chunk"]["chunk"] == 32
    with load(tmp_path / "lm.shard", backend="sim") as session:
        assert session.generate(PROMPT, max_new_tokens=4, stop=set()).tokens == transformers_greedy(model, PROMPT, 4)
    bad = shard_cli("compile", folder, "--target", "rk3588", "-o", tmp_path / "x.shard", "--chunk", "wide")
    assert bad.returncode != 0 and "--chunk 'wide': expected a number of tokens or auto" in bad.stderr
