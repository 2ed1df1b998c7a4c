"""Rotary position embeddings: the cos / sin tables of a model's `rope_scaling` (none, `linear`,
`llama3`, `yarn`, `longrope`), as transformers computes them, and their rotate-half application.

A table function takes the model's `ModelArgs` (`rotary_dim`, `rope_theta`, `rope_scaling`,
`max_position_embeddings`) and returns the inverse frequencies `[rotary_dim / 2]`; YaRN and LongRoPE
also scale cos and sin by their attention factor (`rope_attention_factor`). LongRoPE (Phi-3 / 3.5
long-context models) divides each frequency by its `short_factor` within the original context and
by its `long_factor` past it, switching for the whole sequence as it grows; quantspec builds the
short table and keeps contexts within the original one (`ModelArgs.check_context`).
`rotary_dim` is the head size, or its leading `partial_rotary_factor` part (Phi-4-mini): the
tables are that wide and the rest of each head passes unrotated (`apply_rope`).
"""

from __future__ import annotations

import math

import torch

from quantspec.errors import QuantSpecError

__all__ = ["ROPE_TYPES", "apply_rope", "rope_attention_factor", "rope_cos_sin", "rope_type", "rotary_dim"]


def rotary_dim(args) -> int:
    """The leading dimensions of each head the rotary embedding turns (all of them by default)."""
    return getattr(args, "rotary_dim", 0) or args.head_dim


def _default_inv_freq(args) -> torch.Tensor:
    d = rotary_dim(args)
    return 1.0 / (args.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))


def _linear_inv_freq(args) -> torch.Tensor:
    return _default_inv_freq(args) / float(args.rope_scaling["factor"])


def _llama3_inv_freq(args) -> torch.Tensor:
    """Llama 3.1 frequency-dependent scaling (long wavelengths slowed by `factor`, short ones
    kept, a smooth ramp between `low_freq_factor` and `high_freq_factor`)."""
    s = args.rope_scaling
    inv_freq = _default_inv_freq(args)
    factor, low, high = float(s["factor"]), float(s["low_freq_factor"]), float(s["high_freq_factor"])
    old_ctx = float(s["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _scaling_factor(args) -> float:
    """YaRN's and LongRoPE's `factor`, else the ratio of the extended context to the original."""
    s = args.rope_scaling
    if s.get("factor") is not None:
        return float(s["factor"])
    return args.max_position_embeddings / float(s["original_max_position_embeddings"])


def _yarn_inv_freq(args) -> torch.Tensor:
    """YaRN (Qwen2.5 / Qwen3 long context): dimensions that turn fewer than `beta_slow` times over
    the original context are interpolated by `factor`, those that turn more than `beta_fast`
    times kept, a linear ramp between."""
    s, d, base = args.rope_scaling, rotary_dim(args), args.rope_theta
    factor = _scaling_factor(args)
    old_ctx = float(s.get("original_max_position_embeddings") or args.max_position_embeddings)
    beta_fast, beta_slow = float(s.get("beta_fast") or 32), float(s.get("beta_slow") or 1)

    def dim_of(rotations: float) -> float:  # the dimension that turns `rotations` times over old_ctx
        return d * math.log(old_ctx / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim_of(beta_fast), dim_of(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(d // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    extrapolation = _default_inv_freq(args)
    return extrapolation / factor * ramp + extrapolation * (1 - ramp)


def _longrope_inv_freq(args) -> torch.Tensor:
    """LongRoPE's short table: each frequency divided by its `short_factor` (module docstring)."""
    short = torch.tensor(args.rope_scaling["short_factor"], dtype=torch.float64)
    if short.numel() != rotary_dim(args) // 2:
        raise QuantSpecError(f"rope_scaling short_factor has {short.numel()} entries where a rotary embedding "
                             f"over {rotary_dim(args)} dimensions needs {rotary_dim(args) // 2}; fix config.json")
    return _default_inv_freq(args) / short


ROPE_TYPES = {"default": _default_inv_freq, "linear": _linear_inv_freq, "llama3": _llama3_inv_freq,
              "yarn": _yarn_inv_freq, "longrope": _longrope_inv_freq, "su": _longrope_inv_freq}


def rope_type(args) -> str:
    """The `rope_scaling` kind of `args` (`rope_type`, or the older `type`; "default" without one)."""
    s = args.rope_scaling
    return "default" if s is None else s.get("rope_type", s.get("type", "default"))


def rope_attention_factor(args) -> float:
    """What cos and sin are scaled by: YaRN's attention factor (`attention_factor`, else from
    `factor`, `mscale` and `mscale_all_dim`), LongRoPE's (`attention_factor`, else
    sqrt(1 + ln factor / ln original context)), 1 otherwise."""
    s = args.rope_scaling
    if rope_type(args) in ("longrope", "su"):
        if s.get("attention_factor") is not None:
            return float(s["attention_factor"])
        factor = _scaling_factor(args)
        old = float(s["original_max_position_embeddings"])
        return 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(old))
    if rope_type(args) != "yarn":
        return 1.0
    if s.get("attention_factor") is not None:
        return float(s["attention_factor"])
    factor = _scaling_factor(args)

    def mscale(m: float) -> float:
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

    if s.get("mscale") and s.get("mscale_all_dim"):
        return mscale(float(s["mscale"])) / mscale(float(s["mscale_all_dim"]))
    return mscale(1.0)


def rope_cos_sin(args, max_positions: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables `[max_positions, rotary_dim]` in fp32 (HF's rotate-half convention)."""
    inv_freq = ROPE_TYPES[rope_type(args)](args).to(torch.float32)
    t = torch.arange(max_positions, dtype=torch.float32)
    freqs = torch.outer(t, inv_freq)  # [P, hd/2]
    emb = torch.cat([freqs, freqs], dim=-1)  # [P, hd]
    scale = rope_attention_factor(args)
    return (emb.cos() * scale).to(device), (emb.sin() * scale).to(device)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, H, hd]; cos/sin: [T, r] → x with the leading r dimensions of each head rotated (r
    = hd: all of them), the rest passed as they are (same dtype)."""
    r = cos.shape[-1]
    if r < x.shape[-1]:
        return torch.cat([apply_rope(x[..., :r], cos, sin), x[..., r:]], dim=-1)
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    rotated = torch.cat([-x2, x1], dim=-1)
    if cos.dtype != x.dtype:
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return x * cos[:, None, :] + rotated * sin[:, None, :]
