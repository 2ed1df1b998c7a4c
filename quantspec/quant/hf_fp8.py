"""FP8 checkpoints in transformers' and vLLM's own format (`quantization_config.quant_method:
"fp8"`, as Qwen3-*-FP8, DeepSeek-V3 and AutoFP8 ship them), read as the compressed-tensors
scheme they are.

- `weight_block_size: [bn, bk]` (fine-grained FP8): E4M3 weights with one scale per [bn, bk]
  block, stored as `weight_scale_inv` (the factor dequantization multiplies by, despite its
  name) [ceil(N / bn), ceil(K / bk)]; inputs quantized per token and group of bk at run time
  (`activation_scheme: "dynamic"`, the only one such checkpoints use). This is compressed-tensors'
  FP8_BLOCK with another name for the scale.
- no `weight_block_size`: per-tensor `weight_scale`, and a static per-tensor `input_scale`
  (`activation_scheme: "static"`) or inputs quantized per token at run time ("dynamic").
`modules_to_not_convert` (transformers) / `ignored_layers` (vLLM) name modules as transformers
matches them (from the start up to a module boundary, or as a suffix); they become `re:` ignore
patterns. `config_from_hf_fp8` gives the `QuantConfig`, whose `tensor_names`
maps compressed-tensors' leaf names to the checkpoint's.
"""

from __future__ import annotations

import re
from typing import Any, Mapping

from quantspec.errors import QuantSpecError
from quantspec.quant.args import FORMAT_FLOAT_QUANTIZED, QuantArgs, QuantType

__all__ = ["HF_FP8_METHOD", "config_from_hf_fp8"]

HF_FP8_METHOD = "fp8"
_KNOWN = {"quant_method", "fmt", "activation_scheme", "weight_block_size", "modules_to_not_convert",
          "ignored_layers", "dequantize"}
_W = "quantization_config (quant_method 'fp8')"


def config_from_hf_fp8(d: Mapping[str, Any]):
    """The `QuantConfig` of an FP8 checkpoint's `quantization_config` (module docstring); one line
    naming the field for what quantspec does not run."""
    from quantspec.quant.config import QuantConfig
    from quantspec.quant.scheme import QuantScheme

    unknown = sorted(set(d) - _KNOWN)
    if unknown:
        raise QuantSpecError(f"{_W}: unknown key(s) {unknown}; remove them")
    if d.get("fmt", "e4m3") != "e4m3":
        raise QuantSpecError(f"{_W}: fmt {d['fmt']!r} is unsupported; quantspec runs E4M3 ('e4m3') weights")
    act = d.get("activation_scheme", "dynamic")
    if act not in ("dynamic", "static"):
        raise QuantSpecError(f"{_W}: activation_scheme {act!r} is unsupported; use 'dynamic' or 'static'")
    block = d.get("weight_block_size")
    if block is not None:
        if act != "dynamic":
            raise QuantSpecError(f"{_W}: block weights (weight_block_size) with static activations are "
                                 "unsupported; use activation_scheme 'dynamic'")
        try:
            weights = QuantArgs(type="float", strategy="block", block_structure=block)
        except QuantSpecError as e:
            raise QuantSpecError(f"{_W}: weight_block_size {block!r}: {e}") from None
        inputs = QuantArgs(type="float", strategy="group", group_size=weights.block_structure[1], dynamic=True)
        names = {"weight_scale": "weight_scale_inv"}
    else:
        weights = QuantArgs(type="float", strategy="tensor")
        inputs = QuantArgs(type="float", strategy="tensor") if act == "static" else \
            QuantArgs(type="float", strategy="token", dynamic=True)
        names = {}
    skip = list(d.get("modules_to_not_convert") or []) + list(d.get("ignored_layers") or [])
    if not all(isinstance(s, str) and s for s in skip):
        raise QuantSpecError(f"{_W}: modules_to_not_convert / ignored_layers must list module names")
    # transformers' rule: a pattern matches from the start up to a module boundary (as a regex),
    # or as the name's suffix
    ignore = tuple(dict.fromkeys(["lm_head"] + [t for s in skip for t in (
        rf"re:(?:{s})(?:(?<=\.)|(?=\.|$))", f"re:.*{re.escape(s)}$")]))
    scheme = QuantScheme(targets=("Linear",), weights=weights, input_activations=inputs, format=FORMAT_FLOAT_QUANTIZED)
    return QuantConfig(config_groups={"group_0": scheme}, ignore=ignore, format=FORMAT_FLOAT_QUANTIZED,
                       quant_type=QuantType.A8W8_FP8, tensor_names=names)
