"""A quantization scheme: the args of a module's weights, input activations and outputs plus
the targets it applies to (compressed-tensors' `QuantizationScheme`), and the compressed-tensors
format a scheme's weights are stored in."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from quantspec.errors import QuantSpecError
from quantspec.quant.args import (
    _ACTIVATION_STRATEGIES,
    FORMAT_FLOAT_QUANTIZED,
    FORMAT_INT_QUANTIZED,
    FORMAT_MIXED_PRECISION,
    FORMAT_MXFP4_PACK_QUANTIZED,
    FORMAT_MXFP8_QUANTIZED,
    FORMAT_NVFP4_PACK_QUANTIZED,
    FORMAT_PACK_QUANTIZED,
    SUPPORTED_FORMATS,
    QuantArgs,
    _err,
)

__all__ = ["QuantScheme", "embedding_problem", "is_mxfp4_fp8_inputs", "is_w4a8", "scheme_format"]


def is_w4a8(weights: QuantArgs | None, inputs: QuantArgs | None) -> bool:
    """int4 weights with 8-bit (int8 or FP8) inputs quantized per token at run time: W4A8 /
    W4AFP8, the one scheme of int4 codes with quantized inputs that quantspec runs."""
    return (weights is not None and weights.type == "int" and weights.num_bits == 4 and inputs is not None
            and inputs.num_bits == 8 and inputs.per_token)


def scheme_format(weights: QuantArgs | None, input_activations: QuantArgs | None = None) -> str:
    """The compressed-tensors format name for a scheme's weights.

    NVFP4 → "nvfp4-pack-quantized" and MXFP4 → "mxfp4-pack-quantized" (two E2M1 codes per uint8
    `weight_packed`); MXFP8 → "mxfp8-quantized" (float8_e4m3fn `weight`, uint8 E8M0 scales); fp8 →
    "float-quantized" (float8_e4m3fn `weight`); int with quantized input activations (W8A8)
    → "int-quantized" (plain int8 `weight`); int weight-only (W4A16, W8A16) → "pack-quantized"
    (int32 words), what compressed-tensors writes for them and the only integer weight-only
    format vLLM and SGLang load.
    """
    if weights is None:
        raise QuantSpecError("scheme_format: a scheme without weights has no weight format")
    if weights.is_fp4:
        return FORMAT_MXFP4_PACK_QUANTIZED if weights.is_mx else FORMAT_NVFP4_PACK_QUANTIZED
    if weights.is_mxfp8:
        return FORMAT_MXFP8_QUANTIZED
    if weights.type == "float":
        return FORMAT_FLOAT_QUANTIZED
    if weights.num_bits < 8 or input_activations is None:
        return FORMAT_PACK_QUANTIZED
    return FORMAT_INT_QUANTIZED


# the formats of microscaled weights (their group scales are the format's own)
_MICROSCALED_FORMATS = (FORMAT_NVFP4_PACK_QUANTIZED, FORMAT_MXFP4_PACK_QUANTIZED, FORMAT_MXFP8_QUANTIZED)


def _check_microscaled_inputs(weights: QuantArgs | None, ia: QuantArgs, where: str) -> None:
    """NVFP4 / MXFP4 / MXFP8 inputs go with weights of their own kind, and such weights take those
    inputs or none: NVFP4 inputs are tensor_group with dynamic 'local', MX inputs group 32, dynamic;
    MXFP4 weights also take FP8 inputs quantized at run time per token or group (MXFP4XFP8)."""
    kind = None if weights is None else weights.microscaled
    if kind is None and ia.microscaled is None:
        return
    if ia.microscaled == kind and ia.dynamic == ("local" if kind == "nvfp4" else True):
        return
    if kind == "mxfp4" and is_mxfp4_fp8_inputs(ia):
        return
    raise _err(where, "NVFP4 / MXFP4 / MXFP8 inputs go with weights of their kind, and such weights take those "
                      "inputs or float inputs: NVFP4 inputs are tensor_group with dynamic 'local' (or none: "
                      "NVFP4A16), MXFP4 / MXFP8 inputs group 32 with dynamic true (or none: MXFP4A16 / MXFP8A16); "
                      "MXFP4 weights also take symmetric FP8 inputs per token or group with dynamic true "
                      "(MXFP4XFP8)")


def is_mxfp4_fp8_inputs(ia: QuantArgs | None) -> bool:
    """FP8 E4M3 inputs quantized symmetrically at run time per token or per group of columns, with
    float scales: what MXFP4 weights take beside MXFP4 inputs (compressed-tensors' MXFP4XFP8)."""
    return (ia is not None and ia.is_fp8 and not ia.is_mx and ia.dynamic is True and ia.symmetric
            and ia.strategy in ("token", "group"))


@dataclass(frozen=True)
class QuantScheme:
    """Which modules (`targets`) get which weight / input-activation args, and their format."""

    targets: tuple[str, ...]
    weights: QuantArgs | None = None
    input_activations: QuantArgs | None = None
    format: str | None = None

    def __post_init__(self) -> None:
        w = "QuantScheme"
        targets = self.targets
        if isinstance(targets, str) or not isinstance(targets, Iterable):
            raise _err(w, f"targets must be a list of names, got {targets!r}")
        targets = tuple(targets)
        if not targets or not all(isinstance(t, str) and t for t in targets):
            raise _err(w, f"targets must be a non-empty list of non-empty strings, got {targets!r}")
        for t in targets:
            if t.startswith("re:"):
                try:
                    re.compile(t[3:])
                except re.error as e:
                    raise _err(w, f"target {t!r} is not a valid regex ({e})") from None
        object.__setattr__(self, "targets", targets)
        if self.weights is not None and not isinstance(self.weights, QuantArgs):
            raise _err(w, f"weights must be QuantArgs, got {type(self.weights).__name__}")
        ia = self.input_activations
        if ia is not None:
            if not isinstance(ia, QuantArgs):
                raise _err(w, f"input_activations must be QuantArgs, got {type(ia).__name__}")
            if ia.strategy not in _ACTIVATION_STRATEGIES or ia.strategy == "attn_head":
                raise _err(w, f"input_activations strategy {ia.strategy!r} unsupported; use "
                              "tensor (static) or token (dynamic)")
            _check_microscaled_inputs(self.weights, ia, w)
        if self.weights is None and ia is None:
            raise _err(w, "a scheme needs weights and/or input_activations")
        fmt = self.format
        if fmt is None and self.weights is not None:
            fmt = scheme_format(self.weights, ia)
        if fmt is not None and fmt not in SUPPORTED_FORMATS:
            raise _err(w, f"format {fmt!r} is unsupported; use one of {', '.join(SUPPORTED_FORMATS)}")
        if fmt == FORMAT_PACK_QUANTIZED and self.weights is not None and self.weights.type != "int":
            raise _err(w, "format 'pack-quantized' needs int weights; use 'float-quantized' for FP8")
        if self.weights is not None and (fmt in _MICROSCALED_FORMATS or self.weights.microscaled) \
                and fmt != scheme_format(self.weights, ia):
            raise _err(w, f"format {fmt!r} does not hold {self.weights.num_bits}-bit {self.weights.type} weights; "
                          f"NVFP4 weights are stored as '{FORMAT_NVFP4_PACK_QUANTIZED}', MXFP4 weights as "
                          f"'{FORMAT_MXFP4_PACK_QUANTIZED}', MXFP8 weights as '{FORMAT_MXFP8_QUANTIZED}'")
        object.__setattr__(self, "format", fmt)

    @property
    def sized_by_inputs(self) -> bool:
        """Microscaled weights (their groups the format's own) with inputs quantized per group of
        another kind (a8w4_mxfp4's FP8 inputs): the input groups are what must tile a layer's K."""
        w, ia = self.weights, self.input_activations
        return w is not None and w.microscaled is not None and ia is not None and ia.microscaled is None \
            and ia.strategy == "group"

    def to_dict(self) -> dict:
        return {
            "targets": list(self.targets),
            "weights": None if self.weights is None else self.weights.to_dict(),
            "input_activations": None if self.input_activations is None
            else self.input_activations.to_dict(),
            "output_activations": None,
            "format": self.format,
        }

    @classmethod
    def from_dict(cls, d: Any, where: str = "QuantScheme", default_format: str | None = None
                  ) -> "QuantScheme":
        if isinstance(d, (list, tuple)):
            raise _err(where, "preset-name config groups (a group named after a preset with a "
                              "list of targets) are unsupported; write the scheme out in full")
        if not isinstance(d, Mapping):
            raise _err(where, f"expected a mapping, got {type(d).__name__}")
        known = {"targets", "weights", "input_activations", "output_activations", "format"}
        unknown = sorted(set(d) - known)
        if unknown:
            raise _err(where, f"unknown key(s) {unknown}; remove them")
        if d.get("output_activations") is not None:
            raise _err(where, "output_activations quantization is unsupported; remove it")
        fmt = d.get("format") or default_format
        if fmt == FORMAT_MIXED_PRECISION:
            fmt = None
        if fmt is not None and fmt not in SUPPORTED_FORMATS:
            raise _err(where, f"format {fmt!r} is unsupported by quantspec; supported: "
                              f"{', '.join(SUPPORTED_FORMATS)}")
        weights = d.get("weights")
        ia = d.get("input_activations")
        try:
            return cls(
                targets=tuple(d.get("targets") or ()),
                weights=None if weights is None else QuantArgs.from_dict(weights, f"{where}.weights"),
                input_activations=None if ia is None
                else QuantArgs.from_dict(ia, f"{where}.input_activations"),
                format=fmt,
            )
        except QuantSpecError as e:
            msg = str(e)
            raise QuantSpecError(msg if msg.startswith(where) else f"{where}: {msg}") from None


def embedding_problem(scheme: QuantScheme) -> str | None:
    """Why quantspec does not look up an input embedding quantized with `scheme` (None: it does):
    it runs 4- and 8-bit integer weight-only codes per row or per group of a row (an embedding's
    inputs are token ids)."""
    w, ia = scheme.weights, scheme.input_activations
    if w.type == "int" and w.num_bits in (4, 8) and w.strategy in ("channel", "group") and ia is None:
        return None
    return (f"a {w.type}{w.num_bits} {w.strategy} embedding{' with quantized inputs' if ia is not None else ''} "
            "(quantspec looks up 4- and 8-bit integer weight-only rows, per row or group)")
