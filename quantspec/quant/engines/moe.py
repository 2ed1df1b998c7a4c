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
from typing import Iterable

from quantspec.quant.args import FORMAT_PACK_QUANTIZED
from quantspec.quant.config import QuantConfig
from quantspec.quant.engines.tables import ENGINE_VERSIONS, MXFP4_MOE_W4A4_CAPABILITIES, NVFP4_W4A4_CAPABILITY
from quantspec.quant.engines.verdict import (
    LayerVerdict,
    activation_label,
    mxfp4_inputs_quantized,
    mxfp4_inputs_set_aside,
    nvfp4_inputs_set_aside,
)
from quantspec.quant.scheme import QuantScheme

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
        return "W4A4Mxfp4MoE", mxfp4_inputs_quantized(where, "CUTLASS's W4A4 MoE kernel")
    if not w4a4 and ia is not None:
        return "W4A4Mxfp4MoE", mxfp4_inputs_set_aside("the experts' weights", where)
    return "W4A4Mxfp4MoE", None


def _method(engine: str, s: QuantScheme, config: QuantConfig, capability: int = 90) -> tuple[str | None, str | None]:
    """(the MoE method the engine's code selects for scheme `s`, or None; the problem: why it
    refuses, or what it sets aside)."""
    w, ia = s.weights, s.input_activations
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
        # vLLM selects CompressedTensorsW4A8Fp8MoEMethod (groups of 128) / W4A8Int8MoEMethod (Arm CPUs),
        # SGLang CompressedTensorsW4AFP8MoE for int8 and FP8 inputs alike: kernel-level rules the
        # conformance suite does not lift, so no target promises them
        return None, "its W4A8 / W4AFP8 experts' methods are not among those quantspec checks against the engine's code"
    return None, "no MoE kernel takes static int8 activations"


def moe_layer(engine: str, layer: str, config: QuantConfig, shards: Iterable[str] = (),
              capability: int = 90) -> LayerVerdict | None:
    """vLLM's or SGLang's verdict on the fused-MoE layer `layer` whose quantized expert Linears are
    `shards` (None: left float), on a GPU of `capability`."""
    names = MIXTRAL_PROJECTIONS if ".block_sparse_moe." in f"{layer}." else PROJECTIONS
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
    kind, problem = _method(engine, s, config, capability)
    w, ia = s.weights, s.input_activations
    group = w.group_size if w.strategy in ("group", "tensor_group") else None
    return LayerVerdict(kind, w.num_bits, group, w.symmetric, activation_label(ia), problem=problem,
                        block=w.block_structure)
