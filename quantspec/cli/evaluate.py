"""`quantspec eval` and `quantspec report`: flags → `api.evaluate` / `api.report`, rendered with rich."""

from __future__ import annotations

import click

from quantspec.cli.group import main, one_line_errors, threads_option
from quantspec.errors import QuantSpecError


@main.command(name="eval")
@click.option("--model", default="smollm2-135m", show_default=True, help="zoo name, HF directory or artifact")
@click.option("--text-file", default=None, type=click.Path(), help="text to evaluate (UTF-8 or .json/.jsonl)")
@click.option("--dataset", default=None, help="dataset file or hub id (instead of --text-file)")
@click.option("--split", default="test", show_default=True)
@click.option("--text-field", default="text", show_default=True)
@click.option("--seq-len", default=512, show_default=True, type=int)
@click.option("--max-windows", default=None, type=int, help="evaluate only the first N windows")
@click.option("--batch-size", default=4, show_default=True, type=int, help="windows per forward")
@click.option("--dtype", default="float32", show_default=True, type=click.Choice(["float32", "bfloat16", "float16"]))
@click.option("--kv-cache-dtype", default="auto", show_default=True, type=click.Choice(["auto", "float", "int8", "fp8"]),
              help="auto: the artifact's static KV cache when it stores k/v scales, else float")
@click.option("--cachekv-int8-type", type=click.Choice(["none", "static"]), default="none", show_default=True,
              help="static: int8 KV cache with calibrated per-head scales (= --kv-cache-dtype int8).")
@click.option("--cachekv-fp8-type", type=click.Choice(["none", "static"]), default="none", show_default=True,
              help="static: FP8 E4M3 KV cache with calibrated per-head scales (= --kv-cache-dtype fp8).")
@click.option("--calib", default=None, type=click.Path(), help="calibration table dir (static KV scales)")
@click.option("--reference", default=None,
              help="the model --model was quantized from: score it against that model's next-token distributions "
                   "too (KL divergence, top-1 agreement) on the same windows")
@click.option("--json", "as_json", is_flag=True, help="print the result as one JSON object")
@one_line_errors
@threads_option
def eval_(model, text_file, dataset, split, text_field, seq_len, max_windows, batch_size, dtype, kv_cache_dtype,
          calib, reference, as_json, cachekv_int8_type="none", cachekv_fp8_type="none"):
    """Perplexity of a model or artifact over non-overlapping --seq-len windows (with --reference: KL
    divergence and top-1 agreement against the model it was quantized from)."""
    static = [k for k, flag in (("int8", cachekv_int8_type), ("fp8", cachekv_fp8_type)) if flag == "static"]
    if len(static) > 1 or (static and kv_cache_dtype not in ("auto", static[0])):
        raise QuantSpecError("choose one KV cache type: --cachekv-int8-type, --cachekv-fp8-type or --kv-cache-dtype")
    kv_cache_dtype = static[0] if static else kv_cache_dtype
    import json

    from quantspec.console import Progress

    from quantspec import api

    with Progress("eval") as progress:
        res = api.evaluate(model, text_file=text_file, dataset=dataset, split=split, text_field=text_field,
                           seq_len=seq_len, max_windows=max_windows, batch_size=batch_size, dtype=dtype,
                           kv_cache_dtype=kv_cache_dtype, calib=calib, reference=reference,
                           progress=progress.fraction)
    if as_json:
        click.echo(json.dumps(res))
        return
    if reference is None:
        click.echo(f"perplexity {res['perplexity']:.4f}  (nll {res['nll']:.4f}, {res['num_windows']} windows × "
                   f"{res['seq_len']} tokens, kv cache {res['kv_cache']}, {res['seconds']:.1f} s)")
        return
    click.echo(f"perplexity {res['perplexity']:.4f} against the reference's {res['reference_perplexity']:.4f} "
               f"({res['delta_pct']:+.2f}%); KL divergence mean {res['kld_mean']:.5f}, p99 {res['kld_p99']:.4f}, "
               f"max {res['kld_max']:.3f} nats; top-1 agreement {100 * res['top1_agreement']:.2f}%  "
               f"({res['num_windows']} windows × {res['seq_len']} tokens, kv cache {res['kv_cache']}, "
               f"{res['seconds']:.1f} s)")


@main.command()
@click.option("--model", default="smollm2-135m", show_default=True, help="Base model: zoo name or HF directory.")
@click.option("--speculate-method", default="draft", show_default=True,
              type=click.Choice(["draft", "mtp", "medusa", "eagle", "inference_with_reference"]))
