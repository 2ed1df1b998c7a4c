"""`QuantEmbedding`: an input embedding whose rows are integer codes + scales (compressed-tensors'
weight-only int8 / int4, per row or per group of a row), looked up by dequantizing only the rows
asked for, as vLLM's `CompressedTensorsEmbeddingWNA16Int` does: the [V, D] table stays at its
bits (int32 words of packed codes, the artifact's pack-quantized layout) on every device.

A row is `(q − zero_point) · scale`, computed by `quant.primitives.dequantize` (in the scale's
dtype, then cast to the model's), as compressed-tensors decompresses it.
"""

from __future__ import annotations

from typing import Mapping

import torch
from torch import nn

from quantspec.errors import QuantSpecError
from quantspec.quant.compressed import read_quantized_linear
from quantspec.quant.packing import pack_int32, unpack_int32
from quantspec.quant.primitives import dequantize, quantize
from quantspec.quant.scheme import QuantScheme, embedding_problem

__all__ = ["QuantEmbedding", "check_embedding_scheme"]


def check_embedding_scheme(scheme: QuantScheme) -> None:
    """Refuse, in one line, an embedding scheme quantspec does not look up (`embedding_problem`)."""
    problem = embedding_problem(scheme)
    if problem is not None:
        raise QuantSpecError(f"{problem}; re-quantize with the embedding float or weight_only_int8 / int4")


class QuantEmbedding(nn.Module):
    """An embedding of `num_embeddings` rows of `embedding_dim` codes (module docstring);
    `forward(ids)` → [*ids.shape, embedding_dim] in `dtype`."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None, scheme: QuantScheme,
                 *, dtype: torch.dtype, device: torch.device | str = "cpu"):
        super().__init__()
        check_embedding_scheme(scheme)
        self.args = scheme.weights
        self.num_embeddings, self.embedding_dim = q.shape
        self.dtype = dtype
        self.register_buffer("packed", pack_int32(q.to(torch.int8), self.args.num_bits).to(device))
        self.register_buffer("scale", scale.to(device))
        self.register_buffer("zero_point", None if zero_point is None else zero_point.to(device))

    @classmethod
    def from_tensors(cls, tensors: Mapping[str, torch.Tensor], prefix: str, scheme: QuantScheme,
                     num_embeddings: int, embedding_dim: int, *, dtype: torch.dtype,
                     device: torch.device | str = "cpu") -> "QuantEmbedding":
        """Build from a checkpoint's tensors (compressed-tensors names under `prefix`)."""
        check_embedding_scheme(scheme)
        t = read_quantized_linear(tensors, prefix, scheme, num_embeddings, embedding_dim)
        return cls(t.q, t.scale, t.zero_point, scheme, dtype=dtype, device=device)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` (1-D, in range) dequantized, [len(ids), embedding_dim] in `dtype`."""
        q = unpack_int32(self.packed[ids], self.args.num_bits, (ids.numel(), self.embedding_dim))
        zp = None if self.zero_point is None else self.zero_point[ids]
        return dequantize(q, self.scale[ids], zp, self.args, dtype=self.dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        # checked on the host only: on CUDA the check would sync every step (an out-of-range id
        # there fails the gather's device assert, as in `nn.Embedding`)
        host = flat.device.type == "cpu" and flat.numel() > 0
        if host and (int(flat.min()) < 0 or int(flat.max()) >= self.num_embeddings):
            raise IndexError(f"token id out of range [0, {self.num_embeddings})")
        return self.rows(flat).view(*ids.shape, self.embedding_dim)

    def codes_match(self, table: torch.Tensor, *, tolerance: float = 0.01) -> bool:
        """Whether `table` [V, D] (a float copy of the embedding these codes were made from) rounds to
        these codes under these scales and zero points: at most `tolerance` of its elements one code
        off (a tie rounded the other way in another dtype), none further."""
        if tuple(table.shape) != (self.num_embeddings, self.embedding_dim):
            return False
        ours = unpack_int32(self.packed, self.args.num_bits, tuple(table.shape)).to(torch.int32)
        theirs = quantize(table.to(self.scale.device, self.scale.dtype), self.scale, self.zero_point, self.args,
                          dtype=torch.int32)
        off = (ours - theirs).abs()
        return int(off.max()) <= 1 and float((off > 0).float().mean()) <= tolerance

    def dequantized(self) -> torch.Tensor:
        """The whole [V, D] table dequantized (a copy, in `dtype`)."""
        return self.rows(torch.arange(self.num_embeddings, device=self.packed.device))

    def extra_repr(self) -> str:
        g = self.args.group_size if self.args.strategy == "group" else "row"
        return f"{self.num_embeddings}, {self.embedding_dim}, int{self.args.num_bits} codes per {g}"
