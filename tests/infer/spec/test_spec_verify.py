"""Tests for quantspec/infer/spec/verify.py: greedy acceptance on literal logits, the sampling
path's edge cases, batch invariance, and chi-square tests that rejection sampling is lossless
(the emitted token at each position is distributed as the target), each paired with a wrong rule
that the same test must reject."""

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from quantspec.errors import QuantSpecError
from quantspec.infer.sampler import SamplingParams, generator_for_request, logits_to_probs
from quantspec.infer.spec.types import SpecProposal
from quantspec.infer.spec.verify import verify, verify_proposal

V = 6
GREEDY = SamplingParams()
SAMPLING = SamplingParams(decode_strategy="sampling", temperature=1.0)


def _argmax_logits(argmaxes, vocab=V):
    """[len(argmaxes), vocab] logits whose row-wise argmax is `argmaxes`."""
    logits = torch.randn(len(argmaxes), vocab, generator=torch.Generator().manual_seed(0))
    logits[torch.arange(len(argmaxes)), torch.tensor(argmaxes)] = 10.0
    return logits


def _ids(*tokens):
    return torch.tensor(tokens, dtype=torch.int64)


# --- greedy ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "drafts, expect_n, expect_out",
    [
        ([3, 3], 0, [1]),  # none accepted: recovered = argmax at position 0
        ([3, 2], 0, [1]),  # a later match after a mismatch does not count
        ([1, 3], 1, [1, 2]),  # some accepted: recovered = argmax at position 1
        ([1, 2], 2, [1, 2, 0]),  # all accepted: bonus = argmax at position 2
    ],
)
def test_greedy_single_sequence(drafts, expect_n, expect_out):
    result = verify([_ids(*drafts)], None, _argmax_logits([1, 2, 0]), [GREEDY])
    assert result.num_accepted.tolist() == [expect_n]
    assert result.output_tokens == [expect_out]


def test_greedy_mixed_k_including_zero():
    # k = [2, 0, 3, 1]; rows: seq0 0..2, seq1 3, seq2 4..7, seq3 8..9
    argmaxes = [4, 5, 1] + [2] + [0, 1, 2, 3] + [5, 4]
    drafts = [_ids(4, 5), _ids(), _ids(0, 1, 5), _ids(2)]
    result = verify(drafts, None, _argmax_logits(argmaxes), [GREEDY] * 4)
    assert result.num_accepted.tolist() == [2, 0, 2, 0]
    assert result.output_tokens == [[4, 5, 1], [2], [0, 1, 2], [5]]
    assert result.num_accepted.dtype == torch.int64


def test_greedy_all_k_zero_is_plain_decoding():
    result = verify([_ids(), _ids()], None, _argmax_logits([3, 0]), [GREEDY, GREEDY])
    assert result.num_accepted.tolist() == [0, 0]
    assert result.output_tokens == [[3], [0]]


def test_greedy_ignores_draft_probs_and_proposal_wrapper():
    q = torch.full((2, V), 1.0 / V)
    proposal = SpecProposal([_ids(1, 3)], [q])
    result = verify_proposal(proposal, _argmax_logits([1, 2, 0]), [GREEDY])
    assert result.output_tokens == [[1, 2]]


@pytest.mark.parametrize("seed", range(5))
def test_greedy_host_path_equals_the_general_path(seed):
    """An all-greedy batch takes the host path (`_verify_greedy`, numpy's argmax); a greedy
    sequence beside a sampling one takes the general tensor path (torch's argmax). Same answers,
    ties included (the logits are rounded so rows hold repeated maxima)."""
    g = torch.Generator().manual_seed(seed)
    vocab, ks = 7, [4, 0, 3, 6]
    logits = [torch.randn(k + 1, vocab, generator=g).mul(2).round() for k in ks]  # ties likely
    drafts = []
    for lg, k in zip(logits, ks):  # drafts follow the argmax for a random number of positions
        d = lg.argmax(dim=-1)[:k].clone()
        cut = int(torch.randint(0, k + 1, (1,), generator=g))
        if cut < k:
            d[cut] = (d[cut] + 1) % vocab
        drafts.append(d)
    sampler_rows = _argmax_logits([0, 1], vocab)
    for b in range(len(ks)):
        alone = verify([drafts[b]], None, logits[b], [GREEDY])
        general = verify([drafts[b], _ids(0)], None, torch.cat([logits[b], sampler_rows]), [GREEDY, SAMPLING],
                         [None, torch.Generator().manual_seed(1)])
        assert alone.output_tokens[0] == general.output_tokens[0]
        assert alone.num_accepted.tolist()[0] == general.num_accepted.tolist()[0]
    batch = verify(drafts, None, torch.cat(logits), [GREEDY] * len(ks))
    for b in range(len(ks)):
        assert batch.output_tokens[b] == verify([drafts[b]], None, logits[b], [GREEDY]).output_tokens[0]


