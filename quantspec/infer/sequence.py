"""A request inside the engine: its tokens, sampling params, KV block table and statistics, and the
rules that end it (EOS, max_new_tokens, max_length, a stop string).

KV bookkeeping: after a step, a sequence's cache holds `num_cached = len(tokens) - 1` positions
(its newest token is fed next step); during a chunked prefill it holds the chunks fed so far.
Rejected draft slots are "rolled back" simply by not counting them: the next step overwrites them.
A prefill computes the first `prefill_len` tokens: the prompt, or for a sequence the scheduler
preempted (its blocks taken back), every token it had, so that its KV is recomputed and its next
token comes from the last row, as a prompt's first token does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from quantspec.errors import QuantSpecError
from quantspec.infer.logprobs import TokenLogprob
from quantspec.infer.sampler import SamplingParams

__all__ = ["SeqStats", "Sequence", "append_tokens", "count_drafts"]


@dataclass
class SeqStats:
    t_arrival: float = 0.0
    t_scheduled: float | None = None  # first admitted into the running batch (the queue's end)
    t_first_token: float | None = None
    t_finish: float | None = None
    cached_tokens: int = 0  # prompt tokens found in the prefix cache (their prefill skipped)
    preemptions: int = 0  # times the scheduler took its KV blocks back (and recomputed them)
    target_forwards: int = 0  # forwards of the base model this sequence took part in after prefill
    drafted: int = 0
    accepted: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    drafted_per_position: list[int] = field(default_factory=list)


@dataclass
class Sequence:
    seq_id: int
    prompt_ids: list[int]
    params: SamplingParams
    generator: torch.Generator | None = None
    output_ids: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    num_cached: int = 0
    finished: bool = False
    finish_reason: str | None = None
    stats: SeqStats = field(default_factory=SeqStats)
    text_check: Callable[["Sequence"], int | None] | None = None  # stop-string hook
    # pre-norm hidden state [D] at the position that produced the newest token (kept only when the
    # proposer sets `needs_hidden`): what an MTP module combines with that token's embedding
    last_hidden: torch.Tensor | None = None
    speculate: bool = True  # False: this sequence gets no drafts (a per-request opt-out)
    guide: object | None = None  # with `params.guide`: its matcher (`infer.structured.guide_matcher`)
    # with `params.logprobs`: one per output token; with `params.prompt_logprobs`: one per prompt
    # token, None for the first (nothing predicts it)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=list)
    # with prefix caching: the hashes of the leading blocks of `block_table` that are findable
    # (`prefix_cache.block_hashes`)
    block_hashes: list[bytes] = field(default_factory=list)
    prefill_len: int = -1  # the leading tokens a prefill computes (-1: the prompt's; module docstring)
    priority: int = 0  # under the "priority" scheduling policy, lower runs first (`scheduler.py`)

    def __post_init__(self):
        if self.prefill_len < 0:
            self.prefill_len = len(self.prompt_ids)

    @property
    def prefilling(self) -> bool:
        """Its prefill is not done yet (admitted or waiting, a chunk or more of it still to run)."""
        return self.num_cached < self.prefill_len

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)


def append_tokens(seq: Sequence, toks: list[int], eos: set[int], max_length: int) -> list[int]:
    """Append `toks` to `seq` up to the first that ends it (EOS unless `ignore_eos`, a stop token,
    the end of its structured output, max_new_tokens, `max_length`, a stop string; EOS, stop
    tokens and strings only from `min_tokens` output tokens on), setting its finish reason and
    feeding its guide's matcher; → the tokens appended."""
    p = seq.params
    emitted = []
    for t in toks:
        seq.output_ids.append(t)
        emitted.append(t)
        if seq.guide is not None and not seq.guide.accept_token(t):
            raise QuantSpecError(f"token {t} broke its structured output; a masking bug")
        may_stop = len(seq.output_ids) >= p.min_tokens
        if may_stop and t in eos and not p.ignore_eos:
            seq.finished, seq.finish_reason = True, "eos"
        elif seq.guide is not None and seq.guide.is_terminated():  # the answer is whole: its stop token
            seq.finished, seq.finish_reason = True, "stop"
        elif may_stop and t in p.stop_token_ids:
            seq.finished, seq.finish_reason = True, "stop"
        elif len(seq.output_ids) >= p.max_new_tokens:
            seq.finished, seq.finish_reason = True, "length"
        elif seq.num_tokens >= max_length:
            seq.finished, seq.finish_reason = True, "max_length"
        elif may_stop and seq.text_check is not None and seq.text_check(seq) is not None:
            seq.finished, seq.finish_reason = True, "stop"
        if seq.finished:
            break
    return emitted


def count_drafts(st: SeqStats, drafted: int, accepted: int, emitted: int, depth: int | None = None) -> None:
    """Add one verification to `st`: `drafted` drafts of which `accepted` passed and `emitted` new
    tokens reached the output; a token tree counts its rows as drafted and its `depth` as positions."""
    # the drafts that count as accepted are the ones emitted: where the sequence ends inside the
    # accepted run (an EOS draft, a stop string) the verifier may have accepted drafts after it
    # that never reach the output
    accepted = min(accepted, emitted)
    st.drafted += drafted
    st.accepted += accepted
    positions = drafted if depth is None else depth
    while len(st.drafted_per_position) < positions:
        st.drafted_per_position.append(0)
        st.accepted_per_position.append(0)
    for j in range(positions):
        st.drafted_per_position[j] += 1
        st.accepted_per_position[j] += int(j < accepted)
