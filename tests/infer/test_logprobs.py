"""Token log-probabilities from the engine against transformers' own log-softmax of the same
checkpoint: prompt and output tokens, greedy and sampled, whole and chunked prefill, next to a
sequence that asks for none, and through speculation (chains and token trees, every draft
accepted), which must not change them."""

from __future__ import annotations

import pytest
import torch

from quantspec.errors import QuantSpecError
from quantspec.infer.engine import Engine, EngineConfig
from quantspec.infer.logprobs import token_logprobs
from quantspec.infer.sampler import MAX_LOGPROBS, SamplingParams

ATOL = 1e-4


def _check(seq, ref: torch.Tensor, n: int, prompt: bool) -> None:
    P = len(seq.prompt_ids)
    assert len(seq.logprobs) == len(seq.output_ids)
    for j, (lp, t) in enumerate(zip(seq.logprobs, seq.output_ids)):
        row = ref[P - 1 + j]
        assert lp.token_id == t and abs(lp.logprob - float(row[t])) < ATOL
        assert int((row > row[t] + ATOL).sum()) + 1 <= lp.rank <= int((row > row[t] - ATOL).sum()) + 1
        want = row.topk(n)
        assert [i for i, _ in lp.top] == want.indices.tolist()
        assert torch.allclose(torch.tensor([v for _, v in lp.top]), want.values, atol=ATOL)
    if prompt:
        assert len(seq.prompt_logprobs) == P and seq.prompt_logprobs[0] is None
        got = torch.tensor([lp.logprob for lp in seq.prompt_logprobs[1:]])
        want = ref[torch.arange(P - 1), torch.tensor(seq.prompt_ids[1:], dtype=torch.int64)]
        assert torch.allclose(got, want, atol=ATOL)
        assert all(lp.token_id == t for lp, t in zip(seq.prompt_logprobs[1:], seq.prompt_ids[1:]))
    else:
        assert seq.prompt_logprobs == []


@pytest.mark.parametrize("chunk", [None, 7])
@pytest.mark.parametrize("strategy", ["greedy", "sampling"])
def test_prompt_and_output_logprobs_equal_transformers(tiny_llama_model, hf_logprobs, chunk, strategy):
    eng = Engine(tiny_llama_model, EngineConfig(block_size=16, max_batch_size=4, max_length=128, prefill_chunk=chunk),
                 eos_token_ids=[])
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (23, 9, 1)]
    asks = [SamplingParams(decode_strategy=strategy, max_new_tokens=10, logprobs=3, prompt_logprobs=2, seed=1),
            SamplingParams(max_new_tokens=6),  # asks for nothing
            SamplingParams(decode_strategy=strategy, max_new_tokens=5, logprobs=0, prompt_logprobs=0, seed=2)]
    seqs = [eng.add_request(p, a, request_index=i) for i, (p, a) in enumerate(zip(prompts, asks))]
    eng.run()
    _check(seqs[0], hf_logprobs(seqs[0].tokens), 3, prompt=True)
    _check(seqs[2], hf_logprobs(seqs[2].tokens), 0, prompt=True)
    assert seqs[1].logprobs == [] and seqs[1].prompt_logprobs == []
    assert seqs[2].prompt_logprobs == [None]  # a one-token prompt: nothing predicts it


def test_asking_for_logprobs_does_not_change_the_tokens(tiny_llama_model):
    g = torch.Generator().manual_seed(6)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (12, 30)]

    def run(**kw):
        eng = Engine(tiny_llama_model, EngineConfig(block_size=16, max_batch_size=2, max_length=128), eos_token_ids=[])
        seqs = [eng.add_request(p, SamplingParams(decode_strategy="sampling", max_new_tokens=12, seed=9, **kw),
                                request_index=i) for i, p in enumerate(prompts)]
        eng.run()
        return [s.output_ids for s in seqs]

    assert run() == run(logprobs=5, prompt_logprobs=1)


def _tree_around(answers):
    """Caterpillars of width 2 around the answers: the right token first at each depth (the path
    runs through rows 1, 3, 5, ..., so its keys and values move), a wrong one second."""
    def candidates(s, b):
        ans, at = answers[s.seq_id], len(s.output_ids)
        return [[ans[p], (ans[p] + 1) % 500] for p in range(at, min(len(ans), at + b // 2))]
    return candidates


@pytest.mark.parametrize("tree", [False, True])
def test_speculation_gives_the_plain_logprobs(tiny_llama_model, hf_logprobs, answer_oracle, caterpillar_oracle,
                                               tree):
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (11, 26)]
    params = SamplingParams(max_new_tokens=20, logprobs=2)

    def run(prop=None):
        eng = Engine(tiny_llama_model, EngineConfig(block_size=16, max_batch_size=2, max_length=128,
                                                    spec_max_draft_tokens=6 if prop else 0),
                     eos_token_ids=[], proposer=prop)
        seqs = [eng.add_request(p, params, request_index=i) for i, p in enumerate(prompts)]
        eng.run()
        return seqs

    plain = run()
    answers = [s.output_ids for s in plain]
    spec = run(caterpillar_oracle(_tree_around(answers)) if tree else answer_oracle(answers))
    assert sum(s.stats.accepted for s in spec) > 10
    for p, s in zip(plain, spec):
        assert s.output_ids == p.output_ids
        assert [[i for i, _ in lp.top] for lp in s.logprobs] == [[i for i, _ in lp.top] for lp in p.logprobs]
        assert all(abs(a.logprob - b.logprob) < ATOL for a, b in zip(s.logprobs, p.logprobs))
        _check(s, hf_logprobs(s.tokens), 2, prompt=False)


def test_token_logprobs_rank_top_and_floor():
    logits = torch.tensor([[0.0, 2.0, 1.0, float("-inf")]])
    (lp,) = token_logprobs(logits, [2], 2)
    want = torch.log_softmax(logits, -1)[0]
    assert lp.rank == 2 and abs(lp.logprob - float(want[2])) < 1e-6
    assert [i for i, _ in lp.top] == [1, 2]
    (floor,) = token_logprobs(logits, [3], 0)
    assert floor.logprob == -9999.0 and floor.rank == 4 and floor.top == ()


@pytest.mark.parametrize("field", ["logprobs", "prompt_logprobs"])
@pytest.mark.parametrize("value", [-1, MAX_LOGPROBS + 1, 1.5, True])
def test_bad_logprob_counts_are_refused(field, value):
    with pytest.raises(QuantSpecError, match=field.replace("_", "-")):
        SamplingParams(**{field: value})
