"""quantspec's quant types as plain data: `preset(quant_type, ...)` → the `QuantConfig` that
quantize writes, and the default weight observer per type."""

from __future__ import annotations

from dataclasses import replace
from typing import Iterable

from quantspec.errors import QuantSpecError
from quantspec.quant.args import MIN_GROUP_SIZE, MX_GROUP_SIZE, NVFP4_GROUP_SIZE, QuantArgs, QuantType
from quantspec.quant.config import QuantConfig
from quantspec.quant.scheme import QuantScheme

__all__ = ["A8W4_TYPES", "ACTIVATIONS", "DATA_METHODS", "DEFAULT_GROUP_SIZE", "EXPERT_TARGET", "FP4_TYPES", "FP8_TYPES",
           "INT4_TYPES", "KV_STRATEGIES", "METHODS", "MICROSCALED_TYPES", "MXFP4_TYPES", "MXFP8_TYPES", "NVFP4_TYPES", "PER_TOKEN_TYPES", "PRESET_INPUTS", "PRESET_WEIGHTS", "WEIGHT_OBSERVERS",
           "WEIGHT_STRATEGIES",
           "awq_unfit", "check_weight_block", "check_weight_strategy", "default_weight_observer", "for_experts", "integer_weights", "preset",
           "settle_kv_strategy"]

# how the a8w8 types quantize their input activations: with calibrated per-tensor scales stored
# in the artifact, or per token at run time (llm-compressor's W8A8 / FP8_DYNAMIC schemes)
ACTIVATIONS = ("static", "dynamic")
# how the FP8 types scale their weights (`--weight-strategy`): per output channel (their own) or one
# scale per Linear, which the engines share across a fused layer's shards (quantize writes it so)
WEIGHT_STRATEGIES = ("channel", "tensor")


WEIGHT_OBSERVERS = ("minmax", "mse")  # how quantize picks weight scales (choose_qparams)
# how quantize rounds the weights (`calib.ptq`); awq+gptq: AWQ's factors folded, then GPTQ's
# rounding (llm-compressor's AWQModifier + GPTQModifier)
METHODS = ("rtn", "gptq", "awq", "awq+gptq", "autoround")
DATA_METHODS = METHODS[1:]  # the methods that run calibration data through the model
# int4 weights with 8-bit inputs quantized per token at run time (llm-compressor's W4A8 / W4AFP8)
A8W4_TYPES = (QuantType.A8W4, QuantType.A8W4_FP8)
# the types whose weights are int4 per group (or channel): --group-size, the mse observer
INT4_TYPES = (QuantType.WEIGHT_ONLY_INT4, *A8W4_TYPES)
DEFAULT_GROUP_SIZE = 128  # the int4 types' (weight_only_int8 is per channel unless `int8_group_size` says)
# the types whose inputs `--activations dynamic` quantizes per token (a8w4's only way) at run time
PER_TOKEN_TYPES = (QuantType.A8W8, QuantType.A8W8_FP8, *A8W4_TYPES)
# a8w4_mxfp4's FP8 input groups (`resolve_layer_group_sizes` shrinks them to tile each layer's K)
MXFP4_FP8_INPUT_GROUP = 128
# each quant type's weights, before `preset`'s knobs (symmetry, group size, zero-point dtype,
# observer) are applied
_NVFP4_WEIGHTS = QuantArgs(num_bits=4, type="float", strategy="tensor_group", group_size=NVFP4_GROUP_SIZE)
_MXFP4_WEIGHTS = QuantArgs(num_bits=4, type="float", strategy="group", group_size=MX_GROUP_SIZE,
                           scale_dtype="uint8")
