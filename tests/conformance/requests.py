"""The request `lift.py` answers: per artifact, its `quantization_config`, its engine layers
(name, the engine's class for it — read from the engine's own Llama file —, K, and each shard's
N) and each shard's tensors (shape and dtype; `weight_shape`'s values); and how its answer reads
as a verdict (`lifted_status`), beside `quant.engines`' verdicts on the artifact
(`artifact_verdicts`, as `quantspec inspect` computes them)."""

from __future__ import annotations

import json
from pathlib import Path

from safetensors import safe_open

from quantspec.model_zoo.checkpoint import draft_kind, read_config
from quantspec.quant.artifact import read_quant_config
from quantspec.quant.engines import engine_layers, engine_verdicts
from quantspec.quant.engines.drafts import EAGLE3_LAYERS

from .engines import layer_classes


# the tensors whose values a request carries (the rest go as shapes: `lift.py` loads zeros) and
# whose loaded parameters the answer returns
VALUE_LEAVES = ("input_scale", "weight_scale", "weight_zero_point", "weight_global_scale", "input_global_scale")
# an input embedding's codes travel too, and the engine looks these rows up (`lift.py`'s `rows`)
EMBED = "embed_tokens"
EMBEDDING_IDS = (0, 1, 7, 255, 300, 511)
# the engines' weight-only NVFP4 runs (SGLang's scheme for a W4A4 checkpoint below sm_100, vLLM's
# FP4 Marlin kernel): a checkpoint's NVFP4 input quantization is set aside
_WEIGHT_ONLY_NVFP4 = {"has_input_global_scale": True, "kernel": "MarlinNvFp4LinearKernel"}


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
            owner, _, module = name.rpartition(".")
            if name not in linears and owner in linears:  # a run-time transform's matrix (`v_input.weight`)
                name, leaf = owner, f"{module}.{leaf}"
            if name in linears:
                t = h.get_tensor(k)
                spec = {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")}
                if leaf == "weight_shape" or leaf in VALUE_LEAVES or (name.endswith(EMBED) and leaf == "weight_packed") \
                        or "." in leaf:
                    spec["data"] = t.tolist()
                out.setdefault(name, {})[leaf] = spec
    return out


def linear_shapes(tensors: dict) -> dict[str, tuple[int, int]]:
    out = {}
    for name, t in tensors.items():
        if "weight_shape" in t:
            out[name] = tuple(t["weight_shape"]["data"])
        elif "weight_packed" in t:  # NVFP4: two codes a byte, no weight_shape
            out[name] = (t["weight_packed"]["shape"][0], 2 * t["weight_packed"]["shape"][1])
        else:
            out[name] = tuple(t["weight"]["shape"])
    return out


def build_request(src, artifacts: dict[str, Path], capability: int, packed: dict | None = None) -> dict:
    """The request for `artifacts` of the engine `src`: its Llama's layer classes and
    `packed_modules_mapping` (or `packed`, another model class's)."""
    classes = layer_classes(src.model_source())
    req = {"capability": capability,
           "packed_modules_mapping": src.packed_modules_mapping() if packed is None else packed,
           "value_leaves": list(VALUE_LEAVES), "embedding_ids": list(EMBEDDING_IDS), "artifacts": {}}
    for name, path in artifacts.items():
        cfg = json.loads((path / "config.json").read_text())
        tensors = artifact_tensors(path)
        shapes = linear_shapes(tensors)
        layers = {}
        for layer, shards in engine_layers(sorted(tensors)).items():
            attr = layer.rsplit(".", 1)[-1]
            layers[layer] = {"class": classes[attr], "K": shapes[shards[0]][1],
                             "shards": [{"name": s, "N": shapes[s][0]} for s in shards]}
        req["artifacts"][name] = {
            "quantization_config": cfg["quantization_config"], "layers": layers, "tensors": tensors,
            "attention": "model.layers.0.self_attn.attn" if cfg["quantization_config"].get("kv_cache_scheme")
            else None, "num_kv_heads": cfg["num_key_value_heads"]}
    return req


def float_tensors(path: Path, names) -> dict[str, dict[str, dict]]:
    """Linear name → {"weight": shape and dtype} for the Linears of `names` the artifact holds float."""
    out = {}
    with safe_open(str(path / "model.safetensors"), framework="pt") as h:
        keys = set(h.keys())
        for n in names:
            if f"{n}.weight" in keys:
                t = h.get_tensor(f"{n}.weight")
                out[n] = {"weight": {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")}}
    return out


def eagle3_request(engine: str, artifacts: dict[str, Path], target_layers: int, capability: int = 90) -> dict:
    """A request for EAGLE-3 heads: their layers under the engine's names and classes
    (`EAGLE3_LAYERS`, the index of vLLM's layer `target_layers`), with no `packed_modules_mapping`
    (the draft's quant config gets none in either engine) and the float Linears' weights, which an
    engine that picks a scheme for them meets as unexpected tensors. lm_head (float in every
    head quantspec writes) is left out."""
    req = {"capability": capability, "packed_modules_mapping": {}, "value_leaves": list(VALUE_LEAVES),
           "artifacts": {}}
    for name, path in artifacts.items():
        cfg = json.loads((path / "config.json").read_text())
        tensors = artifact_tensors(path)
        shards = [s for _, ss in EAGLE3_LAYERS[engine].values() for s in ss if s != "lm_head"]
        tensors.update(float_tensors(path, [s for s in shards if s not in tensors]))
        shapes = linear_shapes(tensors)
        layers = {layer.format(L=target_layers): {"class": cls, "K": shapes[ss[0]][1],
                                                  "shards": [{"name": s, "N": shapes[s][0]} for s in ss]}
                  for layer, (cls, ss) in EAGLE3_LAYERS[engine].items() if "lm_head" not in ss}
        attention = EAGLE3_ATTENTION[engine].format(L=target_layers) \
            if cfg["quantization_config"].get("kv_cache_scheme") else None
        req["artifacts"][name] = {"quantization_config": cfg["quantization_config"], "layers": layers,
                                  "tensors": tensors, "attention": attention, "num_kv_heads": cfg["num_key_value_heads"]}
    return req


# the engine's name of an EAGLE-3 head's attention (its decoder layer's prefix, `EAGLE3_LAYERS`, + self_attn.attn)
EAGLE3_ATTENTION = {"vllm": "model.layers.{L}.self_attn.attn", "sglang": "model.self_attn.attn"}


def lifted_status(res: dict) -> tuple[str, dict[str, str]]:
    """(status, layer → "refused" / "ignores" / "loads") of one artifact's lifted answer."""
    if res["error"]:
        return "refused", {}
    per = {}
    for layer, r in res["layers"].items():
        if r["error"] or r["load_errors"] or r["casts"]:
            per[layer] = "refused"
        elif r["scheme"] is not None and (r["never_loaded"] or r.get("skipped")):  # parameters left as made,
            # or tensors the model's loader passes over (SGLang: QuIP's transform matrices)
            per[layer] = "ignores"
        elif "input_global_scale" in r["values"] and any(r["args"].get(k) == v for k, v in _WEIGHT_ONLY_NVFP4.items()):
            per[layer] = "ignores"
        elif bool(r["args"].get("kernel_quantizes_inputs", r.get("inputs"))) != bool(r.get("inputs")):
            # the kernel runs other inputs than the config group says: vLLM's FP4 Marlin runs MXFP4
            # inputs float, FlashInfer's W4A4 kernel quantizes float ones, and a W8A16 scheme (FP8
            # inputs below compute capability 8.9) runs them float
            per[layer] = "ignores"
        else:
            per[layer] = "loads"
    kv = res["kv"]
    kv_status = None if kv is None else "refused" if kv["error"] else \
        "ignores" if kv["method"] is None else "loads"
    statuses = list(per.values()) + ([kv_status] if kv_status else [])
    status = "refused" if "refused" in statuses else "ignores" if "ignores" in statuses else "loads"
    return status, per


def artifact_verdicts(path: Path, capability: int = 90) -> dict:
    """`engine_verdicts` of the artifact at `path`: its quantized Linears with their K and N,
    whether it is a draft module and, for an EAGLE-3 head, its base's layer count (as
    `api.inspect`); on a GPU of `capability`."""
    cfg = read_config(path)
    shapes = linear_shapes(artifact_tensors(path))
    dims, rows = {n: s[1] for n, s in shapes.items()}, {n: s[0] for n, s in shapes.items()}
    return engine_verdicts(read_quant_config(path), dims, rows=rows, capability=capability, draft=draft_kind(cfg),
                           base_layers=(cfg.get("quantspec") or {}).get("base_num_layers"))
