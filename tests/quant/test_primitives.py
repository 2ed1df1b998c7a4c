"""quant.primitives against compressed-tensors' own calculate_qparams / quantize / dequantize,
and against hand-computed values."""

import pytest
import torch

from quantspec.errors import QuantSpecError
from quantspec.quant import (QuantArgs, choose_qparams, dequantize, fake_quantize, minmax,
                             qparams_from_minmax, quantize)

ct_args = pytest.importorskip("compressed_tensors.quantization")
from compressed_tensors.quantization.lifecycle.forward import (  # noqa: E402
    dequantize as ct_dequantize, fake_quantize as ct_fake_quantize, quantize as ct_quantize)
from compressed_tensors.quantization.utils import calculate_qparams  # noqa: E402

CASES = [
    dict(num_bits=4, symmetric=True, strategy="group", group_size=32),
    dict(num_bits=4, symmetric=False, strategy="group", group_size=64),
    dict(num_bits=4, symmetric=True, strategy="channel"),
    dict(num_bits=8, symmetric=True, strategy="channel"),
    dict(num_bits=8, symmetric=False, strategy="channel"),
    dict(num_bits=8, symmetric=True, strategy="tensor"),
    dict(num_bits=8, type="float", strategy="channel"),
    dict(num_bits=8, type="float", strategy="tensor"),
    dict(num_bits=8, type="float", strategy="block", block_structure=[16, 64]),  # tiles the weight
    dict(num_bits=8, type="float", strategy="block", block_structure=[32, 128]),  # 48 rows: a partial block row
    dict(num_bits=8, type="float", strategy="block", block_structure=[64, 96]),  # partial on both sides
]


@pytest.mark.parametrize("kw", CASES, ids=lambda kw: "-".join(f"{v}" for v in kw.values()))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_compressed_tensors_exactly(kw, dtype):
    torch.manual_seed(0)
    w = (torch.randn(48, 256) * torch.rand(48, 1) * 3).to(dtype)
    w[3] = 0.0  # an all-zero row exercises the zero-scale guard
    ours, theirs = QuantArgs(**kw), ct_args.QuantizationArgs(**kw)
    s, z = choose_qparams(w, ours)
    s_ct, z_ct = calculate_qparams(*minmax(w, ours), theirs)
    assert s.dtype == s_ct.dtype == dtype and torch.equal(s, s_ct)
    assert z.dtype == z_ct.dtype and torch.equal(z.float(), z_ct.float())
    q = quantize(w, s, z, ours)
    q_ct = ct_quantize(w, s_ct, z_ct, theirs, dtype=q.dtype)
    assert torch.equal(q.float(), q_ct.float())
    assert torch.equal(dequantize(q, s, z, ours), ct_dequantize(q_ct, s_ct, z_ct, theirs))
    assert torch.equal(fake_quantize(w, s, z, ours).float(),
                       ct_fake_quantize(w, s_ct, z_ct, theirs).to(dtype).float())


def test_int4_symmetric_hand_computed():
    # absmax 7.5 → scale 7.5 / 7.5 = 1; 7.5 → round-half-even(7.5)=8 → clamped to 7; -7.5 → -8
    args = QuantArgs(num_bits=4, strategy="channel")
    w = torch.tensor([[7.5, -7.5, 2.5, 0.4, -1.5]])
    s, z = choose_qparams(w, args)
    assert s.tolist() == [[1.0]] and z.tolist() == [[0]] and z.dtype == torch.int8
    q = quantize(w, s, z, args)
    assert q.dtype == torch.int8 and q.tolist() == [[7, -8, 2, 0, -2]]
    assert dequantize(q, s, None, args).tolist() == [[7.0, -8.0, 2.0, 0.0, -2.0]]


def test_int8_asymmetric_hand_computed():
    args = QuantArgs(num_bits=8, symmetric=False, strategy="tensor")
    s, z = qparams_from_minmax(torch.tensor([1.0]), torch.tensor([255.0]), args)
    # min clamped to 0 → scale = 255 / 255 = 1, zp = -128 - 0 / 1 = -128
    assert s.tolist() == [1.0] and z.tolist() == [-128]
    q = quantize(torch.tensor([0.0, 3.0, 255.0, 300.0]), s, z, args)
    assert q.tolist() == [-128, -125, 127, 127]


