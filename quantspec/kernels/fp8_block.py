"""Block-scaled W8A8 FP8 (E4M3), compressed-tensors' FP8_BLOCK: weights with one scale per
[bn, bk] block, inputs quantized per token and group of `bk` columns at run time.

This file owns two Triton kernels, each beside its torch reference with the same signature:
  quantize_act_fp8_group / _ref:  x [M, K] float → (x_q float8_e4m3fn [M, K], x_scale fp32
      [M, K / g]); per row and group of g columns, scale = absmax / 448 (fp32 eps for an
      all-zero group), x_q = cast(clamp(x / scale, ±448)) — `quant.primitives`' numbers.
  fp8_block_gemm / _ref:  y[m, n] = Σ_kb (x_q[m, kb] · w_q[n, kb]) · x_scale[m, kb] ·
      w_scale[n // bn, kb] (+ bias) → out_dtype, each k block's dot in fp32 then scaled into the
      fp32 sum (DeepSeek-V3's scheme).
`fp8_block_linear` composes them. The activation group equals the weight block's width, so one
k block of the GEMM has one scale on each side. Native fp8 `tl.dot` needs compute capability
>= 8.9; under the CPU interpreter the fp8 operands are upcast to fp32 before the dot (exact).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from quantspec.errors import QuantSpecError
from quantspec.kernels._common import (
    FLOAT_DTYPES,
    FP8_E4M3_MAX,
    check_same_device,
    check_tensor,
    gpu_launch,
    grouped_tile,
    pdl_begin,
    pdl_kwargs,
    round_to_e4m3,
)
from quantspec.kernels.fp8 import FP8_DTYPE, check_fp8_device, check_gemm_operands, fp8_tile_dot

__all__ = ["fp8_block_gemm", "fp8_block_gemm_ref", "fp8_block_linear", "fp8_block_linear_ref",
           "quantize_act_fp8_group", "quantize_act_fp8_group_ref"]

_EPS = torch.finfo(torch.float32).eps  # the scale of an all-zero group (`qparams_from_minmax`)


def _check_group(K: int, group: int) -> None:
    if group <= 0 or group & (group - 1) or K % group:
        raise QuantSpecError(f"activation group {group} must be a power of two dividing K={K}")


@triton.jit
def _quantize_act_fp8_group_kernel(x_ptr, q_ptr, s_ptr, K, stride_x, G: tl.constexpr, EPS: tl.constexpr,
                                   FP8_MAX: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_begin(USE_PDL)
    row = tl.program_id(0)
    grp = tl.program_id(1)
    offs = grp * G + tl.arange(0, G)
    x = tl.load(x_ptr + row * stride_x + offs).to(tl.float32)
    s = tl.max(tl.abs(x), axis=0) / FP8_MAX
    s = tl.where(s == 0.0, EPS, s)
    v = tl.minimum(tl.maximum(tl.math.div_rn(x, s), -FP8_MAX), FP8_MAX)
    tl.store(q_ptr + row * K + offs, round_to_e4m3(v).to(q_ptr.dtype.element_ty))
    tl.store(s_ptr + row * (K // G) + grp, s)


def quantize_act_fp8_group_ref(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference: `quant.primitives`' dynamic per-group FP8 quantizer on x [M, K] (fp32)."""
    check_tensor(x, "x", ndim=2, dtypes=FLOAT_DTYPES)
    _check_group(x.shape[1], group)
    from quantspec.quant.args import QuantArgs
    from quantspec.quant.primitives import choose_qparams, quantize

    args = QuantArgs(num_bits=8, type="float", strategy="group", group_size=group, dynamic=True)
    xf = x.float()
    scale, _ = choose_qparams(xf, args)  # [M, K / g]
    return quantize(xf, scale, None, args), scale


