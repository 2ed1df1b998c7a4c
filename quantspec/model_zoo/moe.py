"""The sparse mixture-of-experts MLP of Qwen2-MoE, Qwen3-MoE and Mixtral, as plain nn.Modules.

`SparseMoE` mirrors HF's on-disk names: the router is `mlp.gate` (a Linear [E, D], never
quantized: llm-compressor and the serving engines keep it in float) and expert e is
`mlp.experts.{e}` with its own `gate_proj` / `up_proj` / `down_proj` (`llama.MLP`), so each expert's
Linears are quantized, stored and loaded by name like a dense MLP's. Mixtral's block is
`block_sparse_moe` and its experts' Linears `w1` / `w3` / `w2` (`NamedMLP`: the same MLP under
those names; code reaches them as gate / up / down all the same). Qwen2-MoE adds a shared
expert every token takes (`mlp.shared_expert`, an MLP quantized like a dense one) scaled by
sigmoid(`mlp.shared_expert_gate`(x)) (a Linear [1, D], float like the router).

Routing is HF's: softmax over the router's logits in float32, the top `experts_per_token`
probabilities, renormalized to sum to 1 where `norm_topk_prob`, cast to the activations' dtype
(Mixtral's stay float32);
each token's output is the sum, in expert order, of its chosen experts' outputs times their
weights, then plus the gated shared expert's.
Every row's numbers depend on that row alone (the experts run on the rows routed to them), so a
row-invariant forward passes the flag to each expert.

Draft layers (MTP, EAGLE-3) of a mixture of experts are dense; `warm_mlp` picks the base MLP
they start from.

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

__all__ = ["MIXTRAL_NAMES", "NamedMLP", "SparseMoE", "all_experts", "copy_mlp", "moe_fields", "moe_weight_table",
           "expert_dims", "route", "router_ignore", "warm_mlp"]

# Mixtral's names of an expert's gate / up / down projections
MIXTRAL_NAMES = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}


def router_ignore(args: ModelArgs) -> tuple[str, ...]:
    """The routers' and shared-expert gates' names as compressed-tensors `ignore` entries
    (llm-compressor's), for a model of `args`."""
    if args.arch == "mixtral":
        return ("re:.*block_sparse_moe.gate$",)
    return ("re:.*mlp.gate$",) + (("re:.*mlp.shared_expert_gate$",) if args.shared_expert_intermediate_size else ())


def expert_dims(args: ModelArgs | None) -> tuple[int, int] | None:
    """(hidden size, expert intermediate size) of a mixture of experts of `args`; None for a dense model."""
    if args is None or not getattr(args, "num_experts", 0):
        return None
    return args.hidden_size, args.moe_intermediate_size


def moe_fields(cfg: dict, arch: str) -> dict:
    """ModelArgs' mixture-of-experts fields of a Qwen2-MoE / Qwen3-MoE / Mixtral config (none for
    a dense one): a Qwen layer is sparse unless listed in `mlp_only_layers` or off the
    `decoder_sparse_step` stride, every Mixtral layer is (its experts as wide as
    `intermediate_size`, their weights always renormalized); defaults are transformers'."""
    experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)  # transformers 5 writes the latter
    if not experts:
        return {}
    common = {"num_experts": experts, "experts_per_token": int(cfg.get("num_experts_per_tok") or 0)}
    if arch == "mixtral":
        return {**common, "moe_intermediate_size": int(cfg["intermediate_size"]), "norm_topk_prob": True}
    step, only = int(cfg.get("decoder_sparse_step") or 1), set(cfg.get("mlp_only_layers") or ())
    dense = tuple(i for i in range(cfg["num_hidden_layers"]) if i in only or (i + 1) % step)
    return {**common, "moe_intermediate_size": int(cfg["moe_intermediate_size"]),
            "norm_topk_prob": bool(cfg.get("norm_topk_prob", False)), "dense_layers": dense,
            "shared_expert_intermediate_size": int(cfg.get("shared_expert_intermediate_size") or 0)}


