"""OpenAI's Responses API (`POST /v1/responses`, what `client.responses.create` sends) over the
chat pipeline: a request becomes a chat request (its `input` items and `instructions` the
messages, its function tools and `text.format` the chat's tools and `response_format`), and the
chat answer becomes a Response: `output` items (a `reasoning` item under a reasoning parser, a
`message` with `output_text`, a `function_call` per call), `usage` in input / output tokens,
`status` "incomplete" where `max_output_tokens` cut it. Streamed, it is the Responses event
sequence (`response.created` ... `response.completed`), each event with its `sequence_number`.

`include` "message.output_text.logprobs" gives each `output_text` the log-probabilities of the
answer's tokens (with `top_logprobs` alternatives). A stored response (`response_store.py`) is
continued by `previous_response_id`: its conversation (earlier inputs and outputs, not its
instructions) goes before the new input. Tools other than functions, and input other than text,
function calls and their outputs (images, files), are a 400 naming the item. vLLM's sampling
fields beside them (`top_k`, `seed`, `stop`, `speculate`, ...) reach the chat request as they are.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr

from quantspec.serve.jobs import BadRequest
from quantspec.serve.protocol import Real

__all__ = ["ResponseItems", "ResponsesRequest", "chat_request", "input_items", "response_events", "whole_response"]

OUTPUT_LOGPROBS = "message.output_text.logprobs"
# `include` values: the one that adds to what this server answers, and those that name items a
# server of function tools and text never makes (accepted; there is nothing to add)
INCLUDES = (OUTPUT_LOGPROBS, "reasoning.encrypted_content", "code_interpreter_call.outputs",
            "computer_call_output.output.image_url", "file_search_call.results", "message.input_image.image_url",
            "web_search_call.action.sources", "web_search_call.results")


class ResponsesRequest(BaseModel):
    """The Responses fields the server reads (typed; a wrong type is a 400 naming the field)."""

    model_config = ConfigDict(extra="allow")
    model: StrictStr | None = None
    input: StrictStr | list[dict]
    instructions: StrictStr | None = None
    max_output_tokens: Annotated[int, Field(ge=1, strict=True)] | None = None
    temperature: Annotated[Real, Field(ge=0, le=2)] | None = None
    top_p: Annotated[Real, Field(gt=0, le=1)] | None = None
    stream: StrictBool = False
    tools: list[dict] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict | None = None
    parallel_tool_calls: StrictBool = True
    text: dict | None = None
    reasoning: dict | None = None
    previous_response_id: StrictStr | None = None
    background: StrictBool = False
    store: StrictBool = True  # OpenAI's default: kept for `previous_response_id` and retrieval
    include: list[StrictStr] | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=20, strict=True)] | None = None


# Responses fields beside `ResponsesRequest`'s that do not reach the chat request (accepted, not
# acted on; `stream_options` is the chat request's own)
_OWN = {"metadata", "user", "truncation", "service_tier", "prompt_cache_key", "safety_identifier",
        "stream_options"}


def _text_of(content, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise BadRequest(f"{where}.content must be text or a list of text parts", param=f"{where}.content")
    parts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text"):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise BadRequest(f"{where}.content[{j}] of type {kind!r} is not served; send input_text parts",
                             param=f"{where}.content")
        parts.append(str(part.get("text", "")))
    return "".join(parts)


def input_items(body: ResponsesRequest) -> list[dict]:
    """`body.input` as Response input items, each with an id (a string is one user message; a
    message's text content becomes its list of text parts), checked as `_messages` reads them."""
    items = [{"type": "message", "role": "user", "content": body.input}] if isinstance(body.input, str) else body.input
    out = []
    for item in items:
        item = {"type": "message", **item}
        if item["type"] == "message" and isinstance(item.get("content"), str):
            kind = "output_text" if item.get("role") == "assistant" else "input_text"
            item["content"] = [{"type": kind, "text": item["content"]}]
        prefix = {"message": "msg_", "function_call": "fc_", "function_call_output": "fco_"}.get(item["type"], "item_")
        item.setdefault("id", prefix + uuid.uuid4().hex)
        out.append(item)
    _messages(None, out)
    return out


def _messages(instructions: str | None, items: list[dict]) -> list[dict]:
    """The chat messages of `instructions` and input (or earlier output) `items`."""
    messages = [{"role": "system", "content": instructions}] if instructions else []
    for i, item in enumerate(items):
        where, kind = f"input[{i}]", item.get("type", "message")
        if kind == "message" and item.get("role") in ("system", "developer", "user", "assistant"):
            messages.append({"role": item["role"], "content": _text_of(item.get("content"), where)})
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments", "{}")}}
            if messages and messages[-1]["role"] == "assistant":  # the calls of one assistant turn
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": str(item.get("output", ""))})
        elif kind == "message":
            raise BadRequest(f"{where}.role {item.get('role')!r} is not one of system, developer, user, assistant",
                             param="input")
        elif kind != "reasoning":  # earlier thinking does not go back to the model
            raise BadRequest(f"{where} of type {kind!r} is not served; send messages, function_call and "
                             "function_call_output items", param="input")
    return messages


def _tools(body: ResponsesRequest) -> dict:
    """The chat request's tools, tool_choice and response_format."""
    out: dict = {}
    for i, tool in enumerate(body.tools or []):
        if tool.get("type") != "function":
            raise BadRequest(f"tools[{i}] of type {tool.get('type')!r} is not served; only function tools are",
                             param="tools")
        fn = {k: tool[k] for k in ("name", "description", "parameters") if tool.get(k) is not None}
        out.setdefault("tools", []).append({"type": "function", "function": fn})
    choice = body.tool_choice
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise BadRequest("tool_choice must be none, auto, required or {\"type\": \"function\", \"name\": ...}",
                             param="tool_choice")
        choice = {"type": "function", "function": {"name": choice["name"]}}
    if choice is not None:
        out["tool_choice"] = choice
    fmt = (body.text or {}).get("format") or {"type": "text"}
    if fmt.get("type") == "json_schema":
        out["response_format"] = {"type": "json_schema", "json_schema": {
            "name": fmt.get("name"), "schema": fmt.get("schema"), "strict": fmt.get("strict")}}
    elif fmt.get("type") == "json_object":
        out["response_format"] = {"type": "json_object"}
    elif fmt.get("type") != "text":
        raise BadRequest(f"text.format of type {fmt.get('type')!r} is not one of text, json_object, json_schema",
                         param="text")
    return out


def chat_request(body: ResponsesRequest, items: list[dict]) -> dict:
    """The chat request (a body for `ChatCompletionRequest`) that answers `body`, whose input
    items, after any earlier conversation, are `items`."""
    chat = {k: v for k, v in (body.model_extra or {}).items() if k not in _OWN}
    if chat.pop("n", 1) not in (1, None):
        raise BadRequest("n is not served on /v1/responses (one answer); use /v1/chat/completions", param="n")
    unknown = [name for name in body.include or () if name not in INCLUDES]
    if unknown:
        raise BadRequest(f"include {unknown[0]!r} is not one of {', '.join(INCLUDES)}", param="include")
    if OUTPUT_LOGPROBS in (body.include or ()):
        chat.update(logprobs=True, top_logprobs=body.top_logprobs or 0)
    chat.update(model=body.model, messages=_messages(body.instructions, items), temperature=body.temperature, top_p=body.top_p,
                stream=body.stream, parallel_tool_calls=body.parallel_tool_calls, **_tools(body))
    if body.max_output_tokens is not None:
        chat["max_completion_tokens"] = body.max_output_tokens
    if body.stream:
        chat["stream_options"] = {"include_usage": True}
    effort = (body.reasoning or {}).get("effort")
    if effort is not None:  # as vLLM hands it to chat templates that read it
        chat["chat_template_kwargs"] = {**chat.get("chat_template_kwargs", {}), "reasoning_effort": effort}
    return {k: v for k, v in chat.items() if v is not None}


def _usage(usage: dict | None) -> dict | None:
    if usage is None:
        return None
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"input_tokens": usage["prompt_tokens"], "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage["total_tokens"]}


class ResponseItems:
    """A Response's output items as an answer's pieces arrive (thinking, text with its tokens'
    log-probabilities, calls' ids, names and arguments), with the stream events each piece makes
    (`events` grows; each event is numbered), and the Response itself (`response`) in its
    `status`: queued, in_progress, then completed, incomplete, failed or cancelled."""

    def __init__(self, body: ResponsesRequest, model: str, request_id: str | None = None, status: str = "in_progress"):
        self.body, self.model, self.status = body, model, status
        self.id, self.created = "resp_" + (request_id or uuid.uuid4().hex), int(time.time())
        self.items: list[dict] = []
        self.events: list[dict] = []  # taken by the stream as they come (`take`)
        self.usage: dict | None = None
        self.reason: str | None = None  # the chat answer's finish reason
        self.stored = False  # whether the store keeps it (what `store` says of it)
        self._sequence = 0
        self._open: dict | None = None  # the item pieces now go to
        self._calls: dict[int, dict] = {}  # a chat call index → its item
        self._logprobs: list = []  # entries of tokens whose text has not reached output_text yet

    def event(self, kind: str, **fields) -> None:
        self.events.append({"type": kind, "sequence_number": self._sequence, **fields})
        self._sequence += 1

    def take(self) -> list[str]:
        """The events made since the last take, as server-sent events named by their type."""
        out = [f"event: {e['type']}\ndata: {json.dumps(e, ensure_ascii=False)}\n\n" for e in self.events]
        self.events.clear()
        return out

    def response(self, error: str | None = None) -> dict:
        """The Response as it stands; `error`: the message of a failed one."""
        b = self.body
        return {"id": self.id, "object": "response", "created_at": self.created, "status": self.status,
                "error": {"code": "server_error", "message": error} if error else None,
                "incomplete_details": {"reason": "max_output_tokens"} if self.status == "incomplete" else None,
                "instructions": b.instructions, "max_output_tokens": b.max_output_tokens, "model": self.model,
                "output": self.items, "parallel_tool_calls": b.parallel_tool_calls,
                "previous_response_id": b.previous_response_id, "reasoning": b.reasoning, "store": self.stored,
                "background": b.background, "temperature": b.temperature, "top_logprobs": b.top_logprobs,
                "text": b.text or {"format": {"type": "text"}}, "tool_choice": b.tool_choice or "auto",
                "tools": b.tools or [], "top_p": b.top_p, "truncation": "disabled", "usage": _usage(self.usage),
                "user": None, "metadata": (b.model_extra or {}).get("metadata") or {}}

    def start(self) -> None:
        self.status = "in_progress"
        self.event("response.created", response=self.response())
        self.event("response.in_progress", response=self.response())

    def _add(self, item: dict) -> dict:
        self.close()
        self.items.append(item)
        self._open = item
        self.event("response.output_item.added", output_index=len(self.items) - 1, item=dict(item, content=[])
                    if "content" in item else dict(item))
        return item

    def _where(self, item: dict) -> dict:
        return {"item_id": item["id"], "output_index": self.items.index(item)}

    def logprobs(self, entries: list) -> None:
        """Log-probability entries of the answer's next tokens (chat `logprobs.content` items): they
        go with the next output text."""
        self._logprobs.extend(entries)

    def thinking(self, piece: str) -> None:
        item = self._open
        if item is None or item["type"] != "reasoning":
            item = self._add({"type": "reasoning", "id": "rs_" + uuid.uuid4().hex, "summary": [], "status": "in_progress",
                              "content": [{"type": "reasoning_text", "text": ""}]})
        item["content"][0]["text"] += piece
        self.event("response.reasoning_text.delta", content_index=0, delta=piece, **self._where(item))

    def text(self, piece: str) -> None:
        item = self._open
        if item is None or item["type"] != "message":
            item = self._add({"type": "message", "id": "msg_" + uuid.uuid4().hex, "status": "in_progress",
                              "role": "assistant", "content": [{"type": "output_text", "text": "", "annotations": [],
                                                               "logprobs": []}]})
            self.event("response.content_part.added", content_index=0, part={**item["content"][0], "logprobs": []},
                        **self._where(item))
        entries, self._logprobs = self._logprobs, []
        item["content"][0]["text"] += piece
        item["content"][0]["logprobs"] += entries
        self.event("response.output_text.delta", content_index=0, delta=piece, logprobs=entries, **self._where(item))

    def call(self, index: int, arguments: str, call_id: str | None = None, name: str | None = None) -> None:
        """A call's first piece (its `call_id` and `name`) or more of its arguments."""
        item = self._calls.get(index)
        if item is None:
            item = self._calls[index] = self._add({"type": "function_call", "id": "fc_" + uuid.uuid4().hex,
                                                   "call_id": call_id, "name": name, "arguments": "",
                                                   "status": "in_progress"})
        if arguments:
            item["arguments"] += arguments
            self.event("response.function_call_arguments.delta", delta=arguments, **self._where(item))

    def close(self) -> None:
        """The open item's closing events: it is complete."""
        item, self._open = self._open, None
        if item is None:
            return
        item["status"] = "completed"
        where = self._where(item)
        if item["type"] == "message":
            self.event("response.output_text.done", content_index=0, text=item["content"][0]["text"],
                        logprobs=item["content"][0]["logprobs"], **where)
            self.event("response.content_part.done", content_index=0, part=item["content"][0], **where)
        elif item["type"] == "reasoning":
            self.event("response.reasoning_text.done", content_index=0, text=item["content"][0]["text"], **where)
        else:
            self.event("response.function_call_arguments.done", arguments=item["arguments"], **where)
        self.event("response.output_item.done", output_index=where["output_index"], item=item)

    def finish(self, usage: dict | None, reason: str | None) -> dict:
        """The closing events and the finished Response."""
        self.close()
        self.usage, self.reason = usage, reason
        self.status = "incomplete" if reason == "length" else "completed"
        response = self.response()
        self.event(f"response.{self.status}", response=response)
        return response

    def fail(self, message: str) -> None:
        """The closing events of a response the engine could not finish."""
        self.status = "failed"
        self.event("error", message=message, code="server_error", param=None)
        self.event("response.failed", response=self.response(message))


def _feed(items: ResponseItems, delta: dict, logprobs: dict | None = None) -> None:
    """One chat delta's (or a whole message's) pieces, and its tokens' `logprobs`, into `items`."""
    if logprobs:
        items.logprobs(logprobs.get("content") or [])
    if delta.get("reasoning_content"):
        items.thinking(delta["reasoning_content"])
    if delta.get("content"):
        items.text(delta["content"])
    for tc in delta.get("tool_calls") or []:
        fn = tc.get("function", {})
        items.call(tc.get("index", 0), fn.get("arguments") or "", tc.get("id"), fn.get("name"))


def whole_response(items: ResponseItems, chat: dict) -> dict:
    """The finished Response in `items` of a whole chat answer `chat` (its body)."""
    choice = chat["choices"][0]
    message = choice["message"]
    _feed(items, {**message, "tool_calls": [{**tc, "index": i} for i, tc in enumerate(message.get("tool_calls") or [])]},
          choice.get("logprobs"))
    response = items.finish(chat.get("usage"), choice["finish_reason"])
    items.events.clear()  # no stream reads them (a stored response keeps none)
    return response


async def response_events(items: ResponseItems, chunks):
    """The Responses stream (server-sent events, each named by its type) of a chat answer's
    `chunks` (`Answers.chunks`), the Response built in `items` as they go."""
    items.start()
    for event in items.take():
        yield event
    usage = reason = None
    async for chunk in chunks:
        if "error" in chunk:
            items.fail(chunk["error"]["message"])
            break
        usage = chunk.get("usage") or usage
        for choice in chunk.get("choices", []):
            _feed(items, choice.get("delta", {}), choice.get("logprobs"))
            reason = choice.get("finish_reason") or reason
        for event in items.take():
            yield event
    else:
        items.finish(usage, reason)
    for event in items.take():
        yield event
