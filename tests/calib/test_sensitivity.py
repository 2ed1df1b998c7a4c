"""α search, per-Linear sensitivity and the W8A16 fallback, each against an independent reference."""

import copy
import json

import re

import pytest
import torch

from quantspec.calib.calibrate import calibrate_model
from quantspec.calib.sensitivity import (fake_quant_weight, group_alpha_errors, linear_sensitivity,
                                         search_alphas, static_linear_error)
from quantspec.calib.static_plan import (FALLBACK_GROUP, plan_static_quant, rank_units, select_fallback,
                                         with_fallback_layers)
from quantspec.calib.smooth import input_scales_for_model, smooth_model, smoothing_factors
from quantspec.calib.tables import ScaleTable
from quantspec.errors import QuantSpecError
from quantspec.infer.dispatch import DispatchPolicy
from quantspec.model_zoo.checkpoint import load_model
from quantspec.model_zoo.llama import DenseCausalAttention
from quantspec.quant.presets import preset

torch.set_num_threads(1)
N, S = 4, 32
# the Linears vLLM / SGLang fuse into one layer, written out (relative to a decoder layer)
UNITS = (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("self_attn.o_proj",),
         ("mlp.gate_proj", "mlp.up_proj"), ("mlp.down_proj",))


def unit_of(name):
    prefix, rel = name.split(".", 3)[:3], name.split(".", 3)[3]
    unit = next(u for u in UNITS if rel in u)
    return tuple(".".join(prefix) + "." + n for n in unit)


def calib_ids(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 500, (N, S), generator=g)


def ref_fq_int8_tensor(x, scale):
    """Hand-written symmetric int8 fake quant (independent of quant/primitives)."""
    return torch.clamp(torch.round(x / scale), -128, 127) * scale


def ref_fq_int8_channel(w):
    s = w.abs().amax(dim=1, keepdim=True) / 127.5
    return torch.clamp(torch.round(w / s), -128, 127) * s


def test_select_fallback_literal():
    errs = {"a": 0.1, "b": 0.3, "c": 0.2, "d": 0.2}  # outside the decoder layers: units of one
    assert select_fallback(errs, 2) == ["b", "c"]  # tie c/d broken by name
    assert select_fallback(errs, 0) == []
    assert select_fallback(errs, 1, threshold=0.15) == ["b", "c", "d"]
    assert select_fallback(errs, 10) == ["b", "c", "d", "a"]
    with pytest.raises(QuantSpecError, match="must be an int >= 0"):
        select_fallback(errs, -1)


def test_select_fallback_takes_whole_fused_units():
    p = "model.layers.0."
    errs = {p + "self_attn.q_proj": 0.1, p + "self_attn.k_proj": 0.3, p + "self_attn.v_proj": 0.05,
            p + "self_attn.o_proj": 0.2, p + "mlp.gate_proj": 0.01, p + "mlp.up_proj": 0.25,
            p + "mlp.down_proj": 0.22}
    qkv = [p + "self_attn.q_proj", p + "self_attn.k_proj", p + "self_attn.v_proj"]
    gate_up = [p + "mlp.gate_proj", p + "mlp.up_proj"]
    assert select_fallback(errs, 1) == qkv  # k_proj's 0.3 brings q and v along
    assert select_fallback(errs, 2) == qkv + gate_up  # the unit's error is its worst member's
    assert select_fallback(errs, 0, threshold=0.21) == qkv + gate_up + [p + "mlp.down_proj"]
    assert [u for u, _ in rank_units(errs)] == [tuple(qkv), tuple(gate_up), (p + "mlp.down_proj",),
                                                (p + "self_attn.o_proj",)]
    # a Linear the ranking does not know (not quantized) is left out of its unit
    del errs[p + "self_attn.v_proj"]
    assert select_fallback(errs, 1) == qkv[:2]


