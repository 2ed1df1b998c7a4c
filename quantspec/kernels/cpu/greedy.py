"""quantspec's CPU screens (`kernels/csrc/greedy.cpp`): argmax_n (x · w_n) for each row x of a
head, exactly as the head's own kernel's logits would give it (the same chain per output; the
lowest index among equal maxima), from a smaller copy of the head, each beside a torch
reference with the same signature (the argmax of the exact logits).

Every logit is first approximated from the copy, and only the outputs whose approximation is
within the proven bound of the best are computed exactly (a row with a non-finite value gets −1:
compute its logits instead).

- bf16 copy of an fp32 head (`screened_argmax`: row-major [N, K] against fp32 x;
  `screened_argmax_pairs`: pair-packed [NB, K/2, 32] with x rounded to bf16, AVX512-BF16's dot
  product):

    |exact_n − approx_n| ≤ rel · ‖x‖₂ · ‖w_n‖₂ (+ abs_err),
    rel = (2^-8 + 2.02 K · 2^-24) · 1.001            x in fp32 (`screened_argmax`)
    rel = (2^-7 + 2^-16 + 2.02 K · 2^-24) · 1.001    x rounded to bf16 too (`screened_argmax_pairs`)

  (bf16 rounds each weight, and on the pair path each input, by at most 2^-8 relatively; each
  fp32 dot product of K terms errs by at most ~K · 2^-24 of Σ|x_k w_nk| ≤ ‖x‖₂ ‖w_n‖₂;
  AVX512-BF16 flushes subnormals, < 2^-126 a term: `PAIR_ABS_ERR`; row norms are rounded up:
  `row_norms_up`).
- int8 copy (`screened_argmax_i8`, AVX512-VNNI and AVX512-BF16) of an fp32 head (exact pass:
  `packed_gemm`'s chain) or a bf16 pair-packed head (exact pass: `packed_pairs_gemm`'s chain,
  rounded to bf16): codes round(w_n / s_n) with s_n = max|w_n| / 127 against each row of x
  quantized to int16, so the approximate dot products are exact integer sums; the bound comes
  from each row's residual ‖w_n − s_n q_n‖₂ and x's own ‖x − σ xq‖₂ (`int8_screen_tables`, the
  kernel's comment).
"""

from __future__ import annotations

import torch

from quantspec.kernels.cpu.build import need
from quantspec.kernels.cpu.gemm import packed_gemm_ref, packed_pairs_gemm_ref
from quantspec.kernels.cpu.layouts import PACK_BLOCK, pack_w8_pairs

__all__ = ["PAIR_ABS_ERR", "has_int8_screen", "int8_screen_tables", "row_norms_up", "screen_bound",
           "screened_argmax", "screened_argmax_i8", "screened_argmax_i8_ref", "screened_argmax_pairs",
           "screened_argmax_pairs_ref", "screened_argmax_ref"]

# the pair-dot path's absolute slack: AVX512-BF16 flushes subnormal inputs, products and sums to
# zero, at most 2^-126 per term of a K ≤ 2^20 dot product
PAIR_ABS_ERR = 2.0 ** -100


def screen_bound(k: int, *, bf16_x: bool = False) -> float:
    """rel of the bf16 screens' bound (module docstring) for a head of K inputs (`bf16_x`: the
    pair-dot screen, which rounds x to bf16 too: 2^-7 + 2^-16 for the products instead of 2^-8)."""
    products = 2.0 ** -7 + 2.0 ** -16 if bf16_x else 2.0 ** -8
    return (products + 2.02 * k * 2.0 ** -24) * 1.001


def _up(v: torch.Tensor) -> torch.Tensor:
    """float64 values → fp32, each rounded up (never below the double)."""
    f = v.float()
    return torch.where(f.double() < v, torch.nextafter(f, torch.tensor(float("inf"))), f)


