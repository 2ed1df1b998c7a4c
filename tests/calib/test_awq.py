"""AWQ (`calib.awq`): the objective against the output error written out from the inputs, the
search against a brute-force pass over the candidates, the folds exact in float on every
architecture's layers (grouped-query v → o, a mixture of experts' router and experts included),
and the quantized model's error."""

import pytest
import torch

from quantspec.calib.awq import (AWQ_GRID, ChannelStats, awq_layer, candidate_scales, layer_awq_groups,
                                 output_error, relative_weight_mean, search_scale)
from quantspec.calib.ptq import quantize_model, quantized_linears
from quantspec.calib.runner import LayerRunner
from quantspec.errors import QuantSpecError
from quantspec.model_zoo.checkpoint import load_model
from quantspec.model_zoo.tiny import build_tiny_model
from quantspec.quant.args import QuantArgs
from quantspec.quant.presets import preset

torch.set_num_threads(1)
INT4_G16 = QuantArgs(num_bits=4, symmetric=True, strategy="group", group_size=16)
IDS = torch.tensor([7, 300, 41, 12, 99, 5, 260, 17, 33, 2, 150, 8, 71])


def _fake_int4(w: torch.Tensor, g: int) -> torch.Tensor:
    """Symmetric int4 round-to-nearest per group of g columns, written out: scale = absmax / 7.5."""
    N, K = w.shape
    wg = w.reshape(N, K // g, g)
    scale = wg.abs().amax(-1, keepdim=True) / 7.5
    return (torch.clamp(torch.round(wg / scale), -8, 7) * scale).reshape(N, K)


def _outlier_inputs(T=400, K=64, seed=0) -> torch.Tensor:
    """Inputs [T, K] whose channels 3 and 40 run 30× larger than the rest (AWQ's case)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, K, generator=g)
    x[:, [3, 40]] *= 30
    return x


def _stats(x: torch.Tensor) -> ChannelStats:
    st = ChannelStats(x.shape[1])
    for part in x.split(150):
        st.update(part)
    return st


def test_relative_weight_mean_worked_example():
    w = torch.tensor([[1.0, 2.0], [4.0, 4.0]])
    per_channel = QuantArgs(num_bits=4, strategy="channel")
    torch.testing.assert_close(relative_weight_mean([w], [per_channel]), torch.tensor([0.75, 1.0]), atol=1e-5, rtol=0)


def test_candidates_are_identity_then_duo_scaling():
    x_mean, w_mean = torch.tensor([4.0, 1.0, 0.25]), torch.tensor([1.0, 0.5, 0.5])
    cands = candidate_scales(x_mean, w_mean)
    assert len(cands) == AWQ_GRID + 1 and cands[0][0] is None and torch.equal(cands[0][1], torch.ones(3))
    ratio, s = cands[11]
    raw = x_mean.pow(ratio) / (w_mean.pow(1 - ratio) + 1e-4)
    torch.testing.assert_close(s, raw / (raw.max() * raw.min()).sqrt())
    torch.testing.assert_close(s.max() * s.min(), torch.tensor(1.0))


@pytest.mark.parametrize("duo", [False, "both"])
def test_candidates_without_duo_scaling_are_llm_compressors(duo):
    """duo_scaling false / "both": llm-compressor's grid (`AWQModifier._get_grid_search_params`,
    written out here) of x̄^α alone over [0, 1], and with duo scaling at half the points each."""
    x_mean, w_mean = torch.tensor([4.0, 1.0, 0.25]), torch.tensor([1.0, 0.5, 0.5])
    n = AWQ_GRID if duo is False else AWQ_GRID // 2
    theirs = [(i / (n - 1), d) for i in range(n) for d in ([False] if duo is False else [False, True])]
    want = []
    for ratio, d in theirs:
        raw = (x_mean.pow(ratio) / (w_mean.pow(1 - ratio) + 1e-4) if d else x_mean.pow(ratio)).clamp(min=1e-4)
        want.append(raw / (raw.max() * raw.min()).sqrt())
    got = candidate_scales(x_mean, w_mean, duo=duo)
    assert got[0][0] is None and len(got) == len(want)  # x̄^0 = 1: the identity, first
    for s in want:
        assert any(torch.allclose(s, g) for _, g in got)


def test_output_error_is_the_output_error_of_the_inputs():
    x = _outlier_inputs()
    w = torch.randn(24, 64, generator=torch.Generator().manual_seed(1))
    s = torch.rand(64, generator=torch.Generator().manual_seed(2)) + 0.5
    st = _stats(x)
    want = (x.double() @ w.double().T - (x / s).double() @ _fake_int4(w * s, 16).double().T
            ).pow(2).sum() * 2 / x.shape[0]  # H = 2/n Σ x xᵀ; float64: the outputs are large, their difference small
    got = output_error(w, INT4_G16, s, st.hessian.compute())
    assert got == pytest.approx(float(want), rel=1e-4)
    torch.testing.assert_close(st.mean_abs, x.abs().mean(0))


def test_search_takes_the_best_candidate_and_beats_rounding_on_outlier_channels():
    x = _outlier_inputs()
    g = torch.Generator().manual_seed(3)
    ws = [torch.randn(24, 64, generator=g), torch.randn(8, 64, generator=g)]
    choice = search_scale(ws, [INT4_G16, INT4_G16], _stats(x))

    def brute(s):  # in float64: the outputs are large and their difference small
        return sum(float((x.double() @ w.double().T - (x / s).double() @ _fake_int4(w * s, 16).double().T)
                         .pow(2).sum()) for w in ws) * 2 / x.shape[0]

    x_mean = x.abs().mean(0)
    w_mean = torch.cat([(w.abs().reshape(-1, 4, 16) / (w.abs().reshape(-1, 4, 16).amax(-1, keepdim=True) + 1e-6))
                        .reshape(-1, 64) for w in ws]).mean(0)
    losses = [brute(s) for _, s in candidate_scales(x_mean, w_mean)]
    best = min(range(len(losses)), key=losses.__getitem__)
    assert best > 0 and choice.ratio == (best - 1) / AWQ_GRID
    # (the returned factor's own: the reference's x̄ differs in the last bits, which can flip a rounding)
    assert choice.loss == pytest.approx(brute(choice.s), rel=1e-4)
    assert choice.rtn_loss == pytest.approx(losses[0], rel=1e-4)
    assert choice.loss < 0.6 * choice.rtn_loss  # the outlier channels' weights round finer


def test_tied_factor_is_equal_across_the_query_heads_of_a_kv_head():
    x = _outlier_inputs(K=64)
    w = torch.randn(16, 64, generator=torch.Generator().manual_seed(4))
    tie = (torch.arange(4)[:, None] // 2 * 16 + torch.arange(16)).reshape(-1)  # 4 heads of 16, 2 KV heads
    s = search_scale([w], [INT4_G16], _stats(x), tie).s
    assert s is not None and torch.equal(s.view(2, 2, 16)[:, 0], s.view(2, 2, 16)[:, 1])


def _fold_in_float(model, ids):
    """Run AWQ's search and folds layer by layer on `model` (nothing rounded) → the losses."""
    linears = quantized_linears(model, preset("weight_only_int4", group_size=16))
    args = {n: QuantArgs(num_bits=4, strategy="group", group_size=16) for n in linears}
    losses = {}
    for step in LayerRunner(model, ids, keep_layers=True):
        losses.update(awq_layer(step, linears, args))
        step.propagate()
    return losses


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "phi3", "qwen2_moe", "olmo2", "gemma3", "granite"])
def test_folds_leave_the_float_model_as_it_was(arch, tmp_path, logits_of):
    """The chosen factors folded (norms, v_proj / up_proj rows and biases, the readers' columns)
    give the float model's logits; a wrong fold (e.g. o_proj's factor not tied per KV head) would not."""
    d = build_tiny_model(tmp_path / arch, arch)
    ref, _ = load_model(d)
    model, _ = load_model(d)
    want = logits_of(ref, IDS)
    ids = torch.randint(3, 500, (4, 24), generator=torch.Generator().manual_seed(0))
    losses = _fold_in_float(model, ids)
    layer = model.model.layers[0]
    groups = {g.readers[0] for g in layer_awq_groups(layer)}
    assert "self_attn.o_proj" in groups and ("mlp.down_proj" in groups) == (arch != "qwen2_moe")
    assert len(losses) == 2 * len(groups)
    changed = [n for n, p in model.state_dict().items() if not torch.equal(p, ref.state_dict()[n])]
    assert any(".self_attn.o_proj." in n for n in changed) and any(".self_attn.v_proj." in n for n in changed)
    torch.testing.assert_close(logits_of(model, IDS), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe", "mixtral"])
def test_moe_folds_scale_router_and_experts_and_leave_the_float_model(arch, tmp_path, logits_of):
    """A sparse layer's post-attention norm group takes the router (and Qwen2-MoE's shared-expert
    gate), every expert's gate / up and the shared expert's; each expert's up → down is a group.
    Folded, the float model's logits stay (the routing too: a router left unscaled would route
    the scaled inputs elsewhere)."""
    d = _outlier_model(tmp_path, arch)
    ref, _ = load_model(d)
    model, _ = load_model(d)
    want = logits_of(ref, IDS)
    layer = model.model.layers[0]
    moe = "block_sparse_moe" if arch == "mixtral" else "mlp"
    up, down = ("w3", "w2") if arch == "mixtral" else ("up_proj", "down_proj")
    mlps = [f"{moe}.experts.{e}" for e in range(4)] + ([f"{moe}.shared_expert"] if arch == "qwen2_moe" else [])
    groups = [g.readers for g in layer_awq_groups(layer)]
    norm_group = next(g for g in groups if g[0] == f"{moe}.gate")
    assert len(norm_group) == 2 * len(mlps) + 1 + (arch == "qwen2_moe")
    assert {(f"{m}.{'down_proj' if 'shared' in m else down}",) for m in mlps} <= set(groups)
    ids = torch.randint(3, 500, (4, 24), generator=torch.Generator().manual_seed(0))
    losses = _fold_in_float(model, ids)
    assert any(k.endswith("more") for k in losses)  # the experts' gate / up: one objective
    changed = {n for n, p in model.state_dict().items() if not torch.equal(p, ref.state_dict()[n])}
    floats = [f"{moe}.gate"] + ([f"{moe}.shared_expert_gate"] if arch == "qwen2_moe" else [])
    for rel in floats + [f"{m}.{p}" for m in mlps for p in ((up, down) if "shared" not in m else ("up_proj",))]:
        assert f"model.layers.0.{rel}.weight" in changed, rel
    torch.testing.assert_close(logits_of(model, IDS), want, rtol=1e-4, atol=1e-4)


def _outlier_model(tmp_path, arch="llama"):
    """A tiny model (Llama's by default) with a few channels of each norm 25× larger: outlier
    input channels."""
    from safetensors.torch import load_file, save_file

    d = build_tiny_model(tmp_path / arch, arch)
    tensors = load_file(d / "model.safetensors")
    for name, t in tensors.items():
        if name.endswith("layernorm.weight"):
            t[[5, 17, 50]] *= 25
    save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
    return d


def _outlier_errors(tmp_path, config, methods, arch="llama"):
    """({method: mean squared error of the quantized outlier model's hidden states}, the last
    method's quantize summary)."""
    from quantspec.model_zoo.llama import DenseCausalAttention

    d = _outlier_model(tmp_path, arch)
    ids = torch.randint(3, 500, (6, 48), generator=torch.Generator().manual_seed(1))
    n, S = ids.shape

    def hidden(m):
        with torch.no_grad():
            return m(ids.reshape(-1), torch.arange(S).repeat(n), DenseCausalAttention(n, S))

    ref, _ = load_model(d)
    target = hidden(ref)
    errs = {}
    for method in methods:
        m, _ = load_model(d)
        res = quantize_model(m, config, method, ids if method != "rtn" else None)
        errs[method] = (hidden(m) - target).pow(2).mean().item()
    return errs, res.summary


def expert_errors(tmp_path, methods):
    """`_outlier_errors` of a tiny Qwen3 mixture of experts with only its experts quantized (int4 g32)."""
    from quantspec.model_zoo.moe import router_ignore

    d = build_tiny_model(tmp_path / "cfg", "qwen3_moe")
    config = preset("weight_only_int4", group_size=32, weight_observer="minmax",
                    ignore=("lm_head", r"re:.*self_attn\..*", *router_ignore(load_model(d)[0].args)))
    return _outlier_errors(tmp_path, config, methods, arch="qwen3_moe")


def test_awq_beats_rounding_without_it_on_outlier_channels(tmp_path):
    errs, summary = _outlier_errors(tmp_path, preset("weight_only_int4", group_size=32, weight_observer="minmax"),
                                    ("rtn", "awq", "gptq", "awq+gptq"))
    assert summary["awq_loss_total"] > 0 and summary["gptq_loss_total"] > 0
    assert summary["calibration_tokens"] == 6 * 48
    assert errs["awq"] < 0.85 * errs["rtn"], errs  # 0.74× here
    assert errs["awq+gptq"] < errs["gptq"], errs  # 0.79× here


def test_awq_beats_rounding_without_it_on_experts(tmp_path):
    """Only the experts quantized (attention and routers float): their groups' factors give less
    output error than rounding alone on outlier channels (with no expert group, AWQ would be
    rounding alone here), and GPTQ after them less again."""
    errs, summary = expert_errors(tmp_path, ("rtn", "awq", "gptq", "awq+gptq"))
    assert summary["awq_loss_total"] > 0
    assert errs["awq"] < 0.85 * errs["rtn"], errs  # 0.59× here
    assert errs["awq+gptq"] < 0.5 * errs["awq"], errs  # 0.32× here


def test_bad_requests(tiny_llama_dir):
    model, _ = load_model(tiny_llama_dir)
    ids = torch.randint(3, 500, (2, 16))
    with pytest.raises(QuantSpecError, match="--dataset"):
        quantize_model(model, preset("weight_only_int4"), "awq")
    with pytest.raises(QuantSpecError, match="static or microscaled input scales"):
        quantize_model(model, preset("a8w8"), "awq", ids, input_scales={n: 0.05 for n in quantized_linears(
            model, preset("a8w8"))})
    with pytest.raises(QuantSpecError, match="integer or FP4 weights"):
        quantize_model(model, preset("a8w8_fp8", activations="dynamic"), "awq", ids)
    with pytest.raises(QuantSpecError, match="static or microscaled input scales"):
        quantize_model(model, preset("mxfp4"), "awq", ids)


@pytest.mark.parametrize("quant_type", ["weight_only_nvfp4", "weight_only_mxfp4", "a8w4_mxfp4"])
def test_awq_on_fp4_weights(tmp_path, quant_type):
    """AWQ with FP4 weights (NVFP4: one global scale per fused unit in the search as in the
    artifact; MXFP4: power-of-two group scales, also beside FP8 inputs whose group scales are
    computed at run time, after the fold): less output error than rounding alone on outlier
    channels."""
    errs, summary = _outlier_errors(tmp_path, preset(quant_type), ("rtn", "awq"))
    assert summary["awq_loss_total"] > 0
    assert errs["awq"] < (0.6 if "nv" in quant_type else 0.9) * errs["rtn"], errs  # 0.45× / 0.87× here


@pytest.mark.parametrize("method", ["awq", "awq+gptq"])
def test_artifact_runs_in_transformers_as_in_quantspec(method, tiny_qwen2_dir, tmp_path,
                                                       artifact_runs_as_in_transformers):
    """The folded norms, v_proj rows and biases travel in the artifact: transformers, through
    compressed-tensors, computes quantspec's logits from it (Qwen2: q/k/v biases)."""
    data = tmp_path / "calib.txt"
    data.write_text("The quick brown fox jumps over the lazy dog. " * 60)
    artifact_runs_as_in_transformers(tiny_qwen2_dir, "weight_only_int4", tmp_path / "art", IDS, method=method,
                                     group_size=32, dataset=str(data), num_samples=4, seq_len=32)


def test_hessians_handed_to_gptq_are_those_of_the_folded_layer(tiny_llama_dir):
    """awq+gptq skips a forward: H / (s sᵀ) of AWQ's statistics equals the Hessian GPTQ's hooks
    accumulate from the folded layer's inputs."""
    from quantspec.quant.gptq import HessianAccumulator

    model, _ = load_model(tiny_llama_dir)
    linears = quantized_linears(model, preset("weight_only_int4", group_size=16))
    args = {n: QuantArgs(num_bits=4, strategy="group", group_size=16) for n in linears}
    ids = torch.randint(3, 500, (4, 24), generator=torch.Generator().manual_seed(0))
    step = next(iter(LayerRunner(model, ids, keep_layers=True)))
    handed: dict = {}
    awq_layer(step, linears, args, handed)
    heads = [f"model.layers.0.{n}" for n in ("self_attn.q_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.down_proj")]
    assert sorted(handed) == sorted(heads)
    accs = {n: HessianAccumulator(linears[n].in_features) for n in heads}
    hooks = [linears[n].register_forward_pre_hook(lambda _m, a, n=n: accs[n].update(a[0])) for n in heads]
    step.forward()
    for h in hooks:
        h.remove()
    for n in heads:
        torch.testing.assert_close(handed[n], accs[n].compute(), rtol=1e-4, atol=1e-5 * accs[n].H.abs().max().item())


def test_duo_scaling_reaches_the_search_and_the_provenance(tiny_llama_dir, tmp_path, monkeypatch):
    """`quantize --method awq --awq-duo-scaling both`: every group's search takes those candidates."""
    import json

    import quantspec.calib.awq as awq
    from quantspec import api
    from quantspec.model_zoo.tiny import TINY_CORPUS

    seen, real = [], awq.candidate_scales
    monkeypatch.setattr(awq, "candidate_scales", lambda *a, **k: seen.append(a[3]) or real(*a, **k))
    data = tmp_path / "calib.txt"
    data.write_text(TINY_CORPUS)
    out = api.quantize(str(tiny_llama_dir), "weight_only_int4", tmp_path / "q", method="awq", group_size=32,
                       awq_duo_scaling="both", dataset=str(data), num_samples=2, seq_len=16)
    assert seen and set(seen) == {"both"}
    assert json.loads((out / "quantspec.json").read_text())["provenance"]["args"]["awq_duo_scaling"] == "both"
