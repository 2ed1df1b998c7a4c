"""Qwen3 (each head's q and k RMS-normalized before the rotary embedding; heads wider than
hidden / heads) against transformers' own Qwen3 classes: quantspec's forward, fused or not, its
engine's greedy decoding alone and in a batch, and quantspec's artifacts of it, which
transformers (decompressing through compressed-tensors) runs to the same logits."""

import pytest
import torch

from quantspec import api
from quantspec.infer.loader import load_for_inference

torch.set_num_threads(1)
IDS = torch.tensor([7, 300, 41, 12, 99, 5, 260, 17, 33, 2, 150, 8, 71])
TOL = dict(rtol=1e-4, atol=1e-4)


@pytest.fixture(scope="module")
def hf_qwen3(tiny_qwen3_dir, transformers_model):
    return transformers_model(tiny_qwen3_dir)


def test_logits_match_transformers_fused_or_not(tiny_qwen3_dir, hf_qwen3, logits_of):
    with torch.no_grad():
        want = hf_qwen3(IDS[None]).logits[0]
    for fuse in (True, False):
        lm = load_for_inference(tiny_qwen3_dir, tokenizer=False, fuse=fuse)
        attn = lm.model.model.layers[0].self_attn
        assert attn.q_norm is not None and attn.num_heads * attn.head_dim == 2 * lm.args.hidden_size
        torch.testing.assert_close(logits_of(lm.model, IDS), want, **TOL)
    with torch.no_grad():  # the norms' gains are read: ones in their place change the logits
        attn.q_norm.weight.fill_(1.0)
    assert (logits_of(lm.model, IDS) - want).abs().max() > 1e-2


def test_engine_greedy_equals_transformers_generate(tiny_qwen3_dir, hf_qwen3, engine_decodes_as_generate):
    engine_decodes_as_generate(tiny_qwen3_dir, hf_qwen3)


@pytest.mark.parametrize("quant_type, options", [
    ("weight_only_int8", {}),
    ("weight_only_int4", {"group_size": 32}),
    ("a8w8", {"kv_cache": "int8", "target": "quantspec"}),
    ("a8w8_fp8", {"kv_cache": "fp8"}),
])
def test_artifacts_run_in_transformers_as_in_quantspec(tiny_qwen3_dir, tmp_path, quant_type, options,
                                                       artifact_runs_as_in_transformers):
    art = artifact_runs_as_in_transformers(tiny_qwen3_dir, quant_type, tmp_path / quant_type, IDS, **options)
    if options.get("kv_cache"):
        lm = load_for_inference(art, tokenizer=False)
        L, KV = lm.args.num_layers, lm.args.num_kv_heads
        assert lm.k_scale is not None and lm.k_scale.numel() in (L, L * KV) and bool((lm.k_scale > 0).all())


def test_speculation_on_a_qwen3_base_keeps_plain_greedy(tiny_qwen3_dir, tmp_path):
    """n-gram drafts and an EAGLE-3 head (a Llama layer over the Qwen3 base's features, the layout
    vLLM and SGLang load for Qwen3 bases: no q / k norms), float or FP8 with dynamic activations,
    leave greedy answers as plain decoding's."""
    import json

    from quantspec.infer.predictor import InferConfig, Predictor
    from quantspec.model_zoo.checkpoint import load_model
    from quantspec.model_zoo.eagle3 import save_eagle3
    from quantspec.model_zoo.eagle3_train import init_eagle3

    base, _ = load_model(tiny_qwen3_dir)
    head = save_eagle3(init_eagle3(base, torch.arange(0, 512, 2), (0, 1, 2)), tmp_path / "eagle3")
    cfg = json.loads((head / "config.json").read_text())
    assert cfg["head_dim"] == 32 and "q_norm" not in (head / "model.safetensors").read_bytes().decode("latin-1")
    prompts = ["The quick brown fox", "Once upon a time, in a quiet village by the sea"]
    # the head quantized on its own, FP8 with per-token activations: no base hidden states to calibrate on
    fp8 = api.quantize(str(head), "a8w8_fp8", tmp_path / "eagle3.fp8", activations="dynamic")
    runs = {}
    for method, extra in (("none", {}), ("inference_with_reference", {}),
                          ("eagle", {"draft_model": str(head), "speculate_tree": "2x2"}),
                          ("eagle-fp8", {"draft_model": str(fp8)})):
        config = InferConfig(model=str(tiny_qwen3_dir), max_new_tokens=24, max_length=128,
                             speculate_method=method.split("-")[0], **extra)
        runs[method] = [o.token_ids for o in Predictor(config).generate(prompts)]
    assert runs["inference_with_reference"] == runs["eagle"] == runs["eagle-fp8"] == runs["none"]
