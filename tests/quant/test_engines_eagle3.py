"""The verdicts on an EAGLE-3 head quantized on its own (`quant.engines.drafts`): vLLM and SGLang
judge it under their own layer names, SGLang takes `fc` float only, transformers has no class for
it; `--target` leaves float what its engines take float, and per-layer group sizes are written so
that the engines' names reach them. The engines' own code checks the same facts in
tests/conformance/test_eagle3.py."""

import dataclasses
import re

import pytest

from quantspec.model_zoo.checkpoint import draft_kind
from quantspec.model_zoo.eagle3 import Eagle3Args
from quantspec.model_zoo.llama import ModelArgs
from quantspec.quant.engines import (ENGINE_NAMES, eagle3_ignore, eagle3_targets, engine_verdicts,
                                     target_refusal)
from quantspec.quant.engines.drafts import EAGLE3_LAYERS, SGLANG_EAGLE3_FC
from quantspec.quant.presets import preset

QKV = [f"midlayer.self_attn.{s}_proj" for s in "qkv"]
MID = QKV + ["midlayer.self_attn.o_proj", "midlayer.mlp.gate_proj", "midlayer.mlp.up_proj",
             "midlayer.mlp.down_proj"]
D = 576  # the default model's hidden size: K = 576 takes group 64 at --group-size 128
K = {"fc": 3 * D, **{n: 2 * D for n in QKV}, "midlayer.self_attn.o_proj": D, "midlayer.mlp.gate_proj": D,
     "midlayer.mlp.up_proj": D, "midlayer.mlp.down_proj": 1536}


def _config(quant_type="weight_only_int8", target="portable", **kw):
    c = preset(quant_type, **kw)
    return dataclasses.replace(c, ignore=(*c.ignore, *eagle3_ignore(target)))


def _verdicts(config, linears=None):
    linears = linears or {n: k for n, k in K.items() if config.scheme_for(n) is not None}
    return engine_verdicts(config, linears, draft="eagle3", base_layers=30)


def test_draft_kind_of_an_eagle3_head():
    base = ModelArgs(hidden_size=64, intermediate_size=128, num_layers=4, num_heads=4, num_kv_heads=2,
                     vocab_size=512)
    assert draft_kind(Eagle3Args.for_base(base, 128).to_config()) == "eagle3"
    assert draft_kind({"architectures": ["Eagle3LlamaForCausalLM"]}) == "eagle3"
    assert draft_kind({"architectures": ["LlamaForCausalLM"]}) is None


def test_portable_head_loads_in_both_engines_under_their_names():
    v = _verdicts(_config())
    assert v["vllm"].status == v["sglang"].status == v["quantspec"].status == "loads"
    assert set(v["vllm"].layers) == {"model.layers.30.self_attn.qkv_proj", "model.layers.30.self_attn.o_proj",
                                     "model.layers.30.mlp.gate_up_proj", "model.layers.30.mlp.down_proj"}
    assert set(v["sglang"].layers) == {"model.qkv_proj", "model.self_attn.o_proj", "model.gate_up_proj",
                                       "model.down_proj"}
    assert {lv.scheme for e in ("vllm", "sglang") for lv in v[e].layers.values()} == {"WNA16"}
    t = v["transformers"]
    assert t.status == "refused" and t.line() == ("refused because transformers 5.24.0 has no model class "
                                                  "for an EAGLE-3 head (architecture LlamaForCausalLMEagle3)")


def test_quantized_fc_loads_in_vllm_and_is_refused_by_sglang():
    v = _verdicts(_config(target="vllm"))
    assert v["vllm"].status == "loads" and v["vllm"].layers["model.fc"].scheme == "WNA16"
    s = v["sglang"]
    assert s.status == "refused" and s.reasons == (f"{SGLANG_EAGLE3_FC} (fc)",)
    assert "builds fc as a plain torch.nn.Linear without quant_config" in s.line()
    assert s.fixes == ("re-quantize with --target portable or sglang (fc stays float), or serve it with vLLM",)


