"""W4A16: y[M, N] = x[M, K] @ dequant(W)ᵀ (+ bias) with 4-bit group-wise weights.

This file owns the Triton kernel and its torch reference `w4a16_linear_ref` (same signature).

Weight layout is compressed-tensors' `pack-quantized` one, read as stored (no repack):
  w_packed int32 [N, ceil(K/8)]: element k of row n sits in word k // 8 at bits 4*(k % 8)..+3,
      stored as the unsigned nibble q + 8 with q in [-8, 7];
  w_scale  [N, K/group_size] (fp32/fp16/bf16; group_size divides K, as compressed-tensors needs);
  w_zero   optional [N, K/group_size] zero points in the same signed domain as q: int8/int32
      (compressed-tensors packs integer ones along dim 0 on disk; unpack them once at load time)
      or fp32/fp16/bf16 (a float `zp_dtype`, stored unpacked; the ZERO_FLOAT variant loads them
      as floats);
  dequant: w[n, k] = (q[n, k] - zero[n, k // g]) * scale[n, k // g] (in fp32).

Two launch shapes of one kernel: small M (decode, speculative verify) uses BLOCK_M = 1 with a
broadcast-multiply-reduce (a GEMV that streams the weight once per row) and split-K so that a
4096-wide layer still fills the GPU; larger M uses tiled `tl.dot`. Split-K partials go to an
fp32 buffer [SPLIT_K, M, N] that is summed in torch (deterministic, no atomics).
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
    split_k_output,
)

__all__ = ["W4A16Config", "w4a16_linear", "w4a16_linear_ref", "w4a16_default_config"]

PACK_FACTOR = 8  # 4-bit values per int32 word
INT4_OFFSET = 8  # stored nibble = q + 8
GEMV_MAX_M = 4  # at or below this M the GEMV launch wins: the weight read dominates


class W4A16Config(tuple):
    """(BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages) for one launch."""

    __slots__ = ()

    def __new__(cls, block_m: int, block_n: int, block_k: int, split_k: int = 1,
                num_warps: int = 4, num_stages: int = 2):
        for name, v in (("block_m", block_m), ("block_n", block_n), ("block_k", block_k)):
            if v < 1 or (v & (v - 1)):
                raise QuantSpecError(f"W4A16Config.{name}={v} must be a power of two")
        if split_k < 1:
            raise QuantSpecError(f"W4A16Config.split_k={split_k} must be >= 1")
        return super().__new__(cls, (block_m, block_n, block_k, split_k, num_warps, num_stages))

    block_m = property(lambda s: s[0])
    block_n = property(lambda s: s[1])
    block_k = property(lambda s: s[2])
    split_k = property(lambda s: s[3])
    num_warps = property(lambda s: s[4])
    num_stages = property(lambda s: s[5])


def w4a16_default_config(M: int, N: int, K: int, group_size: int, on_gpu: bool) -> W4A16Config:
    """Launch heuristic. GPU: GEMV + split-K for M <= 4, 16/32/64/128-row tiles above.

    CPU interpreter: tiny tiles so the tests stay fast and exercise masking.
    """
    if not on_gpu:
        if M <= GEMV_MAX_M:
            return W4A16Config(1, 16, 16, 2)
        return W4A16Config(16, 16, 16, 1)
    bk = 128 if group_size % 128 == 0 else (64 if group_size % 64 == 0 else 32)
    if M <= GEMV_MAX_M:
        block_n = 64 if N >= 8192 else 32
        n_tiles = triton.cdiv(N, block_n)
        # aim for ~4 programs per SM (132 SMs on H100) without splits thinner than 512
        split = max(1, min(K // 512, triton.cdiv(528, n_tiles)))
        return W4A16Config(1, block_n, bk, split, 4, 3)
    if M <= 16:
        return W4A16Config(16, 64, bk, max(1, min(K // 1024, 4)), 4, 4)
    if M <= 64:
        return W4A16Config(32, 64, bk, max(1, min(K // 2048, 2)), 4, 4)
    if M <= 256:
        return W4A16Config(64, 128, min(bk, 64), 1, 4, 4)
    return W4A16Config(128, 128, min(bk, 64), 1, 8, 3)


@triton.jit
def _w4a16_kernel(
    x_ptr, w_ptr, s_ptr, z_ptr, b_ptr, out_ptr,
    M, N, K, group_size,
    stride_xm, stride_wn, stride_sn, stride_zn, stride_om, stride_osplit,
    HAS_ZERO: tl.constexpr, ZERO_FLOAT: tl.constexpr, HAS_BIAS: tl.constexpr,
    GROUP_ALIGNED: tl.constexpr,
    USE_DOT: tl.constexpr, DOT_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    mask_m = offs_m < M
    mask_n = offs_n < N
    k_tiles = tl.cdiv(K, BLOCK_K)
    tiles_per_split = tl.cdiv(k_tiles, SPLIT_K)
    k_begin = pid_k * tiles_per_split * BLOCK_K
    shift_base = tl.arange(0, BLOCK_K) % 8 * 4  # [BK] bit offset of each k inside its word

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for t in range(0, tiles_per_split):
        k0 = k_begin + t * BLOCK_K
        offs_k = k0 + tl.arange(0, BLOCK_K)  # [BK]
        mask_k = offs_k < K
        x = tl.load(
            x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
            mask=mask_m[:, None] & mask_k[None, :], other=0.0,
        )  # [BM, BK]
        wmask = mask_n[:, None] & mask_k[None, :]
        words = tl.load(
            w_ptr + offs_n[:, None] * stride_wn + (offs_k // 8)[None, :], mask=wmask, other=0
        )  # [BN, BK] int32, each word read by its 8 lanes (L1 hit)
        q = ((words >> shift_base[None, :]) & 0xF) - 8  # [BN, BK] int32 in [-8, 7]
        if GROUP_ALIGNED:
            # BLOCK_K divides group_size: the whole k tile shares one group
            # (a split-K launch's last split may run a tile past K, where x is masked to 0: it
            # reads the last group, not one past the end, which may hold a NaN)
            g = tl.minimum(k0, K - 1) // group_size
            s = tl.load(s_ptr + offs_n * stride_sn + g, mask=mask_n, other=0.0).to(tl.float32)
            if HAS_ZERO and ZERO_FLOAT:
                z = tl.load(z_ptr + offs_n * stride_zn + g, mask=mask_n, other=0.0).to(tl.float32)
                w = (q.to(tl.float32) - z[:, None]) * s[:, None]  # [BN, BK]
            else:
                if HAS_ZERO:
                    z = tl.load(z_ptr + offs_n * stride_zn + g, mask=mask_n, other=0).to(tl.int32)
                    q = q - z[:, None]
                w = q.to(tl.float32) * s[:, None]  # [BN, BK]
        else:
            g = offs_k // group_size  # [BK]
            gidx = offs_n[:, None] * stride_sn + g[None, :]
            s = tl.load(s_ptr + gidx, mask=wmask, other=0.0).to(tl.float32)
            if HAS_ZERO and ZERO_FLOAT:
                z = tl.load(z_ptr + offs_n[:, None] * stride_zn + g[None, :], mask=wmask,
                            other=0.0).to(tl.float32)
                w = (q.to(tl.float32) - z) * s  # [BN, BK]
            else:
                if HAS_ZERO:
                    z = tl.load(z_ptr + offs_n[:, None] * stride_zn + g[None, :], mask=wmask,
                                other=0)
                    q = q - z.to(tl.int32)
                w = q.to(tl.float32) * s  # [BN, BK]
        if USE_DOT:
            if DOT_FP32:
                acc += tl.dot(x.to(tl.float32), tl.trans(w), input_precision="ieee")
            else:
                acc += tl.dot(x, tl.trans(w.to(x.dtype)))
        else:
            prod = x.to(tl.float32)[:, None, :] * w[None, :, :]  # [BM, BN, BK]
            acc += tl.sum(prod, axis=2)

    out_mask = mask_m[:, None] & mask_n[None, :]
    if SPLIT_K == 1:
        if HAS_BIAS:
            b = tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
            acc += b[None, :]
        tl.store(
            out_ptr + offs_m[:, None] * stride_om + offs_n[None, :],
            acc.to(out_ptr.dtype.element_ty), mask=out_mask,
        )
    else:
        tl.store(
            out_ptr + pid_k * stride_osplit + offs_m[:, None] * stride_om + offs_n[None, :],
            acc, mask=out_mask,
        )


def _validate(x, w_packed, w_scale, group_size, w_zero, bias):
    check_tensor(x, "x", ndim=2, dtypes=FLOAT_DTYPES)
    M, K = x.shape
    check_tensor(w_packed, "w_packed", ndim=2, dtypes=(torch.int32,))
    N = w_packed.shape[0]
    if not isinstance(group_size, int) or group_size < 1:
        raise QuantSpecError(f"group_size={group_size!r} must be a positive int (use K for per-channel)")
    kw = triton.cdiv(K, PACK_FACTOR)
    if w_packed.shape[1] != kw:
        raise QuantSpecError(
            f"w_packed has {w_packed.shape[1]} int32 words per row but x has K={K} "
            f"(needs ceil(K/8)={kw}); x and the weight do not belong together"
        )
    if K % group_size:
        raise QuantSpecError(
            f"group_size={group_size} does not divide K={K}; compressed-tensors needs whole groups "
            "(re-quantize this layer with a group size that divides K)"
        )
    ng = K // group_size
    check_tensor(w_scale, "w_scale", dtypes=FLOAT_DTYPES, shape=(N, ng))
    if w_zero is not None:
        check_tensor(w_zero, "w_zero", dtypes=(torch.int8, torch.int32) + FLOAT_DTYPES,
                     shape=(N, ng))
    if bias is not None:
        check_tensor(bias, "bias", dtypes=FLOAT_DTYPES, shape=(N,))
    return M, N, K


def w4a16_linear_ref(
    x: torch.Tensor,  # [M, K] fp32/fp16/bf16
    w_packed: torch.Tensor,  # [N, ceil(K/8)] int32
    w_scale: torch.Tensor,  # [N, K/g]
    group_size: int,
    w_zero: torch.Tensor | None = None,  # [N, K/g] int8/int32, or float (float zp_dtype)
    bias: torch.Tensor | None = None,  # [N]
    config: W4A16Config | None = None,
) -> torch.Tensor:
    """Torch reference: unpack + dequantize with `quant/` (fp32), matmul in fp32, cast to x.dtype."""
    M, N, K = _validate(x, w_packed, w_scale, group_size, w_zero, bias)
    from quantspec.kernels._quant_bridge import dequantize_groupwise, unpack_int4

    q = unpack_int4(w_packed, K)  # [N, K] int8
    w = dequantize_groupwise(q, w_scale.float(), w_zero, group_size)  # [N, K] fp32
    y = x.float() @ w.t()  # [M, N]
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def w4a16_linear(
    x: torch.Tensor,  # [M, K] fp32/fp16/bf16
    w_packed: torch.Tensor,  # [N, ceil(K/8)] int32
    w_scale: torch.Tensor,  # [N, K/g]
    group_size: int,
    w_zero: torch.Tensor | None = None,  # [N, K/g] int8/int32, or float (float zp_dtype)
    bias: torch.Tensor | None = None,  # [N]
    config: W4A16Config | None = None,
) -> torch.Tensor:
    """Triton W4A16 linear; `config` overrides the launch heuristic (tests, benchmarks)."""
    M, N, K = _validate(x, w_packed, w_scale, group_size, w_zero, bias)
    device = check_same_device(x=x, w_packed=w_packed, w_scale=w_scale, w_zero=w_zero, bias=bias)
    on_gpu = device.type == "cuda"
    cfg = config or w4a16_default_config(M, N, K, group_size, on_gpu)
    bm, bn, bk, split, warps, stages = cfg
    use_dot = bm >= 16
    out = split_k_output(M, N, split, device, x.dtype)
    stride_osplit = 0 if split == 1 else M * N
    grid = (triton.cdiv(M, bm), triton.cdiv(N, bn), split)
    _w4a16_kernel[grid](
        x, w_packed, w_scale,
        w_zero if w_zero is not None else w_scale,
        bias if bias is not None else w_scale,
        out,
        M, N, K, group_size,
        x.stride(0), w_packed.stride(0), w_scale.stride(0),
        w_zero.stride(0) if w_zero is not None else 0,
        N, stride_osplit,
        HAS_ZERO=w_zero is not None,
        ZERO_FLOAT=w_zero is not None and w_zero.is_floating_point(), HAS_BIAS=bias is not None,
        GROUP_ALIGNED=group_size % bk == 0, USE_DOT=use_dot, DOT_FP32=dot_in_fp32(x.dtype),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split,
        num_warps=warps, num_stages=stages,
    )
    return finish_split_k(out, bias, x.dtype)
