"""vLLM's request fields through `quantspec serve`, against transformers and the tokenizer:
`allowed_token_ids`, `truncate_prompt_tokens`, `skip_special_tokens`, `include_stop_str_in_output`,
chat's `continue_final_message`; and OpenAI's or vLLM's fields the server does not implement are
a 400 naming them, never silently ignored."""

from __future__ import annotations

import httpx2
import pytest
import torch


def _post(url: str, route: str, body: dict):
    return httpx2.post(f"{url}/v1/{route}", json={"model": "tiny", **body}, timeout=60)


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_allowed_token_ids_pick_the_most_likely_allowed_token(server, hf_logprobs, tiny_loaded):
    url, _ = server
    prompt, allowed = _ids(9, 1), [40, 41, 300, 301]
    r = _post(url, "completions", {"prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True,
                                   "allowed_token_ids": allowed}).json()
    ids = list(prompt)
    for _ in range(6):
        row = hf_logprobs(ids)[-1]
        ids.append(max(allowed, key=lambda t: float(row[t])))
    assert r["choices"][0]["text"] == tiny_loaded.tokenizer.decode(ids[len(prompt):], skip_special_tokens=True)
    bad = _post(url, "completions", {"prompt": prompt, "max_tokens": 2, "allowed_token_ids": [10**6]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "allowed_token_ids"


def test_truncate_prompt_tokens_keeps_the_last_tokens(server, hf_greedy, tiny_loaded):
    url, _ = server
    prompt = _ids(30, 2)
    r = _post(url, "completions", {"prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True,
                                   "truncate_prompt_tokens": 10}).json()
    assert r["usage"]["prompt_tokens"] == 10
    assert r["choices"][0]["text"] == tiny_loaded.tokenizer.decode(hf_greedy(prompt[-10:], 6), skip_special_tokens=True)


def test_special_tokens_and_stop_strings_in_the_text(server, reference):
    url, _ = server
    base = {"prompt": _ids(5, 3), "max_tokens": 4, "temperature": 0, "ignore_eos": True, "allowed_token_ids": [1]}
    assert _post(url, "completions", base).json()["choices"][0]["text"] == ""
    kept = _post(url, "completions", {**base, "skip_special_tokens": False}).json()["choices"][0]["text"]
    assert kept == "<|im_start|>" * 4
    text, _ = reference("Hello there", 16, chat=False)
    stop = text[len(text) // 2:len(text) // 2 + 2]
    cut = text[:text.find(stop)]
    body = {"prompt": "Hello there", "max_tokens": 16, "temperature": 0, "stop": [stop]}
    assert _post(url, "completions", body).json()["choices"][0]["text"] == cut
    assert _post(url, "completions", {**body, "include_stop_str_in_output": True}).json()["choices"][0]["text"] == \
        cut + stop


def test_continue_final_message_leaves_the_last_turn_open(server, tiny_loaded):
    url, _ = server
    msgs = [{"role": "user", "content": "Count"}, {"role": "assistant", "content": "one two"}]
    want = tiny_loaded.tokenizer.apply_chat_template(msgs, tokenize=False, continue_final_message=True)
    r = _post(url, "chat/completions", {"messages": msgs, "max_tokens": 2, "continue_final_message": True,
                                        "add_generation_prompt": False}).json()
    assert r["usage"]["prompt_tokens"] == len(tiny_loaded.tokenizer(want, add_special_tokens=False).input_ids)
    bad = _post(url, "chat/completions", {"messages": msgs, "max_tokens": 2, "continue_final_message": True})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "continue_final_message"


@pytest.mark.parametrize("route, field, value, hint", [
    ("completions", "use_beam_search", True, ""),
    ("completions", "guided_json", {"type": "object"}, "structured_outputs.json"),
    ("completions", "best_of", 2, ""),
    ("chat/completions", "functions", [{"name": "f"}], "tools"),
    ("chat/completions", "guided_regex", "a+", "structured_outputs.regex"),
])
def test_fields_the_server_does_not_implement_are_400(server, route, field, value, hint):
    url, _ = server
    body = {"max_tokens": 2, field: value,
            **({"messages": [{"role": "user", "content": "hi"}]} if route.startswith("chat") else {"prompt": "hi"})}
    r = _post(url, route, body)
    assert r.status_code == 400 and r.json()["error"]["param"] == field and hint in r.json()["error"]["message"]


def test_neutral_values_of_those_fields_are_served(server):
    url, _ = server
    r = _post(url, "completions", {"prompt": "hi", "max_tokens": 2, "use_beam_search": False, "best_of": 1,
                                   "bad_words": [], "length_penalty": 1.0})
    assert r.status_code == 200


def test_stop_reason_names_the_stop_string_or_token_that_ended_the_answer(server, hf_greedy, tiny_loaded):
    url, _ = server
    prompt = _ids(12, 3)
    greedy = hf_greedy(prompt, 12)
    text = tiny_loaded.tokenizer.decode(greedy, skip_special_tokens=True)
    stop = text[len(text) // 2:len(text) // 2 + 2]
    by_string = _post(url, "completions", {"prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True,
                                           "stop": [stop]}).json()["choices"][0]
    assert by_string["finish_reason"] == "stop" and by_string["stop_reason"] == stop
    by_token = _post(url, "completions", {"prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True,
                                          "stop_token_ids": [greedy[4]]}).json()["choices"][0]
    assert by_token["finish_reason"] == "stop" and by_token["stop_reason"] == greedy[4]
    by_length = _post(url, "chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
                                                "temperature": 0, "ignore_eos": True}).json()["choices"][0]
    assert by_length["finish_reason"] == "length" and by_length["stop_reason"] is None


def test_continuous_usage_stats_give_the_usage_so_far_in_every_chunk(server):
    import json

    url, _ = server
    body = {"model": "tiny", "prompt": _ids(8, 4), "max_tokens": 6, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    with httpx2.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    counts = [c["usage"]["completion_tokens"] for c in chunks]
    assert all(c["usage"]["prompt_tokens"] == 8 for c in chunks) and counts == sorted(counts) and counts[-1] == 6
    assert chunks[-1]["choices"] == [] and chunks[-2]["choices"][0]["stop_reason"] is None


def test_the_stop_token_s_own_text_is_not_the_answer_s(server, hf_greedy, tiny_loaded):
    """As vLLM: the EOS or stop_token_ids token that ends an answer counts in its usage and token
    ids, not in its text (not even with skip_special_tokens false), unless include_stop_str_in_output."""
    url, state = server
    tok = tiny_loaded.tokenizer
    eos = min(state.loop.engine.eos)
    base = {"model": "tiny", "prompt": _ids(6, 3), "max_tokens": 5, "temperature": 0, "logit_bias": {str(eos): 100},
            "skip_special_tokens": False, "return_token_ids": True}
    r = _post(url, "completions", base).json()
    assert r["choices"][0]["text"] == "" and r["choices"][0]["token_ids"] == [eos] and r["usage"]["completion_tokens"] == 1
    kept = _post(url, "completions", {**base, "include_stop_str_in_output": True}).json()["choices"][0]["text"]
    assert kept == tok.decode([eos])
    prompt = _ids(12, 3)
    greedy = hf_greedy(prompt, 12)
    body = {"prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True, "stop_token_ids": [greedy[4]],
            "skip_special_tokens": False}
    cut = greedy[:greedy.index(greedy[4]) + 1]
    got = _post(url, "completions", body).json()
    assert got["choices"][0]["text"] == tok.decode(cut[:-1]) and got["usage"]["completion_tokens"] == len(cut)
    assert _post(url, "completions", {**body, "include_stop_str_in_output": True}).json()["choices"][0]["text"] == \
        tok.decode(cut)
