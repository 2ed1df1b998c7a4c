"""Mixed precision (`quantize --layer-quant-type TARGET=QUANT_TYPE`): the named Linears take another
weight-only type in their own config group. transformers, through compressed-tensors, runs the
artifact to quantspec's logits; every Linear holds its own type's tensors; vLLM's and SGLang's
verdicts (`inspect`) are per layer; targets that name nothing or split a fused layer are refused
before any work."""

import json

import pytest
import torch
from safetensors.torch import load_file

from quantspec import api
from quantspec.errors import QuantSpecError
from quantspec.quant.artifact import read_quant_config

IDS = torch.tensor([7, 300, 41, 12, 99, 5, 260, 17, 33, 2, 150, 8, 71])
DOWN_INT8 = r"re:.*mlp\.down_proj$=weight_only_int8"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    from quantspec.model_zoo.tiny import TINY_CORPUS

    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_text(TINY_CORPUS * 2)
    return path


def _tensors(art) -> dict:
    out = {}
    for f in sorted(art.glob("*.safetensors")):
        out.update(load_file(f))
    return out


@pytest.mark.parametrize("quant_type, layers, method, want", [
    ("weight_only_int4", (DOWN_INT8,), "rtn", {"q_proj": 4, "o_proj": 4, "gate_proj": 4, "down_proj": 8}),
    ("weight_only_int4", (DOWN_INT8, "model.layers.1.self_attn.o_proj=weight_only_int8"), "awq",
     {"q_proj": 4, "o_proj": (4, 8), "gate_proj": 4, "down_proj": 8}),
    ("weight_only_int8", (r"re:.*mlp\.(gate|up)_proj$=weight_only_int4",), "gptq",
     {"q_proj": 8, "o_proj": 8, "gate_proj": 4, "up_proj": 4, "down_proj": 8}),
])
def test_mixed_artifact_runs_in_transformers_as_in_quantspec(tiny_llama_dir, tmp_path, corpus, quant_type, layers,
                                                             method, want, artifact_runs_as_in_transformers):
    options = {"dataset": str(corpus), "num_samples": 4, "seq_len": 32} if method != "rtn" else {}
    art = artifact_runs_as_in_transformers(tiny_llama_dir, quant_type, tmp_path / "art", IDS, group_size=32,
                                           layer_quant_types=layers, method=method, **options)
    qc = json.loads((art / "config.json").read_text())["quantization_config"]
    assert len(qc["config_groups"]) == 1 + len(layers) and qc["format"] == "pack-quantized"  # int4 and int8 alike
    tensors, config = _tensors(art), read_quant_config(art)
    for i in range(2):
        for short, bits in want.items():
            bits = bits[i] if isinstance(bits, tuple) else bits  # (layer 0's, layer 1's)
            name = next(f"model.layers.{i}.{p}.{short}" for p in ("self_attn", "mlp")
                        if f"model.layers.{i}.{p}.{short}.weight_packed" in tensors)
            assert config.weight_args_for(name).num_bits == bits, name
            # int32 words of 32 / bits codes
            assert tensors[f"{name}.weight_packed"].shape[1] == tensors[f"{name}.weight_shape"][1] * bits // 32


def test_engine_verdicts_are_per_layer(tiny_llama_dir, tmp_path):
    """Both engines load int4 layers beside int8 ones (a scheme per layer); SGLang refuses the
    MXFP4 one (no MXFP4 Linear scheme) while vLLM loads it: `inspect`'s verdicts say so per layer."""
    art = api.quantize(str(tiny_llama_dir), "weight_only_int4", tmp_path / "art", group_size=32,
                       layer_quant_types=(DOWN_INT8, r"re:.*o_proj$=weight_only_mxfp4"), target="vllm")
    engines = api.inspect(art)["engines"]
    vllm, sglang = engines["vllm"], engines["sglang"]
    assert vllm["status"] == "loads", vllm["verdict"]
    assert vllm["layers"]["model.layers.0.mlp.down_proj"]["num_bits"] == 8
    assert vllm["layers"]["model.layers.0.self_attn.qkv_proj"]["num_bits"] == 4
    assert vllm["layers"]["model.layers.0.self_attn.o_proj"]["scheme"] == "W4A4Mxfp4"
    assert sglang["status"] == "refused" and "MXFP4" in sglang["verdict"]
    assert sglang["layers"]["model.layers.0.mlp.down_proj"]["problem"] is None


