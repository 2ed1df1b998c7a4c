"""AutoRound (`calib.autoround`): the untuned start is round-to-nearest's artifact exactly, tuned
codes and scales are compressed-tensors' qparams of the tuned clipping and dequantize to the
weight the tuning ran, the straight-through gradients, and on a model with outlier channels less
error than rounding to nearest and GPTQ against the float model's hidden states."""

import pytest
import torch

from quantspec.calib.autoround import AutoRound, TunedWeight
from quantspec.calib.ptq import quantize_model
from quantspec.errors import QuantSpecError
from quantspec.model_zoo.checkpoint import load_model
from quantspec.quant.args import QuantArgs
from quantspec.quant.gptq import rtn_quantize
from quantspec.quant.presets import preset
from quantspec.quant.primitives import dequantize

torch.set_num_threads(1)

ARGS = {
    "int4-g32-sym": QuantArgs(num_bits=4, strategy="group", group_size=32),
    "int4-g32-asym": QuantArgs(num_bits=4, strategy="group", group_size=32, symmetric=False),
    "int8-channel-sym": QuantArgs(num_bits=8, strategy="channel"),
    "int4-channel-asym": QuantArgs(num_bits=4, strategy="channel", symmetric=False),
}


def _weight(seed=0):
    w = torch.randn(48, 128, generator=torch.Generator().manual_seed(seed)) * 0.02
    w[3, 7] = 0.4  # an outlier: its group's clipping matters
    w[5] -= 0.05  # a row with no positive weight
    return w


def _ct_args(a: QuantArgs):
    from compressed_tensors.quantization import QuantizationArgs  # inside: it imports triton (tests/kernels)

    return QuantizationArgs(num_bits=a.num_bits, type="int", symmetric=a.symmetric, strategy=a.strategy,
                            group_size=a.group_size)


@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(ARGS))
def test_the_untuned_start_is_round_to_nearest(name, scale_dtype):
    args, w = ARGS[name], _weight()
    t = TunedWeight(w, args, scale_dtype)
    q, s, zp = t.codes()
    r = rtn_quantize(w, args, scale_dtype=scale_dtype)
    assert torch.equal(q, r.q) and torch.equal(s, r.scale)
    assert zp is None if args.symmetric else torch.equal(zp, r.zero_point)
    assert torch.equal(t.fake_quantized().detach(), dequantize(r.q, r.scale, r.zero_point, args, dtype=w.dtype))


@pytest.mark.parametrize("name", list(ARGS))
def test_tuned_codes_are_compressed_tensors_qparams_of_the_tuned_clipping(name):
    """Codes round(w / s + v + zp) on the grid, with compressed-tensors' scale and zero point of
    (α · min, β · max), dequantize to the weight the tuning ran."""
    from compressed_tensors.quantization.utils import calculate_qparams

    args, w = ARGS[name], _weight(1)
    gen = torch.Generator().manual_seed(2)
    t = TunedWeight(w, args, torch.bfloat16)
    with torch.no_grad():
        t.v.copy_(torch.rand(w.shape, generator=gen) - 0.5)
        t.alpha.copy_(0.6 + 0.4 * torch.rand(t.alpha.shape, generator=gen))
        t.beta.copy_(0.6 + 0.4 * torch.rand(t.beta.shape, generator=gen))
    q, s, zp = t.codes()
    groups = s.shape[1]
    wg = w.unflatten(-1, (groups, -1))
    mn, mx = wg.amin(-1) * t.alpha.detach(), wg.amax(-1) * t.beta.detach()
    ct_scale, ct_zp = calculate_qparams(mn, mx, _ct_args(args))
    assert torch.equal(s, ct_scale.to(torch.bfloat16))
    if not args.symmetric:
        assert torch.equal(zp, ct_zp.to(zp.dtype))
    lo, hi = (-8, 7) if args.num_bits == 4 else (-128, 127)
    sf, zf = s.float()[..., None], (0 if args.symmetric else ct_zp.float()[..., None])
    want = torch.clamp(torch.round(wg / sf + t.v.detach().unflatten(-1, (groups, -1)) + zf), lo, hi).flatten(1)
    assert torch.equal(q.float(), want)
    assert (q != rtn_quantize(w, args).q).any()  # the tuning moved codes
    assert torch.equal(t.fake_quantized().detach(), dequantize(q, s, zp, args, dtype=w.dtype))


