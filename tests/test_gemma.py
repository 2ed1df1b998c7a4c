"""Gemma 2 (`Gemma2ForCausalLM`) and Gemma 3 (`Gemma3ForCausalLM`) against transformers' own classes,
past what `test_model_variants` covers for every variant: their configs as Google's checkpoints (and
transformers 5) write them; each of their parts counting (Gemma 3: the window layers' own rotary
base and sliding window, 1 + weight norms, the score scale, embeddings × √hidden rounded in bf16;
Gemma 2: the soft caps of scores and logits); every attention path of the engine with some layers
sliding and some not equal to plain decoding, in fp32 and bf16 (Gemma 2's capped scores also in the
batched path's one gathered call); generation, perplexity and the calibration runner past the
window; SmoothQuant folding into Gemma's norms; Gemma 3's multimodal checkpoints read, run and
quantized as the text decoder they hold."""

import dataclasses
import json

import pytest
import torch

from quantspec.errors import QuantSpecError
from quantspec.model_zoo.checkpoint import build_model, load_model
from quantspec.model_zoo.llama import DenseCausalAttention, ModelArgs
from quantspec.model_zoo.tiny import GEMMA2_SOFTCAPS, GEMMA3_LOCAL_THETA, GEMMA_LAYOUT, build_tiny_model
from window_paths import assert_every_path_is_plain_decoding, decode, random_prompts

torch.set_num_threads(1)
WINDOW = GEMMA_LAYOUT["sliding_window"]
# Gemma-3-1B's config.json as Google publishes it (transformers 4.50's keys), shrunk
GEMMA3_HUB_CONFIG = {
    "architectures": ["Gemma3ForCausalLM"], "attn_logit_softcapping": None, "bos_token_id": 2,
    "eos_token_id": [1, 106], "final_logit_softcapping": None, "head_dim": 16,
    "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 64, "intermediate_size": 96,
    "max_position_embeddings": 32768, "model_type": "gemma3_text", "num_attention_heads": 4,
    "num_hidden_layers": 8, "num_key_value_heads": 1, "query_pre_attn_scalar": 16, "rms_norm_eps": 1e-06,
    "rope_local_base_freq": 10000, "rope_scaling": None, "rope_theta": 1000000, "sliding_window": 512,
    "sliding_window_pattern": 6, "vocab_size": 512
}

# gemma-2-2b's config.json as Google publishes it, shrunk
GEMMA2_HUB_CONFIG = {
    "architectures": ["Gemma2ForCausalLM"], "attn_logit_softcapping": 50.0, "bos_token_id": 2,
    "cache_implementation": "hybrid", "eos_token_id": [1, 107], "final_logit_softcapping": 30.0,
    "head_dim": 16, "hidden_act": "gelu_pytorch_tanh", "hidden_activation": "gelu_pytorch_tanh",
    "hidden_size": 64, "intermediate_size": 96, "max_position_embeddings": 8192, "model_type": "gemma2",
    "num_attention_heads": 8, "num_hidden_layers": 4, "num_key_value_heads": 4, "pad_token_id": 0,
    "query_pre_attn_scalar": 16, "rms_norm_eps": 1e-06, "rope_theta": 10000.0, "sliding_window": 4096,
    "vocab_size": 512
}


def _built(tmp_path_factory, arch: str, **kw):
    """(a tiny checkpoint of `arch`, transformers' model of it)."""
    from transformers import AutoModelForCausalLM

    d = build_tiny_model(tmp_path_factory.mktemp(arch) / "m", arch, **kw)
    return d, AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    return _built(tmp_path_factory, "gemma3", rope_scaling={"rope_type": "linear", "factor": 2.0})


@pytest.fixture(scope="module")
def gemma2(tmp_path_factory):
    return _built(tmp_path_factory, "gemma2")


@pytest.fixture(params=["gemma2", "gemma3"])
def gemma(request):
    return request.getfixturevalue(request.param)


def _logits(model, ids, attn=None):
    n = ids.numel()
    with torch.no_grad():
        return model.compute_logits(model(ids, torch.arange(n), attn or DenseCausalAttention.of(model.args, 1, n)))


def _with_parts(model, **change):
    """`model`'s weights in a model whose args differ by `change`."""
    net = build_model(dataclasses.replace(model.args, **change), device="cpu")
    net.load_state_dict(model.state_dict())
    net.setup_rope(64)
    return net


