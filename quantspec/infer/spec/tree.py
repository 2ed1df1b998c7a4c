"""Token trees: the shape `--speculate-tree DxK` asks for, the attention mask of a tree's rows,
and the verifier of a batch of trees.

Words, for one sequence: its verification rows are the root (row 0: the newest token, fed
again) and the draft nodes (row j + 1 for draft j), listed so that a node's parent comes before
it (`parents[j]` is the row of draft j's parent, in 0..j). A chain is the tree whose parents are
0, 1, ..., k - 1. Node j sits at position `num_cached + depth(j)`; it attends to the cached
context and to the rows on its path from the root (its ancestors and itself).

`DxK` (e.g. `4x2`): D draft positions with K candidates each, the top-1 candidate of a position
the parent of every candidate of the next one (D·K drafts, D·K + 1 rows). The accepted path
follows the top-1 candidates and may end in any candidate.

`DxK:N` (e.g. `4x4:8`): a dynamic tree, as EAGLE-2 builds it (Li et al. 2024,
arXiv:2406.16858): at each of D depths the K candidates with the highest path probability (the
product of the drafter's probabilities from the root) are expanded into their K best children;
of every candidate so made, the N with the highest path probability are drafted (N drafts, N + 1
rows; an N above the K + (D - 1)·K² candidates made drafts them all). A node's path probability
is at most its parent's, so the N best form a tree. Medusa's
heads score each position independently of the tokens before it, so a node there is a choice of
one of the K best tokens at each position up to its depth, its path probability the product of
those tokens' probabilities (`best_paths`).

Verification walks from the root. Greedy: the child whose token is the target's argmax at the
current row is accepted; the walk ends where none is, and the target's argmax there is the bonus
(or recovered) token, so the output is exactly plain greedy decoding's. Sampling is
multi-candidate rejection sampling (SpecInfer, Miao et al. 2024, arXiv:2305.09781): the children
of the current row are tried in order, child x drawn from q is accepted with probability
min(1, p(x) / q(x)); on a rejection p becomes norm(max(0, p - q)) for the next child; when every
child is rejected one token is drawn from what is left of p. For a deterministic child (q one-hot
at x) that is: accepted with probability p(x), else x is removed from p. Each emitted token is
distributed exactly as the target's filtered distribution at its row.

    >>> parse_tree_spec("4x2")
    TreeSpec(depth=4, width=2, nodes=None)
    >>> caterpillar([[5, 6], [7, 8]])  # (tokens, parents): depth 1 → 5, 6 under the root; 7, 8 under 5
    ([5, 6, 7, 8], [0, 0, 1, 1])
    >>> greedy_walk([5, 6, 7, 8], [0, 0, 1, 1], [6, 4, 9, 3, 2])  # argmax per row: root→6 (row 2), row 2→9
    ([0, 2], [6, 9])
"""

from __future__ import annotations

import heapq
import re
from dataclasses import dataclass

import torch

from quantspec.errors import QuantSpecError
from quantspec.infer.sampler import SamplingParams, logits_to_probs, sample, sampling_tensors

__all__ = ["TreeSpec", "best_paths", "caterpillar", "chain_parents", "depths", "greedy_walk",
           "parse_tree_spec", "prune", "sampling_walk", "verify_trees"]

MAX_TREE_ROWS = 64  # draft rows of one sequence (the CPU attention kernel's verification rows)
_SPEC = re.compile(r"^\s*(\d+)\s*[xX]\s*(\d+)\s*(?::\s*(\d+)\s*)?$")


@dataclass(frozen=True)
class TreeSpec:
    """D draft positions (`depth`), K candidates per position (`width`); with `nodes` a dynamic
    tree of that many drafts (module docstring)."""

    depth: int
    width: int
    nodes: int | None = None

    @property
    def num_nodes(self) -> int:
        return self.depth * self.width if self.nodes is None else self.nodes

    @property
    def dynamic(self) -> bool:
        return self.nodes is not None


