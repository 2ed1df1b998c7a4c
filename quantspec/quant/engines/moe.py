"""Mixture-of-experts layers: how vLLM and SGLang judge a layer's experts.

Both engines load a layer's experts into one fused-MoE layer (`model.layers.N.mlp.experts`;
Mixtral's `model.layers.N.block_sparse_moe.experts`, projections w1 / w3 / w2) with
one quantization method for all of them. Their decision code (vLLM's
`CompressedTensorsMoEMethod.get_moe_method` and MoE method constructors, SGLang's
`CompressedTensorsConfig.get_moe_scheme` and MoE scheme constructors, at the pinned versions):
- the schemes of expert 0's gate / up / down projections, each resolved by name as a Linear's
  is, must be equal (weights, input activations, format); SGLang resolves them under the names
  gate_proj / up_proj / down_proj whatever the checkpoint's (Mixtral's are w1 / w3 / w2);
- int4 / int8 weights alone in pack-quantized format (SGLang: the config's top-level format)
  load (WNA16, symmetric or not);
- FP8 weights load per tensor with per-tensor inputs (static or dynamic), or per channel with
  dynamic per-token inputs; per-channel weights with static inputs fail the constructor's check;
- int8 weights per channel with dynamic per-token inputs load in vLLM; SGLang implements them on
  NPUs only; static int8 inputs are refused by both;
- NVFP4 weights, alone or with NVFP4 inputs, load in both (vLLM's one NVFP4 MoE method, SGLang's
  W4A16 / W4A4 ones); below compute capability 10.0 both run the weights alone (FP4 Marlin) and set
  the inputs' quantization aside;
- int4 weights with 8-bit inputs per token (W4A8, W4AFP8): vLLM runs FP8 inputs with
  `CompressedTensorsW4A8Fp8MoEMethod` (symmetric, groups of 128, hidden and intermediate sizes
  multiples of 256; CUTLASS W4A8 experts on compute capability 9.0, Humming's from 7.5) and
  int8 inputs on CPUs only; SGLang runs both with `CompressedTensorsW4AFP8MoE` on 9.0, groups of
  128, quantizing the inputs to FP8 with one scale per tensor (`engines.tables`);
- MXFP4 weights, alone or with MXFP4 inputs, take vLLM's `CompressedTensorsW4A4Mxfp4MoEMethod`:
  CUTLASS W4A4 experts on compute capability 10.x-11.x (the inputs quantized to MXFP4 at run time,
  a weight-only checkpoint's too), Marlin experts (weight-only) elsewhere. SGLang picks its
  GPT-OSS method for them (`SGLANG_MXFP4_MOE`), which loads no compressed-tensors expert weights.
The conformance suite runs that code on quantspec's MoE artifacts (`tests/conformance/lift_moe.py`)
and checks these verdicts against it. transformers 5 fuses a checkpoint's experts into 3-D
tensors at load, which no compressed-tensors scheme covers: it refuses quantized experts.
"""

from __future__ import annotations

import re
from typing import Iterable, Mapping

from quantspec.quant.args import FORMAT_PACK_QUANTIZED
from quantspec.quant.config import QuantConfig
from quantspec.quant.engines.tables import (
    ENGINE_VERSIONS,
    MXFP4_MOE_W4A4_CAPABILITIES,
    NVFP4_W4A4_CAPABILITY,
    SGLANG_W4A8_MOE_CAPABILITY,
    SGLANG_W4A8_MOE_INPUTS,
    VLLM_W4A8_INT_MOE,
    W4A8_MOE_ALIGN,
    W4A8_MOE_GROUP,
    W4A8_MOE_MIN_CAPABILITY,
)
from quantspec.quant.engines.verdict import (
    LayerVerdict,
    activation_label,
    mx_inputs_quantized,
    mx_inputs_set_aside,
    nvfp4_inputs_set_aside,
)
from quantspec.quant.scheme import QuantScheme, is_mxfp4_fp8_inputs

