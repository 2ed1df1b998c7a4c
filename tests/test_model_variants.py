"""Llama variants with a twist of their own, against transformers' own classes: SmolLM3 (layers
without a rotary embedding, `no_rope_layers`), Granite (embeddings, block outputs, attention
scores and logits each scaled by a multiplier of its config), OLMo 2 (post-norm layers: each
block's output normalized before its add, no norm before attention or the MLP; q and k
normalized over the whole projection) and Gemma 2 / 3 (four 1 + weight norms a layer, gelu-tanh
MLPs, every other layer sliding a window; Gemma 2's scores and logits soft-capped, Gemma 3's window
layers turning by rotary tables of their own: `test_gemma.py`). For each: quantspec's forward,
fused or not, its engine's greedy decoding, its artifacts (calibrated, GPTQ and AWQ) run by
transformers through compressed-tensors to the same logits, and speculation (n-gram, an EAGLE-3
head, an MTP module) keeping plain greedy output; then what is particular to each."""

import dataclasses

import pytest
import torch

from quantspec import api
from quantspec.infer.dispatch import DispatchPolicy
from quantspec.infer.loader import load_for_inference
from quantspec.model_zoo.llama import NEUTRAL_MULTIPLIERS
from quantspec.model_zoo.tiny import GRANITE_MULTIPLIERS, build_tiny_model

torch.set_num_threads(1)
IDS = torch.tensor([7, 300, 41, 12, 99, 5, 260, 17, 33, 2, 150, 8, 71])
TOL = dict(rtol=1e-4, atol=1e-4)
# 2 layers, hidden 64, 4 / 2 KV heads: SmolLM3's layer 1 takes no rotary embedding, Granite's
# multipliers are `GRANITE_MULTIPLIERS`
ARCHS = ("smollm3", "granite", "olmo2", "gemma2", "gemma3")


@pytest.fixture(scope="module", params=ARCHS)
def variant(request, tmp_path_factory, transformers_model):
    """(arch, its tiny checkpoint, transformers' model of it)."""
    d = build_tiny_model(tmp_path_factory.mktemp(request.param), request.param)
    return request.param, d, transformers_model(d)


def test_logits_match_transformers_fused_or_not(variant, logits_of):
    _, d, hf = variant
    with torch.no_grad():
        want = hf(IDS[None]).logits[0]
    for fuse in (True, False):
        torch.testing.assert_close(logits_of(load_for_inference(d, tokenizer=False, fuse=fuse).model, IDS), want,
                                   **TOL)


def test_engine_greedy_equals_transformers_generate(variant, engine_decodes_as_generate):
    engine_decodes_as_generate(variant[1], variant[2])


@pytest.mark.parametrize("quant_type, options", [
    ("weight_only_int4", {"group_size": 32}),
    ("a8w8", {"kv_cache": "int8", "target": "quantspec"}),  # calibrated through the model's own layers
    ("a8w8_fp8", {"kv_cache": "fp8"}),
])
def test_artifacts_run_in_transformers_as_in_quantspec(variant, tmp_path, quant_type, options,
                                                       artifact_runs_as_in_transformers):
    artifact_runs_as_in_transformers(variant[1], quant_type, tmp_path / quant_type, IDS, **options)


@pytest.mark.parametrize("method", ["gptq", "awq", "awq+gptq"])  # AWQ's factors folded into norms and rows
def test_data_method_artifact_runs_in_transformers(variant, tmp_path, logits_of, method):
    data = tmp_path / "calib.txt"
    data.write_text("The quick brown fox jumps over the lazy dog. " * 60)
    art = api.quantize(str(variant[1]), "weight_only_int4", tmp_path / method, method=method, group_size=32,
                       dataset=str(data), num_samples=4, seq_len=32)
    torch.testing.assert_close(logits_of(load_for_inference(art, tokenizer=False).model, IDS), logits_of(art, IDS),
                               **TOL)


