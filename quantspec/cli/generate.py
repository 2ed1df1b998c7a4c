"""`quantspec infer` and `quantspec serve`: flags → `InferConfig` / `ServeConfig` → `api.infer` / `api.serve`."""

from __future__ import annotations

import click

from quantspec.cli.group import main, one_line_errors, threads_option
from quantspec.cli.speculative import speculative_config_option
from quantspec.errors import QuantSpecError

# vLLM's --kv-cache-dtype values and int8 (`InferConfig.cachekv` reads them)
KV_CACHE_CHOICES = ("auto", "fp8", "fp8_e4m3", "int8", "float")

kv_cache_dtype_option = click.option(
    "--kv-cache-dtype", default="auto", show_default=True, type=click.Choice(KV_CACHE_CHOICES),
    help="KV cache: auto (the artifact's static int8 / fp8 scales where it has them, else the model's dtype), "
         "fp8 / fp8_e4m3 or int8 (static, scales from the artifact or --calib), float (the model's dtype "
         "even where the artifact has KV scales).")

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


def _structured_output(json_schema, regex, choice, grammar) -> dict:
    """`InferConfig`'s structured_output and the flag that gave it, from infer's flags (at most one)."""
    import json
    from pathlib import Path

    given = [(f, v) for f, v in (("--json-schema", json_schema), ("--regex", regex), ("--choice", choice),
                                 ("--grammar", grammar)) if v]
    if len(given) > 1:
        raise QuantSpecError(f"give one of {given[0][0]} and {given[1][0]}")
    if not given:
        return {}
    flag, value = given[0]
    if flag in ("--json-schema", "--grammar"):
        path = Path(value)
        if not path.is_file():
            raise QuantSpecError(f"{flag} {value} does not exist" if not path.exists() else f"{flag} {value} is not a file")
        try:
            value = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise QuantSpecError(f"{flag} {value}: not UTF-8; save the file as UTF-8") from None
    kind = {"--json-schema": "json", "--regex": "regex", "--choice": "choice", "--grammar": "grammar"}[flag]
    spec = json.dumps(list(value)) if kind == "choice" else value
    return {"structured_output": (kind, spec), "structured_flag": flag}


@main.command()
@click.option("--model", default="smollm2-135m", show_default=True,
              help="Zoo name, local HF directory, quantspec artifact, or hub id.")
@click.option("--prompt", help="One prompt; its answer streams to the terminal.")
@click.option("--data-file", type=click.Path(dir_okay=False), help="jsonl with a `src` field per line.")
@click.option("--output-file", type=click.Path(dir_okay=False),
              help="jsonl: each input row + output, output_token_ids (and output_logprobs with --logprobs).")
@click.option("--batch-size", default=1, show_default=True, help="Sequences decoded together.")
@click.option("--src-length", type=int, default=None, help="Max prompt tokens [default: max-length - max-new-tokens].")
@click.option("--max-length", default=None, type=int,
              help="Max prompt + generated tokens per sequence [default: 2048, or the model's sliding window or "
                   "original context where shorter].")
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
@click.option("--min-p", default=0.0, show_default=True,
              help="Keep tokens at least this fraction as likely as the most likely one; 0 = off.")
@click.option("--seed", type=int, default=None)
@click.option("--stop", multiple=True, help="Stop string (repeatable).")
@click.option("--ignore-eos", is_flag=True, help="Generate --max-new-tokens tokens whatever EOS the model emits.")
@click.option("--logprobs", type=int, default=None,
              help="Write each output token's log-probability, and the N most likely tokens', into the --output-file rows.")
@click.option("--repetition-penalty", default=1.0, show_default=True,
              help="Divide positive logits (multiply negative ones) of tokens already in the prompt or output; 1 = off.")
@click.option("--presence-penalty", default=0.0, show_default=True,
              help="Subtract from the logits of tokens already in the output, in [-2, 2]; 0 = off.")
@click.option("--frequency-penalty", default=0.0, show_default=True,
              help="Subtract per occurrence in the output, in [-2, 2]; 0 = off.")
@click.option("--no-chat-template", is_flag=True, help="Send the prompt as raw text.")
@click.option("--cachekv-int8-type", type=click.Choice(["none", "static"]), default="none", show_default=True,
              help="static: int8 KV cache with calibrated per-head scales.")
@click.option("--cachekv-fp8-type", type=click.Choice(["none", "static"]), default="none", show_default=True,
              help="static: FP8 E4M3 KV cache with calibrated per-head scales.")
