"""Token sampling: the per-request `SamplingParams`, logits → probabilities (temperature, top-k,
top-p), batch-invariant sampling with per-sequence generators, and greedy argmax.

Everything here is a pure function of tensors (no model, config or device policy), so the engine's
decode step and the speculative verifier (`infer/spec/verify.py`) share one definition of "the
target distribution" of a sequence.

Random streams. A sequence's randomness comes only from its own `torch.Generator`, so what it
samples does not depend on which other sequences share its batch or in which slot it sits
(batch-invariant sampling). `make_generators` derives the generator of the request with index
`i` (its position in the input file, not its batch slot) from the run seed `s` as
`numpy.random.SeedSequence([s, i])`: the same (seed, request index) gives the same stream in any
batch, and different requests get statistically independent streams. A `None` generator means
"use torch's global generator" (reproducible only with `torch.manual_seed` and an identical
batch).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from quantspec.errors import QuantSpecError

__all__ = [
    "DecodeStrategy",
    "SamplingParams",
    "sampling_tensors",
    "logits_to_probs",
    "sample",
    "greedy",
    "greedy_ids",
    "generator_for_request",
    "make_generators",
    "TOP_P_CANDIDATES",
    "MAX_LOGPROBS",
    "adjust_logits",
]

# Largest seed accepted: torch.Generator.manual_seed takes a uint64, numpy's SeedSequence any
# non-negative int; 2**63 keeps the value representable as a signed int64 everywhere.
_MAX_SEED = 2**63
MAX_LOGPROBS = 20  # the most top log-probabilities a token may ask for (OpenAI's top_logprobs bound)


class DecodeStrategy(str, enum.Enum):
    """How the next token is chosen: `greedy` = argmax of the raw logits, `sampling` = a draw from
    the temperature / top-k / top-p filtered distribution."""

    GREEDY = "greedy"
    SAMPLING = "sampling"


def _is_int(x: object) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def _is_real(x: object) -> bool:
    return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, bool)


@dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding knobs, validated when built.

    decode_strategy: "greedy" or "sampling" (stored as `DecodeStrategy`).
    temperature:     > 0 for sampling; ignored by greedy.
    top_k:           keep the k most likely tokens (ties at the k-th value are kept); 0 = off.
    top_p:           keep the smallest set of most likely tokens whose mass reaches top_p;
                     in (0, 1], 1.0 = off.
    min_p:           keep the tokens at least min_p times as likely as the most likely one (after
                     temperature); in [0, 1], 0.0 = off.
    ignore_eos:      the model's EOS tokens do not end the sequence (fixed-length benchmarks).
    stop_token_ids:  token ids that end the sequence like an EOS (emitted, then finish "stop").
    min_tokens:      no EOS, stop token or stop string ends the sequence before this many output
                     tokens: the EOS and stop tokens' logits are masked until then.
    seed:            None (torch's global generator) or an int in [0, 2**63).
    max_new_tokens:  ≥ 1.
    stop:            stop strings (non-empty), stored as a tuple so the params stay hashable.
    logprobs:        None (off) or n in [0, MAX_LOGPROBS]: each output token's log-probability
                     under the model (the log-softmax of its raw logits, before penalties, bias,
                     temperature and filters) and the n most likely tokens' (`infer.logprobs`).
    prompt_logprobs: the same for every prompt token after the first (None: off).
    presence_penalty, frequency_penalty: in [-2, 2]; subtracted from the logit of every token the
                     output holds, once (presence) and once per occurrence (frequency), as
                     OpenAI's API defines them; 0 = off.
    repetition_penalty: > 0; the logit of every token in the prompt or the output is divided by
                     it where positive and multiplied by it where not (transformers' and vLLM's
                     definition); 1.0 = off.
    logit_bias:      (token id, bias in [-100, 100]) pairs added to those tokens' logits (OpenAI's
                     `logit_bias`; -100 bans a token in effect), after the penalties. Penalties and
                     biases act before temperature and the filters; drafts are verified with each
                     row adjusted after the drafts on its path (`infer.adjust`).
    allowed_token_ids: the only tokens the answer may hold (vLLM's); empty = off.
    bad_words:       token-id sequences the output may not hold (vLLM's `bad_words`, tokenized): a
                     sequence's last token is masked wherever the output ends with the ones before
                     it (a one-token sequence always); empty = off.
    guide:           None, or a compiled structured-output grammar (`infer.structured`): the
                     logits of every token the answer cannot continue with are masked, after the
                     penalties and bias; drafts are verified under the mask (`infer.adjust`).
    guide_after:     None, or (start ids, end ids, thinking first) of a reasoning model's thinking
                     tags: the guide holds the answer after its thinking only
                     (`infer.structured.AfterThinking`).
    """

    decode_strategy: DecodeStrategy | str = DecodeStrategy.GREEDY
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    max_new_tokens: int = 128
    stop: Sequence[str] = field(default_factory=tuple)
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: Sequence[tuple[int, float]] = field(default_factory=tuple)
    min_p: float = 0.0
    ignore_eos: bool = False
    stop_token_ids: Sequence[int] = field(default_factory=tuple)
    min_tokens: int = 0
    allowed_token_ids: Sequence[int] = field(default_factory=tuple)
    bad_words: Sequence[Sequence[int]] = field(default_factory=tuple)
    guide: object | None = field(default=None, compare=False)
    guide_after: tuple | None = None

    def __post_init__(self) -> None:
        try:
            strategy = DecodeStrategy(self.decode_strategy)
        except ValueError:
            raise QuantSpecError(
                f"decode_strategy={self.decode_strategy!r} is not supported; use one of "
                f"{[s.value for s in DecodeStrategy]}"
            ) from None
        object.__setattr__(self, "decode_strategy", strategy)
        self._check_filters(strategy)

        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < _MAX_SEED):
            raise QuantSpecError(f"--seed {self.seed!r} must be an integer in [0, 2**63)")
        if self.seed is not None:
            object.__setattr__(self, "seed", int(self.seed))

        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise QuantSpecError(f"--max-new-tokens {self.max_new_tokens!r} must be an integer >= 1")
        object.__setattr__(self, "max_new_tokens", int(self.max_new_tokens))

        if isinstance(self.stop, str):
            raise QuantSpecError(
                f"--stop {self.stop!r} must be a list of strings, not a string; pass [{self.stop!r}]"
            )
        stop = tuple(self.stop)
        if not all(isinstance(s, str) and s for s in stop):
            raise QuantSpecError(f"--stop {list(stop)!r} must contain only non-empty strings")
        object.__setattr__(self, "stop", stop)
        self._check_extras()

    def _check_extras(self) -> None:
        """Validate and normalise what goes beyond decoding proper: log-probabilities, penalties,
        the logit bias and the stop rules."""
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not _is_int(v) or not 0 <= v <= MAX_LOGPROBS):
                raise QuantSpecError(f"--{name.replace('_', '-')} {v!r} must be an integer in [0, {MAX_LOGPROBS}]")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_real(v) or not -2.0 <= v <= 2.0:
                raise QuantSpecError(f"--{name.replace('_', '-')} {v!r} must be a number in [-2, 2] (0 turns it off)")
            object.__setattr__(self, name, float(v))
        if not _is_real(self.repetition_penalty) or not 0 < self.repetition_penalty < math.inf:
            raise QuantSpecError(f"--repetition-penalty {self.repetition_penalty!r} must be a number > 0 "
                                 "(1 turns it off)")
        object.__setattr__(self, "repetition_penalty", float(self.repetition_penalty))
        bias = tuple(tuple(pair) for pair in (self.logit_bias.items() if isinstance(self.logit_bias, dict)
                                              else self.logit_bias))
        for pair in bias:
            if (len(pair) != 2 or not _is_int(pair[0]) or pair[0] < 0 or not _is_real(pair[1])
                    or not -100 <= pair[1] <= 100):
                raise QuantSpecError(f"logit_bias entry {pair!r} must be (token id >= 0, bias in [-100, 100])")
        object.__setattr__(self, "logit_bias", tuple((int(t), float(b)) for t, b in bias))
        stop_ids = tuple(self.stop_token_ids)
        if not all(_is_int(t) and t >= 0 for t in stop_ids):
            raise QuantSpecError(f"stop_token_ids {list(stop_ids)!r} must be token ids >= 0")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in stop_ids))
        object.__setattr__(self, "ignore_eos", bool(self.ignore_eos))
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_new_tokens:
            raise QuantSpecError(f"min_tokens {self.min_tokens!r} must be an integer in [0, max_new_tokens "
                                 f"{self.max_new_tokens}]")
        allowed = tuple(self.allowed_token_ids)
        if not all(_is_int(t) and t >= 0 for t in allowed):
            raise QuantSpecError("allowed_token_ids must be token ids (integers >= 0)")
        object.__setattr__(self, "allowed_token_ids", tuple(int(t) for t in allowed))
        bad = tuple(tuple(w) for w in self.bad_words)
        if not all(w and all(_is_int(t) and t >= 0 for t in w) for w in bad):
            raise QuantSpecError("bad_words must be non-empty sequences of token ids (integers >= 0)")
        object.__setattr__(self, "bad_words", tuple(tuple(int(t) for t in w) for w in bad))
        object.__setattr__(self, "min_tokens", int(self.min_tokens))
        if self.min_tokens and self.guide is not None:  # it could mask the only token the grammar allows
            raise QuantSpecError("min_tokens does not combine with a structured output, whose grammar says where "
                                 "the answer ends; drop min_tokens")

    def _check_filters(self, strategy: DecodeStrategy) -> None:
        """Validate and normalise the temperature and the top-k / top-p / min-p filters."""
        if not _is_real(self.temperature) or not math.isfinite(self.temperature):
            raise QuantSpecError(
                f"--temperature {self.temperature!r} must be a finite number; pass e.g. 1.0"
            )
        if strategy is DecodeStrategy.SAMPLING and self.temperature <= 0:
            raise QuantSpecError(
                f"--temperature {self.temperature} must be > 0 with --decode-strategy sampling; "
                "use --decode-strategy greedy for deterministic decoding"
            )
        if self.temperature < 0:
            raise QuantSpecError(f"--temperature {self.temperature} must be >= 0")
        object.__setattr__(self, "temperature", float(self.temperature))

        if not _is_int(self.top_k) or self.top_k < 0:
            raise QuantSpecError(f"--top-k {self.top_k!r} must be an integer >= 0 (0 turns top-k off)")
        object.__setattr__(self, "top_k", int(self.top_k))

        if not _is_real(self.top_p) or not (0.0 < self.top_p <= 1.0):
            raise QuantSpecError(f"--top-p {self.top_p!r} must be in (0, 1] (1.0 turns top-p off)")
        object.__setattr__(self, "top_p", float(self.top_p))

        if not _is_real(self.min_p) or not (0.0 <= self.min_p <= 1.0):
            raise QuantSpecError(f"--min-p {self.min_p!r} must be in [0, 1] (0 turns min-p off)")
        object.__setattr__(self, "min_p", float(self.min_p))

    @property
    def is_greedy(self) -> bool:
        return self.decode_strategy is DecodeStrategy.GREEDY

    @property
    def has_logit_rules(self) -> bool:
        """True when a presence, frequency or repetition penalty, a logit bias, min_tokens,
        allowed_token_ids or bad_words is on (`adjust_logits`, and the engine's masking of EOS and
        stop tokens before min_tokens)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias or self.min_tokens or self.allowed_token_ids or self.bad_words)

    @property
    def adjusts_logits(self) -> bool:
        """True when the logits are adjusted before a pick: `has_logit_rules`, or a guide."""
        return self.has_logit_rules or self.guide is not None

    @property
    def uses_filter(self) -> bool:
        """True when sampling with top-k, top-p or min-p on (`logits_to_probs` has masking to do)."""
        return not self.is_greedy and (self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0)


def sampling_tensors(
    params: Sequence[SamplingParams], device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Per-row (temperature [N] fp32, top_k [N] int64 | None, top_p [N] fp32 | None, min_p [N]
    fp32 | None): `logits_to_probs`' arguments after the logits, in its order. Greedy rows get
    temperature 1 and no filter. A filter comes back None when no row uses it, so
    `logits_to_probs` skips it without a device sync."""
    temperature = torch.tensor(
        [1.0 if p.is_greedy else p.temperature for p in params], dtype=torch.float32, device=device
    )  # [N]
    top_k = top_p = None
    if any(not p.is_greedy and p.top_k > 0 for p in params):
        top_k = torch.tensor(
            [0 if p.is_greedy else p.top_k for p in params], dtype=torch.int64, device=device
        )  # [N]
    if any(not p.is_greedy and p.top_p < 1.0 for p in params):
        top_p = torch.tensor(
            [1.0 if p.is_greedy else p.top_p for p in params], dtype=torch.float32, device=device
        )  # [N]
    min_p = None
    if any(not p.is_greedy and p.min_p > 0.0 for p in params):
        min_p = torch.tensor([0.0 if p.is_greedy else p.min_p for p in params], dtype=torch.float32,
                             device=device)  # [N]
    return temperature, top_k, top_p, min_p


