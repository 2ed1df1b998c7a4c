"""Tests for quantspec/infer/spec/ngram.py on literal token arrays, plus a brute-force reference
on random sequences."""

import numpy as np
import pytest
import torch

from quantspec.errors import QuantSpecError
from quantspec.infer.spec.ngram import (
    TIE_BREAK_CONTEXT,
    NgramProposer,
    propose_ngram,
    propose_ngram_batch,
)


def _follow(tokens, end, max_draft):
    """Brute force of the draft after an occurrence ending at `end`: the tokens after it, and past
    the sequence's end, while the sequence equals itself shifted by p = L - 1 - end over its last
    max(p, 2) tokens, the token p places back in the sequence extended so far."""
    tokens = list(tokens)
    length, p = len(tokens), len(tokens) - 1 - end
    draft = tokens[end + 1 : end + 1 + max_draft]
    q = max(p, 2)
    looping = p + q <= length and all(tokens[length - 1 - j] == tokens[length - 1 - p - j] for j in range(q))
    if looping:
        ext = tokens[:]
        while len(draft) < max_draft:
            ext.append(ext[len(ext) - p])
            draft.append(ext[-1])
    return draft


def _reference(tokens, max_n, max_draft, min_n=1):
    """Brute force: the earlier occurrence (ending at e < L - 1) with the longest backward match
    against the suffix, the match length capped at max_n + TIE_BREAK_CONTEXT; the latest among
    equals; none if the longest is shorter than min_n."""
    tokens = list(tokens)
    length = len(tokens)
    cap = max_n + TIE_BREAK_CONTEXT
    best_len, best_end = 0, -1
    for e in range(length - 1):
        n = 0
        while n < cap and n <= e and tokens[e - n] == tokens[length - 1 - n]:
            n += 1
        if n >= best_len and n > 0:
            best_len, best_end = n, e
    if best_len < min_n:
        return []
    return _follow(tokens, best_end, max_draft)


def test_docstring_example():
    tokens = [1, 2, 3, 4, 1, 2, 3, 5, 1, 2, 3]
    assert propose_ngram(tokens, max_ngram_size=3, max_draft_tokens=3) == [5, 1, 2]
    assert propose_ngram(tokens, max_ngram_size=1, max_draft_tokens=3) == [5, 1, 2]


def test_no_match():
    assert propose_ngram([1, 2, 3, 4, 5], 3, 4) == []
    assert propose_ngram([], 3, 4) == []
    assert propose_ngram([7], 3, 4) == []


def test_match_at_start():
    # the suffix [1, 2] occurs only at positions 0..1
    assert propose_ngram([1, 2, 9, 8, 7, 1, 2], 2, 3) == [9, 8, 7]


def test_most_recent_occurrence_wins():
    # [5] occurs at 0 and 3; the later one is followed by 7
    assert propose_ngram([5, 6, 0, 5, 7, 1, 5], 1, 1) == [7]


def test_longest_first_preference():
    # length-2 suffix [1, 2] occurs at 0 (→ 3); the more recent [2] at 5 (→ 4) only matches n=1
    tokens = [1, 2, 3, 0, 9, 2, 4, 1, 2]
    assert propose_ngram(tokens, 2, 1) == [3]
    # max_ngram_size 1: both [2]s match; the one at 1 also matches the [1] before it (context)
    assert propose_ngram(tokens, 1, 1) == [3]
    tokens[0] = 8  # now neither has more context: the most recent wins
    assert propose_ngram(tokens, 1, 1) == [4]


def test_longer_context_chooses_among_full_length_matches():
    # [4, 5] (max_ngram_size 2) occurs at 1..2 (→ 6) and 8..9 (→ 7); the suffix [1, 3, 4, 5]
    # also matches two tokens further back at the first one, so it wins over the more recent
    tokens = [1, 3, 4, 5, 6, 0, 9, 4, 5, 7, 0, 1, 3, 4, 5]
    assert propose_ngram(tokens, 2, 1) == [6]
    # with no extra context on either side the most recent full match wins
    assert propose_ngram([2, 4, 5, 6, 0, 8, 4, 5, 7, 0, 9, 4, 5], 2, 1) == [7]
    # the extra context is capped: beyond TIE_BREAK_CONTEXT tokens the most recent wins again
    shared = list(range(100, 100 + TIE_BREAK_CONTEXT))
    tokens = [1] + shared + [4, 5, 6] + [2] + shared + [4, 5, 7] + [3] + shared + [4, 5]
    assert propose_ngram(tokens, 2, 1) == [7]
    tokens[0] = 3  # the first occurrence now matches one token further back, past the cap
    assert propose_ngram(tokens, 2, 1) == [7]
    assert _reference(tokens, 2, 1) == [7]


