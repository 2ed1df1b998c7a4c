"""Tests for quantspec.calib.observers on literal arrays with hand-computed answers."""

import pytest
import torch

from quantspec.calib.observers import (
    Granularity,
    MinMaxObserver,
    MSEObserver,
    ObservedRange,
    PercentileObserver,
    make_observer,
)
from quantspec.errors import QuantSpecError


def _fq_ternary(x, absmax):
    """Symmetric 'int' fake quant with qmax = 1 (codes -1, 0, 1): easy to compute by hand."""
    scale = absmax / 1.0  # [G, 1]
    return torch.clamp(torch.round(x / scale), -1, 1) * scale


def test_minmax_tensor_channel_head():
    x = torch.tensor([[1.0, -2.0, 3.0], [4.0, 5.0, -6.0]])  # [2, C=3]
    o = MinMaxObserver("t")
    o.update(x)
    r = o.compute()
    assert r.min.shape == () and r.min.item() == -6.0 and r.max.item() == 5.0
    assert r.absmax.item() == 6.0

    c = MinMaxObserver("c", "channel")
    c.update(x)
    c.update(torch.tensor([[0.0, -7.0, 0.5]]))
    r = c.compute()
    assert r.min.tolist() == [0.0, -7.0, -6.0]
    assert r.max.tolist() == [4.0, 5.0, 3.0]
    assert r.absmax.tolist() == [4.0, 7.0, 6.0]

    # x [B=2, H=3, D=2]: head h sees x[:, h, :]
    xh = torch.tensor(
        [[[1.0, 2.0], [-3.0, 0.0], [0.5, 0.5]],
         [[-1.0, 0.0], [2.0, 9.0], [0.25, -4.0]]]
    )
    h = MinMaxObserver("k_proj", Granularity.HEAD)
    h.update(xh)
    r = h.compute()
    assert r.min.tolist() == [-1.0, -3.0, -4.0]
    assert r.max.tolist() == [2.0, 9.0, 0.5]


def test_minmax_accepts_half_and_returns_float32():
    o = MinMaxObserver("h")
    o.update(torch.tensor([1.5, -2.5], dtype=torch.float16))
    r = o.compute()
    assert r.min.dtype == torch.float32 and r.min.item() == -2.5


def test_percentile_symmetric_weighted_mean_over_batches():
    o = PercentileObserver("p", percentile=90.0)
    o.update(torch.arange(1.0, 12.0))  # |x| = 1..11, pos 0.9*10 = 9 -> 10
    o.update(torch.tensor([0.0, -1.0, 2.0, -3.0, 4.0]))  # |x| sorted 0..4, pos 3.6 -> 3.6
    r = o.compute()
    # (10 * 11 + 3.6 * 5) / 16 = 8.0
    assert r.max.item() == pytest.approx(8.0)
    assert r.min.item() == pytest.approx(-8.0)


def test_percentile_interpolates_and_asymmetric():
    o = PercentileObserver("p", percentile=95.0)
    o.update(torch.arange(1.0, 12.0))  # pos 9.5 -> 10.5
    assert o.compute().max.item() == pytest.approx(10.5)

    a = PercentileObserver("a", "channel", percentile=75.0, symmetric=False)
    a.update(torch.tensor([[-10.0, 0.0], [-1.0, 0.0], [0.0, 0.0], [1.0, 0.0], [2.0, 8.0]]))  # [5, C=2]
    r = a.compute()
    # col 0 sorted [-10, -1, 0, 1, 2]: q0.75 at pos 3 -> 1, q0.25 at pos 1 -> -1
    # col 1 sorted [0, 0, 0, 0, 8]: both quantiles 0
    assert r.max.tolist() == [1.0, 0.0]
    assert r.min.tolist() == [-1.0, 0.0]


def test_percentile_clips_outlier_below_minmax():
    x = torch.cat([torch.linspace(-1, 1, 10001), torch.tensor([1000.0])])
    p, m = PercentileObserver("p", percentile=99.0), MinMaxObserver("m")
    p.update(x)
    m.update(x)
    assert m.compute().absmax.item() == 1000.0
    assert p.compute().absmax.item() < 1.0


def test_mse_hand_computed_per_channel():
    # col 0: eight 0.6 and one 1.0; errors (sum of squares) for s = 1, .75, .5, .25:
    #   1.28, 0.2425, 0.33, 1.5425 -> best s = 0.75
    # col 1: eight 0.1 and one 1.0: 0.08, 0.1425, 0.33, 0.6425 -> best s = 1
    col0 = [0.6] * 8 + [1.0]
    col1 = [0.1] * 8 + [1.0]
    x = torch.tensor([col0, col1]).t()  # [9, C=2]
    o = MSEObserver("down_proj", "channel", fake_quant=_fq_ternary, grid=4, min_shrink=0.25)
    assert o.shrink_factors().tolist() == [1.0, 0.75, 0.5, 0.25]
    o.update(x[:4])
    o.update(x[4:])
    r = o.compute()
    assert r.max.tolist() == pytest.approx([0.75, 1.0])
    assert r.min.tolist() == pytest.approx([-0.75, -1.0])


