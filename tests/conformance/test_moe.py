"""A mixture of experts' fused-MoE layers against the engines' own decision code
(`lift_moe.py`): for every artifact type quantspec writes of a Qwen3-MoE model, the portable ones
of a Mixtral model (its experts named w1 / w3 / w2), and one layout quantspec does not write (FP8
experts per channel with static inputs), the method vLLM's and SGLang's
code selects for each layer's experts, or its refusal, is the verdict `inspect` prints and
`quantize --target` refuses by. For MXFP4 experts the methods' own `create_weights` runs too: its
parameters must take the experts' tensors quantspec writes (vLLM's do, SGLang's GPT-OSS ones do
not), and vLLM's experts kernel is checked by compute capability."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from quantspec import api
from quantspec.model_zoo.tiny import build_tiny_model

from . import engines as eng
from .requests import artifact_verdicts

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
    "weight_only_mxfp4": (dict(quant_type="weight_only_mxfp4"), False),
    "mxfp4": (dict(quant_type="mxfp4"), False),
}
MIXTRAL_ARTIFACTS = ("weight_only_int4", "a8w8_fp8", "a8w8_fp8_dynamic", "a8w8_fp8_block", "nvfp4",
                     "weight_only_mxfp4", "mxfp4")
MXFP4 = ("weight_only_mxfp4", "mxfp4")
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


def _experts(path: Path, arch: str) -> dict[str, dict[str, tuple[list[int], str]]]:
    """Expert 0's quantized tensors in layer 0 of the artifact at `path`: projection → {leaf: (shape, dtype)}."""
    from safetensors import safe_open

    layer = MODELS[arch][0][0]
    out: dict[str, dict] = {proj: {} for proj in MODELS[arch][1]}  # gate, up, down
    with safe_open(str(path / "model.safetensors"), framework="pt") as h:
        for k in h.keys():
            for proj in MODELS[arch][1]:
                if k.startswith(f"{layer}.0.{proj}."):
                    sl = h.get_slice(k)
                    out[proj][k.rsplit(".", 1)[1]] = (list(sl.get_shape()), _DTYPES[sl.get_dtype()])
    return out


_DTYPES = {"U8": "uint8", "F32": "float32", "BF16": "bfloat16", "F16": "float16", "I32": "int32"}


def _moe_request(moe_artifacts: dict, names, capability: int):
    """`lift_moe.py`'s request for the artifacts `names` ((model, artifact) pairs) on a GPU of
    `capability`; an MXFP4 artifact's with its experts' sizes, so its method makes its parameters."""
    def request(src):
        mapping = eng.class_literal((src.source / MODEL_FILES[src.engine]).read_text(), "Qwen3MoeForCausalLM",
                                    "packed_modules_mapping") or {}
        arts = {}
        for arch, n in names:
            path = moe_artifacts[arch, n]
            art = arts[f"{arch}/{n}"] = {"quantization_config": json.loads((path / "config.json").read_text())[
                "quantization_config"], "layers": list(MODELS[arch][0]), "ckpt_names": list(MODELS[arch][1])}
            if n in MXFP4:
                gate, down = (_experts(path, arch)[p]["weight_packed"][0] for p in MODELS[arch][1][::2])
                num = len({k.split(".")[5] for k in _keys(path) if k.startswith(MODELS[arch][0][0] + ".")})
                art["experts"] = {"num_experts": num, "hidden": down[0], "intermediate": gate[0]}
        return {"capability": capability, "packed_modules_mapping": mapping, "artifacts": arts}
    return request


def _keys(path: Path) -> list[str]:
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), framework="pt") as h:
        return list(h.keys())


@pytest.fixture(scope="module")
def lifted_moe(engine_sources, moe_artifacts, tmp_path_factory) -> dict:
    """engine → {(model, artifact): {layer: the engine's answer}} (or the skip reason)."""
    out = eng.run_engines(engine_sources, _moe_request(moe_artifacts, moe_artifacts, 90),
                          tmp_path_factory.mktemp("conf_lift_moe"), LIFT)
    return {e: r if isinstance(r, str) else {tuple(k.split("/")): v for k, v in r["result"].items()}
            for e, r in out.items()}


def _unloaded(theirs: dict, experts: dict) -> list[str]:
    """The checkpoint's expert tensors (`_experts`: gate, up, down) that no parameter the engine's method made
    (`theirs["params"]`) takes by name, shape and dtype. Both engines load a checkpoint's
    experts.<e>.<gate|up>.<leaf> into the fused layer's w13_<leaf> (rows: gate's, then up's) and
    <down>.<leaf> into w2_<leaf> (vLLM `RoutedExperts.build_expert_params_mapping`, SGLang
    `FusedMoE.make_expert_params_mapping`)."""
    out = []
    for i, (proj, leaves) in enumerate(experts.items()):
        for leaf, (shape, dtype) in leaves.items():
            name = f"{'w2' if i == 2 else 'w13'}_{leaf}"
            want = shape if i == 2 else [2 * shape[0], *shape[1:]]
            got = theirs["params"].get(name)
            if got is None or got[0][1:] != want or got[1] != dtype:
                out.append(f"{proj}.{leaf} → {name}: {got}")
    return out


