"""Calibration observers: accumulate statistics of a tensor stream, then return its range.

This file owns the observers (llm-compressor `observers/` style) that calibration feeds with every
Linear input and every K/V head: `update(x)` only accumulates, `compute()` returns an
`ObservedRange` (min and max tensors; `.absmax` for symmetric schemes). Turning a range into a
scale/zero-point is *not* done here: that is `quantspec.quant.primitives` (numbers have one
source). The MSE observer needs quantize-dequantize for its search: by default it uses
`quant.primitives.fake_quantize` (see `primitive_fake_quant`); a callable can be passed instead.

Granularity (the shape of the returned min/max):
- `tensor`:  x [...]        -> []   (one range)
- `channel`: x [..., C]     -> [C]  (per last-dim channel, e.g. per input channel of a Linear,
                                     which SmoothQuant needs)
- `head`:    x [..., H, D]  -> [H]  (per attention head, for the KV cache)

Observers:
- `MinMaxObserver`: running elementwise min / max (exact).
- `PercentileObserver(percentile=99.99)`: memory O(groups). For each batch it takes the
  `percentile`-th quantile (linear interpolation, like `torch.quantile`) of |x| per group
  (symmetric, default) or the (100-p)-th / p-th quantiles of x (asymmetric); the result is the
  mean of those per-batch quantiles weighted by the batch's element count. This estimator is not
  the exact quantile of the whole stream, but it is unbiased for i.i.d. batches and needs no
  storage beyond running sums.
- `MSEObserver`: keeps the running absmax and a bounded uniform sample (bottom-k of random keys,
  i.e. reservoir sampling) of each group; `compute()` tries shrink factors s in
  {1, 1 - 1/grid, ..., min_shrink} and, per group, keeps the s that minimises the mean
  |x - fake_quant(x, s * absmax)|^norm over the sample (ties go to the larger s). The returned
  range is symmetric: [-s * absmax, s * absmax].

Every observer validates its input (floating, finite, consistent group count) and raises
`QuantSpecError` naming the observer (`name`, the layer it watches).
"""

from __future__ import annotations

import abc
import enum
import math
from dataclasses import dataclass
from typing import Callable

import torch

from quantspec.errors import QuantSpecError
from quantspec.quant.primitives import all_finite

__all__ = [
    "Granularity",
    "ObservedRange",
    "Observer",
    "MinMaxObserver",
    "PercentileObserver",
    "MSEObserver",
    "FakeQuantFn",
    "primitive_fake_quant",
    "OBSERVERS",
    "make_observer",
]

# (x [G, n], absmax [G, 1]) -> x_hat [G, n]: symmetric quantize-dequantize of each row of x with
# the scale that maps that row's absmax to the largest code of the target type.
FakeQuantFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

DEFAULT_PERCENTILE = 99.99
DEFAULT_MSE_GRID = 100
DEFAULT_MSE_MIN_SHRINK = 0.2
DEFAULT_MSE_NORM = 2.0
# Total number of sampled values the MSE observer keeps over all groups (bounded memory).
DEFAULT_MSE_MAX_SAMPLES = 1 << 16
MIN_SAMPLES_PER_GROUP = 64


def primitive_fake_quant(num_bits: int = 8, type: str = "int") -> FakeQuantFn:
    """The `FakeQuantFn` of `quant.primitives` for symmetric `type`/`num_bits` (int8, int4, fp8):
    rows x [G, n] are quantize-dequantized per row with scale = qparams_from_minmax(-absmax,
    absmax) (e.g. absmax / 127.5 for int8, absmax / 448 for fp8)."""
    from quantspec.quant.args import QuantArgs
    from quantspec.quant.primitives import fake_quantize, qparams_from_minmax

    args = QuantArgs(num_bits=num_bits, type=type, symmetric=True, strategy="channel")

    def fake_quant(x: torch.Tensor, absmax: torch.Tensor) -> torch.Tensor:
        scale, zero_point = qparams_from_minmax(-absmax, absmax, args)  # [G, 1]
        return fake_quantize(x, scale, zero_point, args)  # [G, n]

    return fake_quant


class Granularity(str, enum.Enum):
    """How many ranges an observer returns; see the module docstring for shapes."""

    TENSOR = "tensor"
    CHANNEL = "channel"
    HEAD = "head"

    @classmethod
    def parse(cls, value: "Granularity | str", where: str) -> "Granularity":
        if isinstance(value, Granularity):
            return value
        try:
            return cls(str(value).lower())
        except ValueError:
            names = ", ".join(g.value for g in cls)
            raise QuantSpecError(f"{where}: unknown granularity {value!r}; use one of: {names}") from None


