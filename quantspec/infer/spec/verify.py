"""The one speculative-decoding verifier: a pure function from (draft tokens, draft probs or None,
target logits, per-sequence sampling params, generators) to accepted counts and output tokens.

Words used here, for one sequence with k draft tokens x_1..x_k and target logits at its 1 + k
positions (position j scores the token after x_1..x_j; position 0 scores x_1):

- accepted token: a draft token x_j kept because every earlier draft was kept and x_j passed the
  acceptance test at position j-1 (greedy: x_j == argmax target; sampling: u < p(x_j) / q(x_j)).
- recovered token: the token the target emits at the first rejected position n instead of x_{n+1}
  (greedy: the target argmax; sampling: a draw from norm(max(0, p - q))).
- bonus token: when all k drafts are accepted, the extra token drawn from the target at position
  k (greedy: argmax), so every step emits at least one token.

Sampling is lossless rejection sampling (Leviathan et al. 2023, arXiv:2211.17192; Chen et al.
2023, arXiv:2302.01318): every emitted token is distributed exactly as the target's filtered
distribution p = logits_to_probs(logits, temperature, top_k, top_p, min_p) of that sequence. For
deterministic drafts (draft probs None: n-gram, greedy draft model) q is one-hot at x, so x is
accepted with probability p(x) and a rejection samples from p with x removed, renormalised.
Reference design: vLLM `v1/sample/rejection_sampler.py`.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from quantspec.errors import QuantSpecError
from quantspec.infer.sampler import SamplingParams, greedy_ids, logits_to_probs, sample, sampling_tensors
from quantspec.infer.spec.types import SpecProposal, VerifyResult

__all__ = ["verify", "verify_greedy_ids", "verify_proposal", "VerifyResult"]


def _checked(draft_token_ids, draft_probs, target_logits, sampling_params, generators) -> tuple[SpecProposal, list]:
    """The proposal and one generator per sequence, after checking every input's shape."""
    batch = len(draft_token_ids)
    if target_logits.ndim != 2 or not target_logits.is_floating_point():
        raise QuantSpecError(
            f"target_logits must be a float [sum(1+k_b), V] tensor, got "
            f"{tuple(target_logits.shape)} {target_logits.dtype}"
        )
    if len(sampling_params) != batch:
        raise QuantSpecError(
            f"got {len(sampling_params)} sampling params for {batch} sequences; pass one each"
        )
    generators = [None] * batch if generators is None else list(generators)
    if len(generators) != batch:
        raise QuantSpecError(
            f"got {len(generators)} generators for {batch} sequences; pass one each"
        )
    proposal = SpecProposal(draft_token_ids, draft_probs)  # validates ids / probs shapes
    total_rows, vocab = target_logits.shape
    if total_rows != sum(proposal.num_draft_tokens) + batch:
        raise QuantSpecError(
            f"target_logits has {total_rows} rows but the drafts need sum(1 + k_b) = "
            f"{sum(proposal.num_draft_tokens) + batch}; score every draft position plus one per sequence"
        )
    for b in range(batch):
        q = proposal.probs_of(b)
        if q is not None and q.shape[1] != vocab:
            raise QuantSpecError(
                f"draft_probs[{b}] has vocab {q.shape[1]} but target_logits has {vocab}; "
                "draft and target must share the tokenizer's vocabulary"
            )
    return proposal, generators