def test_static_linear_error_matches_hand_reference():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(50, 24, generator=g) * 2
    x[3, 5] = 40.0  # an outlier the per-tensor scale must cover
    ws = [torch.randn(7, 24, generator=g), torch.randn(5, 24, generator=g)]
    scale = torch.tensor([40.0 / 127.5])
    err, ref = static_linear_error(x, ws, scale, "int8")
    xq = ref_fq_int8_tensor(x, scale)
    want_e = 0.0
    for w in ws:  # per-token relative error, summed over tokens and Linears
        y = x @ w.T
        for t in range(x.shape[0]):
            want_e += float((xq[t] @ ref_fq_int8_channel(w).T - y[t]).pow(2).sum() / y[t].pow(2).sum())
    assert err == pytest.approx(want_e, rel=1e-4) and ref == 50 * 2
    torch.testing.assert_close(fake_quant_weight(ws[0], "int8"), ref_fq_int8_channel(ws[0]))


def test_static_linear_error_smoothed_and_prequantized_are_the_same_numbers():
    """Smoothing by s inside (W · s made per Linear) and weights passed already rounded give
    exactly the errors of the calls that take them made outside."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(40, 24, generator=g)
    x[:, 3] *= 30.0
    ws = [torch.randn(7, 24, generator=g), torch.randn(5, 24, generator=g)]
    s = x.abs().amax(0).sqrt()
    scale = torch.tensor([(x / s).abs().amax() / 127.5])
    y_ref = [x @ w.T for w in ws]
    want = static_linear_error(x / s, [w * s for w in ws], scale, "int8", y_ref=y_ref)
    assert static_linear_error(x, ws, scale, "int8", smooth=s, y_ref=y_ref) == want
    assert static_linear_error(x, ws, scale, "int8", smooth=s) == \
        static_linear_error(x / s, [w * s for w in ws], scale, "int8", x_ref=x, weights_ref=ws)
    wq = [fake_quant_weight(w, "int8") for w in ws]
    assert static_linear_error(x, wq, scale, "int8", quantized=True) == \
        static_linear_error(x, ws, scale, "int8", weights_ref=wq)


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_fake_quant_weight_in_row_blocks_is_one_call(monkeypatch, kind):
    """Rounding a weight a few rows at a time gives the numbers of one call over all rows."""
    from quantspec.calib import sensitivity

    w = torch.randn(37, 16, generator=torch.Generator().manual_seed(3))
    whole = fake_quant_weight(w, kind)
    monkeypatch.setattr(sensitivity, "_FQ_BLOCK_BYTES", 5 * 16 * 4)  # blocks of 5 rows
    assert torch.equal(fake_quant_weight(w, kind), whole)
    if kind == "int8":
        torch.testing.assert_close(whole, ref_fq_int8_channel(w))


def test_group_alpha_errors_brute_force_and_best():
    """Each α's error equals a brute-force smooth → fake-quant → matmul, and the α the search
    keeps is the grid's argmin."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 16, generator=g)
    x[:, [2, 9]] *= 25.0  # outlier channels
    ws = [torch.randn(8, 16, generator=g) * 0.1, torch.randn(4, 16, generator=g) * 0.1]
    ch = x.abs().amax(dim=0)
    grid = (0.0, 0.25, 0.5, 0.75, 1.0)
    errs = group_alpha_errors(x, ws, ch, "int8", grid)
    wmax = torch.stack([w.abs().amax(0) for w in ws]).amax(0)
    brute = {}
    for a in grid:
        s = ch.clamp(min=1e-5).pow(a) / wmax.clamp(min=1e-5).pow(1 - a)
        xs = x / s
        scale = xs.abs().amax() / 127.5
        e = r = 0.0
        for w in ws:
            y = x @ w.T
            d = ref_fq_int8_tensor(xs, scale) @ ref_fq_int8_channel(w * s).T - y
            e += float((d.pow(2).sum(1) / y.pow(2).sum(1)).sum())
            r += y.shape[0]
        brute[a] = e / r
        assert errs[a][0] / errs[a][1] == pytest.approx(brute[a], rel=1e-3)
    best = min(brute, key=brute.get)
    assert best not in (0.0,) and brute[best] < brute[0.0]  # smoothing helps outliers here


