"""Speculation through the engine with the n-gram proposer (`inference_with_reference`): greedy
output identical to the same engine without speculation (batch 1, mixed batches, 128 prompts),
sampling still distributed as the target, the back-off policy on literal histories, and the
knob validation of `build_proposer`."""

from types import SimpleNamespace

import pytest
import torch

from quantspec.errors import QuantSpecError
from quantspec.infer.engine import Engine, EngineConfig, SeqStats
from quantspec.infer.predictor import InferConfig
from quantspec.infer.sampler import SamplingParams
from quantspec.infer.spec.proposers import AdaptiveDraftLength, ReferenceProposer, SpecCost, build_proposer
from quantspec.model_zoo.checkpoint import load_model

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def model(tiny_llama_dir):
    return load_model(tiny_llama_dir)[0]


def _prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 500, (n,), generator=g).tolist() for n in lengths]


def _run(model, prompts, params, *, proposer=None, batch=1, k=5, block_size=16, max_length=256):
    eng = Engine(model, EngineConfig(block_size=block_size, max_batch_size=batch, max_length=max_length,
                                     spec_max_draft_tokens=k if proposer is not None else 0),
                 eos_token_ids=[], proposer=proposer)
    seqs = [eng.add_request(p, params, request_index=i) for i, p in enumerate(prompts)]
    eng.run()
    return seqs


def _ids(seqs):
    return [s.output_ids for s in seqs]


# -- greedy: identical output ---------------------------------------------------------------------


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("adaptive", [False, True])
def test_ngram_greedy_identical_to_plain(model, batch, adaptive):
    prompts = _prompts([5, 17, 30, 9], seed=0)
    prompts.append(prompts[1] * 3)  # repeated text in the prompt
    params = SamplingParams(max_new_tokens=120)
    plain = _ids(_run(model, prompts, params))
    policy = AdaptiveDraftLength(5, SpecCost()) if adaptive else None
    seqs = _run(model, prompts, params, proposer=ReferenceProposer(3, 5, policy=policy), batch=batch)
    assert _ids(seqs) == plain
    # the run really speculated: some steps accepted everything, others rejected drafts
    drafted = sum(s.stats.drafted for s in seqs)
    accepted = sum(s.stats.accepted for s in seqs)
    assert 0 < accepted < drafted
    assert any(len(s.stats.accepted_per_position) == 5 and s.stats.accepted_per_position[4] > 0 for s in seqs)
    # sequences accepted different counts, and every accepted token saved a base forward
    assert len({s.stats.accepted for s in seqs}) > 1
    for s in seqs:
        assert s.stats.target_forwards == len(s.output_ids) - 1 - s.stats.accepted


def test_stats_count_only_emitted_drafts_when_the_sequence_ends_inside_them(model, answer_oracle):
    """An EOS inside an accepted run of drafts: the verifier accepts the drafts after it too, but
    they are never emitted, so they are not counted (acceptance, per position)."""
    prompt = _prompts([12], seed=4)[0]
    answer = _ids(_run(model, [prompt], SamplingParams(max_new_tokens=12)))[0]  # no EOS: 12 tokens
    eos = answer[3]
    assert eos not in answer[:3]  # the answer then ends at its 4th token
    eng = Engine(model, EngineConfig(block_size=16, max_batch_size=1, max_length=256, spec_max_draft_tokens=8),
                 eos_token_ids=[eos], proposer=answer_oracle([answer]))
    seq = eng.add_request(prompt, SamplingParams(max_new_tokens=12), request_index=0)
    eng.run()
    # step 1 prefills (token 1); step 2 verifies 8 drafts = tokens 2..9, all accepted by the
    # base, but the output ends at the EOS (token 4): 3 drafts reached it (tokens 2, 3, 4)
    assert seq.output_ids == answer[:4] and seq.finish_reason == "eos"
    assert (seq.stats.target_forwards, seq.stats.drafted, seq.stats.accepted) == (1, 8, 3)
    assert seq.stats.accepted_per_position == [1, 1, 1, 0, 0, 0, 0, 0]


def test_ngram_block_boundaries_and_draft_budget(model):
    """Tiny blocks (drafts straddle block boundaries) and max_new_tokens / max_length caps."""
    prompts = _prompts([3, 4, 8], seed=2)
    for params, max_length in ((SamplingParams(max_new_tokens=37), 256), (SamplingParams(max_new_tokens=200), 60)):
        plain = _ids(_run(model, prompts, params, block_size=4, max_length=max_length))
        spec = _run(model, prompts, params, proposer=ReferenceProposer(2, 7), batch=2, k=7, block_size=4,
                    max_length=max_length)
        assert _ids(spec) == plain
        assert all(len(s.output_ids) == len(p) for s, p in zip(spec, plain))


