"""Reasoning parsers for `/v1/chat/completions` (`--reasoning-parser NAME`), as vLLM's of the same
names read an answer: the model's thinking goes to the message's `reasoning_content` (and
`reasoning`, vLLM's newer name for it), the rest to `content`.

- `deepseek_r1` (DeepSeek-R1 and its Qwen and Llama distillations, QwQ): the thinking is the text
  up to `</think>` (after a `<think>` where the answer starts with one; the chat template often
  writes it into the prompt); an answer without `</think>` is thinking cut short: all of it is
  reasoning and there is no content.

A request whose answer a structured output or a forced tool call holds (its grammar starts at the
first token, with no thinking) is not split. Streamed, thinking streams as `reasoning_content`
deltas and the rest as `content` deltas; text that may be the start of a tag is held back until
it is clear.
"""

from __future__ import annotations

from quantspec.serve.tool_parsers import held_tail

__all__ = ["REASONING_PARSERS", "DeepSeekR1Reasoning", "ReasoningStream", "reasoning_parser"]


class DeepSeekR1Reasoning:
    """`<think>` … `</think>` then the answer (module docstring)."""

    name = "deepseek_r1"
    START, END = "<think>", "</think>"

    def split(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning, content) of a whole answer, None for an empty part: the stream's cut of
        the answer as one last piece."""
        reasoning, content = ReasoningStream(self).feed(text, final=True)
        return reasoning or None, content or None


REASONING_PARSERS = {p.name: p for p in (DeepSeekR1Reasoning,)}


def reasoning_parser(name: str):
    """The parser called `name` (a key of `REASONING_PARSERS`)."""
    return REASONING_PARSERS[name]()


class ReasoningStream:
    """One streamed answer cut into its reasoning and content pieces (module docstring)."""

    def __init__(self, parser):
        self.parser = parser
        self._text = ""
        self._sent = 0  # characters of the answer streamed (as reasoning, then as content)
        self._thinking = True
        self._start_checked = False

    def feed(self, piece: str, final: bool) -> tuple[str, str]:
        """(reasoning piece, content piece) to stream for `piece`; `final`: the answer's last."""
        p = self.parser
        self._text += piece
        if not self._start_checked:  # a leading <think> is the tag, not reasoning
            head = self._text.lstrip()
            if not final and len(head) < len(p.START) and p.START.startswith(head):
                return "", ""
            self._start_checked = True
            if head.startswith(p.START):
                self._sent = len(self._text) - len(head) + len(p.START)
        reasoning = content = ""
        if self._thinking:
            end = self._text.find(p.END, self._sent)
            if end < 0:
                upto = len(self._text) - (0 if final else held_tail(self._text[self._sent:], p.END))
                reasoning, self._sent = self._text[self._sent:upto], upto
                return reasoning, ""
            reasoning, self._sent, self._thinking = self._text[self._sent:end], end + len(p.END), False
        content, self._sent = self._text[self._sent:], len(self._text)
        return reasoning, content
