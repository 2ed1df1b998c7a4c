"""Integer codes ↔ int32 words, bit-exact with compressed-tensors' `pack_to_int32` /
`unpack_from_int32` for 4- and 8-bit codes ("pack-quantized").

Layout: b-bit codes q ∈ [-2^(b-1), 2^(b-1) - 1] are offset to u = q + 2^(b-1) ∈ [0, 2^b - 1];
along the packed dim, element i goes to word i // (32/b) at bits b·(i % (32/b)) … b·(i % (32/b)) +
b - 1 (the first element in the lowest bits). A trailing partial word is zero-padded (u = 0).
Weights pack along K (packed_dim=1: [N, K] → [N, ceil(K·b/32)]); asymmetric zero points [N, K/g]
pack along N (packed_dim=0: → [ceil(N·b/32), K/g]), as compressed-tensors stores
`weight_zero_point`. int4: 8 codes per word; int8: 4 codes per word (compressed-tensors' W8A16).

Example (int4): q = [[-8, -7, 0, 7, 0, 0, 0, 0]] → u = [0, 1, 8, 15, 8, 8, 8, 8]
→ word = 0x8888F810 → as int32: -2004289520.
Example (int8): q = [[-128, -1, 0, 127]] → u = [0, 127, 128, 255] → word = 0xFF807F00 → -8356096.
"""

from __future__ import annotations

import math
import sys

import torch

from quantspec.errors import QuantSpecError

__all__ = ["PACKED_BITS", "INT4_OFFSET", "INT4_PER_INT32", "codes_per_word", "packed_words",
           "pack_int32", "unpack_int32", "pack_int4", "unpack_int4"]

PACKED_BITS = (4, 8)  # code widths pack-quantized artifacts are written with
WORD_BITS = 32
INT4_OFFSET = 8  # signed int4 code + 8 = the unsigned nibble stored
INT4_PER_INT32 = 8


def codes_per_word(num_bits: int) -> int:
    """Codes in one int32 word: 8 for int4, 4 for int8."""
    if num_bits not in PACKED_BITS:
        raise QuantSpecError(f"packing {num_bits}-bit codes is unsupported; use 4 or 8 bits")
    return WORD_BITS // num_bits


def packed_words(cols: int, num_bits: int) -> int:
    """int32 words that hold `cols` codes of `num_bits` (the last one zero-padded)."""
    return math.ceil(cols / codes_per_word(num_bits))


def _check_dim(packed_dim: int) -> None:
    if packed_dim not in (0, 1):
        raise QuantSpecError(f"packed_dim must be 0 or 1, got {packed_dim}")


def _check_little_endian() -> None:
    if sys.byteorder != "little":  # words are built from and read as their bytes
        raise QuantSpecError("packing int32 words needs a little-endian machine")


def pack_int32(q: torch.Tensor, num_bits: int, packed_dim: int = 1) -> torch.Tensor:
    """Pack int8 codes q [N, K] of `num_bits` (4: in [-8, 7]; 8: any int8) into int32
    [N, ceil(K·b/32)] (packed_dim=1) or [ceil(N·b/32), K] (packed_dim=0)."""
    per_word = codes_per_word(num_bits)
    if not isinstance(q, torch.Tensor) or q.dtype != torch.int8:
        raise QuantSpecError(f"pack_int32 needs int8 codes, got {getattr(q, 'dtype', type(q))}")
    if q.ndim != 2:
        raise QuantSpecError(f"pack_int32 needs a 2-D tensor [N, K], got shape {tuple(q.shape)}")
    _check_dim(packed_dim)
    offset = 1 << (num_bits - 1)
    if q.numel() and (int(q.min()) < -offset or int(q.max()) > offset - 1):
        raise QuantSpecError(f"int{num_bits} codes must lie in [{-offset}, {offset - 1}], got "
                             f"[{int(q.min())}, {int(q.max())}]; quantize with num_bits={num_bits} "
                             "first")
    _check_little_endian()
    src = q.t() if packed_dim == 0 else q  # [rows, cols]
    rows, cols = src.shape
    # codes + 2^(b-1) (mod 256, exact: every code is in range), padded with code 0 like
    # compressed-tensors: one byte per code, so packing a weight holds ~2 bytes per code at most
    words = packed_words(cols, num_bits)
    u = torch.zeros(rows, words * per_word, dtype=torch.uint8, device=q.device)
    u[:, :cols] = src.view(torch.uint8) + offset
    u = u.reshape(-1)  # every row holds whole words
    if num_bits == 4:  # two codes a byte, the lower one in the low nibble
        u = u[0::2] | (u[1::2] << 4)
    # a word's code j sits at bits [b·j, b·(j + 1)): its bytes, least significant first
    packed = u.view(torch.int32).view(rows, words)  # [rows, words]
    if packed_dim == 0:
        packed = packed.t()
    return packed.contiguous()


def unpack_int32(packed: torch.Tensor, num_bits: int, shape: tuple[int, int] | torch.Size | None
                 = None, packed_dim: int = 1) -> torch.Tensor:
    """Inverse of `pack_int32`: int32 words → int8 codes of the original `shape` (default: every
    code the words hold)."""
    per_word = codes_per_word(num_bits)
    if not isinstance(packed, torch.Tensor) or packed.dtype != torch.int32:
        raise QuantSpecError(f"unpack_int32 needs int32 words, got "
                             f"{getattr(packed, 'dtype', type(packed))}")
    if packed.ndim != 2:
        raise QuantSpecError(f"unpack_int32 needs a 2-D tensor, got shape {tuple(packed.shape)}")
    _check_dim(packed_dim)
    p = packed.t() if packed_dim == 0 else packed
    rows, words = p.shape
    cols = words * per_word
    if shape is not None:
        shape = tuple(int(s) for s in shape)
        if len(shape) != 2:
            raise QuantSpecError(f"shape must be 2-D, got {shape}")
        want_rows, cols_req = (shape[1], shape[0]) if packed_dim == 0 else shape
        if want_rows != rows or not cols - per_word < cols_req <= cols:
            raise QuantSpecError(f"packed tensor {tuple(packed.shape)} cannot hold shape {shape} "
                                 f"(packed_dim={packed_dim}, {num_bits}-bit codes)")
        cols = cols_req
    _check_little_endian()
    u = p.contiguous().view(torch.uint8)  # [rows, 4·words]: each word's bytes, least significant first
    if num_bits == 4:  # the low nibble of a byte is the lower code
        u = torch.stack([u & 0xF, u >> 4], dim=-1).reshape(rows, -1)  # [rows, 8·words]
    q = (u[:, :cols] - (1 << (num_bits - 1))).view(torch.int8)  # mod 256: the signed code
    return (q.t() if packed_dim == 0 else q).contiguous()


def pack_int4(q: torch.Tensor, packed_dim: int = 1) -> torch.Tensor:
    """`pack_int32` of int4 codes in [-8, 7]: [N, K] → [N, ceil(K/8)] (packed_dim=1) or
    [ceil(N/8), K] (packed_dim=0)."""
    return pack_int32(q, 4, packed_dim)


def unpack_int4(packed: torch.Tensor, shape: tuple[int, int] | torch.Size | None = None,
                packed_dim: int = 1) -> torch.Tensor:
    """`unpack_int32` of int4 codes (default shape: every nibble, i.e. 8 × the packed dim)."""
    return unpack_int32(packed, 4, shape, packed_dim)