def logits_to_probs(
    logits: torch.Tensor,  # [N, V] float
    temperature: torch.Tensor,  # [N] float, > 0
    top_k: torch.Tensor | None = None,  # [N] int, 0 = off; None = off for all rows
    top_p: torch.Tensor | None = None,  # [N] float in (0, 1], 1 = off; None = off for all rows
    min_p: torch.Tensor | None = None,  # [N] float in [0, 1], 0 = off; None = off for all rows
) -> torch.Tensor:  # [N, V] fp32
    """Temperature, then min-p, top-k and top-p masking, renormalised; per-row parameters.

    Min-p keeps every token whose probability is at least min_p times the most likely token's
    (after temperature); top-k and top-p then act on what it keeps.

    Top-k keeps every token whose logit is >= the k-th largest (ties at the boundary are kept).
    Top-p keeps the smallest prefix of the tokens sorted by probability (after top-k) whose mass
    reaches top_p; the most likely token is always kept. Rows with top_k = 0 and top_p = 1 are
    exactly softmax(logits / temperature).

    Cost: with no filter this is one softmax (pass None for top_k / top_p when no row uses them:
    no host sync on the decode hot path). Top-k uses `topk`, not a sort. Top-p first looks at
    the `TOP_P_CANDIDATES` most likely tokens and sorts the whole row only when their mass does
    not reach top_p (flat distributions).

    Example: logits [[2, 1, 0, -1]], temperature [1], top_k [2] → probs ≈ [[0.731, 0.269, 0, 0]].
    """
    if logits.ndim != 2 or not logits.is_floating_point():
        raise QuantSpecError(
            f"logits must be a float [N, V] tensor, got {tuple(logits.shape)} {logits.dtype}"
        )
    n = logits.shape[0]
    if temperature.shape != (n,):
        raise QuantSpecError(f"temperature must be [N]={n}, got {tuple(temperature.shape)}")
    for name, t in (("top_k", top_k), ("top_p", top_p), ("min_p", min_p)):
        if t is not None and t.shape != (n,):
            raise QuantSpecError(f"{name} must be [N]={n} or None, got {tuple(t.shape)}")

    logits = logits.float() / temperature.float().unsqueeze(1)  # [N, V] fp32 (a new tensor)
    if min_p is not None and bool((min_p > 0).any()):
        # p_i >= min_p * p_max  <=>  logit_i >= logit_max + log(min_p)  (log 0 = -inf: the row is kept)
        floor = logits.max(dim=-1, keepdim=True).values + torch.log(min_p.to(logits.device, torch.float32)).unsqueeze(1)
        logits.masked_fill_(logits < floor, float("-inf"))
    if top_k is not None and bool((top_k > 0).any()):
        _mask_top_k_(logits, top_k.to(device=logits.device, dtype=torch.int64))
    if top_p is not None and bool((top_p < 1.0).any()):
        logits = _mask_top_p(logits, top_p.to(device=logits.device, dtype=torch.float32))
    return torch.softmax(logits, dim=-1)


