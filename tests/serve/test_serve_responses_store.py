"""Stored Responses through the real `openai` client: `previous_response_id` continues a stored
response exactly as the chat request of the whole conversation would (its instructions not
carried over), retrieve / delete / input_items read the store, background runs finish (or are
cancelled, their sequence aborted) whatever the client does, a streamed background run can be
read again from any event, and `include` "message.output_text.logprobs" gives the chat answer's
log-probabilities."""

from __future__ import annotations

import time

import httpx2
import openai
import pytest

POLL_S, POLL_LIMIT_S = 0.05, 60
LOGPROBS = ["message.output_text.logprobs"]


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)


def _chat(client, messages, n_tokens, **kw):
    return client.chat.completions.create(model="tiny", messages=messages, max_tokens=n_tokens, temperature=0, **kw)


def _settled(client, rid: str):
    """The response `rid` once it has left queued / in_progress (polled, bounded)."""
    deadline = time.monotonic() + POLL_LIMIT_S
    while True:
        r = client.responses.retrieve(rid)
        if r.status not in ("queued", "in_progress"):
            return r
        assert time.monotonic() < deadline, f"response {rid} still {r.status}"
        time.sleep(POLL_S)


def test_previous_response_id_continues_the_stored_conversation(server):
    url, _ = server
    client = _client(url)
    first = client.responses.create(model="tiny", instructions="Be brief", input="hi", max_output_tokens=6,
                                    temperature=0)
    assert first.store is True
    second = client.responses.create(model="tiny", previous_response_id=first.id, input="more", max_output_tokens=6,
                                     temperature=0)
    convo = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": first.output_text},
             {"role": "user", "content": "more"}]
    chat = _chat(client, convo, 6)  # the earlier instructions are not carried over (OpenAI's rule)
    assert second.output_text == chat.choices[0].message.content
    assert second.usage.input_tokens == chat.usage.prompt_tokens and second.previous_response_id == first.id
    # a third turn, streamed, with instructions of its own: the whole chain before it
    with client.responses.stream(model="tiny", previous_response_id=second.id, input="and?", instructions="Rhyme",
                                 max_output_tokens=6, temperature=0) as stream:
        third = list(stream)[-1].response  # response.completed's, or response.incomplete's
    chat = _chat(client, [{"role": "system", "content": "Rhyme"}, *convo,
                          {"role": "assistant", "content": second.output_text}, {"role": "user", "content": "and?"}], 6)
    assert third.output_text == chat.choices[0].message.content
    assert client.responses.retrieve(third.id).output_text == third.output_text  # streamed ones are stored too


def test_retrieve_delete_and_input_items_read_the_store(server):
    url, _ = server
    client = _client(url)
    r = client.responses.create(model="tiny", input=[{"role": "user", "content": "one"},
                                                     {"role": "assistant", "content": "two"},
                                                     {"role": "user", "content": [{"type": "input_text", "text": "3"}]}],
                                max_output_tokens=4, temperature=0)
    got = client.responses.retrieve(r.id)
    assert (got.id, got.output_text, got.status, got.usage.output_tokens) == \
        (r.id, r.output_text, r.status, r.usage.output_tokens)
    items = client.responses.input_items.list(r.id)
    assert [i.content[0].text for i in items.data] == ["3", "two", "one"]  # newest first, OpenAI's default
    asc = client.responses.input_items.list(r.id, order="asc", limit=2)
    assert [i.content[0].text for i in asc.data] == ["one", "two"] and asc.has_more
    assert [i.content[0].text for i in asc.data[-1:]] == ["two"]
    rest = client.responses.input_items.list(r.id, order="asc", after=asc.data[-1].id)
    assert [i.content[0].text for i in rest.data] == ["3"] and not rest.has_more
    client.responses.delete(r.id)
    for call in (lambda: client.responses.retrieve(r.id),
                 lambda: client.responses.create(model="tiny", input="x", previous_response_id=r.id)):
        with pytest.raises(openai.NotFoundError):
            call()
    unstored = client.responses.create(model="tiny", input="hi", max_output_tokens=2, store=False)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_a_background_response_runs_on_its_own_and_is_read_when_done(server, reference):
    url, _ = server
    client = _client(url)
    text, _ = reference("Tell me a story", 10)
    r = client.responses.create(model="tiny", input="Tell me a story", max_output_tokens=10, temperature=0,
                                background=True)
    assert r.status in ("queued", "in_progress") and r.background
    done = _settled(client, r.id)
    assert done.status in ("completed", "incomplete") and done.output_text == text
    with pytest.raises(openai.BadRequestError):  # only background responses are cancelled
        client.responses.cancel(client.responses.create(model="tiny", input="hi", max_output_tokens=2).id)
    assert client.responses.cancel(r.id).status == done.status  # a finished one stays as it is


