"""A decoder's checkpoint must be complete before anything is built: a GGUF file or a transformers
folder missing a tensor compiled with random values in its place, exit 0 (transformers fills it)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import transformers as tf
from conftest import assert_one_line_error, shard_cli
from test_generative import tiny_tokenizer

from shard.errors import ShardError
from shard.zoo.decoder import load_causal_lm

LAYERS, HIDDEN, INTER, HEADS, KV, VOCAB = 2, 64, 128, 4, 2, 32


def gguf_tensors(seed: int = 0) -> dict[str, np.ndarray]:
    """A 2-layer Llama's tensors under GGUF's names (llama.cpp's), seeded."""
    rng = np.random.default_rng(seed)
    t = lambda *shape: (rng.standard_normal(shape) * 0.2).astype(np.float32)  # noqa: E731
    ones = lambda: np.ones(HIDDEN, np.float32)  # noqa: E731
    tensors = {"token_embd.weight": t(VOCAB, HIDDEN), "output_norm.weight": ones()}
    kv = KV * HIDDEN // HEADS
    for b in range(LAYERS):
        tensors.update({f"blk.{b}.attn_norm.weight": ones(), f"blk.{b}.ffn_norm.weight": ones(),
                        f"blk.{b}.attn_q.weight": t(HIDDEN, HIDDEN), f"blk.{b}.attn_k.weight": t(kv, HIDDEN),
                        f"blk.{b}.attn_v.weight": t(kv, HIDDEN), f"blk.{b}.attn_output.weight": t(HIDDEN, HIDDEN),
                        f"blk.{b}.ffn_gate.weight": t(INTER, HIDDEN), f"blk.{b}.ffn_up.weight": t(INTER, HIDDEN),
                        f"blk.{b}.ffn_down.weight": t(HIDDEN, INTER)})
    return tensors


def write_gguf(path: Path, tensors: dict[str, np.ndarray], heads: int = HEADS) -> Path:
    """A GGUF file of a Llama with a byte-level BPE tokenizer of 32 tokens, as llama.cpp writes one
    (`heads`: the attention heads its metadata says)."""
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(LAYERS)
    writer.add_context_length(64)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(INTER)
    writer.add_head_count(heads)
    writer.add_head_count_kv(KV)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_vocab_size(VOCAB)
    writer.add_tokenizer_model("gpt2")
    tokens = ["<s>", "</s>", "<pad>"] + [chr(ord("a") + i) for i in range(26)] + ["Ġ", "ab", "cd"]
    writer.add_token_list(tokens)
    writer.add_token_types([3, 3, 3] + [1] * (len(tokens) - 3))
    writer.add_token_merges(["a b", "c d"])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1)
    writer.add_pad_token_id(2)
    for name, value in tensors.items():
        writer.add_tensor(name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_complete_gguf_loads_with_its_weights(tmp_path):
    tensors = gguf_tensors()
    model, tokenizer = load_causal_lm(write_gguf(tmp_path / "lm.gguf", tensors))
    assert tokenizer("ab cd")["input_ids"] == [30, 29, 31]
    down = model.model.layers[1].mlp.down_proj.weight.detach().numpy()
    np.testing.assert_array_equal(down, tensors["blk.1.ffn_down.weight"])
    assert model.lm_head.weight is model.model.embed_tokens.weight   # tied: no output.weight in the file


def test_a_gguf_missing_a_weight_is_refused_in_one_line(tmp_path):
    tensors = gguf_tensors()
    del tensors["blk.1.ffn_down.weight"]
    path = write_gguf(tmp_path / "lm.gguf", tensors)
    res = shard_cli("compile", path, "--target", "cpu", "-o", tmp_path / "lm.shard")
    assert_one_line_error(res, "an incomplete checkpoint", "model.layers.1.mlp.down_proj.weight")
    assert not (tmp_path / "lm.shard").exists()


def test_a_gguf_tensor_of_another_shape_is_refused_in_one_line(tmp_path):
    tensors = gguf_tensors()
    tensors["blk.0.ffn_up.weight"] = tensors["blk.0.ffn_up.weight"][:64]
    res = shard_cli("compile", write_gguf(tmp_path / "lm.gguf", tensors), "--target", "cpu", "-o", tmp_path / "lm.shard")
    assert_one_line_error(res, "does not fit the architecture", "up_proj")


@pytest.mark.parametrize("change", ["missing", "extra"])
def test_a_transformers_folder_missing_a_tensor_or_holding_a_stray_one_is_refused(tmp_path, change):
    from safetensors.torch import load_file, save_file

    torch.manual_seed(0)
    config = tf.LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=LAYERS,
                            num_attention_heads=HEADS, num_key_value_heads=KV, tie_word_embeddings=True)
    folder = tmp_path / "lm"
    tf.LlamaForCausalLM(config).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    weights = load_file(folder / "model.safetensors")
    if change == "missing":
        del weights["model.layers.1.self_attn.o_proj.weight"]
    else:
        weights["model.layers.9.mlp.up_proj.weight"] = torch.zeros(INTER, HIDDEN)
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ShardError, match="an incomplete checkpoint") as raised:
        load_causal_lm(folder)
    assert ("model.layers.1.self_attn.o_proj.weight" if change == "missing" else "model.layers.9") in str(raised.value)
