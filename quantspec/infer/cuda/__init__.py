"""The CUDA backend: the Triton linears of quantized layers (`weights.py`: `CudaWeight`, built by
`QuantLinear`, and `triton_linear`) and the Triton paged attention (`attention.py`), entered
through `prepare`.

On CUDA the generic path runs everything else: float linears are torch's (cuBLAS) and the head
gives full logits; `prepare` stacks a model's projections (`infer/fuse.py`) and hands the paged
caches the Triton attention (torch's SDPA in `infer/kv_cache.PagedAttention` attends where the
kernel does not take a cache's head size): the quantized layers are laid out for CUDA when they
are built.
"""

from __future__ import annotations

import torch
from torch import nn

from quantspec.infer.backend import Runtime
from quantspec.infer.cuda.attention import TritonAttention
from quantspec.infer.dispatch import DispatchPolicy
from quantspec.infer.fuse import fuse_projections
from quantspec.model_zoo.mtp import MTPModule

__all__ = ["default_runtime", "prepare"]


def default_runtime(device: torch.device, policy: DispatchPolicy | None = None) -> Runtime:
    """CUDA's runtime for a model it did not prepare: the generic path with the Triton paged
    attention."""
    return Runtime(device=device, attention=TritonAttention.for_cache)


def prepare(model: nn.Module, device: torch.device, policy: DispatchPolicy, *, fuse: bool = True) -> Runtime:
    """`model` as loaded on CUDA → its `Runtime`. `fuse`: a model's q/k/v and gate/up stacked
    into one projection each (an MTP module keeps the projections it was loaded with)."""
    if fuse and not isinstance(model, MTPModule):
        fuse_projections(model)
    return default_runtime(device, policy)
