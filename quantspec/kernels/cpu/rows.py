"""quantspec's CPU kernels for the small per-row ops of a layer (`kernels/csrc/rows.cpp`), each
beside its torch reference: RMSNorm, the rotary embedding and silu(gate) * up.

Each reproduces the torch expression the model runs, rounding where torch rounds (bf16: after
each op), so bf16 results equal the reference's bitwise (silu * up: within an ulp, from the exp)
and fp32 results differ by summation order. Rows are split over the threads from a few rows on.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from quantspec.kernels.cpu.build import need

__all__ = ["rms_norm", "rms_norm_ref", "rope", "rope_ref", "silu_mul", "silu_mul_ref"]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * rms_norm(x.float(), eps).to(x.dtype) (HF's LlamaRMSNorm): x [M, D] contiguous
    fp32/bf16, weight [D] of x's dtype → [M, D]."""
    return need().rms_norm(x, weight, eps)


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    from quantspec.model_zoo.llama import rms_norm as model_rms_norm

    return model_rms_norm(x, weight, eps)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin, rotate_half(x) = cat(-x2, x1): x [T, heads, hd] (last dim
    contiguous), cos / sin [T, hd] contiguous of x's dtype → contiguous [T, heads, hd]."""
    return need().rope(x, cos, sin)


def rope_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """x = [gate | up] [M, 2 I] contiguous fp32/bf16 → silu(gate) * up [M, I] in x.dtype."""
    return need().silu_mul(x)


def silu_mul_ref(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
