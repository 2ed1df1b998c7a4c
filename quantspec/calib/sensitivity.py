"""Measured choices for static-scale quantization: per-group SmoothQuant α search and the
sensitivity-based mixed-precision fallback (a8w8 → W8A16 for the few worst fused units).

This file owns four things, all driven by calibration data through `calib.runner`:

- **α search** (per smoothing group, like llm-compressor's AutoSmooth / SmoothQuant+): for each
  group of `calib.smooth` (input_layernorm → q/k/v, post_attention_layernorm → gate/up,
  up_proj → down_proj) pick α from a grid minimising the group's *output* error under static
  fake quantization, on the float model's inputs to that group:
      err(α) = mean over Linears i and tokens t of ||ŷ_it − y_it||² / ||y_it||²,
      ŷ_i = fq(X / s_α) · fq(W_i · s_α)ᵀ,  y_i = X · W_iᵀ
  (per-token relative, see `static_linear_error`) with s_α = max|X_j|^α / max|W_j|^(1−α) from
  the *table's* per-channel absmax (exactly what
  `smooth_model` will fold) and the static input scale the artifact will carry
  (`calib.smooth.smoothed_input_absmax` → `scale_from_absmax`). fq(X) is per-tensor static
  int8 / fp8; fq(W) per-output-channel int8 / fp8 (`quant.primitives`).
- **sensitivity**: the error a fallback would remove, i.e. each Linear's per-token relative
  output MSE of static activation quantization given its quantized weight,
  mean_t ||fq(x_t)·Ŵᵀ − x_t·Ŵᵀ||² / ||x_t·Ŵᵀ||²
  (Ŵ = fq(W), which a W8A16 fallback keeps), on calibration inputs to the (already smoothed)
  float model, layer by layer. Scoring the whole error instead would rank fp8 layers by their
  (unremovable) E4M3 weight rounding.
- **fused units**: vLLM and SGLang fuse q/k/v of one attention into `qkv_proj` and gate/up of
  one MLP into `gate_up_proj`, and ignore a fallback that covers only some shards of a fused
  layer. So the fallback is chosen per unit — q/k/v together, gate/up together, o_proj and
  down_proj alone (`FUSED_UNITS`) — a unit's error being its worst member's, and
  `with_fallback_layers` refuses a partial unit.
- **fallback**: the units with the largest measured error — the `n` worst, every one above a
  threshold, or (the default, `calib.budget`) the fewest that keep what static activations add
  to the held-back perplexity within an error budget — keep float activations (int8 / fp8 weight-only, i.e. W8A16) in a
  config group of their own, so the artifact stays a valid compressed-tensors
  `mixed-precision` checkpoint that transformers / vLLM load. A fallback unit is not smoothed:
  its activations stay float, and smoothing would only make its weights harder to quantize
  (on the default model, W8A16 everywhere: +0.8% perplexity unsmoothed, +2.5% smoothed). The
  artifact's provenance lists the units, their errors and the rule that chose them.
"""

from __future__ import annotations

import dataclasses
import re
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence

import torch
from torch import nn

from quantspec.calib.budget import BudgetSearch, fallback_under_budget
from quantspec.calib.ptq import SHARED_INPUT_GROUPS
from quantspec.calib.runner import DEFAULT_BATCH_SIZE, LayerStep, run_layers
from quantspec.calib.smooth import (SMOOTH_GROUPS, input_scales_for_model, smooth_layer,
                                    smoothing_factors)
from quantspec.calib.tables import ScaleTable
from quantspec.errors import QuantSpecError
from quantspec.model_zoo.checkpoint import CheckpointReader
from quantspec.quant.args import QuantArgs
from quantspec.quant.config import QuantConfig
from quantspec.quant.scheme import QuantScheme
from quantspec.quant.engines import fused_targets
from quantspec.quant.primitives import (choose_qparams, fake_quantize, scale_from_absmax,
                                        static_args)
from quantspec.quant.smoothquant import smoothquant_scales, weight_input_absmax