def test_overlapping_occurrence_truncation_and_loops_at_end():
    # the most recent earlier occurrence of [1, 2] is positions 2..3, close to the end: only 2
    # tokens follow it, and the sequence has not repeated them → the draft stops there
    assert propose_ngram([5, 1, 2, 9, 1, 2], 2, 5) == [9, 1, 2]
    assert propose_ngram([1, 2, 3, 1, 2], 2, 5) == [3, 1, 2]
    # periodic [1, 2] * 3: the sequence repeats its last 2 tokens → the draft continues the loop
    assert propose_ngram([1, 2, 1, 2, 1, 2], 2, 5) == [1, 2, 1, 2, 1]
    assert propose_ngram([8, 1, 2, 3, 1, 2, 3], 3, 7) == [1, 2, 3, 1, 2, 3, 1]
    # a loop seen once is enough; a 1-token loop needs three equal tokens
    assert propose_ngram([7, 7, 7, 7], 3, 5) == [7, 7, 7, 7, 7]
    assert propose_ngram([4, 7, 7, 7], 3, 3) == [7, 7, 7]
    assert propose_ngram([4, 7, 7], 3, 3) == [7]
    # the continuation never passes the cap
    assert propose_ngram([1, 2, 1, 2], 2, 0) == [] and propose_ngram([1, 2, 1, 2], 2, 1) == [1]


def test_loop_continuation_of_the_realigned_match():
    from quantspec.infer.spec.ngram import realigned_match

    # "a b X a b X" continues the loop "a b X" however the match was found
    assert realigned_match([1, 2, 9, 1, 2, 9], 5) == ([1, 2, 9, 1, 2], 3)
    assert realigned_match([1, 2, 9, 1, 2, 9], 5) == _realign_reference([1, 2, 9, 1, 2, 9], 5)


def test_max_draft_cap_and_min_ngram_size():
    tokens = [1, 2, 3, 4, 5, 6, 1, 2]
    assert propose_ngram(tokens, 2, 2) == [3, 4]
    assert propose_ngram(tokens, 2, 10) == [3, 4, 5, 6, 1, 2]
    assert propose_ngram(tokens, 2, 0) == []
    # only a 1-gram matches here; min_ngram_size=2 refuses it
    assert propose_ngram([4, 9, 1, 3, 1], 3, 2) == [3, 1]
    assert propose_ngram([4, 9, 1, 3, 1], 3, 2, min_ngram_size=2) == []


def test_accepts_numpy_and_torch_inputs():
    tokens = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 1, 4]
    expect = propose_ngram(tokens, 3, 4)
    assert expect == [1, 5, 9, 2]
    assert propose_ngram(np.array(tokens, dtype=np.int32), 3, 4) == expect
    assert propose_ngram(torch.tensor(tokens), 3, 4) == expect


@pytest.mark.parametrize("seed", range(4))
def test_matches_brute_force_on_random_sequences(seed):
    rng = np.random.default_rng(seed)
    for _ in range(150):
        length = int(rng.integers(0, 40))
        tokens = rng.integers(0, 4, size=length).tolist()  # small vocab → many matches
        max_n = int(rng.integers(1, 5))
        min_n = int(rng.integers(1, max_n + 1))
        max_draft = int(rng.integers(0, 6))
        got = propose_ngram(tokens, max_n, max_draft, min_n)
        assert got == _reference(tokens, max_n, max_draft, min_n), (tokens, max_n, min_n)


