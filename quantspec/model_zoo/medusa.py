"""Medusa heads (Cai et al. 2024, arXiv:2401.10774) in the layout the Medusa authors publish.

Head k (0-based) reads the base's last hidden state h_i (after its final norm; h_i produced
token t_{i+1}) and predicts t_{i+k+2}:

    x_k    = ResBlock^L(h_i),  ResBlock(x) = x + SiLU(linear(x))       # [N, D]
    logits = x_k @ W_k^T                                               # [N, V]

Artifact: `config.json` with `medusa_num_heads` and `medusa_num_layers` (the authors' keys, at the
top level as the authors write them or in a `medusa_config` block, which is read alike; a
`quantspec` block records the base's hidden size and vocabulary), tensors
`medusa_head.{k}.{l}.linear.weight` [D, D] / `.bias` [D] for l < L and
`medusa_head.{k}.{L}.weight` [V, D]. quantspec may add `medusa_draft_vocab` [Vd] int64: the
tokens it scores when drafting (the most frequent targets; the heads' full [V, D] rows stay, so
other loaders read the heads unchanged and ignore it). Scoring Vd rows instead of V keeps a
draft cheap next to the base step (49152 × 576 per head for SmolLM2).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from quantspec.errors import QuantSpecError
from quantspec.model_zoo.llama import ModelArgs

__all__ = ["MEDUSA_VOCAB_NAME", "MedusaArgs", "MedusaHeads", "check_draft_vocab", "check_medusa_matches_base", "is_medusa_config",
           "load_medusa", "medusa_weight_table", "save_medusa"]

MEDUSA_VOCAB_NAME = "medusa_draft_vocab"
_KEYS = ("medusa_num_heads", "medusa_num_layers")


def _medusa_keys(cfg: dict) -> dict:
    """Where the authors' keys live: a `medusa_config` block when there is one, else the top level."""
    block = cfg.get("medusa_config")
    return block if isinstance(block, dict) else cfg


def is_medusa_config(cfg: dict) -> bool:
    """A Medusa head's config.json (either of the authors' keys, a `medusa_config` block, or a
    Medusa architecture)."""
    return ("medusa_config" in cfg or any(k in cfg for k in _KEYS)
            or any("medusa" in str(a).lower() for a in cfg.get("architectures") or ()))


@dataclass(frozen=True)
class MedusaArgs:
    num_heads: int
    num_layers: int
    hidden_size: int
    vocab_size: int
    draft_vocab_size: int | None = None  # None: the heads score the whole vocabulary
    base_rotation: str = ""  # the rotations fused into the base they were trained on (`calib.rotate`)

    @classmethod
    def from_config(cls, cfg: dict, tensors: dict[str, torch.Tensor] | None = None,
                    where: str = "config.json") -> "MedusaArgs":
        """From the authors' keys; hidden and vocab sizes from the `quantspec` block or from the
        first head's tensors."""
        keys = _medusa_keys(cfg)
        for k in _KEYS:
            v = keys.get(k)
            if isinstance(v, bool) or not isinstance(v, int) or v < (1 if k == "medusa_num_heads" else 0):
                raise QuantSpecError(f"{where} has no valid {k} (got {v!r}); a Medusa config.json needs "
                                     "medusa_num_heads and medusa_num_layers, e.g. 4 and 1")
        n, L = keys["medusa_num_heads"], keys["medusa_num_layers"]
        qs = cfg.get("quantspec") or {}
        D, V = qs.get("hidden_size"), qs.get("vocab_size")
        if (D is None or V is None) and tensors is not None:
            last = tensors.get(f"medusa_head.0.{L}.weight")
            if last is None or last.ndim != 2:
                raise QuantSpecError(f"{where}: medusa_head.0.{L}.weight is missing; the heads do not "
                                     f"match medusa_num_layers={L}")
            V, D = int(last.shape[0]), int(last.shape[1])
        if D is None or V is None:
            raise QuantSpecError(f"{where} does not give the heads' hidden_size / vocab_size")
        vd = qs.get("draft_vocab_size")
        return cls(n, L, int(D), int(V), None if vd is None else int(vd), str(qs.get("base_rotation") or ""))

    def to_config(self) -> dict:
        qs = {"hidden_size": self.hidden_size, "vocab_size": self.vocab_size}
        if self.draft_vocab_size is not None:
            qs["draft_vocab_size"] = self.draft_vocab_size
        if self.base_rotation:
            qs["base_rotation"] = self.base_rotation
        return {"architectures": ["MedusaModel"], "medusa_num_heads": self.num_heads,
                "medusa_num_layers": self.num_layers, "quantspec": qs}


def check_medusa_matches_base(args: MedusaArgs, base: ModelArgs, where: str = "the Medusa heads") -> None:
    for name, mine, theirs in (("hidden_size", args.hidden_size, base.hidden_size),
                               ("vocab_size", args.vocab_size, base.vocab_size)):
        if mine != theirs:
            raise QuantSpecError(f"{where} were trained for a base with {name} {mine}, this base has {theirs}; "
                                 "train heads for this base with `quantspec zoo train-draft-head --kind medusa`")
    if args.base_rotation != base.rotation:
        raise QuantSpecError(f"{where} read hidden states of a base {_rotated(args.base_rotation)}, and this base is "
                             f"{_rotated(base.rotation)} (quantize --rotate changes them); train heads for this base "
                             "with `quantspec zoo train-draft-head --kind medusa`")


