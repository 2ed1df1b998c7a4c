"""FP8 E4M3: the static activation quantizer (bit-exact over the whole fp8 grid), the GEMM with
operands upcast under the interpreter, and the clear error on GPUs without fp8."""

import pytest
import torch

from quantspec.errors import QuantSpecError
from quantspec.kernels import fp8 as fp8_mod
from quantspec.kernels.fp8 import (
    fp8_gemm,
    fp8_gemm_ref,
    fp8_linear,
    fp8_linear_ref,
    quantize_act_fp8,
    quantize_act_fp8_ref,
)

F8 = torch.float8_e4m3fn


def _grid_values():
    v = torch.arange(256, dtype=torch.uint8).view(F8).float()
    v = v[v.isfinite()].sort().values
    mids = (v[1:] + v[:-1]) / 2  # exact ties: round to even
    return torch.cat([v, mids, mids * (1 + 2**-20), mids * (1 - 2**-20),
                      torch.tensor([500.0, -1e4, 1e-12, 0.0, -0.0])])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_quantize_exact_on_grid_and_ties(dtype):
    x = _grid_values().to(dtype)
    x = x[: x.numel() // 8 * 8].reshape(8, -1).contiguous()
    s = torch.tensor([1.0])
    assert torch.equal(quantize_act_fp8(x, s).view(torch.uint8),
                       quantize_act_fp8_ref(x, s).view(torch.uint8))


def test_quantize_exact_random_scaled():
    x = torch.randn(17, 88, generator=torch.Generator().manual_seed(0)) * 5
    s = torch.tensor([0.013])
    assert torch.equal(quantize_act_fp8(x, s).view(torch.uint8),
                       quantize_act_fp8_ref(x, s).view(torch.uint8))


def _assert_close_to_reference(y, r, xq, wq, xs, ws, out_dtype):
    """fp32 outputs within 1e-5 of the reference on the CPU; on a GPU, whose fp8 MMA (Hopper's,
    from 64 rows a tile) adds a k tile's products in fewer bits than fp32, within 2**-10 of the
    sum of the products' magnitudes. Half-precision outputs within their rounding."""
    if out_dtype == torch.float32:
        tol = torch.full_like(r.float(), 1e-5)
        if torch.cuda.is_available():
            tol = tol + 2 ** -10 * (xq.float().abs() @ wq.float().abs().t()) * xs * ws.reshape(1, -1)
        assert bool(((y.float() - r.float()).abs() <= tol).all()), float((y.float() - r.float()).abs().max())
    else:
        tol = 2e-3 if out_dtype == torch.float16 else 2 ** -7
        torch.testing.assert_close(y.float(), r.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("M,split", [(1, 2), (17, 3)])
@pytest.mark.parametrize("per_channel", [False, True])
def test_split_k_gemm_matches_reference(M, split, per_channel):
    """Split-K launches (fp32 partial sums, the epilogue in a second launch) give the reference's
    numbers, with and without bias."""
    gen = torch.Generator().manual_seed(M + split)
    xq = (torch.randn(M, 88, generator=gen) * 8).to(F8)
    wq = (torch.randn(37, 88, generator=gen) * 8).to(F8)
    xs = torch.tensor([0.02])
    ws = torch.rand(37 if per_channel else 1, generator=gen) * 0.01
    for b in (torch.randn(37, generator=gen), None):
        for out_dtype in (torch.float32, torch.bfloat16):
            y = fp8_gemm(xq, xs, wq, ws, b, out_dtype, launch=(16, 16, 32, 4, 1, split))
            _assert_close_to_reference(y, fp8_gemm_ref(xq, xs, wq, ws, b, out_dtype), xq, wq, xs, ws, out_dtype)


@pytest.mark.parametrize("M", [1, 3, 17, 64])
@pytest.mark.parametrize("per_channel", [False, True])
def test_gemm_matches_reference(M, per_channel):
    gen = torch.Generator().manual_seed(M)
    xq = (torch.randn(M, 88, generator=gen) * 8).to(F8)
    wq = (torch.randn(37, 88, generator=gen) * 8).to(F8)
    xs = torch.tensor([0.02])
    ws = torch.rand(37 if per_channel else 1, generator=gen) * 0.01
    b = torch.randn(37, generator=gen)
    for out_dtype in (torch.float32, torch.float16):
        y = fp8_gemm(xq, xs, wq, ws, b, out_dtype)
        _assert_close_to_reference(y, fp8_gemm_ref(xq, xs, wq, ws, b, out_dtype), xq, wq, xs, ws, out_dtype)
    lit = (xq.double() @ wq.double().t()) * 0.02 * ws.double() + b.double()
    torch.testing.assert_close(fp8_gemm_ref(xq, xs, wq, ws, b, torch.float32).double(), lit,
                               rtol=1e-5, atol=1e-5)


def test_linear_matches_reference():
    x = torch.randn(17, 88, generator=torch.Generator().manual_seed(1)).half()
    wq = (torch.randn(37, 88) * 8).to(F8)
    ws, xs = torch.rand(37) * 0.01, torch.tensor([0.01])
    torch.testing.assert_close(fp8_linear(x, wq, ws, xs).float(), fp8_linear_ref(x, wq, ws, xs).float(),
                               rtol=2e-3, atol=2e-3)


def test_old_gpu_raises_clear_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "A100")
    with pytest.raises(QuantSpecError, match="8.9"):
        fp8_mod.check_fp8_device(torch.device("cuda", 0))
    fp8_mod.check_fp8_device(torch.device("cpu"))  # no error


def test_bad_inputs_raise():
    wq = torch.zeros(37, 88, dtype=F8)
    with pytest.raises(QuantSpecError, match="x_q has dtype"):
        fp8_gemm(torch.zeros(3, 88, dtype=torch.int8), torch.ones(1), wq, torch.ones(37))
    with pytest.raises(QuantSpecError, match="one static value"):
        fp8_gemm(torch.zeros(3, 88, dtype=F8), torch.ones(3), wq, torch.ones(37))
    with pytest.raises(QuantSpecError, match="w_scale has 5"):
        fp8_gemm(torch.zeros(3, 88, dtype=F8), torch.ones(1), wq, torch.ones(5))
    with pytest.raises(QuantSpecError, match="per-tensor"):
        quantize_act_fp8(torch.randn(3, 88), torch.ones(3))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                    reason="needs CUDA with compute capability >= 8.9")