@click.option("--calib", type=click.Path(file_okay=False), help="Calibration directory (scale tables) for a static KV cache.")
@kv_cache_dtype_option
@click.option("--speculate-method", default="none", show_default=True,
              type=click.Choice(["none", "inference_with_reference", "draft", "mtp", "medusa", "eagle"]))
@click.option("--draft-model", help="Draft model, MTP module, Medusa heads or EAGLE-3 head (directory or artifact).")
@click.option("--speculate-tree", default=None,
              help="medusa, eagle: verify a token tree DxK (D draft positions, K candidates each, e.g. 4x2) instead of a chain, or DxK:N: a dynamic tree of the N most probable drafts (e.g. 4x4:8).")
@click.option("--speculate-max-draft-token-num", default=5, show_default=True, help="Draft tokens per step.")
@click.option("--speculate-max-ngram-size", default=3, show_default=True, help="Longest n-gram tried first.")
@click.option("--speculate-min-ngram-size", default=1, show_default=True, type=int, help="Shortest n-gram tried.")
@click.option("--speculate-backoff/--no-speculate-backoff", default=True, show_default=True,
              help="Adapt drafts per sequence to measured acceptance and cost (never much slower than plain decoding).")
@click.option("--speculate-min-confidence", type=float, default=None,
              help="mtp, eagle, medusa: stop drafting at a draft whose probability is below this (a tree "
                   "always drafts its first depth) [default: 0.4].")
@click.option("--speculate-draft-head", type=click.Choice(["int8", "artifact"]), default=None,
              help="draft: score drafts with the draft model's head rounded to int8 (faster on CPU, output "
                   "unchanged) or with its own head [default: int8].")
@click.option("--json-schema", type=click.Path(dir_okay=False), help="Hold each answer to the JSON schema in this file.")
@click.option("--regex", help="Hold each answer to this regular expression.")
@click.option("--choice", multiple=True, help="Each answer is one of these strings (repeatable).")
@click.option("--grammar", type=click.Path(dir_okay=False), help="Hold each answer to the EBNF grammar in this file (start rule: root).")
@click.option("--enable-prefix-caching", is_flag=True,
              help="Prompts skip the prefill of whole KV blocks an earlier prompt or answer filled (shared system prompts, few-shot preambles).")
@click.option("--kv-cache-memory", default=None,
              help="KV cache size (e.g. 4GiB): the batch holds the sequences it does, the newest preempted and recomputed where it runs out [default: --batch-size sequences of --max-length, on CUDA at most what --gpu-memory-utilization leaves].")
@click.option("--enforce-eager", is_flag=True, help="On CUDA: no CUDA graphs for the decode steps (as vLLM's).")
@click.option("--gpu-memory-utilization", default=0.9, show_default=True, type=float,
              help="CUDA, without --kv-cache-memory: the share of the GPU's memory in use at most once the KV cache is allocated.")
@click.option("--benchmark", is_flag=True, help="Print TTFT, TPOT, tokens/s and peak memory.")
@click.option("--stats-file", type=click.Path(dir_okay=False), help="Write the benchmark statistics as JSON.")
@one_line_errors
@threads_option
@speculative_config_option
def infer(prompt, data_file, output_file, stats_file, no_chat_template, cachekv_int8_type, cachekv_fp8_type, calib,
          kv_cache_dtype, json_schema, regex, choice, grammar, **kw):
    """Generate text with a model or a quantized artifact (optionally speculating)."""
    import json

    from quantspec import api
    from quantspec.console import err_console, stream_to_stdout
    from quantspec.outputs import check_output_file, write_json

    if cachekv_int8_type == "static" and cachekv_fp8_type == "static":
        raise QuantSpecError("choose one of --cachekv-int8-type and --cachekv-fp8-type")
    cachekv = "int8" if cachekv_int8_type == "static" else "fp8" if cachekv_fp8_type == "static" else "none"
    if kv_cache_dtype != "auto":
        if cachekv != "none":
            raise QuantSpecError("choose one of --kv-cache-dtype and --cachekv-int8-type / --cachekv-fp8-type")
        cachekv = kv_cache_dtype
    if prompt is None and data_file is None:
        raise QuantSpecError("give --prompt TEXT or --data-file FILE.jsonl")
    kw.update(_structured_output(json_schema, regex, choice, grammar))
    config = api.InferConfig(chat_template=not no_chat_template, cachekv=cachekv, **kw)
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
@click.option("--max-batch-size", "--max-num-seqs", "max_batch_size", default=16, show_default=True, type=int,
              help="Sequences decoded together (vLLM's --max-num-seqs).")
@click.option("--max-queue", default=256, show_default=True, type=int,
              help="Requests that may wait for the batch; more are answered 503 with Retry-After.")
