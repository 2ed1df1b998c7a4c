"""Every Triton kernel's GPU launches, compiled for NVIDIA GPUs on a machine without one.

The interpreter runs a kernel's Python, not the compiler: a launch can pass every interpreter
test and still fail to compile for a GPU (a statement the compiler builds in a branch the
interpreter never enters, an op a GPU target lacks). Here the host functions run on CPU tensors
with the launch configs and operand types they take on a GPU (`_common.gpu_launch` and
`dot_in_fp32` switched to the GPU's answers); each Triton launch they make is recorded instead
of run, then compiled, in a process without the interpreter, by Triton's own compiler and
`ptxas` for Ampere (sm_80) and Hopper (sm_90) (FP8 operands: Hopper only, as `check_fp8_device`
requires), with the argument specialization a GPU launch gets (16-byte aligned pointers,
integers divisible by 16).
"""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys

import pytest
import torch
import triton
import triton.language as tl

from quantspec.kernels import _common, fp4, fp8, fp8_block, fused, kv_cache, mxfp4, w4a16, w8a8, w8a16
from quantspec.quant.packing import pack_int4

_POINTER_TYPES = {torch.float32: "*fp32", torch.float16: "*fp16", torch.bfloat16: "*bf16", torch.int32: "*i32",
                  torch.int64: "*i64", torch.int8: "*i8", torch.uint8: "*u8", torch.float8_e4m3fn: "*fp8e4nv"}
_MODULES = (_common, fp4, fp8, fp8_block, fused, kv_cache, mxfp4, w4a16, w8a8, w8a16)

# the host functions run on CPU tensors, which only the interpreter takes; where a GPU runs the
# kernels themselves (no interpreter), the `-m gpu` tests compile and run them
pytestmark = pytest.mark.skipif(not _common.interpreter_enabled(), reason="the GPU tests compile the kernels here")

# run in a fresh process: imports each kernel's module from its file and compiles the launches
_COMPILER = r"""
import importlib.util, json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

modules, out = {}, []
for d in json.load(sys.stdin):
    if d["file"] not in modules:
        spec = importlib.util.spec_from_file_location(f"m{len(modules)}", d["file"])
        modules[d["file"]] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(modules[d["file"]])
    fn = getattr(modules[d["file"]], d["name"])
    attrs = {(i,): [["tt.divisibility", 16]] for i in d["aligned"]}
    for cc in d["targets"]:
        src = ASTSource(fn=fn, signature=d["signature"], constexprs=d["constants"], attrs=attrs)
        try:
            asm = triton.compile(src, target=GPUTarget("cuda", cc, 32), options=d["options"]).asm
            ttgir, ptx = asm["ttgir"], asm["ptx"]
            # where the grid dependency wait sits: before the first global memory access, or not
            wait = ptx.find("griddepcontrol.wait")
            mem = [i for i in (ptx.find(op) for op in ("ld.global", "st.global", "atom.", "red.", "cp.async"))
                   if i >= 0]
            out.append({"name": d["name"], "cc": cc, "int_to_float": "sitofp" in ttgir or "uitofp" in ttgir,
                        "ftz": ".ftz" in ptx,  # fp32 subnormals flushed to zero somewhere
                        "waits": wait >= 0, "waits_first": wait >= 0 and all(wait < i for i in mem),
                        "launches_dependents": "griddepcontrol.launch_dependents" in ptx})
        except Exception as e:  # the chain: the compiler's own message is in a cause
            chain, err = [], e
            while err is not None:
                chain.append(f"{type(err).__name__}: {str(err).splitlines()[-1] if str(err) else ''}")
                err = err.__cause__
            out.append({"name": d["name"], "cc": cc, "error": " <- ".join(chain)})
print(json.dumps(out))
"""


class _Recorder:
    """Stands in for a `@triton.jit` kernel: `kernel[grid](...)` records the call, runs nothing."""

    def __init__(self, fn, calls: list):
        self.fn, self.calls = fn, calls

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.calls.append(_describe(self.fn, args, kwargs))
        return launch