def test_batch_of_128_equals_batch_1(model):
    prompts = _prompts([3 + i % 11 for i in range(128)], seed=3)
    params = SamplingParams(max_new_tokens=12)
    plain = _ids(_run(model, prompts, params, max_length=64))
    one = _run(model, prompts, params, proposer=ReferenceProposer(2, 4), k=4, max_length=64)
    many = _run(model, prompts, params, proposer=ReferenceProposer(2, 4), batch=128, k=4, max_length=64)
    assert _ids(many) == _ids(one) == plain
    assert sum(s.stats.accepted for s in many) > 0


def test_ngram_sampling_reproducible_and_batch_invariant(model):
    prompts = _prompts([6, 15, 11], seed=4)
    prompts[0] = prompts[0] * 4
    params = SamplingParams(decode_strategy="sampling", temperature=0.7, top_k=5, seed=3, max_new_tokens=40)

    def run(batch):
        policy = AdaptiveDraftLength(4, SpecCost())
        return _run(model, prompts, params, proposer=ReferenceProposer(3, 4, policy=policy), batch=batch, k=4)

    one, three = run(1), run(3)
    assert _ids(one) == _ids(three)
    assert sum(s.stats.drafted for s in one) > 0


def test_ngram_sampling_matches_target_distribution(model):
    """Chi-square: the first three sampled tokens, with n-gram drafts (deterministic, q one-hot)
    verified by rejection sampling, follow the target's exact joint distribution."""
    from scipy.stats import chisquare

    from quantspec.infer.sampler import logits_to_probs
    from quantspec.model_zoo.llama import DenseCausalAttention

    params = SamplingParams(decode_strategy="sampling", temperature=1.5, top_k=3, seed=7, max_new_tokens=3)
    # a prompt that ends in the model's own greedy text: the tiny random model loops, so the
    # likely next tokens occur in the prompt and the n-gram matcher proposes their continuations
    (base,) = _prompts([6], seed=0)
    prompt = base + _run(model, [base], SamplingParams(max_new_tokens=60))[0].output_ids

    def next_probs(ids):
        h = model(torch.tensor(ids), torch.arange(len(ids)), DenseCausalAttention(1, len(ids)))
        return logits_to_probs(model.compute_logits(h[-1:]), torch.tensor([params.temperature]),
                               torch.tensor([params.top_k]))[0]

    exact = {}
    with torch.inference_mode():
        p1 = next_probs(prompt)
        for a in p1.nonzero().flatten().tolist():
            p2 = next_probs(prompt + [a])
            for b in p2.nonzero().flatten().tolist():
                p3 = next_probs(prompt + [a, b])
                for c in p3.nonzero().flatten().tolist():
                    exact[(a, b, c)] = float(p1[a] * p2[b] * p3[c])

    n, counts, drafted = 0, {}, 0
    for rnd in range(12):
        eng = Engine(model, EngineConfig(block_size=16, max_batch_size=128, max_length=128, spec_max_draft_tokens=2),
                     eos_token_ids=[], proposer=ReferenceProposer(3, 2))
        seqs = [eng.add_request(prompt, params, request_index=rnd * 128 + i) for i in range(128)]
        eng.run()
        for s in seqs:
            counts[tuple(s.output_ids)] = counts.get(tuple(s.output_ids), 0) + 1
            drafted += s.stats.drafted
        n += len(seqs)
    assert drafted > n // 4  # speculation really happened
    assert set(counts) <= set(exact)  # nothing outside the top-k support
    cats = sorted(exact, key=exact.get, reverse=True)
    expected = [n * exact[c] for c in cats]
    observed = [counts.get(c, 0) for c in cats]
    big = [i for i, e in enumerate(expected) if e >= 5]  # pool the rare categories
    obs = [observed[i] for i in big] + [n - sum(observed[i] for i in big)]
    exp = [expected[i] for i in big] + [n - sum(expected[i] for i in big)]
    assert chisquare(obs, exp).pvalue > 1e-3


# -- the back-off policy --------------------------------------------------------------------------


def _fake_seq(seq_id=0):
    return SimpleNamespace(seq_id=seq_id, stats=SeqStats())


def _step(policy, seq, k_asked, accepted):
    """Tell the policy a verification of `k_asked` drafts accepted `accepted` of them."""
    seq.stats.drafted += k_asked
    seq.stats.accepted += accepted


