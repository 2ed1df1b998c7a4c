"""`--speculate-method medusa`: Medusa heads (`model_zoo/medusa.py`) draft a token tree.

Head k scores the token k + 2 ahead of the base's newest hidden state. With `--speculate-tree
DxK` the first D heads each give their top K tokens and the proposal is the `DxK` caterpillar
(`spec/tree.py`: the top-1 candidate of a position is the parent of the next position's
candidates); without it a chain of the heads' top-1 tokens (at most
`speculate_max_draft_token_num`, at most one per head). Drafts are deterministic (draft probs
None): sampling verification treats each candidate as one-hot, which keeps it lossless.

The heads score only their draft vocabulary when the artifact has one (`medusa_draft_vocab`:
its rows of each projection are gathered once at load, a quantized projection's dequantized).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from quantspec.errors import QuantSpecError
from quantspec.infer.spec.tree import TreeSpec, caterpillar, parse_tree_spec
from quantspec.infer.spec.types import SpecProposal
from quantspec.model_zoo.checkpoint import load_checkpoint_tensors, read_config
from quantspec.model_zoo.llama import Transformer
from quantspec.model_zoo.medusa import (MEDUSA_VOCAB_NAME, MedusaArgs, MedusaHeads, check_draft_vocab,
                                        check_medusa_matches_base, is_medusa_config, load_medusa,
                                        medusa_weight_table)

__all__ = ["MedusaProposer", "build_medusa_proposer", "load_medusa_for_inference"]


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
    (the heads read normed hidden states; the engine keeps pre-norm ones)."""

    needs_hidden = True

    def __init__(self, heads: MedusaHeads, norm: nn.Module, *, tree: TreeSpec | None = None, max_draft_tokens: int = 4):
        self.heads, self.norm, self.tree = heads, norm, tree
        n = heads.args.num_heads
        self.depth = min(n, tree.depth) if tree is not None else min(n, int(max_draft_tokens))
        self.width = tree.width if tree is not None else 1
        self.vocab = heads.medusa_draft_vocab
        self.rows: list[nn.Module | None] = []
        dtype = norm.weight.dtype
        for proj in heads.projections()[:self.depth]:
            if self.vocab is None:
                self.rows.append(None)
                continue
            # the draft vocabulary's rows, gathered once (a quantized head's rows dequantized:
            # the same numbers its kernel computes with, Vd instead of V rows a draft)
            w = proj.weight if isinstance(proj, nn.Linear) else proj.dequantized_weight(dtype)  # [V, D]
            sub = nn.Linear(w.shape[1], self.vocab.numel(), bias=False, device=w.device, dtype=dtype)
            sub.weight.data = w.detach()[self.vocab.to(w.device)].to(dtype).contiguous()  # [Vd, D]
            self.rows.append(sub)

    @property
    def max_rows(self) -> int:
        return self.depth * self.width

    def _logits(self, x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Head k's scores [A, Vd or V] and the ids of its columns (None: the full vocabulary)."""
        if self.rows[k] is not None:
            return self.rows[k](x), self.vocab
        full = self.heads.projections()[k](x)  # [A, V]
        return (full, None) if self.vocab is None else (full[:, self.vocab], self.vocab)

    @torch.inference_mode()
    def propose(self, seqs: list, budgets: list[int]) -> SpecProposal:
        live = [i for i, (s, b) in enumerate(zip(seqs, budgets)) if b > 0 and s.last_hidden is not None]
        ids: list[torch.Tensor] = [torch.zeros(0, dtype=torch.int64) for _ in seqs]
        parents: list[list[int] | None] = [None for _ in seqs]
        if not live:
            return SpecProposal(ids, parents=parents if self.tree is not None else None)
        w = self.norm.weight
        h = self.norm(torch.stack([seqs[i].last_hidden for i in live]).to(w.device, w.dtype))  # [A, D]
        x = self.heads.features(h)  # [heads, A, D]
        cands = []  # per depth: [A, K] token ids
        for k in range(self.depth):
            scores, cols = self._logits(x[k], k)
            top = scores.float().topk(self.width, dim=-1).indices  # [A, K]
            cands.append((top if cols is None else cols[top]).cpu())
        for r, i in enumerate(live):
            depth = min(self.depth, budgets[i])
            tokens, par = caterpillar([cands[d][r].tolist() for d in range(depth)])
            ids[i] = torch.tensor(tokens, dtype=torch.int64)
            parents[i] = par
        return SpecProposal(ids, parents=parents if self.width > 1 else None)

    def release(self, seq) -> None:
        pass


def build_medusa_proposer(config, loaded) -> tuple[MedusaProposer, int]:
    """`--speculate-method medusa --draft-model DIR [--speculate-tree DxK]` → (proposer, the most
    draft rows a step verifies)."""
    if not config.draft_model:
        raise QuantSpecError("--speculate-method medusa needs --draft-model DIR (Medusa heads from "
                             "`quantspec zoo train-draft-head --kind medusa`)")
    base = loaded.model
    heads = load_medusa_for_inference(config.draft_model, base)
    tree = parse_tree_spec(getattr(config, "speculate_tree", None))
    proposer = MedusaProposer(heads, base.model.norm, tree=tree, max_draft_tokens=config.speculate_max_draft_token_num)
    return proposer, proposer.max_rows
