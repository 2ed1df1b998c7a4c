"""Paged KV cache: quantize-on-write (bit-exact vs reference) and varlen paged attention (kernel vs
reference, and reference vs dense causal attention from torch's SDPA)."""

import math

import pytest
import torch
import torch.nn.functional as F

from quantspec.errors import QuantSpecError
from quantspec.kernels.kv_cache import (
    paged_attention,
    paged_attention_ref,
    write_kv_cache,
    write_kv_cache_ref,
)

H, HKV, D, BS, NB = 6, 2, 24, 8, 24  # GQA group 3, head_dim not a power of two, block 8
CACHE_DTYPES = [torch.float32, torch.float16, torch.int8, torch.float8_e4m3fn]


def _batch(q_lens, ctx_lens, seed=0, nb=NB):
    """A batch: decode (q_len 1), verify (1 + k) and prefill sequences over shuffled blocks."""
    gen = torch.Generator().manual_seed(seed)
    B = len(q_lens)
    seq = [c + q for c, q in zip(ctx_lens, q_lens)]
    perm = torch.randperm(nb, generator=gen)
    max_blocks = max(-(-s // BS) for s in seq) + 1
    bt = perm[: B * max_blocks].reshape(B, max_blocks).int()
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    return bt, cu, torch.tensor(seq, dtype=torch.int32), gen


def _slots(bt, positions_per_seq):
    return [int(bt[b, p // BS]) * BS + p % BS for b, ps in enumerate(positions_per_seq) for p in ps]


def _scales(dtype, gen):
    if dtype in (torch.int8, torch.float8_e4m3fn):
        return torch.rand(HKV, generator=gen) * 0.03 + 0.01, torch.rand(HKV, generator=gen) * 0.03 + 0.01
    return None, None


def _filled_cache(dtype, bt, seq, gen, nb=NB):
    kc = torch.zeros(nb, BS, HKV, D, dtype=dtype)
    vc = torch.zeros_like(kc)
    ks, vs = _scales(dtype, gen)
    slots = torch.tensor(_slots(bt, [range(int(s)) for s in seq]), dtype=torch.int64)
    k = torch.randn(len(slots), HKV, D, generator=gen)
    v = torch.randn(len(slots), HKV, D, generator=gen)
    write_kv_cache_ref(k, v, kc, vc, slots, ks, vs)
    return kc, vc, ks, vs


def _bits(t):
    return t.view(torch.uint8) if t.element_size() == 1 else t


@pytest.mark.parametrize("dtype", CACHE_DTYPES)
def test_write_exact(dtype):
    bt, cu, seq, gen = _batch([3, 5], [4, 0])
    kc, vc = torch.zeros(NB, BS, HKV, D, dtype=dtype), torch.zeros(NB, BS, HKV, D, dtype=dtype)
    kc2, vc2 = kc.clone(), vc.clone()
    ks, vs = _scales(dtype, gen)
    slots = torch.tensor(_slots(bt, [range(4, 7), range(5)]) + [-1], dtype=torch.int64)  # -1: pad
    k = torch.randn(len(slots), HKV, D, generator=gen) * 2
    v = torch.randn(len(slots), HKV, D, generator=gen) * 2
    write_kv_cache(k.to(torch.float16), v, kc, vc, slots, ks, vs)
    write_kv_cache_ref(k.to(torch.float16), v, kc2, vc2, slots, ks, vs)
    assert torch.equal(_bits(kc), _bits(kc2)) and torch.equal(_bits(vc), _bits(vc2))
    assert _bits(kc).float().abs().sum() > 0
    # the reference writes what quantization says, and only to the given slots
    flat = kc2.view(-1, HKV, D)
    ref_rows = k[:-1].to(torch.float16).float()
    if ks is not None:
        sc = ks[None, :, None]
        got = flat[slots[:-1]].float() * sc
        if dtype == torch.int8:  # within half a step of the value clamped to the int8 range
            assert ((got - torch.clamp(ref_rows, -128 * sc, 127 * sc)).abs() <= sc / 2 + 1e-6).all()
        else:  # fp8 E4M3: 3 mantissa bits, relative error <= 2**-4 (normal range)
            assert ((got - ref_rows).abs() <= ref_rows.abs() / 16 + sc * 2**-9).all()
    else:
        torch.testing.assert_close(flat[slots[:-1]].float(), ref_rows.to(dtype).float())
    untouched = torch.ones(flat.shape[0], dtype=torch.bool)
    untouched[slots[:-1]] = False
    assert _bits(flat[untouched]).float().abs().sum() == 0


@pytest.mark.parametrize("dtype", CACHE_DTYPES)
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.float16])
def test_paged_attention_matches_reference(dtype, q_dtype):
    # decode (1 new token), speculative verify (1 + 3), prefill crossing BLOCK_M (17), mid-prefill
    q_lens, ctx = [1, 4, 17, 5], [13, 9, 0, 20]
    bt, cu, seq, gen = _batch(q_lens, ctx, seed=1)
    kc, vc, ks, vs = _filled_cache(dtype, bt, seq, gen)
    q = torch.randn(int(cu[-1]), H, D, generator=gen).to(q_dtype)
    out = paged_attention(q, kc, vc, cu, seq, bt, ks, vs)
    ref = paged_attention_ref(q, kc, vc, cu, seq, bt, ks, vs)
    assert out.dtype == q_dtype and out.shape == q.shape
    tol = 1e-5 if q_dtype == torch.float32 else 5e-3
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float16, torch.int8])
@pytest.mark.parametrize("splits", [2, 3])
def test_split_attention_matches_reference(dtype, splits):
    """Keys split across programs in chunks of 64 (the last split taking the rest: 2 splits of
    a 151-key context) and combined by the last to finish: decode, verification and prefill
    rows give the reference."""
    q_lens, ctx = [1, 4, 17], [150, 100, 40]
    bt, cu, seq, gen = _batch(q_lens, ctx, seed=4, nb=64)
    kc, vc, ks, vs = _filled_cache(dtype, bt, seq, gen, nb=64)
    q = torch.randn(int(cu[-1]), H, D, generator=gen)
    out = paged_attention(q, kc, vc, cu, seq, bt, ks, vs, kv_chunk=64, kv_splits=splits)
    torch.testing.assert_close(out, paged_attention_ref(q, kc, vc, cu, seq, bt, ks, vs), rtol=1e-5, atol=1e-5)


def test_split_attention_rows_do_not_depend_on_the_step():
    """A decode row equals, bit for bit, the same row inside a verification step whose tile
    sees one split more (position 127: the decode step's keys end at a chunk's end); a context
    within one chunk gets the unsplit kernel's numbers."""
    q_lens, ctx = [5], [127]
    bt, cu, seq, gen = _batch(q_lens, ctx, seed=5, nb=40)
    kc, vc, ks, vs = _filled_cache(torch.float16, bt, seq, gen, nb=40)
    kc.abs_()  # every score negative: a split a row does not see must not lift its maximum to 0
    q = -torch.randn(5, H, D, generator=gen).abs()
    split = dict(kv_chunk=64, kv_splits=4)
    verify = paged_attention(q, kc, vc, cu, seq, bt, ks, vs, **split)
    for i in (0, 3):  # positions 127 (2 splits when decoded) and 130 (3)
        one = torch.tensor([0, 1], dtype=torch.int32)
        decode = paged_attention(q[i:i + 1], kc, vc, one, torch.tensor([128 + i], dtype=torch.int32), bt, ks, vs,
                                 **split)
        assert torch.equal(decode[0], verify[i]), i
    torch.testing.assert_close(verify, paged_attention(q, kc, vc, cu, seq, bt, ks, vs), rtol=1e-5, atol=1e-5)
    short = torch.tensor([40], dtype=torch.int32)
    assert torch.equal(paged_attention(q, kc, vc, cu, short, bt, ks, vs, **split),
                       paged_attention(q, kc, vc, cu, short, bt, ks, vs))
    with pytest.raises(QuantSpecError, match="kv_chunk=48 must be a positive multiple of 64"):
        paged_attention(q, kc, vc, cu, seq, bt, ks, vs, kv_chunk=48, kv_splits=2)


def test_reference_matches_dense_sdpa():
    q_lens, ctx = [1, 4, 6], [10, 3, 0]
    bt, cu, seq, gen = _batch(q_lens, ctx, seed=2)
    kc, vc, ks, vs = _filled_cache(torch.float32, bt, seq, gen)
    q = torch.randn(int(cu[-1]), H, D, generator=gen)
    ref = paged_attention_ref(q, kc, vc, cu, seq, bt)
    for b, (L, S) in enumerate(zip(q_lens, seq.tolist())):
        rows = torch.tensor([int(bt[b, p // BS]) * BS + p % BS for p in range(S)])
        k = kc.view(-1, HKV, D)[rows].transpose(0, 1)[None]  # [1, HKV, S, D]
        v = vc.view(-1, HKV, D)[rows].transpose(0, 1)[None]
        qb = q[cu[b]: cu[b + 1]].transpose(0, 1)[None]  # [1, H, L, D]
        mask = torch.arange(S)[None, :] <= torch.arange(S - L, S)[:, None]  # [L, S]
        dense = F.scaled_dot_product_attention(qb, k, v, attn_mask=mask, enable_gqa=True,
                                               scale=1 / math.sqrt(D))
        torch.testing.assert_close(ref[cu[b]: cu[b + 1]], dense[0].transpose(0, 1), rtol=1e-5, atol=1e-5)


def test_noncontiguous_q_heads_and_max_q_len():
    q_lens, ctx = [2, 3], [5, 1]
    bt, cu, seq, gen = _batch(q_lens, ctx, seed=3)
    kc, vc, ks, vs = _filled_cache(torch.int8, bt, seq, gen)
    qkv = torch.randn(5, H + 2 * HKV, D, generator=gen)
    q = qkv[:, :H]  # a view into a fused qkv projection: strided over tokens, contiguous head_dim
    out = paged_attention(q, kc, vc, cu, seq, bt, ks, vs, max_q_len=3)
    torch.testing.assert_close(out, paged_attention_ref(q, kc, vc, cu, seq, bt, ks, vs),
                               rtol=1e-5, atol=1e-5)


def test_bad_inputs_raise():
    bt, cu, seq, gen = _batch([1], [3])
    kc = torch.zeros(NB, BS, HKV, D, dtype=torch.int8)
    q = torch.randn(1, H, D)
    with pytest.raises(QuantSpecError, match="k_scale is required"):
        paged_attention(q, kc, kc.clone(), cu, seq, bt)
    s = torch.ones(HKV)
    with pytest.raises(QuantSpecError, match="head_dim"):
        paged_attention(torch.randn(1, H, D + 1), kc, kc.clone(), cu, seq, bt, s, s)
    with pytest.raises(QuantSpecError, match="multiple of num_kv_heads"):
        paged_attention(torch.randn(1, 5, D), kc, kc.clone(), cu, seq, bt, s, s)
    with pytest.raises(QuantSpecError, match="cu_q_lens has dtype"):
        paged_attention(q, kc, kc.clone(), cu.long(), seq, bt, s, s)
    with pytest.raises(QuantSpecError, match="must match k_cache"):
        paged_attention(q, kc, kc.float(), cu, seq, bt, s, s)
    with pytest.raises(QuantSpecError, match="slot_mapping"):
        write_kv_cache(torch.randn(2, HKV, D), torch.randn(2, HKV, D), kc, kc.clone(),
                       torch.zeros(2, dtype=torch.int32), s, s)
    with pytest.raises(QuantSpecError, match="value has shape"):
        write_kv_cache(torch.randn(2, HKV, D), torch.randn(3, HKV, D), kc, kc.clone(),
                       torch.zeros(2, dtype=torch.int64), s, s)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("q_dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.int8, torch.float8_e4m3fn])
def test_gpu_half_queries(dtype, q_dtype):
    q_lens, ctx = [1, 4, 24], [40, 20, 0]  # decode, a verification, a prefill
    bt, cu, seq, gen = _batch(q_lens, ctx, seed=4)
    kc, vc, ks, vs = _filled_cache(dtype, bt, seq, gen)
    dev = lambda t: None if t is None else t.cuda()  # noqa: E731
    q = torch.randn(int(cu[-1]), H, D, generator=gen).to(q_dtype).cuda()
    args = [dev(t) for t in (kc, vc, cu, seq, bt, ks, vs)]
    torch.testing.assert_close(paged_attention(q, *args).float(), paged_attention_ref(q, *args).float(),
                               rtol=2e-2, atol=2e-2)


def test_split_kv_chunks_and_the_steps_that_take_them(monkeypatch):
    """`kv_split`: chunks of 256 keys, longer ones past 16 splits, none where one chunk holds
    every sequence; `TritonAttention` with split_kv splits steps of at most 64 rows only, and
    its split attention over a cache gives the unsplit one's numbers within rounding."""
    from quantspec import kernels
    from quantspec.infer.cuda.attention import TritonAttention, kv_split
    from quantspec.infer.kv_cache import AttentionMetadata, PagedKVCache

    assert kv_split(None) is None and kv_split(256) is None
    assert kv_split(600) == (256, 3) and kv_split(8192) == (512, 16)
    chunk, splits = kv_split(100_000)
    assert chunk % 64 == 0 and splits <= 16 and chunk * splits >= 100_000 and chunk * (splits - 1) < 100_000
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # the attention calls its kernels itself
    cache = PagedKVCache(num_layers=1, num_blocks=80, block_size=BS, num_kv_heads=HKV, head_dim=D,
                         dtype=torch.float32, device=dev, max_seq_len=600)
    assert TritonAttention(cache).split is None and TritonAttention(cache, split_kv=True).split == (256, 3)
    gen = torch.Generator().manual_seed(6)
    kv = torch.randn(300, HKV, D, generator=gen).to(dev)
    tables = torch.arange(80, device=dev).reshape(2, 40)
    write = AttentionMetadata([300], [300], torch.arange(300, device=dev), tables[:1], None, None)
    TritonAttention(cache)(0, torch.randn(300, H, D, generator=gen).to(dev), kv, kv.flip(0), write)
    seen = []
    real = kernels.paged_attention
    monkeypatch.setattr(kernels, "paged_attention", lambda *a, **kw: seen.append(kw["kv_splits"]) or real(*a, **kw))
    q = torch.randn(65, H, D, generator=gen).to(dev)
    outs = {}
    for split_kv in (False, True):
        att = TritonAttention(cache, split_kv=split_kv)
        for T in (1, 65):
            meta = AttentionMetadata([T], [300], torch.full((T,), -1, device=dev), tables[:1], None, None)
            outs[split_kv, T] = att(0, q[:T], torch.zeros(T, HKV, D, device=dev), torch.zeros(T, HKV, D, device=dev),
                                    meta)
    assert seen == [1, 1, 3, 1]
    torch.testing.assert_close(outs[True, 1], outs[False, 1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.int8])
@pytest.mark.parametrize("window, softcap", [(5, 0.0), (20, 0.0), (None, 2.0), (7, 3.0)])
def test_window_and_softcap_match_reference(dtype, window, softcap):
    """A sliding window (keys p - window < key ≤ p) shorter than some contexts and longer than
    others, and soft-capped scores: decode, verification, prefill and mid-prefill rows give the
    reference; the reference itself is the masked, capped attention written out per row."""
    q_lens, ctx = [1, 4, 17, 5], [13, 9, 0, 30]
    bt, cu, seq, gen = _batch(q_lens, ctx, seed=6)
    kc, vc, ks, vs = _filled_cache(dtype, bt, seq, gen)
    q = torch.randn(int(cu[-1]), H, D, generator=gen) * 2
    out = paged_attention(q, kc, vc, cu, seq, bt, ks, vs, window=window, softcap=softcap)
    ref = paged_attention_ref(q, kc, vc, cu, seq, bt, ks, vs, window=window, softcap=softcap)
    torch.testing.assert_close(out, ref, rtol=2e-5, atol=2e-5)
    assert (ref - paged_attention_ref(q, kc, vc, cu, seq, bt, ks, vs)).abs().max() > 1e-2  # they matter
    # the reference, written out for the mid-prefill sequence's last row (position 34)
    b, row = 3, int(cu[-1]) - 1
    blocks = bt[b, : -(-int(seq[b]) // BS)].long()
    k = kc[blocks].reshape(-1, HKV, D)[:35].float()
    v = vc[blocks].reshape(-1, HKV, D)[:35].float()
    if ks is not None:
        k, v = k * ks[None, :, None], v * vs[None, :, None]
    lo = 0 if window is None else 35 - window
    s = torch.einsum("hd,shd->hs", q[row], k[lo:].repeat_interleave(H // HKV, 1)) / math.sqrt(D)
    s = torch.tanh(s / softcap) * softcap if softcap else s
    want = torch.einsum("hs,shd->hd", s.softmax(-1), v[lo:].repeat_interleave(H // HKV, 1))
    torch.testing.assert_close(ref[row], want, rtol=1e-5, atol=1e-5)


def test_window_rows_do_not_depend_on_the_step():
    """With a window, a decode row equals, bit for bit, the same row inside a verification step
    whose tile starts its keys blocks earlier (the rows before it see keys the decode row's
    window has left)."""
    q_lens, ctx = [6], [40]
    bt, cu, seq, gen = _batch(q_lens, ctx, seed=7, nb=40)
    kc, vc, ks, vs = _filled_cache(torch.float16, bt, seq, gen, nb=40)
    q = torch.randn(6, H, D, generator=gen).half()
    verify = paged_attention(q, kc, vc, cu, seq, bt, ks, vs, window=16, softcap=5.0)
    one = torch.tensor([0, 1], dtype=torch.int32)
    for i in range(6):
        decode = paged_attention(q[i:i + 1], kc, vc, one, torch.tensor([41 + i], dtype=torch.int32), bt, ks, vs,
                                 window=16, softcap=5.0)
        assert torch.equal(decode[0], verify[i]), i


@pytest.mark.parametrize("arch", ["mistral", "gemma2", "gemma3"])
def test_engine_on_the_triton_kernel_slides_and_caps_as_the_torch_path(arch, tmp_path, monkeypatch):
    """The engine over a cache whose attention is `TritonAttention` (run by the interpreter):
    every layer sliding (Mistral), every other one with capped scores (Gemma 2) or with rotary
    tables of its own (Gemma 3), past the window, with n-gram verification: the kernel takes
    every step and the tokens are the torch path's."""
    import json

    from quantspec import kernels
    from quantspec.infer.backend import Runtime
    from quantspec.infer.cuda.attention import TritonAttention
    from quantspec.infer.spec.proposers import ReferenceProposer
    from quantspec.model_zoo.checkpoint import load_model
    from quantspec.model_zoo.tiny import build_tiny_model
    from window_paths import decode, random_prompts

    d = build_tiny_model(tmp_path / arch, arch)
    if arch == "mistral":
        cfg = json.loads((d / "config.json").read_text())
        (d / "config.json").write_text(json.dumps({**cfg, "sliding_window": 6}))
    model = load_model(d)[0]
    prompts = random_prompts([9, 3], seed=8)
    prompts[1] = (prompts[0] * 2)[:12]  # repeats: the n-gram drafter finds matches
    torch_path = decode(model, prompts, new=10, proposer=ReferenceProposer(2, 3), k=3)
    windows = []
    real = kernels.paged_attention
    monkeypatch.setattr(kernels, "paged_attention", lambda *a, **kw: windows.append(kw["window"]) or real(*a, **kw))
    runtime = Runtime(device=torch.device("cpu"), attention=TritonAttention)
    assert decode(model, prompts, new=10, proposer=ReferenceProposer(2, 3), k=3, runtime=runtime) == torch_path
    assert 6 in windows and (None in windows) == (arch != "mistral")
