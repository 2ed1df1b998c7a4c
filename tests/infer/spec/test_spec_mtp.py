"""MTP speculation on the tiny Llama: greedy output identical to plain decoding (batch 1 and a
mixed batch), sampling lossless (chi-square against the exact target distribution), the
factory's checks."""

from types import SimpleNamespace

import pytest
import torch

from quantspec.errors import QuantSpecError
from quantspec.infer.engine import Engine, EngineConfig
from quantspec.infer.sampler import SamplingParams, logits_to_probs
from quantspec.infer.spec.mtp import MTPProposer, build_mtp_proposer
from quantspec.model_zoo.checkpoint import load_model
from quantspec.model_zoo.llama import DenseCausalAttention
from quantspec.model_zoo.mtp import save_mtp
from quantspec.model_zoo.mtp_train import MTPTrainConfig, extract_features, init_mtp, train_mtp
from quantspec.model_zoo.tiny import build_tiny_model

torch.set_num_threads(1)

PROMPTS = [[5, 6, 7, 8, 9], list(range(20, 60)), [100, 101, 102], list(range(300, 317))]


@pytest.fixture(scope="module")
def base(tiny_llama_dir):
    model, _ = load_model(tiny_llama_dir)
    return model


def _decode(base, prompts, proposer, *, batch, n=40, k=4, params=None):
    eng = Engine(base, EngineConfig(block_size=16, max_batch_size=batch, max_length=256,
                                    spec_max_draft_tokens=k if proposer else 0),
                 eos_token_ids=[], proposer=proposer)
    params = params or SamplingParams(max_new_tokens=n)
    seqs = [eng.add_request(p, params, request_index=i) for i, p in enumerate(prompts)]
    eng.run()
    return [s.output_ids for s in seqs], seqs


@pytest.fixture(scope="module")
def trained_mtp(base, tmp_path_factory):
    """An MTP trained briefly on the base's own greedy continuations of the test prompts (so
    drafts are often, but not always, accepted); returns its artifact directory."""
    outs, _ = _decode(base, PROMPTS, None, batch=4, n=48)
    seqs = [torch.tensor(p + o) for p, o in zip(PROMPTS, outs)]
    feats = extract_features(base, seqs, self_distill=True)
    mtp = init_mtp(base, torch.arange(base.args.vocab_size))
    out = tmp_path_factory.mktemp("mtp")
    train_mtp(mtp, feats, MTPTrainConfig(steps=150, batch_tokens=128, lr=3e-3, chain_weight=1.0, save_every=150), out)
    return out


@pytest.fixture(scope="module")
def random_mtp(base, tmp_path_factory):
    out = tmp_path_factory.mktemp("mtp_random")
    save_mtp(init_mtp(base, torch.arange(0, base.args.vocab_size, 3), seed=1), out)  # a third of the vocab
    return out


def _proposer(base, path, k=4):
    loaded = SimpleNamespace(model=base)
    config = SimpleNamespace(draft_model=str(path), speculate_max_draft_token_num=k)
    proposer, max_k = build_mtp_proposer(config, loaded)
    assert max_k == k and proposer.needs_hidden
    proposer.policy = None  # always k drafts: exercise verification on every step
    return proposer


@pytest.mark.parametrize("which", ["trained_mtp", "random_mtp"])
def test_greedy_identical_batch1_and_mixed_batch(base, request, which):
    path = request.getfixturevalue(which)
    plain, _ = _decode(base, PROMPTS, None, batch=1)
    alone, _ = _decode(base, PROMPTS, _proposer(base, path), batch=1)
    mixed, seqs = _decode(base, PROMPTS, _proposer(base, path), batch=3)  # continuous batching too
    assert alone == plain
    assert mixed == plain
    drafted = [s.stats.drafted for s in seqs]
    assert all(d > 0 for d in drafted)
    if which == "trained_mtp":  # sequences accept different counts, some drafts are accepted
        accepted = [s.stats.accepted for s in seqs]
        assert sum(accepted) > 0.3 * sum(drafted), (accepted, drafted)
        assert len({round(a / d, 2) for a, d in zip(accepted, drafted)}) > 1


