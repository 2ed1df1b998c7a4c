"""SmolLM3 (layers without a rotary embedding: `no_rope_layers`) against transformers' own
SmolLM3 classes: quantspec's forward, fused or not, its engine's greedy decoding, its artifacts run
by transformers (through compressed-tensors) to the same logits, and speculation keeping plain
greedy output."""

import pytest
import torch

from quantspec.infer.loader import load_for_inference
from quantspec.model_zoo.tiny import build_tiny_model

torch.set_num_threads(1)
IDS = torch.tensor([7, 300, 41, 12, 99, 5, 260, 17, 33, 2, 150, 8, 71])
TOL = dict(rtol=1e-4, atol=1e-4)


@pytest.fixture(scope="module")
def smollm3_dir(tmp_path_factory):
    """2-layer SmolLM3 whose layer 1 takes no rotary embedding, hidden 64, 4 / 2 KV heads."""
    return build_tiny_model(tmp_path_factory.mktemp("smollm3"), "smollm3")


@pytest.fixture(scope="module")
def hf_smollm3(smollm3_dir, transformers_model):
    return transformers_model(smollm3_dir)


def test_logits_match_transformers_fused_or_not(smollm3_dir, hf_smollm3, logits_of):
    with torch.no_grad():
        want = hf_smollm3(IDS[None]).logits[0]
    for fuse in (True, False):
        lm = load_for_inference(smollm3_dir, tokenizer=False, fuse=fuse)
        assert lm.args.nope_layers == (1,)
        assert [layer.self_attn.use_rope for layer in lm.model.model.layers] == [True, False]
        torch.testing.assert_close(logits_of(lm.model, IDS), want, **TOL)
    lm.model.model.layers[1].self_attn.use_rope = True  # a rotary embedding there changes the logits
    assert (logits_of(lm.model, IDS) - want).abs().max() > 1e-2


def test_engine_greedy_equals_transformers_generate(smollm3_dir, hf_smollm3, engine_decodes_as_generate):
    engine_decodes_as_generate(smollm3_dir, hf_smollm3)


@pytest.mark.parametrize("quant_type, options", [
    ("weight_only_int4", {"group_size": 32}),
    ("a8w8_fp8", {"kv_cache": "fp8"}),
])
def test_artifacts_run_in_transformers_as_in_quantspec(smollm3_dir, tmp_path, quant_type, options,
                                                       artifact_runs_as_in_transformers):
    artifact_runs_as_in_transformers(smollm3_dir, quant_type, tmp_path / quant_type, IDS, **options)


def test_speculation_on_a_smollm3_base_keeps_plain_greedy(smollm3_dir, tmp_path):
    """n-gram drafts and an EAGLE-3 head (one Llama layer with a rotary embedding, whatever the
    base's NoPE layers) leave greedy answers as plain decoding's."""
    from quantspec.infer.predictor import InferConfig, Predictor
    from quantspec.model_zoo.checkpoint import load_model
    from quantspec.model_zoo.eagle3 import load_eagle3, save_eagle3
    from quantspec.model_zoo.eagle3_train import init_eagle3

    base, _ = load_model(smollm3_dir)
    head = save_eagle3(init_eagle3(base, torch.arange(0, 512, 2), (0, 1, 2)), tmp_path / "eagle3")
    assert load_eagle3(head).args.layer.nope_layers == ()
    prompts = ["The quick brown fox", "Once upon a time, in a quiet village by the sea"]
    runs = {}
    for method, extra in (("none", {}), ("inference_with_reference", {}),
                          ("eagle", {"draft_model": str(head), "speculate_tree": "2x2"})):
        config = InferConfig(model=str(smollm3_dir), max_new_tokens=24, max_length=128, speculate_method=method,
                             **extra)
        runs[method] = [o.token_ids for o in Predictor(config).generate(prompts)]
    assert runs["inference_with_reference"] == runs["eagle"] == runs["none"]