def test_a_streamed_background_response_is_read_again_from_any_event(server, reference):
    url, _ = server
    client = _client(url)
    text, _ = reference("Tell me a story", 10)
    events = list(client.responses.create(model="tiny", input="Tell me a story", max_output_tokens=10,
                                          temperature=0, background=True, stream=True))
    rid = events[0].response.id
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == text
    assert [e.sequence_number for e in events] == list(range(len(events)))
    again = list(client.responses.retrieve(rid, stream=True, starting_after=3))
    assert [e.sequence_number for e in again] == list(range(4, len(events)))
    assert again[-1].response.output_text == text
    bad = httpx2.get(f"{url}/v1/responses/{rid}", params={"stream": "true", "starting_after": -2}, timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "starting_after"
    with pytest.raises(openai.BadRequestError):  # a response that was not a streamed background run
        list(client.responses.retrieve(client.responses.create(model="tiny", input="hi", max_output_tokens=2).id,
                                       stream=True))


def test_cancel_stops_a_background_run_and_frees_its_blocks(start_server, slow_steps, metric):
    with start_server(tweak=slow_steps(0.05), speculate_method="none") as (url, state):
        client = _client(url)
        alloc = state.loop.engine.cache.allocator
        free = alloc.num_free
        r = client.responses.create(model="tiny", input="Tell me a long story", max_output_tokens=200,
                                    temperature=0, background=True, extra_body={"ignore_eos": True})
        deadline = time.monotonic() + POLL_LIMIT_S
        while not client.responses.retrieve(r.id).output:  # it has started writing
            assert time.monotonic() < deadline
            time.sleep(POLL_S)
        with pytest.raises(openai.BadRequestError):  # a running response cannot be continued yet
            client.responses.create(model="tiny", input="x", previous_response_id=r.id)
        cancelled = client.responses.cancel(r.id)
        assert cancelled.status == "cancelled" and client.responses.retrieve(r.id).status == "cancelled"
        deadline = time.monotonic() + POLL_LIMIT_S
        while alloc.num_free < free or state.loop.engine.running:
            assert time.monotonic() < deadline, "the cancelled sequence still holds its KV blocks"
            time.sleep(POLL_S)
        aborted = 'quantspec_requests_total{finish_reason="abort",model_name="tiny"}'
        assert metric(url, aborted) == 1 and client.responses.retrieve(r.id).usage is None  # it never finished


def test_output_text_logprobs_are_the_chat_answers(server):
    url, _ = server
    client = _client(url)
    msgs = [{"role": "user", "content": "Tell me a story"}]
    chat = _chat(client, msgs, 8, logprobs=True, top_logprobs=2).choices[0].logprobs.content
    r = client.responses.create(model="tiny", input="Tell me a story", max_output_tokens=8, temperature=0,
                                include=LOGPROBS, top_logprobs=2)
    got = r.output[0].content[0].logprobs
    assert [e.token for e in got] == [e.token for e in chat]
    assert [e.logprob for e in got] == pytest.approx([e.logprob for e in chat], abs=1e-4)
    assert [[t.token for t in e.top_logprobs] for e in got] == [[t.token for t in e.top_logprobs] for e in chat]
    with client.responses.stream(model="tiny", input="Tell me a story", max_output_tokens=8, temperature=0,
                                 include=LOGPROBS, top_logprobs=2) as stream:
        deltas = [e for e in stream if e.type == "response.output_text.delta"]
    assert [lp.token for e in deltas for lp in e.logprobs] == [e.token for e in chat]
    plain = client.responses.create(model="tiny", input="Tell me a story", max_output_tokens=2)
    assert plain.output[0].content[0].logprobs == []


def test_a_server_that_stores_nothing_refuses_what_needs_the_store(start_server):
    with start_server(max_stored_responses=0) as (url, _):
        client = _client(url)
        r = client.responses.create(model="tiny", input="hi", max_output_tokens=2)
        assert r.store is False
        for body, param in (({"previous_response_id": r.id}, "previous_response_id"), ({"background": True}, "background")):
            got = httpx2.post(f"{url}/v1/responses", json={"model": "tiny", "input": "hi", **body}, timeout=60)
            assert got.status_code == 400 and got.json()["error"]["param"] == param, got.text
