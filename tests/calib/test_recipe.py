"""`quantize --recipe`: an llm-compressor recipe runs as the quantspec options it stands for.

Each recipe is checked two ways: the artifact is byte for byte the one the options written out by
hand here make (the recipe adds nothing and drops nothing), and every Linear's scheme in the
artifact is, field by field, the one compressed-tensors' own resolution of the recipe's schemes
(`preset_name_to_scheme`, `QuantizationScheme`, by its target precedence) gives that Linear."""

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from quantspec import api
from quantspec.cli import main
from quantspec.errors import QuantSpecError
from quantspec.model_zoo.tiny import TINY_CORPUS

torch.set_num_threads(1)

_W4A16_GPTQ = """
quant_stage:
  quant_modifiers:
    GPTQModifier:
      ignore: ["lm_head"]
      scheme: W4A16
      targets: ["Linear"]
      dampening_frac: 0.05
      block_size: 64
"""
_FP8_DYNAMIC = """
quant_stage:
  quant_modifiers:
    QuantizationModifier:
      ignore: [lm_head, "re:.*visual.*"]
      scheme: FP8_DYNAMIC
"""
# an older layout: the scheme on a QuantizationModifier, a GPTQModifier of no scheme quantizes it
_CHANNEL_ASYM = """
test_stage:
  quant_modifiers:
    QuantizationModifier:
      ignore: ["lm_head", "model.layers.0.mlp.down_proj"]
      config_groups:
        group_0:
          weights: {num_bits: 4, type: "int", symmetric: false, strategy: "channel", observer: mse}
          targets: ["Linear"]
    GPTQModifier:
      block_size: 32
      actorder: null
"""
_MIXED = """
quant_stage:
  quant_modifiers:
    QuantizationModifier:
      scheme: {W4A16: ["re:.*mlp.down_proj$"], FP8_DYNAMIC: ["Linear"]}
"""
_A8W8_STATIC = """
quant_stage:
  quant_modifiers:
    SmoothQuantModifier:
      smoothing_strength: 0.6
    QuantizationModifier:
      ignore: [lm_head]
      config_groups:
        group_0:
          weights: {num_bits: 8, type: int, symmetric: true, strategy: channel}
          input_activations: {num_bits: 8, type: int, symmetric: true, strategy: tensor, dynamic: false}
          targets: [Linear]
      kv_cache_scheme: {num_bits: 8, type: float, symmetric: true, strategy: tensor}
"""
_W8A16 = """
quant_stage:
  quant_modifiers:
    GPTQModifier:
      ignore: [lm_head]
      scheme: W8A16
      actorder: null
"""
_W8A8_JSON = json.dumps({"quant_stage": {"quant_modifiers": {"GPTQModifier": {
    "scheme": "W8A8", "ignore": ["lm_head"], "actorder": "static"}}}})

# recipe → the options that make the same artifact, by hand
CASES = [
    ("w4a16_gptq", _W4A16_GPTQ, dict(quant_type="weight_only_int4", method="gptq", group_size=128, act_order=True,
                                     damp=0.05, block_size=64, weight_observer="minmax")),
    ("w8a16_groups", _W8A16, dict(quant_type="weight_only_int8", method="gptq", group_size=128,
                                  weight_observer="minmax")),
    ("fp8_dynamic", _FP8_DYNAMIC, dict(quant_type="a8w8_fp8", activations="dynamic", weight_observer="minmax",
                                       ignore=("lm_head", "re:.*visual.*"))),
    ("channel_asym", _CHANNEL_ASYM, dict(quant_type="weight_only_int4", method="gptq", group_size=-1,
                                         symmetric=False, block_size=32, weight_observer="mse",
                                         ignore=("lm_head", "model.layers.0.mlp.down_proj"))),
    # lm_head is a Linear to llm-compressor, and this recipe does not ignore it
    ("mixed", _MIXED, dict(quant_type="a8w8_fp8", activations="dynamic", weight_observer="minmax",
                           layer_quant_types=("re:.*mlp.down_proj$=weight_only_int4", "lm_head=a8w8_fp8"))),
    ("a8w8_static", _A8W8_STATIC, dict(quant_type="a8w8", smoothquant_alpha=0.6, fallback_layers=0, kv_cache="fp8",
                                       kv_strategy="tensor", weight_observer="minmax")),
    ("fp8_static_kv", (Path(__file__).parent / "llmcompressor_recipes" / "fp8_static_kv.yaml").read_text(),
     dict(quant_type="a8w8_fp8", weight_strategy="tensor", smoothquant_alpha="none", fallback_layers=0,
          kv_cache="fp8", kv_strategy="tensor", weight_observer="minmax")),
    ("w8a8_json", _W8A8_JSON, dict(quant_type="a8w8", activations="dynamic", method="gptq", act_order=True,
                                   weight_observer="minmax")),
]