def int8_screen_tables(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float, float]:
    """The int8 screen's copy of a head w [N, K] (fp32 or bf16 values; a tensor or a `PairRows`,
    read in chunks of rows) → (codes packed [NB, K/2, 64]
    int8 (`pack_w8_pairs`), scale [N], u [N], t [N], rel, abs_err) of `screened_argmax_i8`'s bound: codes
    q_n = round(w_n / s_n), s_n = max|w_n| / 127 (fp32); u_n = ‖w_n − s_n q_n‖ + γ_K ‖w_n‖ and
    t_n = ‖s_n q_n‖ (float64 sums, then × (1 + 2^-40) for their own roundings and rounded up to
    fp32) with γ_K = 1.01 K 2^-24 (≥ K 2^-24 / (1 − K 2^-24) for K < 2^17) for the exact pass's fp32
    chain; rel = 2^-22 ≥ (1 + 2^-24)^3 − 1 for the three roundings of the approximation (its integer
    dot product is exact); abs_err bounds what subnormals can move either dot product (AVX512-BF16
    flushes them in a bf16 head's chain, < 2^-126 an input, product or sum)."""
    n, k = w.shape
    if k >= 2 ** 17:
        raise ValueError(f"int8 head screen: K = {k} is too large for its error bound (< 131072)")
    gamma = 1.01 * k * 2.0 ** -24
    slack = 1 + 2.0 ** -40
    packed = torch.empty(-(-n // PACK_BLOCK), k // 2, 2 * PACK_BLOCK, dtype=torch.int8)  # pack_w8_pairs' layout
    amax, scale, u, t = (torch.empty(n, dtype=dt) for dt in (torch.float64, torch.float32, torch.float32, torch.float32))
    # in chunks of whole column blocks: float64 copies of a whole head would add ~16 bytes per
    # weight at load (+760 MB for SmolLM2's, many GB for a large vocabulary), and the codes go
    # straight into their packed blocks (no whole-head codes beside the packed copy); rows are
    # independent, and so are column blocks
    step = max(1, (1 << 20) // max(1, k) // PACK_BLOCK) * PACK_BLOCK
    for r0 in range(0, n, step):
        wd = w[r0:r0 + step].double()
        am = wd.abs().amax(dim=1)
        sc = torch.where(am > 0, am / 127, torch.ones_like(am)).float()  # the fp32 scale used
        qd = torch.round(wd / sc.double()[:, None]).clamp_(-127, 127)
        deq = qd * sc.double()[:, None]
        amax[r0:r0 + step], scale[r0:r0 + step] = am, sc
        packed[r0 // PACK_BLOCK:(r0 + step) // PACK_BLOCK] = pack_w8_pairs(qd.to(torch.int8))
        u[r0:r0 + step] = _up(((wd - deq).norm(dim=1) + gamma * wd.norm(dim=1)) * slack)
        t[r0:r0 + step] = _up(deq.norm(dim=1) * slack)
    smax = float(scale.max()) if n else 1.0
    abs_err = k * 2.0 ** -118 * (1.0 + 128.0 * smax + float(amax.max() if n else 0.0))
    return packed, scale, u, t, 2.0 ** -22, abs_err


def row_norms_up(w: torch.Tensor) -> torch.Tensor:
    """‖w_n‖₂ of each row of w [N, K] as fp32, rounded up (the bound's ‖w_n‖₂ must not shrink)."""
    norms = torch.empty(w.shape[0], dtype=torch.float64)
    step = max(1, (1 << 20) // max(1, w.shape[1]))  # float64 rows in chunks (int8_screen_tables)
    for r in range(0, w.shape[0], step):
        norms[r:r + step] = w[r:r + step].double().norm(dim=1)
    return _up(norms)


def has_int8_screen() -> bool:
    """Whether the extension has the int8 screen here (AVX512-VNNI and AVX512-BF16)."""
    mod = need()
    return bool(getattr(mod, "has_int8_screen", lambda: False)()) and hasattr(mod, "screened_argmax_i8")


def _argmax_ids(logits: torch.Tensor) -> torch.Tensor:
    """[M] int64 argmax of each row (the lowest index among equal maxima), −1 for a row with a
    non-finite value."""
    ids = logits.argmax(dim=-1)
    return torch.where(torch.isfinite(logits).all(dim=-1), ids, torch.full_like(ids, -1))


def screened_argmax(x: torch.Tensor, w_bf16: torch.Tensor, packed: torch.Tensor, row_norm: torch.Tensor,
                    n: int, rel: float) -> torch.Tensor:
    """x [M, K] fp32, w_bf16 [n, K] the head rounded to bf16, packed [NB, K, 32] the fp32 head
    (`pack_dense`), row_norm [n] (`row_norms_up`), rel (`screen_bound`) → ids [M] int64."""
    return need().screened_argmax(x, w_bf16, packed, row_norm, n, rel)


def screened_argmax_ref(x: torch.Tensor, w_bf16: torch.Tensor, packed: torch.Tensor, row_norm: torch.Tensor,
                        n: int, rel: float) -> torch.Tensor:
    return _argmax_ids(packed_gemm_ref(x, packed, n))


def screened_argmax_pairs(x: torch.Tensor, w_pairs: torch.Tensor, packed: torch.Tensor, row_norm: torch.Tensor,
                          n: int, rel: float, abs_err: float, *, prefetch: bool = True) -> torch.Tensor:
    """`screened_argmax` from the pair-packed bf16 copy w_pairs [NB, K/2, 32] (`pack_pairs`),
    x rounded to bf16 for the approximation (rel: `screen_bound(K, bf16_x=True)`, abs_err:
    `PAIR_ABS_ERR`). `prefetch`: tiles of 8+ rows prefetch the next block of the copy into L2
    while computing one (the same ids either way)."""
    return need().screened_argmax_pairs(x, w_pairs, packed, row_norm, n, rel, abs_err, prefetch)


def screened_argmax_pairs_ref(x: torch.Tensor, w_pairs: torch.Tensor, packed: torch.Tensor,
                              row_norm: torch.Tensor, n: int, rel: float, abs_err: float, *,
                              prefetch: bool = True) -> torch.Tensor:
    return _argmax_ids(packed_gemm_ref(x, packed, n))


def screened_argmax_i8(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, u: torch.Tensor, t: torch.Tensor,
                       exact: torch.Tensor, n: int, rel: float, abs_err: float) -> torch.Tensor:
    """x [M, K] fp32 or bf16; q, scale, u, t, rel, abs_err from `int8_screen_tables` of the head;
    exact: the fp32 head packed (`pack_dense`, fp32 x) or the bf16 head pair-packed (`pack_pairs`,
    bf16 x) → ids [M] int64 of the head's logits (bf16 x: rounded to bf16)."""
    return need().screened_argmax_i8(x, q, scale, u, t, exact, n, rel, abs_err)


def screened_argmax_i8_ref(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, u: torch.Tensor,
                           t: torch.Tensor, exact: torch.Tensor, n: int, rel: float, abs_err: float) -> torch.Tensor:
    if x.dtype == torch.bfloat16:
        return _argmax_ids(packed_pairs_gemm_ref(x, exact, n))
    return _argmax_ids(packed_gemm_ref(x, exact, n))
