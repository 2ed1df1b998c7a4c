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


def test_an_urgent_request_overtakes_a_full_batch_under_the_priority_policy(start_server, reference, metric,
                                                                            slow_steps):
    import time

    with start_server(scheduling_policy="priority", max_batch_size=2, tweak=slow_steps(0.01)) as (url, _):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
        done = []

        def ask(p, n, priority=0):
            r = client.completions.create(model="tiny", prompt=p, max_tokens=n, temperature=0,
                                          extra_body={"priority": priority, "ignore_eos": True})
            done.append(p)
            return r.choices[0].text

        with ThreadPoolExecutor(3) as pool:
            slow = [pool.submit(ask, p, 150) for p in PROMPTS[:2]]
            deadline = time.monotonic() + 60
            while metric(url, "quantspec_requests_running") < 2 and time.monotonic() < deadline:
                time.sleep(0.02)
            urgent = pool.submit(ask, PROMPTS[2], 8, -1).result()
            assert done == [PROMPTS[2]]  # the batch of two was full: one of them made room
            texts = [f.result() for f in slow]
        assert metric(url, "quantspec_num_preemptions_total") == 1
    ref = [reference(p, n, chat=False, ignore_eos=True)[0] for p, n in ((PROMPTS[0], 150), (PROMPTS[1], 150),
                                                                          (PROMPTS[2], 8))]
    assert texts + [urgent] == ref


def test_a_priority_on_a_fcfs_server_is_a_400_naming_the_flag(server):
    url, _ = server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
    try:
        client.completions.create(model="tiny", prompt="hi", max_tokens=2, extra_body={"priority": 1})
    except openai.BadRequestError as e:
        assert e.body["param"] == "priority" and "--scheduling-policy priority" in e.body["message"]
    else:
        raise AssertionError("a priority on a fcfs server was served")
