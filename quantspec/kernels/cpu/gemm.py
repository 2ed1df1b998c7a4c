"""quantspec's CPU GEMMs (`kernels/csrc/gemm.cpp`), each beside a torch reference (`*_ref`) with
the same signature.

`y = x @ Wᵀ (+ b)` for rows of x (fp32 or bf16): `packed_gemm` / `packed_w8_gemm` /
`packed_w4_gemm` / `packed_fp4_gemm` over fp32 / int8 (per-channel scale) / int4 (group scale,
optional zero point) / FP4 (E2M1 codes, group scale: NVFP4, MXFP4) weights in column blocks
(`layouts.pack_dense`, `pack_w8`, `pack_w4`, `pack_fp4_blocks`), any number of rows,
dequantizing in registers; `dense_gemv` over row-major fp32 / bf16 weights for a few rows;
`packed_pairs_gemm` over a bf16 weight in k-pairs (`pack_pairs`) for bf16 x through AVX512-BF16's
dot product, which the int8 / int4 GEMMs also take for bf16 x with `pairs=True` (where the CPU has
it; `pairs=False`: their fp32 chain). Every output element is computed by the same float
operations whatever the number of rows, so verification rows equal decode rows bitwise.
"""

from __future__ import annotations

import torch

from quantspec.kernels.cpu.build import need
from quantspec.kernels.cpu.layouts import unblock, unpack_dense, unpack_fp4_blocks, unpack_pairs, unpack_w4
from quantspec.quant.fp4 import E2M1_VALUES

__all__ = ["K_MULTIPLE", "X_DTYPES", "dense_gemv", "dense_gemv_ref", "packed_gemm", "packed_gemm_ref",
           "packed_fp4_gemm", "packed_fp4_gemm_ref", "packed_pairs_gemm", "packed_pairs_gemm_ref", "packed_w4_gemm",
           "packed_w4_gemm_ref", "packed_w8_gemm", "packed_w8_gemm_ref"]

X_DTYPES = (torch.float32, torch.bfloat16)  # activation dtypes every kernel takes
K_MULTIPLE = 16  # `dense_gemv` takes K % 16 == 0 (the packed kernels take any K)


def _finish(y: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    return (y if bias is None else y + bias).to(dtype)


def dense_gemv(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] fp32/bf16 contiguous, w [N, K] fp32/bf16, bias [N] fp32 → [M, N] in x.dtype."""
    return need().dense_gemv(x, w, bias)


def dense_gemv_ref(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return _finish(x.float() @ w.float().t(), bias, x.dtype)


def packed_gemm(x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] fp32/bf16 contiguous (any M), packed from `pack_dense` of a [n, K] fp32 weight,
    bias [n] fp32 → [M, n] in x.dtype."""
    return need().packed_gemm(x, packed, n, bias)


def packed_gemm_ref(x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    return _finish(x.float() @ unpack_dense(packed, n).t(), bias, x.dtype)


def packed_pairs_gemm(x: torch.Tensor, w_pairs: torch.Tensor, n: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] bf16 contiguous (any M), w_pairs from `pack_pairs` of a [n, K] weight, bias [n]
    fp32 → [M, n] bf16 (fp32 accumulation; needs AVX512-BF16: `pair_path_available()`)."""
    return need().packed_pairs_gemm(x, w_pairs, n, bias)


def packed_pairs_gemm_ref(x: torch.Tensor, w_pairs: torch.Tensor, n: int,
                          bias: torch.Tensor | None = None) -> torch.Tensor:
    return _finish(x.float() @ unpack_pairs(w_pairs, n).float().t(), bias, x.dtype)


def packed_w8_gemm(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, n: int,
                   bias: torch.Tensor | None = None, *, pairs: bool = True) -> torch.Tensor:
    """x [M, K] (any M), q from `pack_w8`, scale [n] fp32 per output → [M, n] in x.dtype;
    `pairs`: bf16 x through AVX512-BF16's dot product where the CPU has it."""
    return need().packed_w8_gemm(x, q, scale, n, bias, pairs)


def packed_w8_gemm_ref(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, n: int,
                       bias: torch.Tensor | None = None, *, pairs: bool = True) -> torch.Tensor:
    return _finish((x.float() @ unblock(q, n).float().t()) * scale[None, :], bias, x.dtype)


def packed_w4_gemm(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor,
                   group: int, n: int, bias: torch.Tensor | None = None, *, pairs: bool = True) -> torch.Tensor:
    """x [M, K] (any M); q, scale, offset from `pack_w4`; groups of `group` k → [M, n];
    `pairs`: bf16 x through AVX512-BF16's dot product where the CPU has it (even groups)."""
    return need().packed_w4_gemm(x, q, scale, offset, group, n, bias, pairs)


def packed_w4_gemm_ref(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor,
                       group: int, n: int, bias: torch.Tensor | None = None, *, pairs: bool = True) -> torch.Tensor:
    u = unpack_w4(q, n).float() + 8
    w = u * unblock(scale, n).repeat_interleave(group, 1) + unblock(offset, n).repeat_interleave(group, 1)
    return _finish(x.float() @ w.t(), bias, x.dtype)


def packed_fp4_gemm(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, group: int, n: int,
                    bias: torch.Tensor | None = None, *, pairs: bool = True) -> torch.Tensor:
    """x [M, K] (any M); q, scale from `pack_fp4_blocks`; groups of `group` k → [M, n] in x.dtype,
    w = e2m1(nibble) · scale in fp32; `pairs`: bf16 x through AVX512-BF16's dot product where the
    CPU has it (E2M1 values are exact in bf16)."""
    return need().packed_fp4_gemm(x, q, scale, group, n, bias, pairs)


def packed_fp4_gemm_ref(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, group: int, n: int,
                        bias: torch.Tensor | None = None, *, pairs: bool = True) -> torch.Tensor:
    table = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=torch.float32)
    w = table[unpack_fp4_blocks(q, n).long()] * unblock(scale, n).repeat_interleave(group, 1)
    return _finish(x.float() @ w.t(), bias, x.dtype)
