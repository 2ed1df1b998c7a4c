"""SmoothQuant from a table: same function, smoothed input ranges, lower a8w8 error; static scales."""

import pytest
import torch

from quantspec.calib.calibrate import calibrate_model
from quantspec.calib.smooth import (SMOOTH_GROUPS, input_scales_for_model, prepare_static_quant,
                                    smooth_model, smoothed_weight, smoothing_factors)
from quantspec.calib.tables import ScaleTable, read_table, write_table
from quantspec.model_zoo.checkpoint import model_fingerprint
from quantspec.errors import QuantSpecError
from quantspec.model_zoo.checkpoint import load_model
from quantspec.model_zoo.llama import DenseCausalAttention
from quantspec.quant.args import QuantArgs
from quantspec.quant.primitives import choose_qparams, fake_quantize

torch.set_num_threads(1)
N, S = 4, 32
OUTLIERS = (3, 17, 40)  # hidden channels given 30x larger activations


def outlier_model(model_dir):
    """The tiny model with activation outliers: a few channels of every norm's gain scaled 30x
    (what SmoothQuant addresses: the q/k/v and gate/up inputs get a few huge channels)."""
    model, _ = load_model(model_dir)
    with torch.no_grad():
        for layer in model.model.layers:
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                norm.weight[list(OUTLIERS)] *= 30.0
    return model


def calib_ids(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 500, (N, S), generator=g)


def logits(model, ids):
    n, s = ids.shape
    with torch.no_grad():
        h = model(ids.reshape(-1), torch.arange(s).repeat(n), DenseCausalAttention(n, s))
        return model.compute_logits(h)


def a8w8_fake_quant(model, input_scales):
    """Simulate a8w8 on `model` in place with quant/ primitives only: int8 per-channel weights and
    int8 per-tensor static input scales on every decoder Linear."""
    w_args = QuantArgs(num_bits=8, strategy="channel")
    a_args = QuantArgs(num_bits=8, strategy="tensor")
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Linear) and name in input_scales:
            with torch.no_grad():
                s, zp = choose_qparams(m.weight, w_args)
                m.weight.copy_(fake_quantize(m.weight, s, zp, w_args))
            scale = input_scales[name]
            m.register_forward_pre_hook(
                lambda mod, args, _s=scale: (fake_quantize(args[0], _s, None, a_args),))
    return model


@pytest.fixture(scope="module")
def smoothed(tiny_llama_dir):
    model = outlier_model(tiny_llama_dir)
    table = ScaleTable(calibrate_model(model, calib_ids()))
    ref = logits(model, calib_ids(1))
    factors = smooth_model(model, table, alpha=0.5)
    return model, table, factors, ref


def test_function_unchanged(smoothed):
    model, _, factors, ref = smoothed
    torch.testing.assert_close(logits(model, calib_ids(1)), ref, rtol=1e-4, atol=1e-4)
    want = {f"model.layers.{i}.{n}" for i in range(2) for _, names in SMOOTH_GROUPS for n in names}
    want |= {f"model.layers.{i}.mlp.down_proj" for i in range(2)}  # up_proj rows → down_proj
    assert set(factors) == want  # o_proj is not smoothed
    s = factors["model.layers.0.self_attn.q_proj"]
    assert torch.equal(s, factors["model.layers.0.self_attn.v_proj"])
    assert s[list(OUTLIERS)].min() > 3 * s.median()  # outlier channels get the large factors


@pytest.mark.parametrize("groups", ["all", "no_down", "down_only"])
def test_smoothed_weight_is_the_smoothed_models(tiny_llama_dir, groups):
    """`smoothed_weight` of each Linear, one at a time, is exactly the weight `smooth_model`
    leaves (up_proj by its columns and / or down_proj's rows), and None where it leaves it."""
    model = outlier_model(tiny_llama_dir)
    table = ScaleTable(calibrate_model(model, calib_ids()))
    heads = {"all": ("self_attn.q_proj", "mlp.gate_proj", "mlp.down_proj"),
             "no_down": ("self_attn.q_proj", "mlp.gate_proj"), "down_only": ("mlp.down_proj",)}[groups]
    alpha = {f"model.layers.{i}.{h}": 0.5 for i in range(len(model.model.layers)) for h in heads}
    factors = smoothing_factors(model, table, alpha)
    ref = outlier_model(tiny_llama_dir)
    smooth_model(ref, table, alpha)
    for i, layer in enumerate(model.model.layers):
        prefix = f"model.layers.{i}"
        for rel, mod in layer.named_modules():
            if isinstance(mod, torch.nn.Linear):
                got = smoothed_weight(layer, prefix, factors, rel)
                want = ref.model.layers[i].get_submodule(rel).weight
                if torch.equal(want, mod.weight):
                    assert got is None, rel
                else:
                    assert torch.equal(got[0], want), rel


