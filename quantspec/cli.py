"""The `quantspec` command line: a thin click layer over `quantspec.api`.

Each command parses flags into one config object, calls one API function and renders the result
with rich. A `QuantSpecError` (bad input) prints as one red line and exits with status 2; any other
exception is a bug and keeps its traceback.
"""

from __future__ import annotations

import functools
import sys

import click

from quantspec import __version__
from quantspec.errors import QuantSpecError

__all__ = ["main"]


def _one_line_errors(fn):
    """Turn QuantSpecError (and Ctrl-C) into one line on stderr and a non-zero exit."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except QuantSpecError as e:
            click.secho(f"error: {e}", fg="red", err=True)
            sys.exit(2)
        except KeyboardInterrupt:
            click.secho("interrupted; nothing partial was left behind", fg="yellow", err=True)
            sys.exit(130)

    return wrapper


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
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
@click.option("--dtype", default="float32", show_default=True, type=click.Choice(["float32", "bfloat16", "float16"]))
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
              type=click.Choice(["none", "inference_with_reference", "draft", "mtp"]))
@click.option("--draft-model", help="Draft model or MTP module (directory or artifact).")
@click.option("--speculate-max-draft-token-num", default=5, show_default=True, help="Draft tokens per step.")
@click.option("--speculate-max-ngram-size", default=3, show_default=True, help="Longest n-gram tried first.")
@click.option("--benchmark", is_flag=True, help="Print TTFT, TPOT, tokens/s and peak memory.")
@click.option("--stats-file", type=click.Path(dir_okay=False), help="Write the benchmark statistics as JSON.")
@_one_line_errors
def infer(prompt, data_file, output_file, stats_file, no_chat_template, cachekv_int8_type, cachekv_fp8_type, **kw):
    """Generate text with a model or a quantized artifact (optionally speculating)."""
    import json

    from rich.console import Console

    from quantspec import api
    from quantspec.infer.predictor import InferConfig, stream_to_stdout

    if cachekv_int8_type == "static" and cachekv_fp8_type == "static":
        raise QuantSpecError("choose one of --cachekv-int8-type and --cachekv-fp8-type")
    cachekv = "int8" if cachekv_int8_type == "static" else "fp8" if cachekv_fp8_type == "static" else "none"
    if prompt is None and data_file is None:
        raise QuantSpecError("give --prompt TEXT or --data-file FILE.jsonl")
    config = InferConfig(chat_template=not no_chat_template, cachekv=cachekv, **kw)
    single = prompt is not None
    outs, stats = api.infer(config, [prompt] if single else None, data_file=data_file,
                            output_file=output_file, on_text=stream_to_stdout if single else None)
    console = Console(stderr=True)
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
        with open(stats_file, "w") as f:
            json.dump(stats, f, indent=2)
