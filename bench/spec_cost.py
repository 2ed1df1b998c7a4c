"""What a verification step costs by its number of drafts, measured in the engine, beside the
back-off's cost model for the device: C(k) = time of a step that verifies k drafts / time of a
plain decode step (k = 0), one sequence, same context, one run.

    python bench/spec_cost.py [--model DIR|zoo name] [--device cpu|cuda] [--threads 2]
                              [--drafts 0,1,2,4,6,8,10,12,16] [--context 256] [--rounds 6] [--repeats 3]
                              [--prefetch-ab]

The back-off (`infer/spec/proposers.py`, `AdaptiveDraftLength`) picks each sequence's k by
E(k) / C(k) with C(k) = 1 + verify_fixed + k · verify_per_token from `SpecCost.for_device`, so a
model that is off for a device makes it draft too much or too little. This prints, per k, the
median and the fastest step time and their ratios to k = 0, the model's C(k), and a least-squares
fit of 1 + fixed + k · per_token to the medians: run it on a new device (a GPU when one is lent)
to check or recalibrate the constants.

A step is `Engine.step()` whole: the base forward over 1 + k rows, the head (greedy ids from the
int8 / bf16 screen where the model has one, else the logits), verification and bookkeeping. The drafter
proposes k copies of one token, so drafts are (almost always) rejected and the context grows by
one token a step whatever k is; each round prefills a `--context`-token prompt of random ids
(EOS ignored) and times `--repeats` steps for every k, in a shuffled order, so the k values see
the same context lengths and the same interference on a shared machine.

`--prefetch-ab` (CPU kernels): every timed step runs twice back to back, with the greedy head
screen's L2 prefetch of its next block on and off (`GreedyHead.with_prefetch`, the screen's
`prefetch=` argument: steps of 7 or more drafts on an fp32 model), in random order. The main
table shows the steps with it on (the default); a second one shows per k the medians of both and
the median of the paired differences, which a shared host's drift leaves alone where the
separate medians do not.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import statistics
import time

import torch

from quantspec.errors import QuantSpecError
from quantspec.infer.predictor import InferConfig, Predictor
from quantspec.infer.sampler import SamplingParams
from quantspec.infer.spec.proposers import MAX_DRAFT_TOKENS
from quantspec.infer.spec.types import SpecProposal


class FixedDrafter:
    """Proposes `k` copies of `token` for every decoding sequence (at most its budget)."""

    needs_hidden = False

    def __init__(self, token: int):
        self.k, self.token = 0, token

    def propose(self, seqs, budgets):
        return SpecProposal.from_token_lists([[self.token] * min(self.k, b) for b in budgets])

    def release(self, seq) -> None:
        pass


def measure(pred: Predictor, drafts: list[int], context: int, rounds: int, repeats: int,
            seed: int = 0, prefetch_ab: bool = False) -> tuple[dict[int, list[float]], int, dict[int, list]]:
    """→ (step times (s) per draft count, drafts verified in the timed steps, per draft count the
    (prefetch on, off) time pairs of `prefetch_ab`, else empty lists): `rounds` prompts, `repeats`
    shuffled steps per k each (two with `prefetch_ab`)."""
    eng = pred.engine
    runtimes = {None: eng.runtime}
    if prefetch_ab:
        runtimes = {on: dataclasses.replace(eng.runtime, greedy=eng.runtime.greedy.with_prefetch(on))
                    for on in (True, False)}
    vocab = pred.loaded.model.args.vocab_size
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    drafter = FixedDrafter(token=0)
    eng.proposer, eng.eos = drafter, set()  # time steps, not stopping rules
    cuda = eng.device.type == "cuda"
    times: dict[int, list[float]] = {k: [] for k in drafts}
    pairs: dict[int, list[tuple[float, float]]] = {k: [] for k in drafts}
    verified = 0
    for r in range(rounds + 1):  # round 0 warms up (kernels, caches) and is not recorded
        prompt = torch.randint(vocab, (context,), generator=gen).tolist()
        stop = []
        seq = eng.add_request(prompt, SamplingParams(max_new_tokens=eng.config.max_length))
        seq.text_check = lambda s: 0 if stop else None  # ends the sequence when asked (below)
        drafter.k = 0
        eng.step()  # the prefill
        order = [k for k in drafts for _ in range(repeats)]
        rng.shuffle(order)
        for k in order:
            drafter.k = k
            took = {}
            for on in rng.sample([True, False], 2) if prefetch_ab else [None]:
                eng.runtime = runtimes[on]
                if cuda:
                    torch.cuda.synchronize()
                t = time.perf_counter()
                eng.step()
                if cuda:
                    torch.cuda.synchronize()
                took[on] = time.perf_counter() - t
            if r:
                times[k].append(took[True] if prefetch_ab else took[None])
                if prefetch_ab:
                    pairs[k].append((took[True], took[False]))
        if r:
            verified += seq.stats.drafted
        stop.append(True)
        drafter.k = 0
        while eng.has_work():
            eng.step()
    return times, verified, pairs


def fit_cost(ratios: dict[int, float]) -> tuple[float, float, float]:
    """Least squares of C(k) = 1 + fixed + k · per_token over k ≥ 1 → (fixed, per_token, and
    per_token with fixed = 0); NaN where the points do not determine them."""
    pts = [(k, c - 1.0) for k, c in ratios.items() if k > 0]
    nan = float("nan")
    if not pts:
        return nan, nan, nan
    through_zero = sum(k * c for k, c in pts) / sum(k * k for k, _ in pts)
    mk = statistics.fmean(k for k, _ in pts)
    var = sum((k - mk) ** 2 for k, _ in pts)
    if var == 0:
        return nan, nan, through_zero
    mc = statistics.fmean(c for _, c in pts)
    slope = sum((k - mk) * (c - mc) for k, c in pts) / var
    return mc - slope * mk, slope, through_zero


def _args(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m", help="zoo name, HF directory or artifact")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--drafts", default="0,1,2,4,6,8,10,12,16", help="draft counts k (0 = plain decode)")
    ap.add_argument("--context", type=int, default=256, help="prompt tokens before the timed steps")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=3, help="timed steps per k in a round")
    ap.add_argument("--prefetch-ab", action="store_true",
                    help="time every step with the head screen's next-block prefetch on and off (module doc)")
    a = ap.parse_args(argv)
    try:
        drafts = sorted({int(k) for k in a.drafts.split(",") if k.strip()} | {0})
    except ValueError:
        raise SystemExit(f"--drafts {a.drafts!r}: give comma-separated draft counts in 0..{MAX_DRAFT_TOKENS}, "
                         "e.g. 0,2,4,8") from None
    if a.rounds < 1 or a.repeats < 1 or a.context < 1 or a.threads < 1:
        raise SystemExit("--rounds, --repeats, --context and --threads must be >= 1")
    if drafts[-1] > MAX_DRAFT_TOKENS or drafts[0] < 0:
        raise SystemExit(f"--drafts {a.drafts}: give draft counts in 0..{MAX_DRAFT_TOKENS} "
                         "(--speculate-max-draft-token-num's range)")
    return a, drafts


def main(argv: list[str] | None = None) -> dict:
    a, drafts = _args(argv)
    torch.set_num_threads(a.threads)
    cfg = InferConfig(model=a.model, device=a.device, batch_size=1,
                      max_length=a.context + a.repeats * len(drafts) * 17 + 2 * drafts[-1] + 8,
                      speculate_method="inference_with_reference",
                      speculate_max_draft_token_num=max(1, drafts[-1]))
    try:
        pred = Predictor(cfg)
    except QuantSpecError as e:  # a missing model, an unknown device: the one-line reason
        raise SystemExit(str(e)) from None
    model_cost = pred.engine.proposer.policy.cost  # what the back-off assumes on this device
    if a.prefetch_ab and not hasattr(pred.engine.runtime.greedy, "with_prefetch"):
        raise SystemExit("--prefetch-ab compares the CPU greedy head's prefetch; use --device cpu on an fp32 model")
    times, verified, pairs = measure(pred, drafts, a.context, a.rounds, a.repeats, prefetch_ab=a.prefetch_ab)

    med = {k: statistics.median(v) for k, v in times.items()}
    fast = {k: min(v) for k, v in times.items()}
    r_med = {k: med[k] / med[0] for k in drafts}
    r_fast = {k: fast[k] / fast[0] for k in drafts}
    fixed, per_token, per_token0 = fit_cost(r_med)
    print(f"\n## verification step cost, {a.model} on {pred.engine.device} ({pred.engine.dtype}), "
          f"{torch.get_num_threads()} thread(s), context {a.context}+, {a.rounds} rounds (after a warm-up one) "
          f"x {a.repeats} timed steps per k\n")
    print("| drafts k | rows | median ms | C(k) median | fastest ms | C(k) fastest | model C(k) |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for k in drafts:
        print(f"| {k} | {k + 1} | {med[k] * 1e3:.2f} | {r_med[k]:.2f}x | {fast[k] * 1e3:.2f} | {r_fast[k]:.2f}x "
              f"| {model_cost.step_cost(k):.2f}x |")
    print(f"\nmodel (SpecCost.for_device): verify_fixed {model_cost.verify_fixed:.3f}, "
          f"verify_per_token {model_cost.verify_per_token:.3f}")
    print(f"fit to the medians over k >= 1: verify_fixed {fixed:.3f}, verify_per_token {per_token:.3f}; "
          f"with verify_fixed = 0: verify_per_token {per_token0:.3f}")
    ab = {}
    if a.prefetch_ab:
        print("\n### next-block prefetch on vs off (the same steps, back to back)\n")
        print("| drafts k | rows | median ms on | median ms off | paired difference on - off | on / off |")
        print("|---:|---:|---:|---:|---:|---:|")
        for k in drafts:
            on, off = (statistics.median(v) for v in zip(*pairs[k]))
            diff = statistics.median(t_on - t_off for t_on, t_off in pairs[k])
            ab[k] = {"on_s": on, "off_s": off, "paired_diff_s": diff}
            print(f"| {k} | {k + 1} | {on * 1e3:.2f} | {off * 1e3:.2f} | {diff * 1e3:+.2f} ms | {on / off:.3f}x |")
    return {"drafts": drafts, "median_s": med, "fastest_s": fast, "ratio_median": r_med, "ratio_fastest": r_fast,
            "model": (model_cost.verify_fixed, model_cost.verify_per_token), "fit": (fixed, per_token, per_token0),
            "verified": verified, "prefetch_ab": ab}


if __name__ == "__main__":
    main()
