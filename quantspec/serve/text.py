"""Text in and out of the engine: prompts → token ids (the chat template for chat requests, as
`quantspec infer` applies it), and the output ids → text deltas for streaming, cut at the first
stop string and never sending a piece that could still become one (or half a character)."""

from __future__ import annotations

from typing import Callable

__all__ = ["TextStream", "chat_prompt_ids", "completion_prompt_ids", "stop_check"]

STOP_TAIL_TOKENS = 32  # output tokens decoded to look for a stop string after each new token


def chat_prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    """The chat template over `messages` with the assistant's turn opened (what `quantspec infer`
    feeds for one user message)."""
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return tokenizer(text, add_special_tokens=False).input_ids
    return tokenizer("\n".join(m["content"] for m in messages)).input_ids


def completion_prompt_ids(tokenizer, prompt: str | list) -> list[int]:
    """A raw prompt's ids (`quantspec infer --no-chat-template`); a list of ints is taken as ids."""
    if isinstance(prompt, list):
        if all(isinstance(t, int) for t in prompt):
            return list(prompt)
        prompt = prompt[0]
    return tokenizer(prompt).input_ids


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
    first stop string, and short of a trailing partial character or a tail that a stop string
    could still start with; `finish()` returns the rest."""

    def __init__(self, tokenizer, stops: tuple[str, ...] = ()):
        self.tokenizer, self.stops = tokenizer, stops
        self.ids: list[int] = []
        self.sent = 0  # characters of the text sent so far
        self.stopped = False
        self._hold = max((len(s) for s in stops), default=1) - 1

    def text(self) -> str:
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        for s in self.stops:
            i = text.find(s)
            if i >= 0:
                text, self.stopped = text[:i], True
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
