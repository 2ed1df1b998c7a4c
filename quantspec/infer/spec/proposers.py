"""Engine-facing speculative proposers: the factory behind `Predictor`, the n-gram adapter, and
the back-off policy that decides how many drafts each sequence gets.

This file owns:
- `build_proposer(config, loaded) -> (proposer, max_draft_tokens)`: validates the speculation
  knobs of an `InferConfig` and builds the proposer of its `speculate_method`
  (`inference_with_reference` → `ReferenceProposer`; `draft` → `spec/draft.py`'s
  `DraftModelProposer`; `mtp` → `spec/mtp.py`; `medusa` → `spec/medusa.py`; `eagle` →
  `spec/eagle.py`; each imported lazily).
- `ReferenceProposer`: `propose_ngram` over each sequence's prompt + generated tokens, kept as a
  growing numpy buffer per sequence so a step costs O(new tokens) to update plus one match.
- `SpecCost` and `AdaptiveDraftLength`: the back-off (see below).

Back-off. Verifying k drafts is not free: the base forward grows by k query rows, and a model
drafter runs k forwards of its own. Where drafts are rarely accepted that is pure overhead, so
each sequence gets k_b drafts chosen by a small cost model instead of always the maximum K:

    a1, ac per-sequence estimates of P(draft 1 accepted) and P(draft j+1 accepted | draft j
           accepted): EMAs over the sequence's acceptance tests (decay 0.8 per test, so they
           remember the last ~5), started from an optimistic prior so new sequences speculate.
    E(k)   = 1 + a1 · (1 + ac + ... + ac^(k-1)), expected tokens from a step with k drafts.
    C(k)   = 1 for k = 0, else 1 + verify_fixed + draft_fixed + k · (verify_per_token +
           draft_per_token): the step's cost in plain decode steps of the base (`SpecCost`).
    k_b    = min(budget, argmax over k in 0..K of E(k) / C(k)) (ties → fewer drafts).

The n-gram drafter keeps these estimates per agreement class of its match (1 token, 2-3, 4 or
more: `agreement_kind`), so a sequence stops drafting after weak 1-token matches without giving
up the long copies that follow them (`bench/spec_replay.py` replays the policies).

k_b = 0 is a plain decode step for that sequence (and a model drafter skips it entirely). A
backed-off sequence probes again after `probe_interval` plain steps, with the k an optimistic
estimate (the prior) would choose. Each probe that does not bring it back doubles the interval up
to `max_probe_interval`. A drafter that could not pay for itself even if every draft were
accepted (best k at a1 = ac = 1 is 0, e.g. a quantized draft that decodes no faster than the
base) never drafts at all. The worst-case overhead on text where nothing is ever accepted is
therefore about (C(probe k) - 1) / max_probe_interval plus the few steps it takes the estimates
to fall. The policy depends
only on the sequence's own history (not on time or batch neighbours), so seeded sampling stays
reproducible and batch-invariant; it never changes a greedy result, and sampled results remain
distributed exactly as without speculation (the verifier is lossless for any k).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from quantspec.errors import QuantSpecError
from quantspec.infer.spec.ngram import NewlineRuns, propose_ngram, propose_ngram_match, realigned_match
from quantspec.infer.spec.types import SpecProposal

__all__ = [
    "MAX_DRAFT_TOKENS",
    "SPECULATE_METHODS",
    "SpecCost",
    "AdaptiveDraftLength",
    "ReferenceProposer",
    "validate_spec_config",
    "build_proposer",
    "loaded_runtime",
]

MAX_DRAFT_TOKENS = 16  # upper bound of --speculate-max-draft-token-num
SPECULATE_METHODS = ("none", "inference_with_reference", "draft", "mtp", "medusa", "eagle")


@dataclass(frozen=True)
class SpecCost:
    """Cost of a speculative step in units of one plain decode step of the base model.

    verify_fixed:     extra cost of a verification forward (1 + k query rows, k ≥ 1) over a
                      1-row decode forward, whatever k is.
    verify_per_token: extra cost per verified draft row.
    draft_per_token:  the drafter's cost per drafted token (0 for n-gram; ≈ the draft model's
                      decode step over the base's for a draft model).
    draft_fixed:      the drafter's cost per step that drafts at all, whatever k (0 where all of
                      it is per draft; Medusa heads: the one call that runs them, whose heads each
                      add `draft_per_token`).

    `for_device` gives the constants per device. On a CPU a decode forward is bound by streaming
    the weights, and extra verification rows ride along until their FMAs no longer overlap that
    stream: a base whose every linear computes all rows in one pass over its packed weights
    (`packed_cpu`) costs 0.05 a row, other bases 0.15. On a GPU a few extra rows are nearly free:
    an H100's int4 8B-shaped step at batch 1 (CUDA graphs) cost C(1) = 1.09, C(4) = 1.11 and
    C(8) = 1.08 plain steps (`bench/gpu_e2e.py`).
    `bench/spec_cost.py` measures whole engine steps per k beside this model, to check or
    recalibrate the constants on a device.
    """

    verify_fixed: float = 0.5
    verify_per_token: float = 0.05
    draft_per_token: float = 0.0
    draft_fixed: float = 0.0

    def __post_init__(self):
        for name in ("verify_fixed", "verify_per_token", "draft_per_token", "draft_fixed"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not np.isfinite(v) or v < 0:
                raise QuantSpecError(f"SpecCost.{name}={v!r} must be a finite number >= 0")

    @classmethod
    def for_device(cls, device: torch.device | str, draft_per_token: float = 0.0, *,
                   packed_cpu: bool = False, draft_fixed: float = 0.0) -> "SpecCost":
        """The cost model for a base on `device`; `packed_cpu`: every linear of the base computes
        all rows of a step in one pass over packed weights (`Runtime.packed_rows`)."""
        draft = dict(draft_per_token=draft_per_token, draft_fixed=draft_fixed)
        if torch.device(device).type == "cuda":
            return cls(verify_fixed=0.085, verify_per_token=0.0025, **draft)
        if packed_cpu:
            return cls(verify_fixed=0.0, verify_per_token=0.05, **draft)
        return cls(verify_fixed=0.0, verify_per_token=0.15, **draft)

    def step_cost(self, k: int) -> float:
        """C(k): the cost of a step with k drafts, in plain decode steps."""
        if k == 0:
            return 1.0
        return 1.0 + self.verify_fixed + self.draft_fixed + k * (self.verify_per_token + self.draft_per_token)


@dataclass
class _Acceptance:
    """One sequence's estimates for one kind of draft (see `AdaptiveDraftLength`)."""

    first: list[float]  # EMA [successes, trials] of the first draft's acceptance test
    more: list[float]  # EMA [successes, trials] of the tests after an accepted draft
    idle: int = 0  # consecutive steps with k = 0
    interval: int = 0  # current probe interval