__all__ = [
    "ALPHA_GRID",
    "DOWN_GROUP",
    "FUSED_UNITS",
    "StaticQuantPlan",
    "fake_quant_weight",
    "static_linear_error",
    "group_alpha_errors",
    "search_alphas",
    "linear_sensitivity",
    "fused_unit",
    "rank_units",
    "select_fallback",
    "with_fallback_layers",
    "plan_static_quant",
]

ALPHA_GRID = (0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95)
# tokens per group (α search) / per mini-batch (sensitivity) whose outputs are compared, taken
# evenly strided; the cost is linear in it (each α candidate is a fake-quant matmul over every
# Linear of the group), and the static scales themselves still come from the full table
MAX_ROWS = 2048
DOWN_GROUP = ("mlp.down_proj",)  # the up_proj → down_proj smoothing group (relative names)
_KINDS = {"a8w8": "int8", "a8w8_fp8": "fp8"}
FALLBACK_GROUP = "fallback_w8a16"
# the Linears vLLM / SGLang fuse into one layer (relative to a decoder layer): exactly those that
# read one input, which is how GPTQ groups them too
FUSED_UNITS = SHARED_INPUT_GROUPS
_LAYER_NAME = re.compile(r"^(model\.layers\.\d+)\.(.+)$")


def _weight_args(kind: str) -> QuantArgs:
    return QuantArgs(num_bits=8, type="int" if kind == "int8" else "float", symmetric=True,
                     strategy="channel")


@torch.no_grad()
def fake_quant_weight(w: torch.Tensor, kind: str) -> torch.Tensor:
    """w [N, K] → per-output-channel symmetric int8 / fp8 fake-quantized copy (float32)."""
    if w.ndim != 2:
        raise QuantSpecError(f"fake_quant_weight: w must be [N, K], got {tuple(w.shape)}")
    args = _weight_args(kind)
    w = w.float()
    scale, zp = choose_qparams(w, args)
    return fake_quantize(w, scale, zp, args)


@torch.no_grad()
def static_linear_error(x: torch.Tensor, weights: Sequence[torch.Tensor], input_scale: torch.Tensor,
                        kind: str, *, x_ref: torch.Tensor | None = None,
                        weights_ref: Sequence[torch.Tensor] | None = None,
                        y_ref: Sequence[torch.Tensor] | None = None) -> tuple[float, float]:
    """(Σ_i Σ_t ||ŷ_t − y_t||² / ||y_t||², number of (i, t) terms) over `weights` [N_i, K] for
    x [T, K]: the error is relative *per token*, so that their ratio is the mean per-token
    relative error.

    ŷ = fq(x, input_scale) · fq(W)ᵀ (static per-tensor input, per-channel weights); the reference
    y = x_ref · W_refᵀ (defaults: x, weights — pass the unsmoothed pair to score a smoothing), or
    the given outputs y_ref [T, N_i] (computed once when scoring many candidates).
    Why per token: SmolLM2-like models have a few tokens with massive activations (absmax ~10³
    vs ~2); a plain Σ||ŷ − y||² / Σ||y||² is dominated by those tokens and hides that a static
    scale sized for them rounds every ordinary token coarsely.
    """
    if x.ndim != 2:
        raise QuantSpecError(f"static_linear_error: x must be [T, K], got {tuple(x.shape)}")
    x = x.float()
    xq = fake_quantize(x, input_scale.float().reshape(1).to(x.device), None, static_args(kind))  # [T, K]
    xr = x if x_ref is None else x_ref.float()
    wr = weights if weights_ref is None else weights_ref
    err = ref = 0.0
    for i, (w, w0) in enumerate(zip(weights, wr)):
        y = xr @ w0.float().T if y_ref is None else y_ref[i]  # [T, N]
        yq = xq @ fake_quant_weight(w, kind).T
        per_tok = (yq - y).pow(2).sum(dim=1) / y.pow(2).sum(dim=1).clamp(min=1e-30)  # [T]
        err += float(per_tok.sum())
        ref += float(y.shape[0])
    return err, ref


