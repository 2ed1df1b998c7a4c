"""`quantspec serve --kv-cache-memory` smaller than the batch: concurrent requests through the real
`openai` client all finish with `quantspec infer`'s answers while the scheduler preempts and
recomputes sequences, /metrics counts the preemptions, and every block comes back."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import openai

PROMPTS = ["What is a cat?", "Where is Paris?", "def add(a, b):", "Name three colours.", "Count to five.",
           "Why is the sky blue?", "Say hello.", "What is two plus two?"]


def test_concurrent_requests_in_a_small_cache_are_preempted_and_answer_as_infer(start_server, reference, metric):
    # 20 blocks of 16 tokens (19 usable: 304 tokens) for 8 requests of ~80 tokens each
    with start_server(kv_cache_memory="160KiB", block_size=16) as (url, state):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)

        def ask(p):
            r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": p}],
                                               max_tokens=48, temperature=0)
            return r.choices[0].message.content

        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            answers = list(pool.map(ask, PROMPTS))
        assert answers == [reference(p, 48)[0] for p in PROMPTS]
        assert metric(url, "quantspec_num_preemptions_total") > 0
        assert metric(url, "quantspec_kv_blocks_total") == 19
        allocator = state.loop.engine.cache.allocator
        assert allocator.num_free == allocator.num_blocks - 1