def test_smoothed_absmax_is_table_over_s(smoothed):
    """The documented rule: after smoothing, a smoothed Linear's input channel absmax is the
    table's / s, so its static scale is max_j(c_j / s_j) / 127.5 — checked by re-calibrating."""
    model, table, factors, _ = smoothed
    fresh = ScaleTable(calibrate_model(model, calib_ids()))
    scales = input_scales_for_model(table, model, "a8w8", smooth=factors)
    for name in fresh.linear_names:
        torch.testing.assert_close(scales[name], fresh.input_scale(name, "int8"), rtol=1e-4, atol=0)
        if name in factors:
            torch.testing.assert_close(fresh.input_channel_absmax(name),
                                       table.input_channel_absmax(name) / factors[name],
                                       rtol=1e-4, atol=1e-6)
    fp8 = input_scales_for_model(table, model, "a8w8_fp8", smooth=factors)
    name = "model.layers.1.mlp.up_proj"
    torch.testing.assert_close(fp8[name] * 448.0, scales[name] * 127.5, rtol=1e-6, atol=0)


@pytest.mark.parametrize("only_smoothable", [True, False])
def test_smoothing_lowers_a8w8_error(tiny_llama_dir, only_smoothable):
    """Relative logit MSE of simulated a8w8 vs fp32 on the outlier model (measured: smoothable
    Linears only 0.098 → 0.030 with alpha 0.5; all Linears 0.129 → 0.078, o_proj / down_proj
    keep their error)."""
    ids, probe = calib_ids(), calib_ids(1)
    smoothable = {n.rsplit(".", 1)[-1] for _, names in SMOOTH_GROUPS for n in names} | {"down_proj"}
    errs = {}
    for alpha in (None, 0.5):
        model = outlier_model(tiny_llama_dir)
        ref = logits(model, probe)
        table = ScaleTable(calibrate_model(model, ids))
        factors = smooth_model(model, table, alpha) if alpha is not None else None
        scales = input_scales_for_model(table, model, "a8w8", smooth=factors)
        if only_smoothable:
            scales = {k: v for k, v in scales.items() if k.rsplit(".", 1)[-1] in smoothable}
        a8w8_fake_quant(model, scales)
        errs[alpha] = ((logits(model, probe) - ref).pow(2).mean() / ref.pow(2).mean()).item()
    assert errs[0.5] < (0.5 if only_smoothable else 0.75) * errs[None], errs


def test_prepare_static_quant_checks_and_errors(tmp_path, tiny_llama_dir):
    model, _ = load_model(tiny_llama_dir)
    tensors = calibrate_model(model, calib_ids())
    out = write_table(tmp_path / "t", tensors, {"model_fingerprint": model_fingerprint(tiny_llama_dir)})
    scales, table = prepare_static_quant(model, out, tiny_llama_dir, "a8w8")
    assert len(scales) == 14 and all(s.shape == (1,) for s in scales.values())
    name = "model.layers.0.mlp.down_proj"
    torch.testing.assert_close(scales[name], tensors[f"{name}.input_absmax"].reshape(1) / 127.5)
    with pytest.raises(QuantSpecError, match="needs static activation scales"):
        prepare_static_quant(model, None, tiny_llama_dir, "a8w8")
    with pytest.raises(QuantSpecError, match="not 'weight_only_int8'"):
        input_scales_for_model(table, model, "weight_only_int8")
    with pytest.raises(QuantSpecError, match=r"alpha=1.5 must be in \[0, 1\]"):
        smooth_model(model, table, 1.5)


