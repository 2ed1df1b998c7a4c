"""Float (unquantized) linears on CPU: packed layouts and quantspec's kernels over them.

- `PackedLinear`: an fp32 weight packed in column blocks (`kernels.cpu.pack_dense`), computed by
  `packed_gemm` for every number of rows (decode, verification and prefill alike);
- `PackedPairsLinear`: a bf16 weight (a quantized artifact's head, a bf16 model's layers) packed in
  k-pairs (`pack_pairs`) for AVX512-BF16's dot product (`packed_pairs_gemm`), bf16 x;
- `PackedInt8Linear`: a drafting head rounded per output row to int8 (`packed_w8_gemm`);
- `PackedEmbedding`: a tied model's embedding read from its packed head's blocks (one copy);
- `SkinnyLinear`: the other float linears: for a few rows, quantspec's row-major `dense_gemv`
  where the kernels are built, else `W @ xᵀ` with x padded to two rows (torch's 1-row `linear`
  is a single-threaded sgemv, its few-row sgemm packs the whole weight first).
Every packed kernel computes each output by one fixed chain whatever M, so a row's numbers in a
verification step equal a decode step's; `SkinnyLinear`'s kernel does for up to `KERNEL_MAX_ROWS`
rows, and for any M in a row-invariant call.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from quantspec.kernels import cpu as cg

__all__ = ["PackedEmbedding", "PackedInt8Linear", "PackedLinear", "PackedPairsLinear", "SkinnyLinear",
           "all_linears_packed", "pack_float_linears", "skinny_linears"]

MAX_ROWS = 4  # largest M that takes the W @ xᵀ path
_FEW_IDS = 16  # PackedEmbedding: up to this many ids are looked up one by one
MAX_ROWS_TALL = 8  # ... for a tall weight (N ≥ TALL_N, e.g. a vocab head)
TALL_N = 16384
KERNEL_MAX_ROWS = {torch.float32: 8, torch.bfloat16: 64}  # dense_gemv's rows, by weight dtype


def _rows(x: torch.Tensor) -> int:
    return x.numel() // x.shape[-1] if x.numel() else 0


class SkinnyLinear(nn.Linear):
    """An `nn.Linear` (the same parameters) whose forward streams W once for a few rows on CPU
    (module docstring). `kernels`: quantspec's extension, or None for torch's ops."""

    takes_row_invariant = True  # model_zoo.llama: the model passes its forward's row_invariant

    def __init__(self, linear: nn.Linear, kernels=None):
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        self.kernels = kernels

    def forward(self, x: torch.Tensor, row_invariant: bool = False) -> torch.Tensor:
        w = self.weight
        rows = _rows(x)
        if (self.kernels is not None and w.dtype in KERNEL_MAX_ROWS and x.dtype in KERNEL_MAX_ROWS
                and 0 < rows and (rows <= KERNEL_MAX_ROWS[w.dtype] or row_invariant)
                and x.device.type == "cpu" and w.shape[1] % cg.K_MULTIPLE == 0):
            b = self.bias if self.bias is None or self.bias.dtype == torch.float32 else self.bias.float()
            y = cg.dense_gemv(x.reshape(rows, x.shape[-1]).contiguous(), w, b)
            return y.view(*x.shape[:-1], w.shape[0])
        limit = MAX_ROWS_TALL if w.shape[0] >= TALL_N else MAX_ROWS
        if not (0 < rows <= limit and x.dtype == torch.float32 and x.device.type == "cpu"):
            return F.linear(x, w, self.bias)
        x2 = x.reshape(rows, x.shape[-1])
        # two contiguous rows: M = 1 would otherwise fall back to sgemv
        x2 = torch.cat([x2, x2.new_zeros(1, x2.shape[1])]) if rows == 1 else x2.contiguous()
        y = torch.mm(w, x2.t()).t()[:rows]  # [rows, N], a transposed view
        if self.bias is not None:
            y = y + self.bias
        # contiguous output: the next skinny linear's operand must be row-major [rows, K]
        return y.contiguous().view(*x.shape[:-1], w.shape[0])


def skinny_linears(model: nn.Module, kernels=None) -> int:
    """Replace every plain fp32 CPU `nn.Linear` below `model` (and bf16 ones, given quantspec's
    `kernels`) by a `SkinnyLinear` over the same parameters; returns how many."""
    dtypes = (torch.float32,) if kernels is None else (torch.float32, torch.bfloat16)
    targets = [name for name, m in model.named_modules()
               if name and type(m) is nn.Linear and m.weight.device.type == "cpu" and m.weight.dtype in dtypes]
    for name in targets:
        model.set_submodule(name, SkinnyLinear(model.get_submodule(name), kernels))
    return len(targets)


def _block_rows(blocks: torch.Tensor, ids, k: int) -> torch.Tensor:
    """Rows `ids` (a list, or a 1-D tensor) of a weight packed in column blocks of 32 outputs,
    `blocks` [NB, ..., 32, ...] with output 32 b + j at [b, :, j] → [len(ids), k]."""
    if isinstance(ids, list):
        if not ids:
            return blocks.new_empty(0, k)
        return torch.stack([blocks[t // 32, :, t % 32].reshape(k) for t in ids])
    return blocks[ids // 32, :, ids % 32].reshape(len(ids), k)


class PackedLinear(nn.Module):
    """An fp32 linear whose weight lives packed in column blocks (`kernels.cpu.pack_dense`),
    computed by `packed_gemm` for every number of rows. The packed copy replaces the [N, K] weight
    (the same memory up to padding N to a multiple of 32; a tied head's tensor stays alive through
    the embedding). Each row's result is one FMA chain per output whatever M."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("packed", cg.pack_dense(linear.weight), persistent=False)  # [NB, K, 32]
        self.bias = (None if linear.bias is None
                     else nn.Parameter(linear.bias.detach().float(), requires_grad=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = _rows(x)
        y = cg.packed_gemm(x.reshape(rows, x.shape[-1]).contiguous(), self.packed, self.out_features, self.bias)
        return y.view(*x.shape[:-1], self.out_features)

    def dense_weight(self) -> torch.Tensor:
        """The [N, K] fp32 weight, unpacked (a copy)."""
        return cg.unpack_dense(self.packed, self.out_features)

    def weight_rows(self, ids) -> torch.Tensor:
        """Rows `ids` (a list or a 1-D tensor of output indices) of the weight, [len, K] fp32."""
        return _block_rows(self.packed, ids, self.in_features)  # [NB, K, 32]

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, packed"


class PackedInt8Linear(nn.Module):
    """A bias-free linear for drafting only: the float weight rounded per output row to int8
    (symmetric, scale = row absmax / 127, round to nearest), computed by `packed_w8_gemm`: a quarter
    of an fp32 weight's bytes, every row one FMA chain. A draft is only a proposal, so the head's
    precision moves acceptance, never the output."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        w = weight.detach().float()
        self.out_features, self.in_features = w.shape
        scale = (w.abs().amax(dim=1) / 127).clamp_min(torch.finfo(torch.float32).tiny)  # [N]
        q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
        self.register_buffer("int8_cpu", cg.pack_w8(q), persistent=False)  # [NB, K, 32]
        self.register_buffer("w_scale_vec", scale.contiguous(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = _rows(x)
        y = cg.packed_w8_gemm(x.reshape(rows, x.shape[-1]).contiguous(), self.int8_cpu, self.w_scale_vec,
                              self.out_features, None)
        return y.view(*x.shape[:-1], self.out_features)

    def dense_weight(self) -> torch.Tensor:
        """The [N, K] fp32 weight it computes with (codes × scales)."""
        return cg.unpack_w8(self.int8_cpu, self.out_features).float() * self.w_scale_vec[:, None]

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 rows, packed"


class PackedEmbedding(nn.Module):
    """The embedding of a tied model whose head is a `PackedLinear` (or a `PackedPairsLinear`):
    rows are read from the head's packed blocks (row t = packed[t // 32, :, t % 32], bitwise the
    original weight), so the [V, D] table is not kept twice. The head is held outside the module
    tree: it stays the model's `lm_head`, counted and saved once."""

    def __init__(self, head: "PackedLinear | PackedPairsLinear"):
        super().__init__()
        self._head = [head]  # a list: not a submodule
        self.num_embeddings, self.embedding_dim = head.out_features, head.in_features

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        if flat.numel() <= _FEW_IDS:  # a decode step / a draft: Python indexing beats 5 tensor ops
            lst = flat.tolist()
            if any(t < 0 or t >= self.num_embeddings for t in lst):
                raise IndexError(f"token id out of range [0, {self.num_embeddings})")
            rows = self._head[0].weight_rows(lst)
        else:
            if int(flat.min()) < 0 or int(flat.max()) >= self.num_embeddings:
                raise IndexError(f"token id out of range [0, {self.num_embeddings})")
            rows = self._head[0].weight_rows(flat)
        return rows.view(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, rows read from the packed head"


class PackedPairsLinear(nn.Module):
    """A bf16 linear packed in k-pairs (`kernels.cpu.pack_pairs`), computed for bf16 x by
    `packed_pairs_gemm`: AVX512-BF16's dot product over column blocks, so every row of a step
    shares one pass over the weight, and each output is one fixed chain whatever M. Other x
    (fp32) take torch's linear on the unpacked weight."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("packed", cg.pack_pairs(linear.weight), persistent=False)  # int32 [NB, K/2, 32]
        self.bias = (None if linear.bias is None
                     else nn.Parameter(linear.bias.detach().float(), requires_grad=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.bfloat16:
            return F.linear(x, self.dense_weight().to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))
        rows = _rows(x)
        y = cg.packed_pairs_gemm(x.reshape(rows, x.shape[-1]).contiguous(), self.packed, self.out_features,
                                 self.bias)
        return y.view(*x.shape[:-1], self.out_features)

    def dense_weight(self) -> torch.Tensor:
        """The [N, K] bf16 weight, unpacked (a copy)."""
        return cg.unpack_pairs(self.packed, self.out_features)

    def weight_rows(self, ids) -> torch.Tensor:
        """Rows `ids` (a list or a 1-D tensor of output indices) of the weight, [len, K] bf16."""
        pairs = self.packed.view(torch.bfloat16).view(self.packed.shape[0], -1, 32, 2)  # [NB, K/2, 32, 2]
        return _block_rows(pairs, ids, self.in_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, bf16 k-pairs"


def pack_float_linears(model: nn.Module, *, pairs: bool) -> int:
    """Replace every fp32 CPU float linear below `model` (`nn.Linear` / `SkinnyLinear`) by a
    `PackedLinear`, and, with `pairs` (AVX512-BF16 here), every bf16 one with an even K by a
    `PackedPairsLinear`; a tied embedding then reads its rows from the packed head. Returns how
    many. Run it after `fuse_projections` (which stacks weights): the packed modules have no
    `weight`. Needs quantspec's CPU kernels."""
    def packer(m: nn.Module):
        if type(m) not in (nn.Linear, SkinnyLinear) or m.weight.device.type != "cpu":
            return None
        if m.weight.dtype == torch.float32:
            return PackedLinear
        if pairs and m.weight.dtype == torch.bfloat16 and m.in_features % 2 == 0:
            return PackedPairsLinear
        return None

    # names only: each original is freed as soon as its packed copy replaces it, so packing a
    # model holds one linear twice at a time, never the whole model
    targets = [(name, packer(m)) for name, m in model.named_modules() if name and packer(m) is not None]
    # embeddings sharing a packed linear's weight (a tied head) read it from the packed copy
    embeddings: dict[tuple, list[str]] = {}
    for n, e in model.named_modules():
        if n and type(e) is nn.Embedding:
            embeddings.setdefault((e.weight.data_ptr(), tuple(e.weight.shape)), []).append(n)
    for name, cls in targets:
        m = model.get_submodule(name)
        packed = cls(m)
        model.set_submodule(name, packed)
        for emb_name in embeddings.get((m.weight.data_ptr(), tuple(m.weight.shape)), []):
            model.set_submodule(emb_name, PackedEmbedding(packed))
        del m, packed
    return len(targets)


def all_linears_packed(model: nn.Module) -> bool:
    """Whether every linear of `model` is a `PackedLinear` (an fp32 model on quantspec's CPU
    kernels): then every row of a forward shares one pass over the weights."""
    from quantspec.infer.quant_linear import QuantLinear

    kinds = {type(m) for m in model.modules()}
    return PackedLinear in kinds and not any(issubclass(t, (nn.Linear, QuantLinear)) for t in kinds)
