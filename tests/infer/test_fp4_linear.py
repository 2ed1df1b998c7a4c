"""NVFP4 and MXFP4 `QuantLinear`s (weight-only, with FP4 inputs, and MXFP4 with FP8 inputs per
group: a8w4_mxfp4): every path against an fp64
reference written with `quant.primitives`, the dispatch rule, q/k/v-style stacking (one global
scale or none), the checkpoint reader's refusals, and the Triton paths' wiring under the
interpreter (a subprocess: TRITON_INTERPRET must be set before triton is imported)."""

import dataclasses
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from quantspec.errors import QuantSpecError
from quantspec.infer.dispatch import DispatchPolicy, KernelPath, LinearKind, LinearTraits, select_kernel
from quantspec.infer.quant_linear import QuantLinear
from quantspec.quant import QuantScheme, choose_qparams, dequantize, quantize
from quantspec.quant.artifact import linear_to_tensors
from quantspec.quant.compressed import QuantizedLinearTensors, read_quantized_linear
from quantspec.quant.config import resolve_group_size
from quantspec.quant.fp4 import global_scale_from_absmax
from quantspec.quant.presets import preset


FORMATS = ("nvfp4", "mxfp4", "a8w4_mxfp4")


def _fp4_layer(N, K, *, inputs: bool, seed=0, weight_global=None, fmt="nvfp4"):
    """A random FP4 layer ("nvfp4" / "mxfp4" / "a8w4_mxfp4" with inputs, else the weight-only type
    of its weights; a8w4_mxfp4's FP8 input groups as `resolve_group_size` fits them to K); NVFP4's
    weight global scale `weight_global` (default: its own)."""
    g = preset(fmt if inputs else f"weight_only_{fmt.removeprefix('a8w4_')}").config_groups["group_0"]
    gen = torch.Generator().manual_seed(seed)
    W = torch.randn(N, K, generator=gen) * 0.05
    if fmt.endswith("mxfp4"):
        s, _ = choose_qparams(W, g.weights)
        ia = g.input_activations
        if g.sized_by_inputs:
            ia = ia.replace(group_size=resolve_group_size(K, ia.group_size))
        return QuantizedLinearTensors(q=quantize(W, s, None, g.weights), scale=s, zero_point=None, weight_args=g.weights,
                                      input_args=ia, bias=torch.randn(N, generator=gen) * 0.1)
    wg = global_scale_from_absmax(W.abs().amax()) if weight_global is None else weight_global
    s, _ = choose_qparams(W, g.weights, wg)
    return QuantizedLinearTensors(q=quantize(W, s, None, g.weights, global_scale=wg), scale=s, zero_point=None,
                                  weight_args=g.weights, input_args=g.input_activations,
                                  bias=torch.randn(N, generator=gen) * 0.1, global_scale=wg,
                                  input_global_scale=global_scale_from_absmax(torch.tensor(3.0)) if inputs else None)


def _reference(t: QuantizedLinearTensors, x: torch.Tensor) -> torch.Tensor:
    """fp64 y = x̂ @ dequantize(q)ᵀ + b; x̂: x's FP4 (FP8) fake quantization (fp32) with FP4 (FP8) inputs."""
    xr = x.float()
    if t.input_args is not None:
        s, _ = choose_qparams(xr, t.input_args, t.input_global_scale)
        xr = dequantize(quantize(xr, s, None, t.input_args, global_scale=t.input_global_scale), s, None,
                        t.input_args, dtype=torch.float32, global_scale=t.input_global_scale)
    w = dequantize(t.q, t.scale, None, t.weight_args, dtype=torch.float32, global_scale=t.global_scale)
    return xr.double() @ w.to(x.dtype).double().t() + t.bias.to(x.dtype).double()


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("inputs", [False, True])
def test_fp4_layer(inputs, dtype, fmt):
    """Every CPU path of an FP4 layer against the fp64 reference: quantspec's FP4 kernel where it
    is built (the layer then holds the codes as nibbles and one fp32 scale per group, about a byte
    a weight, and no dequantized copy; a row's output does not depend on the rows beside it), the
    weight dequantized once otherwise — the reference's numbers exactly."""
    from quantspec.kernels import cpu as cg

    t = _fp4_layer(80, 96, inputs=inputs, seed=3, fmt=fmt)
    layer = QuantLinear(t, dtype=dtype)
    x = (torch.randn(5, 96, generator=torch.Generator().manual_seed(1)) * 2).to(dtype)
    kernel = cg.cpu_kernels() is not None
    assert layer.traits.kind is LinearKind.FP4
    assert layer.kernel_for(x) is (KernelPath.CPU_GEMV_FP4 if kernel else KernelPath.CPU_DEQUANTIZED)
    y = layer(x)
    ref = _reference(t, x)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    paths = [KernelPath.CPU_DEQUANTIZED] + [KernelPath.CPU_GEMV_FP4] * kernel
    for got in [y] + [layer.run(x, p) for p in paths]:
        torch.testing.assert_close(got.double(), ref, rtol=tol, atol=tol * float(ref.abs().max()))
    assert torch.equal(layer.run(x, KernelPath.CPU_DEQUANTIZED), layer.run(x, KernelPath.DEQUANT))
    assert torch.equal(layer.codes().view(torch.uint8), t.q.view(torch.uint8))
    if kernel:
        held = {k: b for k, b in layer.prepared.named_buffers() if b is not None}
        assert set(held) == {"fp4_cpu", "fp4_cpu_scale", "bias_fp32"} | ({"w_scale_vec"} & set(held)), set(held)
        assert sum(b.numel() * b.element_size() for k, b in held.items() if k.startswith("fp4")) <= 96 * 96 * 1.0
        assert all(torch.equal(layer(x[i:i + 1]), y[i:i + 1]) for i in range(5))
    if inputs:  # the inputs are quantized: a float x gives other outputs
        plain = x.float() @ layer.dequantized_weight(torch.float32).t() + t.bias
        assert (y.float() - plain).abs().max() > 1e-3


