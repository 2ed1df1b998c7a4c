"""SmoothQuant on a model from a calibration table, and the static input scales a8w8 uses.

This file owns the model-level side of SmoothQuant (Xiao et al. 2022, arXiv:2211.10438; the
per-tensor math — s = max|X|^α / max|W|^(1-α), folding into a norm / Linear — is in
`quant/smoothquant.py`) and the mapping "table + model (+ smoothing) → static input scale per
Linear" that `calib/ptq.py::quantize_model(..., input_scales=...)` consumes.

Smoothing groups per decoder layer (where X / s folds exactly into a preceding op):
    input_layernorm          → self_attn.q_proj, k_proj, v_proj   (γ / s)
    post_attention_layernorm → mlp.gate_proj, up_proj             (γ / s; Gemma: pre_feedforward_layernorm)
    self_attn.v_proj (output rows) → self_attn.o_proj              (AWQ only, `calib.awq`)
    mlp.up_proj (output rows) → mlp.down_proj                     (optional, `smooth_down`)
A sparse layer's post-attention norm feeds its router (and Qwen2-MoE's shared-expert gate), every
expert's gate / up and the shared expert's: its group lists them all, the router first (its
columns take s too, which keeps its logits), and each expert's up → down is a row fold of
its own. SmoothQuant leaves a sparse layer's MLP as it is; AWQ (`calib.awq`) scales it.
The last one is exact because down_proj reads silu(gate(x)) · up(x), which is linear in up's
output: dividing row j of up_proj's weight (and bias) by s_j divides down_proj's input channel j
by s_j (the pairing AWQ / llm-compressor use for `up_proj → down_proj`). It matters on real
models: SmolLM2's down_proj inputs carry "massive activations" (absmax ≈ 3.6e3 against a median
channel max of ≈ 2.5), which no per-tensor static int8 scale survives. o_proj (after attention)
is not smoothed and keeps its plain static scale. A layer whose blocks read the raw residual
(OLMo 2's post-norm layers: no norm before attention or the MLP) has only the last group.

After smoothing, a smoothed Linear sees X / s, whose per-channel absmax is the table's
`input_channel_absmax / s` (exact: dividing a channel by a positive constant divides its max by
it). Its per-tensor absmax is therefore max_j(channel_absmax_j / s_j), exact for the minmax
observer. For the percentile / mse observers (whose per-tensor value clips below the max) the
same clipping ratio is kept: absmax_smoothed = max_j(c_j / s_j) · (input_absmax / max_j c_j).
Scales are then derived by `quant.primitives.scale_from_absmax` (int8: /127.5, fp8: /448).

KV scales are unaffected by smoothing (the keys and values are the same function of the input).
"""

from __future__ import annotations

import os
from typing import Mapping

import torch
from torch import nn

from quantspec.calib.tables import ScaleTable, read_table
from quantspec.errors import QuantSpecError
from quantspec.model_zoo.checkpoint import CheckpointReader, resident
from quantspec.model_zoo.llama import MLP
from quantspec.model_zoo.moe import SparseMoE
from quantspec.quant.engines.moe import EXPERT
from quantspec.quant.primitives import scale_from_absmax
from quantspec.quant.smoothquant import (fold_into_linear, fold_into_norm, smoothquant_scales,
                                         weight_input_absmax)

__all__ = [
    "SMOOTH_GROUPS",
    "layer_mlps",
    "layer_norm_groups",
    "layer_smoothed_weights",
    "smoothed_weight",
    "layer_smoothing_factors",
    "moe_norm_readers",
    "row_factor",
    "row_folds",
    "smoothing_factors",
    "smoothed_weights",
    "smooth_layer",
    "smooth_model",
    "smoothed_input_absmax",
    "input_scales_for_model",
    "prepare_static_quant",
]

# (norm attribute of a decoder layer, the Linears that read its output)
SMOOTH_GROUPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
    ("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj")),
)
_KINDS = {"a8w8": "int8", "a8w8_fp8": "fp8"}


