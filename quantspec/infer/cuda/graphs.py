"""CUDA graphs of the decoder stack for decode and verification steps: the CUDA backend's
`StackRunner`.

A decode step of an 8B-shaped model launches a few hundred small kernels; launched one by one
from Python the GPU waits on the host between them. `DecodeGraphs` captures the whole stack
(every layer: norms, projections, rotary, the Triton paged attention's write and attend) once per
step shape and replays it, so a step costs one launch.

What it takes: a step in which each of B ≤ `max_batch` sequences brings q_b ≤ 16 new tokens
after a cached context, at most 512 rows once padded — a decode step (every q_b = 1), or the
verification of q_b - 1 drafts per sequence, the same number for every sequence or not (the
n-gram proposer and the load-aware back-off give each sequence its own) — through the cache's
Triton attention (`TritonAttention`). Every other step (prefill, token trees, SDPA attention)
returns None and runs eagerly, and so does every step asked to `capture` residual streams
(EAGLE-3's aux features: the modules keep them) or run while a forward hook sits on a module of
the stack (a hook runs in Python, which a replay skips).

With `fused` (`DispatchPolicy.cuda_fused_ops`, where `layers.fusable`), the stack runs
`layers.fused_stack` instead of the modules, in the graphs and, eagerly, in every step they do
not take (prefill, token trees, steps of more than 512 rows), so that a verification row is
computed by the decode step's kernels; steps that capture residual streams or meet a forward
hook still run the modules. `graphs=False` keeps only that eager fused path. With `pdl`
(`DispatchPolicy.cuda_pdl`) the stack's Triton kernels, captured or eager, are programmatic
dependent launches (`kernels._common.programmatic_launches`).

B sequences run in the graph of (the smallest bucket Bp ≥ B, q = the largest q_b); each
sequence's rows sit at the start of its q rows. The padding rows write no key (slot -1, which the
write kernel skips) and are dropped: a padding sequence attends over stale keys, and a sequence
with fewer than q rows is given q rows ending q - q_b positions later (its context length grows by
as much in the graph), so its own rows keep their positions and, the attention being causal, never
see the padding rows after them. The graph reads its inputs from static buffers that each step
fills: x, cos, sin [Bp·q, ·], the slot mapping [Bp·q], the context lengths [Bp] and block tables
[Bp, cache.num_blocks]. Graphs belong to one cache: a step over another cache (a new engine) drops
them and captures again. Each graph keeps its step's activations in a memory pool of its own (at
most 512 rows' worth); at most `max_graphs` are kept, the least recently replayed dropped first.
A step shape met for the first time pays for its capture (a few eager steps' time); a benchmark
warms up on the shapes it times (`captures` counts them).

Numbers: the graph runs the kernels of the eager path at M = Bp·q rows instead of Σ q_b.
quantspec's weight-only Triton linears take one launch shape for every M up to 16, so there a row
equals the eager one; cuBLAS (float layers) may pick another kernel for the padded M, which rounds
differently in the last bit.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict

import torch
from torch import nn

from quantspec.infer.cuda.attention import TritonAttention
from quantspec.infer.cuda.layers import fused_stack
from quantspec.infer.kv_cache import AttentionMetadata, PagedAttention
from quantspec.kernels._common import programmatic_launches

__all__ = ["DecodeGraphs", "batch_buckets"]

_GLOBAL_HOOKS = ("_global_forward_hooks", "_global_forward_pre_hooks")
MAX_QUERY_ROWS = 16  # new tokens per sequence a graph takes: a decode step, or 1 + up to 15 drafts
MAX_GRAPH_ROWS = 512  # rows of a captured step; above, launches are few beside the work (eager)
# graphs kept per model (each holds its step's activations); the least recent goes. Batch buckets
# times the verification lengths the back-off uses (1 + 0..k drafts) must fit, or steps recapture
MAX_GRAPHS = 64


def batch_buckets(max_batch: int) -> list[int]:
    """The padded batch sizes graphs are captured for: 1, 2, 4, 8, then multiples of 8 (vLLM's
    choice: little padding, few graphs), up to `max_batch`."""
    sizes = {b for b in (1, 2, 4, *range(8, max_batch + 1, 8)) if b <= max_batch}
    return sorted(sizes | {max_batch})


class _Graph:
    """One captured stack for bp sequences of q new tokens each: its static inputs and output."""

    def __init__(self, bp: int, q: int, d: int, hd: int, width: int, dtype: torch.dtype,
                 rope_dtype: torch.dtype, device: torch.device):
        self.bp, self.q = bp, q
        rows = bp * q
        self.x = torch.zeros(rows, d, dtype=dtype, device=device)
        self.cos = torch.zeros(rows, hd, dtype=rope_dtype, device=device)
        self.sin = torch.zeros(rows, hd, dtype=rope_dtype, device=device)
        self.slots = torch.full((rows,), -1, dtype=torch.int64, device=device)
        self.seq = torch.full((bp,), q, dtype=torch.int32, device=device)
        self.tables = torch.zeros(bp, width, dtype=torch.int32, device=device)
        self.cu = torch.arange(bp + 1, dtype=torch.int32, device=device) * q
        self.graph = None  # the captured graph (`DecodeGraphs._record`)
        self.out: torch.Tensor | None = None

    def meta(self) -> AttentionMetadata:
        """The step's metadata over the static buffers (what the captured kernels read)."""
        meta = AttentionMetadata([self.q] * self.bp, [self.q] * self.bp, self.slots, self.tables, None, None)
        meta.kernel = True
        meta.kernel_args = (self.cu, self.seq, self.tables, self.q)
        return meta

    def fill(self, x, cos, sin, slots, seq, tables, rows: torch.Tensor | None = None) -> None:
        """This step's B sequences into the static buffers: their rows (x, cos, sin, slots) at
        `rows` of the padded layout (None: the first ones, every sequence bringing q rows), their
        context lengths `seq` as the graph counts them; the padding rows write no key."""
        B = seq.shape[0]
        if rows is None:
            n = x.shape[0]
            self.x[:n].copy_(x)
            self.cos[:n].copy_(cos)
            self.sin[:n].copy_(sin)
            self.slots[:n].copy_(slots)
            self.slots[n:].fill_(-1)
        else:
            self.x.index_copy_(0, rows, x)
            self.cos.index_copy_(0, rows, cos)
            self.sin.index_copy_(0, rows, sin)
            self.slots.fill_(-1)
            self.slots.index_copy_(0, rows, slots)
        self.seq[:B].copy_(seq)
        self.seq[B:].fill_(self.q)
        self.tables[:B, :tables.shape[1]].copy_(tables)


