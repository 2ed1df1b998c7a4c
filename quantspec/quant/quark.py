"""AMD Quark checkpoints (`quantization_config.quant_method: "quark"`, as the `amd/*-FP8-KV`
releases ship), read in the FP8 W8A8 form vLLM's `quark` method runs:

- `global_quant_config`: FP8 E4M3 weights (`qscheme` per_tensor or per_channel, static) and FP8
  E4M3 inputs (per_tensor static, or per_channel `is_dynamic`: one scale per token at run time),
  no output quantization;
- `exclude`: names, or `re:` regexes, left float (compressed-tensors' ignore rules, as vLLM's
  `should_ignore_layer` matches them);
- an FP8 KV cache where `export.kv_cache_group` names the `layer_quant_config` entries of k_proj /
  v_proj whose `output_tensors` are FP8 per tensor: their scales are stored as
  `self_attn.k_proj.output_scale` / `v_proj.output_scale` (vLLM's `attn.k_scale` / `v_scale`).

The tensors carry compressed-tensors' names (`weight`, `weight_scale`, `input_scale`, scales per
tensor as scalars). A `layer_quant_config` entry other than the KV cache's output scales, a
`layer_type_quant_config`, and other dtypes or schemes (int8, MXFP4, per-group) are refused in one
line. `config_from_quark` gives the `QuantConfig` (its `source` is "quark"); `QuarkTensors` shows
the KV scales under compressed-tensors' names.
"""

from __future__ import annotations

import fnmatch
import re
from typing import Any, Mapping

import torch

from quantspec.errors import QuantSpecError
from quantspec.model_zoo.layout import ShapedTensors, shapes_of
from quantspec.quant.args import FORMAT_FLOAT_QUANTIZED, QuantArgs, QuantType

__all__ = ["QUARK_METHOD", "QuarkTensors", "config_from_quark"]

QUARK_METHOD = "quark"
_W = f"quantization_config (quant_method {QUARK_METHOD!r})"
_FP8 = "fp8_e4m3"
_KV = re.compile(r"^(.*\.self_attn)\.([kv])_proj\.output_scale$")


def _err(msg: str) -> QuantSpecError:
    return QuantSpecError(f"{_W}: {msg}")


def _weights(w: Any) -> QuantArgs:
    if not isinstance(w, Mapping) or w.get("dtype") != _FP8 or w.get("qscheme") not in ("per_tensor", "per_channel") \
            or w.get("is_dynamic"):
        raise _err(f"global_quant_config weight {w!r} is unsupported; quantspec reads static FP8 E4M3 weights per "
                   "tensor or per channel (quantize the original for another type)")
    return QuantArgs(num_bits=8, type="float", strategy="tensor" if w["qscheme"] == "per_tensor" else "channel")


def _inputs(a: Any) -> QuantArgs:
    if isinstance(a, Mapping) and a.get("dtype") == _FP8:
        if a.get("qscheme") == "per_tensor" and not a.get("is_dynamic"):
            return QuantArgs(num_bits=8, type="float", strategy="tensor")
        if a.get("qscheme") == "per_channel" and a.get("is_dynamic"):  # vLLM's kFp8DynamicTokenSym
            return QuantArgs(num_bits=8, type="float", strategy="token", dynamic=True)
    raise _err(f"global_quant_config input_tensors {a!r} is unsupported; quantspec reads FP8 E4M3 inputs per "
               "tensor (static) or per token (per_channel, is_dynamic)")


