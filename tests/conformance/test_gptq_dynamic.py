"""GPTQ checkpoints' module rules as vLLM reads them. GPTQModel's per-module rules (`dynamic`): its own `is_layer_gptq_quantized`,
`get_dynamic_override` and `override_config` (model_executor/layers/quantization/utils/gptq_utils.py,
compiled from the pinned wheel with the `regex` module it imports, and the (bits, sym) pairs of
`AutoGPTQConfig.TYPE_MAP`) decide, per module, whether it is quantized and with which bits, group
size and symmetry, or refuse the config; quantspec's reading of the same config
(`quant.autoquant.config_from_autoquant`) must give every module the same, or refuse too."""

from __future__ import annotations

import ast
import copy
import types
import typing

import pytest

from quantspec.errors import QuantSpecError
from quantspec.quant.autoquant import config_from_autoquant

from . import engines as eng

LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
NAMES = [f"model.layers.{i}.{p}" for i in range(4) for p in LINEARS]
BASE = {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False, "sym": True}
# (dynamic rules, modules_in_block_to_quantize)
CASES = {
    "first-match": ({"+:.*layers\\.0\\..*": {"bits": 8}, "-:.*up_proj": {}, ".*down_proj": {"group_size": 16}}, None),
    "catch-all": ({"-:.*layers\\.[02]\\.self_attn\\..*": {}, "+:.*mlp\\..*": {"bits": 8, "group_size": -1},
                   ".*": {"group_size": 64}}, None),
    "anchored": ({"+:layers\\.1": {"bits": 8}, "+:model\\.layers\\.3\\.mlp": {"bits": 8, "desc_act": True,
                                                                              "group_size": -1}}, None),
    "in-block": ({"+:.*down_proj": {"bits": 8}, "-:.*layers\\.1\\..*": {}}, [["self_attn.q_proj"], ["mlp.down_proj"]]),
    "asymmetric": ({".*o_proj": {"sym": False}}, None),
    "three-bit": ({"+:.*layers\\.2\\..*": {"bits": 3}}, None),
}


@pytest.fixture(scope="module")
def vllm_rules(engine_sources):
    """vLLM's functions (module docstring) and its TYPE_MAP's (bits, sym) pairs."""
    src = engine_sources["vllm"]
    if isinstance(src, str):
        pytest.skip(src)
    import regex

    root = src.source / "vllm/model_executor/layers/quantization"
    ns = eng.compiled_defs(root / "utils/gptq_utils.py", ("flatten_list", "is_layer_gptq_quantized",
                                                          "get_dynamic_override", "override_config"),
                           {"re": regex, "AutoGPTQConfig": object, "Mapping": dict,
                            "MappingProxyType": types.MappingProxyType, "Any": object})
    auto = ast.parse((root / "auto_gptq.py").read_text())
    cls = next(n for n in ast.walk(auto) if isinstance(n, ast.ClassDef) and n.name == "AutoGPTQConfig")
    table = next(s.value for s in cls.body if isinstance(s, ast.AnnAssign | ast.Assign)
                 and getattr(s.targets[0] if isinstance(s, ast.Assign) else s.target, "id", None) == "TYPE_MAP")
    ns["TYPE_MAP"] = {ast.literal_eval(k): None for k in table.keys}
    return ns


def _vllm(ns, d: dict, name: str):
    """What vLLM does with module `name` (unfused) of a GPTQ config `d`: None (float), (bits,
    group, sym), or the error its code raised."""
    blocks = d.get("modules_in_block_to_quantize") or []
    if not ns["is_layer_gptq_quantized"](prefix=name, quantized_layers=blocks):
        return None
    config = types.SimpleNamespace(weight_bits=d["bits"], group_size=d["group_size"], desc_act=d["desc_act"],
                                   is_sym=d["sym"], dynamic=d.get("dynamic") or {}, TYPE_MAP=ns["TYPE_MAP"])
    if ns["get_dynamic_override"](config, layer_name=name) is False:
        return None
    config = copy.deepcopy(config)
    try:
        ns["override_config"](config, prefix=name)
    except ValueError as e:
        return e
    return config.weight_bits, config.group_size, config.is_sym


