"""NVFP4 and FP8 checkpoints in NVIDIA ModelOpt's own format (`quantization_config.quant_method:
"modelopt"`, or the older `hf_quant_config.json` beside config.json, which
`model_zoo.hf_config.modelopt_sidecar` reads into it), read as the
compressed-tensors scheme they are.

FP8 (`quant_algo`, as vLLM's ModelOpt method resolves them): "FP8" (the `nvidia/*-FP8` releases:
FP8 weights with one scale each and static per-tensor FP8 inputs), "FP8_PER_CHANNEL_PER_TOKEN"
(a scale per output channel, inputs per token at run time) and "FP8_PB_WO" (a scale per 128 × 128
block, inputs per group of 128 at run time); their tensors carry compressed-tensors' names
(`weight`, `weight_scale`, `input_scale`), scales as 0-d scalars (per tensor) or [N] (per channel:
shown [N, 1]). "MIXED_PRECISION" gives each module its own algo (`quantized_layers`: {module:
{"quant_algo": ...}}; a module it leaves out is float, as in vLLM): a config group per algo,
targeting its modules by name.

NVFP4: `quant_algo` "NVFP4" (W4A4) or "W4A16_NVFP4"; per quantized Linear the checkpoint holds
- `weight` uint8 [N, K/2]: two E2M1 codes a byte, compressed-tensors' `weight_packed` layout;
- `weight_scale` float8_e4m3fn [N, K/16]: the local scales, as compressed-tensors stores them;
- `weight_scale_2` fp32 (one value): the reciprocal of compressed-tensors' `weight_global_scale`;
- `input_scale` fp32 (W4A4): the reciprocal of its `input_global_scale`;
and an FP8 KV cache (`kv_cache_quant_algo: "FP8"`, or a `kv_cache_scheme` of 8-bit floats) keeps
its per-tensor `k_scale` / `v_scale` on `self_attn.k_proj` / `v_proj`. These are compressed-tensors'
own conversion rules (its `ModelOptNvfp4Converter`) and vLLM's loader's. `exclude_modules` /
`ignore` entries match a module name exactly, as a substring or as a shell wildcard (vLLM's
`is_layer_excluded`). `config_from_modelopt` gives the `QuantConfig` (its `source` is
"modelopt"); `ModelOptTensors` shows a checkpoint's tensors under compressed-tensors' names.
"""

from __future__ import annotations

import fnmatch
import re
from typing import Any, Mapping

import torch

from quantspec.errors import QuantSpecError
from quantspec.model_zoo.layout import ShapedTensors, shapes_of
from quantspec.quant.args import (
    FORMAT_FLOAT_QUANTIZED,
    FORMAT_MIXED_PRECISION,
    FORMAT_NVFP4_PACK_QUANTIZED,
    NVFP4_GROUP_SIZE,
    QuantArgs,
    QuantType,
)

__all__ = ["MODELOPT_METHOD", "ModelOptTensors", "config_from_modelopt"]

MODELOPT_METHOD = "modelopt"
_ALGOS = {"NVFP4": True, "W4A16_NVFP4": False}  # quant_algo → NVFP4 inputs
MIXED = "MIXED_PRECISION"  # a quant_algo per module (`quantized_layers`)
_FP8 = dict(num_bits=8, type="float")
# FP8 quant_algo → (weight args, input args)
FP8_ALGOS = {
    "FP8": (QuantArgs(**_FP8, strategy="tensor"), QuantArgs(**_FP8, strategy="tensor")),
    "FP8_PER_CHANNEL_PER_TOKEN": (QuantArgs(**_FP8, strategy="channel"),
                                  QuantArgs(**_FP8, strategy="token", dynamic=True)),
    "FP8_PB_WO": (QuantArgs(**_FP8, strategy="block", block_structure=(128, 128)),
                  QuantArgs(**_FP8, strategy="group", group_size=128, dynamic=True)),
}
_W = "quantization_config (quant_method 'modelopt')"
# shown (compressed-tensors) leaf → (stored leaf, how the value is shown: as stored, or 1 / it as [1])
_LEAVES = {"weight_packed": ("weight", "same"), "weight_global_scale": ("weight_scale_2", "reciprocal"),
           "input_global_scale": ("input_scale", "reciprocal")}
