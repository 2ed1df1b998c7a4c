"""quantspec's CPU kernels against their torch references (`*_ref`): odd shapes, fp32 / bf16 x,
bias, M-invariance (bitwise), the packings, bad input, and the fallback."""

import os
import subprocess
import sys

import pytest
import torch

from quantspec.kernels import cpu as cg

needs_kernels = pytest.mark.skipif(cg.cpu_kernels() is None,
                                   reason="quantspec's CPU kernels are not built here")


def _close(y, ref, dtype):
    assert y.dtype == dtype and y.shape == ref.shape
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(y.float(), ref.float(), rtol=tol, atol=tol * float(ref.float().abs().max()))


def test_int4_packing_round_trips():
    q = torch.randint(-8, 8, (37, 96), dtype=torch.int8)
    s = torch.rand(37, 3)
    z = torch.randn(37, 3)
    p, sb, off = cg.pack_w4(q, s, z)
    assert p.shape == (2, 96, 16) and p.dtype == torch.uint8 and sb.shape == off.shape == (2, 3, 32)
    assert torch.equal(cg.unpack_w4(p, 37), q)
    # byte j of block b, step k: column 32 b + j (+ 8) low, column 32 b + j + 16 (+ 8) high
    assert int(p[1, 5, 2]) == (int(q[34, 5]) + 8) | (8 << 4)  # column 50 is padding (code 0)
    assert int(p[0, 5, 2]) == (int(q[2, 5]) + 8) | ((int(q[18, 5]) + 8) << 4)
    torch.testing.assert_close(off[0, 1, 3], z[3, 1] - 8 * s[3, 1])  # w = (q + 8) s + off
    assert torch.equal(cg.unpack_w4(*cg.pack_w4(q[:, :48], s[:, :1], z[:, :1])[:1], 37), q[:, :48])


@needs_kernels
@pytest.mark.parametrize("K", [48, 96, 576])  # 48: a K % 32 == 16 tail
@pytest.mark.parametrize("M", [1, 2, 3, 5, 9, 11, 12])
@pytest.mark.parametrize("xdtype", [torch.float32, torch.bfloat16])
def test_dense_and_int8_match_reference(K, M, xdtype):
    g = torch.Generator().manual_seed(K * 31 + M)
    N = 37
    x = torch.randn(M, K, generator=g).to(xdtype)
    b = torch.randn(N, generator=g)
    for wdtype in (torch.float32, torch.bfloat16):
        w = torch.randn(N, K, generator=g).to(wdtype)
        _close(cg.dense_gemv(x, w, b), cg.dense_gemv_ref(x, w, b), xdtype)
        _close(cg.dense_gemv(x, w), cg.dense_gemv_ref(x, w), xdtype)
    q = torch.randint(-128, 128, (N, K), dtype=torch.int8, generator=g)
    s = torch.rand(N, generator=g) * 0.01
    want = (x.double() @ q.double().t()) * s.double() + b.double()
    _close(cg.packed_w8_gemm(x, cg.pack_w8(q), s, N, b), want.to(xdtype), xdtype)
    _close(cg.packed_w8_gemm_ref(x, cg.pack_w8(q), s, N, b), want.to(xdtype), xdtype)


