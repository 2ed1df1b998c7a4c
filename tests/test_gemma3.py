"""Gemma 3 (`Gemma3ForCausalLM`) against transformers' own classes, past what `test_model_variants`
covers for every variant: its config as Google's checkpoints and transformers 5 write it; each of
its parts counting (the window layers' own rotary base and sliding window, 1 + weight norms, the
score scale, embeddings × √hidden rounded in bf16); every attention path of the engine with some
layers sliding and some not equal to plain decoding, in fp32 and bf16; perplexity and the
calibration runner past the window; SmoothQuant folding into Gemma's norms."""

import dataclasses
import json

import pytest
import torch

from quantspec.errors import QuantSpecError
from quantspec.model_zoo.checkpoint import build_model, load_model
from quantspec.model_zoo.llama import DenseCausalAttention, ModelArgs
from quantspec.model_zoo.tiny import GEMMA3_LAYOUT, GEMMA3_LOCAL_THETA, build_tiny_model
from window_paths import assert_every_path_is_plain_decoding, decode as _run, random_prompts as _ids

torch.set_num_threads(1)
WINDOW = GEMMA3_LAYOUT["sliding_window"]
# Gemma-3-1B's config.json as Google publishes it (transformers 4.50's keys), shrunk
HUB_CONFIG = {"architectures": ["Gemma3ForCausalLM"], "attn_logit_softcapping": None, "bos_token_id": 2,
              "eos_token_id": [1, 106], "final_logit_softcapping": None, "head_dim": 16,
              "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 64, "intermediate_size": 96,
              "max_position_embeddings": 32768, "model_type": "gemma3_text", "num_attention_heads": 4,
              "num_hidden_layers": 8, "num_key_value_heads": 1, "query_pre_attn_scalar": 16, "rms_norm_eps": 1e-06,
              "rope_local_base_freq": 10000, "rope_scaling": None, "rope_theta": 1000000, "sliding_window": 512,
              "sliding_window_pattern": 6, "vocab_size": 512}


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("gemma3") / "m", "gemma3",
                            rope_scaling={"rope_type": "linear", "factor": 2.0})