def layer_norm_groups(layer: nn.Module) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """`SMOOTH_GROUPS` of one decoder layer: none where the blocks read the raw residual (OLMo 2's
    post-norm layers); gate/up after `pre_feedforward_layernorm` where each block's output is
    normalized too (Gemma's four norms, which scale by 1 + weight: `fold_into_norm`); a sparse
    layer's MLP group is `moe_norm_readers`'."""
    if not getattr(layer, "pre_norms", True):
        return ()
    if getattr(layer, "post_norms", False):
        return SMOOTH_GROUPS[0], ("pre_feedforward_layernorm", SMOOTH_GROUPS[1][1])
    if isinstance(getattr(layer, "mlp", None), SparseMoE):
        return SMOOTH_GROUPS[0], (SMOOTH_GROUPS[1][0], moe_norm_readers(layer))
    return SMOOTH_GROUPS


def _relative_names(layer: nn.Module) -> dict[int, str]:
    return {id(mod): name for name, mod in layer.named_modules()}


def moe_norm_readers(layer: nn.Module) -> tuple[str, ...]:
    """The Linears (relative to the sparse decoder `layer`) that read its post-attention norm's
    output: the router, the shared-expert gate, then every expert's gate / up and the shared
    expert's, under the names the checkpoint uses (Mixtral's block_sparse_moe, w1 / w3)."""
    moe, name_of = layer.mlp, _relative_names(layer)
    floats = [moe.gate] + ([moe.shared_expert_gate] if moe.shared_expert_gate is not None else [])
    mlps = list(moe.experts) + ([moe.shared_expert] if moe.shared_expert is not None else [])
    return tuple(name_of[id(m)] for m in floats + [p for mlp in mlps for p in (mlp.gate_proj, mlp.up_proj)])


def layer_mlps(layer: nn.Module) -> list[tuple[str, str]]:
    """(up, down) names (relative to the decoder `layer`) of each of its MLPs: the dense one, or
    every expert's and the shared expert's."""
    name_of = _relative_names(layer)
    return [(name_of[id(m.up_proj)], name_of[id(m.down_proj)]) for m in layer.modules() if isinstance(m, MLP)]


def _layers(model) -> nn.ModuleList:
    try:
        return model.model.layers
    except AttributeError:
        raise QuantSpecError(f"smoothing needs a quantspec Transformer, got {type(model).__name__}") from None


def _check_alpha(alpha) -> float:
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0.0 <= alpha <= 1.0:
        raise QuantSpecError(f"smoothquant alpha={alpha!r} must be in [0, 1] (e.g. 0.5)")
    return float(alpha)


@torch.no_grad()
def layer_smoothing_factors(layer: nn.Module, prefix: str, table: ScaleTable,
                            alpha: float | Mapping[str, float], *, smooth_down: bool = True
                            ) -> dict[str, torch.Tensor]:
    """`smoothing_factors` of one decoder layer named `prefix` (e.g. "model.layers.3")."""
    per_group = isinstance(alpha, Mapping)
    factors: dict[str, torch.Tensor] = {}
    dense = isinstance(layer.mlp, MLP)  # a mixture of experts' inputs are not smoothed
    groups = [(lin_names, getattr(layer, norm_name).weight.shape) for norm_name, lin_names in layer_norm_groups(layer)
              if dense or lin_names[0].startswith("self_attn.")]
    if smooth_down and dense:
        groups.append((("mlp.down_proj",), None))
    for lin_names, norm_shape in groups:
        names = [f"{prefix}.{n}" for n in lin_names]
        a = alpha.get(names[0]) if per_group else alpha
        if a is None:
            continue
        weights = [layer.get_submodule(n).weight for n in lin_names]
        act = table.input_channel_absmax(names[0])  # [K]; all read the same tensor
        if act.shape != weights[0].shape[1:] or (norm_shape is not None and act.shape != norm_shape):
            raise QuantSpecError(f"{names[0]}: table has {tuple(act.shape)} channels but the "
                                 f"model has {tuple(weights[0].shape[1:])}; wrong table")
        s = smoothquant_scales(act.to(weights[0].device), weight_input_absmax(*weights), a)
        for n in names:
            factors[n] = s.detach().cpu().float()
    return factors