# --- sampling: deterministic edge cases ------------------------------------------------------


def test_sampling_certain_accept_and_certain_reject():
    # top_k=1 makes p one-hot at the argmax: a matching draft is accepted with probability 1,
    # a different one rejected with probability 1 and the recovered token is the argmax.
    params = SamplingParams(decode_strategy="sampling", temperature=0.8, top_k=1)
    logits = _argmax_logits([2, 4, 1] + [5, 0])
    for seed in range(5):
        gens = [generator_for_request(seed, 0), generator_for_request(seed, 1)]
        result = verify([_ids(2, 4), _ids(3)], None, logits, [params, params], gens)
        assert result.output_tokens == [[2, 4, 1], [5]]


def test_sampling_rejects_draft_outside_target_support_with_draft_probs():
    # the target puts all mass on token 0 (top_k=1); the drafter sampled token 3 from q
    params = SamplingParams(decode_strategy="sampling", top_k=1)
    q = torch.tensor([[0.1, 0.1, 0.1, 0.5, 0.1, 0.1]])
    result = verify([_ids(3)], [q], _argmax_logits([0, 2]), [params])
    assert result.num_accepted.tolist() == [0] and result.output_tokens == [[0]]


def test_sampling_is_batch_invariant_and_reproducible():
    torch.manual_seed(0)
    logits = torch.randn(3, 50)  # the sequence under test: k = 2
    drafts, q = _ids(7, 9), torch.softmax(torch.randn(2, 50), -1)
    mine = SamplingParams(decode_strategy="sampling", temperature=0.9, top_p=0.95)
    alone = [
        verify([drafts], [q], logits, [mine], [generator_for_request(11, 3)]).output_tokens[0]
        for _ in range(3)
    ]
    assert alone[0] == alone[1] == alone[2]
    # the same sequence, seeded the same, placed second in a batch with other sequences
    others = torch.randn(4, 50)
    batch = verify(
        [_ids(1, 2, 3), drafts, _ids()],
        [None, q, None],
        torch.cat([others[:4], logits, torch.randn(1, 50)]),
        [SamplingParams(decode_strategy="sampling", top_k=5), mine, GREEDY],
        [generator_for_request(11, 0), generator_for_request(11, 3), None],
    )
    assert batch.output_tokens[1] == alone[0]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"target_logits": torch.zeros(4, V)}, "rows"),
        ({"target_logits": torch.zeros(3, V, dtype=torch.long)}, "target_logits"),
        ({"sampling_params": [GREEDY, GREEDY]}, "sampling params"),
        ({"generators": [None, None]}, "generators"),
        ({"draft_probs": [torch.zeros(2, V + 1)]}, "vocab"),
        ({"draft_token_ids": [_ids(1, V)]}, "range"),
    ],
)
def test_rejects_inconsistent_inputs(kwargs, match):
    args = {
        "draft_token_ids": [_ids(1, 2)],
        "draft_probs": None,
        "target_logits": torch.zeros(3, V),
        "sampling_params": [GREEDY],
        "generators": None,
    }
    args.update(kwargs)
    with pytest.raises(QuantSpecError, match=match):
        verify(**args)


# --- sampling: distribution tests ------------------------------------------------------------

# Target distributions at positions 0, 1, 2 and draft distributions at positions 0, 1 (k = 2).
P = np.array(
    [
        [0.30, 0.25, 0.20, 0.12, 0.08, 0.05],
        [0.05, 0.10, 0.40, 0.20, 0.15, 0.10],
        [0.15, 0.15, 0.10, 0.30, 0.20, 0.10],
    ]
)
Q = np.array(
    [
        [0.10, 0.15, 0.20, 0.25, 0.15, 0.15],
        [0.20, 0.20, 0.20, 0.20, 0.10, 0.10],
    ]
)
N_TRIALS = 30000
DETERMINISTIC_DRAFTS = (0, 2)  # a greedy-style drafter always proposes these two tokens


def _pvalue(tokens, p):
    """Chi-square goodness of fit of `tokens` to `p`, over p's support. Tokens outside the support
    make the fit fail outright (pvalue 0)."""
    tokens = np.asarray(tokens)
    counts = np.bincount(tokens, minlength=p.size)
    support = p > 0
    if counts[~support].any():
        return 0.0
    expected = counts.sum() * p[support] / p[support].sum()
    return chisquare(counts[support], expected).pvalue