# Top-p looks at this many most likely tokens before falling back to a full sort of the row.
TOP_P_CANDIDATES = 1024


def _mask_top_k_(logits: torch.Tensor, k: torch.Tensor) -> None:
    """In place: logits [N, V] below each row's k-th largest value → -inf; rows with k = 0 kept."""
    k = k.clamp(0, logits.shape[1])  # [N]
    top = logits.topk(int(k.max()), dim=-1).values  # [N, k_max] descending
    kth = top.gather(1, (k - 1).clamp(min=0).unsqueeze(1))  # [N, 1]
    logits.masked_fill_((logits < kth) & (k > 0).unsqueeze(1), float("-inf"))


def _top_p_drop(sorted_logits: torch.Tensor, lse: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Which of the descending `sorted_logits` [N, C] fall outside the top-p set, given the full
    row's logsumexp `lse` [N, 1] and top_p `p` [N, 1] → bool [N, C]."""
    probs = torch.exp(sorted_logits - lse)  # [N, C]
    mass_before = probs.cumsum(dim=-1) - probs  # [N, C] exclusive prefix sum
    # Rows with top_p = 1 are left alone explicitly: rounding can push the prefix sum to 1.
    return (mass_before >= p) & (p < 1.0)  # position 0 has mass_before 0 → always kept


def _mask_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """logits [N, V] with tokens outside each row's top-p set → -inf (rows with top_p = 1 kept)."""
    n, v = logits.shape
    p = top_p.unsqueeze(1)  # [N, 1]
    lse = torch.logsumexp(logits, dim=-1, keepdim=True)  # [N, 1]
    cand = min(v, TOP_P_CANDIDATES)
    cand_logits, cand_idx = logits.topk(cand, dim=-1)  # [N, C] each, descending
    drop = _top_p_drop(cand_logits, lse, p)  # [N, C]
    # Where the last candidate is dropped, every token outside the candidates (less likely, more
    # mass before it) is dropped too, so the candidates decide the row.
    resolved = drop[:, -1] | (top_p >= 1.0) | (cand == v)  # [N]
    out = torch.full_like(logits, float("-inf")).scatter_(
        1, cand_idx, cand_logits.masked_fill(drop, float("-inf"))
    )  # [N, V]
    out = torch.where((top_p < 1.0).unsqueeze(1), out, logits)
    if not bool(resolved.all()):
        rows = torch.nonzero(~resolved).squeeze(1)  # [M]
        sorted_logits, sorted_idx = logits[rows].sort(dim=-1, descending=True)  # [M, V] each
        sorted_logits.masked_fill_(_top_p_drop(sorted_logits, lse[rows], p[rows]), float("-inf"))
        out[rows] = torch.empty_like(sorted_logits).scatter_(1, sorted_idx, sorted_logits)
    return out


def sample(
    probs: torch.Tensor,  # [N, V] float, rows sum to 1 (zeros allowed)
    generators: Sequence[torch.Generator | None],  # N entries
) -> torch.Tensor:  # [N] int64
    """One token per row drawn from `probs`, row i using only `generators[i]`.

    Inverse-CDF sampling: one uniform u per row, token = the first index whose fp64 cumulative
    mass exceeds u · total. Each row consumes exactly one draw from its own generator, so its
    stream does not depend on its neighbours (and a row costs a cumsum, not V random numbers).
    Zero-probability tokens are never returned. Rows whose generator is None draw from torch's
    global generator in one call. Rows need not be normalised, but must have positive mass.
    """
    if probs.ndim != 2 or not probs.is_floating_point():
        raise QuantSpecError(
            f"probs must be a float [N, V] tensor, got {tuple(probs.shape)} {probs.dtype}"
        )
    n, v = probs.shape
    if len(generators) != n:
        raise QuantSpecError(f"got {len(generators)} generators for {n} rows; pass one per row")
    u = torch.empty(n, dtype=torch.float64, device=probs.device)  # [N] in [0, 1)
    shared = [i for i, g in enumerate(generators) if g is None]
    for i, g in enumerate(generators):
        if g is not None:
            u[i : i + 1] = torch.rand(1, generator=g, dtype=torch.float64, device=probs.device)
    if shared:
        u[shared] = torch.rand(len(shared), dtype=torch.float64, device=probs.device)
    cdf = probs.double().cumsum(dim=-1)  # [N, V] fp64 so the tail of a large vocab keeps its mass
    target = (u * cdf[:, -1]).unsqueeze(1)  # [N, 1]
    tokens = torch.searchsorted(cdf, target, right=True).squeeze(1)  # [N]
    # u · total can round up to total; fall back to the last token with nonzero probability.
    last_nonzero = v - 1 - (probs > 0).flip(-1).int().argmax(dim=-1)  # [N]
    return torch.minimum(tokens, last_nonzero)


def greedy(logits: torch.Tensor) -> torch.Tensor:  # [N, V] → [N] int64
    """Argmax per row (the first index on ties)."""
    if logits.ndim != 2:
        raise QuantSpecError(f"logits must be [N, V], got {tuple(logits.shape)}")
    return logits.argmax(dim=-1)


def adjust_logits(logits: torch.Tensor, params: SamplingParams, prompt_ids: Sequence[int],
                    output_ids: Sequence[int]) -> torch.Tensor:
    """A row of logits [V] with `params`' penalties and logit bias applied (`SamplingParams`), in
    place: the repetition penalty over the prompt's and the output's tokens, the frequency and
    presence penalties over the output's, then the bias, then -inf outside `allowed_token_ids` and
    at the last token of each of `bad_words` the output ends with the rest of; → the row."""
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(prompt_ids).union(output_ids)), dtype=torch.int64, device=logits.device)
        vals = logits[seen]
        logits[seen] = torch.where(vals > 0, vals / params.repetition_penalty, vals * params.repetition_penalty)
    if output_ids and (params.frequency_penalty or params.presence_penalty):
        ids, counts = torch.tensor(list(output_ids), dtype=torch.int64, device=logits.device).unique(return_counts=True)
        logits[ids] -= params.frequency_penalty * counts.to(logits.dtype) + params.presence_penalty
    if params.logit_bias:
        ids = torch.tensor([t for t, _ in params.logit_bias], dtype=torch.int64, device=logits.device)
        logits[ids] += torch.tensor([b for _, b in params.logit_bias], dtype=logits.dtype, device=logits.device)
    if params.allowed_token_ids:
        keep = torch.tensor(params.allowed_token_ids, dtype=torch.int64, device=logits.device)
        kept = logits[keep]
        logits.fill_(float("-inf"))
        logits[keep] = kept
    banned = [w[-1] for w in params.bad_words
              if len(w) - 1 <= len(output_ids) and tuple(output_ids[len(output_ids) - len(w) + 1:]) == w[:-1]]
    if banned:
        logits[torch.tensor(banned, dtype=torch.int64, device=logits.device)] = float("-inf")
    return logits


