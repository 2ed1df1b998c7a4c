"""The engines' verdicts on microscaled Linear weights — NVFP4, MXFP4 and MXFP8 — whose schemes
both engines pick from the weight args alone, and whose kernels decide per compute capability
(and, for MXFP8, per layer shape) whether the inputs are quantized at run time."""

from __future__ import annotations

from quantspec.quant.engines.tables import (
    ENGINE_VERSIONS,
    MXFP4_FP8_CAPABILITY,
    MXFP4_MIN_CAPABILITY,
    MXFP4_W4A4_CAPABILITY,
    MXFP8_MIN_CAPABILITY,
    MXFP8_W8A8_CAPABILITY,
    MXFP8_W8A8_MIN_DIM,
    NVFP4_MIN_CAPABILITY,
    NVFP4_W4A4_CAPABILITY,
    engine_name,
)
from quantspec.quant.engines.verdict import (
    MXFP4_INPUTS,
    MXFP8_INPUTS,
    LayerVerdict,
    activation_label as _act,
    mx_inputs_quantized,
    mx_inputs_set_aside,
    nvfp4_inputs_set_aside,
)
from quantspec.quant.scheme import QuantScheme, is_mxfp4_fp8_inputs

__all__ = ["SGLANG_MXFP4_LINEAR", "SGLANG_MXFP8_LINEAR", "microscaled_verdict"]


def _nvfp4(engine: str, s: QuantScheme, capability: int, base: dict) -> LayerVerdict:
    """Both engines pick their NVFP4 scheme from the args alone (any format): W4A4 on FP4 tensor
    cores, weight-only FP4 Marlin below them (an NVFP4 input's scales then unused), nothing below
    their minimum."""
    w, ia = s.weights, s.input_activations
    if w.group_size != 16 or (ia is not None and not (ia.is_fp4 and ia.strategy == "tensor_group")):
        return LayerVerdict(None, **base, problem=f"{engine_name(engine)} runs FP4 weights in NVFP4's layout only "
                                                  "(groups of 16 with NVFP4 inputs or none)")
    if capability < NVFP4_MIN_CAPABILITY[engine]:
        return LayerVerdict(None, **base, problem=f"NVFP4 below compute capability "
                                                  f"{NVFP4_MIN_CAPABILITY[engine] / 10:.1f}")
    if ia is None:  # vLLM: its one NVFP4 scheme, built with use_a16
        return LayerVerdict("W4A16Fp4" if engine == "sglang" else "W4A4Fp4", **base)
    if capability >= NVFP4_W4A4_CAPABILITY:
        return LayerVerdict("W4A4Fp4", **base, input_activations=_act(ia))
    return LayerVerdict("W4A16Fp4" if engine == "sglang" else "W4A4Fp4", **base,
                        problem=nvfp4_inputs_set_aside("the weights"))


# SGLang's compressed-tensors Linear schemes (`_get_scheme_from_parts`): FP4 in NVFP4's layout only,
# and format 'mxfp4-pack-quantized' is not among its activation-quantization formats, so an
# MXFP4 Linear raises "No compressed-tensors compatible scheme was found."
SGLANG_MXFP4_LINEAR = (f"SGLang {ENGINE_VERSIONS['sglang']} has no Linear scheme for MXFP4 weights (its "
                       "compressed-tensors schemes take FP4 in NVFP4's layout only; MXFP4 in fused-MoE experts only)")


