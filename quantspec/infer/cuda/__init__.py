"""The CUDA backend: the Triton linears of quantized layers (`weights.py`: `CudaWeight`, built by
`QuantLinear`, and `triton_linear`), the Triton paged attention (`attention.py`), the CUDA
graphs of decode and verification steps (`graphs.py`) and the layers' small ops fused
(`layers.py`), entered through `prepare`.

On CUDA the generic path runs everything else: float linears are torch's (cuBLAS) and the head
gives full logits; `prepare` stacks a model's projections (`infer/fuse.py`), hands its decode
and verification steps to CUDA graphs of its stack, and hands the paged caches the Triton
attention (torch's SDPA in `infer/kv_cache.PagedAttention` attends where the kernel does not take
a cache's head size): the quantized layers are laid out for CUDA when they are built.
"""

from __future__ import annotations

import functools
import os

import torch
from torch import nn

from quantspec.infer.backend import Runtime
from quantspec.infer.cuda.attention import TritonAttention
from quantspec.infer.cuda.graphs import DecodeGraphs
from quantspec.infer.cuda.layers import fusable
from quantspec.infer.dispatch import DispatchPolicy
from quantspec.infer.fuse import fuse_projections
from quantspec.model_zoo.mtp import MTPModule

__all__ = ["GRAPHS_SWITCH", "default_runtime", "prepare", "prepare_head"]

GRAPHS_SWITCH = "QUANTSPEC_CUDA_GRAPHS"  # "0": every step launches its kernels from Python (eager)


def default_runtime(device: torch.device, policy: DispatchPolicy | None = None) -> Runtime:
    """CUDA's runtime for a model it did not prepare: the generic path with the Triton paged
    attention."""
    return Runtime(device=device, attention=_attention(policy))


def _attention(policy: DispatchPolicy | None):
    """The builder of a cache's `TritonAttention` under `policy` (`Runtime.attention`)."""
    return functools.partial(TritonAttention.for_cache, split_kv=policy is not None and policy.cuda_split_kv)


def prepare(model: nn.Module, device: torch.device, policy: DispatchPolicy, *, fuse: bool = True) -> Runtime:
    """`model` as loaded on CUDA → its `Runtime`. `fuse`: a model's q/k/v and gate/up stacked
    into one projection each (an MTP module keeps the projections it was loaded with). With
    `policy.cuda_graphs` (and QUANTSPEC_CUDA_GRAPHS not "0"), a model's decode and
    verification steps replay CUDA graphs of its stack (`graphs.py`); with
    `policy.cuda_fused_ops` its layers run their small ops as fused kernels (`layers.py`); with
    `policy.cuda_pdl` the stack's kernels are programmatic dependent launches; with
    `policy.cuda_split_kv` the attention splits long contexts across programs."""
    if isinstance(model, MTPModule):
        return default_runtime(device, policy)
    if fuse:
        fuse_projections(model)
    graphs = policy.cuda_graphs and os.environ.get(GRAPHS_SWITCH, "1") != "0"
    layers = model.model.layers
    fused = policy.cuda_fused_ops and fusable(layers, model.model.norm.weight.dtype)
    stack = DecodeGraphs(layers, graphs=graphs, fused=fused, pdl=policy.cuda_pdl) if graphs or fused else None
    return Runtime(device=device, attention=_attention(policy), stack=stack)


def prepare_head(head: nn.Module, device: torch.device) -> nn.Module:
    """A draft head on CUDA runs as loaded (its quantized linears on the Triton path)."""
    return head