@torch.no_grad()
def group_alpha_errors(x: torch.Tensor, weights: Sequence[torch.Tensor],
                       channel_absmax: torch.Tensor, kind: str, alphas: Iterable[float] = ALPHA_GRID,
                       clip: float = 1.0) -> dict[float, tuple[float, float]]:
    """{α: (Σ err, Σ ref)} of one smoothing group; x [T, K] is the group's unsmoothed input,
    weights [N_i, K] the unsmoothed Linears reading it, channel_absmax [K] the table's max|X_j|.

    The static input scale for α is scale_from_absmax(max_j(c_j / s_j) · clip) — clip is the
    table's per-tensor / per-channel-max ratio (1 for minmax), as `smoothed_input_absmax` does.
    """
    w_absmax = weight_input_absmax(*weights)  # [K]
    x = x.float()
    y_ref = [x @ w.float().T for w in weights]  # [T, N_i], the same for every α
    out = {}
    for a in alphas:
        s = smoothquant_scales(channel_absmax, w_absmax, float(a))  # [K]
        absmax = (channel_absmax.float() / s).amax() * clip
        scale = scale_from_absmax(absmax, kind)
        out[float(a)] = static_linear_error(x / s, [w.float() * s for w in weights], scale, kind,
                                            y_ref=y_ref)
    return out


def _groups(prefix: str) -> list[tuple[str, ...]]:
    """The smoothing groups of one decoder layer, as full Linear names."""
    return [tuple(f"{prefix}.{n}" for n in names) for _, names in SMOOTH_GROUPS] + \
        [tuple(f"{prefix}.{n}" for n in DOWN_GROUP)]


def _sample_rows(x: torch.Tensor, max_rows: int) -> torch.Tensor:
    """x [..., K] → [≤ max_rows, K], evenly strided (deterministic)."""
    x = x.reshape(-1, x.shape[-1])
    if x.shape[0] <= max_rows:
        return x
    idx = torch.linspace(0, x.shape[0] - 1, max_rows).round().long()
    return x[idx]


@torch.no_grad()
def search_alphas(model, table: ScaleTable, input_ids: torch.Tensor, kind: str, *,
                  alphas: Iterable[float] = ALPHA_GRID, max_rows: int = MAX_ROWS,
                  batch_size: int = DEFAULT_BATCH_SIZE, smooth_down: bool = True,
                  weights: CheckpointReader | None = None, device=None
                  ) -> tuple[dict[str, float], dict[str, dict[float, float]]]:
    """Per-group α minimising the group's static fake-quant output error (module docstring).

    Runs the float model layer by layer over input_ids [n, S] (not modified; on `meta`, read
    from `weights` one layer at a time onto `device`). Returns
    ({first Linear of each group: best α}, {same key: {α: relative error}}).
    The inputs of a group are gathered over all mini-batches (≤ max_rows rows, strided).
    """
    alphas = tuple(float(a) for a in alphas)
    if not alphas or any(not 0.0 <= a <= 1.0 for a in alphas):
        raise QuantSpecError(f"alpha grid {alphas} must be non-empty values in [0, 1]")
    best: dict[str, float] = {}
    errors: dict[str, dict[float, float]] = {}
    state: dict = {}

    def before(step: LayerStep):
        groups = _groups(step.name)
        if not smooth_down:
            groups = groups[:-1]
        bufs: dict[str, list[torch.Tensor]] = {g[0]: [] for g in groups}
        handles = []
        for g in groups:
            head = step.layer.get_submodule(g[0][len(step.name) + 1:])
            handles.append(head.register_forward_pre_hook(
                lambda m, args, _k=g[0]: bufs[_k].append(args[0].detach().reshape(-1, args[0].shape[-1]))))
        state["bufs"], state["groups"] = bufs, groups

        def cleanup():
            for h in handles:
                h.remove()
        return cleanup

    def after(step: LayerStep):
        bufs = state.pop("bufs")
        for g in state.pop("groups"):
            x = _sample_rows(torch.cat(bufs.pop(g[0])), max_rows)  # [T, K]
            ws = [step.layer.get_submodule(n[len(step.name) + 1:]).weight for n in g]
            ch = table.input_channel_absmax(g[0]).float().to(x.device)  # [K]
            t = table.input_absmax(g[0]).float()
            clip = float(t / ch.amax()) if float(ch.amax()) > 0 else 1.0
            errs = group_alpha_errors(x, ws, ch, kind, alphas, clip)
            rel = {a: e / max(r, 1e-30) for a, (e, r) in errs.items()}
            errors[g[0]] = rel
            best[g[0]] = min(rel, key=lambda a: (rel[a], a))

    run_layers(model, input_ids, before=before, after=after, batch_size=batch_size, **_streamed(weights, device))
    return best, errors