@pytest.fixture(scope="module")
def model_table(tiny_llama_dir):
    model, _ = load_model(tiny_llama_dir)
    with torch.no_grad():  # outliers on the MLP path (what SmolLM2's down_proj sees)
        for layer in model.model.layers:
            layer.post_attention_layernorm.weight[[1, 30]] *= 20.0
            layer.mlp.up_proj.weight[[5, 77]] *= 30.0
    return model, ScaleTable(calibrate_model(model, calib_ids()))


def test_search_alphas_picks_argmin_of_the_group_error(tiny_llama_dir, model_table):
    model, table = model_table
    before = {k: v.clone() for k, v in model.state_dict().items()}
    grid = (0.2, 0.5, 0.8)
    best, errors = search_alphas(model, table, calib_ids(), "int8", alphas=grid)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # not modified
    heads = {f"model.layers.{i}.{n}" for i in range(2)
             for n in ("self_attn.q_proj", "mlp.gate_proj", "mlp.down_proj")}
    assert set(best) == heads == set(errors)
    for k in heads:
        assert best[k] == min(errors[k], key=errors[k].get)
    # independent check for layer 0 down_proj: capture its input with a plain hook and recompute
    name = "model.layers.0.mlp.down_proj"
    captured = []
    down = model.model.layers[0].mlp.down_proj
    h = down.register_forward_pre_hook(lambda m, a: captured.append(a[0].reshape(-1, a[0].shape[-1])))
    ids = calib_ids()
    with torch.no_grad():
        model(ids.reshape(-1), torch.arange(S).repeat(N), DenseCausalAttention(N, S))
    h.remove()
    x = torch.cat(captured)
    ch = table.input_channel_absmax(name)
    for a in grid:
        e, r = group_alpha_errors(x, [down.weight], ch, "int8", (a,))[a]
        assert errors[name][a] == pytest.approx(e / r, rel=1e-3)


def test_linear_sensitivity_and_fallback_are_top_n(model_table):
    model, table = model_table
    scales = input_scales_for_model(table, model, "a8w8")
    sens = linear_sensitivity(model, calib_ids(), scales, "int8")
    assert set(sens) == set(scales)
    # independent: one full forward with hooks computing the hand reference error per Linear
    sums = {}
    hs = []
    for name, m in model.named_modules():
        if name in scales:
            def hook(mod, a, _n=name):
                x = a[0].reshape(-1, a[0].shape[-1])
                wq = ref_fq_int8_channel(mod.weight)  # kept by a W8A16 fallback: not scored
                y = x @ wq.T
                yq = ref_fq_int8_tensor(x, scales[_n]) @ wq.T
                acc = sums.setdefault(_n, [0.0, 0.0])
                acc[0] += float(((yq - y).pow(2).sum(1) / y.pow(2).sum(1)).sum())
                acc[1] += y.shape[0]
            hs.append(m.register_forward_pre_hook(hook))
    with torch.no_grad():
        model(calib_ids().reshape(-1), torch.arange(S).repeat(N), DenseCausalAttention(N, S))
    for h in hs:
        h.remove()
    for n, (e, r) in sums.items():
        assert sens[n] == pytest.approx(e / r, rel=1e-3, abs=1e-9)
    unit_err = {}
    for n, (e, r) in sums.items():
        unit_err[unit_of(n)] = max(unit_err.get(unit_of(n), 0.0), e / r)
    top3 = sorted(unit_err, key=lambda u: -unit_err[u])[:3]
    assert select_fallback(sens, 3) == [n for u in top3 for n in u]


