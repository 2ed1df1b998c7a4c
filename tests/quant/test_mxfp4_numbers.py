"""MXFP4's numbers (`quant.fp4`'s E8M0 scales, `quant.primitives` with MXFP4 args) against
compressed-tensors' own: `calculate_qparams` / `generate_mx_scales`, `quantize` / `dequantize` /
`fake_quantize`, `compute_dynamic_scales_and_zp` (MXFP4 inputs), the MXFP4 compressor's scale
bytes — bit for bit, in fp32, bf16 and fp16."""

import pytest
import torch

from quantspec.quant import primitives as P
from quantspec.quant.args import QuantArgs
from quantspec.quant.fp4 import mx_exponents, mx_exponents_of, mx_values, pack_fp4, unpack_fp4

ct_q = pytest.importorskip("compressed_tensors.quantization")
from compressed_tensors.compressors.mx_utils import compress_mx_scale, decompress_mx_scale  # noqa: E402
from compressed_tensors.compressors.nvfp4.helpers import pack_fp4_to_uint8  # noqa: E402
from compressed_tensors.quantization.lifecycle import forward as ct_forward  # noqa: E402
from compressed_tensors.quantization.utils import helpers as ct_helpers  # noqa: E402

W_ARGS = QuantArgs(num_bits=4, type="float", strategy="group", group_size=32, scale_dtype="uint8")
IN_ARGS = W_ARGS.replace(dynamic=True)
CT_MXFP4 = ct_q.preset_name_to_scheme("MXFP4", ["Linear"])


def _weight(dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 128, generator=g) * torch.logspace(-4, 2, 48).unsqueeze(1)
    w[3, :32] = 0  # an all-zero group
    w[5, 32:64] = -1e-3 * w[5, 32:64].abs()  # tiny negatives
    w[6, 64:96] = 1.75  # absmax on the rounding edge: the scale rounds up
    w[6, 96:128] = 1.70
    w[7, 40] = 80.0
    return w.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_weight_numbers_are_compressed_tensors(dtype):
    W = _weight(dtype)
    Wg = W.unflatten(-1, (-1, 32))
    s_ct, _ = ct_helpers.calculate_qparams(Wg.amin(-1), Wg.amax(-1), CT_MXFP4.weights)
    s, _ = P.choose_qparams(W, W_ARGS)
    assert s.dtype == dtype and torch.equal(s, s_ct)
    assert float(s[6, 2]) == 0.5 and float(s[6, 3]) == 0.25  # 1.75 rounds up to 2 (scale 2^(1-2)), 1.70 down to 1
    e = mx_exponents_of(s)
    assert torch.equal(e, compress_mx_scale(s_ct, torch.uint8))
    assert torch.equal(mx_values(e, dtype), decompress_mx_scale(e).to(dtype))
    q_ct = ct_forward.quantize(W, s_ct, None, CT_MXFP4.weights)
    q = P.quantize(W, s, None, W_ARGS)
    assert q.dtype == torch.float8_e4m3fn and torch.equal(q.float(), q_ct.float())
    assert torch.equal(pack_fp4(q), pack_fp4_to_uint8(q_ct))
    assert torch.equal(unpack_fp4(pack_fp4(q), 128).float(), q.float())
    dq_ct = ct_forward.dequantize(q_ct, s_ct, None, CT_MXFP4.weights)
    assert torch.equal(P.dequantize(q, s, None, W_ARGS, dtype=dq_ct.dtype), dq_ct)
    assert torch.equal(P.fake_quantize(W, s, None, W_ARGS), ct_forward.fake_quantize(W, s_ct, None, CT_MXFP4.weights))


def test_input_numbers_are_compressed_tensors():
    """MXFP4 inputs: power-of-two group scales at run time (fp32, the dtype quantspec quantizes
    activations in)."""
    x = torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(1)) * 3
    x[0, 0, :32] = 0
    s_ct, z_ct = ct_helpers.compute_dynamic_scales_and_zp(x, CT_MXFP4.input_activations, module=None)
    s, _ = P.choose_qparams(x, IN_ARGS)
    assert torch.equal(s, s_ct)
    want = ct_forward.fake_quantize(x, s_ct, z_ct, CT_MXFP4.input_activations)
    assert torch.equal(P.fake_quantize(x, s, None, IN_ARGS), want)


def test_exponents_span_e8m0():
    a = torch.tensor([0.0, 2.0 ** -130, 2.0 ** -125, 1.0, 1.5, 1.75, 6.0, 7.0, 2.0 ** 127])
    assert mx_exponents(a).tolist() == [0, 0, 0, 125, 125, 126, 127, 128, 252]
    assert mx_exponents_of(torch.tensor([0.0, 2.0 ** -127, 1.0, 2.0 ** 127])).tolist() == [0, 0, 127, 254]
    assert mx_values(torch.tensor([0, 1, 127, 254], dtype=torch.uint8), torch.float32).tolist() == [
        2.0 ** -127, 2.0 ** -126, 1.0, 2.0 ** 127]


def test_gptq_on_mxfp4():
    """GPTQ with MXFP4 args: round-to-nearest with an identity Hessian, bit for bit; a smaller
    output error than RTN on correlated inputs."""
    from quantspec.quant.gptq import gptq_quantize, rtn_quantize

    W = _weight(torch.float32)[8:, :64]
    rtn = rtn_quantize(W, W_ARGS)
    ident = gptq_quantize(W, torch.eye(64), W_ARGS)
    assert torch.equal(ident.q.view(torch.uint8), rtn.q.view(torch.uint8)) and torch.equal(ident.scale, rtn.scale)
    gen = torch.Generator().manual_seed(2)
    X = torch.randn(512, 8, generator=gen) @ torch.randn(8, 64, generator=gen) + 0.1 * torch.randn(512, 64, generator=gen)
    gptq = gptq_quantize(W, 2 * X.t() @ X / 512, W_ARGS)
    assert torch.equal(gptq.weight_dq, P.dequantize(gptq.q, gptq.scale, None, W_ARGS))
    err = [float((X @ (W - r.weight_dq).t()).square().sum()) for r in (rtn, gptq)]
    assert err[1] < 0.8 * err[0], err
