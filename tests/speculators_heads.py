"""EAGLE-3 heads in the speculators format (vllm-project/speculators), written as its
`save_pretrained` writes them, with random weights, for the tests that read them."""

from __future__ import annotations

import json

import torch
from safetensors.torch import save_file
from transformers import LlamaConfig, Qwen3Config

# (layer model_type, the head's fields over speculators' defaults, aux layer ids of a 2-layer base)
VARIANTS = {
    "llama-default": ("llama", {}, (0, 1, 2)),  # norm_before_residual left out: true, as vLLM reads it
    "llama-plain": ("llama", {"norm_before_residual": False}, (0, 1, 2)),
    "qwen3-fc-norm-out": ("qwen3", {"norm_before_residual": False, "norm_before_fc": True, "norm_output": True},
                          (0, 1, 2)),
    "llama-two-aux-fc-norm": ("llama", {"norm_before_residual": True, "fc_norm": True}, (1, 2)),
    "llama-norm-before-fc": ("llama", {"norm_before_residual": True, "norm_before_fc": True}, (0, 1, 2)),
}
HEAD_DIMS = {"llama": 16, "qwen3": 24}  # Qwen3's q / k / v wider than hidden / heads, as in its configs


def layer_config(kind: str, hidden: int, vocab: int) -> dict:
    """The decoder layer's transformers config, as speculators stores it (`to_diff_dict`)."""
    config_cls = {"llama": LlamaConfig, "qwen3": Qwen3Config}[kind]
    c = config_cls(vocab_size=vocab, hidden_size=hidden, intermediate_size=96, num_hidden_layers=1,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=HEAD_DIMS[kind], rms_norm_eps=1e-5,
                   max_position_embeddings=256, tie_word_embeddings=False)
    return {**c.to_diff_dict(), "model_type": kind}


def write_speculators_head(path, embed: torch.Tensor, variant: str, seed: int = 0):
    """A speculators-format head of `variant` for a base whose embedding is `embed` [V, D] (its
    copy saved as the head's `embed_tokens`), with a draft vocabulary of every second token."""
    kind, fields, aux = VARIANTS[variant]
    V, D = embed.shape
    tl = layer_config(kind, D, V)
    n, hd, I, Vd = len(aux), tl["head_dim"], tl["intermediate_size"], V // 2
    g = torch.Generator().manual_seed(seed)

    def w(*shape):
        return torch.randn(*shape, generator=g) * shape[-1] ** -0.5 * 1.5

    def norm(size):
        return 1 + torch.randn(size, generator=g) * 0.1

    p = "layers.0."
    t = {"fc.weight": w(D, n * D), p + "hidden_norm.weight": norm(D), p + "input_layernorm.weight": norm(D),
         p + "self_attn.q_proj.weight": w(4 * hd, 2 * D), p + "self_attn.k_proj.weight": w(2 * hd, 2 * D),
         p + "self_attn.v_proj.weight": w(2 * hd, 2 * D), p + "self_attn.o_proj.weight": w(D, 4 * hd),
         p + "post_attention_layernorm.weight": norm(D), p + "mlp.gate_proj.weight": w(I, D),
         p + "mlp.up_proj.weight": w(I, D), p + "mlp.down_proj.weight": w(D, I), "norm.weight": norm(D),
         "lm_head.weight": w(Vd, D) * 3, "d2t": torch.arange(Vd, dtype=torch.int64),
         "t2d": torch.arange(V) % 2 == 0, "embed_tokens.weight": embed.detach().clone()}
    if kind == "qwen3":
        t |= {p + "self_attn.q_norm.weight": norm(hd), p + "self_attn.k_norm.weight": norm(hd)}
    if fields.get("norm_before_fc"):
        t["input_norm.weight"] = norm(n * D)
    if fields.get("fc_norm"):
        t |= {f"fc_norm.{i}.weight": norm(D) for i in range(n)}
    cfg = {"architectures": ["Eagle3DraftModel"], "speculators_model_type": "eagle3", "speculators_version": "0.3.0",
           "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                                  "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
                                  "verifier": {"architectures": ["LlamaForCausalLM"], "name_or_path": "org/base"}},
           "transformer_layer_config": tl, "draft_vocab_size": Vd, "eagle_aux_hidden_state_layer_ids": list(aux),
           "target_hidden_size": None, **fields}
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg))
    save_file({k: v.contiguous() for k, v in t.items()}, str(path / "model.safetensors"))
    return path
