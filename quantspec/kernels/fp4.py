"""NVFP4 linear layers: y[M, N] = x[M, K] @ dequant(W)ᵀ (+ bias) with E2M1 weights in groups of
16 under FP8 E4M3 local scales and one fp32 global scale (compressed-tensors'
`nvfp4-pack-quantized`), weight-only (NVFP4A16) or with NVFP4 activations (W4A4, "nvfp4").

This file owns two Triton kernels, each beside its torch reference with the same signature:
  quantize_act_nvfp4 / _ref:  x [M, K] float, input global scale g fp32 [1] → (codes
      float8_e4m3fn [M, K] holding E2M1 values, local scales fp32 [M, K / 16]); per row and group
      of 16 columns: local = float8_e4m3fn(clamp(absmax / 6 · g, ±448)) (0 → 0.125), codes =
      E2M1(clamp(x / (local / g), ±6)), nearest, ties to even — `quant.primitives`' numbers.
  nvfp4_linear / _ref:  x [M, K] fp32/fp16/bf16, packed uint8 [N, K / 2], scale float8_e4m3fn
      [N, K / 16], global_scale fp32 [1] (+ bias [N]) → y [M, N] in x's dtype, where
      W = code · (local / global); with `input_global_scale` the rows of x are first replaced by
      their NVFP4 fake quantization x̂ = codes · (local / g) (as above).

Layout (`quant.fp4.pack_fp4`): byte j of a row holds column 2j in its low nibble and 2j + 1 in
its high one; a nibble is the index of |q| in (0, 0.5, 1, 1.5, 2, 3, 4, 6) | sign << 3.

The GEMM decodes the nibbles in its k loop (no dequantized weight in memory): a [BLOCK_N,
BLOCK_K / 2] byte tile is split into low and high nibbles, each nibble's bits are placed in an
fp16's exponent and mantissa (the fp16 is then the E2M1 value · 2**-14), the scales' bytes the
same way (an E4M3 byte's bits are an fp16 of its value · 2**-8), so no fp8 instruction is needed
and the kernel runs on any GPU. A code times its local scale is exact in fp32, fp16 and bf16 (at
most 6 significant bits, within fp16's normal range), so the weight tile enters `tl.dot` exactly
in x's dtype (fp32 for fp32 x, and under the interpreter, which has no bf16 dot), and the global
scale divides the fp32 sums once, in the epilogue. W4A4 quantizes each [BLOCK_M, BLOCK_K] tile
of x inside the GEMM's k loop (the same `tl` function as `quantize_act_nvfp4`, so its codes and
scales are that kernel's, bit for bit): x's codes times their local scales are exact in fp16 as
well, so both operands of the dot are fp16, and the epilogue divides by both global scales. Each
column tile's programs quantize their rows again: no second launch and no codes in memory, at a
cost that is small beside the dots for the M of decode and verification.
Only the order of the fp32 sums (and the one division) differs from the reference, which
dequantizes in fp32 and multiplies in fp32. BLOCK_K is a multiple of 32 (K % 32 == 0): a k tile
holds whole groups and whole bytes. Small M splits K (`_common.split_k_buffers`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from quantspec.errors import QuantSpecError
from quantspec.kernels._common import (
    FLOAT_DTYPES,
    FP8_E4M3_MAX,
    MAX_SPLIT_K,
    SM_TARGET,
    check_same_device,
    check_tensor,
    dot_in_fp32,
    finish_split_k,
    gpu_launch,
    grouped_tile,
    pdl_begin,
    pdl_kwargs,
    round_to_e4m3,
    split_k_buffers,
    split_k_partials,
    split_k_range,
)

__all__ = ["NVFP4Config", "nvfp4_default_config", "nvfp4_linear", "nvfp4_linear_ref", "quantize_act_nvfp4",
           "quantize_act_nvfp4_ref"]

GROUP = 16  # NVFP4's group: one local scale per 16 columns
K_ALIGN = 32  # K and BLOCK_K: whole groups and whole bytes per k tile
# the kernels' constants (globals a kernel reads must be constexpr)
_E2M1_MAX = tl.constexpr(6.0)
_FP8_MAX = tl.constexpr(FP8_E4M3_MAX)
_EMPTY_GROUP_SCALE = tl.constexpr(0.125)  # an all-zero group's local scale (FP8's eps, `quant.fp4.local_scales`)
_E2M1_FP16_UNIT = tl.constexpr(16384.0)  # 2**14: an E2M1 nibble's bits placed in an fp16 give its value · 2**-14
_E4M3_FP16_UNIT = tl.constexpr(256.0)  # 2**8: an E4M3 byte's bits placed in an fp16 give its value · 2**-8


class NVFP4Config(NamedTuple):
    """One launch of `nvfp4_linear`: tile sizes (BLOCK_K a multiple of 32), split-K, warps, stages."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 1


