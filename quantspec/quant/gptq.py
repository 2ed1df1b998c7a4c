"""GPTQ: second-order weight rounding for one Linear (Frantar et al. 2022, arXiv:2210.17323).

Terms:
- **Hessian** H [K, K]: of the layer's reconstruction error ||X Wᵀ - X Ŵᵀ||² with respect to a
  weight row, H = 2/n Σ_t x_t x_tᵀ over the n calibration input rows x_t [K] (`HessianAccumulator`).
- **Damping**: H + λ·I with λ = damp · mean(diag H), so H is safely positive definite when the
  calibration data does not span all K directions.
- **Dead columns**: inputs that were always 0 (H_ii == 0) carry no information; their weights are
  set to 0 and H_ii to 1.
- **Lazy batch updates**: columns are quantized left to right inside a block of `block_size`
  columns, each column's rounding error is spread onto the not-yet-quantized columns of the block
  through the upper Cholesky factor U of H⁻¹ (err / U_ii times U_i,i:); the block's accumulated
  error updates the rest of the matrix with one matmul.
- **act-order**: columns are processed in order of decreasing H_ii (most-activated first). To keep
  the artifact loadable without `g_idx`, group scales are "static groups": computed once from the
  original weight, in the original column order, before permuting; a permuted column uses the
  scales of the group it came from. The codes are un-permuted at the end, so the stored layout is
  the plain [N, K/g] group layout.

GPTQ is row-independent: layers that share an input (q/k/v, gate/up) can be concatenated along N
and quantized in one call with their shared Hessian.

NVFP4 (tensor_group) runs like groups of 16 whose local scales are set under one global scale,
fixed before the loop from the weight it is given (or the caller's, for Linears that share one):
llm-compressor's GPTQ on NVFP4. FP8 block scales (FP8_BLOCK, [bn, bk] blocks) run like groups of
bk columns whose scales are shared by bn rows: each block's scale is set from its updated weights
when the loop reaches its first column (from the original weight under act-order).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch

from quantspec.errors import QuantSpecError
from quantspec.quant.args import QuantArgs
from quantspec.quant.fp4 import E2M1_MAX, global_scale_from_absmax, round_to_e2m1
from quantspec.quant.primitives import (choose_qparams, dequantize, quantize, storage_dtype,
                                        zero_point_dtype)

__all__ = ["HessianAccumulator", "GPTQResult", "gptq_quantize", "rtn_by_rows", "rtn_quantize"]

# `rtn_by_rows` works on blocks of rows of at most this many float32 bytes
RTN_BLOCK_BYTES = 32 * 2**20


class HessianAccumulator:
    """Running H = 2/n Σ x xᵀ over the rows of every `update(x [..., K])`; `compute()` → [K, K]."""

    def __init__(self, in_features: int, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32) -> None:
        if not isinstance(in_features, int) or in_features <= 0:
            raise QuantSpecError(f"in_features must be a positive int, got {in_features!r}")
        self.in_features = in_features
        self.H = torch.zeros(in_features, in_features, device=device, dtype=dtype)  # [K, K]
        self.num_samples = 0

    @torch.no_grad()
    def update(self, x: torch.Tensor) -> None:
        if not isinstance(x, torch.Tensor) or not x.is_floating_point():
            raise QuantSpecError("HessianAccumulator.update needs a float tensor [..., K]")
        if x.shape[-1] != self.in_features:
            raise QuantSpecError(f"HessianAccumulator.update: last dim {x.shape[-1]} != "
                                 f"in_features {self.in_features}")
        if self.H is None:
            raise QuantSpecError("HessianAccumulator.update: its Hessian was taken already")
        x = x.reshape(-1, self.in_features).to(self.H.dtype)  # [T, K]
        t = x.shape[0]
        if t == 0:
            return
        n = self.num_samples
        self.H *= n / (n + t)
        self.num_samples = n + t
        x = x * math.sqrt(2.0 / self.num_samples)
        self.H.addmm_(x.t(), x)

    def compute(self) -> torch.Tensor:
        self._check_fed("compute")
        return self.H.clone()

    def take(self) -> torch.Tensor:
        """H [K, K] handed over without a copy: the accumulator is spent (holds no Hessian)."""
        self._check_fed("take")
        H, self.H = self.H, None
        return H

    def _check_fed(self, what: str) -> None:
        if self.H is None:
            raise QuantSpecError(f"HessianAccumulator.{what}: its Hessian was taken already")
        if self.num_samples == 0:
            raise QuantSpecError(f"HessianAccumulator.{what} called before any update(); feed "
                                 "calibration inputs first")


@dataclass
class GPTQResult:
    """Codes q [N, K] (int8 / float8), scale and zero_point shaped per strategy, the dequantized
    weight [N, K] (= dequantize(q, scale, zero_point)), and GPTQ's loss Σ (w - ŵ)² / (2 U_ii²)."""

    q: torch.Tensor
    scale: torch.Tensor
    zero_point: torch.Tensor
    weight_dq: torch.Tensor
    loss: float
    args: QuantArgs
    perm: torch.Tensor | None = None