def test_straight_through_gradients():
    """∂ŵ/∂v is the scale where the code is inside the grid and 0 where it is clamped; α and β
    take gradients through the scale."""
    args, w = ARGS["int4-g32-sym"], _weight(3)
    t = TunedWeight(w, args, torch.float32)
    g = torch.randn(w.shape, generator=torch.Generator().manual_seed(4))
    (t.fake_quantized() * g).sum().backward()
    _, s, _ = t.codes()
    s_full = s.repeat_interleave(32, dim=1)
    r = (w / s_full).round()  # v = 0: the unclamped codes
    inside = (r >= -8) & (r <= 7)
    torch.testing.assert_close(t.v.grad[inside], (g * s_full)[inside])
    assert (~inside).any() and (t.v.grad[~inside] == 0).all()  # each group's +absmax rounds to 8
    assert t.alpha.grad.abs().sum() > 0 and t.beta.grad.abs().sum() > 0


def test_a_step_too_small_to_move_a_code_leaves_round_to_nearest(tiny_llama_dir):
    ids = torch.randint(3, 500, (4, 16), generator=torch.Generator().manual_seed(0))
    config = preset("weight_only_int4", group_size=32, weight_observer="minmax")
    tuned = quantize_model(load_model(tiny_llama_dir)[0], config, "autoround", ids,
                           autoround=AutoRound(iters=3, lr=1e-12, batch_size=2)).tensors
    rtn = quantize_model(load_model(tiny_llama_dir)[0], config, "rtn").tensors
    assert sorted(tuned) == sorted(rtn)
    for k in rtn:
        assert torch.equal(tuned[k], rtn[k]), k


def test_a_layer_left_float_is_left_as_it_is(tiny_llama_dir):
    ids = torch.randint(3, 500, (4, 16), generator=torch.Generator().manual_seed(0))
    model, _ = load_model(tiny_llama_dir)
    float_layer = {k: v.clone() for k, v in model.model.layers[1].state_dict().items()}
    res = quantize_model(model, preset("weight_only_int4", group_size=32, ignore=("lm_head", "re:model.layers.1.*")),
                         "autoround", ids, autoround=AutoRound(iters=5))
    assert any(k.startswith("model.layers.0.") and k.endswith("weight_packed") for k in res.tensors)
    for k, v in float_layer.items():
        assert torch.equal(res.tensors[f"model.layers.1.{k}"], v), k


def test_autoround_beats_rounding_and_gptq_on_outlier_channels(tmp_path):
    from test_awq import _outlier_errors

    for symmetric in (True, False):
        config = preset("weight_only_int4", group_size=32, weight_observer="minmax", symmetric=symmetric)
        errs, summary = _outlier_errors(tmp_path / str(symmetric), config, ("rtn", "gptq", "autoround"))
        assert errs["autoround"] < 0.5 * errs["rtn"], errs  # 0.10× here (symmetric)
        assert errs["autoround"] < errs["gptq"], errs  # 0.15×
        assert summary["autoround_loss_total"] > 0
        assert (summary["iters"], summary["lr"], summary["batch_size"]) == (200, 1 / 200, 8)


def test_autoround_tunes_a_mixture_of_experts_experts(tmp_path):
    """Only the experts quantized: the routed forward tunes each expert on the tokens sent to it."""
    from test_awq import expert_errors

    errs, _ = expert_errors(tmp_path, ("rtn", "autoround"))
    assert errs["autoround"] < 0.5 * errs["rtn"], errs  # 0.22× here


def test_an_autoround_artifact_runs_as_in_transformers(tiny_llama_dir, artifact_runs_as_in_transformers, tmp_path):
    """Its codes and scales are compressed-tensors' layout: transformers decompresses them to the
    weights quantspec runs (symmetric: transformers refuses packed zero points, whatever the method)."""
    from quantspec.model_zoo.tiny import TINY_CORPUS

    data = tmp_path / "calib.txt"
    data.write_text(TINY_CORPUS)
    ids = torch.randint(3, 500, (12,), generator=torch.Generator().manual_seed(5))
    artifact_runs_as_in_transformers(tiny_llama_dir, "weight_only_int4", tmp_path / "art", ids, method="autoround",
                                     group_size=32, dataset=str(data), num_samples=4,
                                     seq_len=32, iters=20)


def test_bad_requests(tiny_llama_dir):
    model, _ = load_model(tiny_llama_dir)
    ids = torch.randint(3, 500, (2, 16))
    with pytest.raises(QuantSpecError, match="--dataset"):
        quantize_model(model, preset("weight_only_int4"), "autoround")
    with pytest.raises(QuantSpecError, match="integer weights .* use --method rtn or gptq"):
        quantize_model(model, preset("a8w8_fp8", activations="dynamic"), "autoround", ids)
    with pytest.raises(QuantSpecError, match="integer zero points"):
        quantize_model(model, preset("weight_only_int4", symmetric=False, zp_dtype="float16"), "autoround", ids)
    for bad, flag in ((dict(iters=0), "--iters"), (dict(batch_size=-1), "--batch-size"), (dict(lr=0.0), "--lr")):
        with pytest.raises(QuantSpecError, match=flag):
            AutoRound(**bad)
