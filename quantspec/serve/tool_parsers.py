"""Parsers of a model's own tool-call syntax, for `tool_choice` "auto" on a server started with
`--enable-auto-tool-choice --tool-call-parser NAME`; they read what vLLM's parsers of the same
names read:

- `hermes` (Hermes 2 Pro and 3, Qwen 2.5 and 3, and the models trained on their format): each call
  is `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`; the text before the first call is
  the message's content; a last call whose closing tag is missing counts when its JSON is whole.
- `llama3_json` (Llama 3.1, 3.2, 3.3): the answer, after an optional `<|python_tag|>`, is a JSON
  object `{"name": ..., "parameters": {...}}` ("arguments" is read too), or several separated by
  ";"; an answer that does not start with `{` is content.
- `pythonic` (Llama 3.2 and 4 with a pythonic tool template, ToolACE): the answer, after an
  optional `<|python_start|>`, is a Python list of calls with keyword arguments of literal values,
  `[get_weather(city="Paris"), get_time()]`; it is read as Python syntax, never run. Streamed, a
  call's arguments go out a keyword argument at a time, each once it is written whole (as the
  JSON of the arguments so far, which the whole call's JSON continues).
- `mistral` (Mistral 7B v0.3, Mistral Small / Nemo / Large, Ministral, Devstral, Magistral): the
  text before `[TOOL_CALLS]` is content; after it, a JSON list of `{"name": ..., "arguments":
  {...}}` (tokenizers up to v7), or `name[ARGS]{...}` per call, each after its own `[TOOL_CALLS]`
  (v11 on; a `[CALL_ID]id` before `[ARGS]` is skipped). `[TOOL_CALLS]` is a special token, so its
  answers are decoded with special tokens kept (`keeps_special_tokens`), and its call ids are 9
  letters and digits, the only ids Mistral's chat templates take back.

A call whose JSON does not parse, or that names no function, leaves the whole answer as content:
what the model wrote reaches the client, never a call made up from part of it.

`AutoToolCalls` is one choice's answer under a parser, whole (`message`) or streamed (`delta`):
content streams as it is generated, and text that may begin a call is held back until it is
clear. Streamed, a call written as `{"name": ..., "arguments": {...}` (the parsers' formats, in
that order) goes out as vLLM's parsers send it: its id and name once the name is complete, then
its arguments' JSON text as it is generated (the model's own text, which decodes to the object
the whole answer gives); a call written otherwise arrives whole once the answer ends. Once a
call has gone out, the answer is calls: a later one that does not parse is dropped, and one cut
by `max_tokens` ends with the arguments written so far (finish "length"), as in vLLM.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

__all__ = ["TOOL_PARSERS", "AutoToolCalls", "HermesParser", "Llama3JsonParser", "MistralParser", "Parsed", "Partial",
           "PythonicParser",
           "call_entry", "held_tail", "partial_call", "partials_from", "tool_parser"]


def call_entry(name: str, arguments: str, call_id: str | None = None) -> dict:
    """One of OpenAI's `tool_calls` entries, with `call_id` or a fresh id."""
    return {"id": call_id or "call_" + uuid.uuid4().hex[:24], "type": "function",
            "function": {"name": name, "arguments": arguments}}


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


_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')
_CLOSE = re.compile(r"\s*\}")  # the call object's own end, after its arguments


@dataclass
class Partial:
    """A call as far as it is written: its name, its arguments' JSON text so far, and where the
    call's object ends in the text it was read from (None: not yet)."""

    name: str
    arguments: str
    end: int | None = None


def _json_value_end(text: str, start: int) -> int | None:
    """The end of the JSON object or array that starts at `text[start]`, None while it is open."""
    depth, in_string, escaped = 0, False, False
    for i in range(start, len(text)):
        ch = text[i]
        if in_string:
            escaped, in_string = (False, True) if escaped else (ch == "\\", ch != '"')
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