def _mxfp4(engine: str, s: QuantScheme, capability: int, base: dict) -> LayerVerdict:
    """vLLM's MXFP4 schemes (from 8.0): `CompressedTensorsW4A4Mxfp4` (MXFP4 inputs or none), whose
    kernel registry takes FlashInfer's W4A4 kernel from 10.0, which quantizes the inputs to MXFP4
    even where the checkpoint leaves them float, and FP4 Marlin (weight-only) below; and
    `CompressedTensorsW4A8Mxfp4` (FP8 inputs), whose FP8 inputs Humming's kernel runs from 8.9
    (`MXFP4_FP8_CAPABILITY`). SGLang has none (`SGLANG_MXFP4_LINEAR`)."""
    ia = s.input_activations
    if engine == "sglang":
        return LayerVerdict(None, **base, problem=SGLANG_MXFP4_LINEAR)
    if capability < MXFP4_MIN_CAPABILITY:
        return LayerVerdict(None, **base, problem=f"MXFP4 below compute capability {MXFP4_MIN_CAPABILITY / 10:.1f}")
    if is_mxfp4_fp8_inputs(ia):
        if capability < MXFP4_FP8_CAPABILITY:
            return LayerVerdict(None, **base, problem=(
                f"FP8 inputs to MXFP4 weights below compute capability {MXFP4_FP8_CAPABILITY / 10:.1f} (vLLM runs "
                "them with Humming's kernels, which take FP8 activations from 8.9, and keeps the checkpoint's "
                "FP8 inputs rather than fall back, so the layer fails as it loads)"))
        return LayerVerdict("W4A8Mxfp4", **base, input_activations=_act(ia))
    if capability >= MXFP4_W4A4_CAPABILITY:
        problem = None if ia is not None else mx_inputs_quantized(
            f"from compute capability {MXFP4_W4A4_CAPABILITY / 10:.1f}", "FlashInfer's W4A4 kernel")
        return LayerVerdict("W4A4Mxfp4", **base, input_activations=MXFP4_INPUTS, problem=problem)
    problem = None if ia is None else mx_inputs_set_aside(
        "the weights", f"below compute capability {MXFP4_W4A4_CAPABILITY / 10:.1f}")
    return LayerVerdict("W4A4Mxfp4", **base, problem=problem)


# SGLang's compressed-tensors config sends no Linear to an MXFP8 scheme: format 'mxfp8-quantized' is
# not among its activation-quantization formats, so `_get_scheme_from_parts` raises "No
# compressed-tensors compatible scheme was found."
SGLANG_MXFP8_LINEAR = (f"SGLang {ENGINE_VERSIONS['sglang']} has no scheme for MXFP8 weights (format "
                       "'mxfp8-quantized' is not among its compressed-tensors formats)")


def _mxfp8_w8a8(capability: int, N: int | None, K: int | None) -> bool:
    """vLLM's MXFP8 registry takes one of FlashInfer's MXFP8 GEMMs (which quantize the inputs) for
    a layer of N outputs and K inputs (None: unknown, taken as wide enough) on `capability`."""
    if capability < MXFP8_W8A8_CAPABILITY:
        return False
    if (N is not None and N < MXFP8_W8A8_MIN_DIM) or (K is not None and K < MXFP8_W8A8_MIN_DIM):
        return False
    return not (120 <= capability < 130 and N is not None and N % 32)


def _mxfp8(engine: str, s: QuantScheme, capability: int, base: dict, N: int | None, K: int | None) -> LayerVerdict:
    """vLLM's one MXFP8 scheme, `CompressedTensorsW8A8Mxfp8` (from 7.5, MXFP8 inputs or none): FlashInfer's
    MXFP8 GEMM where `_mxfp8_w8a8`, which quantizes the inputs even where the checkpoint leaves them
    float, else FP8 Marlin (weight-only). SGLang has none (`SGLANG_MXFP8_LINEAR`)."""
    ia = s.input_activations
    if engine == "sglang":
        return LayerVerdict(None, **base, problem=SGLANG_MXFP8_LINEAR)
    if capability < MXFP8_MIN_CAPABILITY:
        return LayerVerdict(None, **base, problem=f"MXFP8 below compute capability {MXFP8_MIN_CAPABILITY / 10:.1f}")
    if _mxfp8_w8a8(capability, N, K):
        problem = None if ia is not None else mx_inputs_quantized(
            f"from compute capability {MXFP8_W8A8_CAPABILITY / 10:.1f}", "FlashInfer's MXFP8 GEMM", "MXFP8")
        return LayerVerdict("W8A8Mxfp8", **base, input_activations=MXFP8_INPUTS, problem=problem)
    where = f"below compute capability {MXFP8_W8A8_CAPABILITY / 10:.1f}" if capability < MXFP8_W8A8_CAPABILITY \
        else f"on a layer FlashInfer's MXFP8 GEMM does not take (N={N}, K={K})"
    problem = None if ia is None else mx_inputs_set_aside("the weights", where, "MXFP8")
    return LayerVerdict("W8A8Mxfp8", **base, problem=problem)


def microscaled_verdict(engine: str, s: QuantScheme, capability: int, base: dict, N: int | None,
                        K: int | None) -> LayerVerdict:
    """The verdict of `engine` on a Linear of N outputs and K inputs (None: unknown) whose weights
    are NVFP4, MXFP4 or MXFP8 (`base`: the verdict's weight fields)."""
    w = s.weights
    if w.is_fp4:
        return (_mxfp4 if w.is_mx else _nvfp4)(engine, s, capability, base)
    return _mxfp8(engine, s, capability, base, N, K)
