"""Exact greedy ids from a CPU head without every logit (`GreedyHead`), through the screens of
`kernels.cpu.greedy`: the picks are the argmax of the logits `compute_logits` would give, with
its tie-breaking (the lowest index), from a half or a quarter of the head's bytes.

Which screen serves a call, by the head and the number of rows R:
- an fp32 head (`PackedLinear`): the int8 screen (AVX512-VNNI and AVX512-BF16) for R ≤
  `MAX_ROWS_I8_FP32`; above it the bf16 pair screen (AVX512-BF16) up to `MAX_ROWS_PAIRS` (both
  are bound by their dot-product instructions there, and the pair screen's approximations need
  no conversion); without AVX512-BF16 the row-major bf16 screen up to `max_rows` = 3 (it reads
  the copy once per 4 rows of x: beyond 3 rows the packed fp32 head is faster);
- a quantized artifact's bf16 head (`PackedPairsLinear`): the int8 screen for R ≤ `MAX_ROWS_I8`.
Beyond those rows, or for a row with a non-finite value, the caller computes the logits. The
engine takes the picks for every step whose sequences are all greedy (sampling needs the logits).
Memory: an fp32 head keeps both copies, +N · K · 3 bytes; a bf16 head +N · K bytes.
`bench/decode.py` and `bench/spec_cost.py` measure the speed with and without it.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from quantspec.infer.cpu.linears import PackedLinear, PackedPairsLinear
from quantspec.kernels import cpu as cg

__all__ = ["GreedyHead"]


class GreedyHead:
    """Exact greedy ids of `model.compute_logits(hidden)` (module docstring); a
    `infer.backend.Runtime.greedy` picker. `prefetch`: the pair screen's L2 prefetch of its next
    block (the same ids either way)."""

    max_rows = 3  # the row-major screen's rows (module docstring)
    MAX_ROWS_PAIRS = 11  # the pair-dot screen
    MAX_ROWS_I8 = 11  # the int8 screen of a bf16 head
    MAX_ROWS_I8_FP32 = 8  # ... of an fp32 head (beyond: the pair screen)

    def __init__(self, model: nn.Module, *, prefetch: bool = True):
        head = model.lm_head
        self.bf16 = type(head) is PackedPairsLinear  # a quantized artifact's bf16 head: bf16 logits
        # [N, K] bitwise the packed weights: a bf16 head only feeds the int8 screen's tables,
        # which read it in chunks of rows, so it is never unpacked whole (+N · K · 2 bytes)
        w = cg.PairRows(head.packed, head.out_features) if self.bf16 else head.dense_weight()
        self.model, self.head, self.packed, self.prefetch = model, head, head.packed, prefetch
        # an in-place change of the head makes the copies stale (inference tensors keep no version)
        self.version = None if head.packed.is_inference() else head.packed._version
        self.num_outputs = head.out_features
        self.i8 = None
        if cg.has_int8_screen() and w.shape[1] % 2 == 0 and w.shape[1] < 2 ** 17:  # its bound's K
            self.i8 = cg.int8_screen_tables(w)
        self.i8_rows = self.MAX_ROWS_I8 if self.bf16 else self.MAX_ROWS_I8_FP32
        self.pairs = False
        if self.bf16:  # beyond the int8 screen's rows: the logits (packed_pairs_gemm)
            self.max_rows = self.MAX_ROWS_I8
            return
        self.row_norm = cg.row_norms_up(w)
        self.pairs = bool(cg.cpu_kernels().has_bf16_dot()) and w.shape[1] % 2 == 0
        if self.pairs:
            self.w_bf16 = cg.pack_pairs(w)
            self.rel = cg.screen_bound(w.shape[1], bf16_x=True)
            self.max_rows = self.MAX_ROWS_PAIRS
        else:
            self.w_bf16 = w.to(torch.bfloat16).contiguous()
            self.rel = cg.screen_bound(w.shape[1])

    @classmethod
    def build(cls, model: nn.Module, *, prefetch: bool = True) -> "GreedyHead | None":
        """The picker of a CPU-prepared model's head, or None where no screen takes it."""
        kernels = cg.cpu_kernels()
        head = getattr(model, "lm_head", None)
        if kernels is None or not hasattr(kernels, "screened_argmax") or head is None or head.bias is not None:
            return None
        if type(head) is PackedLinear and head.in_features % 16 == 0:  # the bf16 screen's rows: 16-wide
            return cls(model, prefetch=prefetch)
        if type(head) is PackedPairsLinear and cg.has_int8_screen() and head.in_features < 2 ** 17:
            return cls(model, prefetch=prefetch)
        return None

    def with_prefetch(self, on: bool) -> "GreedyHead":
        """The same picker (the same copies of the head) with the pair screen's prefetch `on`."""
        other = copy.copy(self)
        other.prefetch = on
        return other

    def __call__(self, hidden: torch.Tensor) -> list[int] | None:
        """hidden [R, D] pre-norm rows → their greedy ids, or None (compute the logits instead)."""
        if hidden.shape[0] > self.max_rows:
            return None
        if (self.model.lm_head is not self.head or self.head.packed is not self.packed
                or (self.version is not None and self.packed._version != self.version)):
            return None  # the head was swapped, repacked or changed in place after loading
        x = self.model.model.norm(hidden)  # compute_logits' normed rows
        if (x.dtype != (torch.bfloat16 if self.bf16 else torch.float32) or x.dim() != 2 or x.device.type != "cpu"
                or x.shape[0] == 0):
            return None
        x = x.contiguous()
        if self.i8 is not None and x.shape[0] <= self.i8_rows:
            q, scale, u, t, rel, abs_err = self.i8
            ids = cg.screened_argmax_i8(x, q, scale, u, t, self.packed, self.num_outputs, rel, abs_err)
        elif self.bf16:
            return None
        elif self.pairs:
            ids = cg.screened_argmax_pairs(x, self.w_bf16, self.packed, self.row_norm, self.num_outputs, self.rel,
                                           cg.PAIR_ABS_ERR, prefetch=self.prefetch)
        else:
            ids = cg.screened_argmax(x, self.w_bf16, self.packed, self.row_norm, self.num_outputs, self.rel)
        ids = ids.tolist()
        return None if min(ids) < 0 else ids