def test_linear_sensitivity_with_factors_is_the_smoothed_models(model_table):
    """Scoring with smoothing factors (model untouched) equals scoring the smoothed model; with
    down_proj smoothed too, up_proj keeps its score (it is measured in its own output units,
    not in those of its rows divided by down_proj's factor)."""
    model, table = model_table
    before = {k: v.clone() for k, v in model.state_dict().items()}
    scores = {}
    for down in (False, True):
        factors = smoothing_factors(model, table, 0.6, smooth_down=down)
        scales = input_scales_for_model(table, model, "a8w8", smooth=factors)
        got = linear_sensitivity(model, calib_ids(), scales, "int8", smooth=factors)
        assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
        smoothed = copy.deepcopy(model)
        assert smooth_model(smoothed, table, 0.6, smooth_down=down).keys() == factors.keys()
        want = linear_sensitivity(smoothed, calib_ids(), scales, "int8")
        assert got.keys() == want.keys()
        for n in want:
            if not (down and n.endswith("up_proj")):  # layer 1's inputs differ by float rounding
                assert got[n] == pytest.approx(want[n], rel=5e-3, abs=1e-9), n
        scores[down] = got
    ups = [n for n in scores[True] if n.endswith("up_proj")]
    assert all(scores[True][n] == pytest.approx(scores[False][n], rel=1e-6) for n in ups)
    downs = [n for n in scores[True] if n.endswith("down_proj")]
    assert any(scores[True][n] != pytest.approx(scores[False][n], rel=0.1) for n in downs)


def test_with_fallback_layers_config():
    cfg = preset("a8w8")
    names = ["model.layers.1.mlp.down_proj", "model.layers.0.mlp.down_proj"]
    out = with_fallback_layers(cfg, names)
    assert out.config_groups[FALLBACK_GROUP].input_activations is None
    assert out.config_groups[FALLBACK_GROUP].targets == tuple(sorted(names))
    assert out.scheme_for(names[0]).input_activations is None
    assert out.scheme_for("model.layers.0.mlp.up_proj").input_activations is not None
    assert out.quant_type.value == "a8w8"
    assert with_fallback_layers(cfg, []) is cfg
    with pytest.raises(QuantSpecError, match="not quantized"):
        with_fallback_layers(cfg, ["lm_head"])
    qkv = [f"model.layers.2.self_attn.{n}_proj" for n in "qkv"]
    # a whole fused unit is one regex naming its shards and the fused layer (SGLang matches that)
    fb = with_fallback_layers(cfg, qkv)
    (target,) = fb.config_groups[FALLBACK_GROUP].targets
    assert target.startswith("re:") and re.match(target[3:], "model.layers.2.self_attn.qkv_proj")
    assert all(fb.scheme_for(n).input_activations is None for n in qkv)
    assert fb.scheme_for("model.layers.2.self_attn.o_proj").input_activations is not None
    assert fb.config_groups[FALLBACK_GROUP].format == "pack-quantized"  # W8A16
    for partial in (qkv[:1], qkv[1:], ["model.layers.0.mlp.up_proj"]):
        with pytest.raises(QuantSpecError, match="ignore a partial fallback"):
            with_fallback_layers(cfg, partial)
    # a shard the config does not quantize is not part of the unit's fallback
    ignoring_v = preset("a8w8", ignore=("lm_head", "model.layers.2.self_attn.v_proj"))
    assert with_fallback_layers(ignoring_v, qkv[:2]).scheme_for(qkv[0]).input_activations is None


def test_plan_auto_alpha_smooths_per_group(tiny_llama_dir, model_table):
    _, table = model_table
    model, _ = load_model(tiny_llama_dir)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.post_attention_layernorm.weight[[1, 30]] *= 20.0
            layer.mlp.up_proj.weight[[5, 77]] *= 30.0
    ref, _ = load_model(tiny_llama_dir)
    ref.load_state_dict(model.state_dict())
    orig = {k: v.clone() for k, v in ref.state_dict().items()}
    plan = plan_static_quant(model, table, "a8w8", smoothquant_alpha="auto", input_ids=calib_ids(),
                             fallback_layers=2, alphas=(0.3, 0.6, 0.9))
    searched, _ = search_alphas(ref, table, calib_ids(), "int8", alphas=(0.3, 0.6, 0.9))
    assert plan.fallback == select_fallback(plan.sensitivity, 2)
    # every group is smoothed with its searched α but the fallback units' (not smoothed at all)
    assert plan.alphas == {h: a for h, a in searched.items() if h not in plan.fallback}
    assert plan.fallback and any(h in plan.fallback for h in searched)
    factors = smooth_model(ref, table, plan.alphas)  # same per-group α → same weights and scales
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(model.state_dict()[k], v)
    for n in plan.fallback:
        assert torch.equal(model.state_dict()[f"{n}.weight"], orig[f"{n}.weight"]) or n.endswith("up_proj")
    want = input_scales_for_model(table, ref, "a8w8", smooth=factors)
    assert all(torch.equal(plan.input_scales[k], want[k]) for k in want)
    summ = plan.summary()
    assert summ["static_activation_linears"] == 14 - len(plan.fallback)
    assert summ["fallback_layers"] == plan.fallback and summ["fallback_rule"]["by"] == "rank"
    assert [u["linears"] for u in summ["fallback_units"]] == [list(unit_of(n)) for n in plan.fallback
                                                              if n == unit_of(n)[0]]
    with pytest.raises(QuantSpecError, match="calibration data"):
        plan_static_quant(model, table, "a8w8", fallback_layers=1)
    with pytest.raises(QuantSpecError, match="one way"):
        plan_static_quant(model, table, "a8w8", input_ids=calib_ids(), fallback_layers=1,
                          fallback_budget=2.0, holdout_ids=calib_ids(1))
    with pytest.raises(QuantSpecError, match="held-back"):
        plan_static_quant(model, table, "a8w8", input_ids=calib_ids(), fallback_budget=2.0)


