"""Phi-3 (q/k/v stored as one `qkv_proj`, gate/up as one `gate_up_proj`; LongRoPE) against
transformers' own Phi-3 classes: quantspec's forward and engine on the split modules, artifacts
written back in the fused layout that transformers (through compressed-tensors) runs to the same
logits, and the split / fuse rules of `model_zoo.layout` on every compressed-tensors leaf."""

import json
import re

import pytest
import torch
from safetensors import safe_open

from quantspec import api
from quantspec.errors import QuantSpecError
from quantspec.infer.dispatch import DispatchPolicy
from quantspec.infer.loader import load_for_inference
from quantspec.model_zoo import layout
from quantspec.model_zoo.llama import ModelArgs
from quantspec.model_zoo.tiny import build_tiny_model
from quantspec.quant.artifact import linear_to_tensors
from quantspec.quant.args import QuantArgs
from quantspec.quant.gptq import rtn_quantize

torch.set_num_threads(1)
IDS = torch.tensor([7, 300, 41, 12, 99, 5, 260, 17, 33, 2, 150, 8, 71])
TOL = dict(rtol=1e-4, atol=1e-4)


def _names(art):
    with safe_open(str(art / "model.safetensors"), "pt") as f:
        return set(f.keys())


@pytest.fixture(scope="module")
def hf_phi3(tiny_phi3_dir, transformers_model):
    return transformers_model(tiny_phi3_dir)


def test_logits_match_transformers_fused_or_not(tiny_phi3_dir, hf_phi3, logits_of):
    with torch.no_grad():
        want = hf_phi3(IDS[None]).logits[0]
    for fuse in (True, False):
        lm = load_for_inference(tiny_phi3_dir, tokenizer=False, fuse=fuse)
        torch.testing.assert_close(logits_of(lm.model, IDS), want, **TOL)
    assert lm.args.arch == "phi3" and lm.model.model.layers[0].self_attn.k_proj.out_features == lm.args.kv_size


def test_engine_greedy_equals_transformers_generate(tiny_phi3_dir, hf_phi3, engine_decodes_as_generate):
    engine_decodes_as_generate(tiny_phi3_dir, hf_phi3)


def test_longrope_short_factors_and_attention_factor(tmp_path, transformers_model, logits_of):
    """Within the original context LongRoPE divides each frequency by its short factor and scales
    cos / sin by sqrt(1 + ln(max / original) / ln original), as transformers does; a context past
    the original one is refused, naming the flag."""
    g = torch.Generator().manual_seed(1)
    rope = {"rope_type": "longrope", "short_factor": (1 + torch.rand(8, generator=g)).tolist(),
            "long_factor": (2 + 4 * torch.rand(8, generator=g)).tolist(), "original_max_position_embeddings": 64}
    d = build_tiny_model(tmp_path / "long", "phi3", rope_scaling=rope, max_position_embeddings=256)
    lm = load_for_inference(d, tokenizer=False)
    torch.testing.assert_close(logits_of(lm.model, IDS), logits_of(d, IDS), **TOL)
    plain = build_tiny_model(tmp_path / "plain", "phi3", max_position_embeddings=256)
    assert (logits_of(d, IDS) - logits_of(plain, IDS)).abs().max() > 1e-2  # the factors matter
    cfg = json.loads((d / "config.json").read_text())
    cfg.pop("original_max_position_embeddings")
    cfg["rope_parameters"].pop("original_max_position_embeddings", None)
    cfg["rope_scaling"] = {"type": "su", "short_factor": rope["short_factor"], "long_factor": rope["long_factor"]}
    args = ModelArgs.from_hf_config(cfg)  # Phi-3's older spelling, original context from max_position_embeddings
    assert args.rope_scaling["original_max_position_embeddings"] == 256
    with pytest.raises(QuantSpecError, match="--max-length 100 .*original context of 64 .*--max-length 64"):
        ModelArgs.from_hf_config(json.loads((d / "config.json").read_text())).check_context(100, "--max-length")


