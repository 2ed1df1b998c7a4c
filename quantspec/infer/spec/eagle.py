"""`--speculate-method eagle`: an EAGLE-3 head (`model_zoo/eagle3.py`) drafts autoregressively
over its own KV cache, as a chain, a `DxK` token tree or a dynamic `DxK:N` tree.

Features. The proposer names the base's layers whose input streams are its aux features
(`capture_layers`); the engine's forwards capture them (`Transformer.forward(capture=...)`, which
the fused CPU stack serves too) and hand each forward's rows to `file_streams`, which files every
sequence's fed rows with their aux features, tokens and positions. Before drafting,
a sequence's head *catches up*: the rows the verifier kept (a prompt's rows; a decode step's
newest token and its accepted drafts, found in the fed tree by depth and token) run through the
head, row p reading fc(aux features of p) and the token t_{p+1}, their keys / values appended to
the head's cache, which holds one row per position of the sequence.

Drafting. From the head's output at the newest position the head runs one row per draft depth:
token = the previous depth's top-1 draft, hidden = the previous row's pre-norm output, position
+1, keys / values written past the cache's valid rows (overwritten by the next catch-up: nothing
to roll back). Each depth's top K draft-vocabulary tokens (K = 1 for a chain) map to target ids
through `d2t`; a tree is the caterpillar of `spec/tree.py`. A dynamic tree (`DxK:N`) runs the
head once per depth over that depth's K best nodes by path probability (each row attends to the
sequence's rows and its own ancestors' draft rows) and drafts the N best nodes of every depth.
Drafts are deterministic (probs None): sampling verification treats each as one-hot, which keeps
it lossless.

Prefix caching. With the base's prefix cache on (`use_prefix_cache`), the head files its rows of
every whole block it passes in a store found by the scheduler's block hashes (`spec/head_blocks.py`); a
sequence whose first rows the base took from the cache gets the head rows before them from it (no
drafts where the store lacks one of its blocks).

Chains get the back-off of `spec/proposers.py` (`AdaptiveDraftLength`, the head's cost per
draft in the cost model: its bytes read per token over the base's). With `min_confidence` a
sequence stops drafting at the first depth whose top-1 probability (over the draft vocabulary)
is below it: a chain drafts nothing when even its first draft is unsure; a tree always drafts
its first depth's K candidates (their spread is what a tree is for) and stops at the first
deeper depth below it; a dynamic tree always drafts from its first depth and grows past a
depth only while that depth's best path probability is at least the threshold.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from quantspec.errors import QuantSpecError
from quantspec.infer.spec.head_blocks import HeadBlockStore
from quantspec.infer.spec.mtp import check_min_confidence
from quantspec.infer.spec.tree import TreeSpec, caterpillar, parse_tree_spec
from quantspec.infer.spec.types import SpecProposal
from quantspec.model_zoo.checkpoint import read_config
from quantspec.model_zoo.eagle3 import (EAGLE3_ATTENTION, INT_BUFFERS, Eagle3Args, Eagle3Head, check_draft_maps,
                                        check_eagle3_matches_base, eagle3_weight_table, is_eagle3_config, load_eagle3)
from quantspec.model_zoo.llama import Transformer
from quantspec.model_zoo.speculators import is_speculators_config

__all__ = ["EagleProposer", "build_eagle_proposer", "load_eagle3_for_inference"]


def load_eagle3_for_inference(path: str | Path, base: Transformer, *, dtype: torch.dtype | None = None) -> Eagle3Head:
    """An EAGLE-3 head for `base` (unquantized or a compressed-tensors artifact), in the base's
    dtype and on its device, checked against it and bound to its embedding."""
    path = Path(path).expanduser()
    if not (path / "config.json").is_file():
        raise QuantSpecError(f"--draft-model {path} has no config.json; pass a head from "
                             "`quantspec zoo train-draft-head --kind eagle3`")
    cfg = read_config(path)
    if not (is_eagle3_config(cfg) or is_speculators_config(cfg)):  # another speculators model: from_config says so
        raise QuantSpecError(f"--draft-model {path} is not an EAGLE-3 head (architectures {cfg.get('architectures')}); "
                             "pass a head from `quantspec zoo train-draft-head --kind eagle3`")
    from quantspec.infer.spec.mtp import HeadKind, load_head_for_inference

    kind = HeadKind("EAGLE-3 head", load_eagle3, Eagle3Head, eagle3_weight_table, INT_BUFFERS,
                    check_eagle3_matches_base, check_draft_maps, attention=EAGLE3_ATTENTION)
    head = load_head_for_inference(path, cfg, lambda: Eagle3Args.from_config(cfg, where=str(path / "config.json")),
                                   base, dtype, kind)
    return head.bind_embedding(base.model.embed_tokens)


@dataclass
class _Fed:
    """One forward's rows of a sequence: the first `real` are its own tokens, the rest drafts."""

    start: int  # position of the first row
    real: int
    tokens: list[int]
    positions: list[int]
    feats: torch.Tensor  # [q, 3D]


