"""`serve --kv-cache-dtype` (vLLM's flag) with `--calib`: the server runs the static fp8 / int8 KV
cache of a calibration table's scales, or a float cache over an artifact that carries KV scales,
and answers as `quantspec infer` with the same KV cache does; a --calib no static cache reads is
refused."""

from __future__ import annotations

import openai
import pytest
import torch

from quantspec import api
from quantspec.errors import QuantSpecError
from quantspec.infer.predictor import InferConfig, Predictor
from quantspec.serve.server import ServeConfig

PROMPT = "Tell me a story"


@pytest.fixture(scope="module")
def table(tiny_llama_dir, calibration_table):
    return calibration_table(tiny_llama_dir)


def _infer(model, cachekv, kv_scales=None, loaded=None) -> str:
    config = InferConfig(model=str(model), max_new_tokens=16, max_length=256, cachekv=cachekv)
    return Predictor(config, kv_scales=kv_scales, loaded=loaded).generate([PROMPT])[0].text


def _served(url) -> str:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
    return client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": PROMPT}],
                                          max_tokens=16, temperature=0).choices[0].message.content


@pytest.mark.parametrize("kind", ["fp8", "int8"])
def test_a_table_s_scales_make_the_served_kv_cache(tiny_llama_dir, tiny_loaded, start_server, table, kind):
    scales = api.table_kv_scales(table, str(tiny_llama_dir), kind)
    with start_server(kv_cache_dtype="fp8_e4m3" if kind == "fp8" else kind, calib=str(table), speculate_method="none",
                      kv_scales=scales) as (url, state):
        assert kind in state.kv_cache and "calibration table" in state.kv_cache
        cache = state.loop.engine.cache
        assert cache.k.dtype == (torch.int8 if kind == "int8" else torch.float8_e4m3fn)
        assert torch.equal(cache.k_scale, scales[0].float()) and torch.equal(cache.v_scale, scales[1].float())
        got = _served(url)
    assert got == _infer(tiny_llama_dir, kind, scales, tiny_loaded)


def test_float_overrides_an_artifact_s_kv_scales(tiny_llama_dir, serve, table, tmp_path):
    from quantspec.infer.loader import load_for_inference

    art = api.quantize(str(tiny_llama_dir), "weight_only_int8", tmp_path / "w8kv", kv_cache="fp8", calib=table)
    loaded = load_for_inference(str(art))
    base = dict(model=str(art), served_model_name="tiny", max_length=256)
    with serve(ServeConfig(**base), loaded=loaded) as (url, state):
        assert "fp8" in state.kv_cache  # auto: the artifact's own scheme
    with serve(ServeConfig(**base, kv_cache_dtype="float"), loaded=loaded) as (url, state):
        assert "fp8" not in state.kv_cache and state.loop.engine.cache.k.dtype == torch.float32
        assert _served(url) == _infer(art, "float", loaded=loaded)


def test_the_cli_offers_the_kv_cache_dtypes_the_engine_reads():
    from quantspec.cli.generate import KV_CACHE_CHOICES
    from quantspec.infer.predictor import KV_CACHE_DTYPES

    assert KV_CACHE_CHOICES == tuple(KV_CACHE_DTYPES)


def test_calib_without_a_static_kv_cache_is_refused(tiny_llama_dir, table):
    with pytest.raises(QuantSpecError, match="--kv-cache-dtype"):
        ServeConfig(model=str(tiny_llama_dir), calib=str(table))
    with pytest.raises(QuantSpecError, match="--kv-cache-dtype"):
        ServeConfig(model=str(tiny_llama_dir), kv_cache_dtype="fp8_e5m2")
