"""The small ops between a decoder layer's projections, one Triton launch each: the residual add
with the RMSNorm after it, the rotary embedding of q and k, and SiLU(gate) · up.

On a GPU a decode step is a few hundred launches; the ops here are a few microseconds each, so
their number, not their work, is what they cost. Each kernel rounds where the torch modules of
`model_zoo.llama` round (the residual sum and the normalized row into the activations' dtype,
each product and sum of the rotary embedding, SiLU's output), so that they compute the modules'
numbers, but for the order of the norm's sum of squares and SiLU's exponential (`exp2`-based
here), which may move a result by one rounding step. The rotary embedding, a product and a sum
per element, is bit for bit the module's (launched without fused multiply-adds).

Each function has a torch reference (`*_ref`, the modules' own expressions).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from quantspec.errors import QuantSpecError
from quantspec.kernels._common import FLOAT_DTYPES, check_tensor, pdl_begin, pdl_kwargs

__all__ = ["add_rms_norm", "add_rms_norm_ref", "rope_qk_", "rope_qk_ref", "silu_mul", "silu_mul_ref"]


@triton.jit
def _add_rms_norm_kernel(x_ptr, r_ptr, w_ptr, out_ptr, res_ptr, D, eps,
                         stride_x, stride_r, stride_o, stride_s,
                         HAS_RES: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_begin(USE_PDL)
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < D
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RES:  # the residual stream's new value, rounded as torch adds in x's dtype
        r = tl.load(r_ptr + row * stride_r + offs, mask=mask, other=0.0)
        h = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(res_ptr + row * stride_s + offs, h, mask=mask)
    else:
        h = x
    hf = h.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(hf * hf, axis=0) / D + eps)
    normed = (hf * inv).to(x.dtype)  # HF: normalize in fp32, round to the input dtype, then scale
    w = tl.load(w_ptr + offs, mask=mask, other=0.0)
    tl.store(out_ptr + row * stride_o + offs, (w.to(tl.float32) * normed.to(tl.float32)).to(x.dtype), mask=mask)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual [T, D] (or residual None), weight [D] in x's dtype → (RMSNorm(h) · weight, h)
    with h = x + residual (x where residual is None): the next layer's input and the residual
    stream, in one launch."""
    check_tensor(x, "x", ndim=2, dtypes=FLOAT_DTYPES)
    T, D = x.shape
    check_tensor(weight, "weight", ndim=1, dtypes=(x.dtype,))
    if weight.shape[0] != D:
        raise QuantSpecError(f"add_rms_norm: weight {tuple(weight.shape)} must be [{D}], x's width")
    if residual is not None:
        check_tensor(residual, "residual", dtypes=(x.dtype,), shape=(T, D))
    out = torch.empty_like(x)
    h = torch.empty_like(x) if residual is not None else x
    if T:
        _add_rms_norm_kernel[(T,)](
            x, residual if residual is not None else x, weight, out, h, D, float(eps),
            x.stride(0), residual.stride(0) if residual is not None else 0, out.stride(0), h.stride(0),
            HAS_RES=residual is not None, BLOCK=triton.next_power_of_2(D), num_warps=4 if D <= 4096 else 8,
            **pdl_kwargs(x.device),
        )
    return out, h


def add_rms_norm_ref(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference: the decoder layer's `x + ...` and `model_zoo.llama.rms_norm`."""
    from quantspec.model_zoo.llama import rms_norm

    h = x if residual is None else x + residual
    return rms_norm(h, weight, eps), h


@triton.jit
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, stride_t, stride_h, stride_c,
                 HALF: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_begin(USE_PDL)
    t = tl.program_id(0)
    head = tl.program_id(1)
    d = tl.arange(0, BLOCK)
    mask = d < 2 * HALF
    base = x_ptr + t * stride_t + head * stride_h
    x = tl.load(base + d, mask=mask, other=0.0)
    partner = tl.where(d < HALF, d + HALF, d - HALF)
    rot = tl.load(base + partner, mask=mask, other=0.0).to(tl.float32)
    rot = tl.where(d < HALF, -rot, rot)  # cat([-x2, x1]) (negated in fp32: exact)
    c = tl.load(cos_ptr + t * stride_c + d, mask=mask, other=0.0)
    s = tl.load(sin_ptr + t * stride_c + d, mask=mask, other=0.0)
    a = (x.to(tl.float32) * c.to(tl.float32)).to(x.dtype)
    b = (rot * s.to(tl.float32)).to(x.dtype)
    tl.debug_barrier()  # every element of the head is read before any is written
    tl.store(base + d, (a.to(tl.float32) + b.to(tl.float32)).to(x.dtype), mask=mask)


def rope_qk_(x: torch.Tensor, heads: int, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate heads 0..`heads` of x [T, heads + more, hd] in place (a fused q/k/v projection's
    q and k heads) by cos / sin [T, hd] in x's dtype; returns x."""
    check_tensor(x, "x", ndim=3, dtypes=FLOAT_DTYPES)
    T, _, hd = x.shape
    check_tensor(cos, "cos", dtypes=(x.dtype,), shape=(T, hd))
    check_tensor(sin, "sin", dtypes=(x.dtype,), shape=(T, hd))
    if hd % 2 or not 0 < heads <= x.shape[1]:
        raise QuantSpecError(f"rope_qk_: x {tuple(x.shape)} needs an even head size and 0 < heads={heads} <= {x.shape[1]}")
    if T:
        _rope_kernel[(T, heads)](x, cos, sin, x.stride(0), x.stride(1), cos.stride(0), HALF=hd // 2,
                                 BLOCK=triton.next_power_of_2(hd), enable_fp_fusion=False, **pdl_kwargs(x.device))
    return x


def rope_qk_ref(x: torch.Tensor, heads: int, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Torch reference: a copy of x with heads 0..`heads` rotated by `model_zoo.llama.apply_rope`."""
    from quantspec.model_zoo.llama import apply_rope

    out = x.clone()
    out[:, :heads] = apply_rope(x[:, :heads], cos, sin)
    return out


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, I, stride_x, stride_o, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_begin(USE_PDL)
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < I
    g = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    u = tl.load(x_ptr + row * stride_x + I + offs, mask=mask, other=0.0)
    gf = g.to(tl.float32)
    act = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)  # torch's silu, rounded to the input dtype
    tl.store(out_ptr + row * stride_o + offs, (act.to(tl.float32) * u.to(tl.float32)).to(g.dtype), mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2I] (a fused gate/up projection's output) → silu(gate) · up [T, I]."""
    check_tensor(gate_up, "gate_up", ndim=2, dtypes=FLOAT_DTYPES)
    T, two_i = gate_up.shape
    if two_i % 2:
        raise QuantSpecError(f"silu_mul: gate_up {tuple(gate_up.shape)} needs an even last dimension")
    I = two_i // 2
    out = torch.empty((T, I), dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, triton.next_power_of_2(I))
    if T:
        _silu_mul_kernel[(T, triton.cdiv(I, block))](gate_up, out, I, gate_up.stride(0), out.stride(0), BLOCK=block,
                                                     **pdl_kwargs(gate_up.device))
    return out


def silu_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """Torch reference: `model_zoo.llama.SiluAndMul`."""
    from quantspec.model_zoo.llama import SiluAndMul

    return SiluAndMul()(gate_up)
