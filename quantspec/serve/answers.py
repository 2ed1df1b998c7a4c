"""One request's answers in OpenAI's shapes, streamed as server-sent events or whole: `n` choices
per prompt, each fed by its job's deltas (text through the stop-string cut, log-probabilities,
tool calls and reasoning split out where the request and the server ask for them)."""

from __future__ import annotations

import asyncio
import json
import re
import time
from typing import TYPE_CHECKING

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from quantspec.serve.logprob_shapes import chat_entries, legacy_entries, vllm_prompt_logprobs
from quantspec.serve.loop import Delta, Job
from quantspec.serve.protocol import CompletionRequest, GenerationRequest, error_body
from quantspec.serve.reasoning import ReasoningStream, prompt_thinks
from quantspec.serve.text import TextStream
from quantspec.serve.tools import tool_calls

if TYPE_CHECKING:
    from quantspec.serve.app import ServeState

__all__ = ["Answers", "RequestIdHeader", "error_response", "request_id"]

DISCONNECT_POLL_S = 0.25
FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length", "max_length": "length"}


_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")


def request_id(request: Request) -> str | None:
    """The client's `X-Request-Id` (as vLLM reads it), where it is a plain id: the answer's id is
    made of it, so the client's logs and the answer name the same request."""
    rid = request.headers.get("x-request-id")
    return rid if rid is not None and _REQUEST_ID.fullmatch(rid) else None


class RequestIdHeader:
    """ASGI middleware: a request's `X-Request-Id` comes back on its response (streamed ones too)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        rid = dict(scope.get("headers") or ()).get(b"x-request-id") if scope["type"] == "http" else None
        if rid is None:
            return await self.app(scope, receive, send)

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), (b"x-request-id", rid)]}
            await send(message)

        return await self.app(scope, receive, send_with_id)


def error_response(status: int, message: str, *, type: str = "invalid_request_error", param=None, code=None,
                   headers=None) -> JSONResponse:
    """An HTTP error with OpenAI's error object."""
    return JSONResponse(error_body(message, type=type, param=param, code=code), status_code=status, headers=headers)


class _Choice:
    """One answer (choice `index`): its text deltas, each with the log-probability entries of the
    tokens it brings (chat: `content` items; completions: legacy rows)."""

    def __init__(self, resp: "Answers", index: int, job: Job, echo: str | None):
        self.resp, self.index, self.job, self.echo = resp, index, job, echo
        body = resp.body
        # a forced tool call, or "auto" under a parser: the answer goes out as `tool_calls` (`serve/tools.py`)
        self.tools = tool_calls(body, resp.state.tool_parser)
        keep = getattr(getattr(self.tools, "parser", None), "keeps_special_tokens", False)  # e.g. mistral's [TOOL_CALLS]
        self.text = TextStream(resp.state.tokenizer, body.stop_strings(),
                               skip_special_tokens=body.skip_special_tokens and not keep,
                               include_stop=body.include_stop_str_in_output)
        self.score_only = isinstance(body, CompletionRequest) and body.max_tokens == 0
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None  # vLLM's: the stop string or stop token id that ended it
        self.offset = 0  # characters of this choice's text before the next token (legacy text_offset)
        self.prompt_logprobs: list | None = None  # vLLM's, where asked for
        self.ids: list[int] = []  # the answer's token ids (a stop token too, whose text is not shown)
        # a reasoning model's thinking, split from the content (where a grammar holds the answer:
        # only if it holds it after the thinking)
        free = job.params.guide is None or job.params.guide_after is not None
        parser = resp.state.reasoning_parser if resp.chat and free else None
        self.reasoning = None
        if parser is not None:  # whether it starts thinking may hang on the prompt's last tokens
            self.reasoning = ReasoningStream(parser, prompt_thinks(parser, resp.state.tokenizer, job.prompt_ids))

    @property
    def completion_tokens(self) -> int:
        return 0 if self.score_only else len(self.ids)

    def _entries(self, ids: list[int], lps: list) -> list:
        as_ids = self.resp.body.return_tokens_as_token_ids
        if self.resp.chat:
            return chat_entries(self.resp.token_text, ids, lps, as_ids)
        out, self.offset = legacy_entries(self.resp.token_text, ids, lps, self.resp.body.logprobs, self.offset, as_ids)
        return out

    def _shown(self, d: Delta) -> list[int]:
        """The ids of `d` whose text the answer shows: all but a stop token (EOS, a stop_token_ids
        one) that ended it, as vLLM, unless the request asks for it (include_stop_str_in_output)."""
        ids = d.token_ids
        if d.finish_reason in ("eos", "stop") and ids and not self.resp.body.include_stop_str_in_output and \
                (ids[-1] in self.resp.state.loop.engine.eos or ids[-1] in self.job.params.stop_token_ids):
            return ids[:-1]
        return ids

    async def deltas(self):
        """(text piece, log-probability entries, finish reason or None, the delta's token ids) per
        engine delta, until the last."""
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
                self.ids += d.token_ids
                piece += self.text.feed(self._shown(d))
                if d.logprobs:
                    entries += self._entries(d.token_ids, d.logprobs)
            ids = [] if self.score_only else list(d.token_ids)
            if d.finish_reason is None:
                yield piece, entries, None, ids
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
            yield piece, entries, self.finish_reason, ids
            return

    async def collect(self) -> tuple[str, list]:
        parts, entries = [], []
        async for piece, e, _, _ in self.deltas():
            parts.append(piece)
            entries += e
        return "".join(parts), entries


