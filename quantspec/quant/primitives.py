"""The single source of quantization numbers: qparams, quantize, dequantize, fake-quantize.

Everything in quantspec that turns floats into codes or back (calibration observers, RTN, GPTQ,
packing, the kernels' torch references, tests) calls these functions. They reproduce
compressed-tensors' `calculate_qparams` and `lifecycle/forward.py` operation for operation, so a
checkpoint we write dequantizes to the same numbers under transformers / vLLM:

int, b bits:  q_min = -2^(b-1), q_max = 2^(b-1) - 1 (int4: [-8, 7], int8: [-128, 127])
  symmetric:   scale = max(|min|, |max|) / ((q_max - q_min) / 2)   (int4: /7.5, int8: /127.5)
               zero_point = 0
  asymmetric:  scale = (max - min) / (q_max - q_min),  zero_point = round(clamp(q_min - min/scale))
               float `zp_dtype`: zero_point = clamp(q_min - min/scale) cast to it, unrounded
  (min is clamped to ≤ 0 and max to ≥ 0 first, so 0.0 is always representable)
  quantize:    q = round_half_even(clamp(x / scale + zero_point, q_min, q_max))
fp8 E4M3:     scale = absmax / 448, q = float8_e4m3fn(clamp(x / scale, -448, 448))
NVFP4 (E2M1, strategy tensor_group, groups of 16, `global_scale` g = 448·6/absmax of the tensor,
              `quant.fp4`): local = float8_e4m3fn(clamp(g · absmax_group / 6, ±448)) (0 → 0.125),
              the effective scale local / g; q = E2M1(clamp(x / (local / g), -6, 6)) rounded to
              nearest, ties to even, kept in float8_e4m3fn
MXFP4 (E2M1, strategy group, groups of 32, scale_dtype uint8, `quant.fp4`): scale = 2^(e - 127),
              e = 127 + floor(log2(absmax_group rounded to a power of two)) - 2 (the E8M0 byte
              stored), computed in absmax's dtype; q = E2M1(clamp(x / scale, -6, 6))
MXFP8 (E4M3, the same layout): MXFP4's scale with 8 in place of 2; q = float8_e4m3fn(clamp(x /
              scale, -448, 448))
dequantize:   x̂ = (q - zero_point) * scale, computed in the scale's dtype (NVFP4: * (local / g)).
A scale that comes out 0 (an all-zero row) is replaced by the dtype's eps.
`observer: "mse"` args (weights): the range is shrunk per scale group to the factor p in
1, 0.99, ..., 0.80 minimising sum |x - fake_quant(x)|^2.4 (compressed-tensors' MSE observer
defaults; GPTQ's `mse` option), see `mse_qparams`.

Scale shapes by strategy, for a weight [N, K]: tensor → [1], channel → [N, 1], group and
tensor_group → [N, K/g],
block [bn, bk] → [ceil(N/bn), ceil(K/bk)] (a partial edge block is padded with zeros, as
compressed-tensors pads it); for an activation [..., K]: tensor → [1], token → [..., 1], group →
[..., K/g]; for K/V states [B, H, T, D]: attn_head → [H, 1, 1].
"""

from __future__ import annotations

import torch

from quantspec.errors import QuantSpecError
from quantspec.quant.args import QuantArgs
from quantspec.quant.fp4 import global_scale_from_absmax, local_scales, mx_emax, mx_scales, round_to_e2m1

__all__ = [
    "FP8_E4M3_MAX",
    "all_finite",
    "quant_range",
    "storage_dtype",
    "zero_point_dtype",
    "minmax",
    "qparams_from_minmax",
    "choose_qparams",
    "mse_qparams",
    "quantize",
    "dequantize",
    "effective_scale",
    "fake_quantize",
    "KV_KINDS",
    "static_args",
    "scale_from_absmax",
    "quantize_kv",
    "dequantize_kv",
]

FP8_E4M3_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448.0
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_CODE_DTYPES = (torch.int8, torch.int16, torch.int32, torch.float8_e4m3fn) + _FLOAT_DTYPES


def all_finite(x: torch.Tensor) -> bool:
    """True when x holds no NaN/Inf. One reduction (`aminmax` propagates NaN and keeps ±Inf):
    ~25x cheaper than `torch.isfinite(x).all()` on calibration activations."""
    if x.numel() == 0:
        return True
    lo, hi = x.aminmax()
    return bool(torch.isfinite(lo) & torch.isfinite(hi))


