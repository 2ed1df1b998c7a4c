"""A decoder stack with its small ops fused (`kernels/fused.py`): the CUDA backend's layer loop
where `DispatchPolicy.cuda_fused_ops` asks for it.

Per layer the modules launch about twenty kernels besides the projections and the attention
(norms as four ops each, the residual adds, the rotary embedding as six, SiLU and its product);
here they are four: the residual add fused into each RMSNorm, the rotary embedding of q and k in
place in the fused q/k/v projection's output, and SiLU(gate) · up. The residual stream is carried
beside each layer's output, so the add that closes a layer happens inside the next layer's first
norm. Projections and attention are the modules' own (`project`, the step's attention).
"""

from __future__ import annotations

import torch
from torch import nn

from quantspec.model_zoo.llama import MLP, RMSNorm, SiluAndMul, apply_rope, project

__all__ = ["fusable", "fused_stack"]


def fusable(layers: nn.ModuleList, dtype: torch.dtype) -> bool:
    """Whether `fused_stack` takes these layers with activations of `dtype`: fused q/k/v and
    gate/up projections (`infer.fuse`), Llama's RMSNorms with weights in `dtype`, silu MLPs, and
    none of Granite's multipliers (which the layer loop here leaves out)."""
    for layer in layers:
        a, m = layer.self_attn, layer.mlp
        if not isinstance(m, MLP) or a.qkv_proj is None or m.gate_up_proj is None:  # MLP: not a mixture of experts
            return False
        if layer.residual_multiplier != 1.0 or a.q_scale is not None or layer.post_norms or a.local_rope:
            return False  # (OLMo 2's and Gemma 3's norms sit elsewhere; Gemma's window layers turn by other tables)
        if type(m.act_fn) is not SiluAndMul:
            return False
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            if type(norm) is not RMSNorm or norm.fp32_scale or norm.weight.dtype != dtype:
                return False
    return True


def fused_stack(layers: nn.ModuleList, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn,
                row_invariant: bool) -> torch.Tensor:
    """x [T, D] embeddings, cos / sin [T, hd] in x's dtype → the last layer's output [T, D],
    through the layers' projections and `attn` with the fused small ops (module docstring)."""
    from quantspec import kernels

    T = x.shape[0]
    residual, delta = x, None
    for layer in layers:
        a = layer.self_attn
        H, KV, hd = a.num_heads, a.num_kv_heads, a.head_dim
        norm = layer.input_layernorm
        h, residual = kernels.add_rms_norm(residual if delta is None else delta, None if delta is None else residual,
                                           norm.weight, norm.eps)
        qkv = project(a.qkv_proj, h, row_invariant).view(T, H + 2 * KV, hd)
        if a.q_norm is not None:  # Qwen3: q and k normalized per head before the rotary embedding
            qkv[:, :H] = a.q_norm(qkv[:, :H])
            qkv[:, H:H + KV] = a.k_norm(qkv[:, H:H + KV])
        if a.use_rope and cos.shape[-1] == hd:  # (a NoPE layer turns nothing)
            kernels.rope_qk_(qkv, H + KV, cos, sin)
        elif a.use_rope:  # partial rotary: the leading cos.shape[-1] dims of each head (the kernel turns whole heads)
            qkv[:, :H + KV] = apply_rope(qkv[:, :H + KV], cos, sin)
        out = attn(a.layer_idx, qkv[:, :H], qkv[:, H:H + KV], qkv[:, H + KV:])  # [T, H, hd]
        delta = project(a.o_proj, out.reshape(T, H * hd), row_invariant)
        norm = layer.post_attention_layernorm
        h, residual = kernels.add_rms_norm(delta, residual, norm.weight, norm.eps)
        m = layer.mlp
        delta = project(m.down_proj, kernels.silu_mul(project(m.gate_up_proj, h, row_invariant)), row_invariant)
    return residual if delta is None else residual + delta