@torch.no_grad()
def linear_sensitivity(model, input_ids: torch.Tensor, input_scales: Mapping[str, torch.Tensor],
                       kind: str, *, smooth: Mapping[str, torch.Tensor] | None = None,
                       batch_size: int = DEFAULT_BATCH_SIZE, max_rows: int = MAX_ROWS,
                       weights: CheckpointReader | None = None, device=None) -> dict[str, float]:
    """{Linear name: mean_t ||fq(x_t)·Ŵᵀ − x_t·Ŵᵀ||² / ||x_t·Ŵᵀ||²} of each decoder Linear in
    `input_scales`:
    the output error of static per-tensor input quantization (its scale) given the per-channel
    quantized weight Ŵ, on the float model's own inputs over input_ids [n, S] (≤ max_rows
    strided tokens per mini-batch). With `smooth` {linear: s [K]} (`calib.smooth.
    smoothing_factors`) those Linears are scored as if smoothed: x / s and W · s, in the model's
    own output units (up_proj's rows are not divided by down_proj's factor, which down_proj
    undoes). The model is not modified (on `meta`: read from `weights` one layer at a time)."""
    smooth = smooth or {}
    sums: dict[str, list[float]] = {}

    def before(step: LayerStep):
        handles = []
        for sub, mod in step.layer.named_modules():
            full = f"{step.name}.{sub}"
            if isinstance(mod, nn.Linear) and full in input_scales:
                def hook(m, args, _n=full):
                    x, w = _sample_rows(args[0], max_rows), m.weight
                    s = smooth.get(_n)
                    if s is not None:
                        s = s.to(x.device)
                        x, w = x / s, w * s
                    wq = fake_quant_weight(w, kind)
                    e, r = static_linear_error(x, [w], input_scales[_n], kind, weights_ref=[wq])
                    acc = sums.setdefault(_n, [0.0, 0.0])
                    acc[0] += e
                    acc[1] += r
                handles.append(mod.register_forward_pre_hook(hook))

        def cleanup():
            for h in handles:
                h.remove()
        return cleanup

    run_layers(model, input_ids, before=before, batch_size=batch_size, **_streamed(weights, device))
    return {n: e / max(r, 1e-30) for n, (e, r) in sums.items()}


def _streamed(weights: CheckpointReader | None, device) -> dict:
    """The runner's arguments that read a meta model from `weights` (float32, on `device`)."""
    return {} if weights is None else {"weights": weights, "device": device, "dtype": torch.float32}


def fused_unit(name: str, among: Iterable[str] | None = None) -> tuple[str, ...]:
    """The Linears fused with `name` into one engine layer (`FUSED_UNITS`), `name` included, in
    unit order; `among` keeps only those names (e.g. the Linears a config quantizes). A Linear
    outside the units (or outside the decoder layers) is a unit of its own.

    Example: "model.layers.3.self_attn.k_proj" → (q_proj, k_proj, v_proj of model.layers.3).
    """
    m = _LAYER_NAME.match(name)
    unit = (name,)
    if m is not None:
        for names in FUSED_UNITS:
            if m.group(2) in names:
                unit = tuple(f"{m.group(1)}.{n}" for n in names)
                break
    if among is not None:
        keep = set(among) | {name}
        unit = tuple(n for n in unit if n in keep)
    return unit


