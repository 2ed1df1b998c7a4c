"""Greedy picks from an fp32 head without every fp32 logit: exact, from half the bytes.

A greedy step needs only argmax_n(x · w_n) per row, and an fp32 decode step of the default model
spends ~4 ms of ~19 streaming its 113 MB head. `GreedyHead` keeps a bf16 copy of the head
(half the bytes) and the rows' norms; the extension's `screened_argmax` approximates every logit
from the copy and computes exactly — by the very FMA chain `packed_gemm` runs for that output —
only those whose approximation is within the proven error bound of the best (on the default
model's hidden states: a median of 1 such logit per row, at most 10; the bound ~0.6, the largest
actual error ~0.11):

    |exact_n − approx_n| ≤ rel · ‖x‖₂ · ‖w_n‖₂,  rel = (2^-8 + 2 K · 2^-24) · 1.001

(bf16 rounds each weight by at most 2^-8 relatively; each fp32 dot product of K terms errs by at
most K · 2^-24 of Σ|x_k w_nk| ≤ ‖x‖₂ ‖w_n‖₂; row norms are rounded up). So the pick is the
argmax of the logits `compute_logits` would give, with its tie-breaking (the lowest index) — the
engine's greedy decoding and greedy verification take it whenever every sequence of a step is
greedy (sampling needs the logits). A row with a non-finite value falls back to the logits.

Built at load for a float model whose head is a `PackedLinear` without bias (fp32 on quantspec's
CPU kernels); quantized artifacts keep a bf16 head and need none of this. Memory: +N · K bf16
(56.6 MB for SmolLM2's 49152 × 576).
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["GreedyHead", "use_greedy_head"]


def screen_bound(k: int) -> float:
    """rel of the module docstring for a head of K inputs."""
    return (2.0 ** -8 + 2 * k * 2.0 ** -24) * 1.001


class GreedyHead:
    """Exact greedy ids of `model.compute_logits(hidden)` (module docstring)."""

    # rows per call it takes: the bf16 screen reads the copy once per 4 rows of x, so beyond 3
    # rows the packed fp32 head (every row against each weight once) is faster. Default model,
    # 2 threads, real hidden states: 1 row 2.4 vs 4.5 ms, 2 rows 2.2 vs 3.7, 3 rows 3.1 vs 3.8,
    # 4 rows 4.4 vs 4.1, 11 rows 7.9 vs 4.9; a median of 1 exact recomputation per row (max 10)
    max_rows = 3

    def __init__(self, model: nn.Module, kernels):
        head = model.lm_head
        w = head.dense_weight()  # [N, K] fp32, unpacked: bitwise the packed weights
        self.kernels, self.model, self.head, self.packed = kernels, model, head, head.packed
        self.num_outputs = head.out_features
        self.w_bf16 = w.to(torch.bfloat16).contiguous()
        norms = w.double().norm(dim=1)
        up = norms.float()
        self.row_norm = torch.where(up.double() < norms, torch.nextafter(up, torch.tensor(float("inf"))), up)
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
        if self.model.lm_head is not self.head or self.head.packed is not self.packed:
            return None  # the head was swapped or repacked after loading
        x = self.model.model.norm(hidden)  # compute_logits' normed rows
        if x.dtype != torch.float32 or x.dim() != 2 or x.device.type != "cpu" or not 0 < x.shape[0] <= self.max_rows:
            return None
        ids = self.kernels.screened_argmax(x.contiguous(), self.w_bf16, self.packed, self.row_norm,
                                           self.num_outputs, self.rel).tolist()
        return None if min(ids) < 0 else ids


def use_greedy_head(model: nn.Module) -> bool:
    """Attach a `GreedyHead` to `model` where its head allows one; returns whether it did."""
    model.greedy_head = GreedyHead.build(model)
    return model.greedy_head is not None