@pytest.fixture(scope="module")
def model128(tmp_path_factory):
    """A tiny Llama whose every Linear's K tiles llm-compressor's presets' 128-wide groups."""
    from quantspec.model_zoo.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("m") / "llama", hidden=128, intermediate=256)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "calib.txt"
    path.write_text(TINY_CORPUS)
    return str(path)


def _recipe_schemes(text: str) -> dict:
    """The recipe's config groups as compressed-tensors resolves them (what llm-compressor attaches)."""
    import yaml
    from compressed_tensors.quantization import QuantizationScheme, preset_name_to_scheme

    groups = {}
    for stage in yaml.safe_load(text).values():
        for mods in stage.values():
            for args in mods.values():
                scheme = args.get("scheme")
                scheme = {scheme: args.get("targets", ["Linear"])} if isinstance(scheme, str) else scheme or {}
                groups.update({f"{p}{i}": preset_name_to_scheme(p, t) for i, (p, t) in enumerate(scheme.items())})
                groups.update({k: QuantizationScheme.model_validate(v)
                               for k, v in (args.get("config_groups") or {}).items()})
    return groups


def _fields(args) -> dict | None:
    if args is None:
        return None
    return {k: str(getattr(args, k, None)) for k in ("num_bits", "type", "symmetric", "strategy", "group_size", "block_structure",
                                   "dynamic")}


@pytest.mark.parametrize("name,text,options", CASES, ids=[c[0] for c in CASES])
def test_a_recipe_is_the_options_it_stands_for(model128, calibration_table, ct_scheme_of, data, tmp_path,
                                                name, text, options):
    from compressed_tensors.quantization import QuantizationConfig

    recipe = tmp_path / ("recipe.json" if name.endswith("json") else "recipe.yaml")
    recipe.write_text(text)
    common = dict(target="quantspec", dataset=data, num_samples=2, seq_len=16)
    if "kv_cache" in options:  # static scales: a table
        common["calib"] = str(calibration_table(model128))
    a = api.quantize(str(model128), out=tmp_path / "a", recipe=str(recipe), **common)
    opts = dict(options)
    b = api.quantize(str(model128), opts.pop("quant_type"), tmp_path / "b", **opts, **common)
    ta, tb = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    assert ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)
    cfg = json.loads((a / "config.json").read_text())["quantization_config"]
    assert cfg == json.loads((b / "config.json").read_text())["quantization_config"]
    ours, theirs = QuantizationConfig.model_validate(cfg), _recipe_schemes(text)
    ref = QuantizationConfig(config_groups=theirs)
    names = {k.rsplit(".", 1)[0] for k in ta if k.endswith(".weight_scale")}
    assert names and all(
        (_fields(ct_scheme_of(ours, n).weights), _fields(ct_scheme_of(ours, n).input_activations))
        == (_fields(ct_scheme_of(ref, n).weights), _fields(ct_scheme_of(ref, n).input_activations)) for n in names)
    assert ("lm_head" in names) == (name == "mixed")
    recorded = json.loads((a / "quantspec.json").read_text())["provenance"]["recipe"]
    assert recorded["path"] == str(recipe) and f"--quant-type {options['quant_type']}" in recorded["flags"]


def _write(tmp_path, text: str, name="r.yaml"):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


