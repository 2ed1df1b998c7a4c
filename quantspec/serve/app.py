"""The HTTP layer: FastAPI routes over an `EngineLoop`, in OpenAI's shapes.

`/v1/chat/completions` and `/v1/completions` (streaming as server-sent events or one JSON body),
OpenAI's `/v1/responses` over the chat pipeline (`responses.py`; stored ones, `response_store.py`), `/v1/models`, vLLM's `/tokenize`, `/detokenize` and `/tokenizer_info`, `/health`, `/metrics`. With
an API key set, every route but `/health` and `/metrics` wants `Authorization: Bearer <key>`
(401 otherwise). A request is validated (`protocol.py`), tokenized (`text.py`), checked and
turned into a `Job` per answer (`jobs.py`) and submitted; its tokens come back as deltas and
leave as OpenAI chunks or one body (`answers.py`). Bad input is a 400 with an OpenAI error object, a full queue a 503 with
Retry-After (the queue's drain time at the measured completion rate), and a client that goes away
has its sequence aborted. No model logic lives here.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import uuid
from dataclasses import dataclass, field
from typing import Annotated, Literal

from fastapi import Depends, FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import Response, StreamingResponse
from pydantic import ValidationError

from quantspec import __version__
from quantspec.serve.answers import Answers, RequestIdHeader, error_response, request_id
from quantspec.serve.jobs import BadRequest, check_model, check_request, make_job, request_params, serves
from quantspec.serve.loop import EngineLoop
from quantspec.serve.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                      GenerationRequest, TokenizeRequest)
from quantspec.serve.response_store import ResponseStore, Stored
from quantspec.serve.responses import (ResponseItems, ResponsesRequest, chat_request, input_items, response_events,
                                       whole_response)
from quantspec.serve.text import TokenText, chat_prompt_ids, completion_prompt_ids

__all__ = ["DEFAULT_STORED_RESPONSES", "ServeState", "build_app"]

DEFAULT_STORED_RESPONSES = 1000  # Responses kept for previous_response_id and retrieval (--max-stored-responses)


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
    responses: ResponseStore = field(default_factory=lambda: ResponseStore(DEFAULT_STORED_RESPONSES))
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


def _validation_message(exc) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    e = errors[0]
    loc = [str(p) for p in e.get("loc", ())]
    loc = loc[1:] if loc[:1] in (["body"], ["query"], ["path"]) else loc  # where FastAPI read it
    if e.get("type") == "json_invalid":
        return f"malformed JSON: {e.get('msg', '')}", None
    param = ".".join(loc) or None
    return (f"{param}: {e.get('msg')}" if param else e.get("msg", "invalid request")), param


def build_app(state: ServeState, *, on_shutdown=None, allowed_origins: tuple[str, ...] = (),
              allow_credentials: bool = False) -> FastAPI:
    """The routes over `state`; `on_shutdown()` runs when the server stops (after the drain).
    `allowed_origins`: the browser origins answered with CORS headers ("*": any; none: no CORS)."""

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        if on_shutdown is not None:
            on_shutdown()

    app = FastAPI(title="quantspec", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    app.add_middleware(RequestIdHeader)
    if allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(allowed_origins), allow_credentials=allow_credentials,
                           allow_methods=["*"], allow_headers=["*"])

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, exc):
        message, param = _validation_message(exc)
        return error_response(400, message, param=param)

    @app.exception_handler(BadRequest)
    async def _bad(request, exc):
        return error_response(exc.status, str(exc), param=exc.param, code=exc.code)

    guarded = _api_key_check(app, state)

    @app.get("/health")
    async def health():
        if not state.loop.alive:
            return error_response(503, "the engine loop has stopped", type="server_error")
        return {"status": "ok", "kv_cache": state.kv_cache}

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

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

    _model_routes(app, state, guarded)
    _responses_routes(app, state, guarded)
    _tokenizer_routes(app, state, guarded)
    return app


def _model_routes(app: FastAPI, state: ServeState, guarded: list) -> None:
    def card() -> dict:
        return {"id": state.model_name, "object": "model", "created": 0, "owned_by": "quantspec",
                "max_model_len": state.max_length, "kv_cache": state.kv_cache}

    @app.get("/v1/models", dependencies=guarded)
    async def models():
        return {"object": "list", "data": [card()]}

    @app.get("/v1/models/{model:path}", dependencies=guarded)
    async def model(model: str):  # the openai client's models.retrieve
        if not serves(state, model):
            return error_response(404, f"model {model!r} is not served here; use {state.model_name!r}",
                                  param="model", code="model_not_found")
        return {**card(), "id": model}

    @app.get("/version")
    async def version():
        return {"version": __version__}


def _responses_routes(app: FastAPI, state: ServeState, guarded: list) -> None:
    """OpenAI's Responses API: create (whole, streamed or in the background), retrieve, cancel,
    delete, and list a response's input items."""

    @app.post("/v1/responses", dependencies=guarded)
    async def create(request: Request):
        asked = _parse(await _json(request), ResponsesRequest)
        inputs = input_items(asked)
        earlier = state.responses.earlier(asked)
        body = _parse(chat_request(asked, earlier + inputs), ChatCompletionRequest)
        check_request(state, body)
        rid = request_id(request)
        out = _submit(state, body, [_chat_ids(state, body)], chat=True, request_id=rid)
        if not isinstance(out, Answers):
            return out
        entry = state.responses.entry(ResponseItems(asked, state.model_name, rid), inputs, earlier)
        if asked.background:
            state.responses.background(entry, out.chunks(), stream=body.stream)
            return _sse(entry.replay()) if body.stream else entry.items.response()
        if body.stream:
            return _sse(_kept(state, entry, response_events(entry.items, out.chunks())))
        chat = await out.whole(request)
        if not isinstance(chat, dict):
            return chat
        response = whole_response(entry.items, chat)
        state.responses.keep(entry)
        return response

    @app.get("/v1/responses/{rid}", dependencies=guarded)
    async def retrieve(rid: str, stream: bool = False, starting_after: Annotated[int, Query(ge=0)] | None = None):
        entry = state.responses.get(rid)
        if not stream:
            return entry.items.response()
        if entry.events is None:
            raise BadRequest("only a streamed background response can be streamed again; leave stream out",
                             param="stream")
        return _sse(entry.replay(starting_after))

    @app.post("/v1/responses/{rid}/cancel", dependencies=guarded)
    async def cancel(rid: str):
        return await state.responses.cancel(rid)

    @app.delete("/v1/responses/{rid}", dependencies=guarded)
    async def delete(rid: str):
        return state.responses.delete(rid)

    @app.get("/v1/responses/{rid}/input_items", dependencies=guarded)
    async def listed(rid: str, limit: Annotated[int, Query(ge=1, le=100)] = 20,
                     order: Literal["asc", "desc"] = "desc", after: str | None = None):
        return state.responses.input_items(rid, limit=limit, order=order, after=after)


