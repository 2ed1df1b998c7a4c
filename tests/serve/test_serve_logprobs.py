"""Log-probabilities and sampling knobs through `quantspec serve`, against transformers' log-softmax
of the same checkpoint: chat `logprobs` / `top_logprobs` (streamed and whole), legacy completions
`logprobs` with `echo` (lm-evaluation-harness's loglikelihood request, and `max_tokens` 0 to score
a prompt alone), penalties against transformers' `generate`, a logit bias, and the sampling knobs
the server does not implement refused instead of ignored."""

from __future__ import annotations

import httpx2
import openai
import pytest
import torch

from quantspec.serve.text import chat_prompt_ids

ATOL = 1e-4


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)


def _post(url: str, path: str, body: dict) -> httpx2.Response:
    return httpx2.post(f"{url}/v1/{path}", json=body, timeout=60)


def test_chat_logprobs_equal_transformers_streamed_or_not(server, hf_logprobs, reference):
    url, state = server
    client = _client(url)
    prompt = "Tell me a story about a cat"
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": prompt}], max_tokens=16,
                                       temperature=0, logprobs=True, top_logprobs=3)
    want_text, want_ids = reference(prompt, 16)
    content = r.choices[0].logprobs.content
    assert r.choices[0].message.content == want_text and len(content) == len(want_ids)
    assert b"".join(bytes(c.bytes) for c in content).decode("utf-8", "replace") == want_text  # every token's bytes
    prompt_ids = chat_prompt_ids(state.tokenizer, [{"role": "user", "content": prompt}])
    ref = hf_logprobs(prompt_ids + want_ids)[len(prompt_ids) - 1:]
    got = torch.tensor([c.logprob for c in content])
    assert torch.allclose(got, ref[torch.arange(len(want_ids)), torch.tensor(want_ids)], atol=ATOL)
    for c, row in zip(content, ref):
        top = row.topk(3)
        assert [t.token for t in c.top_logprobs] == [state.tokenizer.decode([i]) for i in top.indices.tolist()]
        assert torch.allclose(torch.tensor([t.logprob for t in c.top_logprobs]), top.values, atol=ATOL)
    chunks = list(client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": prompt}],
                                                 max_tokens=16, temperature=0, logprobs=True, top_logprobs=3,
                                                 stream=True))
    streamed = [c for ch in chunks if ch.choices and ch.choices[0].logprobs for c in ch.choices[0].logprobs.content]
    assert [(c.token, c.logprob) for c in streamed] == [(c.token, c.logprob) for c in content]
    plain = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": prompt}], max_tokens=16,
                                           temperature=0)
    assert plain.choices[0].logprobs is None


def test_lm_eval_loglikelihood_request(server, hf_logprobs):
    """lm-evaluation-harness's `local-completions` scoring payload (token ids, echo, logprobs 1,
    max_tokens 1, several prompts per request) and its parse: sum of the continuation's
    log-probabilities, and whether each continuation token was the most likely."""
    url, _ = server
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (14, 25, 6)]
    ctxlens = [9, 20, 3]
    body = {"model": "tiny", "prompt": prompts, "temperature": 0, "max_tokens": 1, "logprobs": 1, "seed": 1234,
            "echo": True}
    out = _post(url, "completions", body).json()
    assert [c["index"] for c in out["choices"]] == [0, 1, 2]
    assert out["usage"]["prompt_tokens"] == sum(map(len, prompts)) and out["usage"]["completion_tokens"] == 3
    for choice, ids, ctxlen in zip(out["choices"], prompts, ctxlens):
        lp = choice["logprobs"]
        assert len(lp["token_logprobs"]) == len(ids) + 1 and lp["token_logprobs"][0] is None
        assert lp["top_logprobs"][0] is None and lp["text_offset"][0] == 0
        ref = hf_logprobs(ids)
        cont = ids[ctxlen:]
        want = ref[torch.arange(ctxlen - 1, len(ids) - 1), torch.tensor(cont)]
        assert abs(sum(lp["token_logprobs"][ctxlen:-1]) - float(want.sum())) < 1e-3  # lm-eval's sum
        greedy = all(tok == max(top.values()) for tok, top in zip(lp["token_logprobs"][ctxlen:-1],
                                                                  lp["top_logprobs"][ctxlen:-1]))
        assert greedy == all(int(ref[i].argmax()) == t for i, t in zip(range(ctxlen - 1, len(ids) - 1), cont))
        last = ref[-1]  # the generated token's row
        assert abs(lp["token_logprobs"][-1] - float(last.max())) < ATOL