def quant_range(args: QuantArgs) -> tuple[float, float]:
    """(q_min, q_max) of the quantized grid: int4 (-8, 7), int8 (-128, 127), fp8 (-448, 448)."""
    return args.q_min, args.q_max


def storage_dtype(args: QuantArgs) -> torch.dtype:
    """The dtype codes are stored in: int8 for int ≤ 8 bits, float8_e4m3fn for fp8 and E2M1."""
    return torch.float8_e4m3fn if args.type == "float" else torch.int8


def zero_point_dtype(args: QuantArgs) -> torch.dtype:
    """compressed-tensors' zp_dtype: `args.zp_dtype` (float16 / bfloat16 / float32) when set,
    else int8 for int args and float8_e4m3fn for fp8 args."""
    if args.zp_dtype is not None:
        return getattr(torch, args.zp_dtype)
    return storage_dtype(args)


def _check_float(name: str, t: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor):
        raise QuantSpecError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in _FLOAT_DTYPES:
        raise QuantSpecError(f"{name} must be a float tensor (fp16/bf16/fp32/fp64), got {t.dtype}")


def _group_size(args: QuantArgs, K: int) -> int:
    g = args.group_size
    if K % g != 0:
        raise QuantSpecError(f"group_size {g} does not divide the input dim {K}; pick a group "
                             f"size that divides it (see quant.config.resolve_group_size)")
    return g


