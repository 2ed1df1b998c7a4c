"""MXFP4 linear (weight-only and W4A4): the Triton GEMM against its torch reference on odd shapes
and launch shapes, every code byte and E8M0 exponents from 0 to 254 decoded exactly, the
activation quantizer bit-exact against `quant.fp4`'s numbers, the reference against the layer's
numbers written out by hand, and the argument checks."""

import pytest
import torch

from quantspec.errors import QuantSpecError
from quantspec.kernels import _common
from quantspec.kernels.fp4 import NVFP4Config
from quantspec.kernels.mxfp4 import mxfp4_linear, mxfp4_linear_ref, quantize_act_mxfp4, quantize_act_mxfp4_ref
from quantspec.quant.fp4 import E2M1_MAX, mx_exponents, mx_values, pack_fp4, round_to_e2m1, unpack_fp4

F8 = torch.float8_e4m3fn
# tensors are built where the kernels run: a GPU where there is one, else the CPU interpreter
DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _weight(N, K, seed=0):
    """(packed uint8 [N, K/2], exponents uint8 [N, K/32], codes fp32 [N, K]) of a random weight
    quantized with `quant.fp4`'s MX numbers: rows 2**-8 .. 2**1 apart, an all-zero group (e = 0)
    and tiny negatives beside large values (codes -0.0)."""
    w = torch.randn(N, K, generator=_gen(seed)) * 2.0 ** torch.randint(-8, 2, (N, 1), generator=_gen(seed + 1))
    w[0, :32] = 0
    w[1, :8] = -1e-7 * torch.rand(8, generator=_gen(seed + 2))
    wg = w.reshape(N, K // 32, 32)
    e = mx_exponents(wg.abs().amax(-1))  # [N, K/32]
    q = round_to_e2m1((wg / mx_values(e, torch.float32)[..., None]).clamp(-E2M1_MAX, E2M1_MAX)).reshape(N, K)
    assert int(e[0, 0]) == 0 and torch.signbit(q[1, :8]).all()
    return pack_fp4(q).to(DEV), e.to(DEV), q


def _act(M, K, dtype, seed=0):
    """x [M, K] with an all-zero group (-0.0 included), tiny negatives beside large values (codes
    -0.0), and where M allows a tiny group and a large row."""
    x = torch.randn(M, K, generator=_gen(seed + 10))
    x[0, :32] = 0
    x[0, 8:16] = -0.0
    if K > 32:
        x[0, 32:40] = -1e-4
    if M > 1:
        x[1, :32] *= 2.0 ** -12
    if M > 2:
        x[2] *= 2.0 ** 6
    return x.to(dtype).to(DEV)


def _check(x, wp, ws, bias=None, w4a4=False, config=None):
    """The kernel's y against the reference's, element by element, within a stated fraction of
    |x̂| @ |W|ᵀ + |bias| (what bounds the error of a sum in any order; the rows of W lie 2**9
    apart): fp32 1e-5 (the order of the fp32 sums); fp16 / bf16 a few ulps (both round fp32 sums
    that differ in their last bits; the CPU interpreter casts to bf16 by truncation)."""
    y = mxfp4_linear(x, wp, ws, bias, quantize_input=w4a4, config=config)
    ref = mxfp4_linear_ref(x, wp, ws, bias, quantize_input=w4a4)
    assert y.dtype == ref.dtype == x.dtype and y.shape == ref.shape and torch.isfinite(ref).all()
    # |W| clears the codes' sign bits; |x|'s MX codes are |x|'s codes under the same exponents
    mag = mxfp4_linear_ref(x.abs().float(), wp & 0x77, ws, None if bias is None else bias.abs().float(),
                           quantize_input=w4a4)
    tol = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 2e-2}[y.dtype]
    err = (y.float() - ref.float()).abs()
    assert (err <= tol * mag + torch.finfo(y.dtype).tiny).all(), float((err / mag).nan_to_num().max())


