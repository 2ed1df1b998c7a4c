"""The paged KV cache: preallocated blocks, a free-list allocator, and the attention backend
that reads and writes it for a flattened batch of variable-length queries.

Layout (shared with `kernels/kv_cache.py`):
    k, v: [num_layers, num_blocks, block_size, num_kv_heads, head_dim]
    storage dtype: the model dtype, or int8 / float8_e4m3fn with static per-(layer, kv-head)
    scales `k_scale`, `v_scale`: [num_layers, num_kv_heads] (stored = round(x / scale)).

A step's `AttentionMetadata` describes B sequences, each bringing q_len_b ≥ 1 new tokens
(prefill: the prompt; decode: 1; speculative verification: 1 + k). Query i of sequence b sits at
position seq_len_b - q_len_b + i and attends keys 0..that position. Block 0 is never handed out:
padded block-table entries point at it, so gathers stay in bounds.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import torch
import torch.nn.functional as F

from quantspec.errors import QuantSpecError

__all__ = [
    "AttentionMetadata", "BlockAllocator", "KVCacheDtype", "PagedAttention", "PagedKVCache", "grouped_attention",
]

_PAD_BLOCK = 0
_INT8_MAX = 127.0


class KVCacheDtype(str, Enum):
    AUTO = "auto"  # the model's dtype, unquantized
    INT8 = "int8"
    FP8 = "fp8"


class BlockAllocator:
    """A free list of block ids (block 0 is reserved as the padding block)."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, 0, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise QuantSpecError(
                f"KV cache is full ({self.num_blocks} blocks); lower --batch-size or --max-length"
            )
        return [self._free.pop() for _ in range(n)]

    def free(self, blocks: list[int]) -> None:
        self._free.extend(reversed(blocks))