def test_nvfp4_layers_stack_only_under_one_global_scale():
    from quantspec.infer.fuse import stack_linears

    g = global_scale_from_absmax(torch.tensor(0.3))
    mods = [QuantLinear(_fp4_layer(n, 64, inputs=True, seed=n, weight_global=g)) for n in (64, 32, 32)]
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(0))
    fused = stack_linears(mods)
    assert fused is not None and torch.equal(fused.weight_global_scale, g.reshape(1))
    assert torch.equal(fused(x), torch.cat([m(x) for m in mods], -1))
    own = QuantLinear(_fp4_layer(32, 64, inputs=True, seed=9))  # its own global scale
    assert stack_linears([mods[0], own]) is None


def test_select_kernel_nvfp4_rule(monkeypatch):
    import quantspec.kernels as kernels

    def traits(**kw):
        return LinearTraits(kind=LinearKind.FP4, dtype=torch.bfloat16, weight_symmetric=True,
                            weight_strategy="tensor_group", act_mode="dynamic", **kw)

    assert select_kernel(traits(), "cpu", 1, torch.bfloat16) is KernelPath.CPU_DEQUANTIZED
    for M in (1, 4096):  # quantspec's FP4 kernel for every M of the prepared dtype
        assert select_kernel(traits(cpu_gemv=True), "cpu", M, torch.bfloat16) is KernelPath.CPU_GEMV_FP4
    assert select_kernel(traits(cpu_gemv=True), "cpu", 1, torch.float16) is KernelPath.CPU_DEQUANTIZED
    assert select_kernel(traits(), "cpu", 1, torch.bfloat16, DispatchPolicy(fast=False)) is KernelPath.DEQUANT
    monkeypatch.setattr(kernels, "triton_usable", lambda device: True)
    for M in (1, 4096):
        assert select_kernel(traits(fp4_tiles=True), "cuda", M, torch.bfloat16) is KernelPath.TRITON_NVFP4
    assert select_kernel(traits(), "cuda", 1, torch.bfloat16) is KernelPath.DEQUANT  # K not a multiple of 32
    mx = LinearTraits(kind=LinearKind.FP4, dtype=torch.bfloat16, weight_symmetric=True, weight_strategy="group",
                      act_mode=None, fp4_tiles=True)
    assert select_kernel(mx, "cuda", 7, torch.bfloat16) is KernelPath.TRITON_MXFP4


def test_mxfp4_reader_takes_the_exponent_bytes_and_refuses_e8m0_nan():
    t = _fp4_layer(48, 64, inputs=True, seed=1, fmt="mxfp4")
    scheme = QuantScheme(targets=("Linear",), weights=t.weight_args, input_activations=t.input_args)
    stored = linear_to_tensors("l", t.q, t.scale, None, t.weight_args)
    assert stored.keys() == {"l.weight_packed", "l.weight_scale"} and stored["l.weight_scale"].dtype == torch.uint8
    got = read_quantized_linear(stored, "l", scheme, 48, 64)
    assert torch.equal(got.q.view(torch.uint8), t.q.view(torch.uint8)) and torch.equal(got.scale, t.scale)
    bad = dict(stored, **{"l.weight_scale": torch.full_like(stored["l.weight_scale"], 255)})
    with pytest.raises(QuantSpecError, match="NaN"):
        read_quantized_linear(bad, "l", scheme, 48, 64)