@pytest.mark.parametrize("M", [1, 3, 17])
@pytest.mark.parametrize("K", [32, 96, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_kernel_matches_reference(M, K, dtype):
    """Weight-only and W4A4, N not a multiple of BLOCK_N, bias on every other shape."""
    N = 48 if (M + K) % 2 else 80
    wp, ws, _ = _weight(N, K, seed=M + K)
    x = _act(M, K, dtype, seed=M * K)
    bias = torch.randn(N, generator=_gen(3)).to(dtype).to(DEV) if (M + K) % 2 else None
    for w4a4 in (False, True):
        _check(x, wp, ws, bias, w4a4)


@pytest.mark.parametrize("cfg", [NVFP4Config(16, 16, 64, 1), NVFP4Config(16, 32, 32, 3), NVFP4Config(32, 16, 128, 2),
                                 NVFP4Config(16, 64, 64, 2)])
@pytest.mark.parametrize("counters", [True, False])
def test_launch_shapes_and_split_k(cfg, counters, monkeypatch):
    """Tiles past K (K = 96 under a 64- or 128-k tile), splits of K finished by the tiles' last
    splits or, without counters, by a launch of their own; W4A4 fp32 and weight-only fp16."""
    if not counters:
        monkeypatch.setattr(_common, "split_k_counters", lambda device, tiles: None)
    wp, ws, _ = _weight(40, 96, seed=7)
    bias = torch.randn(40, generator=_gen(8)).to(DEV)
    x = _act(17, 96, torch.float32, seed=9)
    _check(x, wp, ws, bias, True, cfg)
    _check(x.half(), wp, ws, bias.half(), False, cfg)


def test_reference_is_the_layer_written_out():
    """The reference: codes · 2^(e - 127) per group of 32, x fake-quantized per row and group
    (its codes · 2^(e - 127)), one fp32 matmul."""
    N, K = 24, 64
    wp, ws, q = _weight(N, K, seed=4)
    x = _act(5, K, torch.float32, seed=5)
    w = q * (2.0 ** (ws.cpu().double() - 127)).float().repeat_interleave(32, dim=1)
    torch.testing.assert_close(mxfp4_linear_ref(x, wp, ws).cpu(), x.cpu() @ w.t(), rtol=1e-6, atol=1e-6)
    xq, xe = quantize_act_mxfp4_ref(x)
    xhat = xq.float().cpu() * (2.0 ** (xe.double() - 127)).float().cpu().repeat_interleave(32, dim=1)
    torch.testing.assert_close(mxfp4_linear_ref(x, wp, ws, quantize_input=True).cpu(), xhat @ w.t(), rtol=1e-6,
                               atol=1e-6)
    assert not torch.equal(xhat, x.cpu())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_activation_quantizer_bit_exact(dtype):
    """Codes (-0.0 included) and exponents equal the reference's bit for bit, with an all-zero
    group (-0.0 in it: +0.0 codes, e = 0), tiny negatives (-0.0 codes) and a tiny group."""
    x = _act(19, 96, dtype, seed=11)
    q, e = quantize_act_mxfp4(x)
    rq, re = quantize_act_mxfp4_ref(x)
    assert q.dtype == F8 and q.shape == (19, 96) and e.dtype == torch.uint8 and e.shape == (19, 3)
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(e, re)
    assert int(e[0, 0]) == 0 and (q[0, :32].view(torch.uint8) == 0).all()
    assert (q[0, 32:40].view(torch.uint8) == 0x80).all()  # -0.0 codes
    assert float(q[2].float().abs().max()) == 6.0


def test_activation_exponents_over_fp32s_range():
    """One group per absmax: 0, subnormal (a quotient by the subnormal scale 2**-127), the
    smallest normals, powers of two, the round-up point 1.75 · 2**n and just below it, 6 (scale
    1), and 3e38 (rounds up to fp32's infinity: e = 255, +inf, as the reference's log2 has it);
    the group's other values a spread of magnitudes and signs."""
    absmax = [0.0, 1e-40, 3e-39, 1.5 * 2.0 ** -126, 2.0 ** -100, 1.0, 1.75, 1.7499999, 6.0, 2.0 ** 100, 3e38]
    want = [0, 0, 0, 0, 25, 125, 126, 125, 127, 225, 255]
    spread = torch.linspace(-1, 1, 31, dtype=torch.float64) ** 3  # [31]
    rows = [torch.cat([torch.tensor([a], dtype=torch.float64), a * spread]) for a in absmax]
    x = torch.cat(rows).float().reshape(1, -1).to(DEV)  # [1, 32 · 11]
    q, e = quantize_act_mxfp4(x)
    rq, re = quantize_act_mxfp4_ref(x)
    assert e.cpu().tolist() == [want] and torch.equal(e, re)
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8))
    assert q[0, 32 * 2].float() == 0.5 and q[0, 32 * 3].float() == 3.0  # x / 2**-127 for tiny groups


def test_activation_ties_round_to_even():
    """Quotients on the E2M1 grid's midpoints (a group's absmax 6: scale 1; times 2**-20: scale
    2**-20) round to the even mantissa, as `quant.fp4.round_to_e2m1`; small negatives give -0.0."""
    row = [6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5.0, -0.1]
    want = [6.0, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -0.0, -1.0, -1.0, -2.0, -2.0, -4.0, -4.0, -0.0]
    group = torch.tensor(row + row[::-1])  # [32]
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        x = torch.cat([group, group * 2.0 ** -20]).reshape(1, 64).to(dtype).to(DEV)
        q, e = quantize_act_mxfp4(x)
        w = torch.tensor([want + want[::-1]] * 2).reshape(1, 64).to(F8)
        assert torch.equal(q.cpu().view(torch.uint8), w.view(torch.uint8)) and e.tolist() == [[127, 107]]