@torch.no_grad()
def smoothing_factors(model, table: ScaleTable, alpha: float | Mapping[str, float] = 0.5, *,
                      smooth_down: bool = True, weights: CheckpointReader | None = None
                      ) -> dict[str, torch.Tensor]:
    """{linear name: s [K] float32} that `smooth_model` would fold for these arguments, computed
    from the table and the (unsmoothed) weights without changing the model.

    `alpha`: one α for every group, or {first Linear of a group (q_proj, gate_proj, down_proj):
    α} per group (`calib.sensitivity.search_alphas`); a group missing from the mapping is not
    smoothed. Every factor depends only on its own group's weights (gate/up's s is taken before
    down_proj's s divides up_proj's rows), so any subset of groups can be smoothed alone.
    A model on the `meta` device is read one layer at a time from `weights`.
    """
    if isinstance(alpha, Mapping):
        alpha = {k: _check_alpha(v) for k, v in alpha.items()}
    else:
        alpha = _check_alpha(alpha)
    factors: dict[str, torch.Tensor] = {}
    for i, layer in enumerate(_layers(model)):
        prefix = f"model.layers.{i}"
        with resident(layer, prefix, weights):
            factors.update(layer_smoothing_factors(layer, prefix, table, alpha, smooth_down=smooth_down))
    return factors


def row_folds(layer: nn.Module) -> dict[str, str]:
    """{Linear whose output rows absorb 1 / s: the Linear reading them} of the decoder `layer`
    (relative names): v_proj → o_proj and every MLP's up → down (exact: down_proj reads
    act(gate) · up, o_proj reads attention's weighted sum of v, both linear in the row)."""
    return {"self_attn.v_proj": "self_attn.o_proj", **dict(layer_mlps(layer))}


def row_factor(layer: nn.Module, name: str, s: torch.Tensor) -> torch.Tensor:
    """The factor [N] that divides the output rows of `name` (a `row_folds` key) for its reader's
    column factor s [K]. v_proj → o_proj under grouped-query attention: o_proj's column (h, d)
    reads KV head h // (H / KV), so s must be equal across the query heads of a KV head (as
    `calib.awq` chooses it) and v_proj's row (g, d) takes that value."""
    if name != "self_attn.v_proj":
        return s
    attn = layer.self_attn
    H, KV, hd = attn.num_heads, attn.num_kv_heads, attn.head_dim
    grouped = s.view(KV, H // KV, hd)
    if not torch.equal(grouped, grouped[:, :1].expand_as(grouped)):
        raise QuantSpecError("an o_proj factor must be equal across the query heads that share a KV head")
    return grouped[:, 0].reshape(KV * hd)


@torch.no_grad()
def smoothed_weight(layer: nn.Module, prefix: str, factors: Mapping[str, torch.Tensor], name: str,
                    folds: Mapping[str, str] | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None] | None:
    """(weight [N, K] as `smooth_layer` leaves it, s of its input columns [K] or None, s of its
    output rows [N] or None) of the Linear `name` (relative, e.g. "mlp.up_proj") of the decoder
    layer `prefix`; None when `factors` leave it as it is. One Linear's copy at a time. `folds`:
    the layer's `row_folds`, when the caller has them."""
    folds = row_folds(layer) if folds is None else folds
    col = factors.get(f"{prefix}.{name}")  # factors are keyed by the Linears that read the scaled channels
    row = factors.get(f"{prefix}.{folds[name]}") if name in folds else None
    if row is not None:
        row = row_factor(layer, name, row)
    if col is None and row is None:
        return None
    w = layer.get_submodule(name).weight
    if col is not None:
        w = fold_into_linear(w, col.to(w.device))
    if row is not None:  # output row j / s_j: the γ / s rule of fold_into_norm, applied per row
        ct = torch.promote_types(w.dtype, torch.float32)
        w = (w.to(ct) / row.to(w.device, ct)[:, None]).to(w.dtype)
    return w, col, row


@torch.no_grad()
def layer_smoothed_weights(layer: nn.Module, prefix: str, factors: Mapping[str, torch.Tensor],
                           folds: Mapping[str, str] | None = None
                           ) -> dict[str, tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]]:
    """`smoothed_weights` of one decoder layer named `prefix` (`smoothed_weight` of each Linear);
    `folds`: the layer's `row_folds`, when the caller has them."""
    out, folds = {}, row_folds(layer) if folds is None else folds
    for n, mod in layer.named_modules():
        w = smoothed_weight(layer, prefix, factors, n, folds) if isinstance(mod, nn.Linear) else None
        if w is not None:
            out[f"{prefix}.{n}"] = w
    return out


