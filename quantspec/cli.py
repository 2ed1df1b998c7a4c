"""The `quantspec` command line: a thin click layer over `quantspec.api`.

Each command parses flags into one config object, calls one API function and renders the result
with rich. A `QuantSpecError` (bad input) prints as one red line and exits with status 2; any other
exception is a bug and keeps its traceback.
"""

from __future__ import annotations

import functools
import signal
import sys
import threading

import click

from quantspec import __version__
from quantspec.errors import QuantSpecError, Terminated

__all__ = ["main"]


EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT
EXIT_TERMINATED = 143  # 128 + SIGTERM


def _one_line_errors(fn):
    """Turn QuantSpecError (and Ctrl-C / SIGTERM) into one line on stderr and a non-zero exit."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except QuantSpecError as e:
            click.secho(f"error: {e}", fg="red", err=True)
            sys.exit(EXIT_BAD_INPUT)
        except Terminated:
            click.secho("terminated; nothing partial was left behind", fg="yellow", err=True)
            sys.exit(EXIT_TERMINATED)
        except KeyboardInterrupt:
            click.secho("interrupted; nothing partial was left behind", fg="yellow", err=True)
            sys.exit(EXIT_INTERRUPTED)

    return wrapper


def _threads_option(fn):
    """Add `--threads N` to a command that computes and apply it (quantspec.threads.configure)
    before the command runs; place it under `_one_line_errors`, so a bad count is one line."""

    @click.option("--threads", type=int, default=None,
                  help="CPU threads [default: OMP_NUM_THREADS if set, else the CPUs this process may use].")
    @functools.wraps(fn)
    def wrapper(*args, threads=None, **kwargs):
        from quantspec.threads import configure

        configure(threads)
        return fn(*args, **kwargs)

    return wrapper


def _raise_terminated(signum, frame):
    raise Terminated()


class _Main(click.Group):
    """The `quantspec` group: click's usage errors as one line, SIGTERM unwinding like Ctrl-C, and
    the libraries below kept quiet."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        from quantspec.console import quiet_libraries

        quiet_libraries()
        in_main_thread = threading.current_thread() is threading.main_thread()
        previous = signal.signal(signal.SIGTERM, _raise_terminated) if in_main_thread else None
        try:
            if not standalone_mode:
                return super().main(args, prog_name, complete_var, standalone_mode, **extra)
            try:
                rv = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
            except click.exceptions.Abort:
                click.secho("interrupted; nothing partial was left behind", fg="yellow", err=True)
                sys.exit(EXIT_INTERRUPTED)
            except click.ClickException as e:
                hint = ""
                if isinstance(e, click.UsageError) and e.ctx is not None:
                    hint = f" (see '{e.ctx.command_path} --help')"
                message = " ".join(e.format_message().split())
                click.secho(f"error: {message}{hint}", fg="red", err=True)
                sys.exit(e.exit_code)
            sys.exit(rv if isinstance(rv, int) else 0)
        finally:
            if in_main_thread:
                signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)


@click.group(cls=_Main, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="quantspec")
def main():
    """Quantize, calibrate, run with speculative decoding, and report on decoder LLMs."""


# Commands are added below, one per verb; each is a thin wrapper over quantspec.api.


def _stats_table(title: str, stats: dict):
    from rich.table import Table

    table = Table(title=title)
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key, value in stats.items():
        if isinstance(value, float):
            value = f"{value:.4g}"
        elif isinstance(value, list):
            value = ", ".join(f"{v:.2f}" if isinstance(v, float) else str(v) for v in value)
        table.add_row(key, str(value))
    return table


@main.command()
@click.option("--model", default="smollm2-135m", show_default=True,
              help="Zoo name, local HF directory, quantspec artifact, or hub id.")
