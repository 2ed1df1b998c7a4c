"""W8A8 int8: activation quantization and the int8 × int8 → int32 GEMM with a scale epilogue.

This file owns two Triton kernels, each beside its torch reference with the same signature:
  quantize_act_int8 / _ref:  x [M, K] float -> (x_q int8 [M, K], x_scale fp32 [M] or [1]).
      Static (calibrated) per-tensor scale: x_q = clamp(round(x / scale), -128, 127).
      Dynamic per-token: scale_m = amax(|x_m|) / 127.5 (compressed-tensors' symmetric rule,
      fp32 eps for an all-zero row), then the same rounding.
  int8_gemm / _ref:  y = (x_q · w_qᵀ as int32) * x_scale[m] * w_scale[n] (+ bias) -> out_dtype.
`w8a8_linear` composes the two (what a quantized linear calls).

The int32 accumulation is exact and the epilogue does the same fp32 operations in the same order
as the reference, so kernel and reference agree bit for bit (when |acc| < 2**24).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from quantspec.errors import QuantSpecError
from quantspec.kernels._common import (
    grouped_tile,
    FLOAT_DTYPES,
    INT8_MAX,
    INT8_MIN,
    check_same_device,
    check_tensor,
    finish_scaled_split_k,
    gpu_launch,
    pdl_begin,
    pdl_kwargs,
    round_half_even,
    scaled_gemm_launch,
    split_k_buffers,
    split_k_partials,
    split_k_range,
)

__all__ = [
    "ZERO_SCALE_EPS",
    "int8_gemm",
    "int8_gemm_ref",
    "quantize_act_int8",
    "quantize_act_int8_ref",
    "w8a8_linear",
    "w8a8_linear_ref",
]

# an all-zero row would give scale 0 and 0/0; quant/ replaces such a scale by the fp32 eps
ZERO_SCALE_EPS = float(torch.finfo(torch.float32).eps)
# symmetric int8 maps absmax to (q_max - q_min) / 2 = 127.5 (compressed-tensors), then clamps
INT8_HALF_RANGE = (INT8_MAX - INT8_MIN) / 2


# ---------------------------------------------------------------- activation quantization


@triton.jit
def _quantize_act_int8_kernel(
    x_ptr, q_ptr, s_ptr, K, stride_xm, stride_qm,
    DYNAMIC: tl.constexpr, HALF_RANGE: tl.constexpr, EPS: tl.constexpr, BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_begin(USE_PDL)
    m = tl.program_id(0)
    if DYNAMIC:
        amax = tl.zeros((BLOCK_K,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + m * stride_xm + offs, mask=offs < K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        scale = tl.math.div_rn(tl.max(amax, axis=0), HALF_RANGE)
        scale = tl.where(scale == 0.0, EPS, scale)
        tl.store(s_ptr + m, scale)
    else:
        scale = tl.load(s_ptr).to(tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs = k0 + tl.arange(0, BLOCK_K)
        mask = offs < K
        x = tl.load(x_ptr + m * stride_xm + offs, mask=mask, other=0.0).to(tl.float32)
        # IEEE division (plain `/` is approximate on GPUs) so the result matches torch exactly
        v = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -128.0), 127.0)
        tl.store(q_ptr + m * stride_qm + offs, round_half_even(v).to(tl.int8), mask=mask)


def _validate_act(x, scale):
    check_tensor(x, "x", ndim=2, dtypes=FLOAT_DTYPES)
    if scale is not None:
        check_tensor(scale, "scale", dtypes=(torch.float32,))
        if scale.numel() != 1:
            raise QuantSpecError(
                f"static activation scale must hold one value, got shape {list(scale.shape)}; "
                "pass scale=None for dynamic per-token scales"
            )
        # a value check on a GPU tensor would wait on the device at every call (and cannot run
        # inside a CUDA graph capture): there the artifact reader's check stands
        # (`quant.compressed.read_quantized_linear`)
        if scale.device.type == "cpu" and not bool((scale > 0).all()):
            raise QuantSpecError("static activation scale must be > 0; recalibrate the model")


def quantize_act_int8_ref(
    x: torch.Tensor,  # [M, K] fp32/fp16/bf16
    scale: torch.Tensor | None = None,  # [1] or [] fp32 static scale; None = dynamic per token
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference: returns (x_q int8 [M, K], x_scale fp32 [M] if dynamic else [1])."""
    _validate_act(x, scale)
    from quantspec.kernels._quant_bridge import dynamic_token_scale_int8, quantize_int8

    xf = x.float()
    if scale is None:
        s = dynamic_token_scale_int8(xf)  # [M]
        return quantize_int8(xf, s[:, None]), s
    s = scale.reshape(1).float()  # [1]
    return quantize_int8(xf, s), s


