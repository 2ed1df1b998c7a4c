"""A KV cache smaller than the batch (`kv_cache_memory`): the scheduler admits what the free
blocks hold, preempts the newest sequence when a decoding one needs a block, and readmits it
with a prefill of every token it had. Its answers are the ones transformers gives each prompt
alone, with every drafter, and a sampled answer is the one an unbounded cache gives."""

import pytest
import torch

from quantspec.errors import QuantSpecError
from quantspec.infer.engine import Engine, EngineConfig
from quantspec.infer.kv_cache import BlockAllocator, kv_block_bytes
from quantspec.infer.sampler import SamplingParams
from quantspec.infer.scheduler import Scheduler
from quantspec.infer.sequence import Sequence
from quantspec.infer.spec.draft import DraftModelProposer
from quantspec.infer.spec.mtp import MTPProposer
from quantspec.infer.spec.proposers import ReferenceProposer
from quantspec.sizes import format_size, parse_size

torch.set_num_threads(1)

BS, MAX_LEN = 8, 64


def _block_bytes(model):
    a = model.args
    return kv_block_bytes(num_layers=a.num_layers, block_size=BS, num_kv_heads=a.num_kv_heads, head_dim=a.head_dim,
                          dtype=torch.float32)


def _prompts(lengths, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 500, (n,), generator=g).tolist() for n in lengths]


def _engine(model, blocks=None, proposer=None, k=0, **kw):
    memory = None if blocks is None else blocks * _block_bytes(model)
    config = EngineConfig(block_size=BS, max_batch_size=4, max_length=MAX_LEN, kv_cache_memory=memory,
                          spec_max_draft_tokens=k, **kw)
    return Engine(model, config, eos_token_ids=[], proposer=proposer)


def _serve(eng, prompts, params):
    seqs = [eng.add_request(p, params, request_index=i) for i, p in enumerate(prompts)]
    eng.run()
    return seqs


def test_sizes_read_and_print_as_users_write_them():
    assert parse_size("512MiB", "--kv-cache-memory") == 512 * 2**20
    assert parse_size("2g", "--kv-cache-memory") == 2 * 2**30 and parse_size(".5 KB", "--x") == 500
    for bad in ("4", "GiB", "4 parsecs", "-1GiB", "0MiB"):
        with pytest.raises(QuantSpecError, match="--kv-cache-memory"):
            parse_size(bad, "--kv-cache-memory")
    assert format_size(640) == "640 B" and format_size(5 * 2**30) == "5 GiB"


def test_the_scheduler_preempts_the_newest_and_queues_it_first():
    config = EngineConfig(block_size=4, max_batch_size=3, max_length=12, kv_cache_memory=6 * 100)
    sched = Scheduler(config, BlockAllocator(config.blocks_needed(100)))  # 5 usable blocks of 4
    assert sched.bounded and sched.watermark == 1
    seqs = [Sequence(i, [5] * 5, SamplingParams(max_new_tokens=8)) for i in range(3)]
    sched.waiting = list(seqs)
    # 2 blocks each (prompt and first token); the third waits: 1 left, the watermark
    assert [s.seq_id for s, _ in sched.plan()] == [0, 1]
    s0, s1 = seqs[:2]
    s0.output_ids, s0.num_cached = [7] * 3, 7  # 8 tokens: its next position is in its 2nd block
    s1.output_ids, s1.num_cached = [7] * 4, 8  # 9 tokens: it takes the last free block
    assert [s.seq_id for s, _ in sched.plan()] == [0, 1] and sched.num_preemptions == 0
    s0.output_ids, s0.num_cached = [7] * 4, 8  # needs a 3rd block: s1, the newest, gives its blocks back
    assert [s.seq_id for s, _ in sched.plan()] == [0]
    assert sched.num_preemptions == 1 and [s.seq_id for s in sched.waiting] == [1, 2]
    assert s1.num_cached == 0 and s1.prefill_len == s1.num_tokens == 9 and s1.prefilling
    assert not s1.block_table and len(s0.block_table) == 3 and sched.allocator.num_free == 2


def test_a_cache_smaller_than_one_sequence_is_refused(tiny_llama_model):
    with pytest.raises(QuantSpecError, match="raise --kv-cache-memory or lower --max-length"):
        _engine(tiny_llama_model, blocks=5)


@pytest.mark.parametrize("kw", [{}, {"prefill_chunk": 8}, {"prefix_caching": True}])
def test_preempted_sequences_answer_as_transformers(tiny_llama_model, hf_greedy, kw):
    prompts = _prompts([10, 14, 7, 12, 9, 11], seed=1)
    eng = _engine(tiny_llama_model, blocks=12, **kw)
    seqs = _serve(eng, prompts, SamplingParams(max_new_tokens=40))
    assert eng.scheduler.num_preemptions >= 3
    assert [s.output_ids for s in seqs] == [hf_greedy(p, 40) for p in prompts]
    assert eng.cache.allocator.num_free == eng.cache.num_blocks - 1


