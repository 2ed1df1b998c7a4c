"""Tests for quantspec.model_zoo.tiny: determinism, variants, file layout, sane logits."""

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from quantspec.errors import QuantSpecError
from quantspec.model_zoo.tiny import (
    BOS_TOKEN,
    EOS_TOKEN,
    LOGIT_STD,
    UNK_PAD_TOKEN,
    build_tiny_model,
    build_tiny_tokenizer,
)


def test_tokenizer_deterministic_and_variant_differs():
    a, b = build_tiny_tokenizer(), build_tiny_tokenizer()
    assert a.get_vocab() == b.get_vocab()
    assert len(a) == 512
    c = build_tiny_tokenizer(variant=1)
    assert len(c) == 512
    assert c.get_vocab() != a.get_vocab()
    text = "The quick brown fox jumps over the lazy dog."
    assert a(text)["input_ids"] != c(text)["input_ids"]


def test_tokenizer_special_tokens_and_roundtrip(tiny_tokenizer_dir):
    tok = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    assert tok.convert_ids_to_tokens([0, 1, 2]) == [UNK_PAD_TOKEN, BOS_TOKEN, EOS_TOKEN]
    assert (tok.pad_token, tok.bos_token, tok.eos_token) == (UNK_PAD_TOKEN, BOS_TOKEN, EOS_TOKEN)
    text = "def f(x):\n    return x * 2  # ünïcode ✓"
    assert tok.decode(tok(text)["input_ids"]) == text
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert chat.startswith("<|im_start|>system\n")


def test_tokenizer_bad_args():
    with pytest.raises(QuantSpecError, match="vocab_size"):
        build_tiny_tokenizer(vocab_size=10)
    with pytest.raises(QuantSpecError, match="variant"):
        build_tiny_tokenizer(variant=7)


def test_model_files_and_generation_config(tiny_llama_dir):
    names = {p.name for p in tiny_llama_dir.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json"} <= names
    gen = json.loads((tiny_llama_dir / "generation_config.json").read_text())
    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    assert gen["eos_token_id"] == tok.convert_tokens_to_ids(EOS_TOKEN)
    cfg = AutoConfig.from_pretrained(tiny_llama_dir)
    assert (cfg.model_type, cfg.num_hidden_layers, cfg.hidden_size) == ("llama", 2, 64)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size) == (4, 2, 128)
    assert cfg.vocab_size == len(tok) == 512


def test_model_deterministic_and_seed_changes_weights(tmp_path, tiny_llama_dir):
    again = build_tiny_model(tmp_path / "a", "llama")
    w0, w1 = load_file(tiny_llama_dir / "model.safetensors"), load_file(again / "model.safetensors")
    assert w0.keys() == w1.keys()
    assert all(torch.equal(w0[k], w1[k]) for k in w0)
    other = load_file(build_tiny_model(tmp_path / "b", "llama", seed=1) / "model.safetensors")
    assert not torch.equal(other["model.embed_tokens.weight"], w0["model.embed_tokens.weight"])


def test_qwen2_has_nonzero_qkv_bias(tiny_qwen2_dir):
    w = load_file(tiny_qwen2_dir / "model.safetensors")
    for proj in ("q_proj", "k_proj", "v_proj"):
        b = w[f"model.layers.0.self_attn.{proj}.bias"]
        assert b.abs().max() > 0
    assert "model.layers.0.self_attn.o_proj.bias" not in w


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_logits_spread_and_greedy_not_degenerate(tmp_path, arch):
    d = build_tiny_model(tmp_path, arch)
    model = AutoModelForCausalLM.from_pretrained(d).eval()
    tok = AutoTokenizer.from_pretrained(d)
    ids = tok("Speculative decoding makes generation faster", return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(ids).logits[0]  # [T, vocab]
        out = model.generate(ids, max_new_tokens=24, do_sample=False)[0, ids.shape[1]:]
    std = logits.std(dim=-1).mean().item()
    assert 0.5 * LOGIT_STD < std < 2 * LOGIT_STD
    assert len(out) == 24  # special-token logits are zero: no early eos
    assert len(set(out.tolist())) >= 8


def test_padding_tied_sharded_rope_dtype(tmp_path):
    d = build_tiny_model(
        tmp_path, "llama", vocab_pad_to=96, tie_word_embeddings=True, sharded=True,
        rope_scaling={"rope_type": "linear", "factor": 2.0}, dtype=torch.bfloat16,
    )
    index = json.loads((d / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 1
    cfg = AutoConfig.from_pretrained(d)
    assert cfg.vocab_size == 576 and cfg.tie_word_embeddings
    assert cfg.rope_parameters["rope_type"] == "linear" and cfg.rope_parameters["factor"] == 2.0
    emb = load_file(d / index["weight_map"]["model.embed_tokens.weight"])["model.embed_tokens.weight"]
    assert emb.dtype == torch.bfloat16 and emb.shape == (576, 64)
    assert emb[512:].abs().max() == 0 and emb[:512].abs().max() > 0
    assert "lm_head.weight" not in index["weight_map"]
    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([[5, 6, 7]])).logits
    assert logits.shape == (1, 3, 576)
    assert torch.all(logits[..., 512:] == 0)


def test_tokenizer_variant_model(tmp_path, tiny_llama_dir):
    d = build_tiny_model(tmp_path, "llama", tokenizer_variant=1)
    a = AutoTokenizer.from_pretrained(d).get_vocab()
    assert a != AutoTokenizer.from_pretrained(tiny_llama_dir).get_vocab()


def test_model_bad_args(tmp_path):
    with pytest.raises(QuantSpecError, match="arch"):
        build_tiny_model(tmp_path, "gpt2")
    with pytest.raises(QuantSpecError, match="kv_heads"):
        build_tiny_model(tmp_path, heads=4, kv_heads=3)
    with pytest.raises(QuantSpecError, match="hidden"):
        build_tiny_model(tmp_path, hidden=66)
