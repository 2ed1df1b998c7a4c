"""W8A8 int8: activation quantizer and int8 GEMM kernels vs their references (bit-exact), and the
references vs literal arithmetic."""

import pytest
import torch

from quantspec.errors import QuantSpecError
from quantspec.kernels import w8a8
from quantspec.kernels._common import SM_TARGET, scaled_gemm_launch
from quantspec.kernels.w8a8 import (
    int8_gemm,
    int8_gemm_ref,
    quantize_act_int8,
    quantize_act_int8_ref,
    w8a8_linear,
    w8a8_linear_ref,
)

N, K = 37, 88


def _x(M, dtype, seed=0):
    return (torch.randn(M, K, generator=torch.Generator().manual_seed(seed)) * 3).to(dtype)


@pytest.mark.parametrize("M", [1, 3, 17, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("static", [False, True])
def test_quantize_act_exact(M, dtype, static):
    x = _x(M, dtype, seed=M)
    if M > 1:
        x[1] = 0  # an all-zero row: scale must stay finite
    scale = torch.tensor([0.037]) if static else None
    q, s = quantize_act_int8(x, scale)
    qr, sr = quantize_act_int8_ref(x, scale)
    assert torch.equal(q, qr) and torch.equal(s, sr)
    assert s.shape == ((1,) if static else (M,))


def test_quantize_act_literal_values():
    # ties round to even, clamp at the int8 range, scale = absmax / 127.5
    x = torch.tensor([[0.5, 1.5, 2.5, -0.5, -1.5, 1000.0, -1000.0, 0.0]])
    q, s = quantize_act_int8(x, torch.tensor([1.0]))
    assert q.tolist() == [[0, 2, 2, 0, -2, 127, -128, 0]]
    q, s = quantize_act_int8(torch.tensor([[255.0, -127.5, 0.0]]))
    assert s.tolist() == [2.0] and q.tolist() == [[127, -64, 0]]


@pytest.mark.parametrize("M", [1, 3, 17, 64])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.float16])
def test_int8_gemm_exact(M, out_dtype):
    gen = torch.Generator().manual_seed(M)
    xq = torch.randint(-128, 128, (M, K), dtype=torch.int8, generator=gen)
    wq = torch.randint(-128, 128, (N, K), dtype=torch.int8, generator=gen)
    xs = torch.rand(M if M % 2 else 1, generator=gen) * 0.1  # per-token and static
    ws = torch.rand(N, generator=gen) * 0.01
    b = torch.randn(N, generator=gen)
    y = int8_gemm(xq, xs, wq, ws, b, out_dtype)
    assert torch.equal(y, int8_gemm_ref(xq, xs, wq, ws, b, out_dtype))
    lit = (xq.double() @ wq.double().t()) * xs.double()[:, None] * ws.double() + b.double()
    torch.testing.assert_close(y.double(), lit.to(out_dtype).double(), rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("M,split", [(1, 2), (3, 3), (17, 2), (17, 8)])
def test_int8_gemm_split_k_is_the_unsplit_launch(M, split, same_rounding):
    """Split-K launches (int32 partial sums, then the epilogue in a second launch; a split past
    the k tiles stores zeros) give the unsplit launch's numbers bitwise: per-token and static
    scales, with and without bias."""
    gen = torch.Generator().manual_seed(M + split)
    xq = torch.randint(-128, 128, (M, K), dtype=torch.int8, generator=gen)
    wq = torch.randint(-128, 128, (N, K), dtype=torch.int8, generator=gen)
    ws = torch.rand(N, generator=gen) * 0.01
    for xs, b in ((torch.rand(M, generator=gen) * 0.1, torch.randn(N, generator=gen)), (torch.tensor([0.03]), None)):
        for out_dtype in (torch.float32, torch.bfloat16):
            y = int8_gemm(xq, xs, wq, ws, b, out_dtype, launch=(16, 16, 32, 4, 1, split))
            assert torch.equal(y, int8_gemm(xq, xs, wq, ws, b, out_dtype, launch=(16, 16, 32, 4, 1, 1)))
            same_rounding(y, int8_gemm_ref(xq, xs, wq, ws, b, out_dtype))


def test_scaled_gemm_launch_splits_small_m_only():
    """A GPU's int8 / FP8 launch splits K where its tiles cannot fill the GPU, never so far that
    the partial sums' traffic outgrows a quarter of the weight's bytes; large M is unsplit."""
    for (K_, N_), M in [((4096, 4096), 1), ((4096, 4096), 16), ((4096, 4096), 64), ((14336, 4096), 64),
                        ((4096, 14336), 1), ((4096, 4096), 256), ((4096, 14336), 4096)]:
        bm, bn, bk, _, _, split = scaled_gemm_launch(M, N_, K_, True)
        programs = -(-M // bm) * -(-N_ // bn) * split
        assert split == 1 or programs <= SM_TARGET + -(-M // bm) * -(-N_ // bn)
        assert split * M * N_ * 4 * 2 <= N_ * K_ / 4 or split == 1
        assert (split > 1) == (M <= 64), (K_, N_, M, split)
    for K_ in (576, 1536, 4096, 14336):  # one launch for up to 16 rows: decode and verification rows agree
        assert len({scaled_gemm_launch(M, 4096, K_, True) for M in range(1, 17)}) == 1
    assert scaled_gemm_launch(1, 4096, 4096, False)[-1] == 1
    assert scaled_gemm_launch(0, 4096, 4096, True)[-1] >= 1  # an empty batch launches nothing, and does not fail


@pytest.mark.parametrize("static", [False, True])
def test_w8a8_linear(static):
    x = _x(17, torch.float16, seed=2)
    gen = torch.Generator().manual_seed(1)
    wq = torch.randint(-128, 128, (N, K), dtype=torch.int8, generator=gen)
    ws = torch.rand(N, generator=gen) * 0.01
    xs = torch.tensor([0.05]) if static else None
    y = w8a8_linear(x, wq, ws, xs)
    assert y.dtype == torch.float16 and torch.equal(y, w8a8_linear_ref(x, wq, ws, xs))


def test_bad_inputs_raise():
    xq = torch.zeros(3, K, dtype=torch.int8)
    wq = torch.zeros(N, K, dtype=torch.int8)
    with pytest.raises(QuantSpecError, match="x_scale"):
        int8_gemm(xq, torch.ones(2), wq, torch.ones(N))
    with pytest.raises(QuantSpecError, match="w_scale has dtype"):
        int8_gemm(xq, torch.ones(3), wq, torch.ones(N, dtype=torch.float16))
    with pytest.raises(QuantSpecError, match="K="):
        int8_gemm(xq[:, :5].contiguous(), torch.ones(3), wq, torch.ones(N))
    with pytest.raises(QuantSpecError, match="one value"):
        quantize_act_int8(torch.randn(3, K), torch.ones(3))
    with pytest.raises(QuantSpecError, match="> 0"):  # checked where reading the scale costs no sync:
        # on CPU tensors, so through the module (conftest moves this module's calls to a GPU)
        w8a8.quantize_act_int8(torch.randn(3, K), torch.zeros(1))
    with pytest.raises(QuantSpecError, match="contiguous"):
        quantize_act_int8(torch.randn(K, 3).t())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("M", [1, 16, 64, 300, 2048])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("static", [False, True])
def test_gpu_big_shapes(M, dtype, static):
    gen = torch.Generator().manual_seed(M)
    q = torch.randint(-127, 128, (1000, 4096), dtype=torch.int8, generator=gen).cuda()
    s = (torch.rand(1000, generator=gen) * 1e-3 + 1e-4).cuda()
    x = torch.randn(M, 4096, generator=gen).to(dtype).cuda()
    xs = torch.tensor([0.03], device="cuda") if static else None
    # the reference on the CPU (CUDA has no int32 matmul); exact int32 sums, one output rounding
    r = w8a8_linear_ref(*(None if t is None else t.cpu() for t in (x, q, s, xs))).float()
    torch.testing.assert_close(w8a8_linear(x, q, s, xs).float().cpu(), r, rtol=1e-2, atol=1e-2 * float(r.abs().max()))
