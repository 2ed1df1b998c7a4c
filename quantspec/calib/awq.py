"""AWQ: activation-aware weight quantization (Lin et al. 2023, arXiv:2306.00978), weight-only.

A few input channels of a Linear carry most of its output (those whose activations are large);
rounding their weights costs the most. AWQ multiplies those weight columns by s > 1 before
rounding (their relative rounding error shrinks) and divides the input channel by s where that
is free: in the op that produces it. The model computes the same function in float; only the
rounding moves.

Terms:
- **Smoothing group** (llm-compressor's "mapping"): an op whose output absorbs a per-channel
  1 / s exactly, and the Linears that read that output (their input columns × s), per decoder
  layer, in order:
      input_layernorm            → q_proj, k_proj, v_proj          (γ / s)
      v_proj (output rows)       → o_proj                          (grouped-query attention: one
                                                                    s per KV channel, shared by
                                                                    the query heads reading it)
      post_attention_layernorm   → gate_proj, up_proj              (Gemma: pre_feedforward_layernorm)
      up_proj (output rows)      → down_proj
  A sparse layer's post-attention norm feeds the router (and Qwen2-MoE's shared-expert gate),
  every expert's gate / up and the shared expert's: one group, whose factor the float router's
  columns take too (its logits stay the float model's, up to rounding), searched on the summed
  error of every expert's gate / up; then each expert's (and the shared expert's) up → down is a
  group of its own. As in calibration, every expert runs on every token here
  (`model_zoo.moe.all_experts`), so each expert's error is weighed over all calibration tokens.
  A layer without pre-norms (OLMo 2) skips the norm groups. The folds are `calib.smooth`'s (`smooth_layer`, `row_folds`).
- **Candidates** (llm-compressor's duo scaling): s(α) = x̄^α / (w̄^(1-α) + 1e-4), normalised
  by √(max s · min s), for α = 0, 1/20, …, 19/20; and s = 1 (no scaling), so the search is never
  worse than round-to-nearest on its objective. x̄ [K] is each input channel's mean |x| over the
  calibration tokens; w̄ [K] the mean over the group's rows of |w| / the max |w| of its
  quantization group.
- **Objective**: the output error of the group's quantized Linears, Σ ||X Wᵀ − (X / s) Q(W·s)ᵀ||²
  (the paper's Eq. 4), computed as Σ_rows ΔW H ΔWᵀ with ΔW = Q(W·s) / s − W and H = Σ_t x_t x_tᵀ
  over every calibration token (`HessianAccumulator`): K² work per weight row whatever the number
  of tokens. Q is round-to-nearest with min/max ranges under each Linear's own args (NVFP4:
  under one global scale for each fused unit of the group — q / k / v, gate / up, an expert's
  gate / up — as quantize gives a fused unit one).

The chosen factors are folded into the layer, which is then rounded under the config's args
(their observer included), and re-run so the next layer calibrates on the quantized layer's
outputs. Row scaling of v_proj / up_proj commutes with their per-row (channel, group) integer
scales, so each group's choice does not depend on the groups after it; FP4's group scales (FP8
values under a global scale, or powers of two) round again after it, so there a row's codes can
move with the later fold (llm-compressor searches FP4 the same way).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import torch
from torch import nn

from quantspec.calib.smooth import layer_mlps, layer_norm_groups, smooth_layer
from quantspec.errors import QuantSpecError
from quantspec.model_zoo.moe import all_experts
from quantspec.quant.args import QuantArgs
from quantspec.quant.fp4 import global_scale_from_absmax
from quantspec.quant.gptq import HessianAccumulator, rtn_quantize

__all__ = ["AWQ_DUO", "AWQ_GRID", "AWQGroup", "ChannelStats", "ScaleChoice", "awq_layer", "candidate_scales",
           "check_awq", "layer_awq_groups", "output_error", "relative_weight_mean", "search_scale"]

AWQ_GRID = 20  # α = 0, 1/20, …, 19/20 (llm-compressor's n_grid)
# --awq-duo-scaling → `candidate_scales(duo=)`: llm-compressor's duo_scaling values
AWQ_DUO = {"true": True, "false": False, "both": "both"}
_DUO_EPS = 1e-4  # w̄^(1-α) + eps: a column of zeros does not divide by zero
_MIN_SCALE = 1e-4


def check_awq(config, layer_args: Mapping[str, QuantArgs]) -> None:
    """AWQ folds its factors into the inputs before their quantizer sees them: float inputs and
    8-bit inputs whose scales are computed at run time (per token, or per group: a8w4_mxfp4's FP8)
    take them; static input scales, and microscaled inputs (NVFP4's calibrated global scale, MX
    inputs' 4-bit codes), are fitted to or tuned for the unscaled inputs. It rounds weights with
    per-row scales (integer channel or group strategy, NVFP4, MXFP4); `config`: a `QuantConfig`."""
    for s in config.config_groups.values():
        ia = s.input_activations
        if ia is not None and not (ia.dynamic is True and ia.microscaled is None):
            raise QuantSpecError("AWQ's factors fold into the inputs, which static or microscaled input scales are "
                                 "fitted without; use --method rtn or gptq (or inputs quantized per token)")
    for name, a in layer_args.items():
        if not a.is_fp4 and (a.type != "int" or a.strategy not in ("channel", "group")):
            raise QuantSpecError(f"AWQ scales integer or FP4 weights with per-channel or per-group scales ({name} "
                                 f"is {a.num_bits}-bit {a.type}, {a.strategy}); use --method rtn or gptq")


class ChannelStats:
    """Running statistics of one input [..., K]: H = 2/n Σ x xᵀ [K, K] and mean |x| [K]."""

    def __init__(self, in_features: int, device: torch.device | str = "cpu"):
        self.hessian = HessianAccumulator(in_features, device=device)
        self.abs_sum = torch.zeros(in_features, device=device, dtype=torch.float64)

    @torch.no_grad()
    def update(self, x: torch.Tensor) -> None:
        self.hessian.update(x)
        self.abs_sum += x.reshape(-1, x.shape[-1]).abs().sum(0, dtype=torch.float64)

    @property
    def mean_abs(self) -> torch.Tensor:
        return (self.abs_sum / max(self.hessian.num_samples, 1)).float()  # [K]


def relative_weight_mean(weights: Sequence[torch.Tensor], args: Sequence[QuantArgs]) -> torch.Tensor:
    """w̄ [K]: the mean over every row of `weights` ([N_i, K]) of |w| / the max |w| of its
    quantization group (a whole row for per-channel args).

    Example: one weight [[1, 2], [4, 4]], per channel → rows [0.5, 1] and [1, 1] → [0.75, 1].
    """
    parts = []
    for w, a in zip(weights, args):
        N, K = w.shape
        g = a.group_size if a.strategy in ("group", "tensor_group") else K
        wa = w.detach().float().abs().view(N, K // g, g)
        parts.append((wa / (wa.amax(-1, keepdim=True) + 1e-6)).view(N, K))
    return torch.cat(parts).mean(0)


def candidate_scales(x_mean: torch.Tensor, w_mean: torch.Tensor, grid: int = AWQ_GRID, duo: bool | str = True
                     ) -> list[tuple[float | None, torch.Tensor]]:
    """[(α, s [K])]: s = 1 (α None), then duo scaling for α = i / grid (module docstring).

    `duo` False / "both" are llm-compressor's `duo_scaling` of those values: s = x̄^α alone for
    α = i / (grid - 1) over [0, 1], or both forms at half the points each (α = i / (grid/2 - 1));
    x̄^0 is the s = 1 candidate."""
    if duo is True:
        params = [(i / grid, True) for i in range(grid)]
    else:
        n = grid if duo is False else grid // 2
        params = [(i / (n - 1), d) for d in ((False,) if duo is False else (False, True)) for i in range(n)
                  if i or d]
    out: list[tuple[float | None, torch.Tensor]] = [(None, torch.ones_like(x_mean))]
    for ratio, with_w in params:
        s = (x_mean.pow(ratio) / (w_mean.pow(1 - ratio) + _DUO_EPS) if with_w else x_mean.pow(ratio)).clamp(
            min=_MIN_SCALE)
        s = s / (s.max() * s.min()).sqrt()
        out.append((ratio, torch.where(torch.isfinite(s), s, torch.ones_like(s))))
    return out


def output_error(weight: torch.Tensor, args: QuantArgs, s: torch.Tensor, hessian: torch.Tensor,
                 global_scale: torch.Tensor | None = None) -> float:
    """Σ_rows ΔW H ΔWᵀ for ΔW = Q(W·s) / s − W: the output error ||X Wᵀ − (X / s) Q(W·s)ᵀ||² of
    the inputs X whose `hessian` [K, K] is H = c Σ x xᵀ, times c (`ChannelStats`: c = 2 / n);
    Q rounds to nearest with min/max ranges (NVFP4: under `global_scale`, default W·s's own)."""
    w = weight.float()  # [N, K]
    minmax = args.replace(observer=None) if args.observer else args
    dw = rtn_quantize(w * s, minmax, global_scale=global_scale).weight_dq.float().div_(s).sub_(w)  # [N, K]
    return float((dw @ hessian).mul_(dw).sum())


@dataclass(frozen=True)
class ScaleChoice:
    """The factor chosen for one group (`s` [K], or None: no scaling), its α and objective, and
    the objective without scaling (round-to-nearest's)."""

    s: torch.Tensor | None
    ratio: float | None
    loss: float
    rtn_loss: float


def search_scale(weights: Sequence[torch.Tensor], args: Sequence[QuantArgs], stats: ChannelStats,
                 tie: torch.Tensor | None = None, grid: int = AWQ_GRID,
                 units: Sequence[object] | None = None, duo: bool | str = True) -> ScaleChoice:
    """The candidate (`candidate_scales`) with the least summed `output_error` over `weights`
    ([N_i, K], each rounded under its own args) for inputs with statistics `stats`.

    `tie` [K] (long): column j takes the factor of free channel tie[j] (o_proj under grouped-query
    attention); x̄ and w̄ of the tied columns are averaged, and the returned s is per column.
    `units`: per weight, the fused unit it belongs to (NVFP4: one global scale per unit, as
    quantize writes them; default: all one unit)."""
    H = stats.hessian.H  # [K, K], read in place: a copy would double the largest tensor a layer holds
    if H is None or not stats.hessian.num_samples:
        raise QuantSpecError("search_scale needs statistics of calibration inputs (none were fed, or "
                             "their Hessian was taken)")
    x_mean, w_mean = stats.mean_abs.to(H.device), relative_weight_mean(weights, args).to(H.device)
    if tie is not None:
        x_mean, w_mean = _tied_mean(x_mean, tie), _tied_mean(w_mean, tie)
    best = rtn = None
    for ratio, s in candidate_scales(x_mean, w_mean, grid, duo):
        full = s if tie is None else s[tie]
        g = [None] * len(weights)  # NVFP4: a unit's Linears share a global scale, as quantize writes them
        if args[0].is_nvfp4:
            of = list(units) if units is not None else [0] * len(weights)
            absmax: dict[object, list[torch.Tensor]] = {}
            for w, u in zip(weights, of):
                absmax.setdefault(u, []).append((w.float() * full).abs().amax())
            top = {u: global_scale_from_absmax(torch.stack(ms)) for u, ms in absmax.items()}
            g = [top[u] for u in of]
        loss = sum(output_error(w, a, full, H, gi) for w, a, gi in zip(weights, args, g))
        if ratio is None:
            rtn = loss
        if best is None or loss < best[2]:
            best = (full, ratio, loss)
    s, ratio, loss = best
    return ScaleChoice(s=None if ratio is None else s, ratio=ratio, loss=loss, rtn_loss=rtn)


def _tied_mean(v: torch.Tensor, tie: torch.Tensor) -> torch.Tensor:
    n = int(tie.max()) + 1
    total = torch.zeros(n, dtype=v.dtype, device=v.device).index_add_(0, tie, v)
    return total / torch.bincount(tie, minlength=n).to(v.dtype)


@dataclass(frozen=True)
class AWQGroup:
    """One smoothing group of a decoder layer (names relative to it): the Linears reading the
    scaled channels, and `tie` (o_proj under grouped-query attention) or None."""

    readers: tuple[str, ...]
    tie: torch.Tensor | None = None


def layer_awq_groups(layer: nn.Module) -> list[AWQGroup]:
    """The decoder layer's smoothing groups, in forward order (module docstring)."""
    norms = [names for _, names in layer_norm_groups(layer)]
    groups = [AWQGroup(n) for n in norms if n[0].startswith("self_attn.")]
    attn = layer.self_attn
    H, KV, hd = attn.num_heads, attn.num_kv_heads, attn.head_dim
    tie = None if H == KV else (torch.arange(H)[:, None] // (H // KV) * hd + torch.arange(hd)).reshape(-1)
    groups.append(AWQGroup(("self_attn.o_proj",), tie))
    groups += [AWQGroup(n) for n in norms if not n[0].startswith("self_attn.")]
    return groups + [AWQGroup((down,)) for _, down in layer_mlps(layer)]


@torch.no_grad()
def awq_layer(step, linears: Mapping[str, nn.Linear], layer_args: Mapping[str, QuantArgs],
              hessians: dict[str, torch.Tensor] | None = None, duo: bool | str = True) -> dict[str, float]:
    """Run the decoder layer of `step` (`calib.runner.LayerStep`) over its calibration inputs,
    choose each group's factor and fold it into the layer; → {"awq:<group>": objective after scaling}.

    `linears` / `layer_args`: the quantized Linears (full names) and their weight args. A group
    none of whose readers is quantized is left as it is. `hessians`, when given, receives
    {first reader of each group: H [K, K] of its inputs as the fold leaves them} — the inputs
    become X / s, so H becomes H / (s sᵀ): what GPTQ would accumulate from the folded layer.
    `duo`: the candidates' form (`candidate_scales`)."""
    groups = [(g, [f"{step.name}.{r}" for r in g.readers]) for g in layer_awq_groups(step.layer)]
    groups = [(g, names) for g, names in groups if any(n in linears for n in names)]
    stats, handles = {}, []
    for g, names in groups:
        head = step.layer.get_submodule(g.readers[0])
        st = stats[names[0]] = ChannelStats(head.in_features, device=head.weight.device)
        handles.append(head.register_forward_pre_hook(lambda _m, inputs, st=st: st.update(inputs[0])))
    try:
        with all_experts(step.layer):  # every expert's inputs from every token (module docstring)
            step.forward()
    finally:
        for h in handles:
            h.remove()
    factors, losses = {}, {}
    for g, names in groups:
        quantized = [n for n in names if n in linears]
        if not stats[names[0]].hessian.num_samples:
            continue  # never reached (no calibration token)
        choice = search_scale([linears[n].weight for n in quantized], [layer_args[n] for n in quantized],
                              stats[names[0]], g.tie, units=[n.rsplit(".", 1)[0] for n in quantized], duo=duo)
        losses["awq:" + ("+".join(quantized) if len(quantized) <= 3 else
                         f"{quantized[0]}+{len(quantized) - 1} more")] = choice.loss
        if choice.s is not None:
            factors.update({n: choice.s.cpu() for n in names})
        if hessians is not None:
            H = stats[names[0]].hessian.take()  # [K, K]
            hessians[names[0]] = H if choice.s is None else H.div_(choice.s[:, None] * choice.s[None, :])
    smooth_layer(step.layer, step.name, factors)
    return losses
