"""Held-out perplexity of the default model with STATIC scales: a8w8 (± SmoothQuant), a8w8_fp8,
and a static int8 / fp8 KV cache on top of fp32 and of each, plus the calibration wall time.

One `quantspec calibrate` run (its wall and CPU time are reported) feeds every row: the a8w8 /
a8w8_fp8 artifacts are made with `api.quantize(..., calib=TABLE)` and the KV-cache rows read the
same table's per-head K/V scales (`api.evaluate(kv_cache_dtype=..., calib=TABLE)`). Perplexity is
measured through the inference path (`api.evaluate`) on `bench/data/heldout.txt`; Δ is relative
to the fp32 row of the same run. `static_rows()` is importable (bench/quality.py can append its
rows to its own table).

Row suffixes: `-dynamic` `quantize --quant-type T --activations dynamic` (per-token input scales
at run time: no table; a8w4 / a8w4_fp8 take no other); `-dynamic-sqA` the same with SmoothQuant at
a fixed α A from the table's channel ranges (`--smoothquant-alpha A --calib TABLE`); `-block128` `quantize --quant-type a8w8_fp8 --weight-block 128` (FP8_BLOCK:
one weight scale per block, shrunk per layer to one that tiles it, inputs per token and group at
run time; for weight_only_fp8 the same weights with float inputs, `--target vllm`); `weight_only_fp8`:
a8w8_fp8's per-channel weights with float inputs (W8A16 FP8, no table); `weight_only_nvfp4` / `nvfp4-default`: NVFP4 weights (E2M1, FP8 scales per group of 16
under a global scale), with float inputs / with NVFP4 inputs under the table's global scales;
`weight_only_mxfp4` / `mxfp4` (`weight_only_mxfp8` / `mxfp8`): MXFP4 (MXFP8) weights (E2M1
(E4M3), power-of-two scales per group of 32), with float inputs / with MXFP4 (MXFP8) inputs
quantized at run time; `a8w4_mxfp4`: MXFP4 weights with FP8 inputs per token and group of 128 (64
where 128 does not tile K) at run time (no table; written for `--target quantspec`:
the row measures the numbers, `docs/engines.md` says which engine loads them);
`-tensor` `--weight-strategy tensor` (one FP8 weight scale per Linear, shared by a fused unit's
shards: compressed-tensors' FP8 scheme); `-default` `quantize --quant-type T --calib TABLE` with no other flag (α searched per
smoothing group, the fallback units chosen under the default error budget on held-back windows of
the table's data; `calib/budget.py`); `-gptq` the weights quantized with GPTQ (act-order, on the
calibration data, after smoothing) instead of round-to-nearest; `-sq` fixed SmoothQuant α;
`-awq` / `-awq+gptq` AWQ's activation-aware factors folded in before
rounding to nearest / before GPTQ (act-order); `-sqauto` α searched per smoothing group (`smoothquant_alpha="auto"`); `-fb` the `--fallback`
fused units with the largest measured static-activation error kept at float activations (W8A16 /
FP8 weight-only; `calib/static_plan.py`); rows without `-sq` / `-fb` pass
`smoothquant_alpha="none"` / `fallback_layers=0`. The fallback layers are listed in the JSON
output. K/V scales use calibrate's default K/V observer (mse).

Calibration data: `bench/data/calib.jsonl` when present, else `--calib-data pydoc` builds a
jsonl from Python's own `pydoc_data.topics` (always installed, so the run is reproducible).

    OMP_NUM_THREADS=2 python bench/quality_static.py [--rows fp32,a8w8-sq,...] [--json out.json]
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
FALLBACK = 8  # fused units of the "-fb" rows (--fallback); 8 of 120 units on SmolLM2
DEFAULT = "default"  # the quantize default for this setting (no flag passed)
DYNAMIC = "dynamic"  # in the alpha column: `--activations dynamic` (per-token scales, no table, no smoothing)
BLOCK = "block128"  # in the alpha column: `--weight-block 128` (FP8_BLOCK: per-group dynamic inputs, no table)
PLAIN = "plain"  # in the alpha column: no flag and no table (weight_only_nvfp4, the MXFP4 types)
# name: (quant_type or None for fp32, smoothquant alpha ("auto" = searched per group, None = off),
#        kv cache "int8" / "fp8" / None, fallback units (W8A16, measured-worst first; "fb" =
#        the --fallback count)[, method])
ROWS = {
    "fp32": (None, None, None, 0),
    "a8w8-default": ("a8w8", DEFAULT, None, DEFAULT),
    "a8w8-default-gptq": ("a8w8", DEFAULT, None, DEFAULT, "gptq"),
    "a8w8_fp8-default": ("a8w8_fp8", DEFAULT, None, DEFAULT),
    "a8w8_fp8-default-gptq": ("a8w8_fp8", DEFAULT, None, DEFAULT, "gptq"),
    "a8w8-dynamic": ("a8w8", DYNAMIC, None, DEFAULT),
    "a8w8_fp8-dynamic": ("a8w8_fp8", DYNAMIC, None, DEFAULT),
    "a8w8_fp8-block128": ("a8w8_fp8", BLOCK, None, DEFAULT),
    "weight_only_fp8": ("weight_only_fp8", PLAIN, None, DEFAULT),
    "weight_only_fp8-gptq": ("weight_only_fp8", PLAIN, None, DEFAULT, "gptq"),
    "a8w8_fp8-dynamic-gptq": ("a8w8_fp8", DYNAMIC, None, DEFAULT, "gptq"),
    "weight_only_fp8-block128": ("weight_only_fp8", BLOCK, None, DEFAULT),
    "a8w8_fp8-block128-gptq": ("a8w8_fp8", BLOCK, None, DEFAULT, "gptq"),
    "weight_only_fp8-block128-gptq": ("weight_only_fp8", BLOCK, None, DEFAULT, "gptq"),
    # inputs per token at run time, SmoothQuant at a fixed α from the table's channel ranges
    # one FP8 weight scale per Linear (`--weight-strategy tensor`: compressed-tensors' FP8 scheme; with
    # no SmoothQuant, no fallback and an FP8 KV cache, llm-compressor's FP8 KV-cache example)
    "a8w8_fp8-tensor": ("a8w8_fp8", None, None, 0),
    "a8w8_fp8-tensor+kv-fp8": ("a8w8_fp8", None, "fp8", 0),
    "a8w8_fp8-default-tensor": ("a8w8_fp8", DEFAULT, None, DEFAULT),
    "a8w8_fp8-dynamic-tensor": ("a8w8_fp8", DYNAMIC, None, DEFAULT),
    "weight_only_fp8-tensor": ("weight_only_fp8", PLAIN, None, DEFAULT),
    "weight_only_fp8-gptq-tensor": ("weight_only_fp8", PLAIN, None, DEFAULT, "gptq"),
    "a8w8-dynamic-sq0.5": ("a8w8", (DYNAMIC, 0.5), None, DEFAULT),
    "a8w8-dynamic-sq0.8": ("a8w8", (DYNAMIC, 0.8), None, DEFAULT),
    "a8w4-dynamic": ("a8w4", DYNAMIC, None, DEFAULT),
    "a8w4-dynamic-sq0.5": ("a8w4", (DYNAMIC, 0.5), None, DEFAULT),
    "a8w4-dynamic-sq0.8": ("a8w4", (DYNAMIC, 0.8), None, DEFAULT),
    "a8w4-dynamic-sq0.5-gptq": ("a8w4", (DYNAMIC, 0.5), None, DEFAULT, "gptq"),
    "a8w4_fp8-dynamic": ("a8w4_fp8", DYNAMIC, None, DEFAULT),
    "a8w4_fp8-dynamic-sq0.5": ("a8w4_fp8", (DYNAMIC, 0.5), None, DEFAULT),
    "weight_only_nvfp4": ("weight_only_nvfp4", PLAIN, None, DEFAULT),
    "weight_only_nvfp4-gptq": ("weight_only_nvfp4", PLAIN, None, DEFAULT, "gptq"),
    "weight_only_nvfp4-awq": ("weight_only_nvfp4", PLAIN, None, DEFAULT, "awq"),
    "weight_only_nvfp4-awq+gptq": ("weight_only_nvfp4", PLAIN, None, DEFAULT, "awq+gptq"),
    "nvfp4-default": ("nvfp4", DEFAULT, None, DEFAULT),
    "nvfp4-default-gptq": ("nvfp4", DEFAULT, None, DEFAULT, "gptq"),
    "weight_only_mxfp4": ("weight_only_mxfp4", PLAIN, None, DEFAULT),
    "weight_only_mxfp4-gptq": ("weight_only_mxfp4", PLAIN, None, DEFAULT, "gptq"),
    "weight_only_mxfp4-awq": ("weight_only_mxfp4", PLAIN, None, DEFAULT, "awq"),
    "weight_only_mxfp4-awq+gptq": ("weight_only_mxfp4", PLAIN, None, DEFAULT, "awq+gptq"),
    "mxfp4": ("mxfp4", PLAIN, None, DEFAULT),
    "mxfp4-gptq": ("mxfp4", PLAIN, None, DEFAULT, "gptq"),
    "a8w4_mxfp4": ("a8w4_mxfp4", PLAIN, None, DEFAULT),
    "a8w4_mxfp4-gptq": ("a8w4_mxfp4", PLAIN, None, DEFAULT, "gptq"),
    "a8w4_mxfp4-awq+gptq": ("a8w4_mxfp4", PLAIN, None, DEFAULT, "awq+gptq"),
    "weight_only_mxfp8": ("weight_only_mxfp8", PLAIN, None, DEFAULT),
    "weight_only_mxfp8-gptq": ("weight_only_mxfp8", PLAIN, None, DEFAULT, "gptq"),
    "mxfp8": ("mxfp8", PLAIN, None, DEFAULT),
    "mxfp8-gptq": ("mxfp8", PLAIN, None, DEFAULT, "gptq"),
    "fp32+kv-int8": (None, None, "int8", 0),
    "fp32+kv-fp8": (None, None, "fp8", 0),
    "a8w8": ("a8w8", None, None, 0),
    "a8w8-sq": ("a8w8", 0.75, None, 0),  # α 0.75 measured best of {0.5, 0.75, 0.9} on SmolLM2
    "a8w8-sqauto": ("a8w8", "auto", None, 0),
    "a8w8-sq-fb": ("a8w8", 0.75, None, "fb"),
    "a8w8-sqauto-fb": ("a8w8", "auto", None, "fb"),
    "a8w8-sqauto-fb-gptq": ("a8w8", "auto", None, "fb", "gptq"),
    "a8w8-sqauto-fb+kv-int8": ("a8w8", "auto", "int8", "fb"),
    "a8w8-sqauto-fb+kv-fp8": ("a8w8", "auto", "fp8", "fb"),
    "a8w8_fp8": ("a8w8_fp8", None, None, 0),
    "a8w8_fp8-sq": ("a8w8_fp8", 0.5, None, 0),
    "a8w8_fp8-sqauto": ("a8w8_fp8", "auto", None, 0),
    "a8w8_fp8-fb": ("a8w8_fp8", None, None, "fb"),
    "a8w8_fp8-sqauto-fb": ("a8w8_fp8", "auto", None, "fb"),
    "a8w8_fp8-sqauto-fb+kv-int8": ("a8w8_fp8", "auto", "int8", "fb"),
    "a8w8_fp8-sqauto-fb+kv-fp8": ("a8w8_fp8", "auto", "fp8", "fb"),
}
TARGETS = {"a8w8-default": 4.0, "a8w8-default-gptq": 4.0, "a8w8-sq": 3.0, "a8w8-sqauto": 3.0, "a8w8-sq-fb": 3.0, "a8w8-sqauto-fb": 3.0,
           "a8w8-sqauto-fb-gptq": 3.0,
           "a8w8_fp8": 2.5, "a8w8_fp8-sq": 2.5, "a8w8_fp8-sqauto": 2.5, "a8w8_fp8-fb": 2.5,
           "a8w8_fp8-sqauto-fb": 2.5, "fp32+kv-int8": 0.5, "fp32+kv-fp8": 1.0}  # max Δ%


def pydoc_calib_jsonl(path: Path) -> Path:
    """Write Python's pydoc topics (≈ 110K tokens of English technical prose) as a jsonl."""
    import pydoc_data.topics as topics

    with open(path, "w") as f:
        for _, text in sorted(topics.topics.items()):
            f.write(json.dumps({"text": text}) + "\n")
    return path