def test_portable_target_refuses_a_layer_type_one_engine_cannot_run(tiny_llama_dir, tmp_path):
    with pytest.raises(QuantSpecError, match="--target"):
        api.quantize(str(tiny_llama_dir), "weight_only_int4", tmp_path / "art",
                     layer_quant_types=(r"re:.*o_proj$=weight_only_mxfp4",))
    assert not (tmp_path / "art").exists()


@pytest.mark.parametrize("layers, match", [
    ((r"re:.*self_attn\.q_proj$=weight_only_int8",), "qkv_proj"),  # q without k and v
    ((r"re:.*mlp\.gate_proj$=weight_only_int8",), "gate_up_proj"),
    ((r"re:.*nothing_here$=weight_only_int8",), "names no quantized Linear"),
    (("re:.*down_proj$=weight_only_int8", "re:.*down_proj$=weight_only_int4"), "twice"),
])
def test_refused_before_any_work(tiny_llama_dir, tmp_path, layers, match):
    with pytest.raises(QuantSpecError, match=match):
        api.quantize(str(tiny_llama_dir), "weight_only_int4", tmp_path / "art", layer_quant_types=layers)
    assert not (tmp_path / "art").exists()


@pytest.mark.parametrize("spec, quant_type, match", [
    ("re:.*down_proj$", "weight_only_int4", "TARGET=QUANT_TYPE"),
    ("re:.*down_proj$=int3", "weight_only_int4", "need no calibration table"),
    ("re:.*down_proj$=nvfp4", "weight_only_int4", "need no calibration table"),
    ("re:(.*down_proj$=weight_only_int8", "weight_only_int4", "not a regex"),
    ("re:.*down_proj$=weight_only_int8", "a8w8_fp8", "--activations dynamic"),
    ("re:.*down_proj$=weight_only_int8", "a8w8", "--activations dynamic"),
])
def test_bad_specs(spec, quant_type, match, tmp_path):
    with pytest.raises(QuantSpecError, match=match):
        api.quantize("smollm2-135m", quant_type, tmp_path / "art", layer_quant_types=(spec,))


@pytest.mark.parametrize("quant_type, layers, method, want", [
    # llm-compressor's FP8_DYNAMIC attention beside W4A16 MLPs
    ("weight_only_int4", (r"re:.*self_attn\.[qkvo]_proj$=a8w8_fp8",), "rtn",
     {"q_proj": ("float", True), "o_proj": ("float", True), "gate_proj": ("int", False)}),
    # W8A8 (int8, per-token inputs) with W4A16 MLPs, GPTQ on both
    ("a8w8", (r"re:.*mlp\.(gate|up|down)_proj$=weight_only_int4",), "gptq",
     {"q_proj": ("int", True), "down_proj": ("int", False)}),
    # FP8 blocks with MXFP4 (W4A4, MX inputs at run time) MLPs
    ("a8w8_fp8", (r"re:.*mlp\.(gate|up|down)_proj$=mxfp4",), "rtn",
     {"q_proj": ("float", True), "up_proj": ("float", True)}),
])
def test_layers_with_inputs_quantized_at_run_time(tiny_llama_dir, tmp_path, corpus, quant_type, layers, method,
                                                  want, artifact_runs_as_in_transformers):
    """Layer types whose inputs are quantized at run time need no table, so they mix like weight-only
    ones: transformers, through compressed-tensors, runs the artifact to quantspec's logits, each
    Linear holds its own scheme, and both engines (vLLM alone for MXFP4, whose inputs it quantizes on
    Blackwell only) load it per layer."""
    options = {"dataset": str(corpus), "num_samples": 4, "seq_len": 32} if method != "rtn" else {}
    if quant_type != "weight_only_int4":
        options.update(activations="dynamic") if quant_type == "a8w8" else options.update(weight_block=32)
    if any("mxfp4" in spec for spec in layers):
        options.update(target="vllm")
    art = api.quantize(str(tiny_llama_dir), quant_type, tmp_path / "art", group_size=32, method=method,
                       layer_quant_types=layers, **options) if "mxfp4" in layers[0] else \
        artifact_runs_as_in_transformers(tiny_llama_dir, quant_type, tmp_path / "art", IDS, group_size=32,
                                         method=method, layer_quant_types=layers, **options)
    config = read_quant_config(art)
    for short, (kind, inputs) in want.items():
        name = f"model.layers.1.{'self_attn' if short[0] in 'qkvo' else 'mlp'}.{short}"
        scheme = config.scheme_for(name)
        assert scheme.weights.type == kind and (scheme.input_activations is not None) == inputs, name
        assert scheme.input_activations is None or scheme.input_activations.dynamic
    engines = api.inspect(art)["engines"]
    if "mxfp4" in layers[0]:  # below Blackwell vLLM runs MXFP4 weights with float inputs, as for an mxfp4 model
        assert engines["vllm"]["status"] == "ignores" and "MXFP4 input" in engines["vllm"]["verdict"]
        assert engines["vllm"]["layers"]["model.layers.0.self_attn.qkv_proj"]["problem"] is None
    else:
        assert engines["vllm"]["status"] == engines["sglang"]["status"] == "loads", engines


