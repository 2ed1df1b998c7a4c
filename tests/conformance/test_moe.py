"""A mixture of experts' fused-MoE layers against the engines' own decision code
(`lift_moe.py`): for every artifact type quantspec writes of a Qwen3-MoE model, the portable ones
of a Mixtral model (its experts named w1 / w3 / w2), and one layout quantspec does not write (FP8
experts per channel with static inputs), the method vLLM's and SGLang's
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
# the models' fused-MoE layers and the names the engines' model files give their experts' gate / up / down
MODELS = {"qwen3_moe": (("model.layers.0.mlp.experts", "model.layers.1.mlp.experts"),
                        ("gate_proj", "up_proj", "down_proj")),
          "mixtral": (("model.layers.0.block_sparse_moe.experts", "model.layers.1.block_sparse_moe.experts"),
                      ("w1", "w3", "w2"))}
MODEL_FILES = {"vllm": "vllm/model_executor/models/qwen3_moe.py", "sglang": "sglang/srt/models/qwen3_moe.py"}
# name → (quantize options, whether it needs the calibration table); all written whatever the
# engines say (target quantspec), so that every verdict meets the engines' code
ARTIFACTS = {
    "weight_only_int8": (dict(quant_type="weight_only_int8"), False),
    "weight_only_int4": (dict(quant_type="weight_only_int4", group_size=128), False),
    "weight_only_int4_asym": (dict(quant_type="weight_only_int4", group_size=128, symmetric=False), False),
    "a8w8_fp8": (dict(quant_type="a8w8_fp8", smoothquant_alpha="none", fallback_layers=0), True),
    "a8w8_fp8_dynamic": (dict(quant_type="a8w8_fp8", activations="dynamic"), False),
    "a8w8_dynamic": (dict(quant_type="a8w8", activations="dynamic"), False),
    "a8w8_fp8_block": (dict(quant_type="a8w8_fp8", weight_block=128), False),
    "a8w8": (dict(quant_type="a8w8", smoothquant_alpha="none", fallback_layers=0), True),
    "weight_only_nvfp4": (dict(quant_type="weight_only_nvfp4"), False),
    "nvfp4": (dict(quant_type="nvfp4"), True),
}
MIXTRAL_ARTIFACTS = ("weight_only_int4", "a8w8_fp8", "a8w8_fp8_dynamic", "a8w8_fp8_block", "nvfp4")
CASES = [("qwen3_moe", n) for n in [*ARTIFACTS, "a8w8_fp8_channel_experts"]] + \
    [("mixtral", n) for n in MIXTRAL_ARTIFACTS]


@pytest.fixture(scope="module")
def moe_artifacts(tmp_path_factory, calibration_table) -> dict[tuple[str, str], Path]:
    """Hidden 192 (the experts' gate / up take g64 at --group-size 128), expert intermediate 128
    (down takes g128 alone): quantize gives each MoE layer one group size."""
    root = tmp_path_factory.mktemp("conf_moe")
    out = {}
    for arch, intermediate in (("qwen3_moe", 256), ("mixtral", 128)):
        model = build_tiny_model(root / arch, arch, hidden=192, heads=4, kv_heads=2, intermediate=intermediate)
        for name, (options, static) in ARTIFACTS.items():
            if arch == "mixtral" and name not in MIXTRAL_ARTIFACTS:
                continue
            calib = calibration_table(model) if static else None
            out[arch, name] = api.quantize(str(model), out=root / f"{arch}.{name}", calib=calib, target="quantspec",
                                           **options)
    # what quantspec does not write: FP8 experts per channel with static per-tensor inputs
    other = root / "a8w8_fp8_channel_experts"
    shutil.copytree(out["qwen3_moe", "a8w8_fp8"], other)
    cfg = json.loads((other / "config.json").read_text())
    del cfg["quantization_config"]["config_groups"]["experts"]
    (other / "config.json").write_text(json.dumps(cfg))
    out["qwen3_moe", other.name] = other
    return out


@pytest.fixture(scope="module")
def lifted_moe(engine_sources, moe_artifacts, tmp_path_factory) -> dict:
    """engine → {(model, artifact): {layer: the engine's answer}} (or the skip reason)."""
    configs = {k: json.loads((p / "config.json").read_text())["quantization_config"] for k, p in moe_artifacts.items()}

    def request(src):
        mapping = eng.class_literal((src.source / MODEL_FILES[src.engine]).read_text(), "Qwen3MoeForCausalLM",
                                    "packed_modules_mapping") or {}
        return {"capability": 90, "packed_modules_mapping": mapping,
                "artifacts": {f"{arch}/{n}": {"quantization_config": c, "layers": list(MODELS[arch][0]),
                                              "ckpt_names": list(MODELS[arch][1])}
                              for (arch, n), c in configs.items()}}

    out = eng.run_engines(engine_sources, request, tmp_path_factory.mktemp("conf_lift_moe"), LIFT)
    return {e: r if isinstance(r, str) else {tuple(k.split("/")): v for k, v in r["result"].items()}
            for e, r in out.items()}


@pytest.mark.parametrize("engine", list(eng.ENGINE_PINS))
@pytest.mark.parametrize("case", CASES, ids=["/".join(c) for c in CASES])
def test_moe_verdict_matches_engine_code(lifted_moe, moe_artifacts, engine, case):
    if isinstance(lifted_moe[engine], str):
        pytest.skip(lifted_moe[engine])
    verdict = api.inspect(moe_artifacts[case])["engines"][engine]
    for layer in MODELS[case[0]][0]:
        theirs, ours = lifted_moe[engine][case][layer], verdict["layers"][layer]
        if ours["scheme"] is None:
            assert theirs["method"] is None and theirs["error"], (layer, theirs, ours)
        else:
            want = f"CompressedTensors{ours['scheme']}" + ("Method" if engine == "vllm" else "")
            assert (theirs["method"], theirs["error"]) == (want, None), (layer, theirs, ours)


def test_portable_moe_artifacts_load_in_both_engines(lifted_moe):
    """What `--target portable` lets through for a mixture of experts loads in vLLM and SGLang:
    int8 / int4 weight-only (symmetric or not), FP8 static or dynamic, NVFP4; Mixtral's too."""
    portable = ["weight_only_int8", "weight_only_int4", "weight_only_int4_asym", "a8w8_fp8", "a8w8_fp8_dynamic",
                "weight_only_nvfp4", "nvfp4"]
    for engine, res in lifted_moe.items():
        if isinstance(res, str):
            pytest.skip(res)
        for case in [("qwen3_moe", n) for n in portable] + [("mixtral", n) for n in MIXTRAL_ARTIFACTS]:
            assert all(res[case][layer]["error"] is None for layer in MODELS[case[0]][0]), (engine, case, res[case])


# docs/moe.md's table: row label → the artifacts it speaks for
DOC_ROWS = {"weight_only_int8 / int4 (sym or asym)": ("weight_only_int8", "weight_only_int4", "weight_only_int4_asym"),
            "a8w8_fp8, static or dynamic": ("a8w8_fp8", "a8w8_fp8_dynamic"),
            "a8w8 `--activations dynamic`": ("a8w8_dynamic",),
            "a8w8 static": ("a8w8",),
            "weight_only_nvfp4": ("weight_only_nvfp4",),
            "nvfp4": ("nvfp4",)}


def test_docs_moe_table_says_what_the_verdicts_say(moe_artifacts):
    """Each cell of docs/moe.md's table starts with the status every artifact of its row gets."""
    doc = (Path(__file__).parents[2] / "docs" / "moe.md").read_text()
    rows = {cells[0]: cells[1:] for line in doc.splitlines() if line.startswith("| ")
            for cells in [[c.strip() for c in line.strip("|").split("|")]]}
    assert set(DOC_ROWS) <= set(rows)
    for label, names in DOC_ROWS.items():
        for name in names:
            verdicts = api.inspect(moe_artifacts["qwen3_moe", name])["engines"]
            for engine, cell in zip(("vllm", "sglang", "transformers"), rows[label]):
                status = verdicts[engine]["status"]
                assert cell.split()[0] == status, (label, name, engine, cell)