def nvfp4_default_config(M: int, N: int, K: int, on_gpu: bool) -> NVFP4Config:
    """Launch heuristic. GPU: up to 16 rows (decode, verification) one launch shape, so that a
    row's numbers do not depend on the other rows: [16, 128] tiles over 128-k tiles, split-K to
    about `SM_TARGET` programs (at least two k tiles per split, partial sums bounded by the
    weight's bytes); 17–64 rows, 32- or 64-row tiles; more rows, [128, 128] tiles over 64-k tiles
    (a W4A4 tile's quantization fits the registers), no split. CPU interpreter: small tiles that
    exercise the masks, split-K for up to 4 rows."""
    if not on_gpu:
        return NVFP4Config(16, 32, 32, 2 if M <= 4 and K >= 2 * K_ALIGN else 1, 4, 1)
    if M > 64:
        return NVFP4Config(128, 128, 64, 1, 8, 3)
    bm = 16 if M <= 16 else 32 if M <= 32 else 64
    tiles = triton.cdiv(M, bm) * triton.cdiv(N, 128)
    split = max(1, min(MAX_SPLIT_K, triton.cdiv(K, 128) // 2, triton.cdiv(SM_TARGET, tiles),
                       K // (32 * max(M, 16))))
    return NVFP4Config(bm, 128, 128, split, 4, 3)


@triton.jit
def _e2m1_values(nib):
    """Nibbles (int32, 0..15: magnitude index | sign << 3) → their E2M1 values as fp32. The
    index's three bits (exponent 2, mantissa 1) become the fp16 bits 9..11 and the sign bit 15:
    that fp16 is the value · 2**-14 (0.5 a subnormal), exact in fp32, then scaled by 2**14."""
    bits = ((nib & 0x8) << 12) | ((nib & 0x7) << 9)
    return bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32) * _E2M1_FP16_UNIT


@triton.jit
def _e4m3_values(b):
    """float8_e4m3fn bytes (int32, 0..255; no NaN) → their values as fp32: the 7 exponent and
    mantissa bits shifted into an fp16 (bits 7..14, the sign to 15) give the value · 2**-8
    (E4M3's subnormals fp16 subnormals), exact in fp32, then scaled by 2**8."""
    bits = ((b & 0x80) << 8) | ((b & 0x7F) << 7)
    return bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32) * _E4M3_FP16_UNIT


@triton.jit
def _round_to_e2m1(v):
    """fp32 v already clamped to ±6 → the nearest E2M1 value, ties to even (`quant.fp4.round_to_e2m1`'s
    thresholds); a negative v that rounds to zero gives -0.0, as torch does."""
    a = tl.abs(v)
    m = tl.where(a > 5.0, 6.0, tl.where(a >= 3.5, 4.0, tl.where(a > 2.5, 3.0, tl.where(
        a >= 1.75, 2.0, tl.where(a > 1.25, 1.5, tl.where(a >= 0.75, 1.0, tl.where(a > 0.25, 0.5, 0.0)))))))
    return tl.where(v < 0.0, m * -1.0, m)  # a product keeps the sign of zero (0 - m would not)


