"""Speculative decoding on the default model: tokens/s with and without each method, acceptance,
acceptance per draft position, mean accepted length, and an equality check of the outputs against
plain greedy decoding of the same engine; one run, same machine, batch 1. "vs plain" is end to
end (prefill included: a ~130-token prompt's prefill costs ~10 decode steps); "decode phase"
is the speed after the first token, where speculation acts (TTFT is the same for every method).

    python bench/spec.py [--threads 1] [--new-tokens 128] [--prompts N] [--rounds R] [--methods ngram,self,quant,mtp]
                         [--quant weight_only_int8,weight_only_int4,weight_only_int4@gptq,...] [--draft-head int8|artifact]

Methods (rows), each on the code-editing prompts (the answer mostly repeats the prompt) and the
chat prompts of `bench/data/spec_prompts.jsonl`:
- plain:             no speculation (the baseline of every ratio);
- ngram:             `inference_with_reference` with the back-off policy;
- ngram-exact:       the same with exact suffix matches only (`ReferenceProposer.realign` off:
                     no realignment past an edit of the copied text); not in the default set;
- draft fp32 (self): the base model drafting for itself with its own head and the back-off OFF:
                     an upper bound on acceptance (100%), not a speed-up (the draft costs as much
                     as the base);
- draft <quant>:     the quantized artifact of the same model (built with `quantspec.api.quantize`,
                     RTN, cached; `weight_only_int4@gptq` = GPTQ g128 on bench/data/calib.jsonl
                     (~4 min once); `weight_only_int4@g32-asym-fzp` = group 32, asymmetric, float16
                     zero points, the grid the default model's weights were published on)
                     drafting for the fp32 model, with the back-off (its draft cost measured
                     at start-up), and again with the back-off off (acceptance at every
                     position, whatever it costs); scored by the int8 draft head (the
                     predictor's default; `--draft-head artifact`: the artifact's own head);
- mtp:               the MTP module trained by `quantspec zoo train-mtp` (cached under
                     ~/.cache/quantspec/mtp/), one draft per step, confidence gate 0.4 (the
                     predictor default for mtp), with and without the back-off; and the module
                     quantized on its own (`--mtp-quant`, default weight_only_int8, RTN, cached),
                     with the back-off.
- medusa:            Medusa heads (`--medusa DIR`, from `quantspec zoo train-draft-head --kind
                     medusa`) as a chain of the heads' top-1 tokens (`medusa chain N`, N =
                     `--medusa-chain`, default the number of tree rows) and as each token tree
                     of `--medusa-trees` (default 2x2,4x2: `medusa tree DxK`, D·K draft rows), so
                     trees and chains compare at equal verified rows; and the heads quantized on
                     their own (`--medusa-quant`, RTN, cached) with the first tree; with
                     `--medusa-min-confidence T` as eagle's `--eagle-min-confidence T`.
- eagle:             an EAGLE-3 head (`--eagle DIR`, from `quantspec zoo train-draft-head --kind
                     eagle3`) as a chain of `--eagle-chain` drafts (with the back-off) and as
                     each token tree of `--eagle-trees` (default 4x2), and quantized on its own
                     (`--eagle-quant`) with the first tree; with `--eagle-min-confidence T`,
                     the chain and the first tree again with drafting stopped at a top-1
                     probability below T. The base's forwards capture the head's aux features,
                     on the fused CPU stack as every other row's.
Methods run interleaved prompt by prompt, so load on a shared machine hits all of them alike;
with `--rounds R` each prompt runs R times through every method (interleaved) and each method
keeps its fastest run of the prompt (its TTFT too), which filters out interference that the
ratios of single runs show on a shared machine.

Copy share of an answer: the fraction of its tokens inside a run of >= 4 tokens that also occurs
in the prompt (measured on plain greedy output). The code-editing case is an answer that
mostly repeats the prompt; a small model sometimes answers an edit request with an explanation
instead, so the code prompts are also reported restricted to answers with copy share >= 50%
(`code_edit, copy>=50%`), next to the all-prompts row, and per prompt.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import torch

from quantspec.infer.predictor import InferConfig, Predictor, speculation_stats

DATA = Path(__file__).parent / "data" / "spec_prompts.jsonl"


COPY_RUN = 4  # tokens: a copied run at least this long counts towards the copy share


def load_prompts(path: str | Path, per_kind: int = 0) -> dict[str, list[str]]:
    """The jsonl's {kind, src} rows as kind → prompts, in file order; the first `per_kind` of each
    kind (0: all)."""
    kinds: dict[str, list[str]] = {}
    for line in Path(path).read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            kinds.setdefault(row["kind"], []).append(row["src"])
    return {k: v[: per_kind or None] for k, v in kinds.items()}


def copy_share(prompt_ids: list[int], answer_ids: list[int], n: int = COPY_RUN) -> float:
    """Fraction of answer tokens covered by an n-token window that also occurs in the prompt."""
    if not answer_ids:
        return 0.0
    grams = {tuple(prompt_ids[i:i + n]) for i in range(len(prompt_ids) - n + 1)}
    covered = [False] * len(answer_ids)
    for i in range(len(answer_ids) - n + 1):
        if tuple(answer_ids[i:i + n]) in grams:
            covered[i:i + n] = [True] * n
    return sum(covered) / len(answer_ids)


def _row(name, kind, outs, wall, plain_ids, plain_tps, plain_decode_tps):
    gen = sum(len(o.token_ids) for o in outs)
    decode_tps = _decode_tps(outs, wall)
    spec = speculation_stats(outs)
    tps = gen / wall
    return {
        "kind": kind, "method": name, "tokens": gen, "tokens_per_s": tps,
        "ratio": tps / plain_tps if plain_tps else 1.0,
        "decode_tokens_per_s": decode_tps, "decode_ratio": decode_tps / plain_decode_tps if plain_decode_tps else 1.0,
        "acceptance": spec["acceptance_rate"] if spec["drafted_tokens"] else None,
        "per_position": spec["acceptance_per_position"],
        "mean_accepted_length": spec["mean_accepted_length"] or None,
        "identical": [o.token_ids for o in outs] == plain_ids,
        "drafted": spec["drafted_tokens"],
    }


def _decode_tps(outs, wall: float) -> float:
    """Tokens after the first per second after the first: the decode phase, where speculation
    acts (every method runs the same prefill, so TTFT is the same for all of them)."""
    after_first = sum(max(0, len(o.token_ids) - 1) for o in outs)
    return after_first / max(1e-9, wall - sum(o.ttft_s for o in outs))


def _recipe(spec: str) -> tuple[str, dict]:
    """`weight_only_int4@g32-asym-fzp` → ("weight_only_int4", group_size=32, symmetric=False,
    zp_dtype="float16"); `@gptq`: GPTQ instead of RTN; a bare quant type → RTN with quantspec's
    defaults (int4: g128, sym, MSE-searched scales)."""
    quant_type, _, recipe = spec.partition("@")
    from quantspec.errors import QuantSpecError
    from quantspec.quant.args import QuantType

    try:
        QuantType.parse(quant_type)
    except QuantSpecError as e:
        raise SystemExit(f"{spec!r}: {e}") from None
    kw: dict = {}
    for part in filter(None, recipe.split("-")):
        if part.startswith("g") and part[1:].isdigit():
            kw["group_size"] = int(part[1:])
        elif part == "asym":
            kw["symmetric"] = False
        elif part == "fzp":  # float zero points: quantspec-only (no engine reads them)
            kw.update(zp_dtype="float16", target="quantspec")
        elif part == "gptq":  # as bench/quality.py: 64 x 512 tokens of bench/data/calib.jsonl, act-order
            kw.update(method="gptq", dataset=str(DATA.parent / "calib.jsonl"), num_samples=64, seq_len=512,
                      act_order=True)
        else:
            raise SystemExit(f"unknown recipe part {part!r} in {spec!r}; use g<N>, asym, fzp, gptq")
    return quant_type, kw


def _args():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prompts", type=int, default=0, help="prompts per kind [default: all]")
    ap.add_argument("--data", default=str(DATA), help="jsonl of {kind, src} prompts")
    ap.add_argument("--draft-tokens", type=int, default=5, help="--speculate-max-draft-token-num")
    ap.add_argument("--ngram-draft-tokens", type=int, default=10)
    ap.add_argument("--quant", default="weight_only_int8,weight_only_int4,weight_only_int4@gptq,"
                                       "weight_only_int4@g32-asym-fzp",
                    help="draft artifacts: quant types, optionally @recipe (g<N>, asym, fzp = float16 zero "
                         "points, gptq)")
    ap.add_argument("--draft-head", default="int8", choices=["int8", "artifact"],
                    help="--speculate-draft-head of the quantized drafts (the self-draft always uses its own head)")
    ap.add_argument("--methods", default="ngram,self,quant,mtp")
    ap.add_argument("--mtp", help="MTP module directory [default: the cached one of `zoo train-mtp`]")
    ap.add_argument("--mtp-quant", default="weight_only_int8",
                    help="also run the MTP module quantized to these types (comma list; '' for none)")
    ap.add_argument("--mtp-draft-tokens", type=int, default=1)
    ap.add_argument("--mtp-min-confidence", type=float, default=None,
                    help="--speculate-min-confidence for the mtp rows [default: the predictor's, 0.4]")
    ap.add_argument("--medusa", help="Medusa heads directory (`--methods medusa`)")
    ap.add_argument("--medusa-trees", default="2x2,4x2", help="token trees DxK of the medusa rows (comma list)")
    ap.add_argument("--medusa-chain", type=int, default=4, help="draft tokens of the medusa chain row")
    ap.add_argument("--medusa-quant", default="", help="also run the heads quantized to these types (comma list)")
    ap.add_argument("--medusa-min-confidence", default="",
                    help="also run the chain and the first tree with drafting stopped below these top-1 "
                         "probabilities (comma list; --speculate-min-confidence)")
    ap.add_argument("--eagle", help="EAGLE-3 head directory (`--methods eagle`)")
    ap.add_argument("--eagle-trees", default="4x2", help="token trees DxK of the eagle rows (comma list)")
    ap.add_argument("--eagle-chain", type=int, default=4, help="draft tokens of the eagle chain row")
    ap.add_argument("--eagle-quant", default="", help="also run the head quantized to these types (comma list)")
    ap.add_argument("--eagle-min-confidence", default="",
                    help="also run the chain and the first tree with drafting stopped below these top-1 "
                         "probabilities (comma list; --speculate-min-confidence)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="run every (prompt, method) this many times, interleaved, and keep the fastest "
                         "(on a shared machine the minimum filters out other work's interference)")
    ap.add_argument("--json", help="also write the rows here")
    a = ap.parse_args()
    if a.rounds < 1:
        raise SystemExit(f"--rounds {a.rounds}: give 1 or more")
    return a


def _draft_methods(a, common: dict, model_dir: Path, loaded, methods: dict) -> None:
    """The self-draft and the quantized drafts (`--methods self,quant`), into `methods`."""
    from quantspec.model_zoo.default import DEFAULT_MODEL, cache_dir

    wanted = a.methods.split(",")
    if "self" in wanted:
        p = Predictor(InferConfig(**common, speculate_method="draft", draft_model=str(model_dir),
                                  speculate_max_draft_token_num=a.draft_tokens, speculate_draft_head="artifact"),
                      loaded=loaded)
        p.engine.proposer.policy = None  # upper bound: always draft
        methods["draft fp32 (self, no back-off)"] = p
    if "quant" not in wanted:
        return
    from quantspec import api

    for qt in [q for q in a.quant.split(",") if q]:
        quant_type, recipe = _recipe(qt)
        out = cache_dir() / "bench" / f"{DEFAULT_MODEL}.{qt.replace('@', '.')}"
        if not (out / "config.json").exists():
            api.quantize(str(model_dir), quant_type, out, overwrite=True, **recipe)
        cfg = InferConfig(**common, speculate_method="draft", draft_model=str(out),
                          speculate_max_draft_token_num=a.draft_tokens, speculate_draft_head=a.draft_head)
        methods[f"draft {qt}"] = p = Predictor(cfg, loaded=loaded)
        print(f"{qt} draft: measured step cost {p.engine.proposer.policy.cost.draft_per_token:.2f}x the base's")
        p = methods[f"draft {qt} (no back-off)"] = Predictor(cfg, loaded=loaded)
        p.engine.proposer.policy = None  # acceptance of every position, whatever it costs


def _mtp_methods(a, common: dict, loaded, methods: dict) -> None:
    """The MTP module, plain and quantized on its own (`--methods mtp`), into `methods`."""
    from quantspec.model_zoo.default import DEFAULT_MODEL, cache_dir

    mtp_dir = Path(a.mtp).expanduser() if a.mtp else cache_dir() / "mtp" / DEFAULT_MODEL
    if not (mtp_dir / "config.json").is_file():
        raise SystemExit(f"no MTP module at {mtp_dir}; train one with `quantspec zoo train-mtp --out {mtp_dir}` "
                         "or pass --mtp DIR")
    cfg = InferConfig(**common, speculate_method="mtp", draft_model=str(mtp_dir),
                      speculate_max_draft_token_num=a.mtp_draft_tokens,
                      speculate_min_confidence=a.mtp_min_confidence)
    methods["mtp"] = Predictor(cfg, loaded=loaded)
    p = methods["mtp (no back-off)"] = Predictor(cfg, loaded=loaded)
    p.engine.proposer.policy = None
    for qt in [q for q in a.mtp_quant.split(",") if q]:
        # the MTP module quantized on its own (`quantspec quantize --model MTP_DIR`)
        from quantspec import api

        stamp = int((mtp_dir / "model.safetensors").stat().st_mtime)
        out = cache_dir() / "bench" / f"{mtp_dir.name}.mtp.{stamp}.{qt}"
        if not (out / "config.json").exists():
            api.quantize(str(mtp_dir), qt, out, overwrite=True, target="quantspec")
        methods[f"mtp {qt}"] = Predictor(dataclasses.replace(cfg, draft_model=str(out)), loaded=loaded)


def _head_methods(a, common: dict, loaded, methods: dict, kind: str) -> None:
    """Draft heads (`kind` medusa or eagle) as a chain and as token trees, plain and quantized on
    their own."""
    from quantspec import api
    from quantspec.paths import cache_dir

    train = {"medusa": "medusa", "eagle": "eagle3"}[kind]
    where = getattr(a, kind)
    if not where or not (Path(where).expanduser() / "config.json").is_file():
        raise SystemExit(f"--methods {kind} needs --{kind} DIR (from `quantspec zoo train-draft-head --kind {train}`)")
    heads = Path(where).expanduser()
    chain = getattr(a, f"{kind}_chain")
    cfg = InferConfig(**common, speculate_method=kind, draft_model=str(heads), speculate_max_draft_token_num=chain)
    methods[f"{kind} chain {chain}"] = Predictor(cfg, loaded=loaded)
    trees = [t for t in getattr(a, f"{kind}_trees").split(",") if t]
    for tree in trees:
        methods[f"{kind} tree {tree}"] = Predictor(dataclasses.replace(cfg, speculate_tree=tree), loaded=loaded)
    for tau in [float(t) for t in getattr(a, f"{kind}_min_confidence").split(",") if t]:
        methods[f"{kind} chain {chain}, confidence ≥ {tau}"] = Predictor(
            dataclasses.replace(cfg, speculate_min_confidence=tau), loaded=loaded)
        for tree in trees[:1]:
            methods[f"{kind} tree {tree}, confidence ≥ {tau}"] = Predictor(
                dataclasses.replace(cfg, speculate_tree=tree, speculate_min_confidence=tau), loaded=loaded)
    for qt in [q for q in getattr(a, f"{kind}_quant").split(",") if q]:
        stamp = int((heads / "model.safetensors").stat().st_mtime)
        out = cache_dir() / "bench" / f"{heads.name}.{kind}.{stamp}.{qt}"
        if not (out / "config.json").is_file():
            api.quantize(str(heads), qt, out, overwrite=True, target="quantspec")
        methods[f"{kind} {qt} tree {trees[0] if trees else 'chain'}"] = Predictor(
            dataclasses.replace(cfg, draft_model=str(out), speculate_tree=trees[0] if trees else None), loaded=loaded)


def _methods(a, model_dir: Path, loaded) -> dict:
    """name → Predictor of every method asked for, all over the one loaded base."""
    common = dict(model=str(model_dir), max_new_tokens=a.new_tokens, max_length=1024, batch_size=1)
    methods = {"plain": Predictor(InferConfig(**common), loaded=loaded)}
    wanted = a.methods.split(",")
    ngram_cfg = InferConfig(**common, speculate_method="inference_with_reference",
                            speculate_max_draft_token_num=a.ngram_draft_tokens)
    if "ngram" in wanted:
        methods["ngram"] = Predictor(ngram_cfg, loaded=loaded)
    if "ngram-exact" in wanted:  # the same without `ReferenceProposer.realign` (exact suffix matches only)
        p = methods["ngram, exact matches only"] = Predictor(ngram_cfg, loaded=loaded)
        p.engine.proposer.realign = False
    _draft_methods(a, common, model_dir, loaded, methods)
    if "mtp" in wanted:
        _mtp_methods(a, common, loaded, methods)
    for kind in ("medusa", "eagle"):
        if kind in wanted:
            _head_methods(a, common, loaded, methods, kind)
    return methods


def _fastest(methods: dict, srcs: list[str], rounds: int) -> tuple[dict, dict]:
    """Every method on each prompt, interleaved, `rounds` times; each keeps its fastest run →
    (outputs, wall seconds) per method, by prompt."""
    outs = {m: [] for m in methods}
    wall = {m: [] for m in methods}
    for src in srcs:  # interleaved: every method on this prompt, then the next prompt
        best = {}
        for _ in range(rounds):  # ... `rounds` times; each keeps its fastest run
            for name, pred in methods.items():
                t = time.perf_counter()
                out = pred.generate([src])[0]
                dt = time.perf_counter() - t
                if name in best and out.token_ids != best[name][0].token_ids:
                    raise SystemExit(f"{name}: two rounds of the same greedy prompt gave different outputs")
                if name not in best or dt < best[name][1]:
                    best[name] = (out, dt)
        for name in methods:
            outs[name].append(best[name][0])
            wall[name].append(best[name][1])
    return outs, wall


def _measure(methods: dict, kinds: dict, rounds: int) -> tuple[list, list]:
    """→ (a row per prompt subset and method, code_edit's per-prompt speed ratios)."""
    results, per_prompt = [], []
    tok = methods["plain"].tokenizer
    for kind, srcs in kinds.items():
        outs, wall = _fastest(methods, srcs, rounds)
        shares = [copy_share(tok(src, add_special_tokens=False).input_ids, o.token_ids)
                  for src, o in zip(srcs, outs["plain"])]
        subsets = [(kind, list(range(len(srcs))))]
        if kind == "code_edit":
            subsets.append((f"{kind}, copy>=50%", [i for i, c in enumerate(shares) if c >= 0.5]))
            for i, c in enumerate(shares):
                per_prompt.append((i, c, len(outs["plain"][i].token_ids),
                                   {m: wall["plain"][i] / wall[m][i] for m in methods if m != "plain"}))
        for label, idx in subsets:
            if not idx:
                continue
            plain_ids = [outs["plain"][i].token_ids for i in idx]
            plain_wall = sum(wall["plain"][i] for i in idx)
            plain_tps = sum(len(x) for x in plain_ids) / plain_wall
            plain_decode = _decode_tps([outs["plain"][i] for i in idx], plain_wall)
            for name in methods:
                results.append(_row(name, label, [outs[name][i] for i in idx], sum(wall[name][i] for i in idx),
                                    plain_ids, plain_tps, plain_decode))
    return results, per_prompt


def _print(a, results: list, per_prompt: list) -> None:
    from quantspec.model_zoo.default import DEFAULT_MODEL

    print(f"\n## speculative decoding, {DEFAULT_MODEL} fp32 base, batch 1, {a.new_tokens} new tokens, "
          f"{torch.get_num_threads()} thread(s), greedy, fastest of {a.rounds} round(s)\n")
    print("| prompts | method | tok/s | vs plain | decode phase vs plain | identical | acceptance | per position | "
          "mean accepted length |")
    print("|---|---|---:|---:|---:|:---:|---:|---|---:|")
    for r in results:
        acc = "-" if r["acceptance"] is None else f"{100 * r['acceptance']:.1f}%"
        pos = " ".join(f"{100 * x:.0f}" for x in r["per_position"]) or "-"
        mal = "-" if r["mean_accepted_length"] is None or r["method"] == "plain" else f"{r['mean_accepted_length']:.2f}"
        print(f"| {r['kind']} | {r['method']} | {r['tokens_per_s']:.1f} | {r['ratio']:.2f}x | {r['decode_ratio']:.2f}x | "
              f"{'yes' if r['identical'] else 'NO'} | {acc} | {pos} | {mal} |")
    if per_prompt:
        names = list(per_prompt[0][3])
        print("\ncode_edit per prompt (speed vs plain):\n")
        print("| # | copy share | tokens | " + " | ".join(names) + " |")
        print("|---:|---:|---:|" + "---:|" * len(names))
        for i, c, n, ratios in per_prompt:
            print(f"| {i} | {100 * c:.0f}% | {n} | " + " | ".join(f"{ratios[m]:.2f}x" for m in names) + " |")


def main():
    a = _args()
    torch.set_num_threads(a.threads)

    from quantspec.infer.loader import load_for_inference
    from quantspec.model_zoo.default import DEFAULT_MODEL, ensure_zoo_model

    model_dir = ensure_zoo_model(DEFAULT_MODEL)
    loaded = load_for_inference(model_dir)
    kinds = load_prompts(a.data, a.prompts)
    methods = _methods(a, model_dir, loaded)
    methods["plain"].generate(["Hello"])  # warm-up
    results, per_prompt = _measure(methods, kinds, a.rounds)
    _print(a, results, per_prompt)
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
