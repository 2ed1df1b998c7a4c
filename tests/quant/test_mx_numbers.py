"""The OCP microscaling numbers — MXFP4 (E2M1) and MXFP8 (E4M3) values under power-of-two group
scales stored as E8M0 exponents (`quant.fp4`, `quant.primitives` with MX args) — against
compressed-tensors' own: `calculate_qparams` / `generate_mx_scales`, `quantize` / `dequantize` /
`fake_quantize`, `compute_dynamic_scales_and_zp` (MX inputs), the compressors' scale bytes and
tensors — bit for bit, in fp32, bf16 and fp16; and GPTQ on MX args."""

import pytest
import torch

from quantspec.quant import primitives as P
from quantspec.quant.args import QuantArgs
from quantspec.quant.artifact import linear_from_tensors, linear_to_tensors
from quantspec.quant.fp4 import mx_exponents, mx_exponents_of, mx_values, pack_fp4, unpack_fp4

ct_q = pytest.importorskip("compressed_tensors.quantization")
from compressed_tensors.compressors.mx_utils import compress_mx_scale, decompress_mx_scale  # noqa: E402
from compressed_tensors.compressors.nvfp4.helpers import pack_fp4_to_uint8  # noqa: E402
from compressed_tensors.quantization.lifecycle import forward as ct_forward  # noqa: E402
from compressed_tensors.quantization.utils import helpers as ct_helpers  # noqa: E402

W_ARGS = QuantArgs(num_bits=4, type="float", strategy="group", group_size=32, scale_dtype="uint8")
W8_ARGS = W_ARGS.replace(num_bits=8)
CT = {4: ct_q.preset_name_to_scheme("MXFP4", ["Linear"]), 8: ct_q.preset_name_to_scheme("MXFP8", ["Linear"])}


# per element type: (the absmax of a group on the scale's rounding edge — mantissa 1.75, rounded up —
# one just below it, an outlier within fp16) and the scales they give
_EDGES = {4: ((1.75, 1.70, 80.0), (0.5, 0.25)),  # 1.75 rounds up to 2 (scale 2^(1-2)), 1.70 down to 1
          8: ((448.0, 440.0, 2.0 ** 14), (2.0, 1.0))}  # 448 = 1.75 · 2^8 rounds up to 2^9 → 2^(9-8)


def _weight(dtype: torch.dtype, bits: int = 4) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 128, generator=g) * torch.logspace(-4, 2, 48).unsqueeze(1)
    w[3, :32] = 0  # an all-zero group
    w[5, 32:64] = -1e-3 * w[5, 32:64].abs()  # tiny negatives
    (edge, below, outlier), _ = _EDGES[bits]
    w[6, 64:96] = edge
    w[6, 96:128] = below
    w[7, 40] = outlier
    return w.to(dtype)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_weight_numbers_are_compressed_tensors(dtype, bits):
    args, ct = (W_ARGS if bits == 4 else W8_ARGS), CT[bits].weights
    W = _weight(dtype, bits)
    Wg = W.unflatten(-1, (-1, 32))
    s_ct, _ = ct_helpers.calculate_qparams(Wg.amin(-1), Wg.amax(-1), ct)
    s, _ = P.choose_qparams(W, args)
    assert s.dtype == dtype and torch.equal(s, s_ct)
    assert (float(s[6, 2]), float(s[6, 3])) == _EDGES[bits][1]
    e = mx_exponents_of(s)
    assert torch.equal(e, compress_mx_scale(s_ct, torch.uint8))
    assert torch.equal(mx_values(e, dtype), decompress_mx_scale(e).to(dtype))
    q_ct = ct_forward.quantize(W, s_ct, None, ct)
    q = P.quantize(W, s, None, args)
    assert q.dtype == torch.float8_e4m3fn and torch.equal(q.float(), q_ct.float())
    if bits == 4:
        assert torch.equal(pack_fp4(q), pack_fp4_to_uint8(q_ct))
        assert torch.equal(unpack_fp4(pack_fp4(q), 128).float(), q.float())
    dq_ct = ct_forward.dequantize(q_ct, s_ct, None, ct)
    assert torch.equal(P.dequantize(q, s, None, args, dtype=dq_ct.dtype), dq_ct)
    assert torch.equal(P.fake_quantize(W, s, None, args), ct_forward.fake_quantize(W, s_ct, None, ct))


