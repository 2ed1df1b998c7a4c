"""An EAGLE-3 head written by quantspec, built and loaded by vLLM's and SGLang's own EAGLE-3 model
code (`lift_eagle3.py`): the engines size every module from its config.json as quantspec does,
their `load_weights` puts every tensor somewhere (q/k/v and gate/up into their stacked shards),
leaves only the embedding to be shared from the target, and maps the draft vocabulary to the
same target ids; their aux-layer choice agrees with quantspec's on the default layers.

Quantized on its own: the engines build the head's layers under the names and with the draft's
quantization config that `quant.engines.drafts.EAGLE3_LAYERS` says (SGLang's `fc` a plain
`torch.nn.Linear`), their compressed-tensors decision code (`lift.py`) picks per layer what the
verdicts say, and SGLang's `load_weights` passes a quantized `fc` by."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from quantspec.model_zoo.eagle3 import default_aux_layers
from quantspec.quant.engines.drafts import EAGLE3_LAYERS, SGLANG_EAGLE3_FC

from .conftest import EAGLE3_AUX as AUX
from .requests import artifact_tensors, artifact_verdicts, eagle3_request, lifted_status

LIFT = Path(__file__).with_name("lift_eagle3.py")


def _lift(src, path: Path, args) -> dict:
    r = subprocess.run([sys.executable, str(LIFT), src.engine, str(src.source), str(path), str(args.num_layers),
                        str(args.vocab_size)], capture_output=True, text=True, timeout=600)
    if r.returncode != 0 or not r.stdout.strip():
        raise RuntimeError(f"lift_eagle3.py {src.engine} failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout)


@pytest.fixture(scope="session")
def engine_eagle3(engine_sources, eagle3_head) -> dict:
    path, _, args = eagle3_head
    return {e: src if isinstance(src, str) else _lift(src, path, args) for e, src in engine_sources.items()}


def _lifted(engine_eagle3, engine):
    res = engine_eagle3[engine]
    if isinstance(res, str):
        pytest.skip(res)
    assert "fatal" not in res, res.get("fatal")
    return res


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_engine_builds_and_loads_the_head(engine_eagle3, eagle3_head, engine):
    res = _lifted(engine_eagle3, engine)["result"]
    _, head, args = eagle3_head
    D, Vd = args.hidden_size, head.args.draft_vocab_size
    params, loads = res["params"], res["loads"]
    p = "model.layers.0."
    assert params["model.fc.weight"] == [D, 3 * D]  # three aux hidden states of the target's width
    assert params[p + "self_attn.qkv_proj.weight"][1] == 2 * D  # [embedding ; hidden]
    assert p + "hidden_norm.weight" in params and params["lm_head.weight"] == [Vd, D]
    # every parameter but the embedding comes from the head; the embedding is the target's
    assert set(loads) == set(params) - {"model.embed_tokens.weight"}
    assert res["nan_left"] == ["model.embed_tokens.weight"]
    assert sorted(s for s, _ in loads[p + "self_attn.qkv_proj.weight"]) == ["k", "q", "v"]
    assert sorted(s for s, _ in loads[p + "mlp.gate_up_proj.weight"]) == [0, 1]
    assert all(len(v) == 1 for k, v in loads.items() if "qkv" not in k and "gate_up" not in k)
    assert res["sample"]["model.fc.weight"] == pytest.approx(float(head.fc.weight.detach().sum()))
    targets = head.target_ids(torch.arange(Vd)).tolist()
    if engine == "vllm":  # vLLM keeps d2t as offsets: target = draft + d2t
        assert [i + d for i, d in enumerate(res["draft_id_to_target_id"])] == targets
    else:  # SGLang turns d2t into the hot token ids
        assert res["hot_token_id"] == targets


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_engine_aux_layers(engine_eagle3, engine):
    """Both engines take quantspec's default layers (2, L // 2, L - 3) when the config names none
    (vLLM: inputs of those layers; SGLang: `layers_to_capture`, captured at their input too).
    Explicit ids are read as written by vLLM, one layer later by SGLang: why a head on the
    default layers writes none."""
    aux = _lifted(engine_eagle3, engine)["aux"]
    assert aux["default"] == list(default_aux_layers(30))
    assert aux["from_config"] == (list(AUX) if engine == "vllm" else [i + 1 for i in AUX])


# where the engines' Llama files put a decoder layer's o_proj, gate_up_proj and down_proj under the
# prefix the layer (vLLM: attention and MLP too) is built with: the code they are named by
LLAMA_PREFIXES = {"vllm": ('prefix=f"{prefix}.self_attn"', 'prefix=f"{prefix}.o_proj"', 'prefix=f"{prefix}.mlp"',
                           'prefix=f"{prefix}.gate_up_proj"', 'prefix=f"{prefix}.down_proj"'),
                  "sglang": ('prefix=add_prefix("self_attn", prefix)', 'prefix=add_prefix("o_proj", prefix)',
                             'prefix=add_prefix("gate_up_proj", prefix)', 'prefix=add_prefix("down_proj", prefix)')}


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_engine_names_and_quantizes_the_head_layers_as_the_verdicts_say(engine_eagle3, engine_sources,
                                                                       eagle3_head, engine):
    """The names under which the engine's EAGLE-3 code builds the head's linears (the names its
    compressed-tensors config is matched against) are `EAGLE3_LAYERS`' — not the checkpoint's
    `midlayer.…` — and each gets the draft's quantization config, except SGLang's `fc`: a plain
    `torch.nn.Linear` (`SGLANG_EAGLE3_FC`)."""
    res = _lifted(engine_eagle3, engine)["result"]
    args = eagle3_head[2]
    built: dict[str, list[dict]] = {}
    for b in res["built"]:
        built.setdefault(b["role"], []).append(b)
    llama = engine_sources[engine].model_source()
    assert all(piece in llama for piece in LLAMA_PREFIXES[engine]), engine
    (layer,) = built["LlamaDecoderLayer"]
    (qkv,), (lm_head,) = built["QKVParallelLinear"], built["ParallelLMHead"]
    p = layer["prefix"]
    names = {qkv["prefix"], f"{p}.self_attn.o_proj", lm_head["prefix"]}
    if engine == "vllm":
        (fc,) = built["ReplicatedLinear"]
        names |= {f"{p}.mlp.gate_up_proj", f"{p}.mlp.down_proj", fc["prefix"]}
        assert res["fc_class"].endswith(".RecordedLinear")  # the ReplicatedLinear stand-in
    else:
        (mlp,) = built["LlamaMLP"]
        names |= {f"{mlp['prefix']}.gate_up_proj", f"{mlp['prefix']}.down_proj"}
        assert res["fc_class"] == "torch.nn.modules.linear.Linear" and "ReplicatedLinear" not in built
        assert "builds fc as a plain torch.nn.Linear without quant_config" in SGLANG_EAGLE3_FC
    assert names == {n.format(L=args.num_layers) for n in EAGLE3_LAYERS[engine]}
    quantizable = [b for b in res["built"] if b["role"] != "VocabParallelEmbedding"]
    assert quantizable and all(b["draft_quant_config"] for b in quantizable), quantizable


@pytest.fixture(scope="session")
def lifted_eagle3(engine_sources, eagle3_artifacts, eagle3_head, tmp_path_factory) -> dict:
    """engine → `lift.py`'s answer for the quantized heads under the engine's layer names."""
    tmp = tmp_path_factory.mktemp("conf_lift_eagle3")
    num_layers = eagle3_head[2].num_layers
    return {e: src if isinstance(src, str) else src.run(eagle3_request(e, eagle3_artifacts, num_layers), tmp)
            for e, src in engine_sources.items()}


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
@pytest.mark.parametrize("name", ["eagle3_head_int4", "eagle3_head_fp8_dynamic", "eagle3_head_int8_vllm",
                                  "eagle3_head_nvfp4a16", "eagle3_head_mxfp4a16_vllm",
                                  "eagle3_head_fp8_static_kv_vllm"])
def test_quantized_head_verdict_matches_engine_code(lifted_eagle3, eagle3_artifacts, engine, name):
    """Per engine layer, the engine's own compressed-tensors code picks what the verdict says:
    the default head (fc float, o_proj / gate_up at g64 by name targets that name the engines'
    layers too) loads in both, and so does its FP8 with dynamic activations (no calibration of the
    base's hidden states); `--target vllm` quantizes fc, which only vLLM builds quantized; an
    MXFP4 head loads in vLLM, and SGLang has no MXFP4 Linear scheme."""
    ans = lifted_eagle3[engine]
    if isinstance(ans, str):
        pytest.skip(ans)
    res = ans["result"][name]
    v = artifact_verdicts(eagle3_artifacts[name])[engine]
    status, per_layer = lifted_status(res)
    # SGLang's quantized fc: not a LinearBase, so not the decision code's (test_sglang_passes_a_quantized_fc_by)
    float_only = [n for n in v.layers if n not in per_layer]
    assert float_only == (["fc"] if engine == "sglang" and name.endswith("_vllm") else [])
    assert v.status == "refused" if float_only else status == v.status, (v.line(), res)
    for layer, got in per_layer.items():
        lv = v.layers.get(layer)
        want = "loads" if lv is None else "refused" if lv.scheme is None and lv.problem else \
            "ignores" if lv.problem else "loads"
        assert want == got, (layer, lv, res["layers"][layer])
        r = res["layers"][layer]
        assert r["scheme"] == (None if lv is None else lv.scheme), (layer, r, lv)
        if r["scheme"] == "WNA16":
            assert (None if r["args"]["group_size"] == -1 else r["args"]["group_size"]) == lv.group_size
    if name == "eagle3_head_int4":
        assert {n.rsplit(".", 1)[1]: lv.group_size for n, lv in v.layers.items()} == \
            {"qkv_proj": 128, "o_proj": 64, "gate_up_proj": 64, "down_proj": 128}


def test_head_fallback_unit_reaches_vllm_under_its_name(lifted_eagle3, eagle3_artifacts, eagle3_head):
    """Static int8 inputs with the unit they hurt most kept float: vLLM's compressed-tensors code
    runs that unit's engine layer W8A16 (the fallback group's targets name vLLM's layers,
    `engines.eagle3_targets`) and the others with static int8 inputs, as the verdict says."""
    from quantspec.quant.artifact import read_provenance

    ans = lifted_eagle3["vllm"]
    if isinstance(ans, str):
        pytest.skip(ans)
    name = "eagle3_head_int8_static_fallback_vllm"
    path = eagle3_artifacts[name]
    (unit,) = read_provenance(path)["provenance"]["calibration"]["static_plan"]["fallback_units"]
    res, v = ans["result"][name], artifact_verdicts(path)["vllm"]
    status, per_layer = lifted_status(res)
    assert status == v.status == "loads", (v.line(), res)
    L = eagle3_head[2].num_layers
    fallback = {layer.format(L=L) for layer, (_, shards) in EAGLE3_LAYERS["vllm"].items()
                if set(shards) == set(unit["linears"])}
    assert len(fallback) == 1
    for layer in per_layer:
        r = res["layers"][layer]
        assert r["scheme"] == v.layers[layer].scheme == ("WNA16" if layer in fallback else "W8A8Int8"), (layer, r)


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_head_kv_scales_reach_vllm_attention_and_not_sglang(engine_sources, eagle3_artifacts, eagle3_head,
                                                           lifted_eagle3, engine):
    """An FP8 KV cache on the head, as the verdicts say: both engines' compressed-tensors code gives
    the head's attention its KV-cache method; vLLM's EAGLE-3 `load_weights` (its `midlayer.` →
    `layers.0.` rename, then `QuantizationConfig.get_cache_scale_mapper`) loads
    `midlayer.self_attn.k_scale` / `v_scale` into that attention's scales; SGLang's skips them and
    its attention keeps the scales it was made with (`SGLANG_EAGLE3_KV`)."""
    from safetensors.torch import load_file

    from quantspec.quant.config import QuantConfig
    from quantspec.quant.engines.drafts import SGLANG_EAGLE3_KV, eagle3_kv_ignored

    src, ans = engine_sources[engine], lifted_eagle3[engine]
    if isinstance(src, str) or isinstance(ans, str):
        pytest.skip(src if isinstance(src, str) else ans)
    name = "eagle3_head_fp8_static_kv_vllm"
    path = eagle3_artifacts[name]
    kv = ans["result"][name]["kv"]
    assert kv["error"] is None and kv["method"] is not None, kv
    res = _lift(src, path, eagle3_head[2])
    assert "fatal" not in res, res.get("fatal")
    out, attn = res["result"], "model.layers.0.self_attn.attn"
    written = load_file(str(path / "model.safetensors"))
    v = artifact_verdicts(path)[engine]
    if engine == "vllm":
        for n in "kv":
            assert out["loads"][f"{attn}.{n}_scale"] == [[None, list(written[f"midlayer.self_attn.{n}_scale"].shape)]]
        assert v.kv_cache == "fp8 per-tensor" and not any("KV" in r for r in v.reasons)
    else:
        assert {f"{attn}.k_scale", f"{attn}.v_scale"} <= set(out["nan_left"])
        assert not any(n.startswith(attn) for n in out["loads"])
        # beside fc (refused here: the head is --target vllm's) the verdict ignores the scales
        config = QuantConfig.from_dict(json.loads((path / "config.json").read_text())["quantization_config"])
        assert v.kv_cache is None and SGLANG_EAGLE3_KV in eagle3_kv_ignored("sglang", config)


def test_sglang_passes_a_quantized_fc_by(engine_sources, eagle3_artifacts, eagle3_head):
    """What `SGLANG_EAGLE3_FC` says, run: SGLang's `load_weights` meets fc's weight_packed /
    weight_scale / weight_shape, finds no such parameter on its `torch.nn.Linear` and goes on
    without an error; fc's weight is never loaded."""
    src = engine_sources["sglang"]
    if isinstance(src, str):
        pytest.skip(src)
    path = eagle3_artifacts["eagle3_head_int8_vllm"]
    assert {"fc.weight_packed", "fc.weight_scale"} <= set(artifact_tensors(path)["fc"]) | \
        {f"fc.{k}" for k in artifact_tensors(path)["fc"]}
    res = _lift(src, path, eagle3_head[2])
    assert "fatal" not in res, res.get("fatal")
    out = res["result"]
    assert out["fc_class"] == "torch.nn.modules.linear.Linear"
    assert "model.fc.weight" in out["params"] and "model.fc.weight" not in out["loads"]


