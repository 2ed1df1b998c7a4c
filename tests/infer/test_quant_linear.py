"""QuantLinear vs the reference `dequantize` + matmul from quant/primitives (fp64), on odd shapes;
the dispatch rule (`infer/dispatch.py`); reading compressed-tensors' own packed tensors
(`quant/compressed.py`); the Triton wiring (under the interpreter, in a subprocess) and on a real
GPU when there is one."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from quantspec.errors import QuantSpecError
from quantspec.infer.dispatch import DispatchPolicy, KernelPath, LinearKind, LinearTraits, select_kernel
from quantspec.infer.quant_linear import QuantLinear
from quantspec.quant.compressed import QuantizedLinearTensors, read_quantized_linear
from quantspec.quant import (QuantArgs, QuantScheme, choose_qparams, dequantize, linear_to_tensors,
                             preset, quantize)

torch.set_num_threads(1)


def _make(kind, N, K, *, group_size=32, symmetric=True, act_dynamic=False, act_symmetric=True,
          bias=False, seed=0, zp_dtype=None):
    """A random layer of `kind` (a quant type name) + the calibration batch used for its static
    input scale. Returns (QuantizedLinearTensors, float weight)."""
    gen = torch.Generator().manual_seed(seed)
    cfg = preset(kind, group_size=group_size, symmetric=symmetric, zp_dtype=zp_dtype)
    scheme = cfg.config_groups["group_0"]
    w_args = scheme.weights
    ia = scheme.input_activations
    if ia is not None and (act_dynamic or not act_symmetric):
        ia = ia.replace(dynamic=act_dynamic, strategy="token" if act_dynamic else "tensor",
                        symmetric=act_symmetric)
    W = torch.randn(N, K, generator=gen) * 0.05
    s, z = choose_qparams(W, w_args)
    q = quantize(W, s, z, w_args)
    in_scale = in_zp = None
    if ia is not None and not ia.dynamic:
        calib = torch.randn(64, K, generator=gen) * 2 + (0.5 if not act_symmetric else 0.0)
        in_scale, zp = choose_qparams(calib, ia)
        in_zp = None if ia.symmetric else zp
    b = torch.randn(N, generator=gen) * 0.1 if bias else None
    t = QuantizedLinearTensors(q=q, scale=s, zero_point=None if w_args.symmetric else z,
                               weight_args=w_args, input_args=ia, input_scale=in_scale,
                               input_zero_point=in_zp, bias=b)
    return t


def _reference(t: QuantizedLinearTensors, x: torch.Tensor) -> torch.Tensor:
    """fp64 y = x̂ @ dequantize(q)ᵀ + b, x̂ = fake-quantized x (fp32 primitives) for a8w8 types."""
    xr = x.float()
    ia = t.input_args
    if ia is not None:
        if ia.dynamic:
            s, z = choose_qparams(xr, ia)
        else:
            s, z = t.input_scale, t.input_zero_point
        xr = dequantize(quantize(xr, s, z, ia), s, z, ia, dtype=torch.float32)
    w = dequantize(t.q, t.scale.float(), t.zero_point, t.weight_args, dtype=torch.float32)
    y = xr.double() @ w.to(x.dtype).double().t()
    if t.bias is not None:
        y = y + t.bias.to(x.dtype).double()
    return y


def _check(y, ref, dtype):
    assert y.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))
    else:  # bf16 activations/weights in the op and a bf16 output
        torch.testing.assert_close(y.double(), ref, rtol=2e-2, atol=2e-2 * float(ref.abs().max()))


# (quant type, N, K, group size, symmetric): N, K odd multiples of the group size; N=40 is not a
# multiple of 16 (no CPU int4 packing), K=96 with g=-1 is per-channel int4
CASES = [
    ("weight_only_int8", 48, 96, 128, True),
    ("weight_only_int8", 40, 88, 128, True),  # K % 16 != 0: torch's int8 op is not allowed
    ("weight_only_int4", 48, 96, 32, True),
    ("weight_only_int4", 48, 192, 64, False),
    ("weight_only_int4", 40, 384, 128, True),
    ("weight_only_int4", 48, 96, -1, False),
    ("weight_only_int4", 48, 192, 32, "float16"),  # asymmetric, float zero points
    ("weight_only_int4", 40, 96, -1, "bfloat16"),
    ("a8w8", 40, 96, 128, True),
    ("a8w8_fp8", 48, 96, 128, True),
]


@pytest.mark.parametrize("M", [1, 3, 17])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind,N,K,g,sym", CASES)
def test_quant_linear_matches_reference(kind, N, K, g, sym, dtype, M):
    zp_dtype, sym = (sym, False) if isinstance(sym, str) else (None, sym)
    t = _make(kind, N, K, group_size=g, symmetric=sym, bias=(M == 3), seed=N + K + M,
              zp_dtype=zp_dtype)
    if zp_dtype is not None:
        assert t.zero_point.dtype == getattr(torch, zp_dtype)
    layer = QuantLinear(t, dtype=dtype)
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(M)).to(dtype)
    y = layer(x)
    assert y.shape == (M, N)
    _check(y, _reference(t, x), dtype)
    # a leading batch shape is kept
    y3 = layer(x.reshape(1, M, K))
    assert y3.shape == (1, M, N) and torch.equal(y3.reshape(M, N), y)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dynamic,act_sym", [(True, True), (False, False)])
def test_a8w8_dynamic_and_asymmetric_activations(dynamic, act_sym, dtype):
    t = _make("a8w8", 40, 96, act_dynamic=dynamic, act_symmetric=act_sym, bias=True, seed=7)
    layer = QuantLinear(t, dtype=dtype)
    x = (torch.randn(17, 96, generator=torch.Generator().manual_seed(2)) * 2 + 0.5).to(dtype)
    want = KernelPath.CPU_INT_MM if act_sym else KernelPath.DEQUANT
    assert layer.kernel_for(x) is want
    _check(layer(x), _reference(t, x), dtype)


def test_a8w8_int_mm_is_exact_int8_gemm():
    """The CPU int8 path accumulates exactly: equal to the kernels' int8_gemm_ref bit for bit."""
    from quantspec.kernels import w8a8_linear_ref

    t = _make("a8w8", 40, 96, bias=True, seed=3)
    layer = QuantLinear(t)
    x = torch.randn(5, 96)
    ref = w8a8_linear_ref(x, t.q, t.scale.reshape(-1), t.input_scale, t.bias)
    assert torch.equal(layer.run(x, KernelPath.CPU_INT_MM), ref)


