"""Rotations fused into the weights (`quantize --rotate`, `calib.rotate`) against the engines'
own code: vLLM validates the artifact's `transform_config` with its pinned compressed-tensors and
its `get_linear_transform_schemes` wraps no Linear in a run-time transform (every transform is
fused), while the same config with one transform moved to run time makes it wrap exactly the
Linears that transform targets (the lifted code does read the config); SGLang's model and
quantization code never reads `transform_config` (nothing is left for it to run)."""

from __future__ import annotations

import json
import shutil

import pytest

from . import engines as eng
from .requests import build_request

ROTATED = "weight_only_int4_rotated"


def _answer(engine_sources, artifacts, tmp_path, online: bool) -> dict:
    src = engine_sources["vllm"]
    if isinstance(src, str):
        pytest.skip(src)
    path = artifacts[ROTATED]
    if online:  # R1's input side at run time instead of fused: vLLM must wrap q/k/v, gate/up in it
        path = tmp_path / "online"
        shutil.copytree(artifacts[ROTATED], path)
        cfg = json.loads((path / "config.json").read_text())
        cfg["quantization_config"]["transform_config"]["config_groups"]["R1"]["apply"][1]["location"] = "input"
        (path / "config.json").write_text(json.dumps(cfg))
    return src.run(build_request(src, {ROTATED: path}, 90), tmp_path)["result"][ROTATED]


def test_vllm_runs_the_fused_rotations_as_plain_linears(engine_sources, artifacts, tmp_path):
    res = _answer(engine_sources, artifacts, tmp_path, online=False)
    assert res["error"] is None
    linears = {n: r for n, r in res["layers"].items() if r.get("scheme")}
    assert linears and all(r["transforms"] is None and r["error"] is None and not r["load_errors"]
                           for r in linears.values()), linears


def test_vllm_wraps_the_linears_a_run_time_transform_targets(engine_sources, artifacts, tmp_path):
    res = _answer(engine_sources, artifacts, tmp_path, online=True)
    assert res["error"] is None
    wrapped = {n for n, r in res["layers"].items() if r.get("transforms")}
    assert wrapped == {n for n in res["layers"] if n.endswith(("qkv_proj", "gate_up_proj"))}, wrapped
    r = res["layers"]["model.layers.0.self_attn.qkv_proj"]["transforms"]
    assert r["input_tfms"] == {"0": "R1:input", "1": "R1:input", "2": "R1:input"} and r["output_tfms"] == {}


def test_sglang_reads_no_transform_config(engine_sources):
    src = engine_sources["sglang"]
    if isinstance(src, str):
        pytest.skip(src)
    readers = [f for f in src.files_mentioning("transform_config") if f.startswith("sglang/srt/")
               and "debug_utils" not in f]
    assert readers == [], readers
    assert eng.ENGINE_PINS["sglang"] in str(src.source)
