"""The predictor behind `quantspec infer`: prompts in (a string or a jsonl `data_file`), text out.

Owns the user-facing policy around the engine: chat templates, the `src_length` / `max_length`
limits and what happens to a prompt over them, stop strings, streaming text for one prompt, the
output rows, and the benchmark statistics (TTFT, TPOT, tokens/s, peak memory, acceptance).

Lengths: `max_length` bounds prompt + generated tokens of one sequence (it sizes the KV cache);
`src_length` the prompt (default `max_length - max_new_tokens`). A prompt over `src_length` is
refused with its row number, or (`truncate_prompt`) cut to its last `src_length` tokens.
"""

from __future__ import annotations

import json
import logging
import resource
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable

import torch

from quantspec.devices import resolve_device
from quantspec.errors import QuantSpecError, about
from quantspec.infer.engine import Engine, EngineConfig, Sequence
from quantspec.infer.logprobs import TokenLogprob
from quantspec.infer.scheduler import PREFILL_TOKENS
from quantspec.infer.sampler import SamplingParams
from quantspec.model_zoo.default import DEFAULT_MODEL

__all__ = ["KV_CACHE_DTYPES", "MTP_MIN_CONFIDENCE", "InferConfig", "Predictor", "RequestOutput", "read_jsonl", "speculation_stats",
           "write_jsonl"]

MTP_MIN_CONFIDENCE = 0.4  # --speculate-min-confidence's default for mtp, eagle and medusa (see InferConfig)
_GATED_METHODS = ("mtp", "eagle", "medusa")  # the drafters --speculate-min-confidence applies to
DRAFT_HEADS = ("int8", "artifact")  # --speculate-draft-head (see InferConfig)

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
           "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


# vLLM's --kv-cache-dtype values (and int8) → `InferConfig.cachekv`: auto, the artifact's own static
# KV scheme where it has one, else the model's dtype; float, the model's dtype whatever it holds
KV_CACHE_DTYPES = {"auto": "none", "fp8": "fp8", "fp8_e4m3": "fp8", "int8": "int8", "float": "float"}


# prompt + generated tokens per sequence when --max-length is not given (and the model allows it)
DEFAULT_MAX_LENGTH = 2048


