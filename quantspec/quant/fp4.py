"""NVFP4's numbers that FP8 and int have no counterpart of: rounding to the E2M1 grid, the
per-tensor global scale, and compressed-tensors' `nvfp4-pack-quantized` byte layout.

E2M1 holds ±{0, 0.5, 1, 1.5, 2, 3, 4, 6}. quantspec keeps E2M1 codes in float8_e4m3fn tensors
(every E2M1 value, -0.0 included, is an E4M3 value), so the FP8 code paths carry them unchanged.
An NVFP4 tensor's effective scale per group of 16 is `local / global`: `local` an FP8 E4M3 value
(stored as `weight_scale`), `global` one fp32 per tensor (`weight_global_scale`,
`input_global_scale`) = 448 · 6 / absmax, so the largest group's local scale lands on FP8's top
(compressed-tensors' `generate_gparam`). The rest of NVFP4's numbers — group min/max, local
scales, quantize, dequantize — are `quant.primitives`' with `global_scale=`.
"""

from __future__ import annotations

import torch

from quantspec.errors import QuantSpecError

__all__ = ["E2M1_MAX", "E2M1_VALUES", "global_scale_from_absmax", "local_scales", "pack_fp4", "round_to_e2m1",
           "unpack_fp4"]

E2M1_MAX = 6.0
# the eight magnitudes in nibble order: code c (0..7) is E2M1_VALUES[c], bit 3 the sign
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_FP8_MAX = 448.0
# (lower bound, value, bound inclusive): |x| rounds to `value` from `lower bound` up — the midpoints
# of the grid, ties to the even mantissa (compressed-tensors' `cast_to_fp4`)
_BUCKETS = ((5.0, 6.0, False), (3.5, 4.0, True), (2.5, 3.0, False), (1.75, 2.0, True),
            (1.25, 1.5, False), (0.75, 1.0, True), (0.25, 0.5, False))


def round_to_e2m1(x: torch.Tensor) -> torch.Tensor:
    """x (already clamped to ±6) rounded to the nearest E2M1 value, ties to even, in x's dtype;
    a negative x that rounds to zero gives -0.0 (the sign survives into the packed nibble, as
    compressed-tensors packs it)."""
    a = x.abs()
    out = torch.zeros_like(a)
    done = torch.zeros(a.shape, dtype=torch.bool, device=a.device)
    for lo, value, inclusive in _BUCKETS:
        hit = (a >= lo if inclusive else a > lo) & ~done
        out.masked_fill_(hit, value)
        done |= hit
    return out * torch.sign(x)


def global_scale_from_absmax(absmax: torch.Tensor) -> torch.Tensor:
    """fp32 [1]: 448 · 6 / absmax, computed in absmax's dtype (absmax clamped to its tiny; NaN /
    Inf → 1.0, no global scaling), compressed-tensors' `generate_gparam` for NVFP4."""
    a = absmax.detach().abs().amax()
    a = torch.clamp(a, min=torch.finfo(a.dtype).tiny)
    g = torch.nan_to_num(_FP8_MAX * E2M1_MAX / a, nan=1.0, posinf=1.0, neginf=1.0)
    return g.float().reshape(1)


def local_scales(absmax: torch.Tensor, global_scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(local scales, zero points) of groups with `absmax` under `global_scale`: FP8 E4M3 values of
    global · absmax / 6 (the division in absmax's dtype, as compressed-tensors' `calculate_qparams`),
    a 0 replaced by FP8's eps 0.125; in the product's dtype (fp32 for a fp32 global)."""
    if global_scale is None:
        raise QuantSpecError("NVFP4 qparams need the tensor's global scale (quant.fp4.global_scale_from_absmax)")
    s = (absmax / E2M1_MAX) * global_scale.to(absmax.device)
    s = s.clamp(-_FP8_MAX, _FP8_MAX).to(torch.float8_e4m3fn).to(s.dtype)
    s = torch.where(s == 0, torch.full_like(s, 0.125), s)
    return s, torch.zeros(s.shape, dtype=torch.float8_e4m3fn, device=s.device)


def pack_fp4(q: torch.Tensor) -> torch.Tensor:
    """E2M1 codes q [N, K] (any float dtype holding grid values; K even) → uint8 [N, K/2]: nibble
    = index of |q| in `E2M1_VALUES` | sign << 3, column 2j in the low nibble and 2j + 1 in the high
    (compressed-tensors' `pack_fp4_to_uint8`)."""
    if q.ndim != 2 or q.shape[1] % 2:
        raise QuantSpecError(f"NVFP4 codes must be [N, K] with K even, got {tuple(q.shape)}")
    qf = q.float()
    mag = (qf.abs() * 2).to(torch.uint8)  # 0, 1, 2, 3, 4, 6, 8, 12
    idx = torch.searchsorted(torch.tensor([0, 1, 2, 3, 4, 6, 8, 12], dtype=torch.uint8, device=q.device),
                             mag.to(torch.int64)).to(torch.uint8)
    nib = idx | (torch.signbit(qf).to(torch.uint8) << 3)
    return nib[:, 0::2] | (nib[:, 1::2] << 4)


def unpack_fp4(packed: torch.Tensor, K: int) -> torch.Tensor:
    """uint8 [N, K/2] → E2M1 codes [N, K] as float8_e4m3fn (the inverse of `pack_fp4`)."""
    if packed.dtype != torch.uint8 or packed.ndim != 2 or packed.shape[1] * 2 != K:
        raise QuantSpecError(f"NVFP4 weight_packed must be uint8 [N, {K // 2}], got {packed.dtype} "
                             f"{tuple(packed.shape)}; the checkpoint is corrupt")
    table = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=torch.float32,
                         device=packed.device)
    nib = torch.stack((packed & 0x0F, packed >> 4), dim=-1).reshape(packed.shape[0], K)
    return table[nib.to(torch.int64)].to(torch.float8_e4m3fn)