@pytest.mark.parametrize("quant_type, layers, method, match", [
    ("weight_only_int4", (r"re:.*self_attn\.[qkvo]_proj$=a8w8_fp8",), "awq", "integer or FP4 weights"),
    ("weight_only_int4", (r"re:.*self_attn\.[qkvo]_proj$=mxfp4",), "awq", "weight-only layers"),
])
def test_methods_refuse_the_layers_they_have_no_rule_for(tiny_llama_dir, tmp_path, corpus, quant_type, layers,
                                                         method, match):
    with pytest.raises(QuantSpecError, match=match):
        api.quantize(str(tiny_llama_dir), quant_type, tmp_path / "art", method=method, dataset=str(corpus),
                     layer_quant_types=layers)
    assert not (tmp_path / "art").exists()


@pytest.mark.parametrize("target, layers", [(r"re:.*self_attn\.(q|k|v)_proj$", (0, 1)),
                                           ("model.layers.0.self_attn.qkv_proj", (0,))])
def test_phi3_fused_checkpoint(tiny_phi3_dir, tmp_path, artifact_runs_as_in_transformers, target, layers):
    """Phi-3 stores q / k / v and gate / up fused: a target naming the whole unit, by its parts or
    by the checkpoint's own name, writes it whole, in the checkpoint's layout, at its own type."""
    art = artifact_runs_as_in_transformers(tiny_phi3_dir, "weight_only_int4", tmp_path / "art", IDS, group_size=32,
                                           layer_quant_types=(f"{target}=weight_only_int8",))
    config, tensors = read_quant_config(art), _tensors(art)
    for i in range(2):
        assert config.weight_args_for(f"model.layers.{i}.self_attn.qkv_proj").num_bits == (8 if i in layers else 4)
    assert config.weight_args_for("model.layers.0.mlp.gate_up_proj").num_bits == 4
    assert "model.layers.0.self_attn.qkv_proj.weight_packed" in tensors


def test_mixture_of_experts(tmp_path):
    """Dense Linears of a mixture of experts take their own type; a target naming experts is
    refused (they take the model's --quant-type)."""
    from quantspec.model_zoo.tiny import build_tiny_model

    d = build_tiny_model(tmp_path / "moe", "qwen3_moe")
    art = api.quantize(str(d), "weight_only_int4", tmp_path / "art", group_size=32,
                       layer_quant_types=(r"re:.*self_attn\.o_proj$=weight_only_int8",))
    config = read_quant_config(art)
    assert config.weight_args_for("model.layers.0.self_attn.o_proj").num_bits == 8
    assert config.weight_args_for("model.layers.0.mlp.experts.1.down_proj").num_bits == 4
    assert api.inspect(art)["engines"]["vllm"]["status"] == "loads"
    for target in ("re:.*down_proj$", r"re:.*mlp\.experts\..*"):  # experts take --quant-type
        with pytest.raises(QuantSpecError, match="experts"):
            api.quantize(str(d), "weight_only_int4", tmp_path / "art2", layer_quant_types=(f"{target}=weight_only_int8",))
        assert not (tmp_path / "art2").exists()