@click.option("--max-length", "--max-model-len", "max_length", default=None, type=int,
              help="Max prompt + generated tokens per request (vLLM's --max-model-len) [default: 2048, or the "
                   "model's sliding window or original context where shorter].")
@click.option("--prefill-chunk", default=256, show_default=True, type=int,
              help="Prompt tokens per chunk: prompts are prefilled a chunk per step, between decode steps.")
@click.option("--max-prefill-tokens", "--max-num-batched-tokens", "max_prefill_tokens", default=1024, show_default=True,
              type=int, help="Prompt tokens per prefill step, at most (chunks of several prompts share a step; vLLM's --max-num-batched-tokens).")
@click.option("--drain-timeout", default=30.0, show_default=True, type=float,
              help="On SIGTERM, seconds to let requests in flight finish.")
@click.option("--dtype", default="auto", show_default=True, type=click.Choice(["auto", "float32", "bfloat16", "float16"]))
@click.option("--device", default="auto", show_default=True, help="auto, cpu, cuda, cuda:N.")
@click.option("--block-size", default=64, show_default=True, type=int, help="Paged KV cache block size (tokens).")
@click.option("--speculate-method", default="none", show_default=True,
              type=click.Choice(["none", "inference_with_reference", "draft", "mtp", "medusa", "eagle"]))
@click.option("--draft-model", help="Draft model, MTP module, Medusa heads or EAGLE-3 head (directory or artifact).")
@click.option("--speculate-tree", default=None,
              help="medusa, eagle: verify a token tree DxK (D draft positions, K candidates each, e.g. 4x2) instead of a chain, or DxK:N: a dynamic tree of the N most probable drafts (e.g. 4x4:8).")
@click.option("--speculate-max-draft-token-num", default=5, show_default=True, type=int, help="Most drafts per step.")
@click.option("--speculate-max-ngram-size", default=3, show_default=True, type=int, help="Longest n-gram tried first.")
@click.option("--speculate-min-ngram-size", default=1, show_default=True, type=int, help="Shortest n-gram tried.")
@click.option("--load-aware/--no-load-aware", default=True, show_default=True,
              help="Choose drafts per step from the batch size and measured step costs (no drafts where they cost more than they save).")
@click.option("--enable-prefix-caching", is_flag=True,
              help="Prompts skip the prefill of whole KV blocks an earlier request filled (shared system prompts, a chat's earlier turns).")
@click.option("--kv-cache-memory", default=None,
              help="KV cache size (e.g. 4GiB): the batch holds the sequences it does, the newest preempted and recomputed where it runs out [default: --max-batch-size sequences of --max-length, on CUDA at most what --gpu-memory-utilization leaves].")
@click.option("--gpu-memory-utilization", default=0.9, show_default=True, type=float,
              help="CUDA, without --kv-cache-memory: the share of the GPU's memory in use at most once the KV cache is allocated.")
@click.option("--scheduling-policy", default="fcfs", show_default=True, type=click.Choice(["fcfs", "priority"]),
              help="fcfs: requests in arrival order; priority: a request's 'priority' first (lower first, 0 by default), preempting running requests of a larger one.")
@click.option("--enable-auto-tool-choice", is_flag=True,
              help="Serve tool_choice 'auto' (OpenAI's default with tools): the model's own tool calls, found by --tool-call-parser.")
@click.option("--generation-config", default="auto", show_default=True,
              help="Defaults of the sampling fields a request leaves out (temperature, top_p, top_k, min_p, repetition_penalty, max_tokens): auto, the model's generation_config.json; vllm, none (OpenAI's); or a directory holding one.")
@click.option("--override-generation-config", default=None,
              help="JSON of request defaults over the generation config's, e.g. '{\"temperature\": 0.6, \"top_p\": 0.95}' (temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens).")
@click.option("--chat-template", default=None,
              help="A Jinja chat template (a file, or the template itself) in place of the tokenizer's.")
@click.option("--reasoning-parser", default=None, type=click.Choice(["deepseek_r1", "qwen3"]),
              help="Chat answers' thinking (up to </think>) goes to reasoning_content, the rest to content: deepseek_r1 (DeepSeek-R1 and its distillations, QwQ: always thinks first), qwen3 (thinks where the answer or the prompt opens <think>; enable_thinking false: all content).")
@click.option("--tool-call-parser", default=None, type=click.Choice(["hermes", "llama3_json", "pythonic", "mistral"]),
              help="The model's tool-call syntax: hermes (<tool_call> blocks: Hermes, Qwen 2.5 / 3), llama3_json (Llama 3.1-3.3), pythonic ([f(a=1)]: Llama 3.2 / 4 with a pythonic template) or mistral ([TOOL_CALLS]: Mistral's models).")