def test_policy_speculates_when_accepted_and_backs_off_when_not():
    policy = AdaptiveDraftLength(5, SpecCost(verify_fixed=0.5, verify_per_token=0.02))
    seq = _fake_seq()
    assert policy.num_drafts(seq, 5) == 5  # optimistic prior
    assert policy.num_drafts(seq, 2) == 2  # never above the budget
    assert policy.num_drafts(seq, 0) == 0
    for _ in range(3):
        k = policy.num_drafts(seq, 5)
        _step(policy, seq, k, k)  # everything accepted
    assert min(policy.acceptance(seq)) > 0.9 and policy.num_drafts(seq, 5) == 5
    ks = []
    for _ in range(40):  # nothing accepted any more
        k = policy.num_drafts(seq, 5)
        ks.append(k)
        _step(policy, seq, k, 0)
    assert ks[0] == 5 and 0 in ks[:12]  # backs off within a few steps (a1 has to fall below ~0.1)
    probes = [i for i, k in enumerate(ks) if k > 0 and 0 in ks[:i]]
    assert all(ks[i] == policy.probe_k for i in probes)
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert probes and all(g2 >= g1 for g1, g2 in zip(gaps, gaps[1:]))  # probes get rarer
    assert sum(k > 0 for k in ks[12:]) <= 3
    # a successful probe brings speculation back
    while (k := policy.num_drafts(seq, 5)) == 0:
        pass
    _step(policy, seq, k, k)
    assert policy.num_drafts(seq, 5) > 0


def test_policy_cost_model():
    cpu = AdaptiveDraftLength(8, SpecCost(verify_fixed=0.5, verify_per_token=0.02))
    assert cpu.best_k(0.95) == 8 and cpu.best_k(0.2) == 0
    # E(k)/C(k) by hand for α = 0.6: k=1 1.6/1.52=1.053, k=5 2.383/1.60=1.489,
    # k=6 2.430/1.62=1.500, k=7 2.458/1.64=1.499, k=8 2.475/1.66=1.491
    assert cpu.best_k(0.6) == 6
    # an expensive drafter wants fewer drafts at the same acceptance
    # α = 0.9, C(k) = 1.5 + 0.32 k: k=5 4.69/3.10=1.51, k=6 5.22/3.42=1.53, k=7 5.70/3.74=1.52
    costly = AdaptiveDraftLength(8, SpecCost(verify_fixed=0.5, verify_per_token=0.02, draft_per_token=0.3))
    assert costly.best_k(0.9) == 6 and costly.best_k(0.5) == 0
    # a drafter as slow as the base can never pay: it never drafts, not even to probe
    hopeless = AdaptiveDraftLength(5, SpecCost(verify_fixed=0.5, verify_per_token=0.05, draft_per_token=1.0))
    seq = _fake_seq()
    assert hopeless.probe_k == 0 and not any(hopeless.num_drafts(seq, 5) for _ in range(100))
    # a free drafter on a GPU speculates even at low acceptance
    assert AdaptiveDraftLength(8, SpecCost(verify_fixed=0.0, verify_per_token=0.0)).best_k(0.1) == 8
    # first-draft and run-on rates separately: rarely right, but long when right → still drafts
    # (a1 = 0.3, ac = 0.95, C(k) = 1.5 + 0.05 k: E(5)/C(5) = (1 + 0.3 · 4.52) / 1.75 = 1.35)
    five = AdaptiveDraftLength(5, SpecCost(verify_fixed=0.5, verify_per_token=0.05))
    assert five.best_k(0.3, 0.95) == 5 and five.best_k(0.3, 0.3) == 0
    # a1 = 0.95, ac = 0.3: k=1 1.95/1.55=1.258, k=2 2.235/1.60=1.397, k=3 2.321/1.65=1.407,
    # k=4 2.346/1.70=1.380
    assert five.best_k(0.95, 0.3) == 3
    policy = AdaptiveDraftLength(4, SpecCost())
    a, b = _fake_seq(0), _fake_seq(1)
    policy.num_drafts(a, 4), policy.num_drafts(b, 4)
    _step(policy, a, 4, 0)  # a: first draft rejected
    _step(policy, b, 4, 2)  # b: two accepted, then a rejection
    policy.num_drafts(a, 4), policy.num_drafts(b, 4)
    (a1, ac), (b1, bc) = policy.acceptance(a), policy.acceptance(b)
    assert a1 < b1 and ac == 0.8 and bc < 0.8 and b1 > 0.8  # per sequence, per rate
    policy.forget(a)
    assert policy.acceptance(a) == policy.acceptance(_fake_seq(5)) == (0.8, 0.8)  # back to the prior


