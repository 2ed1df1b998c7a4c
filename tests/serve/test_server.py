"""`quantspec serve` through the real `openai` client on 127.0.0.1: chat and completions, streaming
and not, usage, stop strings, greedy outputs equal to `quantspec infer`'s whatever else is in the
batch, 64 concurrent requests, disconnects, bad input (overload: `test_overload.py`)."""

from __future__ import annotations

import asyncio
import json
import time

import httpx2
import openai
import pytest


PROMPTS = ["Hello there", "Tell me a story about a cat", "def add(a, b):", "1 2 3 4 5 6 7 8", "The quick brown fox",
           "What is the capital of France?", "Write a haiku", "abc abc abc abc"]


def _client(url: str, **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60, **kw)


def _chat(client, prompt, max_tokens, **kw):
    return client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": prompt}],
                                          max_tokens=max_tokens, temperature=0, **kw)


def test_chat_and_completions_equal_quantspec_infer(server, reference):
    url, _ = server
    client = _client(url)
    want_text, want_ids = reference(PROMPTS[1], 20)
    r = _chat(client, PROMPTS[1], 20)
    assert r.choices[0].message.content == want_text and r.choices[0].message.role == "assistant"
    assert r.usage.completion_tokens == len(want_ids) and r.usage.total_tokens == r.usage.prompt_tokens + len(want_ids)
    assert r.choices[0].finish_reason == ("length" if len(want_ids) == 20 else "stop")
    want_text, want_ids = reference(PROMPTS[2], 12, chat=False)
    c = client.completions.create(model="tiny", prompt=PROMPTS[2], max_tokens=12, temperature=0)
    assert c.choices[0].text == want_text and c.usage.completion_tokens == len(want_ids)


def test_streaming_chat_and_completions_with_usage(server, reference):
    url, _ = server
    client = _client(url)
    want_text, want_ids = reference(PROMPTS[0], 24)
    chunks = list(_chat(client, PROMPTS[0], 24, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want_text
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert chunks[-1].usage.completion_tokens == len(want_ids) and not chunks[-1].choices
    want_text, _ = reference(PROMPTS[4], 16, chat=False)
    stream = client.completions.create(model="tiny", prompt=PROMPTS[4], max_tokens=16, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in stream) == want_text


def test_stop_strings_cut_the_text(server, reference):
    url, _ = server
    client = _client(url)
    text, _ = reference(PROMPTS[3], 40)
    stop = text[len(text) // 2: len(text) // 2 + 3]
    if len(stop) < 2:
        pytest.skip("the tiny model's answer is too short for a stop string")
    want = text[: text.find(stop)]
    r = _chat(client, PROMPTS[3], 40, stop=[stop])
    assert r.choices[0].message.content == want and r.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].delta.content or "" for c in _chat(client, PROMPTS[3], 40, stop=stop, stream=True)
                       if c.choices)
    assert streamed == want


def test_64_concurrent_requests_complete_with_the_greedy_outputs(server, reference):
    """64 requests at once (8 run, the rest queue), mixed streaming / speculation opt-out: each
    answer is `quantspec infer`'s for its prompt, whatever else shares the batch."""
    url, _ = server
    want = {p: reference(p, 24)[0] for p in PROMPTS}

    async def one(client, i):
        prompt = PROMPTS[i % len(PROMPTS)]
        kw = dict(model="tiny", messages=[{"role": "user", "content": prompt}], max_tokens=24, temperature=0,
                  extra_body={"speculate": i % 3 != 0})
        if i % 2:
            stream = await client.chat.completions.create(stream=True, **kw)
            return prompt, "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        r = await client.chat.completions.create(**kw)
        return prompt, r.choices[0].message.content

    async def main():
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
        return await asyncio.gather(*(one(client, i) for i in range(64)))

    t0 = time.monotonic()
    results = asyncio.run(main())
    assert time.monotonic() - t0 < 120
    assert len(results) == 64 and all(text == want[p] for p, text in results)


@pytest.mark.parametrize("route, body, marker", [
    ("completions", {"prompt": PROMPTS[1], "max_tokens": 200}, "data:"),
    ("responses", {"input": PROMPTS[1], "max_output_tokens": 200}, "event: response.output_text.delta"),
])
def test_a_disconnect_aborts_the_sequence_and_frees_its_blocks(server, metric, route, body, marker):
    url, state = server
    alloc = state.loop.engine.cache.allocator
    free = alloc.num_free
    body = {"model": "tiny", "temperature": 0, "stream": True, **body}
    aborted = 'quantspec_requests_total{finish_reason="abort",model_name="tiny"}'
    try:
        before = metric(url, aborted)
    except AssertionError:  # no request aborted yet: the sample is not there
        before = 0
    with httpx2.Client(timeout=30) as http:
        with http.stream("POST", f"{url}/v1/{route}", json=body) as r:
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith(marker))
            assert alloc.num_free < free
    deadline = time.monotonic() + 10
    while alloc.num_free < free and time.monotonic() < deadline:
        time.sleep(0.01)
    assert alloc.num_free == free and not state.loop.engine.running
    assert metric(url, "quantspec_kv_blocks_used") == 0
    assert metric(url, aborted) == before + 1