# ---- both ------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_attention_path_equals_plain_decoding(gemma, dtype):
    """Layer 0 slides a window of 6, layer 1 attends to everything (`window_paths`)."""
    assert_every_path_is_plain_decoding(load_model(gemma[0], dtype=dtype)[0], dtype)


def test_greedy_past_the_window_equals_transformers_generate(gemma):
    d, hf = gemma
    model = load_model(d)[0]
    prompts = random_prompts([5, 30], seed=4)
    for p, got in zip(prompts, decode(model, prompts, new=30)):
        with torch.no_grad():
            out = hf.generate(torch.tensor([p]), max_new_tokens=30, do_sample=False, pad_token_id=0)
        assert got == out[0, len(p):].tolist()


def test_perplexity_and_calibration_runner_past_the_window(gemma):
    """`eval`'s paged path and the calibration runner's layer-by-layer forward (what calibrate,
    GPTQ and SmoothQuant see) run the window layers as transformers does."""
    from quantspec.calib.runner import run_layers
    from quantspec.infer.evaluate import perplexity

    d, hf = gemma
    model = load_model(d)[0]
    ids = torch.tensor(random_prompts([48], seed=5)[0]).view(2, 24)
    res = perplexity(model, ids.reshape(-1), seq_len=24, batch_size=2)
    with torch.no_grad():
        out = hf(ids, output_hidden_states=True)
        ours = model.model.norm(run_layers(model, ids, batch_size=2))
    logp = torch.log_softmax(out.logits[:, :-1].float(), dim=-1)
    assert res.nll == pytest.approx(-logp.gather(2, ids[:, 1:, None]).mean().item(), abs=1e-5)
    torch.testing.assert_close(ours, out.hidden_states[-1], atol=1e-4, rtol=0)


def test_config_written_by_quantize_reads_back(gemma, tmp_path):
    from quantspec import api

    art = api.quantize(str(gemma[0]), "weight_only_int8", tmp_path / "w8")
    cfg = json.loads((art / "config.json").read_text())
    assert ModelArgs.from_hf_config(cfg) == ModelArgs.from_hf_config(json.loads((gemma[0] / "config.json").read_text()))


# ---- Gemma 3 ---------------------------------------------------------------------------------


def test_gemma3_hub_config_and_transformers_5_config_read_alike():
    a = ModelArgs.from_hf_config(GEMMA3_HUB_CONFIG)
    assert a.window_layers == (0, 1, 2, 3, 4, 6, 7) and a.attention_window == 512  # every sixth layer is full
    assert (a.rope_theta, a.local_rope_theta, a.rope_scaling) == (1e6, 1e4, None)
    assert a.tie_word_embeddings and a.post_norms and a.pre_norms and a.norm_unit_offset and a.qk_norm
    assert (a.hidden_act, a.attention_multiplier, a.embedding_multiplier) == ("gelu_pytorch_tanh", 0.0, 8.0)
    assert a.context_limit() is None  # the window layers slide: no bound at the window
    from transformers import Gemma3TextConfig

    scaled = {**GEMMA3_HUB_CONFIG, "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "query_pre_attn_scalar": 64}
    ours = ModelArgs.from_hf_config(scaled)
    assert ours.rope_scaling["factor"] == 8.0 and ours.attention_multiplier == 64 ** -0.5
    theirs = ModelArgs.from_hf_config(Gemma3TextConfig(**scaled).to_dict() | {"architectures": ["Gemma3ForCausalLM"]})
    for f in ("window_layers", "sliding_window", "rope_theta", "local_rope_theta", "attention_multiplier"):
        assert getattr(theirs, f) == getattr(ours, f), f
    assert theirs.rope_scaling["factor"] == 8.0


@pytest.mark.parametrize("change, message", [
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention=true: an embedding model"),
    ({"layer_types": ["sliding_attention"] * 3}, "must name sliding_attention or full_attention for each of the 8"),
    ({"hidden_activation": "relu"}, "hidden_act 'relu' is not supported"),
])
def test_gemma3_configs_quantspec_does_not_run_are_one_line(change, message):
    with pytest.raises(QuantSpecError, match=message):
        ModelArgs.from_hf_config({**GEMMA3_HUB_CONFIG, **change})


def test_gemma3_every_part_counts(gemma3):
    """Each of Gemma's parts, left out or swapped, moves the logits away from transformers'."""
    gemma_dir, hf = gemma3
    model = load_model(gemma_dir)[0]
    ids = torch.tensor(random_prompts([20], seed=1)[0])
    with torch.no_grad():
        want = hf(ids[None]).logits[0]
    torch.testing.assert_close(_logits(model, ids), want, atol=1e-4, rtol=0)
    a = model.args
    assert a.window_layers == (0,) and a.local_rope_theta == GEMMA3_LOCAL_THETA and a.attention_multiplier
    assert (_logits(model, ids, DenseCausalAttention(1, 20)) - want).abs().max() > 1e-2  # no window
    assert (_logits(model, ids, DenseCausalAttention(1, 20, window=WINDOW)) - want).abs().max() > 1e-2  # every layer
    for change in ({"local_rope_theta": 0.0}, {"attention_multiplier": 0.0}, {"norm_unit_offset": False}):
        assert (_logits(_with_parts(model, **change), ids) - want).abs().max() > 1e-2, change


def test_gemma3_bf16_embeddings_are_transformers(gemma3):
    """In bf16 the embedding scale √hidden is rounded to bf16 as transformers rounds it (hidden 48:
    6.93 → 6.9375): the scaled embeddings are transformers' to the bit, and the logits follow."""
    from transformers import AutoModelForCausalLM

    d = build_tiny_model(gemma3[0].parent / "bf16", "gemma3", hidden=48, heads=4, kv_heads=2)
    hf16 = AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16).eval()
    model = load_model(d, dtype=torch.bfloat16)[0]
    ids = torch.tensor(random_prompts([16], seed=2)[0])
    with torch.no_grad():
        assert torch.equal(model.embed(ids), hf16.model.embed_tokens(ids))
        assert not torch.equal(model.model.embed_tokens(ids) * 48 ** 0.5, hf16.model.embed_tokens(ids))
        want = hf16(ids[None]).logits[0].float()
    diff = (_logits(model, ids) - want).abs().max().item()
    assert diff < 0.1, diff


