"""OpenAI's Responses API (`POST /v1/responses`, what `client.responses.create` sends) over the
chat pipeline: a request becomes a chat request (its `input` items and `instructions` the
messages, its function tools and `text.format` the chat's tools and `response_format`), and the
chat answer becomes a Response: `output` items (a `reasoning` item under a reasoning parser, a
`message` with `output_text`, a `function_call` per call), `usage` in input / output tokens,
`status` "incomplete" where `max_output_tokens` cut it. Streamed, it is the Responses event
sequence (`response.created` ... `response.completed`), each event with its `sequence_number`.

Responses are not stored: `previous_response_id` and `background` are a 400 (send the
conversation in `input`), and `store` is read as false. Tools other than functions, and input
other than text, function calls and their outputs (images, files), are a 400 naming the item.
vLLM's sampling fields beside them (`top_k`, `seed`, `stop`, `speculate`, ...) reach the chat
request as they are.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr

from quantspec.serve.jobs import BadRequest
from quantspec.serve.protocol import Real

__all__ = ["ResponseItems", "ResponsesRequest", "chat_request", "response_events", "whole_response"]


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
    background: StrictBool | None = None


# Responses fields beside `ResponsesRequest`'s that do not reach the chat request (accepted, not
# acted on; `stream_options` is the chat request's own)
_OWN = {"store", "include", "metadata", "user", "truncation", "service_tier", "prompt_cache_key", "safety_identifier",
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


def _messages(body: ResponsesRequest) -> list[dict]:
    """The chat messages of `instructions` and `input`."""
    items = [{"role": "user", "content": body.input}] if isinstance(body.input, str) else body.input
    messages = [{"role": "system", "content": body.instructions}] if body.instructions else []
    for i, item in enumerate(items):
        where, kind = f"input[{i}]", item.get("type", "message") if isinstance(item, dict) else None
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


def chat_request(body: ResponsesRequest) -> dict:
    """The chat request (a body for `ChatCompletionRequest`) that answers `body`."""
    if body.previous_response_id is not None:
        raise BadRequest("responses are not stored here; send the conversation in input instead of "
                         "previous_response_id", param="previous_response_id")
    if body.background:
        raise BadRequest("background responses are not served (responses are not stored); leave background out",
                         param="background")
    chat = {k: v for k, v in (body.model_extra or {}).items() if k not in _OWN}
    for name, neutral in (("n", 1), ("top_logprobs", 0)):
        if chat.pop(name, neutral) not in (neutral, None):
            raise BadRequest(f"{name} is not served on /v1/responses (one answer, no log-probabilities); use "
                             "/v1/chat/completions", param=name)
    chat.update(model=body.model, messages=_messages(body), temperature=body.temperature, top_p=body.top_p,
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
    """A Response's output items as an answer's pieces arrive (thinking, text, calls' ids, names
    and arguments), with the stream events each piece makes (`events` grows; each event is
    numbered), and the Response itself (`response`)."""

    def __init__(self, body: ResponsesRequest, model: str, request_id: str | None = None):
        self.body, self.model = body, model
        self.id, self.created = "resp_" + (request_id or uuid.uuid4().hex), int(time.time())
        self.items: list[dict] = []
        self.events: list[dict] = []  # taken by the stream as they come (`take`)
        self._sequence = 0
        self._open: dict | None = None  # the item pieces now go to
        self._calls: dict[int, dict] = {}  # a chat call index → its item

    def event(self, kind: str, **fields) -> None:
        self.events.append({"type": kind, "sequence_number": self._sequence, **fields})
        self._sequence += 1

    def take(self) -> list[str]:
        """The events made since the last take, as server-sent events named by their type."""
        out = [f"event: {e['type']}\ndata: {json.dumps(e, ensure_ascii=False)}\n\n" for e in self.events]
        self.events.clear()
        return out

    def response(self, status: str, usage: dict | None = None, reason: str | None = None) -> dict:
        b = self.body
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status, "error": None,
                "incomplete_details": {"reason": "max_output_tokens"} if reason == "length" else None,
                "instructions": b.instructions, "max_output_tokens": b.max_output_tokens, "model": self.model,
                "output": self.items, "parallel_tool_calls": b.parallel_tool_calls, "previous_response_id": None,
                "reasoning": b.reasoning, "store": False, "temperature": b.temperature,
                "text": b.text or {"format": {"type": "text"}}, "tool_choice": b.tool_choice or "auto",
                "tools": b.tools or [], "top_p": b.top_p, "truncation": "disabled", "usage": _usage(usage),
                "user": None, "metadata": {}}

    def start(self) -> None:
        self.event("response.created", response=self.response("in_progress"))
        self.event("response.in_progress", response=self.response("in_progress"))

    def _add(self, item: dict) -> dict:
        self.close()
        self.items.append(item)
        self._open = item
        self.event("response.output_item.added", output_index=len(self.items) - 1, item=dict(item, content=[])
                    if "content" in item else dict(item))
        return item

    def _where(self, item: dict) -> dict:
        return {"item_id": item["id"], "output_index": self.items.index(item)}

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
                              "role": "assistant", "content": [{"type": "output_text", "text": "", "annotations": []}]})
            self.event("response.content_part.added", content_index=0, part=dict(item["content"][0]),
                        **self._where(item))
        item["content"][0]["text"] += piece
        self.event("response.output_text.delta", content_index=0, delta=piece, logprobs=[], **self._where(item))

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
            self.event("response.output_text.done", content_index=0, text=item["content"][0]["text"], logprobs=[],
                        **where)
            self.event("response.content_part.done", content_index=0, part=item["content"][0], **where)
        elif item["type"] == "reasoning":
            self.event("response.reasoning_text.done", content_index=0, text=item["content"][0]["text"], **where)
        else:
            self.event("response.function_call_arguments.done", arguments=item["arguments"], **where)
        self.event("response.output_item.done", output_index=where["output_index"], item=item)

    def finish(self, usage: dict | None, reason: str | None) -> dict:
        """The closing events and the finished Response."""
        self.close()
        status = "incomplete" if reason == "length" else "completed"
        response = self.response(status, usage, reason)
        self.event(f"response.{status}", response=response)
        return response


def _feed(items: ResponseItems, delta: dict) -> None:
    """One chat delta's (or a whole message's) pieces into `items`."""
    if delta.get("reasoning_content"):
        items.thinking(delta["reasoning_content"])
    if delta.get("content"):
        items.text(delta["content"])
    for tc in delta.get("tool_calls") or []:
        fn = tc.get("function", {})
        items.call(tc.get("index", 0), fn.get("arguments") or "", tc.get("id"), fn.get("name"))


def whole_response(body: ResponsesRequest, chat: dict, request_id: str | None = None) -> dict:
    """The Response of a whole chat answer `chat` (its body)."""
    items = ResponseItems(body, chat["model"], request_id)
    choice = chat["choices"][0]
    message = choice["message"]
    _feed(items, {**message, "tool_calls": [{**tc, "index": i} for i, tc in enumerate(message.get("tool_calls") or [])]})
    return items.finish(chat.get("usage"), choice["finish_reason"])


async def response_events(body: ResponsesRequest, model: str, chunks, request_id: str | None = None):
    """The Responses stream (server-sent events, each named by its type) of a chat answer's
    `chunks` (`Answers.chunks`)."""
    items = ResponseItems(body, model, request_id)
    items.start()
    for event in items.take():
        yield event
    usage = reason = None
    async for chunk in chunks:
        if "error" in chunk:
            items.event("error", message=chunk["error"]["message"], code="server_error", param=None)
            items.event("response.failed", response={**items.response("failed"), "error": {
                "code": "server_error", "message": chunk["error"]["message"]}})
            break
        usage = chunk.get("usage") or usage
        for choice in chunk.get("choices", []):
            _feed(items, choice.get("delta", {}))
            reason = choice.get("finish_reason") or reason
        for event in items.take():
            yield event
    else:
        items.finish(usage, reason)
    for event in items.take():
        yield event
