"""The fallback's error budget: held-back perplexity of the emulated static-quantized model, and
the search for the fewest fused units within the budget, against independent references."""

import copy
import math

import pytest
import torch
import torch.nn.functional as F

from quantspec.calib.budget import _NLL_BATCH, _mean_nll, fallback_under_budget, heldback_nll
from quantspec.calib.calibrate import calibrate_model
from quantspec.calib.sensitivity import linear_sensitivity
from quantspec.calib.static_plan import rank_units
from quantspec.calib.smooth import input_scales_for_model, smooth_model, smoothing_factors
from quantspec.calib.tables import ScaleTable
from quantspec.model_zoo.checkpoint import load_model
from quantspec.model_zoo.llama import DenseCausalAttention
from quantspec.quant.args import QuantArgs

torch.set_num_threads(1)
N, S = 4, 32
W_ARGS = QuantArgs(num_bits=8, type="int", symmetric=True, strategy="channel")
HEADS = ("self_attn.q_proj", "mlp.gate_proj", "mlp.down_proj")  # first Linear of each smoothing group


def ids_for(seed):
    return torch.randint(3, 500, (N, S), generator=torch.Generator().manual_seed(seed))


def ref_fq_tensor(x, scale):
    return torch.clamp(torch.round(x / scale), -128, 127) * scale


def ref_fq_channel(w):
    s = w.abs().amax(dim=1, keepdim=True) / 127.5
    return torch.clamp(torch.round(w / s), -128, 127) * s


def ref_nll(model, ids):
    """Mean next-token NLL, written out: log-softmax of the logits, gathered at the next token."""
    B, T = ids.shape
    with torch.no_grad():
        logits = model.compute_logits(model(ids.reshape(-1), torch.arange(T).repeat(B),
                                            DenseCausalAttention(B, T))).view(B, T, -1)
    logp = logits[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:, None])
    return float(-logp.mean())


def artifact_nll(model, table, alpha, fallback, ids):
    """The quantized model built the way the artifact is: smooth every group but the fallback
    units', round every Linear's weight per channel, feed the static ones fq(x) (hand-written)."""
    ref = copy.deepcopy(model)
    heads = {f"model.layers.{i}.{h}": alpha for i in range(len(ref.model.layers)) for h in HEADS}
    factors = smooth_model(ref, table, {h: a for h, a in heads.items() if h not in fallback})
    scales = input_scales_for_model(table, ref, "a8w8", smooth=factors)
    hooks = []
    with torch.no_grad():
        for name, m in ref.named_modules():
            if name in scales:
                m.weight.copy_(ref_fq_channel(m.weight))
                if name not in fallback:
                    hooks.append(m.register_forward_pre_hook(
                        lambda _m, a, _s=scales[name]: (ref_fq_tensor(a[0], _s),)))
    try:
        return ref_nll(ref, ids)
    finally:
        for h in hooks:
            h.remove()


@pytest.fixture(scope="module")
def setup(tiny_llama_dir):
    model, _ = load_model(tiny_llama_dir)
    with torch.no_grad():  # outliers on the MLP path, as in test_sensitivity
        for layer in model.model.layers:
            layer.post_attention_layernorm.weight[[1, 30]] *= 20.0
            layer.mlp.up_proj.weight[[5, 77]] *= 30.0
    table = ScaleTable(calibrate_model(model, ids_for(0)))
    alpha = {f"model.layers.{i}.{h}": 0.5 for i in range(2) for h in HEADS}
    factors = smoothing_factors(model, table, alpha)
    scales = input_scales_for_model(table, model, "a8w8", smooth=factors)
    return model, table, factors, scales


def test_float_nll_is_transformers_cross_entropy(tiny_llama_dir, hf_tiny_llama):
    model, _ = load_model(tiny_llama_dir)
    ids = ids_for(1)
    hf = hf_tiny_llama
    with torch.no_grad():
        logits = hf(ids).logits  # [N, S, V]
    want = float(F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1)))
    assert heldback_nll(model, ids) == pytest.approx(want, rel=1e-5)


