"""Overload: a request the queue has no room for is refused at once with a 503, and its
Retry-After is the queue ahead of it over the rate requests complete, from literal completion
times, and through the server against the rate the client itself saw."""

from __future__ import annotations

import asyncio
import math
import time

import httpx2
import pytest

from quantspec.serve.loop import DrainRate


def test_retry_after_is_the_queue_over_the_completion_rate_clamped():
    d = DrainRate(window_s=10, min_s=1, max_s=60)
    assert d.retry_after(50, now=0.0) == 1  # nothing measured yet
    for t in (0.0, 0.5, 1.0, 1.5):
        d.completed(t)
    assert d.rate(2.0) == pytest.approx(2.0)  # 4 completions in the 2 s since the oldest
    assert d.retry_after(10, now=2.0) == 5
    assert d.retry_after(11, now=2.0) == 6  # rounded up
    assert d.retry_after(1, now=2.0) == 1  # at least min_s
    assert d.retry_after(1000, now=2.0) == 60  # at most max_s
    assert d.retry_after(10, now=5.0) == 13  # no completion since: the rate decays (4 in 5 s)
    assert d.retry_after(10, now=20.0) == 1  # every completion is older than the window


def test_retry_after_is_one_outside_the_window_and_old_times_are_dropped():
    d = DrainRate(window_s=10)
    d.completed(0.0)
    d.completed(100.0)
    assert d.rate(100.5) == pytest.approx(1 / 0.5)
    assert d.retry_after(3, now=100.5) == 2


def test_overload_is_a_503_at_once_and_the_others_complete(start_server, slow_steps, metric):
    """One sequence runs, one waits; a third request is refused at once (Retry-After 1: no
    completion measured yet), the others complete."""
    with start_server(tweak=slow_steps(0.02), max_batch_size=1, max_queue=1) as (url, state):
        body = {"model": "tiny", "prompt": "x", "max_tokens": 30, "temperature": 0}

        async def main():
            async with httpx2.AsyncClient(timeout=60) as http:
                first = [asyncio.ensure_future(http.post(f"{url}/v1/completions", json=body)) for _ in range(2)]
                deadline = time.monotonic() + 30
                while metric(url, "quantspec_requests_waiting") < 1 and time.monotonic() < deadline:
                    await asyncio.sleep(0.01)
                t0 = time.monotonic()
                third = await http.post(f"{url}/v1/completions", json=body)
                took = time.monotonic() - t0
                return await asyncio.gather(*first), third, took

        done, third, took = asyncio.run(main())
        assert third.status_code == 503 and third.headers["retry-after"] == "1" and took < 0.5
        assert third.json()["error"]["code"] == "overloaded"
        assert [r.status_code for r in done] == [200, 200]
        assert metric(url, "quantspec_requests_rejected_total") == 1


def test_a_503_carries_the_drain_time_the_client_measured(start_server, slow_steps, metric):
    """Three requests complete one after another (the client notes when), six queue behind a
    running one, and the next is refused: its Retry-After is the six queued requests over the
    completion rate the client saw, within a second (the server's and client's clocks differ
    by the delivery of a response)."""
    queued = 6
    with start_server(tweak=slow_steps(0.03), max_batch_size=1, max_queue=queued) as (url, state):
        body = {"model": "tiny", "prompt": "x", "max_tokens": 24, "temperature": 0}

        async def main():
            async with httpx2.AsyncClient(timeout=60) as http:
                done = []
                for _ in range(3):
                    assert (await http.post(f"{url}/v1/completions", json=body)).status_code == 200
                    done.append(time.monotonic())
                more = [asyncio.ensure_future(http.post(f"{url}/v1/completions", json=body))
                        for _ in range(queued + 1)]
                deadline = time.monotonic() + 30
                while metric(url, "quantspec_requests_waiting") < queued and time.monotonic() < deadline:
                    await asyncio.sleep(0.01)
                refused = await http.post(f"{url}/v1/completions", json=body)
                t_refused = time.monotonic()
                return done, refused, t_refused, await asyncio.gather(*more)

        done, refused, t_refused, rest = asyncio.run(main())
    assert refused.status_code == 503 and [r.status_code for r in rest] == [200] * (queued + 1)
    rate = len(done) / (t_refused - done[0])
    want = math.ceil(queued / rate)
    assert want >= 3  # the measured rate decides, not a fixed value (1 s would be off by 2 or more)
    assert abs(int(refused.headers["retry-after"]) - want) <= 1
