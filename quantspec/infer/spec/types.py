"""The dataclasses where proposers and the verifier meet: `SpecProposal` (what every drafter
returns for a batch) and `VerifyResult` (what `verify` returns).

Only the engine knows both a drafter and the target model; drafters return a `SpecProposal`
from `propose(seqs, budgets)`, the engine runs one target forward over the 1 + k_b positions of
every sequence, and `verify_proposal` turns the target's logits (or its greedy ids) into a
`VerifyResult`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from quantspec.errors import QuantSpecError

__all__ = ["SpecProposal", "VerifyResult"]


@dataclass(frozen=True)
class SpecProposal:
    """Draft tokens for a batch of B sequences.

    draft_token_ids: B tensors, each 1-D int64 [k_b] (k_b >= 0, may differ per sequence).
    draft_probs:     None for deterministic drafters (n-gram, greedy draft model: q is one-hot at
                     the drafted token), or B entries, each None or a float [k_b, V] tensor: the
                     full distribution each draft token was *sampled from* (after the drafter's
                     own temperature / top-k / top-p), row j for draft token j.
    parents:         None (every sequence drafts a chain), or B entries, each None (a chain) or
                     the k_b rows of a token tree's parents (`spec/tree.py`: row 0 is the newest
                     token, draft j is row j + 1, parents[b][j] in 0..j).
    """

    draft_token_ids: Sequence[torch.Tensor]  # B × [k_b] int64
    draft_probs: Sequence[torch.Tensor | None] | None = None  # B × ([k_b, V] float | None)
    parents: Sequence[list[int] | None] | None = None  # B × ([k_b] rows | None)

    def __post_init__(self) -> None:
        ids = list(self.draft_token_ids)
        for b, t in enumerate(ids):
            if not isinstance(t, torch.Tensor) or t.ndim != 1 or t.dtype != torch.int64:
                got = f"{tuple(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor) else type(t)
                raise QuantSpecError(
                    f"draft_token_ids[{b}] must be a 1-D int64 tensor [k_b], got {got}; "
                    "use torch.tensor(ids, dtype=torch.long)"
                )
        object.__setattr__(self, "draft_token_ids", ids)
        if self.parents is not None:
            self._check_parents(ids)
        if self.draft_probs is None:
            return
        probs = list(self.draft_probs)
        if len(probs) != len(ids):
            raise QuantSpecError(
                f"draft_probs has {len(probs)} entries for {len(ids)} sequences; "
                "pass one ([k_b, V] tensor or None) per sequence, or None for all"
            )
        vocab = None
        for b, (t, q) in enumerate(zip(ids, probs)):
            if q is None:
                continue
            if q.ndim != 2 or q.shape[0] != t.shape[0] or not q.is_floating_point():
                raise QuantSpecError(
                    f"draft_probs[{b}] must be a float [k_b={t.shape[0]}, V] tensor, "
                    f"got {tuple(q.shape)} {q.dtype}"
                )
            if vocab is not None and q.shape[1] != vocab:
                raise QuantSpecError(
                    f"draft_probs[{b}] has vocab {q.shape[1]}, others have {vocab}; "
                    "all sequences must share one vocabulary"
                )
            vocab = q.shape[1]
        object.__setattr__(self, "draft_probs", probs)

    def _check_parents(self, ids: list[torch.Tensor]) -> None:
        parents = list(self.parents)
        if len(parents) != len(ids):
            raise QuantSpecError(f"parents has {len(parents)} entries for {len(ids)} sequences; pass one per sequence")
        for b, (t, par) in enumerate(zip(ids, parents)):
            if par is None:
                continue
            if len(par) != t.shape[0] or any(not 0 <= int(p) <= j for j, p in enumerate(par)):
                raise QuantSpecError(f"parents[{b}] must give each of the {t.shape[0]} drafts a parent row "
                                     f"before it (0..j for draft j), got {list(par)}")
        object.__setattr__(self, "parents", [None if p is None else [int(x) for x in p] for p in parents])

    def parents_of(self, b: int) -> list[int] | None:
        """The tree parents of sequence b's drafts, or None for a chain."""
        return None if self.parents is None else self.parents[b]

    @property
    def has_tree(self) -> bool:
        return self.parents is not None and any(p is not None for p in self.parents)

    @classmethod
    def from_token_lists(
        cls, drafts: Sequence[Sequence[int]], device: torch.device | str = "cpu"
    ) -> SpecProposal:
        """A deterministic proposal (no draft probs) from plain lists of token ids."""
        return cls([torch.tensor(list(d), dtype=torch.int64, device=device) for d in drafts])

    def token_lists(self) -> list[list[int]]:
        """The draft ids of each sequence as a list of ints."""
        return [t.tolist() for t in self.draft_token_ids]

    @property
    def batch_size(self) -> int:
        return len(self.draft_token_ids)

    @property
    def num_draft_tokens(self) -> list[int]:
        """k_b per sequence."""
        return [int(t.shape[0]) for t in self.draft_token_ids]

    def probs_of(self, b: int) -> torch.Tensor | None:
        """Draft probs [k_b, V] of sequence b, or None when its drafts are deterministic."""
        return None if self.draft_probs is None else self.draft_probs[b]


@dataclass(frozen=True)
class VerifyResult:
    """Outcome of one verification step for B sequences.

    num_accepted:  [B] int64 (CPU): how many leading draft tokens were accepted (0..k_b).
    output_tokens: B lists of num_accepted[b] + 1 token ids: the accepted draft tokens followed
                   by one token from the target (recovered on a rejection, bonus if all k_b
                   were accepted). The engine appends these and rolls back the KV slots of the
                   k_b - num_accepted[b] rejected positions.
    """

    num_accepted: torch.Tensor  # [B] int64
    output_tokens: list[list[int]]  # B × (num_accepted[b] + 1)
