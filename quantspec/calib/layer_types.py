"""Mixed precision: `quantize --layer-quant-type TARGET=QUANT_TYPE` gives the Linears a target names
another type than the model's `--quant-type`, in a config group of their own.

- A TARGET is a module name or `re:` regex, as `--ignore` takes (and compressed-tensors matches:
  an exact name or regex outranks the model's class target "Linear" in every loader).
- The model's type and every layer's type need no calibration table (`LAYER_TYPES`): weight-only
  types, and those whose inputs are quantized at run time — a8w8 and a8w8_fp8 with per-token
  input scales (llm-compressor's W8A8 and FP8_DYNAMIC), a8w4 and a8w4_fp8 (W4A8, W4AFP8),
  mxfp4, mxfp8. vLLM and SGLang pick a scheme per layer for each (e.g. FP8 attention beside int4 MLPs).
  The model's a8w8 types must then be `--activations dynamic` (static input scales come from the
  a8w8 recipe, which plans one type).
- A layer's type takes the same knobs as the model's where it has them (group size, --asym and
  --zp-dtype for int4, --asym for int8, --weight-block and --weight-strategy for an FP8 type beside an FP8 model) and
  its own default weight observer unless --weight-observer names one (`with_layer_types`). AWQ is
  for integer and FP4 weights, in weight-only layers and those whose inputs are quantized per token
  (its factors fold in before their quantizer): it refuses other groups.
- Once the model's Linears are known, each layer group is retargeted at the Linears it
  quantizes as every engine resolves them (`resolve_layer_types`: a fused unit as one regex that
  also names the fused layer, which SGLang matches, other Linears by exact name), and `--target`
  is judged on that config. A target must name whole fused units (q / k / v, gate / up), and no
  experts of a mixture of experts (one scheme per fused-MoE layer: the model's type).
- The output head (`lm_head`), which every other target leaves float, is quantized where a target
  names it (`lm_head=weight_only_int8`; a regex that matches the name): vLLM and SGLang build it as
  a `ParallelLMHead` and take its scheme by name only, never by the class target "Linear". GPTQ
  (`gptq`, `awq+gptq`) calibrates it on the last decoder layer's normed outputs, after the layers;
  `rtn` and `awq` round it to nearest. A tied head is untied: the artifact keeps the embedding
  float beside the quantized head and sets `tie_word_embeddings` false (llm-compressor unties a
  quantized head too).
- The input embedding (`model.embed_tokens`) is quantized where a target names it
  (`model.embed_tokens=weight_only_int4`): integer weight-only types with symmetric codes, the
  layout vLLM looks rows up in (`CompressedTensorsEmbeddingWNA16Int`: pack-quantized, no zero
  point), rounded to nearest under every method (a lookup: each row's error is its own). A tied
  model is untied: the head stays float (a copy of the embedding) unless a target names it too.
"""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Iterable, Mapping

from torch import nn

from quantspec.calib.targets import EMBED
from quantspec.errors import QuantSpecError
from quantspec.model_zoo.moe import expert_dims
from quantspec.quant.args import QuantType
from quantspec.quant.config import QuantConfig
from quantspec.quant.presets import FP8_TYPES, PER_TOKEN_TYPES, awq_unfit, integer_weights

__all__ = ["LAYER_TYPES", "check_model_type", "parse_layer_type", "resolve_layer_types", "with_layer_types"]

HEAD = "lm_head"  # the output head: quantized only where a target names it
# the quant types a layer may take beside the model's own, and the model's own with them: weight-only
# ones, and those whose inputs are quantized at run time (a8w8 types with per-token scales)
WEIGHT_ONLY_TYPES = (QuantType.WEIGHT_ONLY_INT8, QuantType.WEIGHT_ONLY_INT4, QuantType.WEIGHT_ONLY_FP8,
                     QuantType.WEIGHT_ONLY_NVFP4, QuantType.WEIGHT_ONLY_MXFP4, QuantType.WEIGHT_ONLY_MXFP8)
