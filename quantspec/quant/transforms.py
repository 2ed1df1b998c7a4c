"""A checkpoint's compressed-tensors `transform_config`: the transforms applied to its Linears.

Two kinds, as compressed-tensors defines them:
- fused (`weight_input` / `weight_output`): folded into the stored weights, nothing is left to run
  (the rotations `quantize --rotate` fuses, `calib.rotate`; llm-compressor's SpinQuant R1 / R2);
- run time (`input` / `output`): a Hadamard transform of a Linear's input before its matmul or
  of its output after it, paired with a fused one on the same Linear that it undoes (QuIP's
  `v` / `u`, `quantize --quip`, `calib.quip`; llm-compressor's `QuIPModifier`; SpinQuant's R4 on
  each `down_proj`'s input, `quantize --rotate R4`).

quantspec runs both, as vLLM does: `online_transforms` resolves each run-time transform to the
Linears it targets (compressed-tensors' own matching, vLLM's too) and its matrix — the tensor the
checkpoint stores under `{linear}.{scheme}_{location}.weight` (permuted by `.perm` where present),
or Sylvester's construction for a `hadamard` scheme that stores none — and the engine wraps those
Linears (`infer.transformed`). Transforms on attention (`q_attn`, `k_cache`: SpinQuant's R3)
or on an embedding, and run-time transforms other than the Hadamard types, are refused in one line.
A mixture's experts take none, as in vLLM, whose fused experts run no transform. SGLang and
transformers run no run-time transform.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any, Mapping

import torch
from torch import nn

from quantspec.errors import QuantSpecError
from quantspec.model_zoo.hf_config import RUN_TIME_LOCATIONS, runs_at_run_time

__all__ = ["OFFLINE", "ONLINE", "OnlineTransform", "fused_groups_only", "online_transforms", "turned_at_run_time",
           "undo_online", "read_transform_config", "run_time_transforms", "sylvester"]

OFFLINE = ("weight_input", "weight_output")
ONLINE = RUN_TIME_LOCATIONS
RUN_TIME_TYPES = ("hadamard", "random-hadamard")  # orthogonal ±1/√n: what vLLM's transform module runs
_EXPERT = re.compile(r"\.experts\.\d+\.")  # a mixture's experts: vLLM's fused experts run no transform


def _location(a) -> str:
    return getattr(a.location, "value", a.location)


def read_transform_config(tc: Any, where: str) -> dict | None:
    """A checkpoint's `transform_config`, checked by compressed-tensors' own model: None when
    empty; refused in one line for a transform quantspec does not run (on attention or the KV
    cache: SpinQuant's R3)."""
    if not tc:
        return None
    from compressed_tensors.transform import TransformConfig

    try:
        parsed = TransformConfig.model_validate(tc)
    except Exception as e:  # pydantic's ValidationError, several lines: the first says what
        first = str(e).strip().splitlines()
        raise QuantSpecError(f"{where}.transform_config is malformed ({' '.join(first[:3])[:200]}); "
                             "re-export the checkpoint") from None
    for name, scheme in parsed.config_groups.items():
        for a in scheme.apply:
            loc = _location(a)
            if loc in ONLINE and scheme.type not in RUN_TIME_TYPES:
                raise QuantSpecError(
                    f"{where}.transform_config[{name!r}] runs a {scheme.type} transform at run time; vLLM runs "
                    f"{' and '.join(RUN_TIME_TYPES)} ones there (quantspec too): re-export it with one of those")
            if loc not in OFFLINE + ONLINE:
                raise QuantSpecError(
                    f"{where}.transform_config[{name!r}] applies a {scheme.type} transform at {loc!r} (on "
                    f"{', '.join(a.targets[:2])}); quantspec runs transforms of Linears only (fused into their "
                    "weights or around them at run time, as vLLM does): quantize the float model with --rotate "
                    "R1,R2 or --quip instead")
    return json.loads(json.dumps(parsed.model_dump()))


def _run_time_applies(qc) -> dict[str, tuple[dict, list[dict]]]:
    """A `QuantConfig`'s dumped `transform_config` groups that run at run time: {name: (group, its
    run-time `apply` entries)}, in name order."""
    groups = ((qc.transform_config or {}).get("config_groups") or {}) if qc is not None else {}
    out = {}
    for name, g in sorted(groups.items()):
        applies = [a for a in g.get("apply") or () if str(a.get("location")) in ONLINE]
        if applies:
            out[name] = (g, applies)
    return out


def run_time_transforms(qc) -> str:
    """What a `QuantConfig`'s `transform_config` runs at run time, for `inspect`: "" for nothing,
    else each such scheme's name, type, block and place ("v: hadamard 64, input")."""
    return "; ".join(f"{name}: {g.get('type')} {g.get('head_dim') or 'full'}, "
                     f"{'+'.join(str(a.get('location')) for a in applies)}"
                     for name, (g, applies) in _run_time_applies(qc).items())


def turned_at_run_time(qc, module_name: str) -> bool:
    """Whether a `QuantConfig`'s run-time transforms turn the checkpoint Linear `module_name`, matched
    as compressed-tensors matches them (`is_match` on a Linear of that name); experts take none, as
    in `online_transforms`."""
    applies = [a for _g, group_applies in _run_time_applies(qc).values() for a in group_applies]
    if not applies or _EXPERT.search(module_name):
        return False
    from compressed_tensors.utils import is_match

    linear = nn.Linear(1, 1, bias=False, device="meta")
    return any(is_match(module_name, linear, a.get("targets") or (), a.get("ignore") or ()) for a in applies)


# ---- the matrices --------------------------------------------------------------------------
def sylvester(size: int) -> torch.Tensor:
    """Sylvester's Hadamard matrix of `size` (a power of two), ±1, float32: compressed-tensors'
    `deterministic_hadamard_matrix`, the `hadamard` scheme's."""
    from compressed_tensors.transform.utils.hadamard import deterministic_hadamard_matrix

    return deterministic_hadamard_matrix(size, torch.float32)


@dataclass(frozen=True, eq=False)
class OnlineTransform:
    """One run-time transform of a Linear: `value` (its input, or its output) in blocks of `size`
    times `dense()` (compressed-tensors' and vLLM's `value @ W`, W transposed where the scheme says
    `inverse`, divided by √size); `matrix` holds W (±1 for the Hadamard types) when it is not
    Sylvester's matrix of `size`."""

    scheme: str
    location: str  # "input" | "output"
    size: int
    matrix: torch.Tensor | None = None  # [size, size] float64, unnormalized; None: Sylvester's

    def unnormalized(self) -> torch.Tensor:
        """W [size, size], float64: `dense()` times √size."""
        return sylvester(self.size).double() if self.matrix is None else self.matrix

    def dense(self) -> torch.Tensor:
        """The matrix `value` blocks are multiplied by, float64, normalized."""
        return self.unnormalized() / math.sqrt(self.size)

    def same_as(self, other: "OnlineTransform | None") -> bool:
        return other is not None and self.size == other.size and (self.matrix is None) == (other.matrix is None) \
            and (self.matrix is None or bool(torch.equal(self.matrix, other.matrix)))

    def describe(self) -> str:
        return f"{self.scheme}:{self.location} {'hadamard' if self.matrix is None else 'dense'} {self.size}"


def _blocks(v: torch.Tensor, t: OnlineTransform) -> torch.Tensor:
    """`v`'s last dimension in blocks of `t.size`, each times `t.dense()` (float64)."""
    return (v.double().unflatten(-1, (-1, t.size)) @ t.dense()).flatten(-2)


def undo_online(w: torch.Tensor, bias: torch.Tensor | None, transforms: Mapping[str, OnlineTransform]
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The weight [N, K] and bias [N] of the float Linear that computes what a Linear of weight `w`
    and bias `bias` computes between its run-time `transforms` ({"input" | "output": transform}):
    `y = (x·Mi·wᵀ + b)·Mo` is `x·(Moᵀ·w·Miᵀ)ᵀ + b·Mo`; float64 in, float32 out."""
    w = w.double()
    if (t := transforms.get("input")) is not None:
        w = (w.unflatten(-1, (-1, t.size)) @ t.dense().T).flatten(-2)
    if (t := transforms.get("output")) is not None:
        w = _blocks(w.T, t).T
        bias = None if bias is None else _blocks(bias, t)
    return w.float().contiguous(), None if bias is None else bias.float()


def fused_groups_only(tc: Mapping | None) -> dict | None:
    """A dumped `transform_config` without its groups that run at run time (undone with them: a
    QuIP group's fused half is its run-time half's inverse); None when nothing is left."""
    groups = {k: g for k, g in ((tc or {}).get("config_groups") or {}).items() if not runs_at_run_time(g)}
    return {**tc, "config_groups": groups} if groups else None


def _matrix(scheme_name: str, scheme, args, name: str, size: int, tensors: Mapping[str, torch.Tensor], where: str,
            used: set[str]) -> torch.Tensor | None:
    """The transform's matrix for `name` (None: Sylvester's, unpermuted), from the checkpoint's
    tensor where it holds one."""
    key = f"{name}.{scheme_name}_{_location(args)}"
    w = tensors[f"{key}.weight"] if f"{key}.weight" in tensors else None
    perm = tensors[f"{key}.perm"] if f"{key}.perm" in tensors else None
    used.update(k for k in (f"{key}.weight", f"{key}.perm") if k in tensors)
    if w is None:
        if scheme.type != "hadamard" or scheme.randomize:
            raise QuantSpecError(f"{where} lacks {key}.weight, the matrix of its {scheme.type} transform "
                                 f"{scheme_name!r}; the checkpoint is incomplete")
        if size & (size - 1):
            raise QuantSpecError(f"{where}: transform {scheme_name!r} on {name} is a Sylvester Hadamard of size "
                                 f"{size}, which is not a power of two; the checkpoint and its config disagree")
        w = sylvester(size)
    if tuple(w.shape) != (size, size):
        raise QuantSpecError(f"{where}: {key}.weight has shape {tuple(w.shape)} where transform {scheme_name!r} "
                             f"on {name} needs ({size}, {size}); the checkpoint and its config disagree")
    w = w.double()
    if perm is None and scheme.type == "hadamard" and bool(torch.equal(w, sylvester(size).double())):
        return None  # symmetric: `inverse` changes nothing
    if perm is not None:
        p = perm.long()
        w = w[p][:, p]
    return (w.T if args.inverse else w).contiguous()


def online_transforms(tc: Mapping | None, net: nn.Module, tensors: Mapping[str, torch.Tensor], where: str
                      ) -> tuple[dict[str, dict[str, OnlineTransform]], set[str]]:
    """The run-time transforms of a checked `transform_config` (`read_transform_config`) on
    `net`'s Linears (its modules named as the checkpoint's): ({Linear: {"input" | "output":
    transform}}, the checkpoint tensors they read). Refused in one line: a run-time transform
    matching an embedding, two at one place of one Linear, a size that does not divide the
    Linear's, a matrix of the wrong shape or missing."""
    out: dict[str, dict[str, OnlineTransform]] = {}
    used: set[str] = set()
    if not tc:
        return out, used
    from compressed_tensors.transform import TransformConfig
    from compressed_tensors.utils import is_match

    parsed = TransformConfig.model_validate(tc)
    for scheme_name, scheme in parsed.config_groups.items():
        for a in scheme.apply:
            loc = _location(a)
            if loc not in ONLINE:
                continue
            for name, mod in net.named_modules():
                if not isinstance(mod, (nn.Linear, nn.Embedding)) or _EXPERT.search(name) \
                        or not is_match(name, mod, a.targets, a.ignore):
                    continue
                if isinstance(mod, nn.Embedding):
                    raise QuantSpecError(f"{where}.transform_config[{scheme_name!r}] transforms the embedding "
                                         f"{name} at run time, which no engine runs; re-export it without")
                full = mod.in_features if loc == "input" else mod.out_features
                size = scheme.head_dim or full
                if full % size:
                    raise QuantSpecError(f"{where}.transform_config[{scheme_name!r}]: head_dim {size} does not divide "
                                         f"{name}'s {loc} size {full}; the checkpoint and its config disagree")
                if loc in out.get(name, {}):
                    raise QuantSpecError(f"{where}.transform_config: {name} has two {loc} transforms "
                                         f"({out[name][loc].scheme!r}, {scheme_name!r}); vLLM runs one")
                m = _matrix(scheme_name, scheme, a, name, size, tensors, where, used)
                out.setdefault(name, {})[loc] = OnlineTransform(scheme_name, loc, size, m)
    return out, used