@dataclass
class _Layout:
    """Where each sequence's drafts and rows are: sequence b owns rows start[b] .. start[b] + k_b
    of the target logits."""

    k: torch.Tensor  # [B] drafts per sequence
    start: torch.Tensor  # [B] first row of each sequence
    start_host: list[int]
    pos: torch.Tensor  # [K] draft positions
    valid: torch.Tensor  # [B, K] a real draft at that position
    rows: torch.Tensor  # [B, K] the target row scoring each draft
    drafts: torch.Tensor  # [B, K] draft ids (0 where padded)
    drafts_host: list[list[int]]

    @classmethod
    def of(cls, proposal: SpecProposal, total_rows: int, vocab: int, device) -> "_Layout":
        num_draft = proposal.num_draft_tokens
        batch, k_max = len(num_draft), max(num_draft)
        k = torch.tensor(num_draft, dtype=torch.int64, device=device)  # [B]
        start = torch.cumsum(k + 1, 0) - (k + 1)  # [B]
        start_host = [0, *itertools.accumulate(kb + 1 for kb in num_draft)][:batch]
        pos = torch.arange(k_max, device=device)  # [K]
        valid = pos.unsqueeze(0) < k.unsqueeze(1)  # [B, K]
        rows = (start.unsqueeze(1) + pos.unsqueeze(0)).clamp(max=total_rows - 1)  # [B, K]
        drafts = torch.zeros(batch, k_max, dtype=torch.int64, device=device)  # [B, K]
        if k_max:
            drafts[valid] = torch.cat([t.to(device) for t in proposal.draft_token_ids])
        drafts_host = drafts.tolist()  # the one host copy of the drafts (they usually start there)
        if any(not 0 <= x < vocab for row in drafts_host for x in row):
            raise QuantSpecError(f"draft token ids must lie in [0, {vocab}); got out-of-range ids")
        return cls(k, start, start_host, pos, valid, rows, drafts, drafts_host)


def _target_probs(target_logits: torch.Tensor, lay: _Layout, seqs: list[int], num_draft: list[int],
                  sampling_params: Sequence[SamplingParams]) -> tuple[torch.Tensor, torch.Tensor]:
    """p [R, V] fp32: the target's filtered distribution at every row of the sampling sequences
    `seqs`, each with its own params; and the first row of each sequence in p [S]."""
    device = target_logits.device
    s_rows = torch.cat(
        [torch.arange(num_draft[b] + 1, device=device) + lay.start_host[b] for b in seqs]
    )  # [R]
    temp, *filters = sampling_tensors([sampling_params[b] for b in seqs], device)
    rep = lay.k[torch.tensor(seqs, device=device)] + 1  # [S]
    # all-sampling batches (the common case) skip the [R, V] gather copy
    s_logits = target_logits if len(seqs) == len(num_draft) else target_logits[s_rows]
    p = logits_to_probs(
        s_logits,
        temp.repeat_interleave(rep),
        *(None if f is None else f.repeat_interleave(rep) for f in filters),  # top_k, top_p, min_p
    )  # [R, V] fp32
    return p, torch.cumsum(rep, 0) - rep


def _sampling_accept(p: torch.Tensor, p_start: torch.Tensor, lay: _Layout, seqs: list[int],
                     proposal: SpecProposal, generators: list) -> torch.Tensor:
    """The acceptance tests u < p(x) / q(x) of the sampling sequences' drafts → [S, K] bool;
    each draws its k_b uniforms from its own generator."""
    device, num_draft = p.device, proposal.num_draft_tokens
    s_idx = torch.tensor(seqs, device=device)  # [S]
    p_rows = (p_start.unsqueeze(1) + lay.pos.unsqueeze(0)).clamp(max=p.shape[0] - 1)  # [S, K]
    s_drafts = lay.drafts[s_idx]  # [S, K]
    p_draft = p[p_rows, s_drafts]  # [S, K] p(x_j) at each draft position
    q_draft = torch.ones_like(p_draft)  # [S, K] deterministic drafts: q(x) = 1
    uniforms = torch.empty_like(p_draft)  # [S, K]
    shared = []
    for i, b in enumerate(seqs):
        kb = num_draft[b]
        q = proposal.probs_of(b)
        if q is not None and kb:
            q_rows = torch.arange(kb, device=device)
            q_draft[i, :kb] = q.to(device).float()[q_rows, s_drafts[i, :kb]]
        g = generators[b]
        if g is None:
            shared.append(i)
        elif kb:
            uniforms[i, :kb] = torch.rand(kb, generator=g, device=device)
    if shared:
        uniforms[shared] = torch.rand(len(shared), max(num_draft), device=device)
    # u < p/q accepts with probability min(1, p/q); written u·q < p so q(x) = 0 (a drafter
    # bug) accepts whenever p(x) > 0 instead of dividing by zero.
    return lay.valid[s_idx] & (uniforms * q_draft < p_draft)  # [S, K]