@click.option("--prompt", help="One prompt; its answer streams to the terminal.")
@click.option("--data-file", type=click.Path(dir_okay=False), help="jsonl with a `src` field per line.")
@click.option("--output-file", type=click.Path(dir_okay=False), help="jsonl: each input row + output, output_token_ids.")
@click.option("--batch-size", default=1, show_default=True, help="Sequences decoded together.")
@click.option("--src-length", type=int, default=None, help="Max prompt tokens [default: max-length - max-new-tokens].")
@click.option("--max-length", default=2048, show_default=True, help="Max prompt + generated tokens per sequence.")
@click.option("--max-new-tokens", default=256, show_default=True)
@click.option("--truncate-prompt", is_flag=True, help="Keep the last src-length tokens of a longer prompt instead of refusing it.")
@click.option("--dtype", default="auto", show_default=True, type=click.Choice(["auto", "float32", "bfloat16", "float16"]),
              help="Activation dtype; auto: float16 on CUDA, bfloat16 on CPU for weight-only int artifacts and "
                   "bfloat16 checkpoints (loaded as stored), else float32.")
@click.option("--device", default="auto", show_default=True, help="auto, cpu, cuda, cuda:N.")
@click.option("--block-size", default=64, show_default=True, help="Paged KV cache block size (tokens).")
@click.option("--decode-strategy", default="greedy", show_default=True, type=click.Choice(["greedy", "sampling"]))
@click.option("--temperature", default=1.0, show_default=True)
@click.option("--top-k", default=0, show_default=True, help="0 = off.")
@click.option("--top-p", default=1.0, show_default=True, help="1.0 = off.")
@click.option("--seed", type=int, default=None)
@click.option("--stop", multiple=True, help="Stop string (repeatable).")
@click.option("--no-chat-template", is_flag=True, help="Send the prompt as raw text.")
@click.option("--cachekv-int8-type", type=click.Choice(["none", "static"]), default="none", show_default=True,
              help="static: int8 KV cache with calibrated per-head scales.")
@click.option("--cachekv-fp8-type", type=click.Choice(["none", "static"]), default="none", show_default=True,
              help="static: FP8 E4M3 KV cache with calibrated per-head scales.")
@click.option("--calib", type=click.Path(file_okay=False), help="Calibration directory (scale tables) for a static KV cache.")
@click.option("--speculate-method", default="none", show_default=True,
              type=click.Choice(["none", "inference_with_reference", "draft", "mtp", "medusa"]))
@click.option("--draft-model", help="Draft model, MTP module or Medusa heads (directory or artifact).")
@click.option("--speculate-tree", default=None,
              help="medusa: verify a token tree DxK (D draft positions, K candidates each, e.g. 4x2) instead of a chain.")
@click.option("--speculate-max-draft-token-num", default=5, show_default=True, help="Draft tokens per step.")
@click.option("--speculate-max-ngram-size", default=3, show_default=True, help="Longest n-gram tried first.")
@click.option("--speculate-backoff/--no-speculate-backoff", default=True, show_default=True,
              help="Adapt drafts per sequence to measured acceptance and cost (never much slower than plain decoding).")
@click.option("--speculate-min-confidence", type=float, default=None,
              help="mtp: stop drafting at a draft whose probability is below this [default: 0.4 for mtp].")
@click.option("--speculate-draft-head", type=click.Choice(["int8", "artifact"]), default=None,
              help="draft: score drafts with the draft model's head rounded to int8 (faster on CPU, output "
                   "unchanged) or with its own head [default: int8].")
