"""Draft modules quantized on their own (`model_zoo.mtp`, `.medusa`): why each engine but
quantspec refuses one, read from its code at the pinned version (no model class, no speculative
method that reads the layout)."""

from __future__ import annotations

from quantspec.quant.engines.tables import ENGINE_VERSIONS, ENGINES
from quantspec.quant.engines.verdict import EngineVerdict

__all__ = ["DRAFT_REFUSALS", "draft_verdicts", "draft_refusal"]

DRAFT_REFUSALS = {
    "mtp": dict.fromkeys(("vllm", "sglang", "transformers"),
                         "it has no model class for a quantspec MTP module (quantspec's own layout)"),
    "medusa": {
        "vllm": f"vLLM {ENGINE_VERSIONS['vllm']} has no Medusa drafter (no 'medusa' in "
                "SpeculativeConfig.method, no Medusa class in its model registry)",
        "sglang": f"SGLang {ENGINE_VERSIONS['sglang']} has no Medusa drafter (no MEDUSA in "
                  "SpeculativeAlgorithm, no Medusa model class)",
        "transformers": "it has no model class for Medusa heads (architecture MedusaModel)",
    },
}


def draft_verdicts(draft: str) -> dict[str, EngineVerdict]:
    """The verdicts on an unquantized draft module of kind `draft` ("mtp" / "medusa"): quantspec
    loads it, every other engine refuses it (`DRAFT_REFUSALS`)."""
    return {e: draft_refusal(e, draft) or EngineVerdict(e, "loads") for e in ENGINES}


def draft_refusal(engine: str, draft: str | None) -> EngineVerdict | None:
    """`engine`'s refusal of a draft module of kind `draft` (None: not a draft, or quantspec)."""
    if draft is None or engine == "quantspec":
        return None
    return EngineVerdict(engine, "refused", (DRAFT_REFUSALS[draft][engine],), ("serve it with quantspec",))
