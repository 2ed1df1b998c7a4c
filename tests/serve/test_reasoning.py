"""The deepseek_r1 and qwen3 reasoning parsers: a whole answer's thinking and content, the same
answer streamed in pieces cut anywhere, and through the server with the real `openai` client (the
tiny model's tokens replaced by a script's, as a reasoning model would write them) in
`reasoning_content`, streamed or whole; qwen3 reads whether the prompt left `<think>` open; a
guided answer is held to its grammar after the thinking, and split."""

from __future__ import annotations

import importlib.util

import openai
import pytest

from quantspec.serve.reasoning import DeepSeekR1Reasoning, Qwen3Reasoning, ReasoningStream

P, Q = DeepSeekR1Reasoning(), Qwen3Reasoning()


def _streamed(parser, text, cuts, thinking=True):
    s = ReasoningStream(parser, thinking)
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    out = [s.feed(p, i == len(pieces) - 1) for i, p in enumerate(pieces)]
    return "".join(r for r, _ in out) or None, "".join(c for _, c in out) or None


@pytest.mark.parametrize("text, split", [
    ("<think>\nCount: 9.8 > 9.11.\n</think>\n\n9.8 is greater.", ("\nCount: 9.8 > 9.11.\n", "\n\n9.8 is greater.")),
    ("Count them.</think>9.8", ("Count them.", "9.8")),          # the <think> was in the prompt
    ("<think>Still counting", ("Still counting", None)),          # cut short: all thinking
    ("</think>Just the answer.", (None, "Just the answer.")),
    ("An answer that mentions <think> in passing.</think>", ("An answer that mentions <think> in passing.", None)),
])
def test_deepseek_r1_splits_thinking_from_content(text, split):
    assert P.split(text) == split and P.thinks_first("<|im_start|>assistant\n")
    for cuts in ([], [1], [2, 3, 4, 5, 6, 7, 8], list(range(1, len(text)))):
        assert _streamed(P, text, cuts) == split, cuts


@pytest.mark.parametrize("prompt_tail, text, split", [
    ("<|im_start|>assistant\n", "<think>\nHm.\n</think>\n\nYes.", ("\nHm.\n", "\n\nYes.")),  # thinking on
    ("<|im_start|>assistant\n", "<think>Cut sh", ("Cut sh", None)),
    ("assistant\n<think>\n\n</think>\n\n", "Just the answer.", (None, "Just the answer.")),  # enable_thinking false
    ("<|im_start|>assistant\n", "An answer.</think> with a stray tag", (None, "An answer.</think> with a stray tag")),
    ("<|im_start|>assistant\n<think>\n", "Hm.\n</think>\n\nYes.", ("Hm.\n", "\n\nYes.")),  # thinking-only template
    ("<|im_start|>assistant\n<think>\n", "Still going", ("Still going", None)),
])
def test_qwen3_thinks_where_the_answer_or_the_prompt_opens_it(prompt_tail, text, split):
    thinking = Q.thinks_first(prompt_tail)
    assert Q.split(text, thinking) == split
    for cuts in ([], [1], [2, 3, 4, 5, 6, 7, 8], list(range(1, len(text)))):
        assert _streamed(Q, text, cuts, thinking) == split, cuts


SCRIPT = "<think>\nThe user greets me.\n</think>\n\nHello there!"


def _scripted(tokenizer, script: str = SCRIPT):
    """A `start_server` tweak: every request's tokens become `script`'s, as the engine steps."""
    ids = tokenizer(script, add_special_tokens=False)["input_ids"]

    def tweak(state):
        engine = state.loop.engine
        step = engine.step
        given: dict[int, int] = {}

        def scripted():
            events = step()
            out = []
            for seq, toks in events:
                at = given.get(seq.seq_id, 0)
                given[seq.seq_id] = at + len(toks)
                out.append((seq, ids[at:at + len(toks)]))
            return out

        engine.step = scripted

    return tweak, len(ids)