def _run_trials(draft_kind, params=SAMPLING, seed=0):
    """N_TRIALS independent sequences, each with k = 2 drafts and target rows P[0], P[1], P[2];
    returns (drafts [N, 2], num_accepted [N], output token lists)."""
    rng = np.random.default_rng(seed)
    if draft_kind == "random_q":
        drafts = np.stack([rng.choice(V, N_TRIALS, p=Q[j]) for j in range(2)], axis=1)
        q = torch.tensor(Q, dtype=torch.float32)
        draft_probs = [q] * N_TRIALS
    else:
        drafts = np.tile(DETERMINISTIC_DRAFTS, (N_TRIALS, 1))
        draft_probs = None
    logits = torch.tensor(np.log(P), dtype=torch.float32).repeat(N_TRIALS, 1)  # [3N, V]
    ids = list(torch.from_numpy(drafts))
    torch.manual_seed(seed)  # generators None: the global stream, seeded → deterministic test
    result = verify(ids, draft_probs, logits, [params] * N_TRIALS)
    return drafts, result.num_accepted.numpy(), result.output_tokens


@pytest.fixture(scope="module", params=["random_q", "deterministic"])
def trials(request):
    return request.param, _run_trials(request.param)


def test_first_token_is_target_distributed(trials):
    kind, (drafts, n_acc, outputs) = trials
    first = np.array([out[0] for out in outputs])
    assert _pvalue(first, P[0]) > 1e-3
    # acceptance rate matches sum_x min(p, q) (one-hot q: p(x) for the fixed draft)
    q0 = Q[0] if kind == "random_q" else np.eye(V)[DETERMINISTIC_DRAFTS[0]]
    assert abs((n_acc >= 1).mean() - np.minimum(P[0], q0).sum()) < 0.015


def test_first_token_wrong_rules_are_rejected(trials):
    kind, (drafts, n_acc, outputs) = trials
    # wrong rule 1: always accept the draft → the first token is distributed as the drafts
    assert _pvalue(drafts[:, 0], P[0]) < 1e-6
    # wrong rule 2: on rejection resample from p itself instead of the residual max(0, p - q)
    rng = np.random.default_rng(1)
    wrong = np.where(n_acc >= 1, drafts[:, 0], rng.choice(V, N_TRIALS, p=P[0]))
    assert _pvalue(wrong, P[0]) < 1e-6


def test_second_and_bonus_tokens_are_target_distributed(trials):
    kind, (drafts, n_acc, outputs) = trials
    second = np.array([out[1] for out, n in zip(outputs, n_acc) if n >= 1])
    bonus = np.array([out[2] for out, n in zip(outputs, n_acc) if n == 2])
    assert len(second) > 5000 and len(bonus) > 1000
    assert _pvalue(second, P[1]) > 1e-3
    assert _pvalue(bonus, P[2]) > 1e-3
    # always accepting the second draft (given the first was accepted) is caught
    assert _pvalue(drafts[n_acc >= 1, 1], P[1]) < 1e-6
    # accepted drafts are emitted unchanged and outputs have num_accepted + 1 tokens
    assert all(len(out) == n + 1 for out, n in zip(outputs, n_acc))
    assert all(out[:n] == d[:n].tolist() for out, n, d in zip(outputs, n_acc, drafts))


@pytest.mark.parametrize("draft_kind", ["random_q", "deterministic"])
def test_filtered_target_is_matched(draft_kind):
    # temperature + top-k + top-p: the target is logits_to_probs(...), with zeros off the support
    params = SamplingParams(decode_strategy="sampling", temperature=0.7, top_k=4, top_p=0.9)
    drafts, n_acc, outputs = _run_trials(draft_kind, params, seed=3)
    target = logits_to_probs(
        torch.tensor(np.log(P), dtype=torch.float32),
        torch.full((3,), 0.7),
        torch.full((3,), 4),
        torch.full((3,), 0.9),
    ).double().numpy()
    assert (target == 0).any(axis=1).all()  # the filter really removed tokens at every position
    first = np.array([out[0] for out in outputs])
    second = np.array([out[1] for out, n in zip(outputs, n_acc) if n >= 1])
    assert _pvalue(first, target[0]) > 1e-3
    assert _pvalue(second, target[1]) > 1e-3
    # the unfiltered p is not what comes out
    assert _pvalue(first, P[0]) < 1e-6


def test_large_vocab_batch_smoke():
    # engine-sized shapes stay consistent: B = 16, mixed k up to 16, V = 50k, mixed params
    torch.manual_seed(0)
    vocab, ks = 50_000, [0, 1, 16, 5] * 4
    drafts = [torch.randint(0, vocab, (k,)) for k in ks]
    logits = torch.randn(sum(ks) + len(ks), vocab)
    probs = [None if i % 2 else torch.softmax(torch.randn(k, vocab), -1) for i, k in enumerate(ks)]
    params = [
        GREEDY,
        SAMPLING,
        SamplingParams(decode_strategy="sampling", temperature=0.6, top_k=50),
        SamplingParams(decode_strategy="sampling", top_p=0.8),
    ] * 4
    result = verify(drafts, probs, logits, params, [generator_for_request(0, i) for i in range(16)])
    assert [len(o) for o in result.output_tokens] == [n + 1 for n in result.num_accepted.tolist()]
    assert all(0 <= t < vocab for o in result.output_tokens for t in o)
    assert (result.num_accepted <= torch.tensor(ks)).all()
