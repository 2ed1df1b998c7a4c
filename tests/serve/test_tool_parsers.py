"""The tool-call parsers on literal answers (what vLLM's parsers of the same names read from them),
and an answer streamed in pieces cut anywhere: its content deltas and calls, put together as a
client does (by `index`), are the whole answer's; a call's arguments go out as they are written."""

from __future__ import annotations

import json

import pytest

from quantspec.serve.tool_parsers import AutoToolCalls, HermesParser, Llama3JsonParser, Parsed

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


def _merge(deltas: list[dict]) -> list[dict]:
    """Tool-call deltas put together by `index`, as the openai client's stream helpers do: the
    first of a call brings its id, type and name, the rest add to its arguments."""
    calls: dict[int, dict] = {}
    for d in deltas:
        call = calls.setdefault(d["index"], {"index": d["index"], "function": {"arguments": ""}})
        for key in ("id", "type"):
            if key in d:
                assert key not in call, d  # once per call
                call[key] = d[key]
        if "name" in d.get("function", {}):
            call["function"]["name"] = d["function"]["name"]
        call["function"]["arguments"] += d.get("function", {}).get("arguments", "")
    return [calls[i] for i in sorted(calls)]


def _stream(parser, text, cuts, last="stop"):
    """Feed `text` cut at `cuts` → (content streamed, the calls put together, finish reason)."""
    tc = AutoToolCalls(parser)
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    content, calls, reason = "", [], None
    for i, piece in enumerate(pieces):
        delta, reason = tc.delta(piece, last if i == len(pieces) - 1 else None)
        content += delta.get("content", "")
        calls += delta.get("tool_calls", [])
    return content, _merge(calls), reason


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
    assert tc.delta("{\"name\"", None) == ({}, None)      # a call has begun: its name is not written yet
    delta, reason = tc.delta(': "get_time", "parameters": {}}', "stop")
    assert reason == "tool_calls"
    assert _merge(delta["tool_calls"])[0]["function"] == {"name": "get_time", "arguments": "{}"}


@pytest.mark.parametrize("parser, text", [
    (HermesParser(), f"Sure. <tool_call>{WEATHER}</tool_call>\n<tool_call>{TIME}</tool_call>"),
    (Llama3JsonParser(), WEATHER.replace("arguments", "parameters") + "; " + TIME),
])
def test_arguments_stream_as_they_are_written(parser, text):
    """Fed a character at a time: each call's name goes out before its arguments are done, its
    arguments in pieces, and the pieces decode to the whole answer's arguments."""
    tc = AutoToolCalls(parser)
    deltas, named_at, args_at = [], {}, {}
    for i, ch in enumerate(text):
        delta, _ = tc.delta(ch, "stop" if i == len(text) - 1 else None)
        for d in delta.get("tool_calls", []):
            deltas.append(d)
            if "name" in d.get("function", {}):
                named_at[d["index"]] = i
            if d.get("function", {}).get("arguments"):
                args_at.setdefault(d["index"], []).append(i)
    whole, _ = tc.message(text, "stop")
    calls = _merge(deltas)
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == \
        [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in whole["tool_calls"]]
    first_args = text.index('"city"')  # the first call's arguments are under way here
    assert named_at[0] < first_args < args_at[0][-1] and len(args_at[0]) > 5 and named_at[1] > args_at[0][-1]


