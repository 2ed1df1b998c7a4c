"""The numbers the torch references use, taken from `quantspec.quant` (the single source of truth).

The references in this package never re-derive a quantization formula: they call these thin
adapters, which only build the `QuantArgs` that `quant/primitives.py` and `quant/packing.py` need
for the kernels' fixed schemes (int4 group-wise weights, int8 per-channel weights, int8/fp8
activations and KV caches).
"""

from __future__ import annotations

import torch

from quantspec.quant.args import QuantArgs
from quantspec.quant.packing import pack_int4 as _pack_int4
from quantspec.quant.packing import unpack_int4 as _unpack_int4
from quantspec.quant.primitives import choose_qparams, dequantize as _dequantize, quantize

__all__ = [
    "dequantize",
    "dequantize_groupwise",
    "dynamic_token_scale_int8",
    "pack_int4",
    "quantize_fp8",
    "quantize_int8",
    "unpack_int4",
]

_INT8 = QuantArgs(num_bits=8)  # symmetric; scale broadcast against x
_FP8 = QuantArgs(num_bits=8, type="float")
_INT8_TOKEN = QuantArgs(num_bits=8, strategy="token", dynamic=True)


def unpack_int4(packed: torch.Tensor, K: int) -> torch.Tensor:
    """int32 [N, ceil(K/8)] compressed-tensors words -> int8 [N, K] in [-8, 7]."""
    return _unpack_int4(packed, (packed.shape[0], K))


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """int8 [N, K] in [-8, 7] -> int32 [N, ceil(K/8)] (compressed-tensors layout)."""
    return _pack_int4(q)


def dequantize_groupwise(
    q: torch.Tensor,  # [N, K] integer codes
    scale: torch.Tensor,  # [N, K/g] float
    zero: torch.Tensor | None,  # [N, K/g] integer or float (float zp_dtype), None if symmetric
    group_size: int,
) -> torch.Tensor:
    """(q - zero) * scale per group of `group_size` input columns, in fp32 -> [N, K] (integer codes, or
    FP8 E4M3 ones: weight_only_mxfp8's with its power-of-two scales)."""
    fp8 = q.dtype == torch.float8_e4m3fn
    args = QuantArgs(num_bits=8, type="float" if fp8 else "int", strategy="group", group_size=group_size,
                     symmetric=zero is None)
    return _dequantize(q, scale.float(), zero, args, dtype=torch.float32)


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Symmetric q * scale in fp32 (int8 or fp8 codes); `scale` broadcasts against q."""
    args = _FP8 if q.dtype == torch.float8_e4m3fn else _INT8
    return _dequantize(q, scale.float(), None, args, dtype=torch.float32)


def quantize_int8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """clamp(round(x / scale), -128, 127) as int8, in fp32; `scale` broadcasts against x."""
    return quantize(x.float(), scale.float(), None, _INT8)


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn(clamp(x / scale, ±448)), in fp32; `scale` broadcasts against x."""
    return quantize(x.float(), scale.float(), None, _FP8)


def dynamic_token_scale_int8(x: torch.Tensor) -> torch.Tensor:
    """Per-row symmetric int8 scale of x [M, K] in fp32 -> [M]: absmax / 127.5 (0 -> fp32 eps)."""
    scale, _ = choose_qparams(x.float(), _INT8_TOKEN)  # [M, 1]
    return scale.reshape(-1)
