"""Structured outputs through the engine on the tiny model: each answer satisfies its guide (checked
with Python's own `json` and `re`), each token is the most likely one the guide allows (checked
against transformers' logits), the other sequences of the batch are untouched, and bad guides are
one clear error."""

import json
import re

import pytest

from quantspec.errors import QuantSpecError
from quantspec.infer.engine import Engine, EngineConfig
from quantspec.infer.sampler import SamplingParams

pytest.importorskip("xgrammar")

from quantspec.infer.structured import Guide, GuideCompiler  # noqa: E402

EOS = 2


@pytest.fixture(scope="module")
def guides(tiny_tokenizer_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    return tok, GuideCompiler(tok, 512, [EOS])


def _run(model, prompt, guide, compiler, n=40, **kw):
    eng = Engine(model, EngineConfig(block_size=16, max_batch_size=2, max_length=256), eos_token_ids=[EOS])
    seq = eng.add_request(prompt, SamplingParams(max_new_tokens=n, guide=compiler.compile(guide), **kw))
    eng.run()
    return seq


def _prompt(tok, text="the quick brown fox"):
    return tok(text)["input_ids"]


SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "age"], "additionalProperties": False}


def test_a_json_schema_answer_parses_and_fits_the_schema(tiny_llama_model, guides):
    tok, compiler = guides
    seq = _run(tiny_llama_model, _prompt(tok), Guide("json", json.dumps(SCHEMA)), compiler, n=80)
    assert seq.finish_reason == "eos", tok.decode(seq.output_ids)
    value = json.loads(tok.decode(seq.output_ids[:-1]), strict=False)  # xgrammar lets control characters into strings
    assert set(value) == {"name", "age"} and isinstance(value["name"], str) and len(value["name"]) <= 8
    assert isinstance(value["age"], int) and 0 <= value["age"] <= 99


@pytest.mark.parametrize("pattern", [r"[0-9]{3}-[a-z]{2,4}", r"(yes|no), because [a-z ]{1,12}\."])
def test_a_regex_answer_matches_it_whole(tiny_llama_model, guides, pattern):
    tok, compiler = guides
    seq = _run(tiny_llama_model, _prompt(tok), Guide("regex", pattern), compiler,
               decode_strategy="sampling", temperature=1.5, seed=3)
    assert seq.finish_reason == "eos"
    assert re.fullmatch(pattern, tok.decode(seq.output_ids[:-1]))


def test_a_choice_is_one_of_the_choices_and_the_most_likely_token_the_guide_allows(tiny_llama_model, guides,
                                                                                     hf_logprobs):
    """Greedy under a guide: each token is the argmax of transformers' logits over the tokens
    that still lead to a choice (found by prefix, independently of xgrammar)."""
    tok, compiler = guides
    choices = ["red apple", "green pear", "blue plum"]
    prompt = _prompt(tok)
    seq = _run(tiny_llama_model, prompt, Guide("choice", json.dumps(choices)), compiler)
    text = tok.decode(seq.output_ids[:-1])
    assert text in choices and seq.output_ids[-1] == EOS
    ref = hf_logprobs(prompt + seq.output_ids)
    for j, t in enumerate(seq.output_ids[:-1]):
        done = tok.decode(seq.output_ids[:j])
        ok = [v for v in range(3, 512) if any(c.startswith(done + tok.decode([v])) for c in choices)]
        row = ref[len(prompt) - 1 + j]
        assert t == max(ok, key=lambda v: float(row[v]))


@pytest.mark.parametrize("strategy", ["greedy", "sampling"])
def test_a_guide_binds_only_its_own_sequence(tiny_llama_model, guides, strategy):
    tok, compiler = guides
    prompt = _prompt(tok)
    kw = dict(max_new_tokens=12, decode_strategy=strategy, seed=5)
    eng = Engine(tiny_llama_model, EngineConfig(block_size=16, max_batch_size=2, max_length=256), eos_token_ids=[EOS])
    alone = eng.add_request(prompt, SamplingParams(**kw))
    eng.run()
    eng = Engine(tiny_llama_model, EngineConfig(block_size=16, max_batch_size=2, max_length=256), eos_token_ids=[EOS])
    guided = eng.add_request(prompt, SamplingParams(**kw, guide=compiler.compile(Guide("regex", "[a-z]+"))))
    plain = eng.add_request(prompt, SamplingParams(**kw), request_index=0)  # alone's random stream
    eng.run()
    assert plain.output_ids == alone.output_ids
    assert re.fullmatch("[a-z]+", tok.decode([t for t in guided.output_ids if t != EOS]))


