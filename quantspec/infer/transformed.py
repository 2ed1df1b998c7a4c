"""`TransformedLinear`: a Linear run between the run-time transforms of its checkpoint's
`transform_config` (`quant.transforms.online_transforms`: QuIP's `v` on its input, `u` on its
output), as vLLM's `CompressedTensorsLinearTransformMethod` runs them:
`y = out(inner(in(x)))`, where `inner` is the Linear as stored (a `QuantLinear`, or a float Linear
that a backend may rewrite), whose weights hold the fused halves of those transforms.

The q/k/v (gate/up) Linears of one input stack into one (`stack_transformed`, used by
`infer.fuse`) where they share the input transform and their output transforms are the same
block transform, whose blocks each member's rows fill whole: the stacked output is then transformed
block by block exactly as each member's was.
"""

from __future__ import annotations

import torch
from torch import nn

from quantspec.model_zoo.llama import project
from quantspec.quant.transforms import OnlineTransform

__all__ = ["TransformedLinear", "stack_transformed", "wrap_transformed"]


def _same(a: OnlineTransform | None, b: OnlineTransform | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    if a.size != b.size or (a.matrix is None) != (b.matrix is None):
        return False
    return a.matrix is None or bool(torch.equal(a.matrix, b.matrix))


class TransformedLinear(nn.Module):
    """`inner` between an input transform and an output transform (either may be None)."""

    takes_row_invariant = True  # model_zoo.llama: passed on to `inner`

    def __init__(self, inner: nn.Module, input_t: OnlineTransform | None, output_t: OnlineTransform | None):
        super().__init__()
        self.inner, self.input_t, self.output_t = inner, input_t, output_t
        self.in_features, self.out_features = inner.in_features, inner.out_features

    def forward(self, x: torch.Tensor, row_invariant: bool = False) -> torch.Tensor:
        if self.input_t is not None:
            x = self.input_t(x)
        y = project(self.inner, x, row_invariant)
        return y if self.output_t is None else self.output_t(y)

    def extra_repr(self) -> str:
        return ", ".join(t.describe() for t in (self.input_t, self.output_t) if t is not None)


def wrap_transformed(net: nn.Module, transforms: dict[str, dict[str, OnlineTransform]]) -> int:
    """Wrap each Linear of `net` named in `transforms` ({name: {"input" | "output": transform}}) in a
    `TransformedLinear`, in place → how many."""
    for name, t in transforms.items():
        net.set_submodule(name, TransformedLinear(net.get_submodule(name), t.get("input"), t.get("output")))
    return len(transforms)


def stack_transformed(mods: list[TransformedLinear], stack) -> TransformedLinear | None:
    """One `TransformedLinear` computing `cat([m(x) for m in mods], -1)`, its inner Linears stacked
    by `stack` (`infer.fuse.stack_linears`), or None when they cannot be stacked."""
    first = mods[0]
    out_t = first.output_t
    if any(not _same(m.input_t, first.input_t) or not _same(m.output_t, out_t) for m in mods[1:]):
        return None
    if out_t is not None and any(m.out_features % out_t.size for m in mods):
        return None  # the stacked rows are transformed block by block: each member's fill whole blocks
    inner = stack([m.inner for m in mods])
    return None if inner is None else TransformedLinear(inner, first.input_t, out_t)
