"""`recipe.yaml` beside an artifact (`calib.recipe_out`): written where an llm-compressor recipe
stands for the run, it validates as compressed-tensors schemes, and `quantize --recipe` of it
writes the same artifact again."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from quantspec import api
from quantspec.model_zoo.tiny import TINY_CORPUS

torch.set_num_threads(1)

DATA = dict(num_samples=2, seq_len=32)

# options → an artifact whose recipe.yaml runs as them
ROUND_TRIPS = {
    "int4_rtn": dict(quant_type="weight_only_int4", group_size=32),
    "int4_gptq": dict(quant_type="weight_only_int4", group_size=32, method="gptq", act_order=True, damp=0.05),
    "int4_awq_gptq": dict(quant_type="weight_only_int4", group_size=32, method="awq+gptq", awq_duo_scaling="both"),
    "int4_autoround": dict(quant_type="weight_only_int4", group_size=32, method="autoround", iters=2),
    "int8_down_proj": dict(quant_type="weight_only_int4", group_size=32,
                           layer_quant_types=(r"re:.*mlp\.down_proj$=weight_only_int8", "lm_head=weight_only_int8")),
    "fp8_dynamic": dict(quant_type="a8w8_fp8", activations="dynamic"),
    "fp8_static_kv": dict(quant_type="a8w8_fp8", weight_strategy="tensor", smoothquant_alpha="none",
                          fallback_layers=0, kv_cache="fp8"),
    "int8_dynamic_sq": dict(quant_type="a8w8", activations="dynamic", smoothquant_alpha=0.5),
    "int4_spinquant": dict(quant_type="weight_only_int4", group_size=32, rotate="R1,R2,R4", target="vllm"),
    "int4_quip": dict(quant_type="weight_only_int4", group_size=32, quip="v,u", target="vllm"),
}


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> str:
    p = tmp_path_factory.mktemp("data") / "calib.txt"
    p.write_text(TINY_CORPUS)
    return str(p)


def _tensors(path: Path) -> dict:
    return load_file(str(path / "model.safetensors"))


@pytest.mark.parametrize("name", sorted(ROUND_TRIPS))
def test_the_recipe_beside_an_artifact_makes_it_again(tiny_llama_dir, data, tmp_path, name):
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    opts = dict(ROUND_TRIPS[name])
    first = api.quantize(str(tiny_llama_dir), opts.pop("quant_type"), tmp_path / "first", dataset=data, **DATA,
                         **opts)
    recipe = first / "recipe.yaml"
    assert api.inspect(first)["llmcompressor_recipe"] == str(recipe)
    stage = yaml.safe_load(recipe.read_text())["quant_stage"]
    quant = next(args for group in stage.values() for mod, args in group.items() if mod.endswith("Modifier")
                 and "config_groups" in args)
    for scheme in quant["config_groups"].values():  # compressed-tensors' own validation, as llm-compressor loads them
        QuantizationScheme.model_validate(scheme)
    if "kv_cache_scheme" in quant:
        QuantizationArgs.model_validate(quant["kv_cache_scheme"])
    target = {"target": opts["target"]} if "target" in opts else {}
    again = api.quantize(str(tiny_llama_dir), out=tmp_path / "again", recipe=str(recipe), dataset=data, **DATA,
                         **target)
    a, b = _tensors(first), _tensors(again)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    cfg = [json.loads((p / "config.json").read_text())["quantization_config"] for p in (first, again)]
    assert cfg[0] == cfg[1]
    assert (again / "recipe.yaml").read_text() == recipe.read_text()


@pytest.mark.parametrize("quant_type,options", [
    ("a8w8", dict()),  # SmoothQuant α searched per group, the fallback chosen by its budget: no modifier holds them
    ("a8w8_fp8", dict(smoothquant_alpha=0.5)),  # one α, but the fallback by budget
])
def test_no_recipe_where_llm_compressor_has_no_modifier_for_the_run(tiny_llama_dir, data, tmp_path, quant_type,
                                                                    options):
    art = api.quantize(str(tiny_llama_dir), quant_type, tmp_path / "q", dataset=data, holdout_samples=1,
                       search_samples=1, **DATA, **options)
    assert not (art / "recipe.yaml").exists() and api.inspect(art)["llmcompressor_recipe"] is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["q"]


def test_a_mixture_of_experts_recipe_ignores_its_routers(tmp_path, data):
    """quantize keeps a mixture of experts' routers float by itself; its recipe ignores them by name, as
    llm-compressor's MoE recipes must, and runs again into the same artifact."""
    from quantspec.model_zoo.moe import router_ignore
    from quantspec.model_zoo.llama import ModelArgs
    from quantspec.model_zoo.checkpoint import read_config
    from quantspec.model_zoo.tiny import build_tiny_model

    moe = build_tiny_model(tmp_path / "moe", "qwen3_moe", num_layers=2)
    first = api.quantize(str(moe), "weight_only_int8", tmp_path / "first")
    ignore = yaml.safe_load((first / "recipe.yaml").read_text())["quant_stage"]["quant_modifiers"][
        "QuantizationModifier"]["ignore"]
    routers = router_ignore(ModelArgs.from_hf_config(read_config(moe)))
    assert routers and set(routers) <= set(ignore) and "lm_head" in ignore
    again = api.quantize(str(moe), out=tmp_path / "again", recipe=str(first / "recipe.yaml"))
    a, b = _tensors(first), _tensors(again)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