@pytest.mark.parametrize("quant_type", ["a8w8", "a8w8_fp8"])
def test_fallback_artifact_loads_here_and_in_transformers(tmp_path, tiny_llama_dir, quant_type):
    """api.quantize with α search + 2 fallback units: config groups are compressed-tensors valid
    and cover whole fused units, provenance lists the layers, quantspec and transformers load it
    and agree on logits."""
    from quantspec import api
    from quantspec.infer.loader import load_for_inference
    from quantspec.model_zoo.tiny import TINY_CORPUS

    data = tmp_path / "calib.txt"
    data.write_text(TINY_CORPUS)
    calib = api.calibrate(str(tiny_llama_dir), str(data), tmp_path / "calib", num_samples=4,
                          seq_len=32).path
    art = api.quantize(str(tiny_llama_dir), quant_type, tmp_path / "art", calib=calib,
                       smoothquant_alpha="auto", fallback_layers=2, search_samples=2)
    cfg = json.loads((art / "config.json").read_text())["quantization_config"]
    fb = cfg["config_groups"][FALLBACK_GROUP]
    assert fb["input_activations"] is None
    info = api.inspect(str(art))
    fallback = info["fallback_layers"]  # the Linears the fallback group's targets match
    assert all(info["layers"][n]["input_activations"] is None for n in fallback)
    assert len({unit_of(t) for t in fallback}) == 2
    assert all(set(unit_of(t)) <= set(fallback) for t in fallback)  # whole units only
    assert info["static_activation_linears"] == 14 - len(fallback)
    plan = info["calibration"]["static_plan"]
    assert sorted(plan["fallback_layers"]) == sorted(fallback)
    heads = {f"model.layers.{i}.{n}" for i in range(2) for n in ("self_attn.q_proj", "mlp.gate_proj",
                                                                 "mlp.down_proj")}
    assert set(plan["smoothquant_alphas"]) == heads - set(fallback)  # fallback units unsmoothed
    mods = dict(load_for_inference(str(art), tokenizer=False, fuse=False).model.named_modules())
    for t in fallback:
        assert mods[t].input_scale is None
    # the reference path: compressed-tensors' op order (see tests/test_interop_transformers.py
    # `_same_op_order`: fp8's CPU kernel may round one activation code of a later layer otherwise)
    loaded = load_for_inference(str(art), tokenizer=False, policy=DispatchPolicy(fast=False))
    pytest.importorskip("compressed_tensors")
    from transformers import AutoModelForCausalLM

    ids = torch.tensor([7, 300, 41, 12, 99, 5, 260, 17])
    hf = AutoModelForCausalLM.from_pretrained(str(art), dtype=torch.float32)
    with torch.no_grad():
        ours = loaded.model.compute_logits(
            loaded.model(ids, torch.arange(len(ids)), DenseCausalAttention(1, len(ids))))
        theirs = hf(ids[None]).logits[0]
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)