# speculators-format heads (tests/speculators_heads.py) of a Llama layer, each read by quantspec and
# written back in the plain layout with its variants' flags
LIFTED_VARIANTS = ("llama-default", "llama-two-aux-fc-norm", "llama-norm-before-fc")


@pytest.fixture(scope="session")
def variant_heads(conformance_model, tmp_path_factory) -> tuple[dict, object]:
    """variant → (the speculators head, quantspec's plain-layout head of it); the base's args."""
    from speculators_heads import write_speculators_head

    from quantspec.model_zoo.checkpoint import load_model
    from quantspec.model_zoo.eagle3 import load_eagle3, save_eagle3

    base = load_model(conformance_model)[0]
    tmp, out = tmp_path_factory.mktemp("conf_speculators"), {}
    for v in LIFTED_VARIANTS:
        spec = write_speculators_head(tmp / v / "speculators", base.model.embed_tokens.weight.detach(), v)
        out[v] = (spec, save_eagle3(load_eagle3(spec, base.args), tmp / v / "plain"))
    return out, base.args


@pytest.fixture(scope="session")
def lifted_variants(engine_sources, variant_heads) -> dict:
    heads, args = variant_heads
    return {e: src if isinstance(src, str) else {v: _lift(src, plain, args) for v, (_, plain) in heads.items()}
            for e, src in engine_sources.items()}


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
@pytest.mark.parametrize("variant", LIFTED_VARIANTS)
def test_engine_reads_the_head_variants_as_quantspec_does(lifted_variants, variant_heads, engine_sources,
                                                          engine, variant):
    """The engine's EAGLE-3 model, built from the plain config quantspec writes for a speculators
    head, loads every tensor of it (the norms before `fc` too) and reads `norm_before_fc`,
    `fc_norm`, `norm_output` and the number of aux features as quantspec does; vLLM also picks its
    residual from hidden_norm(hidden) exactly where quantspec does. SGLang's decoder layer has no
    such choice, so the verdicts refuse SGLang a head with `norm_before_residual`."""
    from quantspec.model_zoo.eagle3 import Eagle3Args
    from quantspec.quant.engines import draft_verdicts

    ans = lifted_variants[engine]
    if isinstance(ans, str):
        pytest.skip(ans)
    res = ans[variant]
    assert "fatal" not in res, res.get("fatal")
    out = res["result"]
    _, plain = variant_heads[0][variant]
    cfg = json.loads((plain / "config.json").read_text())
    a = Eagle3Args.from_config(cfg)
    assert set(out["loads"]) == set(out["params"]) - {"model.embed_tokens.weight"}
    assert out["nan_left"] == ["model.embed_tokens.weight"]
    assert out["fc_input_size"] == a.num_aux * variant_heads[1].hidden_size
    got = out["variant"]
    assert (got["norm_before_fc"], got["fc_norm"], got["norm_output"], got["num_aux"]) == \
        (a.norm_before_fc, a.fc_norm, a.norm_output, a.num_aux)
    sglang = draft_verdicts("eagle3", cfg)["sglang"]
    if engine == "vllm":
        assert got["residual_norm"] == ("_norm_before_residual" if a.norm_before_residual else "_norm_after_residual")
    else:
        code = (engine_sources["sglang"].source / "sglang/srt/models/llama_eagle3.py").read_text()
        assert got["residual_norm"] is None and "norm_before_residual" not in code
        assert sglang.status == ("refused" if a.norm_before_residual else "loads"), sglang.line()