def _kv(d: Mapping[str, Any], group: list, per_layer: Mapping[str, Any]) -> QuantArgs | None:
    """The KV cache's args: the `output_tensors` of the layer entries `kv_cache_group` names."""
    if not group:
        return None
    outs = [c.get("output_tensors") for name, c in per_layer.items()
            if any(fnmatch.fnmatchcase(name, p) for p in group)]
    if not outs or any(o != outs[0] for o in outs):
        raise _err("export.kv_cache_group names no layer_quant_config entries with one output_tensors setting")
    o = outs[0]
    if not isinstance(o, Mapping) or o.get("dtype") != _FP8 or o.get("qscheme") != "per_tensor":
        raise _err(f"KV cache {o!r} is unsupported; quantspec reads FP8 E4M3 KV-cache scales per tensor")
    return QuantArgs(num_bits=8, type="float", strategy="tensor")


def config_from_quark(d: Mapping[str, Any]):
    """The `QuantConfig` of a Quark checkpoint's `quantization_config` (module docstring)."""
    from quantspec.quant.config import QuantConfig
    from quantspec.quant.scheme import QuantScheme

    export = d.get("export")
    if not isinstance(export, Mapping):
        raise _err("the export block is missing; it is not a Quark export")
    g = d.get("global_quant_config")
    if not isinstance(g, Mapping):
        raise _err("global_quant_config is missing")
    if g.get("output_tensors") is not None or g.get("bias") is not None:
        raise _err("output or bias quantization in global_quant_config is unsupported")
    if d.get("layer_type_quant_config"):
        raise _err("layer_type_quant_config (settings per layer type) is unsupported")
    weights, inputs = _weights(g.get("weight")), _inputs(g.get("input_tensors"))
    per_layer = d.get("layer_quant_config") or {}
    group = list(export.get("kv_cache_group") or [])
    for name, c in per_layer.items():  # the KV cache's entries: the global settings plus output scales
        if not isinstance(c, Mapping) or any(c.get(k) != g.get(k) for k in ("weight", "input_tensors", "bias")):
            raise _err(f"layer_quant_config[{name!r}] quantizes otherwise than global_quant_config, which "
                       "quantspec does not read")
        kv_entry = name == "*q_proj" or any(fnmatch.fnmatchcase(name, p) for p in group)  # vLLM drops q's outputs
        if c.get("output_tensors") is not None and not kv_entry:
            raise _err(f"layer_quant_config[{name!r}] quantizes its outputs, which vLLM and quantspec do not run")
    exclude = d.get("exclude") or []
    if not isinstance(exclude, list) or not all(isinstance(e, str) and e for e in exclude):
        raise _err("exclude must list module names or re: regexes")
    scheme = QuantScheme(targets=("Linear",), weights=weights, input_activations=inputs, format=FORMAT_FLOAT_QUANTIZED)
    return QuantConfig(config_groups={"group_0": scheme}, ignore=tuple(exclude), kv_cache_scheme=_kv(d, group, per_layer),
                       format=FORMAT_FLOAT_QUANTIZED, source=QUARK_METHOD, quant_type=QuantType.A8W8_FP8)


class QuarkTensors(ShapedTensors):
    """A Quark checkpoint's tensors under compressed-tensors' names and shapes: its KV scales
    (`self_attn.k_proj.output_scale`) as `self_attn.k_scale` ([1]; `v` likewise), a weight scale
    per channel ([N], as vLLM's Quark scheme makes it) as [N, 1]; every other tensor as stored."""

    def __init__(self, tensors: Mapping[str, torch.Tensor]):
        self.base = tensors
        base_shapes = shapes_of(tensors)
        self.names: dict[str, str] = {}
        self.shapes = {}
        for k, shape in base_shapes.items():
            kv = _KV.match(k)
            shown = f"{kv.group(1)}.{kv.group(2)}_scale" if kv else k
            self.names[shown] = k
            per_channel = k.endswith(".weight_scale") and len(shape) == 1 and shape[0] > 1
            self.shapes[shown] = (1,) if kv else (shape[0], 1) if per_channel else tuple(shape)

    def __getitem__(self, name: str) -> torch.Tensor:
        t = self.base[self.names[name]]
        return t.reshape(self.shapes[name]) if tuple(t.shape) != self.shapes[name] else t