@pytest.mark.parametrize("quant_type,kind,alpha", [("a8w8", "int8", 0.5), ("a8w8_fp8", "fp8", None)])
def test_quantize_pipeline_through_quant_linear(tmp_path, tiny_llama_dir, quant_type, kind, alpha):
    """calibrate → api.quantize(calib, smoothquant_alpha, kv_cache) → load_for_inference: the
    artifact's KV scales are the table's, and every QuantLinear computes the quant/ reference
    fake_quant(x, static scale) @ fake_quant(W (smoothed), per channel)ᵀ."""
    from quantspec import api
    from quantspec.infer.loader import load_for_inference
    from quantspec.infer.quant_linear import QuantLinear
    from quantspec.model_zoo.tiny import TINY_CORPUS

    data = tmp_path / "calib.txt"
    data.write_text(TINY_CORPUS)
    calib = api.calibrate(str(tiny_llama_dir), str(data), tmp_path / "calib", num_samples=4,
                          seq_len=32).path
    art = api.quantize(str(tiny_llama_dir), quant_type, tmp_path / "art", calib=calib,
                       smoothquant_alpha="none" if alpha is None else alpha, fallback_layers=0,
                       kv_cache=kind, target="quantspec")  # int8 KV and per-head scales: quantspec's
    table = read_table(calib, model_dir=tiny_llama_dir)
    loaded = load_for_inference(str(art), tokenizer=False, fuse=False)  # per-module checks
    assert loaded.kv_cache_dtype == kind
    ks, vs = table.kv_scales(kind)
    assert torch.equal(loaded.k_scale, ks) and torch.equal(loaded.v_scale, vs)
    assert read_table(calib, model_dir=art).num_layers == 2  # artifact → source fingerprint

    ref, _ = load_model(tiny_llama_dir)
    factors = smooth_model(ref, table, alpha) if alpha is not None else None
    scales = input_scales_for_model(table, ref, quant_type, smooth=factors)
    w_args = QuantArgs(num_bits=8, type="float" if kind == "fp8" else "int", strategy="channel")
    a_args = QuantArgs(num_bits=8, type=w_args.type, strategy="tensor")
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(0)) * 3
    modules = dict(loaded.model.named_modules())
    checked = 0
    for name, m in ref.named_modules():
        if name not in scales:
            continue
        ql = modules[name]
        assert isinstance(ql, QuantLinear)
        torch.testing.assert_close(ql.input_scale, scales[name], rtol=1e-6, atol=0)
        xi = x[:, : m.in_features]
        s, zp = choose_qparams(m.weight, w_args)
        want = fake_quantize(xi, scales[name], None, a_args) @ fake_quantize(m.weight, s, zp, w_args).t()
        with torch.no_grad():
            torch.testing.assert_close(ql(xi), want, rtol=1e-4, atol=1e-4)
        checked += 1
    assert checked == 14

    # interop: transformers + compressed-tensors load the same artifact and agree on the logits
    # of the static input scales; transformers ignores k_scale / v_scale and runs a float KV
    # cache, so the comparison is with quantspec's float-KV path
    pytest.importorskip("compressed_tensors")
    from transformers import AutoModelForCausalLM

    from quantspec.infer.kv_cache import AttentionMetadata, PagedAttention, PagedKVCache

    ids = torch.tensor([7, 300, 41, 12, 99, 5, 260, 17, 33, 2, 150, 8, 71])
    T, a = len(ids), loaded.args
    cache = PagedKVCache(num_layers=a.num_layers, num_blocks=3, block_size=16,
                         num_kv_heads=a.num_kv_heads, head_dim=a.head_dim, dtype=torch.float32)
    meta = AttentionMetadata.build([T], [T], [[1]], 16, "cpu")
    hf = AutoModelForCausalLM.from_pretrained(str(art), dtype=torch.float32)
    with torch.no_grad():
        ours = loaded.model.compute_logits(loaded.model(ids, torch.arange(T), PagedAttention(cache, meta)))
        theirs = hf(ids[None]).logits[0]
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)