def partial_call(text: str, at: int = 0) -> Partial | None:
    """The call written from `text[at]` on, as far as it goes, where it starts with its name and
    then an object of arguments; None where it does not (yet)."""
    m = _HEAD.match(text, at)
    if m is None or m.end() >= len(text) or text[m.end()] != "{":
        return None
    try:
        name = json.loads(f'"{m.group(1)}"')
    except ValueError:
        return None
    end = _json_value_end(text, m.end())
    if end is None:
        return Partial(name, text[m.end():])
    close = _CLOSE.match(text, end)
    return Partial(name, text[m.end():end], close.end() if close else None)


def partials_from(text: str, at: int, between: str) -> list[Partial]:
    """The calls written one after another from `text[at]` on, with characters of `between`
    between them, as far as they go (`partial_call`)."""
    out = []
    while True:
        p = partial_call(text, at)
        if p is None:
            return out
        out.append(p)
        if p.end is None:
            return out
        at = p.end
        while at < len(text) and text[at] in between:
            at += 1


def _call(obj) -> tuple[str, str] | None:
    """(name, arguments JSON) of a decoded call, or None where it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)


def _split_whole_answer(text: str, sent: int, opener: str, tag: str) -> tuple[int, bool]:
    """`split` of a syntax whose calls are the whole answer, starting with `opener` (or `tag`):
    undecided while the answer is blank or a start of `tag`, else all content or all calls."""
    if sent:
        return len(text), False
    head = text.lstrip()
    if head.startswith(opener) or head.startswith(tag):
        return 0, True
    if not head or tag.startswith(head):
        return 0, False
    return len(text), False


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

    def partials(self, text: str) -> list[Partial]:
        """The calls of a streamed answer as far as they are written (`partial_call`), in order,
        up to the first that is not."""
        out = []
        for m in re.finditer(re.escape(self.START), text):
            p = partial_call(text, m.end())
            if p is None:
                break
            out.append(p)
        return out

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

    def partials(self, text: str) -> list[Partial]:
        """As `HermesParser.partials`: the calls one after another, separated by ";"."""
        return partials_from(text.lstrip().removeprefix(self.TAG), 0, " \t\r\n;")

    def split(self, text: str, sent: int) -> tuple[int, bool]:
        """As `HermesParser.split`: a call can only be the whole answer, so once content has been
        streamed the rest is content too."""
        return _split_whole_answer(text, sent, "{", self.TAG)


class PythonicParser:
    """An answer that is a Python list of calls with literal keyword arguments (module docstring)."""

    name = "pythonic"
    START, END = "<|python_start|>", "<|python_end|>"

    def _body(self, text: str) -> str:
        return text.strip().removeprefix(self.START).removesuffix(self.END).strip()

    def parse(self, text: str) -> Parsed:
        import ast

        body = self._body(text)
        if not body.startswith("["):
            return Parsed(text)
        try:
            tree = ast.parse(body, mode="eval").body
            if not isinstance(tree, ast.List) or not tree.elts:
                return Parsed(text)
            calls = []
            for call in tree.elts:
                if not isinstance(call, ast.Call) or not isinstance(call.func, ast.Name) or call.args:
                    return Parsed(text)
                args = {kw.arg: ast.literal_eval(kw.value) for kw in call.keywords if kw.arg is not None}
                if len(args) != len(call.keywords):  # a **spread
                    return Parsed(text)
                calls.append((call.func.id, json.dumps(args, ensure_ascii=False)))
        except (SyntaxError, ValueError, TypeError, MemoryError, RecursionError):
            return Parsed(text)
        return Parsed(None, calls)

    def split(self, text: str, sent: int) -> tuple[int, bool]:
        """As `Llama3JsonParser.split`, for an answer that starts with `[`."""
        return _split_whole_answer(text, sent, "[", self.START)

    def partials(self, text: str) -> list[Partial]:
        """The calls as far as written, each with the JSON of its whole keyword arguments so far
        (its closing brace once the call is closed), up to the first that does not read."""
        import ast

        body = text.strip().removeprefix(self.START).lstrip()
        if not body.startswith("["):
            return []
        out, at = [], 1
        while (m := _PY_CALL.match(body, at)) is not None:
            kwargs, closed, at = _python_parts(body, m.end(), ")")
            args = {}
            for part in kwargs:
                key, eq, value = part.partition("=")
                try:
                    if not eq or not key.strip().isidentifier():
                        return out
                    args[key.strip()] = ast.literal_eval(value.strip())
                except (SyntaxError, ValueError, TypeError, MemoryError, RecursionError):
                    return out
            whole = json.dumps(args, ensure_ascii=False)
            out.append(Partial(m.group(1), whole if closed else whole[:-1], at if closed else None))
            if not closed:
                return out
            while at < len(body) and body[at] in " \t\r\n,":
                at += 1
        return out


_PY_CALL = re.compile(r"\s*([A-Za-z_][A-Za-z0-9_]*)\s*\(")


def _python_parts(text: str, at: int, closer: str) -> tuple[list[str], bool, int]:
    """The comma-separated parts of a bracketed Python expression from `text[at]` (just inside its
    opening bracket), as far as written: (the parts written whole, whether `closer` closed it,
    where the scan stopped). Strings and nested brackets are skipped over."""
    parts, depth, quote, start, i = [], 0, None, at, at
    while i < len(text):
        ch = text[i]
        if quote is not None:
            if ch == "\\":
                i += 1
            elif ch == quote:
                quote = None
        elif ch in "'\"":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}" and depth:
            depth -= 1
        elif ch in ")]}":
            if ch != closer:
                return parts, False, i
            if text[start:i].strip():
                parts.append(text[start:i])
            return parts, True, i + 1
        elif ch == "," and not depth:
            parts.append(text[start:i])
            start = i + 1
        i += 1
    return parts, False, len(text)


class MistralParser:
    """Content, then `[TOOL_CALLS]` and the calls as a JSON list or as `name[ARGS]{...}` (module docstring)."""

    name = "mistral"
    TAG, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
    keeps_special_tokens = True  # [TOOL_CALLS] is one

    @staticmethod
    def call_id() -> str:
        return uuid.uuid4().hex[:9]

    def _named(self, text: str, at: int) -> list[Partial]:
        """The `name[ARGS]{...}` calls from `text[at]` on, each after a [TOOL_CALLS], as far as written."""
        out = []
        while text.startswith(self.TAG, at):
            args = text.find(self.ARGS, at)
            if args < 0:
                break
            name = text[at + len(self.TAG):args].split(self.CALL_ID)[0].strip()
            start = args + len(self.ARGS)
            while start < len(text) and text[start].isspace():
                start += 1
            if not name or start >= len(text) or text[start] != "{":
                break
            end = _json_value_end(text, start)
            out.append(Partial(name, text[start:end or len(text)], end))
            if end is None:
                break
            at = end + len(text[end:]) - len(text[end:].lstrip())
        return out

    def partials(self, text: str) -> list[Partial]:
        at = text.find(self.TAG)
        if at < 0:
            return []
        after = at + len(self.TAG)
        body = text[after:].lstrip()
        if body.startswith("["):  # a JSON list of calls
            return partials_from(text, len(text) - len(body) + 1, " \t\r\n,")
        return self._named(text, at)

    def parse(self, text: str) -> Parsed:
        at = text.find(self.TAG)
        if at < 0:
            return Parsed(text)
        content = text[:at] if text[:at].strip() else None
        body = text[at + len(self.TAG):].strip()
        if body.startswith("["):
            try:
                calls = [_call(obj) for obj in json.loads(body)]
            except (ValueError, TypeError):
                return Parsed(text)
        else:
            named = self._named(text, at)
            if not named or named[-1].end is None or text[named[-1].end:].strip():
                return Parsed(text)  # a call cut short, or text after the calls
            try:
                calls = [(p.name, json.dumps(json.loads(p.arguments), ensure_ascii=False)) for p in named]
            except ValueError:
                return Parsed(text)
        if not calls or any(c is None for c in calls):
            return Parsed(text)
        return Parsed(content, calls)

    def split(self, text: str, sent: int) -> tuple[int, bool]:
        """As `HermesParser.split`, for `[TOOL_CALLS]`."""
        start = text.find(self.TAG)
        if start >= 0:
            return start, True
        return len(text) - held_tail(text, self.TAG), False


TOOL_PARSERS = {p.name: p for p in (HermesParser, Llama3JsonParser, PythonicParser, MistralParser)}


def tool_parser(name: str):
    """The parser called `name` (a key of `TOOL_PARSERS`)."""
    return TOOL_PARSERS[name]()


class AutoToolCalls:
    """One choice's answer under a tool-call parser (module docstring), with the interface of
    `tools.ToolCalls`."""

    def __init__(self, parser, most: int | None = None):
        self.parser, self.most = parser, most  # most: the calls kept (OpenAI's parallel_tool_calls false: 1)
        self._new_id = getattr(parser, "call_id", lambda: None)  # the call ids the model's template takes back
        self._text = ""
        self._sent = 0  # characters of the answer streamed as content
        self._in_call = False
        self._calls: list[list] = []  # per call streamed: [its entry's id, characters of its arguments sent]

    def message(self, text: str, reason: str | None) -> tuple[dict, str | None]:
        """(the assistant message, the finish reason) of a whole answer."""
        parsed = self.parser.parse(text)
        if not parsed.calls:
            return {"role": "assistant", "content": text}, reason
        calls = [call_entry(n, a, self._new_id()) for n, a in parsed.calls[:self.most]]
        return ({"role": "assistant", "content": parsed.content, "tool_calls": calls},
                "tool_calls" if reason == "stop" else reason)

    def delta(self, piece: str, reason: str | None) -> tuple[dict, str | None]:
        """A streamed chunk's delta for `piece` and its finish reason."""
        self._text += piece
        out = ""
        if not self._in_call:
            safe, self._in_call = self.parser.split(self._text, self._sent)
            if safe > self._sent:
                out, self._sent = self._text[self._sent:safe], safe
        calls = self._stream_calls() if self._in_call else []
        if reason is not None and not self._calls:  # no call has gone out: the whole answer decides
            parsed = self.parser.parse(self._text) if self._in_call else Parsed(None)
            if parsed.calls:
                calls = [{"index": i, **call_entry(n, a, self._new_id())} for i, (n, a) in enumerate(parsed.calls[:self.most])]
                reason = "tool_calls" if reason == "stop" else reason
            else:  # held-back text that began no call, or a call that did not parse
                out += self._text[self._sent:]
                self._sent = len(self._text)
        elif reason is not None:
            calls += self._rest_of_calls(len(self._calls))
            reason = "tool_calls" if reason == "stop" else reason
        delta = {"content": out} if out else {}
        if calls:
            delta["tool_calls"] = calls
        return delta, reason

    def _stream_calls(self) -> list[dict]:
        """The tool-call deltas the answer so far adds: a call's id and name once they are
        written, then its arguments' new text."""
        out = []
        for i, p in enumerate(self.parser.partials(self._text)[:self.most]):
            if i == len(self._calls):
                entry = call_entry(p.name, "", self._new_id())
                self._calls.append([entry["id"], 0])
                out.append({"index": i, **entry})
            sent = self._calls[i][1]
            if len(p.arguments) > sent:
                out.append({"index": i, "function": {"arguments": p.arguments[sent:]}})
                self._calls[i][1] = len(p.arguments)
        return out

    def _rest_of_calls(self, streamed: int) -> list[dict]:
        """At the answer's end, once calls have gone out: the whole calls after the `streamed`
        ones that the whole answer holds and its partial reading did not reach."""
        parsed = self.parser.parse(self._text)
        return [{"index": i, **call_entry(n, a, self._new_id())} for i, (n, a) in enumerate(parsed.calls[:self.most])
                if i >= streamed]
