"""The boolean masks of a step's query rows over their keys (True = attend): causal, a token
tree's paths (`spec/tree.py`), and a sliding window (`ModelArgs.attention_window`: the keys of
the last W positions, a row's own included). A chain's row i of a sequence that brings q_len new
tokens to a context of seq_len sits at position seq_len - q_len + i; a tree's row at the
context's length + its depth."""

from __future__ import annotations

import torch

from quantspec.model_zoo.attention import window_mask

__all__ = ["ancestor_rows", "batched_mask", "sequence_mask"]


def ancestor_rows(parents: list[int] | None, q_len: int) -> torch.Tensor:
    """[q_len, q_len] bool: new row i attends new row j (a tree's path; causal for None)."""
    if parents is None:
        return torch.ones(q_len, q_len, dtype=torch.bool).tril()
    assert len(parents) == q_len - 1, (len(parents), q_len)
    m = torch.zeros(q_len, q_len, dtype=torch.bool)
    m[0, 0] = True
    for j, p in enumerate(parents, start=1):
        m[j] = m[p]
        m[j, j] = True
    return m


def _tree_window(paths: torch.Tensor, ctx: int, window: int) -> torch.Tensor:
    """[q_len, ctx] bool: which of the `ctx` context keys each tree row attends under `window`
    (`paths`: `ancestor_rows`; a row's depth is its number of ancestors)."""
    pos = ctx + paths.sum(1) - 1  # [q_len]
    return pos[:, None] - torch.arange(ctx)[None, :] < window


def sequence_mask(q_len: int, seq_len: int, tree: list[int] | None, window: int | None) -> torch.Tensor | None:
    """[q_len, seq_len] of one sequence's new rows over all its keys (None for one row: it
    attends to the keys of its window's span, no mask needed)."""
    if q_len == 1:
        return None
    if tree is None:
        return window_mask(q_len, seq_len, window)
    ctx = seq_len - q_len
    m = torch.ones(q_len, seq_len, dtype=torch.bool)
    m[:, ctx:] = paths = ancestor_rows(tree, q_len)
    if window is not None:
        m[:, :ctx] = _tree_window(paths, ctx, window)
    return m


def batched_mask(q_lens: list[int], seq_lens: list[int], trees: list[list[int] | None] | None, L: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The batched path's [B, Qmax, L] mask over each sequence's gathered keys (whole contexts: a
    step whose window leaves keys out attends per sequence), and which of the [B, Qmax] query
    slots are real. Padded query slots attend to key 0 only, so softmax stays finite; they are
    dropped."""
    B, q_max = len(q_lens), max(q_lens)
    pos = torch.zeros(B, q_max, dtype=torch.int64)
    valid_q = torch.zeros(B, q_max, dtype=torch.bool)
    for b, (ql, sl) in enumerate(zip(q_lens, seq_lens)):
        pos[b, :ql] = torch.arange(sl - ql, sl)
        valid_q[b, :ql] = True
    keys = torch.arange(L)[None, None, :]
    mask = keys <= pos[:, :, None]  # [B, Qmax, L]
    for b, (ql, sl) in enumerate(zip(q_lens, seq_lens)):
        if trees is not None and trees[b] is not None and ql > 1:
            mask[b, :ql, :sl] = sequence_mask(ql, sl, trees[b], None)
    return mask, valid_q