def test_policy_keeps_estimates_per_kind():
    """Outcomes are credited to the kind that drafted; a kind backed off does not stop another
    from drafting; no candidate (kind None) drafts nothing and does not count towards a probe."""
    policy = AdaptiveDraftLength(6, SpecCost(verify_fixed=0.5, verify_per_token=0.05))
    seq = _fake_seq()
    ks0, ks2 = [], []
    for _ in range(16):  # kind 0 (short matches) always fails at the first draft
        ks0.append(policy.num_drafts(seq, 6, kind=0))
        _step(policy, seq, ks0[-1], 0)
        ks2.append(policy.num_drafts(seq, 6, kind=2))  # kind 2 (long matches) always runs through
        _step(policy, seq, ks2[-1], ks2[-1])
    policy.num_drafts(seq, 6, kind=None)  # reads the last outcome
    (a0, _), (a2, c2) = policy.acceptance(seq, 0), policy.acceptance(seq, 2)
    assert a0 < 0.2 and a2 > 0.9 and c2 > 0.9 and policy.acceptance(seq, 1) == (0.8, 0.8)
    assert all(k == 6 for k in ks2)  # never held back by kind 0's failures
    assert ks0[0] == 6 and sum(k > 0 for k in ks0[8:]) <= 2  # backed off, but for a probe
    # steps without a candidate neither draft nor bring kind 0's probe closer
    idle = policy._seqs[seq.seq_id].kinds[0].idle
    assert not any(policy.num_drafts(seq, 6, kind=None) for _ in range(50))
    assert policy._seqs[seq.seq_id].kinds[0].idle == idle
    # a step with k = 0 leaves nothing to credit: kind 2's estimates stay as they were
    before = policy.acceptance(seq, 2)
    policy.num_drafts(seq, 6, kind=0)
    _step(policy, seq, 0, 0)
    policy.num_drafts(seq, 6, kind=None)
    assert policy.acceptance(seq, 2) == before


def test_reference_proposer_asks_the_policy_per_agreement_class():
    from quantspec.infer.spec.proposers import agreement_kind

    assert [agreement_kind(n) for n in (1, 2, 3, 4, 16)] == [0, 1, 1, 2, 2]
    policy = AdaptiveDraftLength(4, SpecCost(verify_fixed=0.0, verify_per_token=0.05))
    prop = ReferenceProposer(3, 4, policy=policy)
    asked = []
    orig = policy.num_drafts
    policy.num_drafts = lambda seq, budget, kind=0: asked.append((budget, kind)) or orig(seq, budget, kind)
    seq = SimpleNamespace(seq_id=0, prompt_ids=[1, 2, 3, 4, 5, 6, 7, 8, 9], output_ids=[1, 2, 3, 4, 5],
                          stats=SeqStats())
    proposal = prop.propose([seq], [3])
    assert proposal.token_lists() == [[6, 7, 8]] and proposal.draft_probs is None  # deterministic drafts
    assert asked == [(3, 2)]  # 5 tokens agree → kind 2
    short = SimpleNamespace(seq_id=1, prompt_ids=[1, 2, 3, 4, 5, 6, 7, 8, 9], output_ids=[9, 3], stats=SeqStats())
    assert prop.propose([short], [4]).token_lists() == [[4, 5, 6, 7]] and asked[-1] == (4, 0)  # "9 3" is new: 1 token
    short.output_ids.append(42)  # no match: the policy still hears of the step, with no candidate
    assert prop.propose([short], [4]).token_lists() == [[]] and asked[-1] == (4, None)