_MXFP8_WEIGHTS = _MXFP4_WEIGHTS.replace(num_bits=8)
PRESET_WEIGHTS: dict[QuantType, QuantArgs] = {
    QuantType.WEIGHT_ONLY_INT8: QuantArgs(num_bits=8, type="int", strategy="channel"),
    QuantType.WEIGHT_ONLY_INT4: QuantArgs(num_bits=4, type="int", strategy="group", group_size=128),
    QuantType.A8W8: QuantArgs(num_bits=8, type="int", strategy="channel"),
    QuantType.A8W8_FP8: QuantArgs(num_bits=8, type="float", strategy="channel"),
    QuantType.WEIGHT_ONLY_FP8: QuantArgs(num_bits=8, type="float", strategy="channel"),
    QuantType.A8W4: QuantArgs(num_bits=4, type="int", strategy="group", group_size=128),
    QuantType.A8W4_FP8: QuantArgs(num_bits=4, type="int", strategy="group", group_size=128),
    QuantType.WEIGHT_ONLY_NVFP4: _NVFP4_WEIGHTS,
    QuantType.NVFP4: _NVFP4_WEIGHTS,
    QuantType.WEIGHT_ONLY_MXFP4: _MXFP4_WEIGHTS,
    QuantType.MXFP4: _MXFP4_WEIGHTS,
    QuantType.A8W4_MXFP4: _MXFP4_WEIGHTS,
    QuantType.WEIGHT_ONLY_MXFP8: _MXFP8_WEIGHTS,
    QuantType.MXFP8: _MXFP8_WEIGHTS,
}
# the static per-tensor input activations of the types that quantize them (the rest keep float inputs)
PRESET_INPUTS: dict[QuantType, QuantArgs] = {
    QuantType.A8W8: QuantArgs(num_bits=8, type="int", symmetric=True, strategy="tensor", dynamic=False,
                              observer="minmax"),
    QuantType.A8W8_FP8: QuantArgs(num_bits=8, type="float", symmetric=True, strategy="tensor", dynamic=False,
                                  observer="minmax"),
    # group scales at run time under a calibrated global scale (compressed-tensors' NVFP4 preset)
    QuantType.NVFP4: _NVFP4_WEIGHTS.replace(dynamic="local", observer="static_minmax"),
    # power-of-two group scales at run time (compressed-tensors' MXFP4 preset)
    QuantType.MXFP4: _MXFP4_WEIGHTS.replace(dynamic=True),
    QuantType.MXFP8: _MXFP8_WEIGHTS.replace(dynamic=True),  # compressed-tensors' MXFP8 preset
    # per token at run time (compressed-tensors' W4A8 and W4AFP8 presets)
    QuantType.A8W4: QuantArgs(num_bits=8, type="int", symmetric=True, strategy="token", dynamic=True),
    QuantType.A8W4_FP8: QuantArgs(num_bits=8, type="float", symmetric=True, strategy="token", dynamic=True),
    # per token and group of 128 at run time (compressed-tensors' MXFP4XFP8 preset)
    QuantType.A8W4_MXFP4: QuantArgs(num_bits=8, type="float", symmetric=True, strategy="group",
                                    group_size=MXFP4_FP8_INPUT_GROUP, dynamic=True),
}
# NVFP4's types: E2M1 weights in groups of 16 with FP8 scales under a global scale
NVFP4_TYPES = (QuantType.WEIGHT_ONLY_NVFP4, QuantType.NVFP4)
# MXFP4's types: E2M1 weights in groups of 32 with power-of-two (E8M0) scales
MXFP4_TYPES = (QuantType.WEIGHT_ONLY_MXFP4, QuantType.MXFP4, QuantType.A8W4_MXFP4)
FP4_TYPES = NVFP4_TYPES + MXFP4_TYPES
# MXFP8's types: E4M3 weights in groups of 32 with power-of-two (E8M0) scales
MXFP8_TYPES = (QuantType.WEIGHT_ONLY_MXFP8, QuantType.MXFP8)
# the types whose group layout and scales are their format's own (no --group-size, --asym, mse)
MICROSCALED_TYPES = FP4_TYPES + MXFP8_TYPES
# the types whose weights are FP8 E4M3 per channel, or in blocks with --weight-block (per tensor: --weight-strategy)
FP8_TYPES = (QuantType.A8W8_FP8, QuantType.WEIGHT_ONLY_FP8)


def awq_unfit(quant_type: QuantType, inputs_per_token: bool) -> tuple[str, ...]:
    """Why AWQ's factors cannot fold in before `quant_type`'s quantizers (`inputs_per_token`: its
    8-bit inputs, if it quantizes them, are scaled per token at run time): "inputs" where its input
    scales are static or microscaled (fitted to, or tuned for, the unscaled inputs; a8w4_mxfp4's FP8
    groups are scaled at run time, and take them), "fp8" where its weights are FP8 (AWQ scales
    integer or FP4 weights per row); empty where AWQ fits."""
    weight_only = quant_type.value.startswith("weight_only")
    run_time = quant_type is QuantType.A8W4_MXFP4 or (inputs_per_token and quant_type in PER_TOKEN_TYPES)
    reasons = () if weight_only or run_time else ("inputs",)
    return reasons + ("fp8",) if quant_type in FP8_TYPES + MXFP8_TYPES else reasons


def integer_weights(quant_type: QuantType | str) -> bool:
    """Whether `quant_type`'s weights are integer codes (not FP8, FP4 or MX): what AutoRound tunes."""
    return QuantType.parse(quant_type) not in FP8_TYPES + MICROSCALED_TYPES


