"""The request `lift.py` answers: per artifact, its `quantization_config`, its engine layers
(name, the engine's class for it — read from the engine's own Llama file —, K, and each shard's
N) and each shard's tensors (shape and dtype; `weight_shape`'s values)."""

from __future__ import annotations

import json
from pathlib import Path

from safetensors import safe_open

from quantspec.quant.engines import engine_layers

from .engines import layer_classes


# the tensors whose values a request carries (the rest go as shapes: `lift.py` loads zeros) and
# whose loaded parameters the answer returns
VALUE_LEAVES = ("input_scale", "weight_scale", "weight_zero_point")


def artifact_tensors(path: Path) -> dict[str, dict[str, dict]]:
    """Linear name → {leaf: {"shape", "dtype"[, "data"]}} for every quantized Linear ("data":
    `weight_shape` and the `VALUE_LEAVES`)."""
    out: dict[str, dict[str, dict]] = {}
    with safe_open(str(path / "model.safetensors"), framework="pt") as h:
        keys = list(h.keys())
        linears = {k.rsplit(".", 1)[0] for k in keys if k.endswith(".weight_scale")}
        for k in keys:
            if "." not in k:  # a module-less tensor (an MTP module's draft-vocabulary map)
                continue
            name, leaf = k.rsplit(".", 1)
            if name in linears:
                t = h.get_tensor(k)
                spec = {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")}
                if leaf == "weight_shape" or leaf in VALUE_LEAVES:
                    spec["data"] = t.tolist()
                out.setdefault(name, {})[leaf] = spec
    return out


def linear_shapes(tensors: dict) -> dict[str, tuple[int, int]]:
    out = {}
    for name, t in tensors.items():
        if "weight_shape" in t:
            out[name] = tuple(t["weight_shape"]["data"])
        else:
            out[name] = tuple(t["weight"]["shape"])
    return out


def build_request(src, artifacts: dict[str, Path], capability: int) -> dict:
    classes = layer_classes(src.model_source())
    req = {"capability": capability, "packed_modules_mapping": src.packed_modules_mapping(),
           "value_leaves": list(VALUE_LEAVES), "artifacts": {}}
    for name, path in artifacts.items():
        cfg = json.loads((path / "config.json").read_text())
        tensors = artifact_tensors(path)
        shapes = linear_shapes(tensors)
        layers = {}
        for layer, shards in engine_layers(sorted(tensors)).items():
            attr = layer.rsplit(".", 1)[1]
            layers[layer] = {"class": classes[attr], "K": shapes[shards[0]][1],
                             "shards": [{"name": s, "N": shapes[s][0]} for s in shards]}
        req["artifacts"][name] = {
            "quantization_config": cfg["quantization_config"], "layers": layers, "tensors": tensors,
            "attention": "model.layers.0.self_attn.attn" if cfg["quantization_config"].get("kv_cache_scheme")
            else None, "num_kv_heads": cfg["num_key_value_heads"]}
    return req
