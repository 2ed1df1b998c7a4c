"""Tests for quantspec/infer/sampler.py: params validation, logits → probs filtering on literal
arrays, batch-invariant sampling with per-request generators, and a chi-square test of `sample`."""

import math

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from quantspec.errors import QuantSpecError
from quantspec.infer.sampler import (
    TOP_P_CANDIDATES,
    DecodeStrategy,
    SamplingParams,
    generator_for_request,
    greedy,
    greedy_ids,
    logits_to_probs,
    make_generators,
    sample,
    sampling_tensors,
)


# --- SamplingParams -------------------------------------------------------------------------


def test_params_defaults_and_normalisation():
    p = SamplingParams(decode_strategy="sampling", temperature=0.7, top_k=5, stop=["\n\n"])
    assert p.decode_strategy is DecodeStrategy.SAMPLING
    assert not p.is_greedy and p.uses_filter
    assert p.stop == ("\n\n",)
    assert SamplingParams().is_greedy and not SamplingParams().uses_filter
    # greedy ignores temperature, so 0 is allowed there
    assert SamplingParams(decode_strategy="greedy", temperature=0.0).is_greedy
    hash(p)  # frozen + tuple stop → usable as a dict key
    with pytest.raises(AttributeError):
        p.top_k = 3  # type: ignore[misc]


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"decode_strategy": "beam"}, "decode_strategy"),
        ({"decode_strategy": "sampling", "temperature": 0.0}, "temperature"),
        ({"temperature": -1.0}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_k": -1}, "--top-k"),
        ({"top_k": 2.5}, "--top-k"),
        ({"top_k": True}, "--top-k"),
        ({"top_p": 0.0}, "--top-p"),
        ({"top_p": 1.5}, "--top-p"),
        ({"min_p": -0.1}, "--min-p"),
        ({"min_p": 1.5}, "--min-p"),
        ({"seed": -3}, "seed"),
        ({"seed": 2**63}, "seed"),
        ({"seed": "7"}, "seed"),
        ({"max_new_tokens": 0}, "--max-new-tokens"),
        ({"stop": "</s>"}, "stop"),
        ({"stop": [""]}, "stop"),
    ],
)
def test_params_reject_bad_values(kwargs, field):
    with pytest.raises(QuantSpecError, match=field):
        SamplingParams(**kwargs)


def test_sampling_tensors_skip_unused_filters():
    temp, top_k, top_p, min_p = sampling_tensors(
        [SamplingParams(), SamplingParams("sampling", temperature=0.5)]
    )
    assert temp.tolist() == [1.0, 0.5] and top_k is None and top_p is None and min_p is None
    temp, top_k, top_p, min_p = sampling_tensors(
        [SamplingParams(top_k=3, min_p=0.2), SamplingParams("sampling", top_p=0.9)]
    )
    # the greedy row's top_k and min_p do not count: greedy rows are never filtered
    assert top_k is None and min_p is None
    assert top_p.tolist() == pytest.approx([1.0, 0.9])


# --- logits_to_probs ------------------------------------------------------------------------


def _softmax(x):
    e = np.exp(np.asarray(x, dtype=np.float64) - np.max(x))
    return e / e.sum()


def test_temperature_only_is_softmax_and_fp32():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0], [0.5, 0.5, 3.0, 0.0]], dtype=torch.bfloat16)
    probs = logits_to_probs(logits, torch.tensor([1.0, 0.5]))
    assert probs.dtype == torch.float32
    expect = [_softmax(logits[0].float().numpy()), _softmax(logits[1].float().numpy() / 0.5)]
    np.testing.assert_allclose(probs.numpy(), np.stack(expect), rtol=1e-5, atol=1e-7)


def test_top_k_literal_and_ties():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0], [1.0, 1.0, 1.0, 0.0]])
    probs = logits_to_probs(logits, torch.ones(2), top_k=torch.tensor([2, 1]))
    np.testing.assert_allclose(probs[0].numpy(), [*_softmax([2.0, 1.0]), 0, 0], rtol=1e-6)
    # ties at the k-th value are all kept
    np.testing.assert_allclose(probs[1].numpy(), [1 / 3, 1 / 3, 1 / 3, 0], rtol=1e-6)


@pytest.mark.parametrize(
    "top_p, kept",
    [(0.3, 1), (0.75, 2), (0.85, 3), (0.99, 4), (1.0, 4)],
)
def test_top_p_keeps_smallest_prefix_reaching_p(top_p, kept):
    p = np.array([0.5, 0.3, 0.15, 0.05])
    logits = torch.tensor(np.log(p)[None], dtype=torch.float32)
    probs = logits_to_probs(logits, torch.ones(1), top_p=torch.tensor([top_p]))[0].numpy()
    expect = np.where(np.arange(4) < kept, p, 0.0)
    np.testing.assert_allclose(probs, expect / expect.sum(), rtol=1e-5, atol=1e-7)


