"""A decoder as fixed-shape steps over a static KV cache (shard.zoo.decoder, shard.runtime.generate):
in onnxruntime fp32, prefill in chunks and decode one token a step give transformers' own greedy
tokens and logits."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import torch
import transformers as tf

from shard.errors import RunError
from shard.runtime.generate import Cache, advance, generate, prefill
from shard.zoo.decoder import embedding_table, export_step, step_names

CAPACITY = 32
PROMPT = [5, 17, 3, 88, 41, 9, 60]   # 7 tokens: one full prefill chunk of 4 and one of 3


@pytest.fixture(scope="module")
def decoder(tmp_path_factory):
    """A 2-layer Llama with grouped-query attention (4 heads, 2 of keys and values), seeded weights;
    its prefill (4 tokens) and decode (1) steps as onnxruntime sessions."""
    torch.manual_seed(0)
    config = tf.LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                            tie_word_embeddings=True, attn_implementation="eager",
                            initializer_range=0.2)   # larger than the default: attention far from uniform
    model = tf.LlamaForCausalLM(config).eval()
    folder = tmp_path_factory.mktemp("decoder")
    sessions = {width: ort.InferenceSession(str(export_step(model, folder / f"step{width}.onnx", width, CAPACITY)))
                for width in (4, 1)}
    names = step_names(config.num_hidden_layers)[1]

    def run(feeds):
        return dict(zip(names, sessions[feeds["inputs_embeds"].shape[1]].run(None, feeds)))

    return model, run, embedding_table(model)


def empty_cache(model) -> Cache:
    config = model.config
    return Cache.empty(config.num_hidden_layers, config.num_key_value_heads, CAPACITY,
                       config.hidden_size // config.num_attention_heads)


def test_greedy_tokens_are_transformers_own(decoder):
    model, run, table = decoder
    ours = generate(run, table, table[PROMPT], empty_cache(model), max_new=16, chunk=4)
    with torch.no_grad():
        theirs = model.generate(torch.tensor([PROMPT]), max_new_tokens=16, min_new_tokens=16, do_sample=False,
                                eos_token_id=None, pad_token_id=0)[0, len(PROMPT):].tolist()
    assert ours == theirs and len(ours) == 16


def test_teacher_forced_logits_match_the_full_forward(decoder):
    # The same 23 tokens: transformers' one forward; prefill in chunks of 4 of each prefix up to 9 (the
    # last chunk padded; the step's head reads the row `pick` names, the last real token's); and the
    # prompt's prefill followed by one-token steps.
    model, run, table = decoder
    ids = PROMPT + list(range(20, 36))
    with torch.no_grad():
        want = model(torch.tensor([ids])).logits[0].numpy()
    for n in range(1, 10):
        assert np.abs(prefill(run, empty_cache(model), table[ids[:n]], 4) - want[n - 1]).max() < 1e-4, n
    cache = empty_cache(model)
    stepped = np.stack([prefill(run, cache, table[PROMPT], 4)] +
                       [advance(run, cache, table[[t]], 1) for t in ids[len(PROMPT):]])
    assert stepped.shape == want[len(PROMPT) - 1:].shape and np.abs(stepped - want[len(PROMPT) - 1:]).max() < 1e-4
    assert cache.length == len(ids)


def test_a_context_past_the_capacity_stops_in_one_line(decoder):
    model, run, table = decoder
    cache = empty_cache(model)
    prefill(run, cache, table[list(range(28))], 4)
    with pytest.raises(RunError, match="reaches 33 tokens, past the cache's capacity of 32"):
        prefill(run, cache, table[[1, 2, 3, 4, 5]], 4)


def test_step_samples_are_a_real_prompts_steps(decoder):
    """The compile's fidelity inputs for a step: run through the step, each sample's logits are
    transformers' own for those tokens after the ones already in its cache."""
    from shard.zoo.decoder import SAMPLE_PROMPT, step_samples

    model, run, table = decoder

    class Words:   # a tokenizer of the sample prompt: a word each, ids below the vocabulary
        def __call__(self, text):
            return {"input_ids": [5 + len(word) * 7 % 90 for word in text.split()]}

    samples = step_samples(model, Words(), 4, CAPACITY, count=3)
    assert samples["inputs_embeds"].shape == (3, 1, 4, 64) and samples["past_key.1"].shape == (3, 1, 2, CAPACITY, 16)
    ids = Words()(SAMPLE_PROMPT)["input_ids"] * 4
    with torch.no_grad():
        want = model(torch.tensor([ids[:CAPACITY + 4]])).logits[0].numpy()
    for k, length in enumerate(samples["position_ids"][:, 0, 0]):
        got = run({name: value[k] for name, value in samples.items()})["logits"][0, 0]   # the step's last token's
        assert np.abs(got - want[length + 3]).max() < 1e-4, k
    assert list(samples["position_ids"][:, 0, 0]) == [0, 14, 28]


def test_the_residual_stream_carries_what_fp16_rounds_away():
    # 60 sums in fp16, as a 30-layer decoder's residual stream: carried, far nearer the exact sum.
    from shard.zoo.decoder import compensated

    rng = np.random.default_rng(0)
    start, steps = rng.normal(0, 300, 576), rng.normal(0, 3, (60, 576))
    exact = start + steps.sum(0)
    plain = torch.tensor(start, dtype=torch.float16)
    total, lost = plain.clone(), torch.zeros_like(plain)
    for step in torch.tensor(steps, dtype=torch.float16):
        plain = plain + step
        total, lost = compensated(total, lost, step)
    plain_error, carried_error = (np.abs(t.double().numpy() - exact).mean() for t in (plain, total))
    assert carried_error < 0.5 * plain_error, (carried_error, plain_error)
