"""`quantspec quantize`, `calibrate` and `inspect`: flags → `api.quantize` / `api.calibrate` / `api.inspect`, rendered with rich."""

from __future__ import annotations

import click

from quantspec.cli.group import main, one_line_errors, rotate_option, threads_option


def _gib(n) -> str:
    return "?" if n is None else f"{n / 2**20:,.1f} MiB"


@main.command()
@click.option("--model", default="smollm2-135m", show_default=True, help="zoo name, HF directory or hub id")
@click.option("--quant-type", default=None,
              help="[required unless --recipe gives it] weight_only_int8 | weight_only_int4 | a8w8 | a8w8_fp8 | weight_only_fp8 | a8w4 | a8w4_fp8 | "
                   "weight_only_nvfp4 | nvfp4 | weight_only_mxfp4 | mxfp4 | a8w4_mxfp4 | weight_only_mxfp8 | mxfp8 "
                   "(nvfp4: needs --calib or --dataset; MXFP4 / MXFP8: vLLM only, --target vllm; a8w4 / a8w4_fp8: "
                   "int4 weights, int8 / FP8 inputs per token at run time, W4A8 / W4AFP8; a8w4_mxfp4: MXFP4 weights, "
                   "FP8 inputs per group of 128 at run time, MXFP4XFP8) | keep (an artifact's weights as they are, "
                   "with --kv-cache and --calib or --dataset: KV-cache scales added)")
@click.option("--recipe", default=None, type=click.Path(),
              help="an llm-compressor recipe (its recipe.yaml, or JSON): its modifiers' schemes, method, ignore "
                   "list, KV-cache scheme, SmoothQuant, AWQ, QuIP and SpinQuant settings, run as the quantspec "
                   "flags it prints; flags it sets may not be given again (docs/recipes.md)")
@click.option("--method", default="rtn", show_default=True,
              type=click.Choice(["rtn", "gptq", "awq", "awq+gptq", "autoround"]),
              help="rtn: round to nearest; gptq: error-compensating rounding; awq: activation-aware "
                   "scaling, then rtn; awq+gptq: the scaling, then gptq; autoround: each layer's rounding and "
                   "clipping tuned by signed gradient descent on its output error (awq: weight-only types and "
                   "8-bit inputs quantized at run time; autoround: integer weights; all but rtn need --dataset)")
@click.option("--group-size", default=None, type=int,
              help="weight group size along K (-1: per channel) of the int4 types [default: 128] and weight_only_int8 "
                   "[default: per channel; 128 is llm-compressor's W8A16]; a size that does not divide a layer's K is "
                   "lowered for that layer")
@click.option("--sym/--asym", "symmetric", default=True, show_default=True)
@click.option("--zp-dtype", default="int", show_default=True,
              type=click.Choice(["int", "float16", "bfloat16", "float32"]),
              help="weight_only_int4 --asym: zero-point dtype; a float one is stored unrounded "
                   "(compressed-tensors' zp_dtype), e.g. to reproduce GGUF Q4_1-style grids")
@click.option("--weight-observer", default="auto", show_default=True, type=click.Choice(["auto", "minmax", "mse"]),
              help="weight scales: min/max, or mse = per scale, the clipping of the range (down to 0.8) "
                   "with the least |w - q(w)|^2.4 (RTN, and each GPTQ group); auto: mse for "
                   "weight_only_int4, minmax for the 8-bit types")
@click.option("--ignore", multiple=True, help="module name or re:regex to keep unquantized (repeatable; lm_head unless a "
              "--layer-quant-type names it)")
@click.option("--layer-quant-type", "layer_quant_types", multiple=True, metavar="TARGET=QUANT_TYPE",
              help="the Linears a module name or re:regex names at another type, e.g. "
                   "'re:.*mlp.down_proj$=weight_only_int8' or 're:.*self_attn.*=a8w8_fp8'; 'lm_head=weight_only_int8' "
                   "quantizes the output head, 'model.embed_tokens=weight_only_int4' the input embedding (vLLM "
                   "only: --target vllm) (repeatable; types that "
                   "need no calibration table: weight-only ones, and a8w8 / a8w8_fp8 / mxfp4 / mxfp8 with inputs "
                   "quantized at run time)")