def quantize_act_int8(
    x: torch.Tensor,  # [M, K] fp32/fp16/bf16
    scale: torch.Tensor | None = None,  # [1] or [] fp32 static scale; None = dynamic per token
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton activation quantizer; returns (x_q int8 [M, K], x_scale fp32 [M] or [1])."""
    _validate_act(x, scale)
    device = check_same_device(x=x, scale=scale)
    M, K = x.shape
    q = torch.empty((M, K), device=device, dtype=torch.int8)
    s = torch.empty((M,), device=device, dtype=torch.float32) if scale is None else scale.reshape(1)
    block_k = min(triton.next_power_of_2(max(K, 1)), 1024 if gpu_launch(device) else 64)
    _quantize_act_int8_kernel[(M,)](
        x, q, s, K, x.stride(0), q.stride(0),
        DYNAMIC=scale is None, HALF_RANGE=INT8_HALF_RANGE, EPS=ZERO_SCALE_EPS, BLOCK_K=block_k,
        **pdl_kwargs(device),
    )
    return q, s


# ---------------------------------------------------------------- int8 GEMM


@triton.jit
def _int8_gemm_kernel(
    a_ptr, b_ptr, as_ptr, bs_ptr, bias_ptr, out_ptr, y_ptr, cnt_ptr,
    M, N, K, stride_am, stride_bn, stride_om, stride_osplit,
    PER_TOKEN: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    SPLIT_K: tl.constexpr, FINISH: tl.constexpr, USE_PDL: tl.constexpr,
):
    pdl_begin(USE_PDL)
    pid = tl.program_id(0)
    pid_m, pid_n = grouped_tile(pid, M, N, BLOCK_M, BLOCK_N, GROUP_M)
    k_lo, k_hi = split_k_range(K, BLOCK_K, SPLIT_K)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    mask_m = offs_m < M
    mask_n = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        a = tl.load(a_ptr + offs_m[:, None] * stride_am + offs_k[None, :],
                    mask=mask_m[:, None] & mask_k[None, :], other=0)  # [BM, BK] int8
        b = tl.load(b_ptr + offs_n[:, None] * stride_bn + offs_k[None, :],
                    mask=mask_n[:, None] & mask_k[None, :], other=0)  # [BN, BK] int8
        acc += tl.dot(a, tl.trans(b), out_dtype=tl.int32)
    out_mask = mask_m[:, None] & mask_n[None, :]
    acc, y_mask = split_k_partials(acc, out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], out_mask,
                                   stride_osplit, tl.program_id(1), cnt_ptr, pid, SPLIT_K, FINISH)
    if SPLIT_K == 1 or FINISH:
        if PER_TOKEN:
            a_s = tl.load(as_ptr + offs_m, mask=mask_m, other=0.0)  # [BM]
        else:
            a_s = tl.load(as_ptr + offs_m * 0)  # [BM], one static scale
        b_s = tl.load(bs_ptr + offs_n, mask=mask_n, other=0.0)  # [BN]
        y = acc.to(tl.float32) * a_s[:, None] * b_s[None, :]
        if HAS_BIAS:
            y = y + tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + offs_m[:, None] * stride_om + offs_n[None, :], y.to(y_ptr.dtype.element_ty),
                 mask=y_mask)


def _validate_gemm(x_q, x_scale, w_q, w_scale, bias, out_dtype):
    check_tensor(x_q, "x_q", ndim=2, dtypes=(torch.int8,))
    check_tensor(w_q, "w_q", ndim=2, dtypes=(torch.int8,))
    M, K = x_q.shape
    N = w_q.shape[0]
    if w_q.shape[1] != K:
        raise QuantSpecError(f"w_q has K={w_q.shape[1]} but x_q has K={K}; shapes must agree")
    check_tensor(x_scale, "x_scale", ndim=1, dtypes=(torch.float32,))
    if x_scale.shape[0] not in (1, M):
        raise QuantSpecError(f"x_scale has {x_scale.shape[0]} values; expected 1 (static) or M={M}")
    check_tensor(w_scale, "w_scale", dtypes=(torch.float32,), shape=(N,))
    if bias is not None:
        check_tensor(bias, "bias", dtypes=FLOAT_DTYPES, shape=(N,))
    if out_dtype not in FLOAT_DTYPES:
        raise QuantSpecError(f"out_dtype={out_dtype} must be float32, float16 or bfloat16")
    return M, N, K


def int8_gemm_ref(
    x_q: torch.Tensor,  # [M, K] int8
    x_scale: torch.Tensor,  # [M] or [1] fp32
    w_q: torch.Tensor,  # [N, K] int8
    w_scale: torch.Tensor,  # [N] fp32
    bias: torch.Tensor | None = None,  # [N]
    out_dtype: torch.dtype = torch.float16,
) -> torch.Tensor:
    """Torch reference: exact int32 matmul, then acc * x_scale * w_scale (+ bias) in fp32."""
    M, N, K = _validate_gemm(x_q, x_scale, w_q, w_scale, bias, out_dtype)
    acc = x_q.to(torch.int32) @ w_q.to(torch.int32).t()  # [M, N] int32
    y = acc.float() * x_scale[:, None] * w_scale[None, :]
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype)


def int8_gemm(
    x_q: torch.Tensor,  # [M, K] int8
    x_scale: torch.Tensor,  # [M] or [1] fp32
    w_q: torch.Tensor,  # [N, K] int8
    w_scale: torch.Tensor,  # [N] fp32
    bias: torch.Tensor | None = None,  # [N]
    out_dtype: torch.dtype = torch.float16,
    launch: tuple[int, ...] | None = None,
) -> torch.Tensor:
    """Triton int8 × int8 → int32 GEMM with the fp32 scale epilogue. `launch` (BLOCK_M, BLOCK_N,
    BLOCK_K, warps, stages, SPLIT_K) overrides `scaled_gemm_launch` (tests, benchmarks); split or
    not, the same numbers: the partial sums are exact integers."""
    M, N, K = _validate_gemm(x_q, x_scale, w_q, w_scale, bias, out_dtype)
    device = check_same_device(x_q=x_q, x_scale=x_scale, w_q=w_q, w_scale=w_scale, bias=bias)
    bm, bn, bk, warps, stages, split = launch or scaled_gemm_launch(M, N, K, gpu_launch(device))
    grid = (triton.cdiv(M, bm) * triton.cdiv(N, bn), split)
    part, out, counters = split_k_buffers(M, N, split, grid[0], device, out_dtype, torch.int32)
    _int8_gemm_kernel[grid](
        x_q, w_q, x_scale, w_scale, bias if bias is not None else w_scale, part, out,
        counters if counters is not None else out,
        M, N, K, x_q.stride(0), w_q.stride(0), N, M * N,
        PER_TOKEN=x_scale.shape[0] == M,
        HAS_BIAS=bias is not None, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, SPLIT_K=split,
        FINISH=counters is not None, **pdl_kwargs(device),
        num_warps=warps, num_stages=stages, enable_fp_fusion=False,  # the epilogue rounds as the reference
    )
    if split == 1 or counters is not None:
        return out
    return finish_scaled_split_k(part, x_scale, w_scale, bias, out)


def w8a8_linear_ref(
    x: torch.Tensor,  # [M, K] fp32/fp16/bf16
    w_q: torch.Tensor,  # [N, K] int8
    w_scale: torch.Tensor,  # [N] fp32
    x_scale: torch.Tensor | None = None,  # static [1] fp32; None = dynamic per token
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:
    """Reference W8A8 linear: quantize x, int8 GEMM, output in x.dtype."""
    x_q, s = quantize_act_int8_ref(x, x_scale)
    return int8_gemm_ref(x_q, s, w_q, w_scale, bias, x.dtype)


def w8a8_linear(
    x: torch.Tensor,  # [M, K] fp32/fp16/bf16
    w_q: torch.Tensor,  # [N, K] int8
    w_scale: torch.Tensor,  # [N] fp32
    x_scale: torch.Tensor | None = None,  # static [1] fp32; None = dynamic per token
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:
    """Triton W8A8 linear: quantize x, int8 GEMM, output in x.dtype."""
    x_q, s = quantize_act_int8(x, x_scale)
    return int8_gemm(x_q, s, w_q, w_scale, bias, x.dtype)