def moe_weight_table(args: ModelArgs, prefix: str, table: dict) -> list[tuple[str, int, tuple[str, str, str]]]:
    """Add a sparse layer's router (and shared-expert gate) tensors to `table`; → the prefix, width
    and gate / up / down names of each of its MLPs (the experts', the shared expert's), whose
    tensors the caller adds."""
    D, block = args.hidden_size, prefix + ("block_sparse_moe." if args.arch == "mixtral" else "mlp.")
    plain = ("gate_proj", "up_proj", "down_proj")
    names = tuple(MIXTRAL_NAMES[n] for n in plain) if args.arch == "mixtral" else plain
    table[block + "gate.weight"] = (args.num_experts, D)
    mlps = [(block + f"experts.{e}.", args.moe_intermediate_size, names) for e in range(args.num_experts)]
    if args.shared_expert_intermediate_size:
        table[block + "shared_expert_gate.weight"] = (1, D)
        mlps.append((block + "shared_expert.", args.shared_expert_intermediate_size, plain))
    return mlps


class NamedMLP(MLP):
    """`llama.MLP` with its gate / up / down Linears registered under other names (`names`, e.g.
    Mixtral's w1 / w3 / w2): state dicts use those, attribute access either."""

    def __init__(self, args: ModelArgs, intermediate: int, names: dict[str, str]):
        super().__init__(args, intermediate)
        self.__dict__["_names"] = dict(names)
        self.__dict__["_modules"] = {names.get(k, k): v for k, v in self._modules.items()}

    def __getattr__(self, name: str):
        names = self.__dict__.get("_names", {})
        return super().__getattr__(names.get(name, name))

    def __setattr__(self, name: str, value) -> None:
        super().__setattr__(self.__dict__.get("_names", {}).get(name, name), value)


def route(logits: torch.Tensor, k: int, normalize: bool, fp32: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] → (weights [T, k] in the logits' dtype, or float32 where `fp32`
    (Mixtral's), expert ids [T, k])."""
    probs = F.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return (weights if fp32 else weights.to(logits.dtype)), ids


class SparseMoE(nn.Module):
    """A router over `num_experts` MLPs; each token runs through `experts_per_token` of them."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.top_k, self.normalize, self.fp32 = args.experts_per_token, args.norm_topk_prob, args.arch == "mixtral"
        self.gate = nn.Linear(args.hidden_size, args.num_experts, bias=False)
        inter = args.moe_intermediate_size
        self.experts = nn.ModuleList(NamedMLP(args, inter, MIXTRAL_NAMES) if args.arch == "mixtral" else
                                     MLP(args, inter) for _ in range(args.num_experts))
        self.calibrating = False  # every expert sees every token (`all_experts`)
        shared = args.shared_expert_intermediate_size
        self.shared_expert = MLP(args, shared) if shared else None
        self.shared_expert_gate = nn.Linear(args.hidden_size, 1, bias=False) if shared else None

    def forward(self, x: torch.Tensor, row_invariant: bool = False) -> torch.Tensor:
        weights, ids = route(project(self.gate, x, row_invariant), self.top_k, self.normalize, self.fp32)
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


def warm_mlp(base: nn.Module, like: MLP) -> MLP | None:
    """The base's MLP a fresh draft layer's MLP (`like`) starts from: the last layer's; of a
    mixture of experts, the last dense layer's, else the last layer's expert 0 where it has the
    draft's shapes (None: the draft keeps its own initialization)."""
    for layer in reversed(base.model.layers):
        if isinstance(layer.mlp, MLP):
            return layer.mlp
    expert = base.model.layers[-1].mlp.experts[0]
    return expert if expert.down_proj.weight.shape == like.down_proj.weight.shape else None


@torch.no_grad()
def copy_mlp(dst: MLP, src: MLP | None) -> None:
    """dst's gate / up / down weights (and biases) set to src's; nothing for src None."""
    for name in ("gate_proj", "up_proj", "down_proj") if src is not None else ():
        mine, theirs = getattr(dst, name), getattr(src, name)
        mine.weight.copy_(theirs.weight)
        if mine.bias is not None:
            mine.bias.copy_(theirs.bias)
