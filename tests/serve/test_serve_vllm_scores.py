"""vLLM's `prompt_logprobs`, `bad_words`, chat `echo`, `return_token_ids` and
`return_tokens_as_token_ids` through `quantspec serve`: prompt scores against transformers'
log-softmax of the same checkpoint, banned words against transformers'
`generate(bad_words_ids=...)`, the echoed last message against the answer without it, and token
ids against the tokenizer and `quantspec infer`."""

from __future__ import annotations

import json

import httpx2
import openai
import pytest
import torch

from quantspec.serve.text import bad_words_ids, chat_prompt_ids

ATOL = 1e-4


def _post(url: str, route: str, body: dict):
    return httpx2.post(f"{url}/v1/{route}", json={"model": "tiny", **body}, timeout=60)


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _check_prompt_scores(scores: list, ids: list[int], ref: torch.Tensor, n: int, tokenizer) -> None:
    """vLLM's `prompt_logprobs` of prompt `ids` against `ref` [len(ids), V] (transformers')."""
    assert len(scores) == len(ids) and scores[0] is None
    for i, (tok, entry) in enumerate(zip(ids[1:], scores[1:])):
        row = ref[i]
        own = entry[str(tok)]
        assert abs(own["logprob"] - float(row[tok])) < ATOL
        assert own["rank"] == int((row > row[tok]).sum()) + 1 and own["decoded_token"] == tokenizer.decode([tok])
        top = row.topk(n).indices.tolist()
        assert set(entry) == {str(t) for t in top} | {str(tok)}
        for rank, t in enumerate(top, start=1):
            assert t == tok or (entry[str(t)]["rank"] == rank and abs(entry[str(t)]["logprob"] - float(row[t])) < ATOL)


def test_prompt_logprobs_on_completions_equal_transformers(server, hf_logprobs, tiny_loaded):
    url, _ = server
    prompts = [_ids(12, 1), _ids(7, 2)]
    out = _post(url, "completions", {"prompt": prompts, "max_tokens": 2, "temperature": 0, "n": 2,
                                     "prompt_logprobs": 3}).json()
    assert len(out["choices"]) == 4
    for choice in out["choices"]:
        ids = prompts[choice["index"] // 2]
        _check_prompt_scores(choice["prompt_logprobs"], ids, hf_logprobs(ids), 3, tiny_loaded.tokenizer)
    # beside echo's legacy scores, each keeps its own number of most likely tokens
    both = _post(url, "completions", {"prompt": prompts[0], "max_tokens": 1, "temperature": 0, "echo": True,
                                      "logprobs": 1, "prompt_logprobs": 4}).json()["choices"][0]
    assert all(len(top) <= 2 for top in both["logprobs"]["top_logprobs"][1:])
    _check_prompt_scores(both["prompt_logprobs"], prompts[0], hf_logprobs(prompts[0]), 4, tiny_loaded.tokenizer)
    plain = _post(url, "completions", {"prompt": prompts[0], "max_tokens": 1}).json()["choices"][0]
    assert "prompt_logprobs" not in plain


def test_prompt_logprobs_on_chat_through_the_openai_client(server, hf_logprobs, tiny_loaded):
    url, state = server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
    msgs = [{"role": "user", "content": "Name a colour"}]
    r = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=1, temperature=0,
                                       extra_body={"prompt_logprobs": 2})
    ids = chat_prompt_ids(state.tokenizer, msgs)
    _check_prompt_scores(r.model_extra["prompt_logprobs"], ids, hf_logprobs(ids), 2, tiny_loaded.tokenizer)
    streamed = _post(url, "chat/completions", {"messages": msgs, "max_tokens": 1, "prompt_logprobs": 1,
                                               "stream": True})
    assert streamed.status_code == 400 and streamed.json()["error"]["param"] == "prompt_logprobs"


def _word_in(answer: list[int], tokenizer) -> tuple[str, int]:
    """A two-token stretch of `answer` (from its second token on) whose text tokenizes back to those
    two tokens, as that text and where it starts."""
    for i in range(1, len(answer) - 1):
        text = tokenizer.decode(answer[i:i + 2])
        if text == text.lstrip() and tokenizer(text, add_special_tokens=False).input_ids == answer[i:i + 2]:
            return text, i
    raise AssertionError("no two-token word in the answer tokenizes back to itself")