def test_top_k_applies_before_top_p():
    # after top-k=2 the mass is [4/7, 3/7]: top_p=0.5 then keeps one token. Applying top-p to the
    # unfiltered [0.4, 0.3, ...] first would keep two.
    p = np.array([0.4, 0.3, 0.2, 0.1])
    logits = torch.tensor(np.log(p)[None], dtype=torch.float32)
    probs = logits_to_probs(logits, torch.ones(1), torch.tensor([2]), torch.tensor([0.5]))
    np.testing.assert_allclose(probs[0].numpy(), [1, 0, 0, 0], atol=1e-7)


def test_per_row_params_match_row_by_row_and_leave_unfiltered_rows_untouched():
    torch.manual_seed(0)
    logits = torch.randn(6, 37) * 3
    temp = torch.tensor([1.0, 0.7, 1.3, 1.0, 0.5, 2.0])
    top_k = torch.tensor([0, 5, 0, 1, 37, 0])
    top_p = torch.tensor([1.0, 1.0, 0.8, 1.0, 0.6, 1.0])
    batched = logits_to_probs(logits, temp, top_k, top_p)
    for i in range(6):
        one = slice(i, i + 1)
        row = logits_to_probs(logits[one], temp[one], top_k[one], top_p[one])
        torch.testing.assert_close(batched[i : i + 1], row)
    for i in (0, 5):  # top_k=0 and top_p=1: exactly softmax(logits / T)
        assert torch.equal(batched[i], torch.softmax(logits[i] / temp[i], dim=-1))
    assert int((batched[1] > 0).sum()) == 5 and int((batched[3] > 0).sum()) == 1
    torch.testing.assert_close(batched.sum(-1), torch.ones(6))


def test_off_filters_give_same_result_with_or_without_sort():
    torch.manual_seed(1)
    logits = torch.randn(3, 50)
    temp = torch.tensor([0.9, 1.0, 1.1])
    fast = logits_to_probs(logits, temp)
    # one filtered row forces the sort path for the whole batch; the other rows must not change
    top_k = torch.tensor([0, 0, 4])
    sorted_path = logits_to_probs(logits, temp, top_k, torch.ones(3))
    assert torch.equal(fast[:2], sorted_path[:2])
    assert not torch.equal(fast[2], sorted_path[2])


def test_top_p_one_keeps_tail_even_when_prefix_sum_rounds_to_one():
    # a peaked row: in fp32 the prefix sum hits 1.0 long before the tail ends; with top_p = 1
    # the tail must still keep its (tiny, nonzero) probabilities
    logits = torch.zeros(2, 1000)
    logits[:, 0] = 20.0
    probs = logits_to_probs(logits, torch.ones(2), top_p=torch.tensor([1.0, 0.5]))
    assert torch.equal(probs[0], torch.softmax(logits[0], dim=-1))
    assert bool((probs[0] > 0).all())
    assert probs[1].tolist() == [1.0] + [0.0] * 999


def _reference_probs(logits, temperature, top_k, top_p):
    """Row-by-row numpy reference: temperature, top-k by value, top-p over the full sort."""
    out = []
    for row, t, k, p in zip(logits, temperature, top_k, top_p):
        x = np.asarray(row, dtype=np.float64) / t
        if k > 0:
            x = np.where(x < np.sort(x)[::-1][k - 1], -np.inf, x)
        probs = _softmax(x)
        if p < 1.0:
            order = np.argsort(-probs, kind="stable")
            before = np.cumsum(probs[order]) - probs[order]
            keep = np.zeros_like(probs, dtype=bool)
            keep[order] = before < p
            probs = np.where(keep, probs, 0.0)
            probs /= probs.sum()
        out.append(probs)
    return np.stack(out)


def test_top_p_candidate_path_and_full_sort_fallback_match_reference():
    # V > TOP_P_CANDIDATES: peaked rows are decided by the candidates, flat rows need the sort
    gen = torch.Generator().manual_seed(2)
    vocab = 3 * TOP_P_CANDIDATES + 5
    scale = torch.tensor([8.0, 0.5, 8.0, 0.5, 1.0, 8.0]).unsqueeze(1)
    logits = torch.randn(6, vocab, generator=gen) * scale
    temperature = torch.tensor([1.0, 1.0, 0.7, 1.3, 1.0, 1.0])
    top_k = torch.tensor([0, 0, 0, 2000, 0, 30])
    top_p = torch.tensor([0.9, 0.9, 0.5, 0.8, 1.0, 0.95])
    probs = logits_to_probs(logits, temperature, top_k, top_p).double().numpy()
    expect = _reference_probs(logits.numpy(), temperature.numpy(), top_k.numpy(), top_p.numpy())
    np.testing.assert_allclose(probs, expect, atol=1e-6)
    # both regimes were exercised: some kept sets fit in the candidates, some do not
    kept = (probs > 0).sum(axis=1)
    assert kept[0] < TOP_P_CANDIDATES and kept[1] > TOP_P_CANDIDATES


def test_logits_to_probs_rejects_bad_shapes():
    with pytest.raises(QuantSpecError, match="logits"):
        logits_to_probs(torch.zeros(4), torch.ones(1))
    with pytest.raises(QuantSpecError, match="temperature"):
        logits_to_probs(torch.zeros(2, 4), torch.ones(3))
    with pytest.raises(QuantSpecError, match="top_k"):
        logits_to_probs(torch.zeros(2, 4), torch.ones(2), top_k=torch.zeros(1, dtype=torch.long))


