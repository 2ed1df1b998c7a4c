"""A step's logits as each sequence's own rules shape them before a token is picked: EOS and stop
tokens masked until `min_tokens`, the penalties and logit bias (`sampler.adjust_logits`), and a
structured output's mask (`structured.py`). The raw logits stay the step's own (log-probabilities
are the model's); what the picker and the verifier see is adjusted.

Drafts: each row of a sequence's drafts, a chain or a token tree, is adjusted as the row of plain
decoding at that point would be: the penalties, `min_tokens` and `bad_words` over the output
followed by the drafts on the row's path, the bias and `allowed_token_ids` as they are, then the
grammar's mask in its state after those drafts. So verification accepts exactly the drafts the
adjusted target would have produced (greedy), or keeps the rejection-sampling guarantee against
the adjusted distribution (sampling). A chain's deterministic drafts the grammar rules out are cut
before the forward (`guide_drafts`): such a draft is rejected with certainty and the row that
replaces it is the guided distribution itself, so cutting changes nothing but the wasted rows. A
tree keeps its nodes (a node the grammar rules out is rejected like any other, and its subtree
with it).
"""

from __future__ import annotations

import torch

from quantspec.infer.sampler import adjust_logits
from quantspec.infer.sequence import Sequence
from quantspec.infer.spec.tree import row_paths
from quantspec.infer.structured import mask_logits, mask_rows, valid_prefix

__all__ = ["adjust_step", "guide_drafts"]


def _penalize(row: torch.Tensor, seq: Sequence, eos: set[int], path: list[int]) -> None:
    """`row` [V] of the token after `seq`'s output and then `path`, in place: EOS and stop tokens
    masked while that is shorter than `min_tokens`, then the penalties, bias and banned words."""
    p = seq.params
    output = list(seq.output_ids) + path
    if len(output) < p.min_tokens:
        ends = set(p.stop_token_ids) | (set() if p.ignore_eos else eos)
        row[torch.tensor(sorted(t for t in ends if t < row.shape[0]), dtype=torch.int64, device=row.device)] = \
            float("-inf")
    adjust_logits(row, p, seq.prompt_ids, output)


def _adjust_rows(rows: torch.Tensor, seq: Sequence, drafts: list[int], eos: set[int],
                 parents: list[int] | None = None) -> torch.Tensor:
    """rows [1 + k, V] of `seq` (its fed token's row, then one per draft; `parents`: a tree's), in
    place: each as plain decoding would adjust it after the drafts on its path (module docstring)."""
    if seq.params.has_logit_rules:
        for row, path in zip(rows, row_paths(drafts, parents)):
            _penalize(row, seq, eos, path)
    if seq.guide is not None and drafts:
        mask_rows(seq.guide, drafts, rows, parents)
    elif seq.guide is not None:
        mask_logits(seq.guide, rows[0])
    return rows


def adjust_step(model, eos: set[int], seqs: list[Sequence], drafts: list[list[int]], scored: torch.Tensor,
                ids: list[int] | None, logits: torch.Tensor | None, trees: list[list[int] | None] | None = None
                ) -> tuple[list[int] | None, torch.Tensor | None]:
    """The step's (ids, logits) to pick from, with the rows of each sequence whose params adjust
    its logits (`SamplingParams.adjusts_logits`) adjusted: in a greedy batch (`ids`, no logits)
    its ids re-picked from logits computed for its rows, else its rows of a copy of `logits`
    [R, V]. `scored` [R, D]: the step's scored rows, each sequence's 1 + len(drafts) in order;
    `trees`: each sequence's draft parents where it drafted a tree."""
    spans, r = [], 0
    for i, (s, d) in enumerate(zip(seqs, drafts)):
        if s.params.adjusts_logits:
            spans.append((r, s, d, None if trees is None else trees[i]))
        r += 1 + len(d)
    if ids is not None:
        ids = list(ids)
        at = torch.tensor([r + j for r, _, d, _ in spans for j in range(1 + len(d))], device=scored.device)
        lg = model.compute_logits(scored[at]).float()
        i = 0
        for r, s, d, par in spans:
            picked = _adjust_rows(lg[i:i + 1 + len(d)], s, d, eos, par).argmax(-1).tolist()
            ids[r:r + 1 + len(d)] = picked
            i += 1 + len(d)
        return ids, logits
    logits = logits.clone()
    for r, s, d, par in spans:
        _adjust_rows(logits[r:r + 1 + len(d)], s, d, eos, par)
    return ids, logits


def guide_drafts(seqs: list[Sequence], drafts: list[list[int]], probs: list, trees: list | None) -> None:
    """In place, before the forward: of a guided sequence's chain of deterministic drafts (probs
    None), the ones its grammar allows from the start (a tree is kept whole)."""
    for i, s in enumerate(seqs):
        if s.guide is None or not drafts[i] or (trees is not None and trees[i] is not None):
            continue
        if probs[i] is None:
            drafts[i] = drafts[i][:valid_prefix(s.guide, drafts[i])]