@dataclass
class _SeqState:
    kinds: dict[int, _Acceptance] = field(default_factory=dict)
    last_kind: int | None = None  # the kind of the previous step's drafts (None: it drafted none)
    seen_drafted: int = 0  # seq.stats.drafted / accepted when last observed
    seen_accepted: int = 0


class AdaptiveDraftLength:
    """The back-off policy (module docstring): k_b = argmax_k E(k) / C(k) from per-sequence EMAs
    of the acceptance probabilities, with probes after backing off.

    Two rates, because drafts fail mostly at the first position (an n-gram match that leads
    nowhere, a draft model diverging at a hard token) and then tend to run on once one is right:
    a1 = P(draft 1 accepted) and ac = P(draft j+1 accepted | draft j accepted), so
    E(k) = 1 + a1 · (1 + ac + ... + ac^(k-1)).

    Example (C(k) = 1.5 + 0.05 k, K = 5): a1 = ac = 0.9 → E(5)/C(5) = 4.69 / 1.75 ≈ 2.7 →
    5 drafts; a1 = ac = 0.3 → every k > 0 has E(k)/C(k) < 1 → 0 drafts (a plain decode step);
    a1 = 0.3, ac = 0.95 → E(5)/C(5) = 2.36 / 1.75 ≈ 1.35 → 5 drafts (rarely right, but then long).

    Kinds. A drafter may sort its candidates into kinds that deserve separate estimates:
    `ReferenceProposer` passes the agreement class of its n-gram match (`agreement_kind`: 1 token,
    2-3, 4 or more), because a 1-token match is a poor bet where a long one is a near-certain
    run. Each kind
    of a sequence has its own (a1, ac) and probe clock; the outcome of a step is credited to the
    kind it drafted. A model drafter uses one kind (0).

    Call `num_drafts(seq, budget, kind)` once per step for each decoding sequence (it first reads
    what the previous step accepted from `seq.stats`; kind None = no candidate this step, 0
    drafts) and `forget(seq)` when it finishes.
    """

    def __init__(self, max_draft_tokens: int, cost: SpecCost, *, decay: float = 0.8,
                 prior_acceptance: float = 0.8, prior_weight: float = 2.0, probe_interval: int = 4,
                 max_probe_interval: int = 32):
        if not 0.0 < decay < 1.0:
            raise QuantSpecError(f"decay={decay} must be in (0, 1)")
        if not 0.0 <= prior_acceptance < 1.0 or prior_weight <= 0:
            raise QuantSpecError("prior_acceptance must be in [0, 1) and prior_weight > 0")
        if not 1 <= probe_interval <= max_probe_interval:
            raise QuantSpecError("need 1 <= probe_interval <= max_probe_interval")
        self.max_draft_tokens, self.cost, self.decay = int(max_draft_tokens), cost, decay
        self.prior = (prior_acceptance * prior_weight, prior_weight)
        self.probe_interval, self.max_probe_interval = probe_interval, max_probe_interval
        self._costs = [cost.step_cost(k) for k in range(self.max_draft_tokens + 1)]
        # a probe drafts what an optimistic estimate would (at least 1); a drafter that cannot
        # pay for itself even if every draft were accepted (a draft as slow as the base) never
        # drafts: probe_k = 0
        self.probe_k = self.best_k(prior_acceptance) or min(1, self.best_k(1.0))
        self._seqs: dict[int, _Acceptance] = {}

    def best_k(self, a1: float, ac: float | None = None) -> int:
        """argmax_k E(k)/C(k) for first-draft acceptance a1 and run-on acceptance ac (default a1),
        before budgets; ties go to fewer drafts."""
        ac = a1 if ac is None else ac
        best, best_ratio, run, term = 0, 1.0, 0.0, 1.0
        for k in range(1, self.max_draft_tokens + 1):
            run += term  # 1 + ac + ... + ac^(k-1)
            term *= ac
            ratio = (1.0 + a1 * run) / self._costs[k]
            if ratio > best_ratio * (1 + 1e-9):
                best, best_ratio = k, ratio
        return best

    def acceptance(self, seq, kind: int = 0) -> tuple[float, float]:
        """(a1, ac) as currently estimated for `seq`'s drafts of `kind` (the prior if none yet)."""
        st = self._seqs.get(seq.seq_id)
        acc = None if st is None else st.kinds.get(kind)
        if acc is None:
            return self.prior[0] / self.prior[1], self.prior[0] / self.prior[1]
        return acc.first[0] / acc.first[1], acc.more[0] / acc.more[1]

    def _update(self, ema: list[float], outcome: float) -> None:
        ema[0] = self.decay * ema[0] + outcome
        ema[1] = self.decay * ema[1] + 1.0

    def num_drafts(self, seq, budget: int, kind: int | None = 0) -> int:
        """How many drafts `seq` gets this step (0 = plain decode), at most `budget`; `kind`: the
        kind of this step's candidate drafts (None: there is no candidate)."""
        st = self._seqs.get(seq.seq_id)
        if st is None:
            st = self._seqs[seq.seq_id] = _SeqState()
        drafted = seq.stats.drafted - st.seen_drafted
        if drafted > 0 and st.last_kind is not None:  # the previous verification: n of k accepted
            acc = st.kinds[st.last_kind]
            accepted = seq.stats.accepted - st.seen_accepted
            self._update(acc.first, float(accepted > 0))
            for outcome in [1.0] * (accepted - 1) + [0.0] * (0 < accepted < drafted):
                self._update(acc.more, outcome)
        st.seen_drafted, st.seen_accepted, st.last_kind = seq.stats.drafted, seq.stats.accepted, None
        if budget <= 0 or kind is None:
            return 0
        acc = st.kinds.get(kind)
        if acc is None:
            acc = st.kinds[kind] = _Acceptance(list(self.prior), list(self.prior), interval=self.probe_interval)
        k = self.best_k(acc.first[0] / acc.first[1], acc.more[0] / acc.more[1])
        if k == 0:
            acc.idle += 1
            if acc.idle > acc.interval and self.probe_k:  # probe; if it fails, wait twice as long
                acc.idle = 1
                acc.interval = min(2 * acc.interval, self.max_probe_interval)
                k = self.probe_k
        elif acc.idle:  # back from a probe (or the estimate recovered): reset the probe clock
            acc.idle, acc.interval = 0, self.probe_interval
        k = min(k, budget)
        if k > 0:
            st.last_kind = kind
        return k

    def forget(self, seq) -> None:
        self._seqs.pop(seq.seq_id, None)


