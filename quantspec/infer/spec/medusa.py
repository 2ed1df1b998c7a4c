"""`--speculate-method medusa`: Medusa heads (`model_zoo/medusa.py`) draft a token tree.

Head k scores the token k + 2 ahead of the base's newest hidden state. With `--speculate-tree
DxK` the first D heads each give their top K tokens and the proposal is the `DxK` caterpillar
(`spec/tree.py`: the top-1 candidate of a position is the parent of the next position's
candidates); with `DxK:N` the N best paths through those candidates by the product of the heads'
probabilities (`tree.best_paths`); without a tree a chain of the heads' top-1 tokens (at most
`speculate_max_draft_token_num`, at most one per head). Drafts are deterministic (draft probs
None): sampling verification treats each candidate as one-hot, which keeps it lossless.

The heads score only their draft vocabulary when the artifact has one (`medusa_draft_vocab`:
its rows of each projection are gathered once at load, a quantized projection's dequantized).
A step runs only the heads its deepest chain needs, all from the one hidden state.

Chains get the back-off of `spec/proposers.py` (`AdaptiveDraftLength`): a step's cost is one call
of the heads (`SpecCost.draft_fixed`) plus, per draft, one more head's bytes over the base's
(`medusa_draft_cost`). With `min_confidence` a sequence's drafts stop at the first head whose
top-1 probability is below it, as EAGLE's do (`spec/eagle.py`): a chain may draft nothing, a
tree always drafts its first head's candidates; a dynamic tree stops past the first depth whose
best path probability is below it.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from torch import nn

from quantspec.errors import QuantSpecError
from quantspec.infer.spec.mtp import check_min_confidence
from quantspec.infer.spec.tree import TreeSpec, best_paths, caterpillar, parse_tree_spec
from quantspec.infer.spec.types import SpecProposal
from quantspec.model_zoo.checkpoint import load_checkpoint_tensors, read_config
from quantspec.model_zoo.llama import Transformer
from quantspec.model_zoo.medusa import (MEDUSA_VOCAB_NAME, MedusaArgs, MedusaHeads, check_draft_vocab,
                                        check_medusa_matches_base, is_medusa_config, load_medusa,
                                        medusa_weight_table)

__all__ = ["MedusaProposer", "build_medusa_proposer", "load_medusa_for_inference", "medusa_draft_cost"]


def load_medusa_for_inference(path: str | Path, base: Transformer, *, dtype: torch.dtype | None = None
                              ) -> MedusaHeads:
    """Medusa heads for `base` (unquantized or a compressed-tensors artifact), in the base's
    dtype and on its device, checked against it."""
    path = Path(path).expanduser()
    cfg = read_config(path)
    if not is_medusa_config(cfg):
        raise QuantSpecError(f"{path} is not Medusa heads (its config.json has no medusa_num_heads / "
                             "medusa_num_layers); pass heads from `quantspec zoo train-draft-head --kind medusa`")
    from quantspec.infer.spec.mtp import HeadKind, load_head_for_inference

    kind = HeadKind("Medusa heads", load_medusa, MedusaHeads, medusa_weight_table, (MEDUSA_VOCAB_NAME,),
                    check_medusa_matches_base, check_draft_vocab)

    def args() -> MedusaArgs:
        return MedusaArgs.from_config(cfg, load_checkpoint_tensors(path) if "quantspec" not in cfg else None,
                                      where=str(path / "config.json"))

    return load_head_for_inference(path, cfg, args, base, dtype, kind)


class MedusaProposer:
    """Medusa drafts for a batch of sequences (module docstring). `norm`: the base's final norm
    (the heads read normed hidden states; the engine keeps pre-norm ones); `tree`: a `DxK` spec
    (None: a chain of at most `max_draft_tokens`); `policy`: chains' back-off (None: always the
    budget); `min_confidence`: the top-1 probability below which drafting stops (0: never)."""

    needs_hidden = True

    def __init__(self, heads: MedusaHeads, norm: nn.Module, *, tree: TreeSpec | None = None, max_draft_tokens: int = 4,
                 policy=None, min_confidence: float = 0.0):
        self.heads, self.norm, self.tree, self.policy = heads, norm, tree, policy
        self.min_confidence = check_min_confidence(min_confidence)
        n = heads.args.num_heads
        self.depth = min(n, tree.depth) if tree is not None else min(n, int(max_draft_tokens))
        self.width = tree.width if tree is not None else 1
        self.dynamic = tree is not None and tree.dynamic
        self.vocab = heads.medusa_draft_vocab
        # head k's draft-vocabulary rows (empty without a draft vocabulary): a linear of their own,
        # which a backend prepares like the heads (`backend.prepare_head`)
        self.rows = nn.ModuleList()
        dtype = norm.weight.dtype
        for proj in heads.projections()[:self.depth] if self.vocab is not None else ():
            # gathered once (a quantized head's rows dequantized: the same numbers its kernel
            # computes with, Vd instead of V rows a draft)
            w = proj.weight if isinstance(proj, nn.Linear) else proj.dequantized_weight(dtype)  # [V, D]
            sub = nn.Linear(w.shape[1], self.vocab.numel(), bias=False, device=w.device, dtype=dtype)
            sub.weight.data = w.detach()[self.vocab.to(w.device)].to(dtype).contiguous()  # [Vd, D]
            self.rows.append(sub)

    @property
    def max_rows(self) -> int:
        return self.tree.num_nodes if self.dynamic else self.depth * self.width

    def _logits(self, x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Head k's scores [A, Vd or V] and the ids of its columns (None: the full vocabulary)."""
        if self.vocab is not None:
            return self.rows[k](x), self.vocab
        return self.heads.projections()[k](x), None  # [A, V]

    def _depth(self, seq, budget: int) -> int:
        """How many drafts `seq` gets this step (the policy is read every step: it learns from
        the last)."""
        depth = min(self.depth, budget)
        if self.policy is not None and self.tree is None:
            depth = self.policy.num_drafts(seq, depth)
        return depth

    @torch.inference_mode()
    def propose(self, seqs: list, budgets: list[int]) -> SpecProposal:
        depths = [self._depth(s, b) for s, b in zip(seqs, budgets)]
        live = [i for i, (s, d) in enumerate(zip(seqs, depths)) if d > 0 and s.last_hidden is not None]
        ids: list[torch.Tensor] = [torch.zeros(0, dtype=torch.int64) for _ in seqs]
        parents: list[list[int] | None] = [None for _ in seqs]
        if not live:
            return SpecProposal(ids, parents=parents if self.width > 1 or self.dynamic else None)
        need = max(depths[i] for i in live)  # heads past the deepest chain are not run
        w = self.norm.weight
        h = self.norm(torch.stack([seqs[i].last_hidden for i in live]).to(w.device, w.dtype))  # [A, D]
        x = self.heads.features(h, need)  # [need, A, D]
        dynamic = self.dynamic
        tops, logps = [], []
        for k in range(need):
            scores, cols = self._logits(x[k], k)
            scores = scores.float()
            top = scores.topk(self.width, dim=-1)  # [A, K]
            tops.append(top.indices if cols is None else cols[top.indices])
            if self.min_confidence > 0 or dynamic:
                logps.append(top.values - scores.logsumexp(-1, keepdim=True))  # [A, K] log-probabilities
        cands = torch.stack(tops).cpu()  # [need, A, K]: one copy to the host
        logp = torch.stack(logps).cpu() if logps else None  # [need, A, K]
        if self.min_confidence > 0:
            self._gate(depths, live, logp)
        for r, i in enumerate(live):
            if depths[i] == 0:
                continue
            if dynamic:
                nodes, par = best_paths(logp[:depths[i], r].tolist(), self.tree.nodes)
                tokens = [int(cands[len(path) - 1, r, path[-1]]) for path in nodes]
            else:
                tokens, par = caterpillar([cands[d, r].tolist() for d in range(depths[i])])
            ids[i] = torch.tensor(tokens, dtype=torch.int64)
            parents[i] = par
        return SpecProposal(ids, parents=parents if self.width > 1 or dynamic else None)

    def _gate(self, depths: list[int], live: list[int], logp: torch.Tensor) -> None:
        """Cut each live sequence's depth (`logp` [need, A, K]: the heads' top-K log-probabilities):
        a chain or `DxK` tree at its first unsure head (top-1 probability below the gate; a tree's
        first head is never cut), a dynamic tree past the first depth whose best path probability
        (the product of the heads' top-1 probabilities so far) is below the gate."""
        gate = math.log(self.min_confidence)
        if self.dynamic:
            unsure = logp[:, :, 0].cumsum(0) < gate  # [need, A]
            for r, i in enumerate(live):
                cut = unsure[:depths[i], r].nonzero()
                if cut.numel():
                    depths[i] = int(cut[0, 0]) + 1
            return
        first = 0 if self.tree is None else 1
        for r, i in enumerate(live):
            unsure = (logp[first:depths[i], r, 0] < gate).nonzero()
            if unsure.numel():
                depths[i] = first + int(unsure[0, 0])

    def release(self, seq) -> None:
        if self.policy is not None:
            self.policy.forget(seq)


