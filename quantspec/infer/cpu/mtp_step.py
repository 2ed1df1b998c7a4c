"""An MTP module's draft step in one C++ call on CPU (`CpuMTPStep`).

`mtp(h, t)` followed by `mtp.draft_logits(..., head)` through the extension's `MTPPlan`
(`infer/cpu/csrc/plans.cpp`): the calls the modules make, in their order, without Python between
them — bitwise the modules' result. Built only where the plan runs exactly the modules' kernels
(a module prepared by `infer.cpu.prepare`: kernel norms / rotary / activation, fused q/k/v and
gate/up, packed fp32 or int8 / int4 row-kernel linears, the int8 draft head or a packed fp32 one).
A call returns None — the modules run — when a module or tensor was swapped since, a forward hook
is registered on one of them (or globally), or a quantized linear would leave its row kernel for
that many rows. `QUANTSPEC_FUSED_LAYERS=0` turns it off, as it does the base's stack.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from quantspec.infer.cpu.layers import CpuRMSNorm
from quantspec.infer.cpu.stack import ENV_SWITCH, layer_plan_args, linear_plan_args, watch_holds
from quantspec.kernels import cpu as cg
from quantspec.model_zoo.mtp import MTPModule

__all__ = ["CpuMTPStep"]


class CpuMTPStep:
    """The draft step of one CPU-prepared MTP module with its draft head (module docstring)."""

    def __init__(self, mtp: MTPModule, plan, dtype: torch.dtype, watched: list[tuple], max_rows: int | None,
                 head: nn.Module):
        self.mtp, self.plan, self.dtype, self.max_rows = mtp, plan, dtype, max_rows
        self._watch = [list(t) for t in zip(*watched)]
        mods = [*mtp.model.modules(), *head.modules()]
        self._hook_dicts = [d for m in mods for d in (m._forward_hooks, m._forward_pre_hooks)]

    @classmethod
    def build(cls, mtp: MTPModule, head: nn.Module, *, pairs: bool = True) -> "CpuMTPStep | None":
        """The step of `mtp` drafting with `head` (its draft-vocabulary head op), or None."""
        if os.environ.get(ENV_SWITCH, "1") == "0":
            return None
        kernels = cg.cpu_kernels()
        if kernels is None or not hasattr(kernels, "MTPPlan"):
            return None
        m, args = mtp.model, mtp.args.block
        dtype, eps = m.norm.weight.dtype, m.norm.eps
        norms = (m.enorm, m.hnorm, m.norm)
        if (m.norm.weight.device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16) or len(m.layers) != 1
                or any(type(n) is not CpuRMSNorm or n.weight.dtype != dtype or n.eps != eps for n in norms)):
            return None
        tensors, ints, limits = [m.enorm.weight, m.hnorm.weight], [], []
        watched: list[tuple] = [(n._parameters, "weight", n.weight) for n in norms]
        # (eh_proj and the head are watched by `linear_plan_args`, the layer's parts by `layer_plan_args`)
        watched += [(m._modules, name, m._modules[name]) for name in ("enorm", "hnorm", "norm", "layers")]
        watched += [(m.layers._modules, "0", m.layers[0]), (mtp.__dict__, "_attn", mtp._attn),
                    (mtp.__dict__, "_shared", mtp._shared)]
        if (not linear_plan_args(m._modules, "eh_proj", dtype, tensors, ints, watched, limits)
                or not layer_plan_args(m.layers[0], args, dtype, eps, tensors, ints, watched, limits)):
            return None
        tensors.append(m.norm.weight)
        if not linear_plan_args({"head": head}, "head", dtype, tensors, ints, watched, limits):
            return None
        plan = kernels.MTPPlan(tensors, ints, args.num_heads, args.num_kv_heads, args.head_dim, float(eps), pairs)
        return cls(mtp, plan, dtype, watched, min(limits) if limits else None, head)

    def __call__(self, h: torch.Tensor, token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """h [A, D], token_ids [A] → (the MTP's hidden [A, D], draft logits [A, Vd] fp32), or
        None where the modules must run."""
        if h.dtype != self.dtype or h.dim() != 2 or h.shape[0] == 0:
            return None
        if self.max_rows is not None and h.shape[0] > self.max_rows:
            return None
        if not watch_holds(*self._watch, self._hook_dicts):
            return None
        emb = self.mtp._shared["embed"](token_ids).to(h.dtype)  # as MTPModule.forward
        x, logits = self.plan.forward(h, emb)
        return x, logits.float()
