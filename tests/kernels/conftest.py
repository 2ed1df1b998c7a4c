"""Kernel tests run Triton through its CPU interpreter.

TRITON_INTERPRET is read when triton is first imported, so it is set here, at collection of this
directory. Only the kernels (and these tests) import triton on CPU, so setting it for the whole
process does not change other test directories. A machine with CUDA keeps the real compiler
(unless the variable is already set) so the GPU-only tests there exercise real kernels.
"""

import os
import sys

import pytest
import torch

if not torch.cuda.is_available():
    if "triton" in sys.modules and "TRITON_INTERPRET" not in os.environ:
        # every kernel test would fail with "Cannot call @triton.jit'd outside of the scope of a kernel"
        raise pytest.UsageError("triton was imported before tests/kernels could set TRITON_INTERPRET=1: a test "
                                "module collected earlier imports it (transformers' modeling modules do); import "
                                "those inside the tests")
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def same_rounding():
    """assert(y, ref): bitwise, except that the CPU interpreter casts fp32 to bf16 by truncation
    (a GPU rounds to nearest even, as torch does): there, at most one bf16 ulp apart."""
    def check(y: torch.Tensor, ref: torch.Tensor) -> None:
        if y.dtype == torch.bfloat16 and not torch.cuda.is_available():
            torch.testing.assert_close(y.float(), ref.float(), rtol=2 ** -7, atol=0)
        else:
            assert torch.equal(y, ref)
    return check


# the kernel entry points the test modules import by name
_KERNELS = ("w4a16_linear", "w8a16_linear", "w8a8_linear", "int8_gemm", "quantize_act_int8", "fp8_gemm",
            "fp8_linear", "quantize_act_fp8", "paged_attention", "write_kv_cache", "w4a16_dequantize",
            "w8a16_dequantize", "add_rms_norm", "rope_qk_", "silu_mul", "fp8_block_gemm", "fp8_block_linear",
            "quantize_act_fp8_group", "nvfp4_linear", "quantize_act_nvfp4")


def _on_cuda(fn):
    """`fn` run on the GPU: CPU tensor arguments moved there, results moved back, and every moved
    argument copied back (the in-place writes of `write_kv_cache`)."""
    def call(*args, **kwargs):
        moved = []

        def to_gpu(a):
            if isinstance(a, torch.Tensor) and a.device.type == "cpu":
                moved.append((a, a.cuda()))
                return moved[-1][1]
            return a
        out = fn(*[to_gpu(a) for a in args], **{k: to_gpu(v) for k, v in kwargs.items()})
        for cpu_t, gpu_t in moved:
            cpu_t.copy_(gpu_t.cpu())
        if isinstance(out, tuple):
            return tuple(o.cpu() if isinstance(o, torch.Tensor) else o for o in out)
        return out.cpu() if isinstance(out, torch.Tensor) else out
    return call


@pytest.fixture(autouse=True)
def _kernels_on_the_gpu(request, monkeypatch):
    """On a CUDA machine the tests that build CPU tensors run their kernel calls on the GPU with
    the real compiler (the interpreter is for machines without one); `gpu`-marked tests place
    their tensors themselves."""
    if not torch.cuda.is_available() or request.node.get_closest_marker("gpu") is not None:
        return
    for name in _KERNELS:
        fn = getattr(request.module, name, None)
        if callable(fn):
            monkeypatch.setattr(request.module, name, _on_cuda(fn))
