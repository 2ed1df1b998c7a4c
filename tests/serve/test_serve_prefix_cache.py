"""`quantspec serve --enable-prefix-caching` through the real `openai` client: a request that shares
a preamble with an earlier one reports its cached prompt tokens in `usage` as OpenAI does, the
server counts them on /metrics, and the answers are `quantspec infer`'s."""

from __future__ import annotations

import openai

from quantspec.serve.server import ServeConfig

PREAMBLE = ("You are a careful assistant. Answer in one short sentence, without lists, and say so when "
            "you do not know. ")


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)


def test_a_shared_preamble_is_prefilled_once(start_server, reference, metric, tiny_loaded):
    prompts = [PREAMBLE + q for q in ("What is a cat?", "Where is Paris?", "def add(a, b):")]
    tok = tiny_loaded.tokenizer
    lengths = [len(tok(p, add_special_tokens=False)["input_ids"]) for p in prompts]
    shared = len(tok(PREAMBLE, add_special_tokens=False)["input_ids"]) - 1  # its last token may merge
    with start_server(enable_prefix_caching=True, block_size=16) as (url, _):
        client = _client(url)
        cached = []
        for p in prompts:
            r = client.completions.create(model="tiny", prompt=p, max_tokens=8, temperature=0)
            assert r.choices[0].text == reference(p, 8, chat=False)[0]
            cached.append(r.usage.prompt_tokens_details.cached_tokens)
        assert cached[0] == 0 and cached[1] == cached[2] == shared // 16 * 16 > 0
        assert metric(url, "quantspec_prefix_cache_hits_total") == sum(cached)
        assert metric(url, "quantspec_prefix_cache_queries_total") == sum(lengths)
        streamed = client.completions.create(model="tiny", prompt=prompts[1], max_tokens=8, temperature=0,
                                             stream=True, stream_options={"include_usage": True})
        chunks = list(streamed)
        assert "".join(c.choices[0].text for c in chunks if c.choices) == reference(prompts[1], 8, chat=False)[0]
        assert chunks[-1].usage.prompt_tokens_details.cached_tokens == lengths[1] - 1 - (lengths[1] - 1) % 16


def test_without_the_flag_usage_has_no_cache_details(server):
    url, _ = server
    r = _client(url).completions.create(model="tiny", prompt=PREAMBLE + "Hi", max_tokens=2, temperature=0)
    assert r.usage.prompt_tokens_details is None


def test_eagle_with_prefix_caching_is_a_valid_config(tiny_llama_dir):
    config = ServeConfig(model=str(tiny_llama_dir), speculate_method="eagle", draft_model=str(tiny_llama_dir),
                         enable_prefix_caching=True)  # the head keeps its rows of cached blocks
    assert config.infer_config().enable_prefix_caching
