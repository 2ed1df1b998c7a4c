"""quantspec's CPU kernels for the small per-row ops of a decode step: RMSNorm, the rotary
embedding and the MLP's silu(gate) * up (`kernels/cpu.py`), swapped in after loading like the
skinny linears.

A decode step of the default model runs 61 RMSNorms (5 torch ops each, ~16 µs) and 30 rotary
embeddings (7 ops, ~30 µs) on a few rows: ~2.5 ms of a 15 ms int8 step on two cores, spent in
op dispatch. One kernel call each costs 2 and 5 µs (silu * up of a fused gate/up: 2 µs instead
of three torch ops, ~7 µs). The kernels round where torch rounds (bf16:
after each op), so bf16 results equal torch's bitwise and fp32 ones differ by summation order.
Used for up to `MAX_ROWS` rows, and for every row of an engine's decode step (`step_rows`);
prefills keep torch's ops. Parameters are untouched: state dicts see the same modules.
"""

from __future__ import annotations

import torch

from quantspec.infer.step_rows import in_decode_step
from quantspec.kernels.cpu import X_DTYPES as _DTYPES
from quantspec.model_zoo.llama import MLP, Attention, RMSNorm

__all__ = ["KernelAttention", "KernelMLP", "KernelRMSNorm", "MAX_ROWS", "use_cpu_layer_kernels"]

MAX_ROWS = 64


def _kernel_rows(x: torch.Tensor) -> bool:
    return (x.device.type == "cpu" and x.dtype in _DTYPES and 0 < x.shape[0]
            and (x.shape[0] <= MAX_ROWS or in_decode_step()))


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