def _blocks(x: torch.Tensor, args: QuantArgs) -> torch.Tensor:
    """A weight [N, K] zero-padded to whole blocks and viewed as [N/bn, bn, K/bk, bk]."""
    if x.ndim != 2:
        raise QuantSpecError(f"block qparams need a 2-D weight [N, K], got shape {tuple(x.shape)}")
    bn, bk = args.block_structure
    N, K = x.shape
    pad_n, pad_k = -N % bn, -K % bk
    if pad_n or pad_k:
        x = torch.nn.functional.pad(x, (0, pad_k, 0, pad_n))
    return x.reshape((N + pad_n) // bn, bn, (K + pad_k) // bk, bk)


def minmax(x: torch.Tensor, args: QuantArgs) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-strategy (min, max) of `x`, shaped like the scales (see module docstring)."""
    _check_float("x", x)
    s = args.strategy
    if s == "block":
        xb = _blocks(x, args)
        return xb.amin(dim=(1, 3)), xb.amax(dim=(1, 3))  # [N/bn, K/bk]
    if s == "tensor":
        mn, mx = torch.aminmax(x)
        return mn.reshape(1), mx.reshape(1)
    if s == "channel":
        if x.ndim != 2:
            raise QuantSpecError(f"per-channel qparams need a 2-D weight [N, K], got shape "
                                 f"{tuple(x.shape)}")
        return x.amin(dim=1, keepdim=True), x.amax(dim=1, keepdim=True)  # [N, 1]
    if s in ("group", "tensor_group"):
        if x.ndim < 1:
            raise QuantSpecError("per-group qparams need at least one dim")
        g = _group_size(args, x.shape[-1])
        xg = x.unflatten(-1, (x.shape[-1] // g, g))  # [..., K/g, g]
        return xg.amin(dim=-1), xg.amax(dim=-1)  # [..., K/g]
    if s == "token":
        return x.amin(dim=-1, keepdim=True), x.amax(dim=-1, keepdim=True)  # [..., 1]
    if s == "attn_head":
        if x.ndim != 4:
            raise QuantSpecError(f"attn_head qparams need states [B, H, T, D], got shape "
                                 f"{tuple(x.shape)}")
        return x.amin(dim=(0, 2, 3)).reshape(-1, 1, 1), x.amax(dim=(0, 2, 3)).reshape(-1, 1, 1)
    raise QuantSpecError(f"strategy {s!r} has no qparams rule")  # unreachable: args validated


def qparams_from_minmax(min_vals: torch.Tensor, max_vals: torch.Tensor, args: QuantArgs,
                        global_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, zero_point) from observed min/max, exactly as compressed-tensors computes them.

    NVFP4 args (`global_scale` fp32 [1] required): the local FP8 scales, as float32 values;
    MXFP4 args: the power-of-two scales (`quant.fp4.mx_scales`).

    scale has the dtype of `min_vals`; zero_point has `zero_point_dtype(args)`: int8 (int args),
    float8_e4m3fn (fp8) or the float `args.zp_dtype` (unrounded), all zeros when symmetric.
    An all-zero slice gets zero point 0 (compressed-tensors: 0 for int zero points via a NaN
    cast, NaN for a float zp_dtype — quantspec keeps 0 so the slice dequantizes to 0).
    """
    _check_float("min_vals", min_vals)
    _check_float("max_vals", max_vals)
    if min_vals.shape != max_vals.shape:
        raise QuantSpecError(f"min_vals {tuple(min_vals.shape)} and max_vals "
                             f"{tuple(max_vals.shape)} must have the same shape")
    dtype = min_vals.dtype
    min_vals = torch.minimum(min_vals, torch.zeros_like(min_vals))
    max_vals = torch.maximum(max_vals, torch.zeros_like(max_vals))
    if args.is_mx:
        return mx_scales(torch.maximum(min_vals.abs(), max_vals.abs()), mx_emax(args.num_bits))
    if args.is_fp4:
        return local_scales(torch.maximum(min_vals.abs(), max_vals.abs()), global_scale)
    q_min, q_max = quant_range(args)
    bit_range = torch.tensor(q_max - q_min, dtype=dtype, device=min_vals.device)
    eps = torch.finfo(dtype).eps
    if args.symmetric:
        absmax = torch.maximum(min_vals.abs(), max_vals.abs())
        scale = absmax / (bit_range / 2)
        scale = torch.where(scale == 0, torch.full_like(scale, eps), scale)
        zero_point = torch.zeros(scale.shape, dtype=zero_point_dtype(args), device=scale.device)
    else:
        scale = (max_vals - min_vals) / bit_range
        empty = scale == 0
        # an all-zero slice: eps scale and zero point 0 (compressed-tensors gets 0 from a NaN cast)
        scale = torch.where(empty, torch.full_like(scale, eps), scale)
        zp = torch.clamp(q_min - min_vals / scale, q_min, q_max)
        zp = torch.where(empty, torch.zeros_like(zp), zp)
        zdtype = zero_point_dtype(args)
        if zdtype.is_floating_point:  # a float zp_dtype: cast, not rounded (compressed-tensors)
            zero_point = zp.to(zdtype)
        else:
            zero_point = torch.round(torch.clamp(zp, -128, 127)).to(zdtype)
    if scale.ndim == 0:
        scale, zero_point = scale.reshape(1), zero_point.reshape(1)
    return scale, zero_point


def choose_qparams(x: torch.Tensor, args: QuantArgs, global_scale: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, zero_point) for `x` under `args`: min/max, or the MSE search for `observer="mse"`.
    NVFP4 args: local scales under `global_scale` (default: the one of x's own absmax)."""
    if args.is_nvfp4:
        mn, mx = minmax(x, args)
        if global_scale is None:
            global_scale = global_scale_from_absmax(torch.maximum(mn.abs(), mx.abs()))
        return qparams_from_minmax(mn, mx, args, global_scale)
    if args.observer == "mse":
        return mse_qparams(x, args)
    return qparams_from_minmax(*minmax(x, args), args)


MSE_GRID, MSE_MAX_SHRINK, MSE_NORM = 100, 0.20, 2.4  # compressed-tensors' MSE observer defaults


def _error_per_scale(err: torch.Tensor, args: QuantArgs) -> torch.Tensor:
    """Sum an elementwise error over each scale's slice: shaped like the scales of `args`."""
    s = args.strategy
    if s == "tensor":
        return err.sum().reshape(1)
    if s in ("channel", "token"):
        return err.sum(dim=-1, keepdim=True)
    if s == "group":
        g = _group_size(args, err.shape[-1])
        return err.unflatten(-1, (err.shape[-1] // g, g)).sum(dim=-1)
    raise QuantSpecError(f"the MSE search has no rule for strategy {s!r}; use minmax")


@torch.no_grad()
def mse_qparams(x: torch.Tensor, args: QuantArgs, *, grid: int = MSE_GRID,
                max_shrink: float = MSE_MAX_SHRINK, norm: float = MSE_NORM
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, zero_point) whose range (min, max) is shrunk, per scale, to p·(min, max) with
    p = 1 - i/grid for i = 0 .. max_shrink·grid, the p minimising sum |x - fake_quant(x)|^norm.

    Each candidate goes through `qparams_from_minmax` and `fake_quantize`'s numbers in float32,
    so for a float32 x the chosen pair is exactly what quantize/dequantize use (other dtypes get
    the scale cast to theirs, as min/max does). p = 1 (plain min/max) is a candidate: the result
    is never worse than min/max on this error. The candidates share one float32 buffer the size
    of x: the search allocates nothing that size per candidate.
    """
    _check_float("x", x)
    if args.strategy == "block":
        raise QuantSpecError("the MSE search has no rule for block scales; use the minmax observer")
    xf = x.float()
    mn, mx = minmax(xf, args)
    best_scale = best_zp = best_err = None
    # a candidate's fake-quantized x, then its error (contiguous: its group view is a view)
    work = torch.empty(xf.shape, dtype=torch.float32, device=xf.device)
    for i in range(int(round(max_shrink * grid)) + 1):
        p = 1.0 - i / grid
        scale, zp = qparams_from_minmax(mn * p, mx * p, args)
        _fake_quantize_into(work, xf, scale, zp, args)
        err = _error_per_scale(work.sub_(xf).abs_().pow_(norm), args)
        if best_err is None:
            best_scale, best_zp, best_err = scale, zp, err
            continue
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_scale = torch.where(better, scale, best_scale)
        best_zp = torch.where(better, zp, best_zp)
    return best_scale.to(x.dtype), best_zp


def _broadcast(x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None,
               args: QuantArgs):
    """(x, scale, zp, restore) broadcastable against each other: for group strategy x as
    [..., K/g, g] and scale/zp [..., K/g, 1]; for block strategy x as [N/bn, bn, K/bk, bk] (padded)
    and scale/zp [N/bn, 1, K/bk, 1]. `restore(t)` takes a result of x's view back to x's shape
    (None: no view was taken)."""
    if args.strategy == "block":
        N, K = x.shape
        xb = _blocks(x, args)
        if tuple(scale.shape) != (xb.shape[0], xb.shape[2]):
            raise QuantSpecError(f"scale has shape {tuple(scale.shape)} but a [{N}, {K}] weight in "
                                 f"{list(args.block_structure)} blocks needs {(xb.shape[0], xb.shape[2])}")
        zb = None if zero_point is None else zero_point[:, None, :, None]
        return xb, scale[:, None, :, None], zb, lambda t: t.reshape(-1, xb.shape[2] * xb.shape[3])[:N, :K]
    if args.strategy not in ("group", "tensor_group"):
        return x, scale, zero_point, None
    K = x.shape[-1]
    g = _group_size(args, K)
    while scale.ndim < 2:
        scale = scale.unsqueeze(1)
        zero_point = None if zero_point is None else zero_point.unsqueeze(1)
    if scale.shape[-1] != K // g:
        raise QuantSpecError(f"scale has {scale.shape[-1]} groups but K={K} with group_size {g} "
                             f"needs {K // g}")
    xg = x.unflatten(-1, (K // g, g))  # [..., K/g, g]
    zg = None if zero_point is None else zero_point.unsqueeze(-1)
    return xg, scale.unsqueeze(-1), zg, lambda t: t.flatten(start_dim=-2)


def _check_qparams(scale: torch.Tensor, zero_point: torch.Tensor | None, args: QuantArgs) -> None:
    _check_float("scale", scale)
    if zero_point is None and not args.symmetric:
        raise QuantSpecError("asymmetric args need a zero_point; pass the one choose_qparams "
                             "returned")
    if zero_point is not None and zero_point.shape != scale.shape:
        raise QuantSpecError(f"zero_point shape {tuple(zero_point.shape)} must equal scale shape "
                             f"{tuple(scale.shape)}")


def effective_scale(scale: torch.Tensor, args: QuantArgs, global_scale: torch.Tensor | None) -> torch.Tensor:
    """NVFP4: local / global (compressed-tensors divides the same way); every other type: scale."""
    if not args.is_nvfp4:
        return scale
    if global_scale is None:
        raise QuantSpecError("NVFP4 codes need their global scale (weight_global_scale / input_global_scale)")
    return scale / global_scale.to(scale.device)


@torch.no_grad()
def quantize(x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None,
             args: QuantArgs, dtype: torch.dtype | None = None,
             global_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Codes for `x`: round(clamp(x / scale + zp)) (int), float8(clamp(x / scale)) (fp8), or
    E2M1(clamp(x / (scale / global_scale))) (NVFP4).

    Returns `dtype` (default: `storage_dtype(args)`, i.e. int8 or float8_e4m3fn), same shape as x.
    """
    _check_float("x", x)
    _check_qparams(scale, None if args.is_fp4 else zero_point, args)
    out_dtype = storage_dtype(args) if dtype is None else dtype
    scale = effective_scale(scale, args, global_scale)
    xs, s, zp, restore = _broadcast(x, scale, None if args.is_fp4 else zero_point, args)
    scaled = _to_grid_(xs / s, zp, args)
    if args.type == "float":
        q = scaled.to(torch.float8_e4m3fn)
        q = q if out_dtype == torch.float8_e4m3fn else q.to(scaled.dtype)
    else:
        q = scaled
    q = q.to(out_dtype)
    return q if restore is None else restore(q).contiguous()


# The steps of quantize / dequantize on a tensor of their own, in place: the same numbers as
# out-of-place ops, without a fresh allocation per op (which page-faults whenever the allocator
# has handed its free pages back to the system).

def _to_grid_(scaled: torch.Tensor, zp: torch.Tensor | None, args: QuantArgs) -> torch.Tensor:
    """x / scale (in `scaled`, overwritten) → clamp(· + zp) onto the grid, rounded half to even
    for int args (fp8's rounding is the cast to float8_e4m3fn)."""
    q_min, q_max = quant_range(args)
    if zp is not None:
        scaled.add_(zp.to(scaled.dtype))
    scaled.clamp_(q_min, q_max)
    if args.is_fp4:
        return round_to_e2m1(scaled)
    return scaled if args.type == "float" else scaled.round_()


def _from_grid_(q: torch.Tensor, s: torch.Tensor, zp: torch.Tensor | None) -> torch.Tensor:
    """Float codes `q` in the scale's dtype (overwritten) → (q - zp) * s."""
    if zp is not None:
        q.sub_(zp.to(q.dtype))
    return q.mul_(s)


def _fake_quantize_into(out: torch.Tensor, x: torch.Tensor, scale: torch.Tensor,
                        zero_point: torch.Tensor | None, args: QuantArgs) -> torch.Tensor:
    """`fake_quantize(x, scale, zero_point, args)` written into `out` (contiguous, x's shape) for
    x and scale of out's dtype (float32 in `mse_qparams`), with no temporary the size of x; not
    for block args (a padded block view is no view of `out`; `mse_qparams` refuses them)."""
    xs, s, zp, restore = _broadcast(x, scale, zero_point, args)
    o = out if restore is None else out.unflatten(-1, xs.shape[-2:])  # a view of out
    _to_grid_(torch.div(xs, s, out=o), zp, args)
    if args.type == "float":
        o.copy_(o.to(torch.float8_e4m3fn))  # fp8's rounding (a 1-byte temporary)
    _from_grid_(o, s, zp)
    return out


@torch.no_grad()
def dequantize(q: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None,
               args: QuantArgs, dtype: torch.dtype | None = None,
               global_scale: torch.Tensor | None = None) -> torch.Tensor:
    """(q - zero_point) * scale in the scale's dtype, returned as `dtype` (default scale's);
    NVFP4: q * (scale / global_scale)."""
    if not isinstance(q, torch.Tensor) or q.dtype not in _CODE_DTYPES:
        raise QuantSpecError(f"q must be an int8/int32/float8 code tensor, got "
                             f"{getattr(q, 'dtype', type(q).__name__)}")
    _check_float("scale", scale)
    if zero_point is not None and zero_point.shape != scale.shape:
        raise QuantSpecError(f"zero_point shape {tuple(zero_point.shape)} must equal scale shape "
                             f"{tuple(scale.shape)}")
    out_dtype = scale.dtype if dtype is None else dtype
    if args.is_fp4:
        scale, zero_point = effective_scale(scale, args, global_scale), None
    if args.strategy == "block":  # padding takes float codes (exact: int8 and E4M3 ⊂ fp32)
        q = q.to(scale.dtype)
    qs, s, zp, restore = _broadcast(q, scale, zero_point, args)
    x = _from_grid_(qs.to(s.dtype, copy=True), s, zp).to(out_dtype)
    return x if restore is None else restore(x).contiguous()


@torch.no_grad()
def fake_quantize(x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None,
                  args: QuantArgs, global_scale: torch.Tensor | None = None) -> torch.Tensor:
    """dequantize(quantize(x)) in one call; returns x's dtype and shape."""
    q = quantize(x, scale, zero_point, args, dtype=x.dtype if args.type == "int" else None,
                 global_scale=global_scale)
    return dequantize(q, scale, zero_point, args, dtype=x.dtype, global_scale=global_scale)


# ---------------------------------------------------------------------------------------------
# static (calibrated) scales: activations and the KV cache
# ---------------------------------------------------------------------------------------------
#
# Calibration stores absmax (an observer's output); the scales are derived here, on read, so the
# same table serves int8 and fp8:
#   int8: scale = absmax / 127.5 (compressed-tensors' symmetric rule), stored = clamp(round(x /
#         scale), -128, 127) as int8;
#   fp8:  scale = absmax / 448, stored = float8_e4m3fn(clamp(x / scale, ±448)).
# KV cache: x [..., KV, hd] with one scale per KV head, scale [KV].

KV_KINDS = ("int8", "fp8")


def _require_fp8() -> None:
    if not hasattr(torch, "float8_e4m3fn"):
        raise QuantSpecError(f"this torch build ({torch.__version__}) has no float8_e4m3fn dtype; "
                             "use int8 instead of fp8 or upgrade torch (>= 2.1)")


def static_args(kind: str) -> QuantArgs:
    """The symmetric per-tensor QuantArgs of a static "int8" | "fp8" scale."""
    if kind not in KV_KINDS:
        raise QuantSpecError(f"static scale kind {kind!r} unsupported; use 'int8' or 'fp8'")
    if kind == "fp8":
        _require_fp8()
        return QuantArgs(num_bits=8, type="float", symmetric=True, strategy="tensor")
    return QuantArgs(num_bits=8, type="int", symmetric=True, strategy="tensor")


def scale_from_absmax(absmax: torch.Tensor, kind: str) -> torch.Tensor:
    """Static symmetric scale(s) of the same shape as `absmax` (float32; 0-d → [1]).

    int8: absmax / 127.5; fp8: absmax / 448; an absmax of 0 gives fp32 eps (never a 0 scale).
    Example: absmax [127.5, 0.0] int8 → [1.0, 1.1920929e-07].
    """
    _check_float("absmax", absmax)
    a = absmax.detach().float()
    if a.ndim == 0:
        a = a.reshape(1)
    if bool((a < 0).any()):
        raise QuantSpecError("absmax must be >= 0; pass an observer's absmax, not a min")
    scale, _ = qparams_from_minmax(-a, a, static_args(kind))
    return scale


def _check_kv(x: torch.Tensor, scale: torch.Tensor, where: str) -> None:
    if not isinstance(scale, torch.Tensor) or scale.ndim != 1:
        raise QuantSpecError(f"{where}: scale must be a 1-D tensor [num_kv_heads], got "
                             f"{getattr(scale, 'shape', type(scale).__name__)}")
    if x.ndim < 2 or x.shape[-2] != scale.shape[0]:
        raise QuantSpecError(f"{where}: x must be [..., KV={scale.shape[0]}, head_dim], got shape "
                             f"{tuple(x.shape)}")


@torch.no_grad()
def quantize_kv(x: torch.Tensor, scale: torch.Tensor, kind: str) -> torch.Tensor:
    """K or V states x [..., KV, hd] → int8 / float8_e4m3fn codes [..., KV, hd], per-head scale [KV].

    int8: clamp(round(x / scale), -128, 127); fp8: float8_e4m3fn(clamp(x / scale, ±448)); the
    division is done in float32 (x of any float dtype).
    """
    args = static_args(kind)
    _check_float("x", x)
    _check_kv(x, scale, "quantize_kv")
    s = scale.detach().to(x.device, torch.float32).unsqueeze(-1)  # [KV, 1]
    return quantize(x.float(), s, None, args)


@torch.no_grad()
def dequantize_kv(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32
                  ) -> torch.Tensor:
    """Codes q [..., KV, hd] (int8 or float8_e4m3fn) → q * scale [KV] per head, as `dtype`.

    The product is taken in float32, then cast (so int8 → bf16 rounds once).
    """
    if not isinstance(q, torch.Tensor):
        raise QuantSpecError(f"dequantize_kv: q must be a tensor, got {type(q).__name__}")
    if q.dtype == torch.int8:
        args = static_args("int8")
    elif hasattr(torch, "float8_e4m3fn") and q.dtype == torch.float8_e4m3fn:
        args = static_args("fp8")
    else:
        raise QuantSpecError(f"dequantize_kv: q must hold int8 or float8_e4m3fn codes, got {q.dtype}")
    _check_kv(q, scale, "dequantize_kv")
    s = scale.detach().to(q.device, torch.float32).unsqueeze(-1)  # [KV, 1]
    return dequantize(q, s, None, args, dtype=dtype)
