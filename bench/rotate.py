"""Held-out perplexity of the default model quantized with and without rotations fused into its
weights (`quantize --rotate R1,R2`, SpinQuant's offline rotations), recipe by recipe, side by side.

Each recipe is quantized twice in the same run, plain then rotated (`--seed` 0), and evaluated
through the inference path (`api.evaluate`) on `bench/data/heldout.txt`. Δ is each row's
perplexity over the fp32 model's, minus one; the last column is the rotated Δ over the plain Δ
(below 1: the rotation removes that share of the quantization's loss). Recipes with static
scales read a table from `calibrate` of the same model (`--rotate R1,R2` for the rotated one), as
`quantize` requires; the `+kv8` rows add a static int8 KV cache from that table to the int8
weight-only artifact. Calibration data: `bench/data/calib.jsonl`.

    OMP_NUM_THREADS=2 python bench/rotate.py [--recipes int4-gptq,a8w8-dynamic] [--json out.json]

`--rotate R1,R2,R4` adds SpinQuant's R4 to the second arm (each down_proj's input turned at run
time, `--target vllm`; its table calibrated with the same `--rotate`). With `--quip v` (or `v,u`),
the second arm of each recipe is QuIP's run-time transforms (`quantize --quip`, `--target vllm`)
instead of the fused rotations. Recipes with static scales take no QuIP transform: they are left
out there, as `quantize` refuses them.

(`--model`, `--calib-data`, `--heldout`, `--seq-len` run it on another model and data.)
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

from mdtable import markdown_table

from quantspec import api

HERE = Path(__file__).parent
CALIB = HERE / "data" / "calib.jsonl"
STATIC = {"smoothquant_alpha": "none", "fallback_layers": 0}
# name → (quant_type, quantize options, needs the calibration table, evaluate's KV cache)
RECIPES = {
    "int4-rtn": ("weight_only_int4", {"group_size": 128}, False, "float"),
    "int4-gptq": ("weight_only_int4", {"group_size": 128, "method": "gptq", "dataset": None}, False, "float"),
    "int4-gptq-act-order": ("weight_only_int4", {"group_size": 128, "method": "gptq", "dataset": None,
                                                 "act_order": True}, False, "float"),
    "a8w4-dynamic": ("a8w4", {"group_size": 128, "target": "quantspec"}, False, "float"),
    "a8w8-dynamic": ("a8w8", {"activations": "dynamic"}, False, "float"),
    "a8w8_fp8-dynamic": ("a8w8_fp8", {"activations": "dynamic"}, False, "float"),
    "a8w8-static": ("a8w8", STATIC, True, "float"),
    "a8w8-static-default": ("a8w8", {}, True, "float"),
    "a8w8_fp8-static": ("a8w8_fp8", STATIC, True, "float"),
    "int8+kv8": ("weight_only_int8", {}, True, "int8"),
}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--recipes", default=",".join(RECIPES))
    p.add_argument("--heldout", default=str(HERE / "data" / "heldout.txt"))
    p.add_argument("--calib-data", default=str(CALIB), help="calibration texts (tables, GPTQ)")
    p.add_argument("--num-samples", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=512, help="calibration and evaluation windows")
    p.add_argument("--rotate", default="R1,R2", help="the second arm's --rotate (R1,R2,R4: R4 at run time too)")
    p.add_argument("--quip", default=None, help="compare with QuIP's transforms (v or v,u) instead of --rotate")
    p.add_argument("--quip-block-size", type=int, default=None)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    default = a.recipes == p.get_default("recipes")
    names = [n for n in a.recipes.split(",") if n and not (a.quip and default and RECIPES[n][2])]
    unknown = [n for n in names if n not in RECIPES]
    if unknown:
        p.error(f"unknown recipe(s) {unknown}; choose from {', '.join(RECIPES)}")
    if a.quip and any(RECIPES[n][2] for n in names):
        p.error("recipes with static scales (a table) take no QuIP transforms (--quip); choose others")
    work = Path(tempfile.mkdtemp(prefix="bench-rotate-"))
    try:
        out = _run(a, names, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    rows = [[n, f"{r['plain']['perplexity']:.3f}", f"{100 * r['plain']['delta']:+.1f}%",
             f"{r['rotated']['perplexity']:.3f}", f"{100 * r['rotated']['delta']:+.1f}%", f"{r['delta_ratio']:.2f}"]
            for n, r in out["recipes"].items()]
    print(f"\nfp32 perplexity {out['fp32_perplexity']:.3f} ({a.heldout})\n")
    arm = f"QuIP {a.quip}" if a.quip else a.rotate
    print(markdown_table(["recipe", "plain ppl", "plain Δ", f"{arm} ppl", f"{arm} Δ", "Δ ratio"], rows, "lrrrrr"))
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=2))
    return out


def _run(a, names: list[str], work: Path) -> dict:
    """Each recipe quantized plain then rotated, side by side in one run (module docstring)."""
    ev = dict(text_file=a.heldout, seq_len=a.seq_len)
    fp32 = api.evaluate(a.model, **ev)["perplexity"]
    tables, arm = {}, a.rotate
    if any(RECIPES[n][2] for n in names):
        for rot in (None, arm):
            tables[rot] = str(api.calibrate(a.model, a.calib_data, work / f"table-{rot}", num_samples=a.num_samples,
                                            seq_len=a.seq_len, dtype="float32", rotate=rot).path)
    out = {"model": a.model, "fp32_perplexity": fp32, "turned_by": f"quip {a.quip}" if a.quip else arm,
           "recipes": {}}
    for n in names:
        qt, opts, static, kv = RECIPES[n]
        opts = {k: (a.calib_data if k == "dataset" else v) for k, v in opts.items()}
        got = {}
        for rot in (None, arm):
            t0 = time.perf_counter()
            calib = {"calib": tables[rot]} if static and kv == "float" else {}
            vllm = {"target": opts.get("target", "vllm")}  # the run-time transforms' engines
            turn = {} if rot is None else {"quip": a.quip, "quip_block_size": a.quip_block_size, **vllm} if a.quip \
                else {"rotate": rot, **(vllm if "R4" in rot.upper() else {})}
            art = api.quantize(a.model, qt, work / f"{n}-{rot}", num_samples=a.num_samples, seq_len=a.seq_len,
                               **{**opts, **turn}, **calib)
            ppl = api.evaluate(str(art), kv_cache_dtype=kv, calib=tables[rot] if kv != "float" else None,
                               **ev)["perplexity"]
            got[rot] = {"perplexity": ppl, "delta": ppl / fp32 - 1, "quantize_s": round(time.perf_counter() - t0, 1)}
            shutil.rmtree(art, ignore_errors=True)
        out["recipes"][n] = {"plain": got[None], "rotated": got[arm],
                             "delta_ratio": got[arm]["delta"] / got[None]["delta"]}
        print(f"{n}: plain {got[None]['perplexity']:.3f}, rotated {got[arm]['perplexity']:.3f}", flush=True)
    return out


if __name__ == "__main__":
    main()