def test_sampled_drafts_carry_their_distribution(base, random_mtp):
    proposer = _proposer(base, random_mtp, k=3)
    g = torch.Generator().manual_seed(0)
    seq = SimpleNamespace(last_hidden=torch.randn(base.args.hidden_size), tokens=[5, 6, 7],
                          params=SamplingParams(decode_strategy="sampling", top_k=20), generator=g)
    greedy = SimpleNamespace(last_hidden=seq.last_hidden, tokens=[5, 6, 7], params=SamplingParams(), generator=None)
    proposal = proposer.propose([seq, greedy], [3, 2])
    drafts, probs = proposal.token_lists(), proposal.draft_probs
    assert len(drafts[0]) == 3 and len(drafts[1]) == 2 and probs[1] is None
    q = probs[0]  # [3, V]
    assert q.shape == (3, base.args.vocab_size)
    torch.testing.assert_close(q.sum(-1), torch.ones(3))
    assert all(q[j, t] > 0 for j, t in enumerate(drafts[0]))
    assert ((q > 0).sum(-1) <= 20).all()  # top-k applied
    outside = torch.ones(base.args.vocab_size, dtype=torch.bool)
    outside[proposer.mtp.draft_vocab_ids] = False
    assert (q[:, outside] == 0).all()  # never drafts outside the draft vocabulary


def test_sampled_drafts_follow_the_returned_q(base, random_mtp):
    """The verifier is lossless only if q is the law the draft was drawn from: the first draft's
    empirical law over many draws must match the returned q (chi-square)."""
    from scipy.stats import chisquare

    proposer = _proposer(base, random_mtp, k=1)
    hidden = torch.randn(base.args.hidden_size, generator=torch.Generator().manual_seed(3))
    params = SamplingParams(decode_strategy="sampling", temperature=2.0, top_k=6)
    n = 600
    seqs = [SimpleNamespace(last_hidden=hidden, tokens=[7], params=params,
                            generator=torch.Generator().manual_seed(i)) for i in range(n)]
    proposal = proposer.propose(seqs, [1] * n)
    drafts, probs = proposal.token_lists(), proposal.draft_probs
    q = probs[0][0]
    assert all(torch.equal(p[0], q) for p in probs)
    support = q.nonzero().flatten().tolist()
    counts = [sum(d[0] == t for d in drafts) for t in support]
    assert sum(counts) == n
    mass = float(q[support].sum())
    assert abs(mass - 1) < 1e-5
    exp = [float(q[t]) for t in support]
    exp = [e * n / sum(exp) for e in exp]
    assert chisquare(counts, exp).pvalue > 1e-3


