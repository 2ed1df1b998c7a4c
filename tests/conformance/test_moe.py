"""A mixture of experts' fused-MoE layers against the engines' own decision code
(`lift_moe.py`): for every artifact type quantspec writes of a Qwen3-MoE model, and for one layout
it does not write (FP8 experts per channel with static inputs), the method vLLM's and SGLang's
code selects for each layer's experts, or its refusal, is the verdict `inspect` prints and
`quantize --target` refuses by."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from quantspec import api
from quantspec.model_zoo.tiny import build_tiny_model

from . import engines as eng

LIFT = Path(__file__).with_name("lift_moe.py")
MODEL_FILES = {"vllm": "vllm/model_executor/models/qwen3_moe.py", "sglang": "sglang/srt/models/qwen3_moe.py"}
LAYERS = ("model.layers.0.mlp.experts", "model.layers.1.mlp.experts")
# name → (quantize options, whether it needs the calibration table); all written whatever the
# engines say (target quantspec), so that every verdict meets the engines' code
ARTIFACTS = {
    "weight_only_int8": (dict(quant_type="weight_only_int8"), False),
    "weight_only_int4": (dict(quant_type="weight_only_int4", group_size=128), False),
    "weight_only_int4_asym": (dict(quant_type="weight_only_int4", group_size=128, symmetric=False), False),
    "a8w8_fp8": (dict(quant_type="a8w8_fp8", smoothquant_alpha="none", fallback_layers=0), True),
    "a8w8_fp8_dynamic": (dict(quant_type="a8w8_fp8", activations="dynamic"), False),
    "a8w8_dynamic": (dict(quant_type="a8w8", activations="dynamic"), False),
    "a8w8": (dict(quant_type="a8w8", smoothquant_alpha="none", fallback_layers=0), True),
}


@pytest.fixture(scope="module")
def moe_artifacts(tmp_path_factory, calibration_table) -> dict[str, Path]:
    """Hidden 192 (the experts' gate / up take g64 at --group-size 128), expert intermediate 128
    (down takes g128 alone): quantize gives each MoE layer one group size."""
    root = tmp_path_factory.mktemp("conf_moe")
    model = build_tiny_model(root / "model", "qwen3_moe", hidden=192, heads=4, kv_heads=2, intermediate=256)
    out = {}
    for name, (options, static) in ARTIFACTS.items():
        calib = calibration_table(model) if static else None
        out[name] = api.quantize(str(model), out=root / name, calib=calib, target="quantspec", **options)
    # what quantspec does not write: FP8 experts per channel with static per-tensor inputs
    other = root / "a8w8_fp8_channel_experts"
    shutil.copytree(out["a8w8_fp8"], other)
    cfg = json.loads((other / "config.json").read_text())
    del cfg["quantization_config"]["config_groups"]["experts"]
    (other / "config.json").write_text(json.dumps(cfg))
    out[other.name] = other
    return out


@pytest.fixture(scope="module")
def lifted_moe(engine_sources, moe_artifacts, tmp_path_factory) -> dict:
    configs = {n: json.loads((p / "config.json").read_text())["quantization_config"] for n, p in moe_artifacts.items()}

    def request(src):
        mapping = eng.class_literal((src.source / MODEL_FILES[src.engine]).read_text(), "Qwen3MoeForCausalLM",
                                    "packed_modules_mapping") or {}
        return {"capability": 90, "packed_modules_mapping": mapping,
                "artifacts": {n: {"quantization_config": c, "layers": list(LAYERS)} for n, c in configs.items()}}

    out = eng.run_engines(engine_sources, request, tmp_path_factory.mktemp("conf_lift_moe"), LIFT)
    return {e: r if isinstance(r, str) else r["result"] for e, r in out.items()}


@pytest.mark.parametrize("engine", list(eng.ENGINE_PINS))
@pytest.mark.parametrize("name", [*ARTIFACTS, "a8w8_fp8_channel_experts"])
def test_moe_verdict_matches_engine_code(lifted_moe, moe_artifacts, engine, name):
    if isinstance(lifted_moe[engine], str):
        pytest.skip(lifted_moe[engine])
    verdict = api.inspect(moe_artifacts[name])["engines"][engine]
    for layer in LAYERS:
        theirs, ours = lifted_moe[engine][name][layer], verdict["layers"][layer]
        if ours["scheme"] is None:
            assert theirs["method"] is None and theirs["error"], (layer, theirs, ours)
        else:
            want = f"CompressedTensors{ours['scheme']}" + ("Method" if engine == "vllm" else "")
            assert (theirs["method"], theirs["error"]) == (want, None), (layer, theirs, ours)


def test_portable_moe_artifacts_load_in_both_engines(lifted_moe):
    """What `--target portable` lets through for a mixture of experts loads in vLLM and SGLang:
    int8 / int4 weight-only (symmetric or not) and FP8, static or dynamic."""
    for engine, res in lifted_moe.items():
        if isinstance(res, str):
            pytest.skip(res)
        for name in ("weight_only_int8", "weight_only_int4", "weight_only_int4_asym", "a8w8_fp8", "a8w8_fp8_dynamic"):
            assert all(res[name][layer]["error"] is None for layer in LAYERS), (engine, name, res[name])