@pytest.fixture(scope="module")
def partial_dir(tmp_path_factory):
    """Phi-4-mini's rotary layout: the leading 3/4 of each head turned (12 of 16 dims), LongRoPE
    factors for those 6 frequencies."""
    g = torch.Generator().manual_seed(2)
    rope = {"rope_type": "longrope", "partial_rotary_factor": 0.75, "original_max_position_embeddings": 64,
            "short_factor": (1 + torch.rand(6, generator=g)).tolist(), "long_factor": (2 + torch.rand(6)).tolist()}
    return build_tiny_model(tmp_path_factory.mktemp("phi3_partial"), "phi3", rope_scaling=rope,
                            max_position_embeddings=256)


def test_partial_rotary_matches_transformers(partial_dir, transformers_model, logits_of, engine_decodes_as_generate,
                                             tmp_path):
    """A rotary embedding over part of each head (the rest passed unrotated): logits fused and
    unfused, the engine's greedy decoding, and an int4 artifact that transformers runs."""
    hf = transformers_model(partial_dir)
    with torch.no_grad():
        want = hf(IDS[None]).logits[0]
    for fuse in (True, False):
        lm = load_for_inference(partial_dir, tokenizer=False, fuse=fuse)
        assert lm.args.rotary_dim == 12 and lm.model.cos.shape[-1] == 12
        torch.testing.assert_close(logits_of(lm.model, IDS), want, **TOL)
    engine_decodes_as_generate(partial_dir, hf)
    art = api.quantize(str(partial_dir), "weight_only_int4", tmp_path / "w4", group_size=32)
    torch.testing.assert_close(logits_of(load_for_inference(art, tokenizer=False).model, IDS), logits_of(art, IDS),
                               **TOL)
    cfg = json.loads((partial_dir / "config.json").read_text())
    cfg["rope_parameters"]["partial_rotary_factor"] = 0.3125  # 5 of 16: no pairs to rotate
    with pytest.raises(QuantSpecError, match="partial_rotary_factor gives 5 rotary dimensions of a head of 16"):
        ModelArgs.from_hf_config(cfg)


@pytest.mark.parametrize("quant_type, options", [
    ("weight_only_int8", {}),
    ("weight_only_int4", {"group_size": 32}),
    ("a8w8", {"kv_cache": "int8", "target": "quantspec"}),
    ("a8w8_fp8", {"kv_cache": "fp8"}),
])
def test_artifacts_keep_the_fused_layout_and_run_in_transformers(tiny_phi3_dir, tmp_path, quant_type, options,
                                                                 artifact_runs_as_in_transformers):
    art = artifact_runs_as_in_transformers(tiny_phi3_dir, quant_type, tmp_path / quant_type, IDS, **options)
    names = _names(art)
    assert not any(re.search(r"\.(q|k|v|gate|up)_proj\.", n) for n in names)
    packed = "weight_packed" if quant_type.startswith("weight_only") else "weight"
    assert {f"model.layers.0.self_attn.qkv_proj.{packed}", f"model.layers.1.mlp.gate_up_proj.{packed}"} <= names


def test_gptq_artifact_runs_in_transformers(tiny_phi3_dir, tmp_path, logits_of):
    data = tmp_path / "calib.jsonl"
    data.write_text("".join(json.dumps({"text": f"The quick brown fox {i} jumps over the lazy dog."}) + "\n"
                            for i in range(8)))
    art = api.quantize(str(tiny_phi3_dir), "weight_only_int4", tmp_path / "gptq", method="gptq", group_size=32,
                       dataset=str(data), num_samples=4, seq_len=32)
    lm = load_for_inference(art, tokenizer=False)
    torch.testing.assert_close(logits_of(lm.model, IDS), logits_of(art, IDS), **TOL)


def _llama_twin(phi3_dir, out):
    """The same weights in Llama's layout (q/k/v and gate/up apart, LlamaForCausalLM)."""
    from safetensors.torch import load_file, save_file

    from quantspec.model_zoo.checkpoint import load_model

    net, _ = load_model(phi3_dir)
    out.mkdir()
    save_file({k: v.contiguous() for k, v in net.state_dict().items()}, str(out / "model.safetensors"))
    cfg = json.loads((phi3_dir / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**cfg, "architectures": ["LlamaForCausalLM"], "model_type": "llama"}))
    for f in phi3_dir.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "generation")):
            (out / f.name).write_bytes(f.read_bytes())
    assert set(load_file(str(out / "model.safetensors"))) != set(load_file(str(phi3_dir / "model.safetensors")))
    return out