@dataclass
class _TokenBuffer:
    """A sequence's prompt + generated tokens as a growing int64 array (`data`), also seen as a
    torch tensor sharing its memory (`tensor`, what the extension's matchers read). With a
    `view` (`NewlineRuns`) the array holds the view of the tokens, which may be longer."""

    view: NewlineRuns | None = None
    data: np.ndarray = field(default_factory=lambda: np.empty(256, dtype=np.int64))
    size: int = 0  # elements of `data` in use
    raw: int = 0  # the sequence's tokens they hold
    tensor: torch.Tensor | None = None

    def __post_init__(self):
        self.tensor = torch.from_numpy(self.data)

    def sync(self, seq) -> np.ndarray:
        n_prompt = len(seq.prompt_ids)
        if self.raw < n_prompt:
            self._append(seq.prompt_ids[self.raw:])
            self.raw = n_prompt
        total = n_prompt + len(seq.output_ids)
        if self.raw < total:
            self._append(seq.output_ids[self.raw - n_prompt:])
            self.raw = total
        return self.data[: self.size]  # [L]

    def _append(self, ids: list[int]) -> None:
        if self.view is not None:
            ids = self.view.expand(ids)
        end = self.size + len(ids)
        if end > self.data.shape[0]:
            grown = np.empty(max(end, 2 * self.data.shape[0]), dtype=np.int64)
            grown[: self.size] = self.data[: self.size]
            self.data, self.tensor = grown, torch.from_numpy(grown)
        self.data[self.size:end] = ids
        self.size = end


