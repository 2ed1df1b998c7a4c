"""The tool-call parsers on literal answers (what vLLM's parsers of the same names read from them),
and an answer streamed in pieces cut anywhere: its content deltas and calls are the whole
answer's."""

from __future__ import annotations

import json

import pytest

from quantspec.serve.tool_parsers import AutoToolCalls, HermesParser, Llama3JsonParser

WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}'
TIME = '{"name": "get_time", "arguments": {"tz": "UTC"}}'


def _calls(parsed):
    return [(n, json.loads(a)) for n, a in parsed.calls]


def test_hermes_reads_content_then_calls():
    p = HermesParser().parse(f"Let me look.\n<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>{TIME}</tool_call>")
    assert p.content == "Let me look.\n"
    assert _calls(p) == [("get_weather", {"city": "Paris", "unit": "C"}), ("get_time", {"tz": "UTC"})]
    assert HermesParser().parse(f"<tool_call>{WEATHER}").calls  # a last call without its closing tag
    assert HermesParser().parse(f"<tool_call>{WEATHER}</tool_call>").content is None


@pytest.mark.parametrize("text", ["It is sunny.", "<tool_call>{\"name\": \"get_weather\", \"arg", "<tool_call>[1, 2]</tool_call>",
                                  f"<tool_call>{WEATHER}</tool_call><tool_call>oops</tool_call>"])
def test_hermes_leaves_anything_else_as_content(text):
    p = HermesParser().parse(text)
    assert p.calls == [] and p.content == text


def test_llama3_json_reads_one_or_several_calls():
    one = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}'
    assert _calls(Llama3JsonParser().parse(one)) == [("get_weather", {"city": "Oslo"})]
    two = f' {WEATHER}; {TIME}'
    p = Llama3JsonParser().parse(two)
    assert p.content is None and [n for n, _ in p.calls] == ["get_weather", "get_time"]
    for text in ("The weather is fine.", '{"name": "get_weather", "parameters": {', '{"city": "Oslo"}'):
        assert Llama3JsonParser().parse(text).calls == []


def _stream(parser, text, cuts):
    """Feed `text` cut at `cuts` → (content streamed, calls of the last delta, finish reason)."""
    tc = AutoToolCalls(parser)
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    content, calls, reason = "", [], None
    for i, piece in enumerate(pieces):
        delta, reason = tc.delta(piece, "stop" if i == len(pieces) - 1 else None)
        content += delta.get("content", "")
        calls += delta.get("tool_calls", [])
    return content, calls, reason


@pytest.mark.parametrize("cuts", [[], [3], [13, 15, 20], list(range(1, 80))])
def test_a_streamed_answer_gives_the_whole_answer_s_content_and_calls(cuts):
    text = f"Let me look. <tool_call>{WEATHER}</tool_call>"
    content, calls, reason = _stream(HermesParser(), text, cuts)
    whole, whole_reason = AutoToolCalls(HermesParser()).message(text, "stop")
    assert content == whole["content"] == "Let me look. " and reason == whole_reason == "tool_calls"
    assert [(c["index"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == \
        [(0, "get_weather", {"city": "Paris", "unit": "C"})]
    assert calls[0]["id"].startswith("call_") and calls[0]["type"] == "function"


@pytest.mark.parametrize("parser", [HermesParser(), Llama3JsonParser()])
@pytest.mark.parametrize("text", ["Plain words, a < sign and <tool_ and {braces}.", "<tool_call>{broken",
                                  "{not json at all"])
def test_an_answer_without_calls_streams_as_content_in_full(parser, text):
    for cuts in ([], [1], [5, 11, 12]):
        content, calls, reason = _stream(parser, text, cuts)
        assert content == text and calls == [] and reason == "stop"
    assert AutoToolCalls(parser).message(text, "length") == ({"role": "assistant", "content": text}, "length")


def test_llama3_json_streams_text_before_deciding_nothing():
    tc = AutoToolCalls(Llama3JsonParser())
    assert tc.delta("  ", None) == ({}, None)             # whitespace: a call may still follow
    assert tc.delta("{\"name\"", None) == ({}, None)      # a call has begun: held to the end
    delta, reason = tc.delta(': "get_time", "parameters": {}}', "stop")
    assert reason == "tool_calls" and delta["tool_calls"][0]["function"] == {"name": "get_time", "arguments": "{}"}
