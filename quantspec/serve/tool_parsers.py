"""Parsers of a model's own tool-call syntax, for `tool_choice` "auto" on a server started with
`--enable-auto-tool-choice --tool-call-parser NAME`; they read what vLLM's parsers of the same
names read:

- `hermes` (Hermes 2 Pro and 3, Qwen 2.5 and 3, and the models trained on their format): each call
  is `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`; the text before the first call is
  the message's content; a last call whose closing tag is missing counts when its JSON is whole.
- `llama3_json` (Llama 3.1, 3.2, 3.3): the answer, after an optional `<|python_tag|>`, is a JSON
  object `{"name": ..., "parameters": {...}}` ("arguments" is read too), or several separated by
  ";"; an answer that does not start with `{` is content.

A call whose JSON does not parse, or that names no function, leaves the whole answer as content:
what the model wrote reaches the client, never a call made up from part of it.

`AutoToolCalls` is one choice's answer under a parser, whole (`message`) or streamed (`delta`):
content streams as it is generated, text that may begin a call is held back until it is clear,
and once a call has begun the rest of the answer is parsed at its end, its calls arriving whole
in the last chunk (finish reason "tool_calls").
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Callable

__all__ = ["TOOL_PARSERS", "AutoToolCalls", "HermesParser", "Llama3JsonParser", "Parsed", "call_entry",
           "held_tail", "tool_parser"]


def call_entry(name: str, arguments: str) -> dict:
    """One of OpenAI's `tool_calls` entries, with a fresh id."""
    return {"id": "call_" + uuid.uuid4().hex[:24], "type": "function", "function": {"name": name, "arguments": arguments}}


def held_tail(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag`: what a stream holds back until
    the next piece says whether the tag follows."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0


@dataclass
class Parsed:
    """An answer read by a parser: its content (None: none) and its calls (name, arguments JSON)."""

    content: str | None
    calls: list[tuple[str, str]] = field(default_factory=list)


def _call(obj) -> tuple[str, str] | None:
    """(name, arguments JSON) of a decoded call, or None where it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)


class HermesParser:
    """`<tool_call>{...}</tool_call>` blocks after optional content (module docstring)."""

    name = "hermes"
    START = "<tool_call>"
    _CALL = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)\Z", re.S)

    def parse(self, text: str) -> Parsed:
        start = text.find(self.START)
        if start < 0:
            return Parsed(text)
        calls = []
        for m in self._CALL.finditer(text):
            try:
                call = _call(json.loads(m.group(1) if m.group(1) is not None else m.group(2)))
            except ValueError:
                call = None
            if call is None:
                return Parsed(text)
            calls.append(call)
        content = text[:start]
        return Parsed(content if content.strip() else None, calls)

    def split(self, text: str, sent: int) -> tuple[int, bool]:
        """(how much of `text` is content for sure, whether a call has begun), `sent` characters
        of it already streamed as content."""
        start = text.find(self.START)
        if start >= 0:
            return start, True
        return len(text) - held_tail(text, self.START), False


class Llama3JsonParser:
    """An answer that is one JSON call or several separated by ";" (module docstring)."""

    name = "llama3_json"
    TAG = "<|python_tag|>"

    def parse(self, text: str) -> Parsed:
        body = text.strip().removeprefix(self.TAG).lstrip()
        if not body.startswith("{"):
            return Parsed(text)
        decoder, calls, at = json.JSONDecoder(), [], 0
        while at < len(body):
            try:
                obj, at = decoder.raw_decode(body, at)
            except ValueError:
                return Parsed(text)
            call = _call(obj)
            if call is None:
                return Parsed(text)
            calls.append(call)
            while at < len(body) and body[at] in " \t\r\n;":
                at += 1
        return Parsed(None, calls)

    def split(self, text: str, sent: int) -> tuple[int, bool]:
        """As `HermesParser.split`: a call can only be the whole answer, so once content has been
        streamed the rest is content too."""
        if sent:
            return len(text), False
        head = text.lstrip()
        if head.startswith("{") or head.startswith(self.TAG):
            return 0, True
        if not head or self.TAG.startswith(head):
            return 0, False
        return len(text), False


TOOL_PARSERS = {p.name: p for p in (HermesParser, Llama3JsonParser)}


def tool_parser(name: str):
    """The parser called `name` (a key of `TOOL_PARSERS`)."""
    return TOOL_PARSERS[name]()


class AutoToolCalls:
    """One choice's answer under a tool-call parser (module docstring), with the interface of
    `tools.ToolCalls`."""

    def __init__(self, parser):
        self.parser = parser
        self._text = ""
        self._sent = 0  # characters of the answer streamed as content
        self._in_call = False

    def message(self, text: str, reason: str | None) -> tuple[dict, str | None]:
        """(the assistant message, the finish reason) of a whole answer."""
        parsed = self.parser.parse(text)
        if not parsed.calls:
            return {"role": "assistant", "content": text}, reason
        calls = [call_entry(n, a) for n, a in parsed.calls]
        return ({"role": "assistant", "content": parsed.content, "tool_calls": calls},
                "tool_calls" if reason == "stop" else reason)

    def delta(self, piece: str, reason: str | None, text: Callable[[], str] | None = None) -> tuple[dict, str | None]:
        """A streamed chunk's delta for `piece` and its finish reason (`text` is not needed: the
        pieces are kept)."""
        self._text += piece
        out = ""
        if not self._in_call:
            safe, self._in_call = self.parser.split(self._text, self._sent)
            if safe > self._sent:
                out, self._sent = self._text[self._sent:safe], safe
        if reason is None:
            return ({"content": out} if out else {}), None
        if self._in_call:
            parsed = self.parser.parse(self._text)
            if parsed.calls:
                delta = {"tool_calls": [{"index": i, **call_entry(n, a)} for i, (n, a) in enumerate(parsed.calls)]}
                if out:
                    delta["content"] = out
                return delta, "tool_calls" if reason == "stop" else reason
        out += self._text[self._sent:]  # held-back text that began no call, or a call that did not parse
        self._sent = len(self._text)
        return ({"content": out} if out else {}), reason