REFUSED = [
    ("sparsity", "s_stage:\n  s_modifiers:\n    SparseGPTModifier: {sparsity: 0.5}\n", "runs no SparseGPTModifier"),
    ("per_tensor_int8", "q_stage:\n  q_modifiers:\n    QuantizationModifier:\n      config_groups:\n        g: "
                        "{targets: [Linear], weights: {num_bits: 8, type: int, strategy: tensor}}\n",
     "none of quantspec's quant types"),
    ("int8_layer_groups", "q_stage:\n  q_modifiers:\n    QuantizationModifier: {scheme: {W4A16: [Linear], W8A16: "
                          "['re:.*down_proj$']}}\n", "strategy: channel"),
    ("asym_inputs", "q_stage:\n  q_modifiers:\n    QuantizationModifier:\n      config_groups:\n        g: {targets: "
                    "[Linear], weights: {num_bits: 8, type: int, strategy: channel}, input_activations: {num_bits: "
                    "8, type: int, symmetric: false, strategy: token, dynamic: true}}\n", "asym are none"),
    ("two_methods", "q_stage:\n  q_modifiers:\n    QuantizationModifier: {scheme: {W4A16: ['re:.*mlp.*']}}\n"
                    "    GPTQModifier: {scheme: W8A16}\n", "one method"),
    ("actorder_group", "q_stage:\n  q_modifiers:\n    GPTQModifier: {scheme: W4A16, actorder: group}\n",
     "actorder group"),
    ("awq_mappings", "q_stage:\n  q_modifiers:\n    AWQModifier: {mappings: [{smooth_layer: a, balance_layers: [b]}]}\n"
                     "    QuantizationModifier: {scheme: W4A16}\n", "mappings"),
    ("awq_after", "q_stage:\n  q_modifiers:\n    QuantizationModifier: {scheme: W4A16}\n    AWQModifier: {}\n",
     "put it first"),
    ("kv_only", "q_stage:\n  q_modifiers:\n    QuantizationModifier:\n      kv_cache_scheme: {num_bits: 8, type: "
                "float, symmetric: true, strategy: tensor}\n", "--quant-type keep"),
    ("unknown_arg", "q_stage:\n  q_modifiers:\n    GPTQModifier: {scheme: W4A16, sequential_update: true}\n",
     "takes no sequential_update"),
    ("no_linear", "q_stage:\n  q_modifiers:\n    QuantizationModifier: {scheme: {W4A16: ['re:.*mlp.*']}}\n",
     "targets `Linear`"),
    ("group_sizes", "q_stage:\n  q_modifiers:\n    QuantizationModifier:\n      config_groups:\n        a: {targets: "
                    "[Linear], weights: {num_bits: 4, type: int, strategy: group, group_size: 64}}\n        b: "
                    "{targets: ['re:.*mlp.*'], weights: {num_bits: 4, type: int, strategy: group, group_size: 32}}\n",
     "group size"),
    ("spinquant_r3", "q_stage:\n  q_modifiers:\n    SpinQuantModifier: {rotations: [R3]}\n"
                     "    QuantizationModifier: {scheme: W4A16}\n", "R3"),
    ("quip_random", "q_stage:\n  q_modifiers:\n    QuIPModifier: {rotations: [v]}\n"
                    "    QuantizationModifier: {scheme: W4A16}\n", "transform_type: hadamard"),
    ("sq_mappings", "q_stage:\n  q_modifiers:\n    SmoothQuantModifier: {mappings: [[[a], b]]}\n"
                    "    QuantizationModifier: {scheme: W8A8}\n", "default"),
    ("bad_block_size", "q_stage:\n  q_modifiers:\n    GPTQModifier: {scheme: W4A16, block_size: big}\n", "kind"),
    ("bad_config_groups", "q_stage:\n  q_modifiers:\n    GPTQModifier: {config_groups: [1, 2]}\n", "kind"),
    ("args_not_mapping", "q_stage:\n  q_modifiers:\n    GPTQModifier: 5\n", "not a mapping"),
    ("not_a_recipe", "- just\n- a list\n", "no mapping of stages"),
    ("empty", "other: 1\n", "names no modifier"),
    ("yaml_error", "q_stage: {q_modifiers: [\n", "not valid YAML"),
]


@pytest.mark.parametrize("name,text,match", REFUSED, ids=[c[0] for c in REFUSED])
def test_what_quantspec_cannot_run_as_written_is_refused(tiny_llama_dir, tmp_path, name, text, match):
    """One line naming --recipe and what to change; nothing written."""
    with pytest.raises(QuantSpecError, match=match) as e:
        api.quantize(str(tiny_llama_dir), out=tmp_path / "q", recipe=_write(tmp_path, text))
    assert "--recipe" in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "q").exists()


