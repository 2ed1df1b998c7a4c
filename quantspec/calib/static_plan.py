"""The a8w8 / a8w8_fp8 plan: the SmoothQuant α of each smoothing group and the fused units that
keep float activations, chosen from the errors `calib.sensitivity` measures.

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

`plan_from_table` runs the plan for a quantize run from its calibration table, and keeps it in
the run's state so an interrupted run resumes without measuring again.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Iterable, Mapping

import torch

from quantspec.calib.budget import BudgetSearch, fallback_under_budget
from quantspec.calib.ptq import SHARED_INPUT_GROUPS
from quantspec.calib.quip import turned_inputs
from quantspec.calib.runner import DEFAULT_BATCH_SIZE
from quantspec.calib.sensitivity import (ALPHA_GRID, DOWN_GROUP, linear_sensitivity, search_alphas,
                                         smoothing_groups, static_weight_args)
from quantspec.calib.smooth import input_scales_for_model, smooth_layer, smoothing_factors
from quantspec.calib.tables import ScaleTable
from quantspec.errors import QuantSpecError
from quantspec.quant.engines.moe import EXPERT
from quantspec.model_zoo.checkpoint import CheckpointReader
from quantspec.quant.args import QuantArgs
from quantspec.quant.config import QuantConfig
from quantspec.quant.engines import fused_targets
from quantspec.quant.scheme import QuantScheme

__all__ = [
    "FALLBACK_GROUP",
    "FUSED_UNITS",
    "StaticQuantPlan",
    "fused_unit",
    "rank_units",
    "select_fallback",
    "with_fallback_layers",
    "plan_from_table",
    "plan_static_quant",
]

_KINDS = {"a8w8": "int8", "a8w8_fp8": "fp8"}
FALLBACK_GROUP = "fallback_w8a16"
# the Linears vLLM / SGLang fuse into one layer (relative to a decoder layer): exactly those that
# read one input, which is how GPTQ groups them too
FUSED_UNITS = SHARED_INPUT_GROUPS


def fused_unit(name: str, among: Iterable[str] | None = None) -> tuple[str, ...]:
    """The Linears fused with `name` into one engine layer (`FUSED_UNITS`), `name` included, in
    unit order; `among` keeps only those names (e.g. the Linears a config quantizes). A Linear
    outside the units (or outside the decoder layers) is a unit of its own.

    Example: "model.layers.3.self_attn.k_proj" → (q_proj, k_proj, v_proj of model.layers.3);
    an EAGLE-3 head's "midlayer.self_attn.k_proj" → (q_proj, k_proj, v_proj of midlayer).
    """
    unit = (name,)
    for names in FUSED_UNITS:  # under any prefix: a decoder layer's, a draft module's (`midlayer`)
        member = next((n for n in names if name.endswith(f".{n}")), None)
        if member is not None:
            unit = tuple(f"{name[: -len(member) - 1]}.{n}" for n in names)
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


def with_fallback_layers(config: QuantConfig, names: Iterable[str], targets=fused_targets) -> QuantConfig:
    """`config` with `names` moved to a name-targeted group of the same weights and no input
    activations (weight-only: W8A16 for a8w8, FP8 weight-only for a8w8_fp8). Exact names outrank
    the base group's class target in every compressed-tensors loader. `targets(names)`: the
    group's targets (an EAGLE-3 head's: `engines.eagle3_targets`, which name the engines' layers).

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
    groups[FALLBACK_GROUP] = QuantScheme(targets=targets(names), weights=base.weights,
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
                      weights: CheckpointReader | None = None, device=None, r4: bool = False) -> StaticQuantPlan:
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
    r4: measure the model as the engine runs it under SpinQuant's R4 (`calib.quip.turned_inputs`:
    each down_proj's input turned, as a table calibrated with R4 holds its ranges); R4 takes
    down_proj's outliers, so SmoothQuant leaves its group alone. Needs `weights`.
    """
    qt = getattr(quant_type, "value", quant_type)
    if qt not in _KINDS:
        raise QuantSpecError(f"static quantization plans are for a8w8 / a8w8_fp8, not {qt!r}")
    kind = _KINDS[qt]
    table.check_model(model)
    by_rank = bool(fallback_layers) or fallback_threshold is not None
    _check_plan_request(smoothquant_alpha, by_rank, fallback_budget, input_ids, holdout_ids)
    if r4 and weights is None:
        raise QuantSpecError("an R4 plan reads the model's layers turned from its checkpoint; pass weights=")
    with turned_inputs(model, weights, r4) as reader:
        stream = {"weights": reader, "device": device}
        alpha_map, alpha_errors = _choose_alphas(model, table, smoothquant_alpha, input_ids, kind, alphas,
                                                 batch_size, stream, smooth_down=not r4)
        factors = smoothing_factors(model, table, alpha_map, weights=reader) if alpha_map else {}
        sens, units, budget, rule = {}, [], None, {"by": "none"}
        if by_rank or fallback_budget is not None:
            sens, units, budget, rule = _choose_fallback(model, table, qt, factors, input_ids, holdout_ids,
                                                         (fallback_layers, fallback_threshold, fallback_budget),
                                                         weight_args or static_weight_args(kind), batch_size,
                                                         stream)
    fallback = [n for u, _ in units for n in u]
    applied, factors = _smooth_but_fallback(model, alpha_map, factors, fallback, in_place=weights is None)
    scales = input_scales_for_model(table, model, qt, smooth=factors)
    if smoothquant_alpha is None:
        applied = None
    elif smoothquant_alpha != "auto" and len(applied) == len(alpha_map):
        applied = {"*": float(smoothquant_alpha)}
    return StaticQuantPlan(input_scales=scales, alphas=applied, fallback=fallback, factors=factors,
                           sensitivity=sens, alpha_errors=alpha_errors, fallback_units=units,
                           rule=rule, budget=budget)


def _choose_fallback(model, table: ScaleTable, qt: str, factors, input_ids, holdout_ids, rule_args,
                     weight_args: QuantArgs, batch_size: int, stream: dict):
    """(each Linear's measured sensitivity, the fallback units with their errors, the budget search
    or None, the rule) for `rule_args` = (fallback_layers, fallback_threshold, fallback_budget)."""
    fallback_layers, fallback_threshold, fallback_budget = rule_args
    kind = _KINDS[qt]
    scales = input_scales_for_model(table, model, qt, smooth=factors)
    sens = linear_sensitivity(model, input_ids, scales, kind, smooth=factors, batch_size=batch_size, **stream)
    sens = {n: e for n, e in sens.items() if not EXPERT.match(n)}  # no engine loads an MoE layer of 2 schemes
    if fallback_budget is not None:
        budget, units = _units_under_budget(model, sens, scales, factors, holdout_ids, fallback_budget, kind,
                                            weight_args, stream)
        return sens, units, budget, {"by": "budget", "budget_pct": float(fallback_budget)}
    chosen = set(select_fallback(sens, fallback_layers, fallback_threshold))
    units = [(u, e) for u, e in rank_units(sens) if u[0] in chosen]
    return sens, units, None, {"by": "rank", "units": fallback_layers, "threshold": fallback_threshold}


def _layer_groups(model) -> list[tuple[str, ...]]:
    """Every smoothing group of `model`'s decoder layers, as full Linear names."""
    return [g for i in range(len(model.model.layers))
            for g in smoothing_groups(f"model.layers.{i}", not model.args.is_moe_layer(i), model.args.pre_norms)]