def rtn_quantize(weight: torch.Tensor, args: QuantArgs, scale_dtype: torch.dtype | None = None,
                 global_scale: torch.Tensor | None = None) -> GPTQResult:
    """Round-to-nearest with min/max qparams (the baseline GPTQ improves on); NVFP4 args under
    `global_scale` (default: the weight's own)."""
    _check_weight(weight, args)
    w = weight.float()
    scale, zp = choose_qparams(w, args, global_scale)
    scale = scale.to(scale_dtype or weight.dtype)  # NVFP4's FP8 values: exact in every float dtype
    q = quantize(w, scale, zp, args, global_scale=global_scale)
    return GPTQResult(q=q, scale=scale, zero_point=zp,
                      weight_dq=dequantize(q, scale, zp, args, dtype=weight.dtype, global_scale=global_scale),
                      loss=float("nan"), args=args)


def rtn_by_rows(weight: torch.Tensor, args: QuantArgs, scale_dtype: torch.dtype,
                global_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Round-to-nearest of `weight` [N, K] under per-row (channel / group) `args`, in blocks of
    rows of at most `RTN_BLOCK_BYTES` (float32), so its temporaries stay small whatever N;
    `weight` is overwritten with its dequantized values. → (q [N, K], scale, zero_point or None),
    the same numbers as one `rtn_quantize` call over all rows (block args: whole block rows)."""
    rows = max(1, RTN_BLOCK_BYTES // (weight.shape[1] * 4))
    if args.strategy == "block":
        bn = args.block_structure[0]
        rows = max(bn, rows // bn * bn)
    qs, scales, zps = [], [], []
    for a in range(0, weight.shape[0], rows):
        block = weight[a:a + rows]  # [≤ rows, K]
        r = rtn_quantize(block, args, scale_dtype=scale_dtype, global_scale=global_scale)
        block.copy_(r.weight_dq)
        qs.append(r.q)
        scales.append(r.scale)
        zps.append(r.zero_point)
    zp = None if zps[0] is None else torch.cat(zps)
    return torch.cat(qs), torch.cat(scales), zp


def _check_weight(weight: torch.Tensor, args: QuantArgs) -> None:
    if not isinstance(weight, torch.Tensor) or weight.ndim != 2 or not weight.is_floating_point():
        raise QuantSpecError(f"weight must be a float tensor [N, K], got "
                             f"{getattr(weight, 'shape', type(weight))}")
    if not isinstance(args, QuantArgs):
        raise QuantSpecError(f"args must be QuantArgs, got {type(args).__name__}")
    if args.strategy not in ("tensor", "channel", "group", "tensor_group", "block"):
        raise QuantSpecError(f"weight strategy {args.strategy!r} unsupported; use tensor, "
                             "channel, group, tensor_group or block")
    if args.strategy in ("group", "tensor_group") and weight.shape[1] % args.group_size:
        raise QuantSpecError(f"group_size {args.group_size} does not divide K={weight.shape[1]}; "
                             "use quant.config.resolve_group_size to pick one")


@contextlib.contextmanager
def _single_thread():
    """Run GPTQ on one intra-op thread: the column loop's ops are [N, ≤128] — too small to gain
    from OpenMP threads — and on a busy 2-core machine the threads' spin-waits made it 4-20×
    slower (e.g. 2.1 s vs 0.1 s for a 1536×576 weight)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@torch.no_grad()
def gptq_quantize(weight: torch.Tensor, hessian: torch.Tensor, args: QuantArgs, *,
                  block_size: int = 128, damp: float = 0.01, act_order: bool = False,
                  scale_dtype: torch.dtype | None = None, consume_hessian: bool = False,
                  global_scale: torch.Tensor | None = None) -> GPTQResult:
    """Quantize weight [N, K] with GPTQ given the input Hessian [K, K] (see module docstring).

    Scales are rounded to `scale_dtype` (default: the weight's dtype, as compressed-tensors
    stores them) before any code is computed, so the returned codes, scales and `weight_dq` are
    mutually exact. With an identity Hessian GPTQ reduces to round-to-nearest.
    `consume_hessian`: the caller hands `hessian` over (e.g. `HessianAccumulator.take()`): it is
    damped and factorised in place and left empty, so no copy of it is made and its memory is
    freed as soon as it is factorised (a down_proj's [I, I] is the largest tensor of a layer).
    NVFP4 args: local scales under `global_scale` (default: the weight's own).
    """
    if args.is_nvfp4 and global_scale is None:
        global_scale = global_scale_from_absmax(weight.detach().float().abs().amax())
    on_cpu = weight.device.type == "cpu"
    with _single_thread() if on_cpu else contextlib.nullcontext():
        return _gptq(weight, hessian, args, block_size=block_size, damp=damp, act_order=act_order,
                     scale_dtype=scale_dtype, consume=consume_hessian, global_scale=global_scale)


def _gptq(weight: torch.Tensor, hessian: torch.Tensor, args: QuantArgs, *, block_size: int,
          damp: float, act_order: bool, scale_dtype: torch.dtype | None, consume: bool,
          global_scale: torch.Tensor | None) -> GPTQResult:
    _check_gptq_inputs(weight, hessian, args, block_size=block_size, damp=damp)
    g = _column_group(args)
    if g is not None:  # whole groups per block, so each group's qparams see its updated columns
        block_size = max(g, (block_size // g) * g)
    W, H, grid = _prepare(weight, hessian, args, scale_dtype or weight.dtype, act_order, consume, global_scale)
    U = _inverse_factor(H, damp)  # [K, K]; H is left empty
    Q, loss = _quantize_columns(W, U, args, grid, block_size)
    if grid.perm is not None:
        Q = Q[:, torch.argsort(grid.perm)]
    weight_dq = dequantize(Q, grid.scale, grid.zero_point, args, dtype=weight.dtype, global_scale=global_scale)
    return GPTQResult(q=Q, scale=grid.scale, zero_point=grid.zero_point, weight_dq=weight_dq,
                      loss=float(loss.sum()), args=args, perm=grid.perm)


def _check_gptq_inputs(weight: torch.Tensor, hessian: torch.Tensor, args: QuantArgs, *,
                       block_size: int, damp: float) -> None:
    _check_weight(weight, args)
    K = weight.shape[1]
    if not isinstance(hessian, torch.Tensor) or hessian.shape != (K, K):
        raise QuantSpecError(f"hessian must be [K, K] = [{K}, {K}], got "
                             f"{tuple(getattr(hessian, 'shape', ()))}")
    if not 0 <= damp < 1:
        raise QuantSpecError(f"damp must be in [0, 1), got {damp}")
    if block_size <= 0:
        raise QuantSpecError(f"block_size must be positive, got {block_size}")


@dataclass
class _Grid:
    """The quantization grid GPTQ rounds onto: scale / zero_point shaped per strategy (group
    qparams are filled in as the column loop reaches each group, unless act-order fixed them up
    front) and the column order (`perm`, None: the original)."""

    scale: torch.Tensor
    zero_point: torch.Tensor
    perm: torch.Tensor | None
    global_scale: torch.Tensor | None = None  # NVFP4's


def _prepare(weight: torch.Tensor, hessian: torch.Tensor, args: QuantArgs, sdtype: torch.dtype,
             act_order: bool, consume: bool, global_scale: torch.Tensor | None
             ) -> tuple[torch.Tensor, torch.Tensor, _Grid]:
    """float32 copies of the weight [N, K] and Hessian [K, K] (`consume`: the Hessian itself,
    `hessian` left empty) with dead columns handled, in the order GPTQ visits the columns, and
    the grid (per-channel / per-tensor and static-group qparams are computed here, from the
    weight with its dead columns zeroed)."""
    N, K = weight.shape
    group = _column_group(args) is not None
    W = weight.detach().to(torch.float32).clone()  # [N, K]
    H = hessian.detach().to(device=W.device, dtype=torch.float32, copy=not consume)  # [K, K]
    if consume:
        hessian.set_()  # the caller's tensor lets go of the storage: H holds the only reference
    dead = torch.diag(H) == 0
    H[dead, dead] = 1.0
    W[:, dead] = 0.0
    scale = zp = perm = None
    if not group or act_order:  # static groups: from the original weight, original column order
        scale, zp = choose_qparams(W, args, global_scale)  # [N, 1], [1] or [N, K/g]
        scale = scale.to(sdtype)
    if act_order:
        perm = torch.argsort(torch.diag(H), descending=True)
        W = W[:, perm]
        H = H[perm][:, perm]
    elif group:
        shape = (N, K // args.group_size) if args.strategy != "block" else \
            tuple(-(-n // b) for n, b in zip((N, K), args.block_structure))  # whole blocks, the last padded
        scale = torch.empty(shape, dtype=sdtype, device=W.device)
        zp = torch.empty(shape, dtype=zero_point_dtype(args), device=W.device)
    return W, H, _Grid(scale, zp, perm, global_scale)


def _column_group(args: QuantArgs) -> int | None:
    """The columns that share qparams, set when the column loop reaches their first: a group's
    (group, NVFP4's tensor_group) or a block's width (FP8_BLOCK, whose rows share them in blocks
    too); None for per-channel / per-tensor qparams, fixed up front."""
    if args.strategy in ("group", "tensor_group"):
        return args.group_size
    return args.block_structure[1] if args.strategy == "block" else None


def _inverse_factor(H: torch.Tensor, damp: float) -> torch.Tensor:
    """The upper Cholesky factor U [K, K] of (H + damping)⁻¹. H is damped in place and emptied
    once factorised (`set_()` frees its storage whoever else refers to it), so at most two
    [K, K] matrices are alive at a time: for a large K (an MLP's down_proj) each is large."""
    H.diagonal().add_(damp * torch.mean(torch.diag(H)))
    try:
        L = torch.linalg.cholesky(H)
        H.set_()
        Hinv = torch.cholesky_inverse(L)
        del L
        return torch.linalg.cholesky(Hinv, upper=True)
    except torch.linalg.LinAlgError:
        raise QuantSpecError(f"the Hessian is not positive definite even with damp={damp}; "
                             "raise damp (e.g. 0.1) or calibrate on more tokens") from None


def _quantize_columns(W: torch.Tensor, U: torch.Tensor, args: QuantArgs, grid: _Grid,
                      block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """GPTQ's column loop with lazy batch updates (module docstring) over W [N, K] (updated in
    place) → (codes [N, K] in the visiting order, loss [N])."""
    N, K = W.shape
    Q = torch.empty(N, K, dtype=storage_dtype(args), device=W.device)  # codes, visiting order
    loss = torch.zeros(N, dtype=torch.float32, device=W.device)
    # a column's qparams: per row (int / FP8 groups); FP4 and MX groups keep their args (a group's
    # g columns → [N, 1]: their scale rules are the format's own)
    microscaled = args.microscaled is not None
    col_args = args.replace(strategy="channel", group_size=None, block_structure=None) \
        if args.strategy in ("group", "block") and not microscaled else args
    quant_column = _microscaled_column if microscaled else _column
    for i1 in range(0, K, block_size):
        i2 = min(i1 + block_size, K)
        W1 = W[:, i1:i2].clone()  # [N, B]
        Err1 = torch.empty_like(W1)
        U1 = U[i1:i2, i1:i2]  # [B, B]
        for i in range(i2 - i1):
            col = i1 + i
            s, z = _column_qparams(W1, i, col, args, col_args, grid)
            w = W1[:, i:i + 1]  # [N, 1]
            q, dq = quant_column(w, s, z, col_args, grid)
            Q[:, col:col + 1] = q
            err = (w - dq) / U1[i, i]  # [N, 1]
            loss += err.squeeze(1).square() / 2
            W1[:, i:] -= err @ U1[i:i + 1, i:]
            Err1[:, i:i + 1] = err
        if i2 < K:
            W[:, i2:] -= Err1 @ U[i1:i2, i2:]
    return Q, loss


def _column(w: torch.Tensor, s: torch.Tensor, z: torch.Tensor, col_args: QuantArgs, grid: _Grid
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, dequantized fp32) of one column w [N, 1] under its scale / zero point."""
    q = quantize(w, s, z, col_args)
    return q, dequantize(q, s, z, col_args, dtype=torch.float32)


def _microscaled_column(w: torch.Tensor, s: torch.Tensor, z: torch.Tensor, col_args: QuantArgs, grid: _Grid
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """`_column` for FP4 and MXFP8: the codes of w / (s / global) (NVFP4: the group's local scale
    s [N, 1]; MXFP4 / MXFP8: w / s, its power-of-two scale), E2M1 or E4M3, and their values,
    `primitives.quantize` / `dequantize`'s operations on one column."""
    eff = s if grid.global_scale is None else s / grid.global_scale
    if col_args.is_fp4:
        q = round_to_e2m1((w / eff).clamp_(-E2M1_MAX, E2M1_MAX)).to(torch.float8_e4m3fn)
    else:
        q = (w / eff).clamp_(-col_args.q_max, col_args.q_max).to(torch.float8_e4m3fn)
    return q, q.to(eff.dtype) * eff


def _column_qparams(W1: torch.Tensor, i: int, col: int, args: QuantArgs, col_args: QuantArgs,
                    grid: _Grid) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, zero_point) of column `col` (column i of the block W1 [N, B]), per row; a group's
    first column (without act-order) fixes its group's qparams from the updated weights (a
    block's: per block of rows, each row given its block's)."""
    g = _column_group(args)
    if g is None:
        return grid.scale, grid.zero_point
    block = args.strategy == "block"
    if grid.perm is not None:
        gi = int(grid.perm[col]) // g
    else:
        gi = col // g
        if col % g == 0:  # a group's first column: qparams of its updated weights
            s, z = choose_qparams(W1[:, i:i + g], args if block else col_args, grid.global_scale)  # [N(/bn), 1]
            grid.scale[:, gi:gi + 1] = s.to(grid.scale.dtype)
            grid.zero_point[:, gi:gi + 1] = z
    s, z = grid.scale[:, gi:gi + 1], grid.zero_point[:, gi:gi + 1]
    if block:  # each row its block's
        N, bn = W1.shape[0], args.block_structure[0]
        s, z = s.repeat_interleave(bn, dim=0)[:N], z.repeat_interleave(bn, dim=0)[:N]
    return s, z
