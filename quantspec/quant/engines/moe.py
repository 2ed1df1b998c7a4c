"""Mixture-of-experts layers: how vLLM and SGLang judge a layer's experts.

Both engines load a layer's experts into one fused-MoE layer (`model.layers.N.mlp.experts`)
with one quantization method for all of them, chosen by their `CompressedTensorsMoEMethod`:
- vLLM resolves the schemes of expert 0's gate / up / down projections (by name, then class),
  requires them equal, and takes: int4 / int8 weights alone in pack-quantized format (WNA16),
  FP8 weights with static per-tensor or dynamic per-token FP8 inputs, int8 per-channel weights
  with dynamic per-token int8 inputs; anything else (static int8 inputs) is refused;
- SGLang takes the scheme of the config's `"Linear"` target for every MoE layer whatever its
  name, and takes symmetric WNA16 and FP8 W8A8 only (no int8 activations).
transformers 5 fuses a checkpoint's experts into 3-D tensors at load, which no compressed-tensors
scheme covers: it refuses quantized experts.
These rules are read from the engines' `CompressedTensorsMoEMethod.get_moe_method` and MoE method
constructors; unlike the dense layers' verdicts, the conformance suite does not run that code.
"""

from __future__ import annotations

import re
from typing import Iterable, Mapping

from quantspec.quant.args import FORMAT_PACK_QUANTIZED
from quantspec.quant.config import QuantConfig
from quantspec.quant.engines.verdict import LayerVerdict
from quantspec.quant.scheme import QuantScheme

__all__ = ["EXPERT", "PROJECTIONS", "expert_layers", "moe_layer"]

EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)$")
PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
TRANSFORMERS_REFUSAL = "transformers fuses experts into 3-D tensors at load, which take no quantized weights"


def expert_layers(linears: Iterable[str]) -> dict[str, tuple[str, ...]]:
    """Fused-MoE layer name → its experts' Linears among `linears`, e.g.
    "model.layers.0.mlp.experts" → ("model.layers.0.mlp.experts.0.gate_proj", ...)."""
    out: dict[str, list[str]] = {}
    for n in linears:
        m = EXPERT.match(n)
        if m is not None:
            out.setdefault(m.group(1), []).append(n)
    return {k: tuple(v) for k, v in out.items()}


def _kind(s: QuantScheme) -> tuple[str | None, str | None]:
    """(the MoE method this scheme asks of an engine, or None; the problem when None)."""
    w, ia = s.weights, s.input_activations
    if ia is None:
        if w.type == "int" and w.num_bits in (4, 8) and w.strategy in ("group", "channel") \
                and s.format == FORMAT_PACK_QUANTIZED:
            return "WNA16MoE", None
        return None, "its experts' weight-only scheme is not pack-quantized int4 / int8"
    if w.type == "float" and ia.type == "float":
        return "W8A8Fp8MoE", None
    if w.type == "int" and ia.type == "int" and ia.dynamic and w.strategy == "channel":
        return "W8A8Int8MoE", None
    return None, "no MoE kernel takes static int8 activations"


def moe_layer(engine: str, layer: str, config: QuantConfig, targets: Mapping[str, QuantScheme]
              ) -> LayerVerdict | None:
    """vLLM's or SGLang's verdict on the fused-MoE layer `layer` (None: left float)."""
    schemes = [config.scheme_for(f"{layer}.0.{p}") for p in PROJECTIONS]
    if engine == "sglang":
        if all(s is None for s in schemes):
            return None
        got = targets.get("Linear")
        if got is None:
            return LayerVerdict(None, problem="SGLang reads every MoE layer's scheme from the config's "
                                              "'Linear' target, which this config lacks")
        if any(s is None or s != schemes[0] for s in schemes) or got.weights != schemes[0].weights \
                or got.input_activations != schemes[0].input_activations:
            return LayerVerdict(None, problem="SGLang runs its experts with the 'Linear' target's scheme, "
                                              "not the one they were quantized with")
    elif any(s != schemes[0] for s in schemes):
        return LayerVerdict(None, problem="its experts' gate / up / down projections have different "
                                          "schemes (one per MoE layer)")
    s = schemes[0]
    if s is None:
        return None
    kind, problem = _kind(s)
    w = s.weights
    if engine == "sglang" and kind == "W8A8Int8MoE":
        kind, problem = None, "no SGLang MoE kernel takes int8 activations"
    if engine == "sglang" and kind == "WNA16MoE" and not w.symmetric:
        kind, problem = None, "SGLang's MoE takes symmetric weights only"
    group = w.group_size if w.strategy == "group" else None
    ia = s.input_activations
    act = None if ia is None else f"{'fp8' if ia.type == 'float' else 'int8'} {'dynamic' if ia.dynamic else 'static'}"
    return LayerVerdict(kind, w.num_bits, group, w.symmetric, act, problem=problem)
