"""FP4's numbers that FP8 and int have no counterpart of: rounding to the E2M1 grid, NVFP4's
per-tensor global scale, MXFP4's power-of-two scales, and compressed-tensors' `nvfp4-pack-quantized`
/ `mxfp4-pack-quantized` byte layout (the same for both).

E2M1 holds ±{0, 0.5, 1, 1.5, 2, 3, 4, 6}. quantspec keeps E2M1 codes in float8_e4m3fn tensors
(every E2M1 value, -0.0 included, is an E4M3 value), so the FP8 code paths carry them unchanged.
An NVFP4 tensor's effective scale per group of 16 is `local / global`: `local` an FP8 E4M3 value
(stored as `weight_scale`), `global` one fp32 per tensor (`weight_global_scale`,
`input_global_scale`) = 448 · 6 / absmax, so the largest group's local scale lands on FP8's top
(compressed-tensors' `generate_gparam`). The rest of NVFP4's numbers — group min/max, local
scales, quantize, dequantize — are `quant.primitives`' with `global_scale=`.

An MXFP4 group of 32 has one power-of-two scale 2^(e - 127), stored as its E8M0 exponent byte e
(`weight_scale` uint8), and no global scale: e = 127 + floor(log2(absmax rounded to a power of
two)) - 2, the rounding up where absmax's mantissa is ≥ 1.75 (so the group's largest value maps
into E2M1's ±6), compressed-tensors' `generate_mx_scales`. MXFP8's groups (E4M3 values) take the
same rule with floor(log2(448)) = 8 in place of 2 (`mx_emax`).
"""

from __future__ import annotations

import torch

from quantspec.errors import QuantSpecError

__all__ = ["E2M1_MAX", "E2M1_VALUES", "check_groups_tile", "global_scale_from_absmax", "local_scales", "mx_emax", "mx_exponents", "mx_exponents_of", "mx_scales",
           "e2m1_codes", "e2m1_nibbles", "mx_values", "pack_fp4", "round_to_e2m1", "unpack_fp4"]

E2M1_MAX = 6.0
# the eight magnitudes in nibble order: code c (0..7) is E2M1_VALUES[c], bit 3 the sign
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_FP8_MAX = 448.0
# (lower bound, value, bound inclusive): |x| rounds to `value` from `lower bound` up — the midpoints
# of the grid, ties to the even mantissa (compressed-tensors' `cast_to_fp4`)
_BUCKETS = ((5.0, 6.0, False), (3.5, 4.0, True), (2.5, 3.0, False), (1.75, 2.0, True),
            (1.25, 1.5, False), (0.75, 1.0, True), (0.25, 0.5, False))


def check_groups_tile(name: str, K: int, group_size: int, fmt: str) -> None:
    """Refuse, naming `--ignore`, a Linear `name` whose K the format's (`fmt`) groups do not tile."""
    if K % group_size:
        raise QuantSpecError(f"{name}: {fmt}'s groups of {group_size} do not tile K={K}; add --ignore {name}")


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


# (int view, mantissa bits, exponent bits) of the float dtypes MX scales are computed in
_BITS = {torch.float32: (torch.int32, 23, 8), torch.bfloat16: (torch.int16, 7, 8),
         torch.float16: (torch.int16, 10, 5), torch.float64: (torch.int64, 52, 11)}
_E2M1_MANTISSA = 1  # E2M1's mantissa bits: the power-of-two rounding of every MX type's scales
# floor(log2(the element type's largest value)): E2M1's 6, E4M3's 448, by bit width
_MX_EMAX = {4: 2, 8: 8}


def mx_emax(num_bits: int) -> int:
    """The exponent offset of an MX element type of `num_bits` (4: E2M1, 8: E4M3): floor(log2 of
    its largest value), which puts a group's absmax into the type's range."""
    return _MX_EMAX[num_bits]


def _round_to_power_of_two(x: torch.Tensor) -> torch.Tensor:
    """x ≥ 0 rounded to a power of two in its dtype: down, or up where its mantissa is ≥ 1.75
    (compressed-tensors' `round_to_power_2` for E2M1: add half of E2M1's last mantissa step in
    x's bits, keep sign and exponent)."""
    int_dtype, mant, expo = _BITS[x.dtype]
    bits = x.contiguous().view(int_dtype).to(torch.int64)
    keep = ((1 << (expo + 1)) - 1) << mant
    out = (bits + (1 << (mant - _E2M1_MANTISSA - 1))) & keep
    if int_dtype is torch.int16:
        out = torch.where(out >= 1 << 15, out - (1 << 16), out)  # back into int16's range
    return out.to(int_dtype).view(x.dtype)