@pytest.mark.parametrize("guide, says", [
    (Guide("regex", "([a-z"), "regex"),
    (Guide("json", "{not json"), "json"),
    (Guide("grammar", "root ::= "), "grammar"),
    (Guide("choice", "[]"), "choice"),
])
def test_a_bad_guide_is_one_clear_error(guides, guide, says):
    with pytest.raises(QuantSpecError, match=says) as e:
        guides[1].compile(guide)
    assert "\n" not in str(e.value) and "/project/" not in str(e.value)


def test_an_unknown_kind_is_refused():
    with pytest.raises(QuantSpecError, match="json_object"):
        Guide("yaml", "")


def test_drafts_of_a_guided_sequence_are_cut_and_verified_under_the_grammar(tiny_llama_model, guides, answer_oracle):
    """Drafting the guided answer itself, every draft is accepted; drafting text the schema rules
    out, the drafts are cut before the forward or rejected; the answer is the guided one either way."""
    tok, compiler = guides
    prompt = _prompt(tok)
    guide = compiler.compile(Guide("json", json.dumps(SCHEMA)))
    want = _run(tiny_llama_model, prompt, Guide("json", json.dumps(SCHEMA)), compiler, n=80).output_ids
    junk = tok("hello there, no json here at all", add_special_tokens=False)["input_ids"] * 4
    for answers, all_accepted in (([want], True), ([junk], False)):
        eng = Engine(tiny_llama_model, EngineConfig(block_size=16, max_batch_size=1, max_length=256,
                                                    spec_max_draft_tokens=4),
                     eos_token_ids=[EOS], proposer=answer_oracle(answers))
        seq = eng.add_request(prompt, SamplingParams(max_new_tokens=80, guide=guide))
        eng.run()
        assert seq.output_ids == want
        if all_accepted:
            assert seq.stats.drafted > 0 and seq.stats.accepted == seq.stats.drafted
        else:  # most junk is cut (a few tokens fit inside a JSON string, and are rejected)
            assert seq.stats.drafted < seq.stats.target_forwards and seq.stats.accepted < seq.stats.drafted


def _pairs(want, junk, spine):
    """Caterpillar candidates: at each depth the `spine` token first (the parent of the next depth)
    and the other beside it; `spine`: 'want' (the guided answer's next token) or 'junk'."""
    def candidates(s, b):
        at = len(s.output_ids)
        pairs = [[want[at + d], junk[(at + d) % len(junk)]] for d in range(min(b, 3)) if at + d < len(want)]
        return [p[::-1] for p in pairs] if spine == "junk" else pairs
    return candidates


@pytest.mark.parametrize("spine", ["want", "junk"])
@pytest.mark.parametrize("strategy", ["greedy", "sampling"])
def test_a_token_tree_of_a_guided_sequence_is_verified_under_the_grammar_of_each_path(tiny_llama_model, guides,
                                                                                      caterpillar_oracle, spine,
                                                                                      strategy):
    """Trees whose branches hold the guided answer and text the schema rules out: the answer is
    valid, greedy the guided one itself, and the tree's rows were verified (greedy: the answer's
    drafts accepted, past the first depth where they are on the spine)."""
    tok, compiler = guides
    prompt = _prompt(tok)
    guide = Guide("json", json.dumps(SCHEMA))
    kw = {} if strategy == "greedy" else {"decode_strategy": "sampling", "temperature": 0.9, "seed": 5}
    want = _run(tiny_llama_model, prompt, guide, compiler, n=80, **kw).output_ids
    junk = tok("hello there, no json here at all", add_special_tokens=False)["input_ids"]
    eng = Engine(tiny_llama_model, EngineConfig(block_size=16, max_batch_size=1, max_length=256,
                                                spec_max_draft_tokens=6),
                 eos_token_ids=[EOS], proposer=caterpillar_oracle(_pairs(want, junk, spine)))
    seq = eng.add_request(prompt, SamplingParams(max_new_tokens=80, guide=compiler.compile(guide), **kw))
    eng.run()
    assert seq.stats.drafted > 0
    json.loads(tok.decode(seq.output_ids[:-1]))  # a valid answer of the schema, before its stop token
    if strategy == "greedy":  # the answer's token is a child of the root either way; deeper on the spine only
        assert seq.output_ids == want and seq.stats.accepted > 0
        assert (seq.stats.accepted_per_position[1] > 0) == (spine == "want")