def static_rows(model: str, calib_data: str, heldout: str, work: Path, *, rows=tuple(ROWS),
                num_samples: int = 64, seq_len: int = 512, eval_seq_len: int = 512,
                observer: str = "minmax", fallback: int = FALLBACK, calib_dtype: str = "auto", log=print
                ) -> tuple[dict, list[dict]]:
    """Calibrate once, then quantize + evaluate each row; returns (calibration info, rows)."""
    table = work / "calib"
    t0 = time.perf_counter()
    cal = api.calibrate(model, calib_data, table, num_samples=num_samples, seq_len=seq_len,
                        observer=observer, dtype=calib_dtype)
    calib_info = {"wall_s": round(time.perf_counter() - t0, 1), "cpu_s": cal.meta["cpu_s"],
                  "forward_s": cal.meta["forward_s"], "threads": cal.meta["threads"],
                  "num_samples": num_samples, "seq_len": seq_len, "observer": observer,
                  "kv_observer": cal.meta.get("kv_observer"), "dtype": cal.meta.get("dtype"),
                  "data": str(calib_data)}
    log(f"calibrated {num_samples} × {seq_len} in {calib_info['wall_s']} s wall "
        f"({calib_info['cpu_s']} s CPU, {calib_info['threads']} threads)")
    artifacts: dict[tuple, Path] = {}
    out = []
    for name in rows:
        qt, alpha, kv, fb, *method = ROWS[name]
        method = method[0] if method else "rtn"
        fb = fallback if fb == "fb" else fb
        path, q_time, plan = model, None, None
        strategy = "tensor" if "-tensor" in name else None
        if qt is not None:
            key = (qt, alpha, fb, method, strategy)
            if key not in artifacts:
                t1 = time.perf_counter()
                kw = dict(dataset=calib_data, num_samples=num_samples, seq_len=seq_len) if method != "rtn" else {}
                if "gptq" in method:
                    kw["act_order"] = True
                if alpha == DYNAMIC:
                    kw["activations"] = DYNAMIC
                elif isinstance(alpha, tuple):  # (DYNAMIC, α): per-token inputs, SmoothQuant at α
                    kw.update(activations=DYNAMIC, smoothquant_alpha=alpha[1])
                elif alpha == BLOCK:
                    kw["weight_block"] = 128
                elif alpha not in (DEFAULT, PLAIN):
                    kw["smoothquant_alpha"] = "none" if alpha is None else alpha
                if fb != DEFAULT:
                    kw["fallback_layers"] = fb
                if strategy is not None:
                    kw["weight_strategy"] = strategy
                if "mxfp" in qt or qt.startswith("a8w4") or (qt == "weight_only_fp8" and alpha == BLOCK):
                    kw["target"] = "quantspec"
                tag = "-".join(map(str, alpha)) if isinstance(alpha, tuple) else alpha
                artifacts[key] = api.quantize(model, qt, work / f"{qt}-{tag}-{fb}-{method}-{strategy}",
                                              calib=None if alpha in (DYNAMIC, BLOCK, PLAIN) else table,
                                              method=method, **kw)
                q_time = round(time.perf_counter() - t1, 1)
            path = artifacts[key]
            plan = (api.inspect(str(path)).get("calibration") or {}).get("static_plan")
        ev = api.evaluate(str(path), text_file=heldout, seq_len=eval_seq_len,
                          kv_cache_dtype=kv or "auto", calib=table if kv else None)
        out.append({"row": name, "quant_type": qt or "fp32", "method": method, "smoothquant_alpha": alpha,
                    "kv_cache": kv or "fp32", "perplexity": ev["perplexity"],
                    "num_tokens": ev["num_tokens"], "quantize_s": q_time,
                    "eval_s": round(ev["seconds"], 1), "fallback": fb,
                    "fallback_layers": (plan or {}).get("fallback_layers", []),
                    "held_back": (plan or {}).get("held_back"),
                    "alphas": (plan or {}).get("smoothquant_alphas")})
        log(f"{name:26s} ppl {ev['perplexity']:.4f}")
    base = next((r["perplexity"] for r in out if r["row"] == "fp32"), None)
    for r in out:
        r["delta_pct"] = None if base is None else round(100 * (r["perplexity"] / base - 1), 3)
        r["target_pct"] = TARGETS.get(r["row"])
    return calib_info, out