def quantize_act_fp8_group(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton dynamic per-group FP8 quantizer: x [M, K] → (float8_e4m3fn [M, K], fp32 [M, K / g])."""
    check_tensor(x, "x", ndim=2, dtypes=FLOAT_DTYPES)
    M, K = x.shape
    _check_group(K, group)
    device = check_same_device(x=x)
    q = torch.empty((M, K), device=device, dtype=FP8_DTYPE)
    s = torch.empty((M, K // group), device=device, dtype=torch.float32)
    if M:
        _quantize_act_fp8_group_kernel[(M, K // group)](
            x, q, s, K, x.stride(0), G=group, EPS=_EPS, FP8_MAX=FP8_E4M3_MAX, **pdl_kwargs(device))
    return q, s


@triton.jit
def _fp8_block_gemm_kernel(
    a_ptr, b_ptr, as_ptr, bs_ptr, bias_ptr, y_ptr,
    M, N, K, stride_am, stride_bn, stride_as, stride_bs, stride_ym,
    BN_W: tl.constexpr, BK_W: tl.constexpr, HAS_BIAS: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_begin(USE_PDL)
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BK_W)):  # one weight block column (= one activation group)
        part = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, BK_W, BLOCK_K):
            part += fp8_tile_dot(a_ptr, b_ptr, offs_m, offs_n, kb * BK_W + k0 + tl.arange(0, BLOCK_K), mask_m,
                                 mask_n, K, stride_am, stride_bn, UPCAST)
        a_s = tl.load(as_ptr + offs_m * stride_as + kb, mask=mask_m, other=0.0)  # [BM]
        b_s = tl.load(bs_ptr + (offs_n // BN_W) * stride_bs + kb, mask=mask_n, other=0.0)  # [BN]
        acc += part * a_s[:, None] * b_s[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=mask_m[:, None] & mask_n[None, :])


def _validate_gemm(x_q, x_scale, w_q, w_scale, block, bias, out_dtype):
    M, N, K = check_gemm_operands(x_q, w_q, bias, out_dtype)
    bn, bk = block
    _check_group(K, bk)
    check_tensor(x_scale, "x_scale", dtypes=(torch.float32,), shape=(M, K // bk))
    check_tensor(w_scale, "w_scale", dtypes=(torch.float32,), shape=(-(-N // bn), K // bk))
    return M, N, K


def fp8_block_gemm_ref(x_q: torch.Tensor, x_scale: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
                       block: tuple[int, int], bias: torch.Tensor | None = None,
                       out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Torch reference, in the kernel's order: per k block an fp32 matmul of the upcast codes
    (exact operands), scaled by x_scale[:, kb] and w_scale[n // bn, kb], summed in fp32."""
    M, N, K = _validate_gemm(x_q, x_scale, w_q, w_scale, block, bias, out_dtype)
    bn, bk = block
    ws = w_scale.repeat_interleave(bn, dim=0)[:N]  # [N, K / bk]
    acc = torch.zeros(M, N, dtype=torch.float32, device=x_q.device)
    for kb in range(K // bk):
        k = slice(kb * bk, (kb + 1) * bk)
        acc += (x_q[:, k].float() @ w_q[:, k].float().t()) * x_scale[:, kb:kb + 1] * ws[None, :, kb]
    if bias is not None:
        acc += bias.float()
    return acc.to(out_dtype)


def fp8_block_gemm(x_q: torch.Tensor, x_scale: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
                   block: tuple[int, int], bias: torch.Tensor | None = None,
                   out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Triton block-scaled FP8 GEMM; raises `QuantSpecError` below compute capability 8.9."""
    M, N, K = _validate_gemm(x_q, x_scale, w_q, w_scale, block, bias, out_dtype)
    device = check_same_device(x_q=x_q, x_scale=x_scale, w_q=w_q, w_scale=w_scale, bias=bias)
    check_fp8_device(device)
    on_gpu = gpu_launch(device)
    bn, bk = block
    bm = 16 if M <= 16 else 64 if M <= 64 else 128
    bn_tile = 128 if on_gpu else 32
    bk_tile = min(bk, 128 if on_gpu else 32)
    y = torch.empty((M, N), device=device, dtype=out_dtype)
    if M == 0:
        return y
    grid = (triton.cdiv(M, bm) * triton.cdiv(N, bn_tile),)
    _fp8_block_gemm_kernel[grid](
        x_q, w_q, x_scale, w_scale, bias if bias is not None else w_scale, y,
        M, N, K, x_q.stride(0), w_q.stride(0), x_scale.stride(0), w_scale.stride(0), y.stride(0),
        BN_W=bn, BK_W=bk, HAS_BIAS=bias is not None, UPCAST=not on_gpu,
        BLOCK_M=bm, BLOCK_N=bn_tile, BLOCK_K=bk_tile, GROUP_M=8, **pdl_kwargs(device),
        num_warps=4 if on_gpu else 1, num_stages=3 if on_gpu else 1,
        enable_fp_fusion=False,  # the scaling rounds as the reference
    )
    return y


def fp8_block_linear_ref(x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, block: tuple[int, int],
                         bias: torch.Tensor | None = None) -> torch.Tensor:
    """Reference FP8_BLOCK linear: x quantized per token and group of bk, block GEMM, x's dtype."""
    xq, xs = quantize_act_fp8_group_ref(x, block[1])
    return fp8_block_gemm_ref(xq, xs, w_q, w_scale, block, bias, x.dtype)


def fp8_block_linear(x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, block: tuple[int, int],
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """Triton FP8_BLOCK linear: x [M, K] quantized per token and group, block GEMM → [M, N] in
    x's dtype."""
    check_tensor(x, "x", ndim=2, dtypes=FLOAT_DTYPES)
    check_fp8_device(x.device)
    xq, xs = quantize_act_fp8_group(x, block[1])
    return fp8_block_gemm(xq, xs, w_q, w_scale, block, bias, x.dtype)
