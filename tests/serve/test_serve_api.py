"""`quantspec serve`'s tokenizer routes (vLLM's `/tokenize`, `/detokenize`, `/tokenizer_info`,
which lm-evaluation-harness probes for its remote tokenizer) against the model's own tokenizer,
and `--api-key`: the real `openai` client with the wrong key gets a 401, with the right one its
answers; `/health` and `/metrics` stay open."""

from __future__ import annotations

import httpx2
import openai
import pytest

from quantspec.serve.text import chat_prompt_ids


def test_tokenize_detokenize_and_tokenizer_info(server):
    url, state = server
    tok = state.tokenizer
    text = "The quick brown fox, 1 2 3"
    r = httpx2.post(f"{url}/tokenize", json={"prompt": text}).json()
    assert r["tokens"] == tok(text).input_ids and r["count"] == len(r["tokens"]) and r["max_model_len"] == 256
    bare = httpx2.post(f"{url}/tokenize", json={"prompt": text, "add_special_tokens": False}).json()["tokens"]
    assert bare == tok(text, add_special_tokens=False).input_ids
    messages = [{"role": "user", "content": "Hello there"}]
    chat = httpx2.post(f"{url}/tokenize", json={"model": "tiny", "messages": messages}).json()["tokens"]
    assert chat == chat_prompt_ids(tok, messages)
    assert httpx2.post(f"{url}/detokenize", json={"tokens": bare}).json() == {"prompt": tok.decode(bare)}
    info = httpx2.get(f"{url}/tokenizer_info").json()
    assert info["eos_token"] == tok.eos_token and info["chat_template"] == tok.chat_template
    assert info["model_max_length"] == 256


@pytest.mark.parametrize("path, body, param", [
    ("tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "prompt"),
    ("tokenize", {}, "prompt"),
    ("tokenize", {"prompt": "a", "model": "other"}, "model"),
    ("detokenize", {"tokens": [1, 100000]}, "tokens"),
    ("detokenize", {"tokens": "abc"}, "tokens"),
])
def test_bad_tokenizer_requests_are_400(server, path, body, param):
    url, _ = server
    r = httpx2.post(f"{url}/{path}", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param


def test_api_key(start_server):
    with start_server(api_key="s3cret", speculate_method="none") as (url, _):
        wrong = openai.OpenAI(base_url=f"{url}/v1", api_key="nope", max_retries=0, timeout=60)
        with pytest.raises(openai.AuthenticationError):
            wrong.completions.create(model="tiny", prompt="hi", max_tokens=2)
        with pytest.raises(openai.AuthenticationError):
            wrong.models.list()
        right = openai.OpenAI(base_url=f"{url}/v1", api_key="s3cret", max_retries=0, timeout=60)
        assert right.completions.create(model="tiny", prompt="hi", max_tokens=2, temperature=0).usage.completion_tokens
        assert "".join(c.choices[0].delta.content or "" for c in right.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3, stream=True) if c.choices)
        r = httpx2.post(f"{url}/tokenize", json={"prompt": "hi"})
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        assert r.json()["error"]["code"] == "invalid_api_key"
        assert httpx2.get(f"{url}/health").status_code == 200 and httpx2.get(f"{url}/metrics").status_code == 200


def test_a_chat_template_of_the_server_s_own_replaces_the_tokenizer_s(start_server, tmp_path, tiny_loaded):
    from quantspec.errors import QuantSpecError
    from quantspec.serve.server import ServeConfig

    template = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}{% if add_generation_prompt %}[answer] {% endif %}"
    (tmp_path / "t.jinja").write_text(template)
    tok = tiny_loaded.tokenizer
    before = tok.chat_template
    msgs = [{"role": "user", "content": "hi there"}]
    for given in (template, str(tmp_path / "t.jinja")):
        with start_server(chat_template=given) as (url, _):
            r = httpx2.post(f"{url}/tokenize", json={"messages": msgs}).json()
            assert r["tokens"] == tok("[user] hi there\n[answer] ", add_special_tokens=False).input_ids
            chat = httpx2.post(f"{url}/v1/chat/completions", json={"model": "tiny", "messages": msgs, "max_tokens": 2,
                                                                  "temperature": 0}).json()
            assert chat["usage"]["prompt_tokens"] == r["count"]
    assert tok.chat_template == before  # the shared tokenizer is untouched
    with pytest.raises(QuantSpecError, match="--chat-template"):
        ServeConfig(chat_template=str(tmp_path / "missing.jinja"))


def test_a_template_that_refuses_the_messages_is_a_400_on_every_endpoint(start_server):
    """Gemma's chat template raises on a system message: /tokenize and /v1/chat/completions answer
    400 naming `messages`, and the server goes on serving."""
    template = ("{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
                "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}")
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    with start_server(chat_template=template) as (url, _):
        for path, extra in (("/tokenize", {}), ("/v1/chat/completions", {"model": "tiny", "max_tokens": 2})):
            r = httpx2.post(f"{url}{path}", json={"messages": msgs, **extra})
            assert r.status_code == 400, (path, r.text)
            assert r.json()["error"]["param"] == "messages" and "System role not supported" in r.text
        assert httpx2.post(f"{url}/tokenize", json={"messages": msgs[1:]}).status_code == 200
