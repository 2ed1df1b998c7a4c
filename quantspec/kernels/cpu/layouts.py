"""The weight layouts quantspec's CPU kernels read, packed once at load, and their inverses.

Column blocks of 32 outputs: a weight [N, C] becomes [NB, C, 32] (NB = ceil(N / 32), N
zero-padded), block b holding w[32 b + j, c] at [b, c, j], so a block streams sequentially and one
k step of it is two vectors.
"""

from __future__ import annotations

import torch

__all__ = ["PACK_BLOCK", "pack_dense", "pack_fp4_blocks", "pack_pairs", "pack_w4", "pack_w8", "pack_w8_pairs", "unblock",
           "unpack_dense", "unpack_fp4_blocks", "unpack_pairs", "unpack_w4", "unpack_w8", "unpack_w8_pairs"]

PACK_BLOCK = 32  # output features per column block


def _blocks(t: torch.Tensor) -> torch.Tensor:
    """[N, C] → [NB, C, 32]: rows in blocks of 32 (N zero-padded), each block transposed."""
    N, C = t.shape
    nb = -(-N // PACK_BLOCK)
    padded = t.detach()
    if N % PACK_BLOCK:  # (else no padded copy: a 49k-row head packs with one new tensor)
        padded = torch.zeros(nb * PACK_BLOCK, C, dtype=t.dtype)
        padded[:N] = t.detach()
    return padded.reshape(nb, PACK_BLOCK, C).transpose(1, 2).contiguous()


def unblock(t: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of the column blocks: [NB, C, 32] → the first n rows [n, C]."""
    nb, C, _ = t.shape
    return t.transpose(1, 2).reshape(nb * PACK_BLOCK, C)[:n].contiguous()


def pack_dense(w: torch.Tensor) -> torch.Tensor:
    """fp32 weight [N, K] → [NB, K, 32] column blocks (NB = ceil(N / 32), N zero-padded):
    block b holds w[32 b + j, k] at [b, k, j]. Done once at load; `packed_gemm` reads it."""
    return _blocks(w.float())


def unpack_dense(packed: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of `pack_dense` → [n, K]."""
    return unblock(packed, n)


def pack_pairs(w: torch.Tensor) -> torch.Tensor:
    """Float [N, K] (K even) → int32 [NB, K/2, 32]: block b, k-pair p, output j holds
    bf16(w[32b + j, 2p]) in its low half and bf16(w[32b + j, 2p + 1]) in its high half (zero rows
    pad N): the operand of AVX512-BF16's dot product (`packed_pairs_gemm`, the greedy head's
    pair screen). Exact for a bf16 weight; others are rounded to bf16."""
    n, k = w.shape
    if k % 2:
        raise ValueError(f"pack_pairs: K must be even, got {k}")
    nb, full = -(-n // PACK_BLOCK), n // PACK_BLOCK
    w = w.detach()
    # written block-transposed straight from w (rounded to bf16 on the way): the only copy made
    # is the packed one, so packing a large head holds it twice, not three times
    pairs = torch.empty(nb, k // 2, PACK_BLOCK, 2, dtype=torch.bfloat16)  # [NB, K/2, 32, 2]
    pairs[:full] = w[:full * PACK_BLOCK].reshape(full, PACK_BLOCK, k // 2, 2).permute(0, 2, 1, 3)
    if nb > full:  # the last block's rows past n are zero
        tail = torch.zeros(PACK_BLOCK, k, dtype=torch.bfloat16)
        tail[:n - full * PACK_BLOCK] = w[full * PACK_BLOCK:]
        pairs[full:] = tail.view(1, PACK_BLOCK, k // 2, 2).permute(0, 2, 1, 3)
    return pairs.view(torch.int32).view(nb, k // 2, PACK_BLOCK)


def unpack_pairs(packed: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of `pack_pairs` → the bf16 weight [n, K]."""
    nb, kp, _ = packed.shape
    pairs = packed.view(torch.bfloat16).view(nb, kp, PACK_BLOCK, 2)
    return pairs.permute(0, 2, 1, 3).reshape(nb * PACK_BLOCK, 2 * kp)[:n].contiguous()


class PairRows:
    """The bf16 weight [n, K] of a `pack_pairs` tensor read a slice of rows at a time
    (`rows[a:b]` → [b - a, K], unpacked from the blocks that hold them): what a reader of a large
    head's rows in chunks needs (`int8_screen_tables`), without the whole unpacked copy."""

    def __init__(self, packed: torch.Tensor, n: int):
        self.packed = packed  # int32 [NB, K/2, 32]
        self.shape = (n, 2 * packed.shape[1])

    def __getitem__(self, rows: slice) -> torch.Tensor:
        a, b, stride = rows.indices(self.shape[0])
        if stride != 1:
            raise ValueError("PairRows reads contiguous slices of rows")
        b0, b1 = a // PACK_BLOCK, max(a // PACK_BLOCK, -(-b // PACK_BLOCK))
        w = unpack_pairs(self.packed[b0:b1], (b1 - b0) * PACK_BLOCK)  # the blocks' rows [., K]
        return w[a - b0 * PACK_BLOCK:b - b0 * PACK_BLOCK]


def pack_w8(q: torch.Tensor) -> torch.Tensor:
    """int8 codes [N, K] → [NB, K, 32] column blocks (the layout of `pack_dense`)."""
    return _blocks(q.to(torch.int8))


def unpack_w8(packed: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of `pack_w8` → the int8 codes [n, K]."""
    return unblock(packed, n)


def pack_w8_pairs(q: torch.Tensor) -> torch.Tensor:
    """int8 codes [N, K] (K even) → [NB, K/2, 64], the int8 head screen's layout
    (`screened_argmax_i8`): in column block b at k-pair p, bytes 2j and 2j + 1 hold column
    32 b + j at k = 2p and 2p + 1 (N zero-padded), so one sign extension gives 16 outputs' int16
    pairs for AVX512-VNNI's vpdpwssd."""
    n, k = q.shape
    if k % 2:
        raise ValueError(f"pack_w8_pairs: K = {k} must be even")
    nb = -(-n // PACK_BLOCK)
    padded = torch.zeros(nb * PACK_BLOCK, k, dtype=torch.int8)
    padded[:n] = q.detach()
    return padded.reshape(nb, PACK_BLOCK, k // 2, 2).permute(0, 2, 1, 3).reshape(nb, k // 2, 2 * PACK_BLOCK).contiguous()


def unpack_w8_pairs(packed: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of `pack_w8_pairs` → the int8 codes [n, K]."""
    nb, kp, _ = packed.shape
    return packed.reshape(nb, kp, PACK_BLOCK, 2).permute(0, 2, 1, 3).reshape(nb * PACK_BLOCK, 2 * kp)[:n].contiguous()


def pack_w4(q: torch.Tensor, scale: torch.Tensor, neg_zs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """int4 codes q [N, K] (int8 in [-8, 7]) and their group scale / neg_zs [N, G] (fp32,
    w = q * scale + neg_zs) → (bytes [NB, K, 16], scale [NB, G, 32], offset [NB, G, 32]): in
    column block b at step k, byte j holds column 32 b + j in its low nibble and column
    32 b + j + 16 in its high one, each as the unsigned q + 8, so w = (q + 8) * scale + offset
    with offset = neg_zs - 8 * scale."""
    u = _blocks(q.to(torch.int8)).view(torch.uint8) + 8  # [NB, K, 32]; mod 256: the unsigned q + 8
    s = _blocks(scale.float())
    return _nibble_pairs(u), s, _blocks(neg_zs.float()) - 8 * s


def _nibble_pairs(u: torch.Tensor) -> torch.Tensor:
    """Nibbles [NB, K, 32] → bytes [NB, K, 16]: column j in the low nibble, j + 16 in the high."""
    return (u[:, :, :16] | (u[:, :, 16:] << 4)).contiguous()


def _nibbles_of(packed: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of `_nibble_pairs` and the column blocks → uint8 nibbles [n, K]."""
    return unblock(torch.cat([packed & 0x0F, packed >> 4], dim=2), n)


def unpack_w4(packed: torch.Tensor, n: int) -> torch.Tensor:
    """The codes [n, K] of `pack_w4`'s bytes."""
    return (_nibbles_of(packed, n) - 8).view(torch.int8)  # mod 256: the signed code


def pack_fp4_blocks(nibbles: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """E2M1 nibbles [N, K] (uint8: magnitude index | sign << 3, `quant.fp4.e2m1_nibbles`) and
    their group scales [N, G] (fp32, w = e2m1(nibble) · scale) → (bytes [NB, K, 16], scale
    [NB, G, 32]) in `pack_w4`'s byte layout; the padding rows are nibble 0, the value 0."""
    return _nibble_pairs(_blocks(nibbles.to(torch.uint8))), _blocks(scale.float())


def unpack_fp4_blocks(packed: torch.Tensor, n: int) -> torch.Tensor:
    """The nibbles [n, K] of `pack_fp4_blocks`' bytes."""
    return _nibbles_of(packed, n)
