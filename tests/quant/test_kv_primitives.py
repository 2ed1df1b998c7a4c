"""quantize_kv / dequantize_kv / scale_from_absmax on literal arrays with hand-computed answers."""

import pytest
import torch

from quantspec.errors import QuantSpecError
from quantspec.quant.primitives import dequantize_kv, quantize_kv, scale_from_absmax, static_args


def test_scale_from_absmax_literal():
    a = torch.tensor([127.5, 255.0, 0.0])
    assert torch.equal(scale_from_absmax(a, "int8"), torch.tensor([1.0, 2.0, torch.finfo(torch.float32).eps]))
    assert torch.equal(scale_from_absmax(torch.tensor(896.0), "fp8"), torch.tensor([2.0]))
    assert scale_from_absmax(torch.tensor(3.0), "int8").shape == (1,)
    with pytest.raises(QuantSpecError, match="'int8' or 'fp8'"):
        scale_from_absmax(a, "int4")
    with pytest.raises(QuantSpecError, match=">= 0"):
        scale_from_absmax(torch.tensor([-1.0]), "int8")


def test_quantize_kv_int8_literal():
    # x [T=1, KV=2, hd=4], head 0 scale 0.5, head 1 scale 2.0
    x = torch.tensor([[[0.24, 0.25, 0.26, -64.1],
                       [3.0, 5.0, 300.0, -1.0]]])
    s = torch.tensor([0.5, 2.0])
    q = quantize_kv(x, s, "int8")
    assert q.dtype == torch.int8
    # 0.48 -> 0, 0.5 -> 0 (half to even), 0.52 -> 1, -128.2 -> -128 (clamp)
    # 1.5 -> 2 (half to even), 2.5 -> 2, 150 -> 127 (clamp), -0.5 -> -0
    assert q.tolist() == [[[0, 0, 1, -128], [2, 2, 127, 0]]]
    d = dequantize_kv(q, s, torch.float32)
    assert d.tolist() == [[[0.0, 0.0, 0.5, -64.0], [4.0, 4.0, 254.0, 0.0]]]
    assert dequantize_kv(q, s, torch.bfloat16).dtype == torch.bfloat16


def test_quantize_kv_fp8_literal():
    x = torch.tensor([[[0.3, 17.0, 500.0, -3.3]]])  # [1, KV=1, 4], scale 1
    s = torch.tensor([1.0])
    q = quantize_kv(x, s, "fp8")
    assert q.dtype == torch.float8_e4m3fn
    # E4M3 neighbours: 0.3 -> 0.3125 (1.25 * 2^-2), 17 -> 16 (tie, spacing 2 -> even mantissa),
    # 500 -> 448 (clamp), -3.3 -> -3.25 (spacing 0.25)
    assert q.float().tolist() == [[[0.3125, 16.0, 448.0, -3.25]]]
    assert dequantize_kv(q, torch.tensor([0.5])).tolist() == [[[0.15625, 8.0, 224.0, -1.625]]]


def test_round_trip_error_bounded_per_head():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 7, 3, 8, generator=g) * torch.tensor([1.0, 10.0, 0.1])[:, None]  # [.., KV=3, hd]
    absmax = x.abs().amax(dim=(0, 1, 3))  # [3]
    s = scale_from_absmax(absmax, "int8")
    err = (dequantize_kv(quantize_kv(x, s, "int8"), s) - x).abs()
    assert (err <= s[:, None] / 2 + 1e-7).all()
    s8 = scale_from_absmax(absmax, "fp8")
    rel = (dequantize_kv(quantize_kv(x, s8, "fp8"), s8) - x).abs() / x.abs().clamp(min=1e-3 * absmax[:, None])
    assert rel.max() <= 2 ** -4 + 1e-6  # 3 mantissa bits: relative error <= 1/16 in the normal range


def test_bad_input():
    x = torch.randn(2, 3, 4)
    with pytest.raises(QuantSpecError, match=r"\[num_kv_heads\]"):
        quantize_kv(x, torch.ones(3, 1), "int8")
    with pytest.raises(QuantSpecError, match="KV=2"):
        quantize_kv(x, torch.ones(2), "int8")
    with pytest.raises(QuantSpecError, match="int8 or float8"):
        dequantize_kv(x, torch.ones(3))
    with pytest.raises(QuantSpecError, match="'int8' or 'fp8'"):
        quantize_kv(x, torch.ones(3), "fp16")


def test_fp8_missing_dtype_is_a_clear_error(monkeypatch):
    monkeypatch.delattr(torch, "float8_e4m3fn")
    with pytest.raises(QuantSpecError, match="no float8_e4m3fn"):
        quantize_kv(torch.randn(2, 3, 4), torch.ones(3), "fp8")
    with pytest.raises(QuantSpecError, match="no float8_e4m3fn"):
        static_args("fp8")