@pytest.mark.parametrize("bits", [4, 8])
def test_input_numbers_are_compressed_tensors(bits):
    """MX inputs: power-of-two group scales at run time (fp32, the dtype quantspec quantizes
    activations in)."""
    args = (W_ARGS if bits == 4 else W8_ARGS).replace(dynamic=True)
    x = torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(1)) * (3 if bits == 4 else 300)
    x[0, 0, :32] = 0
    s_ct, z_ct = ct_helpers.compute_dynamic_scales_and_zp(x, CT[bits].input_activations, module=None)
    s, _ = P.choose_qparams(x, args)
    assert torch.equal(s, s_ct)
    want = ct_forward.fake_quantize(x, s_ct, z_ct, CT[bits].input_activations)
    assert torch.equal(P.fake_quantize(x, s, None, args), want)


def test_exponents_span_e8m0():
    a = torch.tensor([0.0, 2.0 ** -130, 2.0 ** -125, 1.0, 1.5, 1.75, 6.0, 7.0, 2.0 ** 127])
    assert mx_exponents(a).tolist() == [0, 0, 0, 125, 125, 126, 127, 128, 252]
    assert mx_exponents_of(torch.tensor([0.0, 2.0 ** -127, 1.0, 2.0 ** 127])).tolist() == [0, 0, 127, 254]
    assert mx_values(torch.tensor([0, 1, 127, 254], dtype=torch.uint8), torch.float32).tolist() == [
        2.0 ** -127, 2.0 ** -126, 1.0, 2.0 ** 127]


def test_exponents_put_the_group_max_in_e4m3():
    a = torch.tensor([0.0, 1.0, 447.0, 448.0, 500.0, 2.0 ** 20])
    assert mx_exponents(a, 8).tolist() == [0, 119, 127, 128, 128, 139]
    # a group's largest value lands within E4M3's ±448 after its scale
    assert bool((a / mx_values(mx_exponents(a, 8), torch.float32) <= 448).all())


def test_artifact_tensors_are_the_compressors():
    """`linear_to_tensors` writes what compressed-tensors' MXFP8 compressor writes for the same
    weight (float8 codes, uint8 E8M0 exponents), and reads back to the same codes and scales."""
    from compressed_tensors.compressors.mxfp8 import MXFP8QuantizationCompressor

    W = _weight(torch.bfloat16, 8)
    s, _ = P.choose_qparams(W, W8_ARGS)
    q = P.quantize(W, s, None, W8_ARGS)
    ours = linear_to_tensors("l", q, s, None, W8_ARGS)
    theirs = MXFP8QuantizationCompressor.compress({"weight": W, "weight_scale": s,
                                                   "weight_zero_point": torch.zeros_like(s)}, CT[8])
    assert set(ours) == {"l.weight", "l.weight_scale"}
    assert ours["l.weight_scale"].dtype == theirs["weight_scale"].dtype == torch.uint8
    assert torch.equal(ours["l.weight_scale"], theirs["weight_scale"])
    assert torch.equal(ours["l.weight"].view(torch.uint8), theirs["weight"].view(torch.uint8))
    back = linear_from_tensors(ours, "l", W8_ARGS)
    assert torch.equal(back.q.view(torch.uint8), q.view(torch.uint8)) and torch.equal(back.scale, s.float())


@pytest.mark.parametrize("bits", [4, 8])
def test_gptq_on_mx(bits):
    """GPTQ with MXFP4 / MXFP8 args: round-to-nearest with an identity Hessian, bit for bit; a
    smaller output error than RTN on correlated inputs."""
    from quantspec.quant.gptq import gptq_quantize, rtn_quantize

    args = W_ARGS if bits == 4 else W8_ARGS
    W = _weight(torch.float32)[8:, :64] / (1 if bits == 4 else 50)
    rtn = rtn_quantize(W, args)
    ident = gptq_quantize(W, torch.eye(64), args)
    assert torch.equal(ident.q.view(torch.uint8), rtn.q.view(torch.uint8)) and torch.equal(ident.scale, rtn.scale)
    gen = torch.Generator().manual_seed(2)
    X = torch.randn(512, 8, generator=gen) @ torch.randn(8, 64, generator=gen) + 0.1 * torch.randn(512, 64, generator=gen)
    gptq = gptq_quantize(W, 2 * X.t() @ X / 512, args)
    assert torch.equal(gptq.weight_dq, P.dequantize(gptq.q, gptq.scale, None, args))
    err = [float((X @ (W - r.weight_dq).t()).square().sum()) for r in (rtn, gptq)]
    assert err[1] < 0.8 * err[0], err
