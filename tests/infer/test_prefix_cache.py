"""Automatic prefix caching: the allocator with literal hashes (no model), then the engine against
transformers: a prompt that starts with cached blocks skips their prefill and still gets the
tokens and log-probabilities transformers gives the whole prompt."""

import pytest
import torch

from quantspec.errors import QuantSpecError
from quantspec.infer.engine import Engine, EngineConfig
from quantspec.infer.prefix_cache import PrefixCachingAllocator, block_hashes
from quantspec.infer.sampler import SamplingParams


def test_block_hashes_name_whole_prefixes():
    a = block_hashes([5, 6, 7, 8, 9], 2)
    assert len(a) == 2 and len(set(a)) == 2 and all(len(h) == 16 for h in a)
    assert block_hashes([5, 6, 7, 8, 1], 2) == a  # the partial block is not hashed
    assert block_hashes([5, 6, 7, 9], 2)[0] == a[0] and block_hashes([5, 6, 7, 9], 2)[1] != a[1]
    assert block_hashes([7, 8], 2)[0] != a[1]  # same tokens at other positions: another prefix
    assert block_hashes([5, 6, 7, 8, 9, 9], 2, start=a[:1]) == block_hashes([5, 6, 7, 8, 9, 9], 2)
    assert block_hashes([5, 6, 7, 8], 2, num_blocks=1) == a[:1]


def test_allocator_matches_holds_and_evicts_least_recently_freed_first():
    alloc = PrefixCachingAllocator(num_blocks=5, block_size=2)  # block 0 is the padding block: 4 usable
    h = block_hashes([1, 2, 3, 4, 5, 6], 2)
    blocks = alloc.allocate(3)
    for b, hh in zip(blocks, h):
        alloc.register(b, hh)
    assert alloc.match(h[:2], 5) == blocks[:2]       # held twice now
    alloc.free(blocks)                               # the first holder leaves
    assert alloc.num_free == 2 and alloc.num_cached == 3  # one plain free block + block 3 evictable
    assert (alloc.queries, alloc.hits) == (5, 4)
    other = block_hashes([9, 9], 2)
    assert alloc.match(other, 3) == []
    alloc.free(blocks[:2])                           # the second holder leaves: all three evictable
    assert alloc.num_free == 4
    fresh = alloc.allocate(2)                        # the plain free block, then the oldest evictable
    assert blocks[2] in fresh and alloc.num_cached == 2
    assert alloc.match(h, 6) == blocks[:2]           # the first two are still found
    with pytest.raises(QuantSpecError, match="KV cache is full"):
        alloc.allocate(1)
    assert alloc.num_cached == 2                     # a refused allocation evicts nothing


def test_a_second_block_with_the_same_prefix_stays_private():
    alloc = PrefixCachingAllocator(num_blocks=4, block_size=2)
    h = block_hashes([1, 2], 2)
    a, b = alloc.allocate(1) + alloc.allocate(1)
    alloc.register(a, h[0])
    alloc.register(b, h[0])
    alloc.free([b])
    assert alloc.num_cached == 1 and alloc.match(h, 3) == [a]


def _prompts(lengths, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 500, (n,), generator=g).tolist() for n in lengths]


def _engine(model, **kw):
    kw = {"block_size": 8, "max_batch_size": 4, "max_length": 256, "prefix_caching": True, **kw}
    return Engine(model, EngineConfig(**kw), eos_token_ids=[])


def _fed_rows(eng):
    """The engine, counting the prompt rows each prefill step feeds."""
    fed = []
    step = eng.step

    def counting():
        out = step()
        if eng.last_step is not None and not eng.last_step.decode:
            fed.append(eng.last_step.rows)
        return out

    eng.step = counting
    return fed


@pytest.mark.parametrize("chunk", [None, 8])
def test_a_prompt_on_cached_blocks_skips_them_and_answers_as_transformers(tiny_llama_model, hf_greedy, hf_logprobs,
                                                                       chunk):
    system, q1, q2 = _prompts([21, 5, 11], seed=3)
    eng = _engine(tiny_llama_model, prefill_chunk=chunk)
    fed = _fed_rows(eng)
    first = eng.add_request(system + q1, SamplingParams(max_new_tokens=6))
    eng.run()
    assert first.stats.cached_tokens == 0
    second = eng.add_request(system + q2, SamplingParams(max_new_tokens=10, logprobs=2))
    fed.clear()
    eng.run()
    assert second.stats.cached_tokens == 16  # two whole blocks of the shared 21 tokens
    assert sum(fed) == len(system + q2) - 16
    assert second.output_ids == hf_greedy(system + q2, 10)
    ref = hf_logprobs(system + q2 + second.output_ids)
    for j, lp in enumerate(second.logprobs):
        assert lp.logprob == pytest.approx(float(ref[len(system + q2) - 1 + j, lp.token_id]), abs=1e-4)


