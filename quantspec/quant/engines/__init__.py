"""What each serving engine does with a compressed-tensors artifact: one verdict per engine.

`engine_verdicts(config, linears)` says, for vLLM, SGLang, transformers and quantspec, whether an
artifact with this `quantization_config` and these Linears loads with the scheme it was quantized
with, loads but ignores part of it, or is refused — and, per engine layer, which scheme the
engine picks. It models the engines' compressed-tensors decision code at the versions pinned in
`ENGINE_VERSIONS`; the conformance suite (tests/conformance) runs that code itself, lifted from
the engines' wheels, on every artifact type and checks these verdicts against it, so a change in
an engine shows up as a failing test, not as a wrong verdict. `target_refusal` turns the same
verdicts into the one-line refusals of `quantize --target`.

The package, by concept:
- `tables`: the engines, their pinned versions, the `--target` names, the Llama layer layout
  (fused layers, layer classes) the engines build;
- `verdict`: `LayerVerdict` / `EngineVerdict`, what a verdict says;
- `layers`: per engine layer, the config group an engine resolves and the scheme it picks;
- `moe`: a mixture of experts' fused-MoE layers, as vLLM and SGLang judge them;
- `drafts`: draft modules (MTP, Medusa, EAGLE-3): which engines refuse them, and the EAGLE-3
  head's layers as vLLM and SGLang name and quantize them;
- `decide`: the verdicts on a whole artifact and `quantize --target`'s refusals.
"""

from quantspec.quant.engines.decide import engine_verdicts, target_refusal
from quantspec.quant.engines.drafts import DRAFT_REFUSALS, draft_verdicts, eagle3_ignore, eagle3_refusal, eagle3_targets
from quantspec.quant.engines.layers import engine_layers, fused_targets
from quantspec.quant.engines.tables import (
    DEFAULT_CAPABILITY,
    ENGINE_NAMES,
    ENGINE_VERSIONS,
    ENGINES,
    FP8_MIN_CAPABILITY,
    FUSED_LAYERS,
    LAYER_CLASSES,
    TARGET_ENGINES,
    TARGETS,
    parse_capability,
)
from quantspec.quant.engines.verdict import EngineVerdict, LayerVerdict

__all__ = [
    "ENGINES", "ENGINE_NAMES", "ENGINE_VERSIONS", "TARGETS", "TARGET_ENGINES", "FUSED_LAYERS",
    "LAYER_CLASSES", "FP8_MIN_CAPABILITY", "LayerVerdict", "EngineVerdict", "engine_layers",
    "fused_targets", "engine_verdicts", "draft_verdicts", "DRAFT_REFUSALS", "target_refusal",
    "eagle3_ignore", "eagle3_refusal", "eagle3_targets", "DEFAULT_CAPABILITY", "parse_capability",
]