@pytest.fixture(scope="module")
def hf(gemma_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(gemma_dir, dtype=torch.float32).eval()


def _logits(model, ids, attn=None):
    n = ids.numel()
    with torch.no_grad():
        return model.compute_logits(model(ids, torch.arange(n), attn or DenseCausalAttention.of(model.args, 1, n)))


def test_hub_config_and_transformers_5_config_read_alike():
    a = ModelArgs.from_hf_config(HUB_CONFIG)
    assert a.window_layers == (0, 1, 2, 3, 4, 6, 7) and a.attention_window == 512  # every sixth layer is full
    assert (a.rope_theta, a.local_rope_theta, a.rope_scaling) == (1e6, 1e4, None)
    assert a.tie_word_embeddings and a.post_norms and a.pre_norms and a.norm_unit_offset and a.qk_norm
    assert (a.hidden_act, a.attention_multiplier, a.embedding_multiplier) == ("gelu_pytorch_tanh", 0.0, 8.0)
    assert a.context_limit() is None  # the window layers slide: no bound at the window
    from transformers import Gemma3TextConfig

    scaled = {**HUB_CONFIG, "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "query_pre_attn_scalar": 64}
    ours = ModelArgs.from_hf_config(scaled)
    assert ours.rope_scaling["factor"] == 8.0 and ours.attention_multiplier == 64 ** -0.5
    theirs = ModelArgs.from_hf_config(Gemma3TextConfig(**scaled).to_dict() | {"architectures": ["Gemma3ForCausalLM"]})
    for f in ("window_layers", "sliding_window", "rope_theta", "local_rope_theta", "attention_multiplier"):
        assert getattr(theirs, f) == getattr(ours, f), f
    assert theirs.rope_scaling["factor"] == 8.0


@pytest.mark.parametrize("change, message", [
    ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping=50.0: quantspec runs Gemma 3's causal attention"),
    ({"final_logit_softcapping": 30.0}, "final_logit_softcapping=30.0"),
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention=True"),
    ({"layer_types": ["sliding_attention"] * 3}, "must name sliding_attention or full_attention for each of the 8"),
    ({"hidden_activation": "relu"}, "hidden_act 'relu' is not supported"),
])
def test_what_quantspec_does_not_run_is_one_line(change, message):
    with pytest.raises(QuantSpecError, match=message):
        ModelArgs.from_hf_config({**HUB_CONFIG, **change})


def test_every_part_counts(gemma_dir, hf, logits_of):
    """Each of Gemma's parts, left out or swapped, moves the logits away from transformers'."""
    model = load_model(gemma_dir)[0]
    ids = torch.tensor(_ids([20], seed=1)[0])
    with torch.no_grad():
        want = hf(ids[None]).logits[0]
    torch.testing.assert_close(_logits(model, ids), want, atol=1e-4, rtol=0)
    a = model.args
    assert a.window_layers == (0,) and a.local_rope_theta == GEMMA3_LOCAL_THETA and a.attention_multiplier
    assert (_logits(model, ids, DenseCausalAttention(1, 20)) - want).abs().max() > 1e-2  # no window
    assert (_logits(model, ids, DenseCausalAttention(1, 20, window=WINDOW)) - want).abs().max() > 1e-2  # every layer
    for change in ({"local_rope_theta": 0.0}, {"attention_multiplier": 0.0}, {"norm_unit_offset": False}):
        net = build_model(dataclasses.replace(a, **change), device="cpu")
        net.load_state_dict(model.state_dict())
        net.setup_rope(64)
        assert (_logits(net, ids) - want).abs().max() > 1e-2, change


def test_bf16_logits_follow_transformers(gemma_dir):
    """In bf16 the embedding scale is rounded as transformers rounds it (√64 = 8 is exact, so a
    hidden size whose root is not: 48 → 6.93 → 6.9375)."""
    from transformers import AutoModelForCausalLM

    d = build_tiny_model(gemma_dir.parent / "bf16", "gemma3", hidden=48, heads=4, kv_heads=2)
    hf16 = AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16).eval()
    model = load_model(d, dtype=torch.bfloat16)[0]
    assert float(torch.tensor(model.args.embedding_multiplier, dtype=torch.bfloat16)) == 6.9375
    ids = torch.tensor(_ids([16], seed=2)[0])
    with torch.no_grad():
        want = hf16(ids[None]).logits[0].float()
    diff = (_logits(model, ids) - want).abs().max().item()
    assert diff < 0.1, diff


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_attention_path_equals_plain_decoding(gemma_dir, dtype):
    """Layer 0 slides a window of 6, layer 1 attends to everything (`window_paths`)."""
    assert_every_path_is_plain_decoding(load_model(gemma_dir, dtype=dtype)[0], dtype)


def test_greedy_past_the_window_equals_transformers_generate(gemma_dir, hf):
    model = load_model(gemma_dir)[0]
    prompts = _ids([5, 30], seed=4)
    for p, got in zip(prompts, _run(model, prompts, new=30)):
        with torch.no_grad():
            out = hf.generate(torch.tensor([p]), max_new_tokens=30, do_sample=False, pad_token_id=0)
        assert got == out[0, len(p):].tolist()


def test_perplexity_and_calibration_runner_past_the_window(gemma_dir, hf):
    """`eval`'s paged path and the calibration runner's layer-by-layer forward (what calibrate,
    GPTQ and SmoothQuant see) run the window layers as transformers does."""
    from quantspec.calib.runner import run_layers
    from quantspec.infer.evaluate import perplexity

    model = load_model(gemma_dir)[0]
    ids = torch.tensor(_ids([48], seed=5)[0]).view(2, 24)
    res = perplexity(model, ids.reshape(-1), seq_len=24, batch_size=2)
    with torch.no_grad():
        out = hf(ids, output_hidden_states=True)
        ours = model.model.norm(run_layers(model, ids, batch_size=2))
    logp = torch.log_softmax(out.logits[:, :-1].float(), dim=-1)
    assert res.nll == pytest.approx(-logp.gather(2, ids[:, 1:, None]).mean().item(), abs=1e-5)
    torch.testing.assert_close(ours, out.hidden_states[-1], atol=1e-4, rtol=0)


def test_smoothquant_folds_into_gemma_norms(gemma_dir, calibration_table):
    """q/k/v are smoothed through input_layernorm and gate/up through pre_feedforward_layernorm
    (post_attention_layernorm normalizes the attention's output): each folded factor leaves the
    function as it was, and each norm's scale 1 + weight is divided by s."""
    from quantspec.calib.smooth import smooth_model
    from quantspec.calib.tables import read_table

    model = load_model(gemma_dir)[0]
    ids = torch.tensor(_ids([20], seed=6)[0])
    before = _logits(model, ids)
    layer = model.model.layers[0]
    norms = {n: getattr(layer, n).weight.clone() for n in ("input_layernorm", "pre_feedforward_layernorm",
                                                           "post_attention_layernorm")}
    factors = smooth_model(model, read_table(calibration_table(gemma_dir)), alpha=0.5)
    torch.testing.assert_close(_logits(model, ids), before, atol=1e-4, rtol=1e-4)
    for norm, linear in (("input_layernorm", "self_attn.q_proj"), ("pre_feedforward_layernorm", "mlp.gate_proj")):
        s = factors[f"model.layers.0.{linear}"]
        torch.testing.assert_close(getattr(layer, norm).weight + 1, (norms[norm] + 1) / s)
    assert torch.equal(layer.post_attention_layernorm.weight, norms["post_attention_layernorm"])


def test_config_written_by_quantize_reads_back(gemma_dir, tmp_path):
    from quantspec import api

    art = api.quantize(str(gemma_dir), "weight_only_int8", tmp_path / "w8")
    cfg = json.loads((art / "config.json").read_text())
    assert ModelArgs.from_hf_config(cfg) == ModelArgs.from_hf_config(json.loads((gemma_dir / "config.json").read_text()))
