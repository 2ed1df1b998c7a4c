"""NVFP4's numbers (`quant.fp4`, `quant.primitives` with `global_scale=`) against
compressed-tensors' own: `generate_gparam`, `calculate_qparams`, `quantize` / `dequantize` /
`fake_quantize`, `compute_dynamic_scales_and_zp` (NVFP4 inputs), `pack_fp4_to_uint8` /
`unpack_fp4_from_uint8` — bit for bit, in fp32, bf16 and fp16."""

import pytest
import torch

from quantspec.errors import QuantSpecError
from quantspec.quant import primitives as P
from quantspec.quant.args import QuantArgs
from quantspec.quant.fp4 import E2M1_VALUES, global_scale_from_absmax, pack_fp4, round_to_e2m1, unpack_fp4

ct_q = pytest.importorskip("compressed_tensors.quantization")
from compressed_tensors.compressors.nvfp4.helpers import pack_fp4_to_uint8, unpack_fp4_from_uint8  # noqa: E402
from compressed_tensors.quantization.lifecycle import forward as ct_forward  # noqa: E402
from compressed_tensors.quantization.utils import helpers as ct_helpers  # noqa: E402

W_ARGS = QuantArgs(num_bits=4, type="float", strategy="tensor_group", group_size=16)
IN_ARGS = W_ARGS.replace(dynamic="local")
CT_NVFP4 = ct_q.preset_name_to_scheme("NVFP4", ["Linear"])


def _weight(dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 128, generator=g) * torch.rand(48, 1, generator=g) * 3
    w[3, :16] = 0  # an all-zero group: FP8's eps as its scale
    w[5, 16:32] = -1e-4  # tiny negatives: E2M1 -0.0, whose sign survives into the nibble
    w[7, 40] = 80.0  # an outlier sets the global scale
    return w.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_weight_numbers_are_compressed_tensors(dtype):
    W = _weight(dtype)
    g_ct = ct_helpers.generate_gparam(W.amin(), W.amax())
    Wg = W.unflatten(-1, (-1, 16))
    s_ct, _ = ct_helpers.calculate_qparams(Wg.amin(-1), Wg.amax(-1), CT_NVFP4.weights, global_scale=g_ct)
    g = global_scale_from_absmax(W.abs().amax())
    s, _ = P.choose_qparams(W, W_ARGS)
    assert torch.equal(g, g_ct) and g.dtype == torch.float32
    assert torch.equal(s, s_ct.to(s.dtype)) and float(s[3, 0]) == 0.125
    q_ct = ct_forward.quantize(W, s_ct, None, CT_NVFP4.weights, global_scale=g_ct)
    q = P.quantize(W, s, None, W_ARGS, global_scale=g)
    assert q.dtype == torch.float8_e4m3fn and torch.equal(q.float(), q_ct.float())
    assert torch.signbit(q[5, 16:32].float()).all()  # -0.0 kept
    packed = pack_fp4(q)
    assert torch.equal(packed, pack_fp4_to_uint8(q_ct)) and packed.shape == (48, 64)
    assert torch.equal(unpack_fp4(packed, 128).float(), unpack_fp4_from_uint8(packed, 48, 128, dtype=torch.float32))
    dq_ct = ct_forward.dequantize(q_ct, s_ct, None, CT_NVFP4.weights, global_scale=g_ct)
    assert torch.equal(P.dequantize(q, s, None, W_ARGS, dtype=dq_ct.dtype, global_scale=g), dq_ct)
    fq_ct = ct_forward.fake_quantize(W, s_ct, None, CT_NVFP4.weights, global_scale=g_ct)
    assert torch.equal(P.fake_quantize(W, s, None, W_ARGS, global_scale=g), fq_ct)


