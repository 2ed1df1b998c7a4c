"""A guide held after a reasoning model's thinking (`AfterThinking`): every token passes until the
closing tag's ids are written, then the grammar holds the rest; an answer that may open its
thinking gets the grammar's first tokens and the opening tag; rolled back anywhere, the wrapper's
masks are those of the same tokens replayed from scratch; and through the engine (plain and
speculating) the answer after the tag fits the grammar."""

import re

import pytest
import torch

from quantspec.infer.engine import Engine, EngineConfig
from quantspec.infer.sampler import SamplingParams

xgr = pytest.importorskip("xgrammar")

from quantspec.infer.structured import AfterThinking, Guide, GuideCompiler, guide_matcher  # noqa: E402

EOS, V = 2, 512


@pytest.fixture(scope="module")
def setup(tiny_tokenizer_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    compiler = GuideCompiler(tok, V, [EOS])
    digits = sorted(t for t in range(3, V) if re.fullmatch("[0-9]+", tok.decode([t])))
    words = [t for t in range(3, V) if re.fullmatch("[a-z]+", tok.decode([t]))]
    return tok, compiler.compile(Guide("regex", "[0-9]{2,4}")), digits, words


def _mask(m) -> torch.Tensor:
    bits = xgr.allocate_token_bitmask(1, V)
    m.fill_next_token_bitmask(bits)
    row = torch.zeros(V)
    xgr.apply_token_bitmask_inplace(row.view(1, -1), bits)
    return torch.isfinite(row)


def test_thinking_passes_every_token_until_its_closing_tag(setup):
    tok, compiled, digits, words = setup
    end = (words[0], words[1])
    m = guide_matcher(compiled, ((words[2],), end, True))
    assert isinstance(m, AfterThinking) and _mask(m).all()
    for t in (words[5], digits[0], words[0], words[7]):  # a start of the tag that does not finish
        assert m.accept_token(t) and _mask(m).all() and not m.is_terminated()
    assert m.accept_token(words[0]) and m.accept_token(words[1])  # the tag: the grammar from here
    allowed = _mask(m)
    assert allowed[digits].any() and not allowed[words].any()
    assert not m.accept_token(words[3]) and m.accept_token(digits[0])


def test_an_answer_that_may_think_gets_the_grammar_and_its_opening_tag(setup):
    tok, compiled, digits, words = setup
    start, end = (words[2],), (words[0],)
    m = guide_matcher(compiled, (start, end, False))
    first = _mask(m)
    assert first[start[0]] and first[digits].any() and not first[words[3]]
    assert m.accept_token(start[0]) and _mask(m).all()  # it opened its thinking
    m.rollback(1)
    assert torch.equal(_mask(m), first)
    assert m.accept_token(digits[0]) and not _mask(m)[start[0]]  # answered at once: held from here


@pytest.mark.parametrize("thinking", [True, False])
def test_rolled_back_anywhere_the_masks_are_the_replay_s(setup, thinking):
    tok, compiled, digits, words = setup
    start, end = (words[2],), (words[0], words[1])
    path = ([] if thinking else [start[0]]) + [words[4], words[0], words[1], digits[0], digits[1]]
    m = guide_matcher(compiled, (start, end, thinking))
    for t in path:
        assert m.accept_token(t)
    for k in range(len(path), -1, -1):
        fresh = guide_matcher(compiled, (start, end, thinking))
        for t in path[:k]:
            fresh.accept_token(t)
        assert torch.equal(_mask(m), _mask(fresh)), k
        assert m.is_terminated() == fresh.is_terminated()
        if k:
            m.rollback(1)


@pytest.mark.parametrize("speculate", [False, True])
def test_the_engine_holds_the_answer_after_the_thinking(tiny_llama_model, setup, speculate):
    """The closing tag forced by a logit bias while thinking is free; after it the grammar masks
    the biased tokens away, and the answer is 2–4 digits and the stop token."""
    from quantspec.infer.spec.proposers import ReferenceProposer

    tok, compiled, digits, words = setup
    end = (words[0],)
    eng = Engine(tiny_llama_model, EngineConfig(block_size=16, max_batch_size=1, max_length=256,
                                                spec_max_draft_tokens=3 if speculate else 0),
                 eos_token_ids=[EOS], proposer=ReferenceProposer(1, 3) if speculate else None)
    params = SamplingParams(max_new_tokens=20, guide=compiled, guide_after=((words[2],), end, True),
                            logit_bias=((words[0], 50.0), (words[5], 40.0)))
    seq = eng.add_request(tok("the quick brown fox")["input_ids"], params)
    eng.run()
    out = seq.output_ids
    i = out.index(words[0])
    assert all(t == words[5] for t in out[:i])  # thinking: the biased tokens pass
    answer = out[i + 1:]
    assert answer[-1] == EOS and re.fullmatch("[0-9]{2,4}", tok.decode(answer[:-1])), tok.decode(answer)
