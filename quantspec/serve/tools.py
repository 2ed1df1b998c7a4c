"""Tool calls on `/v1/chat/completions`. Where `tool_choice` forces one, as vLLM serves them without a
model-specific parser: the answer is held by a structured output (`infer.structured`) to the JSON
a call needs, and comes back as OpenAI's `tool_calls`.

- `tool_choice` naming a function: the answer is that function's arguments, a JSON object of its
  `parameters` schema (any object where it has none); one call.
- `"required"`: the answer is a JSON array of one or more `{"name": ..., "parameters": {...}}`,
  each the name of a listed tool and arguments of its schema; one call each.
- `"none"`: no call; the tools only reach the chat template.
- `"auto"` (OpenAI's default with tools): the model answers freely, and the parser of its own
  tool-call syntax the server was started with (`--enable-auto-tool-choice --tool-call-parser`,
  `tool_parsers.py`) finds its calls; without one it is a 400 naming `tool_choice`, never an
  answer that silently ignores the tools.

OpenAI's `parallel_tool_calls` false: at most one call (a "required" array of one; "auto": the
first the model writes).

Streaming: a named call's arguments stream as they are generated, and so do each call's of a
`"required"` answer (its id and name first, then its arguments' text), as vLLM streams them.
"""

from __future__ import annotations

import json

from quantspec.infer.structured import Guide
from quantspec.serve.protocol import ChatCompletionRequest
from quantspec.serve.tool_parsers import AutoToolCalls, Parsed, call_entry, partials_from

__all__ = ["ToolCalls", "tool_calls", "tool_guide"]

ANY_OBJECT = {"type": "object"}


class ToolChoiceError(ValueError):
    """What is wrong with a request's tools, for a 400 naming `param`."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def _forced(body: ChatCompletionRequest, auto: bool = False) -> str | dict | None:
    """The tool_choice that forces a call ("required" or {"name"}), or None (none forced, or
    "auto" where the server has a parser: `auto`)."""
    choice = body.tool_choice
    if not body.tools:
        if choice not in (None, "none"):
            raise ToolChoiceError("tool_choice needs tools", param="tool_choice")
        return None
    if choice is None or choice == "auto":
        if auto:
            return None
        raise ToolChoiceError("tool_choice 'auto' needs a server started with --enable-auto-tool-choice "
                              "--tool-call-parser NAME (a parser of the model's tool-call syntax); send tool_choice "
                              "'required', 'none' or a named function", param="tool_choice")
    if choice == "none":
        return None
    if choice == "required":
        return "required"
    names = [t.function.name for t in body.tools]
    if choice.function.name not in names:
        raise ToolChoiceError(f"tool_choice names {choice.function.name!r}, which is not among the tools "
                              f"({', '.join(names)})", param="tool_choice")
    return {"name": choice.function.name}


def tool_guide(body, auto: bool = False) -> Guide | None:
    """The structured output a forced tool call needs (None where `body` forces none); a
    `ToolChoiceError` for tools it cannot serve (`auto`: the server has a tool-call parser)."""
    if not isinstance(body, ChatCompletionRequest):
        return None
    forced = _forced(body, auto)
    if forced is None:
        return None
    schemas = {t.function.name: t.function.parameters or ANY_OBJECT for t in body.tools}
    if forced != "required":
        return Guide("json", json.dumps(schemas[forced["name"]]))
    calls = [{"type": "object", "properties": {"name": {"type": "string", "enum": [name]}, "parameters": schema},
              "required": ["name", "parameters"]} for name, schema in schemas.items()]
    array = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if body.parallel_tool_calls is False:
        array["maxItems"] = 1
    return Guide("json", json.dumps(array))


def tool_calls(body, parser=None) -> "ToolCalls | AutoToolCalls | None":
    """A choice's `ToolCalls` where `body` (a checked request) forces a call, its `AutoToolCalls`
    where it leaves the choice to the model and the server has a tool-call `parser`, else None."""
    if not isinstance(body, ChatCompletionRequest):
        return None
    forced = _forced(body, parser is not None)
    most = 1 if body.parallel_tool_calls is False else None
    if forced == "required":
        return AutoToolCalls(RequiredCalls(), most)
    if forced is not None:
        return ToolCalls(forced["name"])
    if parser is not None and body.tools and body.tool_choice in (None, "auto"):
        return AutoToolCalls(parser, most)
    return None


class RequiredCalls:
    """The JSON array of `{"name": ..., "parameters": {...}}` a "required" answer is held to, read
    as `tool_parsers` reads a model's own syntax: no content; the calls whole, or as far as they
    are written (an array cut by max_tokens is content, whole)."""

    def parse(self, text: str) -> Parsed:
        try:  # xgrammar lets control characters into strings
            calls = [(c["name"], json.dumps(c["parameters"], ensure_ascii=False)) for c in json.loads(text, strict=False)]
        except (ValueError, KeyError, TypeError):
            return Parsed(text)
        return Parsed(None, calls)

    def split(self, text: str, sent: int) -> tuple[int, bool]:
        return 0, True

    def partials(self, text: str) -> list:
        head = text.lstrip()
        return partials_from(head, 1, " \t\r\n,") if head.startswith("[") else []


class ToolCalls:
    """One choice's answer as a call of the named function `name`: `message` (whole) and `delta`
    (streamed); the answer is the call's arguments."""

    def __init__(self, name: str):
        self.name = name
        self._streamed = False

    def message(self, text: str, reason: str | None) -> tuple[dict, str | None]:
        """(the assistant message, the finish reason) of a whole answer: its call, finish
        "tool_calls"; an answer cut by max_tokens keeps finish "length" and the arguments as far
        as they came."""
        return ({"role": "assistant", "content": None, "tool_calls": [call_entry(self.name, text)]},
                "tool_calls" if reason == "stop" else reason)

    def delta(self, piece: str, reason: str | None) -> tuple[dict, str | None]:
        """A streamed chunk's delta for `piece`, and its finish reason."""
        delta = {}
        if piece or not self._streamed:
            call = {"index": 0, "function": {"arguments": piece}}
            if not self._streamed:
                call = {"index": 0, **call_entry(self.name, piece)}
                self._streamed = True
            delta = {"tool_calls": [call]}
        return delta, ("tool_calls" if reason == "stop" else reason)
