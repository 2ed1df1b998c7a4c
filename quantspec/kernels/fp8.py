"""W8A8 FP8 (E4M3): static activation quantization and the fp8 × fp8 → fp32 GEMM.

This file owns two Triton kernels, each beside its torch reference with the same signature:
  quantize_act_fp8 / _ref:  x [M, K] float, static scale [1] -> x_q float8_e4m3fn [M, K],
      x_q = cast(clamp(x / scale, -448, 448)) (round to nearest even).
  fp8_gemm / _ref:  y = (x_q · w_qᵀ in fp32) * x_scale * w_scale[n or 0] (+ bias) -> out_dtype.
`fp8_linear` composes them.

Native fp8 `tl.dot` needs compute capability >= 8.9 (Ada, Hopper); on older GPUs the Triton
functions raise `QuantSpecError` and the caller falls back (dequantize to fp16/bf16). Under the
CPU interpreter the fp8 operands are upcast to fp32 before the dot (exact: every E4M3 value is an
fp32), so the quantization, the indexing and the epilogue are still tested there.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from quantspec.errors import QuantSpecError
from quantspec.kernels._common import (
    grouped_tile,
    FLOAT_DTYPES,
    FP8_E4M3_MAX,
    check_same_device,
    check_tensor,
    finish_scaled_split_k,
    gpu_launch,
    pdl_begin,
    pdl_kwargs,
    round_to_e4m3,
    scaled_gemm_launch,
    split_k_buffers,
    split_k_partials,
    split_k_range,
)

__all__ = [
    "FP8_MIN_CAPABILITY",
    "check_fp8_device",
    "check_gemm_operands",
    "fp8_gemm",
    "fp8_gemm_ref",
    "fp8_linear",
    "fp8_linear_ref",
    "fp8_scaled_mm_linear",
    "fp8_tile_dot",
    "quantize_act_fp8",
    "quantize_act_fp8_ref",
]

FP8_DTYPE = torch.float8_e4m3fn
FP8_MIN_CAPABILITY = (8, 9)


def check_fp8_device(device: torch.device) -> None:
    """Raise a clear `QuantSpecError` when `device` is a GPU without native FP8 (cc < 8.9)."""
    if device.type != "cuda":
        return
    cc = torch.cuda.get_device_capability(device)
    if cc < FP8_MIN_CAPABILITY:
        raise QuantSpecError(
            f"FP8 GEMM needs compute capability >= 8.9 but {torch.cuda.get_device_name(device)} is "
            f"{cc[0]}.{cc[1]}; dequantize the fp8 weights to fp16/bf16 (fp8_linear_ref) instead"
        )


@triton.jit
def _quantize_act_fp8_kernel(x_ptr, q_ptr, s_ptr, numel, FP8_MAX: tl.constexpr, BLOCK: tl.constexpr,
                             USE_PDL: tl.constexpr):
    pdl_begin(USE_PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    s = tl.load(s_ptr).to(tl.float32)
    v = tl.minimum(tl.maximum(tl.math.div_rn(x, s), -FP8_MAX), FP8_MAX)
    tl.store(q_ptr + offs, round_to_e4m3(v).to(q_ptr.dtype.element_ty), mask=mask)


def _validate_act(x, scale):
    check_tensor(x, "x", ndim=2, dtypes=FLOAT_DTYPES)
    check_tensor(scale, "x_scale", dtypes=(torch.float32,))
    if scale.numel() != 1:
        raise QuantSpecError(
            f"FP8 activation scale is static per-tensor (one value), got shape {list(scale.shape)}"
        )


def quantize_act_fp8_ref(
    x: torch.Tensor,  # [M, K] fp32/fp16/bf16
    scale: torch.Tensor,  # [1] or [] fp32 static scale
) -> torch.Tensor:
    """Torch reference: x_q float8_e4m3fn [M, K] using `quant/`'s fp8 quantizer."""
    _validate_act(x, scale)
    from quantspec.kernels._quant_bridge import quantize_fp8

    return quantize_fp8(x, scale.reshape(1))


def quantize_act_fp8(
    x: torch.Tensor,  # [M, K] fp32/fp16/bf16
    scale: torch.Tensor,  # [1] or [] fp32 static scale
) -> torch.Tensor:
    """Triton static FP8 activation quantizer -> float8_e4m3fn [M, K]."""
    _validate_act(x, scale)
    device = check_same_device(x=x, x_scale=scale)
    q = torch.empty(x.shape, device=device, dtype=FP8_DTYPE)
    block = 1024
    _quantize_act_fp8_kernel[(triton.cdiv(x.numel(), block),)](
        x, q, scale, x.numel(), FP8_MAX=FP8_E4M3_MAX, BLOCK=block, **pdl_kwargs(device)
    )
    return q


