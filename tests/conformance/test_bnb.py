"""bitsandbytes checkpoints against the engines' own code: the quantization methods each pinned
engine accepts, read from its source. vLLM 0.33 has none for `bitsandbytes` (so a QLoRA /
`*-bnb-4bit` checkpoint must become an artifact to load there: `quantize` takes it as a source,
`quant.bnb`); SGLang 0.5.23 still maps it to its `BitsAndBytesConfig`."""

from __future__ import annotations

import ast

import pytest


def _source(engine_sources, engine: str):
    src = engine_sources[engine]
    if isinstance(src, str):
        pytest.skip(src)
    return src


def test_vllm_has_no_bitsandbytes_method(engine_sources):
    src = _source(engine_sources, "vllm")
    tree = ast.parse((src.source / "vllm/model_executor/layers/quantization/__init__.py").read_text())
    lit = next(n for n in ast.walk(tree) if isinstance(n, ast.Assign)
               and any(getattr(t, "id", None) == "QuantizationMethods" for t in n.targets))
    methods = {c.value for c in ast.walk(lit.value) if isinstance(c, ast.Constant) and isinstance(c.value, str)}
    assert {"compressed-tensors", "gptq", "awq"} <= methods and "bitsandbytes" not in methods, sorted(methods)


def test_sglang_maps_bitsandbytes_to_its_own_config(engine_sources):
    src = _source(engine_sources, "sglang")
    tree = ast.parse((src.source / "sglang/srt/layers/quantization/__init__.py").read_text())
    table = next(n for n in ast.walk(tree) if isinstance(n, ast.AnnAssign)
                 and getattr(n.target, "id", None) == "BASE_QUANTIZATION_METHODS")
    entries = {k.value: getattr(v, "id", None) for k, v in zip(table.value.keys, table.value.values)}
    assert entries.get("bitsandbytes") == "BitsAndBytesConfig"
