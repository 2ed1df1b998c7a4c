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
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from quantspec.infer.step_rows import in_decode_step

__all__ = ["SkinnyLinear", "use_skinny_linears"]

MAX_ROWS = 4  # largest M that takes the W @ xᵀ path
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
