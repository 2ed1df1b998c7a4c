"""Speculative decoding without a model: the proposal/result dataclasses, the n-gram drafter and
the one verifier. Drafters that need a model (draft model, MTP) live with the engine."""

from quantspec.infer.spec.ngram import NgramProposer, propose_ngram, propose_ngram_batch
from quantspec.infer.spec.types import SpecProposal, VerifyResult
from quantspec.infer.spec.verify import verify, verify_proposal

__all__ = [
    "SpecProposal",
    "VerifyResult",
    "NgramProposer",
    "propose_ngram",
    "propose_ngram_batch",
    "verify",
    "verify_proposal",
]