@triton.jit
def fp8_tile_dot(a_ptr, b_ptr, offs_m, offs_n, offs_k, mask_m, mask_n, K, stride_am, stride_bn,
                 UPCAST: tl.constexpr):
    """The fp32 [BM, BN] dot of one k tile of fp8 x [M, K] and w [N, K] (row-major), from zero.

    Hopper's fp8 MMA adds in fewer bits than fp32: each k tile's dot starts from zero and its sum
    joins the caller's fp32 accumulator (an fp32 add per tile, as DeepSeek-V3 promotes every
    128 k). Asking for exact accumulation (max_num_imprecise_acc=0) makes Triton convert the
    operands to fp16 for the pre-Hopper MMA instead. UPCAST (the interpreter): fp32 operands."""
    mask_k = offs_k < K
    a = tl.load(a_ptr + offs_m[:, None] * stride_am + offs_k[None, :],
                mask=mask_m[:, None] & mask_k[None, :], other=0.0)  # [BM, BK] fp8
    b = tl.load(b_ptr + offs_n[:, None] * stride_bn + offs_k[None, :],
                mask=mask_n[:, None] & mask_k[None, :], other=0.0)  # [BN, BK] fp8
    if UPCAST:
        return tl.dot(a.to(tl.float32), tl.trans(b.to(tl.float32)), input_precision="ieee")
    return tl.dot(a, tl.trans(b))


@triton.jit
def _fp8_gemm_kernel(
    a_ptr, b_ptr, as_ptr, bs_ptr, bias_ptr, out_ptr, y_ptr, cnt_ptr,
    M, N, K, stride_am, stride_bn, stride_om, stride_osplit,
    W_PER_CHANNEL: tl.constexpr, HAS_BIAS: tl.constexpr, UPCAST: tl.constexpr,
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
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        acc += fp8_tile_dot(a_ptr, b_ptr, offs_m, offs_n, k0 + tl.arange(0, BLOCK_K), mask_m, mask_n, K,
                            stride_am, stride_bn, UPCAST)
    out_mask = mask_m[:, None] & mask_n[None, :]
    acc, y_mask = split_k_partials(acc, out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], out_mask,
                                   stride_osplit, tl.program_id(1), cnt_ptr, pid, SPLIT_K, FINISH)
    if SPLIT_K == 1 or FINISH:
        a_s = tl.load(as_ptr).to(tl.float32)
        if W_PER_CHANNEL:
            b_s = tl.load(bs_ptr + offs_n, mask=mask_n, other=0.0)  # [BN]
        else:
            b_s = tl.load(bs_ptr + offs_n * 0)  # [BN], one per-tensor scale
        y = acc * a_s * b_s[None, :]
        if HAS_BIAS:
            y = y + tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + offs_m[:, None] * stride_om + offs_n[None, :], y.to(y_ptr.dtype.element_ty),
                 mask=y_mask)


def check_gemm_operands(x_q, w_q, bias, out_dtype) -> tuple[int, int, int]:
    """(M, N, K) of an FP8 GEMM's codes x_q [M, K] and w_q [N, K], after checking them, the bias
    [N] and the output dtype."""
    check_tensor(x_q, "x_q", ndim=2, dtypes=(FP8_DTYPE,))
    check_tensor(w_q, "w_q", ndim=2, dtypes=(FP8_DTYPE,))
    M, K = x_q.shape
    N = w_q.shape[0]
    if w_q.shape[1] != K:
        raise QuantSpecError(f"w_q has K={w_q.shape[1]} but x_q has K={K}; shapes must agree")
    if bias is not None:
        check_tensor(bias, "bias", dtypes=FLOAT_DTYPES, shape=(N,))
    if out_dtype not in FLOAT_DTYPES:
        raise QuantSpecError(f"out_dtype={out_dtype} must be float32, float16 or bfloat16")
    return M, N, K


def _validate_gemm(x_q, x_scale, w_q, w_scale, bias, out_dtype):
    M, N, K = check_gemm_operands(x_q, w_q, bias, out_dtype)
    check_tensor(x_scale, "x_scale", dtypes=(torch.float32,))
    if x_scale.numel() != 1:
        raise QuantSpecError(f"x_scale must hold one static value, got shape {list(x_scale.shape)}")
    check_tensor(w_scale, "w_scale", ndim=1, dtypes=(torch.float32,))
    if w_scale.shape[0] not in (1, N):
        raise QuantSpecError(f"w_scale has {w_scale.shape[0]} values; expected 1 or N={N}")
    return M, N, K


