"""Block-scaled FP8 (FP8_BLOCK): the per-group activation quantizer bit-exact against
`quant.primitives`, the block GEMM against its torch reference and against the layer's
reference numbers (x̂ @ ŵᵀ from `dequantize`), and its argument checks."""

import pytest
import torch

from quantspec.errors import QuantSpecError
from quantspec.kernels.fp8_block import (
    fp8_block_gemm,
    fp8_block_gemm_ref,
    fp8_block_linear,
    fp8_block_linear_ref,
    quantize_act_fp8_group,
    quantize_act_fp8_group_ref,
)
from quantspec.quant.args import QuantArgs
from quantspec.quant.primitives import choose_qparams, dequantize, quantize

F8 = torch.float8_e4m3fn


def _block_weight(N, K, block, seed=0):
    w = torch.randn(N, K, generator=torch.Generator().manual_seed(seed)) * 0.05
    args = QuantArgs(type="float", strategy="block", block_structure=block)
    scale, _ = choose_qparams(w, args)
    return quantize(w, scale, None, args), scale, args


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_group_quantizer_bit_exact(dtype):
    x = (torch.randn(9, 256, generator=torch.Generator().manual_seed(1)) * 3).to(dtype)
    x[2, 64:128] = 0  # an all-zero group: eps scale, zero codes
    x[4, :5] = torch.tensor([1e4, -1e4, 1e-9, 448.0, -0.0])
    q, s = quantize_act_fp8_group(x, 64)
    rq, rs = quantize_act_fp8_group_ref(x, 64)
    assert q.dtype == F8 and s.shape == (9, 4)
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(s, rs)
    assert float(s[2, 1]) == torch.finfo(torch.float32).eps


def _close(y, ref):
    """Within 1e-5 on the CPU; on a GPU, whose fp8 MMA adds a k tile's products in fewer bits
    than fp32, within 2e-3 of the output's magnitude."""
    tol = 2e-3 * float(ref.abs().max()) if torch.cuda.is_available() else 1e-5
    torch.testing.assert_close(y, ref, rtol=0 if torch.cuda.is_available() else 1e-5, atol=tol)


@pytest.mark.parametrize("M,N,K,block", [(1, 96, 128, (32, 32)), (5, 200, 256, (64, 64)), (17, 64, 192, (32, 64)),
                                         (33, 130, 128, (128, 128))])
def test_block_gemm_matches_reference(M, N, K, block):
    wq, ws, args = _block_weight(N, K, block)
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(2))
    bias = torch.randn(N, generator=torch.Generator().manual_seed(3))
    xq, xs = quantize_act_fp8_group_ref(x, block[1])
    y = fp8_block_gemm(xq, xs, wq, ws, block, bias, torch.float32)
    ref = fp8_block_gemm_ref(xq, xs, wq, ws, block, bias, torch.float32)
    _close(y, ref)
    # the layer's reference numbers: dequantized inputs and weights, one matmul
    ia = QuantArgs(type="float", strategy="group", group_size=block[1], dynamic=True)
    xhat = dequantize(xq, xs, None, ia)
    dense = xhat @ dequantize(wq, ws, None, args).t() + bias
    _close(fp8_block_linear(x, wq, ws, block, bias), dense)
    torch.testing.assert_close(fp8_block_linear_ref(x, wq, ws, block, bias), dense, rtol=1e-5, atol=1e-5)
    # the scales are read per block: a wrong block row changes the output
    ws2 = ws.clone()
    ws2[-1] *= 2
    assert not torch.allclose(fp8_block_gemm(xq, xs, wq, ws2, block, bias, torch.float32), y)


def test_block_gemm_refuses_bad_arguments():
    wq, ws, _ = _block_weight(64, 128, (32, 32))
    x = torch.randn(3, 128)
    xq, xs = quantize_act_fp8_group_ref(x, 32)
    with pytest.raises(QuantSpecError, match="w_scale has shape"):
        fp8_block_gemm(xq, xs, wq, ws[:1], (32, 32))
    with pytest.raises(QuantSpecError, match="x_scale has shape"):
        fp8_block_gemm(xq, xs[:, :2], wq, ws, (32, 32))
    with pytest.raises(QuantSpecError, match="power of two dividing K=100"):
        quantize_act_fp8_group(torch.randn(2, 100), 32)