def _describe(kernel, args, kwargs) -> dict:
    """One launch as the compiler process reads it: the kernel's file and name, its signature,
    constexpr values, aligned arguments and options."""
    fn = getattr(kernel, "fn", kernel)  # the interpreter's wrapper, or the function
    options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages", "enable_fp_fusion", "launch_pdl") if k in kwargs}
    params = list(inspect.signature(fn).parameters.values())
    bound = dict(zip([p.name for p in params], args), **kwargs)
    signature, constants, aligned = {}, {}, []
    for i, p in enumerate(params):
        v = bound[p.name]
        if "constexpr" in str(p.annotation):
            signature[p.name], constants[p.name] = "constexpr", v
        elif isinstance(v, torch.Tensor):
            signature[p.name] = _POINTER_TYPES[v.dtype]
            aligned.append(i)
        elif isinstance(v, int) and not isinstance(v, bool):
            signature[p.name] = "i32"
            if v % 16 == 0:
                aligned.append(i)
        elif isinstance(v, float):
            signature[p.name] = "fp32"
        else:
            raise AssertionError(f"{fn.__name__}: argument {p.name}={v!r} is not a tensor, an int or a float")
    hopper_only = "*fp8e4nv" in signature.values() or constants.get("USE_PDL")  # FP8 operands, grid dependency control
    return {"file": fn.__code__.co_filename, "name": fn.__name__, "signature": signature, "constants": constants,
            "aligned": aligned, "options": options, "targets": [90] if hopper_only else [80, 90]}


@pytest.fixture
def recorded(monkeypatch):
    """The launches made inside the test, recorded and not run, with a GPU's launch configs and
    operand types (bf16 dots, not the interpreter's fp32)."""
    calls: list = []
    for module in _MODULES:
        monkeypatch.setattr(module, "gpu_launch", lambda device: True, raising=False)
        monkeypatch.setattr(module, "dot_in_fp32", lambda dtype: dtype == torch.float32, raising=False)
        for name, value in list(vars(module).items()):
            if name.startswith("_") and name.endswith("_kernel") and hasattr(value, "fn"):
                monkeypatch.setattr(module, name, _Recorder(value, calls))
    return calls


def _compile_all(calls: list[dict]) -> list[dict]:
    """Every distinct launch compiled for sm_80 and sm_90 → one result per (launch, target)."""
    distinct = list({json.dumps(c, sort_keys=True): c for c in calls}.values())
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", _COMPILER], input=json.dumps(distinct), capture_output=True,
                       text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.splitlines()[-1])


def _compiled(calls: list[dict]) -> list[dict]:
    """`_compile_all`, every launch compiled without an error."""
    results = _compile_all(calls)
    assert [r for r in results if "error" in r] == []
    return results


def _int_to_float_in_weight_kernels(results: list[dict]) -> list[dict]:
    """The compiled launches that convert an integer to a float, less the split-K finish (which
    sums float partials)."""
    return [r for r in results if r["name"] != "_finish_split_k_kernel" and r["int_to_float"]]


K, N, G = 512, 96, 128


