"""The sparse mixture-of-experts MLP of Qwen2-MoE and Qwen3-MoE, as plain nn.Modules.

`SparseMoE` mirrors HF's on-disk names: the router is `mlp.gate` (a Linear [E, D], never
quantized: llm-compressor and the serving engines keep it in float) and expert e is
`mlp.experts.{e}` with its own `gate_proj` / `up_proj` / `down_proj` (`llama.MLP`), so each expert's
Linears are quantized, stored and loaded by name like a dense MLP's. Qwen2-MoE adds a shared
expert every token takes (`mlp.shared_expert`, an MLP quantized like a dense one) scaled by
sigmoid(`mlp.shared_expert_gate`(x)) (a Linear [1, D], float like the router).

Routing is HF's: softmax over the router's logits in float32, the top `experts_per_token`
probabilities, renormalized to sum to 1 where `norm_topk_prob`, cast to the activations' dtype;
each token's output is the sum, in expert order, of its chosen experts' outputs times their
weights, then plus the gated shared expert's.
Every row's numbers depend on that row alone (the experts run on the rows routed to them), so a
row-invariant forward passes the flag to each expert.

Calibration (`all_experts`) runs every expert on every token, as llm-compressor does by default:
an expert few calibration tokens are routed to still gets a full Hessian (GPTQ) and activation
range (static scales); the layer's output still sums only the routed experts' outputs.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from quantspec.model_zoo.llama import MLP, ModelArgs, project

__all__ = ["ROUTER_IGNORE", "SparseMoE", "all_experts", "route"]

# the routers' and shared-expert gates' names as compressed-tensors `ignore` entries
# (llm-compressor's for Qwen-style MoE)
ROUTER_IGNORE = ("re:.*mlp.gate$", "re:.*mlp.shared_expert_gate$")


def route(logits: torch.Tensor, k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] → (weights [T, k] in the logits' dtype, expert ids [T, k])."""
    probs = F.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype), ids


class SparseMoE(nn.Module):
    """A router over `num_experts` MLPs; each token runs through `experts_per_token` of them."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.top_k, self.normalize = args.experts_per_token, args.norm_topk_prob
        self.gate = nn.Linear(args.hidden_size, args.num_experts, bias=False)
        self.experts = nn.ModuleList(MLP(args, args.moe_intermediate_size) for _ in range(args.num_experts))
        self.calibrating = False  # every expert sees every token (`all_experts`)
        shared = args.shared_expert_intermediate_size
        self.shared_expert = MLP(args, shared) if shared else None
        self.shared_expert_gate = nn.Linear(args.hidden_size, 1, bias=False) if shared else None

    def forward(self, x: torch.Tensor, row_invariant: bool = False) -> torch.Tensor:
        weights, ids = route(project(self.gate, x, row_invariant), self.top_k, self.normalize)
        out = torch.zeros_like(x)
        hit = range(len(self.experts)) if self.calibrating else torch.unique(ids).tolist()
        for e in hit:  # ascending: each row sums its experts in one order
            rows, slot = torch.where(ids == e)
            if self.calibrating:
                y = self.experts[e](x, row_invariant)[rows]
            else:
                y = self.experts[e](x[rows], row_invariant)
            out.index_add_(0, rows, (y * weights[rows, slot, None]).to(out.dtype))
        if self.shared_expert is not None:
            gate = torch.sigmoid(project(self.shared_expert_gate, x, row_invariant))
            out = out + gate * self.shared_expert(x, row_invariant)
        return out


@contextmanager
def all_experts(model: nn.Module):
    """Within the block, every `SparseMoE` of `model` runs all its experts on every token (the
    output unchanged: only routed experts are summed)."""
    moes = [m for m in model.modules() if isinstance(m, SparseMoE)]
    for m in moes:
        m.calibrating = True
    try:
        yield
    finally:
        for m in moes:
            m.calibrating = False
