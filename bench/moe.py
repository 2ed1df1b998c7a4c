"""Mixture-of-experts decode speed: quantspec's engine vs transformers `generate` on a random-weight
MoE model (Qwen3-MoE or Mixtral shape), one run, same prompt; prints tokens/s and the ratios.

    python bench/moe.py [--arch qwen3_moe] [--hidden 512] [--layers 4] [--experts 16] [--top-k 4]
                        [--expert-intermediate 256] [--new-tokens 64] [--quant int8,int4] [--rounds 3]

The model is built with `model_zoo.tiny.build_tiny_model` (transformers' own classes, random
weights scaled so that decoding is not degenerate) into a temporary directory, quantized with
RTN (`quantspec.api.quantize`) for each `--quant` type; transformers fp32, quantspec fp32 and each
artifact decode the same prompt at batch 1, interleaved `--rounds` times; the medians are compared.
The last column says whether quantspec's fp32 tokens are transformers' greedy tokens (they must be).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode import bench_engine, bench_hf  # noqa: E402  (the sibling bench)
from mdtable import markdown_table  # noqa: E402

QUANTS = {"int8": "weight_only_int8", "int4": "weight_only_int4"}


def build(args, root: Path) -> Path:
    from quantspec.model_zoo.tiny import build_tiny_model

    moe = {"num_experts_per_tok": args.top_k, ("num_local_experts" if args.arch == "mixtral" else "num_experts"):
           args.experts}
    if args.arch != "mixtral":
        moe["moe_intermediate_size"] = args.expert_intermediate
    return build_tiny_model(root / args.arch, args.arch, num_layers=args.layers, hidden=args.hidden,
                            heads=args.hidden // 64, kv_heads=max(1, args.hidden // 256),
                            intermediate=args.expert_intermediate if args.arch == "mixtral" else 4 * args.hidden,
                            moe=moe)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", default="qwen3_moe", choices=["qwen3_moe", "qwen2_moe", "mixtral"])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--expert-intermediate", type=int, default=256)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--quant", default="int8,int4", help="comma list of int8, int4")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    a = ap.parse_args(argv)
    if a.rounds < 1 or a.new_tokens < 1 or a.prompt_tokens < 1:
        ap.error(f"--rounds {a.rounds}, --new-tokens {a.new_tokens}, --prompt-tokens {a.prompt_tokens}: each must be >= 1")
    if a.hidden < 64 or a.hidden % 64 or not 1 <= a.top_k <= a.experts:
        ap.error(f"--hidden {a.hidden} must be a multiple of 64 (heads of 64) and --top-k {a.top_k} in 1..--experts")
    if a.threads:
        torch.set_num_threads(a.threads)
    from transformers import AutoModelForCausalLM

    from quantspec import api
    from quantspec.infer.loader import load_for_inference

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build(a, Path(tmp))
        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        runs = {"fp32": load_for_inference(model_dir)}
        prompt = list(range(3, 3 + a.prompt_tokens))
        for q in [q for q in a.quant.split(",") if q]:
            art = api.quantize(str(model_dir), QUANTS.get(q, q), Path(tmp) / q, group_size=64)
            runs[q] = load_for_inference(art)
        times = {"transformers fp32": [], **{f"quantspec {k}": [] for k in runs}}
        outputs: list = []
        for _ in range(a.rounds):
            times["transformers fp32"].append(bench_hf(hf, prompt, a.new_tokens, 1))
            for k, loaded in runs.items():
                times[f"quantspec {k}"].append(bench_engine(loaded, prompt, a.new_tokens, 1,
                                                            outputs if k == "fp32" else None)[0])
        with torch.inference_mode():
            want = hf.generate(torch.tensor([prompt]), max_new_tokens=a.new_tokens, min_new_tokens=a.new_tokens,
                               do_sample=False, pad_token_id=0)[0, len(prompt):].tolist()
    same = outputs[0][0] == want
    base = statistics.median(times["transformers fp32"])
    rows = [[name, f"{statistics.median(t):.1f}", f"{statistics.median(t) / base:.2f}x"] for name, t in times.items()]
    print(f"{a.arch}: hidden {a.hidden}, {a.layers} layers, {a.experts} experts (top {a.top_k}, intermediate "
          f"{a.expert_intermediate}), batch 1, {a.new_tokens} new tokens, median of {a.rounds} interleaved rounds")
    print(markdown_table(["run", "tokens/s", "vs transformers fp32"], rows, "lrr"))
    print(f"quantspec fp32 greedy tokens == transformers': {same}")
    return {"times": times, "same": same}


if __name__ == "__main__":
    main()