def default_weight_observer(quant_type: QuantType | str, method: str = "rtn") -> str:
    """mse for the int4 types (weight_only_int4, a8w4, a8w4_fp8), minmax for the others, and for
    every type under AutoRound, which starts from min/max and tunes the clipping itself.

    With 16 levels the clipping search pays: on the default model GPTQ g64 (64 × 512 calibration
    tokens, act-order) held-out ppl 28.19 → 26.74, RTN g64 31.51 → 31.02; at 8 bits min/max is
    already close to the best range, and the a8w8 weights are smoothed against their inputs.
    """
    return "mse" if QuantType.parse(quant_type) in INT4_TYPES and method != "autoround" else "minmax"


def preset(quant_type: QuantType | str, group_size: int | None = None, symmetric: bool = True,
           ignore: Iterable[str] = ("lm_head",), kv_cache: str | None = None,
           kv_strategy: str = "attn_head", zp_dtype: str | None = None,
           weight_observer: str | None = None, activations: str | None = None, weight_block: int | None = None,
           int8_group_size: int | None = None, weight_strategy: str | None = None) -> QuantConfig:
    """The config for one of quantspec's quant types, as plain data.

    weight_only_int8: int8 per-channel weights (8-bit "pack-quantized"), or per group of
    `int8_group_size` where one is given (compressed-tensors' W8A16; -1: per channel).
    weight_only_int4: int4 group-wise weights ("pack-quantized"); `group_size` applies (None: 128,
    -1: per channel), and with symmetric=False `zp_dtype` ("float16" | "bfloat16" | "float32")
    gives float zero points.
    a8w8: int8 per-channel weights + static per-tensor int8 input scales ("int-quantized").
    a8w8_fp8: FP8 E4M3 per-channel weights + static per-tensor FP8 input scales ("float-quantized").
    weight_only_fp8: a8w8_fp8's weights with float inputs (W8A16 FP8, "float-quantized"), which both
    engines run as W8A16 FP8; nothing to calibrate.
    a8w4 / a8w4_fp8: int4 group-wise weights as weight_only_int4's ("pack-quantized"; `group_size`
    applies, and `symmetric` for a8w4) with int8 / FP8 inputs quantized per token at run time
    (compressed-tensors' W4A8 / W4AFP8); nothing to calibrate.
    weight_only_nvfp4 / nvfp4: NVFP4 weights (E2M1 in groups of 16, FP8 group scales, a global
    scale per tensor; "nvfp4-pack-quantized"), float inputs (compressed-tensors' NVFP4A16) or
    NVFP4 inputs with group scales at run time under a calibrated global scale (its NVFP4).
    weight_only_mxfp4 / mxfp4: MXFP4 weights (E2M1 in groups of 32, power-of-two scales stored as
    E8M0 exponents; "mxfp4-pack-quantized"), float inputs (MXFP4A16) or MXFP4 inputs with their
    scales at run time (compressed-tensors' MXFP4); nothing to calibrate.
    a8w4_mxfp4: MXFP4's weights with FP8 inputs quantized per token and group of 128 at run time
    (compressed-tensors' MXFP4XFP8, vLLM's W4A8 MXFP4); nothing to calibrate.
    weight_only_mxfp8 / mxfp8: MXFP8 weights (E4M3 in groups of 32, power-of-two scales stored as
    E8M0 exponents; "mxfp8-quantized"), float inputs (MXFP8A16) or MXFP8 inputs with their scales
    at run time (compressed-tensors' MXFP8); nothing to calibrate.
    `kv_cache` ("int8" | "fp8" | None) adds a static KV-cache scheme (`kv_strategy` "attn_head"
    = one scale per KV head, or "tensor"). `weight_observer` "mse" searches each weight scale's
    range (see `quant.primitives.mse_qparams`) and is recorded as the weights' `observer`;
    None → `default_weight_observer(quant_type)`. `activations` "dynamic": the a8w8 types' inputs
    quantized per token at run time instead (no input scales in the artifact); None: "dynamic"
    for the a8w4 types, else "static".
    `weight_block` b (a8w8_fp8 with dynamic activations): FP8 weights with one scale per b × b block
    and inputs per token and group of b columns at run time (compressed-tensors' FP8_BLOCK; shrunk
    per layer to a block that tiles it, `resolve_layer_group_sizes`); weight_only_fp8: float inputs.
    `weight_strategy` "tensor" (FP8 types): one weight scale per Linear (compressed-tensors' FP8).
    """
    qt = QuantType.parse(quant_type)
    if qt is QuantType.WEIGHT_ONLY_INT8:
        group_size = -1 if int8_group_size is None else int8_group_size
    elif group_size is None:
        group_size = DEFAULT_GROUP_SIZE
    weight_observer = weight_observer or default_weight_observer(qt)
    activations = activations or ("dynamic" if qt in A8W4_TYPES else "static")
    _check_knobs(qt, group_size, symmetric, zp_dtype, weight_observer)
    check_weight_block(qt, weight_block, activations, weight_observer)
    inputs = _inputs(qt, activations)
    if weight_block is not None and qt in FP8_TYPES:  # FP8_BLOCK: inputs per group of the block's side
        inputs = None if inputs is None else inputs.replace(strategy="group", group_size=weight_block)
    w = PRESET_WEIGHTS[qt].replace(symmetric=symmetric, zp_dtype=zp_dtype,
                                   **_layout(qt, group_size, weight_block, weight_strategy))
    if weight_observer != "minmax":
        w = w.replace(observer=weight_observer)
    scheme = QuantScheme(targets=("Linear",), weights=w, input_activations=inputs)
    return QuantConfig(config_groups={"group_0": scheme}, ignore=tuple(ignore),
                       kv_cache_scheme=_kv_cache_args(kv_cache, kv_strategy), quant_type=qt)


