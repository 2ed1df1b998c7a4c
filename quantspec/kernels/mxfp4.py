"""MXFP4 linear layers: y[M, N] = x[M, K] @ dequant(W)ᵀ (+ bias) with E2M1 weights in groups of
32 under power-of-two E8M0 scales and no global scale (OCP microscaling, compressed-tensors'
`mxfp4-pack-quantized`), weight-only or with MXFP4 activations (W4A4).

This file owns two Triton kernels, each beside its torch reference with the same signature:
  quantize_act_mxfp4 / _ref:  x [M, K] float → (codes float8_e4m3fn [M, K] holding E2M1 values,
      exponents uint8 [M, K / 32]); per row and group of 32 columns, in fp32: e =
      `quant.fp4.mx_exponents`(absmax) (absmax's bits + 2**21, masked to the exponent field E:
      absmax rounded to a power of two, up where its mantissa is ≥ 1.75; e = max(E - 2, 0), and
      255 where E is 255 — log2 of an fp32 infinity, as the reference has it), scale s = 2^(e - 127),
      codes = E2M1(clamp(x / s, ±6)), nearest, ties to even (`quant.fp4.round_to_e2m1`).
  mxfp4_linear / _ref:  x [M, K] fp32/fp16/bf16, packed uint8 [N, K / 2], scale uint8 [N, K / 32]
      E8M0 exponents (+ bias [N]) → y [M, N] in x's dtype, W = code · 2^(e - 127); with
      `quantize_input` the rows of x are first replaced by their MXFP4 fake quantization
      x̂ = codes · s (as above).

Layout: the packed codes are NVFP4's (`quant.fp4.pack_fp4`, decoded by `fp4._fp4_codes_tile`);
an E8M0 byte e ≥ 1 is the fp32 whose bits are e << 23 (2^(e - 127); 255 gives +inf, as
`quant.fp4.mx_values` does), e = 0 the subnormal 2^-127 (bits 0x00400000): integer ops and a
bitcast, no fp8 instruction and nothing transcendental in the k loop.

The numbers. 2^(e - 127) spans 2^-127 .. 2^127, far outside fp16's 2^-24 .. 65504, so no scaled
weight is ever formed in x's dtype: the GEMM takes each k tile one group of 32 columns at a time,
dots x's 32 columns with the group's bare codes (exact in fp16, bf16 and fp32) into fp32, and
multiplies that partial sum by the group's scale, per output column, in fp32. For fp16 / bf16 x
each product x · code is exact in fp32 (at most 11 + 2 significant bits), and a power of two
scales a sum exactly unless it leaves fp32's normal range; for fp32 x (fp32 `ieee` dots) x · code
rounds as the reference's x · (code · 2^(e - 127)) does, apart from that range. So only the order
of the fp32 sums differs from the reference, which dequantizes W in fp32 and multiplies in fp32.
W4A4 quantizes each [BLOCK_M, 32] tile of x inside the k loop (the `tl` function of
`quantize_act_mxfp4`, so its codes and scales are that kernel's, bit for bit): the dot of x's
codes with W's codes is exact in fp16 with exact fp32 sums (multiples of 0.25 up to 32 · 36),
then scaled by the row's activation scale and the column's weight scale in fp32.
The reference forms W in fp32, where code · 2^(e - 127) overflows for e = 254 with |code| ≥ 2 and
e = 253 with |code| ≥ 4; the kernel never forms W, so there it stays finite where the sum is.
Quantizing finite weights never gives those exponents (E ≤ 254 → e ≤ 252; e = 255, E8M0's NaN,
comes out +inf in both). The division x / s is IEEE (`div_rn`, subnormal s = 2^-127 included).
Launches take `fp4.NVFP4Config` / `nvfp4_default_config` as they are: BLOCK_K a multiple of 32
holds whole MX groups too. Small M splits K (`_common.split_k_buffers`).
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
    grouped_tile,
    pdl_begin,
    pdl_kwargs,
    split_k_buffers,
    split_k_partials,
    split_k_range,
)
from quantspec.kernels.fp4 import (
    NVFP4Config,
    _check_config,
    _fp4_codes_tile,
    _round_to_e2m1,
    nvfp4_default_config,
)

__all__ = ["mxfp4_linear", "mxfp4_linear_ref", "quantize_act_mxfp4", "quantize_act_mxfp4_ref"]

GROUP = 32  # MXFP4's group: one E8M0 exponent per 32 columns
# the kernels' constants (globals a kernel reads must be constexpr)
_GROUP = tl.constexpr(GROUP)
_E2M1_MAX = tl.constexpr(6.0)
_POW2_ROUND = tl.constexpr(0x200000)  # half of E2M1's mantissa step in fp32's bits: round up from 1.75
_EXP_MASK = tl.constexpr(0x7F800000)  # fp32's exponent field
_E2M1_EMAX = tl.constexpr(2)  # floor(log2(6)): the group's absmax lands in E2M1's top binade
_E8M0_INF = tl.constexpr(255)  # an infinite (rounded) absmax: the reference's log2(inf), clamped
_E8M0_ZERO_BITS = tl.constexpr(0x00400000)  # fp32 bits of 2**-127 (subnormal), the scale of e = 0


@triton.jit
def _e8m0_values(e):
    """E8M0 exponents (int32, 0..255) → 2^(e - 127) as fp32, exactly: the fp32 whose bits are
    e << 23 for e ≥ 1 (255: +inf), the subnormal 2**-127 for e = 0."""
    return tl.where(e == 0, _E8M0_ZERO_BITS, e << 23).to(tl.float32, bitcast=True)


@triton.jit
def _mxfp4_act_tile(x, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """An activation tile x [BLOCK_M, BLOCK_K] (fp32, whole groups of 32) → (E2M1 codes [BLOCK_M,
    BLOCK_K / 32, 32] fp32, exponents int32 [BLOCK_M, BLOCK_K / 32], scales 2^(e - 127) fp32
    [BLOCK_M, BLOCK_K / 32]), each step as `quant.fp4.mx_exponents` and `round_to_e2m1` take it
    (IEEE division); an all-zero (or zero-padded) group gets e = 0 and zero codes."""
    xg = tl.reshape(x, (BLOCK_M, BLOCK_K // 32, 32))
    a = tl.max(tl.abs(xg), axis=2)  # [BM, BK/32] absmax per group
    E = ((a.to(tl.int32, bitcast=True) + _POW2_ROUND) & _EXP_MASK) >> 23  # absmax's power of two
    e = tl.where(E == _E8M0_INF, _E8M0_INF, tl.maximum(E - _E2M1_EMAX, 0))
    s = _e8m0_values(e)  # never 0 in fp32 (2**-127 is a subnormal), so no 0 → 1 replacement
    v = tl.math.div_rn(xg, s[:, :, None])
    v = tl.minimum(tl.maximum(v, -_E2M1_MAX), _E2M1_MAX)
    return _round_to_e2m1(v), e, s


@triton.jit
def _quantize_act_mxfp4_kernel(x_ptr, q_ptr, e_ptr, M, K, stride_xm, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                               USE_PDL: tl.constexpr):
    pdl_begin(USE_PDL)
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    offs_k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)  # [BK]
    offs_g = tl.program_id(1) * (BLOCK_K // 32) + tl.arange(0, BLOCK_K // 32)  # [BK/32]
    mask_m = offs_m < M
    mask = mask_m[:, None] & (offs_k < K)[None, :]
    x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=mask, other=0.0).to(tl.float32)
    codes, e, _ = _mxfp4_act_tile(x, BLOCK_M, BLOCK_K)
    codes = tl.reshape(codes, (BLOCK_M, BLOCK_K))
    tl.store(q_ptr + offs_m[:, None] * K + offs_k[None, :], codes.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(e_ptr + offs_m[:, None] * (K // 32) + offs_g[None, :], e.to(tl.uint8),
             mask=mask_m[:, None] & (offs_g < K // 32)[None, :])


@triton.jit
def _mxfp4_group_dot(acc, x_ptr, w_ptr, s_ptr, offs_m, offs_n, mask_m, mask_n, kg, K, stride_xm, stride_wn,
                     stride_sn, W4A4: tl.constexpr, DOT_FP32: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr):
    """acc [BM, BN] fp32 plus x's 32 columns at kg (a group's) times the group's weight: the dot
    with the bare codes in fp32, then times each column's scale 2^(e - 127) in fp32 (module
    docstring). A group past K adds zeros."""
    codes = _fp4_codes_tile(w_ptr, offs_n, mask_n, kg, K, stride_wn, BLOCK_N, _GROUP)  # [BN, 32]
    in_k = (offs_n * 0 + kg) < K  # [BN] (a scalar mask does not broadcast under the interpreter)
    e = tl.load(s_ptr + offs_n * stride_sn + kg // 32, mask=mask_n & in_k, other=127)  # [BN] uint8
    s_w = _e8m0_values(e.to(tl.int32))  # [BN]
    offs_k = kg + tl.arange(0, _GROUP)  # [32]
    x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                mask=mask_m[:, None] & (offs_k < K)[None, :], other=0.0)  # [BM, 32]
    if W4A4:  # codes · codes: exact in fp16, as are their sums in fp32
        x_codes, _, s_x = _mxfp4_act_tile(x.to(tl.float32), BLOCK_M, _GROUP)  # [BM, 1, 32], [BM, 1]
        part = tl.dot(tl.reshape(x_codes, (BLOCK_M, _GROUP)).to(tl.float16), tl.trans(codes.to(tl.float16)))
        part = part * tl.reshape(s_x, (BLOCK_M,))[:, None]
    elif DOT_FP32:
        part = tl.dot(x.to(tl.float32), tl.trans(codes), input_precision="ieee")
    else:
        part = tl.dot(x, tl.trans(codes.to(x_ptr.dtype.element_ty)))
    return acc + part * s_w[None, :]


@triton.jit
def _mxfp4_linear_kernel(
    x_ptr, w_ptr, s_ptr, b_ptr, out_ptr, y_ptr, cnt_ptr,
    M, N, K, stride_xm, stride_wn, stride_sn, stride_om, stride_osplit,
    W4A4: tl.constexpr, HAS_BIAS: tl.constexpr, DOT_FP32: tl.constexpr,
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
        for g in tl.static_range(BLOCK_K // 32):  # one scale per row of W and group of 32
            acc = _mxfp4_group_dot(acc, x_ptr, w_ptr, s_ptr, offs_m, offs_n, mask_m, mask_n, k0 + g * 32, K,
                                   stride_xm, stride_wn, stride_sn, W4A4, DOT_FP32, BLOCK_M, BLOCK_N)
    out_mask = mask_m[:, None] & mask_n[None, :]
    acc, y_mask = split_k_partials(acc, out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], out_mask,
                                   stride_osplit, tl.program_id(1), cnt_ptr, pid, SPLIT_K, FINISH)
    if SPLIT_K == 1 or FINISH:
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + offs_m[:, None] * stride_om + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=y_mask)


def _check_x(x: object) -> tuple[int, int]:
    check_tensor(x, "x", ndim=2, dtypes=FLOAT_DTYPES)
    M, K = x.shape
    if K % GROUP:
        raise QuantSpecError(f"MXFP4 kernels need K to be a multiple of {GROUP} (whole groups of {GROUP}), "
                             f"got K={K}")
    return M, K


def _validate(x, packed, scale, bias) -> tuple[int, int, int]:
    """(M, N, K) after checking every tensor argument of `mxfp4_linear`."""
    M, K = _check_x(x)
    check_tensor(packed, "packed", dtypes=(torch.uint8,), shape=(None, K // 2))
    N = packed.shape[0]
    check_tensor(scale, "scale", dtypes=(torch.uint8,), shape=(N, K // GROUP))
    if bias is not None:
        check_tensor(bias, "bias", dtypes=FLOAT_DTYPES, shape=(N,))
    return M, N, K


def _act_ref(xf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`quant.fp4`'s MXFP4 activation numbers of xf [M, K] fp32 → (codes fp32 [M, K / 32, 32],
    exponents uint8 [M, K / 32], scales fp32 [M, K / 32])."""
    from quantspec.quant.fp4 import E2M1_MAX, mx_exponents, mx_scales, round_to_e2m1

    xg = xf.reshape(xf.shape[0], -1, GROUP)  # [M, K/32, 32]
    absmax = xg.abs().amax(-1)  # [M, K/32]
    s = mx_scales(absmax)[0]  # [M, K/32] fp32, 0 → 1
    return round_to_e2m1((xg / s[..., None]).clamp(-E2M1_MAX, E2M1_MAX)), mx_exponents(absmax), s