@dataclass(frozen=True)
class ObservedRange:
    """The observed range of a tensor: `min` and `max` have shape [] / [C] / [H] (float32)."""

    min: torch.Tensor
    max: torch.Tensor

    @property
    def absmax(self) -> torch.Tensor:
        """max(|min|, |max|), elementwise: the range of a symmetric scheme."""
        return torch.maximum(self.min.abs(), self.max.abs())


class Observer(abc.ABC):
    """Base observer: `update(x)` accumulates (any number of times), `compute()` returns the range.

    Subclasses implement `_update(rows)` on `rows` [G, n] (one row per group, float32) and
    `_compute() -> (min [G], max [G])`.
    """

    def __init__(self, name: str = "observer", granularity: Granularity | str = Granularity.TENSOR):
        if not isinstance(name, str) or not name:
            raise QuantSpecError(f"observer name={name!r} must be a non-empty string (the layer name)")
        self.name = name
        self.granularity = Granularity.parse(granularity, self._where())
        self.num_updates = 0
        self._groups: int | None = None

    def _where(self) -> str:
        return f"{type(self).__name__} '{self.name}'"

    def _rows(self, x: torch.Tensor) -> torch.Tensor:
        """Validate x and reshape it to [G, n] (float32) for this observer's granularity."""
        where = self._where()
        if not isinstance(x, torch.Tensor):
            raise QuantSpecError(f"{where}: update() takes a torch.Tensor, got {type(x).__name__}")
        if not x.is_floating_point():
            raise QuantSpecError(f"{where}: update() takes a floating tensor, got dtype {x.dtype}")
        if x.numel() == 0:
            raise QuantSpecError(f"{where}: update() got an empty tensor of shape {tuple(x.shape)}")
        g = self.granularity
        if g is Granularity.CHANNEL and x.ndim < 1:
            raise QuantSpecError(f"{where}: per-channel needs x [..., C], got a scalar")
        if g is Granularity.HEAD and x.ndim < 2:
            raise QuantSpecError(f"{where}: per-head needs x [..., H, D], got shape {tuple(x.shape)}")
        if not all_finite(x):
            n_nan = int(torch.isnan(x).sum())
            n_inf = int(torch.isinf(x).sum())
            raise QuantSpecError(
                f"{where}: input has {n_nan} NaN and {n_inf} Inf values; check the model/dtype "
                f"(fp16 overflow?) before calibrating"
            )
        x = x.detach().float()
        if g is Granularity.TENSOR:
            rows = x.reshape(1, -1)  # [1, n]
        elif g is Granularity.CHANNEL:
            rows = x.reshape(-1, x.shape[-1]).t()  # [C, n]
        else:
            rows = x.movedim(-2, 0).reshape(x.shape[-2], -1)  # [H, n]
        if self._groups is None:
            self._groups = rows.shape[0]
        elif rows.shape[0] != self._groups:
            raise QuantSpecError(
                f"{where}: {g.value} observer saw {self._groups} groups before and {rows.shape[0]} "
                f"now (shape {tuple(x.shape)}); feed tensors with the same channel/head count"
            )
        return rows

    def update(self, x: torch.Tensor) -> None:
        """Accumulate statistics of x (shape per granularity, see module docstring)."""
        rows = self._rows(x)  # [G, n]
        self._update(rows)
        self.num_updates += 1

    def compute(self) -> ObservedRange:
        """The range observed so far: min/max of shape [] (tensor), [C] (channel) or [H] (head)."""
        if self.num_updates == 0:
            raise QuantSpecError(
                f"{self._where()}: compute() called before any update(); run calibration data "
                f"through the layer first"
            )
        lo, hi = self._compute()  # [G], [G]
        if self.granularity is Granularity.TENSOR:
            lo, hi = lo.reshape(()), hi.reshape(())
        return ObservedRange(min=lo, max=hi)

    @abc.abstractmethod
    def _update(self, rows: torch.Tensor) -> None: ...

    @abc.abstractmethod
    def _compute(self) -> tuple[torch.Tensor, torch.Tensor]: ...