def test_nll_is_cross_entropys_sum_bit_for_bit(tiny_llama_dir):
    """The head's NLL, one window's log-softmax at a time, is exactly `F.cross_entropy(sum)` over
    each batch's [B·(S−1), V] rows (no copy of them held), for odd batches too."""
    model, _ = load_model(tiny_llama_dir)
    for n in (_NLL_BATCH + 1, 1):
        ids = ids_for(4)[:n]
        hidden = torch.randn(n, S, model.args.hidden_size, generator=torch.Generator().manual_seed(n))
        total = 0.0
        with torch.no_grad():
            for b0 in range(0, n, _NLL_BATCH):
                x = ids[b0:b0 + _NLL_BATCH]
                B = x.shape[0]
                logits = model.compute_logits(hidden[b0:b0 + B].reshape(B * S, -1)).view(B, S, -1)
                total += float(F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1),
                                               reduction="sum"))
        assert _mean_nll(model, hidden, ids, None, "cpu") == total / (n * (S - 1))


@pytest.mark.parametrize("fallback", [(), ("model.layers.0.mlp.down_proj",),
                                      ("model.layers.1.self_attn.q_proj", "model.layers.1.self_attn.k_proj",
                                       "model.layers.1.self_attn.v_proj", "model.layers.0.self_attn.o_proj")])
def test_emulation_is_the_smoothed_quantized_model(setup, fallback):
    """The emulation on the float model equals the model smoothed (fallback units not) and
    quantized the artifact's way, and leaves the model as it was."""
    model, table, factors, scales = setup
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ids = ids_for(2)
    got = heldback_nll(model, ids, input_scales=scales, factors=factors, fallback=fallback, kind="int8",
                       weight_args=W_ARGS)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    want = artifact_nll(model, table, 0.5, set(fallback), ids)
    assert got == pytest.approx(want, rel=1e-5)
    assert got != pytest.approx(ref_nll(model, ids), rel=1e-4)  # the quantization is there


def test_search_returns_a_measured_boundary_of_the_budget(setup):
    """The units chosen meet the budget over the weight-only model and one fewer misses it, both
    by the independent artifact-way perplexity; every measurement recorded is that perplexity."""
    model, table, factors, scales = setup
    ranked = [u for u, _ in rank_units(linear_sensitivity(model, ids_for(0), scales, "int8", smooth=factors))]
    m, held = len(ranked), ids_for(3)
    nll = {k: artifact_nll(model, table, 0.5, {n for u in ranked[:k] for n in u}, held) for k in range(m + 1)}
    delta = {k: 100 * (math.exp(nll[k] - nll[m]) - 1) for k in nll}  # over the weight-only model
    assert delta[0] > 0
    budget = delta[0] / 2
    search = fallback_under_budget(model, ranked, scales, factors, held, budget, "int8", W_ARGS)
    k = search.chosen_units
    assert 0 < k <= m and delta[k] <= budget < delta[k - 1]
    assert search.float_perplexity == pytest.approx(math.exp(ref_nll(model, held)), rel=1e-5)
    assert search.weight_only_perplexity == pytest.approx(math.exp(nll[m]), rel=1e-5)
    for units, linears, ppl in search.measured:
        assert linears == sum(len(u) for u in ranked[:units])
        assert search.delta_pct(ppl) == pytest.approx(delta[units], abs=1e-3)
    summ = search.summary()
    assert summ["chosen_units"] == k and summ["units"] == m and summ["windows"] == N and summ["tokens"] == N * S
    assert summ["delta_pct"] == pytest.approx(delta[k], abs=1e-3)
    assert summ["over_float_pct"] == pytest.approx(100 * (math.exp(nll[k] - ref_nll(model, held)) - 1), abs=1e-3)

    loose = fallback_under_budget(model, ranked, scales, factors, held, delta[0] + 1.0, "int8", W_ARGS)
    assert loose.chosen_units == 0 and [x[0] for x in loose.measured] == [m, 0]
    # a budget below what the static activations of a unit add leaves none: it falls back
    unit = ranked[0]
    added = 100 * (math.exp(nll[0] - artifact_nll(model, table, 0.5, set(unit), held)) - 1)
    assert added > 0
    none_fit = fallback_under_budget(model, [unit], scales, factors, held, added / 2, "int8", W_ARGS)
    assert none_fit.chosen_units == 1 and [x[0] for x in none_fit.measured] == [1, 0]