def mx_exponents(absmax: torch.Tensor, emax: int = _MX_EMAX[4]) -> torch.Tensor:
    """The E8M0 exponents (uint8, bias 127) of groups with `absmax`, computed in absmax's dtype:
    127 + floor(log2(absmax rounded to a power of two)) - emax (`mx_emax`: 2 for MXFP4, 8 for
    MXFP8), clamped to [0, 255]."""
    e = 127 + torch.floor(torch.log2(_round_to_power_of_two(absmax))) - emax
    return torch.round(torch.clamp(e, 0, 255)).to(torch.uint8)


def mx_values(exponents: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The scales 2^(e - 127) of E8M0 exponents as `dtype` (compressed-tensors' decompression,
    exact for every e in bf16 and fp32)."""
    return (2.0 ** (exponents.to(torch.int32) - 127).to(torch.bfloat16)).to(dtype)


def mx_scales(absmax: torch.Tensor, emax: int = _MX_EMAX[4]) -> tuple[torch.Tensor, torch.Tensor]:
    """(scales, zero points) of MX groups with `absmax` (`emax`: `mx_emax` of the element type):
    the power-of-two values of `mx_exponents` in absmax's dtype, one that underflows it (fp16)
    replaced by 1 as compressed-tensors replaces it (uint8's eps); zero points float8_e4m3fn zeros
    (as NVFP4's)."""
    e = mx_exponents(absmax, emax)
    s = (2.0 ** (e.to(torch.int32) - 127).float()).to(absmax.dtype)
    s = torch.where(s == 0, torch.ones_like(s), s)
    return s, torch.zeros(s.shape, dtype=torch.float8_e4m3fn, device=s.device)


def mx_exponents_of(scales: torch.Tensor) -> torch.Tensor:
    """The E8M0 bytes that store power-of-two `scales` (127 + log2; a scale that underflowed to 0
    stores 2^-127)."""
    e = 127 + torch.floor(torch.log2(scales.float().clamp(min=2.0 ** -127)))
    return e.clamp(0, 255).to(torch.int32).to(torch.uint8)


def pack_fp4(q: torch.Tensor) -> torch.Tensor:
    """E2M1 codes q [N, K] (any float dtype holding grid values; K even) → uint8 [N, K/2]: nibble
    = index of |q| in `E2M1_VALUES` | sign << 3, column 2j in the low nibble and 2j + 1 in the high
    (compressed-tensors' `pack_fp4_to_uint8`)."""
    if q.ndim != 2 or q.shape[1] % 2:
        raise QuantSpecError(f"NVFP4 codes must be [N, K] with K even, got {tuple(q.shape)}")
    nib = e2m1_nibbles(q)
    return nib[:, 0::2] | (nib[:, 1::2] << 4)


def e2m1_nibbles(q: torch.Tensor) -> torch.Tensor:
    """E2M1 codes q (any float dtype holding grid values) → uint8 nibbles of q's shape: the index
    of |q| in `E2M1_VALUES` | sign << 3."""
    qf = q.float()
    mag = (qf.abs() * 2).to(torch.uint8)  # 0, 1, 2, 3, 4, 6, 8, 12
    idx = torch.searchsorted(torch.tensor([0, 1, 2, 3, 4, 6, 8, 12], dtype=torch.uint8, device=q.device),
                             mag.to(torch.int64)).to(torch.uint8)
    return idx | (torch.signbit(qf).to(torch.uint8) << 3)


def unpack_fp4(packed: torch.Tensor, K: int) -> torch.Tensor:
    """uint8 [N, K/2] → E2M1 codes [N, K] as float8_e4m3fn (the inverse of `pack_fp4`)."""
    if packed.dtype != torch.uint8 or packed.ndim != 2 or packed.shape[1] * 2 != K:
        raise QuantSpecError(f"NVFP4 weight_packed must be uint8 [N, {K // 2}], got {packed.dtype} "
                             f"{tuple(packed.shape)}; the checkpoint is corrupt")
    return e2m1_codes(torch.stack((packed & 0x0F, packed >> 4), dim=-1).reshape(packed.shape[0], K))


def e2m1_codes(nibbles: torch.Tensor) -> torch.Tensor:
    """Nibbles (uint8, `e2m1_nibbles`) → their E2M1 codes as float8_e4m3fn (the inverse)."""
    table = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=torch.float32,
                         device=nibbles.device)
    return table[nibbles.to(torch.int64)].to(torch.float8_e4m3fn)