def parse_tree_spec(text: str | TreeSpec | None) -> TreeSpec | None:
    """`"4x2"` → TreeSpec(4, 2); `"4x4:8"` → TreeSpec(4, 4, 8); None / "" → None (chains).
    One-line error naming the fix."""
    if text is None or isinstance(text, TreeSpec):
        return text
    if not str(text).strip():
        return None
    m = _SPEC.match(str(text))
    if m is None:
        raise QuantSpecError(f"--speculate-tree {text!r} is malformed; write DEPTHxWIDTH, e.g. 4x2, or "
                             "DEPTHxWIDTH:NODES for a dynamic tree, e.g. 4x4:8")
    spec = TreeSpec(int(m.group(1)), int(m.group(2)), None if m.group(3) is None else int(m.group(3)))
    if spec.depth < 1 or spec.width < 1 or spec.num_nodes < 1 or spec.num_nodes > MAX_TREE_ROWS:
        raise QuantSpecError(f"--speculate-tree {text!r} is out of range; depth, width and nodes >= 1, "
                             f"depth*width (or nodes) <= {MAX_TREE_ROWS} (e.g. 4x2 or 4x4:8)")
    every = sum(spec.width ** d for d in range(1, spec.depth + 1))  # the nodes of the full tree
    if spec.dynamic and spec.nodes > every:
        raise QuantSpecError(f"--speculate-tree {text!r} asks for more nodes than {spec.depth} depths of "
                             f"{spec.width} candidates hold ({every}); lower NODES")
    return spec


def chain_parents(k: int) -> list[int]:
    """The parents of a chain of k drafts: [0, 1, ..., k - 1]."""
    return list(range(k))


def row_paths(tokens: list[int], parents: list[int] | None) -> list[list[int]]:
    """Per row j of a sequence's 1 + k verified rows (its fed token's, then one per draft): the
    drafts from the root down to row j — a chain's tokens[:j] (`parents` None), a tree's by its
    parents (draft i's parent is row parents[i], before it)."""
    if parents is None:
        return [tokens[:j] for j in range(len(tokens) + 1)]
    out: list[list[int]] = [[]]
    for t, parent in zip(tokens, parents):
        out.append(out[parent] + [t])
    return out


def caterpillar(candidates: list[list[int]]) -> tuple[list[int], list[int]]:
    """Candidates per draft position (top-1 first) → (tokens, parents) of the `DxK` tree."""
    tokens: list[int] = []
    parents: list[int] = []
    main = 0  # row of the previous position's top-1 candidate
    for cands in candidates:
        first = len(tokens) + 1
        for t in cands:
            tokens.append(int(t))
            parents.append(main)
        main = first
    return tokens, parents


def best_paths(logprobs: list[list[float]], n: int) -> tuple[list[tuple[int, ...]], list[int]]:
    """The `n` best nodes of the tree whose depth-d nodes choose one of the candidates of
    position d: logprobs[d][c] is candidate c's log-probability at position d (independent of
    the choices before it) and a node's score the sum along its path → (nodes as candidate
    indices from depth 1, parent rows), best first (ties: the shallower node, then the earlier
    choices), so that every prefix is a tree. Best-first search: a node's children are scored only
    once it is taken.

        >>> best_paths([[-0.1, -2.0], [-0.5, -0.7]], 3)  # (0,) then (0, 0) -0.6, (0, 1) -0.8
        ([(0,), (0, 0), (0, 1)], [0, 1, 1])
    """
    heap = [(-lp, 1, (c,)) for c, lp in enumerate(logprobs[0])] if logprobs else []
    heapq.heapify(heap)
    nodes: list[tuple[int, ...]] = []
    rank: dict[tuple[int, ...], int] = {}
    parents: list[int] = []
    while heap and len(nodes) < n:
        neg, d, path = heapq.heappop(heap)
        nodes.append(path)
        rank[path] = len(nodes)
        parents.append(rank.get(path[:-1], 0))
        if d < len(logprobs):
            for c, lp in enumerate(logprobs[d]):
                heapq.heappush(heap, (neg - lp, d + 1, path + (c,)))
    return nodes, parents


def depths(parents: list[int]) -> list[int]:
    """Depth of each row (root 0), rows in order."""
    d = [0]
    for p in parents:
        d.append(d[p] + 1)
    return d