def test_input_numbers_are_compressed_tensors():
    """NVFP4 inputs: group scales at run time under the calibrated global scale (fp32, the dtype
    quantspec quantizes activations in)."""
    x = torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(1)) * 2
    x[0, 0, :16] = 0
    g = global_scale_from_absmax(torch.tensor(5.0))  # an input range narrower than x's: clamps at ±6
    s_ct, z_ct = ct_helpers.compute_dynamic_scales_and_zp(x, CT_NVFP4.input_activations, module=None, global_scale=g)
    s, _ = P.choose_qparams(x, IN_ARGS, global_scale=g)
    assert torch.equal(s, s_ct)
    want = ct_forward.fake_quantize(x, s_ct, z_ct, CT_NVFP4.input_activations, global_scale=g)
    assert torch.equal(P.fake_quantize(x, s, None, IN_ARGS, global_scale=g), want)
    assert (P.quantize(x, s, None, IN_ARGS, global_scale=g).float().abs() == 6).any()


def test_e2m1_rounding_ties_to_even_and_every_nibble_round_trips():
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    assert round_to_e2m1(mids).tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]
    assert round_to_e2m1(-mids).tolist() == [-0.0, -1.0, -1.0, -2.0, -2.0, -4.0, -4.0]
    assert round_to_e2m1(torch.tensor([0.2501, 5.0001, 6.0])).tolist() == [0.5, 6.0, 6.0]
    every = torch.arange(256, dtype=torch.uint8).reshape(4, 64)
    codes = unpack_fp4(every, 128)
    assert set(codes.float().abs().unique().tolist()) == set(E2M1_VALUES)
    assert torch.equal(pack_fp4(codes), every)


def test_global_scale_of_degenerate_ranges():
    assert global_scale_from_absmax(torch.tensor(0.0)).item() == 1.0  # overflow → no global scaling
    assert global_scale_from_absmax(torch.tensor(float("nan"))).item() == 1.0
    assert global_scale_from_absmax(torch.tensor([2.0, 4.0])).item() == pytest.approx(448 * 6 / 4)


def test_nvfp4_numbers_need_their_global_scale():
    W = _weight(torch.float32)
    s, _ = P.choose_qparams(W, W_ARGS)
    with pytest.raises(QuantSpecError, match="global scale"):
        P.quantize(W, s, None, W_ARGS)
    with pytest.raises(QuantSpecError, match="global scale"):
        P.qparams_from_minmax(W.amin(), W.amax(), W_ARGS)
    with pytest.raises(QuantSpecError, match="K even"):
        pack_fp4(torch.zeros(2, 3))
    with pytest.raises(QuantSpecError, match="corrupt"):
        unpack_fp4(torch.zeros(2, 3, dtype=torch.uint8), 8)


def test_gptq_on_nvfp4():
    """GPTQ with NVFP4 args: with an identity Hessian it is round-to-nearest under the same global
    scale, bit for bit; on correlated inputs it leaves a smaller output error than RTN."""
    from quantspec.quant.gptq import gptq_quantize, rtn_quantize

    W = _weight(torch.float32)[:, :64]
    g = global_scale_from_absmax(torch.tensor(3.0))  # a global scale shared with another Linear
    rtn = rtn_quantize(W, W_ARGS, global_scale=g)
    ident = gptq_quantize(W, torch.eye(64), W_ARGS, global_scale=g)
    assert torch.equal(ident.q.view(torch.uint8), rtn.q.view(torch.uint8)) and torch.equal(ident.scale, rtn.scale)
    assert torch.equal(ident.weight_dq, rtn.weight_dq)
    gen = torch.Generator().manual_seed(2)
    X = torch.randn(512, 8, generator=gen) @ torch.randn(8, 64, generator=gen) + 0.1 * torch.randn(512, 64, generator=gen)
    gptq = gptq_quantize(W, 2 * X.t() @ X / 512, W_ARGS, global_scale=g)
    assert torch.equal(gptq.weight_dq, P.dequantize(gptq.q, gptq.scale, None, W_ARGS, global_scale=g))
    err = [float((X @ (W - r.weight_dq).t()).square().sum()) for r in (rtn, gptq)]
    assert err[1] < 0.8 * err[0], err
