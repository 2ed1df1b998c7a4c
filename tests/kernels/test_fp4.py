"""NVFP4 linear (weight-only and W4A4): the Triton GEMM against its torch reference on odd shapes
and every launch shape, the activation quantizer bit-exact against `quant.primitives`, the
reference against the layer's numbers written out by hand, and the argument checks."""

import pytest
import torch

from quantspec.errors import QuantSpecError
from quantspec.kernels import _common
from quantspec.kernels.fp4 import (
    NVFP4Config,
    nvfp4_default_config,
    nvfp4_linear,
    nvfp4_linear_ref,
    quantize_act_nvfp4,
    quantize_act_nvfp4_ref,
)
from quantspec.quant.args import QuantArgs
from quantspec.quant.fp4 import global_scale_from_absmax, pack_fp4
from quantspec.quant.primitives import choose_qparams, quantize

F8 = torch.float8_e4m3fn
WA = QuantArgs(num_bits=4, type="float", strategy="tensor_group", group_size=16)
# tensors are built where the kernels run: a GPU where there is one, else the CPU interpreter
DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _weight(N, K, seed=0):
    """(packed uint8 [N, K/2], local scales float8_e4m3fn [N, K/16], global fp32 [1], codes
    float8 [N, K]) of a random weight through `quant.primitives`, with an all-zero group (scale
    0.125), tiny negatives beside large values (codes -0.0) and a group of tiny negatives only
    (FP8 subnormal scales)."""
    w = torch.randn(N, K, generator=_gen(seed)) * 0.05
    w[0, :16] = 0
    w[1, :8] = -1e-7 * torch.rand(8, generator=_gen(seed + 1))
    w[2, 16:32] = -1e-5 * w.abs().amax() * (1 + torch.rand(16, generator=_gen(seed + 2)))
    g = global_scale_from_absmax(w.abs().amax())
    s, _ = choose_qparams(w, WA, global_scale=g)  # [N, K/16] fp32 on the FP8 grid
    q = quantize(w, s, None, WA, global_scale=g)  # [N, K] float8 E2M1 codes
    assert float(s[0, 0]) == 0.125 and torch.signbit(q[1, :8].float()).all()
    assert (s[2, 1] < 2 ** -6).item()  # subnormal in E4M3
    return pack_fp4(q).to(DEV), s.to(F8).to(DEV), g.to(DEV), q


def _act(M, K, dtype, seed=0):
    """x [M, K] with an all-zero group, tiny negatives and a row far above the input global
    scale's absmax (local scales clamped at 448, codes at ±6), and that global scale."""
    x = torch.randn(M, K, generator=_gen(seed + 10))
    x[0, :16] = 0
    x[0, 16:24] = -1e-4
    g = global_scale_from_absmax(x.abs().amax())
    if M > 2:
        x[2] *= 40
    return x.to(dtype).to(DEV), g.to(DEV)


def _close(y, ref):
    """fp32: within 1e-5 of the output's magnitude (the order of the fp32 sums); fp16 / bf16: a
    few ulps of it (both round fp32 sums that differ in their last bits; the CPU interpreter
    casts to bf16 by truncation)."""
    assert y.dtype == ref.dtype and y.shape == ref.shape
    tol = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 2e-2}[y.dtype]
    scale = max(1.0, float(ref.float().abs().max()))
    torch.testing.assert_close(y.float(), ref.float(), rtol=tol, atol=tol * scale)


@pytest.mark.parametrize("M", [1, 3, 17])
@pytest.mark.parametrize("K", [32, 96, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_kernel_matches_reference(M, K, dtype):
    """Weight-only and W4A4, N not a multiple of BLOCK_N, bias on every other shape."""
    N = 48 if (M + K) % 2 else 80
    wp, ws, g, _ = _weight(N, K, seed=M + K)
    x, g_in = _act(M, K, dtype, seed=M * K)
    bias = torch.randn(N, generator=_gen(3)).to(dtype).to(DEV) if (M + K) % 2 else None
    for w4a4 in (None, g_in):
        y = nvfp4_linear(x, wp, ws, g, bias, w4a4)
        _close(y, nvfp4_linear_ref(x, wp, ws, g, bias, w4a4))


@pytest.mark.parametrize("cfg", [NVFP4Config(16, 16, 64, 1), NVFP4Config(16, 32, 32, 3), NVFP4Config(32, 16, 128, 2),
                                 NVFP4Config(16, 64, 64, 2)])
@pytest.mark.parametrize("counters", [True, False])
def test_launch_shapes_and_split_k(cfg, counters, monkeypatch):
    """Tiles past K (K = 96 under a 64- or 128-k tile), splits of K finished by the tiles' last
    splits or, without counters, by a launch of their own; weight-only fp16 and W4A4 fp32."""
    if not counters:
        monkeypatch.setattr(_common, "split_k_counters", lambda device, tiles: None)
    wp, ws, g, _ = _weight(40, 96, seed=7)
    bias = torch.randn(40, generator=_gen(8)).to(DEV)
    x, g_in = _act(17, 96, torch.float32, seed=9)
    _close(nvfp4_linear(x, wp, ws, g, bias, g_in, config=cfg), nvfp4_linear_ref(x, wp, ws, g, bias, g_in))
    xh = x.half()
    _close(nvfp4_linear(xh, wp, ws, g, bias.half(), config=cfg), nvfp4_linear_ref(xh, wp, ws, g, bias.half()))


def test_reference_is_the_layer_written_out():
    """The reference: codes · (local / global) per group of 16, x fake-quantized per row and
    group (codes · (local / g_in)), one fp32 matmul."""
    N, K = 24, 64
    wp, ws, g, q = _weight(N, K, seed=4)
    x, g_in = _act(5, K, torch.float32, seed=5)
    w = q.float() * (ws.float().cpu() / g.cpu()).repeat_interleave(16, dim=1)
    torch.testing.assert_close(nvfp4_linear_ref(x, wp, ws, g).cpu(), x.cpu() @ w.t(), rtol=1e-6, atol=1e-6)
    xq, xs = quantize_act_nvfp4_ref(x, g_in)
    xhat = xq.float().cpu() * (xs.cpu() / g_in.cpu()).repeat_interleave(16, dim=1)
    torch.testing.assert_close(nvfp4_linear_ref(x, wp, ws, g, None, g_in).cpu(), xhat @ w.t(), rtol=1e-6,
                               atol=1e-6)
    assert not torch.equal(xhat, x.cpu())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_activation_quantizer_bit_exact(dtype):
    """Codes (-0.0 included) and local scales equal the primitives' bit for bit, with an
    all-zero group (0.125), tiny negatives, and scales clamped at 448."""
    x, g_in = _act(19, 96, dtype, seed=11)
    q, s = quantize_act_nvfp4(x, g_in)
    rq, rs = quantize_act_nvfp4_ref(x, g_in)
    assert q.dtype == F8 and q.shape == (19, 96) and s.dtype == torch.float32 and s.shape == (19, 6)
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8))
    assert torch.equal(s.view(torch.int32), rs.view(torch.int32))
    assert float(s[0, 0]) == 0.125 and (q[0, 16:24].view(torch.uint8) == 0x80).all()  # -0.0 codes
    assert float(s[2].max()) == 448.0 and float(q[2].float().abs().max()) == 6.0


