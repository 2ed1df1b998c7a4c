"""Structured outputs through `quantspec serve` with the real `openai` client: OpenAI's
`response_format` (json_object, json_schema) and vLLM's `structured_outputs` (regex, choice,
grammar), streamed or whole; answers checked with Python's own `json` and `re`."""

from __future__ import annotations

import json
import re

import openai
import pytest

pytest.importorskip("xgrammar")

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6},
                                           "rank": {"type": "integer", "minimum": 1, "maximum": 9}},
          "required": ["city", "rank"], "additionalProperties": False}


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)


def _fits(text: str) -> bool:
    value = json.loads(text, strict=False)  # xgrammar lets control characters into strings
    return (set(value) == {"city", "rank"} and isinstance(value["city"], str) and len(value["city"]) <= 6
            and isinstance(value["rank"], int) and 1 <= value["rank"] <= 9)


def test_response_format_json_schema_and_json_object(server):
    url, _ = server
    client = _client(url)
    msgs = [{"role": "user", "content": "Name a city and its rank."}]
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA}}
    r = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=60, temperature=0, response_format=fmt)
    assert r.choices[0].finish_reason == "stop" and _fits(r.choices[0].message.content)
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="tiny", messages=msgs, max_tokens=60, temperature=0, response_format=fmt, stream=True) if c.choices)
    assert streamed == r.choices[0].message.content
    sampled = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=60, temperature=1.0, seed=4,
                                             n=3, response_format=fmt)
    assert all(_fits(c.message.content) for c in sampled.choices)
    any_json = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=120, temperature=0,
                                              response_format={"type": "json_object"})
    if any_json.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(any_json.choices[0].message.content, strict=False), dict)
    else:  # cut by max_tokens: still a prefix of a JSON object
        assert any_json.choices[0].message.content.startswith("{")


def test_structured_outputs_regex_choice_and_grammar(server, reference):
    url, _ = server
    client = _client(url)

    def complete(so, **kw):
        r = client.completions.create(model="tiny", prompt="Answer:", max_tokens=40, temperature=0,
                                      extra_body={"structured_outputs": so}, **kw)
        return r.choices[0]

    c = complete({"regex": r"[0-9]{2}-[a-z]{3}"})
    assert c.finish_reason == "stop" and re.fullmatch(r"[0-9]{2}-[a-z]{3}", c.text)
    choices = ["alpha", "beta gamma", "delta"]
    assert complete({"choice": choices}).text in choices
    assert re.fullmatch(r"(ab)+c", complete({"grammar": 'root ::= ("ab")+ "c"'}).text)
    plain = client.completions.create(model="tiny", prompt="Answer:", max_tokens=8, temperature=0,
                                      extra_body={"response_format": {"type": "text"}})
    assert plain.choices[0].text == reference("Answer:", 8, chat=False)[0]


@pytest.mark.parametrize("body, param", [
    ({"structured_outputs": {"regex": "([a-z"}}, "structured_outputs"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_object"}, "min_tokens": 2}, "min_tokens"),
])
def test_bad_structured_outputs_are_400(server, body, param):
    url, _ = server
    with pytest.raises(openai.BadRequestError) as e:
        _client(url).completions.create(model="tiny", prompt="hi", max_tokens=4, extra_body=body)
    err = e.value.body
    assert param in (err.get("param") or "") + err["message"] and "\n" not in err["message"]