__all__ = ["EXPERT", "MIXTRAL_PROJECTIONS", "PROJECTIONS", "SGLANG_MXFP4_MOE", "TRANSFORMERS_REFUSAL", "expert_layers",
           "moe_layer"]

EXPERT = re.compile(r"^(.*\.(?:mlp|block_sparse_moe)\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)$")
PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
MIXTRAL_PROJECTIONS = ("w1", "w3", "w2")  # Mixtral's names of gate / up / down
TRANSFORMERS_REFUSAL = "transformers fuses experts into 3-D tensors at load, which take no quantized weights"
# SGLang's `CompressedTensorsConfig.get_quant_method` sends every fused-MoE layer of an MXFP4 config
# (`_is_mxfp4_moe`) to `Mxfp4MoEMethod` (quantization/mxfp4.py), which `create_weights` GPT-OSS's
# parameters w13_weight / w2_weight (+ _scale, _bias); `FusedMoE.make_expert_params_mapping`
# maps a checkpoint's experts.<e>.<proj>.weight_packed to w13_weight_packed / w2_weight_packed
SGLANG_MXFP4_MOE = (f"SGLang {ENGINE_VERSIONS['sglang']} runs MXFP4 experts with Mxfp4MoEMethod, whose weight "
                    "parameters are GPT-OSS's w13_weight / w2_weight: the checkpoint's per-expert weight_packed "
                    "maps to w13_weight_packed / w2_weight_packed, which no parameter takes, so the experts' "
                    "weights never load (Qwen3-MoE's load_weights skips them, Mixtral's raises KeyError)")


def expert_layers(linears: Iterable[str]) -> dict[str, tuple[str, ...]]:
    """Fused-MoE layer name → its experts' Linears among `linears`, e.g.
    "model.layers.0.mlp.experts" → ("model.layers.0.mlp.experts.0.gate_proj", ...)."""
    out: dict[str, list[str]] = {}
    for n in linears:
        m = EXPERT.match(n)
        if m is not None:
            out.setdefault(m.group(1), []).append(n)
    return {k: tuple(v) for k, v in out.items()}


def _key(s: QuantScheme | None, config: QuantConfig) -> tuple | None:
    """What the engines compare of a projection's scheme."""
    return None if s is None else (s.weights, s.input_activations, s.format or config.format)


def _nvfp4_method(engine: str, s: QuantScheme, capability: int) -> tuple[str | None, str | None]:
    ia = s.input_activations
    if ia is not None and not ia.is_fp4:
        return None, "NVFP4 experts take NVFP4 inputs or none"
    if engine == "vllm":
        kind = "W4A4Nvfp4MoE"
    else:
        kind = "W4A4Nvfp4MoE" if ia is not None and capability >= NVFP4_W4A4_CAPABILITY else "W4A16Nvfp4MoE"
    if ia is not None and capability < NVFP4_W4A4_CAPABILITY:
        return kind, nvfp4_inputs_set_aside("the experts' weights")
    return kind, None


def _mxfp4_method(engine: str, s: QuantScheme, capability: int) -> tuple[str | None, str | None]:
    if engine == "sglang":
        return None, SGLANG_MXFP4_MOE
    ia, w4a4 = s.input_activations, capability in MXFP4_MOE_W4A4_CAPABILITIES
    where = "on compute capability 10.x-11.x" if w4a4 else \
        "below compute capability 10.0" if capability < MXFP4_MOE_W4A4_CAPABILITIES.start else \
        f"on compute capability {capability / 10:.1f} (its W4A4 experts run on 10.x-11.x)"
    if w4a4 and ia is None:
        return "W4A4Mxfp4MoE", mx_inputs_quantized(where, "CUTLASS's W4A4 MoE kernel")
    if not w4a4 and ia is not None:
        return "W4A4Mxfp4MoE", mx_inputs_set_aside("the experts' weights", where)
    return "W4A4Mxfp4MoE", None