@click.option("--benchmark", is_flag=True, help="Print TTFT, TPOT, tokens/s and peak memory.")
@click.option("--stats-file", type=click.Path(dir_okay=False), help="Write the benchmark statistics as JSON.")
@_one_line_errors
@_threads_option
def infer(prompt, data_file, output_file, stats_file, no_chat_template, cachekv_int8_type, cachekv_fp8_type, calib,
          **kw):
    """Generate text with a model or a quantized artifact (optionally speculating)."""
    import json

    from quantspec import api
    from quantspec.console import err_console
    from quantspec.infer.predictor import InferConfig, stream_to_stdout
    from quantspec.outputs import check_output_file, write_json

    if cachekv_int8_type == "static" and cachekv_fp8_type == "static":
        raise QuantSpecError("choose one of --cachekv-int8-type and --cachekv-fp8-type")
    cachekv = "int8" if cachekv_int8_type == "static" else "fp8" if cachekv_fp8_type == "static" else "none"
    if prompt is None and data_file is None:
        raise QuantSpecError("give --prompt TEXT or --data-file FILE.jsonl")
    config = InferConfig(chat_template=not no_chat_template, cachekv=cachekv, **kw)
    if stats_file:
        check_output_file(stats_file, "--stats-file")
    single = prompt is not None
    outs, stats = api.infer(config, [prompt] if single else None, data_file=data_file, output_file=output_file,
                            calib=calib, on_text=stream_to_stdout if single else None)
    console = err_console()
    if single:
        print()
    elif not output_file:
        for o in outs:
            print(json.dumps({"output": o.text}, ensure_ascii=False))
    if any(o.truncated_prompt for o in outs):
        console.print(f"[yellow]{sum(o.truncated_prompt for o in outs)} prompt(s) truncated to --src-length[/]")
    if kw["benchmark"]:
        console.print(_stats_table("quantspec infer --benchmark", stats))
    if stats_file:
        write_json(stats_file, stats)


@main.command()
@click.option("--model", default="smollm2-135m", show_default=True,
              help="Zoo name, local HF directory, quantspec artifact, or hub id.")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind.")
@click.option("--port", default=8000, show_default=True, type=int, help="Port to bind (0: any free port).")
@click.option("--served-model-name", default=None, help="The model name clients send [default: --model].")
@click.option("--max-batch-size", default=16, show_default=True, type=int, help="Sequences decoded together.")
@click.option("--max-queue", default=256, show_default=True, type=int,
              help="Requests that may wait for the batch; more are answered 503 with Retry-After.")
@click.option("--max-length", default=2048, show_default=True, type=int, help="Max prompt + generated tokens per request.")
@click.option("--prefill-chunk", default=256, show_default=True, type=int,
              help="Prompt tokens per prefill step (long prompts are prefilled in chunks between decode steps).")
@click.option("--drain-timeout", default=30.0, show_default=True, type=float,
              help="On SIGTERM, seconds to let requests in flight finish.")
@click.option("--dtype", default="auto", show_default=True, type=click.Choice(["auto", "float32", "bfloat16", "float16"]))
@click.option("--device", default="auto", show_default=True, help="auto, cpu, cuda, cuda:N.")
@click.option("--block-size", default=64, show_default=True, type=int, help="Paged KV cache block size (tokens).")
@click.option("--speculate-method", default="none", show_default=True,
              type=click.Choice(["none", "inference_with_reference", "draft", "mtp"]))
@click.option("--draft-model", help="Draft model or MTP module (directory or artifact).")
@click.option("--speculate-max-draft-token-num", default=5, show_default=True, type=int, help="Most drafts per step.")
@click.option("--speculate-max-ngram-size", default=3, show_default=True, type=int, help="Longest n-gram tried first.")
@click.option("--load-aware/--no-load-aware", default=True, show_default=True,
              help="Choose drafts per step from the batch size and measured step costs (no drafts where they cost more than they save).")
@_one_line_errors
@_threads_option
def serve(**kw):
    """Serve a model over OpenAI's HTTP API (chat and completions, streaming, /metrics)."""
    from quantspec import api
    from quantspec.console import err_console
    from quantspec.errors import Terminated
    from quantspec.serve import ServeConfig

    config = ServeConfig(**kw)
    console = err_console()

    def ready(url, kv_cache):
        console.print(f"[green]serving[/] {config.served_model_name} at {url}/v1, KV cache {kv_cache}  "
                      "(Ctrl-C or SIGTERM stops, draining requests in flight)")

    try:
        api.serve(config, on_ready=ready)
    except (Terminated, KeyboardInterrupt):
        pass
    console.print("stopped")


@main.group()
def zoo():
    """Model-zoo recipes (the MTP module's training)."""