# --- sample / greedy / generators -----------------------------------------------------------


def test_sample_matches_distribution_chi_square():
    p = np.array([0.05, 0.3, 0.0, 0.25, 0.15, 0.25])
    n = 20000
    torch.manual_seed(1234)
    probs = torch.tensor(p, dtype=torch.float32).expand(n, -1)
    tokens = sample(probs, [None] * n).numpy()
    counts = np.bincount(tokens, minlength=p.size)
    assert counts[2] == 0  # zero-probability tokens are never drawn
    support = p > 0
    result = chisquare(counts[support], n * p[support])
    assert result.pvalue > 1e-3
    # the same test rejects a wrong distribution (uniform over the support)
    wrong = np.bincount(np.random.default_rng(0).choice([0, 1, 3, 4, 5], n), minlength=6)
    assert chisquare(wrong[support], n * p[support]).pvalue < 1e-6


def test_sample_is_batch_invariant_with_per_row_generators():
    torch.manual_seed(0)
    probs = torch.softmax(torch.randn(4, 100), dim=-1)

    def run(neighbours: int, slot: int) -> list[int]:
        gens = make_generators(7, neighbours + 1)
        mine = generator_for_request(7, 42)
        gens.insert(slot, mine)
        out = []
        for _ in range(5):
            rows = probs[torch.arange(neighbours + 1) % 4]
            rows = torch.cat([rows[:slot], probs[1:2], rows[slot:]])
            out.append(int(sample(rows, gens)[slot]))
        return out

    alone = run(0, 0)
    assert run(3, 2) == alone and run(6, 6) == alone


def test_sample_mixes_seeded_and_global_rows():
    probs = torch.softmax(torch.randn(3, 20, generator=torch.Generator().manual_seed(3)), -1)
    a = sample(probs, [None, generator_for_request(1, 0), None])
    b = sample(probs, [None, generator_for_request(1, 0), None])
    assert a[1] == b[1]
    with pytest.raises(QuantSpecError, match="generators"):
        sample(probs, [None])


def test_generator_convention():
    assert make_generators(None, 3) == [None, None, None]
    draws = [torch.rand(4, generator=g) for g in make_generators(5, 3)]
    again = [torch.rand(4, generator=g) for g in make_generators(5, 3)]
    assert all(torch.equal(x, y) for x, y in zip(draws, again))
    assert not torch.equal(draws[0], draws[1])
    # the stream depends on (seed, request index), not on where the batch starts
    shifted = torch.rand(4, generator=make_generators(5, 2, start_index=2)[0])
    assert torch.equal(shifted, draws[2])
    assert not torch.equal(draws[0], torch.rand(4, generator=make_generators(6, 1)[0]))
    with pytest.raises(QuantSpecError, match="seed"):
        generator_for_request(-1, 0)


def test_greedy_is_argmax_first_on_ties():
    logits = torch.tensor([[0.0, 3.0, 3.0, 1.0], [5.0, -1.0, 0.0, math.inf]])
    assert greedy(logits).tolist() == [1, 3]


def test_greedy_ids_equals_torch_argmax():
    """The host argmax (numpy for float32 CPU logits) against torch's: ties, -0.0 / 0.0, inf, NaN,
    a 49k vocabulary, bf16 (torch path), and a non-contiguous view."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 49152, generator=g).mul(3).round()  # many tied maxima
    logits[1, 7], logits[1, 9] = math.inf, math.inf
    logits[2, 100], logits[2, 50] = math.nan, math.nan
    logits[3] = 0.0
    logits[3, 5] = -0.0
    logits[4] = -math.inf
    for x in (logits, logits.to(torch.bfloat16), logits[:, ::2], logits[::2]):
        assert greedy_ids(x) == x.argmax(dim=-1).tolist()
    with pytest.raises(QuantSpecError, match="logits must be"):
        greedy_ids(logits[0])


@pytest.mark.parametrize("min_p", [0.05, 0.3, 1.0])
def test_min_p_is_transformers_warper(min_p):
    """min-p after temperature against transformers' `MinPLogitsWarper`; a row with min_p 0 is left
    alone (the per-row off switch) and greedy rows never filter."""
    from transformers import MinPLogitsWarper

    g = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 40, generator=g) * 2
    temp = torch.tensor([1.0, 0.7, 1.6])
    got = logits_to_probs(logits, temp, None, None, torch.tensor([min_p, min_p, 0.0]))
    scaled = logits / temp[:, None]
    want = torch.softmax(MinPLogitsWarper(min_p, min_tokens_to_keep=1)(None, scaled.clone()), dim=-1)
    assert torch.allclose(got[:2], want[:2], atol=1e-6)
    assert torch.allclose(got[2], torch.softmax(scaled[2], dim=-1), atol=1e-6)
    assert sampling_tensors([SamplingParams(min_p=0.5)])[3] is None