def test_packed_zero_points_split_as_the_unfused_layout_runs_them(tiny_phi3_dir, tmp_path, logits_of):
    """Asymmetric int4 (integer zero points packed 8 to a word along the rows): the fused artifact
    runs to the logits of the same quantization written in Llama's unfused layout."""
    twin = _llama_twin(tiny_phi3_dir, tmp_path / "llama")
    arts = [api.quantize(str(d), "weight_only_int4", tmp_path / f"w4-{i}", group_size=32, symmetric=False)
            for i, d in enumerate((tiny_phi3_dir, twin))]
    assert "model.layers.0.self_attn.qkv_proj.weight_zero_point" in _names(arts[0])
    assert "model.layers.0.self_attn.k_proj.weight_zero_point" in _names(arts[1])
    fused, apart = (logits_of(load_for_inference(a, tokenizer=False).model, IDS) for a in arts)
    torch.testing.assert_close(fused, apart, rtol=0, atol=0)


ARGS = ModelArgs(arch="phi3", vocab_size=64, hidden_size=64, intermediate_size=96, num_layers=1, num_heads=4,
                 num_kv_heads=2)


@pytest.mark.parametrize("qargs, with_input", [
    (QuantArgs(num_bits=4, type="int", strategy="group", group_size=16, symmetric=False), False),
    (QuantArgs(num_bits=8, type="int", strategy="channel"), True),
    (QuantArgs(num_bits=8, type="int", strategy="channel", symmetric=False), False),
])
def test_split_and_fuse_are_inverse_on_every_leaf(qargs, with_input):
    """Fusing a layer's part tensors and splitting the result gives the parts back, codes, scales,
    zero points (packed along rows) and shapes alike; a unit's input scale is the parts' largest."""
    g = torch.Generator().manual_seed(0)
    p = "model.layers.0."
    parts = {}
    for name, rows in (("self_attn.q_proj", 64), ("self_attn.k_proj", 32), ("self_attn.v_proj", 32),
                       ("mlp.gate_proj", 96), ("mlp.up_proj", 96)):
        r = rtn_quantize(torch.randn(rows, 64, generator=g), qargs)
        scale = torch.rand(1, generator=g) if with_input else None
        parts.update(linear_to_tensors(p + name, r.q, r.scale, r.zero_point, qargs, input_scale=scale))
    fused = layout.fuse_tensors(ARGS, parts)
    assert {n.rsplit(".", 2)[-2] for n in fused} == {"qkv_proj", "gate_up_proj"}
    back = layout.SplitTensors(fused, ARGS)
    assert set(back) == set(parts)
    for n, t in parts.items():
        if n.endswith("input_scale"):
            unit = [v for k, v in parts.items()
                    if k.endswith("input_scale") and ("self_attn" in k) == ("self_attn" in n)]
            torch.testing.assert_close(back[n], torch.stack(unit).amax(0))
        else:
            assert back.shapes[n] == tuple(t.shape) and torch.equal(back[n], t), n


def test_config_names_whole_units_only():
    from quantspec.quant.presets import preset

    names = [f"model.layers.0.self_attn.{p}_proj" for p in "qkv"]
    cfg = preset("a8w8", ignore=("lm_head", *names, "model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj"))
    out = layout.checkpoint_config(ARGS, cfg)
    assert out.ignore == ("lm_head", "model.layers.0.self_attn.qkv_proj", "model.layers.0.mlp.gate_up_proj")
    with pytest.raises(QuantSpecError, match="k_proj without the rest of .*qkv_proj"):
        layout.checkpoint_config(ARGS, preset("a8w8", ignore=(names[1],)))
    assert layout.checkpoint_name(ARGS, names[2]) == "model.layers.0.self_attn.qkv_proj"
    assert layout.checkpoint_name(ARGS, "model.layers.0.self_attn.o_proj") == "model.layers.0.self_attn.o_proj"