@zoo.command(name="train-mtp")
@click.option("--model", default="smollm2-135m", show_default=True, help="The frozen base model.")
@click.option("--dataset", default=None, help="Text data: local .txt/.json/.jsonl/.parquet or a hub id.")
@click.option("--split", default="train", show_default=True)
@click.option("--text-field", default="text", show_default=True, help="Dataset column holding the text.")
@click.option("--steps", default=1500, show_default=True, type=int)
@click.option("--seq-len", default=256, show_default=True, type=int, help="Dataset window length (tokens).")
@click.option("--batch-size", default=4, show_default=True, type=int, help="Windows' worth of positions per step.")
@click.option("--num-samples", default=16, show_default=True, type=int, help="Dataset windows used.")
@click.option("--lr", default=1e-3, show_default=True, type=float)
@click.option("--self-distill/--no-self-distill", default=True, show_default=True,
              help="Train on the base's own greedy choices and its answers to built-in chat prompts.")
@click.option("--targets", type=click.Choice(["hard", "soft"]), default="hard", show_default=True,
              help="hard: one token per position (the base's argmax with --self-distill, else the "
                   "dataset's next token); soft: the base's distribution over the draft vocabulary "
                   "(with --self-distill; better on few prompts, on par with hard on all 1618).")
@click.option("--chat-prompts", default=None, type=click.IntRange(min=1),
              help="How many of the built-in chat prompts the base answers for self-distillation [default: all].")
@click.option("--max-new-tokens", default=160, show_default=True, type=int, help="Length of each self-distilled answer.")
@click.option("--draft-vocab-size", default=4096, show_default=True, type=int,
              help="Tokens the draft head scores (the most frequent targets).")
@click.option("--save-every", default=250, show_default=True, type=int, help="Checkpoint interval (steps).")
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--out", required=True, type=click.Path(file_okay=False), help="MTP artifact directory.")
@click.option("--resume", is_flag=True, help="Continue the checkpoint in --out (same data and --targets; "
                                              "--steps may grow); an interrupted run's prepared data is reused.")
@_one_line_errors
@_threads_option
def train_mtp(**kw):
    """Train a DeepSeek-V3-style MTP module for a frozen base (use with --speculate-method mtp)."""
    from quantspec import api
    from quantspec.console import Progress

    with Progress("train-mtp") as progress:
        res = api.train_mtp(on_step=lambda step, total, loss: progress.fraction(step, total, f"loss {loss:.3f}"),
                            on_status=progress.status, **kw)
    console = progress.console
    if res["start_step"] >= res["steps"] and res["positions"] is None:
        console.print(f"{res['out']} is already trained to {res['start_step']} steps (--steps {res['steps']}): "
                      "nothing to do; pass a larger --steps to continue it", soft_wrap=True)
        return
    first = "-" if res["loss_first"] is None else f"{res['loss_first']:.3f}"
    last = "-" if res["loss_last"] is None else f"{res['loss_last']:.3f}"
    console.print(f"[green]wrote[/] {res['out']}  (steps {res['start_step']}→{res['steps']}, loss {first} → {last}, "
                  f"{res['positions']} positions, {res['wall_s']:.0f} s)")


@zoo.command(name="train-draft-head")
@click.option("--kind", type=click.Choice(["medusa"]), default="medusa", show_default=True,
              help="medusa: heads in the Medusa authors' layout (use with --speculate-method medusa).")
@click.option("--model", default="smollm2-135m", show_default=True, help="The frozen base model.")
@click.option("--num-heads", default=4, show_default=True, type=int)
@click.option("--num-layers", default=1, show_default=True, type=int, help="ResBlocks per head.")
@click.option("--dataset", default=None, help="Text data besides the self-distilled chat answers.")
@click.option("--steps", default=300, show_default=True, type=int)
@click.option("--batch-size", default=4, show_default=True, type=int, help="Windows' worth of positions per step.")
@click.option("--seq-len", default=256, show_default=True, type=int)
@click.option("--lr", default=1e-3, show_default=True, type=float)
@click.option("--chat-prompts", default=None, type=click.IntRange(min=1),
              help="How many of the built-in chat prompts the base answers [default: all].")
@click.option("--max-new-tokens", default=160, show_default=True, type=int, help="Length of each self-distilled answer.")
@click.option("--draft-vocab-size", default=4096, show_default=True, type=int,
              help="Tokens the heads score when drafting (the most frequent targets).")
