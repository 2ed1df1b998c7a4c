"""Greedy picks from a head without every logit: exact, from a half or a quarter of the bytes.

A greedy step needs only argmax_n(x · w_n) per row, and a decode step of the default model
spends ~4 ms of ~19 streaming its 113 MB fp32 head (1.5-1.9 ms of ~8 for a quantized artifact's
56.6 MB bf16 head). `GreedyHead` keeps a smaller copy of the head and bounds on its error; the
extension approximates every logit from the copy and computes exactly — by the very chain of the
head's own kernel for that output — only those whose approximation is within the proven bound of
the best.

- int8 copy (`screened_argmax_i8`, CPUs with AVX512-VNNI and AVX512-BF16; up to 11 rows for a
  bf16 head, 8 for an fp32 one): codes round(w_n / s_n) with s_n = max|w_n| / 127, a quarter of an
  fp32 head's bytes, half a bf16 one's, against each row of x quantized to int16 (σ = max|x| /
  16383 for the default model's K), so the approximate dot products are exact integer sums
  (vpdpwssd). The bound comes from each row's residual ‖w_n − s_n q_n‖₂ and x's own
  ‖x − σ xq‖₂ (`int8_screen_tables`, the kernel's comment); on 1,312 of the default model's
  hidden states a median of 2 candidates per row, at most 52 (int8 x: a median of 45, up to
  28,049, which is why x keeps 15 bits). It serves both an fp32 head (`packed_gemm`'s
  logits) and a quantized artifact's bf16 head (`packed_pairs_gemm`'s logits, rounded to bf16:
  the candidates are those whose rounded upper bound reaches the rounded lower bound of the best,
  and equal rounded maxima go to the lowest index, as torch.argmax over the bf16 logits does).
- bf16 copy of an fp32 head (`screened_argmax` / `screened_argmax_pairs`), above 8 rows or
  without the int8 kernel (a median of 1 candidate per row, at most 10; the bound ~0.6,
  the largest actual error ~0.11):

    |exact_n − approx_n| ≤ rel · ‖x‖₂ · ‖w_n‖₂ (+ 2^-100),
    rel = (2^-8 + 2.02 K · 2^-24) · 1.001            x in fp32 (`screened_argmax`)
    rel = (2^-7 + 2^-16 + 2.02 K · 2^-24) · 1.001    x rounded to bf16 too (`screened_argmax_pairs`)

  (bf16 rounds each weight, and on the pair path each input, by at most 2^-8 relatively; each
  fp32 dot product of K terms errs by at most ~K · 2^-24 of Σ|x_k w_nk| ≤ ‖x‖₂ ‖w_n‖₂; AVX512-BF16
  flushes subnormals, < 2^-126 a term; row norms are rounded up). Where the CPU has AVX512-BF16
  the copy is packed in k-pairs for its dot product (twice the FMA rate), which serves
  verification steps of up to 11 rows; else a row-major copy against fp32 x serves up to 3 rows
  (beyond that the packed fp32 head is faster).

So the pick is the argmax of the logits `compute_logits` would give, with its tie-breaking (the
lowest index). The engine takes it for every step whose sequences are all greedy (sampling needs
the logits) and whose rows it serves; a row with a non-finite value falls back to the logits.
Default model, 2 threads, decode phase, the same 128-token runs with the screen and with the
logits, interleaved (8 rounds, paired): int4 artifact 127.9 → 149.6 tok/s, int8 artifact
127.6 → 136.7; fp32 with the int8 screen vs the bf16 pair screen: plain greedy 1.09-1.18x end to
end, n-gram speculation 1.00-1.05x (its verification steps of 9+ rows keep the pair screen). The
table at `GreedyHead.MAX_ROWS_I8` has the kernels' times by rows.

Built at load for a model whose head is a `PackedLinear` (fp32) or a `PackedPairsLinear` (bf16,
AVX512-VNNI and AVX512-BF16) without bias, on quantspec's CPU kernels. Memory: an fp32 head keeps both copies,
+N · K · 3 bytes (85 MB for SmolLM2's 49152 × 576); a bf16 head +N · K bytes (28.3 MB).
"""

from __future__ import annotations

import torch
from torch import nn

from quantspec.kernels.cpu import pack_pairs  # noqa: F401  (re-exported: the screen's layout)

__all__ = ["GreedyHead", "PAIR_ABS_ERR", "int8_screen_tables", "pack_pairs", "row_norms_up", "screen_bound",
           "use_greedy_head"]


