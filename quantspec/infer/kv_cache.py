"""The paged KV cache: preallocated blocks, a free-list allocator, and the attention backend
that reads and writes it for a flattened batch of variable-length queries.

Layout (shared with `kernels/kv_cache.py`):
    k, v: [num_layers, num_blocks, block_size, num_kv_heads, head_dim]
    storage dtype: the model dtype, or int8 / float8_e4m3fn with static per-(layer, kv-head)
    scales `k_scale`, `v_scale`: [num_layers, num_kv_heads] (stored = round(x / scale)).

A step's `AttentionMetadata` describes B sequences, each bringing q_len_b ≥ 1 new tokens
(prefill: the prompt; decode: 1; speculative verification: 1 + k). Query i of sequence b sits at
position seq_len_b - q_len_b + i and attends keys 0..that position; with a sliding window W
(`ModelArgs.attention_window`), in the layers that slide it, only the last W of them (p - W < key
≤ p), read for a decode row as the cache's last W slots, for verification rows as the same slots
each.
Block 0 is never handed out: padded block-table entries point at it, so gathers stay in bounds,
and so do the entries of a sequence's blocks that its window has left behind and the scheduler
has given back (a model whose every layer slides: no row reads them again).

`PagedAttention` attends with torch's SDPA. A device backend may give a cache an
`AttentionKernel` of its own, chosen once when the cache is built (`PagedKVCache(kernel=...)`);
the metadata of each step then says whether the kernel serves that step (`meta.kernel`): a step
whose window leaves out keys only where the kernel slides it, a capped cache only where the kernel
caps (`AttentionKernel`).
"""

from __future__ import annotations

import math
import mmap
from dataclasses import dataclass
from enum import Enum
from typing import Callable, Protocol

import torch
import torch.nn.functional as F

from quantspec.errors import QuantSpecError
from quantspec.infer.attention_masks import ancestor_rows, batched_mask, sequence_mask
from quantspec.model_zoo.attention import folded_gqa_attention, grouped_attention

__all__ = [
    "AttentionKernel", "AttentionMetadata", "BlockAllocator", "KVCacheDtype", "PAD_BLOCK", "PagedAttention", "PagedKVCache",
    "ancestor_rows", "grouped_attention", "kv_block_bytes", "kv_cache_label",
]

PAD_BLOCK = 0  # never handed out: padded block-table entries, and a sequence's blocks given back (below)
_INT8_MAX = 127.0


class KVCacheDtype(str, Enum):
    AUTO = "auto"  # the model's dtype, unquantized
    INT8 = "int8"
    FP8 = "fp8"


def kv_cache_label(kind: str, dtype: torch.dtype | str, origin: str | None = None) -> str:
    """What a command says of the KV cache it ran: "float (bfloat16)" for `kind` "auto" / "none" /
    "float", else e.g. "fp8 static (the artifact's scales)" (`origin`: where the scales come from)."""
    if kind in ("auto", "none", "float"):
        return f"float ({str(dtype).replace('torch.', '')})"
    return f"{kind} static ({origin})"


class BlockAllocator:
    """The free block ids (block 0 is reserved as the padding block).

    `allocate` prefers consecutive ids: a sequence whose blocks form one run can be read from the
    cache as a view (see `PagedAttention`), with no gather. It takes the run that continues the
    sequence's last block (`after`) when that is free, else the lowest free run of `n` ids, else
    the lowest free ids (any block works; a run is only faster).
    """

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self._free = [True] * num_blocks
        self._free[PAD_BLOCK] = False
        self._num_free = num_blocks - 1

    @property
    def num_free(self) -> int:
        return self._num_free

    def _run_at(self, start: int, n: int) -> bool:
        return start + n <= self.num_blocks and all(self._free[start:start + n])

    def allocate(self, n: int, after: int | None = None) -> list[int]:
        if n > self._num_free:
            raise QuantSpecError(
                f"KV cache is full ({self.num_blocks} blocks); lower --batch-size or --max-length"
            )
        if n <= 0:
            return []
        start = None
        if after is not None and self._run_at(after + 1, n):
            start = after + 1
        else:
            run = 0
            for i, f in enumerate(self._free):
                run = run + 1 if f else 0
                if run == n:
                    start = i - n + 1
                    break
        ids = list(range(start, start + n)) if start is not None else \
            [i for i, f in enumerate(self._free) if f][:n]
        for i in ids:
            self._free[i] = False
        self._num_free -= n
        return ids

    def free(self, blocks: list[int]) -> None:
        for i in blocks:
            self._free[i] = True
        self._num_free += len(blocks)


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A zero tensor; on the CPU in fresh anonymous memory, whose pages the system zero-fills
    when first written, so the cache's blocks take memory as sequences fill them rather than all
    at once (a model's `--max-length` × `--batch-size` cache is mostly never written). Private
    (a forked process gets its own copy on write), page-aligned, freed with the tensor."""
    nbytes = dtype.itemsize * math.prod(shape)
    if torch.device(device).type != "cpu" or nbytes == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE)
    return torch.frombuffer(buf, dtype=torch.uint8).view(dtype).view(shape)


class AttentionKernel(Protocol):
    """A device backend's attention over one cache (writes the step's keys / values and attends).
    A kernel whose class sets `slides` applies the cache's sliding window in its window layers
    (token trees aside); one that sets `caps`, the cache's score cap. Others get no such step."""

    def serves(self, q_lens: list[int], seq_lens: list[int]) -> bool:
        """Whether it takes a step of these sequences (else SDPA does)."""

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 meta: "AttentionMetadata") -> torch.Tensor:
        """q [T, H, hd], k / v [T, KV, hd] → [T, H, hd]."""