def fp8_gemm_ref(
    x_q: torch.Tensor,  # [M, K] float8_e4m3fn
    x_scale: torch.Tensor,  # [1] fp32
    w_q: torch.Tensor,  # [N, K] float8_e4m3fn
    w_scale: torch.Tensor,  # [N] or [1] fp32
    bias: torch.Tensor | None = None,  # [N]
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Torch reference: fp8 values upcast to fp32 (exact), fp32 matmul, scale epilogue."""
    _validate_gemm(x_q, x_scale, w_q, w_scale, bias, out_dtype)
    acc = x_q.float() @ w_q.float().t()  # [M, N]
    y = acc * x_scale.reshape(1).float() * w_scale[None, :]
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype)


def fp8_gemm(
    x_q: torch.Tensor,  # [M, K] float8_e4m3fn
    x_scale: torch.Tensor,  # [1] fp32
    w_q: torch.Tensor,  # [N, K] float8_e4m3fn
    w_scale: torch.Tensor,  # [N] or [1] fp32
    bias: torch.Tensor | None = None,  # [N]
    out_dtype: torch.dtype = torch.bfloat16,
    launch: tuple[int, ...] | None = None,
) -> torch.Tensor:
    """Triton FP8 GEMM; raises `QuantSpecError` on GPUs below compute capability 8.9. `launch`
    (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages, SPLIT_K) overrides `scaled_gemm_launch` (tests,
    benchmarks)."""
    M, N, K = _validate_gemm(x_q, x_scale, w_q, w_scale, bias, out_dtype)
    device = check_same_device(x_q=x_q, x_scale=x_scale, w_q=w_q, w_scale=w_scale, bias=bias)
    check_fp8_device(device)
    on_gpu = gpu_launch(device)
    bm, bn, bk, warps, stages, split = launch or scaled_gemm_launch(M, N, K, on_gpu)
    grid = (triton.cdiv(M, bm) * triton.cdiv(N, bn), split)
    part, out, counters = split_k_buffers(M, N, split, grid[0], device, out_dtype, torch.float32)
    _fp8_gemm_kernel[grid](
        x_q, w_q, x_scale, w_scale, bias if bias is not None else w_scale, part, out,
        counters if counters is not None else out,
        M, N, K, x_q.stride(0), w_q.stride(0), N, M * N,
        W_PER_CHANNEL=w_scale.shape[0] == N and N != 1, HAS_BIAS=bias is not None,
        UPCAST=not on_gpu, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, SPLIT_K=split,
        FINISH=counters is not None, **pdl_kwargs(device),
        num_warps=warps, num_stages=stages, enable_fp_fusion=False,  # the epilogue rounds as the reference
    )
    if split == 1 or counters is not None:
        return out
    return finish_scaled_split_k(part, x_scale.reshape(1), w_scale, bias, out)


def fp8_linear_ref(
    x: torch.Tensor,  # [M, K] fp32/fp16/bf16
    w_q: torch.Tensor,  # [N, K] float8_e4m3fn
    w_scale: torch.Tensor,  # [N] or [1] fp32
    x_scale: torch.Tensor,  # [1] fp32 static
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:
    """Reference FP8 linear: quantize x with its static scale, FP8 GEMM, output in x.dtype."""
    return fp8_gemm_ref(quantize_act_fp8_ref(x, x_scale), x_scale.reshape(1), w_q, w_scale, bias, x.dtype)


def fp8_linear(
    x: torch.Tensor,  # [M, K] fp32/fp16/bf16
    w_q: torch.Tensor,  # [N, K] float8_e4m3fn
    w_scale: torch.Tensor,  # [N] or [1] fp32
    x_scale: torch.Tensor,  # [1] fp32 static
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:
    """Triton FP8 linear: quantize x with its static scale, FP8 GEMM, output in x.dtype."""
    check_tensor(x, "x", ndim=2, dtypes=FLOAT_DTYPES)
    check_fp8_device(x.device)
    return fp8_gemm(quantize_act_fp8(x, x_scale), x_scale.reshape(1), w_q, w_scale, bias, x.dtype)


def fp8_scaled_mm_linear(
    x: torch.Tensor,  # [M, K] fp16/bf16
    w_q: torch.Tensor,  # [N, K] float8_e4m3fn
    w_scale: torch.Tensor,  # [N] or [1] fp32
    x_scale: torch.Tensor,  # [1] fp32 static
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:
    """The FP8 linear through torch's `_scaled_mm` (cuBLASLt / CUTLASS): x quantized by
    `quantize_act_fp8`, then one FP8 GEMM with row-wise scales (x's static scale on every row,
    w's per channel) writing bf16, cast to x.dtype; the reference is `fp8_linear_ref`. The
    op takes row counts in multiples of 16: x's rows are padded with zeros up to one."""
    check_tensor(x, "x", ndim=2, dtypes=FLOAT_DTYPES)
    check_fp8_device(x.device)
    M, K = x.shape
    N = w_q.shape[0]
    xq = quantize_act_fp8(x, x_scale)
    pad = (-M) % 16
    if pad:
        xq = torch.cat([xq.view(torch.uint8), xq.new_zeros((pad, K), dtype=torch.uint8)]).view(FP8_DTYPE)
    scale_a = x_scale.reshape(1, 1).float().expand(M + pad, 1).contiguous()
    scale_b = w_scale.float().reshape(1, -1).expand(1, N).contiguous()
    y = torch._scaled_mm(xq, w_q.t(), scale_a=scale_a, scale_b=scale_b, out_dtype=torch.bfloat16)[:M]
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y.to(x.dtype)
