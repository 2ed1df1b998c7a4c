"""W8A16 Triton kernel vs its torch reference (interpreter on CPU); reference vs plain torch."""

import pytest
import torch

from quantspec.errors import QuantSpecError
from quantspec.kernels.w8a16 import (
    W8A16Config,
    w8a16_default_config,
    w8a16_dequantize,
    w8a16_dequantize_ref,
    w8a16_linear,
    w8a16_linear_ref,
)

N, K = 37, 88  # neither a multiple of the blocks


def _make(M, dtype, bias, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(-128, 128, (N, K), dtype=torch.int8, generator=gen)
    s = (torch.rand(N, generator=gen) * 0.01 + 1e-3).to(dtype)
    b = torch.randn(N, generator=gen).to(dtype) if bias else None
    return torch.randn(M, K, generator=gen).to(dtype), q, s, b


@pytest.mark.parametrize("M", [1, 3, 17, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("bias", [False, True])
def test_kernel_matches_reference(M, dtype, bias):
    x, q, s, b = _make(M, dtype, bias, seed=M)
    y = w8a16_linear(x, q, s, b)
    r = w8a16_linear_ref(x, q, s, b)
    assert y.dtype == dtype and y.shape == (M, N)
    tol = 1e-5 if dtype == torch.float32 else 5e-3
    torch.testing.assert_close(y.float(), r.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("cfg", [W8A16Config(1, 8, 8, 4), W8A16Config(16, 16, 32, 3),
                                 W8A16Config(16, 32, 16, 2, swap_ab=True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_split_k_configs(cfg, dtype):
    x, q, s, b = _make(17, dtype, True, seed=3)
    tol = 1e-5 if dtype == torch.float32 else 5e-3
    torch.testing.assert_close(w8a16_linear(x, q, s, b, config=cfg).float(),
                               w8a16_linear_ref(x, q, s, b).float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gpu_small_m_launch(dtype):
    """The GPU's launch for up to 16 rows (split-K over a K that allows the full split) computes
    the reference, and one shape for every M ≤ 16: a decode row equals the same row inside a
    verification step."""
    k = 1024
    gen = torch.Generator().manual_seed(5)
    q = torch.randint(-128, 128, (N, k), dtype=torch.int8, generator=gen)
    s = (torch.rand(N, generator=gen) * 0.01 + 1e-3).to(dtype)
    x = torch.randn(16, k, generator=gen).to(dtype)
    cfg = w8a16_default_config(16, N, k, on_gpu=True)
    assert cfg == w8a16_default_config(1, N, k, on_gpu=True) and cfg.split_k == 4
    y = w8a16_linear(x, q, s, config=cfg)
    tol = 1e-4 if dtype == torch.float32 else 5e-3  # K = 1024 sums of |q| ≤ 128: split order differs
    torch.testing.assert_close(y.float(), w8a16_linear_ref(x, q, s).float(), rtol=tol, atol=tol)
    assert torch.equal(w8a16_linear(x[:1], q, s, config=cfg), y[:1])


def test_reference_is_scaled_matmul():
    x, q, s, b = _make(3, torch.float32, True)
    torch.testing.assert_close(w8a16_linear_ref(x, q, s, b), x @ (q.float() * s[:, None]).t() + b)


def test_bad_inputs_raise():
    x, q, s, b = _make(3, torch.float32, True)
    with pytest.raises(QuantSpecError, match="w_q has dtype"):
        w8a16_linear(x, q.to(torch.int32), s)
    with pytest.raises(QuantSpecError, match="K="):
        w8a16_linear(x[:, :80].contiguous(), q, s)
    with pytest.raises(QuantSpecError, match="w_scale"):
        w8a16_linear(x, q, s[:3])
    with pytest.raises(QuantSpecError, match="contiguous"):
        w8a16_linear(torch.randn(K, 3).t(), q, s)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("M", [1, 16, 64, 300])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_big_shapes(M, dtype):
    gen = torch.Generator().manual_seed(M)
    q = torch.randint(-128, 128, (1000, 4096), dtype=torch.int8, generator=gen).cuda()
    s = (torch.rand(1000, generator=gen) * 1e-3).to(dtype).cuda()
    x = torch.randn(M, 4096, generator=gen).to(dtype).cuda()
    r = w8a16_linear_ref(x, q, s).float()
    torch.testing.assert_close(w8a16_linear(x, q, s).float(), r, rtol=2e-2, atol=1e-2 * float(r.abs().max()))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_dequantize_kernel_equals_reference(dtype, same_rounding):
    gen = torch.Generator().manual_seed(3)
    q = torch.randint(-128, 128, (N, K), dtype=torch.int8, generator=gen)
    s = torch.rand(N, generator=gen) * 1e-2 + 1e-4
    w = w8a16_dequantize(q, s, dtype)
    assert w.dtype == dtype
    same_rounding(w, w8a16_dequantize_ref(q, s, dtype))
    torch.testing.assert_close(w.float(), q.float() * s[:, None], rtol=2 ** -7, atol=0)


def _fp8_codes(gen) -> torch.Tensor:
    """Every E4M3 byte but NaN's (0x7F, 0xFF), subnormals and ±0 included, in random order."""
    codes = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8)
    return codes[torch.randint(len(codes), (N, K), generator=gen)].view(torch.float8_e4m3fn)


def test_fp8_codes_decode_exactly():
    """The kernel's E4M3 decoding (bytes → exact float values) equals torch's cast for every byte."""
    q = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8).view(torch.float8_e4m3fn)
    q = q.reshape(2, -1)
    s = torch.ones(2)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        assert torch.equal(w8a16_dequantize(q, s, dtype), q.to(dtype))


@pytest.mark.parametrize("M", [1, 17])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fp8_weights_match_reference(M, dtype):
    """FP8 E4M3 codes (weight_only_fp8) through the same kernel: the reference's numbers, and the
    dequantized weight bit for bit."""
    gen = torch.Generator().manual_seed(11 + M)
    q = _fp8_codes(gen)
    s = (torch.rand(N, generator=gen) * 0.01 + 1e-3).to(dtype)
    b = torch.randn(N, generator=gen).to(dtype)
    x = torch.randn(M, K, generator=gen).to(dtype)
    tol = 1e-5 if dtype == torch.float32 else 5e-3
    torch.testing.assert_close(w8a16_linear(x, q, s, b).float(), w8a16_linear_ref(x, q, s, b).float(),
                               rtol=tol, atol=tol)
    torch.testing.assert_close(w8a16_linear_ref(x, q, s, b), (x.float() @ (q.float() * s.float()[:, None]).t()
                                                              + b.float()).to(dtype))
    assert torch.equal(w8a16_dequantize(q, s, dtype), w8a16_dequantize_ref(q, s, dtype))


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("cfg", [None, W8A16Config(1, 8, 16, 2), W8A16Config(16, 16, 32, 3),
                                 W8A16Config(16, 32, 16, 2, swap_ab=True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_group_scales_match_reference(fp8, cfg, dtype):
    """Group scales [N, K/g] (weight_only_mxfp8's power-of-two ones per 32 on E4M3 codes; group-wise
    int8 on integer codes): each weight tile scaled per group in the kernel gives the reference's
    numbers — the weight dequantized per group in fp32 — for decode-sized and tiled launches, with
    tiles wider and narrower than a group."""
    g, k = 8, K
    gen = torch.Generator().manual_seed(21)
    q = _fp8_codes(gen)[:, :k].contiguous() if fp8 else torch.randint(-128, 128, (N, k), dtype=torch.int8,
                                                                      generator=gen)
    s = 2.0 ** torch.randint(-9, -3, (N, k // g), generator=gen).float() if fp8 else \
        (torch.rand(N, k // g, generator=gen) * 0.01 + 1e-3)
    b = torch.randn(N, generator=gen).to(dtype)
    for M in (1, 17):
        x = torch.randn(M, k, generator=gen).to(dtype)
        y, r = w8a16_linear(x, q, s, b, config=cfg), w8a16_linear_ref(x, q, s, b)
        tol = 1e-5 if dtype == torch.float32 else 5e-3
        torch.testing.assert_close(y.float(), r.float(), rtol=tol, atol=tol * float(r.abs().max()))
        per_group = (q.float().view(N, -1, g) * s[..., None]).view(N, k)
        torch.testing.assert_close(r.float(), (x.float() @ per_group.t() + b.float()).to(dtype).float())
    with pytest.raises(QuantSpecError, match="do not tile K"):
        w8a16_linear(x, q, s[:, :5], b)