def test_echo_with_max_tokens_zero_scores_the_prompt_only(server, hf_logprobs, metric):
    url, state = server
    prompt = "The quick brown fox"
    generated = metric(url, 'quantspec_generation_tokens_total{model_name="tiny"}')
    out = _post(url, "completions", {"model": "tiny", "prompt": prompt, "max_tokens": 0, "echo": True,
                                      "logprobs": 2}).json()
    # the engine runs the prefill and one step (its token is dropped), not a whole answer
    assert metric(url, 'quantspec_generation_tokens_total{model_name="tiny"}') == generated + 1
    choice = out["choices"][0]
    ids = state.tokenizer(prompt).input_ids
    assert choice["text"] == prompt and choice["finish_reason"] == "length"
    assert out["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 0, "total_tokens": len(ids)}
    lp = choice["logprobs"]
    ref = hf_logprobs(ids)
    assert len(lp["tokens"]) == len(ids) and lp["token_logprobs"][0] is None
    assert torch.allclose(torch.tensor(lp["token_logprobs"][1:]),
                          ref[torch.arange(len(ids) - 1), torch.tensor(ids[1:])], atol=ATOL)
    assert all(len(top) >= 2 for top in lp["top_logprobs"][1:])
    assert lp["text_offset"] == sorted(lp["text_offset"]) and lp["text_offset"][-1] < len(prompt)
    echoed = _client(url).completions.create(model="tiny", prompt=prompt, max_tokens=4, temperature=0, echo=True)
    assert echoed.choices[0].text.startswith(prompt) and len(echoed.choices[0].text) > len(prompt)


@pytest.mark.parametrize("path, body, param", [
    ("chat/completions", {"top_logprobs": 2}, "top_logprobs"),
    ("chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("completions", {"logprobs": -1}, "logprobs"),
    ("completions", {"max_tokens": 0}, "max_tokens"),
    ("completions", {"presence_penalty": 2.5}, "presence_penalty"),
    ("chat/completions", {"repetition_penalty": 0}, "repetition_penalty"),
    ("chat/completions", {"min_p": 1.5}, "min_p"),
    ("completions", {"best_of": 3}, "best_of"),
    ("completions", {"logit_bias": {"five": 10}}, "logit_bias"),
    ("completions", {"logit_bias": {"512": 10}}, "logit_bias"),
    ("chat/completions", {"logit_bias": {"5": 101}}, "logit_bias"),
    ("completions", {"prompt": [[1, 2], []]}, "prompt"),
])
def test_what_the_server_cannot_honour_is_a_400(server, path, body, param):
    url, _ = server
    base = ({"messages": [{"role": "user", "content": "hi"}]} if path.startswith("chat") else {"prompt": "hi"})
    r = _post(url, path, {"model": "tiny", "max_tokens": 4, **base, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param or param in err["message"]


def test_neutral_values_of_unimplemented_knobs_are_accepted(server):
    url, _ = server
    r = _post(url, "chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                                        "max_tokens": 3, "best_of": 1, "temperature": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["logprobs"] is None


def test_repetition_penalty_equals_transformers_generate(server, hf_tiny_llama):
    url, state = server
    hf = hf_tiny_llama
    ids = torch.randint(3, 500, (8,), generator=torch.Generator().manual_seed(12)).tolist() * 3
    out = _post(url, "completions", {"model": "tiny", "prompt": ids, "max_tokens": 12, "temperature": 0,
                                      "repetition_penalty": 0.5, "logprobs": 0}).json()
    with torch.no_grad():
        want = hf.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False, repetition_penalty=0.5,
                           pad_token_id=0)[0, len(ids):].tolist()
    got = out["choices"][0]["logprobs"]["tokens"]
    assert got == [state.tokenizer.decode([t]) for t in want] and len(got) == out["usage"]["completion_tokens"]
    plain = _post(url, "completions", {"model": "tiny", "prompt": ids, "max_tokens": 12, "temperature": 0}).json()
    assert plain["choices"][0]["text"] != out["choices"][0]["text"]


def test_logit_bias_steers_greedy_answers(server, reference):
    url, state = server
    client = _client(url)
    r = client.completions.create(model="tiny", prompt="Hello there", max_tokens=6, temperature=0, logprobs=0,
                                  logit_bias={"37": 100})
    assert r.choices[0].logprobs.tokens == [state.tokenizer.decode([37])] * 6
    _, (first, *_) = reference("Hello there", 1, chat=False)
    r = client.completions.create(model="tiny", prompt="Hello there", max_tokens=1, temperature=0, logprobs=0,
                                  logit_bias={str(first): -100})
    assert r.choices[0].logprobs.tokens[0] != state.tokenizer.decode([first])


def test_ignore_eos_stop_token_ids_and_min_tokens(server, reference):
    """An EOS forced by a logit bias ends the answer at once, unless `ignore_eos` or before
    `min_tokens`; a stop token ends it where it appears."""
    url, state = server
    eos = min(state.loop.engine.eos)
    base = {"model": "tiny", "prompt": "Hello there", "max_tokens": 9, "temperature": 0,
            "logit_bias": {str(eos): 100}}

    def tokens(**body):
        return _post(url, "completions", {**base, **body}).json()["usage"]["completion_tokens"]

    first = _post(url, "completions", base).json()
    assert first["usage"]["completion_tokens"] == 1 and first["choices"][0]["finish_reason"] == "stop"
    assert tokens(ignore_eos=True) == 9
    assert tokens(min_tokens=5) == 6  # the EOS may come once 5 tokens are out
    _, ids = reference("Hello there", 8, chat=False)
    out = _post(url, "completions", {"model": "tiny", "prompt": "Hello there", "max_tokens": 8, "temperature": 0,
                                      "stop_token_ids": [ids[2]]}).json()
    assert out["usage"]["completion_tokens"] == ids.index(ids[2]) + 1 and out["choices"][0]["finish_reason"] == "stop"
    bad = _post(url, "completions", {**base, "min_tokens": 10})
    assert bad.status_code == 400 and "min_tokens" in bad.json()["error"]["message"]