def test_the_next_turn_of_a_chat_reuses_the_answer_s_blocks(tiny_llama_model, hf_greedy, answer_oracle):
    """Turn two's prompt is turn one's prompt and answer and more: it finds the blocks the answer
    filled (emitted tokens are committed), also where the answer came from verified drafts, but
    not the block of the answer's last token, whose keys and values no forward wrote."""
    prompt, more = _prompts([12, 6], seed=5)
    answer = hf_greedy(prompt, 20)
    eng = Engine(tiny_llama_model, EngineConfig(block_size=8, max_batch_size=2, max_length=256, prefix_caching=True,
                                                spec_max_draft_tokens=4),
                 eos_token_ids=[], proposer=answer_oracle([answer, []]))
    one = eng.add_request(prompt, SamplingParams(max_new_tokens=20))
    eng.run()
    assert one.output_ids == answer and one.stats.accepted > 0
    turn2 = prompt + answer + more
    two = eng.add_request(turn2, SamplingParams(max_new_tokens=8))
    eng.run()
    assert two.stats.cached_tokens == 24  # 12 + 20 tokens fill 4 blocks, the 4th without its last position
    assert two.output_ids == hf_greedy(turn2, 8)


def test_concurrent_prompts_share_nothing_until_one_is_prefilled_and_blocks_outlive_their_sequence(
        tiny_llama_model, hf_greedy):
    system, a, b, c = _prompts([17, 3, 4, 5], seed=7)
    eng = _engine(tiny_llama_model)
    s1, s2 = (eng.add_request(system + q, SamplingParams(max_new_tokens=5)) for q in (a, b))
    eng.step()  # both prefill in one step: neither finds the other's blocks
    s3 = eng.add_request(system + c, SamplingParams(max_new_tokens=5))
    eng.run()
    assert (s1.stats.cached_tokens, s2.stats.cached_tokens, s3.stats.cached_tokens) == (0, 0, 16)
    assert eng.cache.allocator.num_free == eng.cache.num_blocks - 1  # every block back (findable ones evictable)
    for s, q in ((s1, a), (s2, b), (s3, c)):
        assert s.output_ids == hf_greedy(system + q, 5)


def test_a_full_cache_evicts_old_prefixes_and_stays_exact(tiny_llama_model, hf_greedy):
    """A cache of 12 blocks serves distinct prompts one after another: old blocks are evicted as
    new ones are needed, and a prompt seen again finds what is left of it."""
    prompts = _prompts([30, 30, 30], seed=9)
    eng = _engine(tiny_llama_model, max_batch_size=1, max_length=40, num_blocks=12)
    outs = []
    for p in prompts + prompts[:1]:
        s = eng.add_request(p, SamplingParams(max_new_tokens=4))
        eng.run()
        outs.append((s.output_ids, s.stats.cached_tokens))
    assert outs[0][1] == 0 and outs[3][1] == 0  # prompt 0's blocks went to prompts 1 and 2
    again = eng.add_request(prompts[2], SamplingParams(max_new_tokens=4))
    eng.run()
    assert again.stats.cached_tokens == 24  # (30 - 1) // 8 blocks of the last prompt but one remain
    for (out, _), p in zip(outs + [(again.output_ids, 0)], prompts + prompts[:1] + prompts[2:]):
        assert out == hf_greedy(p, 4)


def test_a_request_for_prompt_logprobs_prefills_everything(tiny_llama_model, hf_logprobs):
    prompt = _prompts([20], seed=11)[0]
    eng = _engine(tiny_llama_model)
    eng.add_request(prompt, SamplingParams(max_new_tokens=2))
    eng.run()
    s = eng.add_request(prompt, SamplingParams(max_new_tokens=2, prompt_logprobs=0))
    eng.run()
    ref = hf_logprobs(prompt)
    assert s.stats.cached_tokens == 0 and s.prompt_logprobs[0] is None
    got = torch.tensor([lp.logprob for lp in s.prompt_logprobs[1:]])
    want = torch.tensor([float(ref[i, t]) for i, t in enumerate(prompt[1:])])
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


def test_prefix_caching_is_refused_with_a_reader_of_every_prompt_row(tiny_llama_model):
    class Reader:
        needs_hidden = False

        def capture_layers(self, num_layers):
            return (0,)

    with pytest.raises(QuantSpecError, match="--enable-prefix-caching"):
        Engine(tiny_llama_model, EngineConfig(block_size=8, prefix_caching=True, spec_max_draft_tokens=2),
               proposer=Reader())
    with pytest.raises(QuantSpecError, match="--enable-prefix-caching"):
        _engine(tiny_llama_model, all_hidden_rows=True)
