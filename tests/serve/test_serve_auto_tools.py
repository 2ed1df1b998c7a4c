"""`tool_choice` "auto" on a server started with `--enable-auto-tool-choice --tool-call-parser
hermes`, through the real `openai` client. The tiny model's answer is held to a text by a regex
(`structured_outputs`), so that it writes a hermes tool call, or plain text: the call comes back
as `tool_calls` (finish "tool_calls") with the content before it, whole or streamed (its
arguments as they are written); plain text
comes back as content; and a conversation that carries the call and its result renders."""

from __future__ import annotations

import json
import re

import openai
import pytest

pytest.importorskip("xgrammar")

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
MSGS = [{"role": "user", "content": "What is the weather in Paris?"}]
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'


def _ask(client, answer: str, **kw):
    """A chat request with tools, its answer held to exactly `answer`."""
    return client.chat.completions.create(model="tiny", messages=MSGS, tools=[WEATHER], max_tokens=120, temperature=0,
                                          extra_body={"structured_outputs": {"regex": re.escape(answer)}}, **kw)


HERMES = dict(enable_auto_tool_choice=True, tool_call_parser="hermes")


def test_the_model_s_call_comes_back_as_tool_calls(start_server):
    with start_server(**HERMES) as (url, _):
        _calls(openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60))


def _calls(client):
    r = _ask(client, "Checking. " + CALL, tool_choice="auto")
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Checking. "
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    assert call.id.startswith("call_") and call.type == "function"

    chunks = list(_ask(client, "Checking. " + CALL, stream=True))  # tool_choice left out: "auto"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    streamed = [t for c in chunks if c.choices for t in (c.choices[0].delta.tool_calls or [])]
    assert content == "Checking. " and chunks[-1].choices[0].finish_reason == "tool_calls"
    # the call's id and name first, then its arguments in pieces as the model writes them
    assert streamed[0].id.startswith("call_") and streamed[0].function.name == "get_weather"
    assert {t.index for t in streamed} == {0} and len(streamed) > 2
    assert json.loads("".join(t.function.arguments or "" for t in streamed)) == {"city": "Paris"}

    history = MSGS + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                      {"role": "tool", "tool_call_id": call.id, "content": "18 C, clear"}]
    r = client.chat.completions.create(model="tiny", messages=history, tools=[WEATHER], max_tokens=4, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length")


def test_plain_text_stays_content(start_server):
    with start_server(**HERMES) as (url, _):
        _plain(openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60))


def _plain(client):
    r = _ask(client, "It is <b>sunny</b> in Paris.")
    assert r.choices[0].message.content == "It is <b>sunny</b> in Paris." and r.choices[0].message.tool_calls is None
    chunks = list(_ask(client, "It is <b>sunny</b> in Paris.", stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "It is <b>sunny</b> in Paris."


def test_the_flags_go_together():
    from quantspec.errors import QuantSpecError
    from quantspec.serve.server import ServeConfig

    with pytest.raises(QuantSpecError, match="--tool-call-parser"):
        ServeConfig(enable_auto_tool_choice=True)
    with pytest.raises(QuantSpecError, match="--enable-auto-tool-choice"):
        ServeConfig(tool_call_parser="hermes")


@pytest.mark.parametrize("call", ['[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}',
                                  '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]'])
def test_mistral_s_calls_come_back_with_ids_its_templates_take(start_server, call):
    with start_server(enable_auto_tool_choice=True, tool_call_parser="mistral") as (url, _):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
        choice = _ask(client, "Checking. " + call).choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content.strip() == "Checking.", choice
        (got,) = choice.message.tool_calls
        assert (got.function.name, json.loads(got.function.arguments)) == ("get_weather", {"city": "Paris"})
        assert len(got.id) == 9 and got.id.isalnum()
        chunks = list(_ask(client, "Checking. " + call, stream=True))
        streamed = [t for c in chunks if c.choices for t in (c.choices[0].delta.tool_calls or [])]
        assert chunks[-1].choices[0].finish_reason == "tool_calls" and streamed[0].function.name == "get_weather"
        assert json.loads("".join(t.function.arguments or "" for t in streamed)) == {"city": "Paris"}