def test_a_call_cut_by_max_tokens_ends_with_the_arguments_so_far():
    text = 'Sure. <tool_call>{"name": "get_weather", "arguments": {"city": "Par'
    content, calls, reason = _stream(HermesParser(), text, list(range(1, len(text))), last="length")
    assert content == "Sure. " and reason == "length"
    assert calls[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Par'}


def test_parallel_tool_calls_false_keeps_the_first_call():
    text = f"<tool_call>{WEATHER}</tool_call><tool_call>{TIME}</tool_call>"
    whole, reason = AutoToolCalls(HermesParser(), most=1).message(text, "stop")
    assert [c["function"]["name"] for c in whole["tool_calls"]] == ["get_weather"] and reason == "tool_calls"
    tc = AutoToolCalls(HermesParser(), most=1)
    deltas = [d for i, ch in enumerate(text) for d in tc.delta(ch, "stop" if i == len(text) - 1 else None)[0]
              .get("tool_calls", [])]
    assert [c["function"]["name"] for c in _merge(deltas)] == ["get_weather"]


def test_required_calls_stream_from_their_json_array():
    from quantspec.serve.tools import RequiredCalls

    text = '[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_time", "parameters": {}}]'
    content, calls, reason = _stream(RequiredCalls(), text, list(range(1, len(text))))
    assert content == "" and reason == "tool_calls"
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == \
        [("get_weather", {"city": "Paris"}), ("get_time", {})]
    cut = text[:30]
    assert AutoToolCalls(RequiredCalls()).message(cut, "length") == ({"role": "assistant", "content": cut}, "length")


def test_pythonic_reads_a_list_of_calls_with_literal_arguments():
    from quantspec.serve.tool_parsers import PythonicParser

    p = PythonicParser().parse('[get_weather(city="Paris", days=3, units=["C", "F"]), get_time()]')
    assert p.content is None and _calls(p) == [("get_weather", {"city": "Paris", "days": 3, "units": ["C", "F"]}),
                                               ("get_time", {})]
    wrapped = PythonicParser().parse('<|python_start|>[f(x={"a": None, "b": True})]<|python_end|>')
    assert _calls(wrapped) == [("f", {"x": {"a": None, "b": True}})]
    for text in ("It is sunny.", "[1, 2]", "[f(g())]", "[f(1)]", "[f(**kw)]", "[os.system(cmd='x')]", "[f(x=",
                 "[]", "[f(x=open('y'))]"):
        assert PythonicParser().parse(text) == Parsed(text), text


PYTHONIC = '<|python_start|>[get_weather(city="Paris, FR", days=3, units=["C", "F"]), get_time()]<|python_end|>'


@pytest.mark.parametrize("cuts", [[], [1], [4, 9, 30], "each"])
def test_pythonic_streams_content_or_its_calls(cuts):
    from quantspec.serve.tool_parsers import PythonicParser

    cuts = list(range(1, len(PYTHONIC))) if cuts == "each" else cuts
    content, calls, reason = _stream(PythonicParser(), PYTHONIC, cuts)
    whole, _ = AutoToolCalls(PythonicParser()).message(PYTHONIC, "stop")
    assert content == "" and reason == "tool_calls"
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == \
        [(c["function"]["name"], c["function"]["arguments"]) for c in whole["tool_calls"]]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris, FR", "days": 3, "units": ["C", "F"]}
    content, calls, reason = _stream(PythonicParser(), "Paris is sunny [citation].", cuts)
    assert content == "Paris is sunny [citation]." and calls == [] and reason == "stop"


def test_pythonic_arguments_go_out_a_keyword_at_a_time():
    """Fed a character at a time: a call's name goes out once its `(` is written, then each
    keyword argument once it is whole (never a string cut short), the pieces the whole call's JSON."""
    from quantspec.serve.tool_parsers import PythonicParser

    tc = AutoToolCalls(PythonicParser())
    sent = {}
    for i, ch in enumerate(PYTHONIC):
        delta, _ = tc.delta(ch, "stop" if i == len(PYTHONIC) - 1 else None)
        for d in delta.get("tool_calls", []):
            sent.setdefault(d["index"], []).append((i, d.get("function", {}).get("arguments", "")))
    pieces = [a for _, a in sent[0] if a]
    assert pieces[:3] == ["{", '"city": "Paris, FR"', ', "days": 3']  # each whole argument, in order
    assert sent[0][0][0] == PYTHONIC.index("(") and sent[1][0][0] > sent[0][-1][0]
    assert json.loads("".join(pieces)) == {"city": "Paris, FR", "days": 3, "units": ["C", "F"]}


MISTRAL_V3 = f'Checking. [TOOL_CALLS] [{WEATHER}, {TIME}]'
MISTRAL_V11 = 'Checking.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "C"}[TOOL_CALLS]get_time[ARGS]{"tz": "UTC"}'
MISTRAL_CALL_ID = '[TOOL_CALLS]get_weather[CALL_ID]a1b2c3d4e[ARGS]{"city": "Paris", "unit": "C"}'


@pytest.mark.parametrize("text", [MISTRAL_V3, MISTRAL_V11])
def test_mistral_reads_both_of_its_call_layouts(text):
    from quantspec.serve.tool_parsers import MistralParser

    p = MistralParser().parse(text)
    assert p.content.strip() == "Checking."
    assert _calls(p) == [("get_weather", {"city": "Paris", "unit": "C"}), ("get_time", {"tz": "UTC"})]
    assert _calls(MistralParser().parse(MISTRAL_CALL_ID)) == [("get_weather", {"city": "Paris", "unit": "C"})]
    for bad in ("No calls here [1].", "[TOOL_CALLS] [{\"name\": \"f\", \"argum", "[TOOL_CALLS]get_weather[ARGS]{\"ci",
                "[TOOL_CALLS]get_weather{\"city\": 1}", "[TOOL_CALLS]f[ARGS]{}trailing words", "[TOOL_CALLS] [1, 2]"):
        assert MistralParser().parse(bad) == Parsed(bad), bad


@pytest.mark.parametrize("text", [MISTRAL_V3, MISTRAL_V11])
@pytest.mark.parametrize("cuts", [[], [5, 13, 14, 30], "each"])
def test_mistral_streams_content_then_calls_with_template_ids(text, cuts):
    """Streamed in any pieces: the content before [TOOL_CALLS], then the calls as the whole answer
    has them, with the 9-character ids Mistral's chat templates accept back."""
    from quantspec.serve.tool_parsers import MistralParser

    cuts = list(range(1, len(text))) if cuts == "each" else cuts
    content, calls, reason = _stream(MistralParser(), text, cuts)
    whole, whole_reason = AutoToolCalls(MistralParser()).message(text, "stop")
    assert content.strip() == whole["content"].strip() == "Checking." and reason == whole_reason == "tool_calls"
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == \
        [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in whole["tool_calls"]]
    assert all(len(c["id"]) == 9 and c["id"].isalnum() for c in [*calls, *whole["tool_calls"]])


def test_mistral_answers_keep_special_tokens(tiny_loaded):
    """[TOOL_CALLS] is a special token in Mistral's tokenizers: an answer under the mistral parser is
    decoded with special tokens kept, whatever the request's skip_special_tokens."""
    from quantspec.serve.answers import _Choice
    from quantspec.serve.protocol import ChatCompletionRequest
    from quantspec.serve.tool_parsers import MistralParser

    class State:
        tokenizer, tool_parser, reasoning_parser = tiny_loaded.tokenizer, MistralParser(), None

    class Resp:
        state, chat = State(), True

    class Job:
        class params:
            guide = None
        prompt_ids = [1, 2]

    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    for parser, keeps in ((MistralParser(), True), (HermesParser(), False)):
        State.tool_parser = parser
        Resp.body = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}], "tools": tools})
        assert _Choice(Resp(), 0, Job(), None).text.skip_special_tokens is (not keeps)