def test_quantize_refuses_a_table_from_another_model(tmp_path, tiny_llama_dir):
    from quantspec import api
    from quantspec.model_zoo.tiny import TINY_CORPUS, build_tiny_model

    other = build_tiny_model(tmp_path / "other", "llama", seed=1)
    data = tmp_path / "calib.txt"
    data.write_text(TINY_CORPUS)
    calib = api.calibrate(str(other), str(data), tmp_path / "calib", num_samples=2, seq_len=16).path
    with pytest.raises(QuantSpecError, match="was made for model .* calibrate this model"):
        api.quantize(str(tiny_llama_dir), "a8w8", tmp_path / "art", calib=calib)
    with pytest.raises(QuantSpecError, match="needs calibrated activation ranges"):
        api.quantize(str(tiny_llama_dir), "a8w8_fp8", tmp_path / "art")
    assert not (tmp_path / "art").exists()


def test_a8w8_gptq_weights_beat_rtn(tmp_path, tiny_llama_dir):
    """a8w8 with --method gptq: the weights are GPTQ-quantized after smoothing (the static input
    scales are the RTN artifact's), and the artifact's logits are closer to the float model's."""
    from quantspec import api
    from quantspec.infer.loader import load_for_inference
    from quantspec.infer.quant_linear import QuantLinear
    from quantspec.model_zoo.llama import DenseCausalAttention
    from quantspec.model_zoo.tiny import TINY_CORPUS

    data = tmp_path / "calib.txt"
    data.write_text(TINY_CORPUS)
    calib = api.calibrate(str(tiny_llama_dir), str(data), tmp_path / "calib", num_samples=4,
                          seq_len=32, dtype="float32").path
    arts = {m: api.quantize(str(tiny_llama_dir), "a8w8", tmp_path / m, calib=calib, smoothquant_alpha=0.5,
                            fallback_layers=0, method=m, dataset=str(data), num_samples=8, seq_len=64)
            for m in ("rtn", "gptq")}
    ref, _ = load_model(tiny_llama_dir)
    from transformers import AutoTokenizer

    ids = torch.tensor(AutoTokenizer.from_pretrained(str(tiny_llama_dir))(TINY_CORPUS).input_ids[:128])
    pos = torch.arange(len(ids))
    with torch.no_grad():
        want = ref.compute_logits(ref(ids, pos, DenseCausalAttention(1, len(ids))))
    errs, scales = {}, {}
    for m, art in arts.items():
        net = load_for_inference(str(art), tokenizer=False, fuse=False).model
        with torch.no_grad():
            got = net.compute_logits(net(ids, pos, DenseCausalAttention(1, len(ids))))
        errs[m] = float((got - want).pow(2).mean())
        scales[m] = {n: q.input_scale for n, q in net.named_modules() if isinstance(q, QuantLinear)}
    assert scales["rtn"].keys() == scales["gptq"].keys() and len(scales["rtn"]) == 14
    assert all(torch.equal(scales["rtn"][n], scales["gptq"][n]) for n in scales["rtn"])
    assert errs["gptq"] < errs["rtn"], errs


def test_fused_shards_share_one_input_scale(tiny_llama_dir):
    """q/k/v (gate/up) — one fused layer in vLLM and SGLang, which keep one input_scale for it —
    get one static scale, the largest of their table's values; other Linears keep their own."""
    from quantspec.calib.tables import INPUT_ABSMAX

    model, _ = load_model(tiny_llama_dir)
    table = ScaleTable(calibrate_model(model, calib_ids()))
    p = "model.layers.1"
    for name, factor in (("self_attn.k_proj", 3.0), ("mlp.gate_proj", 0.5), ("self_attn.o_proj", 2.0)):
        table.tensors[f"{p}.{name}.{INPUT_ABSMAX}"] = table.tensors[f"{p}.{name}.{INPUT_ABSMAX}"] * factor
    scales = input_scales_for_model(table, model, "a8w8")
    own = {n: table.input_scale(n, "int8") for n in scales}
    for _, names in SMOOTH_GROUPS:
        for i in range(2):
            members = [f"model.layers.{i}.{n}" for n in names]
            top = max(float(own[m]) for m in members)
            assert all(scales[m].shape == own[m].shape and float(scales[m]) == top for m in members)
    assert float(scales[f"{p}.self_attn.q_proj"]) == float(own[f"{p}.self_attn.k_proj"])
    assert float(scales[f"{p}.mlp.gate_proj"]) == float(own[f"{p}.mlp.up_proj"])
    for n in (f"{p}.self_attn.o_proj", f"{p}.mlp.down_proj"):
        assert torch.equal(scales[n], own[n])