def test_sampled_answers_and_prompt_logprobs_survive_a_preemption(tiny_llama_model):
    prompts = _prompts([10, 14, 7, 12], seed=2)
    params = SamplingParams(decode_strategy="sampling", temperature=0.8, top_p=0.9, seed=11, max_new_tokens=40,
                            prompt_logprobs=1, logprobs=1)
    roomy = _serve(_engine(tiny_llama_model), prompts, params)
    eng = _engine(tiny_llama_model, blocks=12)
    tight = _serve(eng, prompts, params)
    assert eng.scheduler.num_preemptions > 0
    assert [s.output_ids for s in tight] == [s.output_ids for s in roomy]
    for a, b in zip(tight, roomy):
        assert len(a.prompt_logprobs) == len(a.prompt_ids) and len(a.logprobs) == 40
        assert [lp.logprob for lp in a.prompt_logprobs[1:]] == pytest.approx(
            [lp.logprob for lp in b.prompt_logprobs[1:]], abs=1e-4)
        assert [lp.logprob for lp in a.logprobs] == pytest.approx([lp.logprob for lp in b.logprobs], abs=1e-4)


def _drafters(base, close_draft, answers):
    from quantspec.model_zoo.eagle3_train import init_eagle3
    from quantspec.model_zoo.mtp import MTPArgs, MTPModule
    from quantspec.infer.spec.eagle import EagleProposer

    mtp = MTPModule(MTPArgs.for_base(base.args))
    mtp.bind_base(base)
    return {
        "ngram": ReferenceProposer(max_ngram_size=2, max_draft_tokens=4),
        "draft": DraftModelProposer(close_draft, vocab_size=512, target_vocab_size=512, max_draft_tokens=4,
                                    max_batch_size=4, max_length=MAX_LEN, block_size=BS),
        "mtp": MTPProposer(mtp, max_draft_tokens=4),
        "eagle": EagleProposer(init_eagle3(base, torch.arange(0, 512, 2), (0, 1, 2)), max_draft_tokens=4),
        "oracle": answers,
    }


@pytest.mark.parametrize("method, prefix", [("ngram", False), ("draft", False), ("mtp", False), ("eagle", False),
                                            ("oracle", False), ("eagle", True), ("oracle", True)])
def test_speculation_stays_lossless_across_preemptions(tiny_llama_model, close_draft, hf_greedy, answer_oracle,
                                                       method, prefix):
    """With prefix caching a readmitted sequence finds its own blocks again (EAGLE-3's head: its
    rows of them too)."""
    prompts = _prompts([10, 14, 7, 12, 9], seed=3)
    prompts[0] = prompts[0][:5] * 2  # something for the n-gram drafter to find
    want = [hf_greedy(p, 40) for p in prompts]
    proposer = _drafters(tiny_llama_model, close_draft, answer_oracle(want))[method]
    # with prefix caching, a cache of 18 blocks still preempts and keeps some blocks of the preempted
    eng = _engine(tiny_llama_model, blocks=18 if prefix else 13, proposer=proposer, k=4, prefix_caching=prefix)
    seqs = _serve(eng, prompts, SamplingParams(max_new_tokens=40))
    assert eng.scheduler.num_preemptions > 0
    assert [s.output_ids for s in seqs] == want
    if method in ("draft", "oracle"):
        assert sum(s.stats.accepted for s in seqs) > 0
    if prefix:  # readmitted sequences found their own blocks (and EAGLE-3's head filed its rows of blocks)
        assert eng.cache.allocator.hits > 0 and (method != "eagle" or len(proposer.blocks) > 0)


def test_infer_reports_preemptions_and_answers_as_an_unbounded_cache(tiny_llama_dir):
    from quantspec.infer.predictor import InferConfig, Predictor

    srcs = [f"Tell me about the number {i} and why it matters." for i in range(6)]
    common = dict(model=str(tiny_llama_dir), batch_size=6, max_length=96, max_new_tokens=48, block_size=8,
                  chat_template=False, ignore_eos=True)
    roomy, roomy_stats = Predictor(InferConfig(**common)).run(srcs)
    tight, stats = Predictor(InferConfig(**common, kv_cache_memory="200KiB")).run(srcs)
    assert [o.token_ids for o in tight] == [o.token_ids for o in roomy]
    assert stats["preemptions"] == sum(o.preemptions for o in tight) > 0 and "preemptions" not in roomy_stats


def test_a_device_budget_cuts_only_a_cache_that_would_not_fit():
    config = EngineConfig(block_size=16, max_batch_size=8, max_length=100)  # 7 blocks a sequence, 57 in all
    assert config.blocks_needed(1000, device_budget=10**6) == 57          # fits: the default size
    assert config.blocks_needed(1000, device_budget=20_500) == 20          # cut to the budget
    with pytest.raises(QuantSpecError, match="raise --gpu-memory-utilization or lower --max-length"):
        config.blocks_needed(1000, device_budget=5_000)
    assert EngineConfig(kv_cache_memory=64_000, max_length=100, block_size=16).blocks_needed(1000, 10**9) == 64
    with pytest.raises(QuantSpecError, match="--gpu-memory-utilization"):
        EngineConfig(gpu_memory_utilization=1.5)