def test_sampling_is_lossless_chi_square(base, random_mtp):
    """Joint law of the first two sampled tokens with MTP speculation (the second comes from
    verifying a sampled draft) against the exact target law computed from the base's logits.
    The untrained MTP's q is far from p, so wrong draft probs would show (a uniform q, i.e.
    always accepting, fails this test)."""
    from scipy.stats import chisquare

    prompt, top_k, temp, n_runs = [40, 41, 42, 43], 4, 1.5, 1200
    with torch.no_grad():
        h = base(torch.tensor(prompt), torch.arange(len(prompt)), DenseCausalAttention(1, len(prompt)))
        p1 = logits_to_probs(base.compute_logits(h[-1:]), torch.tensor([temp]), torch.tensor([top_k]))[0]
        firsts = p1.nonzero().flatten().tolist()
        expected = {}
        for a in firsts:
            ids = torch.tensor(prompt + [a])
            h = base(ids, torch.arange(len(ids)), DenseCausalAttention(1, len(ids)))
            p2 = logits_to_probs(base.compute_logits(h[-1:]), torch.tensor([temp]), torch.tensor([top_k]))[0]
            for b in p2.nonzero().flatten().tolist():
                expected[(a, b)] = float(p1[a] * p2[b])
    params = SamplingParams(decode_strategy="sampling", temperature=temp, top_k=top_k, seed=1234, max_new_tokens=4)
    outs, seqs = _decode(base, [prompt] * n_runs, _proposer(base, random_mtp, k=2), batch=64, params=params)
    assert sum(s.stats.drafted for s in seqs) >= n_runs  # the second token went through verification
    assert 0 < sum(s.stats.accepted for s in seqs) < sum(s.stats.drafted for s in seqs)
    counts = {}
    for o in outs:
        counts[(o[0], o[1])] = counts.get((o[0], o[1]), 0) + 1
    assert set(counts) <= set(expected)
    cells = sorted(expected, key=lambda c: -expected[c])
    big = [c for c in cells if expected[c] * n_runs >= 5]
    obs = [counts.get(c, 0) for c in big] + [n_runs - sum(counts.get(c, 0) for c in big)]
    exp = [expected[c] * n_runs for c in big] + [n_runs * (1 - sum(expected[c] for c in big))]
    if exp[-1] < 1e-9:
        obs, exp = obs[:-1], exp[:-1]
    exp = [e * sum(obs) / sum(exp) for e in exp]  # exact totals for scipy
    assert chisquare(obs, exp).pvalue > 1e-3


def test_factory_refuses_bad_draft_model(base, tiny_llama_dir, tmp_path, random_mtp):
    loaded = SimpleNamespace(model=base)
    with pytest.raises(QuantSpecError, match="not an MTP module"):
        build_mtp_proposer(SimpleNamespace(draft_model=str(tiny_llama_dir), speculate_max_draft_token_num=3), loaded)
    with pytest.raises(QuantSpecError, match="--draft-model"):
        build_mtp_proposer(SimpleNamespace(draft_model=None, speculate_max_draft_token_num=3), loaded)
    other, _ = load_model(build_tiny_model(tmp_path / "wide", "llama", hidden=96, heads=4, kv_heads=2))
    with pytest.raises(QuantSpecError, match="hidden size"):
        build_mtp_proposer(SimpleNamespace(draft_model=str(random_mtp), speculate_max_draft_token_num=3),
                           SimpleNamespace(model=other))


def test_unbound_module_is_refused(base):
    from quantspec.model_zoo.mtp import MTPArgs, MTPModule

    with pytest.raises(QuantSpecError, match="bind_base"):
        MTPProposer(MTPModule(MTPArgs.for_base(base.args)))


@pytest.mark.parametrize("quant_type", ["weight_only_int8", "weight_only_int4"])
def test_quantized_mtp_artifact_drafts_losslessly(base, trained_mtp, tmp_path, quant_type):
    """An MTP quantized on its own (compressed-tensors artifact) loads, drafts, stays lossless."""
    import json

    from quantspec.calib.ptq import quantize_model
    from quantspec.model_zoo.mtp import load_mtp
    from quantspec.quant.presets import preset
    from quantspec.quant.artifact import write_artifact

    mtp = load_mtp(trained_mtp)
    res = quantize_model(mtp, preset(quant_type, group_size=32), "rtn")
    cfg = json.loads((trained_mtp / "config.json").read_text())
    cfg["quantization_config"] = res.config.to_dict()
    out = write_artifact(tmp_path / "mtp.q", res.tensors, cfg)
    proposer = _proposer(base, out)
    assert type(proposer.mtp.model.eh_proj).__name__ == "QuantLinear"
    plain, _ = _decode(base, PROMPTS, None, batch=1)
    spec, seqs = _decode(base, PROMPTS, proposer, batch=3)
    assert spec == plain
    assert sum(s.stats.accepted for s in seqs) > 0