def test_fp8_scale_and_per_token():
    x = torch.tensor([[1.0, -448.0 * 2], [0.5, 0.25]])
    args = QuantArgs(num_bits=8, type="float", strategy="token", dynamic=True)
    s, _ = choose_qparams(x, args)
    assert s.shape == (2, 1) and s[0, 0] == 2.0 and s[1, 0] == 0.5 / 448
    q = quantize(x, s, None, args)
    assert q.dtype == torch.float8_e4m3fn
    assert dequantize(q, s, None, args)[0, 1] == -896.0


def test_attn_head_scales():
    x = torch.zeros(2, 3, 5, 4)
    x[1, 2, 0, 0] = -12.7
    x[0, 0, 4, 3] = 2.54
    s, _ = choose_qparams(x, QuantArgs(num_bits=8, strategy="attn_head"))
    assert s.shape == (3, 1, 1)
    assert torch.allclose(s.flatten(), torch.tensor([2.54 / 127.5, torch.finfo().eps, 12.7 / 127.5]))


def test_bad_input_raises_clear_errors():
    args = QuantArgs(num_bits=4, strategy="group", group_size=128)
    with pytest.raises(QuantSpecError, match="does not divide"):
        choose_qparams(torch.randn(4, 576), args)
    with pytest.raises(QuantSpecError, match="float tensor"):
        choose_qparams(torch.zeros(4, 128, dtype=torch.int8), args)
    with pytest.raises(QuantSpecError, match="zero_point"):
        quantize(torch.randn(4, 128), torch.ones(4, 1), None,
                 QuantArgs(num_bits=4, symmetric=False, strategy="channel"))


# ---- float zero points (compressed-tensors' zp_dtype) -------------------------------------------