def _layout(qt: QuantType, group_size: int, weight_block: int | None, weight_strategy: str | None = None) -> dict:
    """The weights' strategy fields: per group or channel (int4, grouped int8), in blocks, per tensor, or the
    type's own."""
    check_weight_strategy(qt, weight_strategy, weight_block)
    if weight_strategy == "tensor":
        return {"strategy": "tensor"}
    if qt in INT4_TYPES or (qt is QuantType.WEIGHT_ONLY_INT8 and group_size != -1):
        return {"strategy": "channel", "group_size": None} if group_size == -1 else \
            {"strategy": "group", "group_size": group_size}
    if weight_block is not None:
        return {"strategy": "block", "block_structure": (weight_block, weight_block)}
    return {}


def _inputs(qt: QuantType, activations: str) -> QuantArgs | None:
    """The input args of `qt` under `activations` ("static" | "dynamic"), refusing in one line
    naming the flag what the type does not take."""
    if activations not in ACTIVATIONS:
        raise QuantSpecError(f"--activations {activations!r}: use {' or '.join(ACTIVATIONS)}")
    inputs = PRESET_INPUTS.get(qt)
    if qt in A8W4_TYPES:
        if activations != "dynamic":
            raise QuantSpecError(f"{qt.value} quantizes its inputs per token at run time (llm-compressor's W4A8 / "
                                 "W4AFP8 schemes); use --activations dynamic (or leave --activations out)")
        return inputs
    if activations == "dynamic":
        if inputs is None or qt in MICROSCALED_TYPES:
            why = "quantizes its inputs per group at run time already" if inputs is not None else "keeps float activations"
            raise QuantSpecError(f"--activations dynamic is for a8w8 / a8w8_fp8 ({qt.value} {why}); drop it")
        inputs = inputs.replace(strategy="token", dynamic=True, observer=None)
    return inputs


# a mixture of experts' expert Linears (Qwen's and Mixtral's names), as one config target
EXPERT_TARGET = r"re:.*\.experts\.\d+\.(gate_proj|up_proj|down_proj|w1|w3|w2)$"


def for_experts(config: QuantConfig) -> QuantConfig:
    """`config` for a model whose MLPs are mixtures of experts: where its Linears take FP8 weights
    per channel with static per-tensor FP8 inputs, the experts take per-tensor weights instead
    (llm-compressor's static FP8 scheme), the one static FP8 layout vLLM's and SGLang's fused-MoE
    layers load (per-channel weights there need dynamic per-token inputs)."""
    base = next((s for s in config.config_groups.values() if "Linear" in s.targets), None)
    ia = None if base is None else base.input_activations
    if base is None or base.weights.type != "float" or base.weights.strategy != "channel" \
            or ia is None or ia.dynamic:
        return config
    experts = QuantScheme(targets=(EXPERT_TARGET,), weights=base.weights.replace(strategy="tensor"),
                          input_activations=ia, format=base.format)
    return replace(config, config_groups={**config.config_groups, "experts": experts})