@click.option("--save-every", default=100, show_default=True, type=int, help="Checkpoint interval (steps).")
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--out", required=True, type=click.Path(file_okay=False), help="Head artifact directory.")
@click.option("--resume", is_flag=True, help="Continue the checkpoint in --out (same data; --steps may grow).")
@_one_line_errors
@_threads_option
def train_draft_head(**kw):
    """Train draft heads for a frozen base by self-distillation (Medusa)."""
    from quantspec import api
    from quantspec.console import Progress

    with Progress(f"train-draft-head ({kw['kind']})") as progress:
        res = api.train_draft_head(on_step=lambda step, total, loss: progress.fraction(step, total, f"loss {loss:.3f}"),
                                   on_status=progress.status, **kw)
    if res["positions"] is None:
        progress.console.print(f"{res['out']} is already trained to {res['start_step']} steps: nothing to do")
        return
    progress.console.print(f"[green]wrote[/] {res['out']}  (steps {res['start_step']}→{res['steps']}, loss "
                           f"{res['loss_first']:.3f} → {res['loss_last']:.3f}, {res['positions']} positions, "
                           f"{res['wall_s']:.0f} s)")


# ---- quantize / inspect / eval ------------------------------------------------------------------

def _gib(n) -> str:
    return "?" if n is None else f"{n / 2**20:,.1f} MiB"


@main.command()
@click.option("--model", default="smollm2-135m", show_default=True, help="zoo name, HF directory or hub id")
@click.option("--quant-type", required=True, help="weight_only_int8 | weight_only_int4 | a8w8 | a8w8_fp8")
@click.option("--method", default="rtn", show_default=True, type=click.Choice(["rtn", "gptq"]))
@click.option("--group-size", default=128, show_default=True, type=int,
              help="int4 group size along K (-1: per channel); a size that does not divide a layer's K is lowered for that layer")
@click.option("--sym/--asym", "symmetric", default=True, show_default=True)
@click.option("--zp-dtype", default="int", show_default=True,
              type=click.Choice(["int", "float16", "bfloat16", "float32"]),
              help="weight_only_int4 --asym: zero-point dtype; a float one is stored unrounded "
                   "(compressed-tensors' zp_dtype), e.g. to reproduce GGUF Q4_1-style grids")
@click.option("--weight-observer", default="auto", show_default=True, type=click.Choice(["auto", "minmax", "mse"]),
              help="weight scales: min/max, or mse = per scale, the clipping of the range (down to 0.8) "
                   "with the least |w - q(w)|^2.4 (RTN, and each GPTQ group); auto: mse for "
                   "weight_only_int4, minmax for the 8-bit types")
@click.option("--ignore", multiple=True, help="module name or re:regex to keep unquantized (repeatable; lm_head always)")
@click.option("--act-order", is_flag=True, help="GPTQ: quantize columns in order of decreasing Hessian diagonal")
@click.option("--block-size", "gptq_block_size", default=128, show_default=True, type=int, help="GPTQ lazy-update block")
@click.option("--damp", default=0.01, show_default=True, type=float, help="GPTQ damping (fraction of mean diag H)")
@click.option("--dataset", default=None, help="calibration data: .txt/.json/.jsonl/.parquet file or hub id")
@click.option("--split", default="train", show_default=True)
@click.option("--text-field", default="text", show_default=True)
@click.option("--num-samples", default=128, show_default=True, type=int)
@click.option("--seq-len", default=512, show_default=True, type=int)
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--calib", default=None, type=click.Path(), help="calibration table dir (a8w8 types)")
@click.option("--smoothquant-alpha", default=None,
              help="a8w8 types: SmoothQuant migration strength in (0, 1), 'auto' (searched per "
                   "smoothing group on calibration data; the default) or 'none'")
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
@click.option("--out", required=True, type=click.Path(), help="artifact directory to write")
@click.option("--overwrite", is_flag=True, help="replace a non-empty --out")
@click.option("--device", default="auto", show_default=True,
              help="where each layer is quantized (the rest stays on disk): auto, cpu, cuda, cuda:N")
