"""n-gram speculation (`inference_with_reference`) on quantized bases
(`quantspec infer --model smol.w4/ --speculate-method inference_with_reference`), the default
model's artifacts against plain greedy decoding of the same artifact, beside the fp32 model; one
run, same machine, batch 1.

    python bench/spec_bases.py [--bases weight_only_int8,weight_only_int4] [--threads 2] [--rounds 2]
                               [--prompts N] [--new-tokens 128] [--draft-tokens 10]

Each base (fp32, then each artifact: `quantspec.api.quantize`, RTN, cached like `bench/spec.py`'s
drafts) runs every code-editing prompt of `bench/data/spec_prompts.jsonl` plain and with the
n-gram, interleaved prompt by prompt (`--rounds`: each keeps its fastest run), and checks that the
n-gram output equals plain greedy decoding of that base. Prints per base, over all code prompts
and over the copy prompts (answer copy share >= 50%, as in `bench/spec.py`): plain and n-gram
tokens/s, end to end and in the decode phase, and the prefill's share of a plain run; then the
end-to-end ratio of each round alone (min-max, median). The best-of-rounds columns pair each
method with its fastest run; the rounds show how much the machine itself moved (a shared host's
memory bandwidth changes by minutes, and the n-gram's ratio with it: higher when memory is slow,
since the extra verification rows then hide behind the weight stream). Quantized
artifacts load in bf16 on CPU, where verification rows run through the kernels' AVX512-BF16 pair
path (`bench/kernels_cpu.py`'s pair table): what decides how much a 1 + k-row step costs here.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from spec import DATA, _recipe, copy_share, load_prompts  # noqa: E402  (the sibling bench)

from quantspec.errors import QuantSpecError  # noqa: E402
from quantspec.infer.predictor import InferConfig, Predictor  # noqa: E402


def _args(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bases", default="weight_only_int8,weight_only_int4",
                    help="quantized bases beside fp32: quant types, optionally @recipe as in bench/spec.py")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=0, help="code prompts [default: all]")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--draft-tokens", type=int, default=10)
    a = ap.parse_args(argv)
    if a.rounds < 1:
        raise SystemExit(f"--rounds {a.rounds}: give 1 or more")
    return a


def _bases(spec_list: str) -> dict:
    """name → model directory: fp32 and each quantized artifact (built once, cached)."""
    from quantspec import api
    from quantspec.model_zoo.default import DEFAULT_MODEL, cache_dir, ensure_zoo_model

    model_dir = ensure_zoo_model(DEFAULT_MODEL)
    bases = {"fp32": model_dir}
    for spec in [b for b in spec_list.split(",") if b]:
        quant_type, recipe = _recipe(spec)
        out = cache_dir() / "bench" / f"{DEFAULT_MODEL}.{spec.replace('@', '.')}"
        if not (out / "config.json").exists():
            try:
                api.quantize(str(model_dir), quant_type, out, overwrite=True, **recipe)
            except QuantSpecError as e:  # e.g. a8w8 without calibration data
                raise SystemExit(f"--bases {spec}: {e}") from None
        bases[spec] = out
    return bases


def _run(preds: dict, srcs: list[str], rounds: int) -> tuple[dict, dict, list[bool]]:
    """Every (base, method) on each prompt, interleaved, `rounds` times → ((seconds, tokens, ttft)
    of each one's fastest run per prompt, every round's seconds per prompt, the copy prompts)."""
    keys = [(b, m) for b in preds for m in preds[b]]
    runs = {k: [] for k in keys}  # (seconds, tokens, ttft) per prompt
    walls = {k: [] for k in keys}  # per prompt: seconds of each round
    tok = preds["fp32"]["plain"].tokenizer
    copy = []
    for i, src in enumerate(srcs):
        best = {}
        for k in keys:
            walls[k].append([])
        for _ in range(rounds):
            for b, m in keys:
                t = time.perf_counter()
                out = preds[b][m].generate([src])[0]
                dt = time.perf_counter() - t
                walls[b, m][i].append(dt)
                if (b, m) not in best or dt < best[b, m][0]:
                    best[b, m] = (dt, out)
        for b in preds:
            if best[b, "ngram"][1].token_ids != best[b, "plain"][1].token_ids:
                raise SystemExit(f"prompt {i}: the n-gram output on the {b} base differs from its plain greedy output")
            for m in ("plain", "ngram"):
                dt, out = best[b, m]
                runs[b, m].append((dt, len(out.token_ids), out.ttft_s))
        copy.append(copy_share(tok(src, add_special_tokens=False).input_ids, best["fp32", "plain"][1].token_ids) >= 0.5)
    return runs, walls, copy


def _row(b: str, label: str, keep, runs: dict, walls: dict, n_prompts: int, rounds: int) -> dict | None:
    sel = {m: [r for i, r in enumerate(runs[b, m]) if keep(i)] for m in ("plain", "ngram")}
    if not sel["plain"]:
        return None
    tps = {m: sum(r[1] for r in v) / sum(r[0] for r in v) for m, v in sel.items()}
    dec = {m: sum(r[1] - 1 for r in v) / sum(r[0] - r[2] for r in v) for m, v in sel.items()}
    pre = sum(r[2] for r in sel["plain"]) / sum(r[0] for r in sel["plain"])
    # each round alone: its plain and n-gram runs of the same prompts, minutes apart at most
    # (the outputs are equal, so the ratio of tokens/s is the ratio of the seconds)
    by_round = [sum(walls[b, "plain"][i][r] for i in range(n_prompts) if keep(i))
                / sum(walls[b, "ngram"][i][r] for i in range(n_prompts) if keep(i)) for r in range(rounds)]
    return {"base": b, "prompts": label, "plain_tps": tps["plain"], "ngram_tps": tps["ngram"],
            "ratio": tps["ngram"] / tps["plain"], "decode_ratio": dec["ngram"] / dec["plain"], "prefill_share": pre,
            "round_ratios": by_round}


def main(argv: list[str] | None = None) -> dict:
    a = _args(argv)
    torch.set_num_threads(a.threads)
    bases = _bases(a.bases)
    srcs = load_prompts(DATA, a.prompts)["code_edit"]
    preds = {}
    for name, d in bases.items():
        common = dict(model=str(d), max_new_tokens=a.new_tokens, max_length=1024, batch_size=1)
        plain = Predictor(InferConfig(**common))
        ngram = Predictor(InferConfig(**common, speculate_method="inference_with_reference",
                                      speculate_max_draft_token_num=a.draft_tokens), loaded=plain.loaded)
        plain.generate(["Hello"])  # warm-up
        preds[name] = {"plain": plain, "ngram": ngram}
    runs, walls, copy = _run(preds, srcs, a.rounds)
    print(f"\n## n-gram on quantized bases: {len(srcs)} code prompts ({sum(copy)} copy), {a.threads} threads, "
          f"best of {a.rounds} rounds, outputs identical to each base's plain greedy\n")
    print("| base | prompts | plain tok/s | n-gram tok/s | end to end | decode phase | prefill share | "
          "end to end by round |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    rows = []
    for b in bases:
        for label, keep in (("all code", lambda i: True), ("copy", lambda i: copy[i])):
            row = _row(b, label, keep, runs, walls, len(srcs), a.rounds)
            if row is None:
                continue
            rows.append(row)
            by_round = row["round_ratios"]
            spread = (f"{by_round[0]:.2f}x" if len(by_round) == 1
                      else f"{min(by_round):.2f}-{max(by_round):.2f}x (median {statistics.median(by_round):.2f}x)")
            print(f"| {b} | {label} | {row['plain_tps']:.1f} | {row['ngram_tps']:.1f} | {row['ratio']:.2f}x | "
                  f"{row['decode_ratio']:.2f}x | {row['prefill_share']:.0%} | {spread} |", flush=True)
    return {"rows": rows}


if __name__ == "__main__":
    main()