def _check_knobs(qt: QuantType, group_size, symmetric: bool, zp_dtype: str | None, weight_observer: str) -> None:
    """Refuse, naming the flag, a knob that `qt` does not take or a value out of range."""
    if weight_observer not in WEIGHT_OBSERVERS:
        raise QuantSpecError(f"unknown --weight-observer {weight_observer!r}; use one of: "
                             f"{', '.join(WEIGHT_OBSERVERS)}")
    if zp_dtype is not None:
        if qt is not QuantType.WEIGHT_ONLY_INT4:
            raise QuantSpecError(f"--zp-dtype {zp_dtype} is for weight_only_int4 only; "
                                 f"drop it for {qt.value}")
        if symmetric:
            raise QuantSpecError(f"--zp-dtype {zp_dtype} needs asymmetric weights; add --asym")
    if (qt in INT4_TYPES or qt is QuantType.WEIGHT_ONLY_INT8) and group_size != -1 and (
            isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < MIN_GROUP_SIZE):
        raise QuantSpecError(f"--group-size {group_size!r} must be -1 (per channel) or at least "
                             f"{MIN_GROUP_SIZE}, e.g. 128")
    if qt in (*FP8_TYPES, QuantType.A8W4_FP8, *MICROSCALED_TYPES) and not symmetric:
        raise QuantSpecError(f"{qt.value} is symmetric only; drop --asym")
    if qt in MICROSCALED_TYPES and weight_observer != "minmax":
        raise QuantSpecError(f"--weight-observer {weight_observer} has no rule for {qt.value}'s group scales; use "
                             "minmax (or leave it out)")


def check_weight_block(qt: QuantType, weight_block, activations: str, weight_observer: str = "minmax") -> None:
    """Refuse, naming the flag, a `weight_block` that `qt` or the other knobs do not take."""
    if weight_block is None:
        return
    if qt not in FP8_TYPES:
        raise QuantSpecError(f"--weight-block is for a8w8_fp8 and weight_only_fp8 (FP8 block scales); drop it for "
                             f"{qt.value}")
    if isinstance(weight_block, bool) or not isinstance(weight_block, int) or weight_block < MIN_GROUP_SIZE \
            or weight_block & (weight_block - 1):
        raise QuantSpecError(f"--weight-block {weight_block!r} must be a power of two ≥ {MIN_GROUP_SIZE}, "
                             "e.g. 128")
    if activations != "dynamic" and qt is QuantType.A8W8_FP8:
        raise QuantSpecError("--weight-block quantizes the inputs per token group at run time; use "
                             "--activations dynamic (or leave --activations out)")
    if weight_observer != "minmax":
        raise QuantSpecError(f"--weight-observer {weight_observer} has no rule for block scales; use minmax "
                             "(or leave it out)")


def check_weight_strategy(qt: QuantType, weight_strategy, weight_block=None) -> None:
    """Refuse, naming the flag, a `weight_strategy` that `qt` or `weight_block` does not take."""
    if weight_strategy is None:
        return
    if weight_strategy not in WEIGHT_STRATEGIES:
        raise QuantSpecError(f"--weight-strategy {weight_strategy!r}: use {' or '.join(WEIGHT_STRATEGIES)}")
    if weight_strategy == "tensor" and qt not in FP8_TYPES:
        raise QuantSpecError(f"--weight-strategy tensor is for a8w8_fp8 and weight_only_fp8 (FP8 weights); drop it "
                             f"for {qt.value}")
    if weight_strategy == "tensor" and weight_block is not None:
        raise QuantSpecError("--weight-strategy tensor and --weight-block both set the weights' scales; pass one")


def _kv_cache_args(kv_cache: str | None, kv_strategy: str) -> QuantArgs | None:
    """The static KV-cache args of `kv_cache` ("int8" | "fp8", optionally "cachekv_"-prefixed), or None."""
    if kv_cache is None:
        return None
    kind = str(kv_cache).lower().removeprefix("cachekv_")
    if kind not in ("int8", "fp8"):
        raise QuantSpecError(f"--kv-cache {kv_cache!r} unsupported; use int8 or fp8")
    return QuantArgs(num_bits=8, type="int" if kind == "int8" else "float", symmetric=True,
                     strategy=kv_strategy, dynamic=False)


KV_STRATEGIES = {"tensor": "tensor", "head": "attn_head"}  # --kv-strategy → compressed-tensors' strategy


def settle_kv_strategy(target: str, kv_strategy: str | None) -> str:
    """`--kv-strategy` under `--target`, both checked: as given, else per head for the quantspec
    target and per tensor for the others (which both engines load)."""
    from quantspec.quant.engines import TARGETS

    if target not in TARGETS:
        raise QuantSpecError(f"unknown --target {target!r}; use one of: {', '.join(TARGETS)}")
    kv_strategy = kv_strategy or ("head" if target == "quantspec" else "tensor")
    if kv_strategy not in KV_STRATEGIES:
        raise QuantSpecError(f"--kv-strategy {kv_strategy!r}: use {' or '.join(KV_STRATEGIES)}")
    return kv_strategy