DYNAMIC_TYPES = (QuantType.A8W8, QuantType.A8W8_FP8, QuantType.MXFP4, QuantType.MXFP8, QuantType.A8W4,
                 QuantType.A8W4_FP8, QuantType.A8W4_MXFP4)
LAYER_TYPES = WEIGHT_ONLY_TYPES + DYNAMIC_TYPES


def parse_layer_type(spec: str) -> tuple[str, QuantType]:
    """"TARGET=QUANT_TYPE" → (target, type), refusing in one line naming --layer-quant-type what
    is not one."""
    target, sep, name = str(spec).rpartition("=")
    if not sep or not target or not name:
        raise QuantSpecError(f"--layer-quant-type {spec!r} must be TARGET=QUANT_TYPE, e.g. "
                             "'re:.*mlp.down_proj$=weight_only_int8'")
    if target.startswith("re:"):
        try:
            re.compile(target[3:])
        except re.error as e:
            raise QuantSpecError(f"--layer-quant-type {spec!r}: {target[3:]!r} is not a regex ({e})") from None
    try:
        qt = QuantType.parse(name)
    except QuantSpecError:
        qt = None
    if qt not in LAYER_TYPES:
        raise QuantSpecError(f"--layer-quant-type {spec!r}: a layer may take "
                             f"{', '.join(t.value for t in LAYER_TYPES)} (types that need no calibration table)")
    return target, qt


def check_model_type(quant_type: QuantType, activations: str) -> None:
    """Refuse a model type that --layer-quant-type cannot sit beside (module docstring)."""
    if quant_type not in LAYER_TYPES or (quant_type in (QuantType.A8W8, QuantType.A8W8_FP8) and activations != "dynamic"):
        raise QuantSpecError(f"--layer-quant-type mixes types that need no calibration table, and --quant-type "
                             f"{quant_type.value} with static input scales needs one; add --activations dynamic, or "
                             "use a weight-only --quant-type")


def _check_method(spec: str, qt: QuantType, method: str) -> None:
    # AWQ folds in before a quantizer that computes its scales at run time (a layer's a8w8 types: per token)
    unfit = awq_unfit(qt, inputs_per_token=True) if method.startswith("awq") else ()
    if "inputs" in unfit:
        raise QuantSpecError(f"--method {method} is for weight-only layers and 8-bit inputs quantized at run time, and "
                             f"--layer-quant-type {spec!r} quantizes its inputs in microscaled groups; use --method rtn "
                             "or gptq")
    if "fp8" in unfit:
        raise QuantSpecError(f"--method {method}: AWQ scales integer or FP4 weights, and --layer-quant-type "
                             f"{spec!r} is FP8; use --method rtn or gptq")
    if method == "autoround" and not integer_weights(qt):
        raise QuantSpecError(f"--method autoround tunes integer weights, and --layer-quant-type {spec!r}'s are not; "
                             "use --method rtn or gptq")


def with_layer_types(config: QuantConfig, quant_type: QuantType, specs: Iterable[str], *, group_size: int,
                     symmetric: bool, zp_dtype: str | None, observer: str | None,
                     weight_block: int | None = None, weight_strategy: str | None = None,
                     method: str = "rtn") -> tuple[QuantConfig, dict[str, str]]:
    """`config` (the preset of the model's `quant_type`, which `check_model_type` let through)
    with a config group per spec of `specs` ("TARGET=QUANT_TYPE") holding that type's preset under
    the knobs it takes (module docstring), each checked against `method`; → (that config, {new
    group key: its spec})."""
    from quantspec.quant.presets import default_weight_observer, preset

    specs = tuple(specs)
    layers = [parse_layer_type(s) for s in specs]
    targets = [t for t, _ in layers]
    dup = next((t for t in targets if targets.count(t) > 1), None)
    if dup is not None:
        raise QuantSpecError(f"--layer-quant-type names {dup!r} twice; give each target one quant type")
    groups, keys = dict(config.config_groups), {}
    for i, (spec, (target, qt)) in enumerate(zip(specs, layers), start=len(groups)):
        integer = qt in (QuantType.WEIGHT_ONLY_INT8, QuantType.WEIGHT_ONLY_INT4)
        if _names(target, EMBED):
            _check_embedding(spec, qt, integer, symmetric, zp_dtype)
        else:
            _check_method(spec, qt, method)
        per_token = qt in PER_TOKEN_TYPES
        block = weight_block if qt in FP8_TYPES and quant_type in FP8_TYPES else None
        strategy = weight_strategy if qt in FP8_TYPES else None
        scheme = preset(qt, group_size=group_size, symmetric=symmetric or not integer,
                        zp_dtype=zp_dtype if qt is QuantType.WEIGHT_ONLY_INT4 else None,
                        weight_observer=observer or default_weight_observer(qt, method),
                        activations="dynamic" if per_token else "static", weight_block=block,
                        weight_strategy=strategy).config_groups["group_0"]
        keys[f"group_{i}"] = spec
        groups[f"group_{i}"] = replace(scheme, targets=(target,))
    ignore = config.ignore
    if any(_names(t, HEAD) for t in targets):  # the head is quantized only where a target names it
        ignore = tuple(i for i in ignore if i != HEAD)
    return replace(config, config_groups=groups, format=None, ignore=ignore), keys