class MinMaxObserver(Observer):
    """Running elementwise minimum and maximum per group (exact)."""

    def __init__(self, name: str = "observer", granularity: Granularity | str = Granularity.TENSOR):
        super().__init__(name, granularity)
        self._min: torch.Tensor | None = None  # [G]
        self._max: torch.Tensor | None = None  # [G]

    def _update(self, rows: torch.Tensor) -> None:
        lo, hi = rows.amin(dim=1), rows.amax(dim=1)  # [G]
        if self._min is None:
            self._min, self._max = lo, hi
        else:
            self._min = torch.minimum(self._min, lo)
            self._max = torch.maximum(self._max, hi)

    def _compute(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self._min.clone(), self._max.clone()


def _quantile_rows(rows: torch.Tensor, q: float) -> torch.Tensor:
    """Per-row quantile of rows [G, n] with linear interpolation (as torch.quantile) -> [G].

    Uses kthvalue, which (unlike torch.quantile) has no input-size limit.
    """
    n = rows.shape[1]
    pos = q * (n - 1)
    lo_i = int(math.floor(pos))
    hi_i = min(lo_i + 1, n - 1)
    frac = pos - lo_i
    v_lo = rows.kthvalue(lo_i + 1, dim=1).values  # [G]
    if frac == 0.0 or hi_i == lo_i:
        return v_lo
    v_hi = rows.kthvalue(hi_i + 1, dim=1).values  # [G]
    return v_lo + frac * (v_hi - v_lo)


class PercentileObserver(Observer):
    """Range from the `percentile`-th quantile, averaged over batches (see module docstring).

    symmetric=True: q = mean over batches of quantile_p(|x|); range [-q, q].
    symmetric=False: range [mean quantile_{100-p}(x), mean quantile_p(x)].
    The mean is weighted by each batch's number of elements per group.
    """

    def __init__(
        self,
        name: str = "observer",
        granularity: Granularity | str = Granularity.TENSOR,
        *,
        percentile: float = DEFAULT_PERCENTILE,
        symmetric: bool = True,
    ):
        super().__init__(name, granularity)
        if not isinstance(percentile, (int, float)) or not 50.0 < float(percentile) <= 100.0:
            raise QuantSpecError(
                f"{self._where()}: percentile={percentile!r} must be in (50, 100], e.g. 99.99"
            )
        self.percentile = float(percentile)
        self.symmetric = bool(symmetric)
        self._sum_lo: torch.Tensor | None = None  # [G], weighted sum of lower quantiles
        self._sum_hi: torch.Tensor | None = None  # [G]
        self._count = 0  # total elements per group

    def _update(self, rows: torch.Tensor) -> None:
        q = self.percentile / 100.0
        n = rows.shape[1]
        if self.symmetric:
            hi = _quantile_rows(rows.abs(), q)  # [G]
            lo = -hi
        else:
            hi = _quantile_rows(rows, q)
            lo = _quantile_rows(rows, 1.0 - q)
        if self._sum_lo is None:
            self._sum_lo, self._sum_hi = lo * n, hi * n
        else:
            self._sum_lo = self._sum_lo + lo * n
            self._sum_hi = self._sum_hi + hi * n
        self._count += n

    def _compute(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self._sum_lo / self._count, self._sum_hi / self._count


class MSEObserver(Observer):
    """Shrink the absmax to minimise quantization error on a bounded sample (symmetric).

    `fake_quant(x [G, n], absmax [G, 1]) -> x_hat [G, n]` quantize-dequantizes with the scale
    derived from absmax; by default `primitive_fake_quant(num_bits, type)` (symmetric int b-bit
    or fp8 e4m3 through `quant.primitives`). Pass another callable only to test the search.

    Search: shrink factors s_i = 1 - i / grid for i = 0 .. floor((1 - min_shrink) * grid);
    error(s) = mean over the sample of |x - fake_quant(x, s * absmax)|^norm, per group.
    """

    def __init__(
        self,
        name: str = "observer",
        granularity: Granularity | str = Granularity.TENSOR,
        *,
        fake_quant: FakeQuantFn | None = None,
        num_bits: int = 8,
        type: str = "int",
        grid: int = DEFAULT_MSE_GRID,
        min_shrink: float = DEFAULT_MSE_MIN_SHRINK,
        norm: float = DEFAULT_MSE_NORM,
        max_samples: int = DEFAULT_MSE_MAX_SAMPLES,
        seed: int = 0,
    ):
        super().__init__(name, granularity)
        w = self._where()
        if type not in ("int", "float"):
            raise QuantSpecError(f"{w}: type={type!r} must be 'int' or 'float'")
        if type == "int" and not (isinstance(num_bits, int) and 2 <= num_bits <= 8):
            raise QuantSpecError(f"{w}: num_bits={num_bits!r} must be an int in 2..8 for type 'int'")
        if type == "float" and num_bits != 8:
            raise QuantSpecError(f"{w}: num_bits={num_bits!r}; type 'float' supports only 8 (fp8 e4m3)")
        if fake_quant is not None and not callable(fake_quant):
            raise QuantSpecError(f"{w}: fake_quant must be callable (x, absmax) -> x_hat")
        if not isinstance(grid, int) or grid < 1:
            raise QuantSpecError(f"{w}: grid={grid!r} must be a positive int, e.g. 100")
        if not 0.0 < float(min_shrink) <= 1.0:
            raise QuantSpecError(f"{w}: min_shrink={min_shrink!r} must be in (0, 1], e.g. 0.2")
        if not float(norm) > 0.0:
            raise QuantSpecError(f"{w}: norm={norm!r} must be > 0 (2 = mean squared error)")
        if not isinstance(max_samples, int) or max_samples < 1:
            raise QuantSpecError(f"{w}: max_samples={max_samples!r} must be a positive int")
        self.fake_quant = fake_quant
        self.num_bits, self.type = num_bits, type
        self.grid, self.min_shrink, self.norm = grid, float(min_shrink), float(norm)
        self.max_samples = max_samples
        self._gen = torch.Generator().manual_seed(seed)
        self._absmax: torch.Tensor | None = None  # [G]
        self._sample: torch.Tensor | None = None  # [G, k] values kept
        self._keys: torch.Tensor | None = None  # [G, k] their random keys (smallest kept)

    def shrink_factors(self) -> torch.Tensor:
        """The candidate shrink factors, largest first: [num_candidates]."""
        steps = int(math.floor((1.0 - self.min_shrink) * self.grid + 1e-9))
        return 1.0 - torch.arange(steps + 1, dtype=torch.float32) / self.grid

    def _update(self, rows: torch.Tensor) -> None:
        g = rows.shape[0]
        amax = rows.abs().amax(dim=1)  # [G]
        self._absmax = amax if self._absmax is None else torch.maximum(self._absmax, amax)
        # Reservoir by bottom-k random keys: a uniform sample without replacement of the stream.
        k = max(MIN_SAMPLES_PER_GROUP, self.max_samples // g)
        keys = torch.rand(rows.shape, generator=self._gen).to(rows.device)  # [G, n]
        if self._sample is not None:
            rows = torch.cat([self._sample, rows], dim=1)
            keys = torch.cat([self._keys, keys], dim=1)
        if rows.shape[1] > k:
            keys, idx = keys.topk(k, dim=1, largest=False)  # [G, k]
            rows = rows.gather(1, idx)
        self._sample, self._keys = rows, keys

    def _compute(self) -> tuple[torch.Tensor, torch.Tensor]:
        fake_quant = self.fake_quant or primitive_fake_quant(self.num_bits, self.type)
        x = self._sample  # [G, k]
        amax = self._absmax[:, None]  # [G, 1]
        best_err = torch.full_like(self._absmax, float("inf"))  # [G]
        best_s = torch.ones_like(self._absmax)  # [G]
        for s in self.shrink_factors().tolist():
            cand = amax * s  # [G, 1]
            x_hat = fake_quant(x, cand)  # [G, k]
            err = (x - x_hat).abs().pow(self.norm).mean(dim=1)  # [G]
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best_s = torch.where(better, torch.full_like(best_s, s), best_s)
        hi = best_s * self._absmax  # [G]
        return -hi, hi


OBSERVERS: dict[str, type[Observer]] = {
    "minmax": MinMaxObserver,
    "percentile": PercentileObserver,
    "mse": MSEObserver,
}


def make_observer(name: str, /, **kwargs) -> Observer:
    """Build an observer by registry name ("minmax" | "percentile" | "mse") with its kwargs,
    e.g. `make_observer("percentile", name="model.layers.0.mlp.down_proj", percentile=99.9)`.

    Note: the layer name is the `name=` kwarg; the first positional argument is the observer kind.
    """
    if name not in OBSERVERS:
        raise QuantSpecError(f"unknown observer {name!r}; use one of: {', '.join(OBSERVERS)}")
    try:
        return OBSERVERS[name](**kwargs)
    except TypeError as e:
        raise QuantSpecError(f"observer {name!r}: bad arguments ({e})") from None
