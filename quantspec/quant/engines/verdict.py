"""What a verdict says: the scheme an engine picks for one engine layer (`LayerVerdict`) and one
engine's verdict on a whole artifact (`EngineVerdict`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

from quantspec.quant.engines.tables import NVFP4_W4A4_CAPABILITY, engine_name

__all__ = ["MXFP4_INPUTS", "MXFP8_INPUTS", "LayerVerdict", "EngineVerdict", "activation_label", "nvfp4_inputs_set_aside",
           "mx_inputs_set_aside", "mx_inputs_quantized"]

MXFP4_INPUTS = "mxfp4 dynamic"  # MXFP4 inputs: power-of-two group scales computed at run time
MXFP8_INPUTS = "mxfp8 dynamic"  # MXFP8 inputs: the same with E4M3 values


def activation_label(ia) -> str | None:
    """A verdict's name for input activation args `ia` ("int8 static", "fp8 dynamic", NVFP4's,
    MXFP4's, MXFP8's; None: float inputs)."""
    if ia is None:
        return None
    if ia.is_mx:
        return MXFP8_INPUTS if ia.is_fp8 else MXFP4_INPUTS
    if ia.is_fp4:
        return "nvfp4 dynamic (static global scale)"
    kind = "fp8" if ia.type == "float" else f"int{ia.num_bits}"
    return f"{kind} {'dynamic' if ia.dynamic else 'static'}"


def nvfp4_inputs_set_aside(what: str) -> str:
    """The problem of an engine that runs `what` (a layer's weights, its experts') with FP4 Marlin
    below FP4 tensor cores, setting NVFP4 input quantization aside."""
    return (f"NVFP4 input quantization below compute capability {NVFP4_W4A4_CAPABILITY / 10:.1f} "
            f"(it runs {what} with FP4 Marlin, inputs float)")


def mx_inputs_set_aside(what: str, where: str, kind: str = "MXFP4") -> str:
    """The problem of vLLM running `what` (a layer's weights, its experts') with Marlin `where`
    (a compute capability or shape its `kind` ("MXFP4" | "MXFP8") W×A× kernels do not run on),
    setting the MX input quantization aside."""
    return f"{kind} input quantization {where} (it runs {what} with {kind[2:]} Marlin, inputs float)"


def mx_inputs_quantized(where: str, kernel: str, kind: str = "MXFP4") -> str:
    """The problem of vLLM running a `kind` ("MXFP4" | "MXFP8") weight-only layer with `kernel`, a
    kernel that quantizes the layer's inputs to `kind` at run time, `where` (the compute
    capabilities it runs on): its MX code asks for MX inputs whatever the checkpoint says."""
    return (f"that the checkpoint's inputs are float {where} (vLLM's {kind} code asks for {kind} inputs "
            f"and runs {kernel}, which quantizes them at run time)")


@dataclass(frozen=True)
class LayerVerdict:
    """The scheme one engine picks for one engine layer (None: left unquantized)."""

    scheme: str | None
    num_bits: int | None = None
    group_size: int | None = None  # None: per channel (or not grouped)
    symmetric: bool | None = None
    input_activations: str | None = None  # "int8 static" / "fp8 static" / None
    problem: str | None = None  # why the engine refuses or mis-runs this layer
    defect: bool = False  # the problem is the engine's bug: the layer is valid compressed-tensors
    block: tuple[int, int] | None = None  # FP8 block scales: (rows, columns) of a block
    per_tensor: bool = False  # one weight scale per Linear (group_size None: per channel otherwise)

    def to_dict(self) -> dict:
        return {"scheme": self.scheme, "num_bits": self.num_bits, "group_size": self.group_size,
                "block": None if self.block is None else list(self.block), "per_tensor": self.per_tensor,
                "symmetric": self.symmetric, "input_activations": self.input_activations,
                "problem": self.problem, "defect": self.defect}


@dataclass(frozen=True)
class EngineVerdict:
    """One engine's verdict: `status` "loads" | "ignores" | "refused", the reasons (ignored parts
    or the refusal), what to do instead, the KV cache it runs, and the scheme per engine layer.
    `defect`: every reason is a bug of the engine on valid compressed-tensors (e.g. SGLang's
    static int8 layers), so `--target portable` still writes the artifact."""

    engine: str
    status: str
    reasons: tuple[str, ...] = ()
    fixes: tuple[str, ...] = ()
    kv_cache: str | None = None
    layers: Mapping[str, LayerVerdict] = field(default_factory=dict)
    defect: bool = False

    def line(self) -> str:
        """One line: "loads", "loads but ignores X" or "refused because Y"."""
        if self.status == "loads":
            return "loads"
        why = "; ".join(self.reasons)
        if self.defect:
            why += f" (a bug in {engine_name(self.engine)}: the artifact is valid compressed-tensors)"
        return f"loads but ignores {why}" if self.status == "ignores" else f"refused because {why}"

    def to_dict(self) -> dict:
        return {"engine": self.engine, "status": self.status, "verdict": self.line(),
                "reasons": list(self.reasons), "fixes": list(self.fixes), "kv_cache": self.kv_cache,
                "defect": self.defect, "layers": {n: v.to_dict() for n, v in self.layers.items()}}