def rank_units(errors: Mapping[str, float]) -> list[tuple[tuple[str, ...], float]]:
    """[(fused unit, its error)], largest error first (ties by name): each unit's members among
    the Linears of `errors`, its error the largest of theirs.

    Example: {"model.layers.0.self_attn.q_proj": 0.1, ...k_proj: 0.3, ...v_proj: 0.2,
    "model.layers.0.mlp.down_proj": 0.25} → [((q, k, v), 0.3), ((down,), 0.25)].
    """
    units: dict[tuple[str, ...], float] = {}
    for n in errors:
        u = fused_unit(n, among=errors)
        units[u] = max(units.get(u, float("-inf")), float(errors[n]))
    return sorted(units.items(), key=lambda ue: (-ue[1], ue[0]))


def select_fallback(errors: Mapping[str, float], num_units: int = 0,
                    threshold: float | None = None) -> list[str]:
    """The Linears to keep at float activations, as whole fused units (`rank_units` of the
    per-Linear `errors`): the `num_units` units with the largest error, plus every unit with a
    member above `threshold` (when given); units by error, largest first.

    Example: errors {"a": 0.1, "b": 0.3, "c": 0.2}, num_units=2 → ["b", "c"] (names outside the
    decoder layers are units of one); {"model.layers.0.self_attn.q_proj": 0.1, ...k_proj: 0.3,
    ...v_proj: 0.2, "model.layers.0.mlp.down_proj": 0.25}, 1 → [q_proj, k_proj, v_proj].
    """
    if isinstance(num_units, bool) or not isinstance(num_units, int) or num_units < 0:
        raise QuantSpecError(f"fallback layers {num_units!r} must be an int >= 0")
    ranked = rank_units(errors)
    chosen = [u for u, _ in ranked[:num_units]]
    if threshold is not None:
        chosen += [u for u, e in ranked[num_units:] if e > threshold]
    return [n for u in chosen for n in u]


def with_fallback_layers(config: QuantConfig, names: Iterable[str]) -> QuantConfig:
    """`config` with `names` moved to a name-targeted group of the same weights and no input
    activations (weight-only: W8A16 for a8w8, FP8 weight-only for a8w8_fp8). Exact names outrank
    the base group's class target in every compressed-tensors loader.

    `names` must be whole fused units (`fused_unit`, among the Linears the config quantizes):
    vLLM and SGLang ignore a fallback that covers only some shards of a fused layer, so a
    partial one is refused rather than written.
    """
    names = sorted(set(names))
    if not names:
        return config
    base = None
    for n in names:
        s = config.scheme_for(n)
        if s is None or s.weights is None:
            raise QuantSpecError(f"fallback layer {n!r} is not quantized by this config")
        if base is not None and s is not base:
            raise QuantSpecError("fallback layers must all belong to one config group")
        base = s
        missing = [m for m in fused_unit(n) if m not in names and config.scheme_for(m) is not None]
        if missing:
            raise QuantSpecError(f"fallback layer {n!r} without {', '.join(missing)}: vLLM and SGLang "
                                 "fuse them into one layer and ignore a partial fallback; fall back "
                                 "the whole unit")
    groups = OrderedDict(config.config_groups)
    if FALLBACK_GROUP in groups:
        raise QuantSpecError(f"config already has a {FALLBACK_GROUP!r} group")
    # weight-only: W8A16 as 8-bit pack-quantized (int weights) or FP8 weight-only; whole fused
    # units as one regex that names the fused layer too (SGLang matches it before class names)
    groups[FALLBACK_GROUP] = QuantScheme(targets=fused_targets(names), weights=base.weights,
                                         input_activations=None)
    return dataclasses.replace(config, config_groups=groups, format=None)