def agreement_kind(agreement: int) -> int:
    """The back-off kind of an n-gram match by its agreement length (`propose_ngram_match`):
    0 for 1 token, 1 for 2-3, 2 for 4 or more."""
    return 0 if agreement <= 1 else 1 if agreement <= 3 else 2


# `ReferenceProposer`'s realignment: tried when the exact match agrees on at most REALIGN_BELOW
# tokens, taken when it matches at least REALIGN_MIN tokens and REALIGN_MARGIN more than that
REALIGN_BELOW = 3
REALIGN_MIN = 3
REALIGN_MARGIN = 2
# ... and where nothing matches (the last token is new), the match of the tokens before it, taken
# when it agrees on at least INSERTION_MIN tokens
INSERTION_MIN = 2


class ReferenceProposer:
    """`speculate_method = inference_with_reference`: n-gram drafts from the sequence's own prompt
    and output (`propose_ngram_match`: longest suffix match from `max_ngram_size` down to
    `min_ngram_size`, most recent occurrence, up to k tokens). Deterministic drafts: probs None.

    `realign` (default on): where the exact match is short (agreement ≤ REALIGN_BELOW tokens:
    right after an edit of the text being copied, the last token alone matches, often in the
    wrong place), `realigned_match` looks past an insertion / deletion of up to 3 tokens on either
    side, and its draft replaces the exact one when it explains ≥ REALIGN_MIN tokens and
    REALIGN_MARGIN more than the exact match (its agreement is then that count).

    Where neither finds anything the last token is new to the sequence, often a word the answer
    inserts into what it copies ("```python" where the prompt has "```"): the tokens before it are
    matched (with `stop_ids` excluded, so the prompt's closing fence, followed by the end of the
    turn, loses to its opening one), and that draft is taken when it agrees on ≥ INSERTION_MIN
    tokens, as a weak (1-token) match for the back-off. Drafts end before the first of
    `stop_ids` (the end-of-sequence ids): a drafted stop token only costs a row, since the step's
    own token would be it. `newline_runs` (`ngram.NewlineRuns`, which `build_proposer` derives
    from the tokenizer) is the view the matchers see where the tokenizer writes blank lines as
    single newlines. `bench/spec_replay.py` replays these choices on the bench's answers.

    `policy` (an `AdaptiveDraftLength`) picks k per sequence and per agreement class of the match
    (`agreement_kind`); None always asks for min(max_draft_tokens, budget).

    `matchers`: compiled twins of the two matchers (`ngram.native_matchers`, which a CPU base's
    runtime carries): the same drafts from one scalar pass each, which stays cheap right after a
    forward whose weights left numpy's code and data cold.
    """

    needs_hidden = False

    def __init__(self, max_ngram_size: int = 3, max_draft_tokens: int = 5, *, min_ngram_size: int = 1,
                 policy: AdaptiveDraftLength | None = None, realign: bool = True, matchers: tuple | None = None,
                 stop_ids: Sequence[int] = (), newline_runs: NewlineRuns | None = None):
        propose_ngram([0], max_ngram_size, max_draft_tokens, min_ngram_size)  # validates the sizes
        self.max_ngram_size, self.max_draft_tokens = max_ngram_size, max_draft_tokens
        self.min_ngram_size, self.policy, self.realign = min_ngram_size, policy, bool(realign)
        self.stop_ids, self.newline_runs = tuple(int(t) for t in stop_ids), newline_runs
        self._stop = frozenset(self.stop_ids)
        self._buffers: dict[int, _TokenBuffer] = {}
        # compiled twins of the two matchers (`ngram.native_matchers`): the same drafts
        self._native = matchers

    def match(self, tokens: np.ndarray, cap: int, buffer: torch.Tensor | None = None) -> tuple[list[int], int]:
        """(draft, agreement) for a sequence's tokens (int64), at most `cap` drafts (class
        docstring). `buffer`: a torch tensor whose first len(tokens) elements are the tokens, for
        the extension's matchers (else they wrap the array)."""
        n = tokens.shape[0]
        if self._native is not None and buffer is None:
            buffer = torch.from_numpy(np.ascontiguousarray(tokens, dtype=np.int64))
        draft, agreement = self._exact(tokens, n, cap, buffer)
        if self.realign and agreement <= REALIGN_BELOW:
            other, matched = realigned_match(tokens, cap) if self._native is None else self._native[1](buffer, n, cap)
            if other and matched >= max(REALIGN_MIN, agreement + REALIGN_MARGIN):
                draft, agreement = other, matched
        if not draft and cap > 0 and n > 2:  # the last token is new: match what came before it
            before, agreed = self._exact(tokens, n - 1, cap, buffer, self.stop_ids)
            if agreed >= INSERTION_MIN:
                draft, agreement = before, 1
        for i, t in enumerate(draft):
            if t in self._stop:
                return draft[:i], agreement
        return draft, agreement

    def _exact(self, tokens: np.ndarray, n: int, cap: int, buffer: torch.Tensor | None,
               stop_ids: tuple[int, ...] = ()) -> tuple[list[int], int]:
        """`propose_ngram_match` of the first n tokens, by the extension's matcher where there is one."""
        if self._native is None:
            return propose_ngram_match(tokens[:n], self.max_ngram_size, cap, self.min_ngram_size, stop_ids)
        return self._native[0](buffer, n, self.max_ngram_size, cap, self.min_ngram_size, stop_ids)

    def propose(self, seqs: list, budgets: list[int]) -> SpecProposal:
        """Deterministic drafts (no probs) for each sequence, at most its budget."""
        drafts: list[list[int]] = []
        for seq, budget in zip(seqs, budgets):
            cap = min(self.max_draft_tokens, budget)
            draft: list[int] = []
            if cap > 0:
                buf = self._buffers.get(seq.seq_id)
                if buf is None:
                    buf = self._buffers[seq.seq_id] = _TokenBuffer(self.newline_runs)
                draft, agreement = self.match(buf.sync(seq), cap, buf.tensor)
            if self.policy is not None:  # called every step: it reads the previous step's outcome
                k = self.policy.num_drafts(seq, cap, agreement_kind(agreement) if draft else None)
                draft = draft[:k]
            drafts.append(draft)
        return SpecProposal.from_token_lists(drafts)

    def release(self, seq) -> None:
        self._buffers.pop(seq.seq_id, None)
        if self.policy is not None:
            self.policy.forget(seq)