def test_rotations_and_transforms_map_onto_rotate_and_quip(tmp_path):
    from quantspec.calib.recipe import read_recipe

    def read(mods: str) -> dict:
        return read_recipe(_write(tmp_path, f"q_stage:\n  q_modifiers:\n{mods}"
                                            "    QuantizationModifier: {scheme: W4A16}\n")).settings

    assert read("    SpinQuantModifier: {rotations: [R1, R2], transform_type: random-hadamard}\n")["rotate"] == "R1,R2"
    s = read("    QuIPModifier: {rotations: [v, u], transform_type: hadamard, transform_block_size: 32}\n")
    assert (s["quip"], s["quip_block_size"]) == ("v,u", 32)
    s = read("    AWQModifier: {}\n")
    assert s["method"] == "awq" and s["layer_quant_types"] == ("lm_head=weight_only_int4",)
    assert "awq_duo_scaling" not in s and read("    AWQModifier: {duo_scaling: both}\n")["awq_duo_scaling"] == "both"
    with pytest.raises(QuantSpecError, match="random-hadamard"):
        read("    SpinQuantModifier: {rotations: [R1]}\n")  # SpinQuantModifier's default: deterministic Hadamard


def test_the_command_line_prints_the_flags_and_refuses_a_flag_the_recipe_sets(tiny_llama_dir, tmp_path):
    recipe = _write(tmp_path, _FP8_DYNAMIC)
    r = CliRunner().invoke(main, ["quantize", "--model", str(tiny_llama_dir), "--recipe", recipe, "--target", "vllm",
                                  "--out", str(tmp_path / "a")])
    assert r.exit_code == 0, r.output
    assert "--quant-type a8w8_fp8" in r.output and "--activations dynamic" in r.output
    for flag in (["--quant-type", "a8w8"], ["--ignore", "x"], ["--asym"]):
        r = CliRunner().invoke(main, ["quantize", "--model", str(tiny_llama_dir), "--recipe",
                                      _write(tmp_path, _W4A16_GPTQ, "w4.yaml"), *flag, "--out", str(tmp_path / "b")])
        assert r.exit_code == 2 and f"{flag[0] if flag[0] != '--asym' else '--sym/--asym'} and --recipe" in r.output
        assert not (tmp_path / "b").exists()


LLMC = Path(__file__).parent / "llmcompressor_recipes"  # recipe.yaml files as llm-compressor writes them
_GPTQ = dict(method="gptq", block_size=128, damp=0.01, act_order=True)  # its GPTQModifier's defaults (actorder static)
_INT4 = dict(quant_type="weight_only_int4", group_size=128, symmetric=True)
WRITTEN = {
    "gptq_w4a16": {**_GPTQ, **_INT4},
    "awq_w4a16_asym": dict(_INT4, method="awq", symmetric=False),
    "sq_gptq_w8a8": dict(_GPTQ, quant_type="a8w8", activations="dynamic", symmetric=True, smoothquant_alpha=0.8),
    "fp8_dynamic_kv": dict(method="rtn", quant_type="a8w8_fp8", activations="dynamic", kv_cache="fp8",
                           kv_strategy="tensor"),
    "fp8_block": dict(method="rtn", quant_type="a8w8_fp8", activations="dynamic", weight_block=128),
    # compressed-tensors' FP8 preset (per-tensor weights and static inputs), and llm-compressor's FP8 KV-cache example
    "fp8_static": dict(method="rtn", quant_type="a8w8_fp8", activations="static", weight_strategy="tensor"),
    "fp8_static_kv": dict(method="rtn", quant_type="a8w8_fp8", activations="static", weight_strategy="tensor",
                          kv_cache="fp8", kv_strategy="tensor"),
    # actorder None is not written (llm-compressor drops null arguments), so the file reads static
    "w8a16": dict(_GPTQ, quant_type="weight_only_int8", group_size=128, symmetric=True),
    "nvfp4a16": dict(method="rtn", quant_type="weight_only_nvfp4"),
    "quip_w4a16": dict(_INT4, method="rtn", quip="v,u"),
    "spinquant_w4a16": dict(_INT4, method="rtn", rotate="R1,R2"),
}


@pytest.mark.parametrize("name", sorted(WRITTEN))
def test_recipes_llm_compressor_writes_read_as_what_they_ran(name):
    """Every argument llm-compressor writes into its recipe.yaml (lifecycle fields, its defaults,
    the Python tag of AWQ's unset offload device) is read; the options are the recipe's."""
    from quantspec.calib.recipe import read_recipe

    r = read_recipe(str(LLMC / f"{name}.yaml"))
    want = {**WRITTEN[name], "weight_observer": "minmax", "ignore": ("lm_head",), "layer_quant_types": ()}
    assert r.settings == want
    static = want.get("activations") == "static"  # llm-compressor's static recipe: no smoothing, no fallback
    assert r.defaults == ({"smoothquant_alpha": "none", "fallback_layers": 0} if static else {})
