"""Attention without a KV cache and the arithmetic the paged cache's torch path shares with it:
plain causal attention over a dense batch (`DenseCausalAttention`: evaluation, calibration and the
draft heads' training), the sliding-window mask (`window_mask`), and grouped-query attention of
a few query rows (`folded_gqa_attention`) or of a padded batch (`grouped_attention`).

A model's sliding window (`ModelArgs.attention_window`) applies to its `window_layers` (every layer
of Mistral, Mixtral and Phi-3; Gemma's local layers); the other layers attend to the whole
context. `softcap` (Gemma 2's `attn_logit_softcapping`, `ModelArgs.attn_softcap`) bounds every
score s to softcap · tanh(s / softcap) before the mask and softmax, as transformers' eager
attention does; torch's SDPA has no such step, so capped attention runs the scores explicitly."""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["DenseCausalAttention", "folded_gqa_attention", "grouped_attention", "window_mask"]


class DenseCausalAttention:
    """Plain causal attention over a dense `[B, S]` batch flattened to `T = B*S` tokens.

    `kv_hook(layer_idx, k, v)` — if given — sees each layer's keys and values `[B, S, KV, hd]`,
    e.g. for the KV-cache scale observers. `window`: each query of a layer in `window_layers`
    (None: every layer) attends to the keys of the last `window` positions. `softcap`: module
    docstring (0: none).
    """

    def __init__(self, batch: int, seq_len: int, kv_hook=None, window: int | None = None,
                 window_layers: tuple[int, ...] | None = None, softcap: float = 0.0):
        self.batch, self.seq_len, self.kv_hook, self.softcap = batch, seq_len, kv_hook, softcap
        self.mask = None if window is None or seq_len <= window else window_mask(seq_len, seq_len, window)
        self.window_layers = None if window_layers is None else frozenset(window_layers)
        # capped scores run explicitly under an additive mask: {whether the layer's window: [S, S]}
        self.bias = {} if not softcap else {
            w: torch.zeros(seq_len, seq_len).masked_fill_(~m, float("-inf"))
            for w, m in ((False, window_mask(seq_len, seq_len, None)), (True, self.mask)) if m is not None}

    @classmethod
    def of(cls, args, batch: int, seq_len: int, kv_hook=None) -> "DenseCausalAttention":
        """The attention of a model of `ModelArgs` args (its sliding window in its window layers,
        its score cap)."""
        return cls(batch, seq_len, kv_hook, args.attention_window, args.window_layers, args.attn_softcap)

    def __call__(self, layer_idx, q, k, v):
        B, S = self.batch, self.seq_len
        q = q.view(B, S, *q.shape[1:])
        k = k.view(B, S, *k.shape[1:])
        v = v.view(B, S, *v.shape[1:])
        if self.kv_hook is not None:
            self.kv_hook(layer_idx, k, v)
        mask = self.mask if self.window_layers is None or layer_idx in self.window_layers else None
        if self.softcap:
            bias = self.bias[mask is not None].to(q.device).expand(B, 1, S, S)
            return grouped_attention(q, k, v, bias, self.softcap).reshape(B * S, *q.shape[2:])
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=mask is None,
            attn_mask=None if mask is None else mask.to(q.device), enable_gqa=q.shape[2] != k.shape[2],
        )  # (B, H, S, hd)
        return out.transpose(1, 2).reshape(B * S, *out.shape[1:2], out.shape[-1])


def window_mask(q_len: int, seq_len: int, window: int | None) -> torch.Tensor:
    """[q_len, seq_len] bool (True = attend): the last q_len of seq_len positions over all of them,
    causal and, with `window`, within the last `window` positions (transformers' sliding-window
    mask: q - k < window)."""
    d = torch.arange(seq_len - q_len, seq_len)[:, None] - torch.arange(seq_len)[None, :]
    return (d >= 0) & (d < window) if window is not None else d >= 0


def _capped_scores(q: torch.Tensor, k: torch.Tensor, softcap: float) -> torch.Tensor:
    """q [..., Q, hd] · k [..., L, hd] / √hd, capped (module docstring)."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * (q.shape[-1] ** -0.5)
    return torch.tanh(scores / softcap) * softcap if softcap else scores


def folded_gqa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                         softcap: float = 0.0) -> torch.Tensor:
    """A few queries of one sequence over its keys, each KV head read once.

    q: [n, H, hd]; k, v: [L, KV, hd] (any strides, e.g. a view of the cache); mask: [n, L] bool
    (True = attend) or None → [n, H, hd]. The G = H / KV query heads that share a KV head become
    G*n query rows of that head (row g*n + i), so SDPA streams each KV head once instead of once
    per query head (SDPA's `enable_gqa` on CPU costs ~6x more in bf16 for one query). `softcap`:
    the scores capped and run explicitly (module docstring; 0: SDPA).
    """
    n, H, hd = q.shape
    KV = k.shape[1]
    G = H // KV
    qf = q.view(n, KV, G, hd).permute(1, 2, 0, 3).reshape(1, KV, G * n, hd)
    m = None if mask is None else mask.to(q.device).repeat(G, 1)  # [G*n, L]
    kt, vt = k.transpose(0, 1)[None], v.transpose(0, 1)[None]
    if softcap:
        scores = _capped_scores(qf, kt, softcap)
        if m is not None:
            scores = scores.masked_fill(~m, float("-inf"))
        o = torch.matmul(torch.softmax(scores.float(), dim=-1).to(v.dtype), vt)
    else:
        o = F.scaled_dot_product_attention(qf, kt, vt, attn_mask=m)
    return o.view(KV, G, n, hd).permute(2, 0, 1, 3).reshape(n, H, hd)


def grouped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor,
                      softcap: float = 0.0) -> torch.Tensor:
    """Attention with grouped KV heads and an additive mask, without repeating K/V.

    q: [B, Q, H, hd]; k, v: [B, L, KV, hd]; bias: [B, 1, Q, L] → [B, Q, H, hd]. Query head h
    reads KV head h // (H // KV) (HF's `repeat_kv` convention): two batched matmuls around a
    softmax in fp32, the scores capped by `softcap` (module docstring; 0: none).
    """
    B, Q, H, hd = q.shape
    KV, L = k.shape[2], k.shape[1]
    G = H // KV
    qg = q.view(B, Q, KV, G, hd).permute(0, 2, 3, 1, 4).reshape(B, KV, G * Q, hd)  # (B, KV, G*Q, hd)
    scores = _capped_scores(qg, k.permute(0, 2, 1, 3), softcap)  # (B, KV, G*Q, L)
    scores = scores.view(B, KV, G, Q, L) + bias.unsqueeze(2).to(scores.dtype)  # bias (B, 1, 1, Q, L)
    probs = torch.softmax(scores.float(), dim=-1).to(v.dtype).view(B, KV, G * Q, L)
    out = torch.matmul(probs, v.transpose(1, 2))  # (B, KV, G*Q, hd)
    return out.view(B, KV, G, Q, hd).permute(0, 3, 1, 2, 4).reshape(B, Q, H, hd)
