"""AutoRound (Cheng et al., arXiv:2309.05516): each decoder layer's weight rounding and clipping
tuned by signed gradient descent on the layer's output error, as Intel's auto-round and
llm-compressor's `AutoRoundModifier` run it.

Per quantized Linear [N, K] with integer per-channel or per-group args, three tensors are tuned:

- **v** [N, K], the rounding offset: codes are round(w / s + v + zp) (start 0: round to nearest;
  SignSGD's steps sum to at most lr · iters / 2 = 0.5 under the default schedule, so each code
  moves at most one step from its nearest);
- **α, β** [N, groups], the clipping: each group's scale and zero point come from its
  (α · min, β · max), α and β clamped to [0, 1] (start 1: min/max).

Scales and zero points are compressed-tensors' own (`quant.primitives.qparams_from_minmax`,
scales rounded to the stored dtype); gradients pass through the rounding and the qparams by
straight-through estimates. The objective is auto-round's: the mean squared error between the
layer run with its fake-quantized weights on the *quantized* model's inputs (the outputs of the
layers tuned before it) and the float layer on the float model's inputs. Each of `iters` steps
takes `batch_size` calibration samples (a fresh shuffle once all are used), moves every tensor
by lr_t · sign(gradient) with lr_t decaying linearly from `lr` (default 1 / iters) to 0, and the
tensors of the step with the lowest loss are kept (the first step's are round-to-nearest's).

The artifact is the method's only output: codes, scales and zero points in the layout every other
method writes, so vLLM, SGLang and quantspec load it as they load round-to-nearest's.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Mapping

import torch
from torch import nn

from quantspec.errors import QuantSpecError, positive_int
from quantspec.quant.args import QuantArgs
from quantspec.quant.primitives import (dequantize, minmax, qparams_from_minmax, quant_range, storage_dtype,
                                        zero_point_dtype)

__all__ = ["AutoRound", "DEFAULT_ITERS", "DEFAULT_BATCH_SIZE", "TunedWeight", "check_autoround"]

DEFAULT_ITERS = 200  # auto-round's and llm-compressor's default
DEFAULT_BATCH_SIZE = 8  # calibration samples per step (auto-round's default)


def check_autoround(layer_args: Mapping[str, QuantArgs]) -> None:
    """AutoRound tunes integer codes under per-channel or per-group scales with integer zero points."""
    for name, a in layer_args.items():
        if a.type != "int" or a.strategy not in ("channel", "group") or a.zp_dtype is not None:
            kind = f"{a.num_bits}-bit {a.type}, {a.strategy}" + ("" if a.zp_dtype is None else f", {a.zp_dtype} zero points")
            raise QuantSpecError(f"AutoRound tunes integer weights with per-channel or per-group scales and integer "
                                 f"zero points ({name} is {kind}); use --method rtn or gptq")


@dataclass(frozen=True)
class AutoRound:
    """The tuning's settings: SignSGD steps per decoder layer, step size (None: 1 / iters),
    calibration samples per step, and the seed of the sample order."""

    iters: int = DEFAULT_ITERS
    lr: float | None = None
    batch_size: int = DEFAULT_BATCH_SIZE
    seed: int = 0

    def __post_init__(self):
        positive_int("iters", self.iters)
        positive_int("batch_size", self.batch_size)
        if self.lr is not None and not self.lr > 0:
            raise QuantSpecError(f"--lr {self.lr} must be > 0 (default: 1 / --iters)")

    @property
    def step_size(self) -> float:
        return self.lr if self.lr is not None else 1.0 / self.iters

    def tune_layer(self, step, linears: Mapping[str, nn.Linear], layer_args: Mapping[str, QuantArgs],
                   scale_dtype: torch.dtype | None, targets: torch.Tensor) -> tuple[dict, float]:
        """Tune the Linears `linears` (full names) of the runner step `step` (`calib.runner.LayerStep`)
        so the layer on `step.inputs` [n, S, D] comes close to `targets` [n, S, D], the float
        layer's outputs on the float model's inputs → ({name: (codes, scale, zero point)}, the
        kept step's loss). Each Linear's weight holds its dequantized codes on return."""
        prefix = step.name + "."
        tuned = {n: TunedWeight(m.weight.detach(), layer_args[n], scale_dtype or m.weight.dtype)
                 for n, m in linears.items()}
        order = _SampleOrder(step.inputs.shape[0], self.batch_size, self.seed + step.index)
        best, best_loss = None, float("inf")
        with _frozen(step.layer):
            for i in range(self.iters):
                idx = order.next()
                with torch.enable_grad():
                    weights = {n[len(prefix):] + ".weight": t.fake_quantized() for n, t in tuned.items()}
                    out = step.call(step.inputs[idx], lambda *a: torch.func.functional_call(step.layer, weights, a))
                    loss = torch.nn.functional.mse_loss(out.float(), targets[idx].float())
                    loss.backward()
                if loss.item() < best_loss:
                    best_loss, best = loss.item(), {n: t.state() for n, t in tuned.items()}
                lr = self.step_size * (1.0 - i / self.iters)
                for t in tuned.values():
                    t.sign_step(lr)
        if best is None:
            raise QuantSpecError(f"{step.name}: AutoRound's loss is not finite at any step; quantize with a wider "
                                 "dtype, or use --method rtn or gptq")
        results = {}
        for n, t in tuned.items():
            t.load(best[n])
            results[n] = t.codes()
            q, s, zp = results[n]
            linears[n].weight.data.copy_(dequantize(q, s, zp, t.args, dtype=linears[n].weight.dtype))
        return results, best_loss


class _SampleOrder:
    """Batches of sample indices: a seeded shuffle of all n, taken `batch` at a time, reshuffled
    when too few are left for a whole batch (auto-round's sampler)."""

    def __init__(self, n: int, batch: int, seed: int):
        self.n, self.batch = n, min(batch, n)
        self.gen = torch.Generator().manual_seed(seed)
        self.perm, self.at = torch.randperm(n, generator=self.gen), 0

    def next(self) -> torch.Tensor:
        if self.at + self.batch > self.n:
            self.perm, self.at = torch.randperm(self.n, generator=self.gen), 0
        self.at += self.batch
        return self.perm[self.at - self.batch:self.at]


@contextlib.contextmanager
def _frozen(module: nn.Module):
    """`module`'s own parameters out of autograd for the block (only the tuned tensors take gradients)."""
    params = [p for p in module.parameters() if p.requires_grad]
    for p in params:
        p.requires_grad_(False)
    try:
        yield
    finally:
        for p in params:
            p.requires_grad_(True)


def _ste_round(x: torch.Tensor) -> torch.Tensor:
    """round(x) forward (half to even, as `quant.primitives.quantize`), identity backward."""
    return x + (torch.round(x) - x).detach()


class TunedWeight:
    """One Linear's tuned rounding (module docstring): `fake_quantized()` is its weight as the
    tuned codes dequantize (differentiable in v, α, β); `codes()` → (int codes [N, K], scale,
    zero point), the numbers `quant.primitives.dequantize` takes back to that weight."""

    def __init__(self, weight: torch.Tensor, args: QuantArgs, scale_dtype: torch.dtype):
        self.w, self.args, self.scale_dtype, self.dtype = weight.float(), args, scale_dtype, weight.dtype
        self.mn, self.mx = minmax(self.w, args)  # [N, groups]
        self.v = torch.zeros_like(self.w, requires_grad=True)
        self.alpha = torch.ones_like(self.mn, requires_grad=True)
        self.beta = torch.ones_like(self.mx, requires_grad=True)

    def _qparams(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(scale, zero point) [N, groups] of the clipped range: compressed-tensors' numbers
        forward, their closed forms' gradients backward."""
        lo = torch.minimum(self.mn * self.alpha, torch.zeros(()))
        hi = torch.maximum(self.mx * self.beta, torch.zeros(()))
        with torch.no_grad():
            s, zp = qparams_from_minmax(lo, hi, self.args)
            s = s.to(self.scale_dtype).float()
        q_min, q_max = quant_range(self.args)
        if self.args.symmetric:
            free = torch.maximum(-lo, hi) / ((q_max - q_min) / 2)
            return s + (free - free.detach()), zp.float()
        free = (hi - lo) / (q_max - q_min)
        free_zp = q_min - lo / free.detach()
        return s + (free - free.detach()), zp.float() + (free_zp - free_zp.detach())

    def _grid(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(codes as floats [N, groups, g], scale, zero point [N, groups, 1]): round(w / s + v + zp)
        on the grid."""
        s, zp = (t.unsqueeze(-1) for t in self._qparams())
        g = s.shape[1]
        w, v = self.w.unflatten(-1, (g, -1)), self.v.unflatten(-1, (g, -1))
        q_min, q_max = quant_range(self.args)
        return torch.clamp(_ste_round(w / s + v + zp), q_min, q_max), s, zp

    def fake_quantized(self) -> torch.Tensor:
        """The weight [N, K] the tuned codes dequantize to, in the weight's dtype."""
        with torch.no_grad():
            self.alpha.clamp_(0, 1)
            self.beta.clamp_(0, 1)
        q, s, zp = self._grid()
        # the product rounded to the scale dtype: what `quant.primitives.dequantize` computes
        return ((q - zp) * s).to(self.scale_dtype).flatten(1).to(self.dtype)

    @torch.no_grad()
    def codes(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(codes [N, K] in the args' storage dtype, scale [N, groups] in the scale dtype, zero
        point [N, groups] (None when symmetric))."""
        q, s, zp = self._grid()
        zero_point = None if self.args.symmetric else zp.squeeze(-1).to(zero_point_dtype(self.args))
        return q.flatten(1).to(storage_dtype(self.args)), s.squeeze(-1).to(self.scale_dtype), zero_point

    @torch.no_grad()
    def sign_step(self, lr: float) -> None:
        """One SignSGD step of v, α and β; their gradients cleared."""
        for t in (self.v, self.alpha, self.beta):
            if t.grad is not None:
                t.sub_(lr * torch.sign(t.grad))
                t.grad = None

    def state(self) -> tuple[torch.Tensor, ...]:
        return tuple(t.detach().clone() for t in (self.v, self.alpha, self.beta))

    @torch.no_grad()
    def load(self, state: tuple[torch.Tensor, ...]) -> None:
        for t, saved in zip((self.v, self.alpha, self.beta), state):
            t.copy_(saved)