def medusa_draft_cost(heads: MedusaHeads, base: Transformer) -> tuple[float, float]:
    """(per step, per draft) cost of Medusa drafts in base decode steps (`SpecCost.draft_fixed`,
    `draft_per_token`). The heads run once per step from one hidden state: that call costs a
    draft call's overhead, and each draft is one more head, bound on a CPU by reading its
    weights: its ResBlocks and the rows it scores (the draft vocabulary's, gathered in the base's
    dtype, else the whole projection) over the bytes a base decode step reads."""
    from quantspec.infer.spec.mtp import _DRAFT_OVERHEAD, _bytes_touched

    vocab, D = heads.medusa_draft_vocab, heads.args.hidden_size
    itemsize = base.model.norm.weight.element_size()
    per_head = [sum(_bytes_touched(block) for block in list(head)[:-1])
                + (_bytes_touched(head[-1]) if vocab is None else vocab.numel() * D * itemsize)
                for head in heads.medusa_head]
    base_bytes = max(1, _bytes_touched(base, skip=base.model.embed_tokens))
    return _DRAFT_OVERHEAD, max(per_head) / base_bytes


def build_medusa_proposer(config, loaded) -> tuple[MedusaProposer, int]:
    """`--speculate-method medusa --draft-model DIR [--speculate-tree DxK]` → (proposer, the most
    draft rows a step verifies); the heads and their gathered rows prepared for the base's device
    (`backend.prepare_head`)."""
    from quantspec.infer.backend import prepare_head
    from quantspec.infer.spec.proposers import AdaptiveDraftLength, SpecCost, loaded_runtime

    if not config.draft_model:
        raise QuantSpecError("--speculate-method medusa needs --draft-model DIR (Medusa heads from "
                             "`quantspec zoo train-draft-head --kind medusa`)")
    base, runtime = loaded.model, loaded_runtime(loaded)
    heads = load_medusa_for_inference(config.draft_model, base)
    tree = parse_tree_spec(getattr(config, "speculate_tree", None))
    proposer = MedusaProposer(heads, base.model.norm, tree=tree, max_draft_tokens=config.speculate_max_draft_token_num,
                              min_confidence=float(getattr(config, "speculate_min_confidence", 0.0)))
    device = base.model.norm.weight.device
    prepare_head(heads, device)
    prepare_head(proposer.rows, device)
    if tree is None and getattr(config, "speculate_backoff", True):
        fixed, per_draft = medusa_draft_cost(heads, base)
        cost = SpecCost.for_device(runtime.device, draft_per_token=per_draft, draft_fixed=fixed,
                                   packed_cpu=runtime.packed_rows)
        proposer.policy = AdaptiveDraftLength(proposer.depth, cost)
    return proposer, proposer.max_rows