def test_vllm_flattens_a_speculators_config_as_quantspec_does(engine_sources, tmp_path):
    """vLLM's own `update_eagle3` (speculators/algos.py, over the `transformer_layer_config` that
    `SpeculatorsConfig` starts from) gives every key it sets the value quantspec's reading of the
    same file gives it: the architecture for the layer (registered in vLLM, not in SGLang), the
    draft vocabulary, the aux layers and the variants' flags, `norm_before_residual` true where the
    file leaves it out."""
    import runpy

    from speculators_heads import VARIANTS, write_speculators_head

    from quantspec.model_zoo.speculators import eagle3_config

    src = engine_sources["vllm"]
    if isinstance(src, str):
        pytest.skip(src)
    spec_dir = src.source / "vllm/transformers_utils/configs/speculators"
    assert 'config_dict.get("transformer_layer_config", {})' in (spec_dir / "base.py").read_text()
    update = runpy.run_path(str(spec_dir / "algos.py"))["SUPPORTED_SPECULATORS_TYPES"]["eagle3"]
    registry = (src.source / "vllm/model_executor/models/registry.py").read_text()
    model_class = {name: (module, cls) for name, module, cls in
                   re.findall(r'"(\w+)": \(\s*"(\w+)",\s*"(\w+)",?\s*\)', registry)}
    for variant, (kind, _, _) in VARIANTS.items():
        path = write_speculators_head(tmp_path / variant, torch.zeros(96, 32), variant)
        cfg = json.loads((path / "config.json").read_text())
        vllm = dict(cfg["transformer_layer_config"])
        update(config_dict=cfg, pre_trained_config=vllm)
        ours = eagle3_config(cfg)
        # architectures: two names of one vLLM class; quantspec's is the one SGLang knows too
        assert model_class[ours["architectures"][0]] == model_class[vllm["architectures"][0]], variant
        assert {k: ours.get(k, False) for k in vllm if k != "architectures"} == \
            {k: v for k, v in vllm.items() if k != "architectures"}, variant
        sglang = engine_sources["sglang"]
        if not isinstance(sglang, str):
            assert (ours["architectures"][0] in sglang.architectures()) == (kind == "llama")
