"""W4A16 Triton kernel vs its torch reference (interpreter on CPU), and the reference vs
compressed-tensors' own unpacking (an independent implementation of the layout)."""

import pytest
import torch

from quantspec.errors import QuantSpecError
from quantspec.kernels import w4a16 as w4a16_module
from quantspec.kernels._common import MAX_SPLIT_K, SM_TARGET
from quantspec.kernels.w4a16 import (
    W4A16Config,
    quartered_config,
    small_m_split,
    w4a16_default_config,
    w4a16_dequantize,
    w4a16_dequantize_ref,
    w4a16_linear,
    w4a16_linear_ref,
)
from quantspec.quant.packing import pack_int4, unpack_int4

N = 37  # not a multiple of any BLOCK_N


def _make(M, K, g, dtype, asym, bias, seed=0, zero_dtype=torch.int8):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(-8, 8, (N, K), dtype=torch.int8, generator=gen)
    scale = (torch.rand(N, K // g, generator=gen) * 0.05 + 0.01).to(dtype)
    if zero_dtype.is_floating_point:  # float zero points (a float zp_dtype): any value in [-8, 7]
        zero = (torch.rand(N, K // g, generator=gen) * 15 - 8).to(zero_dtype) if asym else None
    else:
        zero = torch.randint(-8, 8, (N, K // g), dtype=zero_dtype, generator=gen) if asym else None
    b = torch.randn(N, generator=gen).to(dtype) if bias else None
    x = torch.randn(M, K, generator=gen).to(dtype)
    return x, pack_int4(q), scale, g, zero, b, q


# (K, group_size): K not a multiple of BLOCK_K=16; groups smaller / not aligned / aligned to it
SHAPES = [(88, 8), (88, 44), (96, 32)]


@pytest.mark.parametrize("M", [1, 3, 17, 64])
@pytest.mark.parametrize("K,g", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_kernel_matches_reference(M, K, g, dtype):
    asym = (M + K) % 2 == 0  # alternate sym/asym and bias over the grid to keep the run short
    x, wp, s, g, z, b, _ = _make(M, K, g, dtype, asym=asym, bias=not asym, seed=M * K)
    y = w4a16_linear(x, wp, s, g, z, b)
    r = w4a16_linear_ref(x, wp, s, g, z, b)
    assert y.dtype == dtype and y.shape == (M, N)
    if dtype == torch.float32:
        torch.testing.assert_close(y, r, rtol=1e-5, atol=1e-5)
    else:  # fp16 weights/activations in the dot vs an fp32 reference
        torch.testing.assert_close(y.float(), r.float(), rtol=5e-3, atol=5e-3)


@pytest.mark.parametrize("M", [1, 3, 17])
@pytest.mark.parametrize("K,g", SHAPES)
@pytest.mark.parametrize("zero_dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_float_zero_point_variant_matches_reference(M, K, g, zero_dtype):
    """The ZERO_FLOAT variant: zero points loaded as floats, w = (q - zp) * scale in fp32."""
    x, wp, s, g, z, b, q = _make(M, K, g, torch.float32, asym=True, bias=M == 3, seed=M + K,
                                 zero_dtype=zero_dtype)
    assert not torch.equal(z.float(), z.float().round())
    y = w4a16_linear(x, wp, s, g, z, b)
    r = w4a16_linear_ref(x, wp, s, g, z, b)
    torch.testing.assert_close(y, r, rtol=1e-5, atol=1e-5)
    w = (q.float() - z.float().repeat_interleave(g, 1)) * s.repeat_interleave(g, 1)
    torch.testing.assert_close(r, x @ w.t() + (0 if b is None else b), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cfg", [W4A16Config(1, 8, 8, 3), W4A16Config(16, 32, 16, 2),
                                 W4A16Config(32, 16, 32, 1), W4A16Config(16, 32, 16, 2, swap_ab=True),
                                 W4A16Config(16, 16, 8, 1, swap_ab=True)])
@pytest.mark.parametrize("zero_dtype", [torch.int8, torch.float16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_split_k_and_tile_configs(cfg, zero_dtype, dtype):
    """Every launch shape (GEMV, tiles, swapped tiles; group-aligned k tiles take the scale after
    the dot) gives the reference."""
    x, wp, s, g, z, b, _ = _make(17, 88, 8, dtype, asym=True, bias=True, seed=5, zero_dtype=zero_dtype)
    if cfg.block_m >= 16 and cfg.block_k < 16 and torch.cuda.is_available():  # a GPU's MMA: k tiles >= 16
        with pytest.raises(QuantSpecError, match="block_k=8 must be at least 16"):
            w4a16_linear(x, wp, s, g, z, b, config=cfg)
        return
    y = w4a16_linear(x, wp, s, g, z, b, config=cfg)
    tol = 1e-5 if dtype == torch.float32 else 5e-3
    torch.testing.assert_close(y.float(), w4a16_linear_ref(x, wp, s, g, z, b).float(), rtol=tol, atol=tol)


def test_integer_zero_points_across_groups_go_to_a_gpu_launch_as_floats(monkeypatch):
    """k tiles across groups on a GPU take integer zero points as half floats: the same numbers
    as the integer launch (under the interpreter, with the GPU's branch forced)."""
    x, wp, s, g, z, b, _ = _make(17, 88, 8, torch.float16, asym=True, bias=True, seed=5)
    cfg = W4A16Config(16, 32, 16, 2, swap_ab=True)
    ints = w4a16_linear(x, wp, s, g, z, b, config=cfg)
    seen = []
    real = w4a16_module._w4a16_kernel

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kw):
                seen.append(args[3].dtype)
                return real[grid](*args, **kw)
            return launch

    monkeypatch.setattr(w4a16_module, "gpu_launch", lambda device: True)
    monkeypatch.setattr(w4a16_module, "_w4a16_kernel", Spy())
    assert torch.equal(w4a16_linear(x, wp, s, g, z, b, config=cfg), ints)
    assert seen == [torch.float16]


def test_gpu_float_zero_points_take_the_unpacking_launch():
    """Float zero points with a group of 128: the GPU's launch for up to 16 rows unpacks (nibble
    dots need integer zero points) and computes the reference under the interpreter."""
    x, wp, s, g, z, b, _ = _make(3, 256, 128, torch.float32, asym=True, bias=True, seed=31,
                                 zero_dtype=torch.float32)
    cfg = w4a16_default_config(3, N, 256, 128, on_gpu=True, float_zero=True)
    assert not cfg.nibble_dots and w4a16_default_config(3, N, 256, 128, on_gpu=True).nibble_dots
    torch.testing.assert_close(w4a16_linear(x, wp, s, g, z, b, config=cfg), w4a16_linear_ref(x, wp, s, g, z, b),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("K,N_,block_n", [(4096, 4096, 128), (4096, 14336, 128), (4096, 14336, 64),
                                          (14336, 4096, 64), (4096, 28672, 128), (1024, 37, 128)])
def test_small_m_split_is_the_deepest_within_the_programs_target(K, N_, block_n):
    """A power of two, at least two k tiles per split, at most `SM_TARGET` programs, and the
    deepest such split up to `MAX_SPLIT_K`."""
    split, tiles = small_m_split(N_, K, block_n, 128), -(-N_ // block_n)
    assert split & (split - 1) == 0 and split <= MAX_SPLIT_K
    assert split == 1 or (K // 128 >= 2 * split and tiles * split <= SM_TARGET)
    deeper = 2 * split
    assert deeper > MAX_SPLIT_K or K // 128 < 2 * deeper or tiles * deeper > SM_TARGET


def test_gpu_small_m_launch_splits_deepest():
    """The GPU's launch for up to 16 rows with nibble dots takes the deepest split K and the
    programs target allow, one shape for every M ≤ 16, and computes the reference under the
    interpreter."""
    x, wp, s, g, z, b, _ = _make(16, 2048, 128, torch.float32, asym=False, bias=False, seed=12)
    cfg = w4a16_default_config(16, N, 2048, 128, on_gpu=True)
    assert cfg == w4a16_default_config(1, N, 2048, 128, on_gpu=True)
    assert cfg.nibble_dots and cfg.split_k == 8
    y = w4a16_linear(x, wp, s, g, config=cfg)
    torch.testing.assert_close(y, w4a16_linear_ref(x, wp, s, g), rtol=1e-5, atol=1e-5)
    assert torch.equal(w4a16_linear(x[:1], wp, s, g, config=cfg), y[:1])


@pytest.mark.parametrize("cfg", [W4A16Config(16, 16, 64, 2, swap_ab=True, fold_scale=True),
                                 W4A16Config(32, 16, 64, 1, fold_scale=True),
                                 W4A16Config(16, 16, 32, 3, swap_ab=True, fold_scale=True),
                                 W4A16Config(1, 16, 64, 2, fold_scale=True)])
@pytest.mark.parametrize("zero_dtype", [None, torch.int8, torch.float16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fold_scale_launch(cfg, zero_dtype, dtype):
    """`fold_scale`: group-aligned k tiles dequantize with their scale before the MMA, which
    accumulates across tiles (swapped and not, split-K, one-row programs); the reference's
    numbers, within one half-precision rounding of each weight."""
    x, wp, s, g, z, b, _ = _make(19, 384, 128, dtype, asym=zero_dtype is not None, bias=True, seed=21,
                                 zero_dtype=zero_dtype or torch.int8)
    y = w4a16_linear(x, wp, s, g, z, b, config=cfg)
    r = w4a16_linear_ref(x, wp, s, g, z, b)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(y.float(), r.float(), rtol=tol, atol=tol)


def test_gpu_large_m_launch_is_swapped_and_folds_the_scale():
    """More than 16 rows on a GPU: swapped tiles with the scale folded in (the dequantized weight
    is the MMA's register operand); under the interpreter they compute the reference."""
    for M in (17, 64, 65, 300):
        cfg = w4a16_default_config(M, N, 256, 128, on_gpu=True)
        assert cfg.swap_ab and cfg.fold_scale and not cfg.nibble_dots
    x, wp, s, g, z, b, _ = _make(300, 256, 128, torch.float32, asym=True, bias=True, seed=13)
    y = w4a16_linear(x, wp, s, g, z, b, config=w4a16_default_config(300, N, 256, 128, on_gpu=True))
    torch.testing.assert_close(y, w4a16_linear_ref(x, wp, s, g, z, b), rtol=1e-5, atol=1e-5)


def test_gpu_wide_m_launch_fills_the_sms():
    """Above 64 rows, where the row and column tiles alone are too few for an H100's 132 SMs,
    the launch splits K (to about two programs per SM, the partial sums at most twice the
    weight's bytes); where the tiles fill the GPU it does not. A split wide launch computes the
    reference under the interpreter."""
    for M, (K_, N_) in ((256, (4096, 4096)), (128, (14336, 4096)), (256, (4096, 6144))):
        for cfg in (w4a16_default_config(M, N_, K_, 128, on_gpu=True), quartered_config(M, N_, K_, True)):
            programs = -(-M // cfg.block_m) * -(-N_ // cfg.block_n) * cfg.split_k
            assert cfg.split_k > 1 and 132 <= programs <= SM_TARGET, (M, K_, N_, cfg)
            assert cfg.split_k * M * 4 <= K_
    assert w4a16_default_config(4096, 4096, 4096, 128, on_gpu=True).split_k == 1
    x, wp, s, g, z, b, _ = _make(70, 1024, 128, torch.float32, asym=True, bias=True, seed=14)
    cfg = w4a16_default_config(70, N, 1024, 128, on_gpu=True)
    assert cfg.split_k == 3
    y = w4a16_linear(x, wp, s, g, z, b, config=cfg)
    torch.testing.assert_close(y, w4a16_linear_ref(x, wp, s, g, z, b), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("K", [384, 512])
@pytest.mark.parametrize("block_m", [16, 1])
@pytest.mark.parametrize("zero_dtype", [None, torch.int8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_nibble_dots_launch(block_m, zero_dtype, dtype, K):
    """`nibble_dots`: each nibble of the words meets its own x columns in a dot of its own (fp16:
    nibbles i and i + 4 in one dot, from the two halves of a word); the sum over k is the
    reference's, for split-K, dot tiles and one-row programs, and integer zero points, with a
    split that runs a tile past K (384 in two splits of two 128-wide tiles) and without (512: no
    k masks); a row's numbers do not depend on the other rows of the launch (a decode row equals
    the same row inside a verification step)."""
    x, wp, s, g, z, b, _ = _make(16, K, 128, dtype, asym=zero_dtype is not None, bias=True, seed=11,
                                 zero_dtype=zero_dtype or torch.int8)
    cfg = W4A16Config(block_m, 16, 128, 2, 4, 2, nibble_dots=True)
    y = w4a16_linear(x, wp, s, g, z, b, config=cfg)
    tol = 1e-5 if dtype == torch.float32 else 5e-3
    torch.testing.assert_close(y.float(), w4a16_linear_ref(x, wp, s, g, z, b).float(), rtol=tol, atol=tol)
    assert torch.equal(w4a16_linear(x[:1], wp, s, g, z, b, config=cfg), y[:1])
    assert torch.equal(w4a16_linear(x[:5], wp, s, g, z, b, config=cfg), y[:5])


def test_nibble_dots_needs_a_tile_in_one_group():
    x, wp, s, g, z, b, _ = _make(1, 384, 128, torch.float32, asym=False, bias=False)
    for cfg in (W4A16Config(16, 16, 64, 1, nibble_dots=True), W4A16Config(4, 16, 128, 1, nibble_dots=True),
                W4A16Config(1, 16, 256, 1, nibble_dots=True),
                W4A16Config(16, 16, 128, 1, swap_ab=True, nibble_dots=True, fold_scale=True)):
        with pytest.raises(QuantSpecError, match="nibble_dots needs block_m 1, or block_m >= 16"):
            w4a16_linear(x, wp, s, g, config=cfg)


def _nan_tailed(t):
    """`t` as a view of a longer buffer whose tail is NaN: a read past its end is seen."""
    fill = float("nan") if t.is_floating_point() else 127
    buf = torch.full((t.numel() + 64,), fill, dtype=t.dtype)
    buf[: t.numel()] = t.flatten()
    return buf[: t.numel()].view(t.shape)


@pytest.mark.parametrize("zero_dtype", [torch.int8, torch.float16])
def test_split_k_tail_tile_reads_no_group_past_k(zero_dtype):
    """K=88 in tiles of 8 over 3 splits: the last split runs a 12th tile past K, whose aligned
    group index is one past the last group. Its scale / zero point must not be read (a NaN there
    made 0 * NaN in the accumulator, seen once in CI as a flaky NaN)."""
    x, wp, s, g, z, b, _ = _make(17, 88, 8, torch.float32, asym=True, bias=True, seed=5,
                                 zero_dtype=zero_dtype)
    s, z = _nan_tailed(s), _nan_tailed(z)
    y = w4a16_linear(x, wp, s, g, z, b, config=W4A16Config(1, 8, 8, 3))
    assert torch.isfinite(y).all()
    torch.testing.assert_close(y, w4a16_linear_ref(x, wp, s, g, z, b), rtol=1e-5, atol=1e-5)


def test_reference_matches_compressed_tensors_unpack():
    x, wp, s, g, z, b, q = _make(3, 88, 8, torch.float32, asym=True, bias=True)
    helpers = pytest.importorskip("compressed_tensors.compressors.pack_quantized.helpers")
    ct_q = helpers.unpack_from_int32(wp, 4, torch.Size((N, 88)))  # independent unpacker
    assert torch.equal(ct_q, q)
    w = (ct_q.float() - z.float().repeat_interleave(g, 1)) * s.repeat_interleave(g, 1)
    torch.testing.assert_close(w4a16_linear_ref(x, wp, s, g, z, b), x @ w.t() + b)


def test_bad_inputs_raise():
    x, wp, s, g, z, b, _ = _make(3, 88, 8, torch.float32, asym=True, bias=True)
    with pytest.raises(QuantSpecError, match="w_packed"):
        w4a16_linear(x, wp.to(torch.int64), s, g)
    with pytest.raises(QuantSpecError, match="ceil"):
        w4a16_linear(x[:, :80].contiguous(), wp, s, g)
    with pytest.raises(QuantSpecError, match="does not divide"):
        w4a16_linear(x, wp, s, 16)
    with pytest.raises(QuantSpecError, match="w_scale"):
        w4a16_linear(x, wp, s[:, :5].contiguous(), g)
    with pytest.raises(QuantSpecError, match="contiguous"):
        w4a16_linear(torch.randn(88, 3).t(), wp, s, g)
    with pytest.raises(QuantSpecError, match="x has dtype"):
        w4a16_linear(x.double(), wp, s, g)
    with pytest.raises(QuantSpecError, match="bias"):
        w4a16_linear(x, wp, s, g, z, b[:5])
    with pytest.raises(QuantSpecError, match="w_zero has dtype float64"):
        w4a16_linear(x, wp, s, g, z.double(), b)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("M", [1, 16, 64, 300])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_big_shapes(M, dtype):
    gen = torch.Generator().manual_seed(M)
    Nb, K, g = 1000, 4096, 128
    q = torch.randint(-8, 8, (Nb, K), dtype=torch.int8, generator=gen)
    s = (torch.rand(Nb, K // g, generator=gen) * 0.02).to(dtype)
    x = torch.randn(M, K, generator=gen).to(dtype)
    args = [t.cuda() for t in (x, pack_int4(q), s)]
    y = w4a16_linear(args[0], args[1], args[2], g)
    r = w4a16_linear_ref(args[0], args[1], args[2], g)
    # one half-precision rounding of outputs of magnitude ~5: a tolerance relative to the largest
    torch.testing.assert_close(y.float(), r.float(), rtol=2e-2, atol=1e-2 * float(r.float().abs().max()))


@pytest.mark.parametrize("K,g", SHAPES)
@pytest.mark.parametrize("zero_dtype", [None, torch.int8, torch.float16])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_dequantize_kernel_equals_reference(K, g, zero_dtype, dtype, same_rounding):
    """What a large-M call multiplies with cuBLAS: the same fp32 operations, the same rounding."""
    x, wp, s, g, z, b, q = _make(1, K, g, torch.float32, asym=zero_dtype is not None, bias=False,
                                 seed=K + g, zero_dtype=zero_dtype or torch.int8)
    w = w4a16_dequantize(wp, s, g, K, z, dtype)
    assert w.dtype == dtype and w.shape == (N, K)
    same_rounding(w, w4a16_dequantize_ref(wp, s, g, K, z, dtype))
    zf = 0 if z is None else z.float().repeat_interleave(g, 1)
    same_rounding(w, ((q.float() - zf) * s.repeat_interleave(g, 1)).to(dtype))



def test_gpu_dot_tiles_need_k_16(monkeypatch):
    """A `tl.dot` launch on a GPU needs k tiles of at least 16 (the MMA's k); one-row programs and
    the interpreter take any."""
    from quantspec.kernels import w4a16

    cpu = torch.device("cpu")
    w4a16.check_gpu_dot_tile(W4A16Config(16, 16, 8), cpu)  # the interpreter
    monkeypatch.setattr(w4a16, "gpu_launch", lambda device: True)
    w4a16.check_gpu_dot_tile(W4A16Config(1, 16, 8), cpu)
    w4a16.check_gpu_dot_tile(W4A16Config(16, 16, 16), cpu)
    with pytest.raises(QuantSpecError, match="block_k=8 must be at least 16"):
        w4a16.check_gpu_dot_tile(W4A16Config(16, 16, 8), cpu)


def test_quarter_int4_reorders_each_128_block():
    """`quarter_int4`: word p of a 128-k block holds k = 32i + 2p in nibble i and 32i + 2p + 1 in
    nibble i + 4; the codes are the same."""
    from quantspec.kernels.w4a16 import quarter_int4, quartered_order

    _, wp, _, _, _, _, q = _make(1, 256, 128, torch.float32, asym=False, bias=False, seed=3)
    quartered = unpack_int4(quarter_int4(wp, 256), (N, 256))
    order = quartered_order(256)
    assert torch.equal(quartered, q[:, order]) and sorted(order.tolist()) == list(range(256))
    for p in (0, 5, 15):
        for i in range(4):
            assert order[8 * p + i] == 32 * i + 2 * p and order[8 * p + i + 4] == 32 * i + 2 * p + 1
            assert order[128 + 8 * p + i] == 128 + 32 * i + 2 * p
    with pytest.raises(QuantSpecError, match="multiple of 128"):
        quarter_int4(wp[:, :12], 96)


@pytest.mark.parametrize("cfg", [None, W4A16Config(16, 16, 128, 2, nibble_dots=True),
                                 W4A16Config(16, 16, 128, 1, swap_ab=True, nibble_dots=True),
                                 W4A16Config(32, 16, 128, 2, 4, 2, swap_ab=True, nibble_dots=True)])
@pytest.mark.parametrize("M", [1, 3, 17])
@pytest.mark.parametrize("asym", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_quartered_weights_give_the_reference(cfg, M, asym, dtype):
    """Launches over `quarter_int4`'s layout (the default `quartered_config`: one-row programs or
    tiles; unswapped and swapped nibble dots, split-K) compute the reference of the standard
    packing."""
    from quantspec.kernels.w4a16 import quarter_int4

    x, wp, s, g, z, b, _ = _make(M, 256, 128, dtype, asym=asym, bias=True, seed=M + asym)
    y = w4a16_linear(x, quarter_int4(wp, 256), s, g, z, b, config=cfg, quartered=True)
    tol = 1e-5 if dtype == torch.float32 else 5e-3
    torch.testing.assert_close(y.float(), w4a16_linear_ref(x, wp, s, g, z, b).float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("zero_dtype", [None, torch.int8, torch.float16])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_quartered_dequantize_writes_k_order(zero_dtype, dtype):
    """`w4a16_dequantize` of quartered words: the standard words' weight, bit for bit (which
    `test_dequantize_kernel_equals_reference` checks against the reference)."""
    from quantspec.kernels.w4a16 import quarter_int4

    _, wp, s, g, z, _, _ = _make(1, 384, 128, torch.float32, asym=zero_dtype is not None, bias=False, seed=7,
                                 zero_dtype=zero_dtype or torch.int8)
    want = w4a16_dequantize(wp, s, g, 384, z, dtype)
    assert torch.equal(w4a16_dequantize(quarter_int4(wp, 384), s, g, 384, z, dtype, quartered=True), want)
    with pytest.raises(QuantSpecError, match=r"K \(192\) and the group size \(192\) to be multiples of 128"):
        w4a16_dequantize(wp[:, :24].contiguous(), s[:, :1].contiguous(), 192, 192, None, dtype, quartered=True)


def test_quartered_weights_need_128_blocks_and_nibble_dots():
    from quantspec.kernels.w4a16 import quarter_int4

    x, wp, s, g, _, _, _ = _make(2, 256, 64, torch.float32, asym=False, bias=False)
    with pytest.raises(QuantSpecError, match="group size .64. to be multiples of 128"):
        w4a16_linear(x, wp, s, g, quartered=True)
    x, wp, s, g, _, _, _ = _make(2, 256, 128, torch.float32, asym=False, bias=False)
    with pytest.raises(QuantSpecError, match="nibble_dots launch with block_k=128"):
        w4a16_linear(x, quarter_int4(wp, 256), s, g, config=W4A16Config(16, 16, 64, 1), quartered=True)


@pytest.mark.parametrize("block", [(8, 256, 4), (4, 1024, 8), (16, 64, 2), (2, 512, 4)])
@pytest.mark.parametrize("quartered", [False, True])
def test_dequantize_tiles_of_any_shape(block, quartered, same_rounding):
    """The tiles `bench/kernels.py --sweep-only` times: every (BLOCK_N, BLOCK_K, warps) gives the
    reference's weight, standard or quartered words, k tiles within a group or across groups."""
    from quantspec.kernels.w4a16 import quarter_int4

    x, wp, s, g, z, _, _ = _make(1, 1024, 128, torch.float32, asym=True, bias=False, seed=3, zero_dtype=torch.int8)
    want = w4a16_dequantize_ref(wp, s, g, 1024, z, torch.float16)
    words = quarter_int4(wp, 1024) if quartered else wp
    same_rounding(w4a16_dequantize(words, s, g, 1024, z, torch.float16, quartered=quartered, block=block), want)


def test_dequantize_block_must_be_powers_of_two():
    _, wp, s, g, _, _, _ = _make(1, 256, 128, torch.float32, asym=False, bias=False)
    with pytest.raises(QuantSpecError, match="powers of two"):
        w4a16_dequantize(wp, s, g, 256, None, torch.float16, block=(12, 128, 4))
