"""Greedy picks from an fp32 head without every fp32 logit: exact, from half the bytes.

A greedy step needs only argmax_n(x · w_n) per row, and an fp32 decode step of the default model
spends ~4 ms of ~19 streaming its 113 MB head. `GreedyHead` keeps a bf16 copy of the head
(half the bytes) and the rows' norms; the extension approximates every logit from the copy and
computes exactly — by the very FMA chain `packed_gemm` runs for that output — only those whose
approximation is within the proven error bound of the best (on the default model's hidden
states: a median of 1 such logit per row, at most 10; the bound ~0.6, the largest actual error
~0.11):

    |exact_n − approx_n| ≤ rel · ‖x‖₂ · ‖w_n‖₂ (+ 2^-100),
    rel = (2^-8 + 2.02 K · 2^-24) · 1.001            x in fp32 (`screened_argmax`)
    rel = (2^-7 + 2^-16 + 2.02 K · 2^-24) · 1.001    x rounded to bf16 too (`screened_argmax_pairs`)

(bf16 rounds each weight, and on the pair path each input, by at most 2^-8 relatively; each fp32
dot product of K terms errs by at most ~K · 2^-24 of Σ|x_k w_nk| ≤ ‖x‖₂ ‖w_n‖₂; AVX512-BF16
flushes subnormals, < 2^-126 a term; row norms are rounded up). So the pick is the argmax of the
logits `compute_logits` would give, with its tie-breaking (the lowest index). Where the CPU has
AVX512-BF16 the copy is packed in k-pairs for its dot product (twice the FMA rate), which serves
verification steps of up to 11 rows; else a row-major copy against fp32 x serves up to 3 rows
(beyond that the packed fp32 head is faster). The engine takes it for every step whose
sequences are all greedy (sampling needs the logits) and whose rows it serves; a row with a
non-finite value falls back to the logits. Default model, 2 threads, pair path: the head of 1
row 4.1 → 2.0 ms, 4 rows 3.9 → 2.2, 11 rows 4.0 → 3.0.

Built at load for a float model whose head is a `PackedLinear` without bias (fp32 on quantspec's
CPU kernels); quantized artifacts keep a bf16 head and need none of this. Memory: +N · K bf16
(56.6 MB for SmolLM2's 49152 × 576).
"""

from __future__ import annotations

import torch
from torch import nn

from quantspec.kernels.cpu import pack_pairs  # noqa: F401  (re-exported: the screen's layout)

__all__ = ["GreedyHead", "PAIR_ABS_ERR", "pack_pairs", "row_norms_up", "screen_bound", "use_greedy_head"]


def screen_bound(k: int, *, bf16_x: bool = False) -> float:
    """rel of the module docstring for a head of K inputs (`bf16_x`: the pair-dot path, which
    rounds x to bf16 too: 2^-7 + 2^-16 for the products instead of 2^-8)."""
    products = 2.0 ** -7 + 2.0 ** -16 if bf16_x else 2.0 ** -8
    return (products + 2.02 * k * 2.0 ** -24) * 1.001


# the pair-dot path's absolute slack: AVX512-BF16 flushes subnormal inputs, products and sums to
# zero, at most 2^-126 per term of a K ≤ 2^20 dot product
PAIR_ABS_ERR = 2.0 ** -100


def row_norms_up(w: torch.Tensor) -> torch.Tensor:
    """‖w_n‖₂ of each row of w [N, K] as fp32, rounded up (the bound's ‖w_n‖₂ must not shrink)."""
    norms = w.double().norm(dim=1)
    up = norms.float()
    return torch.where(up.double() < norms, torch.nextafter(up, torch.tensor(float("inf"))), up)


class GreedyHead:
    """Exact greedy ids of `model.compute_logits(hidden)` (module docstring)."""

    # rows per call the row-major screen takes: it reads the copy once per 4 rows of x, so beyond
    # 3 rows the packed fp32 head is faster (default model, 2 threads, real hidden states: 1 row
    # 2.4 vs 4.5 ms, 3 rows 3.1 vs 3.8, 4 rows 4.4 vs 4.1, 11 rows 7.9 vs 4.9)
    max_rows = 3
    MAX_ROWS_PAIRS = 11  # the pair-dot screen: 11 rows 3.0 vs 4.0 ms (module docstring)

    def __init__(self, model: nn.Module, kernels):
        head = model.lm_head
        w = head.dense_weight()  # [N, K] fp32, unpacked: bitwise the packed weights
        self.kernels, self.model, self.head, self.packed = kernels, model, head, head.packed
        # an in-place change of the head makes the copy stale (inference tensors keep no version)
        self.version = None if head.packed.is_inference() else head.packed._version
        self.num_outputs = head.out_features
        self.row_norm = row_norms_up(w)
        # AVX512-BF16 here: the pair-dot screen (x rounded too, twice the FMA rate: up to 11 rows);
        # else the row-major bf16 copy against fp32 x (up to 3 rows)
        self.pairs = kernels.has_bf16_dot() and w.shape[1] % 2 == 0
        if self.pairs:
            self.w_bf16 = pack_pairs(w)
            self.rel = screen_bound(w.shape[1], bf16_x=True)
            self.max_rows = self.MAX_ROWS_PAIRS
        else:
            self.w_bf16 = w.to(torch.bfloat16).contiguous()
            self.rel = screen_bound(w.shape[1])

    @classmethod
    def build(cls, model: nn.Module) -> "GreedyHead | None":
        from quantspec.infer.dense_linear import PackedLinear
        from quantspec.kernels.cpu import cpu_kernels

        kernels = cpu_kernels()
        head = getattr(model, "lm_head", None)
        if (kernels is None or not hasattr(kernels, "screened_argmax") or type(head) is not PackedLinear
                or head.bias is not None or head.in_features % 16):  # the bf16 screen's rows: 16-wide
            return None
        return cls(model, kernels)

    def __call__(self, hidden: torch.Tensor) -> list[int] | None:
        """hidden [R, D] pre-norm rows → their greedy ids, or None (compute the logits instead)."""
        if hidden.shape[0] > self.max_rows:
            return None
        if (self.model.lm_head is not self.head or self.head.packed is not self.packed
                or (self.version is not None and self.packed._version != self.version)):
            return None  # the head was swapped, repacked or changed in place after loading
        x = self.model.model.norm(hidden)  # compute_logits' normed rows
        if x.dtype != torch.float32 or x.dim() != 2 or x.device.type != "cpu" or x.shape[0] == 0:
            return None
        if self.pairs:
            ids = self.kernels.screened_argmax_pairs(x.contiguous(), self.w_bf16, self.packed, self.row_norm,
                                                     self.num_outputs, self.rel, PAIR_ABS_ERR).tolist()
        else:
            ids = self.kernels.screened_argmax(x.contiguous(), self.w_bf16, self.packed, self.row_norm,
                                               self.num_outputs, self.rel).tolist()
        return None if min(ids) < 0 else ids


def use_greedy_head(model: nn.Module) -> bool:
    """Attach a `GreedyHead` to `model` where its head allows one; returns whether it did."""
    model.greedy_head = GreedyHead.build(model)
    return model.greedy_head is not None
