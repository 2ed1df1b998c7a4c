"""int4 codes ↔ int32 words, bit-exact with compressed-tensors' `pack_to_int32` (num_bits=4).

Layout ("pack-quantized"): codes q ∈ [-8, 7] are offset to u = q + 8 ∈ [0, 15]; along the packed
dim, element i goes to word i // 8 at bits 4·(i % 8) … 4·(i % 8) + 3 (the first element in the
lowest nibble). A trailing partial word is zero-padded (u = 0). Weights pack along K
(packed_dim=1: [N, K] → [N, ceil(K/8)]); asymmetric zero points [N, K/g] pack along N
(packed_dim=0: → [ceil(N/8), K/g]), as compressed-tensors stores `weight_zero_point`.

Example: q = [[-8, -7, 0, 7, 0, 0, 0, 0]] → u = [0, 1, 8, 15, 8, 8, 8, 8]
→ word = 0x8888F810 → as int32: -2004289520.
"""

from __future__ import annotations

import math

import torch

from quantspec.errors import QuantSpecError

__all__ = ["INT4_OFFSET", "INT4_PER_INT32", "pack_int4", "unpack_int4"]

INT4_OFFSET = 8  # signed int4 code + 8 = the unsigned nibble stored
INT4_PER_INT32 = 8
_SHIFTS = torch.arange(INT4_PER_INT32, dtype=torch.int64) * 4  # [8]


def pack_int4(q: torch.Tensor, packed_dim: int = 1) -> torch.Tensor:
    """Pack int8 codes q [N, K] in [-8, 7] into int32 [N, ceil(K/8)] (packed_dim=1) or
    [ceil(N/8), K] (packed_dim=0)."""
    if not isinstance(q, torch.Tensor) or q.dtype != torch.int8:
        raise QuantSpecError(f"pack_int4 needs int8 codes, got {getattr(q, 'dtype', type(q))}")
    if q.ndim != 2:
        raise QuantSpecError(f"pack_int4 needs a 2-D tensor [N, K], got shape {tuple(q.shape)}")
    if packed_dim not in (0, 1):
        raise QuantSpecError(f"packed_dim must be 0 or 1, got {packed_dim}")
    if q.numel() and (int(q.min()) < -8 or int(q.max()) > 7):
        raise QuantSpecError(f"int4 codes must lie in [-8, 7], got [{int(q.min())}, "
                             f"{int(q.max())}]; quantize with num_bits=4 first")
    u = q.to(torch.int64) + INT4_OFFSET
    if packed_dim == 0:
        u = u.t()
    rows, cols = u.shape
    words = math.ceil(cols / INT4_PER_INT32)
    pad = words * INT4_PER_INT32 - cols
    if pad:
        u = torch.nn.functional.pad(u, (0, pad))  # pads with nibble 0, like compressed-tensors
    u = u.reshape(rows, words, INT4_PER_INT32)  # [rows, words, 8]
    packed = (u << _SHIFTS.to(u.device)).sum(dim=-1)  # [rows, words], in [0, 2^32)
    packed = torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)
    if packed_dim == 0:
        packed = packed.t()
    return packed.contiguous()


def unpack_int4(packed: torch.Tensor, shape: tuple[int, int] | torch.Size | None = None,
                packed_dim: int = 1) -> torch.Tensor:
    """Inverse of `pack_int4`: int32 words → int8 codes in [-8, 7] of the original `shape`
    (default: every nibble, i.e. 8 × the packed dim)."""
    if not isinstance(packed, torch.Tensor) or packed.dtype != torch.int32:
        raise QuantSpecError(f"unpack_int4 needs int32 words, got "
                             f"{getattr(packed, 'dtype', type(packed))}")
    if packed.ndim != 2:
        raise QuantSpecError(f"unpack_int4 needs a 2-D tensor, got shape {tuple(packed.shape)}")
    if packed_dim not in (0, 1):
        raise QuantSpecError(f"packed_dim must be 0 or 1, got {packed_dim}")
    p = packed.t() if packed_dim == 0 else packed
    rows, words = p.shape
    cols = words * INT4_PER_INT32
    if shape is not None:
        shape = tuple(int(s) for s in shape)
        if len(shape) != 2:
            raise QuantSpecError(f"shape must be 2-D, got {shape}")
        want_rows, cols_req = (shape[1], shape[0]) if packed_dim == 0 else shape
        if want_rows != rows or not cols - INT4_PER_INT32 < cols_req <= cols:
            raise QuantSpecError(f"packed tensor {tuple(packed.shape)} cannot hold shape {shape} "
                                 f"(packed_dim={packed_dim})")
        cols = cols_req
    u = (p.to(torch.int64).unsqueeze(-1) >> _SHIFTS.to(p.device)) & 0xF  # [rows, words, 8]
    q = (u.reshape(rows, -1)[:, :cols] - INT4_OFFSET).to(torch.int8)
    return (q.t() if packed_dim == 0 else q).contiguous()