@click.option("--awq-duo-scaling", default="true", show_default=True, type=click.Choice(["true", "false", "both"]),
              help="awq: the candidate scales, as llm-compressor's AWQModifier duo_scaling: x̄^α / w̄^(1-α) (true), "
                   "x̄^α alone (false), or both at half the grid each")
@click.option("--act-order", is_flag=True, help="GPTQ: quantize columns in order of decreasing Hessian diagonal")
@click.option("--block-size", "gptq_block_size", default=128, show_default=True, type=int, help="GPTQ lazy-update block")
@click.option("--damp", default=0.01, show_default=True, type=float, help="GPTQ damping (fraction of mean diag H)")
@click.option("--iters", default=None, type=int, help="autoround: tuning steps per decoder layer [default: 200]")
@click.option("--lr", default=None, type=float,
              help="autoround: step size, decaying linearly to 0 over the steps [default: 1 / --iters]")
@click.option("--batch-size", default=None, type=int, help="autoround: calibration samples per step [default: 8]")
@click.option("--dataset", default=None,
              help="calibration data: .txt/.json/.jsonl/.parquet file or hub id (GPTQ, AWQ, AutoRound; without "
                   "--calib, the scales a static type or --kv-cache needs are measured on it first)")
@click.option("--base", default=None,
              help="gptq of a draft module (MTP, Medusa, EAGLE-3): the float base it drafts for, whose hidden "
                   "states it is calibrated on [default: the base the module records: its training's, a "
                   "speculators head's verifier]")
@click.option("--split", default="train", show_default=True)
@click.option("--text-field", default="text", show_default=True)
@click.option("--num-samples", default=128, show_default=True, type=int)
@click.option("--seq-len", default=512, show_default=True, type=int)
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--calib", default=None, type=click.Path(),
              help="calibration table dir from `quantspec calibrate` (a8w8 types: input scales; nvfp4: input "
                   "global scales; --kv-cache) [default: measured on --dataset in this run]")
@click.option("--activations", default=None, type=click.Choice(["static", "dynamic"]),
              help="a8w8 types: input scales calibrated per tensor (needs --calib) or computed per token at run "
                   "time (llm-compressor's W8A8 / FP8_DYNAMIC; no --calib, SmoothQuant or fallback) "
                   "[default: static; dynamic with --weight-block and for a8w4 / a8w4_fp8, which take no other]")
@click.option("--weight-block", default=None, type=int,
              help="a8w8_fp8: one weight scale per N × N block and inputs quantized per token in groups of N "
                   "at run time (llm-compressor's FP8_BLOCK, e.g. 128; shrunk per layer to a block that tiles it); "
                   "weight_only_fp8: the same weights, float inputs")
@click.option("--weight-strategy", default=None, type=click.Choice(["channel", "tensor"]),
              help="a8w8_fp8, weight_only_fp8: one FP8 weight scale per output channel or per Linear "
                   "(llm-compressor's FP8 scheme; the engines' fused layers share one) [default: channel]")
@click.option("--smoothquant-alpha", default=None,
              help="a8w8 types: SmoothQuant migration strength in (0, 1), 'auto' (searched per "
                   "smoothing group on calibration data; the default) or 'none'; inputs quantized per token "
                   "(--activations dynamic, a8w4 types): a number with --calib (channel ranges), default none")
@click.option("--a8w8-fallback-budget", "fallback_budget", default=None, type=float,
              help="a8w8 types: keep the fewest fused units (q/k/v, gate/up, o_proj, down_proj) at "
                   "float activations (W8A16) that hold the perplexity on held-back calibration "
                   "windows within this many percent of the weight-only model's [default: 1.5]")