@dataclass
class StaticQuantPlan:
    """What `plan_static_quant` decided: static input scales (smoothed model), the α applied per
    smoothing group (None = no SmoothQuant; {"*": α} = one α everywhere), the smoothing factors
    that applies ({Linear: s [K]}, `calib.smooth`), the fallback Linears (whole fused units)
    with the rule and measurements behind them."""

    input_scales: dict[str, torch.Tensor]
    alphas: dict[str, float] | None
    fallback: list[str]
    factors: dict[str, torch.Tensor] = field(default_factory=dict)
    sensitivity: dict[str, float] = field(default_factory=dict)
    alpha_errors: dict[str, dict[float, float]] = field(default_factory=dict)
    fallback_units: list[tuple[tuple[str, ...], float]] = field(default_factory=list)
    rule: dict = field(default_factory=lambda: {"by": "none"})
    budget: BudgetSearch | None = None

    def summary(self, num_linears: int | None = None) -> dict:
        """JSON-able provenance: α per group, the fallback rule, the units it chose with their
        measured errors, and (budget rule) the held-back measurements."""
        n = num_linears if num_linears is not None else len(self.input_scales)
        return {
            "smoothquant_alphas": self.alphas,
            "fallback_rule": dict(self.rule),
            "fallback_layers": list(self.fallback),
            "fallback_units": [{"linears": list(u), "error": round(e, 6)} for u, e in self.fallback_units],
            "held_back": None if self.budget is None else self.budget.summary(),
            "static_activation_linears": n - len(self.fallback),
            "static_activation_fraction": round(1 - len(self.fallback) / max(n, 1), 4),
        }


@torch.no_grad()
def plan_static_quant(model, table: ScaleTable, quant_type: str, *,
                      smoothquant_alpha: float | str | None = None,
                      input_ids: torch.Tensor | None = None, fallback_layers: int = 0,
                      fallback_threshold: float | None = None,
                      fallback_budget: float | None = None,
                      holdout_ids: torch.Tensor | None = None,
                      weight_args: QuantArgs | None = None,
                      alphas: Iterable[float] = ALPHA_GRID,
                      batch_size: int = DEFAULT_BATCH_SIZE,
                      weights: CheckpointReader | None = None, device=None) -> StaticQuantPlan:
    """Choose SmoothQuant α (fixed, or `"auto"` = per-group search) and the fallback units, then
    smooth `model` in place — every group but the fallback units' — and return the plan (input
    scales for the smoothed model, and the factors applied). A model on `meta` is measured one
    layer at a time from `weights` (onto `device`) and left as it is: the quantizer folds
    `plan.factors` into each layer as it reads it (`calib.ptq.quantize_model(smooth=)`).

    Fallback, one rule: `fallback_layers` = the n fused units with the largest measured error
    and / or every unit with a Linear above `fallback_threshold`; or `fallback_budget` = the
    fewest units that keep the held-back perplexity over holdout_ids [m, S] within that many
    percent of the weight-only model's (`calib.budget`; a budget that leaves no static
    activation raises).
    input_ids [n, S] (calibration tokens) are needed for `"auto"` and for any fallback.
    weight_args: the artifact's weight args, for the budget's round-to-nearest weights
    (default: per-channel min/max int8 / fp8).
    """
    qt = getattr(quant_type, "value", quant_type)
    if qt not in _KINDS:
        raise QuantSpecError(f"static quantization plans are for a8w8 / a8w8_fp8, not {qt!r}")
    kind = _KINDS[qt]
    table.check_model(model)
    by_rank = bool(fallback_layers) or fallback_threshold is not None
    _check_plan_request(smoothquant_alpha, by_rank, fallback_budget, input_ids, holdout_ids)
    stream = {"weights": weights, "device": device}
    alpha_errors: dict = {}
    if smoothquant_alpha == "auto":
        alpha_map, alpha_errors = search_alphas(model, table, input_ids, kind, alphas=alphas,
                                                batch_size=batch_size, **stream)
    elif smoothquant_alpha is not None:
        alpha_map = {g[0]: float(smoothquant_alpha) for i in range(len(model.model.layers))
                     for g in _groups(f"model.layers.{i}")}
    else:
        alpha_map = {}
    factors = smoothing_factors(model, table, alpha_map, weights=weights) if alpha_map else {}
    sens, units, budget, rule = {}, [], None, {"by": "none"}
    if by_rank or fallback_budget is not None:
        scales = input_scales_for_model(table, model, qt, smooth=factors)
        sens = linear_sensitivity(model, input_ids, scales, kind, smooth=factors,
                                  batch_size=batch_size, **stream)
        if fallback_budget is not None:
            rule = {"by": "budget", "budget_pct": float(fallback_budget)}
            budget, units = _units_under_budget(model, sens, scales, factors, holdout_ids, fallback_budget, kind,
                                                weight_args or _weight_args(kind), stream)
        else:
            rule = {"by": "rank", "units": fallback_layers, "threshold": fallback_threshold}
            chosen = set(select_fallback(sens, fallback_layers, fallback_threshold))
            units = [(u, e) for u, e in rank_units(sens) if u[0] in chosen]
    fallback = [n for u, _ in units for n in u]
    applied = {h: a for h, a in alpha_map.items() if h not in set(fallback)}
    # each group's factor depends on its own weights only: the applied groups' are a subset
    head_of = {n: g[0] for i in range(len(model.model.layers)) for g in _groups(f"model.layers.{i}") for n in g}
    factors = {n: s for n, s in factors.items() if head_of.get(n) in applied}
    if weights is None:
        for i, layer in enumerate(model.model.layers):
            smooth_layer(layer, f"model.layers.{i}", factors)
    scales = input_scales_for_model(table, model, qt, smooth=factors)
    if smoothquant_alpha is None:
        applied = None
    elif smoothquant_alpha != "auto" and len(applied) == len(alpha_map):
        applied = {"*": float(smoothquant_alpha)}
    return StaticQuantPlan(input_scales=scales, alphas=applied, fallback=fallback, factors=factors,
                           sensitivity=sens, alpha_errors=alpha_errors, fallback_units=units,
                           rule=rule, budget=budget)


