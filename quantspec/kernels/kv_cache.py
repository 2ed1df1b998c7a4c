"""Paged KV cache kernels: quantize-on-write and varlen paged attention over an fp/int8/fp8 cache.

This file owns two Triton kernels, each beside its torch reference with the same signature:
  write_kv_cache / _ref:   scatter new K/V rows into their cache slots, quantizing with the static
      per-kv-head scales when the cache is int8 (round, clamp to [-128, 127]) or fp8 (clamp ±448).
  paged_attention / _ref:  causal attention of T flattened query tokens over each sequence's paged
      context, with GQA and varlen queries (decode q_len = 1, speculative verify 1 + k, prefill).

The cache layout is the engine's, fixed:
  k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim] (fp32/fp16/bf16, int8,
      float8_e4m3fn); k_scale, v_scale: [num_kv_heads] fp32, stored = round(x / scale);
  q: [T, num_heads, head_dim]; cu_q_lens: [B + 1] int32 (prefix sums of q_len);
  seq_lens: [B] int32, context length INCLUDING the new tokens; block_tables: [B, max_blocks]
      int32; slot_mapping: [T] int64 = block_id * block_size + offset (negative = skip, padding).
Query i of sequence b sits at position seq_lens[b] - q_len_b + i and attends keys 0..position.
"""

from __future__ import annotations

import math

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
    dot_in_fp32,
    pdl_begin,
    pdl_kwargs,
    round_half_even,
    round_to_e4m3,
    split_k_arrive,
    split_k_counters,
)

__all__ = [
    "CACHE_DTYPES",
    "paged_attention",
    "paged_attention_ref",
    "write_kv_cache",
    "write_kv_cache_ref",
]

CACHE_DTYPES = (*FLOAT_DTYPES, torch.int8, torch.float8_e4m3fn)

# how a cache stores values (a constexpr in the kernels)
KV_FLOAT = tl.constexpr(0)
KV_INT8 = tl.constexpr(1)
KV_FP8 = tl.constexpr(2)


def _kv_kind(dtype: torch.dtype) -> int:
    if dtype == torch.int8:
        return 1
    if dtype == torch.float8_e4m3fn:
        return 2
    return 0


def _check_cache(k_cache, v_cache, k_scale, v_scale):
    check_tensor(k_cache, "k_cache", ndim=4, dtypes=CACHE_DTYPES)
    check_tensor(v_cache, "v_cache", ndim=4, dtypes=CACHE_DTYPES)
    if v_cache.shape != k_cache.shape or v_cache.dtype != k_cache.dtype:
        raise QuantSpecError(
            f"v_cache {list(v_cache.shape)} {v_cache.dtype} must match k_cache "
            f"{list(k_cache.shape)} {k_cache.dtype}; allocate both the same way"
        )
    hkv = k_cache.shape[2]
    if _kv_kind(k_cache.dtype) != 0:
        for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
            if s is None:
                raise QuantSpecError(
                    f"{name} is required for a {str(k_cache.dtype).replace('torch.', '')} KV cache; "
                    "pass the calibrated per-kv-head scales"
                )
            check_tensor(s, name, dtypes=(torch.float32,), shape=(hkv,))