_KV = re.compile(r"^(.*\.self_attn)\.([kv])_proj\.([kv])_scale$")


def _fields(d: Mapping[str, Any]) -> tuple[str, str | None, list, Any, Any]:
    """(quant_algo, KV algo, exclude list, group size, MIXED_PRECISION's quantized_layers) of
    config.json's block or the sidecar's."""
    if "quantization" in d:  # hf_quant_config.json: {"producer": ..., "quantization": {...}}
        q = d["quantization"]
        if not isinstance(q, Mapping):
            raise QuantSpecError(f"{_W}: 'quantization' must be a mapping")
        return str(q.get("quant_algo") or ""), q.get("kv_cache_quant_algo"), q.get("exclude_modules") or [], \
            q.get("group_size"), q.get("quantized_layers")
    kv = d.get("kv_cache_scheme")
    kv_algo = "FP8" if isinstance(kv, Mapping) and kv.get("type") == "float" and kv.get("num_bits") == 8 else \
        (None if kv is None else "other")
    return str(d.get("quant_algo") or ""), kv_algo, d.get("ignore", d.get("exclude_modules")) or [], \
        d.get("group_size"), d.get("quantized_layers")


def _scheme_args(algo: str, group: Any, where: str) -> tuple[QuantArgs, QuantArgs | None, str, QuantType]:
    """(weight args, input args, format, quant type) of a linear `quant_algo`."""
    algo = str(algo).upper()
    if algo not in _ALGOS and algo not in FP8_ALGOS:
        raise QuantSpecError(f"{_W}: {where}quant_algo {algo or None!r} is unsupported; quantspec runs ModelOpt's "
                             f"{', '.join([*_ALGOS, *FP8_ALGOS, MIXED])} checkpoints (quantize the original for "
                             "another type)")
    if algo in FP8_ALGOS:
        return (*FP8_ALGOS[algo], FORMAT_FLOAT_QUANTIZED, QuantType.A8W8_FP8)
    if group not in (None, NVFP4_GROUP_SIZE, str(NVFP4_GROUP_SIZE)):
        raise QuantSpecError(f"{_W}: {where}group_size {group!r} is not NVFP4's {NVFP4_GROUP_SIZE}")
    weights = QuantArgs(num_bits=4, type="float", strategy="tensor_group", group_size=NVFP4_GROUP_SIZE)
    inputs = weights.replace(dynamic="local") if _ALGOS[algo] else None
    return weights, inputs, FORMAT_NVFP4_PACK_QUANTIZED, QuantType.NVFP4 if inputs else QuantType.WEIGHT_ONLY_NVFP4


def _mixed_groups(layers: Any) -> dict[str, tuple[list[str], tuple]]:
    """MIXED_PRECISION's `quantized_layers` ({module: {"quant_algo": ..., "group_size": ...}}) →
    {algo: (its modules, `_scheme_args`)}; a module not listed stays float (vLLM's rule)."""
    if not isinstance(layers, Mapping) or not layers or not all(
            isinstance(k, str) and isinstance(v, Mapping) for k, v in layers.items()):
        raise QuantSpecError(f"{_W}: quant_algo MIXED_PRECISION needs quantized_layers, a mapping of module "
                             "names to their quant_algo")
    out: dict[str, tuple[list[str], tuple]] = {}
    for name, info in layers.items():
        algo = str(info.get("quant_algo") or "").upper()
        args = _scheme_args(algo, info.get("group_size"), f"quantized_layers[{name!r}]: ")
        out.setdefault(algo, ([], args))[0].append(name)
    return out