class PagedKVCache:
    def __init__(self, *, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device | str = "cpu",
                 kv_dtype: KVCacheDtype = KVCacheDtype.AUTO,
                 k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None):
        self.block_size, self.num_blocks = block_size, num_blocks
        self.kv_dtype = KVCacheDtype(kv_dtype)
        self.compute_dtype = dtype
        if self.kv_dtype is KVCacheDtype.AUTO:
            storage = dtype
        else:
            if k_scale is None or v_scale is None:
                raise QuantSpecError(
                    f"a static {self.kv_dtype.value} KV cache needs k/v scales; run `quantspec calibrate` "
                    f"and pass --calib DIR (or use an artifact that stores k_scale/v_scale)"
                )
            expected = (num_layers, num_kv_heads)
            for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
                if tuple(s.shape) != expected:
                    raise QuantSpecError(f"{name} has shape {tuple(s.shape)}, the model needs {expected}")
            if self.kv_dtype is KVCacheDtype.FP8 and not hasattr(torch, "float8_e4m3fn"):
                raise QuantSpecError("this torch build has no float8_e4m3fn; use the int8 KV cache")
            storage = torch.int8 if self.kv_dtype is KVCacheDtype.INT8 else torch.float8_e4m3fn
        self.k_scale = None if k_scale is None else k_scale.to(device, torch.float32)
        self.v_scale = None if v_scale is None else v_scale.to(device, torch.float32)
        shape = (num_layers, num_blocks, block_size, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=storage, device=device)
        self.v = torch.zeros(shape, dtype=storage, device=device)
        self.allocator = BlockAllocator(num_blocks)

    def _store(self, x: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
        """x: [T, KV, hd] → storage dtype."""
        if self.kv_dtype is KVCacheDtype.AUTO:
            return x
        from quantspec.quant.primitives import quantize_kv

        return quantize_kv(x, scale, self.kv_dtype.value)

    def _load(self, x: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
        """x: [..., KV, hd] storage → compute dtype."""
        if self.kv_dtype is KVCacheDtype.AUTO:
            return x
        from quantspec.quant.primitives import dequantize_kv

        return dequantize_kv(x, scale, self.compute_dtype)

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """k, v: [T, KV, hd]; slot_mapping: [T] flat slot ids."""
        kf = self.k[layer].view(-1, *self.k.shape[-2:])
        vf = self.v[layer].view(-1, *self.v.shape[-2:])
        ks = None if self.k_scale is None else self.k_scale[layer]
        vs = None if self.v_scale is None else self.v_scale[layer]
        kq, vq = self._store(k, ks), self._store(v, vs)
        if kf.dtype == torch.float8_e4m3fn:  # CPU index_copy_ has no fp8 kernel: copy the bytes
            kf, vf, kq, vq = (t.view(torch.uint8) for t in (kf, vf, kq, vq))
        kf.index_copy_(0, slot_mapping, kq)
        vf.index_copy_(0, slot_mapping, vq)

    def gather(self, layer: int, block_tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """block_tables: [B, nb] block ids → k, v: [B, nb*block_size, KV, hd] in the compute dtype.

        Whole blocks are copied (`index_select` on the block dim is a contiguous memcpy per
        block), which on CPU is ~50x faster than indexing slot by slot."""
        B, nb = block_tables.shape
        flat = block_tables.reshape(-1)
        k = self.k[layer].index_select(0, flat).view(B, nb * self.block_size, *self.k.shape[-2:])
        v = self.v[layer].index_select(0, flat).view(B, nb * self.block_size, *self.v.shape[-2:])
        ks = None if self.k_scale is None else self.k_scale[layer]
        vs = None if self.v_scale is None else self.v_scale[layer]
        return self._load(k, ks), self._load(v, vs)


@dataclass
class AttentionMetadata:
    """One step's batch layout, built once and shared by every layer."""

    q_lens: list[int]  # new tokens per sequence
    seq_lens: list[int]  # context length per sequence, including the new tokens
    slot_mapping: torch.Tensor  # [T] int64, where each new token's K/V goes
    block_tables: torch.Tensor  # [B, nb] int64, each sequence's blocks (padded with block 0)
    bias: torch.Tensor | None  # [B, 1, Qmax, L] additive mask (0 / -inf); None: only fresh prompts
    q_index: torch.Tensor | None  # [T] flat index into [B*Qmax] for padding queries; None if uniform

    @classmethod
    def build(cls, q_lens: list[int], seq_lens: list[int], block_tables: list[list[int]],
              block_size: int, device) -> "AttentionMetadata":
        B = len(q_lens)
        slots: list[int] = []
        for ql, sl, table in zip(q_lens, seq_lens, block_tables):
            for pos in range(sl - ql, sl):
                slots.append(table[pos // block_size] * block_size + pos % block_size)
        slot_mapping = torch.tensor(slots, dtype=torch.int64, device=device)
        max_blocks = max(-(-sl // block_size) for sl in seq_lens)
        tables = torch.full((B, max_blocks), _PAD_BLOCK, dtype=torch.int64)
        for b, table in enumerate(block_tables):
            n = min(len(table), max_blocks)
            tables[b, :n] = torch.tensor(table[:n], dtype=torch.int64)
        q_max = max(q_lens)
        # only fresh prompts (nothing cached yet): each attends causally to its own new tokens
        fresh_prefill = all(ql == sl for ql, sl in zip(q_lens, seq_lens))
        bias = q_index = None
        if not fresh_prefill:
            L = max_blocks * block_size
            pos = torch.zeros(B, q_max, dtype=torch.int64)
            valid_q = torch.zeros(B, q_max, dtype=torch.bool)
            for b, (ql, sl) in enumerate(zip(q_lens, seq_lens)):
                pos[b, :ql] = torch.arange(sl - ql, sl)
                valid_q[b, :ql] = True
            # padded query rows attend to key 0 only, so softmax stays finite; they are dropped
            mask = torch.arange(L)[None, None, :] <= pos[:, :, None]  # [B, Qmax, L]
            bias = torch.zeros(mask.shape, dtype=torch.float32).masked_fill_(~mask, float("-inf"))
            bias = bias.unsqueeze(1).to(device)  # [B, 1, Qmax, L]
            if any(ql != q_max for ql in q_lens):
                q_index = valid_q.view(-1).nonzero().squeeze(1).to(device)
        return cls(q_lens, seq_lens, slot_mapping, tables.to(device), bias, q_index)


class PagedAttention:
    """The attention backend of the engine: write this step's K/V, attend over the cache."""

    def __init__(self, cache: PagedKVCache, meta: AttentionMetadata):
        self.cache, self.meta = cache, meta

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [T, H, hd]; k, v: [T, KV, hd] → [T, H, hd]."""
        meta, cache = self.meta, self.cache
        cache.write(layer_idx, k, v, meta.slot_mapping)
        gqa = q.shape[1] != k.shape[1]
        if meta.bias is None:  # fresh prompts only: plain causal attention per sequence, no padding
            out = torch.empty_like(q)
            start = 0
            for b, n in enumerate(meta.q_lens):
                kb, vb = k[start:start + n], v[start:start + n]
                if cache.kv_dtype is not KVCacheDtype.AUTO:  # attend to the cache's rounded values
                    kc, vc = cache.gather(layer_idx, meta.block_tables[b:b + 1])
                    kb, vb = kc[0, :n], vc[0, :n]
                o = F.scaled_dot_product_attention(
                    q[start:start + n].transpose(0, 1)[None], kb.transpose(0, 1)[None], vb.transpose(0, 1)[None],
                    is_causal=True, enable_gqa=gqa,
                )  # (1, H, n, hd)
                out[start:start + n] = o[0].transpose(0, 1)
                start += n
            return out
        B, q_max = meta.bias.shape[0], meta.bias.shape[2]
        H, hd = q.shape[1], q.shape[2]
        if meta.q_index is None:
            qp = q.view(B, q_max, H, hd)
        else:
            qp = q.new_zeros(B * q_max, H, hd)
            qp[meta.q_index] = q
            qp = qp.view(B, q_max, H, hd)
        kc, vc = cache.gather(layer_idx, meta.block_tables)  # (B, L, KV, hd)
        return grouped_attention(qp, kc, vc, meta.bias).reshape(-1, H, hd)[
            slice(None) if meta.q_index is None else meta.q_index]


def grouped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """Attention with grouped KV heads and an additive mask, without repeating K/V.

    q: [B, Q, H, hd]; k, v: [B, L, KV, hd]; bias: [B, 1, Q, L] → [B, Q, H, hd]. Query head h
    reads KV head h // (H // KV) (HF's `repeat_kv` convention). For a handful of query rows this
    is two small batched matmuls, much cheaper on CPU than SDPA's masked math path.
    """
    B, Q, H, hd = q.shape
    KV, L = k.shape[2], k.shape[1]
    G = H // KV
    qg = q.view(B, Q, KV, G, hd).permute(0, 2, 3, 1, 4).reshape(B, KV, G * Q, hd)  # (B, KV, G*Q, hd)
    scores = torch.matmul(qg, k.permute(0, 2, 3, 1)) * (hd ** -0.5)  # (B, KV, G*Q, L)
    scores = scores.view(B, KV, G, Q, L) + bias.unsqueeze(2).to(scores.dtype)  # bias (B, 1, 1, Q, L)
    probs = torch.softmax(scores.float(), dim=-1).to(v.dtype).view(B, KV, G * Q, L)
    out = torch.matmul(probs, v.transpose(1, 2))  # (B, KV, G*Q, hd)
    return out.view(B, KV, G, Q, hd).permute(0, 3, 1, 2, 4).reshape(B, Q, H, hd)