# ---------------------------------------------------------------------------------------------
# the factory


def validate_spec_config(config) -> None:
    """Check the speculation knobs of an `InferConfig`; one-line `QuantSpecError` on bad input."""
    method = config.speculate_method
    if method not in SPECULATE_METHODS:
        raise QuantSpecError(
            f"--speculate-method {method!r} is not supported; use one of {', '.join(SPECULATE_METHODS)}"
        )
    k = config.speculate_max_draft_token_num
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_DRAFT_TOKENS:
        raise QuantSpecError(
            f"--speculate-max-draft-token-num {k!r} is out of range; use an int in [1, {MAX_DRAFT_TOKENS}]"
        )
    n = config.speculate_max_ngram_size
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise QuantSpecError(f"--speculate-max-ngram-size {n!r} must be an int >= 1 (e.g. 3)")
    lo = getattr(config, "speculate_min_ngram_size", 1)
    if isinstance(lo, bool) or not isinstance(lo, int) or not 1 <= lo <= n:
        raise QuantSpecError(f"--speculate-min-ngram-size {lo!r} must be an int in [1, --speculate-max-ngram-size {n}]")
    if method == "inference_with_reference" and config.draft_model:
        raise QuantSpecError(
            "--draft-model is not used by --speculate-method inference_with_reference (n-gram drafts "
            "come from the prompt); drop --draft-model or use --speculate-method draft"
        )
    if method in ("draft", "mtp", "medusa", "eagle") and not config.draft_model:
        what = {"draft": "a draft model with the same tokenizer", "mtp": "an MTP module artifact",
                "medusa": "Medusa heads", "eagle": "an EAGLE-3 head"}[method]
        raise QuantSpecError(f"--speculate-method {method} needs --draft-model DIR ({what})")
    if method == "none" and config.draft_model:
        raise QuantSpecError("--draft-model needs --speculate-method draft, mtp, medusa or eagle")
    tree = getattr(config, "speculate_tree", None)
    if tree:
        from quantspec.infer.spec.tree import parse_tree_spec

        parse_tree_spec(tree)
        if method not in ("medusa", "eagle"):
            raise QuantSpecError(f"--speculate-tree drafts a token tree with --speculate-method medusa or "
                                 f"eagle; drop it for {method}")


