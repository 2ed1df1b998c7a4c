"""W8A16: y[M, N] = (x[M, K] @ q[N, K]ᵀ) * scale[N] (+ bias) with per-channel int8 weights, or
FP8 E4M3 ones (weight_only_fp8: W8A16 FP8); with group scales [N, K/g] (weight_only_mxfp8's
power-of-two scales per 32, group-wise int8) y = x @ (q · scale per group)ᵀ.

This file owns the Triton kernel and its torch reference `w8a16_linear_ref` (same signature).
Because the scale is per output channel it factors out of the K sum, so the kernel accumulates
x · q and applies the scale once in the epilogue (fewer multiplies, and the int8 → float convert
is the only dequant work in the inner loop). Group scales do not factor out: each weight tile is
q · scale in fp32, cast to the dot's dtype, as the reference casts its dequantized weight. FP8 codes are read as their bytes and decoded with
integer ops into exact float values (`_e4m3_codes`): every GPU the kernels run on, and Triton's
interpreter, take them alike.

The launches are W4A16's tiles (`tl.dot` for every M on a GPU, split-K for small M), with a
small-M shape of its own (`w8a16_default_config`). Split-K partials go to an fp32 buffer
[SPLIT_K, M, N] that each output tile's last split sums in split order (as W4A16's do).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from quantspec.errors import QuantSpecError
from quantspec.kernels._common import (
    FLOAT_DTYPES,
    check_same_device,
    check_tensor,
    dot_in_fp32,
    finish_split_k,
    gpu_launch,
    pdl_begin,
    pdl_kwargs,
    small_ints_to_float,
    split_k_buffers,
    split_k_partials,
)
from quantspec.kernels.w4a16 import GEMV_MAX_M, W4A16Config, check_gpu_dot_tile, gpu_weight_only_config, small_m_split

__all__ = ["W8A16Config", "w8a16_default_config", "w8a16_dequantize", "w8a16_dequantize_ref", "w8a16_linear", "w8a16_linear_ref"]

# the tuple of W4A16Config: (BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages, swap_ab;
# nibble_dots has no int8 meaning and is not read)
W8A16Config = W4A16Config


def w8a16_default_config(M: int, N: int, K: int, on_gpu: bool) -> W4A16Config:
    """Launch heuristic: on a GPU, up to 16 rows one launch shape (a row's numbers do not depend
    on the other rows): [16, 64] tiles, unswapped (`W4A16Config.swap_ab`), split-K by
    `w4a16.small_m_split` — the fastest tiles over 1 and 16 rows of the Llama-3-8B shapes in an
    H100's sweep (`bench/kernels.py --sweep-only`); more rows `w4a16.gpu_weight_only_config`'s
    tiles. Tiny tiles on the CPU."""
    if not on_gpu:
        return W4A16Config(1, 16, 16, 2) if M <= GEMV_MAX_M else W4A16Config(16, 16, 16, 1)
    if M <= 16:
        return W4A16Config(16, 64, 128, small_m_split(N, K, 64, 128), 4, 3)
    return gpu_weight_only_config(M, N, K, 128)


@triton.jit
def _int8_codes(q, DTYPE: tl.constexpr):
    """int8 codes as exact DTYPE values, without an int-to-float conversion
    (`small_ints_to_float` of q + 128)."""
    return small_ints_to_float(q.to(tl.int32) + 128, 128, DTYPE, False)


@triton.jit
def _e4m3_codes(q, DTYPE: tl.constexpr):
    """FP8 E4M3 bytes (uint8) as exact DTYPE values: a normal byte's exponent and mantissa go into
    an fp32's bits (exponent rebiased by 127 - 7), a subnormal's (exponent 0) value is m · 2⁻⁹."""
    b = q.to(tl.int32)
    sign = b >> 7
    mag = b & 0x7F
    normal = ((mag << 20) + (120 << 23)).to(tl.float32, bitcast=True)
    sub = small_ints_to_float(b & 7, 0, tl.float32, True) * 0.001953125
    v = tl.where(mag >= 8, normal, sub)
    return tl.where(sign == 1, -v, v).to(DTYPE)


@triton.jit
def _codes(q, DTYPE: tl.constexpr, FP8: tl.constexpr):
    if FP8:
        return _e4m3_codes(q, DTYPE)
    return _int8_codes(q, DTYPE)


@triton.jit
def _weights(q, DTYPE: tl.constexpr, FP8: tl.constexpr, GROUP: tl.constexpr):
    """A weight tile as the dot takes it: the codes as exact DTYPE values, or (GROUP) the tile
    already scaled in fp32, rounded to DTYPE."""
    if GROUP > 0:
        return q.to(DTYPE)
    return _codes(q, DTYPE, FP8)


@triton.jit
def _w8a16_kernel(
    x_ptr, w_ptr, s_ptr, b_ptr, out_ptr, y_ptr, cnt_ptr,
    M, N, K,
    stride_xm, stride_wn, stride_sn, stride_om, stride_osplit,
    HAS_BIAS: tl.constexpr, USE_DOT: tl.constexpr, DOT_FP32: tl.constexpr, SWAP_AB: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    FINISH: tl.constexpr, USE_PDL: tl.constexpr, FP8: tl.constexpr, GROUP: tl.constexpr,
):
    pdl_begin(USE_PDL)
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    mask_m = offs_m < M
    mask_n = offs_n < N
    tiles_per_split = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K)
    k_begin = pid_k * tiles_per_split * BLOCK_K

    if SWAP_AB:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for t in range(0, tiles_per_split):
        offs_k = k_begin + t * BLOCK_K + tl.arange(0, BLOCK_K)  # [BK]
        mask_k = offs_k < K
        x = tl.load(
            x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
            mask=mask_m[:, None] & mask_k[None, :], other=0.0,
        )  # [BM, BK]
        q = tl.load(
            w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :],
            mask=mask_n[:, None] & mask_k[None, :], other=0,
        )  # [BN, BK] int8 (FP8: uint8 bytes)
        # int8 and E4M3 codes are exact in every float dtype; made without an int-to-float conversion
        if GROUP > 0:  # each column's group scale, then the tile in the dot's dtype
            s = tl.load(s_ptr + offs_n[:, None] * stride_sn + (offs_k // GROUP)[None, :],
                        mask=mask_n[:, None] & mask_k[None, :], other=0.0).to(tl.float32)  # [BN, BK]
            q = _codes(q, tl.float32, FP8) * s
        if USE_DOT:
            if DOT_FP32:
                w = _weights(q, tl.float32, FP8, GROUP)
                if SWAP_AB:  # [BN, BM]: the weight tile as the MMA's wide operand, untransposed
                    acc += tl.dot(w, tl.trans(x.to(tl.float32)), input_precision="ieee")
                else:
                    acc += tl.dot(x.to(tl.float32), tl.trans(w), input_precision="ieee")
            else:
                w = _weights(q, x.dtype, FP8, GROUP)
                if SWAP_AB:
                    acc = tl.dot(w, tl.trans(x), acc)
                else:
                    acc = tl.dot(x, tl.trans(w), acc)
        else:
            w = _weights(q, tl.float32, FP8, GROUP)
            prod = x.to(tl.float32)[:, None, :] * w[None, :, :]  # [BM, BN, BK]
            acc += tl.sum(prod, axis=2)
    if SWAP_AB:
        acc = tl.trans(acc)  # [BM, BN]

    out_mask = mask_m[:, None] & mask_n[None, :]
    if GROUP == 0:
        s = tl.load(s_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)  # [BN]
        acc = acc * s[None, :]
    tile = pid_m * tl.num_programs(1) + pid_n
    acc, y_mask = split_k_partials(acc, out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], out_mask,
                                   stride_osplit, pid_k, cnt_ptr, tile, SPLIT_K, FINISH)
    if SPLIT_K == 1 or FINISH:
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + offs_m[:, None] * stride_om + offs_n[None, :], acc.to(y_ptr.dtype.element_ty), mask=y_mask)


_CODE_DTYPES = (torch.int8, torch.float8_e4m3fn)


def _validate(x, w_q, w_scale, bias):
    """(M, N, K, group size: 0 for a per-channel scale [N], g for group scales [N, K/g])."""
    check_tensor(x, "x", ndim=2, dtypes=FLOAT_DTYPES)
    M, K = x.shape
    check_tensor(w_q, "w_q", ndim=2, dtypes=_CODE_DTYPES)
    N = w_q.shape[0]
    if w_q.shape[1] != K:
        raise QuantSpecError(f"w_q has K={w_q.shape[1]} but x has K={K}; shapes must agree")
    group = 0
    if w_scale.ndim == 2:
        groups = w_scale.shape[1]
        group = K // groups if groups and K % groups == 0 else 0
        if not group:
            raise QuantSpecError(f"w_scale has {groups} groups, which do not tile K={K}; give [N, K/g]")
        check_tensor(w_scale, "w_scale", dtypes=FLOAT_DTYPES, shape=(N, groups))
    else:
        check_tensor(w_scale, "w_scale", dtypes=FLOAT_DTYPES, shape=(N,))
    if bias is not None:
        check_tensor(bias, "bias", dtypes=FLOAT_DTYPES, shape=(N,))
    return M, N, K, group


def w8a16_linear_ref(
    x: torch.Tensor,  # [M, K] fp32/fp16/bf16
    w_q: torch.Tensor,  # [N, K] int8 or float8_e4m3fn
    w_scale: torch.Tensor,  # [N], or [N, K/g] group scales
    bias: torch.Tensor | None = None,  # [N]
    config: W4A16Config | None = None,
) -> torch.Tensor:
    """Torch reference: dequantize with `quant/` in fp32, matmul in fp32, cast to x.dtype.

    `config` is accepted (and ignored) so the reference and the kernel share one signature.
    """
    M, N, K, group = _validate(x, w_q, w_scale, bias)
    from quantspec.kernels._quant_bridge import dequantize, dequantize_groupwise

    if group:
        w = dequantize_groupwise(w_q, w_scale.float(), None, group)  # [N, K] fp32
    else:
        w = dequantize(w_q, w_scale.float()[:, None]) if w_q.dtype == torch.float8_e4m3fn else \
            dequantize_groupwise(w_q, w_scale.float()[:, None], None, K)
    y = x.float() @ w.t()  # [M, N]
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def w8a16_linear(
    x: torch.Tensor,  # [M, K] fp32/fp16/bf16
    w_q: torch.Tensor,  # [N, K] int8 or float8_e4m3fn
    w_scale: torch.Tensor,  # [N], or [N, K/g] group scales
    bias: torch.Tensor | None = None,  # [N]
    config: W4A16Config | None = None,
) -> torch.Tensor:
    """Triton W8A16 linear (int8 or FP8 E4M3 codes, per-channel or group scales); `config` overrides
    the launch heuristic (tests, benchmarks)."""
    M, N, K, group = _validate(x, w_q, w_scale, bias)
    device = check_same_device(x=x, w_q=w_q, w_scale=w_scale, bias=bias)
    cfg = config or w8a16_default_config(M, N, K, gpu_launch(device))
    check_gpu_dot_tile(cfg, device)
    bm, bn, bk, split, warps, stages, swap = cfg[:7]
    grid = (triton.cdiv(M, bm), triton.cdiv(N, bn), split)
    # the tiles' last splits finish the sums in the small-M launch; wider tiles would need
    # more registers for it than their main loop (fewer programs per SM)
    part, out, counters = split_k_buffers(M, N, split, grid[0] * grid[1], device, x.dtype,
                                          in_kernel=bm <= 16)
    fp8 = w_q.dtype == torch.float8_e4m3fn
    _w8a16_kernel[grid](
        x, w_q.view(torch.uint8) if fp8 else w_q, w_scale, bias if bias is not None else w_scale, part, out,
        counters if counters is not None else out,
        M, N, K,
        x.stride(0), w_q.stride(0), w_scale.stride(0), N, M * N,
        HAS_BIAS=bias is not None, USE_DOT=bm >= 16, DOT_FP32=dot_in_fp32(x.dtype), SWAP_AB=swap and bm >= 16,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split, FINISH=counters is not None, FP8=fp8, GROUP=group,
        num_warps=warps, num_stages=stages, **pdl_kwargs(device),
    )
    return finish_split_k(part, bias, out) if split > 1 and counters is None else out


@triton.jit
def _w8_dequant_kernel(w_ptr, s_ptr, out_ptr, N, K, stride_wn, stride_on,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr, FP8: tl.constexpr):
    pdl_begin(USE_PDL)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (offs_n < N)[:, None] & (offs_k < K)[None, :]
    q = tl.load(w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :], mask=mask, other=0)
    s = tl.load(s_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs_n[:, None] * stride_on + offs_k[None, :],
             (_codes(q, tl.float32, FP8) * s[:, None]).to(out_ptr.dtype.element_ty), mask=mask)


def w8a16_dequantize_ref(w_q: torch.Tensor, w_scale: torch.Tensor, dtype: torch.dtype = torch.float16) -> torch.Tensor:
    """Torch reference: the [N, K] weight q * scale computed in fp32, cast to `dtype`."""
    return (w_q.float() * w_scale.float()[:, None]).to(dtype)


def w8a16_dequantize(w_q: torch.Tensor, w_scale: torch.Tensor, dtype: torch.dtype = torch.float16) -> torch.Tensor:
    """Triton: the [N, K] weight in `dtype`, equal to `w8a16_dequantize_ref` bit for bit."""
    check_tensor(w_q, "w_q", ndim=2, dtypes=_CODE_DTYPES)
    N, K = w_q.shape
    check_tensor(w_scale, "w_scale", dtypes=FLOAT_DTYPES, shape=(N,))
    device = check_same_device(w_q=w_q, w_scale=w_scale)
    out = torch.empty((N, K), device=device, dtype=dtype)
    bn, bk = (32, 128) if gpu_launch(device) else (16, 16)
    fp8 = w_q.dtype == torch.float8_e4m3fn
    _w8_dequant_kernel[(triton.cdiv(N, bn), triton.cdiv(K, bk))](
        w_q.view(torch.uint8) if fp8 else w_q, w_scale, out, N, K, w_q.stride(0), out.stride(0), BLOCK_N=bn,
        BLOCK_K=bk, FP8=fp8, **pdl_kwargs(device))
    return out
