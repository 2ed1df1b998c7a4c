"""The paged attention of a CUDA cache: quantspec's Triton kernels (`kernels/kv_cache.py`) write
each step's keys and values into the cache (quantizing them for an int8 / fp8 cache) and attend
over it for the whole batch in one launch per layer: prefill, decode and verification rows alike.

Each query row is computed from its own keys only, in the same key-block order whatever else is
in the step (one query tile size for every step), so a verification row gives the numbers of the
decode step at that position. With `split_kv` (`DispatchPolicy.cuda_split_kv`) a step of at most
`SPLIT_KV_MAX_ROWS` rows splits each row's keys across programs in chunks at fixed positions
(`kv_split`: flash-decoding), so that a long context is read by many programs at once; the
chunks do not depend on the step, so the same holds for those steps among themselves. The
kernel applies the cache's sliding window in its window layers (their keys unsplit) and Gemma 2's
score cap, so such models' steps stay on it (token trees past a window aside).
"""

from __future__ import annotations

import itertools

import torch

from quantspec.infer.kv_cache import AttentionMetadata, PagedKVCache

__all__ = ["TritonAttention"]

SUPPORTED_HEAD_DIMS = (64, 80, 96, 128, 256)
KV_CHUNK = 256  # the fewest keys a split reads (four of the kernel's 64-key blocks)
MAX_KV_SPLITS = 16
SPLIT_KV_MAX_ROWS = 64  # the partial sums of a step: splits x rows x heads x head_dim fp32 (16 MB for 32 x 128)


def kv_split(max_seq_len: int | None) -> tuple[int, int] | None:
    """(kv_chunk, kv_splits) of `kernels.paged_attention` for a cache of sequences up to
    `max_seq_len` keys: chunks of `KV_CHUNK` keys, longer ones (multiples of 64) where more than
    `MAX_KV_SPLITS` would be needed; None where one chunk holds every sequence."""
    if not max_seq_len:
        return None
    per_split = -(-max_seq_len // MAX_KV_SPLITS)
    chunk = max(KV_CHUNK, -(-per_split // 64) * 64)
    splits = -(-max_seq_len // chunk)
    return (chunk, splits) if splits > 1 else None


class TritonAttention:
    """The `AttentionKernel` of one CUDA `PagedKVCache` (module docstring); it applies the cache's
    sliding window in its window layers and its score cap (`slides`, `caps`)."""

    slides = caps = True

    def __init__(self, cache: PagedKVCache, split_kv: bool = False):
        self.cache = cache
        self.split = kv_split(cache.max_seq_len) if split_kv else None

    @classmethod
    def for_cache(cls, cache: PagedKVCache, split_kv: bool = False) -> "TritonAttention | None":
        """The kernel for `cache`, or None where the Triton kernels cannot take it."""
        from quantspec.kernels import triton_usable

        if not triton_usable(cache.k.device) or cache.head_dim not in SUPPORTED_HEAD_DIMS:
            return None
        return cls(cache, split_kv)

    def serves(self, q_lens: list[int], seq_lens: list[int]) -> bool:
        return True

    def _step_args(self, meta: AttentionMetadata) -> tuple:
        if meta.kernel_args is None:
            dev = self.cache.k.device
            cu = torch.tensor([0, *itertools.accumulate(meta.q_lens)], dtype=torch.int32, device=dev)
            seq = torch.tensor(meta.seq_lens, dtype=torch.int32, device=dev)
            meta.kernel_args = (cu, seq, meta.block_tables.to(torch.int32), max(meta.q_lens))
        return meta.kernel_args

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 meta: AttentionMetadata) -> torch.Tensor:
        """q: [T, H, hd]; k, v: [T, KV, hd] → [T, H, hd]."""
        from quantspec import kernels

        c = self.cache
        kc, vc = c.k[layer_idx], c.v[layer_idx]
        ks = None if c.k_scale is None else c.k_scale[layer_idx]
        vs = None if c.v_scale is None else c.v_scale[layer_idx]
        kernels.write_kv_cache(k, v, kc, vc, meta.slot_mapping, ks, vs)
        cu, seq, tables, max_q = self._step_args(meta)
        chunk, splits = self.split if self.split is not None and q.shape[0] <= SPLIT_KV_MAX_ROWS else (None, 1)
        window = c.window if c.window is not None and (c.window_layers is None or layer_idx in c.window_layers) \
            else None  # (a windowed layer's keys are not split)
        return kernels.paged_attention(q, kc, vc, cu, seq, tables, ks, vs, max_q_len=max_q, kv_chunk=chunk,
                                       kv_splits=splits, window=window, softcap=c.softcap)