# ---------------------------------------------------------------- quantize-on-write


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, ks_ptr, vs_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh, stride_slot,
    D, KIND: tl.constexpr, FP8_MAX: tl.constexpr, BLOCK_D: tl.constexpr, USE_PDL: tl.constexpr,
):
    pdl_begin(USE_PDL)
    t = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(slot_ptr + t)  # int64
    offs_d = tl.arange(0, BLOCK_D)
    # the scalar test is broadcast through an add: the interpreter rejects a scalar-bool & vector
    mask = (offs_d < D) & ((offs_d * 0 + slot) >= 0)
    k = tl.load(k_ptr + t * stride_kt + h * stride_kh + offs_d, mask=mask, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + t * stride_vt + h * stride_vh + offs_d, mask=mask, other=0.0).to(tl.float32)
    if KIND == KV_INT8:
        ks = tl.load(ks_ptr + h)
        vs = tl.load(vs_ptr + h)
        k = round_half_even(tl.minimum(tl.maximum(tl.math.div_rn(k, ks), -128.0), 127.0))
        v = round_half_even(tl.minimum(tl.maximum(tl.math.div_rn(v, vs), -128.0), 127.0))
    elif KIND == KV_FP8:
        ks = tl.load(ks_ptr + h)
        vs = tl.load(vs_ptr + h)
        k = round_to_e4m3(tl.minimum(tl.maximum(tl.math.div_rn(k, ks), -FP8_MAX), FP8_MAX))
        v = round_to_e4m3(tl.minimum(tl.maximum(tl.math.div_rn(v, vs), -FP8_MAX), FP8_MAX))
    dst = slot * stride_slot + h * D + offs_d
    tl.store(kc_ptr + dst, k.to(kc_ptr.dtype.element_ty), mask=mask)
    tl.store(vc_ptr + dst, v.to(vc_ptr.dtype.element_ty), mask=mask)


def _check_write(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale):
    _check_cache(k_cache, v_cache, k_scale, v_scale)
    _, _, hkv, d = k_cache.shape
    check_tensor(key, "key", ndim=3, dtypes=FLOAT_DTYPES, contiguous=False)
    T = key.shape[0]
    check_tensor(key, "key", shape=(T, hkv, d), contiguous=False)
    check_tensor(value, "value", dtypes=FLOAT_DTYPES, shape=(T, hkv, d), contiguous=False)
    for name, t in (("key", key), ("value", value)):
        if t.stride(2) != 1:
            raise QuantSpecError(f"{name} must have a contiguous head_dim; call .contiguous() on it")
    check_tensor(slot_mapping, "slot_mapping", dtypes=(torch.int64,), shape=(T,))


