"""Model-free n-gram drafting (`speculate_method = inference_with_reference`): propose the tokens
that followed the latest earlier occurrence of the sequence's own suffix.

Pure numpy over a sequence's token ids (prompt + generated so far); no model, config or device.
`native_matchers` wraps the CPU extension's scalar twins of the two matchers (same results),
which the engine's proposer takes on a CPU base; these numpy versions are their reference.
Reference design: vLLM `v1/spec_decode/ngram_proposer.py`; the search here is our own
(candidate-narrowing over suffix lengths). `realigned_match` is the edit-tolerant fallback the
engine's `ReferenceProposer` takes where the exact match is short (right after an edit of the
text being copied).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from quantspec.errors import QuantSpecError
from quantspec.infer.spec.types import SpecProposal

__all__ = ["propose_ngram", "propose_ngram_match", "propose_ngram_batch", "realigned_match", "native_matchers",
           "NewlineRuns", "NgramProposer", "TIE_BREAK_CONTEXT", "AGREEMENT_CAP"]

TIE_BREAK_CONTEXT = 64  # tokens of context beyond max_ngram_size that choose among occurrences
AGREEMENT_CAP = 16  # `propose_ngram_match` counts agreeing context tokens up to this many

# `realigned_match`: the largest insertion / deletion it bridges on either side, the context it
# compares (per side of the gap), the score lost per skipped token, and the most recent
# occurrences of the last token it considers
REALIGN_MAX_GAP = 3
REALIGN_CONTEXT = 8
REALIGN_GAP_PENALTY = 0.5
REALIGN_CANDIDATES = 64
_GAP_OUT, _GAP_SRC = (np.array(v, dtype=np.int64) for v in zip(
    *[(go, gs) for go in range(REALIGN_MAX_GAP + 1) for gs in range(REALIGN_MAX_GAP + 1) if go or gs]))


def _check_sizes(max_ngram_size: object, max_draft_tokens: object, min_ngram_size: object) -> None:
    def is_int(x: object) -> bool:
        return isinstance(x, (int, np.integer)) and not isinstance(x, bool)

    if not is_int(min_ngram_size) or min_ngram_size < 1:
        raise QuantSpecError(f"min_ngram_size={min_ngram_size!r} must be an int >= 1")
    if not is_int(max_ngram_size) or max_ngram_size < min_ngram_size:
        raise QuantSpecError(
            f"max_ngram_size={max_ngram_size!r} must be an int >= min_ngram_size={min_ngram_size}"
        )
    if not is_int(max_draft_tokens) or max_draft_tokens < 0:
        raise QuantSpecError(f"--speculate-max-draft-token-num {max_draft_tokens!r} must be an integer >= 0")


def _as_token_array(token_ids: Sequence[int] | np.ndarray | torch.Tensor) -> np.ndarray:
    if isinstance(token_ids, torch.Tensor):
        token_ids = token_ids.detach().cpu().numpy()
    arr = np.asarray(token_ids)
    if arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
        raise QuantSpecError(
            f"token_ids must be a 1-D sequence of ints, got shape {arr.shape} dtype {arr.dtype}"
        )
    return arr.astype(np.int64, copy=False)


def _continuation(tokens: np.ndarray, end: int, cap: int) -> list[int]:
    """The up to `cap` tokens that followed position `end` (an earlier occurrence of the
    sequence's suffix), continued periodically where they run into the sequence's own end and the
    sequence already repeats itself: with p = L - 1 - end, if the last q = max(p, 2) tokens equal
    the q tokens p before them (one whole turn of a loop seen; a 1-token loop needs 3 equal
    tokens), the draft cycles through the last p tokens up to `cap` tokens; else it stops at the
    sequence's end. A repeating answer (a list of rows that differ in one field, a small model
    stuck in a loop) then gets a full draft instead of one cut to its period: [7, 1, 2, 1, 2]
    matched at end = 2 → [1, 2, 1, 2, 1] for cap = 5, where [5, 1, 2, 9, 1, 2] at end = 2 gives
    [9, 1, 2] (the last 3 tokens have not repeated)."""
    length = tokens.shape[0]
    nxt = tokens[end + 1 : end + 1 + cap]  # [≤ cap]
    p = length - 1 - end
    q = max(p, 2)
    if (nxt.shape[0] < cap and 0 < p and p + q <= length
            and np.array_equal(tokens[length - q:], tokens[length - q - p : length - p])):
        nxt = np.resize(nxt, cap)  # nxt is the last p tokens here: repeated cyclically
    return nxt.tolist()


def propose_ngram(
    token_ids: Sequence[int] | np.ndarray | torch.Tensor,  # [L] prompt + generated so far
    max_ngram_size: int,
    max_draft_tokens: int,
    min_ngram_size: int = 1,
) -> list[int]:
    """The draft of `propose_ngram_match` (see there), without the agreement length."""
    return propose_ngram_match(token_ids, max_ngram_size, max_draft_tokens, min_ngram_size)[0]


def _best_occurrence(tokens: np.ndarray, max_n: int, stop_ids: Sequence[int]) -> tuple[int, int]:
    """(n, end) of `propose_ngram_match`'s chosen occurrence of tokens' suffix: the longest match
    up to max_n tokens, the most recent among them, narrowed by the context before full-length
    matches; (0, -1) when the last token never occurred (followed by no stop id)."""
    length = tokens.shape[0]
    # `ends` = end positions e < L-1 of earlier occurrences of the length-(j+1) suffix,
    # ascending; extend the match one token further back on each pass.
    ends = np.flatnonzero(tokens[: length - 1] == tokens[length - 1])  # [C]
    if len(stop_ids):
        ends = ends[~np.isin(tokens[ends + 1], np.asarray(stop_ids, dtype=np.int64))]
    best_n, best_end = 0, -1
    for j in range(max_n):
        if j > 0:
            ends = ends[ends >= j]
            ends = ends[tokens[ends - j] == tokens[length - 1 - j]]
        if ends.size == 0:
            break
        best_n, best_end = j + 1, int(ends[-1])
    # several full-length matches: keep narrowing by the context before them
    if best_n == max_n and ends.size > 1:
        for j in range(max_n, min(max_n + TIE_BREAK_CONTEXT, length - 1)):
            ends = ends[ends >= j]
            ends = ends[tokens[ends - j] == tokens[length - 1 - j]]
            if ends.size == 0:
                break
            best_end = int(ends[-1])
            if ends.size == 1:
                break
    return best_n, best_end


def propose_ngram_match(
    token_ids: Sequence[int] | np.ndarray | torch.Tensor,  # [L] prompt + generated so far
    max_ngram_size: int,
    max_draft_tokens: int,
    min_ngram_size: int = 1,
    stop_ids: Sequence[int] = (),
) -> tuple[list[int], int]:
    """→ (draft, agreement): draft tokens by matching the sequence's suffix against its own earlier text.

    For n from max_ngram_size down to min_ngram_size, look for an earlier occurrence of the last
    n tokens (it must end before the last token; it may overlap the suffix). The first n that
    matches wins (longest first). When several occurrences match all max_ngram_size tokens, the
    one whose match runs furthest back beyond them (up to TIE_BREAK_CONTEXT more tokens) is used:
    code being re-emitted repeats short n-grams in many places ("    x = 0\n" opening two
    functions) and the longer context tells which place is being copied. Among equally long
    matches the *most recent* occurrence wins: the latest context is the best predictor of what
    comes next in generated text (a list being continued). The draft is the up to
    max_draft_tokens tokens that followed that occurrence, cut at the end of the sequence (a
    match close to the end yields fewer tokens) unless the sequence is repeating itself there,
    where the draft continues the loop (`_continuation`). [] if nothing matches, the sequence has
    fewer than 2 tokens, or max_draft_tokens is 0.

    stop_ids: occurrences followed by one of these tokens (end-of-sequence ids) are not candidates:
    a draft that starts with a stop token gains nothing (the step's own token would be it).

    agreement: how many trailing tokens of the sequence equal the tokens ending at the chosen
    occurrence (at least the matched n, counted up to AGREEMENT_CAP; 0 with an empty draft). A
    longer agreement is a better bet: the back-off (`AdaptiveDraftLength`) keeps its estimates per
    agreement class.

    Worked example (max_ngram_size=3, max_draft_tokens=3):
        token_ids = [1, 2, 3, 4, 1, 2, 3, 5, 1, 2, 3]   positions 0..10
        suffix of length 3 = [1, 2, 3]; earlier occurrences start at 0 and 4;
        most recent = 4..6 → the tokens after it are positions 7, 8, 9 → [5, 1, 2].
    With max_ngram_size=1 the suffix [3] last occurred at position 6 → also [5, 1, 2].
    Agreement at that occurrence (tokens 4..6 vs 8..10, then 3 vs 7 differs): 3.

    Cost: one vectorised comparison over L, then work proportional to the surviving candidates
    for each longer n.
    """
    _check_sizes(max_ngram_size, max_draft_tokens, min_ngram_size)
    tokens = _as_token_array(token_ids)  # [L]
    length = tokens.shape[0]
    max_n = min(int(max_ngram_size), length - 1)
    if max_draft_tokens == 0 or max_n < min_ngram_size:
        return [], 0
    best_n, best_end = _best_occurrence(tokens, max_n, stop_ids)
    if best_n < min_ngram_size:
        return [], 0
    draft = _continuation(tokens, best_end, int(max_draft_tokens))
    agreement = best_n
    while (agreement < AGREEMENT_CAP and agreement <= best_end
           and tokens[best_end - agreement] == tokens[length - 1 - agreement]):
        agreement += 1
    return draft, agreement


def _agreeing_runs(tokens: np.ndarray, at: np.ndarray, src: np.ndarray, cap: int) -> np.ndarray:
    """For each pair (at[i], src[i]) with src[i] < at[i]: how many j = 0, 1, ... (< cap) have
    tokens[at - j] == tokens[src - j] consecutively; a pair with src < 0 counts 0. Most pairs
    differ at j = 0; the rest get one [P', cap] comparison and its first mismatch (one vectorised
    pass instead of narrowing the live pairs j by j)."""
    runs = np.zeros(at.shape, dtype=np.int64)
    live = np.flatnonzero(src >= 0)
    live = live[tokens[at[live]] == tokens[src[live]]]
    if live.size:
        back = np.arange(cap)  # [cap]
        s = src[live, None] - back  # [P', cap]
        valid = s >= 0  # then at - j > s - j >= 0 too
        eq = valid & (tokens[np.where(valid, at[live, None] - back, 0)] == tokens[np.where(valid, s, 0)])
        first_miss = eq.argmin(axis=1)  # 0 where all agree
        runs[live] = np.where(eq[np.arange(live.size), first_miss], cap, first_miss)
    return runs


def realigned_match(
    token_ids: Sequence[int] | np.ndarray | torch.Tensor,  # [L] prompt + generated so far
    max_draft_tokens: int,
) -> tuple[list[int], int]:
    """→ (draft, matched): an edit-tolerant match, for when `propose_ngram_match`'s is short.

    A copy that is being edited (a renamed variable, a word inserted, a line dropped) breaks the
    exact suffix match right after the edit: the last token then matches many places (a newline,
    a space) and the most recent one is usually the wrong one. This looks past the edit: for
    each earlier occurrence e of the last token (the REALIGN_CANDIDATES most recent), `a`
    tokens agree going back from e as in the exact match; then the sequence skips `go` tokens
    (inserted by the edit) and the source `gs` tokens (replaced or dropped), 0 ≤ go, gs ≤
    REALIGN_MAX_GAP, not both 0, and `b` more tokens agree before the gap (each side compared
    over at most REALIGN_CONTEXT tokens; the source part must lie before the sequence's part).
    An occurrence scores a + its best gain over the gaps, gain = max(0, b − REALIGN_GAP_PENALTY ·
    (go + gs)) (the smallest edit that explains the most text; among equal gains the first gap in
    (go, gs) order); the best score wins, ties → the most recent occurrence. Its draft is the up
    to max_draft_tokens tokens after e (`_continuation`); matched = a + the b of its best gap (a
    alone when no gap gains). [] and 0 when the last token never occurred before.

    Example: the prompt holds "```\ndef f(x):" and the answer so far is "```python\n": the
    last token "\n" occurs after every line of the prompt, but only after "```" does the
    context agree once "python" is skipped (go = 1: "\n" + "```" + the newline before it), so
    the draft is "def f(x):" rather than what followed the prompt's last newline.
    """
    _check_sizes(1, max_draft_tokens, 1)
    tokens = _as_token_array(token_ids)  # [L]
    length = tokens.shape[0]
    if max_draft_tokens == 0 or length < 2:
        return [], 0
    ends = np.flatnonzero(tokens[: length - 1] == tokens[length - 1])[-REALIGN_CANDIDATES:]  # [C]
    if ends.size == 0:
        return [], 0
    a = _agreeing_runs(tokens, np.full(ends.size, length - 1), ends, REALIGN_CONTEXT)  # [C]
    at = (length - 1 - a)[:, None] - _GAP_OUT[None, :]  # [C, gaps]: the sequence before its gap
    src = (ends - a)[:, None] - _GAP_SRC[None, :]  # ... and the source before its gap
    src = np.where(src < at, src, -1)  # the source part lies before the sequence's part
    b = _agreeing_runs(tokens, at.ravel(), src.ravel(), REALIGN_CONTEXT).reshape(at.shape)
    gain = np.maximum(b - REALIGN_GAP_PENALTY * (_GAP_OUT + _GAP_SRC)[None, :], 0.0)  # [C, gaps]
    best_gap = gain.argmax(axis=1)  # [C]; ties → the first gap (fewest skipped sequence tokens)
    best_gain = gain[np.arange(ends.size), best_gap]
    score = a + best_gain
    i = ends.size - 1 - int(np.argmax(score[::-1]))  # the best; ties → the most recent
    e = int(ends[i])
    matched = int(a[i]) + (int(b[i, best_gap[i]]) if best_gain[i] > 0 else 0)
    return _continuation(tokens, e, int(max_draft_tokens)), matched


@dataclass(frozen=True)
class NewlineRuns:
    """The matchers' view of a sequence where the tokenizer writes a blank line as two single-
    newline tokens: each token that is a run of k ≥ 2 newlines is seen as k newline tokens.

    Byte-level BPEs with GPT-2's pre-tokenizer (SmolLM2's among them) hand the last newline before
    a word to its own piece, so a prompt's two blank lines between functions, "\\n\\n\\ndef",
    are `\\n\\n` `\\n` `def`, while an answer that keeps one blank line, as models re-emitting
    code tend to, writes `\\n` `\\n` `def`. Token by token the two never agree on the first
    newline, so a copy would break at every such boundary. In the view both are runs of single
    newlines that agree up to the shorter run, and the exact match picks the copy up again right
    after it. Drafts drawn from the view write newlines one token each: the tokenizer's own form
    for a blank line before a word (`from_tokenizer` checks it), so the form a model trained on
    its tokenization emits.

    newline_id: the single-newline token; runs: {token id: k} for the tokens that are k newlines.
    """

    newline_id: int
    runs: dict[int, int]  # {token id: k}, k >= 2

    @classmethod
    def from_tokenizer(cls, tokenizer) -> NewlineRuns | None:
        """The view for a tokenizer (a transformers tokenizer, or anything with
        `encode(text, add_special_tokens=False)`), or None where it does not apply: no single-
        newline token, a blank line between words not encoded as two of them (Llama-3's and
        Qwen2's pre-tokenizers keep "\\n\\n" whole, and their models emit it), or no longer runs."""
        if tokenizer is None:
            return None

        def enc(text: str) -> list[int]:
            return list(tokenizer.encode(text, add_special_tokens=False))

        try:
            nl = enc("\n")
            if len(nl) != 1 or enc("a\n\nb") != enc("a") + nl + nl + enc("b"):
                return None
            runs = {ids[0]: k for k in range(2, 33) if len(ids := enc("\n" * k)) == 1 and ids[0] != nl[0]}
        except Exception:  # a tokenizer without a usable encode: no view
            return None
        return cls(nl[0], runs) if runs else None

    def expand(self, token_ids: Sequence[int]) -> list[int]:
        """The view of `token_ids` (ints): every run token replaced by its k newline tokens."""
        out: list[int] = []
        for t in token_ids:
            k = self.runs.get(t)
            if k is None:
                out.append(t)
            else:
                out.extend([self.newline_id] * k)
        return out


def native_matchers(kernels) -> tuple:
    """(exact, realigned): `propose_ngram_match` and `realigned_match` from quantspec's CPU
    extension (`kernels`, from `quantspec.kernels.cpu.cpu_kernels()`), the same results from one
    scalar pass each, over the first `length` tokens of an int64 torch tensor (a buffer the caller
    keeps, so no array is wrapped per call):

        exact(tokens, length, max_ngram_size, max_draft_tokens, min_ngram_size, stop_ids) -> (draft, agreement)
        realigned(tokens, length, max_draft_tokens) -> (draft, matched)

    One call touches the token array and a few lines of code, where the numpy versions make ~25
    calls, slow right after a forward that streamed the weights through the caches. Sizes are
    not checked here."""

    def exact(tokens: torch.Tensor, length: int, max_ngram_size: int, max_draft_tokens: int,
              min_ngram_size: int = 1, stop_ids: Sequence[int] = ()) -> tuple[list[int], int]:
        return kernels.ngram_match(tokens, length, max_ngram_size, max_draft_tokens, min_ngram_size,
                                   TIE_BREAK_CONTEXT, AGREEMENT_CAP, stop_ids)

    def realigned(tokens: torch.Tensor, length: int, max_draft_tokens: int) -> tuple[list[int], int]:
        return kernels.realigned_match(tokens, length, max_draft_tokens, REALIGN_MAX_GAP, REALIGN_CONTEXT,
                                       REALIGN_GAP_PENALTY, REALIGN_CANDIDATES)

    return exact, realigned


def propose_ngram_batch(
    token_id_seqs: Sequence[Sequence[int] | np.ndarray | torch.Tensor],  # B × [L_b]
    max_ngram_size: int,
    max_draft_tokens: int | Sequence[int],
    min_ngram_size: int = 1,
) -> list[list[int]]:
    """`propose_ngram` for each of B sequences. max_draft_tokens is one int or one per sequence
    (e.g. capped by what is left of each request's max_new_tokens)."""
    if isinstance(max_draft_tokens, (int, np.integer)):
        caps = [int(max_draft_tokens)] * len(token_id_seqs)
    else:
        caps = list(max_draft_tokens)
        if len(caps) != len(token_id_seqs):
            raise QuantSpecError(
                f"max_draft_tokens has {len(caps)} entries for {len(token_id_seqs)} sequences; "
                "pass one int or one per sequence"
            )
    return [
        propose_ngram(seq, max_ngram_size, cap, min_ngram_size)
        for seq, cap in zip(token_id_seqs, caps)
    ]


@dataclass(frozen=True)
class NgramProposer:
    """The n-gram drafter behind `speculate_method = inference_with_reference`.

    max_ngram_size:   `speculate_max_ngram_size`, the longest suffix tried first.
    max_draft_tokens: `speculate_max_draft_token_num`, drafts per step.
    min_ngram_size:   the shortest suffix accepted as a match.
    """

    max_ngram_size: int = 3
    max_draft_tokens: int = 5
    min_ngram_size: int = 1

    def __post_init__(self) -> None:
        _check_sizes(self.max_ngram_size, self.max_draft_tokens, self.min_ngram_size)

    def propose(
        self,
        token_id_seqs: Sequence[Sequence[int] | np.ndarray | torch.Tensor],  # B × [L_b]
        max_draft_tokens: Sequence[int] | None = None,  # optional per-sequence caps
        device: torch.device | str = "cpu",
    ) -> SpecProposal:
        """Deterministic drafts (draft_probs None) for B sequences."""
        caps: int | list[int] = self.max_draft_tokens
        if max_draft_tokens is not None:
            caps = [min(int(c), self.max_draft_tokens) for c in max_draft_tokens]
        drafts = propose_ngram_batch(token_id_seqs, self.max_ngram_size, caps, self.min_ngram_size)
        return SpecProposal.from_token_lists(drafts, device=device)
