"""What ends a sequence, per request: `ignore_eos`, `stop_token_ids` (with speculation too, where the
stop token sits inside accepted drafts) and `min_tokens` against transformers' `generate` with
`min_new_tokens`."""

from __future__ import annotations

import pytest
import torch

from quantspec.errors import QuantSpecError
from quantspec.infer.engine import Engine, EngineConfig
from quantspec.infer.sampler import SamplingParams


def _prompt(seed):
    return torch.randint(3, 500, (9,), generator=torch.Generator().manual_seed(seed)).tolist()


def _run(model, prompt, params, eos, proposer=None):
    eng = Engine(model, EngineConfig(block_size=16, max_batch_size=1, max_length=128,
                                     spec_max_draft_tokens=6 if proposer else 0),
                 eos_token_ids=eos, proposer=proposer)
    seq = eng.add_request(prompt, params)
    eng.run()
    return seq


def test_ignore_eos_and_stop_token_ids(tiny_llama_model, answer_oracle):
    prompt = _prompt(1)
    answer = _run(tiny_llama_model, prompt, SamplingParams(max_new_tokens=16), []).output_ids
    eos = answer[3]
    assert eos not in answer[:3]
    ended = _run(tiny_llama_model, prompt, SamplingParams(max_new_tokens=16), [eos])
    assert ended.output_ids == answer[:4] and ended.finish_reason == "eos"
    through = _run(tiny_llama_model, prompt, SamplingParams(max_new_tokens=16, ignore_eos=True), [eos])
    assert through.output_ids == answer and through.finish_reason == "length"
    stop = answer[5]
    assert stop not in answer[:5]
    for proposer in (None, answer_oracle([answer])):
        seq = _run(tiny_llama_model, prompt, SamplingParams(max_new_tokens=16, stop_token_ids=[stop]), [], proposer)
        assert seq.output_ids == answer[:6] and seq.finish_reason == "stop"
    assert seq.stats.accepted > 0  # the stop token came inside accepted drafts


def test_min_tokens_equals_transformers_min_new_tokens(tiny_llama_model, hf_tiny_llama, answer_oracle):
    hf = hf_tiny_llama
    prompt = _prompt(2)
    answer = _run(tiny_llama_model, prompt, SamplingParams(max_new_tokens=12), []).output_ids
    eos = answer[2]
    assert eos not in answer[:2]
    seq = _run(tiny_llama_model, prompt, SamplingParams(max_new_tokens=12, min_tokens=8), [eos])
    with torch.no_grad():
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=12, min_new_tokens=8, do_sample=False,
                           eos_token_id=eos, pad_token_id=0)[0, len(prompt):].tolist()
    assert seq.output_ids == want and len(seq.output_ids) >= 8
    assert seq.output_ids[:2] == answer[:2] and seq.output_ids[2] != eos  # the EOS was masked at position 3
    # drafted: the unmasked answer (its EOS at position 3, rejected there) and the masked one
    for drafts in (answer, want):
        spec = _run(tiny_llama_model, prompt, SamplingParams(max_new_tokens=12, min_tokens=8), [eos],
                    answer_oracle([drafts]))
        assert spec.output_ids == want and spec.stats.drafted > 0
    assert spec.stats.accepted > 0


@pytest.mark.parametrize("kw", [{"min_tokens": 20, "max_new_tokens": 10}, {"min_tokens": -1},
                                {"stop_token_ids": [-4]}, {"stop_token_ids": [1.5]}])
def test_bad_stop_rules_are_refused(kw):
    with pytest.raises(QuantSpecError, match="min_tokens|stop_token_ids"):
        SamplingParams(**kw)
