"""An OpenAI request → the engine's jobs: the checks every prompt of a request passes (`BadRequest`
for what the server cannot serve, with the field to change), the sampling params and stop-string
hook its answers share, and one `Job` per answer of each prompt."""

from __future__ import annotations

import dataclasses
import json
from typing import TYPE_CHECKING, Callable

from quantspec.errors import QuantSpecError
from quantspec.infer.sampler import SamplingParams
from quantspec.infer.structured import Guide
from quantspec.serve.loop import Job
from quantspec.serve.protocol import UNSUPPORTED, ChatCompletionRequest, CompletionRequest, GenerationRequest
from quantspec.serve.reasoning import thinking_guide
from quantspec.serve.text import bad_words_ids, stop_check
from quantspec.serve.tools import ToolChoiceError, tool_guide

if TYPE_CHECKING:
    from quantspec.serve.app import ServeState

__all__ = ["BadRequest", "check_model", "check_request", "make_job", "request_guide", "request_params", "serves"]


class BadRequest(Exception):
    """A 400 (or another client error's `status`): `message` says what is wrong, `param` names the
    field, `code` OpenAI's error code."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None, status: int = 400):
        super().__init__(message)
        self.param, self.code, self.status = param, code, status


def serves(state: ServeState, model: str) -> bool:
    """Whether `model` names the served model (its name or an alias)."""
    return model in (state.model_name, *state.aliases)


def check_model(state: ServeState, model: str | None) -> None:
    if model is not None and not serves(state, model):
        raise BadRequest(f"model {model!r} is not served here; use {state.model_name!r}", param="model",
                         code="model_not_found")


def check_request(state: ServeState, body: GenerationRequest) -> None:
    """A `BadRequest` for what no prompt of `body` can be served with."""
    check_model(state, body.model)
    extra = body.model_extra or {}
    for name, neutral, instead in UNSUPPORTED:
        value = extra.get(name)
        if value is not None and (isinstance(value, bool) != isinstance(neutral, bool) or value != neutral):
            hint = f"leave it out (or {neutral!r})" + (f"; use {instead}" if instead else "")
            raise BadRequest(f"{name}={value!r} is not supported by this server; {hint}", param=name)
    if body.priority and state.loop.engine.config.scheduling_policy != "priority":
        raise BadRequest(f"priority={body.priority} needs a server started with --scheduling-policy priority; "
                         "leave it out (or 0)", param="priority")
    if isinstance(body, ChatCompletionRequest) and body.continue_final_message and body.add_generation_prompt:
        raise BadRequest("continue_final_message needs add_generation_prompt=false", param="continue_final_message")
    if body.prompt_logprobs is not None and body.stream:  # as vLLM: the prompt's scores are not streamed
        raise BadRequest("prompt_logprobs is not available with stream=true; leave one out", param="prompt_logprobs")
    if any(not w.strip() for w in body.bad_words or ()):
        raise BadRequest("bad_words holds an empty word; leave it out", param="bad_words")
    if isinstance(body, ChatCompletionRequest) and body.top_logprobs is not None and not body.logprobs:
        raise BadRequest("top_logprobs needs logprobs=true", param="top_logprobs")
    if isinstance(body, CompletionRequest) and body.max_tokens == 0 and not body.echo:
        raise BadRequest("max_tokens=0 generates nothing; it needs echo=true (to score the prompt)",
                         param="max_tokens")


def request_params(state: ServeState, body: GenerationRequest) -> tuple[SamplingParams, Callable | None]:
    """What every answer of a checked request shares: its sampling params (`max_new_tokens` the
    server's --max-length: `make_job` sets each prompt's) and its stop-string hook; a `BadRequest`
    for what the model cannot do."""
    d = state.sampling_defaults

    def given(value, name: str, neutral):  # the request's value, else the model's default, else OpenAI's
        return value if value is not None else d.get(name, neutral)

    temperature = float(given(body.temperature, "temperature", 1.0))
    stops = body.stop_strings()
    if isinstance(body, ChatCompletionRequest):
        logprobs, echoed = (body.top_logprobs or 0) if body.logprobs else None, None
    else:
        logprobs, echoed = body.logprobs, body.logprobs if body.echo else None
    asked = [n for n in (echoed, body.prompt_logprobs) if n is not None]  # the engine scores the most asked
    vocab = state.loop.engine.model.args.vocab_size
    if any(t >= vocab for t in body.allowed_token_ids or ()):
        raise BadRequest(f"allowed_token_ids must be token ids in [0, {vocab})", param="allowed_token_ids")
    bad_words = bad_words_ids(state.tokenizer, body.bad_words or [])
    if any(t >= vocab for w in bad_words for t in w):
        raise BadRequest(f"bad_words tokenize to ids outside the model's vocabulary [0, {vocab})", param="bad_words")
    bias = []
    for key, value in (body.logit_bias or {}).items():
        if not key.isdigit() or int(key) >= vocab:
            raise BadRequest(f"logit_bias key {key!r} must be a token id in [0, {vocab})", param="logit_bias")
        bias.append((int(key), value))
    guide, field_name = request_guide(body, auto_tools=state.tool_parser is not None)
    try:
        compiled = None if guide is None else state.guide_compiler().compile(guide)
    except QuantSpecError as e:
        raise BadRequest(str(e), param=field_name) from None
    try:
        params = SamplingParams(decode_strategy="greedy" if temperature == 0 else "sampling",
                                temperature=temperature or 1.0, top_k=max(0, int(given(body.top_k, "top_k", 0))),
                                top_p=float(given(body.top_p, "top_p", 1.0)),
                                min_p=float(given(body.min_p, "min_p", 0)), seed=body.seed, max_new_tokens=state.max_length,
                                stop=stops, logprobs=logprobs,
                                prompt_logprobs=max(asked, default=None), presence_penalty=body.presence_penalty or 0,
                                frequency_penalty=body.frequency_penalty or 0,
                                repetition_penalty=given(body.repetition_penalty, "repetition_penalty", 1),
                                logit_bias=bias, ignore_eos=body.ignore_eos, stop_token_ids=body.stop_token_ids or (),
                                min_tokens=body.min_tokens, allowed_token_ids=body.allowed_token_ids or (),
                                bad_words=bad_words, guide=compiled)
    except QuantSpecError as e:
        raise BadRequest(str(e)) from None
    return params, stop_check(state.tokenizer, stops)


def request_guide(body: GenerationRequest, auto_tools: bool = False) -> tuple[Guide | None, str | None]:
    """The structured output `body` asks for (a forced `tool_choice`, OpenAI's `response_format` or
    vLLM's `structured_outputs`; "text" asks for none) and the field that asked; a `BadRequest` for
    two, or for tools the server cannot serve (`auto_tools`: it has a tool-call parser)."""
    asked = []
    try:
        tool = tool_guide(body, auto_tools)
    except ToolChoiceError as e:
        raise BadRequest(str(e), param=e.param) from None
    if tool is not None:
        asked.append((tool, "tool_choice"))
    fmt = body.response_format
    if fmt is not None and fmt.type == "json_object":
        asked.append((Guide("json_object"), "response_format"))
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None:
            raise BadRequest("response_format of type json_schema needs json_schema.schema", param="response_format")
        asked.append((Guide("json", json.dumps(fmt.json_schema.json_schema)), "response_format"))
    so = body.structured_outputs
    if so is not None:
        for kind, value in (("json", so.json_spec), ("regex", so.regex), ("choice", so.choice),
                            ("grammar", so.grammar), ("json_object", so.json_object or None)):
            if value is not None:
                spec = value if isinstance(value, str) else "" if value is True else json.dumps(value)
                asked.append((Guide(kind, spec), "structured_outputs"))
    if len(asked) > 1:
        raise BadRequest("give one structured output (response_format, one field of structured_outputs, or a "
                         "forced tool_choice)",
                         param=asked[1][1])
    return asked[0] if asked else (None, None)


def make_job(state: ServeState, body: GenerationRequest, shared: tuple[SamplingParams, Callable | None],
         ids: list[int], index: int = 0) -> Job:
    """The engine job of answer `index` to one prompt of a checked request, on the request's
    `shared` params and stop hook (`request_params`); a `BadRequest` for a prompt too long."""
    param = "messages" if isinstance(body, ChatCompletionRequest) else "prompt"
    if not ids:
        raise BadRequest("the prompt is empty", param=param)
    if body.truncate_prompt_tokens is not None:
        ids = ids[-body.truncate_prompt_tokens:]
    room = state.max_length - len(ids)
    if room < 1:
        raise BadRequest(f"the prompt has {len(ids)} tokens, over the server's --max-length {state.max_length} "
                         "(prompt + output); shorten it", param=param, code="context_length_exceeded")
    max_tokens = getattr(body, "max_completion_tokens", None) or body.max_tokens
    if max_tokens is None and "max_new_tokens" in state.sampling_defaults:  # the model's default, within the room
        max_tokens = min(max(1, int(state.sampling_defaults["max_new_tokens"])), room)
    if max_tokens is not None and max_tokens > room:
        raise BadRequest(f"max_tokens={max_tokens} + the prompt's {len(ids)} tokens is over the server's "
                         f"--max-length {state.max_length}; ask for at most {room}", param="max_tokens",
                         code="context_length_exceeded")
    params, text_check = shared
    after = None
    if params.guide is not None and state.reasoning_parser is not None and isinstance(body, ChatCompletionRequest):
        after = thinking_guide(state.reasoning_parser, state.tokenizer, ids)  # the grammar after the thinking
    try:  # max_tokens 0 (echo): one token, dropped
        params = dataclasses.replace(params, max_new_tokens=1 if max_tokens == 0 else max_tokens or room,
                                     guide_after=after)
    except QuantSpecError as e:  # min_tokens over this prompt's room
        raise BadRequest(str(e)) from None
    return Job(list(ids), params, speculate=body.speculate, index=index, text_check=text_check,
               priority=body.priority)