def _rotated(tag: str) -> str:
    return f"rotated by {tag}" if tag else "without rotations"


class ResBlock(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.linear = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.silu(self.linear(x))


class MedusaHeads(nn.Module):
    """The heads (module docstring). `medusa_head[k]` = L ResBlocks then the [V, D] projection."""

    def __init__(self, args: MedusaArgs):
        super().__init__()
        self.args = args
        D, V = args.hidden_size, args.vocab_size
        self.medusa_head = nn.ModuleList(
            nn.Sequential(*[ResBlock(D) for _ in range(args.num_layers)], nn.Linear(D, V, bias=False))
            for _ in range(args.num_heads))
        if args.draft_vocab_size is not None:
            self.register_buffer(MEDUSA_VOCAB_NAME, torch.zeros(args.draft_vocab_size, dtype=torch.int64))
        else:
            self.medusa_draft_vocab = None

    def features(self, h: torch.Tensor, count: int | None = None) -> torch.Tensor:
        """h [N, D] (after the base's final norm) → the features of the first `count` heads
        (None: all K) [count, N, D]. Each head reads h alone, so fewer heads cost less."""
        out = []
        for head in self.medusa_head[:count]:
            x = h
            for block in list(head)[:-1]:
                x = block(x)
            out.append(x)
        return torch.stack(out)

    def projections(self) -> list[nn.Module]:
        return [head[-1] for head in self.medusa_head]

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """h [N, D] → logits [K, N, V] over the whole vocabulary."""
        x = self.features(h)
        return torch.stack([proj(x[k]) for k, proj in enumerate(self.projections())])


def medusa_weight_table(args: MedusaArgs) -> dict[str, tuple[int, ...]]:
    """Every tensor of an unquantized Medusa artifact, with its shape."""
    D, L = args.hidden_size, args.num_layers
    table: dict[str, tuple[int, ...]] = {}
    for k in range(args.num_heads):
        for layer in range(L):
            table[f"medusa_head.{k}.{layer}.linear.weight"] = (D, D)
            table[f"medusa_head.{k}.{layer}.linear.bias"] = (D,)
        table[f"medusa_head.{k}.{L}.weight"] = (args.vocab_size, D)
    if args.draft_vocab_size is not None:
        table[MEDUSA_VOCAB_NAME] = (args.draft_vocab_size,)
    return table


def save_medusa(heads: MedusaHeads, out_dir: str | os.PathLike, extra_config: dict | None = None) -> Path:
    """Write config.json + model.safetensors into `out_dir`, each file replaced atomically."""
    from quantspec.model_zoo.checkpoint import save_module

    return save_module(heads, out_dir, heads.args.to_config(), extra_config)


def load_medusa(path: str | os.PathLike, base: ModelArgs | None = None, *, dtype: torch.dtype = torch.float32,
                device: str | torch.device = "cpu") -> MedusaHeads:
    """Load unquantized Medusa heads (built on meta, `assign=True`), checked against the weight
    table and — given the base's args — against the base."""
    from quantspec.model_zoo.checkpoint import check_against_table, load_checkpoint_tensors, read_config

    path = Path(path).expanduser()
    cfg = read_config(path)
    if cfg.get("quantization_config"):
        raise QuantSpecError(f"{path} is quantized; load it with quantspec.infer.spec.medusa.load_medusa_for_inference")
    tensors = load_checkpoint_tensors(path)
    args = MedusaArgs.from_config(cfg, tensors, where=str(path / "config.json"))
    if base is not None:
        check_medusa_matches_base(args, base, where=f"Medusa heads {path}")
    table = medusa_weight_table(args)
    check_against_table(tensors, table, str(path))
    unexpected = sorted(set(tensors) - set(table))
    if unexpected:
        raise QuantSpecError(f"{path}: unexpected tensor {unexpected[0]} for Medusa heads with "
                             f"medusa_num_layers={args.num_layers}")
    with torch.device("meta"):
        heads = MedusaHeads(args)
    heads.load_state_dict({k: (v if k == MEDUSA_VOCAB_NAME else v.to(dtype)) for k, v in tensors.items()},
                          assign=True)
    check_draft_vocab(heads, str(path))
    return heads.to(device).eval()


def check_draft_vocab(heads: MedusaHeads, where: str) -> None:
    """The draft vocabulary must name tokens of the heads' vocabulary."""
    ids = heads.medusa_draft_vocab
    if ids is not None and ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= heads.args.vocab_size):
        raise QuantSpecError(f"{where}: {MEDUSA_VOCAB_NAME} holds token ids outside the vocabulary of "
                             f"{heads.args.vocab_size}; retrain the heads for this base or drop the tensor")