class Answers:
    """One request's answers (module docstring)."""

    def __init__(self, state: ServeState, body: GenerationRequest, jobs: list[Job], chat: bool,
                 echoes: list[str | None], answer_id: str):
        self.state, self.body, self.chat = state, body, chat
        self.id = answer_id  # chatcmpl-… / cmpl-…, of the client's X-Request-Id where it sent one
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
            delta, reason = tools.delta(piece or "", reason)
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
            kind = "chat.completion.chunk"
        elif self.chat:
            delta = {"role": "assistant", "content": ""} if first else ({"content": piece} if piece else {})
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
            kind = "chat.completion.chunk"
        else:
            choice = {"index": index, "text": piece or "", "logprobs": logprobs, "finish_reason": reason}
            kind = "text_completion"
        if thought and self.body.include_reasoning:
            choice["delta"] = {**choice["delta"], "reasoning_content": thought, "reasoning": thought}
        if reason is not None:
            choice["stop_reason"] = self.choices[index].stop_reason
        return {"id": self.id, "object": kind, "created": self.created, "model": self.state.model_name,
                "choices": [choice]}

    def _abort(self) -> None:
        for c in self.choices:
            self.state.loop.abort(c.job)  # a no-op once the job is done

    async def sse(self):
        """The answers as server-sent events, then `[DONE]`."""
        async for obj in self.chunks():
            yield _event(obj)
        yield "data: [DONE]\n\n"

    async def chunks(self):
        """The answers as OpenAI's stream chunks (dicts), each with the usage so far where the
        request asks for it, the last with the request's usage where it asks for that; an engine
        failure ends them with an error object."""
        usage = self.body.stream_options is not None and self.body.stream_options.include_usage
        every = usage and self.body.stream_options.continuous_usage_stats  # the usage so far in each chunk

        def out(chunk: dict) -> dict:
            return {**chunk, "usage": self._usage()} if every else chunk

        try:
            if self.chat:
                for c in self.choices:
                    chunk = self._chunk(c.index, None, [], None, first=True)
                    if self.body.return_token_ids:
                        chunk["prompt_token_ids"] = c.job.prompt_ids
                    yield out(chunk)
                    if c.echo:  # chat `echo`: the last message's text, before the answer's
                        chunk = {**chunk, "choices": [{**chunk["choices"][0], "delta": {"content": c.echo}}]}
                        chunk.pop("prompt_token_ids", None)
                        yield out(chunk)
            started = set()  # choices whose first chunk has gone out
            async for index, (piece, entries, reason, ids) in _merged([c.deltas() for c in self.choices]):
                if piece or reason or entries or (ids and self.body.return_token_ids):
                    chunk = self._chunk(index, piece, entries, reason)
                    if self.body.return_token_ids:  # vLLM's: each chunk's token ids, the prompt's first
                        if not self.chat and index not in started:
                            chunk["choices"][0]["prompt_token_ids"] = self.choices[index].job.prompt_ids
                        chunk["choices"][0]["token_ids"] = ids
                    started.add(index)
                    yield out(chunk)
            if usage:
                yield {**self._chunk(0, None, [], None), "choices": [], "usage": self._usage()}
        except RuntimeError as e:
            yield error_body(str(e), type="server_error")
        finally:
            self._abort()

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
            return error_response(500, str(e), type="server_error")
        finally:
            self._abort()
        choices = []
        for c, (text, entries) in zip(self.choices, results):
            if self.chat:
                thought = None
                if c.reasoning is not None:
                    thought, text = c.reasoning.parser.split(text, c.reasoning.thinking_first)
                message, reason = (({"role": "assistant", "content": text}, c.finish_reason) if c.tools is None
                                   else c.tools.message(text or "", c.finish_reason))
                if c.reasoning is not None:
                    if self.body.include_reasoning:
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
                if self.body.return_token_ids:
                    choices[-1]["prompt_token_ids"] = c.job.prompt_ids
            if self.body.return_token_ids:
                choices[-1]["token_ids"] = list(c.ids)
        out = {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
               "created": self.created, "model": self.state.model_name, "choices": choices, "usage": self._usage()}
        if self.chat and self.body.prompt_logprobs is not None:  # vLLM's place for a chat request's
            out["prompt_logprobs"] = self.choices[0].prompt_logprobs
        if self.chat and self.body.return_token_ids:
            out["prompt_token_ids"] = self.choices[0].job.prompt_ids
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


def _event(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"