@dataclass
class _HeadState:
    """A sequence's head cache: `n` valid rows (positions 0..n-1), the output of row n-1."""

    k: torch.Tensor  # [cap, KV, hd]
    v: torch.Tensor
    n: int = 0
    last: torch.Tensor | None = None  # [D]
    fed: list[_Fed] = field(default_factory=list)


class EagleProposer:
    """EAGLE-3 drafts for a batch of sequences (module docstring). `tree`: a `DxK` spec (None: a
    chain of at most `max_draft_tokens`); `policy`: chains' back-off (None: always the budget);
    `min_confidence`: the top-1 probability below which drafting stops (0: never)."""

    needs_hidden = False

    def __init__(self, head: Eagle3Head, *, tree: TreeSpec | None = None, max_draft_tokens: int = 4, policy=None,
                 min_confidence: float = 0.0):
        self.head, self.tree, self.policy = head, tree, policy
        self.min_confidence = check_min_confidence(min_confidence)
        self.depth = tree.depth if tree is not None else int(max_draft_tokens)
        self.width = tree.width if tree is not None else 1
        self.dynamic = tree is not None and tree.dynamic
        self._states: dict[int, _HeadState] = {}
        self.blocks: HeadBlockStore | None = None  # with the base's prefix cache: head rows by block
        self.kv = head.kv_cache  # the artifact's static KV cache (`spec.head_kv`), None: a float one

    def use_prefix_cache(self, block_size: int, capacity: int) -> None:
        """The base's engine caches prefix blocks: keep the head's rows of whole blocks too, so a
        prompt whose leading blocks the base skips gets its head rows from them (`head_blocks`)."""
        self.blocks = HeadBlockStore(block_size, capacity)

    @property
    def max_rows(self) -> int:
        return self.tree.num_nodes if self.tree is not None else self.depth

    # -- features of the base's forwards ------------------------------------------------------

    def capture_layers(self, num_layers: int) -> tuple[int, ...]:
        """The base's layers whose input streams are the head's aux features (the engine's
        forwards capture them: `engine.FeatureReader`)."""
        return tuple(self.head.args.aux_layers(num_layers))

    def file_streams(self, rows: list, token_ids: list[int], positions: list[int],
                     streams: tuple[torch.Tensor, ...]) -> None:
        """One forward of the engine: each sequence's rows ((sequence, query rows) in row order)
        go to its state with their tokens, positions and aux features (streams [T, D] each, in
        `capture_layers`' order)."""
        feats = torch.cat(streams, dim=-1)  # [T, 3D]
        off = 0
        for seq, q in rows:
            st = self._state(seq)
            real = min(q, seq.num_tokens - seq.num_cached)
            st.fed.append(_Fed(seq.num_cached, real, token_ids[off:off + q], positions[off:off + q],
                               feats[off:off + q]))
            off += q

    def _state(self, seq) -> _HeadState:
        st = self._states.get(seq.seq_id)
        if st is None:
            a, w = self.head.args.layer, self.head.norm.weight
            shape = (seq.num_tokens + 256, a.num_kv_heads, a.head_dim)  # grown by `_attend` as needed
            dtype = w.dtype if self.kv is None else self.kv.dtype
            st = self._states[seq.seq_id] = _HeadState(w.new_empty(shape, dtype=dtype), w.new_empty(shape, dtype=dtype))
        return st

    # -- the head over its cache ---------------------------------------------------------------

    @staticmethod
    def _reserve(st: _HeadState, end: int) -> None:
        """Grow the head cache to at least `end` rows."""
        if end > st.k.shape[0]:
            grow = max(end, 2 * st.k.shape[0])
            st.k = torch.cat([st.k, st.k.new_empty((grow - st.k.shape[0], *st.k.shape[1:]))])
            st.v = torch.cat([st.v, st.v.new_empty((grow - st.v.shape[0], *st.v.shape[1:]))])

    def _write(self, st: _HeadState, start: int, k, v) -> None:
        """k / v [m, KV, hd] into cache rows start..start+m-1 (as codes with a static KV cache)."""
        end = start + k.shape[0]
        self._reserve(st, end)
        st.k[start:end], st.v[start:end] = (k, v) if self.kv is None else self.kv.store(k, v)

    def _sdpa(self, st: _HeadState, q, end: int, mask):
        """q [m, H, hd] over cache rows 0..end-1 under mask [m, end] → [m, H, hd]."""
        k, v = st.k[:end], st.v[:end]
        if self.kv is not None:
            k, v = self.kv.load(k, v, q.dtype)
        out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                             v.transpose(0, 1)[None], attn_mask=mask,
                                             enable_gqa=q.shape[1] != k.shape[1])  # (1, H, m, hd)
        return out[0].transpose(0, 1)

    def _attend(self, st: _HeadState, start: int):
        """attend() for rows written from cache row `start` on: causal over rows 0..own."""
        def attend(q, k, v):  # q [m, H, hd], k / v [m, KV, hd]
            m = q.shape[0]
            end = start + m
            self._write(st, start, k, v)
            keys = torch.arange(end, device=q.device)
            mask = keys[None, :] <= (start + torch.arange(m, device=q.device))[:, None]  # [m, end]
            return self._sdpa(st, q, end, mask)
        return attend

    def _attend_nodes(self, st: _HeadState, start: int, ancestors: list[list[int]]):
        """attend() for m tree nodes written at cache rows start..start+m-1: node i attends to the
        sequence's rows 0..n-1 and to the rows in ancestors[i] (its own, its drafted ancestors')."""
        def attend(q, k, v):
            m = q.shape[0]
            end = start + m
            self._write(st, start, k, v)
            mask = torch.zeros((m, end), dtype=torch.bool, device=q.device)
            mask[:, :st.n] = True
            for i, rows in enumerate(ancestors):
                mask[i, rows] = True
            return self._sdpa(st, q, end, mask)
        return attend

    def _catch_up(self, seq, st: _HeadState) -> bool:
        """Run the kept rows of the forwards since the last step through the head (at most one
        decode step's, whose accepted drafts are those matching the tokens that followed); False
        when the rows do not continue the cache (the head then drafts nothing for the sequence)."""
        toks = seq.tokens
        feats, positions = [], []
        for f in st.fed:
            keep = list(range(f.real))
            accepted = max(0, len(toks) - (f.start + f.real) - 1)
            base_pos = f.start + f.real - 1
            for d in range(1, accepted + 1):
                want = toks[base_pos + d]
                row = next((r for r in range(f.real, len(f.tokens))
                            if f.positions[r] == base_pos + d and f.tokens[r] == want), None)
                if row is None:
                    break
                keep.append(row)
            feats.append(f.feats[keep])
            positions.extend(f.start + i for i in range(len(keep)))
        st.fed.clear()
        if positions and st.n == 0 and positions[0] > 0 and not self._restore(seq, st, feats, positions):
            return False
        if not positions:
            return st.last is not None
        if positions[0] != st.n or positions[-1] + 1 >= len(toks):
            return False
        dev = st.k.device
        pos = torch.tensor(positions, device=dev)
        nxt = torch.tensor([toks[p + 1] for p in positions], dtype=torch.int64, device=dev)
        raw = torch.cat(feats)  # [m, 3D]
        hidden = self.head.fuse(raw.to(self.head.norm.weight.dtype))  # [m, D]
        out = self.head(nxt, hidden, pos, self._attend(st, st.n))  # [m, D]
        st.n += len(positions)
        st.last = out[-1]
        if self.blocks is not None:
            self.blocks.file(seq.block_hashes, st.k, st.v, positions, raw)
        return True

    def _restore(self, seq, st: _HeadState, feats: list, positions: list[int]) -> bool:
        """A sequence whose first rows the base took from its prefix cache: the head rows before
        them from the block store, and the last skipped row's features put before this catch-up's
        (False where the store lacks a block: the sequence then drafts nothing)."""
        found = None if self.blocks is None else self.blocks.restore(seq.block_hashes, positions[0])
        if found is None:
            return False
        k, v, feat = found
        self._reserve(st, len(k) + 1)
        st.k[:len(k)], st.v[:len(k)] = k, v
        st.n = len(k)
        feats.insert(0, feat[None])
        positions.insert(0, st.n)
        return True

    def _draft(self, st: _HeadState, depth: int) -> list[list[int]]:
        """Top-`width` target ids at each of up to `depth` draft positions (top-1 first), chained
        on the top-1; fewer where `min_confidence` stops the chain (module docstring)."""
        head, h, pos = self.head, st.last[None], st.n - 1
        cands: list[list[int]] = []
        for d in range(depth):
            if d:
                tok = torch.tensor([cands[-1][0]], dtype=torch.int64, device=h.device)
                h = head(tok, h, torch.tensor([pos + d], device=h.device), self._attend(st, st.n + d - 1))
            logits = head.logits(h)[0]
            top = logits.topk(self.width)  # [K] draft ids
            if self.min_confidence > 0 and (d or self.width == 1):
                p = float(torch.softmax(logits.float(), dim=-1)[top.indices[0]])
                if p < self.min_confidence:
                    break
            cands.append(head.target_ids(top.indices).tolist())
        return cands

    def _draft_dynamic(self, st: _HeadState, depth: int) -> tuple[list[int], list[int], list[float]]:
        """A dynamic tree of up to `depth` depths (`spec/tree.py`'s `DxK:N`) → (target ids,
        parent rows, path probabilities), best path probability first. Each depth runs the head
        once over its K expanded nodes (token = the node, hidden = the output of the row that
        proposed it, position = its depth), each attending to the sequence's rows and its own
        ancestors. With `min_confidence` the tree grows past a depth only while that depth's best
        path probability is at least it."""
        head, K, n_keep = self.head, self.width, self.tree.nodes
        logp = torch.log_softmax(head.logits(st.last[None])[0], dim=-1)
        top = logp.topk(K)
        score, tok = top.values.tolist(), head.target_ids(top.indices).tolist()
        parent, level = [-1] * K, [1] * K
        row_of: dict[int, int] = {}  # expanded node → its head cache row
        out_of: dict[int, torch.Tensor] = {}  # expanded node → its output
        frontier, row = list(range(K)), st.n
        for d in range(1, depth):
            beam = sorted(frontier, key=lambda i: -score[i])[:K]
            if math.exp(score[beam[0]]) < self.min_confidence:
                break
            hidden = torch.stack([st.last if parent[i] < 0 else out_of[parent[i]] for i in beam])
            toks = torch.tensor([tok[i] for i in beam], dtype=torch.int64, device=hidden.device)
            pos = torch.full((len(beam),), st.n - 1 + d, device=hidden.device)
            ancestors = []
            for j, i in enumerate(beam):
                row_of[i] = row + j
                rows, a = [row + j], parent[i]
                while a >= 0:
                    rows.append(row_of[a])
                    a = parent[a]
                ancestors.append(rows)
            h = head(toks, hidden, pos, self._attend_nodes(st, row, ancestors))  # [m, D]
            row += len(beam)
            lp = torch.log_softmax(head.logits(h), dim=-1).topk(K)  # [m, K]
            ids = head.target_ids(lp.indices.flatten()).tolist()
            vals = lp.values.tolist()
            frontier = []
            for j, i in enumerate(beam):
                out_of[i] = h[j]
                for c in range(K):
                    frontier.append(len(score))
                    score.append(score[i] + vals[j][c])
                    tok.append(ids[j * K + c])
                    parent.append(i)
                    level.append(d + 1)
        # a child's path probability is at most its parent's, and ties go to the shallower node:
        # every prefix of this order is a tree
        order = sorted(range(len(score)), key=lambda i: (-score[i], level[i], i))[:n_keep]
        rank = {i: r for r, i in enumerate(order, start=1)}
        return ([tok[i] for i in order], [0 if parent[i] < 0 else rank[parent[i]] for i in order],
                [math.exp(score[i]) for i in order])

    @torch.inference_mode()
    def propose(self, seqs: list, budgets: list[int]) -> SpecProposal:
        ids = [torch.zeros(0, dtype=torch.int64) for _ in seqs]
        parents: list[list[int] | None] = [None for _ in seqs]
        for i, (seq, budget) in enumerate(zip(seqs, budgets)):
            depth = min(self.depth, budget)
            if self.policy is not None and self.tree is None:  # read every step: it learns from the last
                depth = self.policy.num_drafts(seq, depth)
            st = self._state(seq)
            # every step: the rows of the last verification must be resolved before later tokens
            # could pass for accepted drafts
            if not self._catch_up(seq, st) or depth <= 0 or not seq.speculate:
                continue
            if self.dynamic:
                tokens, par, _ = self._draft_dynamic(st, depth)
            else:
                cands = self._draft(st, depth)
                if not cands:
                    continue
                tokens, par = caterpillar(cands)
            ids[i] = torch.tensor(tokens, dtype=torch.int64)
            parents[i] = par
        return SpecProposal(ids, parents=parents if self.width > 1 or self.dynamic else None)

    def release(self, seq) -> None:
        self._states.pop(seq.seq_id, None)
        if self.policy is not None:
            self.policy.forget(seq)