def test_predictor_runs_mtp_losslessly(tiny_llama_dir, trained_mtp):
    """`quantspec infer --speculate-method mtp --draft-model DIR` end to end (loader + factory)."""
    from quantspec.infer.predictor import InferConfig, Predictor

    prompts = ["Tell me about the sea.", "What is two plus two?"]
    common = dict(model=str(tiny_llama_dir), max_new_tokens=24, max_length=256, batch_size=2)
    plain, _ = Predictor(InferConfig(**common)).run(prompts)
    spec, stats = Predictor(InferConfig(speculate_method="mtp", draft_model=str(trained_mtp),
                                        speculate_max_draft_token_num=3, **common)).run(prompts)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert stats["drafted_tokens"] > 0 and len(stats["acceptance_per_position"]) >= 1


def test_confidence_gate_is_lossless_and_drops_unsure_drafts(base, trained_mtp):
    """min_confidence stops a sequence's chain at its first unsure draft: fewer drafts as the
    threshold rises, every draft made is one the module was sure of, and greedy output is unchanged."""
    plain, _ = _decode(base, PROMPTS, None, batch=1)
    drafted = []
    for tau in (0.0, 0.9, 0.999):
        prop = _proposer(base, trained_mtp)
        prop.min_confidence = tau
        out, seqs = _decode(base, PROMPTS, prop, batch=3)
        assert out == plain
        drafted.append(sum(s.stats.drafted for s in seqs))
    assert drafted[0] > drafted[1] > drafted[2]
    # a direct call: each returned draft had top probability >= tau at its depth
    prop = _proposer(base, trained_mtp)
    prop.min_confidence = 0.4
    _, seqs = _decode(base, PROMPTS[:1], None, batch=1, n=8)
    seq = seqs[0]
    seq.last_hidden = base(torch.tensor(seq.tokens[:-1]), torch.arange(seq.num_tokens - 1),
                           DenseCausalAttention(1, seq.num_tokens - 1))[-1]
    (draft,) = prop.propose([seq], [4]).token_lists()
    assert draft  # the trained module is sure of its first draft here
    mtp, h, tok = prop.mtp, seq.last_hidden[None], torch.tensor([seq.tokens[-1]])
    with torch.no_grad():
        for d in draft:
            h = mtp(h, tok)
            p = torch.softmax(mtp.draft_logits(h).float(), -1)
            assert p.max() >= 0.4 and int(mtp.draft_vocab_ids[p.argmax()]) == d
            tok = torch.tensor([d])


def test_confidence_gate_config_errors():
    from quantspec.infer.predictor import MTP_MIN_CONFIDENCE, InferConfig

    assert InferConfig(speculate_method="mtp", draft_model="x").speculate_min_confidence == MTP_MIN_CONFIDENCE
    assert InferConfig().speculate_min_confidence == 0.0
    with pytest.raises(QuantSpecError, match="applies to --speculate-method mtp, eagle and medusa"):
        InferConfig(speculate_method="draft", speculate_min_confidence=0.3)
    with pytest.raises(QuantSpecError, match=r"must be in \[0, 1\)"):
        InferConfig(speculate_method="mtp", speculate_min_confidence=1.5)


def test_mtp_backoff_probes_often_but_cheaply(base, random_mtp):
    """The MTP back-off remembers more tests and probes within 8 steps; its worst-case overhead
    (a probe every max_probe_interval steps, never accepted) stays a few percent of plain decoding."""
    from quantspec.infer.spec.mtp import MTP_BACKOFF_DECAY, MTP_MAX_PROBE_INTERVAL

    loaded = SimpleNamespace(model=base)
    proposer, _ = build_mtp_proposer(SimpleNamespace(draft_model=str(random_mtp), speculate_max_draft_token_num=1),
                                     loaded)
    pol = proposer.policy
    assert pol.decay == MTP_BACKOFF_DECAY == 0.9 and pol.max_probe_interval == MTP_MAX_PROBE_INTERVAL == 8
    assert pol.probe_k == 1
    worst = (pol.cost.step_cost(pol.probe_k) - 1.0) / pol.max_probe_interval
    assert 0 < worst < 0.1, worst