def test_smoothquant_folds_into_gemma_norms(gemma3, calibration_table):
    """q/k/v are smoothed through input_layernorm and gate/up through pre_feedforward_layernorm
    (post_attention_layernorm normalizes the attention's output): each folded factor leaves the
    function as it was, and each norm's scale 1 + weight is divided by s."""
    from quantspec.calib.smooth import smooth_model
    from quantspec.calib.tables import read_table

    gemma_dir = gemma3[0]
    model = load_model(gemma_dir)[0]
    ids = torch.tensor(random_prompts([20], seed=6)[0])
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


# ---- Gemma 2 ---------------------------------------------------------------------------------


def test_gemma2_hub_config():
    a = ModelArgs.from_hf_config(GEMMA2_HUB_CONFIG)
    assert a.window_layers == (0, 2) and a.attention_window == 4096  # every other layer, the first sliding
    assert (a.attn_softcap, a.logit_softcap, a.local_rope_theta, a.qk_norm) == (50.0, 30.0, 0.0, False)
    assert a.tie_word_embeddings and a.post_norms and a.pre_norms and a.norm_unit_offset
    assert (a.hidden_act, a.attention_multiplier, a.embedding_multiplier) == ("gelu_pytorch_tanh", 0.0, 8.0)


@pytest.mark.parametrize("arch", ["Gemma2ForCausalLM", "Gemma3ForCausalLM"])
def test_keys_a_config_leaves_out_take_transformers_defaults(arch):
    """Caps, window, score scale, layer types and rotary bases as transformers' config classes
    fill them in."""
    from transformers import Gemma2Config, Gemma3TextConfig

    sparse = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 6,
              "num_attention_heads": 8, "head_dim": 16}
    config = {"Gemma2ForCausalLM": Gemma2Config, "Gemma3ForCausalLM": Gemma3TextConfig}[arch](**sparse).to_dict()
    ours = ModelArgs.from_hf_config({**sparse, "architectures": [arch]})
    theirs = ModelArgs.from_hf_config({**config, "architectures": [arch]})
    assert ours == dataclasses.replace(theirs, bos_token_id=None, eos_token_ids=[])  # (ids: the checkpoint's)
    assert ours.attention_multiplier == 256 ** -0.5 and (ours.sliding_window, ours.num_kv_heads) == (4096, 4)