def eagle_draft_cost(head: Eagle3Head, base: Transformer) -> float:
    """One draft's cost in base decode steps (bytes read per token, as for an MTP module)."""
    from quantspec.infer.spec.mtp import _DRAFT_OVERHEAD, _bytes_touched

    return _bytes_touched(head) / max(1, _bytes_touched(base, skip=base.model.embed_tokens)) + _DRAFT_OVERHEAD


def build_eagle_proposer(config, loaded) -> tuple[EagleProposer, int]:
    """`--speculate-method eagle --draft-model DIR [--speculate-tree DxK]` → (proposer, the most
    draft rows a step verifies); the head prepared for the base's device (`backend.prepare_head`)."""
    from quantspec.infer.backend import prepare_head
    from quantspec.infer.spec.proposers import AdaptiveDraftLength, SpecCost, loaded_runtime

    if not config.draft_model:
        raise QuantSpecError("--speculate-method eagle needs --draft-model DIR (an EAGLE-3 head from "
                             "`quantspec zoo train-draft-head --kind eagle3`)")
    base, runtime = loaded.model, loaded_runtime(loaded)
    head = prepare_head(load_eagle3_for_inference(config.draft_model, base), base.model.norm.weight.device)
    tree = parse_tree_spec(getattr(config, "speculate_tree", None))
    k = int(config.speculate_max_draft_token_num)
    policy = None
    if tree is None and getattr(config, "speculate_backoff", True):
        cost = SpecCost.for_device(runtime.device, draft_per_token=eagle_draft_cost(head, base),
                                   packed_cpu=runtime.packed_rows)
        policy = AdaptiveDraftLength(k, cost)
    proposer = EagleProposer(head, tree=tree, max_draft_tokens=k, policy=policy,
                             min_confidence=float(getattr(config, "speculate_min_confidence", 0.0)))
    return proposer, proposer.max_rows