def test_batch_and_per_sequence_caps():
    seqs = [[1, 2, 3, 1, 2], [5, 6, 7], [9, 9, 9, 9]]
    assert propose_ngram_batch(seqs, 2, 3) == [[3, 1, 2], [], [9, 9, 9]]
    assert propose_ngram_batch(seqs, 2, [1, 3, 0]) == [[3], [], []]
    with pytest.raises(QuantSpecError, match="max_draft_tokens"):
        propose_ngram_batch(seqs, 2, [1, 2])


def test_proposer_returns_deterministic_proposal():
    proposer = NgramProposer(max_ngram_size=2, max_draft_tokens=2)
    proposal = proposer.propose([[1, 2, 3, 1, 2], [5, 6]], max_draft_tokens=[5, 0])
    assert proposal.draft_probs is None
    assert [t.tolist() for t in proposal.draft_token_ids] == [[3, 1], []]
    assert all(t.dtype == torch.int64 for t in proposal.draft_token_ids)


@pytest.mark.parametrize(
    "args, field",
    [
        ((0, 3, 1), "max_ngram_size"),
        ((2, 3, 3), "max_ngram_size"),
        ((2, -1, 1), "--speculate-max-draft-token-num"),
        ((2, 3, 0), "min_ngram_size"),
    ],
)
def test_rejects_bad_sizes(args, field):
    max_n, max_draft, min_n = args
    with pytest.raises(QuantSpecError, match=field):
        propose_ngram([1, 2, 1], max_n, max_draft, min_n)
    with pytest.raises(QuantSpecError, match=field):
        NgramProposer(max_n, max_draft, min_n)


def test_rejects_non_integer_tokens():
    with pytest.raises(QuantSpecError, match="token_ids"):
        propose_ngram([[1, 2], [3, 4]], 2, 2)
    with pytest.raises(QuantSpecError, match="token_ids"):
        propose_ngram([1.5, 2.0], 2, 2)


def test_long_sequence_finds_distant_match():
    # a decode-step-sized input: 4k tokens of a 50-token vocabulary (many 1-gram candidates)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 50, size=4096)
    tokens[-4:] = tokens[100:104]  # plant a 4-gram match far back
    got = propose_ngram(tokens, 4, 5)
    assert got == _reference(tokens.tolist(), 4, 5)


@pytest.mark.parametrize(
    "tokens, max_n, expect",
    [
        ([1, 2, 3, 4, 1, 2, 3, 5, 1, 2, 3], 3, ([5, 1, 2], 3)),  # the docstring example
        ([1, 2, 3, 4, 1, 2, 3, 5, 1, 2, 3], 1, ([5, 1, 2], 3)),  # agreement is counted past max_n
        ([1, 2, 1, 2, 1, 2], 3, ([1, 2, 1], 4)),  # overlapping occurrence: agrees back to position 0
        ([7, 1, 2, 8, 2], 3, ([8, 2], 1)),  # 1-token match
        ([5, 6], 3, ([], 0)),  # nothing matches
        (list(range(20)) * 2, 2, ([0, 1, 2], 16)),  # capped at AGREEMENT_CAP
    ],
)
def test_match_agreement_length(tokens, max_n, expect):
    from quantspec.infer.spec.ngram import AGREEMENT_CAP, propose_ngram_match

    assert AGREEMENT_CAP == 16
    got = propose_ngram_match(tokens, max_n, 3)
    assert got == expect
    assert got[0] == propose_ngram(tokens, max_n, 3)


# -- realigned_match: an edit-tolerant match past an insertion / deletion / substitution ----------


def _realign_reference(tokens, max_draft):
    """Brute force of `realigned_match`'s docstring, loop by loop."""
    from quantspec.infer.spec.ngram import (REALIGN_CANDIDATES, REALIGN_CONTEXT, REALIGN_GAP_PENALTY,
                                            REALIGN_MAX_GAP)

    tokens = list(tokens)
    length = len(tokens)
    if max_draft == 0 or length < 2:
        return [], 0
    ends = [e for e in range(length - 1) if tokens[e] == tokens[-1]][-REALIGN_CANDIDATES:]
    best = None  # (score, e, matched)
    for e in ends:
        a = 0
        while a < REALIGN_CONTEXT and e - a >= 0 and tokens[e - a] == tokens[length - 1 - a]:
            a += 1
        gain, b_used = 0.0, 0
        for go in range(REALIGN_MAX_GAP + 1):
            for gs in range(REALIGN_MAX_GAP + 1):
                if go == gs == 0:
                    continue
                q, r = length - 1 - a - go, e - a - gs
                if r < 0 or r >= q:
                    continue
                b = 0
                while b < REALIGN_CONTEXT and r - b >= 0 and tokens[q - b] == tokens[r - b]:
                    b += 1
                g = b - REALIGN_GAP_PENALTY * (go + gs)
                if g > gain:
                    gain, b_used = g, b
        if best is None or a + gain >= best[0]:
            best = (a + gain, e, a + b_used)
    if best is None:
        return [], 0
    return _follow(tokens, best[1], max_draft), best[2]


