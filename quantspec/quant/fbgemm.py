"""FP8 checkpoints in FBGEMM's format (`quantization_config.quant_method: "fbgemm_fp8"`, as Meta's
`Llama-3.1-*-Instruct-FP8` releases ship), read as vLLM's `fbgemm_fp8` method reads them: E4M3
weights (`weight`) with a scale per output channel (`weight_scale` [N, 1]), inputs quantized to
FP8 per token at run time under an upper bound on their scale (`activation_scale_ub`: a token's
absolute maximum is taken as at most that bound, so larger values saturate, as vLLM's
`scaled_fp8_quant(scale_ub=...)` does), `modules_to_not_convert` left float (exact names, as
vLLM's `is_layer_skipped`), the output head float. The bound is the config's `input_bound`, which
each quantized Linear applies before its per-token quantizer; an `input_scale_ub` tensor some
exports store beside each Linear (the same bound) is not read.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from quantspec.errors import QuantSpecError
from quantspec.model_zoo.layout import ShapedTensors, shapes_of
from quantspec.quant.args import FORMAT_FLOAT_QUANTIZED, QuantArgs, QuantType

__all__ = ["FBGEMM_METHOD", "FbgemmTensors", "config_from_fbgemm"]

FBGEMM_METHOD = "fbgemm_fp8"
_W = f"quantization_config (quant_method {FBGEMM_METHOD!r})"
_BOUND_LEAF = ".input_scale_ub"


def config_from_fbgemm(d: Mapping[str, Any]):
    """The `QuantConfig` of an FBGEMM FP8 checkpoint's `quantization_config` (module docstring)."""
    from quantspec.quant.config import QuantConfig
    from quantspec.quant.scheme import QuantScheme

    bound = d.get("activation_scale_ub")
    if isinstance(bound, bool) or not isinstance(bound, (int, float)) or not bound > 0:
        raise QuantSpecError(f"{_W}: activation_scale_ub must be a number > 0, got {bound!r}")
    skip = d.get("modules_to_not_convert") or []
    if not isinstance(skip, list) or not all(isinstance(s, str) and s for s in skip):
        raise QuantSpecError(f"{_W}: modules_to_not_convert must list module names")
    scheme = QuantScheme(targets=("Linear",), weights=QuantArgs(num_bits=8, type="float", strategy="channel"),
                         input_activations=QuantArgs(num_bits=8, type="float", strategy="token", dynamic=True),
                         format=FORMAT_FLOAT_QUANTIZED)
    return QuantConfig(config_groups={"group_0": scheme}, ignore=tuple(dict.fromkeys(["lm_head", *skip])),
                       format=FORMAT_FLOAT_QUANTIZED, quant_type=QuantType.A8W8_FP8, source=FBGEMM_METHOD,
                       input_bound=float(bound))


class FbgemmTensors(ShapedTensors):
    """An FBGEMM FP8 checkpoint's tensors without the `input_scale_ub` ones (module docstring)."""

    def __init__(self, tensors: Mapping[str, torch.Tensor]):
        self.base = tensors
        base_shapes = shapes_of(tensors)
        self.shapes = {k: tuple(s) for k, s in base_shapes.items() if not k.endswith(_BOUND_LEAF)}

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self.shapes:
            raise KeyError(name)
        return self.base[name]
