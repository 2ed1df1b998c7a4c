"""The HTTP layer: FastAPI routes over an `EngineLoop`, in OpenAI's shapes.

`/v1/chat/completions` and `/v1/completions` (streaming as server-sent events or one JSON body),
`/v1/models`, `/health`, `/metrics`. A request is validated (`protocol.py`), tokenized
(`text.py`), turned into a `Job` and submitted; its tokens come back as deltas and leave as
OpenAI chunks. Bad input is a 400 with an OpenAI error object, a full queue a 503 with
Retry-After (the queue's drain time at the measured completion rate), and a client that goes away
has its sequence aborted. No model logic lives here.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from quantspec.errors import QuantSpecError
from quantspec.infer.sampler import SamplingParams
from quantspec.serve.loop import Delta, EngineLoop, Job
from quantspec.serve.protocol import ChatCompletionRequest, CompletionRequest, GenerationRequest, error_body
from quantspec.serve.text import TextStream, chat_prompt_ids, completion_prompt_ids, stop_check

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


class BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param, self.code = param, code


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

    @app.get("/health")
    async def health():
        if not state.loop.alive:
            return _error(503, "the engine loop has stopped", type="server_error")
        return {"status": "ok", "kv_cache": state.kv_cache}

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": state.model_name, "object": "model", "created": 0,
                                            "owned_by": "quantspec", "max_model_len": state.max_length,
                                            "kv_cache": state.kv_cache}]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = _parse(await _json(request), ChatCompletionRequest)
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        ids = chat_prompt_ids(state.tokenizer, messages)
        return await _generate(state, request, body, ids, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = _parse(await _json(request), CompletionRequest)
        if isinstance(body.prompt, list) and len(body.prompt) > 1 and isinstance(body.prompt[0], str):
            raise BadRequest("one prompt per request is supported; send a string", param="prompt")
        ids = completion_prompt_ids(state.tokenizer, body.prompt)
        return await _generate(state, request, body, ids, chat=False)

    return app


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


def _job(state: ServeState, body: GenerationRequest, ids: list[int]) -> Job:
    """The engine job of a validated request; a `BadRequest` for what the model cannot do."""
    if body.model is not None and body.model not in (state.model_name, *state.aliases):
        raise BadRequest(f"model {body.model!r} is not served here; use {state.model_name!r}", param="model",
                         code="model_not_found")
    if body.n != 1:
        raise BadRequest(f"n={body.n} is not supported; use n=1", param="n")
    if not ids:
        raise BadRequest("the prompt is empty", param="prompt")
    room = state.max_length - len(ids)
    if room < 1:
        raise BadRequest(f"the prompt has {len(ids)} tokens, over the server's --max-length {state.max_length} "
                         "(prompt + output); shorten it",
                         param="messages" if isinstance(body, ChatCompletionRequest) else "prompt",
                         code="context_length_exceeded")
    max_tokens = getattr(body, "max_completion_tokens", None) or body.max_tokens
    if max_tokens is not None and max_tokens > room:
        raise BadRequest(f"max_tokens={max_tokens} + the prompt's {len(ids)} tokens is over the server's "
                         f"--max-length {state.max_length}; ask for at most {room}", param="max_tokens",
                         code="context_length_exceeded")
    temperature = 1.0 if body.temperature is None else float(body.temperature)
    stops = body.stop_strings()
    try:
        params = SamplingParams(decode_strategy="greedy" if temperature == 0 else "sampling",
                                temperature=temperature or 1.0, top_k=max(0, body.top_k or 0),
                                top_p=1.0 if body.top_p is None else float(body.top_p), seed=body.seed,
                                max_new_tokens=max_tokens or room, stop=stops)
    except QuantSpecError as e:
        raise BadRequest(str(e)) from None
    return Job(list(ids), params, speculate=body.speculate, text_check=stop_check(state.tokenizer, stops))


async def _generate(state: ServeState, request: Request, body: GenerationRequest, ids: list[int], *, chat: bool):
    job = _job(state, body, ids)
    if not state.loop.submit(job):
        state.metrics.rejected.inc()
        return _error(503, "the server is at capacity (its request queue is full); retry shortly",
                      type="server_error", code="overloaded",
                      headers={"Retry-After": str(state.loop.retry_after())})
    out = _Output(state, body, job, chat)
    if body.stream:
        return StreamingResponse(out.sse(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    return await out.whole(request)


class _Output:
    """One request's answer in OpenAI's shapes, streamed or whole."""

    def __init__(self, state: ServeState, body: GenerationRequest, job: Job, chat: bool):
        self.state, self.body, self.job, self.chat = state, body, job, chat
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.text = TextStream(state.tokenizer, body.stop_strings())
        self.finish_reason: str | None = None

    def _usage(self) -> dict:
        n, p = len(self.text.ids), len(self.job.prompt_ids)
        return {"prompt_tokens": p, "completion_tokens": n, "total_tokens": p + n}

    def _reason(self, reason: str) -> str:
        return "stop" if self.text.stopped else FINISH_REASONS.get(reason, reason)

    async def _deltas(self):
        """(text piece, finish reason or None) per engine delta, until the last."""
        while True:
            d: Delta = await self.job.queue.get()
            piece = self.text.feed(d.token_ids)
            if d.finish_reason is None:
                yield piece, None
                continue
            if d.finish_reason == "error":
                raise RuntimeError("the engine failed on this request")
            self.finish_reason = self._reason(d.finish_reason)
            yield piece + self.text.finish(), self.finish_reason
            return

    def _chunk(self, piece: str | None, reason: str | None, *, first: bool = False) -> dict:
        if self.chat:
            delta = {"role": "assistant", "content": ""} if first else ({"content": piece} if piece else {})
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
            kind = "chat.completion.chunk"
        else:
            choice = {"index": 0, "text": piece or "", "logprobs": None, "finish_reason": reason}
            kind = "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.state.model_name,
                "choices": [choice]}

    async def sse(self):
        usage = self.body.stream_options is not None and self.body.stream_options.include_usage
        try:
            if self.chat:
                yield _event(self._chunk(None, None, first=True))
            async for piece, reason in self._deltas():
                if piece or reason:
                    yield _event(self._chunk(piece, reason))
            if usage:
                yield _event({**self._chunk(None, None), "choices": [], "usage": self._usage()})
        except RuntimeError as e:
            yield _event(error_body(str(e), type="server_error"))
        finally:
            self.state.loop.abort(self.job)  # a no-op once the job is done
        yield "data: [DONE]\n\n"

    async def _collect(self) -> str:
        parts = []
        async for piece, _ in self._deltas():
            parts.append(piece)
        return "".join(parts)

    async def whole(self, request: Request):
        task = asyncio.ensure_future(self._collect())
        try:
            while not task.done():
                await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
                if not task.done() and await request.is_disconnected():
                    task.cancel()
                    return Response(status_code=499)
            text = task.result()
        except RuntimeError as e:
            return _error(500, str(e), type="server_error")
        finally:
            self.state.loop.abort(self.job)
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": self.finish_reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": self.finish_reason}
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.state.model_name, "choices": [choice],
                "usage": self._usage()}


def _event(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"
