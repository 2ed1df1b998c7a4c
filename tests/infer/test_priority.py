"""The priority scheduling policy: the waiting queue in (priority, arrival) order, a request of a
lower priority value admitted at once by preempting one of a larger value, and answers unchanged
(transformers' for each prompt alone); under fcfs a priority is refused."""

import pytest
import torch

from quantspec.errors import QuantSpecError
from quantspec.infer.engine import Engine, EngineConfig
from quantspec.infer.kv_cache import BlockAllocator
from quantspec.infer.sampler import SamplingParams
from quantspec.infer.scheduler import Scheduler
from quantspec.infer.sequence import Sequence

torch.set_num_threads(1)


def _scheduler(policy, batch=2):
    config = EngineConfig(block_size=16, max_batch_size=batch, max_length=64, scheduling_policy=policy)
    return Scheduler(config, BlockAllocator(config.blocks_needed()))


def _seq(i, priority=0):
    s = Sequence(i, [5] * 6, SamplingParams(max_new_tokens=8))
    s.priority = priority
    return s


def test_the_queue_is_in_priority_then_arrival_order():
    sched = _scheduler("priority", batch=1)
    for i, p in enumerate([1, 0, 1, -1, 0]):
        sched.enqueue(_seq(i, p))
    assert [s.seq_id for s in sched.waiting] == [3, 1, 4, 0, 2]


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_an_urgent_request_preempts_only_under_the_priority_policy(policy):
    sched = _scheduler(policy)
    for i in range(2):
        sched.enqueue(_seq(i))
    sched.plan()
    urgent = _seq(2, priority=-1 if policy == "priority" else 0)
    sched.enqueue(urgent)
    sched.plan()
    running = [s.seq_id for s in sched.running]
    if policy == "priority":
        assert running == [0, 2] and [s.seq_id for s in sched.waiting] == [1] and sched.num_preemptions == 1
    else:
        assert running == [0, 1] and sched.waiting == [urgent] and sched.num_preemptions == 0


def test_equal_priorities_never_preempt_each_other():
    sched = _scheduler("priority")
    for i in range(3):
        sched.enqueue(_seq(i, priority=2))
    sched.plan()
    sched.enqueue(_seq(3, priority=2))
    sched.plan()
    assert [s.seq_id for s in sched.running] == [0, 1] and sched.num_preemptions == 0


def _prompts(lengths, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 500, (n,), generator=g).tolist() for n in lengths]


def test_an_urgent_request_finishes_first_and_every_answer_is_transformers(tiny_llama_model, hf_greedy):
    prompts = _prompts([9, 12, 7], seed=4)
    eng = Engine(tiny_llama_model, EngineConfig(block_size=8, max_batch_size=2, max_length=96,
                                                scheduling_policy="priority"), eos_token_ids=[])
    slow = [eng.add_request(p, SamplingParams(max_new_tokens=40)) for p in prompts[:2]]
    for _ in range(5):
        eng.step()
    urgent = eng.add_request(prompts[2], SamplingParams(max_new_tokens=10), priority=-3)
    finished = []
    while eng.has_work():
        finished += [s.seq_id for s, _ in eng.step() if s.finished]
    assert finished[0] == urgent.seq_id and eng.scheduler.num_preemptions == 1
    assert [s.output_ids for s in slow + [urgent]] == [hf_greedy(p, n) for p, n in zip(prompts, (40, 40, 10))]


def test_a_priority_needs_the_priority_policy(tiny_llama_model):
    eng = Engine(tiny_llama_model, EngineConfig(block_size=8, max_batch_size=2, max_length=32), eos_token_ids=[])
    with pytest.raises(QuantSpecError, match="--scheduling-policy priority"):
        eng.add_request([5, 6], SamplingParams(max_new_tokens=2), priority=1)
    with pytest.raises(QuantSpecError, match="--scheduling-policy"):
        EngineConfig(scheduling_policy="lottery")
