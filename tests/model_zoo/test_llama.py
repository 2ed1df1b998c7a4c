"""The model file against transformers' own forward, and the loader's one-line errors."""

import json
import shutil

import pytest
import torch

from quantspec.errors import QuantSpecError
from quantspec.model_zoo.checkpoint import load_model
from quantspec.model_zoo.llama import DenseCausalAttention, ModelArgs
from quantspec.model_zoo.tiny import build_tiny_model

# fp32 on CPU: the two implementations differ only in summation order.
LOGITS_ATOL = 1e-4


def _ours(model_dir, ids):
    model, _ = load_model(model_dir)
    B, S = ids.shape
    with torch.no_grad():
        hidden = model(ids.reshape(-1), torch.arange(S).repeat(B), DenseCausalAttention(B, S))
        return model.compute_logits(hidden).view(B, S, -1)


def _theirs(model_dir, ids):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        return hf(ids).logits


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
def test_logits_match_transformers(tmp_path, arch):
    d = build_tiny_model(tmp_path / arch, arch)
    ids = torch.randint(3, 500, (2, 37), generator=torch.Generator().manual_seed(0))
    ours, theirs = _ours(d, ids), _theirs(d, ids)
    assert theirs.abs().max() > 1.0  # the check is not trivially satisfied by near-zero logits
    torch.testing.assert_close(ours, theirs, atol=LOGITS_ATOL, rtol=0)


def test_llama3_rope_scaling_and_tied_embeddings_match_transformers(tmp_path):
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
    d = build_tiny_model(tmp_path / "l3", "llama", rope_scaling=scaling, tie_word_embeddings=True)
    ids = torch.randint(3, 500, (1, 150), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(_ours(d, ids), _theirs(d, ids), atol=LOGITS_ATOL, rtol=0)


@pytest.mark.parametrize("yarn", [
    {"factor": 4.0, "original_max_position_embeddings": 64},  # Qwen3's long-context form
    {"factor": 8.0, "original_max_position_embeddings": 32, "beta_fast": 16, "mscale": 0.7, "mscale_all_dim": 1.0},
    {"factor": 2.0, "original_max_position_embeddings": 48, "attention_factor": 1.3, "truncate": False},
])
def test_yarn_rope_scaling_matches_transformers(tmp_path, yarn):
    """Positions past the original context, where YaRN's interpolation and attention factor act."""
    d = build_tiny_model(tmp_path / "yarn", "qwen3", rope_scaling={"rope_type": "yarn", **yarn},
                         max_position_embeddings=256)
    ids = torch.randint(3, 500, (1, 150), generator=torch.Generator().manual_seed(2))
    ours, theirs = _ours(d, ids), _theirs(d, ids)
    torch.testing.assert_close(ours, theirs, atol=LOGITS_ATOL, rtol=0)
    plain = build_tiny_model(tmp_path / "plain", "qwen3", max_position_embeddings=256)  # the same seed, no YaRN
    assert (_ours(plain, ids) - theirs).abs().max() > 1e-2


def test_sharded_checkpoint_loads_like_single_file(tmp_path):
    single = build_tiny_model(tmp_path / "single", "llama")
    sharded = build_tiny_model(tmp_path / "sharded", "llama", sharded=True)
    assert (sharded / "model.safetensors.index.json").exists()
    ids = torch.randint(3, 500, (1, 11))
    torch.testing.assert_close(_ours(single, ids), _ours(sharded, ids), atol=0, rtol=0)


@pytest.mark.slow
def test_default_model_logits_match_transformers():
    from quantspec.model_zoo.default import DEFAULT_MODEL, ensure_zoo_model

    d = ensure_zoo_model(DEFAULT_MODEL)
    ids = torch.randint(3, 49000, (1, 64), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(_ours(d, ids), _theirs(d, ids), atol=1e-3, rtol=0)


def test_unsupported_architecture_lists_supported(tmp_path, tiny_llama_dir):
    d = tmp_path / "gpt2"
    shutil.copytree(tiny_llama_dir, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"], cfg["model_type"] = ["GPT2LMHeadModel"], "gpt2"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(QuantSpecError, match="unsupported architecture 'GPT2LMHeadModel'.*LlamaForCausalLM"):
        load_model(d)


def test_truncated_safetensors_is_one_clear_error(tmp_path, tiny_llama_dir):
    d = tmp_path / "trunc"
    shutil.copytree(tiny_llama_dir, d)
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(QuantSpecError, match="truncated or corrupt.*re-download"):
        load_model(d)


def test_missing_path_and_missing_config(tmp_path):
    with pytest.raises(QuantSpecError, match="does not exist"):
        load_model(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(QuantSpecError, match="no config.json"):
        load_model(tmp_path / "empty")


def test_shape_mismatch_names_the_tensor(tmp_path, tiny_llama_dir):
    d = tmp_path / "bad"
    shutil.copytree(tiny_llama_dir, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["intermediate_size"] += 8
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(QuantSpecError, match="gate_proj.weight has shape"):
        load_model(d)


def test_args_from_transformers5_config():
    cfg = {"architectures": ["Qwen2ForCausalLM"], "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
           "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
           "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}, "eos_token_id": [3, 4]}
    args = ModelArgs.from_hf_config(cfg)
    assert (args.arch, args.rope_theta, args.qkv_bias, args.o_bias, args.head_dim) == ("qwen2", 1e6, True, False, 4)
    assert args.eos_token_ids == [3, 4]


def test_head_weight_of_float_packed_and_opaque_heads(tiny_llama_model):
    """`Transformer.head_weight()`: a float head's own weight, a packed head's unpacked one, and
    for a head without a float weight (a quantized one) head(I)ᵀ — all the same [V, D] matrix."""
    import copy

    from torch import nn

    model = copy.deepcopy(tiny_llama_model)
    w = model.lm_head.weight.detach().clone()
    assert torch.equal(model.head_weight(), w)

    class Opaque(nn.Module):  # scores like the head, exposes no float weight
        def __init__(self, lin):
            super().__init__()
            self.inner = lin

        def forward(self, x):
            return self.inner(x)

    model.lm_head = Opaque(model.lm_head)
    torch.testing.assert_close(model.head_weight(), w, rtol=0, atol=1e-6)
    from quantspec.kernels.cpu import cpu_kernels

    if cpu_kernels() is not None:
        from quantspec.infer.cpu.linears import PackedLinear

        model.lm_head = PackedLinear(model.lm_head.inner)
        assert torch.equal(model.head_weight(), w)