async def _kept(state: ServeState, entry: Stored, events):
    """`events` passed on; the response stored once they end with it finished."""
    async for event in events:
        yield event
    if entry.items.status in ("completed", "incomplete"):
        state.responses.keep(entry)


def _api_key_check(app: FastAPI, state: ServeState) -> list:
    """The route dependencies that ask for `state.api_key` as a bearer token (none asked where it
    is None), and the 401 they answer without it."""

    @app.exception_handler(Unauthorized)
    async def _unauthorized(request, exc):
        return error_response(401, "a missing or wrong API key; send the server's --api-key as 'Authorization: Bearer KEY'",
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
            ids = _rendered(state, [{"role": m.role, "content": m.text()} for m in body.messages],
                            add_generation_prompt=body.add_generation_prompt)
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
    return _rendered(state, messages, add_generation_prompt=body.add_generation_prompt, tools=tools,
                     continue_final_message=body.continue_final_message, template_kwargs=body.template_kwargs())


def _rendered(state: ServeState, messages: list[dict], **kw) -> list[int]:
    """`chat_prompt_ids` with the served template; a template that refuses the messages (e.g.
    Gemma's, which has no system role) is the request's error (400), not the server's."""
    try:
        return chat_prompt_ids(state.tokenizer, messages, chat_template=state.chat_template, **kw)
    except Exception as e:  # the template's own checks (jinja2's raise_exception, transformers')
        raise BadRequest(f"the chat template cannot render these messages: {e}", param="messages") from None


async def _generate(state: ServeState, request: Request, body: GenerationRequest, prompts: list[list[int]], *,
                    chat: bool):
    out = _submit(state, body, prompts, chat=chat, request_id=request_id(request))
    if not isinstance(out, Answers):
        return out
    if body.stream:
        return _sse(out.sse())
    return await out.whole(request)


def _sse(events) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def _submit(state: ServeState, body: GenerationRequest, prompts: list[list[int]], *, chat: bool,
            request_id: str | None = None):
    """A checked request's jobs submitted to the loop → its `Answers` (ids made of `request_id`
    where the client sent one), or a 503 where the queue is full."""
    shared = request_params(state, body)
    jobs = [make_job(state, body, shared, ids, j) for ids in prompts for j in range(body.n)]  # choice i: prompt i // n
    answer_id = ("chatcmpl-" if chat else "cmpl-") + (request_id or uuid.uuid4().hex)
    for i, job in enumerate(jobs):
        job.request_id = answer_id if len(jobs) == 1 else f"{answer_id}-{i}"  # what request logs name
        if not state.loop.submit(job):
            for taken in jobs[:i]:
                state.loop.abort(taken)
            state.metrics.rejected.inc()
            return error_response(503, "the server is at capacity (its request queue is full); retry shortly",
                                  type="server_error", code="overloaded",
                                  headers={"Retry-After": str(state.loop.retry_after())})
    echoes = [None] * len(jobs)
    if isinstance(body, CompletionRequest) and body.echo:
        echoes = [p if isinstance(p, str) else state.tokenizer.decode(p) for p in body.prompts() for _ in range(body.n)]
    elif chat and body.echo and (body.messages[-1].role == "assistant" or not body.add_generation_prompt):
        echoes = [body.messages[-1].text()] * len(jobs)  # vLLM's: the last message, in the answer's role
    return Answers(state, body, jobs, chat, echoes, answer_id)
