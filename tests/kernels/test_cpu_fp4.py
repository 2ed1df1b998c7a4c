"""quantspec's CPU FP4 GEMM (`packed_fp4_gemm`: E2M1 nibbles in column blocks, a scale per group)
against a float64 product of E2M1's values, the layout against its inverse, and the row invariance
every CPU kernel keeps."""

import pytest
import torch

from quantspec.kernels import cpu as cg
from quantspec.quant.fp4 import e2m1_nibbles

needs_kernels = pytest.mark.skipif(cg.cpu_kernels() is None,
                                   reason="quantspec's CPU kernels are not built here")
# nibble n's value, written out: magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6, bit 3 the sign
VALUES = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def _case(N, K, group, seed):
    g = torch.Generator().manual_seed(seed)
    nib = torch.randint(0, 16, (N, K), dtype=torch.uint8, generator=g)
    scale = torch.rand(N, K // group, generator=g) * 0.05 + 1e-3
    w = torch.tensor(VALUES, dtype=torch.float64)[nib.long()] * scale.double().repeat_interleave(group, 1)
    return nib, scale, w


def test_fp4_packing_round_trips():
    nib, scale, _ = _case(37, 96, 32, 0)
    p, sb = cg.pack_fp4_blocks(nib, scale)
    assert p.shape == (2, 96, 16) and p.dtype == torch.uint8 and sb.shape == (2, 3, 32)
    assert torch.equal(cg.unpack_fp4_blocks(p, 37), nib)
    assert int(p[0, 5, 2]) == int(nib[2, 5]) | (int(nib[18, 5]) << 4)
    assert int(p[1, 5, 2]) == int(nib[34, 5])  # column 50 is padding: nibble 0, the value 0
    assert float(sb[1, 2, 4]) == float(scale[36, 2])
    codes = torch.tensor([VALUES], dtype=torch.float32).to(torch.float8_e4m3fn)
    assert e2m1_nibbles(codes).tolist() == [list(range(16))]  # -0.0 keeps its sign nibble


@needs_kernels
@pytest.mark.parametrize("K,group", [(64, 16), (96, 32), (48, 16), (576, 32), (40, 8)])
@pytest.mark.parametrize("M", [1, 3, 11, 19])
@pytest.mark.parametrize("xdtype", [torch.float32, torch.bfloat16])
def test_fp4_gemm_matches_e2m1_values(K, group, M, xdtype):
    N = 45
    nib, scale, w = _case(N, K, group, K + M)
    g = torch.Generator().manual_seed(M)
    x = torch.randn(M, K, generator=g).to(xdtype)
    bias = torch.randn(N, generator=g)
    want = (x.double() @ w.t() + bias.double()).to(xdtype)
    p, sb = cg.pack_fp4_blocks(nib, scale)
    for op in (cg.packed_fp4_gemm, cg.packed_fp4_gemm_ref):
        for pairs in (True, False):
            y = op(x, p, sb, group, N, bias, pairs=pairs)
            assert y.dtype == xdtype and y.shape == (M, N)
            tol = 1e-5 if xdtype == torch.float32 else 1e-2
            torch.testing.assert_close(y.float(), want.float(), rtol=tol, atol=tol * float(want.float().abs().max()))


@needs_kernels
@pytest.mark.parametrize("xdtype", [torch.float32, torch.bfloat16])
def test_every_nibble_decodes_exactly(xdtype):
    """One-hot rows of x read single weights: every nibble's value times its scale, exactly (the
    pair path for bf16 x, the fp32 chain for fp32)."""
    K, N, group = 32, 32, 16
    nib = torch.arange(16, dtype=torch.uint8).repeat(N, 2)  # column k holds nibble k % 16
    scale = torch.full((N, 2), 0.25)
    scale[:, 1] = 2.0 ** -3
    p, sb = cg.pack_fp4_blocks(nib, scale)
    y = cg.packed_fp4_gemm(torch.eye(K).to(xdtype), p, sb, group, N)
    want = [VALUES[k % 16] * (0.25 if k < 16 else 0.125) for k in range(K)]
    assert y[:, 0].float().tolist() == want


@needs_kernels
def test_fp4_rows_are_bitwise_invariant_to_the_batch():
    nib, scale, _ = _case(50, 576, 16, 3)
    p, sb = cg.pack_fp4_blocks(nib, scale)
    x = torch.randn(11, 576, generator=torch.Generator().manual_seed(1))
    for xd in (x, x.bfloat16()):
        full = cg.packed_fp4_gemm(xd, p, sb, 16, 50)
        for i in range(xd.shape[0]):
            assert torch.equal(cg.packed_fp4_gemm(xd[i:i + 1].contiguous(), p, sb, 16, 50), full[i:i + 1])
        assert torch.equal(cg.packed_fp4_gemm(torch.cat([xd] * 3), p, sb, 16, 50), torch.cat([full] * 3))


@needs_kernels
def test_fp4_gemm_refuses_bad_input():
    nib, scale, _ = _case(8, 64, 16, 0)
    p, sb = cg.pack_fp4_blocks(nib, scale)
    with pytest.raises(RuntimeError, match="group 24 must divide K=64"):
        cg.packed_fp4_gemm(torch.randn(2, 64), p, sb, 24, 8)
    with pytest.raises(RuntimeError, match=r"scale must be \[NB, G, 32\]"):
        cg.packed_fp4_gemm(torch.randn(2, 64), p, sb, 32, 8)
    with pytest.raises(RuntimeError, match=r"uint8 \[NB, K, 16\]"):
        cg.packed_fp4_gemm(torch.randn(2, 64), p.view(torch.int8), sb, 16, 8)