def greedy_ids(logits: torch.Tensor) -> list[int]:  # [N, V] → N host ints
    """`greedy(logits).tolist()`, with numpy's argmax for float32 CPU logits: the same indices
    (first on ties, a NaN counts as the maximum in both), vectorised where torch's CPU argmax of
    a row is single-threaded and scalar on this build."""
    if logits.ndim != 2:
        raise QuantSpecError(f"logits must be [N, V], got {tuple(logits.shape)}")
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and not logits.requires_grad:
        return logits.numpy().argmax(axis=-1).tolist()
    return logits.argmax(dim=-1).tolist()


def generator_for_request(
    seed: int | None, request_index: int, device: torch.device | str = "cpu"
) -> torch.Generator | None:
    """The generator of request `request_index` in a run seeded with `seed` (None → None, i.e.
    torch's global generator). Its 64-bit seed is `SeedSequence([seed, request_index])`, so
    requests get independent streams and a request's stream depends only on (seed, index)."""
    if seed is None:
        return None
    if not _is_int(seed) or not 0 <= seed < _MAX_SEED:
        raise QuantSpecError(f"seed={seed!r} must be None or an int in [0, 2**63)")
    if not _is_int(request_index) or request_index < 0:
        raise QuantSpecError(f"request_index={request_index!r} must be an int >= 0")
    state = np.random.SeedSequence([int(seed), int(request_index)]).generate_state(1, np.uint64)
    g = torch.Generator(device=device)
    g.manual_seed(int(state[0]) % _MAX_SEED)
    return g


def make_generators(
    seed: int | None,
    num_requests: int,
    device: torch.device | str = "cpu",
    start_index: int = 0,
) -> list[torch.Generator | None]:
    """Generators for requests start_index .. start_index + num_requests - 1 (see
    `generator_for_request`)."""
    if not _is_int(num_requests) or num_requests < 0:
        raise QuantSpecError(f"num_requests={num_requests!r} must be an int >= 0")
    return [generator_for_request(seed, start_index + i, device) for i in range(num_requests)]
