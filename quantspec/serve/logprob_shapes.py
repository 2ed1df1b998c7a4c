"""Log-probabilities (`infer.logprobs.TokenLogprob`) in the shapes clients read: OpenAI's chat
`logprobs.content` items, the rows of the legacy completions object (`tokens`, `token_logprobs`,
`top_logprobs`, `text_offset`), and vLLM's `prompt_logprobs`: per prompt position None for the
first, else {token id: {"logprob", "rank", "decoded_token"}} of the prompt's token and the
position's n most likely tokens (ranks 1..n), the prompt's token first with its own rank."""

from __future__ import annotations

from quantspec.infer.logprobs import TokenLogprob

__all__ = ["chat_entries", "legacy_entries", "vllm_prompt_logprobs"]


def chat_entries(tt, ids: list[int], lps: list[TokenLogprob]) -> list[dict]:
    """One `content` item per token (`tt`: the server's `TokenText`): its text, log-probability,
    UTF-8 bytes and its position's most likely tokens."""
    return [{"token": tt.text(tok), "logprob": lp.logprob, "bytes": tt.bytes(tok),
             "top_logprobs": [{"token": tt.text(t), "logprob": v, "bytes": tt.bytes(t)} for t, v in lp.top]}
            for tok, lp in zip(ids, lps)]


def legacy_entries(tt, ids: list[int], lps: list[TokenLogprob | None], n: int, offset: int) -> tuple[list, int]:
    """(text, log-probability, {text: log-probability} of the n most likely and the token itself,
    text offset) per token, None for an unscored one (a prompt's first), and the offset after them."""
    out = []
    for tok, lp in zip(ids, lps):
        text = tt.text(tok)
        top = None
        if lp is not None:
            top = {tt.text(t): v for t, v in lp.top[:n]}
            top.setdefault(text, lp.logprob)
        out.append((text, None if lp is None else lp.logprob, top, offset))
        offset += len(text)
    return out, offset


def vllm_prompt_logprobs(tt, ids: list[int], lps: list[TokenLogprob | None], n: int) -> list[dict | None]:
    """vLLM's `prompt_logprobs` of prompt `ids` from their scores `lps` (the first None), with the
    n most likely tokens of each position."""
    out: list[dict | None] = []
    for tok, lp in zip(ids, lps):
        if lp is None:
            out.append(None)
            continue
        entry = {str(tok): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": tt.text(tok)}}
        for rank, (t, v) in enumerate(lp.top[:n], start=1):
            entry.setdefault(str(t), {"logprob": v, "rank": rank, "decoded_token": tt.text(t)})
        out.append(entry)
    return out