# the prompt "A\n```\ndef f(x)\nreturn x\n```B" as ids (A=10, B=11, newline=1, fence=7, def=2,
# f=3, x=4, return=5); the answer so far "\n```python\n" (python=6)
_FENCE_PROMPT = [10, 1, 7, 1, 2, 3, 4, 1, 5, 4, 1, 7, 11]
_FENCE_ANSWER = [1, 7, 6, 1]


@pytest.mark.parametrize(
    "tokens, exact, realigned",
    [
        # an inserted token ("python" after the fence): the exact 1-token match takes the latest
        # newline; realigned, the newline after the prompt's opening fence (skip 1 token)
        (_FENCE_PROMPT + _FENCE_ANSWER, ([7, 6, 1], 1), ([2, 3, 4, 1, 5], 3)),
        # a substituted token ("a b X d" against "a b c d"; "d" occurs again later, before "i")
        ([1, 2, 3, 4, 5, 0, 6, 7, 8, 4, 9] + [1, 2, 99, 4], ([9, 1, 2, 99, 4], 1), ([5, 0, 6, 7, 8], 3)),
        # a deleted token ("p q s" against "p q r s"; "s" occurs again later, before "w")
        ([1, 2, 3, 4, 5, 6, 0, 7, 4, 8] + [1, 2, 4], ([8, 1, 2, 4], 1), ([5, 6, 0, 7, 4], 3)),
    ],
)
def test_realigned_match_looks_past_an_edit(tokens, exact, realigned):
    from quantspec.infer.spec.ngram import propose_ngram_match, realigned_match

    assert propose_ngram_match(tokens, 3, 5) == exact
    assert realigned_match(tokens, 5) == realigned
    assert realigned_match(np.array(tokens), 5) == realigned == _realign_reference(tokens, 5)


@pytest.mark.parametrize("tokens, k", [([], 3), ([4], 3), ([4, 5], 3), ([1, 2, 3], 0), ([5, 1, 2, 5], 2)])
def test_realigned_match_edges(tokens, k):
    from quantspec.infer.spec.ngram import realigned_match

    got = realigned_match(tokens, k)
    assert got == _realign_reference(tokens, k)
    if tokens == [5, 1, 2, 5]:
        assert got == ([1, 2], 1)  # no gap gains: the plain 1-token agreement
    else:
        assert got == ([], 0)


def test_realigned_match_refuses_a_bad_count():
    from quantspec.infer.spec.ngram import realigned_match

    for bad in (-1, 2.0, True):
        with pytest.raises(QuantSpecError, match="--speculate-max-draft-token-num"):
            realigned_match([1, 2, 1], bad)


@pytest.mark.parametrize("vocab, length", [(3, 30), (5, 60), (8, 120), (2, 200)])
def test_realigned_match_matches_brute_force(vocab, length):
    """Random sequences over small vocabularies (many partial matches, ties, and for vocab 2 more
    than REALIGN_CANDIDATES occurrences), every prefix."""
    from quantspec.infer.spec.ngram import realigned_match

    rng = np.random.default_rng(vocab * 1000 + length)
    for trial in range(4):
        seq = rng.integers(0, vocab, size=length).tolist()
        for n in range(1, length + 1):
            k = int(rng.integers(0, 7))
            assert realigned_match(seq[:n], k) == _realign_reference(seq[:n], k), (trial, n, k)


# -- the CPU extension's scalar matchers: the numpy versions' results ----------------------------