@dataclass
class InferConfig:
    model: str = DEFAULT_MODEL
    dtype: str = "auto"  # see resolve_dtype
    device: str = "auto"
    batch_size: int = 1
    src_length: int | None = None
    # None: DEFAULT_MAX_LENGTH, or the model's context limit where shorter (`_fit_default_lengths`)
    max_length: int | None = None
    # (whether --max-length / --src-length were given, set from them: `_fit_default_lengths`)
    lengths_given: tuple[bool, bool] = field(default=(True, True), init=False, repr=False, compare=False)
    max_new_tokens: int = 256
    truncate_prompt: bool = False
    block_size: int = 64
    decode_strategy: str = "greedy"
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    # sampling penalties (`SamplingParams`), verified under speculation row by row (`infer.adjust`)
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None  # each output token's log-probability and its n most likely tokens'
    ignore_eos: bool = False  # generate max_new_tokens whatever the model says (fixed-length benchmarks)
    chat_template: bool = True
    benchmark: bool = False
    # static KV cache: "int8" | "fp8" (scales from the artifact, or given to the Predictor); "none":
    # the artifact's own static scheme where it has one; "float": the model's dtype whatever it
    # holds; vLLM's --kv-cache-dtype names are read as these (`KV_CACHE_DTYPES`)
    cachekv: str = "none"
    # speculative decoding
    speculate_method: str = "none"
    draft_model: str | None = None
    speculate_max_draft_token_num: int = 5
    speculate_max_ngram_size: int = 3
    speculate_min_ngram_size: int = 1  # n-gram: the shortest suffix tried
    # medusa, eagle: a token tree "DxK" (D draft positions, K candidates each; spec/tree.py), None: a chain
    speculate_tree: str | None = None
    # adapt the number of drafts to measured acceptance and cost (spec/proposers.py); off: always
    # draft speculate_max_draft_token_num tokens (what a compatibility measurement wants)
    speculate_backoff: bool = True
    # mtp, eagle, medusa: stop drafting at a draft whose top probability is below this (None: 0.4;
    # their heads are small and often unsure: an unsure draft is mostly rejected and costs a verify
    # row)
    speculate_min_confidence: float | None = None
    # draft: the head the draft model drafts with (None: "int8"): "int8" = its head rounded per
    # row to int8 by the backend where it has a kernel for it (`Runtime.int8_head`: half the
    # bytes of a bf16 head; drafts are proposals, so the output stays exact); "artifact" = the
    # draft's own head (what `quantspec report` measures an artifact pair with)
    speculate_draft_head: str | None = None
    # prompts cut into chunks of this many tokens, prefill steps alternating with decode steps
    # (EngineConfig.prefill_chunk); None: whole prompts
    prefill_chunk: int | None = None
    prefill_tokens: int = PREFILL_TOKENS  # prompt tokens per prefill step, at most
    # prompts skip the prefill of leading KV blocks an earlier prompt or answer filled (a shared
    # system prompt, few-shot examples, a chat's earlier turns); EngineConfig.prefix_caching
    enable_prefix_caching: bool = False
    # bytes of KV cache ("4GiB" as the flag writes it): a batch holds the sequences its blocks
    # do, preempting the newest where they run out (EngineConfig.kv_cache_memory); None: enough
    # for batch_size sequences of max_length
    kv_cache_memory: int | str | None = None
    scheduling_policy: str = "fcfs"  # EngineConfig.scheduling_policy
    gpu_memory_utilization: float = 0.9  # on CUDA, without kv_cache_memory (EngineConfig)
    enforce_eager: bool = False  # on CUDA: no CUDA graphs for the decode steps (vLLM's --enforce-eager)
    # structured output (`infer.structured`): (kind, spec), e.g. ("regex", "[0-9]+"), and the flag
    # that asked for it (what an error names)
    structured_output: tuple[str, str] | None = None
    structured_flag: str = "--structured-output"

    def __post_init__(self):
        if self.dtype != "auto" and self.dtype not in _DTYPES:
            raise QuantSpecError(f"--dtype {self.dtype!r} is not supported; use auto or one of {', '.join(_DTYPES)}")
        self.cachekv = KV_CACHE_DTYPES.get(self.cachekv, self.cachekv)
        if self.cachekv not in KV_CACHE_DTYPES.values():
            raise QuantSpecError(f"--kv-cache-dtype {self.cachekv!r} is not one of {', '.join(KV_CACHE_DTYPES)}")
        if self.max_new_tokens < 1:
            raise QuantSpecError(f"--max-new-tokens must be >= 1, got {self.max_new_tokens}")
        self.lengths_given = (self.max_length is not None, self.src_length is not None)
        if self.max_length is None:
            self.max_length = DEFAULT_MAX_LENGTH
        if self.max_length <= 1:
            raise QuantSpecError(f"--max-length must be > 1, got {self.max_length}")
        if self.src_length is None:
            self.src_length = max(1, self.max_length - self.max_new_tokens)
        if self.src_length < 1 or self.src_length >= self.max_length:
            raise QuantSpecError(
                f"--src-length {self.src_length} must be in [1, --max-length {self.max_length})"
            )
        self.device = resolve_device(self.device)
        gated = self.speculate_method in _GATED_METHODS
        if self.speculate_min_confidence is None:
            self.speculate_min_confidence = MTP_MIN_CONFIDENCE if gated else 0.0
        from quantspec.infer.spec.mtp import check_min_confidence

        self.speculate_min_confidence = check_min_confidence(self.speculate_min_confidence)
        if self.speculate_min_confidence and not gated:
            raise QuantSpecError("--speculate-min-confidence applies to --speculate-method mtp, eagle and medusa "
                                 "only; drop it")
        if self.speculate_draft_head is not None:
            if self.speculate_draft_head not in DRAFT_HEADS:
                raise QuantSpecError(f"--speculate-draft-head {self.speculate_draft_head!r} is not one of "
                                     f"{', '.join(DRAFT_HEADS)}")
            if self.speculate_method != "draft":
                raise QuantSpecError("--speculate-draft-head applies to --speculate-method draft only; drop it")
        if self.structured_output is not None:
            from quantspec.infer.structured import Guide

            Guide(*self.structured_output)  # a known kind
        if isinstance(self.kv_cache_memory, str):
            from quantspec.sizes import parse_size

            self.kv_cache_memory = parse_size(self.kv_cache_memory, "--kv-cache-memory")
        self.stop = tuple(self.stop)
        # the speculation's, the engine's and the sampler's own checks, before any model is loaded
        from quantspec.infer.spec.proposers import validate_spec_config

        validate_spec_config(self)
        EngineConfig(block_size=self.block_size, max_batch_size=self.batch_size, max_length=self.max_length,
                     prefill_chunk=self.prefill_chunk, prefill_tokens=self.prefill_tokens,
                     kv_cache_memory=self.kv_cache_memory, scheduling_policy=self.scheduling_policy,
                     gpu_memory_utilization=self.gpu_memory_utilization)
        self.sampling_params()

    def sampling_params(self) -> SamplingParams:
        return SamplingParams(decode_strategy=self.decode_strategy, temperature=self.temperature,
                              top_k=self.top_k, top_p=self.top_p, min_p=self.min_p, seed=self.seed,
                              max_new_tokens=self.max_new_tokens, stop=self.stop,
                              repetition_penalty=self.repetition_penalty, presence_penalty=self.presence_penalty,
                              frequency_penalty=self.frequency_penalty, logprobs=self.logprobs,
                              ignore_eos=self.ignore_eos)


