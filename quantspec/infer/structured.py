"""Structured outputs: an answer held to a JSON schema, to any JSON, to a regular expression, to an
EBNF grammar or to one of a list of choices, by masking each step's logits to the tokens that keep
the answer a prefix of a valid one. The grammars, their compilation against the vocabulary and the
per-sequence matchers are xgrammar's (the engine vLLM and SGLang use for the same fields).

A `Guide` is what a request asks for (plain data); `GuideCompiler.compile` turns it into a
compiled grammar for one tokenizer (cached: a schema sent by every request compiles once), which a
request carries as `SamplingParams.guide`. The engine gives each such sequence a matcher
(`guide_matcher`), masks its next-token logits with it (`mask_logits`, after penalties and bias)
and feeds it every emitted token (`sequence.append_tokens`). Once the answer is complete only the
stop tokens are allowed, and the sequence ends with one (whatever the engine's EOS set). A guided
sequence's drafts, a chain or a token tree, are verified under the mask of each draft's position
(`mask_rows`; `infer/adjust.py`).

A reasoning model's answer can be held to its guide after its thinking only
(`SamplingParams.guide_after`, `AfterThinking`): the thinking, up to the token ids of its closing
tag, is free; the grammar holds what follows, as vLLM's structured outputs with a reasoning parser.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import lru_cache

import torch

from quantspec.errors import QuantSpecError
from quantspec.infer.spec.tree import row_paths

__all__ = ["GUIDE_KINDS", "AfterThinking", "Guide", "GuideCompiler", "guide_matcher", "mask_logits", "mask_rows",
           "valid_prefix"]

# json: a JSON schema (JSON text); json_object: any JSON object; regex: a regular expression;
# grammar: an EBNF grammar (xgrammar's dialect of GBNF, `root` its start rule); choice: one of the
# strings of a JSON list
GUIDE_KINDS = ("json", "json_object", "regex", "grammar", "choice")
_NATIVE_PREFIX = re.compile(r"^(\[[^\]]*\] \S+:\d+: )?(Check failed: \(.*?\) is false: )?")


@dataclass(frozen=True)
class Guide:
    """What an answer must match: `kind` (one of `GUIDE_KINDS`) and its `spec` as text."""

    kind: str
    spec: str = ""

    def __post_init__(self):
        if self.kind not in GUIDE_KINDS:
            raise QuantSpecError(f"structured output kind {self.kind!r} is not one of {', '.join(GUIDE_KINDS)}")


def _native_message(e: Exception) -> str:
    """xgrammar's error without the native source location: its first line."""
    return _NATIVE_PREFIX.sub("", str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__)


