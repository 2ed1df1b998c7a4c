"""SmoothQuant: migrate activation outliers into the weights (Xiao et al. 2022, arXiv:2211.10438).

For a Linear y = X Wᵀ with X [T, K] and W [N, K], a per-input-channel factor s [K] gives the same
function y = (X / s) (W · s)ᵀ (W's columns multiplied by s). Choosing
    s_j = max|X_j|^α / max|W_j|^(1-α)
(α, the migration strength, ~0.5) evens out the per-channel ranges of X and W so both quantize
well with per-tensor / per-channel scales. X / s is folded into the preceding RMSNorm's weight
(its output is multiplied elementwise by γ, so γ / s gives X / s for free) and W · s into every
Linear that reads that norm's output (q/k/v after input_layernorm; gate/up after
post_attention_layernorm), so inference runs no extra op.
"""

from __future__ import annotations

import torch

from quantspec.errors import QuantSpecError

__all__ = [
    "smoothquant_scales",
    "weight_input_absmax",
    "fold_into_norm",
    "fold_into_linear",
    "smooth_norm_linears",
]

_MIN_ABSMAX = 1e-5  # channels that never fire keep s ≈ 1 instead of 0 / inf


def _check_vec(name: str, t: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor) or t.ndim != 1 or not t.is_floating_point():
        raise QuantSpecError(f"{name} must be a 1-D float tensor [K], got "
                             f"{getattr(t, 'shape', type(t))}")


def weight_input_absmax(*weights: torch.Tensor) -> torch.Tensor:
    """max |W_j| over the rows of every weight [N_i, K] that reads the same input → [K]."""
    if not weights:
        raise QuantSpecError("weight_input_absmax needs at least one weight")
    K = weights[0].shape[-1]
    for w in weights:
        if w.ndim != 2 or w.shape[1] != K:
            raise QuantSpecError(f"every weight must be [N, {K}], got {tuple(w.shape)}")
    return torch.stack([w.detach().abs().amax(dim=0).float() for w in weights]).amax(dim=0)


def smoothquant_scales(act_absmax: torch.Tensor, weight_absmax: torch.Tensor, alpha: float = 0.5
                       ) -> torch.Tensor:
    """s [K] = max|X|^α / max|W|^(1-α), both maxima clamped to ≥ 1e-5 (float32).

    Example: act_absmax [4, 1], weight_absmax [1, 4], α = 0.5 → s = [2, 0.5].
    """
    _check_vec("act_absmax", act_absmax)
    _check_vec("weight_absmax", weight_absmax)
    if act_absmax.shape != weight_absmax.shape:
        raise QuantSpecError(f"act_absmax {tuple(act_absmax.shape)} and weight_absmax "
                             f"{tuple(weight_absmax.shape)} must both be [K]")
    if not 0.0 <= alpha <= 1.0:
        raise QuantSpecError(f"alpha must be in [0, 1], got {alpha}")
    a = act_absmax.float().clamp(min=_MIN_ABSMAX)
    w = weight_absmax.float().clamp(min=_MIN_ABSMAX)
    s = a.pow(alpha) / w.pow(1.0 - alpha)
    return s.clamp(min=_MIN_ABSMAX)


@torch.no_grad()
def fold_into_norm(norm_weight: torch.Tensor, s: torch.Tensor, norm_bias: torch.Tensor | None = None, *,
                   unit_offset: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """γ / s (and β / s): the norm now outputs X / s. Returns new tensors in γ's dtype.
    `unit_offset`: the norm scales by γ = 1 + weight (Gemma's); the new weight is γ / s - 1."""
    _check_vec("norm_weight", norm_weight)
    _check_vec("s", s)
    if norm_weight.shape != s.shape:
        raise QuantSpecError(f"norm weight {tuple(norm_weight.shape)} and s {tuple(s.shape)} "
                             "must both be [K]")
    ct = torch.promote_types(norm_weight.dtype, torch.float32)  # at least fp32 for the divide
    one = 1.0 if unit_offset else 0.0
    new_w = ((norm_weight.to(ct) + one) / s.to(ct) - one).to(norm_weight.dtype)
    new_b = None if norm_bias is None else (norm_bias.to(ct) / s.to(ct)).to(norm_bias.dtype)
    return new_w, new_b


@torch.no_grad()
def fold_into_linear(weight: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """W · s (column j multiplied by s_j) for weight [N, K]; returns a new tensor, W's dtype."""
    _check_vec("s", s)
    if weight.ndim != 2 or weight.shape[1] != s.shape[0]:
        raise QuantSpecError(f"weight must be [N, {s.shape[0]}], got {tuple(weight.shape)}")
    ct = torch.promote_types(weight.dtype, torch.float32)
    return (weight.to(ct) * s.to(ct).unsqueeze(0)).to(weight.dtype)  # [N, K]


@torch.no_grad()
def smooth_norm_linears(norm_weight: torch.Tensor, weights: list[torch.Tensor],
                        act_absmax: torch.Tensor, alpha: float = 0.5
                        ) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
    """Smooth one norm → Linears group: returns (new γ, new weights, s)."""
    s = smoothquant_scales(act_absmax, weight_input_absmax(*weights), alpha)
    new_norm, _ = fold_into_norm(norm_weight, s)
    return new_norm, [fold_into_linear(w, s) for w in weights], s