@dataclass
class RequestOutput:
    text: str
    token_ids: list[int]
    prompt_tokens: int
    finish_reason: str
    truncated_prompt: bool = False
    ttft_s: float = 0.0
    tpot_s: float = 0.0
    target_forwards: int = 0
    drafted: int = 0
    accepted: int = 0
    cached_prompt_tokens: int = 0  # prompt tokens found in the prefix cache (not prefilled)
    preemptions: int = 0  # times its KV blocks were taken back and recomputed (--kv-cache-memory)
    accepted_per_position: list[int] = field(default_factory=list)
    drafted_per_position: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)  # with InferConfig.logprobs: one per token


def resolve_dtype(config: InferConfig) -> torch.dtype:
    """The activation dtype: `--dtype`, or for `auto` the loader's per-artifact choice."""
    if config.dtype != "auto":
        return _DTYPES[config.dtype]
    from quantspec.infer.loader import auto_dtype

    return auto_dtype(config.model, config.device)


def read_jsonl(path: str | Path, field_name: str = "src", flag: str = "--data-file") -> list[dict]:
    """The rows of a UTF-8 jsonl file, each an object with a string `field_name`; errors name
    `flag`, the line and the column."""
    path = Path(path)
    if not path.is_file():
        raise QuantSpecError(f"{flag} {path} does not exist" if not path.exists() else f"{flag} {path} is not a file")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        line = path.read_bytes()[: e.start].count(b"\n") + 1
        raise QuantSpecError(f"{flag} {path}:{line}: not UTF-8 (byte 0x{e.object[e.start]:02x}); save the file "
                             "as UTF-8") from None
    rows = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise QuantSpecError(f"{flag} {path}:{lineno}: malformed JSON at column {e.colno} "
                                 f"({e.msg.lower()}); fix that line") from None
        if not isinstance(row, dict) or not isinstance(row.get(field_name), str):
            raise QuantSpecError(f"{flag} {path}:{lineno}: each line needs a string field {field_name!r}")
        rows.append(row)
    if not rows:
        raise QuantSpecError(f"{flag} {path} is empty; give one JSON object per line with a {field_name!r} field")
    return rows


def write_jsonl(path: str | Path, rows: list[dict]) -> None:
    """Write atomically: a crash midway leaves any previous file intact."""
    from quantspec.outputs import atomic_file

    with atomic_file(path) as tmp, tmp.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


