"""Held-out perplexity of the default model under each weight-only scheme, side by side.

Rows: fp32, weight_only_int8 RTN (and GPTQ) per channel and in groups of 128 (llm-compressor's W8A16), weight_only_int4 RTN, GPTQ (act-order, static
groups; one g64 row without act-order), AWQ and AWQ + GPTQ (act-order) at group 128 (→ 64 on SmolLM2's K = 576 layers) / 64 / 32, AutoRound
(its defaults, and auto-round's light recipe of 50 steps), and `--asym --group-size 32` RTN sanity rows (the default model's
weights came from a 4-bit group-32 asymmetric GGUF Q4_1, w = d·q + m with a float min m, so the
float-zero-point row `--zp-dtype float16` should nearly reproduce them; integer zero points cannot).
int4 rows use the default weight observer (mse: each scale's range clipped to its best fit); the
`-minmax` rows take plain min/max scales for comparison; the `-down8` rows keep down_proj at int8
and the `-head8` / `-head4` rows quantize the output head too, the `-emb8` / `-emb4` rows the input
embedding too (`--layer-quant-type`; the embedding rows for `--target vllm`, the engine that loads them);
the `w4a8-` / `w4afp8-` rows quantize the inputs per token at run time too (int8 / FP8).
Each row quantizes with `api.quantize` (wall time measured around it), evaluates with
`api.evaluate` (the inference path) on `bench/data/heldout.txt`, and reports size on disk.
Calibration (GPTQ, AWQ, AutoRound) uses `bench/data/calib.jsonl`: 80 texts (≈ 35k tokens) sampled from the default
model itself (temperature 0.8, top-p 0.95) on 80 varied topics, disjoint from the held-out prose,
which was written by hand. (Calibrating on the Python language reference instead — code-heavy,
another domain — made GPTQ better than RTN on that domain but worse on the held-out prose.)

`--kld` scores each artifact against the fp32 model too (`eval --reference`): the mean KL divergence of
the next-token distributions per token (nats) and the share of tokens whose top-1 choice is the fp32 model's.

    OMP_NUM_THREADS=2 python bench/quality.py [--rows fp32,int8,gptq-g64] [--kld] [--markdown out.md]
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import torch

from mdtable import markdown_table

from quantspec import api

HERE = Path(__file__).parent
DOWN_INT8 = r"re:.*mlp\.down_proj$=weight_only_int8"
HEAD_INT8 = "lm_head=weight_only_int8"
HEAD_INT4 = "lm_head=weight_only_int4"
EMB_INT8 = "model.embed_tokens=weight_only_int8"
EMB_INT4 = "model.embed_tokens=weight_only_int4"
ROWS = {
    # name: (quant_type, method, group_size, symmetric, act_order[, zp_dtype[, observer[, layer quant types]]])
    "fp32": None,
    "int8-rtn": ("weight_only_int8", "rtn", None, True, False),
    "int8-gptq": ("weight_only_int8", "gptq", None, True, True),
    "int8-rtn-g128": ("weight_only_int8", "rtn", 128, True, False),  # llm-compressor's W8A16 layout
    "int8-gptq-g128": ("weight_only_int8", "gptq", 128, True, True),
    "int4-rtn-g128": ("weight_only_int4", "rtn", 128, True, False),
    "int4-rtn-g64": ("weight_only_int4", "rtn", 64, True, False),
    "int4-rtn-g32": ("weight_only_int4", "rtn", 32, True, False),
    "int4-gptq-g128": ("weight_only_int4", "gptq", 128, True, True),
    "int4-gptq-g64": ("weight_only_int4", "gptq", 64, True, True),
    "int4-gptq-g32": ("weight_only_int4", "gptq", 32, True, True),
    "int4-gptq-g64-noact": ("weight_only_int4", "gptq", 64, True, False),
    "int4-awq-g128": ("weight_only_int4", "awq", 128, True, False),
    "int4-awq-g64": ("weight_only_int4", "awq", 64, True, False),
    "int4-awq-g64-duo-false": ("weight_only_int4", "awq", 64, True, False),  # --awq-duo-scaling false
    "int4-awq-g64-duo-both": ("weight_only_int4", "awq", 64, True, False),  # --awq-duo-scaling both
    "int4-awq-g32": ("weight_only_int4", "awq", 32, True, False),
    "int4-awq-gptq-g128": ("weight_only_int4", "awq+gptq", 128, True, True),
    "int4-awq-gptq-g64": ("weight_only_int4", "awq+gptq", 64, True, True),
    "int4-awq-gptq-g32": ("weight_only_int4", "awq+gptq", 32, True, True),
    "int4-rtn-asym-g32": ("weight_only_int4", "rtn", 32, False, False),
    "int4-rtn-asym-g32-fzp": ("weight_only_int4", "rtn", 32, False, False, "float16"),
    # int4 defaults to the MSE weight observer; these rows take plain min/max scales
    "int4-rtn-g64-minmax": ("weight_only_int4", "rtn", 64, True, False, None, "minmax"),
    "int4-gptq-g64-minmax": ("weight_only_int4", "gptq", 64, True, True, None, "minmax"),
    "int4-awq-g64-minmax": ("weight_only_int4", "awq", 64, True, False, None, "minmax"),
    # mixed precision (`--layer-quant-type`): int8 down_proj beside int4 elsewhere
    "int4-rtn-g64-down8": ("weight_only_int4", "rtn", 64, True, False, None, None, (DOWN_INT8,)),
    "int4-gptq-g64-down8": ("weight_only_int4", "gptq", 64, True, True, None, None, (DOWN_INT8,)),
    # a quantized output head (untied from the embedding, which stays float; GPTQ on the last
    # layer's normed outputs where the method is GPTQ)
    "int4-rtn-g64-head8": ("weight_only_int4", "rtn", 64, True, False, None, None, (HEAD_INT8,)),
    "int4-gptq-g64-head8": ("weight_only_int4", "gptq", 64, True, True, None, None, (HEAD_INT8,)),
    "int4-rtn-g64-head4": ("weight_only_int4", "rtn", 64, True, False, None, None, (HEAD_INT4,)),
    "int4-gptq-g64-head4": ("weight_only_int4", "gptq", 64, True, True, None, None, (HEAD_INT4,)),
    "int8-rtn-head8": ("weight_only_int8", "rtn", None, True, False, None, None, (HEAD_INT8,)),
    # ... and a quantized input embedding (rows rounded to nearest under every method)
    "int4-rtn-g64-head8-emb8": ("weight_only_int4", "rtn", 64, True, False, None, None, (HEAD_INT8, EMB_INT8)),
    "int4-rtn-g64-head8-emb4": ("weight_only_int4", "rtn", 64, True, False, None, None, (HEAD_INT8, EMB_INT4)),
    "int4-gptq-g64-head8-emb4": ("weight_only_int4", "gptq", 64, True, True, None, None, (HEAD_INT8, EMB_INT4)),
    "int8-rtn-head8-emb8": ("weight_only_int8", "rtn", None, True, False, None, None, (HEAD_INT8, EMB_INT8)),
    # int4 weights with inputs quantized per token at run time: int8 (a8w4, W4A8) and FP8 (a8w4_fp8, W4AFP8)
    "w4a8-rtn-g64": ("a8w4", "rtn", 64, True, False),
    "w4a8-gptq-g64": ("a8w4", "gptq", 64, True, True),
    "w4afp8-rtn-g64": ("a8w4_fp8", "rtn", 64, True, False),
    "w4afp8-gptq-g64": ("a8w4_fp8", "gptq", 64, True, True),
    "w4a8-awq-gptq-g64": ("a8w4", "awq+gptq", 64, True, True),
    "w4afp8-awq-gptq-g64": ("a8w4_fp8", "awq+gptq", 64, True, True),
    # AutoRound: its defaults (200 steps of 8 samples
    # per layer), and auto-round's light recipe (50 steps, lr 5e-3)
    "int4-autoround-g64": ("weight_only_int4", "autoround", 64, True, False),
    "int4-autoround-light-g64": ("weight_only_int4", "autoround", 64, True, False),
    "int4-autoround-light-g128": ("weight_only_int4", "autoround", 128, True, False),
    "int4-autoround-light-asym-g32": ("weight_only_int4", "autoround", 32, False, False),
}
# options beside a row's spec
ROW_OPTIONS = {name: dict(iters=50, lr=5e-3) for name in ROWS if "-autoround-light-" in name} | {
    name: dict(awq_duo_scaling=name.rsplit("-", 1)[1]) for name in ROWS if "-duo-" in name}


def _target(quant_type: str, zp_dtype: str | None, layers: tuple) -> str:
    """The --target a row's artifact is written for: quantspec for float zero points and the W4A8
    types (engines set their inputs aside or refuse them on the default model's shapes), vLLM
    for a quantized embedding, else portable."""
    if zp_dtype or quant_type.startswith("a8w4"):
        return "quantspec"
    return "vllm" if EMB_INT8 in layers or EMB_INT4 in layers else "portable"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--heldout", default=str(HERE / "data" / "heldout.txt"))
    p.add_argument("--calib", default=str(HERE / "data" / "calib.jsonl"))
    p.add_argument("--num-samples", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--eval-seq-len", type=int, default=512)
    p.add_argument("--rows", default=",".join(ROWS), help="comma-separated subset of: " + ", ".join(ROWS))
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--markdown", default=None, help="also write the table to this file")
    p.add_argument("--json", default=None, help="also write the raw results to this file")
    p.add_argument("--kld", action="store_true",
                   help="score each artifact against --model too: KL divergence and top-1 agreement per token")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    rows = a.rows.split(",")
    unknown = [r for r in rows if r not in ROWS]
    if unknown:
        p.error(f"unknown row(s) {unknown}; choose from {list(ROWS)}")

    work = Path(tempfile.mkdtemp(prefix="quantspec-quality-"))
    results = []
    try:
        for name in rows:
            spec = ROWS[name]
            q_time, size, path = None, None, a.model
            if spec is not None:
                qt, method, g, sym, act_order, *extra = spec
                zp, observer, layers = list(extra) + [None, None, ()][len(extra):]
                path = work / name
                t0 = time.perf_counter()
                api.quantize(a.model, qt, path, method=method, group_size=g, symmetric=sym,
                             zp_dtype=zp, weight_observer=observer, act_order=act_order, layer_quant_types=layers,
                             target=_target(qt, zp, layers),
                             dataset=a.calib if method != "rtn" else None,
                             num_samples=a.num_samples, seq_len=a.seq_len, **ROW_OPTIONS.get(name, {}))
                q_time = time.perf_counter() - t0
                info = api.inspect(path)
                size = info["weights_bytes"]
                groups = sorted({(d["group_size"] or -1) for d in info["layers"].values()})
            else:
                info = api.inspect(path)
                size, groups = info["weights_bytes"], []
            ev = api.evaluate(path, text_file=a.heldout, seq_len=a.eval_seq_len,
                              reference=a.model if a.kld and spec is not None else None)
            results.append({"row": name, "ppl": ev["perplexity"], "tokens": ev["num_tokens"],
                            "quantize_s": q_time, "size_bytes": size, "groups": groups,
                            "kld_mean": ev.get("kld_mean"), "top1_agreement": ev.get("top1_agreement")})
            print(json.dumps(results[-1]), flush=True)
            if spec is not None:
                shutil.rmtree(path, ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    base = next((r["ppl"] for r in results if r["row"] == "fp32"), None)
    cells = []
    for r in results:
        delta = "" if base is None or r["row"] == "fp32" else f"{100 * (r['ppl'] / base - 1):+.2f}%"
        qs = "" if r["quantize_s"] is None else f"{r['quantize_s']:.1f}"
        kld = [] if not a.kld else ["" if r["kld_mean"] is None else f"{r['kld_mean']:.4f}",
                                    "" if r["kld_mean"] is None else f"{100 * r['top1_agreement']:.1f}%"]
        cells.append([r["row"], ",".join(map(str, r["groups"])) or "-", f"{r['ppl']:.3f}", delta, *kld, qs,
                      f"{r['size_bytes'] / 2**20:.1f}"])
    table = (f"held-out perplexity, {a.model}, {results[0]['tokens']} predicted tokens "
             f"(seq_len {a.eval_seq_len}); GPTQ and AWQ on {a.num_samples} × {a.seq_len} calibration tokens; "
             f"{a.threads} thread(s)\n\n" +
             markdown_table(["scheme", "group sizes used", "ppl", "Δ vs fp32",
                             *(["KL div. vs fp32", "top-1 agreement"] if a.kld else []), "quantize s", "size MiB"],
                            cells, "llrr" + "rr" * a.kld + "rr"))
    print(table)
    if a.markdown:
        Path(a.markdown).write_text(table + "\n")
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