def _choose_alphas(model, table: ScaleTable, smoothquant_alpha, input_ids, kind: str, alphas,
                   batch_size: int, stream: dict, smooth_down: bool = True) -> tuple[dict[str, float], dict]:
    """({first Linear of each smoothing group: α}, the α search's errors): searched for
    `"auto"`, one α everywhere for a number, nothing for None; without `smooth_down`, the
    up_proj → down_proj groups are left out."""
    if smoothquant_alpha == "auto":
        return search_alphas(model, table, input_ids, kind, alphas=alphas, batch_size=batch_size,
                             smooth_down=smooth_down, **stream)
    if smoothquant_alpha is not None:
        return {g[0]: float(smoothquant_alpha) for g in _layer_groups(model)
                if smooth_down or not g[0].endswith(f".{DOWN_GROUP[0]}")}, {}
    return {}, {}


def _smooth_but_fallback(model, alpha_map: Mapping[str, float], factors: Mapping[str, torch.Tensor],
                         fallback: list[str], *, in_place: bool):
    """(the α of each group outside `fallback`, the factors of those groups); with `in_place`
    the model's layers are smoothed by them."""
    applied = {h: a for h, a in alpha_map.items() if h not in set(fallback)}
    # each group's factor depends on its own weights only: the applied groups' are a subset
    head_of = {n: g[0] for g in _layer_groups(model) for n in g}
    factors = {n: s for n, s in factors.items() if head_of.get(n) in applied}
    if in_place:
        for i, layer in enumerate(model.model.layers):
            smooth_layer(layer, f"model.layers.{i}", factors)
    return applied, factors


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


