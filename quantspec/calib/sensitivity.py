"""Measured errors of static-scale quantization, driven by calibration data through
`calib.runner`: the per-group SmoothQuant α search and each Linear's sensitivity, from which
`calib.static_plan` chooses the a8w8 / a8w8_fp8 plan.

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
"""

from __future__ import annotations

from typing import Iterable, Mapping, Sequence

import torch
from torch import nn

from quantspec.calib.runner import DEFAULT_BATCH_SIZE, LayerStep, run_layers
from quantspec.calib.smooth import SMOOTH_GROUPS
from quantspec.model_zoo.llama import MLP
from quantspec.calib.tables import ScaleTable
from quantspec.errors import QuantSpecError
from quantspec.model_zoo.checkpoint import CheckpointReader
from quantspec.quant.args import QuantArgs
from quantspec.quant.primitives import (choose_qparams, fake_quantize, scale_from_absmax,
                                        static_args)
from quantspec.quant.smoothquant import smoothquant_scales, weight_input_absmax

__all__ = [
    "ALPHA_GRID",
    "MAX_ROWS",
    "sample_rows",
    "DOWN_GROUP",
    "static_weight_args",
    "fake_quant_weight",
    "static_linear_error",
    "group_alpha_errors",
    "smoothing_groups",
    "search_alphas",
    "linear_sensitivity",
]

ALPHA_GRID = (0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95)
# tokens per group (α search) / per mini-batch (sensitivity) whose outputs are compared, taken
# evenly strided; the cost is linear in it (each α candidate is a fake-quant matmul over every
# Linear of the group), and the static scales themselves still come from the full table
MAX_ROWS = 2048
DOWN_GROUP = ("mlp.down_proj",)  # the up_proj → down_proj smoothing group (relative names)
# rows of a weight fake-quantized at a time (float32): its temporaries stay this small whatever N
_FQ_BLOCK_BYTES = 16 * 2**20


def static_weight_args(kind: str) -> QuantArgs:
    """The per-output-channel symmetric 8-bit weight args of `kind` ("int8" / "fp8")."""
    return QuantArgs(num_bits=8, type="int" if kind == "int8" else "float", symmetric=True,
                     strategy="channel")