def test_speculation_on_a_partial_rotary_base_keeps_plain_greedy(partial_dir, tmp_path):
    """n-gram drafts and an EAGLE-3 head whose layer turns the same part of each head as its base
    (`partial_rotary_factor` in its config, which vLLM's Llama layer reads), saved and read back,
    leave greedy answers as plain decoding's."""
    from quantspec.infer.predictor import InferConfig, Predictor
    from quantspec.model_zoo.checkpoint import load_model
    from quantspec.model_zoo.eagle3 import load_eagle3, save_eagle3
    from quantspec.model_zoo.eagle3_train import init_eagle3

    base, _ = load_model(partial_dir)
    head = save_eagle3(init_eagle3(base, torch.arange(0, 512, 2), (0, 1, 2)), tmp_path / "eagle3")
    assert json.loads((head / "config.json").read_text())["partial_rotary_factor"] == 0.75
    assert load_eagle3(head).args.layer.rotary_dim == 12
    prompts = ["The quick brown fox", "Once upon a time"]  # within the 64 tokens of the original context
    runs = {}
    for method, extra in (("none", {}), ("inference_with_reference", {}),
                          ("eagle", {"draft_model": str(head), "speculate_tree": "2x2"})):
        config = InferConfig(model=str(partial_dir), max_new_tokens=12, max_length=64, speculate_method=method,
                             **extra)
        runs[method] = [o.token_ids for o in Predictor(config).generate(prompts)]
    assert runs["inference_with_reference"] == runs["eagle"] == runs["none"]


def test_mtp_on_a_partial_rotary_base_keeps_plain_greedy(partial_dir, tmp_path):
    """An MTP module of a partial-rotary base, saved and read back, turns the same part of each
    head; speculating with it leaves greedy answers as plain decoding's."""
    from quantspec.infer.predictor import InferConfig, Predictor
    from quantspec.model_zoo.checkpoint import load_model
    from quantspec.model_zoo.mtp import MTPArgs, save_mtp
    from quantspec.model_zoo.mtp_train import init_mtp

    base, _ = load_model(partial_dir)
    out = tmp_path / "mtp"
    save_mtp(init_mtp(base, torch.arange(base.args.vocab_size), seed=0), out)
    assert MTPArgs.from_config(json.loads((out / "config.json").read_text())).block.rotary_dim == 12
    runs = [[o.token_ids for o in Predictor(InferConfig(model=str(partial_dir), max_new_tokens=12, max_length=64,
                                                        speculate_method=m, **extra)).generate(["Once upon a time"])]
            for m, extra in (("none", {}), ("mtp", {"draft_model": str(out)}))]
    assert runs[0] == runs[1]


def test_ignore_takes_fused_units_whole(tiny_phi3_dir, tmp_path, logits_of):
    """`--ignore` names a fused module (the checkpoint's name) and it stays float, whole; a part of
    one is refused in one line naming the flag before any work, and nothing is written."""
    from click.testing import CliRunner

    from quantspec.cli import main

    fused = "model.layers.0.self_attn.qkv_proj"
    art = api.quantize(str(tiny_phi3_dir), "weight_only_int8", tmp_path / "w8", ignore=("lm_head", fused))
    names = _names(art)
    assert f"{fused}.weight" in names and f"{fused}.weight_packed" not in names
    assert "model.layers.1.self_attn.qkv_proj.weight_packed" in names
    assert json.loads((art / "config.json").read_text())["quantization_config"]["ignore"] == ["lm_head", fused]
    # the float linears stay Linears (quantspec's CPU kernels pack them otherwise)
    lm = load_for_inference(art, tokenizer=False, fuse=False, policy=DispatchPolicy(cpu_kernels=False))
    assert isinstance(lm.model.model.layers[0].self_attn.k_proj, torch.nn.Linear)
    torch.testing.assert_close(logits_of(lm.model, IDS), logits_of(art, IDS), **TOL)
    out = tmp_path / "refused"
    result = CliRunner().invoke(main, ["quantize", "--model", str(tiny_phi3_dir), "--quant-type", "weight_only_int8",
                                       "--ignore", "model.layers.0.self_attn.k_proj", "--out", str(out)])
    err = result.stderr.strip()
    assert result.exit_code == 2 and len(err.splitlines()) == 1 and "Traceback" not in result.output, result.output
    assert "--ignore names model.layers.0.self_attn.k_proj without the rest of" in err and f"name {fused}" in err
    assert not out.exists() and not any(p.name.startswith(".refused") for p in tmp_path.iterdir())