def test_fp8_cpu_path_equals_kernel_reference():
    from quantspec.kernels import fp8_linear_ref

    t = _make("a8w8_fp8", 48, 96, bias=True, seed=4)
    layer = QuantLinear(t)
    x = torch.randn(5, 96)
    assert layer.kernel_for(x) is KernelPath.CPU_FP8_UPCAST
    ref = fp8_linear_ref(x, t.q, t.scale.reshape(-1), t.input_scale, t.bias)
    torch.testing.assert_close(layer(x), ref, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kind", ["weight_only_fp8", "weight_only_mxfp8", "mxfp8"])
@pytest.mark.parametrize("kernels", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_weights_on_cpu(dtype, kernels, kind):
    """FP8 weights alone (per channel, MXFP8's power-of-two groups) and MXFP8 with MXFP8 inputs on
    CPU: quantspec's packed fp32 GEMM over the weight dequantized at load where its kernels are
    built (every row its own numbers whatever M), else x times the codes upcast at load, then the
    weight scales (per channel) or the weight dequantized once (groups): the reference's numbers
    (inputs fake-quantized per row and group of 32 for mxfp8) within rounding order."""
    from quantspec.kernels import cpu as cg

    kernels = kernels and cg.cpu_kernels() is not None
    t = _make(kind, 48, 96, bias=True, seed=5)
    layer = QuantLinear(t, dtype=dtype, policy=DispatchPolicy(cpu_kernels=kernels))
    x = torch.randn(5, 96, generator=torch.Generator().manual_seed(1)).to(dtype)
    torch_path = KernelPath.CPU_FP8_UPCAST if kind == "weight_only_fp8" else KernelPath.CPU_DEQUANTIZED
    assert layer.kernel_for(x) is (KernelPath.CPU_GEMV_DENSE if kernels else torch_path)
    y = layer(x)
    _check(y, _reference(t, x), dtype)
    _check(layer.run(x, torch_path), _reference(t, x), dtype)
    assert torch.equal(layer.codes().float(), t.q.float())
    if kernels:
        assert layer.prepared.row_path is KernelPath.CPU_GEMV_DENSE
        assert all(torch.equal(layer(x[i:i + 1]), y[i:i + 1]) for i in range(5))  # rows alone: bitwise
    if kind == "mxfp8":  # the inputs are quantized per group: a float x gives other outputs
        plain = x.float() @ layer.dequantized_weight(torch.float32).t() + t.bias
        assert (y.float() - plain).abs().max() > 1e-4


@pytest.mark.parametrize("kind,g,sym,path", [
    ("weight_only_int8", 128, True, KernelPath.CPU_INT8PACK),
    ("weight_only_int4", 32, True, KernelPath.CPU_INT4PACK),
    ("weight_only_int4", 64, False, KernelPath.CPU_INT4PACK),
    ("weight_only_int4", -1, True, KernelPath.CPU_INT4PACK),
    ("weight_only_int4", 32, "float16", KernelPath.CPU_INT4PACK),  # zero = -zp·scale, float zp
    ("a8w4", 32, True, KernelPath.CPU_INT4PACK),  # x quantized per token first
    ("a8w4_fp8", 64, True, KernelPath.CPU_INT4PACK),
])
def test_cpu_fast_path_is_taken_when_allowed(monkeypatch, kind, g, sym, path):
    """torch's packed ops (the policy's `cpu_kernels=False`, or a machine without quantspec's)."""
    zp_dtype, sym = (sym, False) if isinstance(sym, str) else (None, sym)
    t = _make(kind, 48, 192, group_size=g, symmetric=sym, seed=11, zp_dtype=zp_dtype)
    torch_ops = DispatchPolicy(cpu_kernels=False)
    layer = QuantLinear(t, dtype=torch.bfloat16, policy=torch_ops)
    op = "_weight_int8pack_mm" if path is KernelPath.CPU_INT8PACK else "_weight_int4pack_mm_for_cpu"
    real, calls = getattr(torch, op), []
    monkeypatch.setattr(torch, op, lambda *a: calls.append(a[0].shape) or real(*a))
    x = torch.randn(16, 192).bfloat16()
    assert layer.kernel_for(x[:1]) is path and layer.kernel_for(x) is path
    _check(layer(x[:3]), _reference(t, x[:3]), torch.bfloat16)
    assert calls == [(3, 192)]
    # not taken: M above the bound, fp32 activations, or the policy says no
    assert layer.kernel_for(torch.randn(65, 192).bfloat16()) is KernelPath.DEQUANT
    assert QuantLinear(t, dtype=torch.float32, policy=torch_ops).kernel_for(x.float()) \
        is KernelPath.DEQUANT
    slow = QuantLinear(t, dtype=torch.bfloat16, policy=DispatchPolicy(fast=False))
    assert slow.kernel_for(x) is KernelPath.DEQUANT
    layer(torch.randn(65, 192).bfloat16())
    assert len(calls) == 1


needs_cpu_kernels = pytest.mark.skipif(
    "cpu_kernels() is None", reason="quantspec's CPU kernels are not available on this machine")


def cpu_kernels():
    from quantspec.kernels.cpu import cpu_kernels as build

    return build()


@needs_cpu_kernels
@pytest.mark.parametrize("kind,g,sym,dtype,path", [
    ("weight_only_int8", 128, True, torch.bfloat16, KernelPath.CPU_GEMV_INT8),
    ("weight_only_int8", 128, True, torch.float32, KernelPath.CPU_GEMV_INT8),
    ("weight_only_int4", 32, True, torch.float32, KernelPath.CPU_GEMV_INT4),
    ("weight_only_int4", 64, False, torch.float32, KernelPath.CPU_GEMV_INT4),
    ("weight_only_int4", -1, True, torch.float32, KernelPath.CPU_GEMV_INT4),
    ("weight_only_int4", 32, "float16", torch.float32, KernelPath.CPU_GEMV_INT4),
    ("a8w4", 32, True, torch.float32, KernelPath.CPU_GEMV_INT4),  # x quantized per token first
    ("a8w4", 64, False, torch.bfloat16, KernelPath.CPU_GEMV_INT4),
    ("a8w4_fp8", 32, True, torch.float32, KernelPath.CPU_GEMV_INT4),
])
def test_cpu_kernels_path(kind, g, sym, dtype, path):
    """quantspec's CPU kernels serve every number of rows of bf16 / fp32 x (prefill too), equal
    the reference, and give every row bitwise the numbers it gets alone; the packed blocks are
    the codes' only copy (no row-major int8 beside them) and `codes()` unpacks them exactly."""
    zp_dtype, sym = (sym, False) if isinstance(sym, str) else (None, sym)
    t = _make(kind, 40, 192, group_size=g, symmetric=sym, seed=12, zp_dtype=zp_dtype, bias=True)
    layer = QuantLinear(t, dtype=dtype)
    x = torch.randn(300, 192).to(dtype)
    assert layer.kernel_for(x[:1]) is path and layer.kernel_for(x[:64]) is path
    y = layer(x[:7])
    _check(y, _reference(t, x[:7]), dtype)
    for i in range(7):
        assert torch.equal(layer(x[i:i + 1]), y[i:i + 1])
    assert layer.kernel_for(x) is path  # prefill-sized
    y = layer(x)
    _check(y, _reference(t, x), dtype)
    assert torch.equal(layer(x[:7]), y[:7])
    assert layer.prepared.qweight is None
    assert torch.equal(layer.codes(), t.q.to(torch.int8))
    torch.testing.assert_close(layer.dequantized_weight(torch.float32),
                               QuantLinear(t, dtype=dtype, policy=DispatchPolicy(fast=False))
                               .dequantized_weight(torch.float32), rtol=0, atol=0)
    assert QuantLinear(t, dtype=dtype, policy=DispatchPolicy(cpu_kernels=False)).kernel_for(x[:1]) \
        is not path


def test_cpu_fast_path_refused_for_layouts_torch_cannot_take():
    # int8: K % 16 != 0 (torch 2.13's op crashes or returns garbage there); quantspec's packed
    # kernel takes any K, where it is built
    t8 = _make("weight_only_int8", 48, 88, seed=1)
    assert not QuantLinear(t8, dtype=torch.bfloat16).traits.cpu_int8pack
    x = torch.randn(3, 88).bfloat16()
    layer = QuantLinear(t8, dtype=torch.bfloat16)
    assert layer.traits.cpu_gemv == (cpu_kernels() is not None)
    _check(layer(x), _reference(t8, x), torch.bfloat16)
    # int4: N % 16 != 0; group 16 (below the op's smallest group)
    t4 = _make("weight_only_int4", 40, 96, group_size=32, seed=1)
    assert QuantLinear(t4, dtype=torch.bfloat16).traits.cpu_int4_group is None
    x = torch.randn(2, 96).bfloat16()  # quantspec's kernel takes it when built here
    _check(QuantLinear(t4, dtype=torch.bfloat16)(x), _reference(t4, x), torch.bfloat16)
    t16 = _make("weight_only_int4", 48, 96, group_size=16, seed=1)
    layer = QuantLinear(t16, dtype=torch.bfloat16)
    assert layer.traits.cpu_int4_group is None
    assert layer.traits.cpu_gemv == (cpu_kernels() is not None)
    _check(layer(x), _reference(t16, x), torch.bfloat16)
    # a group of 512 is tiled by torch's CPU groups of 256 with repeated scales
    t512 = _make("weight_only_int4", 48, 1024, group_size=512, seed=1)
    layer = QuantLinear(t512, dtype=torch.bfloat16)
    assert layer.traits.cpu_int4_group == 256
    x = torch.randn(2, 1024).bfloat16()
    # quantspec's pair path takes it first where this CPU has AVX512-BF16
    assert layer.kernel_for(x) is (KernelPath.CPU_GEMV_INT4 if layer.traits.cpu_pairs else KernelPath.CPU_INT4PACK)
    _check(layer(x), _reference(t512, x), torch.bfloat16)


def _traits(kind, **kw):
    base = dict(kind=kind, dtype=torch.bfloat16, weight_symmetric=True, weight_strategy="channel",
                act_mode=None)
    base.update(kw)
    return LinearTraits(**base)


def test_select_kernel_cpu_rule():
    g8 = _traits(LinearKind.W8A16, cpu_int8pack=True, cpu_gemv=True)
    assert select_kernel(g8, "cpu", 1, torch.bfloat16) is KernelPath.CPU_GEMV_INT8
    assert select_kernel(g8, "cpu", 64, torch.bfloat16) is KernelPath.CPU_GEMV_INT8
    assert select_kernel(g8, "cpu", 65, torch.bfloat16) is KernelPath.CPU_GEMV_INT8  # any M
    assert select_kernel(g8, "cpu", 4096, torch.bfloat16) is KernelPath.CPU_GEMV_INT8
    assert select_kernel(g8, "cpu", 8, torch.float32) is KernelPath.DEQUANT  # prepared for bf16
    assert select_kernel(_traits(LinearKind.W8A16, dtype=torch.float32, cpu_gemv=True), "cpu", 1,
                         torch.float32) is KernelPath.CPU_GEMV_INT8
    assert select_kernel(g8, "cpu", 1, torch.bfloat16, DispatchPolicy(cpu_kernels=False)) \
        is KernelPath.CPU_INT8PACK
    g4 = _traits(LinearKind.W4A16, weight_strategy="group", cpu_int4_group=64, cpu_gemv=True)
    assert select_kernel(g4, "cpu", 1, torch.bfloat16) is KernelPath.CPU_INT4PACK  # faster there
    assert select_kernel(g4, "cpu", 65, torch.bfloat16) is KernelPath.CPU_GEMV_INT4  # beyond its bound
    assert select_kernel(_traits(LinearKind.W4A16, weight_strategy="group", cpu_gemv=True), "cpu",
                         1, torch.bfloat16) is KernelPath.CPU_GEMV_INT4
    assert select_kernel(_traits(LinearKind.W4A16, dtype=torch.float16, cpu_gemv=True), "cpu", 1,
                         torch.float16) is KernelPath.DEQUANT
    # the pair path (bf16 x through AVX512-BF16) is taken before torch's op for every M
    p4 = _traits(LinearKind.W4A16, weight_strategy="group", cpu_int4_group=64, cpu_gemv=True, cpu_pairs=True)
    for m in (1, 11, 64, 65, 512):
        assert select_kernel(p4, "cpu", m, torch.bfloat16) is KernelPath.CPU_GEMV_INT4
    assert select_kernel(p4, "cpu", 1, torch.bfloat16, DispatchPolicy(cpu_kernels=False)) is KernelPath.CPU_INT4PACK
    t8 = _traits(LinearKind.W8A16, cpu_int8pack=True)
    assert select_kernel(t8, "cpu", 1, torch.bfloat16) is KernelPath.CPU_INT8PACK
    assert select_kernel(t8, "cpu", 64, torch.bfloat16) is KernelPath.CPU_INT8PACK
    assert select_kernel(t8, "cpu", 65, torch.bfloat16) is KernelPath.DEQUANT
    assert select_kernel(t8, "cpu", 1, torch.float32) is KernelPath.DEQUANT
    assert select_kernel(t8, "cpu", 0, torch.bfloat16) is KernelPath.DEQUANT
    assert select_kernel(t8, "cpu", 32, torch.bfloat16, DispatchPolicy(cpu_packed_max_m=16)) \
        is KernelPath.DEQUANT
    t4 = _traits(LinearKind.W4A16, weight_strategy="group", cpu_int4_group=64)
    assert select_kernel(t4, "cpu", 4, torch.bfloat16) is KernelPath.CPU_INT4PACK
    assert select_kernel(_traits(LinearKind.W4A16), "cpu", 4, torch.bfloat16) is KernelPath.DEQUANT
    a8 = _traits(LinearKind.W8A8, act_mode="static")
    assert select_kernel(a8, "cpu", 512, torch.float32) is KernelPath.CPU_INT_MM
    assert select_kernel(_traits(LinearKind.W8A8, act_mode="static", weight_symmetric=False),
                         "cpu", 1, torch.float32) is KernelPath.DEQUANT
    fp8 = _traits(LinearKind.FP8, act_mode="static")
    assert select_kernel(fp8, "cpu", 3, torch.float32) is KernelPath.CPU_FP8_UPCAST
    # FP8 weights alone: the upcast codes for x of the dtype they are upcast to, else the reference
    assert select_kernel(_traits(LinearKind.FP8), "cpu", 3, torch.bfloat16) is KernelPath.CPU_FP8_UPCAST
    assert select_kernel(_traits(LinearKind.FP8), "cpu", 3, torch.float32) is KernelPath.DEQUANT
    for strategy in ("block", "group"):  # FP8 blocks, MXFP8's groups: the weight dequantized at load
        assert select_kernel(_traits(LinearKind.FP8, weight_strategy=strategy), "cpu", 3, torch.bfloat16) \
            is KernelPath.CPU_DEQUANTIZED
    # with quantspec's kernels: their packed fp32 GEMM for FP8 weights alone and for per-group inputs;
    # per-channel weights with FP8 inputs keep their exact FP8 products
    for strategy, act in (("channel", None), ("block", "dynamic"), ("group", "dynamic"), ("group", None)):
        t = _traits(LinearKind.FP8, weight_strategy=strategy, act_mode=act, cpu_gemv=True)
        assert select_kernel(t, "cpu", 3, torch.bfloat16) is KernelPath.CPU_GEMV_DENSE
    assert select_kernel(_traits(LinearKind.FP8, act_mode="static", cpu_gemv=True), "cpu", 3, torch.bfloat16) \
        is KernelPath.CPU_FP8_UPCAST


def test_select_kernel_cuda_rule(monkeypatch):
    import quantspec.kernels as kernels

    monkeypatch.setattr(kernels, "triton_usable", lambda device: True)
    t4 = _traits(LinearKind.W4A16, weight_strategy="group")
    assert select_kernel(t4, "cuda", 1, torch.bfloat16) is KernelPath.TRITON_W4A16
    assert select_kernel(t4, "cuda", 256, torch.float16) is KernelPath.TRITON_W4A16
    assert select_kernel(t4, "cuda", 257, torch.bfloat16) is KernelPath.CUDA_DEQUANT_MM
    t8 = _traits(LinearKind.W8A16)
    assert select_kernel(t8, "cuda", 8, torch.bfloat16) is KernelPath.TRITON_W8A16
    assert select_kernel(t8, "cuda", 4096, torch.bfloat16) is KernelPath.CUDA_DEQUANT_MM
    g8 = _traits(LinearKind.W8A16, weight_strategy="group")  # group scales: the kernel for every M
    assert select_kernel(g8, "cuda", 8, torch.bfloat16) is select_kernel(g8, "cuda", 4096, torch.bfloat16) \
        is KernelPath.TRITON_W8A16
    assert select_kernel(_traits(LinearKind.W8A16, weight_symmetric=False), "cuda", 8,
                         torch.bfloat16) is KernelPath.DEQUANT
    a8 = _traits(LinearKind.W8A8, act_mode="dynamic")
    assert select_kernel(a8, "cuda", 4096, torch.bfloat16) is KernelPath.TRITON_W8A8
    assert select_kernel(_traits(LinearKind.W8A8, act_mode="static", act_symmetric=False),
                         "cuda", 1, torch.bfloat16) is KernelPath.DEQUANT
    fp8 = _traits(LinearKind.FP8, act_mode="static", fp8_native=True)
    assert select_kernel(fp8, "cuda", 1, torch.bfloat16) is KernelPath.TRITON_FP8
    assert select_kernel(fp8, "cuda", 512, torch.bfloat16) is KernelPath.CUDA_SCALED_MM
    assert select_kernel(fp8, "cuda", 511, torch.bfloat16) is KernelPath.TRITON_FP8
    assert select_kernel(fp8, "cuda", 4096, torch.float32) is KernelPath.TRITON_FP8  # it writes bf16
    assert select_kernel(fp8, "cuda", 16, torch.bfloat16, DispatchPolicy(cuda_scaled_mm_min_m=16)) \
        is KernelPath.CUDA_SCALED_MM
    assert select_kernel(_traits(LinearKind.FP8, act_mode="static"), "cuda", 1,
                         torch.bfloat16) is KernelPath.DEQUANT  # below sm_89
    w8fp8 = _traits(LinearKind.FP8)  # FP8 weights alone: the W8A16 kernels, any compute capability
    assert select_kernel(w8fp8, "cuda", 8, torch.bfloat16) is KernelPath.TRITON_W8A16
    assert select_kernel(w8fp8, "cuda", 4096, torch.bfloat16) is KernelPath.CUDA_DEQUANT_MM
    assert select_kernel(_traits(LinearKind.FP8, weight_strategy="block"), "cuda", 8,
                         torch.bfloat16) is KernelPath.DEQUANT
    for act in (None, "dynamic"):  # MXFP8 (group scales), weight-only or with MXFP8 inputs
        mx8 = _traits(LinearKind.FP8, weight_strategy="group", act_mode=act)
        assert select_kernel(mx8, "cuda", 1, torch.bfloat16) is select_kernel(mx8, "cuda", 4096, torch.float32) \
            is KernelPath.TRITON_W8A16
    monkeypatch.setattr(kernels, "triton_usable", lambda device: False)
    assert select_kernel(t4, "cuda", 1, torch.bfloat16) is KernelPath.DEQUANT


# ---------------------------------------------------------------- reading checkpoint tensors


def test_read_compressed_tensors_packed_int8_and_asym_int4():
    """Tensors packed by compressed-tensors' own `pack_to_int32` (an independent implementation):
    8-bit codes (4 per word, llm-compressor's W8A16 layout) and 4-bit codes with zero points
    packed along N."""
    helpers = pytest.importorskip("compressed_tensors.compressors.pack_quantized.helpers")
    gen = torch.Generator().manual_seed(0)
    N, K = 40, 96
    for bits, sym, strategy, g in ((8, True, "channel", None), (4, False, "group", 32)):
        args = QuantArgs(num_bits=bits, symmetric=sym, strategy=strategy, group_size=g)
        W = torch.randn(N, K, generator=gen)
        s, z = choose_qparams(W, args)
        q = quantize(W, s, z, args)
        p = "model.layers.0.mlp.up_proj"
        tensors = {f"{p}.weight_packed": helpers.pack_to_int32(q, bits),
                   f"{p}.weight_scale": s, f"{p}.weight_shape": torch.tensor([N, K])}
        if not sym:
            tensors[f"{p}.weight_zero_point"] = helpers.pack_to_int32(z, bits, packed_dim=0)
        scheme = QuantScheme(targets=("Linear",), weights=args, format="pack-quantized")
        got = read_quantized_linear(tensors, p, scheme, N, K)
        assert torch.equal(got.q, q)
        assert got.zero_point is None if sym else torch.equal(got.zero_point, z)


def test_read_errors_are_one_line():
    cfg = preset("a8w8")
    scheme = cfg.config_groups["group_0"]
    args = scheme.weights
    W = torch.randn(16, 32)
    s, z = choose_qparams(W, args)
    p = "model.layers.0.self_attn.q_proj"
    tensors = linear_to_tensors(p, quantize(W, s, z, args), s, z, args, format=scheme.format)
    with pytest.raises(QuantSpecError, match="has no input_scale.*--calib"):
        read_quantized_linear(tensors, p, scheme, 16, 32)
    tensors[f"{p}.input_scale"] = torch.tensor([0.1])
    with pytest.raises(QuantSpecError, match=r"weight has shape \(16, 32\), expected \(16, 48\)"):
        read_quantized_linear(tensors, p, scheme, 16, 48)
    tensors[f"{p}.input_scale"] = torch.tensor([0.0])  # what the GPU kernels do not check per call
    with pytest.raises(QuantSpecError, match="input_scale is 0.0; it must be a finite value > 0"):
        read_quantized_linear(tensors, p, scheme, 16, 32)
    tensors[f"{p}.input_scale"] = torch.tensor([0.1])
    tensors.pop(f"{p}.weight_scale")
    with pytest.raises(QuantSpecError, match="weight_scale' is missing"):
        read_quantized_linear(tensors, p, scheme, 16, 32)


def test_read_float_zero_points_and_mismatches():
    """A float zp_dtype: `weight_zero_point` unpacked [N, K/g] in that dtype; an integer scheme
    given float zero points, or a float scheme given packed int32 ones, is one line."""
    N, K = 32, 96
    p = "model.layers.0.mlp.up_proj"
    fargs = QuantArgs(num_bits=4, symmetric=False, strategy="group", group_size=32,
                      zp_dtype="float16")
    W = torch.randn(N, K, generator=torch.Generator().manual_seed(4))
    s, z = choose_qparams(W, fargs)
    q = quantize(W, s, z, fargs)
    tensors = linear_to_tensors(p, q, s, z, fargs)
    fscheme = QuantScheme(targets=("Linear",), weights=fargs)
    got = read_quantized_linear(tensors, p, fscheme, N, K)
    assert torch.equal(got.q, q) and got.zero_point.dtype == torch.float32
    assert torch.equal(got.zero_point, z.float())
    ischeme = QuantScheme(targets=("Linear",), weights=fargs.replace(zp_dtype=None))
    with pytest.raises(QuantSpecError, match=r"weight_zero_point has shape \(32, 3\), expected "
                                             r"\(4, 3\)"):
        read_quantized_linear(tensors, p, ischeme, N, K)
    # a float tensor where packed int32 words belong (same shape): the dtype gives it away
    iargs = ischeme.weights
    si, zi = choose_qparams(W, iargs)
    itensors = linear_to_tensors(p, quantize(W, si, zi, iargs), si, zi, iargs)
    itensors[f"{p}.weight_zero_point"] = itensors[f"{p}.weight_zero_point"].to(torch.float16)
    with pytest.raises(QuantSpecError, match="float zero points.*no float zp_dtype"):
        read_quantized_linear(itensors, p, ischeme, N, K)
    bad = dict(tensors, **{f"{p}.weight_zero_point": z.float()})
    with pytest.raises(QuantSpecError, match="dtype torch.float32 but the config's zp_dtype is "
                                             "float16"):
        read_quantized_linear(bad, p, fscheme, N, K)


# ---------------------------------------------------------------- Triton wiring

_TRITON_SCRIPT = textwrap.dedent("""
    import torch
    from quantspec.infer.dispatch import KernelPath
    from quantspec.infer.quant_linear import QuantLinear
    from quantspec.quant import preset, choose_qparams, quantize
    from quantspec.quant.compressed import QuantizedLinearTensors
    torch.manual_seed(0)
    cases = [("weight_only_int4", 32, True, KernelPath.TRITON_W4A16),
             ("weight_only_int4", 32, False, KernelPath.TRITON_W4A16),
             ("weight_only_int4", -1, True, KernelPath.TRITON_W4A16),
             ("weight_only_int4", 32, "float16", KernelPath.TRITON_W4A16),
             ("weight_only_int4", -1, "bfloat16", KernelPath.TRITON_W4A16),
             ("weight_only_int8", 128, True, KernelPath.TRITON_W8A16),
             ("a8w8", 128, True, KernelPath.TRITON_W8A8),
             ("a8w8_fp8", 128, True, KernelPath.TRITON_FP8),
             ("weight_only_fp8", 128, True, KernelPath.TRITON_W8A16),
             ("weight_only_fp8", 128, True, KernelPath.CUDA_DEQUANT_MM),
             ("a8w4", 32, True, KernelPath.TRITON_W4A16),
             ("a8w4", 32, False, KernelPath.CUDA_DEQUANT_MM),
             ("a8w4_fp8", 32, True, KernelPath.TRITON_W4A16),
             ("weight_only_mxfp8", 32, True, KernelPath.TRITON_W8A16),  # group scales in the kernel
             ("mxfp8", 32, True, KernelPath.TRITON_W8A16)]  # ... MXFP8 inputs fake-quantized first
    N, K = 24, 64
    for kind, g, sym, path in cases:
        zp_dtype, sym = (sym, False) if isinstance(sym, str) else (None, sym)
        sch = preset(kind, group_size=g, symmetric=sym, zp_dtype=zp_dtype).config_groups["group_0"]
        W = torch.randn(N, K) * 0.05
        s, z = choose_qparams(W, sch.weights)
        q = quantize(W, s, z, sch.weights)
        ia = sch.input_activations
        xs = choose_qparams(torch.randn(32, K), ia)[0] if ia is not None and not ia.dynamic else None
        t = QuantizedLinearTensors(q, s, None if sym else z, sch.weights, ia, xs,
                                   bias=torch.randn(N) * 0.1)
        layer = QuantLinear(t)
        for M in (1, 3, 17):
            x = torch.randn(M, K)
            y, ref = layer.run(x, path), layer.run(x, KernelPath.DEQUANT)
            err = float((y - ref).abs().max() / ref.abs().max())
            assert err < 1e-5, (kind, g, sym, M, err)

    # group-wise int8 weights (a checkpoint's): W8A16's kernel with their group scales
    w8g = preset("weight_only_int8").config_groups["group_0"].weights.replace(strategy="group", group_size=16)
    W = torch.randn(N, K) * 0.05
    s, _ = choose_qparams(W, w8g)
    layer = QuantLinear(QuantizedLinearTensors(quantize(W, s, None, w8g), s, None, w8g, None, None,
                                               bias=torch.randn(N) * 0.1))
    for M in (1, 17):
        x = torch.randn(M, K)
        y, ref = layer.run(x, KernelPath.TRITON_W8A16), layer.run(x, KernelPath.DEQUANT)
        assert float((y - ref).abs().max() / ref.abs().max()) < 1e-5, M

    # FP8 block scales (a partial block row: 24 rows in 16-row blocks), per-group dynamic inputs
    g = preset("a8w8_fp8", activations="dynamic", weight_block=16).config_groups["group_0"]
    W = torch.randn(N, K) * 0.05
    s, _ = choose_qparams(W, g.weights)
    layer = QuantLinear(QuantizedLinearTensors(quantize(W, s, None, g.weights), s, None, g.weights,
                                               g.input_activations, None, bias=torch.randn(N) * 0.1))
    for M in (1, 3, 17):
        x = torch.randn(M, K)
        y, ref = layer.run(x, KernelPath.TRITON_FP8_BLOCK), layer.run(x, KernelPath.DEQUANT)
        assert float((y - ref).abs().max() / ref.abs().max()) < 1e-5, M

    # the CUDA layout of an int4 layer whose scales a 16-bit float holds exactly (a 16-bit
    # checkpoint's): the kernels take them in the activations' dtype, with the reference's numbers
    from quantspec.infer.cuda.weights import CudaWeight
    from quantspec.infer.dispatch import LinearKind
    sch = preset("weight_only_int4", group_size=32).config_groups["group_0"]
    W = torch.randn(N, K) * 0.05
    s, z = choose_qparams(W, sch.weights)
    s = s.half().float()
    q = quantize(W, s, z, sch.weights)
    for dtype, narrow in ((torch.float16, torch.float16), (torch.bfloat16, torch.float32)):
        layer = QuantLinear(QuantizedLinearTensors(q, s, None, sch.weights, None, None), dtype=dtype)
        layer.prepared = CudaWeight(layer, LinearKind.W4A16, q, None, torch.device("cpu"))
        assert layer.prepared.w4_scale.dtype == narrow, (dtype, layer.prepared.w4_scale.dtype)
        for M in (1, 17):
            x = torch.randn(M, K).to(dtype)
            ref = layer.run(x, KernelPath.DEQUANT).float()
            for path in (KernelPath.TRITON_W4A16, KernelPath.CUDA_DEQUANT_MM):
                err = float((layer.run(x, path).float() - ref).abs().max() / ref.abs().max())
                assert err < 1e-2, (dtype, path, M, err)
    print("OK")
""")


def test_triton_paths_match_reference_under_interpreter():
    """The Triton branch of QuantLinear (argument layout for each kernel) vs the reference path,
    run by Triton's CPU interpreter in a subprocess (TRITON_INTERPRET must be set before triton
    is imported)."""
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-c", _TRITON_SCRIPT], env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0 and "OK" in r.stdout, r.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kind,g,sym", [("weight_only_int4", 128, True),
                                        ("weight_only_int4", 64, False),
                                        ("weight_only_int8", 128, True), ("a8w8", 128, True),
                                        ("a8w8_fp8", 128, True), ("weight_only_fp8", 128, True), ("a8w4", 128, True),
                                        ("a8w4_fp8", 128, True), ("weight_only_mxfp8", 32, True), ("mxfp8", 32, True)])
@pytest.mark.parametrize("M", [1, 3, 17, 200])
def test_cuda_quant_linear_matches_reference(kind, g, sym, M):
    t = _make(kind, 384, 1024, group_size=g, symmetric=sym, bias=True, seed=M)
    layer = QuantLinear(t, dtype=torch.bfloat16, device="cuda")
    x = torch.randn(M, 1024).bfloat16()
    y = layer(x.cuda()).cpu()
    _check(y, _reference(t, x), torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                    reason="needs CUDA with compute capability >= 8.9")
@pytest.mark.parametrize("M", [1, 17, 200])
def test_cuda_fp8_block_layer_matches_reference(M):
    t = _block_tensors(384, 1024, 128, seed=M)
    layer = QuantLinear(t, dtype=torch.bfloat16, device="cuda")
    x = torch.randn(M, 1024).bfloat16()
    assert layer.kernel_for(x.cuda()) is KernelPath.TRITON_FP8_BLOCK
    _check(layer(x.cuda()).cpu(), _reference(t, x), torch.bfloat16)


@pytest.mark.parametrize("kind,g", [("weight_only_int8", 128), ("weight_only_int4", 32)])
def test_packed_ops_survive_unaligned_buffers(kind, g):
    """Views at odd offsets (weights straight out of a safetensors buffer, a row slice of x)
    crashed torch's int8 op; the layer re-homes them."""
    t = _make(kind, 48, 96, group_size=g, seed=5)
    store = torch.empty(t.q.numel() + 7, dtype=torch.int8)
    store[7:] = t.q.reshape(-1)
    t.q = store[7:].view(48, 96)  # data_ptr % 64 == 7
    layer = QuantLinear(t, dtype=torch.bfloat16)
    xb = torch.randn(5 * 96 + 3).bfloat16()
    x = xb[3:].view(5, 96)  # data_ptr % 64 != 0
    assert layer.kernel_for(x) in (KernelPath.CPU_INT8PACK, KernelPath.CPU_INT4PACK,
                                   KernelPath.CPU_GEMV_INT8, KernelPath.CPU_GEMV_INT4)
    _check(layer(x), _reference(t, x), torch.bfloat16)


@pytest.mark.parametrize("policy", [DispatchPolicy(), DispatchPolicy(cpu_kernels=False)])
@pytest.mark.parametrize("kind", ["weight_only_int8", "weight_only_int4"])
def test_decode_steps_take_the_row_invariant_path_for_any_m(kind, policy):
    """A row-invariant call (an engine decode step) of 80 rows (above torch's packed-op bound)
    still gives each row its one-row numbers bitwise; otherwise 80 rows take the prefill path:
    quantspec's packed kernel where built (any M), else dequantize + matmul."""
    t = _make(kind, 48, 192, group_size=32, seed=13)
    layer = QuantLinear(t, dtype=torch.bfloat16, policy=policy)
    x = torch.randn(80, 192).bfloat16()
    prefill = (KernelPath.DEQUANT if not layer.traits.cpu_gemv else
               KernelPath.CPU_GEMV_INT8 if kind == "weight_only_int8" else KernelPath.CPU_GEMV_INT4)
    assert layer.kernel_for(x) is prefill
    y = layer(x, row_invariant=True)
    for i in (0, 41, 79):
        assert torch.equal(layer(x[i:i + 1]), y[i:i + 1])
    _check(y, _reference(t, x), torch.bfloat16)


# ---------------------------------------------------------------- FP8 block scales

def _block_tensors(N, K, side, seed=0):
    """A random FP8_BLOCK layer (side × side weight blocks, inputs per token and group of side)."""
    g = preset("a8w8_fp8", activations="dynamic", weight_block=side).config_groups["group_0"]
    gen = torch.Generator().manual_seed(seed)
    W = torch.randn(N, K, generator=gen) * 0.05
    s, _ = choose_qparams(W, g.weights)
    return QuantizedLinearTensors(q=quantize(W, s, None, g.weights), scale=s, zero_point=None,
                                  weight_args=g.weights, input_args=g.input_activations,
                                  bias=torch.randn(N, generator=gen) * 0.1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("N,K,side", [(96, 128, 32), (100, 192, 64)])  # 100 rows: a partial block row
def test_fp8_block_layer(N, K, side, dtype):
    t = _block_tensors(N, K, side, seed=N)
    assert t.scale.shape == (-(-N // side), K // side)
    layer = QuantLinear(t, dtype=dtype)
    x = (torch.randn(5, K, generator=torch.Generator().manual_seed(1)) * 2).to(dtype)
    assert layer.kernel_for(x) in (KernelPath.CPU_GEMV_DENSE, KernelPath.CPU_DEQUANTIZED)
    y = layer(x)
    # the reference's numbers, weight dequantized once
    assert torch.equal(layer.run(x, KernelPath.CPU_DEQUANTIZED), layer.run(x, KernelPath.DEQUANT))
    _check(y, _reference(t, x), dtype)
    assert torch.equal(layer.codes().view(torch.uint8), t.q.view(torch.uint8))
    # the inputs are quantized per group: a float x gives other outputs
    plain = x.float() @ layer.dequantized_weight(torch.float32).t() + t.bias
    assert (y.float() - plain).abs().max() > 1e-4


def test_fp8_block_layers_stack_on_block_boundaries():
    """q/k/v-style stacking of block layers is exact where every member but the last ends on a
    block row; otherwise the layers stay apart."""
    from quantspec.infer.fuse import stack_linears

    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(0))
    mods = [QuantLinear(_block_tensors(n, 64, 32, seed=n)) for n in (64, 32, 40)]
    fused = stack_linears(mods)
    assert fused is not None and fused.weight_scale.shape == (5, 2)  # 2 + 1 + 2 block rows
    assert torch.equal(fused(x), torch.cat([m(x) for m in mods], -1))
    assert stack_linears([mods[2], mods[0]]) is None  # 40 rows end mid-block


def test_select_kernel_block_rule(monkeypatch):
    import quantspec.kernels as kernels

    block = _traits(LinearKind.FP8, weight_strategy="block", act_mode="dynamic")
    assert select_kernel(block, "cpu", 1, torch.float32) is KernelPath.CPU_DEQUANTIZED
    assert select_kernel(block, "cpu", 1, torch.float32, DispatchPolicy(fast=False)) is KernelPath.DEQUANT
    monkeypatch.setattr(kernels, "triton_usable", lambda device: True)
    native = _traits(LinearKind.FP8, weight_strategy="block", act_mode="dynamic", fp8_native=True)
    assert select_kernel(native, "cuda", 4096, torch.bfloat16) is KernelPath.TRITON_FP8_BLOCK
    assert select_kernel(block, "cuda", 1, torch.bfloat16) is KernelPath.DEQUANT  # below sm_89


@pytest.mark.parametrize("kind", ["a8w4", "a8w4_fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_w4a8_input_quantizer_is_the_primitives(kind, dtype):
    """A W4A8 layer's own per-token quantizer (the kernels' input) gives `quantize` /
    `dequantize`'s numbers bitwise: rows of every magnitude, an all-zero row, ties at .5."""
    layer = QuantLinear(_make(kind, 16, 64, group_size=32), dtype=dtype)
    x = torch.randn(9, 64) * torch.logspace(-6, 3, 9)[:, None]
    x[4] = 0
    x[5] = torch.arange(64) - 31.5  # absmax 31.5: x / s lands on halves
    x = x.to(dtype)
    assert torch.equal(layer._w4a8_input(x), layer.fake_quantized_input(x))
    assert not torch.equal(layer._w4a8_input(x), x)
