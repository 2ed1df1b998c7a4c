"""QuIP's run-time transforms (`quantize --quip`, `calib.quip`) against vLLM's own code: its
`get_linear_transform_schemes` wraps every turned Linear (fused ones by partition) in its
`CompressedTensorsLinearTransformMethod`, whose `create_weights` registers the transform modules
(`v_input`, `u_output`) and their `SharedWeightParameter`s; every matrix the artifact stores is loaded
through those parameters' own shard loaders (none left unloaded, none unexpected), the input
transform's partitions share one tensor, and the values loaded are the artifact's ±1 Sylvester
blocks. The Linears the artifact leaves unturned (lm_head) are not wrapped."""

from __future__ import annotations

import pytest
import torch

from quantspec import api
from quantspec.quant.transforms import sylvester

from .requests import build_request

QUIP = "weight_only_int4_quip"


@pytest.fixture(scope="module")
def quip_answer(engine_sources, conformance_model, tmp_path_factory):
    src = engine_sources["vllm"]
    if isinstance(src, str):
        pytest.skip(src)
    root = tmp_path_factory.mktemp("quip")
    art = api.quantize(str(conformance_model), "weight_only_int4", root / QUIP, group_size=64, quip="v,u",
                       quip_block_size=32, target="vllm")
    return src.run(build_request(src, {QUIP: art}, 90), root)["result"][QUIP]


def test_vllm_wraps_every_turned_linear_in_its_transforms(quip_answer):
    assert quip_answer["error"] is None
    layers = quip_answer["layers"]
    decoder = {n: r for n, r in layers.items() if n.startswith("model.layers.")}
    assert decoder and all(r["error"] is None and r["scheme"] for r in decoder.values()), decoder
    for name, r in decoder.items():
        parts = {"qkv_proj": 3, "gate_up_proj": 2}.get(name.rsplit(".", 1)[-1], 1)
        assert r["transforms"] == {"input_tfms": {str(i): "v:input" for i in range(parts)},
                                   "output_tfms": {str(i): "u:output" for i in range(parts)}}, (name, r["transforms"])
    assert all(r.get("transforms") is None for n, r in layers.items() if not n.startswith("model.layers."))


def test_vllm_loads_every_matrix_where_the_artifact_stores_it(quip_answer):
    block = sylvester(32)
    for name, r in quip_answer["layers"].items():
        if not r.get("transforms"):
            continue
        assert not r["load_errors"] and not r["never_loaded"], (name, r["load_errors"], r["never_loaded"])
        values = r["transform_values"]
        assert set(values) == {"v_input", "u_output"}, (name, set(values))
        assert values["v_input"]["shared"]  # one input: vLLM requires its partitions to share the tensor
        for t in values.values():
            for part in t["parts"].values():
                assert torch.equal(torch.tensor(part), block), name