@torch.no_grad()
def fake_quant_weight(w: torch.Tensor, kind: str) -> torch.Tensor:
    """w [N, K] → per-output-channel symmetric int8 / fp8 fake-quantized copy (float32), in
    blocks of rows of at most `_FQ_BLOCK_BYTES`: each row's scale and codes are its own, so the
    numbers are one call's over all rows, and the temporaries stay small whatever N."""
    if w.ndim != 2:
        raise QuantSpecError(f"fake_quant_weight: w must be [N, K], got {tuple(w.shape)}")
    args = static_weight_args(kind)
    out = torch.empty(w.shape, dtype=torch.float32, device=w.device)  # [N, K]
    rows = max(1, _FQ_BLOCK_BYTES // (w.shape[1] * 4))
    for a in range(0, w.shape[0], rows):
        block = w[a:a + rows].float()  # [≤ rows, K]
        scale, zp = choose_qparams(block, args)
        out[a:a + rows] = fake_quantize(block, scale, zp, args)
    return out


@torch.no_grad()
def static_linear_error(x: torch.Tensor, weights: Sequence[torch.Tensor], input_scale: torch.Tensor,
                        kind: str, *, smooth: torch.Tensor | None = None,
                        x_ref: torch.Tensor | None = None,
                        weights_ref: Sequence[torch.Tensor] | None = None,
                        y_ref: Sequence[torch.Tensor] | None = None,
                        quantized: bool = False) -> tuple[float, float]:
    """(Σ_i Σ_t ||ŷ_t − y_t||² / ||y_t||², number of (i, t) terms) over `weights` [N_i, K] for
    x [T, K]: the error is relative *per token*, so that their ratio is the mean per-token
    relative error.

    ŷ = fq(x, input_scale) · fq(W)ᵀ (static per-tensor input, per-channel weights); the reference
    y = x_ref · W_refᵀ (defaults: x, weights), or the given outputs y_ref [T, N_i] (computed once
    when scoring many candidates). `smooth` s [K]: the Linears are scored smoothed,
    ŷ = fq(x / s, input_scale) · fq(W · s)ᵀ, each W · s made when it is scored (one Linear's
    copies are resident at a time), against the unsmoothed reference. `quantized`: `weights`
    are fq(W) already (`fake_quant_weight`'s), used as they are.
    Why per token: SmolLM2-like models have a few tokens with massive activations (absmax ~10³
    vs ~2); a plain Σ||ŷ − y||² / Σ||y||² is dominated by those tokens and hides that a static
    scale sized for them rounds every ordinary token coarsely.
    """
    if x.ndim != 2:
        raise QuantSpecError(f"static_linear_error: x must be [T, K], got {tuple(x.shape)}")
    x = x.float()
    xs = x if smooth is None else x / smooth  # [T, K]
    xq = fake_quantize(xs, input_scale.float().reshape(1).to(x.device), None, static_args(kind))  # [T, K]
    del xs
    xr = x if x_ref is None else x_ref.float()
    err = ref = 0.0
    for i, w in enumerate(weights):
        w_ref = w if weights_ref is None else weights_ref[i]
        y = xr @ w_ref.float().T if y_ref is None else y_ref[i]  # [T, N]
        del w_ref
        den = y.pow(2).sum(dim=1).clamp(min=1e-30)  # [T]
        if smooth is not None:
            w = w.float() * smooth  # [N, K]
        wq = w if quantized else fake_quant_weight(w, kind)  # [N, K]
        del w
        yq = xq @ wq.T  # [T, N]
        del wq
        per_tok = yq.sub_(y).pow_(2).sum(dim=1) / den  # [T]
        del yq
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
    One Linear at a time, every α over it (its outputs [T, N_i] are every α's reference), its
    errors added to each α's in the order of `weights`.
    """
    w_absmax = weight_input_absmax(*weights)  # [K]
    x = x.float()
    steps = {}  # α → (s [K], static input scale)
    for a in dict.fromkeys(float(a) for a in alphas):
        s = smoothquant_scales(channel_absmax, w_absmax, a)  # [K]
        steps[a] = (s, scale_from_absmax((channel_absmax.float() / s).amax() * clip, kind))
    sums = {a: [0.0, 0.0] for a in steps}
    for w in weights:
        y_ref = x @ w.float().T  # [T, N_i]
        for a, (s, scale) in steps.items():
            e, r = static_linear_error(x, [w], scale, kind, smooth=s, y_ref=[y_ref])
            sums[a][0] += e
            sums[a][1] += r
    return {a: (e, r) for a, (e, r) in sums.items()}


def smoothing_groups(prefix: str, dense: bool = True, pre_norms: bool = True) -> list[tuple[str, ...]]:
    """The smoothing groups of one decoder layer, as full Linear names; of a layer whose MLP is a
    mixture of experts (`dense` False), the attention's alone; of a layer with no norm before its
    blocks (`pre_norms` False: OLMo 2's), down_proj's alone (`smooth.layer_smoothing_factors`)."""
    groups = [tuple(f"{prefix}.{n}" for n in names) for _, names in SMOOTH_GROUPS] if pre_norms else []
    return groups + [tuple(f"{prefix}.{n}" for n in DOWN_GROUP)] if dense else groups[:1]


def sample_rows(x: torch.Tensor, max_rows: int) -> torch.Tensor:
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
        dense = isinstance(step.layer.mlp, MLP)
        groups = smoothing_groups(step.name, dense, getattr(step.layer, "pre_norms", True))
        if not smooth_down and dense:
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
            x = sample_rows(torch.cat(bufs.pop(g[0])), max_rows)  # [T, K]
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
                    x, w = sample_rows(args[0], max_rows), m.weight
                    s = smooth.get(_n)
                    if s is not None:
                        s = s.to(x.device)
                        x, w = x / s, w * s
                    wq = fake_quant_weight(w, kind)  # [N, K]
                    del w  # the smoothed copy: one Linear's weights at a time besides the layer's
                    e, r = static_linear_error(x, [wq], input_scales[_n], kind, quantized=True)
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