@pytest.mark.parametrize("zp_dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_float_zero_point_matches_compressed_tensors_exactly(zp_dtype, dtype):
    if dtype == torch.bfloat16 and zp_dtype == torch.float32:
        pytest.skip("compressed-tensors' own cast overflows for bf16 weights + fp32 zp_dtype")
    torch.manual_seed(1)
    w = (torch.randn(40, 256) * torch.rand(40, 1) * 3 + torch.randn(40, 1) * 0.5).to(dtype)
    kw = dict(num_bits=4, symmetric=False, strategy="group", group_size=32)
    ours = QuantArgs(**kw, zp_dtype=str(zp_dtype).removeprefix("torch."))
    theirs = ct_args.QuantizationArgs(**kw, zp_dtype=zp_dtype)
    s, z = choose_qparams(w, ours)
    s_ct, z_ct = calculate_qparams(*minmax(w, ours), theirs)
    assert z.dtype == z_ct.dtype == zp_dtype and torch.equal(s, s_ct) and torch.equal(z, z_ct)
    assert not torch.equal(z, z.round())  # really unrounded
    q = quantize(w, s, z, ours)
    q_ct = ct_quantize(w, s_ct, z_ct, theirs, dtype=torch.int8)
    assert q.dtype == torch.int8 and torch.equal(q, q_ct)
    assert torch.equal(dequantize(q, s, z, ours), ct_dequantize(q_ct, s_ct, z_ct, theirs))
    assert torch.equal(fake_quantize(w, s, z, ours), ct_fake_quantize(w, s_ct, z_ct, theirs).to(dtype))


def test_float_zero_point_of_all_zero_group_is_zero():
    # compressed-tensors gets NaN here (0 / 0 cast to a float); quantspec keeps 0 → dequantizes to 0
    args = QuantArgs(num_bits=4, symmetric=False, strategy="group", group_size=32, zp_dtype="float16")
    w = torch.randn(2, 64)
    w[1, :32] = 0.0
    s, z = choose_qparams(w, args)
    assert z[1, 0] == 0 and torch.isfinite(z).all()
    assert torch.equal(fake_quantize(w, s, z, args)[1, :32], torch.zeros(32))


def _q4_1_weight(N=64, K=256, g=32, seed=0):
    """A weight exactly on a GGUF Q4_1 grid: w = d·u + m per group of g, u ∈ 0..15, with each
    group's grid ends hit (u = 0 and 15 occur) and m < 0 < m + 15d (so min/max span the grid)."""
    gen = torch.Generator().manual_seed(seed)
    G = K // g
    d = (torch.rand(N, G, 1, generator=gen) * 0.02 + 0.001).half().float()  # fp16, like GGUF
    m = -d * (torch.rand(N, G, 1, generator=gen) * 13 + 1)  # offset: a non-integer number of steps
    u = torch.randint(0, 16, (N, G, g), generator=gen)
    u[..., 0], u[..., 1] = 0, 15
    return (d * u + m).reshape(N, K)


def test_float_zero_point_reproduces_a_q4_1_grid():
    """Asymmetric g32 with a float zero point lands back on the Q4_1 grid (~1e-7 relative in
    fp32); integer zero points cannot represent the float offset m and miss it by ~1/4 step."""
    w = _q4_1_weight()
    base = dict(num_bits=4, symmetric=False, strategy="group", group_size=32)

    def rel_err(args):
        s, z = choose_qparams(w, args)
        return float((fake_quantize(w, s, z, args) - w).norm() / w.norm())

    err_int = rel_err(QuantArgs(**base))
    err_f32 = rel_err(QuantArgs(**base, zp_dtype="float32"))
    err_f16 = rel_err(QuantArgs(**base, zp_dtype="float16"))
    assert err_f32 < 1e-6
    assert err_f16 < 1e-3  # fp16 rounds the zero point itself (11-bit mantissa)
    assert err_int > 1e-2
    assert err_f32 < err_int / 1000 and err_f16 < err_int / 10


def test_gptq_takes_float_zero_points():
    from quantspec.quant import gptq_quantize

    args = QuantArgs(num_bits=4, symmetric=False, strategy="group", group_size=32, zp_dtype="float32")
    w = _q4_1_weight(N=16, K=64)
    for act_order in (False, True):
        r = gptq_quantize(w, torch.eye(64), args, act_order=act_order)
        assert r.zero_point.dtype == torch.float32 and r.zero_point.shape == (16, 2)
        assert torch.equal(r.weight_dq, dequantize(r.q, r.scale, r.zero_point, args))
        assert float((r.weight_dq - w).norm() / w.norm()) < 1e-6  # identity Hessian = RTN


# -- the MSE weight observer ---------------------------------------------------------------------

def _mse_reference(w, num_bits, g, symmetric, grid=100, max_shrink=0.2, norm=2.4):
    """Brute force, one group at a time, from the documented rule (not the vectorised code):
    for each shrink p, the group's range p·(min, max) → compressed-tensors' qparams → round trip."""
    q_min, q_max = -(2 ** (num_bits - 1)), 2 ** (num_bits - 1) - 1
    N, K = w.shape
    scales = torch.empty(N, K // g)
    for r in range(N):
        for j in range(K // g):
            x = w[r, j * g:(j + 1) * g].double()
            best = None
            for i in range(int(round(max_shrink * grid)) + 1):
                p = 1 - i / grid
                lo, hi = min(float(x.min()) * p, 0.0), max(float(x.max()) * p, 0.0)
                if symmetric:
                    s = max(abs(lo), abs(hi)) / ((q_max - q_min) / 2)
                    z = 0.0
                else:
                    s = (hi - lo) / (q_max - q_min)
                    z = round(min(max(q_min - lo / s, q_min), q_max))
                xq = (torch.clamp(torch.round(x / s + z), q_min, q_max) - z) * s
                err = float((x - xq).abs().pow(norm).sum())
                if best is None or err < best[0] * (1 - 1e-9):
                    best = (err, s)
            scales[r, j] = best[1]
    return scales


@pytest.mark.parametrize("symmetric", [True, False])
def test_mse_qparams_match_brute_force_and_beat_minmax(symmetric):
    from quantspec.quant.primitives import mse_qparams

    g = torch.Generator().manual_seed(3)
    w = torch.randn(6, 64, generator=g)
    w[0, 5] = 9.0  # an outlier: shrinking the range pays for this group
    args = QuantArgs(num_bits=4, strategy="group", group_size=32, symmetric=symmetric, observer="mse")
    s, z = choose_qparams(w, args)  # dispatches on observer="mse"
    s2, _ = mse_qparams(w, args)
    assert torch.equal(s, s2)
    torch.testing.assert_close(s, _mse_reference(w, 4, 32, symmetric), rtol=1e-5, atol=1e-7)
    plain = args.replace(observer=None)
    s0, z0 = choose_qparams(w, plain)
    err = lambda sc, zp: (fake_quantize(w, sc, zp, args) - w).abs().pow(2.4).unflatten(1, (2, 32)).sum(-1)
    assert bool((err(s, z) <= err(s0, z0) * (1 + 1e-6)).all())  # never worse than min/max
    assert bool((s < s0).any())  # and here it does clip some group
    # no shrink allowed: exactly min/max
    s1, z1 = mse_qparams(w, args, max_shrink=0.0)
    assert torch.equal(s1, s0) and torch.equal(z1, z0)
