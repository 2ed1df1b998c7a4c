"""SmoothQuant: literal scales, folding preserves the float function, outliers shrink."""

import pytest
import torch

from quantspec.errors import QuantSpecError
from quantspec.quant import (fold_into_linear, fold_into_norm, smooth_norm_linears,
                             smoothquant_scales, weight_input_absmax)


def _rmsnorm(x, w, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def test_literal_scales():
    s = smoothquant_scales(torch.tensor([4.0, 1.0, 0.0]), torch.tensor([1.0, 4.0, 1.0]), 0.5)
    torch.testing.assert_close(s, torch.tensor([2.0, 0.5, 1e-5**0.5]))
    assert torch.equal(smoothquant_scales(torch.tensor([3.0]), torch.tensor([7.0]), 1.0),
                       torch.tensor([3.0]))


def test_folding_preserves_function_and_reduces_outliers():
    torch.manual_seed(0)
    K = 64
    x = torch.randn(200, K, dtype=torch.float64)
    gamma = torch.rand(K, dtype=torch.float64) + 0.5
    gamma[5] = 40.0  # an outlier channel, as LLM norms have
    Wq, Wk = torch.randn(32, K, dtype=torch.float64), torch.randn(16, K, dtype=torch.float64)
    h = _rmsnorm(x, gamma)
    act_absmax = h.abs().amax(0)
    new_gamma, (nq, nk), s = smooth_norm_linears(gamma, [Wq, Wk], act_absmax, alpha=0.5)
    h2 = _rmsnorm(x, new_gamma)
    torch.testing.assert_close(h2 @ nq.T, h @ Wq.T)
    torch.testing.assert_close(h2 @ nk.T, h @ Wk.T)
    ratio = lambda a: (a.amax() / a.median()).item()  # noqa: E731
    assert ratio(h2.abs().amax(0)) < ratio(act_absmax) / 3
    torch.testing.assert_close(weight_input_absmax(Wq, Wk),
                               torch.maximum(Wq.abs().amax(0), Wk.abs().amax(0)).float())


def test_fold_helpers_literal():
    w, _ = fold_into_norm(torch.tensor([2.0, 3.0]), torch.tensor([2.0, 0.5]))
    assert w.tolist() == [1.0, 6.0]
    W = fold_into_linear(torch.tensor([[1.0, 1.0], [2.0, 3.0]]), torch.tensor([2.0, 0.5]))
    assert W.tolist() == [[2.0, 0.5], [4.0, 1.5]]


def test_bad_input():
    with pytest.raises(QuantSpecError, match="alpha"):
        smoothquant_scales(torch.ones(3), torch.ones(3), 1.5)
    with pytest.raises(QuantSpecError, match=r"\[K\]"):
        smoothquant_scales(torch.ones(3), torch.ones(4))
