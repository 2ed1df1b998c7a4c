"""Which Linears a `QuantConfig` quantizes in a model, at which group or block size, the static
input scales they need, and which of them a method can quantize: the questions PTQ asks of a
config before it quantizes anything (`calib.ptq`)."""

from __future__ import annotations

from typing import Mapping

import torch
from torch import nn

from quantspec.errors import QuantSpecError
from quantspec.quant.args import QuantArgs
from quantspec.quant.artifact_plan import weight_dims
from quantspec.quant.config import QuantConfig, layer_size, resolve_block_size, resolve_group_size
from quantspec.quant.fp4 import check_groups_tile
from quantspec.quant.presets import DATA_METHODS

__all__ = ["EMBED", "check_input_scales", "check_outside", "quantized_linears", "resolve_layer_group_sizes"]

EMBED = "model.embed_tokens"  # the input embedding: quantized only where a target names it


def quantized_linears(model: nn.Module, config: QuantConfig) -> dict[str, nn.Module]:
    """Module name → module for every Linear the config quantizes (ignore list honoured), and the
    input embedding (an `nn.Embedding`, its rows quantized as a Linear's) where a config group
    names it."""
    out = {}
    for name, mod in model.named_modules():
        if isinstance(mod, (nn.Linear, nn.Embedding)):
            classes = tuple(c.__name__ for c in type(mod).__mro__)
            scheme = config.scheme_for(name, classes)
            if scheme is not None and scheme.weights is not None:
                out[name] = mod
    return out


def resolve_layer_group_sizes(model: nn.Module, config: QuantConfig) -> QuantConfig:
    """`config` with every grouped Linear at a group size that divides its K and every block
    Linear at a block that tiles it, one size per fused unit (q/k/v, gate/up, a fused-MoE layer)
    (`QuantConfig.with_group_sizes` arranges the groups so every loader resolves them; an EAGLE-3
    head's groups also name its layers as vLLM and SGLang do, `engines.eagle3_targets`)."""
    from quantspec.model_zoo.eagle3 import Eagle3Head
    from quantspec.quant.engines import eagle3_targets, engine_layers

    sizes = {}
    for name, mod in quantized_linears(model, config).items():
        scheme = config.scheme_for(name)
        args = scheme.weights
        if args.microscaled:  # NVFP4's, MXFP4's and MXFP8's group size is the format's own
            check_groups_tile(name, weight_dims(mod)[1], args.group_size, args.microscaled.upper())
            if scheme.sized_by_inputs:  # a8w4_mxfp4: its FP8 input groups tile K
                sizes[name] = resolve_group_size(weight_dims(mod)[1], scheme.input_activations.group_size)
        elif args.strategy == "group":
            sizes[name] = resolve_group_size(weight_dims(mod)[1], args.group_size)
        elif args.strategy == "block":
            sizes[name] = resolve_block_size(mod.in_features, mod.out_features, args.block_structure)
    for members in engine_layers(sizes).values():  # a fused unit or fused-MoE layer: one size
        common = -1 if any(sizes[n] == -1 for n in members) else min(sizes[n] for n in members)
        sizes.update(dict.fromkeys(members, common))
    if all(g == layer_size(config.scheme_for(n)) for n, g in sizes.items()):
        return config
    return config.with_group_sizes(sizes, eagle3_targets if isinstance(model, Eagle3Head) else None)


def check_input_scales(layer_args_in: Mapping[str, QuantArgs], config: QuantConfig,
                        input_scales: Mapping[str, torch.Tensor | float] | None) -> dict[str, torch.Tensor]:
    out = {}
    for name in layer_args_in:
        scheme = config.scheme_for(name)
        ia = scheme.input_activations
        if ia is None or (ia.dynamic and not ia.is_nvfp4):
            continue
        if input_scales is None or name not in input_scales:
            qt = config.quant_type.value if config.quant_type else "this scheme"
            what = "input global scales" if ia.is_nvfp4 else "static activation scales"
            raise QuantSpecError(f"{qt} needs {what} and none were given for "
                                 f"{name}; run `quantspec calibrate` and pass --calib DIR")
        s = torch.as_tensor(input_scales[name], dtype=torch.float32).reshape(-1)
        if s.numel() != 1 or not torch.isfinite(s).all() or float(s) <= 0:
            raise QuantSpecError(f"input scale for {name} must be one positive finite number, got "
                                 f"{s.tolist()[:4]}; re-run `quantspec calibrate`")
        out[name] = s
    return out


def check_outside(method: str, outside: list[str], measured: bool = False) -> None:
    """GPTQ / AWQ on the quantized Linears `outside` the decoder layers: the output head is
    calibrated on the last layer's outputs (GPTQ) or rounded to nearest (AWQ: no norm of its own
    to fold factors into), the embedding rounded to nearest (a lookup: each row's error is its
    own); another one has no calibration path here (a draft module's Linears are calibrated on
    its base's hidden states, `calib.draft_calib`: `measured`)."""
    if measured:
        return
    beyond = [n for n in outside if n not in ("lm_head", EMBED)]
    if method in DATA_METHODS and beyond:
        raise QuantSpecError(f"{method.upper()} quantizes decoder-layer Linears only; add {beyond[0]} to "
                             "--ignore or use --method rtn")