def peak_memory_mb(device: str) -> float:
    if device.startswith("cuda"):
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def _fit_default_lengths(config: InferConfig, args) -> InferConfig:
    """`config` with a default --max-length (and the --src-length it implies) lowered to the
    model's context limit where that is shorter, said once on stderr."""
    limit = args.context_limit()
    if config.lengths_given[0] or limit is None or config.max_length <= limit:
        return config
    what = "sliding window" if limit == args.sliding_window else "original context"
    logging.getLogger("quantspec").warning(f"quantspec: --max-length {limit} (this model's {what}; give "
                                           "--max-length to choose another)")
    return replace(config, max_length=limit, src_length=config.src_length if config.lengths_given[1] else None)


class Predictor:
    """Loads a model (plain HF directory, zoo name, or quantspec artifact) and generates."""

    def __init__(self, config: InferConfig, *, loaded=None, kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None):
        """`loaded`: a `LoadedModel` to reuse (else `config.model` is loaded); `kv_scales`: static
        KV-cache scales (k, v) [num_layers, num_kv_heads] for `config.cachekv`, which override an
        artifact's own (`api.infer` reads them from a calibration table)."""
        from quantspec.infer.dispatch import DispatchPolicy
        from quantspec.infer.loader import load_for_inference

        with about("--model"):
            policy = DispatchPolicy(cuda_graphs=False) if config.enforce_eager else None
            self.loaded = loaded or load_for_inference(config.model, dtype=resolve_dtype(config), device=config.device,
                                                       policy=policy)
        self.config = config = _fit_default_lengths(config, self.loaded.args)
        self.tokenizer = self.loaded.tokenizer
        self.loaded.args.check_context(config.max_length, "--max-length")
        k_scale = v_scale = None
        cachekv = config.cachekv
        if cachekv == "none" and getattr(self.loaded, "kv_cache_dtype", None) and kv_scales is None:
            cachekv = self.loaded.kv_cache_dtype  # an artifact with k_scale/v_scale: no flag needed
        elif cachekv == "float":
            cachekv = "none"
        if cachekv != "none":
            k_scale, v_scale = kv_scales if kv_scales is not None else self._artifact_kv_scales(cachekv)
        from quantspec.infer.kv_cache import kv_cache_label

        #: which KV cache runs, as `infer --benchmark`, the report and the server say it
        self.kv_cache = kv_cache_label(cachekv, self.loaded.model.model.norm.weight.dtype,
                                       "the calibration table's scales" if kv_scales is not None
                                       else "the artifact's scales")
        proposer, max_drafts = self._proposer()
        self.engine = Engine(
            self.loaded.model,
            EngineConfig(block_size=config.block_size, max_batch_size=config.batch_size,
                         max_length=config.max_length, kv_cache_dtype="auto" if cachekv == "none" else cachekv,
                         spec_max_draft_tokens=max_drafts, prefill_chunk=config.prefill_chunk,
                         prefill_tokens=config.prefill_tokens, prefix_caching=config.enable_prefix_caching,
                         kv_cache_memory=config.kv_cache_memory, scheduling_policy=config.scheduling_policy,
                         gpu_memory_utilization=config.gpu_memory_utilization),
            eos_token_ids=self.loaded.eos_token_ids, k_scale=k_scale, v_scale=v_scale, proposer=proposer,
            runtime=self.loaded.runtime,
        )

    def _artifact_kv_scales(self, kind: str):
        if self.loaded.k_scale is not None:
            return self.loaded.k_scale, self.loaded.v_scale
        raise QuantSpecError(
            f"a static {kind} KV cache (--kv-cache-dtype {kind}, --cachekv-{kind}-type static) needs KV scales: "
            f"pass --calib DIR from `quantspec calibrate`, or use an artifact quantized with --kv-cache {kind}"
        )

    def _proposer(self):
        if self.config.speculate_method == "none":
            return None, 0
        from quantspec.infer.spec.proposers import build_proposer

        with about("--draft-model"):
            return build_proposer(self.config, self.loaded)

    # -- prompts -----------------------------------------------------------------------------

    def encode(self, src: str, row: int | None = None) -> tuple[list[int], bool]:
        tok = self.tokenizer
        if tok is None:
            raise QuantSpecError(f"--model {self.loaded.model_dir} has no tokenizer files; copy the source model's into it")
        if self.config.chat_template and getattr(tok, "chat_template", None):
            text = tok.apply_chat_template([{"role": "user", "content": src}], tokenize=False,
                                           add_generation_prompt=True)
            ids = tok(text, add_special_tokens=False).input_ids
        else:
            ids = tok(src).input_ids
        limit = self.config.src_length
        if len(ids) > limit:
            where = "the prompt" if row is None else f"row {row} of --data-file"
            if not self.config.truncate_prompt:
                raise QuantSpecError(
                    f"{where} has {len(ids)} tokens, over --src-length {limit}; refused (raise --src-length / "
                    f"--max-length, or pass --truncate-prompt to keep its last {limit} tokens)"
                )
            return ids[-limit:], True
        return ids, False

    def _guide(self):
        """The compiled structured output of `structured_output` (an error names its flag)."""
        from quantspec.infer.structured import Guide, GuideCompiler

        try:
            return GuideCompiler.for_engine(self.tokenizer, self.engine).compile(Guide(*self.config.structured_output))
        except QuantSpecError as e:
            raise QuantSpecError(f"{self.config.structured_flag}: {e}") from None

    def _stop_check(self):
        stops = self.config.stop
        if not stops:
            return None
        tok = self.tokenizer

        def check(seq: Sequence):
            tail = tok.decode(seq.output_ids[-32:], skip_special_tokens=True)
            return 0 if any(s in tail for s in stops) else None

        return check

    def _text(self, ids: list[int]) -> str:
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        for s in self.config.stop:
            i = text.find(s)
            if i >= 0:
                text = text[:i]
        return text

    # -- generation --------------------------------------------------------------------------

    def generate(self, srcs: list[str], on_text: Callable[[str], None] | None = None) -> list[RequestOutput]:
        """Generate for every prompt; `on_text` streams the text of a single prompt as it grows."""
        params = self.config.sampling_params()
        if self.config.structured_output is not None:
            params = replace(params, guide=self._guide())
        encoded = [self.encode(s, row=i + 1 if len(srcs) > 1 else None) for i, s in enumerate(srcs)]
        check = self._stop_check()
        seqs = [self.engine.add_request(ids, params, request_index=i, text_check=check)
                for i, (ids, _) in enumerate(encoded)]
        printed = [0]

        def stream(_events):
            text = self._text(seqs[0].output_ids)
            if text.endswith("\ufffd"):  # half a multi-byte character: wait for the rest
                return
            on_text(text[printed[0]:])
            printed[0] = len(text)

        streaming = on_text is not None and len(seqs) == 1
        self.engine.run(stream if streaming else None)
        if streaming:  # whatever was held back (a trailing partial character) goes out now
            rest = self._text(seqs[0].output_ids)[printed[0]:]
            if rest:
                on_text(rest)
        outs = []
        for seq, (ids, truncated) in zip(seqs, encoded):
            st = seq.stats
            n = len(seq.output_ids)
            ttft = (st.t_first_token or st.t_arrival) - st.t_arrival
            tpot = ((st.t_finish or 0) - (st.t_first_token or 0)) / max(1, n - 1)
            outs.append(RequestOutput(
                text=self._text(seq.output_ids), token_ids=list(seq.output_ids), prompt_tokens=len(ids),
                finish_reason=seq.finish_reason or "", truncated_prompt=truncated, ttft_s=ttft, tpot_s=tpot,
                target_forwards=st.target_forwards, drafted=st.drafted, accepted=st.accepted,
                cached_prompt_tokens=st.cached_tokens, preemptions=st.preemptions,
                accepted_per_position=list(st.accepted_per_position),
                drafted_per_position=list(st.drafted_per_position), logprobs=list(seq.logprobs),
            ))
        return outs

    def run(self, srcs: list[str], on_text=None) -> tuple[list[RequestOutput], dict]:
        """Generate and collect the benchmark statistics of the run."""
        t0 = time.perf_counter()
        outs = self.generate(srcs, on_text)
        wall = time.perf_counter() - t0
        return outs, summarize(outs, wall, self.config, kv_cache=self.kv_cache)


