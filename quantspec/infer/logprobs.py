"""Token log-probabilities: what a request that asks for `logprobs` / `prompt_logprobs` gets back
for each token.

A token's log-probability is the log-softmax of the model's raw logits at the row that predicted
it (before penalties, biases, temperature and the filters: the model's own distribution, as vLLM
reports by default), with the token's rank among all tokens (1: the most likely) and the `n` most
likely tokens of that row. The rows come from the forward that scored the token: speculation
changes which forward that is, not the numbers' meaning. -inf is reported as `LOGPROB_FLOOR`, which JSON
can carry.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["LOGPROB_FLOOR", "TokenLogprob", "score_new_tokens", "score_prompt_rows", "token_logprobs"]

LOGPROB_FLOOR = -9999.0
ROWS_PER_CHUNK = 256  # rows of logits turned into log-probabilities at a time (a long prompt's [P, V])


@dataclass(frozen=True)
class TokenLogprob:
    """One token's log-probability, its rank (1: the most likely) and the row's `top`: (token id,
    log-probability) of its n most likely tokens, most likely first."""

    token_id: int
    logprob: float
    rank: int
    top: tuple[tuple[int, float], ...] = ()


def token_logprobs(logits: torch.Tensor, token_ids: list[int], n: int) -> list[TokenLogprob]:
    """logits [R, V] (any float dtype) and the token each row predicted → one `TokenLogprob` per
    row, with the row's n most likely tokens (n = 0: none)."""
    if len(token_ids) != logits.shape[0]:
        raise ValueError(f"token_logprobs: {logits.shape[0]} rows of logits for {len(token_ids)} tokens")
    out: list[TokenLogprob] = []
    for start in range(0, len(token_ids), ROWS_PER_CHUNK):
        lp = torch.log_softmax(logits[start:start + ROWS_PER_CHUNK].float(), dim=-1)  # [r, V]
        ids = torch.tensor(token_ids[start:start + ROWS_PER_CHUNK], dtype=torch.int64, device=lp.device)
        chosen = lp.gather(1, ids[:, None])  # [r, 1]
        rank = ((lp > chosen).sum(dim=-1) + 1).tolist()
        chosen = chosen.clamp_min(LOGPROB_FLOOR).squeeze(1).tolist()
        if n:
            top_lp, top_ids = lp.topk(min(n, lp.shape[1]), dim=-1)
            tops = [tuple(zip(i, v)) for i, v in zip(top_ids.tolist(), top_lp.clamp_min(LOGPROB_FLOOR).tolist())]
        else:
            tops = [()] * len(chosen)
        out.extend(TokenLogprob(t, c, r, top) for t, c, r, top in zip(ids.tolist(), chosen, rank, tops))
    return out


def score_prompt_rows(model, prompt_rows: list[tuple[object, list[int]]], hidden: torch.Tensor,
                      at: dict[int, int]) -> None:
    """A prefill step's part (the engine's `_forward`): each prefilling sequence that asks for
    `prompt_logprobs` gets the log-probabilities of the prompt tokens its chunk's rows predict
    (`prompt_rows`: (sequence, its rows counted in the fed batch); `hidden[at[r]]`: row r's
    output before the final norm), after a None for the first prompt token."""
    for seq, rs in prompt_rows:
        start = seq.num_cached
        if start == 0:
            seq.prompt_logprobs.append(None)
        if rs:
            logits = model.compute_logits(hidden[torch.tensor([at[r] for r in rs], device=hidden.device)])
            seq.prompt_logprobs.extend(token_logprobs(logits, seq.prompt_ids[start + 1:start + 1 + len(rs)],
                                                      seq.params.prompt_logprobs))


def score_new_tokens(model, wants: list[tuple[object, list[int], list[int]]], scored: torch.Tensor,
                     logits: torch.Tensor | None) -> None:
    """A step's part (the engine's `_record`): each sequence of `wants` (sequence, the scored rows
    that predicted its new tokens, the tokens) gets their log-probabilities appended to its
    `logprobs`, from the step's raw `logits` of the scored rows, or (a greedy batch picks its ids
    without logits) from one `compute_logits` over those rows of `scored`."""
    idx = torch.tensor([r for _, rs, _ in wants for r in rs], device=scored.device)
    lg = logits[idx.to(logits.device)] if logits is not None else model.compute_logits(scored[idx])
    at = 0
    for seq, rs, toks in wants:
        seq.logprobs.extend(token_logprobs(lg[at:at + len(rs)], toks, seq.params.logprobs))
        at += len(rs)