def quantize_act_mxfp4_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference: `quant.fp4`'s MXFP4 activation quantizer on x [M, K] in fp32 → (codes
    float8_e4m3fn [M, K], exponents uint8 [M, K / 32])."""
    M, K = _check_x(x)
    codes, e, _ = _act_ref(x.float())
    return codes.reshape(M, K).to(torch.float8_e4m3fn), e


def quantize_act_mxfp4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton MXFP4 activation quantizer: x [M, K] → (codes float8_e4m3fn [M, K], exponents
    uint8 [M, K / 32]), equal to `quantize_act_mxfp4_ref` bit for bit."""
    M, K = _check_x(x)
    device = check_same_device(x=x)
    q = torch.empty((M, K), device=device, dtype=torch.float8_e4m3fn)
    e = torch.empty((M, K // GROUP), device=device, dtype=torch.uint8)
    bm, bk = (16, 128) if gpu_launch(device) else (16, 32)
    if M:
        _quantize_act_mxfp4_kernel[(triton.cdiv(M, bm), triton.cdiv(K, bk))](
            x, q, e, M, K, x.stride(0), BLOCK_M=bm, BLOCK_K=bk, **pdl_kwargs(device))
    return q, e


def mxfp4_linear_ref(
    x: torch.Tensor,  # [M, K] fp32/fp16/bf16
    packed: torch.Tensor,  # [N, K/2] uint8, two E2M1 codes per byte
    scale: torch.Tensor,  # [N, K/32] uint8 E8M0 exponents
    bias: torch.Tensor | None = None,  # [N]
    *,
    quantize_input: bool = False,  # W4A4
    config: NVFP4Config | None = None,
) -> torch.Tensor:
    """Torch reference: W = codes · 2^(e - 127) in fp32 (`quant.fp4.unpack_fp4`, `mx_values`), x
    fake-quantized with `quant.fp4`'s MXFP4 numbers where `quantize_input`, one fp32 matmul
    (+ bias), cast to x's dtype. `config` is the kernel's launch, ignored here."""
    _validate(x, packed, scale, bias)
    from quantspec.quant.fp4 import mx_values, unpack_fp4

    M, K = x.shape
    w = unpack_fp4(packed, K).float() * mx_values(scale, torch.float32).repeat_interleave(GROUP, dim=1)  # [N, K]
    xf = x.float()  # [M, K]
    if quantize_input:
        codes, _, s = _act_ref(xf)  # [M, K/32, 32], [M, K/32]
        xf = (codes * s[..., None]).reshape(M, K)
    y = xf @ w.t()  # [M, N]
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def mxfp4_linear(
    x: torch.Tensor,  # [M, K] fp32/fp16/bf16
    packed: torch.Tensor,  # [N, K/2] uint8, two E2M1 codes per byte
    scale: torch.Tensor,  # [N, K/32] uint8 E8M0 exponents
    bias: torch.Tensor | None = None,  # [N]
    *,
    quantize_input: bool = False,  # W4A4
    config: NVFP4Config | None = None,
) -> torch.Tensor:
    """Triton MXFP4 linear → [M, N] in x's dtype: weight-only, or W4A4 with `quantize_input` (x
    quantized per group inside the GEMM, module docstring). `config` overrides the launch
    heuristic (`fp4.nvfp4_default_config`; tests, benchmarks)."""
    M, N, K = _validate(x, packed, scale, bias)
    device = check_same_device(x=x, packed=packed, scale=scale, bias=bias)
    cfg = config or nvfp4_default_config(M, N, K, gpu_launch(device))
    _check_config(cfg, device)
    bm, bn, bk, split, warps, stages = cfg
    grid = (triton.cdiv(M, bm) * triton.cdiv(N, bn), split)
    part, out, counters = split_k_buffers(M, N, split, grid[0], device, x.dtype, in_kernel=bm <= 16)
    if M == 0 or N == 0:
        return out
    w4a4 = bool(quantize_input)
    _mxfp4_linear_kernel[grid](
        x, packed, scale, bias if bias is not None else x, part, out, counters if counters is not None else out,
        M, N, K, x.stride(0), packed.stride(0), scale.stride(0), N, 0 if split == 1 else M * N,
        W4A4=w4a4, HAS_BIAS=bias is not None, DOT_FP32=not w4a4 and dot_in_fp32(x.dtype),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, SPLIT_K=split, FINISH=counters is not None,
        num_warps=warps, num_stages=stages, **pdl_kwargs(device),
    )
    return finish_split_k(part, bias, out) if split > 1 and counters is None else out
