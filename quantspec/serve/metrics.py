"""Prometheus metrics of one server, in a registry of its own (two servers in one process do not
share counters): requests running / waiting, KV blocks, TTFT / TPOT / end-to-end histograms,
per-request queue / prefill / decode time and prompt / generation token histograms, token,
prefix-cache and preemption counters and the speculation counters (drafts, drafted and accepted tokens, per position);
and `StatsLog`, the periodic line of them vLLM's servers print."""

from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

__all__ = ["Metrics", "StatsLog"]

PREFIX = "quantspec"
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0,
                   7.5, 10.0, 20.0, 40.0, 80.0)


class Metrics:
    def __init__(self, model_name: str):
        self.registry = r = CollectorRegistry()
        labels = {"model_name": model_name}

        def gauge(name, doc):
            return Gauge(f"{PREFIX}_{name}", doc, labelnames=list(labels), registry=r).labels(**labels)

        def counter(name, doc, extra=()):
            c = Counter(f"{PREFIX}_{name}", doc, labelnames=list(labels) + list(extra), registry=r)
            return c if extra else c.labels(**labels)

        def hist(name, doc, buckets=LATENCY_BUCKETS):
            return Histogram(f"{PREFIX}_{name}", doc, labelnames=list(labels), buckets=buckets,
                             registry=r).labels(**labels)

        self.labels = labels
        self.running = gauge("requests_running", "Requests in the running batch.")
        self.waiting = gauge("requests_waiting", "Requests queued for the running batch.")
        self.kv_used = gauge("kv_blocks_used", "KV-cache blocks held by sequences.")
        self.kv_total = gauge("kv_blocks_total", "KV-cache blocks in the cache.")
        self.draft_cap = gauge("spec_draft_cap", "Drafts per sequence the load-aware policy allowed last step.")
        self.requests = counter("requests_total", "Finished requests by finish reason.", ["finish_reason"])
        self.rejected = counter("requests_rejected_total", "Requests refused with 503 (queue full or draining).")
        self.prompt_tokens = counter("prompt_tokens_total", "Prompt tokens of admitted requests.")
        self.prefix_queries = counter("prefix_cache_queries_total",
                                      "Prompt tokens looked up in the prefix cache (with --enable-prefix-caching).")
        self.prefix_hits = counter("prefix_cache_hits_total", "Prompt tokens found in the prefix cache (not prefilled).")
        self.preemptions = counter("num_preemptions_total",
                                   "Sequences whose KV blocks were taken back to be recomputed (--kv-cache-memory).")
        self.generation_tokens = counter("generation_tokens_total", "Generated tokens.")
        self.drafts = counter("spec_drafts_total", "Verification steps of a sequence that carried drafts.")
        self.draft_tokens = counter("spec_draft_tokens_total", "Draft tokens verified.")
        self.accepted_tokens = counter("spec_accepted_tokens_total", "Draft tokens accepted.")
        self.drafted_at = counter("spec_draft_tokens_per_position_total", "Draft tokens verified, by position.",
                                  ["position"])
        self.accepted_at = counter("spec_accepted_tokens_per_position_total", "Draft tokens accepted, by position.",
                                   ["position"])
        self.ttft = hist("time_to_first_token_seconds", "From arrival to the first token.")
        self.queue_time = hist("request_queue_time_seconds", "From reaching the engine to joining the running batch.")
        self.prefill_time = hist("request_prefill_time_seconds", "From joining the running batch to the first token.")
        self.decode_time = hist("request_decode_time_seconds", "From the first token to the last.")
        self.request_prompt_tokens = hist("request_prompt_tokens", "Prompt tokens per finished request.", TOKEN_BUCKETS)
        self.request_generation_tokens = hist("request_generation_tokens", "Generated tokens per finished request.",
                                              TOKEN_BUCKETS)
        self.tpot = hist("time_per_output_token_seconds", "Mean time per output token after the first.")
        self.e2e = hist("e2e_request_latency_seconds", "From arrival to the last token.")

    def finished(self, seq, reason: str, ttft: float | None, e2e: float) -> None:
        """Count a sequence that left the engine (finished or aborted)."""
        st, n = seq.stats, len(seq.output_ids)
        self.requests.labels(finish_reason=reason, **self.labels).inc()
        self.request_prompt_tokens.observe(len(seq.prompt_ids))
        self.request_generation_tokens.observe(n)
        if st.t_scheduled is not None:
            self.queue_time.observe(max(0.0, st.t_scheduled - st.t_arrival))
            if st.t_first_token is not None:
                self.prefill_time.observe(max(0.0, st.t_first_token - st.t_scheduled))
                self.decode_time.observe(max(0.0, (st.t_finish or st.t_first_token) - st.t_first_token))
        if ttft is not None:
            self.ttft.observe(ttft)
            self.e2e.observe(e2e)
            if n > 1:
                self.tpot.observe((e2e - ttft) / (n - 1))
        if st.drafted:
            self.drafts.inc(st.drafted_per_position[0])
            self.draft_tokens.inc(st.drafted)
            self.accepted_tokens.inc(st.accepted)
            for j, (d, a) in enumerate(zip(st.drafted_per_position, st.accepted_per_position)):
                self.drafted_at.labels(position=str(j + 1), **self.labels).inc(d)
                self.accepted_at.labels(position=str(j + 1), **self.labels).inc(a)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def value(self, name: str) -> float:
        """The current value of metric `name` (without the prefix; a counter's with `_total`)."""
        return self.registry.get_sample_value(f"{PREFIX}_{name}", self.labels) or 0.0