def test_reference_proposer_realigns_only_short_matches(monkeypatch):
    """Past an edit the realigned draft replaces a short exact match (and the policy hears its
    agreement class); a long exact match is kept without searching; realign=False keeps the
    exact match."""
    import quantspec.infer.spec.proposers as proposers
    from quantspec.infer.spec.ngram import propose_ngram_match, realigned_match

    prompt = [10, 1, 7, 1, 2, 3, 4, 1, 5, 4, 1, 7, 11]  # "A\n```\ndef f(x)\nreturn x\n```B"
    answer = [1, 7, 6, 1]  # "\n```python\n": "python" inserted after the fence
    assert propose_ngram_match(prompt + answer, 3, 4) == ([7, 6, 1], 1)
    assert realigned_match(prompt + answer, 4) == ([2, 3, 4, 1], 3)
    calls = []
    monkeypatch.setattr(proposers, "realigned_match", lambda t, k: calls.append(len(t)) or realigned_match(t, k))
    for realign, expect, kind in ((True, [2, 3, 4, 1], 1), (False, [7, 6, 1], 0)):
        policy = AdaptiveDraftLength(4, SpecCost(verify_fixed=0.0, verify_per_token=0.05))
        asked = []
        orig = policy.num_drafts
        policy.num_drafts = lambda seq, budget, kind=0, orig=orig: asked.append(kind) or orig(seq, budget, kind)
        prop = ReferenceProposer(3, 4, policy=policy, realign=realign)
        seq = SimpleNamespace(seq_id=0, prompt_ids=prompt, output_ids=list(answer), stats=SeqStats())
        assert prop.propose([seq], [4]).token_lists() == [expect] and asked == [kind]
    assert calls == [len(prompt) + len(answer)]  # the realign=False proposer never searched
    # a long exact match (the answer now copies "def f(x)"): kept, no search
    prop = ReferenceProposer(3, 4)
    seq = SimpleNamespace(seq_id=1, prompt_ids=prompt, output_ids=answer + [2, 3, 4], stats=SeqStats())
    assert prop.propose([seq], [4]).token_lists() == [[1, 5, 4, 1]] and len(calls) == 1


def test_backoff_bounds_the_cost_when_drafts_are_poor(model):
    """Drafts that are mostly wrong (1-gram matches while sampling a flat distribution) and a
    costly verification: the modelled cost of the adaptive run (sum of C(k) over its steps) stays
    within 10% of plain decoding, where always drafting costs far more."""
    cost = SpecCost(verify_fixed=1.0, verify_per_token=0.1)
    prompts = _prompts([20, 25], seed=9)
    params = SamplingParams(decode_strategy="sampling", temperature=1.0, seed=1, max_new_tokens=150)

    def modelled_cost(seqs):
        st = [s.stats for s in seqs]
        steps_with_drafts = sum(sum(x.drafted_per_position[:1]) for x in st)
        return (sum(x.target_forwards for x in st) + cost.verify_fixed * steps_with_drafts
                + cost.verify_per_token * sum(x.drafted for x in st))

    plain = _run(model, prompts, params)
    eager = _run(model, prompts, params, proposer=ReferenceProposer(1, 5))
    adaptive = _run(model, prompts, params, proposer=ReferenceProposer(1, 5, policy=AdaptiveDraftLength(5, cost)))
    assert [len(x) for x in _ids(adaptive)] == [len(x) for x in _ids(plain)]
    assert modelled_cost(eager) > 1.2 * modelled_cost(plain)  # the setting really is unfavourable
    assert modelled_cost(adaptive) <= 1.1 * modelled_cost(plain)


def test_proposer_respects_budgets(model):
    seq = _run(model, [[5, 6, 7, 5, 6, 7, 5, 6]], SamplingParams(max_new_tokens=1))[0]
    prop = ReferenceProposer(3, 5)
    proposal = prop.propose([seq], [2])
    assert len(proposal.token_lists()[0]) <= 2 and proposal.draft_probs is None
    assert prop.propose([seq], [0]).token_lists() == [[]]
    prop.release(seq)


# -- knobs ----------------------------------------------------------------------------------------


def test_build_proposer_validates_knobs(model):
    loaded = SimpleNamespace(model=model)
    ok = InferConfig(speculate_method="inference_with_reference", speculate_max_draft_token_num=4,
                     speculate_max_ngram_size=2)
    proposer, k = build_proposer(ok, loaded)
    assert isinstance(proposer, ReferenceProposer) and k == 4 and proposer.max_ngram_size == 2
    assert build_proposer(InferConfig(), loaded) == (None, 0)
    bad = [
        (dict(speculate_max_draft_token_num=0), "--speculate-max-draft-token-num"),
        (dict(speculate_max_draft_token_num=17), "--speculate-max-draft-token-num"),
        (dict(speculate_max_ngram_size=0), "--speculate-max-ngram-size"),
        (dict(draft_model="some/dir"), "--draft-model"),
        (dict(speculate_method="draft"), "--draft-model"),
        (dict(speculate_method="mtp"), "--draft-model"),
        (dict(speculate_method="eagle"), "--speculate-method"),
    ]
    for kw, needle in bad:
        with pytest.raises(QuantSpecError, match=needle) as e:  # InferConfig checks them when built
            build_proposer(InferConfig(**{"speculate_method": "inference_with_reference", **kw}), loaded)
        assert "\n" not in str(e.value)