@triton.jit
def _nvfp4_act_tile(x, g, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """An activation tile x [BLOCK_M, BLOCK_K] (fp32, whole groups of 16), input global scale g →
    (E2M1 codes [BLOCK_M, BLOCK_K / 16, 16] fp32, local scales [BLOCK_M, BLOCK_K / 16] fp32), each
    step rounded as `quant.primitives` rounds it (IEEE divisions); a zero-padded group gets
    scale 0.125 and zero codes."""
    xg = tl.reshape(x, (BLOCK_M, BLOCK_K // 16, 16))
    a = tl.max(tl.abs(xg), axis=2)  # [BM, BK/16] absmax per group
    local = round_to_e4m3(tl.minimum(tl.math.div_rn(a, _E2M1_MAX) * g, _FP8_MAX))
    local = tl.where(local == 0.0, _EMPTY_GROUP_SCALE, local)
    eff = tl.math.div_rn(local, g)  # the effective scale local / g
    v = tl.math.div_rn(xg, eff[:, :, None])
    v = tl.minimum(tl.maximum(v, -_E2M1_MAX), _E2M1_MAX)
    return _round_to_e2m1(v), local


@triton.jit
def _quantize_act_nvfp4_kernel(x_ptr, q_ptr, s_ptr, g_ptr, M, K, stride_xm, BLOCK_M: tl.constexpr,
                               BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_begin(USE_PDL)
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    offs_k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)  # [BK]
    offs_g = tl.program_id(1) * (BLOCK_K // 16) + tl.arange(0, BLOCK_K // 16)  # [BK/16]
    mask_m = offs_m < M
    mask = mask_m[:, None] & (offs_k < K)[None, :]
    x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=mask, other=0.0).to(tl.float32)
    codes, local = _nvfp4_act_tile(x, tl.load(g_ptr), BLOCK_M, BLOCK_K)
    codes = tl.reshape(codes, (BLOCK_M, BLOCK_K))
    tl.store(q_ptr + offs_m[:, None] * K + offs_k[None, :], codes.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + offs_m[:, None] * (K // 16) + offs_g[None, :], local,
             mask=mask_m[:, None] & (offs_g < K // 16)[None, :])


@triton.jit
def _fp4_codes_tile(w_ptr, offs_n, mask_n, k0, K, stride_wn, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The E2M1 codes of the packed weight's tile [BLOCK_N, BLOCK_K] at columns k0.. (k0 even) as
    fp32 values: bytes [BN, BK/2] → low and high nibbles, joined into k order (k = 2j + h). Past
    K or N: zeros. NVFP4's and MXFP4's (`kernels.mxfp4`) layout alike."""
    offs_b = k0 // 2 + tl.arange(0, BLOCK_K // 2)  # [BK/2] the tile's bytes
    b = tl.load(w_ptr + offs_n[:, None] * stride_wn + offs_b[None, :],
                mask=mask_n[:, None] & (offs_b < K // 2)[None, :], other=0).to(tl.int32)  # [BN, BK/2]
    codes = tl.join(_e2m1_values(b & 0xF), _e2m1_values(b >> 4))  # [BN, BK/2, 2]
    return tl.reshape(codes, (BLOCK_N, BLOCK_K))


@triton.jit
def _nvfp4_weight_tile(w_ptr, s_ptr, offs_n, mask_n, k0, K, stride_wn, stride_sn, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr):
    """The weight tile [BLOCK_N, BLOCK_K] at columns k0.. as code · local scale in fp32 (exact;
    the global scale is the epilogue's): the codes (`_fp4_codes_tile`) times each group's scale
    ([BN, BK/16] bytes). Past K or N: zeros."""
    codes = _fp4_codes_tile(w_ptr, offs_n, mask_n, k0, K, stride_wn, BLOCK_N, BLOCK_K)  # [BN, BK]
    offs_g = k0 // 16 + tl.arange(0, BLOCK_K // 16)  # [BK/16] the tile's groups
    s = tl.load(s_ptr + offs_n[:, None] * stride_sn + offs_g[None, :],
                mask=mask_n[:, None] & (offs_g < K // 16)[None, :], other=0).to(tl.int32)  # [BN, BK/16]
    w = tl.reshape(codes, (BLOCK_N, BLOCK_K // 16, 16)) * _e4m3_values(s)[:, :, None]
    return tl.reshape(w, (BLOCK_N, BLOCK_K))


@triton.jit
def _nvfp4_linear_kernel(
    x_ptr, w_ptr, s_ptr, gw_ptr, gx_ptr, b_ptr, out_ptr, y_ptr, cnt_ptr,
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
    g = tl.load(gw_ptr)
    if W4A4:
        g_x = tl.load(gx_ptr)
        g = g * g_x
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        w = _nvfp4_weight_tile(w_ptr, s_ptr, offs_n, mask_n, k0, K, stride_wn, stride_sn, BLOCK_N, BLOCK_K)
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                    mask=mask_m[:, None] & (offs_k < K)[None, :], other=0.0)  # [BM, BK]
        if W4A4:  # codes · local scale: exact in fp16, as is the weight tile
            codes, local = _nvfp4_act_tile(x.to(tl.float32), g_x, BLOCK_M, BLOCK_K)
            xq = tl.reshape(codes * local[:, :, None], (BLOCK_M, BLOCK_K)).to(tl.float16)
            acc = tl.dot(xq, tl.trans(w.to(tl.float16)), acc)
        elif DOT_FP32:
            acc = tl.dot(x.to(tl.float32), tl.trans(w), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, tl.trans(w.to(x_ptr.dtype.element_ty)), acc)
    acc = acc * tl.math.div_rn(1.0, g)  # the global scale(s), once per output
    out_mask = mask_m[:, None] & mask_n[None, :]
    acc, y_mask = split_k_partials(acc, out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], out_mask,
                                   stride_osplit, tl.program_id(1), cnt_ptr, pid, SPLIT_K, FINISH)
    if SPLIT_K == 1 or FINISH:
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + offs_m[:, None] * stride_om + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=y_mask)


def _check_global(t: object, name: str) -> None:
    check_tensor(t, name, dtypes=(torch.float32,))
    if t.numel() != 1:
        raise QuantSpecError(f"{name} must hold one fp32 value (one per tensor), got shape {list(t.shape)}")


def _check_x(x: object) -> tuple[int, int]:
    check_tensor(x, "x", ndim=2, dtypes=FLOAT_DTYPES)
    M, K = x.shape
    if K % K_ALIGN:
        raise QuantSpecError(f"NVFP4 kernels need K to be a multiple of {K_ALIGN} (whole groups of {GROUP} "
                             f"and whole bytes per k tile), got K={K}")
    return M, K


def _validate(x, packed, scale, global_scale, bias, input_global_scale) -> tuple[int, int, int]:
    """(M, N, K) after checking every argument of `nvfp4_linear`."""
    M, K = _check_x(x)
    check_tensor(packed, "packed", dtypes=(torch.uint8,), shape=(None, K // 2))
    N = packed.shape[0]
    check_tensor(scale, "scale", dtypes=(torch.float8_e4m3fn,), shape=(N, K // GROUP))
    _check_global(global_scale, "global_scale")
    if input_global_scale is not None:
        _check_global(input_global_scale, "input_global_scale")
    if bias is not None:
        check_tensor(bias, "bias", dtypes=FLOAT_DTYPES, shape=(N,))
    return M, N, K


def _check_config(cfg: NVFP4Config, device: torch.device) -> None:
    bm, bn, bk, split = cfg[:4]
    if bk % K_ALIGN or split < 1 or any(v < 1 or v & (v - 1) for v in (bm, bn, bk)):
        raise QuantSpecError(f"NVFP4Config {tuple(cfg)}: tiles must be powers of two, block_k a multiple of "
                             f"{K_ALIGN}, split_k at least 1")
    if gpu_launch(device) and min(bm, bn) < 16:
        raise QuantSpecError(f"NVFP4Config {tuple(cfg)}: a GPU's tl.dot needs block_m and block_n >= 16")


def _act_args():
    from quantspec.quant.args import QuantArgs

    return QuantArgs(num_bits=4, type="float", strategy="tensor_group", group_size=GROUP, dynamic="local")


def quantize_act_nvfp4_ref(x: torch.Tensor, input_global_scale: torch.Tensor
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference: `quant.primitives`' NVFP4 activation quantizer on x [M, K] in fp32 →
    (codes float8_e4m3fn [M, K], local scales fp32 [M, K / 16])."""
    _check_x(x)
    _check_global(input_global_scale, "input_global_scale")
    from quantspec.quant.primitives import choose_qparams, quantize

    ia, xf = _act_args(), x.float()
    scale, _ = choose_qparams(xf, ia, global_scale=input_global_scale)  # [M, K/16]
    return quantize(xf, scale, None, ia, global_scale=input_global_scale), scale


def quantize_act_nvfp4(x: torch.Tensor, input_global_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton NVFP4 activation quantizer: x [M, K] → (codes float8_e4m3fn [M, K], local scales
    fp32 [M, K / 16]), equal to `quantize_act_nvfp4_ref` bit for bit."""
    M, K = _check_x(x)
    _check_global(input_global_scale, "input_global_scale")
    device = check_same_device(x=x, input_global_scale=input_global_scale)
    q = torch.empty((M, K), device=device, dtype=torch.float8_e4m3fn)
    s = torch.empty((M, K // GROUP), device=device, dtype=torch.float32)
    bm, bk = (16, 128) if gpu_launch(device) else (16, 32)
    if M:
        _quantize_act_nvfp4_kernel[(triton.cdiv(M, bm), triton.cdiv(K, bk))](
            x, q, s, input_global_scale, M, K, x.stride(0), BLOCK_M=bm, BLOCK_K=bk, **pdl_kwargs(device))
    return q, s


def nvfp4_linear_ref(
    x: torch.Tensor,  # [M, K] fp32/fp16/bf16
    packed: torch.Tensor,  # [N, K/2] uint8, two E2M1 codes per byte
    scale: torch.Tensor,  # [N, K/16] float8_e4m3fn local scales
    global_scale: torch.Tensor,  # [1] fp32 weight_global_scale
    bias: torch.Tensor | None = None,  # [N]
    input_global_scale: torch.Tensor | None = None,  # [1] fp32: W4A4
    config: NVFP4Config | None = None,
) -> torch.Tensor:
    """Torch reference: W dequantized with `quant.primitives` in fp32, x fake-quantized the same
    way where `input_global_scale` is given, one fp32 matmul (+ bias), cast to x's dtype.
    `config` is the kernel's launch, ignored here."""
    _validate(x, packed, scale, global_scale, bias, input_global_scale)
    from quantspec.quant.args import QuantArgs
    from quantspec.quant.fp4 import unpack_fp4
    from quantspec.quant.primitives import choose_qparams, dequantize, fake_quantize

    K = x.shape[1]
    wa = QuantArgs(num_bits=4, type="float", strategy="tensor_group", group_size=GROUP)
    w = dequantize(unpack_fp4(packed, K), scale.float(), None, wa, dtype=torch.float32,
                   global_scale=global_scale)  # [N, K]
    xf = x.float()  # [M, K]
    if input_global_scale is not None:
        ia = _act_args()
        s, _ = choose_qparams(xf, ia, global_scale=input_global_scale)  # [M, K/16]
        xf = fake_quantize(xf, s, None, ia, global_scale=input_global_scale)
    y = xf @ w.t()  # [M, N]
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def nvfp4_linear(
    x: torch.Tensor,  # [M, K] fp32/fp16/bf16
    packed: torch.Tensor,  # [N, K/2] uint8, two E2M1 codes per byte
    scale: torch.Tensor,  # [N, K/16] float8_e4m3fn local scales
    global_scale: torch.Tensor,  # [1] fp32 weight_global_scale
    bias: torch.Tensor | None = None,  # [N]
    input_global_scale: torch.Tensor | None = None,  # [1] fp32: W4A4
    config: NVFP4Config | None = None,
) -> torch.Tensor:
    """Triton NVFP4 linear → [M, N] in x's dtype: weight-only, or W4A4 where
    `input_global_scale` is given (x quantized per k tile inside the GEMM, module docstring).
    `config` overrides the launch heuristic (tests, benchmarks)."""
    M, N, K = _validate(x, packed, scale, global_scale, bias, input_global_scale)
    device = check_same_device(x=x, packed=packed, scale=scale, global_scale=global_scale, bias=bias,
                               input_global_scale=input_global_scale)
    cfg = config or nvfp4_default_config(M, N, K, gpu_launch(device))
    _check_config(cfg, device)
    bm, bn, bk, split, warps, stages = cfg
    grid = (triton.cdiv(M, bm) * triton.cdiv(N, bn), split)
    part, out, counters = split_k_buffers(M, N, split, grid[0], device, x.dtype, in_kernel=bm <= 16)
    if M == 0 or N == 0:
        return out
    w4a4 = input_global_scale is not None
    _nvfp4_linear_kernel[grid](
        x, packed, scale.view(torch.uint8), global_scale, input_global_scale if w4a4 else global_scale,
        bias if bias is not None else global_scale, part, out, counters if counters is not None else out,
        M, N, K, x.stride(0), packed.stride(0), scale.stride(0), N, 0 if split == 1 else M * N,
        W4A4=w4a4, HAS_BIAS=bias is not None, DOT_FP32=not w4a4 and dot_in_fp32(x.dtype),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, SPLIT_K=split, FINISH=counters is not None,
        num_warps=warps, num_stages=stages, **pdl_kwargs(device),
    )
    return finish_split_k(part, bias, out) if split > 1 and counters is None else out