@click.option("--a8w8-fallback-layers", "fallback_layers", default=None, type=int,
              help="a8w8 types: instead of the budget, keep the N fused units with the largest "
                   "measured static-activation error at float activations (0: none)")
@click.option("--a8w8-fallback-threshold", "fallback_threshold", default=None, type=float,
              help="a8w8 types: instead of the budget, fall back every fused unit with a Linear "
                   "whose relative output MSE exceeds this")
@click.option("--kv-cache", default=None, type=click.Choice(["int8", "fp8"]),
              help="store static KV-cache scales from --calib in the artifact (k_scale/v_scale)")
@click.option("--kv-strategy", default=None, type=click.Choice(["tensor", "head"]),
              help="KV-cache scales per tensor (SGLang and vLLM load them) or per KV head "
                   "[default: head for --target quantspec, else tensor]")
@click.option("--target", default="portable", show_default=True,
              type=click.Choice(["portable", "vllm", "sglang", "transformers", "quantspec"]),
              help="the engines the artifact must load in (portable: vLLM and SGLang); options one of "
                   "them would refuse or ignore are refused before any work")
@click.option("--compute-capability", default=None, metavar="X.Y",
              help="judge --target for the serving GPU of this compute capability (e.g. 8.0 for A100) [default: the "
                   "GPU each type is made for: 9.0, or 10.0 for NVFP4 / MXFP4 / MXFP8 inputs]")
@click.option("--out", required=True, type=click.Path(), help="artifact directory to write")
@click.option("--overwrite", is_flag=True, help="replace a non-empty --out")
@click.option("--device", default="auto", show_default=True,
              help="where each layer is quantized (the rest stays on disk): auto, cpu, cuda, cuda:N")
@click.option("--restart", is_flag=True,
              help="start over: discard the state an interrupted run of a big model left beside --out")
@rotate_option
@click.option("--quip", default=None, metavar="v|v,u",
              help="quantize each decoder Linear in QuIP's turned basis: a block Hadamard transform of its input (v) "
                   "and output (u), fused into its weight and undone at run time around it (vLLM and quantspec run "
                   "it; needs --target vllm or quantspec)")
@click.option("--quip-block-size", default=None, type=int,
              help="the --quip transforms' block, a power of two [default: the largest up to 128 that divides "
                   "every Linear]")