def summarize(outs: list[RequestOutput], wall_s: float, config: InferConfig, *, kv_cache: str | None = None) -> dict:
    """The run's statistics (`infer --benchmark`, `--stats-file`); `kv_cache`: which KV cache ran."""
    gen = sum(len(o.token_ids) for o in outs)
    stats = {
        "model": config.model,
        "kv_cache": kv_cache,
        "requests": len(outs),
        "batch_size": config.batch_size,
        "prompt_tokens": sum(o.prompt_tokens for o in outs),
        "generated_tokens": gen,
        "wall_s": wall_s,
        "tokens_per_s": gen / wall_s if wall_s > 0 else 0.0,
        "ttft_ms": 1000 * sum(o.ttft_s for o in outs) / len(outs),
        "tpot_ms": 1000 * sum(o.tpot_s for o in outs) / len(outs),
        "peak_memory_mb": peak_memory_mb(config.device),
        "speculate_method": config.speculate_method,
    }
    if config.enable_prefix_caching:
        stats["cached_prompt_tokens"] = sum(o.cached_prompt_tokens for o in outs)
    if config.kv_cache_memory is not None or any(o.preemptions for o in outs):  # (a cache cut to the GPU's memory)
        stats["preemptions"] = sum(o.preemptions for o in outs)
    if config.speculate_method != "none":
        if config.speculate_tree:  # positions are the tree's depths
            stats["speculate_tree"] = config.speculate_tree
        stats.update(speculation_stats(outs))
    return stats


