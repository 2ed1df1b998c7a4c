"""The CUDA backend: the Triton linears of quantized layers (`weights.py`: `CudaWeight`, built by
`QuantLinear`, and `triton_linear`), entered through `prepare`.

On CUDA the generic path runs everything else: float linears are torch's (cuBLAS), the paged
attention is torch's SDPA (`infer/kv_cache.PagedAttention`), the head gives full logits; so
`prepare` rewrites nothing beyond the quantized layers their construction already laid out.
"""

from __future__ import annotations

import torch
from torch import nn

from quantspec.infer.backend import Runtime
from quantspec.infer.dispatch import DispatchPolicy

__all__ = ["default_runtime", "prepare"]


def default_runtime(device: torch.device) -> Runtime:
    """CUDA's runtime for a model it did not prepare: the generic path."""
    return Runtime(device=device)


def prepare(model: nn.Module, device: torch.device, policy: DispatchPolicy) -> Runtime:
    """`model` as loaded on CUDA (fused already, `infer.backend.prepare`) → its `Runtime`."""
    return default_runtime(device)
