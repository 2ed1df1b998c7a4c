"""The error budget of the a8w8 / a8w8_fp8 fallback: how many fused units keep float activations.

The budget bounds what static activations add to the weights' own error, measured as perplexity
on **held-back** calibration windows (windows of the calibration data that neither the scale
table nor the α search saw):

    ppl_q(k) / ppl_q(m) − 1 ≤ budget,

where ppl_q(k) is the perplexity with the k most sensitive of the m fused units
(`calib.static_plan`'s ranking) at float activations and every other decoder Linear at static
int8 / fp8 activations; ppl_q(m), every unit at float activations, is the weight-only model with
the same weights. The reference is the weight-only model, not the float one, because the
fallback can remove only the activations' error: on the default model FP8 E4M3 weights alone
cost +2.2% held-back perplexity (+2.0% on bench/heldout.txt), and no fallback could meet a bound
on the total below that.
The float model's perplexity is measured and recorded beside it.

`fallback_under_budget` measures ppl_q(m), then ppl_q(k) for k = 0, 1, 2, 4, ... until one meets
the budget, then bisects between the last miss and the first hit; it returns the smallest k so
found. Every k it returns was measured, not inferred. k = m (no static activation left) means
the budget cannot be met with any static activations.

The quantized model is emulated on the float model, without changing it, as the artifact computes
it (up to float rounding): the artifact's Linear holds fq(W'), W' = W with its input columns
multiplied by the smoothing factor s and (up_proj) its output rows divided by down_proj's factor
r — exactly as `calib.smooth.smooth_model` folds them — and, when static, reads fq(x / s). The
emulated Linear holds fq(W') · r / s and, when static, reads fq(x / s) · s: the same products,
in the unsmoothed model's units. A fallback unit is not smoothed (its activations stay float, so
smoothing would only make its weights harder to quantize). fq(W') is the round-to-nearest weight
of the artifact's weight args; fq(x) the static per-tensor input quantization with the table's
scale (`quant.primitives`). With `--method gptq` the fallback is chosen on these round-to-nearest
weights, and GPTQ then quantizes the model smoothed for that choice.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Iterator, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from quantspec.calib.runner import LayerRunner
from quantspec.calib.smooth import smoothed_weight
from quantspec.errors import QuantSpecError
from quantspec.model_zoo.checkpoint import CheckpointReader, resident
from quantspec.quant.args import QuantArgs
from quantspec.quant.primitives import choose_qparams, fake_quantize, static_args

__all__ = ["DEFAULT_BUDGET_PCT", "HOLDOUT_SAMPLES", "BudgetSearch", "heldback_nll",
           "fallback_under_budget"]

# the default budget: static activations may add 1.5% to the weight-only model's held-back
# perplexity. On the default model (a8w8) that keeps the held-back perplexity ≈ 2% over float,
# and bench/heldout.txt reads ≈ 1 point above the held-back windows: ≈ +3%, inside the ≤ +4% target
DEFAULT_BUDGET_PCT = 1.5
# held-back windows measured per candidate (each candidate is one forward over all of them)
HOLDOUT_SAMPLES = 4
# windows per forward: the logits of 2 × 512 tokens over a 49k vocabulary are ≈ 200 MB
_NLL_BATCH = 2


@dataclass
class BudgetSearch:
    """What `fallback_under_budget` measured on the held-back windows: the float model's and the
    weight-only model's perplexity, (fallback units, fallback Linears, perplexity) in the order
    measured, and the units chosen."""

    budget_pct: float
    float_perplexity: float
    weight_only_perplexity: float
    measured: list[tuple[int, int, float]] = field(default_factory=list)  # (units, Linears, ppl)
    chosen_units: int = 0
    num_units: int = 0
    num_windows: int = 0
    seq_len: int = 0

    def delta_pct(self, ppl: float) -> float:
        """Percent over the weight-only model's perplexity: the budgeted quantity."""
        return 100.0 * (ppl / self.weight_only_perplexity - 1.0)

    def over_float_pct(self, ppl: float) -> float:
        return 100.0 * (ppl / self.float_perplexity - 1.0)

    @property
    def chosen_perplexity(self) -> float:
        return next(p for k, _, p in self.measured if k == self.chosen_units)

    def summary(self) -> dict:
        """JSON-able: the budget, the reference perplexities, every measurement and the choice."""
        p = self.chosen_perplexity
        return {
            "budget_pct": self.budget_pct,
            "windows": self.num_windows, "seq_len": self.seq_len,
            "tokens": self.num_windows * self.seq_len,
            "float_perplexity": round(self.float_perplexity, 4),
            "weight_only_perplexity": round(self.weight_only_perplexity, 4),
            "measured": [{"units": k, "linears": n, "perplexity": round(q, 4),
                          "delta_pct": round(self.delta_pct(q), 3),
                          "over_float_pct": round(self.over_float_pct(q), 3)}
                         for k, n, q in self.measured],
            "units": self.num_units, "chosen_units": self.chosen_units,
            "delta_pct": round(self.delta_pct(p), 3), "over_float_pct": round(self.over_float_pct(p), 3),
        }


