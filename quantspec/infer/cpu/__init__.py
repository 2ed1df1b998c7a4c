"""The CPU backend: everything CPU-specific of the runtime, entered through `prepare`.

- `weights.py`: a quantized Linear's CPU layouts and paths (`CpuWeight`, built by `QuantLinear`);
- `linears.py`: float linears in packed layouts (`PackedLinear`, `PackedPairsLinear`, ...);
- `layers.py`: RMSNorm, rotary and silu*up on quantspec's kernels;
- `attention.py`: the paged-attention kernel of a cache (`CpuAttention`);
- `stack.py` / `mtp_step.py`: a model's decoder stack, an MTP module's draft step, in one C++ call
  (`csrc/plans.cpp`);
- `greedy.py`: exact greedy ids from a screen of the head (`GreedyHead`).

`prepare(model, device, policy)` rewrites a loaded `Transformer` or a bound `MTPModule` for the
CPU (modules replaced by name, parameters untouched) and returns the `Runtime` of what the engine
and the drafters plug in; `prepare_head(head, device)` rewrites a draft head (EAGLE-3, Medusa)
the same way. Where quantspec's CPU kernels are not built (or the policy keeps them out), it keeps
torch's ops.
"""

from __future__ import annotations

import torch
from torch import nn

from quantspec.infer.backend import Runtime
from quantspec.infer.cpu.attention import CpuAttention
from quantspec.infer.cpu.greedy import GreedyHead
from quantspec.infer.cpu.layers import use_cpu_layer_kernels
from quantspec.infer.cpu.linears import PackedInt8Linear, SkinnyLinear, all_linears_packed, pack_float_linears, skinny_linears
from quantspec.infer.cpu.mtp_step import CpuMTPStep
from quantspec.infer.cpu.stack import CpuLayerStack
from quantspec.infer.dispatch import DispatchPolicy
from quantspec.infer.fuse import fuse_mlps, fuse_projections
from quantspec.kernels import cpu as cg
from quantspec.model_zoo.mtp import MTPModule

__all__ = ["default_runtime", "prepare", "prepare_head"]


def _attention(policy: DispatchPolicy):
    return lambda cache: CpuAttention.for_cache(cache, pairs=policy.cpu_pairs)


def default_runtime(device: torch.device, policy: DispatchPolicy | None = None) -> Runtime:
    """The CPU's runtime for a model it did not prepare: its attention kernel (and the n-gram
    matchers) where quantspec's kernels are built."""
    policy = policy or DispatchPolicy()
    kernels = cg.cpu_kernels()
    ngram = None
    if kernels is not None:
        from quantspec.infer.spec.ngram import native_matchers

        ngram = native_matchers(kernels)
    return Runtime(device=device, attention=_attention(policy), ngram=ngram,
                   int8_head=None if kernels is None else PackedInt8Linear)


def _prepare_modules(model: nn.Module, policy: DispatchPolicy):
    """The rewriting both models share: float linears, small ops, packed layouts. → the extension
    when its kernels now serve the model, else None."""
    kernels = cg.cpu_kernels() if policy.cpu_kernels else None
    skinny_linears(model, kernels)
    if cg.cpu_kernels() is not None:  # the small ops' kernels, wherever the extension is built
        use_cpu_layer_kernels(model)
    if kernels is not None:
        pack_float_linears(model, pairs=bool(kernels.has_bf16_dot()))
    return kernels


def _draft_head(mtp: MTPModule) -> nn.Module:
    """The MTP's draft-vocabulary head op: the base head's rows (fp32) rounded per row to int8
    where the kernels are built (a quarter of the bytes to read each draft step; a draft is only a
    proposal), else a linear over the same tensor on the float-linear path."""
    head = mtp._shared["head"]  # [Vd, D]
    kernels = cg.cpu_kernels()
    if kernels is not None and head.dtype == torch.float32:
        return PackedInt8Linear(head)
    linear = nn.Linear(head.shape[1], head.shape[0], bias=False, device="meta", dtype=head.dtype)
    linear.weight = nn.Parameter(head, requires_grad=False)
    if head.dtype == torch.float32 or kernels is not None:
        return SkinnyLinear(linear, kernels)
    return linear


def prepare(model: nn.Module, device: torch.device, policy: DispatchPolicy, *, fuse: bool = True) -> Runtime:
    """Rewrite `model` for the CPU (`fuse`: q/k/v and gate/up stacked first) → its `Runtime`."""
    if fuse:
        fuse_projections(model)
    base = default_runtime(device, policy)
    if isinstance(model, MTPModule):
        head = _draft_head(model)
        _prepare_modules(model, DispatchPolicy())
        return Runtime(device=device, attention=base.attention, draft_head=head,
                       draft_step=CpuMTPStep.build(model, head, pairs=policy.cpu_pairs))
    kernels = _prepare_modules(model, policy)
    stack = greedy = None
    if kernels is not None:
        stack = CpuLayerStack.build(model, pairs=policy.cpu_pairs)
        greedy = GreedyHead.build(model)
    return Runtime(device=device, stack=stack, greedy=greedy, attention=base.attention, int8_head=base.int8_head,
                   ngram=base.ngram, packed_rows=all_linears_packed(model))


def prepare_head(head: nn.Module, device: torch.device, policy: DispatchPolicy | None = None) -> nn.Module:
    """Rewrite a draft head for the CPU as a model's layers are (`_prepare_modules`, gate/up
    stacked first): its fp32 / bf16 linears packed, its small ops on the kernels. → `head`."""
    fuse_mlps(head)
    _prepare_modules(head, policy or DispatchPolicy())
    return head
