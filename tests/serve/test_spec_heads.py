"""`quantspec serve` speculating with an EAGLE-3 head or Medusa heads (chains and token trees):
16 concurrent greedy requests through the real `openai` client each get `quantspec infer`'s
plain answer for their prompt, and the drafts really ran (the server's speculation counters)."""

from __future__ import annotations

import asyncio

import openai
import pytest
import torch

PROMPTS = ["Hello there", "Tell me a story about a cat", "def add(a, b):", "1 2 3 4 5 6 7 8",
           "abc abc abc abc", "What is the capital of France?"]


@pytest.fixture(scope="module")
def heads(tiny_llama_dir, tmp_path_factory):
    """{method: head directory} for the tiny Llama: the recipes' initialisations with noise."""
    from quantspec.model_zoo.checkpoint import load_model
    from quantspec.model_zoo.eagle3 import save_eagle3
    from quantspec.model_zoo.eagle3_train import init_eagle3
    from quantspec.model_zoo.medusa import save_medusa
    from quantspec.model_zoo.medusa_train import init_medusa

    base = load_model(tiny_llama_dir)[0]
    g = torch.Generator().manual_seed(0)
    eagle = init_eagle3(base, torch.arange(0, 512, 2), (0, 1, 2))
    medusa = init_medusa(base, torch.arange(0, 512, 2), num_heads=3)
    with torch.no_grad():
        for p in eagle.midlayer.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.02)
        for head in medusa.medusa_head:
            head[0].linear.weight.copy_(torch.randn(head[0].linear.weight.shape, generator=g) * 0.05)
    d = tmp_path_factory.mktemp("heads")
    return {"eagle": save_eagle3(eagle, d / "eagle3"), "medusa": save_medusa(medusa, d / "medusa")}


@pytest.mark.parametrize("method,tree,load_aware,prefix", [("eagle", None, False, False), ("eagle", "2x2", True, False),
                                                            ("medusa", "2x2", True, False), ("medusa", None, False, False),
                                                            ("eagle", None, False, True)])
def test_concurrent_greedy_answers_equal_plain_decoding(method, tree, load_aware, prefix, heads, start_server,
                                                        reference, metric):
    want = {p: reference(p, 20)[0] for p in PROMPTS}

    async def one(client, i):
        prompt = PROMPTS[i % len(PROMPTS)]
        r = await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": prompt}],
                                                 max_tokens=20, temperature=0)
        return prompt, r.choices[0].message.content

    with start_server(speculate_method=method, draft_model=str(heads[method]), speculate_tree=tree,
                      speculate_max_draft_token_num=3, load_aware=load_aware, enable_prefix_caching=prefix,
                      block_size=16 if prefix else 64) as (url, _):
        async def main():
            client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
            return await asyncio.gather(*(one(client, i) for i in range(16)))

        results = asyncio.run(main())
        drafted = metric(url, "quantspec_spec_draft_tokens_total")
        hits = metric(url, "quantspec_prefix_cache_hits_total") if prefix else 0
    assert all(text == want[p] for p, text in results)
    assert hits > 0 or not prefix  # the chat template's shared head, and repeated prompts
    assert drafted > 0 or load_aware  # the load-aware cap may find drafts not worth their rows