def test_every_code_byte_decodes():
    """Every byte of packed codes (all 16 nibbles in both positions) under E8M0 exponents
    2**-17 .. 2**2, weight-only (fp32, fp16) and W4A4."""
    N, K = 32, 512
    perm = torch.stack([torch.randperm(256, generator=_gen(i)) for i in range(N)])
    wp = perm.to(torch.uint8).to(DEV)  # [N, K/2]: each row every byte once
    ws = torch.randint(110, 130, (N, K // 32), generator=_gen(40), dtype=torch.uint8).to(DEV)
    x = _act(3, K, torch.float32, seed=41)
    for xd in (x, x.half()):
        for w4a4 in (False, True):
            _check(xd, wp, ws, None, w4a4)


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")  # fp16's ±inf, on purpose
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_exponents_0_to_254_decode_exactly(dtype):
    """x = the identity, so y = Wᵀ: each W = code · 2^(e - 127) for every exponent byte 0 .. 254
    (2**-127 a subnormal, 2**127; codes of magnitude ≤ 1.5 under e ≥ 253, where W's larger codes
    overflow fp32), cast to x's dtype (fp16: many to 0 and ±inf), equal to the reference bit for
    bit, weight-only and W4A4 (each group of the identity quantizes exactly: its one 1.0 is the
    code 4 under e = 125). bf16 under the CPU interpreter: the outputs that are fp32 normals."""
    N, K = 32, 256
    ws = torch.arange(N * K // 32).reshape(N, K // 32).clamp(max=254).to(torch.uint8)  # [N, K/32]: 0 .. 254
    wp = torch.randint(0, 256, (N, K // 2), generator=_gen(50), dtype=torch.uint8)
    big = (ws >= 253).repeat_interleave(16, dim=1)  # [N, K/2]
    wp = torch.where(big, wp & 0xBB, wp)  # nibble magnitudes 0 .. 3 (≤ 1.5), signs kept
    w = unpack_fp4(wp, K).float() * mx_values(ws, torch.float32).repeat_interleave(32, dim=1)  # [N, K]
    assert torch.isfinite(w).all() and (w.abs() == 2.0 ** -128).any() and (w.abs() == 1.5 * 2.0 ** 127).any()
    x = torch.eye(K).to(dtype).to(DEV)
    shown = torch.ones(K, N, dtype=torch.bool)  # [K, N]: the outputs compared
    if dtype == torch.bfloat16 and not torch.cuda.is_available():
        shown = (w.t().abs() >= 2.0 ** -126) | (w.t() == 0)  # the interpreter casts fp32 subnormals to bf16 wrongly
    wp, ws = wp.to(DEV), ws.to(DEV)
    for w4a4 in (False, True):
        y = mxfp4_linear(x, wp, ws, quantize_input=w4a4)
        ref = mxfp4_linear_ref(x, wp, ws, quantize_input=w4a4)
        assert torch.equal(ref.cpu(), w.t().to(dtype))
        assert torch.equal(y.cpu()[shown], ref.cpu()[shown])


def test_bad_arguments_raise():
    wp, ws, _ = _weight(32, 64)
    x = _act(2, 64, torch.float32)
    bad = [
        ((torch.randn(2, 48, device=DEV), wp[:, :24], ws[:, :1]), "multiple of 32"),
        ((x, wp[:, :16], ws), "packed has shape"),
        ((x, wp.view(torch.int8), ws), "packed has dtype"),
        ((x, wp, ws.view(F8)), "scale has dtype"),
        ((x, wp, ws.repeat(1, 2)), "scale has shape"),  # NVFP4's [N, K/16]
        ((x, wp, ws, torch.zeros(31, device=DEV)), "bias has shape"),
        ((x, wp, ws, torch.zeros(32, device=DEV, dtype=torch.int32)), "bias has dtype"),
        ((x.int(), wp, ws), "x has dtype"),
        ((x.t(), wp, ws), "x must be contiguous"),
    ]
    for args, match in bad:
        for fn in (mxfp4_linear, mxfp4_linear_ref):
            with pytest.raises(QuantSpecError, match=match):
                fn(*args)
    with pytest.raises(QuantSpecError, match="block_k a multiple of 32"):
        mxfp4_linear(x, wp, ws, config=NVFP4Config(16, 16, 16))
    for fn in (quantize_act_mxfp4, quantize_act_mxfp4_ref):
        with pytest.raises(QuantSpecError, match="multiple of 32"):
            fn(torch.randn(2, 40, device=DEV))
        with pytest.raises(QuantSpecError, match="x must be 2-D"):
            fn(torch.randn(64, device=DEV))
