"""Log-probabilities (`infer.logprobs.TokenLogprob`) in the shapes clients read: OpenAI's chat
`logprobs.content` items, the rows of the legacy completions object (`tokens`, `token_logprobs`,
`top_logprobs`, `text_offset`), and vLLM's `prompt_logprobs`: per prompt position None for the
first, else {token id: {"logprob", "rank", "decoded_token"}} of the prompt's token and the
position's n most likely tokens (ranks 1..n), the prompt's token first with its own rank. With
vLLM's `return_tokens_as_token_ids` (`as_ids`) a token is named "token_id:{id}" in place of its
text (its bytes and text offsets stay its text's)."""

from __future__ import annotations

from quantspec.infer.logprobs import TokenLogprob

__all__ = ["chat_entries", "legacy_entries", "vllm_prompt_logprobs"]


def _namer(tt, as_ids: bool):
    return (lambda t: f"token_id:{t}") if as_ids else tt.text


def chat_entries(tt, ids: list[int], lps: list[TokenLogprob], as_ids: bool = False) -> list[dict]:
    """One `content` item per token (`tt`: the server's `TokenText`): its text, log-probability,
    UTF-8 bytes and its position's most likely tokens."""
    name = _namer(tt, as_ids)
    return [{"token": name(tok), "logprob": lp.logprob, "bytes": tt.bytes(tok),
             "top_logprobs": [{"token": name(t), "logprob": v, "bytes": tt.bytes(t)} for t, v in lp.top]}
            for tok, lp in zip(ids, lps)]


def legacy_entries(tt, ids: list[int], lps: list[TokenLogprob | None], n: int, offset: int,
                   as_ids: bool = False) -> tuple[list, int]:
    """(token, log-probability, {token: log-probability} of the n most likely and the token itself,
    text offset) per token, None for an unscored one (a prompt's first), and the offset after them."""
    name = _namer(tt, as_ids)
    out = []
    for tok, lp in zip(ids, lps):
        top = None
        if lp is not None:
            top = {name(t): v for t, v in lp.top[:n]}
            top.setdefault(name(tok), lp.logprob)
        out.append((name(tok), None if lp is None else lp.logprob, top, offset))
        offset += len(tt.text(tok))
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