def test_speculation_keeps_plain_greedy(variant, tmp_path):
    """n-gram drafts, an EAGLE-3 head (a plain Llama layer with a rotary embedding and no
    multipliers, as vLLM's EAGLE-3 Llama layer) and an MTP module (the base's layer, saved and read
    back) leave greedy answers as plain decoding's."""
    from quantspec.infer.predictor import InferConfig, Predictor
    from quantspec.model_zoo.checkpoint import load_model
    from quantspec.model_zoo.eagle3 import load_eagle3, save_eagle3
    from quantspec.model_zoo.eagle3_train import init_eagle3
    from quantspec.model_zoo.mtp import load_mtp, save_mtp
    from quantspec.model_zoo.mtp_train import init_mtp

    arch, d, _ = variant
    base, _ = load_model(d)
    head = save_eagle3(init_eagle3(base, torch.arange(0, 512, 2), (0, 1, 2)), tmp_path / "eagle3")
    layer = load_eagle3(head).args.layer
    assert layer.nope_layers == () and not layer.multiplied
    mtp = tmp_path / "mtp"
    save_mtp(init_mtp(base, torch.arange(base.args.vocab_size), seed=0), mtp)
    module = load_mtp(mtp, base)
    block = module.args.block
    assert all(getattr(block, k) == getattr(base.args, k) for k in NEUTRAL_MULTIPLIERS)
    hidden = torch.randn(3, base.args.hidden_size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():  # its soft targets are the base's own logits (Granite's scaled)
        torch.testing.assert_close(module.teacher_logits(hidden), base.compute_logits(hidden))
    prompts = ["The quick brown fox", "Once upon a time, in a quiet village by the sea"]
    runs = {}
    for method, extra in (("none", {}), ("inference_with_reference", {}), ("mtp", {"draft_model": str(mtp)}),
                          ("eagle", {"draft_model": str(head), "speculate_tree": "2x2"})):
        config = InferConfig(model=str(d), max_new_tokens=24, max_length=128, speculate_method=method, **extra)
        runs[method] = [o.token_ids for o in Predictor(config).generate(prompts)]
    assert runs["inference_with_reference"] == runs["eagle"] == runs["mtp"] == runs["none"], arch


def _only(variant, arch):
    if variant[0] != arch:
        pytest.skip(f"{arch} only")
    return variant


def test_smollm3_nope_layer_takes_no_rotary(variant, logits_of):
    _, d, hf = _only(variant, "smollm3")
    lm = load_for_inference(d, tokenizer=False)
    assert lm.args.nope_layers == (1,)
    assert [layer.self_attn.use_rope for layer in lm.model.model.layers] == [True, False]
    lm.model.model.layers[1].self_attn.use_rope = True  # a rotary embedding there changes the logits
    with torch.no_grad():
        assert (logits_of(lm.model, IDS) - hf(IDS[None]).logits[0]).abs().max() > 1e-2


def test_granite_every_multiplier_counts(variant, logits_of):
    from quantspec.infer.cuda.layers import fusable
    from quantspec.model_zoo.checkpoint import build_model

    _, d, hf = _only(variant, "granite")
    # the float linears keep their weights (quantspec's CPU kernels pack them otherwise)
    lm = load_for_inference(d, tokenizer=False, fuse=False, policy=DispatchPolicy(cpu_kernels=False))
    assert {k: getattr(lm.args, k) for k in GRANITE_MULTIPLIERS} == GRANITE_MULTIPLIERS
    with torch.no_grad():
        want = hf(IDS[None]).logits[0]
    for k, neutral in NEUTRAL_MULTIPLIERS.items():  # each left out moves the logits
        net = build_model(dataclasses.replace(lm.args, **{k: neutral}), device="cpu")
        net.load_state_dict(lm.model.state_dict())
        net.setup_rope(64)
        assert (logits_of(net, IDS) - want).abs().max() > 1e-2, k
    fused = load_for_inference(d, tokenizer=False)  # the fused stacks leave the multipliers to the modules
    assert not fusable(fused.model.model.layers, torch.float32) and fused.runtime.stack is None


def test_olmo2_post_norms_and_whole_projection_qk_norms(variant, logits_of, tmp_path, calibration_table):
    """OLMo 2's layers read the raw residual: SmoothQuant has no norm to fold q/k/v's or gate/up's
    factors into and smooths down_proj alone (through up_proj's rows), in the default a8w8 recipe
    too, whose artifact transformers runs to quantspec's logits; per-head q / k norms would be
    another model; the fused stacks leave the layers to the modules."""
    from quantspec.calib.smooth import smoothing_factors
    from quantspec.calib.tables import read_table
    from quantspec.infer.cuda.layers import fusable
    from quantspec.quant.artifact import read_provenance

    _, d, hf = _only(variant, "olmo2")
    lm = load_for_inference(d, tokenizer=False, fuse=False, policy=DispatchPolicy(cpu_kernels=False))
    a = lm.args
    assert a.post_norms and a.qk_norm and not a.qk_norm_per_head
    layer = lm.model.model.layers[0]
    assert layer.input_layernorm is None and layer.self_attn.q_norm.weight.shape == (a.q_size,)
    with torch.no_grad():
        want = hf(IDS[None]).logits[0]
    moved = load_for_inference(d, tokenizer=False, fuse=False).model
    for lyr in moved.model.layers:  # the same gains read per head move the logits
        lyr.self_attn.qk_norm_per_head = True
        for norm in (lyr.self_attn.q_norm, lyr.self_attn.k_norm):
            norm.weight = torch.nn.Parameter(norm.weight[:a.head_dim].clone())
    assert (logits_of(moved, IDS) - want).abs().max() > 1e-2
    factors = smoothing_factors(lm.model, read_table(calibration_table(d)), 0.5)
    assert factors and all(n.endswith("mlp.down_proj") for n in factors)
    art = api.quantize(str(d), "a8w8", tmp_path / "a8w8", calib=calibration_table(d))  # default recipe: α search
    torch.testing.assert_close(logits_of(load_for_inference(art, tokenizer=False).model, IDS), logits_of(art, IDS),
                               **TOL)
    alphas = read_provenance(art)["provenance"]["calibration"]["static_plan"]["smoothquant_alphas"]
    assert alphas and all(n.endswith("mlp.down_proj") for n in alphas), alphas
    fused = load_for_inference(d, tokenizer=False)
    assert not fusable(fused.model.model.layers, torch.float32) and fused.runtime.stack is None

