"""The CUDA backend: the Triton linears of quantized layers (`weights.py`: `CudaWeight`, built by
`QuantLinear`, and `triton_linear`), entered through `prepare`.

On CUDA the generic path runs everything else: float linears are torch's (cuBLAS), the paged
attention is torch's SDPA (`infer/kv_cache.PagedAttention`), the head gives full logits; so
`prepare` only stacks a model's projections (`infer/fuse.py`): the quantized layers are laid out
for CUDA when they are built.
"""

from __future__ import annotations

import torch
from torch import nn

from quantspec.infer.backend import Runtime
from quantspec.infer.dispatch import DispatchPolicy
from quantspec.infer.fuse import fuse_projections
from quantspec.model_zoo.mtp import MTPModule

__all__ = ["default_runtime", "prepare"]


def default_runtime(device: torch.device) -> Runtime:
    """CUDA's runtime for a model it did not prepare: the generic path."""
    return Runtime(device=device)


def prepare(model: nn.Module, device: torch.device, policy: DispatchPolicy, *, fuse: bool = True) -> Runtime:
    """`model` as loaded on CUDA → its `Runtime`. `fuse`: a model's q/k/v and gate/up stacked
    into one projection each (an MTP module keeps the projections it was loaded with)."""
    if fuse and not isinstance(model, MTPModule):
        fuse_projections(model)
    return default_runtime(device)
