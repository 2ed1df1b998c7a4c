"""The periodic stats line (`metrics.StatsLog`, what vLLM's servers log) against the counters it
reads, the generation-token counter counting tokens as they are generated, not at a request's
end, and the per-request queue / prefill / decode time and token histograms."""

from __future__ import annotations

import asyncio
import re
import time

import httpx2
import openai
import pytest

from quantspec.serve.metrics import Metrics, StatsLog


def _add(m: Metrics, **counts) -> None:
    for name, n in counts.items():
        getattr(m, name).inc(n)


def _set(m: Metrics, **values) -> None:
    for name, v in values.items():
        getattr(m, name).set(v)


def test_the_line_gives_rates_since_the_last_one_and_nothing_when_idle():
    m = Metrics("m")
    lines: list[str] = []
    log = StatsLog(m, lines.append, interval=10.0, now=100.0)
    _add(m, prompt_tokens=300, generation_tokens=50)
    _set(m, running=2, waiting=1, kv_total=200, kv_used=50)
    assert log.tick(105.0) is None  # before the interval
    line = log.tick(110.0)
    assert line == lines[-1] == ("Avg prompt throughput: 30.0 tokens/s, Avg generation throughput: 5.0 tokens/s, "
                                 "Running: 2 reqs, Waiting: 1 reqs, KV cache usage: 25.0%")
    _add(m, generation_tokens=40, prefix_queries=100, prefix_hits=25, drafts=10, draft_tokens=40, accepted_tokens=30)
    line = log.tick(130.0)  # 20 s later: rates over them
    assert "Avg generation throughput: 2.0 tokens/s" in line and "Avg prompt throughput: 0.0 tokens/s" in line
    assert line.endswith("Prefix cache hit rate: 25.0%, Draft acceptance rate: 75.0%, Mean acceptance length: 4.00")
    _set(m, running=0, waiting=0)
    assert log.tick(140.0) is None and len(lines) == 2  # idle: nothing changed, nothing runs


def test_a_busy_server_logs_lines_and_counts_tokens_as_they_come(start_server, slow_steps, metric):
    lines: list[str] = []
    slow = slow_steps(0.05)

    def tweak(state):
        slow(state)
        state.loop.stats_log = StatsLog(state.metrics, lines.append, interval=0.3, now=time.perf_counter())

    with start_server(tweak=tweak) as (url, _):
        name = 'quantspec_generation_tokens_total{model_name="tiny"}'
        body = {"model": "tiny", "prompt": "Hello there", "max_tokens": 40, "temperature": 0, "ignore_eos": True,
                "stream": True, "speculate": False}
        with httpx2.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
            chunks = 0
            for line in r.iter_lines():
                chunks += line.startswith("data: {")
                if chunks == 10:
                    mid = metric(url, name)  # the request is still running
        assert 10 <= mid < 40 and metric(url, name) == 40
        deadline = time.monotonic() + 10
        while not lines and time.monotonic() < deadline:
            time.sleep(0.05)
    assert lines, "no stats line while busy"
    rate = float(re.search(r"Avg generation throughput: ([\d.]+) tokens/s", lines[0]).group(1))
    assert rate > 0 and "Running: " in lines[0] and "KV cache usage: " in lines[0]


@pytest.mark.parametrize("flag", [True, False])
def test_disable_log_stats_leaves_the_loop_without_a_line(tiny_llama_dir, tiny_loaded, flag):
    from quantspec.serve.server import ServeConfig, load

    config = ServeConfig(model=str(tiny_llama_dir), disable_log_stats=flag, max_length=64)
    state = load(config, loaded=tiny_loaded, on_stats=print)
    try:
        assert (state.loop.stats_log is None) == flag
    finally:
        state.loop.stop(timeout=10)


def test_request_histograms_split_queue_prefill_and_decode(start_server, slow_steps, metric):
    """One place in the batch, two requests at once: the second waits for the first, and its
    queue time shows it; token histograms add up to the requests' usage."""
    with start_server(tweak=slow_steps(0.02), max_batch_size=1, speculate_method="none") as (url, _):
        async def main():
            client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
            return await asyncio.gather(*(client.completions.create(
                model="tiny", prompt=p, max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
                for p in ("Hello there", "A much longer prompt than the first one")))

        answers = asyncio.run(main())

        def hist(name, part):
            return metric(url, f'quantspec_{name}_{part}{{model_name="tiny"}}')

        assert hist("request_queue_time_seconds", "count") == 2
        assert hist("request_queue_time_seconds", "sum") >= 11 * 0.02  # the second waited for the first's steps
        assert hist("request_prefill_time_seconds", "count") == hist("request_decode_time_seconds", "count") == 2
        assert hist("request_decode_time_seconds", "sum") >= 2 * 10 * 0.02
        assert hist("request_prompt_tokens", "sum") == sum(a.usage.prompt_tokens for a in answers)
        assert hist("request_generation_tokens", "sum") == 24
