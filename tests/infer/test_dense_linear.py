"""The CPU skinny-M float linear against torch's own linear."""

import pytest
import torch
from torch import nn

from quantspec.infer.dense_linear import MAX_ROWS, SkinnyLinear, use_skinny_linears


@pytest.mark.parametrize("rows", [1, 2, 3, MAX_ROWS, MAX_ROWS + 1, 17])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_linear(rows, bias):
    torch.manual_seed(rows)
    ref = nn.Linear(37, 53, bias=bias)
    x = torch.randn(rows, 37)
    want = ref(x)
    use_skinny_linears(ref)
    assert type(ref) is SkinnyLinear
    torch.testing.assert_close(ref(x), want, atol=1e-5, rtol=1e-5)
    # 3-D input and a non-contiguous one
    x3 = torch.randn(1, rows, 37)
    torch.testing.assert_close(ref(x3), torch.nn.functional.linear(x3, ref.weight, ref.bias), atol=1e-5, rtol=1e-5)
    xt = torch.randn(37, rows).t()
    torch.testing.assert_close(ref(xt), torch.nn.functional.linear(xt, ref.weight, ref.bias), atol=1e-5, rtol=1e-5)
    assert ref(x).is_contiguous()


def test_only_fp32_cpu_linears_are_swapped():
    m = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4).to(torch.bfloat16))
    assert use_skinny_linears(m) == 1
    assert type(m[0]) is SkinnyLinear and type(m[1]) is nn.Linear
