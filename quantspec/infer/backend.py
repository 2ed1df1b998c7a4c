"""The one door to the device backends: `prepare(model, device)` → a `Runtime`.

A backend is a room of its own (`infer/cpu/`, `infer/cuda/`): it rewrites a loaded model for its
device (layouts of the weights, kernel versions of the small ops) and hands back, in a `Runtime`,
what replaces parts of the generic path. The engine, the proposers and evaluation receive the
`Runtime` explicitly and plug each part in at one place:

- `stack`: runs the whole decoder stack in one call (`Transformer.forward(stack=...)`);
- `greedy`: exact greedy ids from pre-norm hidden rows, instead of the logits' argmax;
- `attention`: builds a paged cache's attention kernel (`PagedKVCache(kernel=...)`);
- `draft_head` / `draft_step`: an MTP module's draft-vocabulary head and its whole draft step;
- `int8_head`: turns a float head into an int8 drafting head (a draft model's, `spec/draft.py`);
- `ngram`: the n-gram matchers' compiled twins (`spec/ngram.native_matchers`);
- `packed_rows`: every linear streams its weights once for all rows of a step (the back-off's
  cost model, `spec/proposers.SpecCost`).
Each is None (False) where the backend has nothing better: the generic path runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from quantspec.infer.dispatch import DispatchPolicy

__all__ = ["Runtime", "default_runtime", "prepare", "prepare_head", "prepare_weight", "triton_linear"]


@dataclass(frozen=True)
class Runtime:
    """What a backend prepared for one model (module docstring)."""

    device: torch.device
    stack: Callable | None = None
    greedy: Callable | None = None
    attention: Callable | None = None
    draft_head: nn.Module | None = None
    draft_step: Callable | None = None
    int8_head: Callable | None = None
    ngram: tuple | None = None
    packed_rows: bool = False


def _room(device: torch.device):
    if device.type == "cuda":
        from quantspec.infer import cuda as room
    else:
        from quantspec.infer import cpu as room
    return room


def prepare(model: nn.Module, device: torch.device | str, *, policy: DispatchPolicy | None = None,
            fuse: bool = True) -> Runtime:
    """Rewrite `model` (a `model_zoo.llama.Transformer` or a bound `model_zoo.mtp.MTPModule`) in
    place for `device` and return what its backend prepared. `fuse`: let the backend stack q/k/v
    and gate/up into one projection each (`infer/fuse.py`); `policy`: the dispatch policy it was
    loaded with."""
    device = torch.device(device)
    return _room(device).prepare(model, device, policy or DispatchPolicy(), fuse=fuse)


def prepare_head(head: nn.Module, device: torch.device | str) -> nn.Module:
    """Rewrite a draft head (an EAGLE-3 head, Medusa heads, the draft-vocabulary rows a proposer
    gathered) in place for `device`, as `prepare` rewrites a model's layers: its float linears in
    the backend's layouts, its norms, rotary and activations on the backend's kernels. → `head`."""
    device = torch.device(device)
    _room(device).prepare_head(head, device)
    return head


def default_runtime(device: torch.device | str) -> Runtime:
    """The runtime of a model that was not prepared: the device backend's attention kernel only."""
    device = torch.device(device)
    return _room(device).default_runtime(device)


def prepare_weight(layer, kind, q: torch.Tensor, bias: torch.Tensor | None, device: torch.device):
    """The `PreparedWeight` of a `QuantLinear` being built on `device`."""
    if device.type == "cuda":
        from quantspec.infer.cuda.weights import CudaWeight as Weight
    else:
        from quantspec.infer.cpu.weights import CpuWeight as Weight
    return Weight(layer, kind, q, bias, device)


def triton_linear(layer, x: torch.Tensor, path) -> torch.Tensor:
    """A `QuantLinear`'s Triton path (the CUDA backend's kernels) on x [M, K] → [M, N]."""
    from quantspec.infer.cuda.weights import triton_linear as run

    return run(layer, x, path)