def markdown(calib_info: dict, rows: list[dict]) -> str:
    cells = []
    for r in rows:
        d = "—" if r["delta_pct"] is None else f"{r['delta_pct']:+.2f}%"
        t = "" if r["target_pct"] is None else f"≤ +{r['target_pct']}%"
        n = len(r.get("fallback_layers") or [])
        if r.get("fallback") == DEFAULT:
            held = r.get("held_back") or {}
            fb = (f"budget +{held.get('budget_pct')}%: {held.get('chosen_units')} of {held.get('units')} units, "
                  f"{n} Linears (held-back {held.get('delta_pct'):+.2f}% over weight-only, "
                  f"{held.get('over_float_pct'):+.2f}% over float)") if held else "—"
        else:
            fb = f"{r['fallback']} units, {n} Linears" if r.get("fallback") else "—"
        q = "" if r.get("quantize_s") is None else f"{r['quantize_s']:.0f}"
        a = r["smoothquant_alpha"]
        alpha = f"{a[1]} (dynamic activations)" if isinstance(a, tuple) else \
            {DYNAMIC: "— (dynamic activations)",  # per-token activations: no smoothing
             BLOCK: "— (128² blocks, float activations)" if r["quant_type"] == "weight_only_fp8" else
             "— (128² blocks, dynamic per-group activations)",
             PLAIN: "— (float activations)" if r["quant_type"].startswith("weight_only") else
             "— (per-group activations at run time)"}.get(a)
        alpha = alpha or r["smoothquant_alpha"] or "—"
        cells.append([r["row"], r["quant_type"], alpha, fb, r["kv_cache"],
                      f"{r['perplexity']:.4f}", d, t, q])
    lines = [markdown_table(["row", "weights × activations", "SmoothQuant α", "W8A16 fallback",
                             "KV cache", "perplexity", "Δ vs fp32", "target", "quantize s"], cells)]
    lines.append(f"\ncalibration: {calib_info['num_samples']} × {calib_info['seq_len']} tokens, "
                 f"observer {calib_info['observer']} (K/V: {calib_info.get('kv_observer')}), "
                 f"{calib_info.get('dtype')} forward, "
                 f"{calib_info['wall_s']} s wall / "
                 f"{calib_info['cpu_s']} s CPU on {calib_info['threads']} thread(s); data "
                 f"{calib_info['data']}")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--heldout", default=str(HERE / "data" / "heldout.txt"))
    default_calib = HERE / "data" / "calib.jsonl"
    p.add_argument("--calib-data", default=str(default_calib) if default_calib.exists() else "pydoc",
                   help="calibration jsonl/txt, or 'pydoc' (Python's pydoc topics)")
    p.add_argument("--num-samples", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--eval-seq-len", type=int, default=512)
    p.add_argument("--observer", default="minmax", choices=["minmax", "percentile", "mse"])
    p.add_argument("--calib-dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="forward dtype of the calibration run (quantspec calibrate --dtype)")
    p.add_argument("--fallback", type=int, default=FALLBACK,
                   help="W8A16 fallback (fused units) of the -fb rows")
    p.add_argument("--rows", default=",".join(ROWS), help="comma-separated subset of: " + ", ".join(ROWS))
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--markdown", default=None)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    rows = a.rows.split(",")
    unknown = [r for r in rows if r not in ROWS]
    if unknown:
        p.error(f"unknown row(s) {unknown}; choose from {list(ROWS)}")
    work = Path(tempfile.mkdtemp(prefix="quantspec-quality-static-"))
    try:
        data = str(pydoc_calib_jsonl(work / "pydoc.jsonl")) if a.calib_data == "pydoc" else a.calib_data
        calib_info, out = static_rows(a.model, data, a.heldout, work, rows=rows,
                                      num_samples=a.num_samples, seq_len=a.seq_len,
                                      eval_seq_len=a.eval_seq_len, observer=a.observer,
                                      fallback=a.fallback, calib_dtype=a.calib_dtype)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    md = markdown(calib_info, out)
    print(md)
    if a.markdown:
        Path(a.markdown).write_text(md + "\n")
    if a.json:
        Path(a.json).write_text(json.dumps({"calibration": calib_info, "rows": out}, indent=2))


if __name__ == "__main__":
    main()