def screen_bound(k: int, *, bf16_x: bool = False) -> float:
    """rel of the module docstring for a head of K inputs (`bf16_x`: the pair-dot path, which
    rounds x to bf16 too: 2^-7 + 2^-16 for the products instead of 2^-8)."""
    products = 2.0 ** -7 + 2.0 ** -16 if bf16_x else 2.0 ** -8
    return (products + 2.02 * k * 2.0 ** -24) * 1.001


# the pair-dot path's absolute slack: AVX512-BF16 flushes subnormal inputs, products and sums to
# zero, at most 2^-126 per term of a K ≤ 2^20 dot product
PAIR_ABS_ERR = 2.0 ** -100


def _up(v: torch.Tensor) -> torch.Tensor:
    """float64 values → fp32, each rounded up (never below the double)."""
    f = v.float()
    return torch.where(f.double() < v, torch.nextafter(f, torch.tensor(float("inf"))), f)


def int8_screen_tables(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float, float]:
    """The int8 screen's copy of a head w [N, K] (fp32 or bf16 values) → (codes packed [NB, K/2, 64]
    int8 (`pack_w8_pairs`), scale [N], u [N], t [N], rel, abs_err) of `screened_argmax_i8`'s bound: codes
    q_n = round(w_n / s_n), s_n = max|w_n| / 127 (fp32); u_n = ‖w_n − s_n q_n‖ + γ_K ‖w_n‖ and
    t_n = ‖s_n q_n‖ (float64 sums, then × (1 + 2^-40) for their own roundings and rounded up to
    fp32) with γ_K = 1.01 K 2^-24 (≥ K 2^-24 / (1 − K 2^-24) for K < 2^17) for the exact pass's fp32
    chain; rel = 2^-22 ≥ (1 + 2^-24)^3 − 1 for the three roundings of the approximation (its integer
    dot product is exact); abs_err bounds what subnormals can move either dot product (AVX512-BF16
    flushes them in a bf16 head's chain, < 2^-126 an input, product or sum)."""
    from quantspec.kernels.cpu import pack_w8_pairs

    n, k = w.shape
    if k >= 2 ** 17:
        raise ValueError(f"int8 head screen: K = {k} is too large for its error bound (< 131072)")
    gamma = 1.01 * k * 2.0 ** -24
    slack = 1 + 2.0 ** -40
    q = torch.empty(n, k, dtype=torch.int8)
    amax, scale, u, t = (torch.empty(n, dtype=dt) for dt in (torch.float64, torch.float32, torch.float32, torch.float32))
    # in chunks of rows: float64 copies of a whole head would add ~16 bytes per weight at load
    # (+760 MB for SmolLM2's, many GB for a large vocabulary); rows are independent
    step = max(1, (1 << 20) // max(1, k))
    for r0 in range(0, n, step):
        wd = w[r0:r0 + step].double()
        am = wd.abs().amax(dim=1)
        sc = torch.where(am > 0, am / 127, torch.ones_like(am)).float()  # the fp32 scale used
        qd = torch.round(wd / sc.double()[:, None]).clamp_(-127, 127)
        deq = qd * sc.double()[:, None]
        amax[r0:r0 + step], scale[r0:r0 + step], q[r0:r0 + step] = am, sc, qd.to(torch.int8)
        u[r0:r0 + step] = _up(((wd - deq).norm(dim=1) + gamma * wd.norm(dim=1)) * slack)
        t[r0:r0 + step] = _up(deq.norm(dim=1) * slack)
    smax = float(scale.max()) if n else 1.0
    abs_err = k * 2.0 ** -118 * (1.0 + 128.0 * smax + float(amax.max() if n else 0.0))
    return pack_w8_pairs(q), scale, u, t, 2.0 ** -22, abs_err


def row_norms_up(w: torch.Tensor) -> torch.Tensor:
    """‖w_n‖₂ of each row of w [N, K] as fp32, rounded up (the bound's ‖w_n‖₂ must not shrink)."""
    norms = torch.empty(w.shape[0], dtype=torch.float64)
    step = max(1, (1 << 20) // max(1, w.shape[1]))  # float64 rows in chunks (int8_screen_tables)
    for r in range(0, w.shape[0], step):
        norms[r:r + step] = w[r:r + step].double().norm(dim=1)
    return _up(norms)


class GreedyHead:
    """Exact greedy ids of `model.compute_logits(hidden)` (module docstring)."""

    # rows per call the row-major screen takes: it reads the copy once per 4 rows of x, so beyond
    # 3 rows the packed fp32 head is faster (default model, 2 threads, real hidden states: 1 row
    # 2.4 vs 4.5 ms, 3 rows 3.1 vs 3.8, 4 rows 4.4 vs 4.1, 11 rows 7.9 vs 4.9)
    max_rows = 3
    MAX_ROWS_PAIRS = 11  # the pair-dot screen: 11 rows 3.0 vs 4.0 ms (module docstring)
    # the int8 screen serves a bf16 head up to 11 rows and an fp32 head up to 8; beyond 8 rows an
    # fp32 head's bf16 pair screen is faster: both are bound by their dot-product instructions
    # there (32 products each), and the pair screen's approximations need no conversion. Default
    # model, 2 threads, real hidden states, medians of interleaved calls (ms):
    #   rows                         1     4     8     11
    #   int8 screen, fp32 head       1.16  1.54  1.74  2.38
    #   bf16 pair screen             1.80  2.03  1.99  2.10
    #   int8 screen, bf16 head       0.82  1.10  1.64  2.27
    #   bf16 logits (bf16 head)      1.68  1.93  2.41  3.12
    MAX_ROWS_I8 = 11
    MAX_ROWS_I8_FP32 = 8

    def __init__(self, model: nn.Module, kernels):
        from quantspec.infer.dense_linear import PackedPairsLinear

        head = model.lm_head
        w = head.dense_weight()  # [N, K] fp32 or bf16, unpacked: bitwise the packed weights
        self.kernels, self.model, self.head, self.packed = kernels, model, head, head.packed
        # an in-place change of the head makes the copies stale (inference tensors keep no version)
        self.version = None if head.packed.is_inference() else head.packed._version
        self.num_outputs = head.out_features
        self.bf16 = type(head) is PackedPairsLinear  # a quantized artifact's bf16 head: bf16 logits
        # AVX512-VNNI and -BF16 here: the int8 screen for up to i8_rows rows (a quarter of an fp32
        # head's bytes, half a bf16 one's)
        self.i8 = None
        if _has_int8_screen(kernels) and w.shape[1] % 2 == 0 and w.shape[1] < 2 ** 17:  # its bound's K
            self.i8 = int8_screen_tables(w)
        self.i8_rows = self.MAX_ROWS_I8 if self.bf16 else self.MAX_ROWS_I8_FP32
        self.pairs = False
        if self.bf16:  # beyond the int8 screen's rows: the logits (packed_pairs_gemm)
            self.max_rows = self.MAX_ROWS_I8
            return
        self.row_norm = row_norms_up(w)
        # the fp32 head with AVX512-BF16: the pair-dot screen above i8_rows rows (x rounded
        # too, twice the FMA rate: up to 11 rows); else the row-major bf16 copy against fp32 x (up
        # to 3 rows)
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
        from quantspec.infer.dense_linear import PackedLinear, PackedPairsLinear
        from quantspec.kernels.cpu import cpu_kernels

        kernels = cpu_kernels()
        head = getattr(model, "lm_head", None)
        if kernels is None or not hasattr(kernels, "screened_argmax") or head is None or head.bias is not None:
            return None
        if type(head) is PackedLinear and head.in_features % 16 == 0:  # the bf16 screen's rows: 16-wide
            return cls(model, kernels)
        if type(head) is PackedPairsLinear and _has_int8_screen(kernels) and head.in_features < 2 ** 17:
            return cls(model, kernels)
        return None

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
            ids = self.kernels.screened_argmax_i8(x, q, scale, u, t, self.packed, self.num_outputs, rel, abs_err)
        elif self.bf16:
            return None
        elif self.pairs:
            ids = self.kernels.screened_argmax_pairs(x, self.w_bf16, self.packed, self.row_norm,
                                                     self.num_outputs, self.rel, PAIR_ABS_ERR)
        else:
            ids = self.kernels.screened_argmax(x, self.w_bf16, self.packed, self.row_norm, self.num_outputs, self.rel)
        ids = ids.tolist()
        return None if min(ids) < 0 else ids


def _has_int8_screen(kernels) -> bool:
    """Whether the extension has the int8 screen (AVX512-VNNI and AVX512-BF16)."""
    return bool(getattr(kernels, "has_int8_screen", lambda: False)()) and hasattr(kernels, "screened_argmax_i8")


def use_greedy_head(model: nn.Module) -> bool:
    """Attach a `GreedyHead` to `model` where its head allows one; returns whether it did."""
    model.greedy_head = GreedyHead.build(model)
    return model.greedy_head is not None