def kv_block_bytes(*, num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                   kv_dtype: KVCacheDtype | str = KVCacheDtype.AUTO) -> int:
    """Bytes one block of a `PagedKVCache` takes: keys and values of every layer, stored in the
    model's `dtype` or, for a static int8 / fp8 cache, one byte each."""
    itemsize = dtype.itemsize if KVCacheDtype(kv_dtype) is KVCacheDtype.AUTO else 1
    return 2 * num_layers * block_size * num_kv_heads * head_dim * itemsize


class PagedKVCache:
    """The blocks of every layer's keys and values (module docstring). `kernel`: builds this
    cache's `AttentionKernel` from it (a backend's, `Runtime.attention`), or returns None.
    `max_seq_len`: the longest sequence it holds (what a kernel may size its launches by), or
    None where unknown. `window`: the model's sliding window (`ModelArgs.attention_window`) and
    `window_layers` the layers that slide it (None: every layer), which every step's
    `AttentionMetadata` is built with. `softcap`: Gemma 2's score cap (`model_zoo.attention`); a
    capped cache keeps only a kernel that caps (`AttentionKernel`)."""

    def __init__(self, *, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device | str = "cpu",
                 kv_dtype: KVCacheDtype = KVCacheDtype.AUTO,
                 k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                 kernel: Callable[["PagedKVCache"], AttentionKernel | None] | None = None,
                 max_seq_len: int | None = None, window: int | None = None,
                 window_layers: tuple[int, ...] | None = None, softcap: float = 0.0):
        self.block_size, self.num_blocks, self.window = block_size, num_blocks, window
        self.window_layers = None if window_layers is None or set(window_layers) >= set(range(num_layers)) \
            else frozenset(window_layers)
        self.max_seq_len, self.softcap = max_seq_len, softcap
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
        self.k = _zeros(shape, storage, device)
        self.v = _zeros(shape, storage, device)
        self.allocator = BlockAllocator(num_blocks)
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.kernel = None if kernel is None else kernel(self)
        if softcap and not getattr(self.kernel, "caps", False):
            self.kernel = None

    @classmethod
    def of(cls, args, **kw) -> "PagedKVCache":
        """The cache of a model of `ModelArgs` args: its layers, KV heads and head size, its sliding
        window in its window layers and its score cap; `kw`: the other arguments."""
        return cls(num_layers=args.num_layers, num_kv_heads=args.num_kv_heads, head_dim=args.head_dim,
                   window=args.attention_window, window_layers=args.window_layers, softcap=args.attn_softcap, **kw)

    def metadata(self, q_lens: list[int], seq_lens: list[int], block_tables: list[list[int]], device,
                 trees: list[list[int] | None] | None = None) -> "AttentionMetadata":
        """`AttentionMetadata.build` of a step over this cache (its blocks, kernel and window)."""
        return AttentionMetadata.build(q_lens, seq_lens, block_tables, self.block_size, device, self.kernel, trees,
                                       self.window, self.window_layers)

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

    def move(self, src: list[int], dst: list[int]) -> None:
        """Copy the keys and values of slots `src` to slots `dst` in every layer (a token tree's
        accepted rows moved to the positions that follow the context)."""
        if not src:
            return
        s = torch.tensor(src, dtype=torch.int64, device=self.k.device)
        d = torch.tensor(dst, dtype=torch.int64, device=self.k.device)
        for t in (self.k, self.v):
            f = t.view(t.shape[0], -1, *t.shape[-2:])  # [layers, slots, KV, hd]
            if f.dtype == torch.float8_e4m3fn:  # CPU indexing has no fp8 kernel: copy the bytes
                f = f.view(torch.uint8)
            f[:, d] = f[:, s]

    def sequence_kv(self, layer: int, table: torch.Tensor, span: tuple[int, int] | None, length: int,
                    start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """One sequence's cached k, v of positions `start` (a multiple of the block size) to
        `length`: [length - start, KV, hd] in the compute dtype.

        span = (first block, number of blocks) when the sequence's blocks from `start` on are
        consecutive: then the unquantized cache is read as a view, with no copy; else its blocks
        are gathered."""
        if span is None:
            k, v = self.gather(layer, table[None, start // self.block_size:-(-length // self.block_size)])  # dequantized
            return k[0, :length - start], v[0, :length - start]
        first, nb = span
        k = self.k[layer, first:first + nb].view(-1, *self.k.shape[-2:])[:length - start]
        v = self.v[layer, first:first + nb].view(-1, *self.v.shape[-2:])[:length - start]
        ks = None if self.k_scale is None else self.k_scale[layer]
        vs = None if self.v_scale is None else self.v_scale[layer]
        return self._load(k, ks), self._load(v, vs)


@dataclass
class AttentionMetadata:
    """One step's batch layout, built once and shared by every layer.

    Two ways to attend over the cache, chosen here once per step:
    - per sequence (B ≤ `PER_SEQUENCE_MAX_BATCH`, or any B whose window leaves keys out: each row
      then gets the keys and arithmetic it gets alone, which bf16 needs): each sequence's keys
      are read as a view of the cache when its blocks are consecutive (`spans`), and SDPA runs on
      exactly its `seq_len` keys (a causal mask `masks[b]` only when it brings several rows);
    - batched (larger B, e.g. 128 short sequences): the blocks of every sequence are gathered into
      [B, L] and one SDPA call runs under the additive mask `bias` (padded keys masked).
    """

    q_lens: list[int]  # new tokens per sequence
    seq_lens: list[int]  # context length per sequence, including the new tokens
    slot_mapping: torch.Tensor  # [T] int64, where each new token's K/V goes
    block_tables: torch.Tensor  # [B, nb] int64, each sequence's blocks (padded with block 0)
    bias: torch.Tensor | None  # batched path: [B, 1, Qmax, L] additive mask (0 / -inf); else None
    q_index: torch.Tensor | None  # batched path: [T] flat index into [B*Qmax] for padding queries
    spans: list[tuple[int, int] | None] | None = None  # per-sequence path: (first block, #blocks)
    masks: list[torch.Tensor | None] | None = None  # per-sequence path: [q_len, seq_len] bool or None
    kernel: bool = False  # the whole step goes through the cache's attention kernel
    kernel_args: object = None  # what that kernel derived from this step once, for every layer
    # token trees (`spec/tree.py`): per sequence None (causal rows) or its drafts' parent rows
    trees: list[list[int] | None] | None = None
    block_size: int = 0  # of `block_tables` when it is not the cache's (tree steps: 1, slot ids)
    # the sliding window where it leaves out keys of some row of this step (else None); per-sequence
    # path: the first key each sequence's rows attend (`lows`; its masks are over all its keys) and
    # the first position its keys are read from (`starts`: the block of its low, so that blocks the
    # window has passed, given back by the scheduler, are never read; `spans` count from there)
    window: int | None = None
    lows: list[int] | None = None
    starts: list[int] | None = None
    window_layers: frozenset[int] | None = None  # where only these layers slide (Gemma 3), the
    whole: "AttentionMetadata | None" = None  # layout of the others

    @property
    def fresh_prefill(self) -> bool:
        """Only fresh prompts: each attends causally to its own new tokens, nothing cached yet."""
        return all(ql == sl for ql, sl in zip(self.q_lens, self.seq_lens))

    @classmethod
    def build(cls, q_lens: list[int], seq_lens: list[int], block_tables: list[list[int]],
              block_size: int, device, kernel: AttentionKernel | None = None,
              trees: list[list[int] | None] | None = None, window: int | None = None,
              window_layers: frozenset[int] | None = None) -> "AttentionMetadata":
        """The layout of a step; `kernel`: the cache's attention kernel (`PagedKVCache.kernel`),
        which takes the step when it serves it (then SDPA's layout is not built). `trees`: per
        sequence None or the parent rows of its drafts (its new rows are a token tree: each
        attends to the context and its path from the root, not to every earlier row).
        `window`, `window_layers`: the cache's sliding window and the layers that slide it
        (`PagedKVCache.window_layers`; on the torch path the others read the step's `whole` layout)."""
        window = window if window is not None and max(seq_lens) > window else None  # it leaves keys out
        tree = trees is not None and any(t is not None for t in trees)
        if window is not None and getattr(kernel, "slides", False) and not tree and kernel.serves(q_lens, seq_lens):
            window = None  # the kernel takes the whole step, each layer with its own window
        if window is not None and window_layers is not None:
            meta = cls.build(q_lens, seq_lens, block_tables, block_size, device, trees=trees, window=window)
            meta.window_layers = window_layers
            meta.whole = cls.build(q_lens, seq_lens, block_tables, block_size, device, kernel, trees)
            return meta
        if window is not None:
            kernel = None
        if tree:
            meta = cls._tree_build(q_lens, seq_lens, block_tables, block_size, device, kernel, trees)
            if meta is not None:
                return meta
        B = len(q_lens)
        slots: list[int] = []
        for ql, sl, table in zip(q_lens, seq_lens, block_tables):
            for pos in range(sl - ql, sl):
                slots.append(table[pos // block_size] * block_size + pos % block_size)
        slot_mapping = torch.tensor(slots, dtype=torch.int64, device=device)
        max_blocks = max(-(-sl // block_size) for sl in seq_lens)
        tables = torch.full((B, max_blocks), PAD_BLOCK, dtype=torch.int64)
        for b, table in enumerate(block_tables):
            n = min(len(table), max_blocks)
            tables[b, :n] = torch.tensor(table[:n], dtype=torch.int64)
        meta = cls(q_lens, seq_lens, slot_mapping, tables.to(device), None, None, trees=trees, window=window)
        meta.kernel = kernel is not None and kernel.serves(q_lens, seq_lens) and not meta.tree_step
        if meta.kernel:
            return meta
        if meta.fresh_prefill:  # causal SDPA, or masks where the window leaves keys out
            if window is not None:
                meta.masks = [sequence_mask(sl, sl, None, window).to(device) if sl > window else None
                              for sl in seq_lens]
            return meta
        if B <= PER_SEQUENCE_MAX_BATCH or window is not None:
            meta._per_sequence(block_tables, block_size, device)
        else:
            meta._batched(max_blocks * block_size, device)
        return meta

    @property
    def tree_step(self) -> bool:
        return self.trees is not None and any(t is not None for t in self.trees)

    @classmethod
    def _tree_build(cls, q_lens, seq_lens, block_tables, block_size, device, kernel, trees
                    ) -> "AttentionMetadata | None":
        """A tree step for the cache's kernel: every row becomes a sequence of one query whose
        "block table" lists the slots of its keys in order (block size 1): the context, then its
        path from the root. The kernel attends each row exactly as a decode step at that
        position would (same keys, same order). None: the kernel does not take it (then SDPA
        runs under tree masks)."""
        if kernel is None:
            return None
        slots, keys = [], []
        for ql, sl, table, tree in zip(q_lens, seq_lens, block_tables, trees):
            pos = torch.arange(sl)
            s = torch.tensor(table, dtype=torch.int64)[pos // block_size] * block_size + pos % block_size  # [sl]
            ctx = sl - ql
            slots.append(s[ctx:])
            mask = ancestor_rows(tree, ql)  # [ql, ql]
            keys.extend(torch.cat([s[:ctx], s[ctx:][mask[i]]]) for i in range(ql))
        v_q, v_seq = [1] * len(keys), [len(k) for k in keys]
        if not kernel.serves(v_q, v_seq):
            return None
        table = torch.zeros(len(keys), max(v_seq), dtype=torch.int64)
        for i, k in enumerate(keys):
            table[i, :len(k)] = k
        meta = cls(v_q, v_seq, torch.cat(slots).to(device), table.to(device), None, None, block_size=1)
        meta.kernel = True
        return meta

    def _per_sequence(self, block_tables: list[list[int]], block_size: int, device) -> None:
        self.spans, self.masks, self.lows, self.starts = [], [], [], []
        w = self.window
        for b, (ql, sl, table) in enumerate(zip(self.q_lens, self.seq_lens, block_tables)):
            lo = 0 if w is None else max(0, sl - ql + 1 - w)  # the first row's first key
            first, nb = lo // block_size, -(-sl // block_size)
            run = table[nb - 1] - table[first] == nb - 1 - first and all(
                table[j + 1] == table[j] + 1 for j in range(first, nb - 1))
            self.spans.append((table[first], nb - first) if run else None)
            self.lows.append(lo)
            self.starts.append(first * block_size)
            mask = sequence_mask(ql, sl, None if self.trees is None else self.trees[b], w)
            self.masks.append(None if mask is None else mask.to(device))

    def _batched(self, L: int, device) -> None:
        mask, valid_q = batched_mask(self.q_lens, self.seq_lens, self.trees, L)
        bias = torch.zeros(mask.shape, dtype=torch.float32).masked_fill_(~mask, float("-inf"))
        self.bias = bias.unsqueeze(1).to(device)  # [B, 1, Qmax, L]
        if any(ql != max(self.q_lens) for ql in self.q_lens):
            self.q_index = valid_q.view(-1).nonzero().squeeze(1).to(device)


PER_SEQUENCE_MAX_BATCH = 16  # up to this many sequences a step attends per sequence (no gathers)
_EXACT_VERIFY_MAX = 32  # half precision: up to this many new queries attend one by one (see below)


class PagedAttention:
    """The attention backend of the engine: write this step's K/V, attend over the cache."""

    def __init__(self, cache: PagedKVCache, meta: AttentionMetadata):
        self.cache, self.meta = cache, meta

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [T, H, hd]; k, v: [T, KV, hd] → [T, H, hd]."""
        meta, cache = self.meta, self.cache
        if meta.whole is not None and layer_idx not in meta.window_layers:  # a layer that does not slide
            meta = meta.whole
        if meta.kernel:  # the cache's kernel writes k / v and attends for the whole batch
            return cache.kernel(layer_idx, q, k, v, meta)
        cache.write(layer_idx, k, v, meta.slot_mapping)
        gqa, cap = q.shape[1] != k.shape[1], cache.softcap
        if meta.bias is None:  # per sequence: fresh prompts, or decode / verify of a few sequences
            out = torch.empty_like(q)
            start = 0
            for b, (n, sl) in enumerate(zip(meta.q_lens, meta.seq_lens)):
                qb = q[start:start + n]
                fresh = n == sl  # a whole prompt: causal over its own tokens, however it is batched
                if fresh and cache.kv_dtype is KVCacheDtype.AUTO:
                    kb, vb = k[start:start + n], v[start:start + n]
                else:  # the cache (for a fresh quantized cache: its rounded values), from position `o` on
                    span, o = (None, 0) if meta.spans is None else (meta.spans[b], meta.starts[b])
                    kb, vb = cache.sequence_kv(layer_idx, meta.block_tables[b], span, sl, o)
                mask = None if meta.masks is None else meta.masks[b]
                lo = 0 if meta.lows is None else meta.lows[b]
                if fresh and (mask is not None or cap):  # a prompt longer than the window; capped scores
                    mask = sequence_mask(n, n, None, None) if mask is None else mask  # (None for one row)
                    out[start:start + n] = folded_gqa_attention(qb, kb, vb, mask, cap)
                elif fresh:
                    o = F.scaled_dot_product_attention(
                        qb.transpose(0, 1)[None], kb.transpose(0, 1)[None], vb.transpose(0, 1)[None],
                        is_causal=True, enable_gqa=gqa)  # (1, H, n, hd)
                    out[start:start + n] = o[0].transpose(0, 1)
                elif 1 < n <= _EXACT_VERIFY_MAX and q.dtype in (torch.float16, torch.bfloat16):
                    # a few new queries (verification) in half precision: each attends over
                    # exactly its own keys, the very call a decode step makes at that position.
                    # One masked call would round differently (bf16 outputs differ by an ulp),
                    # enough to flip greedy picks: speculation would no longer be lossless.
                    first, w = sl - n, meta.window or sl
                    tree = meta.trees is not None and meta.trees[b] is not None
                    for i in range(n):
                        keys = mask[i, o:] if tree else slice(max(0, first + i + 1 - w) - o, first + i + 1 - o)
                        out[start + i] = folded_gqa_attention(qb[i:i + 1], kb[keys], vb[keys], None, cap)[0]
                else:  # a window's rows: from their first key on (a decode row: no mask at all)
                    out[start:start + n] = folded_gqa_attention(qb, kb[lo - o:], vb[lo - o:],
                                                                None if mask is None else mask[:, lo:], cap)
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
        if cap:
            out = grouped_attention(qp, kc, vc, meta.bias, cap)  # (B, Qmax, H, hd)
            return out.reshape(-1, H, hd)[slice(None) if meta.q_index is None else meta.q_index]
        o = F.scaled_dot_product_attention(qp.transpose(1, 2), kc.transpose(1, 2), vc.transpose(1, 2),
                                           attn_mask=meta.bias.to(q.dtype), enable_gqa=gqa)  # (B, H, Qmax, hd)
        return o.transpose(1, 2).reshape(-1, H, hd)[slice(None) if meta.q_index is None else meta.q_index]