@one_line_errors
@threads_option
def quantize(model, quant_type, recipe, method, group_size, symmetric, zp_dtype, weight_observer, ignore, layer_quant_types,
             awq_duo_scaling, act_order, gptq_block_size, damp, iters, lr, batch_size,
             dataset, base, split, text_field, num_samples, seq_len, seed, calib, activations, weight_block, weight_strategy,
             smoothquant_alpha,
             fallback_budget, fallback_layers, fallback_threshold, out, overwrite, device, restart, kv_cache=None,
             kv_strategy=None, target="portable", compute_capability=None, rotate=None, quip=None,
             quip_block_size=None):
    """Quantize a checkpoint into a compressed-tensors artifact directory."""
    import time

    from quantspec import api
    from quantspec.console import Progress
    from quantspec.errors import QuantSpecError

    if smoothquant_alpha is not None and smoothquant_alpha not in ("auto", "none"):
        try:
            smoothquant_alpha = float(smoothquant_alpha)
        except ValueError:
            raise click.BadParameter(f"{smoothquant_alpha!r} is neither a number, 'auto' nor 'none'",
                                     param_hint="--smoothquant-alpha") from None
    options = dict(method=method, group_size=group_size, symmetric=symmetric,
                   zp_dtype=None if zp_dtype == "int" else zp_dtype,
                   weight_observer=None if weight_observer == "auto" else weight_observer, ignore=tuple(ignore),
                   layer_quant_types=tuple(layer_quant_types), awq_duo_scaling=awq_duo_scaling, act_order=act_order,
                   block_size=gptq_block_size,
                   damp=damp, iters=iters, lr=lr, batch_size=batch_size, dataset=dataset, base=base, split=split,
                   text_field=text_field, num_samples=num_samples, seq_len=seq_len, seed=seed, calib=calib,
                   activations=activations, weight_block=weight_block, weight_strategy=weight_strategy,
                   smoothquant_alpha=smoothquant_alpha,
                   overwrite=overwrite, kv_cache=kv_cache, kv_strategy=kv_strategy, target=target,
                   compute_capability=compute_capability, fallback_layers=fallback_layers,
                   fallback_threshold=fallback_threshold, fallback_budget=fallback_budget, device=device,
                   restart=restart, rotate=rotate, quip=quip, quip_block_size=quip_block_size)
    if recipe is not None:  # the recipe's options, and those given beside it (`calib.recipe.Recipe.merge`)
        options = _given(options)
    elif quant_type is None:
        raise QuantSpecError("--quant-type is required: the type to quantize to (or --recipe FILE, an "
                             "llm-compressor recipe that names it)")
    t0 = time.perf_counter()
    with Progress(f"quantize {quant_type or 'recipe'}") as progress:
        path = api.quantize(model, quant_type, out, recipe=recipe, progress=progress.layer, on_status=progress.status,
                            **options)
    info = api.inspect(path)
    progress.console.print(f"[green]wrote[/] {path}  ({_gib(info['weights_bytes'])}, "
                           f"{info.get('compression_ratio') or '?'}x smaller than the source, "
                           f"{time.perf_counter() - t0:.1f} s)")
    if info.get("recipe"):  # the flags the run recorded for its recipe
        progress.console.print(f"the recipe {recipe} ran as: {' '.join(info['recipe']['flags'])}", highlight=False)


def _given(options: dict) -> dict:
    """`options` less those left at their default on the command line (beside --recipe, the recipe's
    apply there)."""
    from click.core import ParameterSource

    ctx = click.get_current_context()
    names = {"block_size": "gptq_block_size"}
    return {k: v for k, v in options.items()
            if ctx.get_parameter_source(names.get(k, k)) not in (ParameterSource.DEFAULT, None)}


def _head_table(info: dict):
    """`inspect`'s first table: what the artifact is, its size, and each engine's verdict."""
    from rich.table import Table

    from quantspec import api

    head = Table(title=f"quantspec inspect {info['path']}", show_header=False)
    head.add_row("quantized", str(info["quantized"]))
    for key in ("quant_type", "format", "method", "quantspec_version"):
        if info.get(key) is not None:
            head.add_row(key, str(info[key]))
    if info.get("ignore") is not None:
        head.add_row("ignore", ", ".join(info["ignore"]) or "-")
    head.add_row("weights on disk", _gib(info["weights_bytes"]))
    if info.get("quantized_linears") is not None:
        head.add_row("quantized Linears", str(info["quantized_linears"]))
    if info.get("convert"):
        head.add_row("convert", info["convert"])
    if info.get("source_quantization"):  # the source was itself quantized: its weights were decompressed
        was = info["source_quantization"]
        head.add_row("quantized from", f"{was['quant_type'] or was['format']} ({was['quant_method']})")
    if info.get("rotation"):
        head.add_row("rotations fused", info["rotation"])
    if info.get("run_time_transforms"):
        head.add_row("run-time transforms", info["run_time_transforms"])
    if info.get("source_size_bytes"):
        head.add_row("source weights", _gib(info["source_size_bytes"]))
        head.add_row("compression ratio", f"{info['compression_ratio']}x")
    if info.get("activation_linears") is not None:
        static = info["static_activation_linears"]
        kind = "static" if static == info["activation_linears"] else "dynamic" if not static else "quantized"
        head.add_row(f"{kind} activations", f"{info['activation_linears']} of {len(info['layers'])} Linears")
        for key, value in _fallback_rows(info.get("fallback")):
            head.add_row(key, value)
    if info.get("llmcompressor_recipe"):
        head.add_row("llm-compressor recipe", info["llmcompressor_recipe"])
    if info.get("kv_cache"):
        head.add_row("kv cache", f"{info['kv_cache']['type']}{info['kv_cache']['num_bits']} "
                                 f"{info['kv_cache']['strategy']}")
    if info.get("compute_capability"):
        head.add_row("verdicts for", f"a GPU of compute capability {info['compute_capability']}")
    for engine in (info.get("engines") or {}).values():
        head.add_row(api.ENGINE_NAMES[engine["engine"]], engine["verdict"])
    return head