def _fake_quant_weight(w: torch.Tensor, args: QuantArgs) -> torch.Tensor:
    w = w.float()
    scale, zp = choose_qparams(w, args)
    return fake_quantize(w, scale, zp, args)


@torch.no_grad()
def _emulated_params(layer: nn.Module, prefix: str, input_scales: Mapping[str, torch.Tensor],
                     factors: Mapping[str, torch.Tensor], weight_args: QuantArgs
                     ) -> dict[str, torch.Tensor]:
    """{"<linear>.weight" (relative to the decoder layer `prefix`): fq(W') · row s / column s}
    for every Linear of the layer in `input_scales`, W' the weight exactly as `smooth_layer`
    with `factors` leaves it (module docstring)."""
    out = {}
    for name in input_scales:
        if not name.startswith(prefix + "."):
            continue
        rel = name[len(prefix) + 1:]
        w0 = layer.get_submodule(rel).weight
        w, col, row = smoothed_weight(layer, prefix, factors, rel) or (w0, None, None)
        wq = _fake_quant_weight(w, weight_args)  # [N, K], the artifact's codes × scales
        del w  # one Linear's smoothed copy at a time
        if row is not None:
            wq = wq * row.to(wq.device)[:, None]
        if col is not None:
            wq = wq / col.to(wq.device)
        out[f"{rel}.weight"] = wq.to(w0.dtype)
    return out


@contextlib.contextmanager
def _swapped(layer: nn.Module, params: Mapping[str, torch.Tensor]) -> Iterator[None]:
    """`layer` with the parameters `params` (relative names) in place of its own for the block."""
    saved = []
    for name, t in params.items():
        mod_name, _, attr = name.rpartition(".")
        mod = layer.get_submodule(mod_name)
        saved.append((mod, attr, mod._parameters[attr]))
        mod._parameters[attr] = nn.Parameter(t, requires_grad=False)
    try:
        yield
    finally:
        for mod, attr, p in saved:
            mod._parameters[attr] = p


def _static_hooks(layer: nn.Module, prefix: str, input_scales: Mapping[str, torch.Tensor],
                  factors: Mapping[str, torch.Tensor], fallback: set[str], kind: str) -> list:
    """Pre-hooks feeding fq(x / s) · s (or fq(x)) to the layer's static Linears; their handles."""
    a_args = static_args(kind)
    handles = []
    for name, scale in input_scales.items():
        if name in fallback or not name.startswith(prefix + "."):
            continue
        s, sc = factors.get(name), scale.float().reshape(1)

        def hook(_m, args, _s=s, _sc=sc):
            x = args[0]
            if _s is None:
                return (fake_quantize(x, _sc.to(x.device), None, a_args),)
            s_ = _s.to(x.device, x.dtype)
            return (fake_quantize(x / s_, _sc.to(x.device), None, a_args) * s_,)
        handles.append(layer.get_submodule(name[len(prefix) + 1:]).register_forward_pre_hook(hook))
    return handles


@torch.no_grad()
def _mean_nll(model: nn.Module, hidden: torch.Tensor, input_ids: torch.Tensor, weights, device) -> float:
    """Mean next-token NLL of the last layer's outputs hidden [n, S, D], `_NLL_BATCH` windows
    at a time through the final norm and the head (read from `weights` on a meta model).

    The NLL is `F.cross_entropy(..., reduction="sum")` of each batch's predicting rows, computed
    as its two steps without their [B·(S−1), V] copies: log-softmax is per row, so one window's
    rows at a time give the same numbers, and `F.nll_loss` sums the picked log-probabilities
    [B·(S−1), 1] in the order it would pick them from the whole [B·(S−1), V] (the same sum)."""
    tied = {"weight": "model.embed_tokens.weight"} if model.args.tie_word_embeddings else None
    total, count = 0.0, 0
    with resident(model.model.norm, "model.norm", weights, device=device), \
            resident(model.lm_head, "lm_head", weights, device=device, rename=tied):
        for b0 in range(0, input_ids.shape[0], _NLL_BATCH):
            x = input_ids[b0:b0 + _NLL_BATCH].to(hidden.device)  # [B, S]
            B, S = x.shape
            logits = model.compute_logits(hidden[b0:b0 + B].reshape(B * S, -1)).view(B, S, -1)  # [B, S, V]
            picked = torch.empty(B, S - 1, 1, dtype=logits.dtype, device=logits.device)  # log p(x_t+1)
            for i in range(B):
                picked[i] = torch.log_softmax(logits[i, :-1], dim=-1).gather(1, x[i, 1:, None])  # [S-1, 1]
            del logits
            zeros = torch.zeros(B * (S - 1), dtype=torch.long, device=picked.device)
            total += float(F.nll_loss(picked.view(B * (S - 1), 1), zeros, reduction="sum"))
            count += B * (S - 1)
    return total / count