@click.option("--restart", is_flag=True,
              help="start over: discard the state an interrupted run of a big model left beside --out")
@_one_line_errors
@_threads_option
def quantize(model, quant_type, method, group_size, symmetric, zp_dtype, weight_observer, ignore, act_order, gptq_block_size, damp,
             dataset, split, text_field, num_samples, seq_len, seed, calib, smoothquant_alpha,
             fallback_budget, fallback_layers, fallback_threshold, out, overwrite, device, restart, kv_cache=None,
             kv_strategy=None, target="portable"):
    """Quantize a checkpoint into a compressed-tensors artifact directory."""
    import time

    from quantspec import api
    from quantspec.console import Progress

    if smoothquant_alpha is not None and smoothquant_alpha not in ("auto", "none"):
        try:
            smoothquant_alpha = float(smoothquant_alpha)
        except ValueError:
            raise click.BadParameter(f"{smoothquant_alpha!r} is neither a number, 'auto' nor 'none'",
                                     param_hint="--smoothquant-alpha") from None
    t0 = time.perf_counter()
    with Progress(f"quantize {quant_type}") as progress:
        path = api.quantize(model, quant_type, out, method=method, group_size=group_size,
                            symmetric=symmetric, zp_dtype=None if zp_dtype == "int" else zp_dtype,
                            weight_observer=None if weight_observer == "auto" else weight_observer,
                            ignore=tuple(ignore), act_order=act_order,
                            block_size=gptq_block_size, damp=damp, dataset=dataset, split=split,
                            text_field=text_field, num_samples=num_samples, seq_len=seq_len, seed=seed,
                            calib=calib, smoothquant_alpha=smoothquant_alpha, overwrite=overwrite,
                            kv_cache=kv_cache, kv_strategy=kv_strategy, target=target,
                            fallback_layers=fallback_layers,
                            fallback_threshold=fallback_threshold, fallback_budget=fallback_budget,
                            device=device, restart=restart, progress=progress.layer, on_status=progress.status)
    info = api.inspect(path)
    progress.console.print(f"[green]wrote[/] {path}  ({_gib(info['weights_bytes'])}, "
                           f"{info.get('compression_ratio') or '?'}x smaller than the source, "
                           f"{time.perf_counter() - t0:.1f} s)")


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
        names = ", ".join(u["linears"][0].rsplit(".", 1)[0] + "." + "/".join(n.rsplit(".", 1)[1] for n in u["linears"])
                          + f" ({u['error']:.3g})" for u in units)
        rows.append(("fallback (weight-only)", f"{len(units)} units, {sum(len(u['linears']) for u in units)} "
                                               f"Linears, by measured error: {names}"))
    return rows


