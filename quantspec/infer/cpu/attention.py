"""The CPU backend's attention kernel over a paged cache (`kernels.cpu.paged_attention`).

One call per layer writes a step's keys / values and attends every new row of every sequence over
exactly its keys, through the block table. It takes a cache of fp32 or bf16 keys (not a quantized
one), head dim 64 or 128 and a power-of-two block size, and serves:
- decode and verification steps (no fresh prompt, at most `MAX_QUERIES` new rows a sequence);
  a token tree's step comes as one query per row whose block table lists its keys' slots (block
  size 1, `AttentionMetadata._tree_build`);
- steps of fresh prompts of at most `max_prefill` tokens: any length in fp32 and in bf16 on the
  AVX512-BF16 pair path (its blocked prefill path is faster than SDPA at every length), else
  `MAX_PREFILL` tokens (bf16 through the fp32 chain is SDPA's beyond that).
"""

from __future__ import annotations

import weakref

import torch

from quantspec.infer.kv_cache import AttentionMetadata, KVCacheDtype, PagedKVCache
from quantspec.kernels import cpu as cg

__all__ = ["CpuAttention", "MAX_PREFILL", "MAX_QUERIES"]

MAX_QUERIES = 64  # new rows per sequence of a decode / verification step the kernel takes
MAX_PREFILL = 512  # longest fresh prompt of the fp32-chain bf16 kernel (beyond it: SDPA)
_ANY = 1 << 30


class CpuAttention:
    """The attention kernel of one `PagedKVCache` (module docstring). `pairs`: bf16 through
    AVX512-BF16's dot product where the CPU has it; `prefill_blocks`: fresh prompts of 16+ tokens
    through the blocked prefill kernel (off: the per-row kernel of decode steps)."""

    def __init__(self, cache: PagedKVCache, *, pairs: bool = True, prefill_blocks: bool = True):
        self.cache, self.pairs, self.prefill_blocks = cache, pairs, prefill_blocks
        self.max_prefill = _ANY if cache.compute_dtype == torch.float32 or cg.pair_path_available() else MAX_PREFILL
        # each layer's cache as [slots, KV, hd] views, built once (a decode step reads 2 per layer)
        kv = (cache.num_kv_heads, cache.head_dim)
        self.k_slots = [cache.k[i].view(-1, *kv) for i in range(cache.k.shape[0])]
        self.v_slots = [cache.v[i].view(-1, *kv) for i in range(cache.v.shape[0])]
        # one-call layer-stack plans over this cache's tensors, by stack (`infer/cpu/stack.py`):
        # the cache owns them, so a discarded cache frees them
        self.plans: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    @classmethod
    def for_cache(cls, cache: PagedKVCache, *, pairs: bool = True) -> "CpuAttention | None":
        """The kernel for `cache`, or None where it does not take the cache (module docstring)."""
        if (cache.k.device.type != "cpu" or cache.kv_dtype is not KVCacheDtype.AUTO
                or cache.compute_dtype not in (torch.float32, torch.bfloat16) or cache.head_dim not in (64, 128)
                or cache.block_size & (cache.block_size - 1)):  # the kernel finds slots by shift
            return None
        if cg.cpu_kernels() is None:
            return None
        return cls(cache, pairs=pairs)

    def serves(self, q_lens: list[int], seq_lens: list[int]) -> bool:
        if all(ql == sl for ql, sl in zip(q_lens, seq_lens)):  # fresh prompts only
            return max(seq_lens) <= self.max_prefill
        return all(ql < sl for ql, sl in zip(q_lens, seq_lens)) and max(q_lens) <= MAX_QUERIES

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 meta: AttentionMetadata) -> torch.Tensor:
        return cg.paged_attention(q, k, v, self.k_slots[layer_idx], self.v_slots[layer_idx], meta.slot_mapping,
                                  meta.block_tables, meta.q_lens, meta.seq_lens, meta.block_size or self.cache.block_size,
                                  q.shape[-1] ** -0.5, pairs=self.pairs, prefill_blocks=self.prefill_blocks)
