"""`quantspec serve`: load the model once, start the engine loop, run uvicorn until SIGTERM / Ctrl-C.

`ServeConfig` holds the server's knobs and validates them when built (messages name the flag).
`load(config)` builds the model, the engine and its load-aware speculation (`infer/spec/load.py`,
its step costs measured at start-up) and returns a `ServeState`; `build(config)` wraps that in
the FastAPI app; `run(config)` serves it. On SIGTERM uvicorn stops accepting connections and waits
for the requests in flight (at most `drain_timeout` seconds), then the loop stops and the
process exits.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from quantspec.errors import QuantSpecError, positive_int
from quantspec.infer.loader import SAMPLING_DEFAULT_KEYS, read_sampling_defaults
from quantspec.infer.predictor import KV_CACHE_DTYPES, InferConfig, Predictor
from quantspec.model_zoo.default import DEFAULT_MODEL
from quantspec.serve.app import DEFAULT_STORED_RESPONSES, ServeState, build_app
from quantspec.serve.loop import EngineLoop
from quantspec.serve.metrics import Metrics, StatsLog
from quantspec.serve.reasoning import REASONING_PARSERS, reasoning_parser
from quantspec.serve.response_store import ResponseStore
from quantspec.serve.tool_parsers import TOOL_PARSERS, tool_parser

__all__ = ["ServeConfig", "build", "load", "run"]

log = logging.getLogger("quantspec.serve")
UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


@dataclass
class ServeConfig:
    model: str = DEFAULT_MODEL
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None  # the name clients send as `model` (default: --model)
    max_batch_size: int = 16
    max_queue: int = 256
    max_length: int | None = None  # None: InferConfig's default (2048, or the model's context limit)
    prefill_chunk: int = 256
    max_prefill_tokens: int = 1024  # prompt tokens per prefill step (chunks of several prompts)
    drain_timeout: float = 30.0
    dtype: str = "auto"
    device: str = "auto"
    block_size: int = 64
    speculate_method: str = "none"
    draft_model: str | None = None
    speculate_tree: str | None = None  # medusa / eagle: a token tree DxK (or dynamic DxK:N) instead of a chain
    speculate_max_draft_token_num: int = 5
    speculate_max_ngram_size: int = 3
    speculate_min_ngram_size: int = 1
    load_aware: bool = True  # cap drafts per step by the batch and measured step costs
    enable_prefix_caching: bool = False  # prompts skip the prefill of cached leading KV blocks
    kv_cache_memory: int | str | None = None  # KV cache bytes ("4GiB"); None: max_batch_size full sequences
    scheduling_policy: str = "fcfs"  # "priority": requests' `priority` orders admission and preemption
    gpu_memory_utilization: float = 0.9  # on CUDA without kv_cache_memory: the device share in use at most
    enable_auto_tool_choice: bool = False  # tool_choice "auto": the model's calls found by `tool_call_parser`
    tool_call_parser: str | None = None  # a key of `tool_parsers.TOOL_PARSERS`
    reasoning_parser: str | None = None  # a key of `reasoning.REASONING_PARSERS`: thinking split from content
    # request defaults of the sampling fields a request leaves out: "auto" the model's
    # generation_config.json (as vLLM), "vllm" none (OpenAI's), or a directory holding one
    generation_config: str = "auto"
    # vLLM's --override-generation-config: JSON of those defaults, over what generation_config gives
    override_generation_config: str | dict | None = None
    # a Jinja chat template in place of the tokenizer's: a file, or the template's text; read when built
    chat_template: str | None = None
    api_key: str | None = field(default=None, repr=False)  # clients must send it as a bearer token
    disable_log_stats: bool = False  # no periodic stats line (`metrics.StatsLog`)
    enable_log_requests: bool = False  # a line per request accepted and per one done (`loop.accepted_line`)
    root_path: str = ""  # ASGI root_path: the prefix a reverse proxy serves the API under and strips
    # vLLM launch flags: no CUDA graphs; one device (1 only); no remote code is ever run (accepted);
    # the checkpoint's own quantization ("compressed-tensors", checked against --model)
    enforce_eager: bool = False
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    trust_remote_code: bool = False
    quantization: str | None = None
    uvicorn_log_level: str = "warning"
    max_stored_responses: int = DEFAULT_STORED_RESPONSES  # Responses API answers kept (`response_store.py`)
    seed: int | None = None  # vLLM's --seed: torch's global generator seeded, the stream of requests sending none
    # KV cache (vLLM's names, `infer.predictor.KV_CACHE_DTYPES`): auto (the artifact's static scheme
    # if any), fp8 / fp8_e4m3 / int8 (static; scales from `calib`, else the artifact's), float
    kv_cache_dtype: str = "auto"
    calib: str | None = None
    # deployment: browser origins answered with CORS headers (vLLM's JSON list, or comma-separated;
    # "*": any), TLS (both files, PEM)
    allowed_origins: tuple[str, ...] | str = ()
    allow_credentials: bool = False
    ssl_keyfile: str | None = None
    ssl_certfile: str | None = None

    def __post_init__(self):
        for name in ("max_batch_size", "max_queue", "max_length", "prefill_chunk", "max_prefill_tokens"):
            if name != "max_length" or self.max_length is not None:
                positive_int(name, getattr(self, name))
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not 0 <= self.seed < 2 ** 63):
            raise QuantSpecError(f"--seed {self.seed!r} must be an integer in [0, 2**63)")
        if isinstance(self.port, bool) or not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise QuantSpecError(f"--port {self.port!r} must be in [0, 65535] (0: any free port)")
        if isinstance(self.max_stored_responses, bool) or not isinstance(self.max_stored_responses, int) \
                or self.max_stored_responses < 0:
            raise QuantSpecError(f"--max-stored-responses {self.max_stored_responses!r} must be an int >= 0 (0: none)")
        if self.uvicorn_log_level not in UVICORN_LOG_LEVELS:
            raise QuantSpecError(f"--uvicorn-log-level {self.uvicorn_log_level!r} is not one of "
                                 f"{', '.join(UVICORN_LOG_LEVELS)}")
        for flag, n in (("--tensor-parallel-size", self.tensor_parallel_size),
                        ("--pipeline-parallel-size", self.pipeline_parallel_size)):
            if n != 1:
                raise QuantSpecError(f"{flag} {n}: quantspec serves a model on one device per process; pass 1 (or "
                                     "leave it out) and run one server per device behind a load balancer")
        if self.quantization not in (None, "compressed-tensors"):
            raise QuantSpecError(f"--quantization {self.quantization!r}: quantspec serves compressed-tensors "
                                 "artifacts (their config says so); write one with `quantspec quantize` and leave "
                                 "--quantization out")
        if self.root_path and not self.root_path.startswith("/"):
            raise QuantSpecError(f"--root-path {self.root_path!r} must start with '/', e.g. /llm")
        if not self.drain_timeout >= 0:
            raise QuantSpecError(f"--drain-timeout {self.drain_timeout!r} must be >= 0 seconds")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise QuantSpecError("--enable-auto-tool-choice needs --tool-call-parser NAME (the model's tool-call "
                                 f"syntax: {', '.join(TOOL_PARSERS)})")
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_PARSERS:
            raise QuantSpecError(f"--tool-call-parser {self.tool_call_parser!r} is not one of {', '.join(TOOL_PARSERS)}")
        if self.tool_call_parser is not None and not self.enable_auto_tool_choice:
            raise QuantSpecError("--tool-call-parser is read for tool_choice 'auto' only; add --enable-auto-tool-choice")
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise QuantSpecError(f"--reasoning-parser {self.reasoning_parser!r} is not one of "
                                 f"{', '.join(REASONING_PARSERS)}")
        if self.generation_config not in ("auto", "vllm") and not Path(self.generation_config).expanduser().is_dir():
            raise QuantSpecError(f"--generation-config {self.generation_config!r} is not auto, vllm or a directory")
        if self.chat_template is not None:
            self.chat_template = _template_text(self.chat_template)
        self.override_generation_config = _overrides(self.override_generation_config)
        self.allowed_origins = _origins(self.allowed_origins)
        if (self.ssl_keyfile is None) != (self.ssl_certfile is None):
            raise QuantSpecError("TLS needs both --ssl-keyfile and --ssl-certfile")
        for flag, path in (("--ssl-keyfile", self.ssl_keyfile), ("--ssl-certfile", self.ssl_certfile)):
            if path is not None and not Path(path).expanduser().is_file():
                raise QuantSpecError(f"{flag} {path}: no such file")
        if self.calib is not None and KV_CACHE_DTYPES.get(self.kv_cache_dtype) not in ("fp8", "int8"):
            raise QuantSpecError("--calib gives static KV-cache scales: add --kv-cache-dtype fp8 or int8, or drop --calib")
        self.served_model_name = self.served_model_name or self.model
        self.infer_config()  # the engine's and speculation's own checks, before anything loads

    def infer_config(self) -> InferConfig:
        return InferConfig(model=self.model, dtype=self.dtype, device=self.device, batch_size=self.max_batch_size,
                           max_length=self.max_length, max_new_tokens=1, block_size=self.block_size,
                           speculate_method=self.speculate_method, draft_model=self.draft_model,
                           speculate_tree=self.speculate_tree,
                           speculate_max_draft_token_num=self.speculate_max_draft_token_num,
                           speculate_max_ngram_size=self.speculate_max_ngram_size,
                           speculate_min_ngram_size=self.speculate_min_ngram_size, prefill_chunk=self.prefill_chunk,
                           prefill_tokens=self.max_prefill_tokens,
                           enable_prefix_caching=self.enable_prefix_caching,
                           kv_cache_memory=self.kv_cache_memory, scheduling_policy=self.scheduling_policy,
                           gpu_memory_utilization=self.gpu_memory_utilization,
                           cachekv=self.kv_cache_dtype, enforce_eager=self.enforce_eager)


def _overrides(value: str | dict | None) -> dict:
    """`--override-generation-config`: a JSON object of request defaults (`SAMPLING_DEFAULT_KEYS`,
    numbers; vLLM's `max_tokens` / `max_new_tokens` for the output length)."""
    if value is None:
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise QuantSpecError(f"--override-generation-config is not JSON: {e.msg}") from None
    if not isinstance(value, dict):
        raise QuantSpecError("--override-generation-config must be a JSON object, e.g. '{\"temperature\": 0.6}'")
    out = {}
    for key, v in value.items():
        name = "max_new_tokens" if key == "max_tokens" else key
        if name not in SAMPLING_DEFAULT_KEYS or isinstance(v, bool) or not isinstance(v, (int, float)):
            raise QuantSpecError(f"--override-generation-config {key}={v!r}: give numbers for "
                                 f"{', '.join(SAMPLING_DEFAULT_KEYS)}")
        out[name] = v
    return out


def _origins(value: tuple[str, ...] | str) -> tuple[str, ...]:
    """`--allowed-origins`: vLLM's JSON list (`'["https://a.example"]'`) or comma-separated origins."""
    if not isinstance(value, str):
        return tuple(value)
    if value.strip().startswith("["):
        try:
            origins = json.loads(value)
        except ValueError:
            origins = None
        if not isinstance(origins, list) or not all(isinstance(o, str) for o in origins):
            raise QuantSpecError(f"--allowed-origins {value!r} is not a JSON list of origins; give "
                                 "'[\"https://app.example\"]' or comma-separated origins")
        return tuple(origins)
    return tuple(o.strip() for o in value.split(",") if o.strip())


def _template_text(value: str) -> str:
    """`--chat-template`: a file's text, or `value` itself where it is a Jinja template."""
    path = Path(value).expanduser()
    if "{{" not in value and "{%" not in value:
        try:
            return path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise QuantSpecError(f"--chat-template {value}: not a readable template file nor a template "
                                 f"({type(e).__name__})") from None
    return value


def load(config: ServeConfig, *, loaded=None, on_stats=None, kv_scales=None) -> ServeState:
    """The model, its engine and the engine loop (started); `loaded`: a `LoadedModel` to reuse;
    `on_stats(line)`: where the periodic stats lines (none without it or with `disable_log_stats`)
    and, with `enable_log_requests`, the request lines go; `kv_scales`: the (k, v) scales of `config.calib` for a static KV cache
    (`api.serve` reads them)."""
    if config.calib is not None and kv_scales is None:
        raise QuantSpecError("--calib's KV scales were not read: serve through api.serve, which reads them")
    predictor = Predictor(config.infer_config(), loaded=loaded, kv_scales=kv_scales)
    if config.quantization is not None and predictor.loaded.quant_config is None:
        raise QuantSpecError(f"--quantization {config.quantization}: {config.model} is not quantized; leave "
                             "--quantization out, or serve an artifact of `quantspec quantize`")
    if predictor.tokenizer is None:
        raise QuantSpecError(f"--model {predictor.loaded.model_dir} has no tokenizer files, which the server "
                             "encodes prompts and decodes answers with; copy the source model's into it")
    engine = predictor.engine
    engine.warm_up()  # CUDA: the decode steps' graphs, captured before any request waits on one
    if config.speculate_method != "none" and config.load_aware:
        from quantspec.infer.spec.load import LoadAwareDrafts, measure_step_costs

        k = engine.config.spec_max_draft_tokens
        rows = min(config.max_batch_size * (1 + k), 256)
        engine.draft_limit = LoadAwareDrafts(k, measure_step_costs(engine, rows))
    metrics = Metrics(config.served_model_name)
    defaults = ({} if config.generation_config == "vllm" else
                read_sampling_defaults(predictor.loaded.model_dir if config.generation_config == "auto"
                                       else Path(config.generation_config).expanduser()))
    defaults.update(config.override_generation_config)
    stats = None if on_stats is None or config.disable_log_stats else StatsLog(metrics, on_stats,
                                                                              now=time.perf_counter())
    request_log = on_stats if config.enable_log_requests else None
    loop = EngineLoop(engine, max_queue=config.max_queue, metrics=metrics, stats_log=stats, request_log=request_log)
    if config.seed is not None:  # after the warm-up forwards: the first request meets the seed's stream
        torch.manual_seed(config.seed)
    loop.start()
    return ServeState(loop=loop, tokenizer=predictor.tokenizer, model_name=config.served_model_name,
                      max_length=predictor.config.max_length, metrics=metrics, kv_cache=predictor.kv_cache,
                      api_key=config.api_key or None,
                      tool_parser=tool_parser(config.tool_call_parser) if config.enable_auto_tool_choice else None,
                      reasoning_parser=reasoning_parser(config.reasoning_parser) if config.reasoning_parser else None,
                      sampling_defaults=defaults, chat_template=config.chat_template,
                      responses=ResponseStore(config.max_stored_responses))


def build(config: ServeConfig, *, loaded=None, on_stats=None, kv_scales=None):
    """(FastAPI app, its state): the app stops the engine loop when it shuts down."""
    state = load(config, loaded=loaded, on_stats=on_stats, kv_scales=kv_scales)
    return build_app(state, on_shutdown=lambda: state.loop.stop(timeout=10), allowed_origins=config.allowed_origins,
                     allow_credentials=config.allow_credentials), state


def uvicorn_server(app, config: ServeConfig):
    import uvicorn

    uv = uvicorn.Config(app, host=config.host, port=config.port, log_level=config.uvicorn_log_level,
                        access_log=config.uvicorn_log_level in ("debug", "trace"), root_path=config.root_path,
                        timeout_graceful_shutdown=config.drain_timeout, lifespan="on",
                        ssl_keyfile=config.ssl_keyfile, ssl_certfile=config.ssl_certfile)
    return uvicorn.Server(uv)


def run(config: ServeConfig, *, on_ready=None, on_stats=None, kv_scales=None) -> None:
    """Serve until SIGTERM or Ctrl-C (drained, see the module docstring). `on_ready(url, kv_cache,
    sampling_defaults)` is called once the model is loaded, before uvicorn binds; `on_stats(line)`
    gets the periodic stats lines; `kv_scales`: as `load`'s."""
    app, state = build(config, on_stats=on_stats, kv_scales=kv_scales)
    if on_ready is not None:
        scheme = "https" if config.ssl_certfile else "http"
        on_ready(f"{scheme}://{config.host}:{config.port}", state.kv_cache, state.sampling_defaults)
    uvicorn_server(app, config).run()
