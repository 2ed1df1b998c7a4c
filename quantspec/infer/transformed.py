"""`TransformedLinear`: a Linear run between the run-time transforms of its checkpoint's
`transform_config` (`quant.transforms.online_transforms`: QuIP's `v` on its input, `u` on its
output), as vLLM's `CompressedTensorsLinearTransformMethod` runs them:
`y = out(inner(in(x)))`, where `inner` is the Linear as stored (a `QuantLinear`, or a float Linear),
whose weights hold the fused halves of those transforms.

Each transform is a float Linear over one block (`size` inputs and outputs, its ±1 matrix as the
weight, exact in any dtype) applied to every block of the value's rows, then scaled by 1/√size: the
backend prepares it as it prepares every float Linear (on CPU quantspec's packed kernels, whose
numbers for a row do not depend on the other rows, so speculation stays lossless).

The q/k/v (gate/up) Linears of one input stack into one (`stack_transformed`, used by
`infer.fuse`) where they share the input transform and their output transforms are the same block
transform, whose blocks each member's rows fill whole: the stacked output is then transformed
block by block exactly as each member's was.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from quantspec.model_zoo.llama import project
from quantspec.quant.transforms import OnlineTransform

__all__ = ["TransformedLinear", "stack_transformed", "wrap_transformed"]


def _block_linear(t: OnlineTransform, dtype: torch.dtype, device) -> nn.Linear:
    """The float Linear `x ↦ x @ W` over one block (W = `t.unnormalized()`)."""
    lin = nn.Linear(t.size, t.size, bias=False, device="meta", dtype=dtype)
    lin.weight = nn.Parameter(t.unnormalized().T.to(device=device, dtype=dtype).contiguous(), requires_grad=False)
    return lin


class TransformedLinear(nn.Module):
    """`inner` between an input transform and an output transform (either may be None)."""

    takes_row_invariant = True  # model_zoo.llama: passed on to `inner` and the transforms' Linears

    def __init__(self, inner: nn.Module, input_t: OnlineTransform | None, output_t: OnlineTransform | None, *,
                 dtype: torch.dtype, device, blocks: tuple[nn.Module | None, nn.Module | None] | None = None):
        super().__init__()
        self.inner, self.input_t, self.output_t = inner, input_t, output_t
        self.in_features, self.out_features = inner.in_features, inner.out_features
        given = blocks or (None, None)
        self.input_block = given[0] if given[0] is not None or input_t is None else \
            _block_linear(input_t, dtype, device)
        self.output_block = given[1] if given[1] is not None or output_t is None else \
            _block_linear(output_t, dtype, device)

    @staticmethod
    def _apply(block: nn.Module, t: OnlineTransform, x: torch.Tensor, row_invariant: bool) -> torch.Tensor:
        y = project(block, x.reshape(-1, t.size), row_invariant)
        return (y * (1.0 / math.sqrt(t.size))).view(x.shape)

    def forward(self, x: torch.Tensor, row_invariant: bool = False) -> torch.Tensor:
        if self.input_t is not None:
            x = self._apply(self.input_block, self.input_t, x, row_invariant)
        y = project(self.inner, x, row_invariant)
        return y if self.output_t is None else self._apply(self.output_block, self.output_t, y, row_invariant)

    def extra_repr(self) -> str:
        return ", ".join(t.describe() for t in (self.input_t, self.output_t) if t is not None)


def wrap_transformed(net: nn.Module, transforms: dict[str, dict[str, OnlineTransform]], *, dtype: torch.dtype,
                     device) -> int:
    """Wrap each Linear of `net` named in `transforms` ({name: {"input" | "output": transform}}) in a
    `TransformedLinear` (its transforms' Linears in `dtype` on `device`), in place → how many."""
    for name, t in transforms.items():
        net.set_submodule(name, TransformedLinear(net.get_submodule(name), t.get("input"), t.get("output"),
                                                  dtype=dtype, device=device))
    return len(transforms)


def _same(a: OnlineTransform | None, b: OnlineTransform | None) -> bool:
    return a is b is None or (a is not None and a.same_as(b))


def stack_transformed(mods: list[TransformedLinear], stack) -> TransformedLinear | None:
    """One `TransformedLinear` computing `cat([m(x) for m in mods], -1)`, its inner Linears stacked
    by `stack` (`infer.fuse.stack_linears`) and the first member's transforms, or None when they
    cannot be stacked."""
    first = mods[0]
    out_t = first.output_t
    if any(not _same(m.input_t, first.input_t) or not _same(m.output_t, out_t) for m in mods[1:]):
        return None
    if out_t is not None and any(m.out_features % out_t.size for m in mods):
        return None  # the stacked rows are transformed block by block: each member's fill whole blocks
    inner = stack([m.inner for m in mods])
    return None if inner is None else TransformedLinear(inner, first.input_t, out_t, dtype=None, device=None,
                                                        blocks=(first.input_block, first.output_block))
