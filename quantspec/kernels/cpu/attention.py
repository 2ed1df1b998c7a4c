"""quantspec's CPU paged attention (`kernels/csrc/attention.cpp`) beside its torch reference.

`paged_attention` writes a step's keys / values into the paged cache and attends each new query
row (decode: one per sequence; verification: 1 + k; a fresh prompt: all of its rows) over exactly
its sequence's keys up to its position, reading the cache through the block table: one call per
layer for the whole batch. Each query's numbers depend only on its own keys, so decode and
verification rows agree bitwise.
"""

from __future__ import annotations

import torch

from quantspec.kernels.cpu.build import need

__all__ = ["paged_attention", "paged_attention_ref"]


def paged_attention(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                    q_lens: list[int], seq_lens: list[int], block_size: int, scale: float, *,
                    pairs: bool = True, prefill_blocks: bool = True) -> torch.Tensor:
    """q [T, H, hd] (sequence b's q_lens[b] rows in order; fp32/bf16, hd 64 or 128); k_new, v_new
    [T, KV, hd] are written to k_cache, v_cache [slots, KV, hd] at slot_mapping [T]; then row i
    of sequence b (position seq_lens[b] − q_lens[b] + i) attends over its keys 0..position,
    found through block_tables [B, nb] → out [T, H, hd] (query head h reads KV head h // (H/KV)).
    fp32 accumulation. `pairs`: bf16 through AVX512-BF16's dot product where the CPU has it (the
    softmax weights rounded to bf16 before the value product, as a bf16 model's eager attention
    rounds its probabilities). `prefill_blocks`: fresh prompts of 16+ tokens (fp32, or bf16 on the
    pair path) through the blocked kernel, queries on the vector lanes and each key read once for
    a block of rows (False: the per-row kernel of decode steps)."""
    return need().paged_attention(q, k_new, v_new, k_cache, v_cache, slot_mapping, block_tables,
                                  list(q_lens), list(seq_lens), block_size, scale, pairs, prefill_blocks)


def paged_attention_ref(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, k_cache: torch.Tensor,
                        v_cache: torch.Tensor, slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                        q_lens: list[int], seq_lens: list[int], block_size: int, scale: float, *,
                        pairs: bool = True, prefill_blocks: bool = True) -> torch.Tensor:
    k_cache[slot_mapping] = k_new
    v_cache[slot_mapping] = v_new
    H, KV = q.shape[1], k_cache.shape[1]
    out, row = torch.empty_like(q), 0
    for b, (ql, sl) in enumerate(zip(q_lens, seq_lens)):
        pos = torch.arange(sl)
        slots = block_tables[b][pos // block_size] * block_size + pos % block_size
        k = k_cache[slots].float().repeat_interleave(H // KV, dim=1)  # [sl, H, hd]
        v = v_cache[slots].float().repeat_interleave(H // KV, dim=1)
        for i in range(ql):
            L = sl - ql + i + 1
            w = torch.softmax(torch.einsum("hd,lhd->hl", q[row + i].float() * scale, k[:L]), dim=-1)
            out[row + i] = torch.einsum("hl,lhd->hd", w, v[:L]).to(q.dtype)
        row += ql
    return out