def _sampling_final(p: torch.Tensor, p_start: torch.Tensor, num_accepted: torch.Tensor, lay: _Layout,
                    seqs: list[int], proposal: SpecProposal, generators: list) -> torch.Tensor:
    """The token after the accepted drafts of each sampling sequence [S]: recovered from
    norm(max(0, p - q)) at a rejection, the bonus from p after the last draft."""
    device, num_draft = p.device, proposal.num_draft_tokens
    s_idx = torch.tensor(seqs, device=device)
    s_n = num_accepted[s_idx]  # [S]
    dist = p[p_start + s_n].clone()  # [S, V] target probs at the final position
    rejected = s_n < lay.k[s_idx]  # [S]; otherwise bonus from p at position k
    residual_q = torch.zeros_like(dist)  # [S, V] q at the rejected position, 0 for bonus
    s_n_host = s_n.tolist()
    for i, b in enumerate(seqs):
        n = s_n_host[i]
        if n < num_draft[b]:
            q = proposal.probs_of(b)
            if q is None:
                residual_q[i, lay.drafts_host[b][n]] = 1.0
            else:
                residual_q[i] = q[n].to(device).float()
    residual = (dist - residual_q).clamp_(min=0.0)  # [S, V]
    mass = residual.sum(dim=1, keepdim=True)  # [S, 1]
    # Mathematically a rejection leaves positive mass; if rounding leaves none, fall back to p.
    use_residual = rejected.unsqueeze(1) & (mass > 0)  # [S, 1]
    dist = torch.where(use_residual, residual / mass.clamp(min=1e-30), dist)  # [S, V]
    return sample(dist, [generators[b] for b in seqs])


def verify(
    draft_token_ids: Sequence[torch.Tensor],  # B × [k_b] int64
    draft_probs: Sequence[torch.Tensor | None] | None,  # None, or B × ([k_b, V] float | None)
    target_logits: torch.Tensor,  # [sum_b(1 + k_b), V]; sequence 0's rows, then sequence 1's...
    sampling_params: Sequence[SamplingParams],  # B
    generators: Sequence[torch.Generator | None] | None = None,  # B; None → global generator
) -> VerifyResult:
    """Accept a prefix of each sequence's drafts and emit one more token from the target.

    Per sequence b with k_b drafts, output_tokens[b] = accepted drafts + one recovered-or-bonus
    token, and num_accepted[b] = len(output_tokens[b]) - 1. Greedy sequences ignore draft probs
    and randomness. Sampling sequences draw, from their own generator only, k_b uniforms for the
    acceptance tests and then one uniform for the final token (a fixed amount whatever the
    outcome), so results do not depend on batch neighbours. Generators must live on the logits'
    device.

    Example (greedy, V = 4): drafts [[2, 3]], target argmax at the 3 positions = [2, 1, 0]
    → x_1 = 2 accepted, x_2 = 3 != 1 rejected → num_accepted [1], output_tokens [[2, 1]].
    """
    proposal, generators = _checked(draft_token_ids, draft_probs, target_logits, sampling_params, generators)
    batch = len(proposal.draft_token_ids)
    if batch == 0:
        return VerifyResult(torch.zeros(0, dtype=torch.int64), [])
    if all(p.is_greedy for p in sampling_params):
        return _verify_greedy(proposal.draft_token_ids, target_logits)
    device = target_logits.device
    lay = _Layout.of(proposal, *target_logits.shape, device)
    accept = torch.zeros(lay.drafts.shape, dtype=torch.bool, device=device)  # [B, K]
    final = torch.zeros(batch, dtype=torch.int64, device=device)  # [B]
    greedy_seqs = [b for b in range(batch) if sampling_params[b].is_greedy]
    sampling_seqs = [b for b in range(batch) if not sampling_params[b].is_greedy]
    if greedy_seqs:
        is_greedy = torch.tensor([p.is_greedy for p in sampling_params], device=device)  # [B]
        target_argmax = target_logits.argmax(dim=-1)  # [T]
        accept |= lay.valid & (lay.drafts == target_argmax[lay.rows]) & is_greedy.unsqueeze(1)
    s_idx = torch.tensor(sampling_seqs, device=device)  # [S] (there is one: not all greedy)
    p, p_start = _target_probs(target_logits, lay, sampling_seqs, proposal.num_draft_tokens, sampling_params)
    accept[s_idx] = _sampling_accept(p, p_start, lay, sampling_seqs, proposal, generators)
    # Accepted = the leading run of passed tests (padding positions never pass).
    num_accepted = torch.cumprod(accept.int(), dim=1).sum(dim=1)  # [B] int64
    if greedy_seqs:
        g_idx = torch.tensor(greedy_seqs, device=device)
        final[g_idx] = target_argmax[lay.start[g_idx] + num_accepted[g_idx]]
    final[s_idx] = _sampling_final(p, p_start, num_accepted, lay, sampling_seqs, proposal, generators)
    n_host = num_accepted.tolist()
    final_host = final.tolist()
    output_tokens = [lay.drafts_host[b][: n_host[b]] + [final_host[b]] for b in range(batch)]
    return VerifyResult(num_accepted.to("cpu", torch.int64), output_tokens)


