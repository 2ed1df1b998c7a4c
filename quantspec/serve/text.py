"""Text in and out of the engine: prompts → token ids (the chat template for chat requests, as
`quantspec infer` applies it), and the output ids → text deltas for streaming, cut at the first
stop string and never sending a piece that could still become one (or half a character)."""

from __future__ import annotations

import functools
import json
from typing import Callable

__all__ = ["TextStream", "TokenText", "bad_words_ids", "chat_prompt_ids", "completion_prompt_ids", "stop_check"]

STOP_TAIL_TOKENS = 32  # output tokens decoded to look for a stop string after each new token


def chat_prompt_ids(tokenizer, messages: list[dict], add_generation_prompt: bool = True,
                    tools: list[dict] | None = None, continue_final_message: bool = False,
                    template_kwargs: dict | None = None, chat_template: str | None = None) -> list[int]:
    """The chat template over `messages` (and `tools`, for a template that shows them) with the
    assistant's turn opened (what `quantspec infer` feeds for one user message;
    `add_generation_prompt` False: not opened; `continue_final_message`: the last message left
    open, to be continued); `template_kwargs`: more variables of the template; `chat_template`:
    a template (Jinja text) in place of the tokenizer's. An assistant message's `tool_calls`
    reach the template with their arguments as objects."""
    messages = [_template_message(m) for m in messages]
    if chat_template or getattr(tokenizer, "chat_template", None):
        kw = {**(template_kwargs or {}), **({"tools": tools} if tools else {}),
              **({"chat_template": chat_template} if chat_template else {})}
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                             continue_final_message=continue_final_message, **kw)
        return tokenizer(text, add_special_tokens=False).input_ids
    return tokenizer("\n".join(m["content"] or "" for m in messages)).input_ids


def _template_message(message: dict) -> dict:
    """A message as chat templates read it: an assistant's `tool_calls` arguments as objects, not
    OpenAI's JSON text (what transformers' tool-use templates expect, and vLLM hands them)."""
    calls = message.get("tool_calls")
    if message["role"] != "assistant" or not isinstance(calls, list):
        return message
    out = []
    for call in calls:
        fn = call.get("function") if isinstance(call, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
            try:
                call = {**call, "function": {**fn, "arguments": json.loads(fn["arguments"])}}
            except ValueError:  # not JSON: the template gets the text
                pass
        out.append(call)
    return {**message, "tool_calls": out}


def completion_prompt_ids(tokenizer, prompt: str | list[int]) -> list[int]:
    """A raw prompt's ids (`quantspec infer --no-chat-template`); a list of ints is taken as ids."""
    if isinstance(prompt, list):
        return list(prompt)
    return tokenizer(prompt).input_ids


def bad_words_ids(tokenizer, words: list[str]) -> list[list[int]]:
    """vLLM's tokenization of `bad_words`: each word's ids as the text starts with it, and again
    after a space where that makes a token sequence of the same length with another first token
    (the word in the middle of a text, for tokenizers that mark a leading space)."""
    out: list[list[int]] = []
    for word in words:
        ids = tokenizer(word.lstrip(), add_special_tokens=False).input_ids
        if not ids:
            continue
        out.append(ids)
        spaced = tokenizer(" " + word.lstrip(), add_special_tokens=False).input_ids
        if spaced[0] != ids[0] and len(spaced) == len(ids):
            out.append(spaced)
    return out


@functools.cache
def _byte_of_char() -> dict[str, int]:
    """The byte-level BPE alphabet (GPT-2's): the printable character standing for each byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


class TokenText:
    """One token's text and bytes, as the logprobs of a response name it: `text(id)` decodes the
    token alone (a piece of a multi-byte character decodes to U+FFFD); `bytes(id)` is the token's
    exact UTF-8 bytes where the tokenizer is byte-level BPE (a piece of a character gets its own
    bytes), else the text's."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)
        try:
            from tokenizers.decoders import ByteLevel
            self._byte_level = isinstance(getattr(backend, "decoder", None), ByteLevel)
        except ImportError:
            self._byte_level = False
        self._text = functools.lru_cache(maxsize=65536)(self._decode)
        self._bytes = functools.lru_cache(maxsize=65536)(self._token_bytes)

    def _decode(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def _token_bytes(self, token_id: int) -> list[int]:
        if self._byte_level:
            piece = self.tokenizer.convert_ids_to_tokens(token_id)
            table = _byte_of_char()
            if isinstance(piece, str) and all(c in table for c in piece):
                return [table[c] for c in piece]
        return list(self._text(token_id).encode("utf-8"))

    def text(self, token_id: int) -> str:
        return self._text(token_id)

    def bytes(self, token_id: int) -> list[int]:
        return self._bytes(token_id)


def stop_check(tokenizer, stops: tuple[str, ...]) -> Callable | None:
    """The engine's stop-string hook (`Sequence.text_check`): runs in the engine's thread after each
    new token and ends the sequence once a stop string appears in the decoded tail."""
    if not stops:
        return None

    def check(seq):
        tail = tokenizer.decode(seq.output_ids[-STOP_TAIL_TOKENS:], skip_special_tokens=True)
        return 0 if any(s in tail for s in stops) else None

    return check


class TextStream:
    """Output ids → text deltas. `feed(ids)` returns the text that is now safe to send: up to the
    first stop string (`include_stop`: through it), and short of a trailing partial character or
    a tail that a stop string could still start with; `finish()` returns the rest.
    `skip_special_tokens` False: special tokens' texts stay in."""

    def __init__(self, tokenizer, stops: tuple[str, ...] = (), *, skip_special_tokens: bool = True,
                 include_stop: bool = False):
        self.tokenizer, self.stops = tokenizer, stops
        self.skip_special_tokens, self.include_stop = skip_special_tokens, include_stop
        self.ids: list[int] = []
        self.sent = 0  # characters of the text sent so far
        self.stopped = False
        self.stop_str: str | None = None  # the stop string the text ends at, once `stopped`
        self._hold = max((len(s) for s in stops), default=1) - 1

    def text(self) -> str:
        text = self.tokenizer.decode(self.ids, skip_special_tokens=self.skip_special_tokens)
        for s in self.stops:
            i = text.find(s)
            if i >= 0:
                text, self.stopped, self.stop_str = text[:i + len(s) if self.include_stop else i], True, s
        return text

    def feed(self, ids: list[int]) -> str:
        self.ids.extend(ids)
        text = self.text()
        end = len(text)
        if not self.stopped:
            end -= self._hold
            while end > self.sent and text[end - 1] == "\ufffd":  # half a multi-byte character
                end -= 1
        return self._take(text, end)

    def finish(self) -> str:
        text = self.text()
        return self._take(text, len(text))

    def _take(self, text: str, end: int) -> str:
        if end <= self.sent:
            return ""
        piece, self.sent = text[self.sent:end], end
        return piece