def _vllm_w4a8(s: QuantScheme, capability: int, dims: tuple[int | None, int | None]) -> tuple[str | None, str | None]:
    """vLLM's W4A8 / W4AFP8 experts, checked in the order its code checks them (`engines.tables`)."""
    w, ia = s.weights, s.input_activations
    if ia.type == "int":
        return (None, VLLM_W4A8_INT_MOE) if w.symmetric and ia.strategy == "token" else \
            (None, "asymmetric int4 experts or int8 inputs not per token (its W4A8 MoE methods take symmetric "
                   "weights with per-token inputs)")
    if not (w.symmetric and ia.symmetric and w.strategy == "group" and ia.strategy == "token"):
        return None, "its W4AFP8 experts take symmetric int4 groups with symmetric FP8 inputs per token"
    if w.group_size != W4A8_MOE_GROUP:
        return None, (f"CompressedTensorsW4A8Fp8MoEMethod takes groups of {W4A8_MOE_GROUP} only (the experts' "
                      f"group size is {w.group_size})")
    if capability < W4A8_MOE_MIN_CAPABILITY:
        return None, (f"its W4A8 experts (CUTLASS on 9.0, Humming from {W4A8_MOE_MIN_CAPABILITY / 10:.1f}) "
                      f"do not run on compute capability {capability / 10:.1f}")
    off = [f"{what} {d}" for what, d in zip(("hidden size", "intermediate size"), dims)
           if d is not None and d % W4A8_MOE_ALIGN]
    if off:
        return None, (f"CompressedTensorsW4A8Fp8MoEMethod.create_weights asserts the experts' hidden and "
                      f"intermediate sizes are multiples of {W4A8_MOE_ALIGN} ({', '.join(off)})")
    return "W4A8Fp8MoE", None


def _sglang_w4a8(s: QuantScheme, config: QuantConfig, capability: int) -> tuple[str | None, str | None]:
    """SGLang's W4A8 / W4AFP8 experts (`engines.tables`): one scheme for int8 and FP8 inputs."""
    w, ia = s.weights, s.input_activations
    if not w.symmetric:
        return None, "asymmetric int4 experts (its W4AFP8 experts take symmetric weights only)"
    if config.format != FORMAT_PACK_QUANTIZED:  # SGLang's `_is_wint4afp8` reads the top-level format
        return None, (f"its W4AFP8 experts take a checkpoint that is {FORMAT_PACK_QUANTIZED} throughout (this "
                      f"one's format is {config.format!r})")
    if capability < SGLANG_W4A8_MOE_CAPABILITY:
        return None, (f"CompressedTensorsW4AFP8MoE runs CUTLASS W4A8 experts, which ask for compute capability "
                      f"{SGLANG_W4A8_MOE_CAPABILITY / 10:.1f} (the scheme's get_min_capability, which SGLang does not "
                      "check for fused-MoE layers)")
    if w.group_size != W4A8_MOE_GROUP:
        return None, (f"its CUTLASS W4A8 experts (cutlass_w4a8_moe) run groups of {W4A8_MOE_GROUP} whatever the "
                      f"checkpoint's, so g{w.group_size} experts would compute wrong outputs")
    what = "int8 input quantization" if ia.type == "int" else \
        "per-token FP8 input scales" if ia.strategy == "token" else "the experts' FP8 input scales"
    return "W4AFP8MoE", SGLANG_W4A8_MOE_INPUTS.format(what=what)


