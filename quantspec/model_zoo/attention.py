"""Plain causal attention over a dense batch (`DenseCausalAttention`: evaluation, calibration and
the draft heads' training, no KV cache) and the sliding-window mask it and the paged KV cache
share (`window_mask`).

A model's sliding window (`ModelArgs.attention_window`) applies to its `window_layers` (every layer
of Mistral, Mixtral and Phi-3; Gemma 3's local layers); the other layers attend to the whole
context."""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["DenseCausalAttention", "window_mask"]


class DenseCausalAttention:
    """Plain causal attention over a dense `[B, S]` batch flattened to `T = B*S` tokens.

    `kv_hook(layer_idx, k, v)` — if given — sees each layer's keys and values `[B, S, KV, hd]`,
    e.g. for the KV-cache scale observers. `window`: each query of a layer in `window_layers`
    (None: every layer) attends to the keys of the last `window` positions.
    """

    def __init__(self, batch: int, seq_len: int, kv_hook=None, window: int | None = None,
                 window_layers: tuple[int, ...] | None = None):
        self.batch, self.seq_len, self.kv_hook = batch, seq_len, kv_hook
        self.mask = None if window is None or seq_len <= window else window_mask(seq_len, seq_len, window)
        self.window_layers = None if window_layers is None else frozenset(window_layers)

    @classmethod
    def of(cls, args, batch: int, seq_len: int, kv_hook=None) -> "DenseCausalAttention":
        """The attention of a model of `ModelArgs` args (its sliding window, in its window layers)."""
        return cls(batch, seq_len, kv_hook, args.attention_window, args.window_layers)

    def __call__(self, layer_idx, q, k, v):
        B, S = self.batch, self.seq_len
        q = q.view(B, S, *q.shape[1:])
        k = k.view(B, S, *k.shape[1:])
        v = v.view(B, S, *v.shape[1:])
        if self.kv_hook is not None:
            self.kv_hook(layer_idx, k, v)
        mask = self.mask if self.window_layers is None or layer_idx in self.window_layers else None
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
