"""Sampling penalties and logit biases against independent references: the repetition penalty against transformers'
own `RepetitionPenaltyLogitsProcessor` and `generate`, presence and frequency penalties against
OpenAI's formula over transformers' logits; a penalized sequence speculates (each draft row
penalized after the drafts before it) with the answer of plain decoding, beside others in its batch."""

from __future__ import annotations

import pytest
import torch

from quantspec.errors import QuantSpecError
from quantspec.infer.engine import Engine, EngineConfig
from quantspec.infer.sampler import SamplingParams, adjust_logits
from quantspec.infer.spec.proposers import ReferenceProposer


def _engine(model, *, k=0, proposer=None, batch=3):
    return Engine(model, EngineConfig(block_size=16, max_batch_size=batch, max_length=160, spec_max_draft_tokens=k),
                  eos_token_ids=[], proposer=proposer)


def _prompt(n, seed):
    return torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_repetition_penalty_is_transformers_processor():
    from transformers import RepetitionPenaltyLogitsProcessor

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(50, generator=g) * 3
    prompt, output = [3, 7, 7, 11], [11, 20, 3, 42]
    got = adjust_logits(logits.clone(), SamplingParams(repetition_penalty=1.7), prompt, output)
    want = RepetitionPenaltyLogitsProcessor(1.7)(torch.tensor([prompt + output]), logits[None].clone())[0]
    assert torch.allclose(got, want)


def test_presence_and_frequency_penalties_are_openais_formula():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(30, generator=g)
    output = [4, 4, 4, 9, 17, 9]
    got = adjust_logits(logits.clone(), SamplingParams(presence_penalty=0.5, frequency_penalty=-0.3), [1, 2], output)
    want = logits.clone()
    for j in set(output):  # mu[j] - c[j] * alpha_frequency - (c[j] > 0) * alpha_presence
        want[j] -= output.count(j) * -0.3 + 0.5
    assert torch.allclose(got, want)
    assert torch.equal(adjust_logits(logits.clone(), SamplingParams(presence_penalty=2.0), [1, 2], []), logits)


def test_logit_bias_is_added_after_the_penalties():
    logits = torch.linspace(-1, 1, 10)
    params = SamplingParams(logit_bias={3: 5.0, 7: -100}, presence_penalty=1.0)
    want = logits.clone()
    want[4] -= 1.0
    want[3] += 5.0
    want[7] -= 100
    assert torch.allclose(adjust_logits(logits.clone(), params, [], [4]), want)
    assert params.logit_bias == ((3, 5.0), (7, -100.0)) and params.adjusts_logits


def test_greedy_repetition_penalty_equals_transformers_generate(tiny_llama_model, hf_tiny_llama):
    hf = hf_tiny_llama
    prompt = _prompt(17, 2)
    eng = _engine(tiny_llama_model)
    seq = eng.add_request(prompt, SamplingParams(max_new_tokens=24, repetition_penalty=1.8))
    plain = eng.add_request(prompt, SamplingParams(max_new_tokens=24))
    eng.run()
    with torch.no_grad():
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False, repetition_penalty=1.8,
                           eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    assert seq.output_ids == want
    assert seq.output_ids != plain.output_ids  # the penalty changed the answer


def test_greedy_presence_and_frequency_penalties_equal_a_transformers_loop(tiny_llama_model, hf_logprobs):
    prompt = _prompt(9, 3)
    params = SamplingParams(max_new_tokens=16, presence_penalty=1.5, frequency_penalty=0.7)
    eng = _engine(tiny_llama_model)
    seq = eng.add_request(prompt, params)
    eng.run()
    out: list[int] = []
    for _ in range(16):  # log-softmax is logits minus a per-row constant: the same argmax after the penalties
        row = hf_logprobs(prompt + out)[-1]
        for j in set(out):
            row[j] -= out.count(j) * 0.7 + 1.5
        out.append(int(row.argmax()))
    assert seq.output_ids == out


def test_a_penalized_sequence_speculates_and_every_answer_is_unchanged(tiny_llama_model):
    prompts = [_prompt(8, 4) * 3, _prompt(12, 5) * 3, _prompt(6, 6) * 4]
    params = [SamplingParams(max_new_tokens=30), SamplingParams(max_new_tokens=30, repetition_penalty=1.3),
              SamplingParams(decode_strategy="sampling", max_new_tokens=30, seed=4)]

    def run(which, proposer=None):
        eng = _engine(tiny_llama_model, k=4 if proposer else 0, proposer=proposer)
        seqs = [eng.add_request(prompts[i], params[i], request_index=i) for i in which]
        eng.run()
        return seqs

    mixed = run([0, 1, 2], ReferenceProposer(3, 4))
    assert all(s.stats.drafted > 0 for s in mixed)
    # each as it runs alone (sampling draws through the verifier where it has drafts: alone, with them too)
    assert [s.output_ids for s in mixed] == [run([i], ReferenceProposer(3, 4))[0].output_ids for i in range(3)]
    assert mixed[1].output_ids == run([1])[0].output_ids


@pytest.mark.parametrize("kw, flag", [({"presence_penalty": 2.5}, "--presence-penalty"),
                                      ({"frequency_penalty": -3}, "--frequency-penalty"),
                                      ({"repetition_penalty": 0}, "--repetition-penalty"),
                                      ({"repetition_penalty": float("nan")}, "--repetition-penalty"),
                                      ({"logit_bias": {5: 101}}, "logit_bias"),
                                      ({"logit_bias": {-1: 1}}, "logit_bias")])
def test_bad_penalties_are_refused(kw, flag):
    with pytest.raises(QuantSpecError, match=flag):
        SamplingParams(**kw)


def test_a_logit_bias_steers_greedy_decoding_and_a_foreign_token_is_refused(tiny_llama_model):
    prompt = _prompt(10, 7)
    eng = _engine(tiny_llama_model)
    plain = eng.add_request(prompt, SamplingParams(max_new_tokens=8))
    forced = eng.add_request(prompt, SamplingParams(max_new_tokens=8, logit_bias={42: 100}))
    eng.run()
    eng = _engine(tiny_llama_model)
    banned = eng.add_request(prompt, SamplingParams(max_new_tokens=8, logit_bias={t: -100 for t in plain.output_ids}))
    eng.run()
    assert forced.output_ids == [42] * 8
    assert not set(banned.output_ids) & set(plain.output_ids)
    with pytest.raises(QuantSpecError, match="vocabulary"):
        eng.add_request(prompt, SamplingParams(logit_bias={tiny_llama_model.args.vocab_size: 1.0}))