@click.option("--allowed-origins", default="",
              help="Browser origins answered with CORS headers: a JSON list (vLLM's form) or comma-separated; \"*\": any [default: none, no CORS].")
@click.option("--allow-credentials", is_flag=True, help="CORS: allow credentials (cookies, Authorization) from those origins.")
@click.option("--ssl-keyfile", default=None, help="Serve HTTPS with this PEM private key (with --ssl-certfile).")
@click.option("--ssl-certfile", default=None, help="Serve HTTPS with this PEM certificate (with --ssl-keyfile).")
@kv_cache_dtype_option
@click.option("--calib", type=click.Path(file_okay=False),
              help="Calibration directory whose KV scales a static --kv-cache-dtype fp8 / int8 cache uses (over the artifact's).")
@click.option("--max-stored-responses", default=1000, show_default=True, type=click.IntRange(min=0),
              help="Responses API answers kept (least recently used out) for previous_response_id, background runs and retrieval; 0: none.")
@click.option("--enable-log-requests", is_flag=True,
              help="A line per request accepted (id, prompt tokens, sampling; never its text) and per one done (output tokens, first-token and total time).")
@click.option("--root-path", default="", help="The path prefix (e.g. /llm) of a reverse proxy that serves the API under it and strips it before forwarding (ASGI root_path, as vLLM's).")
@click.option("--uvicorn-log-level", default="warning", show_default=True,
              type=click.Choice(["critical", "error", "warning", "info", "debug", "trace"]),
              help="uvicorn's own logs (debug and trace add its access log).")
@click.option("--enforce-eager", is_flag=True, help="On CUDA: no CUDA graphs for the decode steps (as vLLM's).")
@click.option("--seed", default=None, type=int,
              help="vLLM's: seeds the random stream of the requests that send no seed of their own.")
@click.option("--tensor-parallel-size", "-tp", default=1, type=int, help="vLLM's: 1 (quantspec serves on one device).")
@click.option("--pipeline-parallel-size", "-pp", default=1, type=int, help="vLLM's: 1 (quantspec serves on one device).")
@click.option("--trust-remote-code", is_flag=True,
              help="Accepted as vLLM's: quantspec builds the architectures it runs from its own code and runs none of a checkpoint's.")
@click.option("--quantization", "-q", default=None, type=click.Choice(["compressed-tensors"]),
              help="vLLM's: the artifact's own format, checked against --model (compressed-tensors, what quantspec writes).")
@click.option("--disable-log-stats", is_flag=True,
              help="No stats line (throughput, running / waiting requests, KV-cache use, draft acceptance) every 10 s while busy.")
@click.option("--api-key", default=None, envvar="QUANTSPEC_API_KEY", show_envvar=True,
              help="Clients must send 'Authorization: Bearer KEY' (every route but /health and /metrics).")
@click.argument("model_tag", required=False, metavar="[MODEL]")
@one_line_errors
@threads_option
@speculative_config_option
def serve(model_tag, **kw):
    """Serve a model over OpenAI's HTTP API (chat and completions, streaming, /metrics).

    MODEL, as vLLM's `vllm serve MODEL`, is another way to give --model."""
    from click.core import ParameterSource

    from quantspec import api
    from quantspec.console import err_console
    from quantspec.errors import QuantSpecError, Terminated

    if model_tag is not None:
        if click.get_current_context().get_parameter_source("model") is not ParameterSource.DEFAULT:
            raise QuantSpecError(f"the model is given twice ({model_tag} and --model {kw['model']}); give it once "
                                 "(--served-model-name takes one name)")
        kw["model"] = model_tag
    config = api.ServeConfig(**kw)
    console = err_console()

    def ready(url, kv_cache, defaults):
        cache = f"KV cache {kv_cache}" + (", prefix caching" if config.enable_prefix_caching else "")
        console.print(f"[green]serving[/] {config.served_model_name} at {url}/v1, {cache}  "
                      "(Ctrl-C or SIGTERM stops, draining requests in flight)")
        if defaults:
            console.print("requests that leave them out get the model's generation config: "
                          + ", ".join(f"{k}={v}" for k, v in defaults.items()) + " (--generation-config vllm: none)")

    try:
        api.serve(config, on_ready=ready, on_stats=lambda line: console.print(line, highlight=False, markup=False))
    except (Terminated, KeyboardInterrupt):
        pass
    console.print("stopped")