def _check_plan_request(smoothquant_alpha, by_rank: bool, fallback_budget, input_ids, holdout_ids) -> None:
    if by_rank and fallback_budget is not None:
        raise QuantSpecError("choose the fallback one way: --a8w8-fallback-budget, or "
                             "--a8w8-fallback-layers / --a8w8-fallback-threshold")
    needs_data = smoothquant_alpha == "auto" or by_rank or fallback_budget is not None
    if needs_data and input_ids is None:
        raise QuantSpecError("α search and layer fallback measure errors on calibration data; "
                             "pass --dataset (or a table whose calibration.json names its dataset)")
    if fallback_budget is not None and holdout_ids is None:
        raise QuantSpecError("the fallback's error budget is measured on held-back calibration "
                             "windows; pass --dataset (or choose --a8w8-fallback-layers N)")


def _units_under_budget(model, sens, scales, factors, holdout_ids, fallback_budget, kind, weight_args, stream):
    """(the budget search, the units it keeps at float activations); a budget that leaves no
    static activation is one line."""
    ranked = rank_units(sens)
    budget = fallback_under_budget(model, [u for u, _ in ranked], scales, factors, holdout_ids, fallback_budget,
                                   kind, weight_args, **stream)
    if ranked and budget.chosen_units == len(ranked):
        least = min(budget.delta_pct(p) for k, _, p in budget.measured if k < len(ranked))
        raise QuantSpecError(
            f"no static activation fits the {fallback_budget:g}% error budget: with any "
            f"fused unit at static {kind} activations the held-back perplexity is at least "
            f"{least:+.2f}% over the weight-only model's; raise --a8w8-fallback-budget, or "
            "quantize weight-only")
    return budget, ranked[:budget.chosen_units]