def plan_from_table(config, src, net, qconfig, batches, say, run, device):
    """The a8w8 recipe of the quantize run `config` (`calib.quantize.QuantizeConfig`) on `src` (its
    source, with its table) for the model `net`, measured one layer at a time (or as an earlier run
    of the run state `run` kept it) → (config with the fallback group, static input scales,
    smoothing factors, the calibration batches of GPTQ or AutoRound: `batches`, or the table's
    own windows)."""
    from quantspec.calib.budget import DEFAULT_BUDGET_PCT, HOLDOUT_SAMPLES
    from quantspec.calib.data import TableWindows

    table = src.table
    table.check_model(net)
    alpha = config.alpha
    budget = None if config.by_rank else (config.fallback_budget or DEFAULT_BUDGET_PCT)
    data = TableWindows(table.meta, src.model_dir, config.dataset, split=config.split,
                        text_field=config.text_field, seq_len=config.seq_len, seed=config.seed)
    search_ids = holdout_ids = None
    if alpha == "auto" or config.fallback_layers or config.fallback_threshold is not None or budget is not None:
        search_ids = data.search_windows(config.search_samples)
    if config.method in ("gptq", "autoround") and batches is None:  # on the windows the table was calibrated on
        batches = data.table_windows()
        src.calib_summary.update(method_data=data.describe(0, batches.shape[0]))
    if budget is not None:
        holdout_ids = data.held_back_windows(config.holdout_samples or HOLDOUT_SAMPLES)
    saved = run.load("plan")
    if saved is None:
        if search_ids is not None:
            say(f"measuring static-activation error on {search_ids.shape[0]} × {search_ids.shape[1]} tokens "
                "(SmoothQuant α search, fallback ranking)"
                + ("" if holdout_ids is None else f" and the fallback budget on {holdout_ids.shape[0]} "
                   "held-back windows") + ", one layer at a time")
        # the a8w8 presets' one class-target group (a mixture of experts' experts have one more)
        base = next(s for s in qconfig.config_groups.values() if "Linear" in s.targets)
        plan = plan_static_quant(net, table, config.quant_type, smoothquant_alpha=alpha, input_ids=search_ids,
                                 fallback_layers=config.fallback_layers or 0,
                                 fallback_threshold=config.fallback_threshold, fallback_budget=budget,
                                 holdout_ids=holdout_ids, weight_args=base.weights, weights=src.reader,
                                 device=device, r4=config.r4)
        summary = plan.summary()
        if summary["held_back"] is not None:
            summary["held_back"].update(data.describe(data.held_back_start, holdout_ids.shape[0]))
        saved = {"input_scales": plan.input_scales, "factors": plan.factors, "fallback": plan.fallback,
                 "summary": summary}
        run.save("plan", saved)
    src.calib_summary.update(smoothquant_alpha=alpha, static_plan=saved["summary"],
                             search_samples=None if search_ids is None else int(search_ids.shape[0]))
    return (with_fallback_layers(qconfig, saved["fallback"]), saved["input_scales"], saved["factors"],
            batches)
