"""The load-aware draft cap (`infer/spec/load.py`) with literal step costs, and through the engine:
any cap keeps greedy outputs."""

import pytest
import torch

from quantspec.infer.engine import Engine, EngineConfig, StepInfo
from quantspec.infer.sampler import SamplingParams
from quantspec.infer.spec.load import LoadAwareDrafts, StepCosts, measure_step_costs
from quantspec.infer.spec.proposers import ReferenceProposer


def _costs(table: dict[int, float]) -> StepCosts:
    c = StepCosts()
    for rows, s in table.items():
        c.add(rows, s)
    return c


def test_step_costs_interpolate_and_extrapolate():
    c = _costs({1: 0.030, 4: 0.036, 16: 0.080})
    assert c.estimate(4) == pytest.approx(0.036)
    assert c.estimate(10) == pytest.approx(0.058)  # halfway between 4 and 16
    assert c.estimate(32) == pytest.approx(0.160)  # beyond: proportional to the largest seen
    assert StepCosts().estimate(3) is None
    c.add(4, 0.046)  # an EMA: moves towards new measurements
    assert 0.036 < c.estimate(4) < 0.046


# CPU-like: a few rows ride along with the weight stream, many rows are compute
CPU = {1: 0.030, 2: 0.031, 4: 0.033, 6: 0.035, 8: 0.040, 16: 0.080, 32: 0.160, 64: 0.320, 96: 0.480}


def test_drafts_at_low_load_none_where_rows_cost_more_than_they_save():
    policy = LoadAwareDrafts(5, _costs(CPU))
    assert policy.best_cap(1) >= 3
    assert policy.best_cap(16) == 0


def test_acceptance_estimates_move_the_cap():
    policy = LoadAwareDrafts(5, _costs(CPU), decay=0.5)
    step = StepInfo(True, 6, 1, 5, 0.035)
    for accepted, want in ((0, 0), (5, 5)):  # every draft rejected, then every draft accepted
        for _ in range(30):
            policy.last_cap = 5
            policy.observe(step, [object()], [[1, 2, 3, 4, 5]], [accepted])
        assert policy.best_cap(1) == want


def test_probes_back_off():
    policy = LoadAwareDrafts(5, _costs(CPU), probe_interval=2, max_probe_interval=8)
    caps = [policy.cap(16) for _ in range(40)]
    probes = [i for i, k in enumerate(caps) if k]
    assert caps[probes[0]] == policy.probe_k
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert gaps == sorted(gaps) and gaps[-1] == 9  # doubling up to max_probe_interval


def test_any_cap_keeps_greedy_outputs_and_the_costs_are_measured(tiny_llama_model):
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 60, (n,), generator=g).tolist() * 3 for n in (7, 12, 5)]

    def run(limit):
        eng = Engine(tiny_llama_model, EngineConfig(block_size=16, max_batch_size=3, max_length=256,
                                                    spec_max_draft_tokens=4),
                     eos_token_ids=[], proposer=ReferenceProposer(3, 4))
        if limit is not None:
            eng.draft_limit = limit(eng)
        seqs = [eng.add_request(p, SamplingParams(max_new_tokens=20)) for p in prompts]
        eng.run()
        return [s.output_ids for s in seqs], eng

    plain, _ = run(None)
    fixed = _costs({1: 1.0, 100: 1.0})  # rows free: always the most drafts
    out, eng = run(lambda e: LoadAwareDrafts(4, fixed))
    assert out == plain and eng.draft_limit.last_cap >= 0
    out, eng = run(lambda e: LoadAwareDrafts(4, measure_step_costs(e, 12, repeats=1)))
    assert out == plain and eng.draft_limit.costs.estimate(12) > 0


def test_measured_step_rates_veto_drafts_that_do_not_pay_and_plain_steps_keep_them_current():
    policy = LoadAwareDrafts(5, _costs(CPU), plain_every=4)
    assert policy.best_cap(1) > 0
    seqs = [object()]
    assert policy.cap(1) == 0  # no plain rate measured yet: a plain step first
    policy.observe(StepInfo(True, 1, 1, 0, 0.030), seqs, [[]], [0])  # 33 tok/s without drafts
    caps = []
    for _ in range(10):  # with drafts: 2 tokens per 0.035 s = 57 tok/s
        caps.append(k := policy.cap(1))
        policy.observe(StepInfo(True, 1 + k, 1, k, 0.035 if k else 0.030), seqs, [[7] * k], [min(k, 1)])
    assert caps.count(0) == 2 and caps[0] > 0  # one plain step in every plain_every + 1
    for _ in range(40):  # now the steps with drafts are slow: 2 tokens per 0.2 s
        k = policy.cap(1)
        policy.observe(StepInfo(True, 1 + k, 1, k, 0.2 if k else 0.030), seqs, [[7] * k], [min(k, 1)])
    assert policy.measured_rate(1, True) < policy.measured_rate(1, False)
    assert [policy.cap(1) for _ in range(5)] == [0] * 5
