"""An int4 `QuantLinear` in the CUDA layout with `DispatchPolicy.cuda_int4_quartered`: the codes
kept in `quarter_int4`'s order where K and the group size are multiples of 128 (integer zero
points), its Triton and dequantize + matmul paths against the reference, its codes unchanged."""

import pytest
import torch

from quantspec.infer.cuda.weights import CudaWeight
from quantspec.infer.dispatch import DispatchPolicy, KernelPath, LinearKind
from quantspec.infer.quant_linear import QuantizedLinearTensors, QuantLinear
from quantspec.quant.presets import preset
from quantspec.quant.primitives import choose_qparams, quantize

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _layer(N, K, group, *, symmetric=True, zp_dtype=None, dtype=torch.float32, quartered=True, seed=0):
    gen = torch.Generator().manual_seed(seed)
    w = preset("weight_only_int4", group_size=group, symmetric=symmetric, zp_dtype=zp_dtype).config_groups["group_0"].weights
    s, z = choose_qparams(torch.randn(N, K, generator=gen) * 0.05, w)
    q = quantize(torch.randn(N, K, generator=gen) * 0.05, s, z, w)
    t = QuantizedLinearTensors(q=q, scale=s, zero_point=None if symmetric else z, weight_args=w, input_args=None,
                               input_scale=None, bias=torch.randn(N, generator=gen) * 0.1)
    layer = QuantLinear(t, dtype=dtype, device=DEVICE, policy=DispatchPolicy(cuda_int4_quartered=quartered))
    if DEVICE.type == "cpu":  # the CUDA layout, run by the interpreter
        layer.prepared = CudaWeight(layer, LinearKind.W4A16, q, None, DEVICE)
    return layer, q


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_quartered_layer_gives_the_reference(symmetric, dtype):
    """Triton's quartered launches (one row, tiles) and the quartered dequantize + matmul (x's
    columns in the weight's order) give the dequantized reference; `codes()` are the layer's."""
    layer, q = _layer(48, 256, 128, symmetric=symmetric, dtype=dtype, seed=int(symmetric))
    assert layer.prepared.quartered and torch.equal(layer.codes().cpu(), q.to(torch.int8))
    tol = 1e-5 if dtype == torch.float32 else 5e-3
    for M in (1, 17, 40):
        x = torch.randn(M, 256, generator=torch.Generator().manual_seed(M)).to(dtype).to(DEVICE)
        ref = layer.run(x, KernelPath.DEQUANT).float()
        for path in (KernelPath.TRITON_W4A16, KernelPath.CUDA_DEQUANT_MM):
            torch.testing.assert_close(layer.run(x, path).float(), ref, rtol=tol, atol=tol)


@pytest.mark.parametrize("K,group,symmetric,zp_dtype", [(192, 64, True, None), (256, 64, True, None),
                                                         (256, 128, False, "float32")])
def test_layers_the_quartered_layout_cannot_take_keep_the_standard_one(K, group, symmetric, zp_dtype):
    """K or the group size not a multiple of 128, or float zero points: the standard layout."""
    layer, q = _layer(16, K, group, symmetric=symmetric, zp_dtype=zp_dtype)
    assert not layer.prepared.quartered and layer.prepared.k_order is None
    x = torch.randn(3, K).to(DEVICE)
    torch.testing.assert_close(layer.run(x, KernelPath.TRITON_W4A16), layer.run(x, KernelPath.DEQUANT),
                               rtol=1e-5, atol=1e-5)