@pytest.mark.parametrize("dtype,zero", [(torch.float16, False), (torch.bfloat16, True)])
def test_w4a16_gpu_launches_compile(recorded, dtype, zero):
    """Decode and verification rows (1, 16), the swapped tiles (32) and large M (300), with and
    without integer zero points, over the standard and the quartered layout, and the dequantize
    kernel: they compile for sm_80 and sm_90, and no weight code becomes a float by an
    int-to-float conversion."""
    gen = torch.Generator().manual_seed(0)
    wp = pack_int4(torch.randint(-8, 8, (N, K), dtype=torch.int8, generator=gen))
    s = torch.rand(N, K // G, generator=gen).to(dtype)
    z = torch.randint(-8, 8, (N, K // G), dtype=torch.int8, generator=gen) if zero else None
    for M in (1, 16, 32, 300):
        w4a16.w4a16_linear(torch.randn(M, K, generator=gen).to(dtype), wp, s, G, z)
        w4a16.w4a16_linear(torch.randn(M, K, generator=gen).to(dtype), w4a16.quarter_int4(wp, K), s, G, z,
                           quartered=True)
    # K = 640: five tiles in two splits, one of them past K, so the loads keep their k masks
    w4a16.w4a16_linear(torch.randn(1, 640, generator=gen).to(dtype),
                       pack_int4(torch.randint(-8, 8, (N, 640), dtype=torch.int8, generator=gen)),
                       s[:, :1].repeat(1, 5), G, None if z is None else z[:, :1].repeat(1, 5))
    w4a16.w4a16_dequantize(wp, s, G, K, z, dtype)
    w4a16.w4a16_dequantize(w4a16.quarter_int4(wp, K), s, G, K, z, dtype, quartered=True)
    for block in ((8, 512, 4), (16, 1024, 8)):  # tiles across groups, as the sweep times them
        w4a16.w4a16_dequantize(wp, s, G, K, z, dtype, block=block)
        w4a16.w4a16_dequantize(w4a16.quarter_int4(wp, K), s, G, K, z, dtype, quartered=True, block=block)
    assert {c["name"] for c in recorded} == {"_w4a16_kernel", "_finish_split_k_kernel", "_w4_dequant_kernel"}
    finishes = {(c["constants"]["BLOCK_M"], c["constants"]["FINISH"]) for c in recorded
                if c["name"] == "_w4a16_kernel" and c["constants"]["SPLIT_K"] > 1}
    assert {(16, True), (32, False)} <= finishes  # the tiles' last splits sum in the small-M launch only
    assert not any(c["constants"].get("DOT_FP32") for c in recorded)
    assert {c["constants"]["EVEN_K"] for c in recorded if c["name"] == "_w4a16_kernel"} == {True, False}
    quartered = [c["constants"] for c in recorded if c["name"] == "_w4a16_kernel" and c["constants"]["QUARTERED"]]
    assert {(c["SWAP_AB"], c["NIBBLE_DOTS"]) for c in quartered} == {(False, True), (True, True)}
    dequant = [c["constants"] for c in recorded if c["name"] == "_w4_dequant_kernel"]
    assert {(c["BLOCK_N"], c["BLOCK_K"]) for c in dequant} == {(32, 128), (8, 512), (16, 1024)}
    assert {c["QUARTERED"] for c in dequant} == {False, True}
    assert {c["GROUP_ALIGNED"] for c in dequant} == {False, True} and all(c["WORD_GROUPS"] for c in dequant)
    results = _compiled(recorded)
    assert len(results) >= 2 * 8
    assert _int_to_float_in_weight_kernels(results) == []


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_w8a16_gpu_launches_compile(recorded, dtype):
    gen = torch.Generator().manual_seed(1)
    q = torch.randint(-127, 128, (N, K), dtype=torch.int8, generator=gen)
    s = torch.rand(N, generator=gen).to(dtype)
    for M in (1, 16, 32, 300):
        w8a16.w8a16_linear(torch.randn(M, K, generator=gen).to(dtype), q, s)
    w8a16.w8a16_dequantize(q, s.float(), dtype)
    results = _compiled(recorded)
    assert len(results) >= 2 * 4
    assert _int_to_float_in_weight_kernels(results) == []


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_w8a8_and_fp8_gpu_launches_compile(recorded, dtype, monkeypatch):
    """Activation quantizers (static and dynamic int8, static fp8) and the int8 / FP8 GEMMs at
    decode (split-K, finished by the tiles' last splits, and without counters by a launch of
    its own), tile and large M."""
    gen = torch.Generator().manual_seed(2)
    q = torch.randint(-127, 128, (N, K), dtype=torch.int8, generator=gen)
    w_fp8 = (torch.randn(N, K, generator=gen) * 20).clamp(-448, 448).to(torch.float8_e4m3fn)
    ws, xs = torch.rand(N, generator=gen) + 0.01, torch.tensor([0.02])
    for M in (1, 32, 2048):
        x = torch.randn(M, K, generator=gen).to(dtype)
        w8a8.w8a8_linear(x, q, ws, xs)
        w8a8.w8a8_linear(x, q, ws, None)
        fp8.fp8_linear(x, w_fp8, ws, xs)
    x = torch.randn(1, 4 * K, generator=gen).to(dtype)  # deep enough to split K
    w8a8.w8a8_linear(x, q.repeat(1, 4), ws, None)
    fp8.fp8_linear(x, w_fp8.view(torch.uint8).repeat(1, 4).view(torch.float8_e4m3fn), ws, xs)
    monkeypatch.setattr(_common, "split_k_counters", lambda device, tiles: None)
    w8a8.w8a8_linear(x, q.repeat(1, 4), ws, None)
    fp8.fp8_linear(x, w_fp8.view(torch.uint8).repeat(1, 4).view(torch.float8_e4m3fn), ws, xs)
    names = {c["name"] for c in recorded}
    assert names == {"_quantize_act_int8_kernel", "_int8_gemm_kernel", "_quantize_act_fp8_kernel", "_fp8_gemm_kernel",
                     "_finish_scaled_split_k_kernel"}
    assert all(not c["constants"]["UPCAST"] for c in recorded if c["name"] == "_fp8_gemm_kernel")
    gemms = [c for c in recorded if c["name"] in ("_int8_gemm_kernel", "_fp8_gemm_kernel")]
    assert {c["constants"]["SPLIT_K"] > 1 for c in gemms} == {True, False}
    assert {c["constants"]["FINISH"] for c in gemms if c["constants"]["SPLIT_K"] > 1} == {True, False}
    results = _compiled(recorded)
    assert {r["cc"] for r in results if r["name"] == "_fp8_gemm_kernel"} == {90}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fp8_block_gpu_launches_compile(recorded, dtype):
    """The per-group FP8 activation quantizer and the block-scaled FP8 GEMM at decode, tile and
    large M, for 128 × 128 and 64 × 64 blocks (a partial block row: N = 200)."""
    gen = torch.Generator().manual_seed(5)
    N, K = 200, 512
    w_fp8 = (torch.randn(N, K, generator=gen) * 20).clamp(-448, 448).to(torch.float8_e4m3fn)
    for side in (128, 64):
        ws = torch.rand(-(-N // side), K // side, generator=gen) + 0.01
        for M in (1, 32, 2048):
            fp8_block.fp8_block_linear(torch.randn(M, K, generator=gen).to(dtype), w_fp8, ws, (side, side))
    assert {c["name"] for c in recorded} == {"_quantize_act_fp8_group_kernel", "_fp8_block_gemm_kernel"}
    assert all(not c["constants"]["UPCAST"] for c in recorded if c["name"] == "_fp8_block_gemm_kernel")
    results = _compiled(recorded)
    assert {r["cc"] for r in results} == {90}


def _nvfp4_weight(N: int, K: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(packed uint8 [N, K/2], local scales float8_e4m3fn [N, K/16], global scale fp32 [1]): any
    bytes are valid codes; the scales positive FP8 values."""
    packed = torch.randint(0, 256, (N, K // 2), dtype=torch.uint8, generator=gen)
    scale = (torch.rand(N, K // 16, generator=gen) * 400 + 0.01).to(torch.float8_e4m3fn)
    return packed, scale, torch.tensor([1000.0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_nvfp4_gpu_launches_compile(recorded, dtype, monkeypatch):
    """The NVFP4 linear, weight-only (fp32 x: fp32 dots) and W4A4 (fp16 dots), at decode
    (split-K finished by the tiles' last splits, and by a launch of its own), tile and large M,
    and the activation quantizer: the GEMM compiles for sm_80 and sm_90 (no fp8 instruction) and
    converts no weight code from an integer."""
    gen = torch.Generator().manual_seed(6)
    N, K = 200, 2048
    packed, scale, g = _nvfp4_weight(N, K, gen)
    bias = torch.randn(N, generator=gen).to(dtype)
    for M in (1, 32, 300):
        x = torch.randn(M, K, generator=gen).to(dtype)
        fp4.nvfp4_linear(x, packed, scale, g, bias)
        fp4.nvfp4_linear(x, packed, scale, g, None, torch.tensor([50.0]))
    fp4.quantize_act_nvfp4(torch.randn(3, K, generator=gen).to(dtype), torch.tensor([50.0]))
    monkeypatch.setattr(_common, "split_k_counters", lambda device, tiles: None)
    fp4.nvfp4_linear(torch.randn(1, K, generator=gen).to(dtype), packed, scale, g, bias)
    assert {c["name"] for c in recorded} == {"_nvfp4_linear_kernel", "_quantize_act_nvfp4_kernel",
                                             "_finish_split_k_kernel"}
    gemms = [c["constants"] for c in recorded if c["name"] == "_nvfp4_linear_kernel"]
    assert {c["W4A4"] for c in gemms} == {True, False}
    assert {c["DOT_FP32"] for c in gemms if not c["W4A4"]} == {dtype == torch.float32}
    assert not any(c["DOT_FP32"] for c in gemms if c["W4A4"])
    assert {c["SPLIT_K"] > 1 for c in gemms} == {True, False}
    assert {c["FINISH"] for c in gemms if c["SPLIT_K"] > 1} == {True, False}
    results = _compiled(recorded)
    assert {r["cc"] for r in results if r["name"] == "_nvfp4_linear_kernel"} == {80, 90}
    assert [r for r in results if r["name"] == "_nvfp4_linear_kernel" and r["int_to_float"]] == []


def _mxfp4_weight(N: int, K: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed uint8 [N, K/2], E8M0 exponents uint8 [N, K/32]): any bytes are valid codes, and
    any exponent byte a scale."""
    packed = torch.randint(0, 256, (N, K // 2), dtype=torch.uint8, generator=gen)
    return packed, torch.randint(0, 255, (N, K // 32), dtype=torch.uint8, generator=gen)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_mxfp4_gpu_launches_compile(recorded, dtype, monkeypatch):
    """The MXFP4 linear, weight-only (fp32 x: fp32 dots) and W4A4 (fp16 dots), at decode
    (split-K finished by the tiles' last splits, and by a launch of its own), tile and large M,
    and the activation quantizer: the GEMM compiles for sm_80 and sm_90 (no fp8 instruction);
    neither makes a weight code or scale by an int-to-float conversion, nor flushes a subnormal
    (the scale 2**-127 of exponent 0 is one)."""
    gen = torch.Generator().manual_seed(8)
    N, K = 200, 2048
    packed, scale = _mxfp4_weight(N, K, gen)
    bias = torch.randn(N, generator=gen).to(dtype)
    for M in (1, 32, 300):
        x = torch.randn(M, K, generator=gen).to(dtype)
        mxfp4.mxfp4_linear(x, packed, scale, bias)
        mxfp4.mxfp4_linear(x, packed, scale, quantize_input=True)
    mxfp4.quantize_act_mxfp4(torch.randn(3, K, generator=gen).to(dtype))
    monkeypatch.setattr(_common, "split_k_counters", lambda device, tiles: None)
    mxfp4.mxfp4_linear(torch.randn(1, K, generator=gen).to(dtype), packed, scale, bias)
    assert {c["name"] for c in recorded} == {"_mxfp4_linear_kernel", "_quantize_act_mxfp4_kernel",
                                             "_finish_split_k_kernel"}
    gemms = [c["constants"] for c in recorded if c["name"] == "_mxfp4_linear_kernel"]
    assert {c["W4A4"] for c in gemms} == {True, False}
    assert {c["DOT_FP32"] for c in gemms if not c["W4A4"]} == {dtype == torch.float32}
    assert not any(c["DOT_FP32"] for c in gemms if c["W4A4"])
    assert {c["SPLIT_K"] > 1 for c in gemms} == {True, False}
    assert {c["FINISH"] for c in gemms if c["SPLIT_K"] > 1} == {True, False}
    results = _compiled(recorded)
    mx = [r for r in results if r["name"] in ("_mxfp4_linear_kernel", "_quantize_act_mxfp4_kernel")]
    assert {r["cc"] for r in mx if r["name"] == "_mxfp4_linear_kernel"} == {80, 90}  # its codes: fp8 stores, sm_90
    assert [r for r in mx if r["int_to_float"] or r["ftz"]] == []


@pytest.mark.parametrize("q_dtype", [torch.float16, torch.bfloat16])
def test_kv_cache_gpu_launches_compile(recorded, q_dtype):
    """Quantize-on-write and paged attention over bf16, int8 and fp8 caches (decode,
    verification and prefill rows in one batch), its keys split across programs and not."""
    gen = torch.Generator().manual_seed(3)
    H, HKV, D, BS, NB = 8, 2, 64, 16, 8
    bt = torch.arange(NB, dtype=torch.int32).reshape(2, 4)
    cu = torch.tensor([0, 1, 5], dtype=torch.int32)
    seq = torch.tensor([30, 20], dtype=torch.int32)
    for cache in (torch.bfloat16, torch.int8, torch.float8_e4m3fn):
        kc = torch.zeros(NB, BS, HKV, D, dtype=cache)
        vc = torch.zeros_like(kc)
        ks = vs = None if cache == torch.bfloat16 else torch.rand(HKV, generator=gen) + 0.01
        k, v = torch.randn(5, HKV, D, generator=gen).to(q_dtype), torch.randn(5, HKV, D, generator=gen).to(q_dtype)
        kv_cache.write_kv_cache(k, v, kc, vc, torch.arange(5, dtype=torch.int64), ks, vs)
        for splits in (1, 4):  # keys split across programs (flash-decoding) or not
            kv_cache.paged_attention(torch.randn(5, H, D, generator=gen).to(q_dtype), kc, vc, cu, seq, bt, ks, vs,
                                     max_q_len=4, kv_chunk=64, kv_splits=splits)
    assert {c["name"] for c in recorded} == {"_write_kv_kernel", "_paged_attn_kernel"}
    assert {c["constants"]["SPLITS"] for c in recorded if c["name"] == "_paged_attn_kernel"} == {1, 4}
    assert not any(c["constants"].get("DOT_FP32") for c in recorded)
    _compiled(recorded)


@triton.jit
def _early_return(a, b, SWAP: tl.constexpr):
    if SWAP:
        return tl.dot(a, tl.trans(b))
    return tl.dot(b, tl.trans(a))


@triton.jit
def _early_return_kernel(a_ptr, b_ptr, o_ptr, SWAP: tl.constexpr):
    r16, r32 = tl.arange(0, 16), tl.arange(0, 32)
    a = tl.load(a_ptr + r32[:, None] * 16 + r16[None, :])  # [32, 16]
    b = tl.load(b_ptr + r16[:, None] * 16 + r16[None, :])  # [16, 16]
    tl.store(o_ptr + r32[:, None] * 16 + r16[None, :], _early_return(a, b, SWAP))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_fused_small_op_launches_compile(recorded, dtype):
    """The fused residual add + RMSNorm (with and without a residual, an 8B model's width), the
    rotary embedding of q and k (launched without fused multiply-adds) and SiLU · up."""
    D, hd = 4096, 128
    fused.add_rms_norm(torch.randn(2, D).to(dtype), None, torch.ones(D, dtype=dtype), 1e-5)
    fused.add_rms_norm(torch.randn(2, D).to(dtype), torch.randn(2, D).to(dtype), torch.ones(D, dtype=dtype), 1e-5)
    fused.rope_qk_(torch.randn(2, 6, hd).to(dtype), 5, torch.randn(2, hd).to(dtype), torch.randn(2, hd).to(dtype))
    fused.silu_mul(torch.randn(2, 2 * 14336).to(dtype))
    assert {c["name"] for c in recorded} == {"_add_rms_norm_kernel", "_rope_kernel", "_silu_mul_kernel"}
    assert [c["options"].get("enable_fp_fusion") for c in recorded if c["name"] == "_rope_kernel"] == [False]
    assert len(_compiled(recorded)) == 2 * 4


def _every_kernel(dtype: torch.dtype, monkeypatch) -> None:
    """One GPU launch of each of quantspec's Triton kernels (recorded by the `recorded` fixture):
    the GEMMs at decode M (split-K finished in the launch, and by a launch of its own; FP8 with
    block scales; NVFP4 and MXFP4 W4A4), the dequantize kernels, the activation quantizers, the
    paged cache's write and attention, the fused small ops."""
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(1, K, generator=gen).to(dtype)
    wp = pack_int4(torch.randint(-8, 8, (N, K), dtype=torch.int8, generator=gen))
    s4 = torch.rand(N, K // G, generator=gen).to(dtype)
    q = torch.randint(-127, 128, (N, K), dtype=torch.int8, generator=gen)
    ws, xs = torch.rand(N, generator=gen) + 0.01, torch.tensor([0.02])
    w_fp8 = (torch.randn(N, K, generator=gen) * 20).clamp(-448, 448).to(torch.float8_e4m3fn)
    w4a16.w4a16_linear(x, wp, s4, G)
    w4a16.w4a16_dequantize(wp, s4, G, K, None, dtype)
    w8a16.w8a16_linear(x, q, ws.to(dtype))
    w8a16.w8a16_dequantize(q, ws, dtype)
    w8a8.w8a8_linear(x, q, ws, xs)
    fp8.fp8_linear(x, w_fp8, ws, xs)
    fp8_block.fp8_block_linear(x, w_fp8, torch.rand(-(-N // 64), K // 64, generator=gen) + 0.01, (64, 64))
    packed, scale, g = _nvfp4_weight(N, K, gen)
    fp4.nvfp4_linear(x, packed, scale, g, None, torch.tensor([50.0]))
    fp4.quantize_act_nvfp4(x, torch.tensor([50.0]))
    mx_packed, mx_scale = _mxfp4_weight(N, K, gen)
    mxfp4.mxfp4_linear(x, mx_packed, mx_scale, quantize_input=True)
    mxfp4.quantize_act_mxfp4(x)
    monkeypatch.setattr(_common, "split_k_counters", lambda device, tiles: None)
    w4a16.w4a16_linear(x, wp, s4, G)
    w8a8.w8a8_linear(torch.randn(1, 4 * K, generator=gen).to(dtype), q.repeat(1, 4), ws, xs)  # deep: split K
    kc = torch.zeros(4, 16, 2, 64, dtype=dtype)
    kv = torch.randn(3, 2, 64, generator=gen).to(dtype)
    kv_cache.write_kv_cache(kv, kv, kc, kc.clone(), torch.arange(3, dtype=torch.int64))
    kv_cache.paged_attention(torch.randn(3, 8, 64, generator=gen).to(dtype), kc, kc.clone(),
                             torch.tensor([0, 3], dtype=torch.int32), torch.tensor([20], dtype=torch.int32),
                             torch.arange(4, dtype=torch.int32).reshape(1, 4), max_q_len=3)
    fused.add_rms_norm(torch.randn(2, 256).to(dtype), torch.randn(2, 256).to(dtype), torch.ones(256, dtype=dtype), 1e-5)
    fused.rope_qk_(torch.randn(2, 6, 64).to(dtype), 5, torch.randn(2, 64).to(dtype), torch.randn(2, 64).to(dtype))
    fused.silu_mul(torch.randn(2, 512).to(dtype))


def test_programmatic_launches_wait_before_they_touch_memory(recorded, monkeypatch):
    """Inside `programmatic_launches` on a Hopper GPU every kernel is a programmatic dependent
    launch whose sm_90 code waits for the kernel before it (griddepcontrol.wait) before its first
    global load, store or atomic, and lets the next one launch; outside, none is, and their code
    has no grid dependency control."""
    monkeypatch.setattr(_common, "_capability", lambda device: (9, 0))
    with _common.programmatic_launches():
        _every_kernel(torch.bfloat16, monkeypatch)
    names = {c["name"] for c in recorded}
    defined = {n for m in _MODULES for n, v in vars(m).items() if isinstance(v, _Recorder)}
    assert names == defined, defined - names  # every kernel quantspec has
    assert all(c["constants"]["USE_PDL"] and c["options"].get("launch_pdl") for c in recorded)
    results = _compiled(recorded)
    assert {r["cc"] for r in results} == {90}
    assert [r["name"] for r in results if not (r["waits_first"] and r["launches_dependents"])] == []
    recorded.clear()
    _every_kernel(torch.bfloat16, monkeypatch)  # outside the context
    assert not any(c["constants"]["USE_PDL"] or "launch_pdl" in c["options"] for c in recorded)
    assert not any(r["waits"] or r["launches_dependents"] for r in _compiled(recorded) if r["cc"] == 90)


def test_pdl_launch_needs_the_context_a_gpu_and_hopper(monkeypatch):
    """`pdl_launch`: inside `programmatic_launches` (this thread only, reset on exit), on a
    GPU, of compute capability 9.0 or more."""
    import threading

    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    monkeypatch.setattr(_common, "_capability", lambda device: (9, 0))
    assert not _common.pdl_launch(cuda)
    with _common.programmatic_launches():
        assert _common.pdl_launch(cuda) and not _common.pdl_launch(cpu)
        seen = []
        t = threading.Thread(target=lambda: seen.append(_common.pdl_launch(cuda)))
        t.start()
        t.join()
        assert seen == [False]
        with _common.programmatic_launches(False):
            assert not _common.pdl_launch(cuda)
        assert _common.pdl_launch(cuda)
        monkeypatch.setattr(_common, "_capability", lambda device: (8, 9))
        assert not _common.pdl_launch(cuda)
    monkeypatch.setattr(_common, "_capability", lambda device: (9, 0))
    assert not _common.pdl_launch(cuda)


def test_the_compiler_sees_what_the_interpreter_does_not():
    """A kernel the interpreter runs (it never enters the statement after the return) fails to
    compile: the checks above can fail."""
    a, b, o = torch.randn(32, 16), torch.randn(16, 16), torch.empty(32, 16)
    if _common.can_launch("cpu"):
        _early_return_kernel[(1,)](a, b, o, SWAP=True)
        torch.testing.assert_close(o, a @ b.t())
    results = _compile_all([_describe(_early_return_kernel, (a, b, o), {"SWAP": True, "num_warps": 4})])
    assert len(results) == 2
    assert all("return types" in r.get("error", "") for r in results), results