def _fallback_rows(fb: dict | None) -> list[tuple[str, str]]:
    """`inspect`'s lines on an a8w8 fallback: the rule, what the budget measured, the units."""
    if not fb:
        return []
    rule, held, rows = fb.get("rule") or {}, fb.get("held_back"), []
    if rule.get("by") == "budget" and held:
        rows.append(("fallback rule", f"held-back perplexity within +{rule['budget_pct']:g}% of the weight-only "
                                      f"model's ({held['windows']} × {held['seq_len']} tokens of "
                                      f"{held.get('dataset')}, windows from {held.get('first_window')}, unseen "
                                      "by the scales and the α search)"))
        steps = "; ".join(f"{m['units']} unit{'' if m['units'] == 1 else 's'} {m['delta_pct']:+.2f}%"
                          + (f" (chosen; {m['over_float_pct']:+.2f}% over float)"
                             if m["units"] == held.get("chosen_units") else "")
                          for m in sorted(held["measured"], key=lambda m: m["units"]))
        rows.append(("held-back measured", f"float ppl {held['float_perplexity']:.3f}, weight-only "
                                           f"{held['weight_only_perplexity']:.3f}; fallback {steps}"))
    elif rule.get("by") == "rank":
        what = [f"the {rule['units']} fused units with the largest static-activation error"] if rule.get("units") else []
        if rule.get("threshold") is not None:
            what.append(f"every unit with a Linear's error > {rule['threshold']:g}")
        rows.append(("fallback rule", " + ".join(what)))
    else:
        rows.append(("fallback rule", "none"))
    units = fb.get("units") or []
    if units:
        names = ", ".join(_unit_name(u["linears"]) + f" ({u['error']:.3g})" for u in units)
        rows.append(("fallback (weight-only)", f"{len(units)} units, {sum(len(u['linears']) for u in units)} "
                                               f"Linears, by measured error: {names}"))
    return rows


def _unit_name(linears: list[str]) -> str:
    """A fused unit by its shards: "model.layers.3.self_attn.q_proj/k_proj/v_proj"; a Linear of a
    draft module outside any layer by its name ("fc")."""
    prefix, _, _ = linears[0].rpartition(".")
    return (f"{prefix}." if prefix else "") + "/".join(n.rpartition(".")[2] for n in linears)


@main.command()
@click.argument("path", type=click.Path())
@click.option("--json", "as_json", is_flag=True, help="print the full description as JSON")
@click.option("--compute-capability", default=None,
              help="the serving GPU's compute capability for the engines' verdicts (their kernels differ by "
                   "GPU), e.g. 7.5 (T4), 8.0 (A100), 8.9 (L40S), 9.0 (H100), 10.0 (B200)  [default: 9.0]")
