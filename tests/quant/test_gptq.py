"""GPTQ: beats RTN on correlated inputs, equals RTN with an identity Hessian, act-order and
asymmetric variants, dead columns, the Hessian accumulator."""

import pytest
import torch

from quantspec.errors import QuantSpecError
from quantspec.quant import (HessianAccumulator, QuantArgs, choose_qparams, dequantize,
                             gptq_quantize, quantize, rtn_quantize)


def _problem(N=96, K=256, T=1024, seed=0):
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(N, K, generator=g) * 0.05
    mix = torch.randn(K, K, generator=g) / K**0.5
    X = torch.randn(T, K, generator=g) @ mix + 0.1 * torch.randn(T, K, generator=g)  # correlated
    return W, X


def _out_err(X, W, Wq):
    return ((X @ W.T - X @ Wq.T).norm() / (X @ W.T).norm()).item()


def test_hessian_accumulator_matches_formula():
    _, X = _problem(K=64, T=300)
    acc = HessianAccumulator(64)
    for chunk in X.split(77):
        acc.update(chunk.reshape(1, -1, 64))
    assert acc.num_samples == 300
    torch.testing.assert_close(acc.compute(), 2.0 / 300 * X.T @ X, rtol=1e-4, atol=1e-5)
    with pytest.raises(QuantSpecError, match="before any update"):
        HessianAccumulator(8).compute()


def test_hessian_accumulator_take_hands_over_the_hessian():
    _, X = _problem(K=64, T=300)
    acc = HessianAccumulator(64)
    acc.update(X)
    expected = acc.compute()
    H = acc.take()
    assert torch.equal(H, expected)
    for use in (acc.take, acc.compute, lambda: acc.update(X)):
        with pytest.raises(QuantSpecError, match="taken already"):
            use()


@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("symmetric", [True, False])
def test_gptq_beats_rtn(act_order, symmetric):
    W, X = _problem()
    H = 2.0 / X.shape[0] * X.T @ X
    args = QuantArgs(num_bits=4, strategy="group", group_size=64, symmetric=symmetric)
    res = gptq_quantize(W, H, args, act_order=act_order, block_size=128)
    rtn = rtn_quantize(W, args)
    assert _out_err(X, W, res.weight_dq) < 0.8 * _out_err(X, W, rtn.weight_dq)
    # the returned codes/qparams reproduce weight_dq exactly in the plain group layout
    assert res.q.dtype == torch.int8 and res.scale.shape == (96, 4)
    assert int(res.q.min()) >= -8 and int(res.q.max()) <= 7
    assert torch.equal(dequantize(res.q, res.scale, res.zero_point, args), res.weight_dq)
    if symmetric:
        assert torch.all(res.zero_point == 0)


@pytest.mark.parametrize("args", [
    QuantArgs(num_bits=4, strategy="group", group_size=32),
    QuantArgs(num_bits=4, strategy="group", group_size=32, symmetric=False),
    QuantArgs(num_bits=8, strategy="channel"),
    QuantArgs(num_bits=8, type="float", strategy="channel"),
    QuantArgs(num_bits=4, strategy="group", group_size=32, observer="mse"),
    QuantArgs(num_bits=4, strategy="group", group_size=32, symmetric=False, observer="mse"),
    QuantArgs(num_bits=8, strategy="channel", observer="mse"),
    QuantArgs(num_bits=8, type="float", strategy="block", block_structure=[16, 32]),
    QuantArgs(num_bits=8, type="float", strategy="block", block_structure=[24, 48]),  # the last blocks padded
])
def test_identity_hessian_is_rtn(args):
    W, _ = _problem(N=32, K=128)
    res = gptq_quantize(W, torch.eye(128), args, damp=0.0)
    s, z = choose_qparams(W, args)
    assert torch.equal(res.scale, s)
    assert torch.equal(res.q.float(), quantize(W, s, z, args).float())


@pytest.mark.parametrize("act_order", [False, True])
def test_fp8_block_gptq_beats_rtn_on_the_block_grid(act_order):
    """FP8 block scales: the codes and [N/bn, K/bk] scales reproduce weight_dq exactly, each scale
    covers its block's codes (|q| <= 448), and the output error is below round-to-nearest's."""
    W, X = _problem(K=128)
    H = 2.0 / X.shape[0] * X.T @ X
    args = QuantArgs(num_bits=8, type="float", strategy="block", block_structure=[32, 64])
    res = gptq_quantize(W, H, args, act_order=act_order)
    assert res.scale.shape == (3, 2) and res.q.dtype == torch.float8_e4m3fn
    assert torch.equal(dequantize(res.q, res.scale, res.zero_point, args), res.weight_dq)
    assert float(res.q.float().abs().max()) <= 448
    assert _out_err(X, W, res.weight_dq) < 0.8 * _out_err(X, W, rtn_quantize(W, args).weight_dq)  # about 0.7×


def test_channel_int8_and_fp8_beat_rtn():
    W, X = _problem(K=128)
    H = 2.0 / X.shape[0] * X.T @ X
    for args in (QuantArgs(num_bits=8, strategy="channel"),
                 QuantArgs(num_bits=8, type="float", strategy="channel")):
        res = gptq_quantize(W, H, args, act_order=True)
        assert _out_err(X, W, res.weight_dq) < _out_err(X, W, rtn_quantize(W, args).weight_dq)


@pytest.mark.parametrize("act_order", [False, True])
def test_a_consumed_hessian_gives_the_same_result_and_is_freed(act_order):
    """consume_hessian factorises the caller's Hessian in place and empties it; the codes,
    scales and loss are those of the call that copies it (which leaves it as it was)."""
    W, X = _problem()
    X[:, 7] = 0  # a dead column: its diagonal entry is set in place too
    H = 2.0 / X.shape[0] * X.T @ X
    args = QuantArgs(num_bits=4, strategy="group", group_size=64, symmetric=False)
    kept = H.clone()
    ref = gptq_quantize(W, kept, args, act_order=act_order)
    assert torch.equal(kept, H)
    got = gptq_quantize(W, H, args, act_order=act_order, consume_hessian=True)
    assert H.numel() == 0
    for f in ("q", "scale", "zero_point", "weight_dq"):
        assert torch.equal(getattr(got, f), getattr(ref, f)), f
    assert got.loss == ref.loss


def test_dead_columns_are_zeroed():
    W, X = _problem(K=128)
    X[:, [3, 77]] = 0.0
    H = 2.0 / X.shape[0] * X.T @ X
    res = gptq_quantize(W, H, QuantArgs(num_bits=4, strategy="group", group_size=64))
    assert torch.all(res.weight_dq[:, [3, 77]] == 0)


def test_bad_inputs():
    W, _ = _problem(N=8, K=96)
    with pytest.raises(QuantSpecError, match="does not divide"):
        gptq_quantize(W, torch.eye(96), QuantArgs(num_bits=4, strategy="group", group_size=64))
    with pytest.raises(QuantSpecError, match="hessian"):
        gptq_quantize(W, torch.eye(95), QuantArgs(num_bits=4, strategy="channel"))
    with pytest.raises(QuantSpecError, match="positive definite"):
        gptq_quantize(W, -torch.eye(96), QuantArgs(num_bits=4, strategy="channel"), damp=0.0)