STATS_INTERVAL_S = 10.0
_TOTALS = ("prompt_tokens_total", "generation_tokens_total", "prefix_cache_queries_total", "prefix_cache_hits_total",
           "spec_drafts_total", "spec_draft_tokens_total", "spec_accepted_tokens_total")


class StatsLog:
    """Every `interval` seconds while the server is busy, one line to `emit`, as vLLM's servers log
    them: prompt and generation throughput since the last line, running and waiting requests,
    KV-cache use, and where they apply the prefix-cache hit rate and the draft acceptance (rate
    and mean accepted length) of the requests that finished meanwhile. An idle server logs nothing."""

    def __init__(self, metrics: Metrics, emit: Callable[[str], None], interval: float = STATS_INTERVAL_S,
                 now: float = 0.0):
        self.metrics, self.emit, self.interval = metrics, emit, interval
        self._t, self._totals = now, {k: metrics.value(k) for k in _TOTALS}

    def tick(self, now: float) -> str | None:
        """The line due at `now` (emitted), else None."""
        if now - self._t < self.interval:
            return None
        m = self.metrics
        totals = {k: m.value(k) for k in _TOTALS}
        d = {k: totals[k] - self._totals[k] for k in _TOTALS}
        dt, self._t, self._totals = now - self._t, now, totals
        running, waiting = int(m.value("requests_running")), int(m.value("requests_waiting"))
        if not any(d.values()) and not running and not waiting:
            return None
        used, total = m.value("kv_blocks_used"), m.value("kv_blocks_total")
        line = (f"Avg prompt throughput: {d['prompt_tokens_total'] / dt:.1f} tokens/s, "
                f"Avg generation throughput: {d['generation_tokens_total'] / dt:.1f} tokens/s, "
                f"Running: {running} reqs, Waiting: {waiting} reqs, "
                f"KV cache usage: {100 * used / max(total, 1):.1f}%")
        if d["prefix_cache_queries_total"]:
            line += f", Prefix cache hit rate: {100 * d['prefix_cache_hits_total'] / d['prefix_cache_queries_total']:.1f}%"
        if d["spec_draft_tokens_total"]:
            line += (f", Draft acceptance rate: {100 * d['spec_accepted_tokens_total'] / d['spec_draft_tokens_total']:.1f}%"
                     f", Mean acceptance length: {1 + d['spec_accepted_tokens_total'] / d['spec_drafts_total']:.2f}")
        self.emit(line)
        return line
