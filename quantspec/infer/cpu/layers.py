"""quantspec's CPU kernels for the small per-row ops of a layer: RMSNorm, the rotary embedding
and the MLP's silu(gate) * up (`kernels.cpu.rms_norm` / `rope` / `silu_mul`), put in place of the
zoo's modules by name.

A decode step of a small model runs a few hundred of these ops on a few rows, where torch's
dispatch costs more than the arithmetic; one kernel call each replaces 3-7 torch ops. The kernels
round where torch rounds (bf16: after each op), so bf16 norms and rotations equal torch's bitwise
(silu * up: within an ulp, from the exp) and fp32 results differ by summation order. Rows are
split over the threads from a few rows on, so they serve decode, verification and prefill
alike. Parameters are untouched: state dicts see the same tensors.
"""

from __future__ import annotations

import torch
from torch import nn

from quantspec.kernels import cpu as cg
from quantspec.model_zoo.llama import RMSNorm, RotaryEmbedding, SiluAndMul

__all__ = ["CpuRMSNorm", "CpuRotary", "CpuSiluAndMul", "use_cpu_layer_kernels"]


def _kernel_rows(x: torch.Tensor) -> bool:
    return x.device.type == "cpu" and x.dtype in cg.X_DTYPES and 0 < x.shape[0]


class CpuRMSNorm(RMSNorm):
    """An `RMSNorm` (the same weight) computed by `kernels.cpu.rms_norm` for 2-D CPU rows."""

    def __init__(self, norm: RMSNorm):
        nn.Module.__init__(self)
        self.eps, self.weight, self.fp32_scale, self.unit_offset = norm.eps, norm.weight, False, False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and _kernel_rows(x) and self.weight.dtype == x.dtype:
            return cg.rms_norm(x.contiguous(), self.weight, self.eps)
        return super().forward(x)


class CpuRotary(RotaryEmbedding):
    """The rotary embedding by `kernels.cpu.rope`."""

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if _kernel_rows(x) and x.stride(-1) == 1 and cos.dtype == x.dtype and cos.shape[-1] == x.shape[-1]:
            return cg.rope(x, cos.contiguous(), sin.contiguous())  # whole heads (partial rotary: the modules')
        return super().forward(x, cos, sin)


class CpuSiluAndMul(SiluAndMul):
    """silu(gate) * up by `kernels.cpu.silu_mul`."""

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        if gate_up.dim() == 2 and _kernel_rows(gate_up):
            return cg.silu_mul(gate_up.contiguous())
        return super().forward(gate_up)


def _owner_dtype_ok(owner: nn.Module) -> bool:
    p = next(owner.parameters(), None)
    return p is None or (p.device.type == "cpu" and p.dtype in cg.X_DTYPES)


def use_cpu_layer_kernels(model: nn.Module) -> int:
    """Put the kernel versions in place of the RMSNorms, rotary embeddings and activations below
    `model` whose module holds CPU fp32 / bf16 parameters; returns how many. Needs quantspec's CPU
    kernels."""
    targets = []
    for name, m in model.named_modules():
        if not name:
            continue
        if type(m) is RMSNorm and not m.fp32_scale and _owner_dtype_ok(m):  # the kernel: HF Llama's rounding
            targets.append((name, CpuRMSNorm(m)))
        elif type(m) in (RotaryEmbedding, SiluAndMul):
            owner = model.get_submodule(name.rpartition(".")[0])
            if _owner_dtype_ok(owner):
                targets.append((name, CpuRotary() if type(m) is RotaryEmbedding else CpuSiluAndMul()))
    for name, new in targets:
        model.set_submodule(name, new)
    return len(targets)
