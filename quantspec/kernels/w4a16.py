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

A k tile reads each of its int32 words once ([BLOCK_N, BLOCK_K/8]) and unpacks the 8 nibbles
of each word into consecutive k, or (`nibble_dots`, the GPU's launch for up to 16 rows) meets the
x columns of each nibble position in a dot of its own (with fp16 / bf16 operands, one dot per
pair of nibble positions i, i + 4, which one mask of the shifted word leaves in its two 16-bit
halves). Codes become floats without an int-to-float instruction
(`_common.small_ints_to_float`, or its mantissa trick on both halves of a word at once). Where
K is a multiple of BLOCK_K × SPLIT_K no tile reaches past K and the loads drop their k masks,
so that a row's words are copied 16 bytes at a time. On a GPU every M runs tiled `tl.dot`
(`gpu_weight_only_config`), with split-K for the small M of decode and verification, and the
scale folded into swapped tiles above 16 rows; a BLOCK_M = 1 launch shape (one row per program,
multiply-reduce) serves configs that ask for it. Split-K
partials go to an fp32 buffer [SPLIT_K, M, N]; each output tile's last split to finish sums
them in split order (deterministic: no atomic adds of numbers, only an arrival count per tile,
`_common.split_k_arrive`), or where the launch has no counters `finish_split_k` does after it.

`quartered` weights (`quarter_int4`, K and the group size multiples of 128): the same codes with
the nibbles of each 128-k block reordered so that word p holds k = 32i + 2p in nibble i and
32i + 2p + 1 in nibble i + 4 (i = 0..3). A nibble-dots tile's pair i is then the consecutive
k of the block's quarter i, which meets a contiguous quarter of x's columns: no shuffle of x,
and the weight pairs are the MMA's register operand as they are (also as the swapped tiles'
A operand, for more than 16 rows).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from quantspec.errors import QuantSpecError
from quantspec.kernels._common import (
    FLOAT_DTYPES,
    MAX_SPLIT_K,
    SM_TARGET,
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

__all__ = ["W4A16Config", "gpu_weight_only_config", "quarter_int4", "quartered_config", "small_m_split",
           "w4a16_default_config", "w4a16_dequantize", "w4a16_dequantize_ref", "w4a16_linear", "w4a16_linear_ref"]

PACK_FACTOR = 8  # 4-bit values per int32 word
INT4_OFFSET = 8  # stored nibble = q + 8
GEMV_MAX_M = 4  # on the CPU interpreter, at or below this M the tests take the GEMV launch shape
QUARTER_BLOCK = 128  # the k block whose nibbles `quarter_int4` reorders


def quartered_order(K: int) -> torch.Tensor:
    """The k read by position 8p + s of each 128-k block in the quartered layout (module
    docstring): 32 (s mod 4) + 2p + s // 4, offset by the block's start. K % 128 == 0."""
    pos = torch.arange(QUARTER_BLOCK)
    p, s = pos // PACK_FACTOR, pos % PACK_FACTOR
    local = 32 * (s % 4) + 2 * p + s // 4
    return (torch.arange(0, K, QUARTER_BLOCK)[:, None] + local[None, :]).reshape(-1)


def quarter_int4(w_packed: torch.Tensor, K: int) -> torch.Tensor:
    """`pack-quantized` words [N, K/8] → the same codes in the quartered layout (module
    docstring); K must be a multiple of 128."""
    from quantspec.quant.packing import pack_int4, unpack_int4

    if K % QUARTER_BLOCK:
        raise QuantSpecError(f"quarter_int4: K={K} must be a multiple of {QUARTER_BLOCK}")
    q = unpack_int4(w_packed, (w_packed.shape[0], K))
    return pack_int4(q[:, quartered_order(K).to(q.device)]).to(w_packed.device)


class W4A16Config(tuple):
    """(BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages, swap_ab, nibble_dots,
    fold_scale) for one launch.

    swap_ab: a `tl.dot` launch computes the transposed tile, weight [BLOCK_N, BLOCK_K] times
    xᵀ [BLOCK_K, BLOCK_M], so that a small M is the MMA's narrow dimension (the weight tile needs
    no transpose) and BLOCK_N its wide one; on Hopper the dequantized weight is then the MMA's A
    operand, taken from registers where its layout is the operand's (the quartered layout's
    nibble dots; an unpacked tile is rearranged through shared memory first, sm_90 SASS shows).
    nibble_dots (W4A16, launches whose k tile lies in one group): the tile's words are not
    unpacked into consecutive k; nibble i of every word ([BLOCK_N, BLOCK_K/8], k = 8j + i) meets
    the x columns 8j + i in a dot of its own (or, with BLOCK_M = 1, a multiply-reduce), eight per
    tile; with fp16 / bf16 operands nibbles i and i + 4 share a dot (four per tile), the two
    16-bit halves of one masked word being the MMA's pair of consecutive k. The sum over k is
    the same; no register reshuffle between the unpack and the MMA. Swapped or not.
    fold_scale (W4A16 `tl.dot` launches): the weight tile is dequantized with its scale into x's
    dtype before the MMA, which accumulates across tiles; without it, group-aligned tiles feed
    the exact integer codes and scale each tile's partial sums in fp32 (more exact, but every
    tile waits for its MMA). W8A16 applies its per-channel scale once, at the end, and ignores
    it."""

    __slots__ = ()

    def __new__(cls, block_m: int, block_n: int, block_k: int, split_k: int = 1,
                num_warps: int = 4, num_stages: int = 2, swap_ab: bool = False, nibble_dots: bool = False,
                fold_scale: bool = False):
        for name, v in (("block_m", block_m), ("block_n", block_n), ("block_k", block_k)):
            if v < 1 or (v & (v - 1)):
                raise QuantSpecError(f"W4A16Config.{name}={v} must be a power of two")
        if split_k < 1:
            raise QuantSpecError(f"W4A16Config.split_k={split_k} must be >= 1")
        return super().__new__(cls, (block_m, block_n, block_k, split_k, num_warps, num_stages, bool(swap_ab),
                                     bool(nibble_dots), bool(fold_scale)))

    block_m = property(lambda s: s[0])
    block_n = property(lambda s: s[1])
    block_k = property(lambda s: s[2])
    split_k = property(lambda s: s[3])
    num_warps = property(lambda s: s[4])
    num_stages = property(lambda s: s[5])
    swap_ab = property(lambda s: s[6])
    nibble_dots = property(lambda s: s[7])
    fold_scale = property(lambda s: s[8])


def check_gpu_dot_tile(cfg: W4A16Config, device: torch.device) -> None:
    """Raise `QuantSpecError` for a `tl.dot` launch (block_m >= 16) on a GPU whose k tile is
    shorter than the MMA's 16 (the interpreter takes any)."""
    if cfg.block_m >= 16 and cfg.block_k < 16 and gpu_launch(device):
        raise QuantSpecError(f"W4A16Config.block_k={cfg.block_k} must be at least 16 for a tl.dot launch "
                             f"(block_m >= 16) on a GPU")


def _mid_m_rows_and_split(M: int, N: int, K: int, block_k: int, block_n: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K) of a swapped launch for 17–64 rows: row tiles of 32 or
    64, split-K to about half `SM_TARGET` programs (at least two k tiles per split)."""
    split = max(1, min(triton.cdiv(K, block_k) // 2, triton.cdiv(SM_TARGET // 2, triton.cdiv(N, block_n))))
    return 32 if M <= 32 else 64, block_n, block_k, split


def _wide_m_split(M: int, N: int, K: int, block_m: int, block_n: int, block_k: int) -> int:
    """SPLIT_K of a launch of more than 64 rows: one tile per row block and column block leaves
    most SMs idle where M and N are small (256 rows of a 4096-wide layer are 64 tiles for 132
    SMs), so split K to about `SM_TARGET` / 2 programs (two per SM, so that one's unpacking
    overlaps the other's MMA), with at least four k tiles per split and partial sums of at most
    twice the weight's bytes (split · M · 4 ≤ K); 1 where the tiles alone fill the GPU."""
    tiles = triton.cdiv(M, block_m) * triton.cdiv(N, block_n)
    return max(1, min(round(SM_TARGET / 2 / tiles), triton.cdiv(K, block_k) // 4, K // (4 * M)))


def small_m_split(N: int, K: int, block_n: int, block_k: int) -> int:
    """SPLIT_K of a weight-only GEMV launch (up to 16 rows, unswapped): the deepest power of two
    up to `MAX_SPLIT_K` that keeps at least two k tiles per split and the programs (column tiles
    times splits) within `SM_TARGET`. On an H100's sweep (`bench/kernels.py --sweep-only`) that is
    each Llama-3-8B shape's fastest split over 1 and 16 rows, for W4A16 and W8A16 alike: 8 where
    N is 4096, but 4 (W4A16) and 2 (W8A16) for 4096×14336, whose columns alone give 112 and 224
    tiles: more programs than the GPU runs at once cost partial sums and arrivals, and no
    bandwidth."""
    cap = max(1, min(MAX_SPLIT_K, triton.cdiv(K, block_k) // 2, SM_TARGET // triton.cdiv(N, block_n)))
    return 1 << (cap.bit_length() - 1)


def gpu_weight_only_config(M: int, N: int, K: int, block_k: int, *, nibble_dots: bool = False) -> W4A16Config:
    """The GPU launch of a weight-only kernel (W4A16, W8A16): `tl.dot` tiles for every M. Up to
    16 rows (decode, and the verification of up to 15 drafts) one launch shape, so that a row's
    numbers do not depend on the other rows and a verification row gives what its decode step
    gives: [16, 128] tiles, and split-K so that a layer's weight is streamed by enough programs
    to fill the GPU. With nibble dots (unswapped) `small_m_split`'s: the deepest power of two
    within `SM_TARGET` programs, the fastest at 1 and 16 rows on the Llama-3-8B shapes of an
    H100's sweep (`bench/kernels.py --sweep-only`); without them (a group smaller than 128)
    swapped, split to about `SM_TARGET` programs. More rows: swapped tiles with the scale folded
    into the weight tile (the MMA then accumulates across tiles instead of scaling each tile's
    sums; Triton still rearranges the unpacked tile through shared memory for the MMA, which
    `quartered_config`'s launches avoid).
    Above 64 rows split-K where the tiles alone would leave SMs idle (`_wide_m_split`).
    W8A16 has its own small-M launch (`w8a16.w8a16_default_config`)."""
    if M > 64:
        bm, bk = (64 if M <= 128 else 128), min(block_k, 64)
        return W4A16Config(bm, 128, bk, _wide_m_split(M, N, K, bm, 128, bk), 8, 3, swap_ab=True, fold_scale=True)
    if M > 16:
        return W4A16Config(*_mid_m_rows_and_split(M, N, K, block_k, 64), 4, 3, swap_ab=True, fold_scale=True)
    if nibble_dots:
        split = small_m_split(N, K, 128, block_k)
    else:
        split = max(1, min(MAX_SPLIT_K, triton.cdiv(K, block_k) // 2, triton.cdiv(SM_TARGET, triton.cdiv(N, 128))))
    return W4A16Config(16, 128, block_k, split, 4, 3, swap_ab=not nibble_dots, nibble_dots=nibble_dots)


def quartered_config(M: int, N: int, K: int, on_gpu: bool) -> W4A16Config:
    """The launch for `quartered` weights: nibble dots over 128-k tiles for every M, up to 16 rows
    `gpu_weight_only_config`'s, more rows swapped (the weight pairs as the MMA's register operand,
    x's quarters read from shared memory as they are); small tiles on the CPU interpreter."""
    if not on_gpu:
        return W4A16Config(1, 16, 128, 2, nibble_dots=True) if M <= GEMV_MAX_M else \
            W4A16Config(16, 16, 128, 1, nibble_dots=True)
    if M <= 16:
        return gpu_weight_only_config(M, N, K, QUARTER_BLOCK, nibble_dots=True)
    if M <= 64:
        return W4A16Config(*_mid_m_rows_and_split(M, N, K, QUARTER_BLOCK, 64), 4, 3, swap_ab=True, nibble_dots=True)
    bm, warps = (64, 4) if M <= 128 else (128, 8)
    return W4A16Config(bm, 128, QUARTER_BLOCK, _wide_m_split(M, N, K, bm, 128, QUARTER_BLOCK), warps, 3, swap_ab=True,
                       nibble_dots=True)


def w4a16_default_config(M: int, N: int, K: int, group_size: int, on_gpu: bool, *,
                         float_zero: bool = False) -> W4A16Config:
    """Launch heuristic: `gpu_weight_only_config` on a GPU (with the largest BLOCK_K ≤ 128 that
    divides the group size, and at least the MMA's 16; nibble dots where that is 128 and the zero
    points, if any, are integers: `float_zero` says they are floats); on the CPU interpreter tiny
    tiles, so that the tests stay fast and exercise masking and both launch shapes."""
    if not on_gpu:
        if M <= GEMV_MAX_M:
            return W4A16Config(1, 16, 16, 2)
        return W4A16Config(16, 16, 16, 1)
    bk = next((b for b in (128, 64, 32) if group_size % b == 0), 16)
    return gpu_weight_only_config(M, N, K, bk, nibble_dots=bk == 128 and not float_zero)


@triton.jit
def _nibbles(words, BLOCK_K: tl.constexpr):
    """words [BLOCK_N, BLOCK_K / 8] int32 → the stored nibbles [BLOCK_N, BLOCK_K] (q + 8, in
    0..15) in k order: word j holds k = 8j .. 8j+7 in its nibbles 0..7. Each word is repeated
    eight times by interleaving it with itself (which keeps the copies in the thread that loaded
    the word: no trip through shared memory), then shifted by 4·(k mod 8)."""
    w = tl.interleave(words, words)
    w = tl.interleave(w, w)
    w = tl.interleave(w, w)
    return (w >> ((tl.arange(0, BLOCK_K) % 8) * 4)[None, :]) & 0xF


@triton.jit
def _codes(nib, z, HAS_ZERO: tl.constexpr, DTYPE: tl.constexpr):
    """Stored nibbles (int32, 0..15) → the codes q - zero as exact DTYPE values; `z` (integer
    zero points in the int4 range, broadcast against `nib`) is read only with HAS_ZERO."""
    if HAS_ZERO:  # + 64 keeps the value non-negative for `small_ints_to_float`
        out = small_ints_to_float(nib - z + 64, 72, DTYPE, True)
    else:
        out = small_ints_to_float(nib, 8, DTYPE, True)
    return out


@triton.jit
def _scaled_codes(nib, z, s, HAS_ZERO: tl.constexpr, DTYPE: tl.constexpr):
    """(q - zero) · scale in DTYPE, for a scale tile `s` as stored (broadcast against `nib`). A
    code times a 16-bit float scale is exact in fp32, so one rounding gives the product however
    it is computed: where DTYPE is fp16 / bf16 and the scale is stored in it, the product is taken
    in DTYPE (two values per instruction on a GPU), else in fp32 and then rounded to DTYPE."""
    if DTYPE != tl.float32 and s.dtype == DTYPE:
        out = _codes(nib, z, HAS_ZERO, DTYPE) * s
    else:
        out = (_codes(nib, z, HAS_ZERO, tl.float32) * s.to(tl.float32)).to(DTYPE)
    return out


@triton.jit
def _mma(w, x, acc, SWAP_AB: tl.constexpr, DOT_FP32: tl.constexpr):
    """acc + w·xᵀ ([BN, BM], SWAP_AB) or acc + x·wᵀ ([BM, BN]) for a weight tile w [BN, BK] in
    x's dtype, or with both operands in fp32 (DOT_FP32, ieee products)."""
    # one return at the end: the compiler still builds the statements after a return inside a
    # constexpr branch, where the other orientation's shapes do not fit
    if DOT_FP32:
        if SWAP_AB:
            out = tl.dot(w.to(tl.float32), tl.trans(x.to(tl.float32)), acc, input_precision="ieee")
        else:
            out = tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
    elif SWAP_AB:
        out = tl.dot(w, tl.trans(x), acc)
    else:
        out = tl.dot(x, tl.trans(w), acc)
    return out


@triton.jit
def _nibble_dots_tile(x_ptr, w_ptr, s_ptr, z_ptr, offs_m, offs_n, mask_m, mask_n, k0, K, KW, group_size,
                      stride_xm, stride_wn, stride_sn, stride_zn,
                      HAS_ZERO: tl.constexpr, USE_DOT: tl.constexpr, DOT_FP32: tl.constexpr,
                      SWAP_AB: tl.constexpr, EVEN_K: tl.constexpr, QUARTERED: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """One k tile of a launch with `nibble_dots` (`W4A16Config`): the tile's partial sums
    ([BN, BM] with SWAP_AB, else [BM, BN]) times the group's scale, by four dots of 16-bit
    operands, eight of fp32 ones, or for one row (no USE_DOT) eight multiply-reduces. The k tile
    lies in one group (integer zero points only). EVEN_K: no tile reaches past K. QUARTERED: the
    words in `quarter_int4`'s layout (BLOCK_K = 128)."""
    offs_w = k0 // 8 + tl.arange(0, BLOCK_K // 8)  # [BK/8] the tile's words
    words = tl.load(w_ptr + offs_n[:, None] * stride_wn + offs_w[None, :],
                    mask=mask_n[:, None] & ((offs_w < KW) | EVEN_K)[None, :], other=0)  # [BN, BK/8]
    g = tl.minimum(k0, K - 1) // group_size
    s = tl.load(s_ptr + offs_n * stride_sn + g, mask=mask_n, other=0.0).to(tl.float32)  # [BN]
    z = 0
    if HAS_ZERO:
        z = tl.load(z_ptr + offs_n * stride_zn + g, mask=mask_n, other=0).to(tl.int32)[:, None]
    if SWAP_AB:
        part = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        part = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if USE_DOT and not DOT_FP32:
        part = _paired_nibble_dots(x_ptr, words, z, offs_m, k0, mask_m, K, stride_xm, part, HAS_ZERO,
                                   SWAP_AB, EVEN_K, QUARTERED, BLOCK_K)
    else:
        part = _single_nibble_dots(x_ptr, words, z, offs_m, offs_w, k0, mask_m, K, stride_xm, part, HAS_ZERO,
                                   USE_DOT, SWAP_AB, EVEN_K, QUARTERED)
    if SWAP_AB:
        part = part * s[:, None]
    else:
        part = part * s[None, :]
    return part


@triton.jit
def _paired_nibble_dots(x_ptr, words, z, offs_m, k0, mask_m, K, stride_xm, part,
                        HAS_ZERO: tl.constexpr, SWAP_AB: tl.constexpr, EVEN_K: tl.constexpr,
                        QUARTERED: tl.constexpr, BLOCK_K: tl.constexpr):
    """`_nibble_dots_tile`'s dots in x's 16-bit float type: four, each over nibbles i and i + 4
    of every word (k = 8j + i, 8j + i + 4; QUARTERED: k = 32i + 2j, 32i + 2j + 1, a contiguous
    quarter of the tile). One mask of a shifted word leaves those two nibbles in its two 16-bit
    halves, which become the two values' mantissas (the fp16 / bf16 bits of 1024 + v / 128 + v,
    as `small_ints_to_float`): the word is then the pair of codes the MMA takes, after one
    two-value subtraction."""
    x_dtype: tl.constexpr = x_ptr.dtype.element_ty
    magic: tl.constexpr = 0x64006400 if x_dtype == tl.float16 else 0x43004300
    # the stored nibble is q + 8; with zero points each half holds q - z + 72
    sub: tl.constexpr = (1024.0 if x_dtype == tl.float16 else 128.0) + (72.0 if HAS_ZERO else 8.0)
    if not QUARTERED:
        # x's tile [BM, BK] in one load, then the columns of each pair of nibbles: k = 8j + 4h + i
        # (h = 0 / 1: nibble i / i + 4) as [BM, BK/8, 2(h), 2(i // 2), 2(i % 2)], split on i's bits
        kk = k0 + tl.arange(0, BLOCK_K)
        xt = tl.load(x_ptr + offs_m[:, None] * stride_xm + kk[None, :],
                     mask=mask_m[:, None] & ((kk < K) | EVEN_K)[None, :], other=0.0)
        xt = tl.reshape(xt, (xt.shape[0], BLOCK_K // 8, 2, 2, 2))
        x_even, x_odd = tl.split(xt)  # i % 2 = 0 / 1: [BM, BK/8, 2, 2]
        x0, x2 = tl.split(x_even)  # i = 0, 2: [BM, BK/8, 2]
        x1, x3 = tl.split(x_odd)  # i = 1, 3
    for i in tl.static_range(4):
        if QUARTERED:  # the tile's quarter i: columns k0 + 32i ..
            kq = k0 + i * (BLOCK_K // 4) + tl.arange(0, BLOCK_K // 4)
            x = tl.load(x_ptr + offs_m[:, None] * stride_xm + kq[None, :],
                        mask=mask_m[:, None] & ((kq < K) | EVEN_K)[None, :], other=0.0)  # [BM, BK/4]
        else:
            if i == 0:
                xi = x0
            elif i == 1:
                xi = x1
            elif i == 2:
                xi = x2
            else:
                xi = x3
            x = tl.reshape(xi, (xi.shape[0], BLOCK_K // 4))  # [BM, BK/4]: columns 8j + i, 8j + i + 4
        t = (words >> (4 * i)) & 0x000F000F  # [BN, BK/8]: nibble i low, nibble i + 4 high
        if HAS_ZERO:  # + 64 - z in each half (the sum is in 0..127: no carry between the halves)
            t = t + (64 - z) * 0x00010001
        t = t | magic
        lo = (t & 0xFFFF).to(tl.int16).to(x_dtype, bitcast=True)
        hi = (t >> 16).to(tl.int16).to(x_dtype, bitcast=True)
        w = tl.reshape(tl.join(lo, hi), (lo.shape[0], BLOCK_K // 4)) - sub  # [BN, BK/4]
        part = _mma(w, x, part, SWAP_AB, False)
    return part


@triton.jit
def _single_nibble_dots(x_ptr, words, z, offs_m, offs_w, k0, mask_m, K, stride_xm, part,
                        HAS_ZERO: tl.constexpr, USE_DOT: tl.constexpr, SWAP_AB: tl.constexpr,
                        EVEN_K: tl.constexpr, QUARTERED: tl.constexpr):
    """`_nibble_dots_tile`'s eight dots (fp32 operands) or, for one row, multiply-reduces."""
    for i in tl.static_range(8):
        nib = (words >> (4 * i)) & 0xF  # [BN, BK/8]: k = 8j + i (QUARTERED: 32 (i mod 4) + 2j + i // 4)
        if QUARTERED:
            cols = k0 + 32 * (i % 4) + 2 * (offs_w - k0 // 8) + i // 4
        else:
            cols = offs_w * 8 + i
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + cols[None, :],
                    mask=mask_m[:, None] & ((cols < K) | EVEN_K)[None, :], other=0.0)  # [BM, BK/8]
        if not USE_DOT:  # one row (BLOCK_M = 1): multiply and reduce over the words
            q = _codes(nib, z, HAS_ZERO, tl.float32)
            part += tl.sum(q[None, :, :] * x.to(tl.float32)[:, None, :], axis=2)
        else:
            part = _mma(_codes(nib, z, HAS_ZERO, tl.float32), x, part, SWAP_AB, True)
    return part


@triton.jit
def _w4a16_kernel(
    x_ptr, w_ptr, s_ptr, z_ptr, b_ptr, out_ptr, y_ptr, cnt_ptr,
    M, N, K, group_size,
    stride_xm, stride_wn, stride_sn, stride_zn, stride_om, stride_osplit,
    HAS_ZERO: tl.constexpr, ZERO_FLOAT: tl.constexpr, HAS_BIAS: tl.constexpr,
    GROUP_ALIGNED: tl.constexpr, SCALE_AFTER: tl.constexpr,
    USE_DOT: tl.constexpr, DOT_FP32: tl.constexpr, SWAP_AB: tl.constexpr, NIBBLE_DOTS: tl.constexpr,
    EVEN_K: tl.constexpr, QUARTERED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, FINISH: tl.constexpr, USE_PDL: tl.constexpr,
):
    pdl_begin(USE_PDL)
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
    KW = tl.cdiv(K, 8)

    if SWAP_AB:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for t in range(0, tiles_per_split):
        k0 = k_begin + t * BLOCK_K
        if NIBBLE_DOTS:
            acc += _nibble_dots_tile(x_ptr, w_ptr, s_ptr, z_ptr, offs_m, offs_n, mask_m, mask_n, k0, K, KW,
                                     group_size, stride_xm, stride_wn, stride_sn, stride_zn,
                                     HAS_ZERO, USE_DOT, DOT_FP32, SWAP_AB, EVEN_K, QUARTERED, BLOCK_M, BLOCK_N,
                                     BLOCK_K)
        else:
            offs_k = k0 + tl.arange(0, BLOCK_K)  # [BK]
            mask_k = offs_k < K
            x = tl.load(
                x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                mask=mask_m[:, None] & (mask_k | EVEN_K)[None, :], other=0.0,
            )  # [BM, BK]
            wmask = mask_n[:, None] & mask_k[None, :]
            offs_w = k0 // 8 + tl.arange(0, BLOCK_K // 8)  # [BK/8] the tile's words
            words = tl.load(
                w_ptr + offs_n[:, None] * stride_wn + offs_w[None, :],
                mask=mask_n[:, None] & ((offs_w < KW) | EVEN_K)[None, :], other=0,
            )  # [BN, BK/8] int32, each word read once
            nib = _nibbles(words, BLOCK_K)  # [BN, BK]
            if GROUP_ALIGNED:
                # BLOCK_K divides group_size: the whole k tile shares one group
                # (a split-K launch's last split may run a tile past K, where x is masked to 0: it
                # reads the last group, not one past the end, which may hold a NaN)
                g = tl.minimum(k0, K - 1) // group_size
                s_raw = tl.load(s_ptr + offs_n * stride_sn + g, mask=mask_n, other=0.0)[:, None]
                zidx = offs_n[:, None] * stride_zn + g
                zmask = mask_n[:, None]
            else:
                g = offs_k // group_size  # [BK]
                s_raw = tl.load(s_ptr + offs_n[:, None] * stride_sn + g[None, :], mask=wmask, other=0.0)
                zidx = offs_n[:, None] * stride_zn + g[None, :]
                zmask = wmask
            s = s_raw.to(tl.float32)
            if HAS_ZERO and (ZERO_FLOAT or not GROUP_ALIGNED):
                # float zero points; and integer ones of a k tile across groups (one per element,
                # which a GPU launch gets as floats: `w4a16_linear`), subtracted in fp32
                z = tl.load(z_ptr + zidx, mask=zmask, other=0).to(tl.float32)
                w = (_codes(nib, 0, False, tl.float32) - z) * s  # [BN, BK]
            else:
                z = 0
                if HAS_ZERO:
                    z = tl.load(z_ptr + zidx, mask=zmask, other=0).to(tl.int32)
                if SCALE_AFTER:  # exact integers; the tile's partial sums take the group's scale
                    if DOT_FP32 or not USE_DOT:
                        w = _codes(nib, z, HAS_ZERO, tl.float32)
                    else:
                        w = _codes(nib, z, HAS_ZERO, x.dtype)
                elif USE_DOT and not DOT_FP32 and GROUP_ALIGNED:  # the scale folded in, in x's dtype
                    w = _scaled_codes(nib, z, s_raw, HAS_ZERO, x.dtype)  # [BN, BK]
                else:  # a k tile across groups (a scale per element): fp32
                    w = _codes(nib, z, HAS_ZERO, tl.float32) * s  # [BN, BK]
            if USE_DOT:
                if not DOT_FP32:
                    w = w.to(x.dtype)
                if SCALE_AFTER:
                    if SWAP_AB:
                        acc += _mma(w, x, tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32), True, DOT_FP32) * s
                    else:
                        acc += _mma(w, x, tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), False,
                                    DOT_FP32) * tl.trans(s)
                else:
                    acc = _mma(w, x, acc, SWAP_AB, DOT_FP32)
            else:
                if SCALE_AFTER:
                    w = w * s
                prod = x.to(tl.float32)[:, None, :] * w[None, :, :]  # [BM, BN, BK]
                acc += tl.sum(prod, axis=2)

    if SWAP_AB:
        acc = tl.trans(acc)  # [BM, BN]
    out_mask = mask_m[:, None] & mask_n[None, :]
    tile = pid_m * tl.num_programs(1) + pid_n
    acc, y_mask = split_k_partials(acc, out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], out_mask,
                                   stride_osplit, pid_k, cnt_ptr, tile, SPLIT_K, FINISH)
    if SPLIT_K == 1 or FINISH:
        if HAS_BIAS:
            b = tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
            acc += b[None, :]
        tl.store(y_ptr + offs_m[:, None] * stride_om + offs_n[None, :], acc.to(y_ptr.dtype.element_ty), mask=y_mask)


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


def _check_quartered(K: int, group_size: int) -> None:
    """Raise `QuantSpecError` unless K and the group size suit `quarter_int4`'s layout."""
    if K % QUARTER_BLOCK or group_size % QUARTER_BLOCK:
        raise QuantSpecError(f"quartered weights need K ({K}) and the group size ({group_size}) to be "
                             f"multiples of {QUARTER_BLOCK}")


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
    quartered: bool = False,
) -> torch.Tensor:
    """Triton W4A16 linear; `config` overrides the launch heuristic (tests, benchmarks).
    `quartered`: w_packed in `quarter_int4`'s layout (K and the group size multiples of 128;
    nibble-dots launches over 128-k tiles, `quartered_config`)."""
    M, N, K = _validate(x, w_packed, w_scale, group_size, w_zero, bias)
    device = check_same_device(x=x, w_packed=w_packed, w_scale=w_scale, w_zero=w_zero, bias=bias)
    if quartered:
        _check_quartered(K, group_size)
    if config is None:
        cfg = quartered_config(M, N, K, gpu_launch(device)) if quartered else \
            w4a16_default_config(M, N, K, group_size, gpu_launch(device),
                                 float_zero=w_zero is not None and w_zero.is_floating_point())
    else:
        cfg = config
    bm, bn, bk, split, warps, stages, swap, nibble, fold = cfg
    if bk < PACK_FACTOR:
        raise QuantSpecError(f"W4A16Config.block_k={bk} must be at least {PACK_FACTOR} (one int32 word of codes)")
    use_dot = bm >= 16
    check_gpu_dot_tile(cfg, device)
    if w_zero is not None and not w_zero.is_floating_point() and group_size % bk and gpu_launch(device):
        # k tiles across groups read a zero point per element: from an integer tile of them an
        # H100 under Triton 3.6 computes wrong numbers (16-bit x), from the same integers as
        # half floats (exact up to 2048) the reference's
        w_zero = w_zero.to(torch.float16)
    scale_after = group_size % bk == 0 and not (w_zero is not None and w_zero.is_floating_point()) and not fold
    if nibble and not (scale_after and (bm == 1 or (use_dot and bk >= 16 * PACK_FACTOR))):
        raise QuantSpecError(f"W4A16Config.nibble_dots needs block_m 1, or block_m >= 16 with block_k >= "
                             f"{16 * PACK_FACTOR}; fold_scale off, block_k dividing the group size ({group_size}) "
                             f"and integer zero points; got {tuple(cfg)}")
    if quartered and not (nibble and bk == QUARTER_BLOCK):
        raise QuantSpecError(f"quartered weights need a nibble_dots launch with block_k={QUARTER_BLOCK}; got {tuple(cfg)}")
    grid = (triton.cdiv(M, bm), triton.cdiv(N, bn), split)
    # the tiles' last splits finish the sums in the small-M launch; wider tiles would need
    # more registers for it than their main loop (fewer programs per SM)
    part, out, counters = split_k_buffers(M, N, split, grid[0] * grid[1], device, x.dtype,
                                          in_kernel=bm <= 16)
    stride_osplit = 0 if split == 1 else M * N
    _w4a16_kernel[grid](
        x, w_packed, w_scale,
        w_zero if w_zero is not None else w_scale,
        bias if bias is not None else w_scale,
        part, out, counters if counters is not None else out,
        M, N, K, group_size,
        x.stride(0), w_packed.stride(0), w_scale.stride(0),
        w_zero.stride(0) if w_zero is not None else 0,
        N, stride_osplit,
        HAS_ZERO=w_zero is not None,
        ZERO_FLOAT=w_zero is not None and w_zero.is_floating_point(), HAS_BIAS=bias is not None,
        GROUP_ALIGNED=group_size % bk == 0,
        SCALE_AFTER=scale_after,
        USE_DOT=use_dot, DOT_FP32=dot_in_fp32(x.dtype), SWAP_AB=swap and use_dot, NIBBLE_DOTS=nibble,
        EVEN_K=K % (bk * split) == 0, QUARTERED=quartered,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split, FINISH=counters is not None,
        num_warps=warps, num_stages=stages, **pdl_kwargs(device),
    )
    return finish_split_k(part, bias, out) if split > 1 and counters is None else out


# ---------------------------------------------------------------- dequantize (for large M)


@triton.jit
def _w4_dequant_kernel(
    w_ptr, s_ptr, z_ptr, out_ptr, N, K, group_size, stride_wn, stride_sn, stride_zn, stride_on,
    HAS_ZERO: tl.constexpr, ZERO_FLOAT: tl.constexpr, GROUP_ALIGNED: tl.constexpr, EVEN_K: tl.constexpr,
    QUARTERED: tl.constexpr, WORD_GROUPS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """One [BLOCK_N, BLOCK_K] tile of the weight, as [BLOCK_N, BLOCK_K / 8, 8]: word j's nibble i
    is k = 8j + i, so each thread writes the eight k of the words it loaded (no exchange between
    threads). GROUP_ALIGNED (BLOCK_K divides the group size): the tile lies in one group, whose
    scale (and zero point) each row loads once; else WORD_GROUPS (the group size a multiple of 8,
    or quartered words): the eight codes of a word share a group, whose scale each word loads
    once; else each code loads its own. EVEN_K (BLOCK_K divides K): no k masks, so that a
    thread's words come in one vector load. QUARTERED: the words in `quarter_int4`'s layout, each
    code written to its k (`quartered_order`, word by word, so any BLOCK_K; a tile of up to 128
    k lies in one 128-k block, and so in one group of a multiple of 128)."""
    pdl_begin(USE_PDL)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * BLOCK_K
    offs_w = k0 // 8 + tl.arange(0, BLOCK_K // 8)
    mask_n = offs_n < N
    if EVEN_K:
        w_mask = mask_n[:, None]
    else:
        w_mask = mask_n[:, None] & (offs_w < tl.cdiv(K, 8))[None, :]
    words = tl.load(w_ptr + offs_n[:, None] * stride_wn + offs_w[None, :], mask=w_mask, other=0)
    i = tl.arange(0, 8)
    nib = (words[:, :, None] >> (i * 4)[None, None, :]) & 0xF  # [BN, BK/8, 8]
    if QUARTERED:  # position 8p + s of a 128-k block holds k = 32 (s mod 4) + 2p + s // 4
        offs_k = ((offs_w // 16) * 128 + 2 * (offs_w % 16))[None, :, None] + \
            (32 * (i % 4) + i // 4)[None, None, :]
    else:
        offs_k = offs_w[None, :, None] * 8 + i[None, None, :]  # [1, BK/8, 8]
    if EVEN_K:
        mask = mask_n[:, None, None]
    else:
        mask = mask_n[:, None, None] & (offs_k < K)
    if GROUP_ALIGNED:  # [BN, 1, 1]: one group per row of the tile
        s_off = offs_n[:, None, None] * stride_sn + k0 // group_size
        z_off = offs_n[:, None, None] * stride_zn + k0 // group_size
        s_mask = mask_n[:, None, None]
    elif WORD_GROUPS:  # [BN, BK/8, 1]: one group per word
        if QUARTERED:
            g = ((offs_w // 16) * 128 // group_size)[None, :, None]
        else:
            g = (offs_w * 8 // group_size)[None, :, None]
        s_off = offs_n[:, None, None] * stride_sn + g
        z_off = offs_n[:, None, None] * stride_zn + g
        s_mask = w_mask[:, :, None]
    else:
        g = offs_k // group_size
        s_off = offs_n[:, None, None] * stride_sn + g
        z_off = offs_n[:, None, None] * stride_zn + g
        s_mask = mask
    s = tl.load(s_ptr + s_off, mask=s_mask, other=0.0)
    if HAS_ZERO and ZERO_FLOAT:
        z = tl.load(z_ptr + z_off, mask=s_mask, other=0.0).to(tl.float32)
        w = ((_codes(nib, 0, False, tl.float32) - z) * s.to(tl.float32)).to(out_ptr.dtype.element_ty)
    else:
        z = 0
        if HAS_ZERO:
            z = tl.load(z_ptr + z_off, mask=s_mask, other=0).to(tl.int32)
        w = _scaled_codes(nib, z, s, HAS_ZERO, out_ptr.dtype.element_ty)
    tl.store(out_ptr + offs_n[:, None, None] * stride_on + offs_k, w, mask=mask)


def w4a16_dequantize_ref(w_packed: torch.Tensor, w_scale: torch.Tensor, group_size: int, K: int,
                         w_zero: torch.Tensor | None = None, dtype: torch.dtype = torch.float16) -> torch.Tensor:
    """Torch reference: the [N, K] weight (q - zero) * scale computed in fp32, cast to `dtype`."""
    from quantspec.kernels._quant_bridge import dequantize_groupwise, unpack_int4

    return dequantize_groupwise(unpack_int4(w_packed, K), w_scale.float(), w_zero, group_size).to(dtype)


DEQUANT_BLOCK = (32, 128, 4)  # the GPU's dequantize tile: BLOCK_N, BLOCK_K, warps (`w4a16_dequantize`)


def w4a16_dequantize(w_packed: torch.Tensor, w_scale: torch.Tensor, group_size: int, K: int,
                     w_zero: torch.Tensor | None = None, dtype: torch.dtype = torch.float16,
                     quartered: bool = False, block: tuple[int, int, int] | None = None) -> torch.Tensor:
    """Triton: the [N, K] weight in `dtype`, equal to `w4a16_dequantize_ref` bit for bit (what a
    large-M call multiplies with cuBLAS). `quartered`: w_packed in `quarter_int4`'s layout (K and
    the group size multiples of 128); the weight comes out in k order all the same. `block`:
    (BLOCK_N, BLOCK_K, warps) of the launch, powers of two with BLOCK_K ≥ 8 (default
    `DEQUANT_BLOCK` on a GPU; `bench/kernels.py --sweep-only` times others)."""
    _validate(torch.empty((0, K), dtype=dtype, device=w_packed.device), w_packed, w_scale, group_size,
              w_zero, None)
    device = check_same_device(w_packed=w_packed, w_scale=w_scale, w_zero=w_zero)
    if quartered:
        _check_quartered(K, group_size)
    N = w_packed.shape[0]
    out = torch.empty((N, K), device=device, dtype=dtype)
    bn, bk, warps = block or (DEQUANT_BLOCK if gpu_launch(device) else (16, 16, 4))
    if any(v < 1 or v & (v - 1) for v in (bn, bk, warps)) or bk < PACK_FACTOR:
        raise QuantSpecError(f"w4a16_dequantize: block {(bn, bk, warps)} must be powers of two with BLOCK_K >= 8")
    _w4_dequant_kernel[(triton.cdiv(N, bn), triton.cdiv(K, bk))](
        w_packed, w_scale, w_zero if w_zero is not None else w_scale, out, N, K, group_size,
        w_packed.stride(0), w_scale.stride(0), w_zero.stride(0) if w_zero is not None else 0, out.stride(0),
        HAS_ZERO=w_zero is not None, ZERO_FLOAT=w_zero is not None and w_zero.is_floating_point(),
        GROUP_ALIGNED=group_size % bk == 0, EVEN_K=K % bk == 0, QUARTERED=quartered,
        WORD_GROUPS=quartered or group_size % PACK_FACTOR == 0, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps,
        **pdl_kwargs(device),
    )
    return out