class GuideCompiler:
    """Compiles `Guide`s for one tokenizer; `vocab_size` is the model's (its logits' width, which
    may pass the tokenizer's), `stop_token_ids` the tokens that end an answer (the EOS)."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int]):
        try:
            import xgrammar as xgr
        except ImportError:
            raise QuantSpecError("structured outputs need xgrammar; pip install xgrammar") from None
        try:
            info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                      stop_token_ids=list(stop_token_ids))
        except Exception as e:  # a tokenizer xgrammar cannot read, or one larger than the model's vocabulary
            raise QuantSpecError(f"structured outputs are unavailable for this tokenizer: {_native_message(e)}") from None
        self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        self.compile = lru_cache(maxsize=64)(self._compile)

    @classmethod
    def for_engine(cls, tokenizer, engine) -> "GuideCompiler":
        """The compiler of an `Engine`'s guides: its model's vocabulary, its EOS tokens as the stops."""
        return cls(tokenizer, engine.model.args.vocab_size, sorted(engine.eos))

    def _compile(self, guide: Guide):
        c = self._compiler
        try:
            if guide.kind == "json":
                return c.compile_json_schema(guide.spec, any_whitespace=False)
            if guide.kind == "json_object":
                return c.compile_builtin_json_grammar()
            if guide.kind == "regex":
                return c.compile_regex(guide.spec)
            if guide.kind == "grammar":
                return c.compile_grammar(guide.spec)
            choices = json.loads(guide.spec)
            if not choices or not all(isinstance(x, str) and x for x in choices):
                raise QuantSpecError("a choice guide needs a non-empty list of non-empty strings")
            return c.compile_grammar("root ::= " + " | ".join(json.dumps(x) for x in choices))
        except QuantSpecError:
            raise
        except Exception as e:  # xgrammar's parse errors (RuntimeError, ValueError, its own)
            raise QuantSpecError(f"the {guide.kind} of the structured output does not compile: "
                                 f"{_native_message(e)}") from None


def guide_matcher(compiled, after: tuple | None = None):
    """A fresh matcher of one sequence's answer over a compiled guide; `after` (start ids, end ids,
    thinking first): held to it only after its thinking (`AfterThinking`)."""
    import xgrammar as xgr

    matcher = xgr.GrammarMatcher(compiled)
    return matcher if after is None else AfterThinking(matcher, *after)


class AfterThinking:
    """A guide's matcher (xgrammar's interface: accept_token, rollback, is_terminated,
    fill_next_token_bitmask) that holds an answer to its grammar after its thinking only: tokens
    through the closing tag's ids `end` pass unmasked. `thinking`: the answer starts in its
    thinking (the prompt opened it); otherwise it thinks only where its first token is `start`
    (the opening tag, one token), and is held to the grammar from its first token else."""

    def __init__(self, matcher, start: tuple[int, ...], end: tuple[int, ...], thinking: bool):
        self.matcher, self.start, self.end, self.thinking = matcher, tuple(start), tuple(end), thinking
        self._toks: list[int] = []
        self._from: int | None = None if thinking else 0  # where the grammar starts (None: still thinking)

    def accept_token(self, t: int) -> bool:
        if self._from is None:
            self._toks.append(t)
            if tuple(self._toks[-len(self.end):]) == self.end:
                self._from = len(self._toks)
            return True
        if not self._toks and not self.thinking and (t,) == self.start:
            self._toks.append(t)
            self._from = None
            return True
        if not self.matcher.accept_token(t):
            return False
        self._toks.append(t)
        return True

    def rollback(self, n: int) -> None:
        fed = 0
        for _ in range(n):
            if self._from is not None and len(self._toks) > self._from:
                fed += 1
            self._toks.pop()
        if fed:
            self.matcher.rollback(fed)
        if self._from is not None and len(self._toks) < self._from:
            self._from = None  # back inside the thinking
        if not self._toks and not self.thinking:
            self._from = 0

    def is_terminated(self) -> bool:
        return self._from is not None and self.matcher.is_terminated()

    def fill_next_token_bitmask(self, bitmask, index: int = 0) -> None:
        if self._from is None:
            bitmask[index].fill_(-1)  # thinking: every token
            return
        self.matcher.fill_next_token_bitmask(bitmask, index)
        if not self._toks and not self.thinking and len(self.start) == 1:  # the answer may open its thinking
            word, bit = divmod(self.start[0], 32)
            bitmask[index, word] |= (1 << bit) - (1 << 32 if bit == 31 else 0)


def mask_logits(matcher, row: torch.Tensor) -> torch.Tensor:
    """row [V] fp32, in place: -inf at every token the answer so far cannot continue with."""
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(1, row.shape[-1])
    matcher.fill_next_token_bitmask(bitmask)
    xgr.apply_token_bitmask_inplace(row.view(1, -1), bitmask.to(row.device))
    return row


def mask_rows(matcher, drafts: list[int], rows: torch.Tensor, parents: list[int] | None = None) -> torch.Tensor:
    """rows [1 + k, V] fp32 of a sequence's fed token and its k drafts, in place: row j masked with
    the grammar's state after the drafts on its path, drafts[:j] for a chain, or for a token tree
    (`parents[i]`: the row of draft i's parent, `spec/tree.py`) the drafts from the root down to
    row j. Past a draft the grammar rules out (or the end of the answer) the rows are left as they
    are: verification rejects that draft, so they are never used. The matcher is back where it was."""
    for j, path in enumerate(row_paths(drafts, parents)):
        n = 0
        for t in path:
            if matcher.is_terminated() or not matcher.accept_token(t):
                break
            n += 1
        if n == len(path) and not matcher.is_terminated():
            mask_logits(matcher, rows[j])
        matcher.rollback(n)
    return rows


def valid_prefix(matcher, drafts: list[int]) -> int:
    """How many leading `drafts` the grammar allows from the matcher's state (which it keeps)."""
    n = 0
    while n < len(drafts) and not matcher.is_terminated() and matcher.accept_token(drafts[n]):
        n += 1
    matcher.rollback(n)
    return n