@main.command()
@click.argument("path", type=click.Path())
@click.option("--json", "as_json", is_flag=True, help="print the full description as JSON")
@_one_line_errors
def inspect(path, as_json):
    """Describe an artifact: scheme, per-layer bits / group size, size and compression ratio."""
    import json
    from collections import Counter

    from rich.table import Table

    from quantspec import api
    from quantspec.console import out_console
    from quantspec.quant.engines import ENGINE_NAMES

    info = api.inspect(path)
    if as_json:
        click.echo(json.dumps(info, indent=2, default=str))
        return
    console = out_console()
    head = Table(title=f"quantspec inspect {info['path']}", show_header=False)
    head.add_row("quantized", str(info["quantized"]))
    for key in ("quant_type", "format", "method", "quantspec_version"):
        if info.get(key) is not None:
            head.add_row(key, str(info[key]))
    if info.get("ignore") is not None:
        head.add_row("ignore", ", ".join(info["ignore"]) or "-")
    head.add_row("weights on disk", _gib(info["weights_bytes"]))
    if info.get("source_size_bytes"):
        head.add_row("source weights", _gib(info["source_size_bytes"]))
        head.add_row("compression ratio", f"{info['compression_ratio']}x")
    if info.get("static_activation_linears") is not None:
        head.add_row("static activations", f"{info['static_activation_linears']} of "
                                           f"{len(info['layers'])} Linears")
        for key, value in _fallback_rows(info.get("fallback")):
            head.add_row(key, value)
    if info.get("kv_cache"):
        head.add_row("kv cache", f"{info['kv_cache']['type']}{info['kv_cache']['num_bits']} "
                                 f"{info['kv_cache']['strategy']}")
    for engine in (info.get("engines") or {}).values():
        head.add_row(ENGINE_NAMES[engine["engine"]], engine["verdict"])
    console.print(head)
    if not info["quantized"]:
        return
    # one row per (module kind, scheme): e.g. q_proj ×30 int4 g64 sym
    rows = Counter()
    for name, d in info["layers"].items():
        kind = name.rsplit(".", 1)[-1]
        rows[(kind, d["type"], d["bits"], d["strategy"], d["group_size"], d["symmetric"],
              d.get("zp_dtype") or "-", d["input_activations"] or "-")] += 1
    t = Table(title="quantized Linears")
    for col in ("module", "count", "weights", "granularity", "symmetric", "zero point",
                "activations"):
        t.add_column(col)
    for (kind, typ, bits, strat, g, sym, zp, act), n in sorted(rows.items(),
                                                              key=lambda r: str(r[0])):
        gran = f"group {g}" if strat == "group" else strat
        t.add_row(kind, str(n), f"{typ}{bits}", gran, "yes" if sym else "no", zp, act)
    console.print(t)


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
@click.option("--json", "as_json", is_flag=True, help="print the result as one JSON object")
@_one_line_errors
@_threads_option
def eval_(model, text_file, dataset, split, text_field, seq_len, max_windows, batch_size, dtype, kv_cache_dtype,
          calib, as_json, cachekv_int8_type="none", cachekv_fp8_type="none"):
    """Perplexity of a model or artifact over non-overlapping --seq-len windows."""
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
                           kv_cache_dtype=kv_cache_dtype, calib=calib,
                           progress=progress.fraction)
    if as_json:
        click.echo(json.dumps(res))
        return
    click.echo(f"perplexity {res['perplexity']:.4f}  (nll {res['nll']:.4f}, {res['num_windows']} windows × "
               f"{res['seq_len']} tokens, kv cache {res['kv_cache']}, {res['seconds']:.1f} s)")


@main.command()
@click.option("--model", default="smollm2-135m", show_default=True, help="Base model: zoo name or HF directory.")
@click.option("--speculate-method", default="draft", show_default=True,
              type=click.Choice(["draft", "mtp", "inference_with_reference"]))
@click.option("--draft-model", help="Draft model (default: the base model itself) or MTP module directory.")
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
@click.option("--quant-method", default="rtn", show_default=True, type=click.Choice(["rtn", "gptq"]))
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
@_one_line_errors
@_threads_option
def report(**kw):
    """Measure which (base quant × draft quant × KV cache) pairs work, stay lossless, and how fast."""
    from quantspec import api
    from quantspec.console import err_console, out_console
    from quantspec.report import ReportConfig
    from quantspec.report.render import rich_table

    console = err_console()
    kw["symmetric"] = not kw.pop("asym")
    kw["zp_dtype"] = None if kw["zp_dtype"] == "int" else kw["zp_dtype"]
    config = ReportConfig(**kw)

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
@_one_line_errors
@_threads_option
def calibrate(model, dataset, out, **kw):
    """Measure static activation and KV-cache scales (scales.safetensors + calibration.json)."""
    from quantspec import api
    from quantspec.console import Progress

    with Progress(f"calibrate ({kw['observer']})") as progress:
        res = api.calibrate(model, dataset, out, progress=progress.layer, on_status=progress.status, **kw)
    m = res.meta
    progress.console.print(f"[green]wrote[/] {res.path}  ({m['num_layers']} layers, {m['num_samples']} × "
                           f"{m['seq_len']} tokens, observer {m['observer']}, fingerprint "
                           f"{m['model_fingerprint']}, {res.wall_s:.1f} s)")


if __name__ == "__main__":  # python -m quantspec.cli (what tests and benches start servers with)
    main()