def test_activation_ties_round_to_even():
    """Quotients on the E2M1 grid's midpoints (global 1, a group's absmax 6: scale 1) round to
    the even mantissa, as `quant.fp4.round_to_e2m1`; small negatives give -0.0."""
    row = [6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5.0, -0.1]
    want = [6.0, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -0.0, -1.0, -1.0, -2.0, -2.0, -4.0, -4.0, -0.0]
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.tensor([row + row[::-1]], dtype=dtype, device=DEV)  # [1, 32]
        q, s = quantize_act_nvfp4(x, torch.ones(1, device=DEV))
        w = torch.tensor([want + want[::-1]]).to(F8)
        assert torch.equal(q.cpu().view(torch.uint8), w.view(torch.uint8)) and s.tolist() == [[1.0, 1.0]]


def test_every_code_and_scale_byte_decodes():
    """Every byte of packed codes (all 16 nibbles in both positions) under arbitrary FP8 scale
    bytes (subnormal, negative, 448; no NaN), weight-only and W4A4."""
    N, K = 32, 512
    perm = torch.stack([torch.randperm(256, generator=_gen(i)) for i in range(N)])
    wp = perm.to(torch.uint8).to(DEV)  # [N, K/2]: each row every byte once
    sb = torch.randint(0, 255, (N, K // 16), generator=_gen(40), dtype=torch.uint8)
    sb[(sb & 0x7F) == 0x7F] = 0x7E  # 448 in place of NaN
    ws = sb.view(F8).to(DEV)
    g = torch.tensor([3.0], device=DEV)
    x, g_in = _act(3, K, torch.float32, seed=41)
    for w4a4 in (None, g_in):
        _close(nvfp4_linear(x, wp, ws, g, None, w4a4), nvfp4_linear_ref(x, wp, ws, g, None, w4a4))


def test_default_config():
    """GPU: up to 16 rows one launch shape; every tile a `tl.dot` shape with BLOCK_K a multiple of 32."""
    shapes = {nvfp4_default_config(m, 4096, 4096, True) for m in range(1, 17)}
    assert len(shapes) == 1 and next(iter(shapes)).split_k > 1
    for m in (1, 17, 64, 65, 4096):
        cfg = nvfp4_default_config(m, 4096, 4096, True)
        assert cfg.block_k % 32 == 0 and min(cfg.block_m, cfg.block_n) >= 16
    assert nvfp4_default_config(3, 48, 32, False).split_k == 1  # one k tile: nothing to split


def test_bad_arguments_raise():
    wp, ws, g, _ = _weight(32, 64)
    x, g_in = _act(2, 64, torch.float32)
    bad = [
        ((torch.randn(2, 48, device=DEV), wp[:, :24], ws[:, :3], g), "multiple of 32"),
        ((x, wp[:, :16], ws, g), "packed has shape"),
        ((x, wp.view(torch.int8), ws, g), "packed has dtype"),
        ((x, wp, ws.float(), g), "scale has dtype"),
        ((x, wp, ws[:, :2], g), "scale has shape"),
        ((x, wp, ws, g.repeat(2)), "global_scale must hold one"),
        ((x, wp, ws, g.double()), "global_scale has dtype"),
        ((x, wp, ws, g, torch.zeros(31, device=DEV)), "bias has shape"),
        ((x, wp, ws, g, None, g_in.half()), "input_global_scale has dtype"),
        ((x.int(), wp, ws, g), "x has dtype"),
    ]
    for args, match in bad:
        for fn in (nvfp4_linear, nvfp4_linear_ref):
            with pytest.raises(QuantSpecError, match=match):
                fn(*args)
    with pytest.raises(QuantSpecError, match="block_k a multiple of 32"):
        nvfp4_linear(x, wp, ws, g, config=NVFP4Config(16, 16, 16))
    with pytest.raises(QuantSpecError, match="multiple of 32"):
        quantize_act_nvfp4(torch.randn(2, 40, device=DEV), g_in)