def smoothed_weights(model, factors: Mapping[str, torch.Tensor]
                     ) -> dict[str, tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]]:
    """{linear name: (weight [N, K] as `smooth_model` leaves it, s of its input columns [K] or
    None, s of its output rows [N] or None)} for every Linear that smoothing with `factors`
    (`smoothing_factors`) changes; the model is not modified. Column j is multiplied by s_j;
    up_proj's (v_proj's) row j is divided by down_proj's (o_proj's) s_j (`row_factor`)."""
    out = {}
    for i, layer in enumerate(_layers(model)):
        out.update(layer_smoothed_weights(layer, f"model.layers.{i}", factors))
    return out


@torch.no_grad()
def smooth_layer(layer: nn.Module, prefix: str, factors: Mapping[str, torch.Tensor]) -> None:
    """Fold `factors` (`smoothing_factors`, keyed by full Linear names) into the decoder layer
    named `prefix` in place: each norm's γ (and the output rows and bias of each `row_folds`
    source) divided by s, the Linears reading it with their input columns multiplied by s
    (`layer_smoothed_weights`)."""
    folds = row_folds(layer)
    weights = layer_smoothed_weights(layer, prefix, factors, folds)
    for norm_name, lin_names in layer_norm_groups(layer):
        s = factors.get(f"{prefix}.{lin_names[0]}")
        if s is not None:
            norm = getattr(layer, norm_name)
            norm.weight.copy_(fold_into_norm(norm.weight, s.to(norm.weight.device),
                                             unit_offset=getattr(norm, "unit_offset", False))[0])
    for name, reader in folds.items():
        s = factors.get(f"{prefix}.{reader}")
        bias = layer.get_submodule(name).bias if s is not None else None
        if bias is not None:
            bias.copy_(fold_into_norm(bias, row_factor(layer, name, s).to(bias.device))[0])
    for name, (w, _, _) in weights.items():
        layer.get_submodule(name[len(prefix) + 1:]).weight.copy_(w)


@torch.no_grad()
def smooth_model(model, table: ScaleTable, alpha: float | Mapping[str, float] = 0.5, *,
                 smooth_down: bool = True) -> dict[str, torch.Tensor]:
    """Apply SmoothQuant in place; returns {linear name: s [K]} for every smoothed Linear
    (`smoothing_factors`, same arguments).

    The model computes the same function afterwards (up to float rounding): see `smooth_layer`.
    """
    factors = smoothing_factors(model, table, alpha, smooth_down=smooth_down)
    for i, layer in enumerate(_layers(model)):
        smooth_layer(layer, f"model.layers.{i}", factors)
    return factors