def prune(parents: list[int], max_nodes: int, max_depth: int) -> tuple[list[int], list[int]]:
    """The first `max_nodes` drafts, less those deeper than `max_depth` → (kept draft indices,
    their parents renumbered). A prefix of a tree's rows is a tree (parents come first)."""
    d = depths(parents)
    row = {0: 0}  # old row → new row
    kept, new_parents = [], []
    for j, p in enumerate(parents[:max_nodes]):
        if d[j + 1] <= max_depth and p in row:
            kept.append(j)
            new_parents.append(row[p])
            row[j + 1] = len(kept)
    return kept, new_parents


def _children(parents: list[int]) -> list[list[int]]:
    kids: list[list[int]] = [[] for _ in range(len(parents) + 1)]
    for j, p in enumerate(parents, start=1):
        kids[p].append(j)
    return kids


def greedy_walk(tokens: list[int], parents: list[int], target_ids: list[int]) -> tuple[list[int], list[int]]:
    """→ (accepted path rows from the root, output tokens: the accepted drafts then the target's
    pick at the path's end). target_ids: the target's argmax at each of the 1 + n rows."""
    kids = _children(parents)
    path, out = [0], []
    while True:
        want = int(target_ids[path[-1]])
        nxt = next((c for c in kids[path[-1]] if tokens[c - 1] == want), None)
        out.append(want)
        if nxt is None:
            return path, out
        path.append(nxt)


def sampling_walk(tokens: list[int], parents: list[int], p_rows: torch.Tensor, q_rows: torch.Tensor | None,
                  generator: torch.Generator | None) -> tuple[list[int], list[int]]:
    """Multi-candidate rejection sampling (module docstring). p_rows [1 + n, V]: the target's
    filtered probs per row; q_rows [n, V] or None: the distribution each draft was drawn from
    (None: deterministic drafts) → (accepted path rows, output tokens)."""
    kids = _children(parents)
    path, out = [0], []
    while True:
        p = p_rows[path[-1]].double()
        nxt = None
        for c in kids[path[-1]]:
            x = tokens[c - 1]
            q = None if q_rows is None else q_rows[c - 1].double()
            qx = 1.0 if q is None else float(q[x])
            u = float(torch.rand((), generator=generator, dtype=torch.float64, device=p.device))
            if qx > 0 and u < min(1.0, float(p[x]) / qx):
                nxt = c
                break
            if q is None:
                p = p.clone()
                p[x] = 0.0
            else:
                p = (p - q).clamp_min(0.0)
            total = float(p.sum())
            if total <= 0:  # p was all on rejected candidates: cannot happen for exact p, q
                p = p_rows[path[-1]].double()
            else:
                p = p / total
        if nxt is None:
            out.append(int(sample(p[None], [generator])[0]))
            return path, out
        out.append(tokens[nxt - 1])
        path.append(nxt)


def verify_trees(trees: list[tuple[list[int], list[int]]], draft_probs: list[torch.Tensor | None],
                 logits: torch.Tensor | None, params: list[SamplingParams], generators: list,
                 target_ids: list[int] | None = None) -> tuple[list[list[int]], list[list[int]]]:
    """Verify B trees from one forward.

    trees: B × (tokens [n_b], parents [n_b]); draft_probs: B × ([n_b, V] or None); logits
    [sum(1 + n_b), V] fp32 (None when `target_ids`, the greedy ids of every row, are given and
    every sequence is greedy) → (B accepted paths of rows, B output token lists).
    """
    rows = [1 + len(t) for t, _ in trees]
    if logits is not None:
        assert logits.ndim == 2 and logits.shape[0] == sum(rows), (tuple(logits.shape), rows)
    if target_ids is None and all(p.is_greedy for p in params):
        target_ids = logits.argmax(dim=-1).tolist()
    paths, outs = [], []
    start = 0
    for b, ((tokens, parents), n) in enumerate(zip(trees, rows)):
        if params[b].is_greedy:
            ids = target_ids[start:start + n] if target_ids is not None else logits[start:start + n].argmax(-1).tolist()
            path, out = greedy_walk(tokens, parents, ids)
        else:
            p_rows = logits_to_probs(logits[start:start + n],
                                     *sampling_tensors([params[b]] * n, logits.device))  # [1 + n, V]
            path, out = sampling_walk(tokens, parents, p_rows, draft_probs[b], generators[b])
        paths.append(path)
        outs.append(out)
        start += n
    return paths, outs
