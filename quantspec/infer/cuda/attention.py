"""The paged attention of a CUDA cache: quantspec's Triton kernels (`kernels/kv_cache.py`) write
each step's keys and values into the cache (quantizing them for an int8 / fp8 cache) and attend
over it for the whole batch in one launch per layer: prefill, decode and verification rows alike.

Each query row is computed from its own keys only, in the same key-block order whatever else is
in the step (one query tile size for every step), so a verification row gives the numbers of the
decode step at that position.
"""

from __future__ import annotations

import itertools

import torch

from quantspec.infer.kv_cache import AttentionMetadata, PagedKVCache

__all__ = ["TritonAttention"]

SUPPORTED_HEAD_DIMS = (64, 80, 96, 128, 256)


class TritonAttention:
    """The `AttentionKernel` of one CUDA `PagedKVCache` (module docstring)."""

    def __init__(self, cache: PagedKVCache):
        self.cache = cache

    @classmethod
    def for_cache(cls, cache: PagedKVCache) -> "TritonAttention | None":
        """The kernel for `cache`, or None where the Triton kernels cannot take it."""
        from quantspec.kernels import triton_usable

        if not triton_usable(cache.k.device) or cache.head_dim not in SUPPORTED_HEAD_DIMS:
            return None
        return cls(cache)

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
        return kernels.paged_attention(q, kc, vc, cu, seq, tables, ks, vs, max_q_len=max_q)

