"""Load-aware speculation: how many drafts each sequence may verify in a decode step, chosen from
the running batch and the measured cost of steps, so that speculation never makes a load level
slower.

A decode step of B sequences feeds B rows; with up to k drafts each it feeds about
B · (1 + u·k) rows, where u is the share of the offered drafts the sequences actually bring (the
per-sequence back-off of `proposers.AdaptiveDraftLength` and n-gram misses leave some out). On a
CPU a step is bound by streaming the weights while the rows are few, so extra rows ride along;
with many sequences the rows are compute, and verifying drafts costs more than it saves. Per step:

    T(R)   measured seconds of the forward of a decode step that feeds R rows (`StepCosts`: an
           EMA per R from the steps that ran, seeded by `measure_step_costs` at start-up with the
           same forward, interpolated between)
    q_j    P(draft j accepted | draft j-1 accepted), an EMA per position over every verification
    E(k)   = 1 + u · (q_1 + q_1 q_2 + ... + q_1 ... q_k), expected tokens per sequence and step
    cap(B) = argmax over k in 0..K of B · E(k) / T(B · (1 + u·k)), k > 0 only when it beats
             k = 0 by `margin` (ties and noise go to plain decoding)

The model is checked against what the steps deliver: per batch-size class (1, 2-3, 4-7, ...)
an EMA of the tokens per second of whole decode steps (proposer and acceptance included) with
drafts and without; where the steps with drafts deliver fewer, the cap is 0 whatever the model
says. Every `plain_every` steps with drafts one runs without, so both rates stay current.

While the cap is 0 nothing is verified, so the estimates would go stale: every `probe_interval`
such steps one step offers drafts (`probe_k`, or the model's k where the measured rate vetoed
it), and each probe that does not bring speculation back doubles the interval (up to
`max_probe_interval`). Any cap is lossless (the verifier is), so the policy only moves speed,
never outputs.
"""

from __future__ import annotations

import bisect
import math

__all__ = ["LoadAwareDrafts", "StepCosts", "measure_step_costs"]


class StepCosts:
    """Seconds of a decode step by the rows it feeds: an EMA per row count, linear between the
    counts seen, proportional beyond the largest (rows cost at least their share)."""

    def __init__(self, decay: float = 0.8):
        self.decay = decay
        self._rows: list[int] = []  # sorted row counts seen
        self._seconds: dict[int, float] = {}

    def add(self, rows: int, seconds: float) -> None:
        if rows < 1 or not math.isfinite(seconds) or seconds <= 0:
            return
        if rows in self._seconds:
            self._seconds[rows] = self.decay * self._seconds[rows] + (1 - self.decay) * seconds
        else:
            bisect.insort(self._rows, rows)
            self._seconds[rows] = seconds

    def estimate(self, rows: float) -> float | None:
        """T(rows), or None before any step was seen."""
        if not self._rows:
            return None
        i = bisect.bisect_left(self._rows, rows)
        if i < len(self._rows) and self._rows[i] == rows:
            return self._seconds[rows]
        if i == 0:
            return self._seconds[self._rows[0]]  # fewer rows than any seen: no cheaper than that
        lo = self._rows[i - 1]
        if i == len(self._rows):
            return self._seconds[lo] * rows / lo
        hi = self._rows[i]
        w = (rows - lo) / (hi - lo)
        return (1 - w) * self._seconds[lo] + w * self._seconds[hi]