def config_from_modelopt(d: Mapping[str, Any]):
    """The `QuantConfig` of a ModelOpt checkpoint's quantization config (config.json's block or
    the sidecar's); one line naming the field for what quantspec does not run."""
    from quantspec.quant.config import QuantConfig
    from quantspec.quant.scheme import QuantScheme

    algo, kv_algo, exclude, group, layers = _fields(d)
    algo = algo.upper()
    if kv_algo is not None and str(kv_algo).upper() != "FP8":
        raise QuantSpecError(f"{_W}: KV cache {kv_algo!r} is unsupported; quantspec reads FP8 KV-cache scales")
    if not isinstance(exclude, list) or not all(isinstance(e, str) and e for e in exclude):
        raise QuantSpecError(f"{_W}: exclude_modules / ignore must list module names or wildcards")
    ignore = tuple(dict.fromkeys(["lm_head"] + [p for e in exclude for p in (
        f"re:.*{re.escape(e)}.*", "re:" + fnmatch.translate(e))]))
    kv = None if kv_algo is None else QuantArgs(num_bits=8, type="float", strategy="tensor")
    per_algo = _mixed_groups(layers) if algo == MIXED else {algo: (["Linear"], _scheme_args(algo, group, ""))}
    groups = {f"group_{i}": QuantScheme(targets=tuple(names), weights=w, input_activations=a, format=fmt)
              for i, (names, (w, a, fmt, _)) in enumerate(per_algo.values())}
    formats = {s.format for s in groups.values()}
    _, (_, _, _, qt) = max(per_algo.values(), key=lambda v: len(v[0]))  # the type of most modules
    return QuantConfig(config_groups=groups, ignore=ignore, kv_cache_scheme=kv,
                       format=formats.pop() if len(formats) == 1 else FORMAT_MIXED_PRECISION,
                       source=MODELOPT_METHOD, quant_type=qt)


class ModelOptTensors(ShapedTensors):
    """A ModelOpt checkpoint's tensors under compressed-tensors' names (module docstring): each
    quantized Linear's (those `config` quantizes whose stored `weight_scale_2` is there) `weight`
    shown as `weight_packed`, `weight_scale_2` / `input_scale` as their reciprocals
    `weight_global_scale` / `input_global_scale`, and `self_attn.k_proj.k_scale` as
    `self_attn.k_scale` (`v` likewise)."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], config):
        self.base = tensors
        base_shapes = shapes_of(tensors)
        self.names: dict[str, tuple[str, str]] = {}  # shown → (stored, "same" | "reciprocal" | "scalar")
        quantized = {k.rsplit(".", 1)[0] for k in base_shapes if k.endswith(".weight_scale_2")}
        for k in base_shapes:
            module, _, leaf = k.rpartition(".")
            kv = _KV.match(k)
            if kv is not None and kv.group(2) == kv.group(3):
                self.names[f"{kv.group(1)}.{kv.group(2)}_scale"] = (k, "scalar")  # one per tensor, as [1]
                continue
            shown = next((s for s, (stored, _) in _LEAVES.items() if stored == leaf), None)
            scheme = config.scheme_for(module) if leaf == "weight_scale" or shown is not None else None
            if shown is not None and module in quantized and scheme is not None:
                self.names[f"{module}.{shown}"] = (k, _LEAVES[shown][1])
            elif leaf == "weight_scale" and scheme is not None and scheme.weights.strategy == "channel" \
                    and len(base_shapes[k]) == 1:
                self.names[k] = (k, "column")  # FP8 per channel: [N] shown as compressed-tensors' [N, 1]
            else:
                self.names[k] = (k, "same")
        self.shapes = {shown: tuple(base_shapes[k]) if how == "same" else (base_shapes[k][0], 1) if how == "column"
                       else (1,) for shown, (k, how) in self.names.items()}

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self.names:
            raise KeyError(name)
        stored, how = self.names[name]
        t = self.base[stored]
        if how == "same":
            return t
        if how == "column":
            return t.reshape(-1, 1)
        return (1.0 / t.float() if how == "reciprocal" else t.float()).reshape(1)
