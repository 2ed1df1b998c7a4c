"""The small modules of a decoder layer that an inference backend replaces by name: the rotary
embedding, the MLP's activation of its fused gate / up output and the RMSNorms (Llama's, OLMo 2's
fp32-scaled, Gemma's 1 + weight), as transformers computes them."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from quantspec.model_zoo.rope import apply_rope

__all__ = ["ACTIVATIONS", "GeluTanhAndMul", "RMSNorm", "RotaryEmbedding", "SiluAndMul", "gelu_tanh", "rms_norm"]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's LlamaRMSNorm: x normalized in fp32, rounded to x's dtype, then scaled by `weight`."""
    return weight * F.rms_norm(x.float(), x.shape[-1:], eps=eps).to(x.dtype)


class RotaryEmbedding(nn.Module):
    """The rotary embedding of x [T, heads, hd] by cos / sin [T, hd] (`apply_rope`)."""

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return apply_rope(x, cos, sin)


class SiluAndMul(nn.Module):
    """silu(gate) * up of a fused gate/up projection's output [..., 2 I] → [..., I]."""

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up


class GeluTanhAndMul(nn.Module):
    """gelu_tanh(gate) * up (Gemma's gelu_pytorch_tanh) of a fused gate/up projection's output."""

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


# config.json hidden_act → the MLP's activation of its gate
ACTIVATIONS = {"silu": F.silu, "gelu_pytorch_tanh": gelu_tanh}


class RMSNorm(nn.Module):
    """HF's LlamaRMSNorm (`rms_norm`); `fp32_scale`: the weight scales the fp32 normalized x
    before the cast (OLMo 2's, Gemma's); `unit_offset`: the scale is 1 + weight (Gemma's)."""

    def __init__(self, dim: int, eps: float, fp32_scale: bool = False, unit_offset: bool = False):
        super().__init__()
        self.eps, self.fp32_scale, self.unit_offset = eps, fp32_scale or unit_offset, unit_offset
        self.weight = nn.Parameter(torch.zeros(dim) if unit_offset else torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fp32_scale:
            w = self.weight.float() + 1.0 if self.unit_offset else self.weight
            return (w * F.rms_norm(x.float(), x.shape[-1:], eps=self.eps)).to(x.dtype)
        return rms_norm(x, self.weight, self.eps)

    @classmethod
    def of(cls, args, dim: int) -> "RMSNorm":
        """A norm of the kind of a model of `ModelArgs` args (`post_norms`: fp32-scaled; `norm_unit_offset`)."""
        return cls(dim, args.rms_norm_eps, args.post_norms, args.norm_unit_offset)