def test_the_server_returns_the_thinking_as_reasoning_content(start_server, tiny_loaded):
    tweak, n = _scripted(tiny_loaded.tokenizer)
    with start_server(reasoning_parser="deepseek_r1", speculate_method="none", tweak=tweak) as (url, _):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
        kw = dict(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=n, temperature=0,
                  extra_body={"ignore_eos": True})
        msg = client.chat.completions.create(**kw).choices[0].message
        assert msg.content == "\n\nHello there!"
        assert msg.reasoning_content == msg.reasoning == "\nThe user greets me.\n"
        chunks = list(client.chat.completions.create(stream=True, **kw))
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == "\nThe user greets me.\n"
        assert "".join(d.content or "" for d in deltas) == "\n\nHello there!"
        if importlib.util.find_spec("xgrammar") is None:
            return
        guided = client.chat.completions.create(**{**kw, "response_format": {"type": "json_object"}}).choices[0].message
        # the grammar holds the answer after its thinking (deepseek_r1 always thinks first): split as any
        assert guided.model_extra.get("reasoning_content") == "\nThe user greets me.\n"
        assert guided.content == "\n\nHello there!"


ANSWER = "Hello there!</think> again"
OPEN_THINK = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
              "<|im_start|>assistant\n<think>\n")


@pytest.mark.parametrize("template, reasoning, content", [
    (None, None, ANSWER),  # no <think> anywhere: all content
    (OPEN_THINK, "Hello there!", " again"),  # the template leaves <think> open: thinking first
])
def test_qwen3_on_the_server_reads_the_prompt(start_server, tiny_loaded, template, reasoning, content):
    tweak, n = _scripted(tiny_loaded.tokenizer, ANSWER)
    with start_server(reasoning_parser="qwen3", speculate_method="none", tweak=tweak, chat_template=template) as (url, _):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
        kw = dict(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=n, temperature=0,
                  extra_body={"ignore_eos": True})
        msg = client.chat.completions.create(**kw).choices[0].message
        assert (msg.model_extra.get("reasoning_content"), msg.content) == (reasoning, content)
        deltas = [c.choices[0].delta for c in client.chat.completions.create(stream=True, **kw) if c.choices]
        assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == (reasoning or "")
        assert "".join(d.content or "" for d in deltas) == content


@pytest.mark.parametrize("parser, tail, after", [
    (P, "<|im_start|>assistant\n", True),  # deepseek_r1: thinks first
    (Q, "assistant\n<think>\n\n</think>\n\n", False),  # qwen3, enable_thinking false
    (Q, "assistant\n<think>\n", True),  # qwen3, a thinking-only template
])
def test_a_guided_request_is_held_after_the_thinking(tiny_loaded, parser, tail, after):
    """The job of a guided chat request under a reasoning parser carries the thinking tags' ids for
    the engine (`guide_after`) where its answer may think; the tiny tokenizer's `<think>` is not one
    token, so an answer that does not start thinking is held from its first token."""
    from quantspec.serve.reasoning import thinking_guide

    tok = tiny_loaded.tokenizer
    got = thinking_guide(parser, tok, tok(tail, add_special_tokens=False)["input_ids"])
    if after:
        start, end, thinking = got
        assert thinking and tok.decode(list(start)) == "<think>" and tok.decode(list(end)) == "</think>"
    else:
        assert got is None


EFFORT = "{% for m in messages %}{{ m['content'] }}{% endfor %} effort={{ reasoning_effort | default('none') }}"


def test_reasoning_effort_reaches_the_template_and_include_reasoning_false_drops_the_thinking(start_server,
                                                                                              tiny_loaded):
    tweak, n = _scripted(tiny_loaded.tokenizer)
    with start_server(reasoning_parser="deepseek_r1", speculate_method="none", tweak=tweak,
                      chat_template=EFFORT) as (url, _):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
        kw = dict(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=n, temperature=0,
                  extra_body={"ignore_eos": True, "return_token_ids": True})
        for effort in ("low", "high"):
            r = client.chat.completions.create(reasoning_effort=effort, **kw)
            assert tiny_loaded.tokenizer.decode(r.model_extra["prompt_token_ids"]).endswith(f"effort={effort}")
        plain = client.chat.completions.create(**kw)
        assert tiny_loaded.tokenizer.decode(plain.model_extra["prompt_token_ids"]).endswith("effort=none")
        kw["extra_body"]["include_reasoning"] = False
        msg = client.chat.completions.create(**kw).choices[0].message
        assert msg.content == "\n\nHello there!" and msg.model_extra.get("reasoning_content") is None
        deltas = [c.choices[0].delta for c in client.chat.completions.create(stream=True, **kw) if c.choices]
        assert not any(getattr(d, "reasoning_content", None) for d in deltas)
        assert "".join(d.content or "" for d in deltas) == "\n\nHello there!"