def _names(target: str, module: str) -> bool:
    """`target` names `module`, as compressed-tensors and the engines match a module by name."""
    return re.match(target[3:], module) is not None if target.startswith("re:") else target == module


def _check_embedding(spec: str, qt: QuantType, integer: bool, symmetric: bool, zp_dtype: str | None) -> None:
    if not integer:
        raise QuantSpecError(f"--layer-quant-type {spec!r} names the embedding ({EMBED}), which takes "
                             "weight_only_int8 or weight_only_int4 (vLLM looks up integer rows only)")
    if not symmetric or zp_dtype is not None:
        raise QuantSpecError(f"--layer-quant-type {spec!r} names the embedding ({EMBED}), whose codes are "
                             "symmetric (vLLM's embedding lookup has no zero point); drop --asym / --zp-dtype")


def resolve_layer_types(model: nn.Module, config: QuantConfig, specs: Mapping[str, str], target: str,
                        capability: int | None = None) -> QuantConfig:
    """`config` with its groups `specs` keys (group key → the spec that made it,
    `with_layer_types`) retargeted at the Linears of `model` they quantize, as every engine
    resolves them (`engines.fused_targets`), after the checks of the module docstring and
    `--target`'s (`engines.target_refusal`, on a GPU of `capability` where given), each refused in one line."""
    from quantspec.calib.ptq import quantized_linears
    from quantspec.quant.engines import engine_layers, fused_targets, target_refusal
    from quantspec.quant.engines.moe import EXPERT

    linears = list(quantized_linears(model, config))
    governed = {k: [n for n in linears if config.scheme_for(n) is config.config_groups[k]] for k in specs}
    for k, names in governed.items():
        if not names:
            raise QuantSpecError(f"--layer-quant-type {specs[k]!r} names no quantized Linear of this model "
                                 f"(e.g. {linears[0] if linears else 'none'}); fix its target")
        expert = next((n for n in names if EXPERT.match(n)), None)
        if expert is not None:
            raise QuantSpecError(f"--layer-quant-type {specs[k]!r} names experts of a mixture of experts ({expert}), "
                                 "which take --quant-type; narrow the target to dense Linears")
    for fused, members in engine_layers(linears).items():
        if len({id(config.scheme_for(n)) for n in members}) > 1:
            parts = sorted({n.rsplit(".", 1)[-1] for n in members})
            raise QuantSpecError(f"--layer-quant-type gives the parts of {fused} ({', '.join(parts)}) different "
                                 "quant types, and vLLM and SGLang run it as one layer; name all of its parts")
    groups = dict(config.config_groups)
    for k, names in governed.items():
        groups[k] = replace(groups[k], targets=fused_targets(names))
    config = replace(config, config_groups=groups)
    refusal = target_refusal(target, config, moe=getattr(model.args, "num_experts", 0) > 0,
                             expert_dims=expert_dims(model.args), capability=capability)
    if refusal is not None:
        raise QuantSpecError(refusal)
    return config
