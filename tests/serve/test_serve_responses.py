"""OpenAI's Responses API (`/v1/responses`) through the real `openai` client, including its stream
helper (which rebuilds the Response from the events and checks their order): the answer is the
chat answer of the same messages (`quantspec infer`'s for one user turn), usage counts the chat
template's tokens, function tools come back as `function_call` items, and what the server does not
serve is a 400 naming the field. Stored responses: test_serve_responses_store.py."""

from __future__ import annotations

import json

import httpx2
import openai
import pytest

from quantspec.serve.text import chat_prompt_ids

WEATHER = {"type": "function", "name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"]}}


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)


def test_a_response_is_the_chat_answer_whole_or_streamed(server, reference):
    url, state = server
    client = _client(url)
    text, ids = reference("Tell me a story", 12)
    r = client.responses.create(model="tiny", input="Tell me a story", max_output_tokens=12, temperature=0)
    assert r.output_text == text and r.id.startswith("resp_") and r.object == "response"
    prompt = chat_prompt_ids(state.tokenizer, [{"role": "user", "content": "Tell me a story"}])
    assert (r.usage.input_tokens, r.usage.output_tokens) == (len(prompt), len(ids))
    assert r.usage.total_tokens == len(prompt) + len(ids)
    cut = len(ids) == 12  # the answer ran to max_output_tokens
    assert r.status == ("incomplete" if cut else "completed")
    assert (r.incomplete_details.reason if cut else r.incomplete_details) == ("max_output_tokens" if cut else None)
    (message,) = r.output
    assert message.type == "message" and message.role == "assistant" and message.status == "completed"

    with client.responses.stream(model="tiny", input="Tell me a story", max_output_tokens=12, temperature=0) as stream:
        events = list(stream)
    final = events[-1].response  # response.completed's, or response.incomplete's (OpenAI's for a cut answer)
    assert final.output_text == text and final.usage.output_tokens == len(ids) and final.status == r.status
    kinds = [e.type for e in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[-1] == f"response.{r.status}" and "response.output_text.done" in kinds
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == text
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_instructions_and_input_items_are_the_chat_messages(server):
    url, state = server
    client = _client(url)
    msgs = [{"role": "system", "content": "Be brief"}, {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "more"}]
    chat = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=8, temperature=0)
    r = client.responses.create(model="tiny", instructions="Be brief", max_output_tokens=8, temperature=0, input=[
        {"role": "user", "content": [{"type": "input_text", "text": "hi"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hello"}]},
        {"role": "user", "content": "more"}])
    assert r.output_text == chat.choices[0].message.content
    assert r.usage.input_tokens == chat.usage.prompt_tokens == len(chat_prompt_ids(state.tokenizer, msgs))


def test_function_tools_come_back_as_function_call_items(server):
    pytest.importorskip("xgrammar")
    url, _ = server
    client = _client(url)
    kw = dict(model="tiny", input="Weather in Paris?", tools=[WEATHER], tool_choice="required", max_output_tokens=60,
              temperature=0)
    r = client.responses.create(**kw)
    calls = [item for item in r.output if item.type == "function_call"]
    assert calls and r.status == "completed" and all(c.name == "get_weather" for c in calls)
    assert all(c.call_id.startswith("call_") and "city" in json.loads(c.arguments, strict=False) for c in calls)
    with client.responses.stream(**kw) as stream:
        events = list(stream)
        final = stream.get_final_response()
    streamed = [item for item in final.output if item.type == "function_call"]
    assert [(c.name, json.loads(c.arguments, strict=False)) for c in streamed] == \
        [(c.name, json.loads(c.arguments, strict=False)) for c in calls]
    assert sum(e.type == "response.function_call_arguments.delta" for e in events) > len(calls)
    # the call and its output go back as input items: the next turn renders them
    follow = client.responses.create(model="tiny", tools=[WEATHER], max_output_tokens=4, temperature=0, input=[
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "function_call", "call_id": calls[0].call_id, "name": "get_weather", "arguments": calls[0].arguments},
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": "18 C"}], tool_choice="none")
    assert follow.status in ("completed", "incomplete") and follow.usage.input_tokens > r.usage.input_tokens


def test_a_json_schema_text_format_holds_the_answer(server):
    pytest.importorskip("xgrammar")
    url, _ = server
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6}}, "required": ["name"]}
    r = _client(url).responses.create(model="tiny", input="A name?", max_output_tokens=40, temperature=0,
                                      text={"format": {"type": "json_schema", "name": "n", "schema": schema}})
    assert set(json.loads(r.output_text, strict=False)) == {"name"}


@pytest.mark.parametrize("body, param", [
    ({"background": True, "store": False}, "background"),
    ({"include": ["file_search_call.results", "message.output_text.tokens"]}, "include"),
    ({"include": ["message.output_text.logprobs"], "top_logprobs": 21}, "top_logprobs"),
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content"),
    ({"input": [{"type": "computer_call"}]}, "input"),
    ({"text": {"format": {"type": "yaml"}}}, "text"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"tool_choice": {"type": "function"}}, "tool_choice"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input"),
    ({"n": 2}, "n"),
])
def test_what_the_server_does_not_serve_is_a_400(server, body, param):
    url, _ = server
    r = httpx2.post(f"{url}/v1/responses", json={"model": "tiny", "input": "hi", **body}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
