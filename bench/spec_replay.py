"""How far n-gram speculation (`inference_with_reference`) can go on a set of prompts: the engine's
back-off policy replayed offline on plain greedy answers, beside the same drafts with hindsight-
perfect lengths and a perfect copier, under the back-off's cost model; one run.

    python bench/spec_replay.py [--model smollm2-135m|DIR] [--data bench/data/spec_prompts.jsonl]
                                [--new-tokens 128] [--draft-tokens 10] [--ngram 3] [--cost FIXED,PER_TOKEN]
                                [--threads 2] [--json FILE]

The plain greedy answers are generated once by the engine (timed: the time to the first token is
the prefill P, the rest the decode phase D). Greedy speculation is lossless, so every drafter sees
the same answers, and a step with k drafts accepts them up to the first one that differs from the
answer, plus one token of its own. Replayed with the engine's rules (its draft budget per step,
its bookkeeping of drafted / accepted tokens), per prompt kind:

- policy:    `ReferenceProposer` with the back-off (`AdaptiveDraftLength`), as the engine builds it
             for this model: what `--speculate-method inference_with_reference` does
             (tests/infer/spec/test_bench_spec_replay.py checks every count against the engine);
- hindsight: the same matcher's drafts without the back-off, each cut to the tokens that will be
             accepted (k = accepted): the ceiling of any draft-length policy for this matcher;
- copier:    the longest run of the answer's next tokens that occurs anywhere in the prompt and
             output so far (≤ the budget): the ceiling of any drafter that copies from its context.

Each row: base forwards after the first token, tokens per forward, the decode-phase speed-up under
C(k) (plain step = 1: Σ tokens / Σ C(k_step)), and the end-to-end speed-up that implies with the
measured prefill, (P + D) / (P + D / r). C(k) = 1 + fixed + k · per_token is the back-off's own
model for the device (`SpecCost.for_device`; `bench/spec_cost.py` measures it) unless `--cost` is
given. `bench/spec.py` measures the real thing; this separates what the drafter could do from what
the verification steps cost.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from spec import DATA, copy_share, load_prompts  # noqa: E402  (the sibling bench: the same prompts, copy share)

from quantspec.errors import QuantSpecError  # noqa: E402
from quantspec.infer.predictor import InferConfig, Predictor  # noqa: E402
from quantspec.infer.spec.proposers import (  # noqa: E402
    MAX_DRAFT_TOKENS,
    AdaptiveDraftLength,
    ReferenceProposer,
    SpecCost,
)

DRAFTERS = ("policy", "hindsight", "copier")


@dataclass
class _Stats:
    drafted: int = 0
    accepted: int = 0


@dataclass
class _Seq:  # what a proposer reads of an engine `Sequence`
    seq_id: int
    prompt_ids: list[int]
    output_ids: list[int]
    stats: _Stats = field(default_factory=_Stats)


@dataclass
class Replay:
    """One drafter over one answer: decode steps (base forwards after the first token), drafted
    and accepted tokens, and Σ C(k) over the steps."""

    forwards: int = 0
    drafted: int = 0
    accepted: int = 0
    cost: float = 0.0
    tokens: int = 0  # tokens after the first


def longest_copy(context: np.ndarray, upcoming: np.ndarray) -> int:
    """The longest prefix of `upcoming` that occurs anywhere in `context` (a run may not read past
    its end)."""
    if upcoming.size == 0 or context.size == 0:
        return 0
    starts = np.flatnonzero(context == upcoming[0])
    best = 1 if starts.size else 0
    j = 1
    while starts.size and j < upcoming.size:
        starts = starts[starts + j < context.size]
        starts = starts[context[starts + j] == upcoming[j]]
        if starts.size:
            best = j + 1
        j += 1
    return best


def replay(drafter: str, prompt: list[int], answer: list[int], *, max_draft_tokens: int, ngram: int,
           cost: SpecCost, max_new_tokens: int, max_length: int, seq_id: int = 0,
           like: ReferenceProposer | None = None) -> Replay:
    """Replays `drafter` (one of DRAFTERS) over a greedy `answer` to `prompt` with the engine's
    rules: before each decode step the budget is min(K, max_new_tokens − generated − 1,
    max_length − tokens − 1) (`Engine._budget`); a step accepts its drafts up to the first that
    differs from the answer and adds one token; the answer ends where the engine stopped it.
    `like`: the engine's proposer, whose stop ids and newline view the replayed one takes."""
    policy = AdaptiveDraftLength(max_draft_tokens, cost) if drafter == "policy" else None
    proposer = None
    if drafter != "copier":
        proposer = ReferenceProposer(ngram, max_draft_tokens, policy=policy,
                                     stop_ids=like.stop_ids if like is not None else (),
                                     newline_runs=like.newline_runs if like is not None else None)
    seq = _Seq(seq_id, list(prompt), answer[:1])  # the prefill step gave the first token
    ans = np.asarray(answer, dtype=np.int64)
    r = Replay(tokens=max(0, len(answer) - 1))
    n = 1
    while n < len(answer):
        budget = max(0, min(max_draft_tokens, max_new_tokens - n - 1, max_length - len(prompt) - n - 1))
        if drafter == "copier":
            context = np.asarray(prompt + answer[:n], dtype=np.int64)
            draft = answer[n:n + longest_copy(context, ans[n:n + budget])] if budget else []
        else:
            draft = proposer.propose([seq], [budget]).token_lists()[0][:budget]
        a = 0
        while a < len(draft) and n + a < len(answer) and draft[a] == answer[n + a]:
            a += 1
        if drafter == "hindsight":
            draft = draft[:a]
        r.forwards += 1
        r.drafted += len(draft)
        r.accepted += a
        r.cost += cost.step_cost(len(draft))
        seq.stats.drafted += len(draft)
        seq.stats.accepted += a
        n += a + 1
        seq.output_ids = answer[:n]
    if proposer is not None:
        proposer.release(seq)
    return r


