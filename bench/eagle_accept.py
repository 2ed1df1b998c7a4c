"""Acceptance of EAGLE-3 heads on the default model: greedy, batch 1, no back-off and no
confidence gate (every step drafts every depth), a chain of 4 drafts and a 4x2 token tree per
head, each output checked against plain greedy decoding; mean accepted length = tokens emitted
after prefill per base forward (`predictor.summarize`).
Acceptance only (no timing): the figures do not depend on the machine's load.

    python bench/eagle_accept.py --heads DIR[,DIR...] [--prompts chat|train:N] [--new-tokens 96]

`--prompts chat`: the chat prompts of `bench/data/spec_prompts.jsonl` (not among the training
prompts); `train:N`: the last 4 of the first N built-in self-distillation prompts (a head trained
with `--chat-prompts N` has seen them).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from quantspec.infer.loader import load_for_inference
from quantspec.infer.predictor import InferConfig, Predictor, summarize

DATA = Path(__file__).with_name("data") / "spec_prompts.jsonl"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heads", required=True, help="EAGLE-3 head directories (comma list)")
    ap.add_argument("--prompts", default="chat")
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--trees", default="4x2", help="token trees besides the chain, DxK or dynamic DxK:N (comma list)")
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    if a.prompts.startswith("train:"):
        from quantspec.model_zoo.mtp_train import chat_prompts

        rows = chat_prompts(int(a.prompts.split(":")[1]))[-4:]
    else:
        rows = [r["src"] for r in map(json.loads, DATA.read_text().splitlines()) if r["kind"] == a.prompts]
    loaded = load_for_inference("smollm2-135m")
    common = dict(model="smollm2-135m", max_new_tokens=a.new_tokens, max_length=1024)
    plain = [o.token_ids for o in Predictor(InferConfig(**common), loaded=loaded).generate(rows)]
    print("| head | drafts | identical to plain | acceptance per depth (%) | mean accepted length |")
    print("|---|---|---|---|---:|")
    for head in a.heads.split(","):
        for tree in [None] + [t for t in a.trees.split(",") if t]:
            cfg = InferConfig(**common, speculate_method="eagle", draft_model=head, speculate_max_draft_token_num=4,
                              speculate_tree=tree, speculate_backoff=False,
                              speculate_min_confidence=0.0)
            p = Predictor(cfg, loaded=loaded)
            outs = p.generate(rows)
            s = summarize(outs, 1.0, cfg)
            per = " ".join(f"{100 * x:.0f}" for x in s["acceptance_per_position"])
            print(f"| {head} | {tree or 'chain 4'} | {[o.token_ids for o in outs] == plain} | {per} | "
                  f"{s['mean_accepted_length']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
