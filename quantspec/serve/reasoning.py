"""Reasoning parsers for `/v1/chat/completions` (`--reasoning-parser NAME`), as vLLM's of the same
names read an answer: the model's thinking goes to the message's `reasoning_content` (and
`reasoning`, vLLM's newer name for it), the rest to `content`.

- `deepseek_r1` (DeepSeek-R1 and its Qwen and Llama distillations, QwQ): the thinking is the text
  up to `</think>` (after a `<think>` where the answer starts with one; the chat template often
  writes it into the prompt); an answer without `</think>` is thinking cut short: all of it is
  reasoning and there is no content.
- `qwen3` (Qwen3, hybrid or thinking-only): the answer thinks where it starts with `<think>` or
  the prompt leaves one open (a thinking-only template writes it there); then as `deepseek_r1`.
  Otherwise, as with `enable_thinking: false` (the template closes an empty thinking block in
  the prompt), all of it is content.

A request whose answer a structured output or a forced tool call holds is held to it after the
thinking (`thinking_guide`: the engine's `AfterThinking`), and split as any other; where the
tags are not single tokens and the answer might not think, the grammar starts at the first token
and the answer is not split. Streamed, thinking streams as `reasoning_content`
deltas and the rest as `content` deltas; text that may be the start of a tag is held back until
it is clear.
"""

from __future__ import annotations

from quantspec.serve.tool_parsers import held_tail

__all__ = ["PROMPT_TAIL_TOKENS", "REASONING_PARSERS", "DeepSeekR1Reasoning", "Qwen3Reasoning", "ReasoningStream",
           "prompt_thinks", "reasoning_parser", "thinking_guide"]

PROMPT_TAIL_TOKENS = 16  # the prompt's last tokens a parser reads (a `<think>` the template left open)


class DeepSeekR1Reasoning:
    """`<think>` … `</think>` then the answer (module docstring)."""

    name = "deepseek_r1"
    START, END = "<think>", "</think>"

    def thinks_first(self, prompt_tail: str) -> bool:
        """Whether an answer after a prompt ending in `prompt_tail` starts in its thinking (before
        any `<think>` of its own)."""
        return True

    def split(self, text: str, thinking: bool = True) -> tuple[str | None, str | None]:
        """(reasoning, content) of a whole answer, None for an empty part: the stream's cut of
        the answer as one last piece; `thinking`: `thinks_first` of its prompt."""
        reasoning, content = ReasoningStream(self, thinking).feed(text, final=True)
        return reasoning or None, content or None


class Qwen3Reasoning(DeepSeekR1Reasoning):
    """Thinking where the answer opens it or the prompt left it open (module docstring)."""

    name = "qwen3"

    def thinks_first(self, prompt_tail: str) -> bool:
        return prompt_tail.rfind(self.START) > prompt_tail.rfind(self.END)


REASONING_PARSERS = {p.name: p for p in (DeepSeekR1Reasoning, Qwen3Reasoning)}


def reasoning_parser(name: str):
    """The parser called `name` (a key of `REASONING_PARSERS`)."""
    return REASONING_PARSERS[name]()


def prompt_thinks(parser, tokenizer, prompt_ids: list[int]) -> bool:
    """Whether an answer to `prompt_ids` starts in its thinking (`thinks_first` of the prompt's end)."""
    return parser.thinks_first(tokenizer.decode(prompt_ids[-PROMPT_TAIL_TOKENS:]))


def thinking_guide(parser, tokenizer, prompt_ids: list[int]) -> tuple | None:
    """`SamplingParams.guide_after` of a guided answer to `prompt_ids`: (the opening tag's ids, the
    closing tag's ids, whether it starts thinking); None where the grammar must hold it from its
    first token (an answer that might not think, whose opening tag is not one token)."""
    start = tuple(tokenizer.encode(parser.START, add_special_tokens=False))
    end = tuple(tokenizer.encode(parser.END, add_special_tokens=False))
    thinking = prompt_thinks(parser, tokenizer, prompt_ids)
    return (start, end, thinking) if thinking or len(start) == 1 else None


class ReasoningStream:
    """One streamed answer cut into its reasoning and content pieces (module docstring);
    `thinking`: whether it starts in its thinking (the parser's `thinks_first` of its prompt)."""

    def __init__(self, parser, thinking: bool = True):
        self.parser, self.thinking_first = parser, thinking
        self._text = ""
        self._sent = 0  # characters of the answer streamed (as reasoning, then as content)
        self._thinking = thinking
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
                self._sent, self._thinking = len(self._text) - len(head) + len(p.START), True
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