@needs_kernels
@pytest.mark.parametrize("K,group", [(96, 32), (128, 64), (192, 192), (40, 8), (88, 44), (63, 21)])  # any group dividing K
@pytest.mark.parametrize("M", [1, 4, 7, 19])
@pytest.mark.parametrize("xdtype", [torch.float32, torch.bfloat16])
def test_int4_matches_reference(K, group, M, xdtype):
    g = torch.Generator().manual_seed(K + M)
    N = 21
    x = torch.randn(M, K, generator=g).to(xdtype)
    q = torch.randint(-8, 8, (N, K), dtype=torch.int8, generator=g)
    s = torch.rand(N, K // group, generator=g) * 0.02
    zs = -torch.randint(-8, 8, s.shape, generator=g).float() * s  # w = (q - zp)·s
    p, sb, off = cg.pack_w4(q, s, zs)
    want = x.double() @ ((q.double() * s.double().repeat_interleave(group, 1))
                         + zs.double().repeat_interleave(group, 1)).t()
    _close(cg.packed_w4_gemm(x, p, sb, off, group, N), want.to(xdtype), xdtype)
    _close(cg.packed_w4_gemm_ref(x, p, sb, off, group, N), want.to(xdtype), xdtype)


@needs_kernels
def test_rows_are_bitwise_invariant_to_the_batch():
    """A row's output does not depend on how many rows come with it (decode vs verification)."""
    g = torch.Generator().manual_seed(0)
    K, N = 576, 50
    x = torch.randn(11, K, generator=g)
    w = torch.randn(N, K, generator=g)
    q = torch.randint(-128, 128, (N, K), dtype=torch.int8, generator=g)
    s = torch.rand(N, generator=g)
    q8 = cg.pack_w8(q)
    p4 = cg.pack_w4(torch.randint(-8, 8, (N, K), dtype=torch.int8, generator=g),
                    torch.rand(N, K // 32, generator=g), torch.randn(N, K // 32, generator=g))
    ops = [lambda a: cg.dense_gemv(a, w), lambda a: cg.dense_gemv(a, w.bfloat16()),
           lambda a: cg.packed_w8_gemm(a, q8, s, N), lambda a: cg.packed_w4_gemm(a, *p4, 32, N)]
    for op in ops:
        for xd in (x, x.bfloat16()):
            full = op(xd)
            for i in range(xd.shape[0]):
                assert torch.equal(op(xd[i:i + 1].contiguous()), full[i:i + 1])
            assert torch.equal(op(xd[3:8].contiguous()), full[3:8])
            assert torch.equal(op(torch.cat([xd] * 3)), torch.cat([full] * 3))  # 33 rows: 3 tiles


needs_pairs = pytest.mark.skipif(not cg.pair_path_available(),
                                 reason="needs quantspec's CPU kernels with AVX512-BF16")


def test_pairs_packing_round_trips():
    w = torch.randn(37, 20).bfloat16()
    p = cg.pack_pairs(w)
    assert p.shape == (2, 10, 32) and p.dtype == torch.int32
    assert torch.equal(cg.unpack_pairs(p, 37), w)
    # lane j of pair k: bf16(w[32 b + j, 2k]) low, bf16(w[32 b + j, 2k + 1]) high
    lo, hi = int(p[1, 4, 2]) & 0xFFFF, (int(p[1, 4, 2]) >> 16) & 0xFFFF
    assert lo == int(w[34, 8].view(torch.int16)) & 0xFFFF and hi == int(w[34, 9].view(torch.int16)) & 0xFFFF
    assert int(p[1, 4, 10]) == 0  # row 42: padding
    with pytest.raises(ValueError, match="even"):
        cg.pack_pairs(torch.randn(4, 5))


@needs_pairs
@pytest.mark.parametrize("N,K", [(37, 20), (64, 576), (96, 2), (33, 130)])
@pytest.mark.parametrize("M", [1, 2, 5, 11, 12, 23, 130])
def test_packed_pairs_gemm_matches_reference_for_any_rows(N, K, M):
    g = torch.Generator().manual_seed(N * 7 + K + M)
    w = torch.randn(N, K, generator=g).bfloat16()
    x = torch.randn(M, K, generator=g).bfloat16()
    b = torch.randn(N, generator=g)
    p = cg.pack_pairs(w)
    for bias in (None, b):
        want = x.double() @ w.double().t() + (0 if bias is None else bias.double())
        _close(cg.packed_pairs_gemm(x, p, N, bias), want.to(torch.bfloat16), torch.bfloat16)
        _close(cg.packed_pairs_gemm_ref(x, p, N, bias), want.to(torch.bfloat16), torch.bfloat16)
        full = cg.packed_pairs_gemm(x, p, N, bias)
        assert torch.equal(torch.cat([cg.packed_pairs_gemm(x[i:i + 1], p, N, bias) for i in range(M)]), full)


@needs_pairs
def test_packed_pairs_gemm_refuses_bad_input():
    p = cg.pack_pairs(torch.randn(40, 16))
    with pytest.raises(RuntimeError, match="bfloat16"):
        cg.packed_pairs_gemm(torch.randn(2, 16), p, 40)
    with pytest.raises(RuntimeError, match="features"):
        cg.packed_pairs_gemm(torch.randn(2, 18).bfloat16(), p, 40)
    with pytest.raises(RuntimeError, match="does not fit"):
        cg.packed_pairs_gemm(torch.randn(2, 16).bfloat16(), p, 70)
    with pytest.raises(RuntimeError, match=r"int32 \[NB, K/2, 32\]"):
        cg.packed_pairs_gemm(torch.randn(2, 16).bfloat16(), torch.zeros(2, 8, 32), 40)


@needs_pairs
def test_quantized_gemms_take_the_pair_path_for_bf16_x():
    """bf16 x with an even K (int4: an even group) runs the pair path, fp32 x and odd K / groups the
    fp32 chain: told apart by a subnormal input, which AVX512-BF16's dot product flushes to zero
    (the chain keeps it); with the path turned off the chain runs for bf16 too. Both paths match
    the float64 reference elsewhere (the reference tests above run bf16 x through the pair path)."""
    tiny = 2.0 ** -130  # subnormal in fp32 and bf16

    def probe(K, group=None, pairs=True):
        x = torch.zeros(1, K)
        x[0, 0] = tiny
        q = torch.ones(32, K, dtype=torch.int8)
        if group is None:
            return [float(cg.packed_w8_gemm(xx, cg.pack_w8(q), torch.ones(32), 32, pairs=pairs)[0, 0])
                    for xx in (x, x.bfloat16())]
        p4 = cg.pack_w4(q, torch.ones(32, K // group), torch.zeros(32, K // group))
        return [float(cg.packed_w4_gemm(xx, *p4, group, 32, pairs=pairs)[0, 0]) for xx in (x, x.bfloat16())]

    assert probe(64) == [tiny, 0.0]  # int8: fp32 x chain, bf16 x pairs
    assert probe(63) == [tiny, tiny]  # odd K: the chain
    assert probe(64, 32) == [tiny, 0.0] and probe(63, 21) == [tiny, tiny]  # int4: odd group → chain
    assert probe(64, pairs=False) == [tiny, tiny] and probe(64, 32, pairs=False) == [tiny, tiny]


def test_dense_packing_round_trips():
    w = torch.randn(37, 20)
    p = cg.pack_dense(w)
    assert p.shape == (2, 20, 32) and p.dtype == torch.float32
    assert torch.equal(p[1, 3, 4], w[36, 3]) and torch.equal(p[1, :, 5:], torch.zeros(20, 27))
    assert torch.equal(cg.unpack_dense(p, 37), w)


@needs_kernels
@pytest.mark.parametrize("N,K", [(37, 20), (64, 576), (96, 13), (5, 1)])  # any K; N % 32 tails
@pytest.mark.parametrize("M", [1, 2, 3, 5, 7, 8, 10, 11, 12, 19, 23, 130])  # tiles of <= 11 rows
@pytest.mark.parametrize("xdtype", [torch.float32, torch.bfloat16])
def test_packed_gemm_matches_reference_for_any_rows(N, K, M, xdtype):
    g = torch.Generator().manual_seed(N * K + M)
    x = torch.randn(M, K, generator=g).to(xdtype)
    w = torch.randn(N, K, generator=g)
    b = torch.randn(N, generator=g)
    p = cg.pack_dense(w)
    want = (x.double() @ w.double().t() + b.double()).to(xdtype)
    _close(cg.packed_gemm(x, p, N, b), want, xdtype)
    _close(cg.packed_gemm_ref(x, p, N, b), want, xdtype)
    _close(cg.packed_gemm(x, p, N), (x.double() @ w.double().t()).to(xdtype), xdtype)


@needs_kernels
def test_packed_gemm_rows_are_bitwise_invariant_to_the_batch():
    """Each output is one FMA chain over k in one lane: whatever tile (1-11 rows, M split into
    near-equal tiles) a row lands in, its result is the same bits as alone."""
    g = torch.Generator().manual_seed(1)
    N, K = 70, 576
    x = torch.randn(35, K, generator=g)
    p = cg.pack_dense(torch.randn(N, K, generator=g))
    b = torch.randn(N, generator=g)
    full = cg.packed_gemm(x, p, N, b)
    for i in range(x.shape[0]):
        assert torch.equal(cg.packed_gemm(x[i:i + 1].contiguous(), p, N, b), full[i:i + 1])
    for n in range(2, x.shape[0]):  # every number of rows up to 34: every tile size and split
        lo = n % 3
        hi = min(x.shape[0], lo + n)
        assert torch.equal(cg.packed_gemm(x[lo:hi].contiguous(), p, N, b), full[lo:hi])


@needs_kernels
def test_packed_gemm_refuses_bad_input():
    p = cg.pack_dense(torch.randn(40, 16))
    with pytest.raises(RuntimeError, match="does not fit"):
        cg.packed_gemm(torch.randn(2, 16), p, 70)
    with pytest.raises(RuntimeError, match="features"):
        cg.packed_gemm(torch.randn(2, 8), p, 40)
    with pytest.raises(RuntimeError, match=r"\[NB, K, 32\]"):
        cg.packed_gemm(torch.randn(2, 16), torch.randn(40, 16), 40)
    with pytest.raises(RuntimeError, match="bias"):
        cg.packed_gemm(torch.randn(2, 16), p, 40, torch.randn(39))


@needs_kernels
def test_bad_input_is_refused():
    x = torch.randn(2, 40)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        cg.dense_gemv(x, torch.randn(8, 40))
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        cg.dense_gemv(torch.randn(2, 64).half(), torch.randn(8, 64))
    q8 = cg.pack_w8(torch.zeros(8, 64, dtype=torch.int8))
    with pytest.raises(RuntimeError, match="features"):
        cg.packed_w8_gemm(torch.randn(2, 48), q8, torch.ones(8), 8)
    with pytest.raises(RuntimeError, match="scale"):
        cg.packed_w8_gemm(torch.randn(2, 64), q8, torch.ones(7), 8)
    p4 = cg.pack_w4(torch.zeros(8, 64, dtype=torch.int8), torch.ones(8, 2), torch.zeros(8, 2))
    with pytest.raises(RuntimeError, match="must divide K"):
        cg.packed_w4_gemm(torch.randn(2, 64), *p4, 48, 8)
    with pytest.raises(RuntimeError, match=r"\[NB, G, 32\]"):
        cg.packed_w4_gemm(torch.randn(2, 64), *p4, 16, 8)


def test_switch_off_falls_back_to_none():
    """QUANTSPEC_CPU_KERNELS=0: nothing is built, callers keep torch's ops."""
    code = ("from quantspec.kernels import cpu as cg; assert cg.cpu_kernels() is None; "
            "print(cg.cpu_kernels_error())")
    env = dict(os.environ, QUANTSPEC_CPU_KERNELS="0")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "QUANTSPEC_CPU_KERNELS=0" in out.stdout


def _untried_build(monkeypatch, build_fn, lacks_avx512: bool):
    """`cpu_kernels()` not yet asked in this process, with `_build` and the CPU check replaced."""
    from quantspec.kernels.cpu import build

    if build.platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("not x86-64: the build is never tried")
    monkeypatch.setattr(build, "_state", {"tried": False, "module": None, "error": None})
    monkeypatch.setattr(build, "_build", build_fn)
    monkeypatch.setattr(build, "_lacks_avx512", lambda: lacks_avx512)
    monkeypatch.delenv(cg.ENV_SWITCH, raising=False)


def _asked_twice(caplog) -> int:
    """Ask for the kernels twice (None both times): the number of warnings that they are unavailable."""
    with caplog.at_level("WARNING", logger="quantspec"):
        assert cg.cpu_kernels() is None and cg.cpu_kernels() is None
    return sum("CPU kernels unavailable" in r.message for r in caplog.records)


def test_a_failed_build_warns_once_and_returns_none(monkeypatch, caplog):
    _untried_build(monkeypatch, lambda: (_ for _ in ()).throw(RuntimeError("g++: not found")), False)
    assert _asked_twice(caplog) == 1 and "g++: not found" in cg.cpu_kernels_error()


def test_a_cpu_without_avx512_skips_the_build_and_says_so_once(monkeypatch, caplog):
    """Where /proc/cpuinfo shows no AVX-512 F + BW, nothing is compiled (minutes that could not
    run here), and one warning names the reason."""
    built = []
    _untried_build(monkeypatch, lambda: built.append(1), True)
    assert _asked_twice(caplog) == 1 and not built and "no AVX-512" in cg.cpu_kernels_error()


def test_avx512_is_read_from_the_cpu_flags(monkeypatch, tmp_path):
    from quantspec.kernels.cpu import build

    real = build.Path

    def cpuinfo(flags):
        f = tmp_path / "cpuinfo"
        f.write_text(f"processor\t: 0\nflags\t\t: {flags}\n")
        monkeypatch.setattr(build, "Path", lambda p: f if p == "/proc/cpuinfo" else real(p))
        return build._lacks_avx512()

    assert not cpuinfo("fpu sse2 avx2 avx512f avx512bw avx512vl")
    assert cpuinfo("fpu sse2 avx2 fma")
    assert cpuinfo("fpu avx512f")  # F without BW


def _attention_case(dtype, hd, G, seed):
    g = torch.Generator().manual_seed(seed)
    bs, KV = 16, 2
    H = KV * G
    nblocks = 24
    kc = torch.randn(nblocks * bs, KV, hd, generator=g).to(dtype)
    vc = torch.randn(nblocks * bs, KV, hd, generator=g).to(dtype)
    q_lens, seq_lens = [1, 4, 2], [40, 70, 17]
    tables = torch.tensor([[5, 2, 9, 0, 0], [10, 11, 12, 13, 20], [3, 4, 0, 0, 0]])  # scattered
    T = sum(q_lens)
    qkv = torch.randn(T, H + 2 * KV, hd, generator=g).to(dtype)  # q, k, v as strided views
    q, k, v = qkv[:, :H], qkv[:, H:H + KV], qkv[:, H + KV:]
    slots = [int(tables[b][p // bs]) * bs + p % bs
             for b, (ql, sl) in enumerate(zip(q_lens, seq_lens)) for p in range(sl - ql, sl)]
    return q, k, v, kc, vc, torch.tensor(slots), tables, q_lens, seq_lens, bs, hd ** -0.5


def _pair_modes(dtype):
    """bf16 attention runs two ways: the pair path (AVX512-BF16) and the fp32 chain"""
    if dtype == torch.bfloat16 and cg.pair_path_available():
        return [True, False]
    return [True]


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hd,G", [(64, 2), (64, 3), (128, 1), (64, 5), (128, 3), (64, 16), (64, 25)])
def test_paged_attention_matches_reference(dtype, hd, G):
    """Heads are computed in compile-time chunks (up to 4 at head_dim 64, 2 at 128): G = 5 and
    G = 3 at 128 take a partial last chunk; 25 query heads per KV head (multi-query models)."""
    for pairs in _pair_modes(dtype):
        args = _attention_case(dtype, hd, G, seed=hd + G)
        q, k, v, kc, vc, *rest = args
        kc2, vc2 = kc.clone(), vc.clone()
        out = cg.paged_attention(q, k, v, kc, vc, *rest, pairs=pairs)
        ref = cg.paged_attention_ref(q, k, v, kc2, vc2, *rest, pairs=pairs)
        assert torch.equal(kc, kc2) and torch.equal(vc, vc2)  # this step's k / v written to their slots
        _close(out, ref, dtype)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hd,G", [(64, 3), (64, 5), (128, 3)])
def test_paged_attention_rows_equal_one_query_calls(dtype, hd, G):
    """Verification rows (several queries of one sequence) equal decode calls of one query each."""
    q, k, v, kc, vc, sm, tables, q_lens, seq_lens, bs, scale = _attention_case(dtype, hd, G, seed=1)
    for pairs in _pair_modes(dtype):
        full = cg.paged_attention(q, k, v, kc, vc, sm, tables, q_lens, seq_lens, bs, scale, pairs=pairs)
        row = 0
        for b, (ql, sl) in enumerate(zip(q_lens, seq_lens)):
            for i in range(ql):
                r = row + i
                one = cg.paged_attention(q[r:r + 1], k[r:r + 1], v[r:r + 1], kc, vc, sm[r:r + 1],
                                         tables[b:b + 1].contiguous(), [1], [sl - ql + i + 1], bs, scale,
                                         pairs=pairs)
                assert torch.equal(one[0], full[r])
            row += ql


def _fresh_prompts(lens, KV, G, hd, seed, bs=16, dtype=torch.float32):
    """A prefill step of fresh prompts of `lens` tokens over scattered cache blocks."""
    g = torch.Generator().manual_seed(seed)
    nblocks = [-(-n // bs) for n in lens]
    order = torch.randperm(sum(nblocks) + 3, generator=g).tolist()
    tables, slots, used = [], [], 0
    for n, nb in zip(lens, nblocks):
        table = order[used:used + nb]
        used += nb
        tables.append(table + [0] * (max(nblocks) - nb))
        slots += [table[p // bs] * bs + p % bs for p in range(n)]
    kc = torch.zeros((sum(nblocks) + 3) * bs, KV, hd, dtype=dtype)
    vc = torch.zeros_like(kc)
    qkv = torch.randn(sum(lens), (G + 2) * KV, hd, generator=g).to(dtype)
    q, k, v = qkv[:, :G * KV], qkv[:, G * KV:(G + 1) * KV], qkv[:, (G + 1) * KV:]
    return q, k, v, kc, vc, torch.tensor(slots), torch.tensor(tables), list(lens), list(lens), bs, hd ** -0.5


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("blocks", [True, False])
@pytest.mark.parametrize("hd,G", [(64, 3), (128, 2), (64, 1), (64, 7), (128, 5)])
def test_fresh_prompts_match_reference(dtype, blocks, hd, G):
    """Fresh prompts of 16+ tokens take the blocked prefill kernel (queries on the lanes: fp32,
    and bf16 on the AVX512-BF16 pair path; off: the per-row kernel of decode steps), shorter ones
    the per-row kernel; one step mixes them (5, 16, 17, 40, 100 tokens: partial row blocks, the 8-
    and 1-key score tails, odd key counts for bf16's key pairs, query counts that are not a
    multiple of 16)."""
    for pairs in _pair_modes(dtype):
        q, k, v, kc, vc, *rest = _fresh_prompts([40, 5, 100, 16, 17], KV=2, G=G, hd=hd, seed=hd + G, dtype=dtype)
        kc2, vc2 = kc.clone(), vc.clone()
        out = cg.paged_attention(q, k, v, kc, vc, *rest, pairs=pairs, prefill_blocks=blocks)
        ref = cg.paged_attention_ref(q, k, v, kc2, vc2, *rest)
        assert torch.equal(kc, kc2) and torch.equal(vc, vc2)
        _close(out, ref, dtype)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fresh_prompt_rows_depend_only_on_their_own_keys(dtype):
    """A blocked prefill row's result is its own q and keys' alone, bitwise: the first 37 rows of
    a 100-token prompt equal a 37-token prompt of those rows (other row blocks, other key
    counts), and prompts prefilled together equal each prefilled alone."""
    if dtype == torch.bfloat16 and not cg.pair_path_available():
        pytest.skip("bf16 prompts take the blocked kernel on the AVX512-BF16 pair path only")
    q, k, v, kc, vc, sm, tables, lens, _, bs, scale = _fresh_prompts([100, 37], KV=3, G=3, hd=64, seed=3, dtype=dtype)
    q[100:], k[100:], v[100:] = q[:37], k[:37], v[:37]  # the 37-token prompt is the 100's first rows
    q *= 4  # sharper softmaxes: the paths' different sum orders show through bf16's rounding too
    both = cg.paged_attention(q, k, v, kc, vc, sm, tables, lens, lens, bs, scale)
    assert torch.equal(both[100:], both[:37])
    for b, (r0, n) in enumerate([(0, 100), (100, 37)]):
        alone = cg.paged_attention(q[r0:r0 + n], k[r0:r0 + n], v[r0:r0 + n], kc, vc, sm[r0:r0 + n],
                                   tables[b:b + 1].contiguous(), [n], [n], bs, scale)
        assert torch.equal(alone, both[r0:r0 + n])
    # the per-row kernel sums in another order: close, not equal
    rows = cg.paged_attention(q, k, v, kc, vc, sm, tables, lens, lens, bs, scale, prefill_blocks=False)
    _close(rows, both, dtype)
    assert not torch.equal(rows, both)


@needs_pairs
def test_bf16_attention_takes_the_pair_path():
    """Where AVX512-BF16 is, bf16 attention weighs the values with its weights rounded to bf16
    (normalised by their rounded sum), as a bf16 model's eager attention rounds its probabilities;
    the fp32 chain (fp32 q / caches, or the path turned off) keeps them in fp32. Two keys, values
    +1 and -1: the output (1 - e) / (1 + e) cancels, so the rounding of e = exp(s1 - s0) shows."""
    hd, bs = 64, 16
    x = -0.048  # key 1's first element: s1 - s0 = x / 8 ≈ -0.006
    kc, vc = torch.zeros(bs, 1, hd), torch.zeros(bs, 1, hd)
    vc[0] = 1.0
    q = torch.zeros(1, 1, hd)
    q[0, 0, 0] = 1.0
    k1, v1 = torch.zeros(1, 1, hd), -torch.ones(1, 1, hd)
    k1[0, 0, 0] = x
    tables = torch.zeros(1, 1, dtype=torch.int64)

    def out(dtype, pairs):
        args = [t.to(dtype) for t in (q, k1, v1, kc.clone(), vc.clone())]
        return float(cg.paged_attention(*args, torch.tensor([1]), tables, [1], [2], bs, hd ** -0.5,
                                        pairs=pairs)[0, 0, 0])

    e = torch.tensor(float(torch.tensor(x).bfloat16()) / 8).double().exp()  # exact weight of key 1
    e_bf16 = e.float().bfloat16().double()  # the same, rounded to bf16
    assert e_bf16 != e.float().double()
    want_chain, want_pairs = float((1 - e) / (1 + e)), float((1 - e_bf16) / (1 + e_bf16))
    assert abs(want_pairs - want_chain) > 0.2 * abs(want_chain)  # far apart at bf16's output precision
    for got, want in ((out(torch.bfloat16, True), want_pairs), (out(torch.bfloat16, False), want_chain),
                      (out(torch.float32, True), want_chain)):
        assert got == pytest.approx(want, rel=2 ** -7)


@needs_kernels
def test_paged_attention_refuses_what_it_does_not_take():
    q, k, v, kc, vc, sm, tables, q_lens, seq_lens, bs, scale = _attention_case(torch.float32, 64, 2, seed=2)
    with pytest.raises(RuntimeError, match="head_dim must be 64 or 128"):
        cg.paged_attention(q[..., :32].contiguous(), k[..., :32].contiguous(), v[..., :32].contiguous(),
                           kc[..., :32].contiguous(), vc[..., :32].contiguous(), sm, tables, q_lens,
                           seq_lens, bs, scale)
    with pytest.raises(RuntimeError, match="q_lens sum"):
        cg.paged_attention(q, k, v, kc, vc, sm, tables, [1, 4, 1], seq_lens, bs, scale)
    with pytest.raises(RuntimeError, match="block table too short"):
        cg.paged_attention(q, k, v, kc, vc, sm, tables[:, :2].contiguous(), q_lens, seq_lens, bs, scale)
    with pytest.raises(RuntimeError, match="one dtype"):
        cg.paged_attention(q.bfloat16(), k, v, kc, vc, sm, tables, q_lens, seq_lens, bs, scale)
    with pytest.raises(RuntimeError, match="one dtype"):
        cg.paged_attention(q, k, v.bfloat16(), kc, vc, sm, tables, q_lens, seq_lens, bs, scale)
    with pytest.raises(RuntimeError, match="block_size must be a power of two"):
        cg.paged_attention(q, k, v, kc, vc, sm, tables, q_lens, seq_lens, 24, scale)
    with pytest.raises(RuntimeError, match=r"query heads \(3\) must be a multiple of the KV heads \(2\)"):
        cg.paged_attention(q[:, :3], k, v, kc, vc, sm, tables, q_lens, seq_lens, bs, scale)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_and_rope_match_the_model_ops(dtype):
    """The fused per-row ops equal the model's torch expressions (bf16: bitwise, since they round
    where torch rounds; fp32: up to summation order); their `_ref` twins are those expressions."""
    import torch.nn.functional as F

    from quantspec.model_zoo.llama import apply_rope

    mod = cg.cpu_kernels()
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(5, 576, generator=g) * 3).to(dtype)
    w = (torch.rand(576, generator=g) + 0.5).to(dtype)
    want = w * F.rms_norm(x.float(), (576,), eps=1e-5).to(dtype)
    got = cg.rms_norm(x, w, 1e-5)
    assert torch.equal(cg.rms_norm_ref(x, w, 1e-5), want)
    qkv = torch.randn(4, 13, 64, generator=g).to(dtype)
    cos, sin = torch.randn(4, 64, generator=g).to(dtype), torch.randn(4, 64, generator=g).to(dtype)
    rot_want, rot_got = apply_rope(qkv[:, :9], cos, sin), cg.rope(qkv[:, :9], cos, sin)  # strided x
    assert torch.equal(cg.rope_ref(qkv[:, :9], cos, sin), rot_want)
    if dtype == torch.bfloat16:
        assert torch.equal(got, want) and torch.equal(rot_got, rot_want)
    else:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(rot_got, rot_want, rtol=0, atol=0)
    # head dims of 128 (the 16-lane path, two vectors a half) and 40 (a half of 20: the scalar loop)
    for hd in (128, 40):
        qh = torch.randn(3, 5, hd, generator=g).to(dtype)
        ch, sh = torch.randn(3, hd, generator=g).to(dtype), torch.randn(3, hd, generator=g).to(dtype)
        qh[0, 0, :3] = torch.tensor([0.0, -0.0, 1e-30])  # signed zeros and a tiny value
        qh[0, 0, hd // 2:hd // 2 + 2] = torch.tensor([-0.0, 0.0])
        want_h, got_h = apply_rope(qh, ch, sh), mod.rope(qh, ch, sh)
        bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
        assert torch.equal(got_h.view(bits), want_h.view(bits))  # bitwise, signed zeros included
    with pytest.raises(RuntimeError, match="weight"):
        mod.rms_norm(x, w[:10], 1e-5)
    with pytest.raises(RuntimeError, match="cos / sin"):
        mod.rope(qkv[:, :9], cos[:, :32].contiguous(), sin)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_per_row_ops_are_row_invariant_across_threads(dtype):
    """rms_norm, rope and silu_mul split rows over the threads from a few rows on: every row must
    come out with the same bits as when it is computed alone (a verification row equals a decode
    row; a prefill row equals either), at 1 and 2 threads."""
    mod = cg.cpu_kernels()
    g = torch.Generator().manual_seed(5)
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for m in (2, 5, 11, 70):
                x = (torch.randn(m, 576, generator=g) * 3).to(dtype)
                w = (torch.rand(576, generator=g) + 0.5).to(dtype)
                q = torch.randn(m, 12, 64, generator=g).to(dtype)
                cos, sin = torch.randn(m, 64, generator=g).to(dtype), torch.randn(m, 64, generator=g).to(dtype)
                gu = (torch.randn(m, 2 * 1536, generator=g) * 4).to(dtype)
                norm, rot, act = mod.rms_norm(x, w, 1e-5), mod.rope(q, cos, sin), mod.silu_mul(gu)
                for i in (0, m // 2, m - 1):
                    assert torch.equal(mod.rms_norm(x[i:i + 1], w, 1e-5), norm[i:i + 1]), (threads, m, i)
                    assert torch.equal(mod.rope(q[i:i + 1], cos[i:i + 1], sin[i:i + 1]), rot[i:i + 1])
                    assert torch.equal(mod.silu_mul(gu[i:i + 1]), act[i:i + 1])
    finally:
        torch.set_num_threads(before)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_matches_torch(dtype):
    g = torch.Generator().manual_seed(4)
    x = (torch.randn(6, 2 * 1544, generator=g) * 5).to(dtype)  # I = 1544: a vector tail of 8
    x[0, :6] = torch.tensor([0.0, -0.0, 90.0, -90.0, float("inf"), -1e30])
    got, want = cg.silu_mul(x), cg.silu_mul_ref(x)
    assert got.dtype == dtype and got.shape == (6, 1544)
    tol = 2e-6 if dtype == torch.float32 else 8e-3
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=1e-30)
    assert torch.equal(cg.silu_mul(x[3:4].contiguous()), got[3:4])
    with pytest.raises(RuntimeError, match="2 I"):
        cg.silu_mul(x[:, :7].contiguous())


@needs_kernels
def test_kernel_settings_are_arguments():
    """The pair path, the blocked prefill and the screen's prefetch are arguments of the calls
    (`pairs=`, `prefill_blocks=`, `prefetch=`): the extension holds no setting that changes them."""
    mod = cg.cpu_kernels()
    assert not [name for name in dir(mod) if name.startswith("set_")]


@needs_kernels
@pytest.mark.parametrize("N,K,M", [(1, 16, 1), (1037, 64, 3), (517, 96, 11), (2049, 48, 12)])
def test_screens_match_their_references(N, K, M):
    """Each screen picks the argmax of its head's exact logits (its `_ref`), on odd shapes: N not
    a multiple of 32, K of 16 × 3, M up to a 12-row tile; a non-finite row gets −1."""
    g = torch.Generator().manual_seed(N + K + M)
    w = torch.randn(N, K, generator=g)
    x = torch.randn(M, K, generator=g) * 2
    packed, norms = cg.pack_dense(w), cg.row_norms_up(w)
    args = (x, w.bfloat16().contiguous(), packed, norms, N, cg.screen_bound(K))
    assert torch.equal(cg.screened_argmax(*args), cg.screened_argmax_ref(*args))
    if cg.pair_path_available():
        pargs = (x, cg.pack_pairs(w), packed, norms, N, cg.screen_bound(K, bf16_x=True), cg.PAIR_ABS_ERR)
        for prefetch in (True, False):
            got = cg.screened_argmax_pairs(*pargs, prefetch=prefetch)
            assert torch.equal(got, cg.screened_argmax_pairs_ref(*pargs, prefetch=prefetch))
    if cg.has_int8_screen():
        q, scale, u, t, rel, abs_err = cg.int8_screen_tables(w)
        for xx, exact in ((x, packed), (x.bfloat16(), cg.pack_pairs(w.bfloat16()))):
            i8 = (xx, q, scale, u, t, exact, N, rel, abs_err)
            assert torch.equal(cg.screened_argmax_i8(*i8), cg.screened_argmax_i8_ref(*i8))
    x[0, 1] = float("nan")
    assert int(cg.screened_argmax(*args)[0]) == int(cg.screened_argmax_ref(*args)[0]) == -1


@needs_kernels
def test_bf16_rounding_keeps_nan_payloads_nan():
    """The vector bf16 rounding (GEMM outputs, rope, rms_norm, silu_mul) makes every NaN the
    canonical 0x7FC0, as c10's conversion does: rounding the bits of a NaN whose payload is all
    ones carried into the sign and gave -0 (the GEMM case below did, before)."""
    mod = cg.cpu_kernels()
    nan = torch.tensor([0x7FFFFFFF], dtype=torch.int32).view(torch.float32)  # NaN, payload all ones
    # a NaN through rope (x * cos): NaN out
    q = torch.ones(1, 1, 64, dtype=torch.bfloat16)
    cos = torch.ones(1, 64)
    cos[0, 0] = nan
    out = mod.rope(q, cos.bfloat16(), torch.zeros(1, 64, dtype=torch.bfloat16))
    assert torch.isnan(out[0, 0, 0].float()), out[0, 0, :2]
    # fp32 GEMM into bf16 output: one output NaN from an all-ones payload weight
    w = torch.zeros(32, 16)
    w[3, 0] = nan
    x = torch.ones(1, 16, dtype=torch.bfloat16)
    y = cg.packed_gemm(x, cg.pack_dense(w), 32)
    assert torch.isnan(y[0, 3].float()) and int(y[0, 3:4].view(torch.int16)) == 0x7FC0
