"""Phi-3 artifacts (q/k/v stored as one `qkv_proj`, gate/up as one `gate_up_proj`) against the
engines' own code: both engines' registries build `Phi3ForCausalLM`, vLLM's Phi-3 class names its
fused modules as the checkpoint does (so the module names quantspec writes in `ignore` and the
config groups are the names its compressed-tensors matching compares), and the lifted decision
code (`lift.py`, with the Phi-3 class's `packed_modules_mapping`) picks a scheme for each fused
layer and loads its tensors, as the verdict `inspect` prints says.

The fused tensors go to the parameters' loaders as one shard spanning the layer's rows: what the
engines' fused linears do with a tensor fused on disk (`_load_fused_module_from_checkpoint`: the
rows cut per shard and loaded at their offsets, a per-tensor scale loaded as the first shard's)."""

from __future__ import annotations

import json

import pytest
import torch

from quantspec import api
from quantspec.model_zoo.tiny import build_tiny_model
from quantspec.quant.artifact import load_safetensors

from . import engines as eng
from .requests import artifact_verdicts, build_request, lifted_status

PHI3_FILES = {"vllm": "vllm/model_executor/models/phi3.py", "sglang": "sglang/srt/models/llama.py"}
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


def _packed(src) -> dict:
    """The Phi-3 class's `packed_modules_mapping` in the engine's source ({}: it declares none,
    and neither does the Llama class it inherits from)."""
    text = (src.source / PHI3_FILES[src.engine]).read_text()
    return eng.class_literal(text, "Phi3ForCausalLM", "packed_modules_mapping") or src.packed_modules_mapping()


@pytest.fixture(scope="module")
def phi3_artifacts(tmp_path_factory, calibration_table):
    root = tmp_path_factory.mktemp("conf_phi3")
    model = build_tiny_model(root / "phi3", "phi3", hidden=192, heads=4, kv_heads=2, intermediate=512)
    out = {}
    for name, (options, static) in ARTIFACTS.items():
        out[name] = api.quantize(str(model), out=root / name, calib=calibration_table(model) if static else None,
                                 target="quantspec", **options)
    return out


@pytest.fixture(scope="module")
def phi3_lifted(engine_sources, phi3_artifacts, tmp_path_factory):
    return eng.run_engines(engine_sources, lambda src: build_request(src, phi3_artifacts, 90, _packed(src)),
                           tmp_path_factory.mktemp("conf_phi3_lift"))


@pytest.mark.parametrize("engine", list(eng.ENGINE_PINS))
def test_engines_build_phi3_under_the_checkpoints_module_names(engine_sources, engine):
    src = engine_sources[engine]
    if isinstance(src, str):
        pytest.skip(src)
    assert "Phi3ForCausalLM" in src.architectures()
    packed = _packed(src)
    assert all(packed.get(m, [m]) == [m] for m in ("qkv_proj", "gate_up_proj")), packed


@pytest.mark.parametrize("engine", list(eng.ENGINE_PINS))
@pytest.mark.parametrize("name", list(ARTIFACTS))
def test_phi3_verdict_matches_engine_code(phi3_artifacts, phi3_lifted, engine, name):
    ans = phi3_lifted[engine]
    if isinstance(ans, str):
        pytest.skip(ans)
    res = ans["result"][name]
    path = phi3_artifacts[name]
    verdict = artifact_verdicts(path)[engine]
    status, per_layer = lifted_status(res)
    assert status == verdict.status, (verdict.line(), res)
    assert {"model.layers.0.self_attn.qkv_proj", "model.layers.1.mlp.gate_up_proj"} <= set(res["layers"])
    if name == "a8w8_fallback":  # a fused unit falls back: named in the config so as to match the fused module
        targets = [t for g in json.loads((path / "config.json").read_text())["quantization_config"]["config_groups"]
                   .values() for t in g["targets"]]
        assert any("qkv_proj" in t or "gate_up_proj" in t for t in targets), targets
    tensors = load_safetensors(path)
    for layer, r in res["layers"].items():
        assert per_layer[layer] == ("refused" if verdict.layers[layer].scheme is None and verdict.layers[layer].problem
                                    else "ignores" if verdict.layers[layer].problem else "loads"), (layer, r)
        if per_layer[layer] == "refused":
            continue
        for leaf, loaded in r["values"].items():  # the fused tensors' values, loaded whole
            want = tensors[f"{layer}.{leaf}"].to(getattr(torch, loaded["dtype"])).float().reshape(-1)
            got = torch.tensor(loaded["data"])
            assert torch.equal(got, want) or got.numel() == 1 and bool(torch.all(want == got)), (layer, leaf)