@pytest.mark.parametrize("case", list(CASES))
def test_dynamic_rules_read_as_vllm_reads_them(vllm_rules, case):
    rules, blocks = CASES[case]
    d = {**BASE, "dynamic": rules, **({"modules_in_block_to_quantize": blocks} if blocks else {})}
    theirs = {n: _vllm(vllm_rules, d, n) for n in NAMES}
    if any(isinstance(v, Exception) for v in theirs.values()):
        with pytest.raises(QuantSpecError, match="dynamic rule"):
            config_from_autoquant(d)
        return
    config = config_from_autoquant(d)
    ours = {}
    for n in NAMES:
        s = config.scheme_for(n)
        ours[n] = None if s is None else \
            (s.weights.num_bits, s.weights.group_size if s.weights.strategy == "group" else -1, s.weights.symmetric)
    assert ours == theirs
    assert len(set(theirs.values())) > 1, theirs  # the rules give modules different schemes


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe", "mixtral"])
@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_moe_checkpoint_layers_quantized_as_vllm_finds_them(engine_sources, tmp_path, arch, method):
    """A GPTQ / AWQ checkpoint of a mixture of experts whose config names no modules: vLLM's own
    `maybe_update_config` (AutoGPTQConfig's, AutoAWQConfig's) reads the safetensors header's
    dtypes, and its `is_layer_gptq_quantized` / `is_layer_skipped` (substring) decide each Linear;
    quantspec quantizes exactly those (the routers and Qwen2-MoE's shared-expert gate float)."""
    src = engine_sources["vllm"]
    if isinstance(src, str):
        pytest.skip(src)
    import regex
    import torch
    from safetensors import safe_open
    from safetensors.torch import _TYPES

    from quantspec.infer.loader import load_for_inference
    from quantspec.infer.quant_linear import QuantLinear
    from quantspec.model_zoo.checkpoint import build_model
    from quantspec.model_zoo.tiny import build_tiny_model
    from test_interop_autoquant import _write

    ckpt = tmp_path / method
    _write(build_tiny_model(tmp_path / arch, arch, num_layers=2), ckpt, method)
    with safe_open(str(ckpt / "model.safetensors"), framework="pt") as h:
        metadata = {k: {"dtype": h.get_slice(k).get_dtype()} for k in h.keys()}
    root = src.source / "vllm/model_executor/layers/quantization"
    cls, attr = ("AutoGPTQConfig", "modules_in_block_to_quantize") if method == "gptq" else \
        ("AutoAWQConfig", "modules_to_not_convert")
    ns = {"torch": torch, "re": regex, "_SAFETENSORS_TO_TORCH_DTYPE": _TYPES, "is_list_of": lambda v, t: False,
          "get_safetensors_params_metadata": lambda *a, **k: metadata, "Any": object, "Literal": typing.Literal,
          "Mapping": dict, "MappingProxyType": types.MappingProxyType, "PreTrainedConfig": object}
    eng.compiled_defs(root / f"auto_{method}.py", (f"{cls}.maybe_update_config",), ns)
    eng.compiled_defs(root / "utils/quant_utils.py", ("is_layer_skipped",), ns)
    eng.compiled_defs(root / "utils/gptq_utils.py", ("flatten_list", "is_layer_gptq_quantized"), ns)
    config = types.SimpleNamespace(**{attr: []})
    ns["maybe_update_config"](config, str(ckpt))
    listed = getattr(config, attr)
    lm = load_for_inference(ckpt, tokenizer=False, fuse=False)
    linears = {n for n, m in build_model(lm.args, device="meta").named_modules()
               if isinstance(m, torch.nn.Linear) and n != "lm_head"}  # the checkpoint's Linears
    theirs = {n for n in linears if (ns["is_layer_gptq_quantized"](prefix=n, quantized_layers=listed) if method == "gptq"
                                     else not ns["is_layer_skipped"](n, listed, match_mode="substring"))}
    ours = {n for n, m in lm.model.named_modules() if isinstance(m, QuantLinear)}
    assert ours == theirs and any(".experts." in n for n in ours) and ours != linears