def test_gemma2_softcaps_count(gemma2):
    gemma_dir, hf = gemma2
    """Each cap, left out, moves the logits away from transformers'; the logits stay within the cap."""
    model = load_model(gemma_dir)[0]
    assert (model.args.attn_softcap, model.args.logit_softcap) == tuple(GEMMA2_SOFTCAPS.values())
    ids = torch.tensor(random_prompts([20], seed=1)[0])
    with torch.no_grad():
        want = hf(ids[None]).logits[0]
    got = _logits(model, ids)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    assert got.abs().max() < model.args.logit_softcap
    for change in ({"attn_softcap": 0.0}, {"logit_softcap": 0.0}):
        assert (_logits(_with_parts(model, **change), ids) - want).abs().max() > 1e-2, change


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemma2_capped_batched_path_equals_plain_decoding(gemma2, tmp_path, dtype):
    gemma_dir = gemma2[0]
    """A window longer than every sequence leaves no key out: 20 sequences at once then take the
    batched path's one gathered call, with capped scores."""
    d = tmp_path / "wide"
    d.mkdir()
    for f in gemma_dir.iterdir():
        (d / f.name).symlink_to(f)
    (d / "config.json").unlink()
    (d / "config.json").write_text(json.dumps({**json.loads((gemma_dir / "config.json").read_text()),
                                               "sliding_window": 512}))
    assert_every_path_is_plain_decoding(load_model(d, dtype=dtype)[0], dtype)


# ---- Gemma 3's multimodal checkpoints ---------------------------------------------------------


@pytest.fixture(scope="module")
def gemma3_multimodal(gemma3, tmp_path_factory):
    """A `Gemma3ForConditionalGeneration` holding the tiny Gemma 3's decoder beside a tiny SigLIP
    tower, as transformers saves it (`language_model.model.*`, `vision_tower.*`, ...)."""
    import shutil

    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    d, hf = gemma3
    text = json.loads((d / "config.json").read_text())
    cfg = Gemma3Config(text_config=text, vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                                            num_attention_heads=2, image_size=28, patch_size=14),
                       mm_tokens_per_image=4, boi_token_index=509, eoi_token_index=510, image_token_index=511,
                       eos_token_id=text["eos_token_id"], bos_token_id=text["bos_token_id"],
                       tie_word_embeddings=text["tie_word_embeddings"])
    mm = Gemma3ForConditionalGeneration(cfg).eval()
    mm.model.language_model.load_state_dict(hf.model.state_dict())
    mm.lm_head.load_state_dict(hf.lm_head.state_dict())
    out = tmp_path_factory.mktemp("gemma3mm") / "m"
    mm.save_pretrained(out)
    for f in d.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "generation_config")):
            shutil.copy(f, out / f.name)
    return out, mm


def test_gemma3_multimodal_reads_as_its_text_decoder(gemma3, gemma3_multimodal):
    from safetensors import safe_open

    (d, _), (mm_dir, mm) = gemma3, gemma3_multimodal
    with safe_open(str(mm_dir / "model.safetensors"), "pt") as f:
        assert any(k.startswith("vision_tower.") for k in f.keys())
        assert "language_model.model.layers.0.self_attn.q_proj.weight" in f.keys()
    model = load_model(mm_dir)[0]
    assert model.args == load_model(d)[0].args
    ids = torch.tensor(random_prompts([20], seed=7)[0])
    with torch.no_grad():
        want = mm(input_ids=ids[None]).logits[0]
    torch.testing.assert_close(_logits(model, ids), want, atol=1e-4, rtol=0)


@pytest.mark.parametrize("quant_type, options", [("weight_only_int4", {"group_size": 32}),
                                                 ("a8w8", {"kv_cache": "int8", "target": "quantspec"}),
                                                 ("weight_only_int4", {"group_size": 32,  # its tied head untied
                                                                       "layer_quant_types": ("lm_head=weight_only_int8",)})])
def test_gemma3_multimodal_artifact_is_the_text_model(gemma3_multimodal, tmp_path, quant_type, options,
                                                       artifact_runs_as_in_transformers):
    """The artifact is the text-only `Gemma3ForCausalLM` (what transformers, vLLM and SGLang load
    as Gemma 3 1B), which transformers runs to quantspec's logits."""
    from quantspec.quant.artifact import load_safetensors

    ids = torch.tensor(random_prompts([13], seed=8)[0])
    art = artifact_runs_as_in_transformers(gemma3_multimodal[0], quant_type, tmp_path / quant_type, ids, **options)
    cfg = json.loads((art / "config.json").read_text())
    assert cfg["architectures"] == ["Gemma3ForCausalLM"] and "vision_config" not in cfg
    names = list(load_safetensors(art))
    assert "model.layers.0.self_attn.q_proj.weight_packed" in names or "model.layers.0.self_attn.q_proj.weight" in names
    assert not any(n.startswith(("vision_tower.", "multi_modal_projector.", "language_model.")) for n in names)