def test_bad_words_equal_transformers_bad_words_ids(server, hf_greedy, hf_tiny_llama, tiny_loaded):
    url, _ = server
    tok = tiny_loaded.tokenizer
    prompt, n = _ids(10, 5), 16
    answer = hf_greedy(prompt, n)
    word, at = _word_in(answer, tok)
    banned = bad_words_ids(tok, [word, tok.decode(answer[:1]).strip() or "x"])
    assert answer[at:at + 2] in banned and prompt[-1] not in [w[0] for w in banned if len(w) > 1]
    with torch.no_grad():  # transformers checks the prompt too: its last token starts no banned pair (above)
        want = hf_tiny_llama.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                      eos_token_id=None, pad_token_id=0, bad_words_ids=banned)[0, len(prompt):].tolist()
    body = {"prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True, "logprobs": 0,
            "bad_words": [word, tok.decode(answer[:1]).strip() or "x"]}
    got = _post(url, "completions", body).json()["choices"][0]["logprobs"]["tokens"]
    assert got == [tok.decode([t]) for t in want] and want != answer
    bad = _post(url, "completions", {"prompt": prompt, "max_tokens": 2, "bad_words": ["  "]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "bad_words"


@pytest.mark.parametrize("stream", [False, True])
def test_chat_echo_puts_the_last_message_before_the_answer(server, stream):
    url, _ = server
    msgs = [{"role": "user", "content": "Count"}, {"role": "assistant", "content": "one two"}]
    base = {"messages": msgs, "max_tokens": 4, "temperature": 0, "add_generation_prompt": False,
            "continue_final_message": True}
    plain = _post(url, "chat/completions", base).json()["choices"][0]["message"]["content"]

    def content(body: dict) -> str:
        if not stream:
            return _post(url, "chat/completions", body).json()["choices"][0]["message"]["content"]
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
        extra = {k: v for k, v in body.items() if k not in ("messages", "max_tokens", "temperature")}
        chunks = client.chat.completions.create(model="tiny", messages=body["messages"], max_tokens=4, temperature=0,
                                                stream=True, extra_body=extra)
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)

    assert content({**base, "echo": True}) == "one two" + plain
    user_last = {"messages": msgs[:1], "max_tokens": 4, "temperature": 0}  # the answer's role is not the user's
    assert content({**user_last, "echo": True}) == content(user_last)


def _sse(url: str, route: str, body: dict) -> list[dict]:
    with httpx2.stream("POST", f"{url}/v1/{route}", json={"model": "tiny", "stream": True, **body}, timeout=60) as r:
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(x) for x in lines[:-1]]


def test_return_token_ids_on_completions_whole_and_streamed(server, reference, tiny_loaded):
    url, _ = server
    text, want = reference("Hello there", 8, chat=False)
    body = {"prompt": "Hello there", "max_tokens": 8, "temperature": 0, "return_token_ids": True}
    choice = _post(url, "completions", body).json()["choices"][0]
    assert choice["prompt_token_ids"] == tiny_loaded.tokenizer("Hello there").input_ids
    assert choice["token_ids"] == want and choice["text"] == text
    chunks = _sse(url, "completions", {**body, "n": 2})
    for index in (0, 1):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == index]
        assert mine[0]["prompt_token_ids"] == choice["prompt_token_ids"]
        assert all("prompt_token_ids" not in c for c in mine[1:])
        assert [t for c in mine for t in c["token_ids"]] == want
    assert "token_ids" not in _post(url, "completions", {**body, "return_token_ids": False}).json()["choices"][0]


def test_return_token_ids_on_chat_through_the_openai_client(server, reference):
    url, state = server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
    msgs = [{"role": "user", "content": "Tell me a story"}]
    text, want = reference("Tell me a story", 10)
    r = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=10, temperature=0,
                                       extra_body={"return_token_ids": True})
    assert r.model_extra["prompt_token_ids"] == chat_prompt_ids(state.tokenizer, msgs)
    assert r.choices[0].model_extra["token_ids"] == want and r.choices[0].message.content == text
    chunks = list(client.chat.completions.create(model="tiny", messages=msgs, max_tokens=10, temperature=0,
                                                 stream=True, extra_body={"return_token_ids": True}))
    assert chunks[0].model_extra["prompt_token_ids"] == r.model_extra["prompt_token_ids"]
    assert [t for c in chunks[1:] for t in c.choices[0].model_extra["token_ids"]] == want


def test_return_tokens_as_token_ids_names_logprob_tokens_by_id(server):
    url, _ = server
    body = {"prompt": "Hello there", "max_tokens": 6, "temperature": 0, "logprobs": 2, "return_token_ids": True}
    plain = _post(url, "completions", body).json()["choices"][0]
    named = _post(url, "completions", {**body, "return_tokens_as_token_ids": True}).json()["choices"][0]
    assert named["logprobs"]["tokens"] == [f"token_id:{t}" for t in plain["token_ids"]]
    assert named["logprobs"]["text_offset"] == plain["logprobs"]["text_offset"]
    assert all(all(k.startswith("token_id:") for k in top) for top in named["logprobs"]["top_logprobs"])
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0, "logprobs": True,
            "top_logprobs": 1, "return_token_ids": True, "return_tokens_as_token_ids": True}
    choice = _post(url, "chat/completions", chat).json()["choices"][0]
    assert [c["token"] for c in choice["logprobs"]["content"]] == [f"token_id:{t}" for t in choice["token_ids"]]
