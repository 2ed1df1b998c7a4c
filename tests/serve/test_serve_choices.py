"""Several answers per request through `quantspec serve`: a list of prompts (one choice each, in
order) and `n` answers per prompt, each drawn from its own random stream (the first one's is the
stream of the same request with n = 1), streamed or whole, with usage counting each prompt once."""

from __future__ import annotations

import openai


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)


def test_several_prompts_one_choice_each(server, reference):
    url, _ = server
    client = _client(url)
    prompts = ["def add(a, b):", "Hello there", "1 2 3 4 5 6 7 8"]
    r = client.completions.create(model="tiny", prompt=prompts, max_tokens=10, temperature=0)
    assert [c.index for c in r.choices] == [0, 1, 2]
    want = [reference(p, 10, chat=False) for p in prompts]
    assert [c.text for c in r.choices] == [t for t, _ in want]
    assert r.usage.completion_tokens == sum(len(i) for _, i in want)
    texts = {}
    for chunk in client.completions.create(model="tiny", prompt=prompts, max_tokens=10, temperature=0, stream=True):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
    assert [texts[i] for i in range(3)] == [t for t, _ in want]

def test_n_answers_per_prompt(server, reference):
    """Seeded answers are reproducible without speculation (with it, how many drafts a step
    verifies depends on the load, and so does which random draws the verifier makes)."""
    url, _ = server
    client = _client(url)
    msgs = [{"role": "user", "content": "Tell me a story about a cat"}]
    kw = dict(model="tiny", messages=msgs, max_tokens=12, temperature=1.0, seed=7, extra_body={"speculate": False})
    one = client.chat.completions.create(**kw)
    r = client.chat.completions.create(**kw, n=4)
    texts = [c.message.content for c in r.choices]
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert texts[0] == one.choices[0].message.content and len(set(texts)) > 1
    assert r.usage.prompt_tokens == one.usage.prompt_tokens
    again = client.chat.completions.create(**kw, n=4)
    assert [c.message.content for c in again.choices] == texts  # seeded: reproducible
    streamed = {}
    for chunk in client.chat.completions.create(**kw, n=4, stream=True):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + (c.delta.content or "")
    assert [streamed[i] for i in range(4)] == texts
    prompts = ["Hello there", "def add(a, b):"]
    g = client.completions.create(model="tiny", prompt=prompts, max_tokens=8, temperature=0, n=2)
    want = [reference(p, 8, chat=False)[0] for p in prompts]
    assert [c.text for c in g.choices] == [want[0], want[0], want[1], want[1]]  # choice i: prompt i // n
