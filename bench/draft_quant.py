"""Quantized EAGLE-3 heads against their float head, over thousands of positions: per draft depth,
the share of positions where the head's top-1 draft is the base's own greedy choice, teacher-forced
(depth d reads the text's tokens, as the training-time test unrolls the head: what greedy
verification accepts at that depth when the earlier drafts were right), on windows of held-out
text (`bench/data/heldout.txt`, which no head trains on). Finer than `bench/eagle_accept.py`'s
end-to-end acceptance on six prompts, which moves by a point or two with a single token.
A head quantized with `--kv-cache` reads its keys and values as its cache stores them (int8 / FP8
codes at its scales). Acceptance only (no timing): the figures do not depend on the machine's load.

    python bench/draft_quant.py --heads smol.eagle3/,smol.eagle3.w4/,smol.eagle3.w4gptq/ [--windows 16]

The held-out text gives 16 windows of 256 tokens.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from quantspec.infer.spec.eagle import load_eagle3_for_inference
from quantspec.model_zoo.checkpoint import load_model
from quantspec.model_zoo.eagle3_train import ttt_outputs
from quantspec.model_zoo.llama import DenseCausalAttention

HELDOUT = Path(__file__).with_name("data") / "heldout.txt"


def windows(model_dir: Path, n: int, seq_len: int) -> list[torch.Tensor]:
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(str(model_dir))(HELDOUT.read_text())["input_ids"]
    return [torch.tensor(ids[i:i + seq_len]) for i in range(0, len(ids) - seq_len + 1, seq_len)][:n]


@torch.no_grad()
def base_rows(base, wins: list[torch.Tensor], aux: tuple[int, ...]) -> list[tuple]:
    """Per window: (tokens [S], the aux layers' features [S, n·D], the base's choice after each
    position [S]), computed once for every head."""
    rows = []
    for ids in wins:
        S = ids.numel()
        hidden, streams = base(ids, torch.arange(S), DenseCausalAttention.of(base.args, 1, S), capture=aux)
        rows.append((ids, torch.cat(streams, dim=-1), base.compute_logits(hidden).argmax(-1)))
    return rows


@torch.no_grad()
def depth_accuracy(head, rows: list[tuple], depths: int) -> list[float]:
    """Per depth d: the share of rows whose top-1 draft is the base's argmax at that position."""
    hits, counted = [0] * depths, [0] * depths
    for ids, feats, nxt in rows:
        S = ids.numel()
        for d, out in enumerate(ttt_outputs(head, ids, feats, depths)):
            m = S - 2 - d  # row p drafts the token after position p + 1 + d
            draft = head.target_ids(head.logits(out[:m]).argmax(-1))
            hits[d] += int((draft == nxt[1 + d:1 + d + m]).sum())
            counted[d] += m
    return [h / r for h, r in zip(hits, counted)]


def main(argv: list[str] | None = None) -> list[list[float]]:
    """Print the table; → each head's per-depth agreement."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heads", required=True, help="EAGLE-3 head directories, the float one first (comma list)")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--windows", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--depths", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    base, model_dir = load_model(a.model)
    wins = windows(model_dir, a.windows, a.seq_len)
    print(f"{len(wins)} windows of {a.seq_len} tokens of {HELDOUT.name}; top-1 agreement with the base per depth "
          "(teacher-forced)\n")
    print("| head | " + " | ".join(f"depth {d + 1} (%)" for d in range(a.depths)) + " | vs the first head (points) |")
    print("|---|" + "---:|" * (a.depths + 1))
    heads = [load_eagle3_for_inference(path, base) for path in a.heads.split(",")]
    auxes = {tuple(h.args.aux_layers(base.args.num_layers)) for h in heads}
    if len(auxes) != 1:
        raise SystemExit(f"the heads read different aux layers {sorted(auxes)}; compare heads of one recipe")
    rows = base_rows(base, wins, auxes.pop())
    table = []
    for path, head in zip(a.heads.split(","), heads):
        acc = depth_accuracy(head, rows, a.depths)
        table.append(acc)
        delta = " ".join(f"{100 * (x - f):+.1f}" for x, f in zip(acc, table[0]))
        print(f"| {path} | " + " | ".join(f"{100 * x:.1f}" for x in acc) + f" | {delta} |", flush=True)
    return table


if __name__ == "__main__":
    main()