@pytest.mark.parametrize("engine", list(eng.ENGINE_PINS))
@pytest.mark.parametrize("case", CASES, ids=["/".join(c) for c in CASES])
def test_moe_verdict_matches_engine_code(lifted_moe, moe_artifacts, engine, case):
    if isinstance(lifted_moe[engine], str):
        pytest.skip(lifted_moe[engine])
    verdict = api.inspect(moe_artifacts[case])["engines"][engine]
    for layer in MODELS[case[0]][0]:
        theirs, ours = lifted_moe[engine][case][layer], verdict["layers"][layer]
        if ours["scheme"] is None and "params" in theirs:  # refused where the weights load
            assert _unloaded(theirs, _experts(moe_artifacts[case], case[0])), (layer, theirs, ours)
        elif ours["scheme"] is None:
            assert theirs["method"] is None and theirs["error"], (layer, theirs, ours)
        else:
            want = f"CompressedTensors{ours['scheme']}" + ("Method" if engine == "vllm" else "")
            assert (theirs["method"], theirs["error"]) == (want, None), (layer, theirs, ours)
            if "params" in theirs:
                assert not _unloaded(theirs, _experts(moe_artifacts[case], case[0])), (layer, theirs)


# vLLM's MXFP4 experts by compute capability (`lift_moe._cutlass_mxfp4_oracle`): CUTLASS W4A4 on
# 10.x-11.x, Marlin (weight-only) elsewhere
MXFP4_EXPERTS = {80: "MarlinExperts", 90: "MarlinExperts", 100: "CutlassExpertsMxfp4", 120: "MarlinExperts"}


def test_mxfp4_experts_by_capability_match_engine_code(engine_sources, moe_artifacts, tmp_path):
    """MXFP4 experts, Qwen3-MoE's and Mixtral's, by compute capability: vLLM's MXFP4 MoE method
    makes parameters that take every expert tensor quantspec writes (names, shapes, dtypes) and
    runs CUTLASS W4A4 experts on Blackwell 10.x (quantizing a weight-only checkpoint's inputs
    too) and Marlin experts elsewhere (setting `mxfp4`'s input quantization aside), as the
    verdicts say; SGLang's Mxfp4MoEMethod makes GPT-OSS's parameters, which take none of the
    experts' weight_packed, on every GPU, and its fused-MoE name mapping is the one `_unloaded` reads."""
    cases = [(arch, n) for arch in MODELS for n in MXFP4]
    for cap, kernel in MXFP4_EXPERTS.items():
        (tmp_path / str(cap)).mkdir()
        out = eng.run_engines(engine_sources, _moe_request(moe_artifacts, cases, cap), tmp_path / str(cap), LIFT)
        for engine, ans in out.items():
            if isinstance(ans, str):
                pytest.skip(ans)
            for arch, n in cases:
                ours = artifact_verdicts(moe_artifacts[arch, n], capability=cap)[engine].layers[MODELS[arch][0][0]]
                status = "refused" if ours.scheme is None else "ignores" if ours.problem else "loads"
                theirs = ans["result"][f"{arch}/{n}"][MODELS[arch][0][0]]
                unloaded = _unloaded(theirs, _experts(moe_artifacts[arch, n], arch))
                if engine == "sglang":
                    assert theirs["method"] == "Mxfp4MoEMethod" and unloaded == \
                        [f"{p}.weight_packed → {w}_weight_packed: None"
                         for p, w in zip(MODELS[arch][1], ("w13", "w13", "w2"))], (cap, arch, n, unloaded)
                    assert status == "refused", ours
                    continue
                assert (theirs["method"], theirs["experts"], unloaded) == \
                    ("CompressedTensorsW4A4Mxfp4MoEMethod", kernel, []), (cap, arch, n, theirs)
                w4a4 = kernel == "CutlassExpertsMxfp4"  # runs MXFP4 inputs, whatever the checkpoint says
                assert status == ("loads" if w4a4 == (n == "mxfp4") else "ignores"), (cap, n, ours)
    sglang = engine_sources["sglang"]
    if not isinstance(sglang, str):
        layer = (sglang.source / "sglang/srt/layers/moe/fused_moe_triton/layer.py").read_text()
        assert '"experts.w13_"' in layer and 'f"experts.{expert_id}.{weight_name}."' in layer


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
            "nvfp4": ("nvfp4",),
            "weight_only_mxfp4": ("weight_only_mxfp4",),
            "mxfp4": ("mxfp4",)}


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