@one_line_errors
def inspect(path, as_json, compute_capability):
    """Describe an artifact: scheme, per-layer bits / group size, size and compression ratio."""
    import json
    from collections import Counter

    from rich.table import Table

    from quantspec import api
    from quantspec.console import out_console

    info = api.inspect(path, compute_capability=compute_capability)
    if as_json:
        click.echo(json.dumps(info, indent=2, default=str))
        return
    console = out_console()
    head = _head_table(info)
    console.print(head)
    if not info.get("layers"):  # a float model, or a bitsandbytes source (no compressed-tensors layers)
        return
    # one row per (module kind, scheme): e.g. q_proj ×30 int4 g64 sym
    rows = Counter()
    for name, d in info["layers"].items():
        kind = name.rsplit(".", 1)[-1]
        size = "×".join(map(str, d["block"])) if d.get("block") else d["group_size"]
        rows[(kind, d["type"], d["bits"], d["strategy"], size, d["symmetric"],
              d.get("zp_dtype") or "-", d["input_activations"] or "-")] += 1
    t = Table(title="quantized Linears")
    for col in ("module", "count", "weights", "granularity", "symmetric", "zero point",
                "activations"):
        t.add_column(col)
    for (kind, typ, bits, strat, g, sym, zp, act), n in sorted(rows.items(),
                                                              key=lambda r: str(r[0])):
        gran = f"{strat} {g}" if strat in ("group", "tensor_group", "block") else strat
        t.add_row(kind, str(n), f"{typ}{bits}", gran, "yes" if sym else "no", zp, act)
    console.print(t)


@main.command()
@click.option("--model", default="smollm2-135m", show_default=True, help="zoo name, HF directory or hub id (unquantized)")
@click.option("--dataset", required=True, help="calibration data: .txt/.json/.jsonl/.parquet file or hub id")
@click.option("--split", default="train", show_default=True)
@click.option("--text-field", default="text", show_default=True, help="dataset column holding the text")
@click.option("--num-samples", default=128, show_default=True, type=int)
@click.option("--seq-len", default=512, show_default=True, type=int)
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--observer", default="minmax", show_default=True, type=click.Choice(["minmax", "percentile", "mse"]))
@click.option("--percentile", default=99.99, show_default=True, type=float, help="percentile observer: quantile of |x|")
@click.option("--kv-observer", default=None, type=click.Choice(["minmax", "percentile", "mse"]),
              help="observer of the K/V per-head scales (default: see calib/calibrate.py DEFAULT_KV_OBSERVER)")
@click.option("--batch-size", default=8, show_default=True, type=int, help="samples per forward")
@click.option("--dtype", default="auto", show_default=True, type=click.Choice(["auto", "float32", "bfloat16", "float16"]),
              help="forward dtype while observing; auto: bfloat16 where the CPU computes it natively (AVX512-BF16/AMX), else float32")
@click.option("--device", default="auto", show_default=True,
              help="where each layer runs (the rest stays on disk): auto, cpu, cuda, cuda:N")
@click.option("--out", required=True, type=click.Path(), help="table directory to write")
@click.option("--overwrite", is_flag=True, help="replace a non-empty --out")
@click.option("--restart", is_flag=True,
              help="start over: discard the state an interrupted run of a big model left beside --out")
@click.option("--base", default=None,
              help="a draft module (MTP, Medusa, EAGLE-3): the float base it drafts for, whose hidden states it "
                   "is measured on [default: the base the module records]")
@rotate_option
@one_line_errors
@threads_option
def calibrate(model, dataset, out, **kw):
    """Measure static activation and KV-cache scales (scales.safetensors + calibration.json)."""
    from quantspec import api
    from quantspec.console import Progress

    with Progress(f"calibrate ({kw['observer']})") as progress:
        res = api.calibrate(model, dataset, out, progress=progress.layer, on_status=progress.status, **kw)
    m = res.meta
    what = f"draft module ({m['draft']['kind']}) on the base {m['draft']['base']}" if m.get("draft") else \
        f"{m['num_layers']} layers"
    progress.console.print(f"[green]wrote[/] {res.path}  ({what}, {m['num_samples']} × "
                           f"{m['seq_len']} tokens, observer {m['observer']}, fingerprint "
                           f"{m['model_fingerprint']}, {res.wall_s:.1f} s)")


if __name__ == "__main__":  # python -m quantspec.cli (what tests and benches start servers with)
    main()