@pytest.mark.parametrize("M", [1, 64, 300])
def test_gpu_native_fp8(M):
    x = torch.randn(M, 4096, device="cuda", dtype=torch.bfloat16)
    wq = (torch.randn(1000, 4096, device="cuda") * 8).to(F8)
    ws, xs = torch.rand(1000, device="cuda") * 1e-3, torch.tensor([0.02], device="cuda")
    torch.testing.assert_close(fp8_linear(x, wq, ws, xs).float(), fp8_linear_ref(x, wq, ws, xs).float(),
                               rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                    reason="needs CUDA with compute capability >= 8.9")
@pytest.mark.parametrize("M", [1, 16, 300])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_scaled_mm_linear(M, dtype):
    from quantspec.kernels.fp8 import fp8_scaled_mm_linear

    x = torch.randn(M, 4096, device="cuda", dtype=dtype)
    wq = (torch.randn(1024, 4096, device="cuda") * 8).to(F8)
    ws, xs = torch.rand(1024, device="cuda") * 1e-3, torch.tensor([0.02], device="cuda")
    b = torch.randn(1024, device="cuda", dtype=dtype)
    y = fp8_scaled_mm_linear(x, wq, ws, xs, b)
    assert y.dtype == dtype and y.shape == (M, 1024)
    torch.testing.assert_close(y.float(), fp8_linear_ref(x, wq, ws, xs, b).float(), rtol=2e-2, atol=2e-2)
