"""Float (unquantized) linears on CPU: a faster path for a few rows.

For M ≤ a handful of rows, torch's CPU `linear` takes sgemv (M = 1: single-threaded, slower
than the memory bandwidth allows) or an sgemm that first packs the whole weight (M ≥ 2: ~1.5-2.5x
the cost of one row on the default model's shapes). Computing `W @ xᵀ` with x padded to two
contiguous rows streams W once through sgemm's skinny kernel instead. Measured on SmolLM2-135M
(fp32, 2 cores): a decode step 52 → 29 ms, and a 2-row verification step 66 → 28 ms; gains stop
near 4 rows (8 for the 49k-row head), where the plain path takes over again.

Where quantspec's CPU kernels are built (`kernels/cpu.py`, AVX-512), they take over: fp32
weights for M ≤ 8 (on par with the path above at M ≤ 4, 1.2-1.4x faster than torch at M = 8 over
the default model's layers, 1.9x on its head) and bf16 weights — the head of a quantized
artifact — for M ≤ 64 (2x faster than torch's bf16 linear at M = 1; slower from M ≈ 4, but one
kernel for every verification size keeps each row's logits bitwise equal to a decode step's, so
bf16 speculation stays lossless), and for every row of an engine decode step whatever M
(`step_rows`). See `bench/kernels_cpu.py`.

This is a dispatch policy (infer/ owns those), applied after loading by swapping the modules'
class; parameters are untouched, so state dicts and quantizers see plain `nn.Linear`s.

Last, where the kernels are built, the loader replaces every fp32 linear by a `PackedLinear`
(weights repacked into column blocks, `packed_gemm` for any number of rows: 2.2x the kernel above
at 8 rows, faster than torch's sgemm for prefill) and, where the CPU has AVX512-BF16, every bf16
linear with an even K (an artifact's head) by a `PackedPairsLinear`; `SkinnyLinear` then serves
the other bf16 linears and every float linear where the kernels are not built.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from quantspec.infer.step_rows import in_decode_step

__all__ = ["PackedEmbedding", "PackedInt8Linear", "PackedLinear", "PackedPairsLinear", "SkinnyLinear", "all_linears_packed", "pack_float_linears", "use_skinny_linears"]

MAX_ROWS = 4  # largest M that takes the W @ xᵀ path
_FEW_IDS = 16  # PackedEmbedding: up to this many ids are looked up one by one
MAX_ROWS_TALL = 8  # ... for a tall weight (N ≥ TALL_N, e.g. a vocab head)
TALL_N = 16384
KERNEL_MAX_ROWS = {torch.float32: 8, torch.bfloat16: 64}  # quantspec's CPU kernel, by weight dtype


class SkinnyLinear(nn.Linear):
    """`nn.Linear` whose forward streams W once for a few fp32 rows on CPU (see module doc)."""

    kernels = None  # quantspec's CPU kernels module, set by `use_skinny_linears` when built

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        rows = x.numel() // x.shape[-1] if x.numel() else 0
        if (self.kernels is not None and w.dtype in KERNEL_MAX_ROWS and x.dtype in KERNEL_MAX_ROWS
                and 0 < rows and (rows <= KERNEL_MAX_ROWS[w.dtype] or in_decode_step())
                and x.device.type == "cpu" and w.shape[1] % 16 == 0):
            b = self.bias if self.bias is None or self.bias.dtype == torch.float32 else self.bias.float()
            y = self.kernels.dense_gemv(x.reshape(rows, x.shape[-1]).contiguous(), w, b)
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


def use_skinny_linears(model: nn.Module, *, cpu_kernels: bool = True) -> int:
    """Swap every plain fp32 CPU `nn.Linear` in `model` (and bf16 ones, where quantspec's CPU
    kernels are built) to `SkinnyLinear`; returns how many. `cpu_kernels=False`: torch's ops."""
    kernels = None
    if cpu_kernels:
        from quantspec.kernels.cpu import cpu_kernels as built

        kernels = built()
    dtypes = (torch.float32,) if kernels is None else (torch.float32, torch.bfloat16)
    n = 0
    for module in model.modules():
        if type(module) is nn.Linear and module.weight.device.type == "cpu" and module.weight.dtype in dtypes:
            module.__class__ = SkinnyLinear
            module.kernels = kernels
            n += 1
    return n


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
    computed by quantspec's `packed_gemm` kernel for every number of rows: decode, verification
    and prefill alike. The packed copy replaces the [N, K] weight (the same memory up to padding N
    to a multiple of 32; a tied head's tensor stays alive through the embedding). Each row's result is one FMA chain per output
    whatever M, so verification rows equal decode rows bitwise without any dispatch on M.

    Measured on SmolLM2-135M's layers (2 cores): 8 rows 2.5-3.0x torch's linear (2.2x the
    row-major kernel behind `SkinnyLinear`), 1 row 1.1-1.5x, prefill (128-600 rows) 1.3-1.7x
    torch's sgemm (`bench/kernels_cpu.py`). Built by `pack_float_linears` once a model is loaded (and fused).
    """

    def __init__(self, linear: nn.Linear, kernels):
        super().__init__()
        from quantspec.kernels.cpu import pack_dense

        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.kernels = kernels
        self.register_buffer("packed", pack_dense(linear.weight), persistent=False)  # [NB, K, 32]
        self.bias = (None if linear.bias is None
                     else nn.Parameter(linear.bias.detach().float(), requires_grad=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1] if x.numel() else 0
        y = self.kernels.packed_gemm(x.reshape(rows, x.shape[-1]).contiguous(), self.packed,
                                     self.out_features, self.bias)
        return y.view(*x.shape[:-1], self.out_features)

    def dense_weight(self) -> torch.Tensor:
        """The [N, K] fp32 weight, unpacked (a copy)."""
        from quantspec.kernels.cpu import unpack_dense

        return unpack_dense(self.packed, self.out_features)

    def weight_rows(self, ids) -> torch.Tensor:
        """Rows `ids` (a list or a 1-D tensor of output indices) of the weight, [len, K] fp32."""
        return _block_rows(self.packed, ids, self.in_features)  # [NB, K, 32]

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, packed"


class PackedInt8Linear(nn.Module):
    """A bias-free linear for drafting only: the float weight rounded per output row to int8
    (symmetric, scale = row absmax / 127, round to nearest) and computed by quantspec's
    `packed_w8_gemm` — a quarter of the fp32 weight's bytes, every row one FMA chain. Used for an
    MTP module's draft-vocabulary head (`spec/mtp.py`): a draft is only a proposal, so its
    precision moves acceptance, never the output; on the default model's held-out chat prompts
    the fp32 head accepted 178 of 400 drafts, this one 179 of 400, with the head's weight reads
    9.4 → 2.4 MB a draft step."""

    def __init__(self, weight: torch.Tensor, kernels):
        super().__init__()
        from quantspec.kernels.cpu import pack_w8

        w = weight.detach().float()
        self.out_features, self.in_features = w.shape
        self.kernels = kernels
        scale = (w.abs().amax(dim=1) / 127).clamp_min(torch.finfo(torch.float32).tiny)  # [N]
        q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
        self.register_buffer("int8_cpu", pack_w8(q), persistent=False)  # [NB, K, 32]
        self.register_buffer("w_scale_vec", scale.contiguous(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1] if x.numel() else 0
        y = self.kernels.packed_w8_gemm(x.reshape(rows, x.shape[-1]).contiguous(), self.int8_cpu,
                                        self.w_scale_vec, self.out_features, None)
        return y.view(*x.shape[:-1], self.out_features)

    def dense_weight(self) -> torch.Tensor:
        """The [N, K] fp32 weight it computes with (codes × scales)."""
        from quantspec.kernels.cpu import unpack_w8

        return unpack_w8(self.int8_cpu, self.out_features).float() * self.w_scale_vec[:, None]

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 rows, packed"


class PackedEmbedding(nn.Module):
    """The embedding of a tied model whose head is a `PackedLinear` (or a `PackedPairsLinear`):
    rows are read from the head's packed blocks (row t = packed[t // 32, :, t % 32], bitwise the
    original weight), so the [V, D] table is not kept twice (−108 MiB for SmolLM2's fp32
    49152 × 576, −54 MiB in bf16). The head is held outside the module tree: it stays the model's
    `lm_head`, counted and saved once."""

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
    """A bf16 linear (the head of a quantized artifact, a bf16 model's layers) packed in k-pairs
    (`kernels.cpu.pack_pairs`) and computed for bf16 x by `packed_pairs_gemm`: AVX512-BF16's dot
    product over column blocks, so every row of a step shares one pass over the weight at twice
    the fp32 FMA rate, and each output is one fixed chain whatever M (verification rows equal
    decode rows bitwise). It replaces the row-major kernel behind `SkinnyLinear`, whose tiles of
    ≤ 4 rows re-read the weight: SmolLM2's 49152 × 576 head, 2 threads, 1 row 1.46 vs 1.49 ms,
    11 rows 2.0 vs 7.9, 130 rows 17 vs 66 (`bench/kernels_cpu.py`). Other x (fp32) take torch's
    linear on the unpacked weight. Built by `pack_float_linears` where the CPU has AVX512-BF16."""

    def __init__(self, linear: nn.Linear, kernels):
        super().__init__()
        from quantspec.kernels.cpu import pack_pairs

        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.kernels = kernels
        self.register_buffer("packed", pack_pairs(linear.weight), persistent=False)  # int32 [NB, K/2, 32]
        self.bias = (None if linear.bias is None
                     else nn.Parameter(linear.bias.detach().float(), requires_grad=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.bfloat16:
            return F.linear(x, self.dense_weight().to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))
        rows = x.numel() // x.shape[-1] if x.numel() else 0
        y = self.kernels.packed_pairs_gemm(x.reshape(rows, x.shape[-1]).contiguous(), self.packed,
                                           self.out_features, self.bias)
        return y.view(*x.shape[:-1], self.out_features)

    def dense_weight(self) -> torch.Tensor:
        """The [N, K] bf16 weight, unpacked (a copy)."""
        from quantspec.kernels.cpu import unpack_pairs

        return unpack_pairs(self.packed, self.out_features)

    def weight_rows(self, ids) -> torch.Tensor:
        """Rows `ids` (a list or a 1-D tensor of output indices) of the weight, [len, K] bf16."""
        pairs = self.packed.view(torch.bfloat16).view(self.packed.shape[0], -1, 32, 2)  # [NB, K/2, 32, 2]
        return _block_rows(pairs, ids, self.in_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, bf16 k-pairs"


def pack_float_linears(model: nn.Module) -> int:
    """Replace every fp32 CPU float linear of `model` (`nn.Linear` / `SkinnyLinear`) by a
    `PackedLinear`, and every bf16 one with an even K (a quantized artifact's head) by a
    `PackedPairsLinear` where the CPU has AVX512-BF16, where quantspec's CPU kernels are built;
    returns how many. Run it last, after `fuse_projections` (which stacks weights): the packed
    modules have no `weight` attribute. `model` itself is never replaced (wrap a lone Linear in
    `PackedLinear` directly)."""
    from quantspec.kernels.cpu import cpu_kernels

    kernels = cpu_kernels()
    if kernels is None:
        return 0
    pairs = bool(kernels.has_bf16_dot())

    def packer(m: nn.Module):
        if type(m) not in (nn.Linear, SkinnyLinear) or m.weight.device.type != "cpu":
            return None
        if m.weight.dtype == torch.float32:
            return PackedLinear
        if pairs and m.weight.dtype == torch.bfloat16 and m.in_features % 2 == 0:
            return PackedPairsLinear
        return None

    targets = [(name, m, packer(m)) for name, m in model.named_modules() if name and packer(m) is not None]
    # embeddings sharing a packed linear's weight (a tied head) read it from the packed copy
    embeddings: dict[tuple, list[str]] = {}
    for n, e in model.named_modules():
        if n and type(e) is nn.Embedding:
            embeddings.setdefault((e.weight.data_ptr(), tuple(e.weight.shape)), []).append(n)
    for name, m, cls in targets:
        packed = cls(m, kernels)
        model.set_submodule(name, packed)
        for emb_name in embeddings.get((m.weight.data_ptr(), tuple(m.weight.shape)), []):
            model.set_submodule(emb_name, PackedEmbedding(packed))
    return len(targets)


def all_linears_packed(model: nn.Module) -> bool:
    """Whether every linear of `model` is a `PackedLinear` (an fp32 model on quantspec's CPU
    kernels): then every row of a forward shares one pass over the weights, and speculation's
    cost model uses the packed measurements (`SpecCost.for_device(..., packed_cpu=True)`)."""
    from quantspec.infer.quant_linear import QuantLinear

    kinds = {type(m) for m in model.modules()}
    return PackedLinear in kinds and not any(issubclass(t, (nn.Linear, QuantLinear)) for t in kinds)