def loaded_runtime(loaded):
    """The runtime the backend prepared for a `LoadedModel` (or the device's default runtime for
    an object that only carries a `model`)."""
    from quantspec.infer.backend import default_runtime

    runtime = getattr(loaded, "runtime", None)
    return runtime if runtime is not None else default_runtime(loaded.model.model.norm.weight.device)


def build_proposer(config, loaded):
    """The proposer for `config.speculate_method` and the most drafts it proposes per step.

    config: an `InferConfig`; loaded: the base `LoadedModel` (`infer/loader.py`).
    → (proposer, max_draft_tokens); (None, 0) for `none`.
    """
    validate_spec_config(config)
    method, k = config.speculate_method, config.speculate_max_draft_token_num
    if method == "none":
        return None, 0
    runtime = loaded_runtime(loaded)
    if method == "inference_with_reference":
        cost = SpecCost.for_device(runtime.device, packed_cpu=runtime.packed_rows)
        policy = AdaptiveDraftLength(k, cost) if getattr(config, "speculate_backoff", True) else None
        proposer = ReferenceProposer(config.speculate_max_ngram_size, k, policy=policy, matchers=runtime.ngram,
                                     min_ngram_size=getattr(config, "speculate_min_ngram_size", 1),
                                     stop_ids=getattr(loaded, "eos_token_ids", ()),
                                     newline_runs=NewlineRuns.from_tokenizer(getattr(loaded, "tokenizer", None)))
        return proposer, k
    if method == "draft":
        from quantspec.infer.spec.draft import build_draft_proposer

        return build_draft_proposer(config, loaded), k
    if method == "mtp":
        from quantspec.infer.spec.mtp import build_mtp_proposer

        return build_mtp_proposer(config, loaded)
    if method == "medusa":
        from quantspec.infer.spec.medusa import build_medusa_proposer

        return build_medusa_proposer(config, loaded)
    if method == "eagle":
        from quantspec.infer.spec.eagle import build_eagle_proposer

        return build_eagle_proposer(config, loaded)
    raise AssertionError(method)  # validate_spec_config covers every method
