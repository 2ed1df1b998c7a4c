"""Fused projections for inference: q/k/v → one `qkv_proj`, gate/up → one `gate_up_proj`.

A decode step on CPU is mostly per-call overhead once the weights are small (int8/int4): the
three attention input projections and the two MLP input projections read the same x, so one
Linear over their stacked rows does the same arithmetic in two calls instead of five, and the
rotary embedding then runs once over q and k together. Each output element is the same dot
product as before (rows are stacked, K is untouched).

Float linears are stacked by concatenating weights (and biases). Quantized ones are stacked from
their codes and per-row scales / zero points, which is exact when they share one scheme: the same
weight args (channel or group strategy: per-row qparams; block strategy: per block row, where every
member but the last ends on a block boundary; per tensor: one scale, the same in every member, as
quantize writes the Linears of one input), the same input args and static input
scale (a8w8's q/k/v read the same smoothed input, so their calibrated scales agree) and, for
NVFP4, the same global scales (quantize gives the Linears of one input one). Otherwise
the layer is left unfused. The stacked module replaces the originals (set to None), so memory is
unchanged; `model_zoo.llama` uses it when present. It runs before a backend rewrites the float
linears (`infer.backend.prepare`). Quantizers never see fused models: they load checkpoints
through `model_zoo`, not through `load_for_inference`.
"""

from __future__ import annotations

import torch
from torch import nn

from quantspec.infer.dispatch import LinearKind
from quantspec.infer.quant_linear import QuantLinear
from quantspec.infer.transformed import TransformedLinear, stack_transformed
from quantspec.model_zoo.checkpoint import release_free_heap
from quantspec.model_zoo.llama import MLP
from quantspec.quant.compressed import QuantizedLinearTensors

__all__ = ["fuse_mlps", "fuse_projections", "stack_linears"]


def _same_tensor(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return a.shape == b.shape and bool(torch.equal(a, b))


def _stack_quant(mods: list[QuantLinear]) -> QuantLinear | None:
    first = mods[0]
    w = first.weight_args
    per_tensor = w.strategy not in ("channel", "group", "tensor_group", "block")
    if w.strategy == "block" and any(m.out_features % w.block_structure[0] for m in mods[:-1]):
        return None  # block rows stack only where each member ends on a block boundary
    if per_tensor and not all(_same_tensor(m.weight_scale, first.weight_scale)
                              and _same_tensor(m.weight_zero_point, first.weight_zero_point) for m in mods[1:]):
        return None  # one scale per tensor: stacked only where the members share it
    for m in mods[1:]:
        if (m.weight_args != w or m.input_args != first.input_args or m.dtype != first.dtype
                or m.input_bound != first.input_bound
                or m.in_features != first.in_features or m.traits.kind is not first.traits.kind
                or not _same_tensor(m.input_scale, first.input_scale)
                or not _same_tensor(m.input_zero_point, first.input_zero_point)
                or not _same_tensor(m.weight_global_scale, first.weight_global_scale)
                or not _same_tensor(m.input_global_scale, first.input_global_scale)
                or (m.bias is None) != (first.bias is None)):
            return None
    codes = []
    for m in mods:
        c = m.codes()
        if first.traits.kind in (LinearKind.FP8, LinearKind.FP4):
            c = c.to(torch.float8_e4m3fn)  # the fp8 codes upcast exactly on CPU; back to fp8
        codes.append(c)
    zps = [m.weight_zero_point for m in mods]
    q = torch.cat(codes)
    del codes  # the members' unpacked codes: only the stacked ones stay while it is packed
    t = QuantizedLinearTensors(
        q=q, scale=first.weight_scale if per_tensor else torch.cat([m.weight_scale for m in mods]),
        zero_point=None if zps[0] is None else zps[0] if per_tensor else torch.cat(zps),
        weight_args=w, input_args=first.input_args, input_scale=first.input_scale,
        input_zero_point=first.input_zero_point,
        bias=None if first.bias is None else torch.cat([m.bias for m in mods]).float(),
        global_scale=first.weight_global_scale, input_global_scale=first.input_global_scale,
    )
    device = first.weight_scale.device
    name = first.name.rsplit(".", 1)[0] + ".fused" if first.name else ""
    fused = QuantLinear(t, dtype=first.dtype, device=device, policy=first.policy, name=name)
    fused.input_bound = first.input_bound
    return fused


def _stack_float(mods: list[nn.Linear]) -> nn.Linear | None:
    first = mods[0]
    if any(type(m) is not nn.Linear or m.weight.dtype != first.weight.dtype
           or m.in_features != first.in_features or (m.bias is None) != (first.bias is None) for m in mods):
        return None
    out = sum(m.out_features for m in mods)
    fused = nn.Linear(first.in_features, out, bias=first.bias is not None,
                      device="meta", dtype=first.weight.dtype)
    fused.weight = nn.Parameter(torch.cat([m.weight.detach() for m in mods]), requires_grad=False)
    if first.bias is not None:
        fused.bias = nn.Parameter(torch.cat([m.bias.detach() for m in mods]), requires_grad=False)
    return fused


def stack_linears(mods: list[nn.Module]) -> nn.Module | None:
    """One module computing `cat([m(x) for m in mods], -1)`, or None when they cannot be stacked."""
    if all(isinstance(m, TransformedLinear) for m in mods):  # run-time transforms around them
        return stack_transformed(mods, stack_linears)
    if all(isinstance(m, QuantLinear) for m in mods):
        return _stack_quant(mods)
    if all(type(m) is nn.Linear for m in mods):
        return _stack_float(mods)
    return None


def _fuse_mlp(mlp: MLP) -> int:
    """Stack one MLP's gate/up in place → 1 when it was fused, else 0."""
    if mlp.gate_up_proj is None and mlp.gate_proj is not None:
        fused = stack_linears([mlp.gate_proj, mlp.up_proj])
        if fused is not None:
            mlp.gate_up_proj, mlp.gate_proj, mlp.up_proj = fused, None, None
            return 1
    return 0


def fuse_mlps(module: nn.Module) -> int:
    """Fuse the gate/up projections of every `MLP` below `module` (a draft head's) in place;
    returns how many."""
    return sum(_fuse_mlp(m) for m in list(module.modules()) if isinstance(m, MLP))


def fuse_projections(model: nn.Module) -> int:
    """Fuse every decoder layer's q/k/v and gate/up projections (every expert's of a mixture of
    experts) in place; returns how many groups were fused (two per dense layer when every layer
    qualifies)."""
    n = 0
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        if attn.qkv_proj is None and attn.q_proj is not None:
            fused = stack_linears([attn.q_proj, attn.k_proj, attn.v_proj])
            if fused is not None:
                attn.qkv_proj, attn.q_proj, attn.k_proj, attn.v_proj = fused, None, None, None
                n += 1
        n += _fuse_mlp(mlp) if isinstance(mlp, MLP) else fuse_mlps(mlp)  # a mixture of experts: each expert's
        release_free_heap()  # the originals' memory, between the stacked copies: no growth per layer
    return n
