"""Qwen3 (each head's q and k RMS-normalized before the rotary embedding; heads wider than
hidden / heads) against transformers' own Qwen3 classes: quantspec's forward, fused or not, its
engine's greedy decoding alone and in a batch, and quantspec's artifacts of it, which
transformers (decompressing through compressed-tensors) runs to the same logits."""

import pytest
import torch

from quantspec import api
from quantspec.infer.dispatch import DispatchPolicy
from quantspec.infer.engine import Engine, EngineConfig
from quantspec.infer.loader import load_for_inference
from quantspec.infer.sampler import SamplingParams
from quantspec.model_zoo.llama import DenseCausalAttention

torch.set_num_threads(1)
IDS = torch.tensor([7, 300, 41, 12, 99, 5, 260, 17, 33, 2, 150, 8, 71])
TOL = dict(rtol=1e-4, atol=1e-4)


def _hf(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def _hf_logits(path) -> torch.Tensor:
    with torch.no_grad():
        return _hf(path)(IDS[None]).logits[0]


def _logits(model) -> torch.Tensor:
    T = IDS.numel()
    with torch.no_grad():
        return model.compute_logits(model(IDS, torch.arange(T), DenseCausalAttention(1, T)))


@pytest.fixture(scope="module")
def hf_qwen3(tiny_qwen3_dir):
    return _hf(tiny_qwen3_dir)


def test_logits_match_transformers_fused_or_not(tiny_qwen3_dir, hf_qwen3):
    with torch.no_grad():
        want = hf_qwen3(IDS[None]).logits[0]
    for fuse in (True, False):
        lm = load_for_inference(tiny_qwen3_dir, tokenizer=False, fuse=fuse)
        attn = lm.model.model.layers[0].self_attn
        assert attn.q_norm is not None and attn.num_heads * attn.head_dim == 2 * lm.args.hidden_size
        torch.testing.assert_close(_logits(lm.model), want, **TOL)
    with torch.no_grad():  # the norms' gains are read: ones in their place change the logits
        attn.q_norm.weight.fill_(1.0)
    assert (_logits(lm.model) - want).abs().max() > 1e-2


def test_engine_greedy_equals_transformers_generate(tiny_qwen3_dir, hf_qwen3):
    lm = load_for_inference(tiny_qwen3_dir, tokenizer=False)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (5, 17, 40)]
    want = []
    for p in prompts:
        out = hf_qwen3.generate(torch.tensor([p]), max_new_tokens=20, min_new_tokens=20, do_sample=False,
                                eos_token_id=None, pad_token_id=0)
        want.append(out[0, len(p):].tolist())
    for batch in (1, 3):  # alone, and joining and leaving one running batch
        eng = Engine(lm.model, EngineConfig(block_size=16, max_batch_size=batch, max_length=128), eos_token_ids=[],
                     runtime=lm.runtime)
        seqs = [eng.add_request(p, SamplingParams(max_new_tokens=20)) for p in prompts]
        eng.run()
        assert [s.output_ids for s in seqs] == want


@pytest.fixture(scope="module")
def qwen3_table(tiny_qwen3_dir, calibration_table):
    return calibration_table(tiny_qwen3_dir)


@pytest.mark.parametrize("quant_type, options", [
    ("weight_only_int8", {}),
    ("weight_only_int4", {"group_size": 32}),
    ("a8w8", {"kv_cache": "int8", "target": "quantspec"}),
    ("a8w8_fp8", {"kv_cache": "fp8"}),
])
def test_artifacts_run_in_transformers_as_in_quantspec(tiny_qwen3_dir, qwen3_table, tmp_path, quant_type, options):
    calib = qwen3_table if quant_type.startswith("a8w8") else None
    art = api.quantize(str(tiny_qwen3_dir), quant_type, tmp_path / quant_type, calib=calib, **options)
    theirs = _hf_logits(art)  # transformers runs a float KV cache: so does this forward
    # compressed-tensors' order of operations for fp8 activations (see test_interop_transformers.py)
    policy = DispatchPolicy(fast=False) if quant_type == "a8w8_fp8" else None
    lm = load_for_inference(art, tokenizer=False, policy=policy)
    torch.testing.assert_close(_logits(lm.model), theirs, **TOL)
    if options.get("kv_cache"):
        L, KV = lm.args.num_layers, lm.args.num_kv_heads
        assert lm.k_scale is not None and lm.k_scale.numel() in (L, L * KV) and bool((lm.k_scale > 0).all())
    fp32 = _logits(load_for_inference(tiny_qwen3_dir, tokenizer=False).model)
    assert (fp32 - theirs).abs().max() > 1e-3  # the comparison has teeth: quantization moved the logits


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