def test_reader_takes_the_stored_tensors_and_refuses_missing_globals():
    for inputs in (False, True):
        t = _fp4_layer(48, 64, inputs=inputs, seed=1)
        scheme = QuantScheme(targets=("Linear",), weights=t.weight_args, input_activations=t.input_args)
        stored = linear_to_tensors("l", t.q, t.scale, None, t.weight_args, global_scale=t.global_scale,
                                   input_global_scale=t.input_global_scale)
        assert stored["l.weight_packed"].dtype == torch.uint8 and stored["l.weight_scale"].dtype == torch.float8_e4m3fn
        got = read_quantized_linear(stored, "l", scheme, 48, 64)
        assert torch.equal(got.q.view(torch.uint8), t.q.view(torch.uint8)) and torch.equal(got.scale, t.scale)
        assert torch.equal(got.global_scale, t.global_scale)
        if inputs:
            assert torch.equal(got.input_global_scale, t.input_global_scale)
            with pytest.raises(QuantSpecError, match="input_global_scale"):
                read_quantized_linear({k: v for k, v in stored.items() if "input_global" not in k}, "l", scheme, 48, 64)
        bad = dict(stored, **{"l.weight_global_scale": torch.zeros(1)})
        with pytest.raises(QuantSpecError, match="weight_global_scale is 0.0"):
            read_quantized_linear(bad, "l", scheme, 48, 64)


_TRITON_SCRIPT = textwrap.dedent("""
    import sys, torch
    sys.path.insert(0, %r)
    from test_fp4_linear import _fp4_layer
    from quantspec.infer.cuda.weights import CudaWeight
    from quantspec.infer.dispatch import KernelPath, LinearKind
    from quantspec.infer.quant_linear import QuantLinear
    for fmt, path in (("nvfp4", KernelPath.TRITON_NVFP4), ("mxfp4", KernelPath.TRITON_MXFP4),
                      ("a8w4_mxfp4", KernelPath.TRITON_MXFP4)):
        for inputs in (False, True):
            for dtype in (torch.float32, torch.float16):
                layer = QuantLinear(_fp4_layer(48, 64, inputs=inputs, seed=2, fmt=fmt), dtype=dtype)
                cpu_prepared = layer.prepared
                for prepared in (cpu_prepared, CudaWeight(layer, LinearKind.FP4, layer.codes(), None, torch.device("cpu"))):
                    layer.prepared = prepared
                    for M in (1, 3, 17):
                        x = torch.randn(M, 64).to(dtype)
                        y, ref = layer.run(x, path).float(), layer.run(x, KernelPath.DEQUANT).float()
                        err = float((y - ref).abs().max() / ref.abs().max())
                        assert err < (1e-5 if dtype == torch.float32 else 5e-3), (fmt, inputs, dtype, M, err)
                assert torch.equal(layer.prepared.codes().view(torch.uint8), cpu_prepared.codes().view(torch.uint8))
    print("OK")
""" % os.path.dirname(os.path.abspath(__file__)))


def test_triton_fp4_paths_match_reference_under_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-c", _TRITON_SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "OK" in r.stdout, r.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("inputs", [False, True])
@pytest.mark.parametrize("M", [1, 17, 300])
def test_cuda_fp4_layer_matches_reference(inputs, M, fmt):
    t = _fp4_layer(384, 1024, inputs=inputs, seed=M, fmt=fmt)
    layer = QuantLinear(t, dtype=torch.bfloat16, device="cuda")
    x = torch.randn(M, 1024).bfloat16()
    assert layer.kernel_for(x.cuda()) is (KernelPath.TRITON_MXFP4 if fmt.endswith("mxfp4") else KernelPath.TRITON_NVFP4)
    y, ref = layer(x.cuda()).cpu().double(), _reference(t, x)
    torch.testing.assert_close(y, ref, rtol=2e-2, atol=2e-2 * float(ref.abs().max()))


def test_fp8_input_groups_that_do_not_tile_k_are_one_line():
    """An MXFP4XFP8 checkpoint's FP8 input groups of 128 on a layer of K=96 (llm-compressor writes
    them as its preset says): refused in one line naming the fix, where quantspec fits them."""
    t = _fp4_layer(48, 96, inputs=True, fmt="a8w4_mxfp4")
    t = dataclasses.replace(t, input_args=t.input_args.replace(group_size=128))
    with pytest.raises(QuantSpecError, match=r"input groups of 128 do not divide K=96.*`quantspec quantize`") as e:
        QuantLinear(t, name="l")
    assert "\n" not in str(e.value)