def _method(engine: str, s: QuantScheme, config: QuantConfig, capability: int = 90,
            dims: tuple[int | None, int | None] = (None, None)) -> tuple[str | None, str | None]:
    """(the MoE method the engine's code selects for scheme `s`, or None; the problem: why it
    refuses, or what it sets aside). `dims`: the experts' hidden and intermediate sizes, where known."""
    w, ia = s.weights, s.input_activations
    if w.is_mxfp8 or (w.is_mx and is_mxfp4_fp8_inputs(ia)):
        what, method = ("MXFP8 experts", "W8A8Mxfp8") if w.is_mxfp8 else ("MXFP4 experts with FP8 inputs", "W4A8Mxfp4")
        return None, (f"quantspec does not judge {what} (vLLM's CompressedTensors{method}MoEMethod picks their "
                      "backend per GPU, SGLang has none); quantize the experts with another type")
    if w.is_mx:
        return _mxfp4_method(engine, s, capability)
    if w.is_fp4:
        return _nvfp4_method(engine, s, capability)
    if ia is None:
        fmt = config.format if engine == "sglang" else (s.format or config.format)
        if w.type == "int" and w.num_bits in (4, 8) and w.strategy in ("group", "channel") \
                and fmt == FORMAT_PACK_QUANTIZED:
            return "WNA16MoE", None
        return None, "its experts' weight-only scheme is not pack-quantized int4 / int8"
    if w.type == "float" and ia.type == "float":
        if (w.strategy, ia.strategy) == ("tensor", "tensor") or \
                ((w.strategy, ia.strategy) == ("channel", "token") and ia.dynamic) or \
                (w.strategy == "block" and ia.dynamic):
            return "W8A8Fp8MoE", None
        return None, "FP8 experts take per-tensor weights with per-tensor inputs, per-channel weights " \
                     "with dynamic per-token inputs, or block weights with dynamic inputs"
    if w.type == "int" and ia.type == "int" and ia.dynamic and w.strategy == "channel" and ia.strategy == "token":
        if engine == "sglang":
            return None, "SGLang runs int8-activation experts on NPUs only"
        return "W8A8Int8MoE", None
    if w.type == "int" and w.num_bits == 4 and ia.num_bits == 8 and ia.dynamic:
        return _vllm_w4a8(s, capability, dims) if engine == "vllm" else _sglang_w4a8(s, config, capability)
    return None, "no MoE kernel takes static int8 activations"


def moe_layer(engine: str, layer: str, config: QuantConfig, shards: Iterable[str] = (),
              capability: int = 90, linears: Mapping[str, int | None] | None = None) -> LayerVerdict | None:
    """vLLM's or SGLang's verdict on the fused-MoE layer `layer` whose quantized expert Linears are
    `shards` (None: left float), on a GPU of `capability`; `linears`: Linear name → input dim K,
    where known (the experts' hidden size is expert 0's gate's K, their intermediate size its down's)."""
    names = MIXTRAL_PROJECTIONS if ".block_sparse_moe." in f"{layer}." else PROJECTIONS
    dims = tuple((linears or {}).get(f"{layer}.0.{p}") for p in (names[0], names[2]))
    intended = [config.scheme_for(f"{layer}.0.{p}") for p in names]
    first = {p: _key(i, config) for p, i in zip(names, intended)}
    if any(_key(config.scheme_for(n), config) != first.get(EXPERT.match(n).group(3)) for n in shards):
        return LayerVerdict(None, problem="its experts were quantized with different schemes (the engines "
                                          "run every expert with expert 0's)")
    # SGLang looks every layer's experts up as gate_proj / up_proj / down_proj, vLLM by the
    # checkpoint's names
    schemes = [config.scheme_for(f"{layer}.0.{p}") for p in PROJECTIONS] if engine == "sglang" else intended
    if len({_key(s, config) for s in schemes}) > 1:
        return LayerVerdict(None, problem="its experts' gate / up / down projections have different "
                                          "schemes (one per MoE layer)")
    s = schemes[0]
    if _key(s, config) != _key(intended[0], config):
        return LayerVerdict(None, problem="SGLang resolves its experts' scheme under the names gate_proj / "
                                          "up_proj / down_proj, which the config quantizes otherwise")
    if s is None:
        return None
    kind, problem = _method(engine, s, config, capability, dims)
    w, ia = s.weights, s.input_activations
    group = w.group_size if w.strategy in ("group", "tensor_group") else None
    return LayerVerdict(kind, w.num_bits, group, w.symmetric, activation_label(ia), problem=problem,
                        block=w.block_structure)