class DecodeGraphs:
    """The `StackRunner` of a CUDA model (module docstring). `layers`: the model's decoder layers;
    `max_batch`: the largest batch captured (larger decode steps run eagerly)."""

    def __init__(self, layers: nn.ModuleList, max_batch: int = 256, max_graphs: int = MAX_GRAPHS, *,
                 graphs: bool = True, fused: bool = False, pdl: bool = False):
        self.layers = layers
        self.use_graphs, self.fused, self.pdl = graphs, fused, pdl
        self._hook_dicts = [d for m in layers.modules() for d in (m._forward_hooks, m._forward_pre_hooks)]
        self.max_batch, self.max_graphs = max_batch, max_graphs
        self.buckets = batch_buckets(max_batch)
        self.graphs: OrderedDict[tuple[int, int, bool], _Graph] = OrderedDict()  # least recent first
        self._cache_ref = None
        self.replays = 0  # steps served by a graph (tests, benchmarks)
        self.captures = 0  # graphs captured (a step shape met for the first time, or again once dropped)

    def _modules_only(self, capture: tuple[int, ...]) -> bool:
        """Whether the step must run the modules: it captures residual streams, or a forward
        hook sits on the stack (a replay or a fused layer skips Python hooks)."""
        return bool(capture) or any(self._hook_dicts) or any(getattr(nn.modules.module, n) for n in _GLOBAL_HOOKS)

    def _graphable(self, x: torch.Tensor) -> bool:
        """Whether x's device replays graphs (CUDA)."""
        return x.device.type == "cuda" and not torch.cuda.is_current_stream_capturing()

    def _step_shape(self, x: torch.Tensor, attn) -> tuple[list[int], int] | None:
        """(q_b per sequence, q = the largest) of a step a graph can take, else None."""
        if not self.use_graphs or not isinstance(attn, PagedAttention) or not self._graphable(x):
            return None
        meta, cache = attn.meta, attn.cache
        q_lens = meta.q_lens
        if not (meta.kernel and isinstance(cache.kernel, TritonAttention) and not meta.tree_step
                and meta.block_size == 0 and len(q_lens) <= self.max_batch and max(q_lens) <= MAX_QUERY_ROWS
                and all(s > n for s, n in zip(meta.seq_lens, q_lens))):
            return None
        q = max(q_lens)
        # a short sequence's padding rows lie past its own: they must stay within the block tables
        reach = cache.num_blocks * cache.block_size
        if any(s - n + q > reach for s, n in zip(meta.seq_lens, q_lens)):
            return None
        return q_lens, q

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn,
                 out_rows: torch.Tensor | None, row_invariant: bool, capture: tuple[int, ...] = ()
                 ) -> torch.Tensor | None:
        """A step replayed by a graph, or with `fused` run eagerly through the fused layers, or
        None where the modules run (module docstring)."""
        if self._modules_only(capture):
            return None
        shape = self._step_shape(x, attn)
        bp = None if shape is None else next(b for b in self.buckets if b >= len(shape[0]))
        if shape is None or bp * shape[1] > MAX_GRAPH_ROWS:
            if not self.fused:
                return None
            out = self._stack(x, cos, sin, attn, row_invariant)
            return out if out_rows is None else out[out_rows]
        (q_lens, q), cache = shape, attn.cache
        if self._cache_ref is None or self._cache_ref() is not cache:
            self.graphs.clear()  # graphs of another cache's buffers
            self._cache_ref = weakref.ref(cache)
        key = (bp, q, row_invariant)
        g = self.graphs.get(key)
        if g is None:
            while len(self.graphs) >= self.max_graphs:
                self.graphs.popitem(last=False)
            g = self._capture(bp, q, x, cos, cache, row_invariant)
        self.graphs.move_to_end(key)
        _, seq, tables, _ = cache.kernel._step_args(attn.meta)
        rows = None  # every sequence brings q rows: the graph's first rows, in order
        if any(n != q for n in q_lens):
            # each sequence's rows at the start of its q rows; its context as long as q rows make it
            rows = torch.tensor([b * q + i for b, n in enumerate(q_lens) for i in range(n)], device=x.device)
            seq = torch.tensor([s - n + q for s, n in zip(attn.meta.seq_lens, q_lens)], dtype=torch.int32,
                               device=x.device)
        g.fill(x, cos, sin, attn.meta.slot_mapping, seq, tables, rows)
        g.graph.replay()
        self.replays += 1
        if rows is not None:
            return g.out[rows if out_rows is None else rows[out_rows]]
        out = g.out[:x.shape[0]]
        return out.clone() if out_rows is None else out[out_rows]

    def _stack(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn, row_invariant: bool) -> torch.Tensor:
        with programmatic_launches(self.pdl):
            if self.fused:
                return fused_stack(self.layers, x, cos, sin, attn, row_invariant)
            for layer in self.layers:
                x = layer(x, cos, sin, attn, row_invariant)
            return x

    def _run(self, g: _Graph, cache, row_invariant: bool) -> torch.Tensor:
        return self._stack(g.x, g.cos, g.sin, PagedAttention(cache, g.meta()), row_invariant)

    def _capture(self, bp: int, q: int, x: torch.Tensor, cos: torch.Tensor, cache, row_invariant: bool) -> _Graph:
        g = _Graph(bp, q, x.shape[1], cos.shape[1], cache.num_blocks, x.dtype, cos.dtype, x.device)
        self._record(g, lambda: self._run(g, cache, row_invariant))
        self.graphs[(bp, q, row_invariant)] = g
        self.captures += 1
        return g

    def _record(self, g: _Graph, run) -> None:
        """Capture `run` (the stack over g's static buffers) into g.graph, its output g.out."""
        device = g.x.device
        stream = torch.cuda.Stream(device=device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):  # compiles the kernels and sizes the allocator outside capture
            for _ in range(2):
                run()
        torch.cuda.current_stream(device).wait_stream(stream)
        # each graph keeps a memory pool of its own (a step's activations: small); a pool shared
        # across graphs that are dropped and captured again trips torch's allocator
        g.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g.graph):
            g.out = run()