@click.option("--draft-model", help="Draft model (default: the base model itself), or the MTP module, "
                                    "Medusa heads or EAGLE-3 head directory.")
@click.option("--base-quant-types", default="none,weight_only_int8,weight_only_int4", show_default=True,
              help="Comma-separated rows: none, weight_only_int8, weight_only_int4, a8w8, a8w8_fp8.")
@click.option("--draft-quant-types", default="weight_only_int8,weight_only_int4", show_default=True,
              help="Comma-separated columns (same names; ignored for inference_with_reference).")
@click.option("--cachekv", default="none", show_default=True, help="Comma-separated: none, int8, fp8.")
@click.option("--prompts-file", type=click.Path(dir_okay=False), help="jsonl with `src` [default: 8 built-in prompts].")
@click.option("--calib-dataset", help="Calibration data for a8w8 / static KV [default: a built-in text].")
@click.option("--eval-text", type=click.Path(dir_okay=False), help="Held-out text for perplexity [default: built-in].")
@click.option("--eval-windows", default=4, show_default=True, help="Perplexity windows of --eval-seq-len tokens.")
@click.option("--eval-seq-len", default=256, show_default=True)
@click.option("--max-new-tokens", default=64, show_default=True)
@click.option("--speculate-max-draft-token-num", default=4, show_default=True, help="Draft tokens per step.")
@click.option("--speculate-max-ngram-size", default=3, show_default=True)
@click.option("--quant-method", default="rtn", show_default=True,
              type=click.Choice(["rtn", "gptq", "awq", "awq+gptq", "autoround"]),
              help="How the base (and a draft model's) artifacts are rounded; the data: --calib-dataset. "
                   "Draft heads take gptq (on the base's hidden states) and are rounded to nearest otherwise.")
@click.option("--group-size", default=128, show_default=True, help="Group size of weight_only_int4.")
@click.option("--asym", "asym", is_flag=True, help="weight_only_int4 with zero points (asymmetric).")
@click.option("--zp-dtype", default="int", show_default=True,
              type=click.Choice(["int", "float16", "bfloat16", "float32"]),
              help="weight_only_int4 --asym: zero-point dtype (float: unrounded, see `quantize --zp-dtype`).")
@click.option("--dtype", default="auto", show_default=True, type=click.Choice(["auto", "float32", "bfloat16", "float16"]),
              help="Inference activation dtype; auto: each artifact's fast one (bfloat16 for weight-only int on "
                   "CPU, float16 on CUDA, else float32). Calibration and perplexity always run in float32 for auto.")
@click.option("--device", default="auto", show_default=True)
@click.option("--cache-dir", help="Built artifacts, keyed by content [default: ~/.cache/quantspec/report-artifacts].")
@click.option("--out", required=True, type=click.Path(), help="Report directory (report.md/.json/.png, cells/).")
@click.option("--force", is_flag=True, help="Recompute finished cells instead of resuming.")
@one_line_errors
@threads_option
def report(**kw):
    """Measure which (base quant × draft quant × KV cache) pairs work, stay lossless, and how fast."""
    from quantspec import api
    from quantspec.console import err_console, out_console
    from quantspec.report.render import rich_table

    console = err_console()
    kw["symmetric"] = not kw.pop("asym")
    kw["zp_dtype"] = None if kw["zp_dtype"] == "int" else kw["zp_dtype"]
    config = api.ReportConfig(**kw)

    def progress(event, cell, i, total, result):
        where = f"[{i + 1}/{total}] base {cell.base} · draft {cell.draft} · kv {cell.cachekv}"
        if event == "start":
            console.print(f"{where} …", style="dim")
        elif event == "skip":
            console.print(f"{where}: finished earlier, reused", style="dim")
        elif result.supported:
            console.print(f"{where}: {result.speedup:.2f}× · accept {100 * (result.acceptance_rate or 0):.0f}% · "
                          f"{'lossless' if result.lossless else '[red]NOT lossless[/]'} ({result.elapsed_s:.0f} s)")
        else:
            console.print(f"{where}: [yellow]unsupported[/]: {result.reason}")

    result = api.report(config, progress=progress)
    out_console().print(rich_table(result))
    console.print(f"wrote {config.out}/report.md, report.json and the heatmap "
                  f"({len(result.computed)} cells computed, {len(result.skipped)} reused)")
