"""Forced tool calls through `quantspec serve` with the real `openai` client: a named function's
arguments fit its schema, `"required"` gives calls of listed tools, streamed calls add up to the
whole ones, and what the server cannot do (`"auto"` without a tool-call parser, an unknown name)
is a 400 naming `tool_choice`."""

from __future__ import annotations

import json

import openai
import pytest

pytest.importorskip("xgrammar")

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city.",
                                            "parameters": {"type": "object",
                                                           "properties": {"city": {"type": "string", "maxLength": 8},
                                                                          "days": {"type": "integer", "minimum": 1,
                                                                                   "maximum": 7}},
                                                           "required": ["city", "days"],
                                                           "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}}
MSGS = [{"role": "user", "content": "What is the weather in Paris?"}]


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)


def _weather_args(text: str) -> bool:
    a = json.loads(text, strict=False)  # xgrammar lets control characters into strings
    return set(a) == {"city", "days"} and len(a["city"]) <= 8 and 1 <= a["days"] <= 7


def test_a_named_function_is_called_with_arguments_of_its_schema(server):
    url, _ = server
    client = _client(url)
    kw = dict(model="tiny", messages=MSGS, max_tokens=60, temperature=0, tools=[WEATHER, TIME],
              tool_choice={"type": "function", "function": {"name": "get_weather"}})
    r = client.chat.completions.create(**kw)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    assert _weather_args(call.function.arguments)
    args, names = "", set()
    for chunk in client.chat.completions.create(**kw, stream=True):
        for tc in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            args += tc.function.arguments or ""
            names.add(tc.function.name) if tc.function.name else None
    assert args == call.function.arguments and names == {"get_weather"}


def test_required_gives_calls_of_listed_tools(server):
    url, _ = server
    client = _client(url)
    kw = dict(model="tiny", messages=MSGS, max_tokens=120, temperature=0, tools=[WEATHER, TIME], tool_choice="required")
    r = client.chat.completions.create(**kw)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls and choice.message.content is None
    for call in choice.message.tool_calls:
        assert call.function.name in ("get_weather", "get_time")
        if call.function.name == "get_weather":
            assert _weather_args(call.function.arguments)
        else:
            assert json.loads(call.function.arguments)["zone"] in ("UTC", "CET")
    streamed = [tc for chunk in client.chat.completions.create(**kw, stream=True) if chunk.choices
                for tc in chunk.choices[0].delta.tool_calls or []]
    assert len(streamed) > 2 * len(choice.message.tool_calls)  # each call's arguments come in pieces
    merged = {}
    for tc in streamed:  # as a client puts them together: by index, the arguments' pieces joined
        name, args = merged.get(tc.index, (None, ""))
        merged[tc.index] = (name or tc.function.name, args + (tc.function.arguments or ""))
    assert [(n, json.loads(a, strict=False)) for _, (n, a) in sorted(merged.items())] == \
        [(c.function.name, json.loads(c.function.arguments, strict=False)) for c in choice.message.tool_calls]
    cut = client.chat.completions.create(**{**kw, "max_tokens": 3}).choices[0]  # cut short: the raw text
    assert cut.finish_reason == "length" and cut.message.content.startswith("[") and not cut.message.tool_calls


def test_tool_choice_none_answers_in_text(server):
    url, _ = server
    r = _client(url).chat.completions.create(model="tiny", messages=MSGS, max_tokens=6, temperature=0,
                                             tools=[WEATHER], tool_choice="none")
    assert r.choices[0].message.tool_calls is None and r.choices[0].message.content


@pytest.mark.parametrize("extra", [
    {"tools": [WEATHER]},  # auto, OpenAI's default with tools
    {"tools": [WEATHER], "tool_choice": "auto"},
    {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
    {"tool_choice": "required"},  # no tools
    {"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
])
def test_tool_choices_the_server_cannot_serve_are_400(server, extra):
    url, _ = server
    with pytest.raises(openai.BadRequestError) as e:
        _client(url).chat.completions.create(model="tiny", messages=MSGS, max_tokens=4, **extra)
    err = e.value.body
    assert err["param"] in ("tool_choice", "response_format") and "\n" not in err["message"]


def test_parallel_tool_calls_false_holds_a_required_answer_to_one_call():
    from quantspec.serve.protocol import ChatCompletionRequest
    from quantspec.serve.tools import tool_guide

    body = dict(messages=MSGS, tools=[WEATHER, TIME], tool_choice="required")
    assert "maxItems" not in json.loads(tool_guide(ChatCompletionRequest(**body)).spec)
    one = json.loads(tool_guide(ChatCompletionRequest(**body, parallel_tool_calls=False)).spec)
    assert one["maxItems"] == 1 and one["minItems"] == 1