BAD = [
    (b"{not json", None),
    (json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": "10"}).encode(), "max_tokens"),
    (json.dumps({"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}).encode(), "temperature"),
    (json.dumps({"messages": "hi"}).encode(), "messages"),
    (json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 100000}).encode(), "max_tokens"),
    (json.dumps({"messages": [{"role": "user", "content": "hi " * 400}]}).encode(), "messages"),
    (json.dumps({"messages": [{"role": "user", "content": "hi"}], "n": 0}).encode(), "n"),
    (json.dumps({"messages": [{"role": "user", "content": "hi"}], "n": 129}).encode(), "n"),
    (json.dumps({"messages": [{"role": "user", "content": "hi"}], "model": "gpt-4o"}).encode(), "model"),
    (json.dumps({"messages": [{"role": "user", "content": "hi"}], "stream": "yes"}).encode(), "stream"),
    (json.dumps([1, 2]).encode(), None),
]


@pytest.mark.parametrize("body,param", BAD, ids=[f"bad{i}" for i in range(len(BAD))])
def test_bad_input_is_a_400_with_an_openai_error(server, body, param):
    url, _ = server
    r = httpx2.post(f"{url}/v1/chat/completions", content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"]
    if param is not None:
        assert err["param"].split(".")[0] == param
    assert _chat(_client(url), "still serving", 2).choices  # the server keeps serving


def test_the_openai_client_sees_a_400_as_bad_request(server):
    url, _ = server
    with pytest.raises(openai.BadRequestError):
        _client(url).completions.create(model="tiny", prompt="x", max_tokens=10, n=200)


def test_models_health_and_metrics(server):
    url, _ = server
    assert [m.id for m in _client(url).models.list()] == ["tiny"]
    assert _client(url).models.retrieve("tiny").id == "tiny" and _client(url).models.retrieve("default").id == "default"
    with pytest.raises(openai.NotFoundError):
        _client(url).models.retrieve("gpt-4")
    from quantspec import __version__

    assert httpx2.get(f"{url}/version").json() == {"version": __version__}
    assert httpx2.get(f"{url}/health").json() == {"status": "ok", "kv_cache": "float (float32)"}
    _chat(_client(url), PROMPTS[7], 8)
    text = httpx2.get(f"{url}/metrics").text
    for name in ("requests_running", "requests_waiting", "kv_blocks_used", "time_to_first_token_seconds_bucket",
                 "time_per_output_token_seconds_bucket", "spec_drafts_total", "spec_draft_tokens_total",
                 "spec_accepted_tokens_total"):
        assert f"quantspec_{name}" in text


def test_a_client_s_request_id_names_the_answer_and_comes_back(server):
    url, _ = server
    head = {"X-Request-Id": "job-42.a"}
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    r = httpx2.post(f"{url}/v1/chat/completions", json=chat, headers=head, timeout=60)
    assert r.headers["x-request-id"] == "job-42.a" and r.json()["id"] == "chatcmpl-job-42.a"
    with httpx2.stream("POST", f"{url}/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2,
                                                              "stream": True}, headers=head, timeout=60) as s:
        first = json.loads(next(line for line in s.iter_lines() if line.startswith("data: "))[6:])
        assert s.headers["x-request-id"] == "job-42.a" and first["id"] == "cmpl-job-42.a"
    resp = httpx2.post(f"{url}/v1/responses", json={"model": "tiny", "input": "hi", "max_output_tokens": 2},
                       headers=head, timeout=60)
    assert resp.json()["id"] == "resp_job-42.a"
    bad = httpx2.post(f"{url}/v1/chat/completions", json={**chat, "n": 0}, headers=head, timeout=60)
    assert bad.status_code == 400 and bad.headers["x-request-id"] == "job-42.a"
    odd = httpx2.post(f"{url}/v1/chat/completions", json=chat, headers={"X-Request-Id": "a b/c"}, timeout=60)
    assert odd.headers["x-request-id"] == "a b/c" and "a b" not in odd.json()["id"]  # not a plain id: not in the body
    assert "x-request-id" not in httpx2.post(f"{url}/v1/chat/completions", json=chat, timeout=60).headers
