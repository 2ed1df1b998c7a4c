"""AutoRound configs as vLLM reads them: its own `INCConfigParser` (model_executor/layers/quantization/
inc/config_parser.py, compiled from the pinned wheel with the `regex` module it imports; the output
head a `ParallelLMHead`, every other module a plain layer) resolves each module's bits, group size
and symmetry, or leaves it float; quantspec's reading of the same config
(`quant.autoround.config_from_autoround`) must give every module the same."""

from __future__ import annotations

import types
from dataclasses import dataclass

import pytest

from quantspec.quant.autoround import config_from_autoround

from . import engines as eng

LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
NAMES = [f"model.layers.{i}.{p}" for i in range(4) for p in LINEARS] + ["lm_head"]
BASE = {"quant_method": "auto-round", "bits": 4, "group_size": 128, "sym": True, "data_type": "int",
        "packing_format": "auto_round:auto_gptq", "autoround_version": "0.9.0", "iters": 200}
# name → (the config's changes, packing's symmetric weights: what quantspec's args say for it)
CASES = {
    "plain": ({}, True),
    "blocks": ({"block_name_to_quantize": "model.layers.0,model.layers.2"}, True),
    "exact": ({"extra_config": {"model.layers.1.mlp.down_proj": {"bits": 8, "group_size": 32},
                                "model.layers.3.self_attn.o_proj": {"bits": 16}, "lm_head": {"bits": 8}}}, True),
    "regex": ({"extra_config": {r".*layers\.[01]\.mlp\..*": {"bits": 8}, r".*down_proj": {"bits": 16},
                                "model.layers.0.mlp.down_proj": {"group_size": 64}}}, True),
    "regex-outside-blocks": ({"block_name_to_quantize": ["model.layers.1"],
                              "extra_config": {r"layers\.2\.mlp": {"bits": 8}, r"layers\.3\.self_attn": {},
                                               r"layers\.1\.self_attn\.[qk]_proj": {"group_size": -1}}}, True),
    "suffix": ({"extra_config": {"mlp.gate_proj": {"bits": 8}, "layers.2.mlp.gate_proj": {"bits": 16}}}, True),
    "awq": ({"packing_format": "auto_round:auto_awq", "sym": False,
             "extra_config": {"model.layers.2.mlp.up_proj": {"bits": 16}, r".*o_proj": {"group_size": 32}}}, False),
}


class _Head:
    """vLLM's ParallelLMHead, as the parser's isinstance check asks."""


@pytest.fixture(scope="module")
def vllm_parser(engine_sources):
    src = engine_sources["vllm"]
    if isinstance(src, str):
        pytest.skip(src)
    import regex

    path = src.source / "vllm/model_executor/layers/quantization/inc/config_parser.py"
    ns = {"re": regex, "dataclass": dataclass, "ParallelLMHead": _Head, "TYPE_CHECKING": False}
    return eng.compiled_defs(path, ("INCLayerConfig", "INCConfigParser"), ns)["INCConfigParser"]


def _vllm(parser_cls, d: dict) -> dict:
    """Module → None (float) or (bits, group, sym) as vLLM's parser resolves config `d` (INCConfig's
    fields as its from_config reads them; no fused modules: the names are the checkpoint's)."""
    blocks = d.get("block_name_to_quantize")
    config = types.SimpleNamespace(weight_bits=d["bits"], group_size=d["group_size"], sym=d.get("sym", True),
                                   packing_format=d["packing_format"], backend="auto", data_type="int",
                                   block_name_to_quantize=blocks.split(",") if isinstance(blocks, str) else blocks,
                                   extra_config=d.get("extra_config"), packed_modules_mapping={})
    parser = parser_cls(config)
    out = {}
    for name in NAMES:
        r = parser.resolve(_Head() if name == "lm_head" else object(), name)
        out[name] = (r.bits, r.group_size, r.sym) if r.quantized else None
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_autoround_layers_resolve_as_vllm_resolves_them(vllm_parser, case):
    change, symmetric = CASES[case]
    d = {**BASE, **change}
    theirs = _vllm(vllm_parser, d)
    config = config_from_autoround(d)
    ours = {}
    for n in NAMES:
        s = config.scheme_for(n)
        ours[n] = None if s is None else \
            (s.weights.num_bits, s.weights.group_size if s.weights.strategy == "group" else -1, s.weights.symmetric)
    # AutoAWQ's layout stores zero points whatever `sym` says: quantspec reads them (asymmetric args)
    assert ours == {n: v and (*v[:2], symmetric) for n, v in theirs.items()}
    assert case == "plain" or len(set(theirs.values())) > 1, theirs  # the settings differ by module