@torch.no_grad()
def heldback_nll(model: nn.Module, input_ids: torch.Tensor, *,
                 input_scales: Mapping[str, torch.Tensor] | None = None,
                 factors: Mapping[str, torch.Tensor] | None = None,
                 fallback: Sequence[str] = (), kind: str = "int8",
                 weight_args: QuantArgs | None = None, weights: CheckpointReader | None = None,
                 device: str | torch.device | None = None) -> float:
    """Mean next-token NLL (nats) over input_ids [n, S] (each window predicts its tokens 1..S-1).

    Without `input_scales`: the float model. With them: the static-quantized model emulated on
    the float one (module docstring) — Linears in `input_scales` and not in `fallback` read
    static `kind` activations, smoothed by `factors` {linear: s [K]} where given; every Linear
    in `input_scales` holds round-to-nearest `weight_args` weights. The model is not modified.
    Layer by layer (`calib.runner`): a model on `meta` is read from `weights` onto `device`.
    """
    if not isinstance(input_ids, torch.Tensor) or input_ids.ndim != 2 or input_ids.shape[1] < 2:
        raise QuantSpecError("held-back windows must be a LongTensor [n, S] with S >= 2")
    if input_scales is not None and weight_args is None:
        raise QuantSpecError("heldback_nll: emulating static quantization needs weight_args")
    fallback = set(fallback)
    factors = {n: s for n, s in (factors or {}).items() if n not in fallback}
    runner = LayerRunner(model, input_ids, batch_size=_NLL_BATCH, weights=weights, device=device,
                         dtype=torch.float32 if weights is not None else None)
    for step in runner:
        if input_scales is None:
            continue  # the runner runs the float layer
        params = _emulated_params(step.layer, step.name, input_scales, factors, weight_args)
        handles = _static_hooks(step.layer, step.name, input_scales, factors, fallback, kind)
        try:
            with _swapped(step.layer, params):
                step.forward()
        finally:
            for h in handles:
                h.remove()
        del params  # the layer's emulated weights, freed before the next layer's (and the head)
    return _mean_nll(model, runner.hidden, input_ids, weights, runner.device)


def fallback_under_budget(model: nn.Module, ranked_units: Sequence[Sequence[str]],
                          input_scales: Mapping[str, torch.Tensor],
                          factors: Mapping[str, torch.Tensor], holdout_ids: torch.Tensor,
                          budget_pct: float, kind: str, weight_args: QuantArgs, *,
                          weights: CheckpointReader | None = None,
                          device: str | torch.device | None = None) -> BudgetSearch:
    """The fewest of `ranked_units` (most sensitive first) to keep at float activations so that
    the held-back perplexity over holdout_ids [n, S] stays within `budget_pct` percent of the
    weight-only model's (module docstring). `chosen_units` == len(ranked_units) says that no
    static activation fits the budget. Each measurement is one pass over the layers (read from
    `weights` one at a time on a meta model)."""
    if isinstance(budget_pct, bool) or not isinstance(budget_pct, (int, float)) or not budget_pct > 0:
        raise QuantSpecError(f"error budget {budget_pct!r} must be a positive percentage, e.g. 1.5")
    m = len(ranked_units)

    def nll(k: int) -> tuple[int, float]:
        fb = [n for u in ranked_units[:k] for n in u]
        return len(fb), heldback_nll(model, holdout_ids, input_scales=input_scales, factors=factors,
                                     fallback=fb, kind=kind, weight_args=weight_args, weights=weights,
                                     device=device)

    n_all, ref = nll(m)
    float_nll = heldback_nll(model, holdout_ids, weights=weights, device=device)
    search = BudgetSearch(budget_pct=float(budget_pct), float_perplexity=math.exp(float_nll),
                          weight_only_perplexity=math.exp(ref), num_units=m,
                          num_windows=int(holdout_ids.shape[0]), seq_len=int(holdout_ids.shape[1]))
    search.measured.append((m, n_all, math.exp(ref)))
    bound = math.log1p(budget_pct / 100.0)  # ppl_k / ppl_m − 1 ≤ b  ⇔  nll_k − nll_m ≤ log(1 + b)

    def meets(k: int) -> bool:
        if k == m:
            return True
        n, q = nll(k)
        search.measured.append((k, n, math.exp(q)))
        return q - ref <= bound

    lo, hi, k = -1, m, 0
    while k < m:  # gallop: the answer is usually a few units
        if meets(k):
            hi = k
            break
        lo, k = k, max(1, 2 * k)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if meets(mid):
            hi = mid
        else:
            lo = mid
    search.chosen_units = hi
    return search