@pytest.mark.parametrize("vocab, length", [(2, 150), (3, 60), (6, 120), (50, 300)])
def test_native_matchers_equal_the_numpy_ones(vocab, length):
    """Every prefix of random sequences (small vocabularies: many partial matches, ties, more
    than REALIGN_CANDIDATES occurrences; plus a periodic stretch for the loop continuation), with
    varied sizes: `native_matchers` gives exactly `propose_ngram_match` / `realigned_match`."""
    from quantspec.infer.spec.ngram import native_matchers, propose_ngram_match, realigned_match
    from quantspec.kernels.cpu import cpu_kernels

    kernels = cpu_kernels()
    if kernels is None:
        pytest.skip("quantspec's CPU kernels are not built here")
    exact, realigned = native_matchers(kernels)
    rng = np.random.default_rng(vocab * 7 + length)
    seq = rng.integers(0, vocab, size=length)
    seq[length // 2: length // 2 + 12] = np.tile(seq[:3], 4)  # a loop the drafts may continue
    for n in range(1, length + 1):
        tokens = np.ascontiguousarray(seq[:n], dtype=np.int64)
        cap = int(rng.integers(0, 12))
        max_n, min_n = int(rng.integers(1, 5)), int(rng.integers(1, 3))
        buffer = torch.from_numpy(np.concatenate([tokens, rng.integers(0, vocab, 5)]))  # read up to n only
        if min_n <= max_n:
            want = propose_ngram_match(tokens, max_n, cap, min_n)
            assert exact(buffer, n, max_n, cap, min_n) == want, (n, max_n, cap)
            stop = tuple(int(t) for t in rng.choice(vocab, size=int(rng.integers(1, 3)), replace=False))
            want = propose_ngram_match(tokens, max_n, cap, min_n, stop)
            assert exact(buffer, n, max_n, cap, min_n, stop) == want, (n, max_n, cap, stop)
        assert realigned(buffer, n, cap) == realigned_match(tokens, cap), (n, cap)


def test_the_proposer_takes_the_native_matchers_on_a_cpu_base(monkeypatch):
    """`build_proposer` hands a CPU base's n-gram proposer the extension's matchers (its runtime's
    `ngram`); its drafts over a copy-with-edits sequence are those of the numpy matchers step by
    step."""
    from types import SimpleNamespace

    from quantspec.infer.spec import proposers
    from quantspec.kernels.cpu import cpu_kernels

    if cpu_kernels() is None:
        pytest.skip("quantspec's CPU kernels are not built here")
    loaded = SimpleNamespace(model=torch.nn.Module(), eos_token_ids=[3], tokenizer=None)
    loaded.model.model = SimpleNamespace(norm=SimpleNamespace(weight=torch.zeros(1)))
    config = SimpleNamespace(speculate_method="inference_with_reference", speculate_max_draft_token_num=10,
                             speculate_max_ngram_size=3, draft_model=None, speculate_backoff=False)
    native, _ = proposers.build_proposer(config, loaded)
    assert native._native is not None and native.stop_ids == (3,)
    ref = proposers.ReferenceProposer(3, 10, stop_ids=[3])
    rng = np.random.default_rng(1)
    prompt = rng.integers(0, 40, 200)
    # an edit, a copy, new tokens inserted (the match of what came before them), another copy
    answer = np.concatenate([prompt[:60], [7, 7], prompt[63:150], [90, 91], prompt[150:160], [92], prompt[10:30]])
    seq = SimpleNamespace(seq_id=0, prompt_ids=prompt.tolist(), output_ids=[], stats=None)
    for n in range(len(answer)):
        seq.output_ids = answer[:n].tolist()
        tokens = np.concatenate([prompt, answer[:n]]).astype(np.int64)
        got, want = native.propose([seq], [10]), ref.propose([seq], [10])
        assert got.token_lists() == want.token_lists() == [ref.match(tokens, 10)[0]]
        assert got.draft_probs is None and want.draft_probs is None
        assert native.match(tokens, 10) == ref.match(tokens, 10)


# -- stop tokens, an inserted new token, the newline view ----------------------------------------


def test_an_occurrence_followed_by_a_stop_token_is_no_candidate():
    from quantspec.infer.spec.ngram import propose_ngram_match

    tokens = [7, 1, 9, 2, 7, 1, 3, 4, 7, 1]  # [7, 1] occurs at 0-1 (then 9) and 4-5 (then 3)
    assert propose_ngram_match(tokens, 2, 3) == ([3, 4, 7], 2)  # the most recent
    assert propose_ngram_match(tokens, 2, 3, stop_ids=(3,)) == ([9, 2, 7], 2)
    assert propose_ngram_match(tokens, 2, 3, stop_ids=(3, 9)) == ([], 0)  # no candidate left
    assert propose_ngram_match(tokens, 2, 3, stop_ids=(5,)) == ([3, 4, 7], 2)  # not in the sequence


def _ref_seq(prompt, output, _ids=iter(range(1 << 30))):
    """A new sequence (its own id: a proposer keeps each id's tokens and only appends to them)."""
    from types import SimpleNamespace

    return SimpleNamespace(seq_id=next(_ids), prompt_ids=list(prompt), output_ids=list(output), stats=None)


@pytest.mark.parametrize("native", [False, True])
def test_the_proposer_stops_drafts_at_a_stop_token_and_matches_past_a_new_token(native):
    """An answer opens its copy of a fenced block with a word the prompt does not have (```python
    for ```): the match of the tokens before it is the opening fence, not the closing one, whose
    continuation is the end of the turn; a draft that reaches a stop token ends before it."""
    from quantspec.infer.spec.proposers import ReferenceProposer
    from quantspec.kernels.cpu import cpu_kernels

    from quantspec.infer.spec.ngram import native_matchers

    kernels = cpu_kernels() if native else None
    if native and kernels is None:
        pytest.skip("quantspec's CPU kernels are not built here")
    matchers = native_matchers(kernels) if native else None
    EOS, NL, FENCE, PY = 2, 8, 50, 77
    prompt = [30, 31, NL, FENCE, NL, 60, 61, 62, NL, 63, NL, FENCE, EOS, 1, 40, NL]
    ref = ReferenceProposer(3, 5, stop_ids=[EOS], matchers=matchers)
    assert ref.propose([_ref_seq(prompt, [FENCE, PY])], [5]).token_lists() == [[NL, 60, 61, 62, NL]]
    # without stop ids the closing fence (the most recent) wins, and the draft is the turn's end
    bare = ReferenceProposer(3, 5, matchers=matchers)
    assert bare.propose([_ref_seq(prompt, [FENCE, PY])], [5]).token_lists() == [[EOS, 1, 40, NL, FENCE]]
    # a draft is cut before the stop token: [63, NL, FENCE] and not the EOS after it
    assert ref.propose([_ref_seq(prompt, [FENCE, NL, 60, 61, 62, NL, 63])], [5]).token_lists() == [[NL, FENCE]]
    assert bare.propose([_ref_seq(prompt, [FENCE, NL, 60, 61, 62, NL, 63])], [5]).token_lists() == [[NL, FENCE, EOS, 1, 40]]
    # one agreeing token before the new one is too weak (INSERTION_MIN = 2): nothing
    assert ref.propose([_ref_seq(prompt, [45, 61, PY])], [5]).token_lists() == [[]]


def _byte_bpe(newline_pieces: bool):
    """A byte-level BPE with newline-run tokens: GPT-2's pre-tokenizer (a blank line before a word
    is two single newlines, as in SmolLM2's) or one that keeps newline runs whole (as Llama-3's
    and Qwen2's do)."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(alphabet)}
    vocab.update({"ĊĊ": len(vocab), "ĊĊĊ": len(vocab) + 1})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[("Ċ", "Ċ"), ("ĊĊ", "Ċ")]))
    if newline_pieces:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(r"\n+"), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    return PreTrainedTokenizerFast(tokenizer_object=tok), vocab


def test_newline_runs_from_the_tokenizer():
    from quantspec.infer.spec.ngram import NewlineRuns

    tok, vocab = _byte_bpe(True)
    nl = vocab["Ċ"]
    assert tok.encode("a\n\nb") == [vocab["a"], nl, nl, vocab["b"]]
    assert tok.encode("x\n\n\ny") == [vocab["x"], vocab["ĊĊ"], nl, vocab["y"]]  # a prompt's two blank lines
    view = NewlineRuns.from_tokenizer(tok)
    assert view == NewlineRuns(nl, {vocab["ĊĊ"]: 2, vocab["ĊĊĊ"]: 3})
    assert view.expand([5, vocab["ĊĊ"], nl, 6, vocab["ĊĊĊ"]]) == [5, nl, nl, nl, 6, nl, nl, nl]
    assert view.expand([]) == []
    whole, vocab2 = _byte_bpe(False)
    assert whole.encode("a\n\nb") == [vocab2["a"], vocab2["ĊĊ"], vocab2["b"]]
    assert NewlineRuns.from_tokenizer(whole) is None  # its models emit the runs themselves
    assert NewlineRuns.from_tokenizer(None) is None
    assert NewlineRuns.from_tokenizer(object()) is None  # no encode


@pytest.mark.parametrize("native", [False, True])
def test_the_newline_view_picks_the_copy_up_after_a_dropped_blank_line(native):
    """The prompt separates two functions by two blank lines (`\\n\\n` `\\n`), the answer by one
    (`\\n` `\\n`): with the view the draft after the answer's first newline is the second one and
    the next function; token by token it is not. The buffer holds the view of every token."""
    from quantspec.infer.spec.ngram import NewlineRuns
    from quantspec.infer.spec.proposers import ReferenceProposer, _TokenBuffer
    from quantspec.kernels.cpu import cpu_kernels

    from quantspec.infer.spec.ngram import native_matchers

    kernels = cpu_kernels() if native else None
    if native and kernels is None:
        pytest.skip("quantspec's CPU kernels are not built here")
    matchers = native_matchers(kernels) if native else None
    NL, NN = 8, 100
    view = NewlineRuns(NL, {NN: 2})
    f1 = [20, 21, 22, 23, 24]  # "    return x"
    f2 = [30, 31, 32, 33]  # "def g(y):"
    prompt = [40, 41, NL] + f1 + [NN, NL] + f2 + [NL, 42, 43]
    out = [40, 41, NL] + f1 + [NL]
    flat = ReferenceProposer(3, 4, matchers=matchers)
    seen = ReferenceProposer(3, 4, matchers=matchers, newline_runs=view)
    # the view drafts the prompt's three newlines: the first is right, and the step's own token
    # (the function) puts the answer back on the copy; token by token no newline follows f1's end
    assert seen.propose([_ref_seq(prompt, out)], [4]).token_lists() == [[NL, NL, 30, 31]]
    assert flat.propose([_ref_seq(prompt, out)], [4]).token_lists()[0][:1] != [NL]
    assert seen.propose([_ref_seq(prompt, out + [NL, 30])], [4]).token_lists() == [[31, 32, 33, NL]]

    def forwards(proposer, answer):  # greedy steps to produce `answer` after its first token
        seq, n, steps = _ref_seq(prompt, answer[:1]), 1, 0
        while n < len(answer):
            draft = proposer.propose([seq], [4]).token_lists()[0]
            a = 0
            while a < len(draft) and n + a < len(answer) and draft[a] == answer[n + a]:
                a += 1
            n, steps = n + a + 1, steps + 1
            seq.output_ids = answer[:n]
        return steps

    answer = out + [NL] + f2 + [NL, 42, 43]
    assert forwards(seen, answer) < forwards(flat, answer)

    # the buffer: the view of the prompt, then of the output as it grows (by 0, 1 or more tokens
    # a step, past the initial capacity)
    long_prompt = (prompt * 20)[:300]
    outs = [NN, 5, NN, NL, NN, 6, 7, NN, NN] * 30
    buf, seq = _TokenBuffer(view), _ref_seq(long_prompt, [])
    for n in [0, 0, 1, 2, 5, 6, 6, 9, 40, 41, 200, 270]:
        seq.output_ids = outs[:n]
        want = view.expand(long_prompt + outs[:n])
        assert buf.sync(seq).tolist() == want and buf.tensor[: buf.size].tolist() == want
    plain = _TokenBuffer()
    assert plain.sync(seq).tolist() == long_prompt + outs[:270]
