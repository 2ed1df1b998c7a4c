"""The HTTP layer: FastAPI routes over an `EngineLoop`, in OpenAI's shapes.

`/v1/chat/completions` and `/v1/completions` (streaming as server-sent events or one JSON body),
`/v1/models`, vLLM's `/tokenize`, `/detokenize` and `/tokenizer_info`, `/health`, `/metrics`. With
an API key set, every route but `/health` and `/metrics` wants `Authorization: Bearer <key>`
(401 otherwise). A request is validated (`protocol.py`), tokenized (`text.py`), checked and
turned into a `Job` per answer (`jobs.py`) and submitted; its tokens come back as deltas and
leave as OpenAI chunks. Bad input is a 400 with an OpenAI error object, a full queue a 503 with
Retry-After (the queue's drain time at the measured completion rate), and a client that goes away
has its sequence aborted. No model logic lives here.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import time
import uuid
from dataclasses import dataclass, field

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from quantspec.serve.jobs import BadRequest, check_model, check_request, make_job, request_params
from quantspec.serve.logprob_shapes import chat_entries, legacy_entries, vllm_prompt_logprobs
from quantspec.serve.loop import Delta, EngineLoop, Job
from quantspec.serve.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                      GenerationRequest, TokenizeRequest, error_body)
from quantspec.serve.text import TextStream, TokenText, chat_prompt_ids, completion_prompt_ids
from quantspec.serve.reasoning import ReasoningStream
from quantspec.serve.tools import tool_calls

__all__ = ["ServeState", "build_app"]

DISCONNECT_POLL_S = 0.25
FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length", "max_length": "length"}


@dataclass
class ServeState:
    """What the routes need: the loop, the tokenizer, the names the model answers to, limits."""

    loop: EngineLoop
    tokenizer: object
    model_name: str
    max_length: int
    metrics: object
    aliases: tuple[str, ...] = ("default",)
    kv_cache: str = ""  # which KV cache the engine runs (`infer.kv_cache.kv_cache_label`)
    api_key: str | None = field(default=None, repr=False)  # None: no authentication
    tool_parser: object = None  # the model's tool-call syntax, for tool_choice "auto" (`tool_parsers.py`)
    reasoning_parser: object = None  # where chat answers' thinking ends (`reasoning.py`)
    # what a request that leaves out temperature, top_p, top_k, min_p, repetition_penalty or
    # max_tokens gets (the model's generation_config.json: `loader.read_sampling_defaults`)
    sampling_defaults: dict = field(default_factory=dict)
    chat_template: str | None = None  # a Jinja chat template in place of the tokenizer's (--chat-template)
    token_text: TokenText = field(init=False)  # the tokens' texts and bytes that logprobs name
    _guides: object = field(default=None, init=False, repr=False)

    def __post_init__(self):
        self.token_text = TokenText(self.tokenizer)

    def guide_compiler(self):
        """The structured-output compiler for the served tokenizer (`infer.structured`), built when
        a request first asks for one."""
        if self._guides is None:
            from quantspec.infer.structured import GuideCompiler

            self._guides = GuideCompiler.for_engine(self.tokenizer, self.loop.engine)
        return self._guides


class Unauthorized(Exception):
    pass


def _error(status: int, message: str, *, type: str = "invalid_request_error", param=None, code=None,
           headers=None) -> JSONResponse:
    return JSONResponse(error_body(message, type=type, param=param, code=code), status_code=status, headers=headers)


def _validation_message(exc) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    e = errors[0]
    loc = [str(p) for p in e.get("loc", ()) if p != "body"]
    if e.get("type") == "json_invalid":
        return f"malformed JSON: {e.get('msg', '')}", None
    param = ".".join(loc) or None
    return (f"{param}: {e.get('msg')}" if param else e.get("msg", "invalid request")), param


def build_app(state: ServeState, *, on_shutdown=None) -> FastAPI:
    """The routes over `state`; `on_shutdown()` runs when the server stops (after the drain)."""

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        if on_shutdown is not None:
            on_shutdown()

    app = FastAPI(title="quantspec", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, exc):
        message, param = _validation_message(exc)
        return _error(400, message, param=param)

    @app.exception_handler(BadRequest)
    async def _bad(request, exc):
        return _error(400, str(exc), param=exc.param, code=exc.code)

    guarded = _api_key_check(app, state)

    @app.get("/health")
    async def health():
        if not state.loop.alive:
            return _error(503, "the engine loop has stopped", type="server_error")
        return {"status": "ok", "kv_cache": state.kv_cache}

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models", dependencies=guarded)
    async def models():
        return {"object": "list", "data": [{"id": state.model_name, "object": "model", "created": 0,
                                            "owned_by": "quantspec", "max_model_len": state.max_length,
                                            "kv_cache": state.kv_cache}]}

    @app.post("/v1/chat/completions", dependencies=guarded)
    async def chat(request: Request):
        body = _parse(await _json(request), ChatCompletionRequest)
        check_request(state, body)
        return await _generate(state, request, body, [_chat_ids(state, body)], chat=True)

    @app.post("/v1/completions", dependencies=guarded)
    async def completions(request: Request):
        body = _parse(await _json(request), CompletionRequest)
        check_request(state, body)
        ids = [completion_prompt_ids(state.tokenizer, p) for p in body.prompts()]
        return await _generate(state, request, body, ids, chat=False)

    _tokenizer_routes(app, state, guarded)
    return app


def _api_key_check(app: FastAPI, state: ServeState) -> list:
    """The route dependencies that ask for `state.api_key` as a bearer token (none asked where it
    is None), and the 401 they answer without it."""

    @app.exception_handler(Unauthorized)
    async def _unauthorized(request, exc):
        return _error(401, "a missing or wrong API key; send the server's --api-key as 'Authorization: Bearer KEY'",
                      code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    async def authorized(request: Request):
        if state.api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), state.api_key.encode()):
            raise Unauthorized()

    return [Depends(authorized)]


def _tokenizer_routes(app: FastAPI, state: ServeState, guarded: list) -> None:
    """vLLM's `/tokenize`, `/detokenize` and `/tokenizer_info` on `app` (what lm-evaluation-harness
    probes for its remote tokenizer), behind `guarded` (the API key's check)."""

    @app.post("/tokenize", dependencies=guarded)
    async def tokenize(request: Request):
        body = _parse(await _json(request), TokenizeRequest)
        check_model(state, body.model)
        if (body.prompt is None) == (body.messages is None):
            raise BadRequest("give one of prompt and messages", param="prompt")
        if body.messages is not None:
            ids = chat_prompt_ids(state.tokenizer, [{"role": m.role, "content": m.text()} for m in body.messages],
                                  add_generation_prompt=body.add_generation_prompt, chat_template=state.chat_template)
        else:
            ids = state.tokenizer(body.prompt, add_special_tokens=body.add_special_tokens).input_ids
        return {"count": len(ids), "max_model_len": state.max_length, "tokens": ids}

    @app.post("/detokenize", dependencies=guarded)
    async def detokenize(request: Request):
        body = _parse(await _json(request), DetokenizeRequest)
        check_model(state, body.model)
        vocab = len(state.tokenizer)
        if any(t >= vocab for t in body.tokens):
            raise BadRequest(f"tokens must be ids in [0, {vocab})", param="tokens")
        return {"prompt": state.tokenizer.decode(body.tokens)}

    @app.get("/tokenizer_info", dependencies=guarded)
    async def tokenizer_info():
        tok = state.tokenizer
        return {"tokenizer_class": type(tok).__name__, "eos_token": tok.eos_token, "bos_token": tok.bos_token,
                "pad_token": tok.pad_token, "unk_token": tok.unk_token,
                "chat_template": getattr(tok, "chat_template", None), "model_max_length": state.max_length}



async def _json(request: Request):
    raw = await request.body()
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BadRequest(f"malformed JSON: {e}") from None


def _parse(data, model: type[GenerationRequest]):
    if not isinstance(data, dict):
        raise BadRequest("the body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        message, param = _validation_message(e)
        raise BadRequest(message, param=param) from None


def _chat_ids(state: ServeState, body: ChatCompletionRequest) -> list[int]:
    """The prompt ids of a chat request: its messages (and tools) through the chat template."""
    messages = [{**(m.model_extra or {}), "role": m.role, "content": m.text()} for m in body.messages]
    tools = [t.model_dump(exclude_none=True) for t in body.tools or []]
    try:
        return chat_prompt_ids(state.tokenizer, messages, body.add_generation_prompt, tools=tools,
                               continue_final_message=body.continue_final_message,
                               template_kwargs=body.chat_template_kwargs, chat_template=state.chat_template)
    except Exception as e:  # the template's own checks (jinja2's raise_exception, transformers')
        raise BadRequest(f"the chat template cannot render these messages: {e}", param="messages") from None


async def _generate(state: ServeState, request: Request, body: GenerationRequest, prompts: list[list[int]], *,
                    chat: bool):
    shared = request_params(state, body)
    jobs = [make_job(state, body, shared, ids, j) for ids in prompts for j in range(body.n)]  # choice i: prompt i // n
    for i, job in enumerate(jobs):
        if not state.loop.submit(job):
            for taken in jobs[:i]:
                state.loop.abort(taken)
            state.metrics.rejected.inc()
            return _error(503, "the server is at capacity (its request queue is full); retry shortly",
                          type="server_error", code="overloaded",
                          headers={"Retry-After": str(state.loop.retry_after())})
    echoes = [None] * len(jobs)
    if isinstance(body, CompletionRequest) and body.echo:
        echoes = [p if isinstance(p, str) else state.tokenizer.decode(p) for p in body.prompts() for _ in range(body.n)]
    elif chat and body.echo and (body.messages[-1].role == "assistant" or not body.add_generation_prompt):
        echoes = [body.messages[-1].text()] * len(jobs)  # vLLM's: the last message, in the answer's role
    out = _Response(state, body, jobs, chat, echoes)
    if body.stream:
        return StreamingResponse(out.sse(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    return await out.whole(request)


class _Choice:
    """One answer (choice `index`): its text deltas, each with the log-probability entries of the
    tokens it brings (chat: `content` items; completions: legacy rows)."""

    def __init__(self, resp: "_Response", index: int, job: Job, echo: str | None):
        self.resp, self.index, self.job, self.echo = resp, index, job, echo
        body = resp.body
        self.text = TextStream(resp.state.tokenizer, body.stop_strings(), skip_special_tokens=body.skip_special_tokens,
                               include_stop=body.include_stop_str_in_output)
        self.score_only = isinstance(body, CompletionRequest) and body.max_tokens == 0
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None  # vLLM's: the stop string or stop token id that ended it
        self.offset = 0  # characters of this choice's text before the next token (legacy text_offset)
        self.prompt_logprobs: list | None = None  # vLLM's, where asked for
        # a forced tool call, or "auto" under a parser: the answer goes out as `tool_calls` (`serve/tools.py`)
        self.tools = tool_calls(body, resp.state.tool_parser)
        # a reasoning model's thinking, split from the content (not where a grammar holds the answer)
        parser = resp.state.reasoning_parser if resp.chat and job.params.guide is None else None
        self.reasoning = None if parser is None else ReasoningStream(parser)

    @property
    def completion_tokens(self) -> int:
        return 0 if self.score_only else len(self.text.ids)

    def _entries(self, ids: list[int], lps: list) -> list:
        if self.resp.chat:
            return chat_entries(self.resp.token_text, ids, lps)
        out, self.offset = legacy_entries(self.resp.token_text, ids, lps, self.resp.body.logprobs, self.offset)
        return out

    async def deltas(self):
        """(text piece, log-probability entries, finish reason or None) per engine delta, until the last."""
        first = True
        while True:
            d: Delta = await self.job.queue.get()
            if d.finish_reason == "error":
                raise RuntimeError("the engine failed on this request")
            piece, entries = "", []
            if first and d.prompt_logprobs is not None and self.resp.body.prompt_logprobs is not None:
                self.prompt_logprobs = vllm_prompt_logprobs(self.resp.token_text, self.job.prompt_ids,
                                                            d.prompt_logprobs, self.resp.body.prompt_logprobs)
            if first and self.echo is not None and not self.resp.chat:
                piece = self.echo
                if d.prompt_logprobs is not None:
                    entries = self._entries(self.job.prompt_ids, d.prompt_logprobs)
                self.offset = len(self.echo)
            first = False
            if not self.score_only:
                piece += self.text.feed(d.token_ids)
                if d.logprobs:
                    entries += self._entries(d.token_ids, d.logprobs)
            if d.finish_reason is None:
                yield piece, entries, None
                continue
            if self.score_only:
                self.finish_reason = "length"
            else:
                self.finish_reason = "stop" if self.text.stopped else FINISH_REASONS.get(d.finish_reason,
                                                                                        d.finish_reason)
                piece += self.text.finish()
                last = self.job.seq.output_ids[-1] if self.job.seq is not None and self.job.seq.output_ids else None
                self.stop_reason = (self.text.stop_str if self.text.stopped else
                                    last if d.finish_reason == "stop" and last in self.job.params.stop_token_ids
                                    else None)
            yield piece, entries, self.finish_reason
            return

    async def collect(self) -> tuple[str, list]:
        parts, entries = [], []
        async for piece, e, _ in self.deltas():
            parts.append(piece)
            entries += e
        return "".join(parts), entries


class _Response:
    """One request's answers in OpenAI's shapes, streamed or whole: `n` choices per prompt."""

    def __init__(self, state: ServeState, body: GenerationRequest, jobs: list[Job], chat: bool,
                 echoes: list[str | None]):
        self.state, self.body, self.chat = state, body, chat
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.token_text = state.token_text
        self.wants_logprobs = body.logprobs if chat else body.logprobs is not None
        self.choices = [_Choice(self, i, job, echo) for i, (job, echo) in enumerate(zip(jobs, echoes))]

    def _usage(self) -> dict:
        firsts = [c.job for c in self.choices if c.job.index == 0]  # each prompt once, whatever n
        p, n = sum(len(j.prompt_ids) for j in firsts), sum(c.completion_tokens for c in self.choices)
        usage = {"prompt_tokens": p, "completion_tokens": n, "total_tokens": p + n}
        if self.state.loop.engine.config.prefix_caching:  # as OpenAI reports its prompt caching
            usage["prompt_tokens_details"] = {"cached_tokens": sum(j.seq.stats.cached_tokens for j in firsts if j.seq)}
        return usage

    def _logprobs(self, entries: list) -> dict | None:
        if not self.wants_logprobs:
            return None
        if self.chat:
            return {"content": entries, "refusal": None}
        tokens, lps, tops, offsets = (list(x) for x in zip(*entries)) if entries else ([], [], [], [])
        return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}

    def _chunk(self, index: int, piece: str | None, entries: list, reason: str | None, *, first: bool = False) -> dict:
        logprobs = None if first else self._logprobs(entries)
        tools = self.choices[index].tools if self.chat and not first else None
        thought = ""
        if self.choices[index].reasoning is not None and not first:
            thought, piece = self.choices[index].reasoning.feed(piece or "", reason is not None)
        if tools is not None:
            delta, reason = tools.delta(piece or "", reason, self.choices[index].text.text)
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
            kind = "chat.completion.chunk"
        elif self.chat:
            delta = {"role": "assistant", "content": ""} if first else ({"content": piece} if piece else {})
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
            kind = "chat.completion.chunk"
        else:
            choice = {"index": index, "text": piece or "", "logprobs": logprobs, "finish_reason": reason}
            kind = "text_completion"
        if thought:
            choice["delta"] = {**choice["delta"], "reasoning_content": thought, "reasoning": thought}
        if reason is not None:
            choice["stop_reason"] = self.choices[index].stop_reason
        return {"id": self.id, "object": kind, "created": self.created, "model": self.state.model_name,
                "choices": [choice]}

    def _abort(self) -> None:
        for c in self.choices:
            self.state.loop.abort(c.job)  # a no-op once the job is done

    async def sse(self):
        usage = self.body.stream_options is not None and self.body.stream_options.include_usage
        every = usage and self.body.stream_options.continuous_usage_stats  # the usage so far in each chunk
        try:
            if self.chat:
                for c in self.choices:
                    chunk = self._chunk(c.index, None, [], None, first=True)
                    yield _event(chunk, self._usage() if every else None)
                    if c.echo:  # chat `echo`: the last message's text, before the answer's
                        chunk["choices"][0]["delta"] = {"content": c.echo}
                        yield _event(chunk, self._usage() if every else None)
            async for index, (piece, entries, reason) in _merged([c.deltas() for c in self.choices]):
                if piece or reason or entries:
                    yield _event(self._chunk(index, piece, entries, reason), self._usage() if every else None)
            if usage:
                yield _event({**self._chunk(0, None, [], None), "choices": [], "usage": self._usage()})
        except RuntimeError as e:
            yield _event(error_body(str(e), type="server_error"))
        finally:
            self._abort()
        yield "data: [DONE]\n\n"

    async def whole(self, request: Request):
        task = asyncio.ensure_future(asyncio.gather(*(c.collect() for c in self.choices)))
        try:
            while not task.done():
                await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
                if not task.done() and await request.is_disconnected():
                    task.cancel()
                    return Response(status_code=499)
            results = task.result()
        except RuntimeError as e:
            return _error(500, str(e), type="server_error")
        finally:
            self._abort()
        choices = []
        for c, (text, entries) in zip(self.choices, results):
            if self.chat:
                thought = None
                if c.reasoning is not None:
                    thought, text = c.reasoning.parser.split(text)
                message, reason = (({"role": "assistant", "content": text}, c.finish_reason) if c.tools is None
                                   else c.tools.message(text or "", c.finish_reason))
                if c.reasoning is not None:
                    message.update(reasoning_content=thought, reasoning=thought)
                if c.echo is not None:
                    message["content"] = c.echo + (message["content"] or "")
                choices.append({"index": c.index, "message": message, "logprobs": self._logprobs(entries),
                                "finish_reason": reason, "stop_reason": c.stop_reason})
            else:
                choices.append({"index": c.index, "text": text, "logprobs": self._logprobs(entries),
                                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
                if self.body.prompt_logprobs is not None:
                    choices[-1]["prompt_logprobs"] = c.prompt_logprobs
        out = {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
               "created": self.created, "model": self.state.model_name, "choices": choices, "usage": self._usage()}
        if self.chat and self.body.prompt_logprobs is not None:  # vLLM's place for a chat request's
            out["prompt_logprobs"] = self.choices[0].prompt_logprobs
        return out


async def _merged(streams: list):
    """(index, item) from several async iterators as each yields, until all end; an exception in
    one ends the merge with it (the others are cancelled)."""
    if len(streams) == 1:
        async for item in streams[0]:
            yield 0, item
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i, stream):
        try:
            async for item in stream:
                await queue.put((i, item))
            await queue.put((i, done))
        except Exception as e:  # handed to the consumer, which raises it
            await queue.put((i, e))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        left = len(tasks)
        while left:
            i, item = await queue.get()
            if item is done:
                left -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()


def _event(obj: dict, usage: dict | None = None) -> str:
    if usage is not None:
        obj = {**obj, "usage": usage}
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"
