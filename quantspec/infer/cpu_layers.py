"""quantspec's CPU kernels for the small per-row ops of the model: RMSNorm, the rotary embedding
and the MLP's silu(gate) * up (`kernels/cpu.py`), swapped in after loading like the skinny
linears.

A decode step of the default model runs 61 RMSNorms (5 torch ops each, ~16 µs) and 30 rotary
embeddings (7 ops, ~30 µs) on a few rows: ~2.5 ms of a 15 ms int8 step on two cores, spent in
op dispatch. One kernel call each costs 1-2 µs (silu * up of a fused gate/up: 1.3 µs instead of
three torch ops, ~6 µs). The kernels round where torch rounds (bf16: after each op), so bf16
norms and rotations equal torch's bitwise (silu * up: within an ulp, from the exp) and fp32
results differ by summation order. Rows are split over the threads from a few rows on, so they
serve every number of rows — decode, verification and prefill alike. Measured on two cores
(the default model's shapes, fp32): 11 rows (a 10-draft verification) norm 3.4 µs
vs torch's 20, silu * up 5.4 vs 14, rope 3.8 vs 20; 128 rows (a prefill) 8 vs 57, 47 vs 79,
26 vs 66; 512 rows 26 vs 113, 148 vs 248, 83 vs 173. Parameters are untouched: state dicts see
the same modules.
"""

from __future__ import annotations

import torch

from quantspec.kernels.cpu import X_DTYPES as _DTYPES
from quantspec.model_zoo.llama import MLP, Attention, RMSNorm

__all__ = ["KernelAttention", "KernelMLP", "KernelRMSNorm", "use_cpu_layer_kernels"]


def _kernel_rows(x: torch.Tensor) -> bool:
    return x.device.type == "cpu" and x.dtype in _DTYPES and 0 < x.shape[0]


class KernelRMSNorm(RMSNorm):
    kernels = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and _kernel_rows(x) and self.weight.dtype == x.dtype:
            return self.kernels.rms_norm(x.contiguous(), self.weight, self.eps)
        return super().forward(x)


class KernelAttention(Attention):
    kernels = None

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if _kernel_rows(x) and x.stride(-1) == 1 and cos.dtype == x.dtype:
            return self.kernels.rope(x, cos.contiguous(), sin.contiguous())
        return super().rotate(x, cos, sin)


class KernelMLP(MLP):
    kernels = None

    def act(self, gate_up: torch.Tensor) -> torch.Tensor:
        if gate_up.dim() == 2 and _kernel_rows(gate_up):
            return self.kernels.silu_mul(gate_up.contiguous())
        return super().act(gate_up)


def use_cpu_layer_kernels(model: torch.nn.Module) -> int:
    """Swap the RMSNorms, attentions and MLPs of a CPU fp32 / bf16 model to the kernel versions, when
    quantspec's CPU kernels are built here; returns how many modules were swapped."""
    from quantspec.kernels.cpu import cpu_kernels

    kernels = cpu_kernels()
    if kernels is None:
        return 0
    n = 0
    for module in model.modules():
        swap = {RMSNorm: KernelRMSNorm, Attention: KernelAttention, MLP: KernelMLP}.get(type(module))
        if swap is None:
            continue
        p = next(module.parameters(), None)
        if p is not None and (p.device.type != "cpu" or p.dtype not in _DTYPES):
            continue
        module.__class__ = swap
        module.kernels = kernels
        n += 1
    return n