def _verify_greedy(draft_token_ids: Sequence[torch.Tensor], target_logits: torch.Tensor) -> VerifyResult:
    """`verify` for an all-greedy batch, on the host: a draft is accepted while it equals the
    target's argmax, then the argmax at the first mismatch (or after the last draft) is emitted.
    The same results as the general path (the same argmax and tie-breaking, `greedy_ids`),
    without its torch argmax and tensor bookkeeping."""
    vocab = target_logits.shape[1]
    if any(not 0 <= x < vocab for t in draft_token_ids for x in t.tolist()):
        raise QuantSpecError(f"draft token ids must lie in [0, {vocab}); got out-of-range ids")
    return verify_greedy_ids(draft_token_ids, greedy_ids(target_logits))


def verify_greedy_ids(draft_token_ids: Sequence[torch.Tensor], target_ids: Sequence[int]) -> VerifyResult:
    """Greedy verification from the target's argmax ids [sum_b(1 + k_b)] (sequence 0's rows, then
    sequence 1's...) instead of its logits — e.g. a backend's exact greedy picks: each draft is
    accepted while it equals the argmax at its position, then that argmax is emitted at the first
    mismatch (or after the last draft as the bonus token).

    Example: drafts [[2, 3]], target_ids [2, 1, 0] → output_tokens [[2, 1]], num_accepted [1]."""
    drafts = [t.tolist() for t in draft_token_ids]
    if len(target_ids) != sum(len(d) + 1 for d in drafts):
        raise QuantSpecError(f"{len(target_ids)} target ids for {sum(len(d) + 1 for d in drafts)} rows")
    outputs: list[list[int]] = []
    start = 0
    for d in drafts:
        out = []
        for j, x in enumerate(d + [None]):  # None: the bonus position never matches
            out.append(int(target_ids[start + j]))
            if out[-1] != x:
                break
        outputs.append(out)
        start += len(d) + 1
    num_accepted = torch.tensor([len(o) - 1 for o in outputs], dtype=torch.int64)
    return VerifyResult(num_accepted, outputs)


def verify_proposal(
    proposal: SpecProposal,
    target_logits: torch.Tensor | None,  # [sum_b(1 + k_b), V], or None with target_ids
    sampling_params: Sequence[SamplingParams],  # B
    generators: Sequence[torch.Generator | None] | None = None,  # B
    *,
    target_ids: Sequence[int] | None = None,  # [sum_b(1 + k_b)] argmax ids, all-greedy batches
) -> VerifyResult:
    """The verifier's one entry: a `SpecProposal` against the target's logits (`verify`), or, for
    a batch whose sequences are all greedy, against the target's argmax ids at the same rows
    (`verify_greedy_ids`: e.g. a backend's exact greedy picks, no logits computed)."""
    if target_ids is not None:
        if not all(p.is_greedy for p in sampling_params):
            raise QuantSpecError("target ids verify greedy sequences only; pass the logits for sampling")
        return verify_greedy_ids(proposal.draft_token_ids, target_ids)
    if target_logits is None:
        raise QuantSpecError("verify_proposal needs the target's logits or its greedy ids")
    return verify(
        proposal.draft_token_ids, proposal.draft_probs, target_logits, sampling_params, generators
    )
