"""`triton_usable` and the shared `tl` rounding and conversion helpers vs torch."""

import pytest
import torch
import triton
import triton.language as tl

from quantspec.kernels import triton_usable
from quantspec.errors import QuantSpecError
from quantspec import kernels
from quantspec.kernels._common import can_launch, round_half_even, small_ints_to_float


def test_triton_usable_and_can_launch(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert can_launch("cpu") and not triton_usable("cpu")  # dispatch never picks the interpreter
    assert triton_usable("cuda") == torch.cuda.is_available()
    assert not triton_usable("meta") and not can_launch("meta")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not can_launch("cpu")
    with pytest.raises(QuantSpecError, match="cannot run on cpu"):  # the package's function: on the
        # CPU tensors it is given, also on a CUDA machine (where conftest moves this module's calls there)
        kernels.w8a16_linear(torch.randn(2, 8), torch.zeros(4, 8, dtype=torch.int8), torch.ones(4))


@triton.jit
def _rne_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n)
    tl.store(y_ptr + offs, round_half_even(x), mask=offs < n)


@pytest.mark.skipif(not can_launch("cpu") and not torch.cuda.is_available(), reason="no triton")
def test_round_half_even_matches_torch_round():
    x = torch.tensor([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5, -127.5, 3.49999, -3.50001, 0.0, 7.0])
    if not can_launch("cpu"):
        x = x.cuda()
    y = torch.empty_like(x)
    _rne_kernel[(1,)](x, y, x.numel(), BLOCK=16)
    assert torch.equal(y, torch.round(x))


@triton.jit
def _small_ints_kernel(v_ptr, y_ptr, OFFSET: tl.constexpr, DTYPE: tl.constexpr, BELOW_128: tl.constexpr,
                       BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(y_ptr + offs, small_ints_to_float(tl.load(v_ptr + offs), OFFSET, DTYPE, BELOW_128))


@pytest.mark.skipif(not can_launch("cpu") and not torch.cuda.is_available(), reason="no triton")
@pytest.mark.parametrize("dtype,tl_dtype", [(torch.float16, tl.float16), (torch.bfloat16, tl.bfloat16),
                                            (torch.float32, tl.float32)])
@pytest.mark.parametrize("offset", [8, 72, 128])
@pytest.mark.parametrize("below_128", [False, True])
def test_small_ints_to_float_is_exact(dtype, tl_dtype, offset, below_128):
    """Every v in [0, 1024) (with BELOW_128: [0, 128)) becomes v - offset exactly (bf16: where that
    is representable, |v - offset| < 256, which covers every int4 and int8 code) — torch's own
    int-to-float cast as the reference. On a GPU, bf16 with BELOW_128 takes bf16's own mantissa;
    the interpreter, which cannot reinterpret int16 bits as bf16, takes the fp32 route."""
    n = 128 if below_128 else 1024
    v = torch.arange(n, dtype=torch.int32)
    if not can_launch("cpu"):
        v = v.cuda()
    y = torch.empty(n, dtype=dtype, device=v.device)
    _small_ints_kernel[(1,)](v, y, OFFSET=offset, DTYPE=tl_dtype, BELOW_128=below_128, BLOCK=n)
    ref = (v - offset).to(dtype)
    keep = (v - offset).abs() < (256 if dtype == torch.bfloat16 else 2048)
    assert torch.equal(y[keep], ref[keep])


@pytest.mark.parametrize("offset", [8, 72])
def test_bf16_mantissa_of_128_holds_every_small_int(offset):
    """The bit pattern the GPU's bf16 path builds: 0x4300 + v is bf16 128 + v for every v in
    [0, 128), so subtracting 128 + offset leaves v - offset exactly."""
    v = torch.arange(128, dtype=torch.int32)
    y = (v + 0x4300).to(torch.int16).view(torch.bfloat16) - (128.0 + offset)
    assert torch.equal(y, (v - offset).to(torch.bfloat16))