def test_ignore_must_name_fc_as_vllm_does():
    """An ignore entry "fc" (the checkpoint's name) leaves vLLM's `model.fc` quantized: it would
    expect weight_packed where the checkpoint holds a float weight."""
    c = preset("weight_only_int8", ignore=("lm_head", "fc"))
    v = _verdicts(c)
    assert v["vllm"].status == "refused" and v["sglang"].status == "loads"
    assert "expects quantized weights where the checkpoint holds float ones" in v["vllm"].line()
    assert re.match(eagle3_ignore("portable")[0][3:], "model.fc") and re.match(eagle3_ignore("sglang")[0][3:], "fc")
    assert eagle3_ignore("vllm") == eagle3_ignore("quantspec") == ()


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_group_size_targets_must_name_the_engines_layers(engine):
    """At --group-size 128, o_proj and gate/up (K = 576) take 64: a group named after the
    checkpoint's Linears does not reach the engines' layers, one from `eagle3_targets` does."""
    sizes = {n: 64 if K[n] == D else 128 for n in MID}
    base = _config("weight_only_int4", group_size=128)
    bad = _verdicts(base.with_group_sizes(sizes))[engine]
    o_proj = next(n for n in bad.layers if n.endswith("o_proj"))
    assert bad.status == "refused"
    if engine == "vllm":
        assert bad.layers[o_proj].problem == (f"it resolves group size 128 instead of 64 (name targets written "
                                              f"for the checkpoint's names do not reach {ENGINE_NAMES[engine]}'s "
                                              f"name for it, {o_proj})")
        assert "re-quantize with this quantspec (it writes what both engines load)" in bad.fixes
    else:  # SGLang sizes the layer by the class group first
        assert bad.layers[o_proj].problem == "group size 128 does not divide K=576"
    good = _verdicts(base.with_group_sizes(sizes, eagle3_targets))[engine]
    assert good.status == "loads"
    assert {n.rsplit(".", 1)[1]: lv.group_size for n, lv in good.layers.items()} == \
        {"qkv_proj": 128, "o_proj": 64, "gate_up_proj": 64, "down_proj": 128}


def test_eagle3_targets_name_every_layer_name():
    (o_proj,) = eagle3_targets(["midlayer.self_attn.o_proj"])
    for name in ("midlayer.self_attn.o_proj", "model.layers.30.self_attn.o_proj", "model.self_attn.o_proj"):
        assert re.match(o_proj[3:], name), name
    assert not re.match(o_proj[3:], "model.layers.30.self_attn.qkv_proj")
    gate_up, q_alone = eagle3_targets(["midlayer.mlp.gate_proj", "midlayer.mlp.up_proj", QKV[0]])
    for name in ("midlayer.mlp.up_proj", "model.layers.2.mlp.gate_up_proj", "model.gate_up_proj"):
        assert re.match(gate_up[3:], name), name
    assert q_alone == QKV[0]  # a part of a fused layer: no engine can give it its own scheme
    names = {n for _, (_, shards) in EAGLE3_LAYERS["vllm"].items() for n in shards}
    assert names == set(K) | {"lm_head"}


def test_target_refusal_of_an_eagle3_head():
    assert target_refusal("portable", _config(), draft="eagle3") is None
    assert target_refusal("vllm", _config(target="vllm"), draft="eagle3") is None
    line = target_refusal("sglang", _config(target="vllm"), draft="eagle3")
    assert line.startswith("--target sglang: SGLang refused because SGLang 0.5.23 builds fc as a plain")
    assert line.endswith("pass --target quantspec")
    line = target_refusal("transformers", _config(target="transformers"), draft="eagle3")
    assert "has no model class for an EAGLE-3 head" in line and line.endswith("pass --target quantspec")