def test_mse_tensor_granularity_shape():
    o = MSEObserver("t", fake_quant=_fq_ternary, grid=4, min_shrink=0.25)
    o.update(torch.tensor([0.6] * 8 + [-1.0]))
    r = o.compute()
    assert r.max.shape == () and r.max.item() == pytest.approx(0.75)


def test_mse_default_uses_primitives_int2():
    # symmetric int2 in quant.primitives: codes [-2, 1], scale = absmax / 1.5.
    # x = eight 0.3 and one 1.0; summed squared error for s = 1, .75, .5, .25:
    #   s=1   scale 2/3: 0.3 -> 0,   1.0 -> 2/3 : 0.72 + 0.111 = 0.831
    #   s=.75 scale 1/2: 0.3 -> 1/2, 1.0 -> 1/2 : 0.32 + 0.25  = 0.57
    #   s=.5  scale 1/3: 0.3 -> 1/3, 1.0 -> 1/3 : 0.009 + 0.444 = 0.453  <- best
    #   s=.25 scale 1/6: 0.3 -> 1/6, 1.0 -> 1/6 : 0.142 + 0.694 = 0.836
    o = MSEObserver("t", num_bits=2, type="int", grid=4, min_shrink=0.25)
    o.update(torch.tensor([0.3] * 8 + [1.0]))
    assert o.compute().max.item() == pytest.approx(0.5)


def test_mse_fp8_and_int8_shrink_heavy_tail():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4096, generator=g)
    x[0] = 60.0  # one outlier: int8 pays for it with coarse steps everywhere, so it shrinks
    r8 = make_observer("mse", name="i8", num_bits=8, type="int")
    r8.update(x)
    assert r8.compute().max.item() < 60.0
    f8 = make_observer("mse", name="f8", num_bits=8, type="float")
    f8.update(x)
    assert 0 < f8.compute().max.item() <= 60.0


def test_mse_reservoir_is_bounded_and_uniform():
    o = MSEObserver("r", fake_quant=_fq_ternary, max_samples=2000, seed=0)
    for i in range(100):
        o.update(torch.full((1000,), float(i)))
    assert o._sample.shape == (1, 2000)
    # a uniform sample of values 0..99 has mean 49.5 (std of the mean ~ 0.65); keeping the first
    # or the last k values would give 0.5 or 98.5
    assert abs(o._sample.mean().item() - 49.5) < 3.0
    assert o.compute().max.item() <= 99.0


def test_compute_before_update_names_observer():
    for obs in (MinMaxObserver("layers.3.q_proj"), PercentileObserver("layers.3.q_proj"),
                MSEObserver("layers.3.q_proj", fake_quant=_fq_ternary)):
        with pytest.raises(QuantSpecError, match=r"layers\.3\.q_proj.*before any update"):
            obs.compute()


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_nan_inf_raise_with_name(bad):
    o = MinMaxObserver("model.layers.0.mlp.up_proj")
    with pytest.raises(QuantSpecError, match=r"model\.layers\.0\.mlp\.up_proj.*NaN"):
        o.update(torch.tensor([1.0, bad]))
    assert o.num_updates == 0


def test_bad_inputs():
    o = MinMaxObserver("x", "channel")
    o.update(torch.zeros(2, 3))
    with pytest.raises(QuantSpecError, match="3 groups before and 4"):
        o.update(torch.zeros(2, 4))
    with pytest.raises(QuantSpecError, match="floating"):
        MinMaxObserver("x").update(torch.tensor([1, 2]))
    with pytest.raises(QuantSpecError, match="empty"):
        MinMaxObserver("x").update(torch.zeros(0))
    with pytest.raises(QuantSpecError, match=r"\[\.\.\., H, D\]"):
        MinMaxObserver("x", "head").update(torch.zeros(3))
    with pytest.raises(QuantSpecError, match="granularity"):
        MinMaxObserver("x", "row")
    with pytest.raises(QuantSpecError, match="percentile"):
        PercentileObserver("x", percentile=120)
    with pytest.raises(QuantSpecError, match="num_bits"):
        MSEObserver("x", type="float", num_bits=4)


def test_make_observer_registry():
    o = make_observer("percentile", name="layers.0.k_proj", percentile=99.0, granularity="head")
    assert isinstance(o, PercentileObserver) and o.name == "layers.0.k_proj" and o.percentile == 99.0
    assert isinstance(make_observer("minmax"), MinMaxObserver)
    assert isinstance(make_observer("mse", fake_quant=_fq_ternary), MSEObserver)
    with pytest.raises(QuantSpecError, match="minmax, percentile, mse"):
        make_observer("histogram")
    with pytest.raises(QuantSpecError, match="bad arguments"):
        make_observer("minmax", percentile=3)


def test_observed_range_absmax():
    r = ObservedRange(min=torch.tensor([-3.0, -1.0]), max=torch.tensor([2.0, 5.0]))
    assert r.absmax.tolist() == [3.0, 5.0]