def speculation_stats(outs: list[RequestOutput]) -> dict:
    """The speculation figures of a run, over all its requests:

    drafted_tokens / accepted_tokens: draft rows verified / accepted (a tree counts every row).
    acceptance_rate:          accepted_tokens / drafted_tokens.
    draft_steps:              base forwards that verified drafts (a backed-off step drafts none).
    accepted_per_draft_step:  accepted_tokens / draft_steps.
    acceptance_per_position:  [j] = steps that accepted ≥ j + 1 drafts / steps that drafted
                              ≥ j + 1; for a token tree, j + 1 is the depth (the accepted path's
                              length over the steps whose tree reached that depth).
    mean_accepted_length:     tokens emitted after prefill per base forward (each forward after
                              the prefill, with or without drafts; 1.0 = no gain).

    Example: one request whose decode steps drafted 3, 3, 2 tokens and accepted 3, 0, 1, then
    ran one plain step (9 tokens in all, the first from the prefill): drafted 8, accepted 4,
    draft_steps 3, acceptance_per_position [2/3, 1/3, 1/2], mean accepted length 8 / 4 = 2.0.
    """
    drafted, accepted = sum(o.drafted for o in outs), sum(o.accepted for o in outs)
    forwards = sum(o.target_forwards for o in outs)
    positions = max((len(o.drafted_per_position) for o in outs), default=0)
    per_pos = []
    for j in range(positions):
        d = sum(o.drafted_per_position[j] for o in outs if j < len(o.drafted_per_position))
        a = sum(o.accepted_per_position[j] for o in outs if j < len(o.accepted_per_position))
        per_pos.append(a / d if d else 0.0)
    steps = sum(o.drafted_per_position[0] for o in outs if o.drafted_per_position)
    after_prefill = sum(len(o.token_ids) for o in outs) - len(outs)
    return {
        "drafted_tokens": drafted,
        "accepted_tokens": accepted,
        "acceptance_rate": accepted / drafted if drafted else 0.0,
        "draft_steps": steps,
        "accepted_per_draft_step": accepted / steps if steps else 0.0,
        "acceptance_per_position": per_pos,
        "mean_accepted_length": after_prefill / forwards if forwards else 0.0,
    }


def config_dict(config: InferConfig) -> dict:
    return asdict(config)