def end_to_end(prefill_s: float, decode_s: float, decode_speedup: float) -> float:
    """(P + D) / (P + D / r): the whole-request speed-up a decode-phase speed-up r gives."""
    return (prefill_s + decode_s) / (prefill_s + decode_s / decode_speedup)


def _args(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m", help="zoo name, HF directory or artifact")
    ap.add_argument("--data", default=str(DATA), help="jsonl of {kind, src} prompts")
    ap.add_argument("--prompts", type=int, default=0, help="prompts per kind [default: all]")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--max-length", type=int, default=1024)
    ap.add_argument("--draft-tokens", type=int, default=10, help="--speculate-max-draft-token-num (bench/spec.py's n-gram)")
    ap.add_argument("--ngram", type=int, default=3, help="--speculate-max-ngram-size")
    ap.add_argument("--cost", help="FIXED,PER_TOKEN of C(k) = 1 + FIXED + k * PER_TOKEN [default: the back-off's "
                                   "model for the device]")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ignore-eos", action="store_true", help="answers run to --new-tokens")
    ap.add_argument("--json", help="also write the rows here")
    a = ap.parse_args(argv)
    if a.threads < 1 or a.new_tokens < 1 or not 1 <= a.draft_tokens <= MAX_DRAFT_TOKENS or a.ngram < 1 or a.prompts < 0:
        raise SystemExit(f"--threads, --new-tokens and --ngram must be >= 1, --draft-tokens in 1..{MAX_DRAFT_TOKENS}, "
                         "--prompts >= 0")
    if a.max_length <= a.new_tokens:
        raise SystemExit(f"--max-length {a.max_length} leaves no room for a prompt before --new-tokens {a.new_tokens}")
    a.cost_model = None
    if a.cost:
        try:
            fixed, per_token = (float(v) for v in a.cost.split(","))
            a.cost_model = SpecCost(fixed, per_token)
        except (ValueError, QuantSpecError):  # not two numbers, or a negative / non-finite one
            raise SystemExit(f"--cost {a.cost!r}: give FIXED,PER_TOKEN, two numbers >= 0, e.g. 0,0.05") from None
    return a


def _answers(plain: Predictor, kind: str, srcs: list[str]) -> list[tuple]:
    """(prompt ids, answer ids, copy share, prefill s, decode s) of each plain greedy answer."""
    answers = []
    for src in srcs:
        t = time.perf_counter()
        try:
            out = plain.generate([src])[0]
        except QuantSpecError as e:  # a prompt longer than --max-length allows: the one-line reason
            raise SystemExit(f"{kind} prompt {src[:40]!r}...: {e}") from None
        wall = time.perf_counter() - t
        prompt = plain.encode(src)[0]
        answers.append((prompt, out.token_ids, copy_share(prompt, out.token_ids), out.ttft_s, wall - out.ttft_s))
    return answers


def _replay_rows(a, label: str, subset: list[tuple], cost: SpecCost, like: ReferenceProposer) -> list[dict]:
    """A row per drafter replayed over the answers of `subset`, printed as it goes."""
    rows = []
    prefill_s, decode_s = sum(x[3] for x in subset), sum(x[4] for x in subset)
    for drafter in DRAFTERS:
        tot = Replay()
        for i, (prompt, answer, *_) in enumerate(subset):
            r = replay(drafter, prompt, answer, max_draft_tokens=a.draft_tokens, ngram=a.ngram, cost=cost,
                       max_new_tokens=a.new_tokens, max_length=a.max_length, seq_id=i, like=like)
            for f in ("forwards", "drafted", "accepted", "cost", "tokens"):
                setattr(tot, f, getattr(tot, f) + getattr(r, f))
        speedup = tot.tokens / tot.cost if tot.cost else 1.0
        e2e = end_to_end(prefill_s, decode_s, speedup)
        row = dict(kind=label, drafter=drafter, forwards=tot.forwards, drafted=tot.drafted,
                   accepted=tot.accepted, tokens=tot.tokens,
                   acceptance=tot.accepted / tot.drafted if tot.drafted else None,
                   tokens_per_forward=tot.tokens / tot.forwards if tot.forwards else None,
                   decode_speedup=speedup, end_to_end=e2e, prefill_share=prefill_s / (prefill_s + decode_s))
        rows.append(row)
        acc = "-" if row["acceptance"] is None else f"{100 * row['acceptance']:.1f}%"
        tpf = "-" if row["tokens_per_forward"] is None else f"{row['tokens_per_forward']:.2f}"
        print(f"| {label} | {drafter} | {tot.forwards} | {tot.drafted} | {acc} | {tpf} | {speedup:.2f}x | "
              f"{e2e:.2f}x |")
    return rows


def main(argv: list[str] | None = None) -> dict:
    a = _args(argv)
    data = Path(a.data)
    if not data.is_file():
        raise SystemExit(f"--data {data}: no such file")
    kinds = load_prompts(data, a.prompts)
    if not kinds:
        raise SystemExit(f"--data {data}: no prompts")
    torch.set_num_threads(a.threads)
    cfg = InferConfig(model=a.model, device="cpu", batch_size=1, max_new_tokens=a.new_tokens,
                      max_length=a.max_length, speculate_method="inference_with_reference",
                      speculate_max_draft_token_num=a.draft_tokens, speculate_max_ngram_size=a.ngram)
    try:
        pred = Predictor(cfg)
    except QuantSpecError as e:  # a missing model, a bad size: the one-line reason
        raise SystemExit(str(e)) from None
    cost = a.cost_model or pred.engine.proposer.policy.cost  # default: the back-off's own model here
    plain = Predictor(InferConfig(model=a.model, device="cpu", batch_size=1, max_new_tokens=a.new_tokens,
                                  max_length=a.max_length), loaded=pred.loaded)
    if a.ignore_eos:
        plain.engine.eos = set()
    plain.generate(["Hello"])  # warm-up
    results = []
    print(f"\n## n-gram drafting replayed on plain greedy answers: {a.model}, K = {a.draft_tokens}, "
          f"n-gram ≤ {a.ngram}, C(k) = 1 + {cost.verify_fixed:g} + {cost.verify_per_token:g} k\n")
    print("| prompts | drafter | forwards | drafted | acceptance | tokens per forward | decode speed-up (model) | "
          "end to end (model, measured prefill) |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for kind, srcs in kinds.items():
        answers = _answers(plain, kind, srcs)
        subsets = [(kind, answers)]
        if kind == "code_edit":
            subsets.append((f"{kind}, copy>=50%", [x for x in answers if x[2] >= 0.5]))
        for label, subset in subsets:
            if subset:
                results += _replay_rows(a, label, subset, cost, pred.engine.proposer)
    shares = {r["kind"]: r["prefill_share"] for r in results}
    print("\nprefill share of the plain runs (measured): " + ", ".join(f"{k}: {100 * v:.0f}%" for k, v in shares.items()))
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=2))
    return {"rows": results, "cost": cost}


if __name__ == "__main__":
    main()
