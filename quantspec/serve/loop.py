"""The engine loop: one thread owns the `Engine` and steps it; the async front end talks to it
only through `submit` and `abort`, which take effect at the next step boundary.

Each request is a `Job`: its prompt ids and sampling params in, and an asyncio queue out that
receives one `Delta` per step that gave it tokens (pushed onto the server's event loop with
`call_soon_threadsafe`), the last one with the finish reason. The queue ahead of the running
batch is bounded (`max_queue`): `submit` refuses at once when it is full, so overload is a 503,
never a stall of the accepted requests, and `retry_after()` tells the refused client when the
queue will have drained at the rate requests have been completing (`DrainRate`). `abort` (a client gone) retires the sequence and frees its
KV blocks before the next step runs.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from quantspec.infer.engine import Engine, Sequence
from quantspec.infer.logprobs import TokenLogprob
from quantspec.infer.prefix_cache import PrefixCachingAllocator
from quantspec.infer.sampler import SamplingParams

__all__ = ["Delta", "DrainRate", "EngineLoop", "Job"]

log = logging.getLogger("quantspec.serve")
IDLE_WAIT_S = 0.5  # how long the idle loop sleeps before looking again (a submit wakes it at once)
RETRY_AFTER_MIN_S, RETRY_AFTER_MAX_S = 1, 60  # the Retry-After a refused request gets, clamped
DRAIN_WINDOW_S = 30.0  # completions this recent measure the drain rate


class DrainRate:
    """How fast requests leave the engine (finished or aborted): completions per second over the
    last `window_s` seconds, and from it the Retry-After of a refused request: the seconds the
    requests queued ahead of it take to drain at that rate, rounded up and clamped to
    [`min_s`, `max_s`]; `min_s` while no completion is that recent (nothing measured yet).

    >>> d = DrainRate(window_s=30)
    >>> for t in (100.0, 101.0, 102.0, 103.0):
    ...     d.completed(t)
    >>> d.retry_after(10, now=104.0)  # 4 completions in the 4 s since the oldest: 1/s; 10 queued
    10
    """

    def __init__(self, window_s: float = DRAIN_WINDOW_S, min_s: int = RETRY_AFTER_MIN_S,
                 max_s: int = RETRY_AFTER_MAX_S):
        self.window_s, self.min_s, self.max_s = window_s, min_s, max_s
        self._times: deque[float] = deque()
        self._lock = threading.Lock()

    def completed(self, t: float) -> None:
        with self._lock:
            self._times.append(t)
            while self._times and t - self._times[0] > self.window_s:
                self._times.popleft()

    def rate(self, now: float) -> float | None:
        """Completions per second over the window (None: none in it)."""
        with self._lock:
            recent = [t for t in self._times if now - t <= self.window_s]
        if not recent:
            return None
        return len(recent) / max(now - recent[0], 1e-3)

    def retry_after(self, queued: int, now: float) -> int:
        rate = self.rate(now)
        if rate is None:
            return self.min_s
        return int(min(self.max_s, max(self.min_s, math.ceil(queued / rate))))


@dataclass
class Delta:
    """Tokens a step gave a request; `finish_reason` on its last delta ("error": the engine failed).
    With `logprobs` asked for, one `TokenLogprob` per token; with `prompt_logprobs`, the prompt's
    on the first delta that brings tokens."""

    token_ids: list[int]
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None


@dataclass
class Job:
    """One answer to produce: a prompt, its sampling params, and `index`, the answer's number among
    the `n` of its prompt (its random stream: `sampler.generator_for_request(seed, index)`)."""

    prompt_ids: list[int]
    params: SamplingParams
    speculate: bool = True
    index: int = 0
    text_check: object = None
    priority: int = 0  # under --scheduling-policy priority, lower first
    request_id: str = ""  # the answer's id (what request logs name)
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    loop: asyncio.AbstractEventLoop | None = None
    t_arrival: float = field(default_factory=time.perf_counter)
    t_first: float | None = None
    seq: Sequence | None = None
    done: bool = False

    def push(self, delta: Delta) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, delta)


def accepted_line(job: Job) -> str:
    """The log line of a request accepted (`--enable-log-requests`): its id, prompt length and
    sampling, never its text."""
    p = job.params
    sampling = "greedy" if p.decode_strategy.value == "greedy" else \
        f"temperature {p.temperature:g}, top_p {p.top_p:g}, top_k {p.top_k}, seed {p.seed}"
    extra = ", guided" if p.guide is not None else ""
    return (f"request {job.request_id or '-'} accepted: {len(job.prompt_ids)} prompt tokens, max_tokens "
            f"{p.max_new_tokens}, {sampling}{extra}, speculate {'on' if job.speculate else 'off'}")


def finished_line(job: Job, reason: str, ttft: float | None, e2e: float) -> str:
    """The log line of a request that left the engine (finished, aborted or failed)."""
    seq = job.seq
    out = 0 if seq is None else len(seq.output_ids)
    cached = 0 if seq is None else seq.stats.cached_tokens
    first = "no token" if ttft is None else f"first token {ttft * 1e3:.0f} ms"
    return (f"request {job.request_id or '-'} {reason}: {out} output tokens, {first}, {e2e:.2f} s in all"
            + (f", {cached} prompt tokens cached" if cached else ""))


class EngineLoop:
    """Steps `engine` in a thread of its own (module docstring)."""

    def __init__(self, engine: Engine, *, max_queue: int, metrics=None, stats_log=None, request_log=None):
        self.engine, self.max_queue, self.metrics = engine, max_queue, metrics
        self.stats_log = stats_log  # the periodic stats line (`metrics.StatsLog`), or None
        self.request_log = request_log  # request_log(line): a line per request accepted and per one done
        self._inbox: deque[Job] = deque()
        self._aborts: deque[Job] = deque()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._jobs: dict[int, Job] = {}  # seq_id → job, owned by the loop thread
        self._waiting = 0  # the engine's queue length, as the loop last saw it ...
        self._slots = engine.config.max_batch_size  # ... and the free places in its running batch
        self.drain = DrainRate()
        self._prefix_counted = (0, 0)  # the prefix cache's (queries, hits) the metrics hold
        self._preemptions_counted = 0  # the scheduler's preemptions the metrics hold
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="quantspec-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float | None = None) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def submit(self, job: Job) -> bool:
        """Queue `job` for the running batch; False (at once) when `max_queue` requests already wait
        that the batch has no place for."""
        with self._lock:
            if self._stop or len(self._inbox) + self._waiting - self._slots >= self.max_queue:
                return False
            job.loop = job.loop or asyncio.get_running_loop()
            self._inbox.append(job)
        self._wake.set()
        if self.request_log is not None:
            self.request_log(accepted_line(job))
        return True

    def retry_after(self) -> int:
        """Seconds a refused request should wait: the queue ahead of the batch over the drain rate."""
        with self._lock:
            queued = max(1, len(self._inbox) + self._waiting - self._slots)
        return self.drain.retry_after(queued, time.perf_counter())

    def abort(self, job: Job) -> None:
        """Drop `job` at the next step boundary (its client has gone)."""
        if job.done:
            return
        with self._lock:
            self._aborts.append(job)
        self._wake.set()

    # -- the loop thread -----------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop:
            self._take()
            if self.stats_log is not None:
                self.stats_log.tick(time.perf_counter())
            if not self.engine.has_work():
                self._wake.wait(IDLE_WAIT_S)
                self._wake.clear()
                continue
            try:
                events = self.engine.step()
            except Exception:  # a bug: fail the requests in flight, keep serving
                log.exception("engine step failed")
                self._fail_all()
                continue
            self._deliver(events)
            self._gauges()
        self._fail_all("abort")

    def _take(self) -> None:
        with self._lock:
            jobs, aborts = list(self._inbox), list(self._aborts)
            self._inbox.clear()
            self._aborts.clear()
        for job in jobs:
            try:
                seq = self.engine.add_request(job.prompt_ids, job.params, request_index=job.index,
                                              text_check=job.text_check, priority=job.priority)
            except Exception:  # the front end checked the request: a bug, but not the loop's end
                log.exception("could not add a request")
                job.done = True
                job.push(Delta([], "error"))
                continue
            seq.speculate = seq.speculate and job.speculate
            job.seq = seq
            self._jobs[seq.seq_id] = job
            if self.metrics is not None:
                self.metrics.prompt_tokens.inc(len(job.prompt_ids))
        for job in aborts:
            if job.seq is not None and not job.done:
                self.engine.abort(job.seq)
                self._retire(job, "abort")
        if jobs or aborts:
            self._gauges()

    def _deliver(self, events: list[tuple[Sequence, list[int]]]) -> None:
        now = time.perf_counter()
        for seq, toks in events:
            job = self._jobs.get(seq.seq_id)
            if job is None:
                continue
            delta = Delta(list(toks))
            if self.metrics is not None:
                self.metrics.generation_tokens.inc(len(toks))
            if toks and seq.params.logprobs is not None:
                delta.logprobs = seq.logprobs[len(seq.logprobs) - len(toks):]
            if job.t_first is None and toks:
                job.t_first = now
                if seq.params.prompt_logprobs is not None:
                    delta.prompt_logprobs = list(seq.prompt_logprobs)
            if seq.finished:
                self._retire(job, seq.finish_reason or "stop", delta)
            elif toks:
                job.push(delta)

    def _retire(self, job: Job, reason: str, delta: Delta | None = None) -> None:
        job.done = True
        self._jobs.pop(job.seq.seq_id, None)
        delta = delta or Delta([])
        delta.finish_reason = reason
        job.push(delta)
        now = time.perf_counter()
        self.drain.completed(now)
        ttft = None if job.t_first is None else job.t_first - job.t_arrival
        if self.metrics is not None:
            self.metrics.finished(job.seq, reason, ttft, now - job.t_arrival)
        if self.request_log is not None:
            self.request_log(finished_line(job, reason, ttft, now - job.t_arrival))

    def _fail_all(self, reason: str = "error") -> None:
        for job in list(self._jobs.values()):
            if job.seq is not None and not job.seq.finished:
                self.engine.abort(job.seq)
            self._retire(job, reason)
        with self._lock:
            pending = list(self._inbox)
            self._inbox.clear()
        for job in pending:
            job.done = True
            job.push(Delta([], reason))

    def _gauges(self) -> None:
        eng = self.engine
        with self._lock:
            self._waiting = len(eng.waiting)
            self._slots = max(0, eng.config.max_batch_size - len(eng.running))
            inbox = len(self._inbox)
        m = self.metrics
        if m is None:
            return
        alloc = eng.cache.allocator
        m.running.set(len(eng.running))
        m.waiting.set(self._waiting + inbox)
        m.kv_total.set(alloc.num_blocks - 1)
        m.kv_used.set(alloc.num_blocks - 1 - alloc.num_free)
        if isinstance(alloc, PrefixCachingAllocator):  # its totals since start, as counters
            m.prefix_queries.inc(alloc.queries - self._prefix_counted[0])
            m.prefix_hits.inc(alloc.hits - self._prefix_counted[1])
            self._prefix_counted = (alloc.queries, alloc.hits)
        m.preemptions.inc(eng.scheduler.num_preemptions - self._preemptions_counted)
        self._preemptions_counted = eng.scheduler.num_preemptions
        limit = eng.draft_limit
        if limit is not None:
            m.draft_cap.set(getattr(limit, "last_cap", 0))