class LoadAwareDrafts:
    """The engine's `DraftLimit` (module docstring): `cap(B)` per step, `observe(...)` after each
    decode step. Example: T(16) = 40 ms, T(96) = 200 ms, u = 1, q = 0.8 → E(5) = 3.7 and
    16 · 3.7 / 0.2 s = 296 tok/s < 16 / 0.04 s = 400 tok/s: no drafts at B = 16; T(1) = 30 ms,
    T(6) = 33 ms → 3.7 / 0.033 s = 112 tok/s > 33 tok/s: 5 drafts at B = 1."""

    def __init__(self, max_draft_tokens: int, costs: StepCosts | None = None, *, prior: float = 0.7,
                 prior_weight: float = 4.0, decay: float = 0.9, margin: float = 0.03, probe_k: int = 1,
                 probe_interval: int = 8, max_probe_interval: int = 64, plain_every: int = 32):
        self.max_draft_tokens = int(max_draft_tokens)
        self.costs = costs or StepCosts()
        self.decay, self.margin = decay, margin
        self.accept = [[prior * prior_weight, prior_weight] for _ in range(self.max_draft_tokens)]
        self.usage = [prior_weight, prior_weight]  # EMA [drafts brought, drafts offered]
        self.probe_k = min(probe_k, self.max_draft_tokens)
        self.probe_interval, self.max_probe_interval = probe_interval, max_probe_interval
        self._idle, self._interval = 0, probe_interval
        self.plain_every, self._since_plain = plain_every, 0
        self._rates: dict[tuple[int, bool], list[float]] = {}  # (batch class, drafted) → EMA [tokens, s]
        self.last_cap = 0

    def expected_tokens(self, k: int) -> float:
        """E(k): expected tokens per sequence from a step that offers k drafts."""
        u = self.usage[0] / self.usage[1]
        run, reach = 0.0, 1.0
        for j in range(k):
            reach *= self.accept[j][0] / self.accept[j][1]
            run += reach
        return 1.0 + u * run

    def best_cap(self, num_seqs: int) -> int:
        """argmax_k of the expected tokens per second at `num_seqs` sequences (0 without costs)."""
        base = self.costs.estimate(num_seqs)
        if base is None:
            return 0
        u = self.usage[0] / self.usage[1]
        best, best_rate = 0, num_seqs / base * (1 + self.margin)
        for k in range(1, self.max_draft_tokens + 1):
            rate = num_seqs * self.expected_tokens(k) / self.costs.estimate(num_seqs * (1 + u * k))
            if rate > best_rate:
                best, best_rate = k, rate
        return best

    def measured_rate(self, num_seqs: int, drafted: bool) -> float | None:
        """Tokens per second of recent decode steps of this batch class, with or without drafts."""
        ema = self._rates.get((num_seqs.bit_length(), drafted))
        return None if ema is None else ema[0] / ema[1]

    def cap(self, num_seqs: int) -> int:
        if num_seqs <= 0:
            self.last_cap = 0
            return 0
        k = model_k = self.best_cap(num_seqs)
        spec, plain = self.measured_rate(num_seqs, True), self.measured_rate(num_seqs, False)
        if k and spec is not None and plain is not None and spec < plain:
            k = 0  # the steps with drafts deliver less than those without at this load
        if k == 0:
            self._idle += 1
            if self._idle > self._interval:  # probe; if it does not bring speculation back, wait longer
                self._idle, self._interval = 0, min(2 * self._interval, self.max_probe_interval)
                k = model_k or self.probe_k
        else:
            self._idle, self._interval = 0, self.probe_interval
            self._since_plain += 1
            if plain is None or self._since_plain > self.plain_every:  # keep the plain rate current
                self._since_plain, k = 0, 0
        self.last_cap = k
        return k

    def _ema(self, pair: list[float], hit: float, weight: float = 1.0) -> None:
        pair[0] = self.decay * pair[0] + hit
        pair[1] = self.decay * pair[1] + weight

    def observe(self, step, seqs, drafts: list[list[int]], accepted: list[int]) -> None:
        """Learn from a decode step: its seconds at its rows, the drafts brought of those offered,
        and per position whether each verified draft was accepted."""
        self.costs.add(step.rows, step.forward_seconds or step.seconds)
        speculating = sum(bool(getattr(s, "speculate", True)) for s in seqs)
        if step.seconds > 0:
            self._ema(self._rates.setdefault((speculating.bit_length(), any(drafts)), [0.0, 0.0]),
                      len(seqs) + sum(accepted), step.seconds)
        offered = self.last_cap * speculating
        if offered:
            self._ema(self.usage, sum(len(d) for d in drafts) / offered)
        for d, a in zip(drafts, accepted):
            for j in range(min(len(d), a + 1)):
                self._ema(self.accept[j], float(j < a))


def _time_rows(engine, rows: int, repeats: int) -> float:
    """The mean of `repeats` decode-like forwards (`Engine.dry_forward`) feeding `rows` rows,
    spread over up to max_batch_size sequences as a decode or verification step brings them, after
    one that is not timed (it compiles, and captures the step's graph): what a step's
    `forward_seconds` measures."""
    n = min(rows, engine.config.max_batch_size)
    q = [rows // n + (i < rows % n) for i in range(n)]
    engine.dry_forward(q)
    return sum(engine.dry_forward(q) for _ in range(repeats)) / repeats


def measure_step_costs(engine, max_rows: int, costs: StepCosts | None = None, repeats: int = 2) -> StepCosts:
    """Seed `costs` with timed forwards of 1, 2, 3, 4, 6, 8, ... rows up to `max_rows` (steps of
    about 1.5×): what `LoadAwareDrafts` interpolates until real steps refine it."""
    costs = costs or StepCosts()
    rows = 1
    while rows <= max_rows:
        costs.add(rows, _time_rows(engine, rows, repeats))
        rows = max(rows + 1, int(rows * 1.5))
    if max_rows not in costs._seconds:
        costs.add(max_rows, _time_rows(engine, max_rows, repeats))
    return costs