def smoothed_input_absmax(table: ScaleTable, linear: str, s: torch.Tensor | None) -> torch.Tensor:
    """The per-tensor absmax (0-d) of `linear`'s input after dividing it by s [K] (or as is)."""
    absmax = table.input_absmax(linear).float().reshape(())
    if s is None:
        return absmax
    ch = table.input_channel_absmax(linear).float()  # [K]
    if s.shape != ch.shape:
        raise QuantSpecError(f"{linear}: smoothing factor has shape {tuple(s.shape)}, the table "
                             f"{tuple(ch.shape)}")
    ch_max = ch.amax()
    clip = absmax / ch_max if float(ch_max) > 0 else torch.ones(())  # observer's clipping ratio
    return (ch / s.float()).amax() * clip


def input_scales_for_model(table: ScaleTable, model, quant_type: str,
                           smooth: Mapping[str, torch.Tensor] | None = None
                           ) -> dict[str, torch.Tensor]:
    """{linear name: static input scale [1] float32} for every decoder Linear of `model`.

    quant_type "a8w8" → int8 scales (absmax / 127.5), "a8w8_fp8" → fp8 (absmax / 448).
    `smooth` is `smooth_model`'s return value when SmoothQuant was applied (see module docstring).
    The Linears of one smoothing group (q/k/v; gate/up) get one scale, the group's largest.
    """
    qt = getattr(quant_type, "value", quant_type)
    if qt not in _KINDS:
        raise QuantSpecError(f"static input scales are for a8w8 / a8w8_fp8, not {qt!r}")
    kind = _KINDS[qt]
    table.check_model(model)
    smooth = smooth or {}
    out = {}
    for name, mod in model.named_modules():
        if isinstance(mod, nn.Linear) and name.startswith("model.layers."):
            out[name] = scale_from_absmax(smoothed_input_absmax(table, name, smooth.get(name)), kind)
    return shared_group_scales(out)


def shared_group_scales(scales: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`scales` with every smoothing group's Linears at the group's largest scale.

    vLLM and SGLang fuse q/k/v into one qkv_proj and gate/up into one gate_up_proj, and vLLM's
    static int8 layer keeps one input_scale for the fused layer (the last shard's it loads): a
    shard written with another scale would run with the wrong one. The group's Linears read one
    tensor, so their observed ranges agree and the largest is each one's own scale; taking it
    makes the artifact's shared value explicit rather than a coincidence of the observer. A
    mixture of experts is one fused layer in those engines, with one input scale for all its
    experts' gate/up and one for their down projections (vLLM takes the largest): so here too."""
    prefixes = {n.rsplit(".", 2)[0] for n in scales}
    groups = [[f"{prefix}.{n}" for n in names if f"{prefix}.{n}" in scales]
              for prefix in prefixes for _, names in SMOOTH_GROUPS]
    experts: dict[str, list[str]] = {}  # a mixture of experts': one scale per layer for gate/up, one for down
    for n in scales:
        m = EXPERT.match(n)
        if m is not None:
            experts.setdefault(f"{m.group(1)}/{'down' if m.group(3) in ('down_proj', 'w2') else 'gate_up'}",
                               []).append(n)
    for members in [*groups, *experts.values()]:
        if len(members) > 1:
            top = torch.stack([scales[m].reshape(()) for m in members]).amax()
            for m in members:
                scales[m] = top.reshape(scales[m].shape).clone()
    return scales


def prepare_static_quant(model, calib: str | os.PathLike, model_dir: str | os.PathLike,
                         quant_type: str, smoothquant_alpha: float | None = None
                         ) -> tuple[dict[str, torch.Tensor], ScaleTable]:
    """One call for `api.quantize` with a8w8 / a8w8_fp8: read `calib` (checked against the model's
    fingerprint and layers), smooth `model` in place when `smoothquant_alpha` is given, and
    return (input scales per Linear, the table)."""
    qt = getattr(quant_type, "value", quant_type)
    if calib is None:
        raise QuantSpecError(f"{qt} needs static activation scales: run `quantspec calibrate` and "
                             "pass --calib DIR")
    table = read_table(calib, model_dir=model_dir)
    table.check_model(model)
    factors = smooth_model(model, table, smoothquant_alpha) if smoothquant_alpha is not None else None
    return input_scales_for_model(table, model, qt, smooth=factors), table
