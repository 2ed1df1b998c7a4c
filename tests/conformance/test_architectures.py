"""Artifacts of the architectures that vLLM and SGLang build with model classes of their own beyond
Llama's, against the engines' own code: Phi-3 (q/k/v stored as one `qkv_proj`, gate/up as one
`gate_up_proj`), Granite, OLMo 2 (SGLang's class; vLLM builds OLMo 2 through its Transformers
backend) and Gemma 2 / 3 (their norms, window layers and soft caps). Both engines' registries build each class; vLLM's Phi-3 class names
its fused modules as the checkpoint does (so the module names quantspec writes in `ignore` and the
config groups are the names its compressed-tensors matching compares); and the lifted decision
code (`lift.py`, with the class's own `packed_modules_mapping`) picks a scheme for each layer and
loads its tensors, as the verdict `inspect` prints says.

A Phi-3 layer's fused tensors go to the parameters' loaders as one shard spanning the layer's
rows: what the engines' fused linears do with a tensor fused on disk
(`_load_fused_module_from_checkpoint`: the rows cut per shard and loaded at their offsets, a
per-tensor scale loaded as the first shard's)."""

from __future__ import annotations

import json

import pytest
import torch

from quantspec import api
from quantspec.model_zoo.tiny import build_tiny_model
from quantspec.quant.artifact import load_safetensors
from quantspec.quant.engines import engine_layers

from . import engines as eng
from .requests import artifact_tensors, artifact_verdicts, build_request, lifted_status

# arch → (HF class, the file of each engine that defines it)
MODELS = {"phi3": ("Phi3ForCausalLM", {"vllm": "vllm/model_executor/models/phi3.py",
                                       "sglang": "sglang/srt/models/llama.py"}),
          "granite": ("GraniteForCausalLM", {"vllm": "vllm/model_executor/models/granite.py",
                                             "sglang": "sglang/srt/models/granite.py"}),
          # vLLM's registry maps Olmo2ForCausalLM to its Transformers backend: no class of its own to lift
          "olmo2": ("Olmo2ForCausalLM", {"sglang": "sglang/srt/models/olmo2.py"}),
          "gemma2": ("Gemma2ForCausalLM", {"vllm": "vllm/model_executor/models/gemma2.py",
                                           "sglang": "sglang/srt/models/gemma2.py"}),
          "gemma3": ("Gemma3ForCausalLM", {"vllm": "vllm/model_executor/models/gemma3.py",
                                           "sglang": "sglang/srt/models/gemma3_causal.py"})}
ARTIFACTS = {
    "weight_only_int8": (dict(quant_type="weight_only_int8"), False),
    "weight_only_int4": (dict(quant_type="weight_only_int4", group_size=128), False),
    "weight_only_int4_asym": (dict(quant_type="weight_only_int4", group_size=128, symmetric=False), False),
    # 5 of the 8 units fall back: at least one fused unit (2 layers × o_proj, down_proj unfused)
    "a8w8_fallback": (dict(quant_type="a8w8", smoothquant_alpha="none", fallback_layers=5), True),
    "a8w8_fp8_kv_fp8": (dict(quant_type="a8w8_fp8", smoothquant_alpha="none", fallback_layers=0, kv_cache="fp8"),
                        True),
    "a8w8_dynamic": (dict(quant_type="a8w8", activations="dynamic"), False),
}


def _packed(src, arch: str) -> dict:
    """The class's `packed_modules_mapping` in the engine's source ({}: it declares none, and
    neither does the Llama class it inherits from)."""
    cls, files = MODELS[arch]
    text = (src.source / files[src.engine]).read_text()
    return eng.class_literal(text, cls, "packed_modules_mapping") or src.packed_modules_mapping()


@pytest.fixture(scope="module", params=list(MODELS))
def arch_artifacts(request, tmp_path_factory, calibration_table):
    """(arch, {artifact name: path}) of a hidden-192 model of each architecture."""
    root = tmp_path_factory.mktemp(f"conf_{request.param}")
    model = build_tiny_model(root / request.param, request.param, hidden=192, heads=4, kv_heads=2, intermediate=512)
    out = {}
    for name, (options, static) in ARTIFACTS.items():
        out[name] = api.quantize(str(model), out=root / name, calib=calibration_table(model) if static else None,
                                 target="quantspec", **options)
    return request.param, out


@pytest.fixture(scope="module")
def arch_lifted(engine_sources, arch_artifacts, tmp_path_factory):
    arch, artifacts = arch_artifacts
    cls, files = MODELS[arch]
    sources = {e: src if isinstance(src, str) or e in files else f"{e} builds {cls} through its Transformers backend"
               for e, src in engine_sources.items()}
    return eng.run_engines(sources, lambda src: build_request(src, artifacts, 90, _packed(src, arch)),
                           tmp_path_factory.mktemp(f"conf_{arch}_lift"))


@pytest.mark.parametrize("engine", list(eng.ENGINE_PINS))
@pytest.mark.parametrize("arch", list(MODELS))
def test_engines_build_the_class(engine_sources, engine, arch):
    src = engine_sources[engine]
    if isinstance(src, str):
        pytest.skip(src)
    assert MODELS[arch][0] in src.architectures()
    if arch == "phi3":  # the checkpoint's fused names are the engine's module names
        packed = _packed(src, arch)
        assert all(packed.get(m, [m]) == [m] for m in ("qkv_proj", "gate_up_proj")), packed


@pytest.mark.parametrize("engine", list(eng.ENGINE_PINS))
@pytest.mark.parametrize("name", list(ARTIFACTS))
def test_verdict_matches_engine_code(arch_artifacts, arch_lifted, engine, name):
    ans = arch_lifted[engine]
    if isinstance(ans, str):
        pytest.skip(ans)
    res = ans["result"][name]
    path = arch_artifacts[1][name]
    verdict = artifact_verdicts(path)[engine]
    status, per_layer = lifted_status(res)
    assert status == verdict.status, (verdict.line(), res)
    assert {"model.layers.0.self_attn.qkv_proj", "model.layers.1.mlp.gate_up_proj"} <= set(res["layers"])
    if name == "a8w8_fallback":  # a fused unit falls back: named in the config so as to match the fused module
        targets = [t for g in json.loads((path / "config.json").read_text())["quantization_config"]["config_groups"]
                   .values() for t in g["targets"]]
        assert any("qkv_proj" in t or "gate_up_proj" in t for t in targets), targets
    tensors = load_safetensors(path)
    shards = engine_layers(sorted(artifact_tensors(path)))
    for layer, r in res["layers"].items():
        assert per_layer[layer] == ("refused" if verdict.layers[layer].scheme is None and verdict.layers[layer].problem
                                    else "ignores" if verdict.layers[layer].problem else "loads"), (layer, r)
        if per_layer[layer] == "refused":
            continue
        for leaf, loaded in r["values"].items():  # the shards' values (a fused one's whole), in order
            want = torch.cat([tensors[f"{s}.{leaf}"].to(getattr(torch, loaded["dtype"])).float().reshape(-1)
                              for s in shards[layer]])
            got = torch.tensor(loaded["data"])
            assert torch.equal(got, want) or got.numel() == 1 and bool(torch.all(want == got)), (layer, leaf)