def write_kv_cache_ref(
    key: torch.Tensor,  # [T, num_kv_heads, head_dim]
    value: torch.Tensor,  # [T, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [T] int64, negative = skip
    k_scale: torch.Tensor | None = None,  # [num_kv_heads] fp32 (int8/fp8 caches)
    v_scale: torch.Tensor | None = None,  # [num_kv_heads] fp32
) -> None:
    """Torch reference: writes in place, quantizing with `quant/`'s primitives."""
    _check_write(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    from quantspec.kernels._quant_bridge import quantize_fp8, quantize_int8

    keep = slot_mapping >= 0
    slots = slot_mapping[keep]  # [T']
    kind = _kv_kind(k_cache.dtype)
    for src, cache, scale in ((key, k_cache, k_scale), (value, v_cache, v_scale)):
        x = src[keep]  # [T', Hkv, D]
        if kind == 1:
            x = quantize_int8(x, scale[None, :, None])
        elif kind == 2:
            x = quantize_fp8(x, scale[None, :, None])
        flat = cache.view(-1, cache.shape[2], cache.shape[3])  # [num_blocks * block_size, Hkv, D]
        flat[slots] = x.to(cache.dtype)


def write_kv_cache(
    key: torch.Tensor,  # [T, num_kv_heads, head_dim]
    value: torch.Tensor,  # [T, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [T] int64, negative = skip
    k_scale: torch.Tensor | None = None,  # [num_kv_heads] fp32 (int8/fp8 caches)
    v_scale: torch.Tensor | None = None,  # [num_kv_heads] fp32
) -> None:
    """Triton quantize-on-write into the paged cache (in place)."""
    _check_write(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    device = check_same_device(key=key, value=value, k_cache=k_cache, v_cache=v_cache,
                               slot_mapping=slot_mapping, k_scale=k_scale, v_scale=v_scale)
    T = key.shape[0]
    if T == 0:
        return
    _, _, hkv, d = k_cache.shape
    dummy = slot_mapping
    _write_kv_kernel[(T, hkv)](
        key, value, k_cache, v_cache, slot_mapping,
        k_scale if k_scale is not None else dummy, v_scale if v_scale is not None else dummy,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1), hkv * d,
        d, KIND=_kv_kind(k_cache.dtype), FP8_MAX=FP8_E4M3_MAX,
        BLOCK_D=triton.next_power_of_2(d), **pdl_kwargs(device),
    )


# ---------------------------------------------------------------- paged attention


@triton.jit
def _paged_attn_kernel(
    q_ptr, kc_ptr, vc_ptr, cu_ptr, seq_ptr, bt_ptr, ks_ptr, vs_ptr, out_ptr,
    acc_ptr, ml_ptr, cnt_ptr,
    sm_scale, stride_qt, stride_qh, stride_ot, stride_oh, stride_bt, stride_slot,
    D, block_size, chunk, T, H, window, softcap,
    GROUP: tl.constexpr, KIND: tl.constexpr, DOT_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, SPLITS: tl.constexpr,
    USE_PDL: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
):
    """Program (query tile × key split, sequence, head). SPLITS > 1 (`paged_attention`'s
    kv_chunk): split s attends over the keys at absolute positions [s · chunk, (s + 1) · chunk)
    that its tile sees (the last split: from (SPLITS - 1) · chunk on); where the tile sees keys
    of one split only, that split writes the output as the unsplit kernel does; otherwise each
    split stores its unnormalized sums, row maxima and row sums (acc_ptr [SPLITS, T, H, D],
    ml_ptr [SPLITS, T, H, 2], fp32), and the tile's last split to arrive (cnt_ptr,
    `split_k_arrive`) combines them in split order. The splits' key ranges do not depend on the
    step, so a row's numbers do not depend on the other rows. WINDOW (unsplit only): a query at p
    attends keys p - window < key ≤ p, from the key block (on the same grid from 0) holding the
    tile's first such key; blocks a row sees nothing of leave its sums exactly 0, so a row's
    numbers still do not depend on the tile. SOFTCAP: scores s → softcap · tanh(s / softcap)."""
    pdl_begin(USE_PDL)
    pid_m = tl.program_id(0) // SPLITS
    split = tl.program_id(0) % SPLITS
    b = tl.program_id(1)
    h = tl.program_id(2)
    kvh = h // GROUP
    q_start = tl.load(cu_ptr + b)
    q_len = tl.load(cu_ptr + b + 1) - q_start
    if pid_m * BLOCK_M >= q_len:
        return
    seq_len = tl.load(seq_ptr + b)
    ctx = seq_len - q_len  # tokens already in the cache before this step
    # causal: the last query of this tile sees keys up to its own position
    kv_end = tl.minimum(seq_len, ctx + (pid_m + 1) * BLOCK_M)
    kv_lo = 0
    kv_hi = kv_end
    if WINDOW:
        kv_lo = (tl.maximum(ctx + pid_m * BLOCK_M - window + 1, 0) // BLOCK_N) * BLOCK_N
    if SPLITS > 1:
        kv_lo = split * chunk
        if kv_lo >= kv_end:  # no key of this split is visible to the tile
            return
        if split < SPLITS - 1:
            kv_hi = tl.minimum(kv_end, kv_lo + chunk)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM] query index inside the sequence
    offs_d = tl.arange(0, BLOCK_D)
    mask_m = offs_m < q_len
    mask_d = offs_d < D
    tok = (q_start + offs_m).to(tl.int64)
    q = tl.load(q_ptr + tok[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
                mask=mask_m[:, None] & mask_d[None, :], other=0.0)  # [BM, BD]
    pos_q = ctx + offs_m  # [BM] absolute position of each query
    if KIND != KV_FLOAT:
        k_s = tl.load(ks_ptr + kvh)
        v_s = tl.load(vs_ptr + kvh)
    if DOT_FP32:
        q = q.to(tl.float32)

    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    for n0 in range(kv_lo, kv_hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)  # [BN] key positions
        mask_n = offs_n < kv_hi
        blk = tl.load(bt_ptr + b * stride_bt + offs_n // block_size, mask=mask_n, other=0)
        slot = blk.to(tl.int64) * block_size + offs_n % block_size  # [BN]
        kv_off = slot[:, None] * stride_slot + kvh * D + offs_d[None, :]  # [BN, BD]
        kv_mask = mask_n[:, None] & mask_d[None, :]
        k = tl.load(kc_ptr + kv_off, mask=kv_mask, other=0.0).to(tl.float32)
        v = tl.load(vc_ptr + kv_off, mask=kv_mask, other=0.0).to(tl.float32)
        if KIND != KV_FLOAT:
            k = k * k_s
            v = v * v_s
        if DOT_FP32:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")  # [BM, BN]
        else:
            s = tl.dot(q, tl.trans(k.to(q.dtype)))
        s = s * sm_scale
        if SOFTCAP:  # softcap · tanh(s / softcap), tanh through exp (2 / (1 + e^-2x) - 1)
            s = softcap * (2.0 / (1.0 + tl.exp(-2.0 * s / softcap)) - 1.0)
        visible = mask_n[None, :] & (offs_n[None, :] <= pos_q[:, None])
        if WINDOW:
            visible = visible & (offs_n[None, :] > pos_q[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))  # finite in split 0: key 0 is visible to every query
        if SPLITS > 1:  # a later split may hold no key a row sees yet: its sums stay 0
            m_new = tl.where(m_new == float("-inf"), 0.0, m_new)
        m_use = m_new
        if WINDOW:  # a block before a row's window: exp(-inf - 0) = 0 leaves its sums 0, its max -inf
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_use)
        p = tl.exp(s - m_use[:, None])  # [BM, BN]
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if DOT_FP32:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype))
        m_i = m_new
    out_mask = mask_m[:, None] & mask_d[None, :]
    if SPLITS > 1:
        parts = tl.minimum(tl.cdiv(kv_end, chunk), SPLITS)  # the splits that hold keys the tile sees
        if parts > 1:
            row = (split * T + tok) * H + h  # [BM] (split, token, head), int64
            tl.store(acc_ptr + row[:, None] * D + offs_d[None, :], acc, mask=out_mask)
            # a row that sees no key of this split: a maximum of -inf, so that its weight is 0
            tl.store(ml_ptr + row * 2, tl.where(l_i == 0, float("-inf"), m_i), mask=mask_m)
            tl.store(ml_ptr + row * 2 + 1, l_i, mask=mask_m)
            tile = (pid_m * tl.num_programs(1) + b) * H + h
            if split_k_arrive(cnt_ptr, tile, parts) != parts - 1:
                return  # the tile's last split combines
            m_all = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
            for s_ in range(0, parts):
                row = (s_ * T + tok) * H + h
                m_all = tl.maximum(m_all, tl.load(ml_ptr + row * 2, mask=mask_m, other=0.0, cache_modifier=".cg"))
            l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
            acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
            for s_ in range(0, parts):  # in split order: the numbers do not depend on which split came last
                row = (s_ * T + tok) * H + h
                w = tl.exp(tl.load(ml_ptr + row * 2, mask=mask_m, other=0.0, cache_modifier=".cg") - m_all)
                l_i += tl.load(ml_ptr + row * 2 + 1, mask=mask_m, other=0.0, cache_modifier=".cg") * w
                acc += tl.load(acc_ptr + row[:, None] * D + offs_d[None, :], mask=out_mask, other=0.0,
                               cache_modifier=".cg") * w[:, None]
            l_i = tl.where(mask_m, l_i, 1.0)  # rows past the tile's queries: stored nowhere
    if WINDOW:  # rows past the tile's queries may see no key of the loop's: stored nowhere
        l_i = tl.where(mask_m, l_i, 1.0)
    out = acc / l_i[:, None]
    tl.store(out_ptr + tok[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=out_mask)


def _check_attn(q, k_cache, v_cache, cu_q_lens, seq_lens, block_tables, k_scale, v_scale):
    _check_cache(k_cache, v_cache, k_scale, v_scale)
    _, _, hkv, d = k_cache.shape
    check_tensor(q, "q", ndim=3, dtypes=FLOAT_DTYPES, contiguous=False)
    T, H, dq = q.shape
    if dq != d:
        raise QuantSpecError(f"q has head_dim {dq} but the KV cache has {d}; they must match")
    if q.stride(2) != 1:
        raise QuantSpecError("q must have a contiguous head_dim; call .contiguous() on it")
    if H % hkv:
        raise QuantSpecError(f"num_heads={H} is not a multiple of num_kv_heads={hkv} (GQA groups)")
    check_tensor(cu_q_lens, "cu_q_lens", ndim=1, dtypes=(torch.int32,))
    B = cu_q_lens.shape[0] - 1
    if B < 1:
        raise QuantSpecError("cu_q_lens must hold B + 1 >= 2 prefix sums (at least one sequence)")
    check_tensor(seq_lens, "seq_lens", dtypes=(torch.int32,), shape=(B,))
    check_tensor(block_tables, "block_tables", ndim=2, dtypes=(torch.int32,))
    if block_tables.shape[0] != B:
        raise QuantSpecError(f"block_tables has {block_tables.shape[0]} rows; expected B={B}")
    return T, H, hkv, d, B


def paged_attention_ref(
    q: torch.Tensor,  # [T, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    cu_q_lens: torch.Tensor,  # [B + 1] int32
    seq_lens: torch.Tensor,  # [B] int32, including the new tokens
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    k_scale: torch.Tensor | None = None,  # [num_kv_heads] fp32 (int8/fp8 caches)
    v_scale: torch.Tensor | None = None,  # [num_kv_heads] fp32
    max_q_len: int | None = None,
    window: int | None = None,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Torch reference, one sequence at a time in fp32; returns [T, num_heads, head_dim] in q.dtype.
    `window`: a query at p attends keys p - window < key ≤ p; `softcap`: scores s → softcap ·
    tanh(s / softcap)."""
    T, H, hkv, d, B = _check_attn(q, k_cache, v_cache, cu_q_lens, seq_lens, block_tables,
                                  k_scale, v_scale)
    from quantspec.kernels._quant_bridge import dequantize

    bs = k_cache.shape[1]
    group = H // hkv
    out = torch.empty_like(q)
    cu = cu_q_lens.tolist()
    for b in range(B):
        L = cu[b + 1] - cu[b]
        if L == 0:
            continue
        S = int(seq_lens[b])
        if L > S:
            raise QuantSpecError(f"sequence {b} has q_len={L} > seq_len={S}; seq_lens must include new tokens")
        blocks = block_tables[b, : -(-S // bs)].long()
        k = k_cache[blocks].reshape(-1, hkv, d)[:S]  # [S, Hkv, D]
        v = v_cache[blocks].reshape(-1, hkv, d)[:S]
        if _kv_kind(k_cache.dtype):
            k = dequantize(k, k_scale[None, :, None])
            v = dequantize(v, v_scale[None, :, None])
        k = k.float().repeat_interleave(group, dim=1)  # [S, H, D]
        v = v.float().repeat_interleave(group, dim=1)
        qb = q[cu[b]: cu[b + 1]].float()  # [L, H, D]
        scores = torch.einsum("lhd,shd->hls", qb, k) / math.sqrt(d)  # [H, L, S]
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        pos = torch.arange(S - L, S, device=q.device)[:, None]  # [L, 1]
        keys = torch.arange(S, device=q.device)[None, :]
        hidden = (keys > pos) | (keys <= pos - window) if window is not None else keys > pos
        scores = scores.masked_fill(hidden, float("-inf"))
        out[cu[b]: cu[b + 1]] = torch.einsum("hls,shd->lhd", scores.softmax(-1), v).to(q.dtype)
    return out


def paged_attention(
    q: torch.Tensor,  # [T, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    cu_q_lens: torch.Tensor,  # [B + 1] int32
    seq_lens: torch.Tensor,  # [B] int32, including the new tokens
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    k_scale: torch.Tensor | None = None,  # [num_kv_heads] fp32 (int8/fp8 caches)
    v_scale: torch.Tensor | None = None,  # [num_kv_heads] fp32
    max_q_len: int | None = None,
    kv_chunk: int | None = None,
    kv_splits: int = 1,
    window: int | None = None,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Triton varlen paged attention; returns [T, num_heads, head_dim] in q.dtype.

    Pass `max_q_len` (the longest q_len in the batch) to avoid a device→host sync.
    `kv_chunk` (a multiple of 64) and `kv_splits` > 1: the keys of each query tile are split
    across `kv_splits` programs at absolute positions (chunks of `kv_chunk` keys, the last split
    taking the rest) whose partial softmax sums the last to finish combines, so that a long
    context is read by many programs at once (flash-decoding); a row's numbers still do not
    depend on the other rows of its step, and a context within one chunk gets the unsplit
    kernel's numbers. Without counters for the launch (`_common.split_k_counters`) unsplit.
    `window` (a sliding window: a query at p attends keys p - window < key ≤ p; unsplit) and
    `softcap` (scores s → softcap · tanh(s / softcap)) as `paged_attention_ref`.
    """
    T, H, hkv, d, B = _check_attn(q, k_cache, v_cache, cu_q_lens, seq_lens, block_tables,
                                  k_scale, v_scale)
    device = check_same_device(q=q, k_cache=k_cache, v_cache=v_cache, cu_q_lens=cu_q_lens,
                               seq_lens=seq_lens, block_tables=block_tables,
                               k_scale=k_scale, v_scale=v_scale)
    out = torch.empty((T, H, d), device=device, dtype=q.dtype)
    if T == 0:
        return out
    if max_q_len is None:
        max_q_len = int((cu_q_lens[1:] - cu_q_lens[:-1]).max())
    on_gpu = gpu_launch(device)
    # one query tile size for every step: a row's numbers do not depend on the other rows of its
    # step (a verification row equals the decode step at its position)
    block_m = 16
    block_n = 16 if not on_gpu else 64
    dot_fp32 = dot_in_fp32(q.dtype)
    dummy = seq_lens
    tiles = triton.cdiv(max_q_len, block_m)
    splits, chunk, counters = 1, 0, None
    if kv_splits > 1 and window is None:
        if kv_chunk is None or kv_chunk < 64 or kv_chunk % 64:
            raise QuantSpecError(f"paged_attention: kv_chunk={kv_chunk} must be a positive multiple of 64 "
                                 f"with kv_splits={kv_splits}")
        counters = split_k_counters(device, tiles * B * H)
        if counters is not None:
            splits, chunk = kv_splits, kv_chunk
    acc = ml = dummy
    if splits > 1:
        acc = torch.empty((splits, T, H, d), device=device, dtype=torch.float32)
        ml = torch.empty((splits, T, H, 2), device=device, dtype=torch.float32)
    _paged_attn_kernel[(tiles * splits, B, H)](
        q, k_cache, v_cache, cu_q_lens, seq_lens, block_tables,
        k_scale if k_scale is not None else dummy, v_scale if v_scale is not None else dummy, out,
        acc, ml, counters if counters is not None else dummy,
        1.0 / math.sqrt(d), q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        block_tables.stride(0), hkv * d, d, k_cache.shape[1], chunk, T, H, window or 0, float(softcap),
        GROUP=H // hkv, KIND=_kv_kind(k_cache.dtype), DOT_FP32=dot_fp32,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=max(16, triton.next_power_of_2(d)), SPLITS=splits,
        WINDOW=window is not None, SOFTCAP=bool(softcap), num_warps=4, num_stages=2, **pdl_kwargs(device),
    )
    return out
