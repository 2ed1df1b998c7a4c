"""The scheduler's plan of each step, with literal prompts (no model), and through the engine: a
long prompt or a burst of arrivals does not hold back the prompts behind it, and the tokens are
those of each prompt alone."""

import pytest
import torch

from quantspec.errors import QuantSpecError
from quantspec.infer.engine import Engine
from quantspec.infer.kv_cache import BlockAllocator
from quantspec.infer.sampler import SamplingParams
from quantspec.infer.scheduler import EngineConfig, Scheduler
from quantspec.infer.sequence import Sequence


def _scheduler(lengths, **kw):
    config = EngineConfig(block_size=16, max_batch_size=8, max_length=256, **kw)
    sched = Scheduler(config, BlockAllocator(config.blocks_needed()))
    sched.waiting = [Sequence(i, [5] * n, SamplingParams(max_new_tokens=4)) for i, n in enumerate(lengths)]
    return sched


def _run_plan(sched):
    """Plan a step and apply what the engine would: prefilled chunks are cached, a finished
    prefill or a decode step gives each of its sequences one token."""
    plan = sched.plan()
    for s, n in plan:
        if n:
            s.num_cached += n
        if not n or s.num_cached == len(s.prompt_ids):
            s.output_ids.append(7)
            s.num_cached = s.num_tokens - 1
    return [(s.seq_id, n) for s, n in plan]


def test_a_long_prompt_gives_one_chunk_per_step_and_the_prompts_behind_it_share_the_step():
    sched = _scheduler([50, 5, 6, 40], prefill_chunk=16, prefill_tokens=40)
    assert _run_plan(sched) == [(0, 16), (1, 5), (2, 6)]   # 27 tokens; 16 more from prompt 3 would pass 40
    assert _run_plan(sched) == [(1, 0), (2, 0)]            # a decode step between prefill steps
    assert _run_plan(sched) == [(0, 16), (3, 16)]
    assert _run_plan(sched) == [(1, 0), (2, 0)]
    assert _run_plan(sched) == [(0, 16), (3, 16)]
    assert _run_plan(sched) == [(1, 0), (2, 0)]
    assert _run_plan(sched) == [(0, 2), (3, 8)]            # the prompts' last chunks


def test_without_chunks_whole_prompts_fill_the_budget_before_any_decode():
    sched = _scheduler([30, 25, 70, 10], prefill_tokens=60)
    assert [_run_plan(sched) for _ in range(4)] == [[(0, 30), (1, 25)], [(2, 70)], [(3, 10)],
                                                    [(0, 0), (1, 0), (2, 0), (3, 0)]]


def test_admission_respects_the_batch_size_and_the_budget_is_checked():
    sched = _scheduler([4] * 10)
    sched.plan()
    assert len(sched.running) == 8 and len(sched.waiting) == 2
    with pytest.raises(QuantSpecError, match="--max-prefill-tokens"):
        EngineConfig(prefill_tokens=0)


def _alone(model, prompt, n):
    eng = Engine(model, EngineConfig(block_size=16, max_batch_size=1, max_length=256), eos_token_ids=[])
    seq = eng.add_request(prompt, SamplingParams(max_new_tokens=n))
    eng.run()
    return seq.output_ids


def test_a_burst_arriving_while_others_decode_gets_its_first_tokens_in_one_prefill_step(tiny_llama_model):
    """Six prompts arrive together while two sequences decode: with a step budget of 64 tokens
    (chunks of 16) they all prefill in one step, the decoding ones keep a decode step between
    prefill steps, and every output is the prompt's alone."""
    model = tiny_llama_model
    lengths = [40, 30, 9, 10, 11, 8, 12, 10]
    ids = torch.randint(3, 500, (sum(lengths),), generator=torch.Generator().manual_seed(4))
    prompts = [p.tolist() for p in ids.split(lengths)]
    eng = Engine(model, EngineConfig(block_size=16, max_batch_size=8, max_length=256, prefill_chunk=16,
                                     prefill_tokens=64), eos_token_ids=[])
    early = [eng.add_request(p, SamplingParams(max_new_tokens=12)) for p in prompts[:2]]
    while not all(s.output_ids for s in early):
        eng.step()
    burst = [eng.add_request(p, SamplingParams(max_new_tokens=6)) for p in prompts[2:]]
    kinds = []
    while not all(s.output_ids for s in burst):
        eng.step()
        kinds.append(eng.last_step.decode)
    assert kinds.count(False) == 1  # 60 prompt tokens: one prefill step (after at most one decode step)
    eng.step()
    assert eng.last_step.decode  # then the decoding sequences' turn
    eng.run()
    for s, p in zip(early + burst, prompts):
        assert s.output_ids == _alone(model, p, s.params.max_new_tokens)
