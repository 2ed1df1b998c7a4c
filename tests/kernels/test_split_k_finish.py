"""Split-K launches whose output tiles' last splits sum the partials in the GEMM's own launch
(`_common.split_k_arrive`) give the numbers of the separate finishing launch bitwise, leave
their arrival counters at zero for the next launch (or CUDA graph replay), and fall back to
the finishing launch where they have no counters."""

import pytest
import torch

from quantspec.kernels import _common
from quantspec.kernels.fp8 import fp8_gemm
from quantspec.kernels.w4a16 import W4A16Config, quarter_int4, w4a16_linear, w4a16_linear_ref
from quantspec.kernels.w8a8 import int8_gemm, int8_gemm_ref
from quantspec.kernels.w8a16 import w8a16_linear, w8a16_linear_ref
from quantspec.quant.packing import pack_int4

N, K, G = 40, 256, 128
SPLIT = 3


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def _w4(dtype, zero):
    gen = _gen(1)
    wp = pack_int4(torch.randint(-8, 8, (N, K), dtype=torch.int8, generator=gen))
    s = (torch.rand(N, K // G, generator=gen) * 0.02 + 0.001).to(dtype)
    z = torch.randint(-8, 8, (N, K // G), dtype=torch.int8, generator=gen) if zero else None
    return wp, s, z


def _fp8_supported() -> bool:
    return not torch.cuda.is_available() or torch.cuda.get_device_capability() >= (8, 9)


def _cases():
    """(name, call(M, bias) → y, reference(M, bias) → y or None) of every split-K GEMM, each
    with a split launch of up to 16 rows (the one that finishes in its own launch)."""
    def x(M, dtype=torch.float32):
        return torch.randn(M, K, generator=_gen(M)).to(dtype)

    def bias_of(on, dtype=torch.float32):
        return torch.randn(N, generator=_gen(5)).to(dtype) if on else None

    wp, s, z = _w4(torch.float32, True)
    w4cfg = W4A16Config(16, 16, 32, SPLIT)
    q8 = torch.randint(-127, 128, (N, K), dtype=torch.int8, generator=_gen(2))
    s8 = torch.rand(N, generator=_gen(3)) * 0.01 + 0.001
    xq = torch.randint(-127, 128, (4, K), dtype=torch.int8, generator=_gen(4))
    xs = torch.rand(4, generator=_gen(6)) * 0.05 + 0.01
    f8w = (torch.randn(N, K, generator=_gen(7)) * 20).clamp(-448, 448).to(torch.float8_e4m3fn)
    scaled = (16, 16, 32, 4, 1, SPLIT)
    return [
        ("w4a16", lambda M, b: w4a16_linear(x(M), wp, s, G, z, bias_of(b), config=w4cfg),
         lambda M, b: w4a16_linear_ref(x(M), wp, s, G, z, bias_of(b))),
        ("w4a16 one row per program", lambda M, b: w4a16_linear(x(M), wp, s, G, None, bias_of(b),
                                                                config=W4A16Config(1, 16, 32, SPLIT)),
         lambda M, b: w4a16_linear_ref(x(M), wp, s, G, None, bias_of(b))),
        ("w4a16 quartered", lambda M, b: w4a16_linear(x(M), quarter_int4(wp, K), s, G, z, bias_of(b),
                                                      config=W4A16Config(16, 16, 128, 2, nibble_dots=True),
                                                      quartered=True),
         lambda M, b: w4a16_linear_ref(x(M), wp, s, G, z, bias_of(b))),
        ("w8a16", lambda M, b: w8a16_linear(x(M), q8, s8, bias_of(b), config=W4A16Config(16, 16, 32, SPLIT)),
         lambda M, b: w8a16_linear_ref(x(M), q8, s8, bias_of(b))),
        ("int8", lambda M, b: int8_gemm(xq[:M], xs[:M], q8, s8, bias_of(b), torch.float32, launch=scaled),
         lambda M, b: int8_gemm_ref(xq[:M], xs[:M], q8, s8, bias_of(b), torch.float32)),
        ("fp8", lambda M, b: fp8_gemm(xq[:M].float().to(torch.float8_e4m3fn), xs[:1], f8w, s8, bias_of(b),
                                      torch.float32, launch=scaled),
         None),
    ]


CASES = _cases()


@pytest.fixture
def counters(monkeypatch):
    """A persistent set of arrival counters per device, as a GPU's are, handed to every launch
    (the CPU interpreter otherwise takes a fresh set per launch)."""
    made: dict = {}

    def persistent(device, tiles):
        c = made.setdefault(device, torch.zeros(64, dtype=torch.int32, device=device))
        return c if tiles <= c.numel() else None
    monkeypatch.setattr(_common, "split_k_counters", persistent)
    return made


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("M", [1, 3])
@pytest.mark.parametrize("name,call,ref", CASES, ids=[c[0] for c in CASES])
def test_in_launch_finish_equals_the_finishing_launch(name, call, ref, M, bias, counters, monkeypatch):
    if name == "fp8" and not _fp8_supported():
        pytest.skip("needs compute capability >= 8.9")
    first = call(M, bias)
    assert counters and all(int(c.abs().sum()) == 0 for c in counters.values()), "counters left non-zero"
    again = call(M, bias)  # the same counters, as a graph replay meets them
    assert torch.equal(first, again)
    monkeypatch.setattr(_common, "split_k_counters", lambda device, tiles: None)
    assert torch.equal(call(M, bias), first)
    if ref is not None:
        torch.testing.assert_close(first, ref(M, bias), rtol=1e-4, atol=1e-4)


def test_int8_split_in_launch_is_exact(counters):
    """int8 partial sums are exact integers: the split launch gives the unsplit numbers."""
    xq = torch.randint(-127, 128, (5, K), dtype=torch.int8, generator=_gen(8))
    xs = torch.rand(5, generator=_gen(9)) * 0.05 + 0.01
    w = torch.randint(-127, 128, (N, K), dtype=torch.int8, generator=_gen(10))
    ws = torch.rand(N, generator=_gen(11)) * 0.01 + 0.001
    split = int8_gemm(xq, xs, w, ws, None, torch.float16, launch=(16, 16, 32, 4, 1, 4))
    whole = int8_gemm(xq, xs, w, ws, None, torch.float16, launch=(16, 16, 32, 4, 1, 1))
    assert torch.equal(split, whole)


def test_wide_weight_only_tiles_finish_in_a_launch_of_their_own(monkeypatch):
    """Weight-only launches of more than 16 rows per tile keep the separate finishing launch
    (their registers go to the tile)."""
    asked = []
    real = _common.split_k_buffers

    def spy(*args, **kwargs):
        asked.append(kwargs.get("in_kernel", True))
        return real(*args, **kwargs)
    monkeypatch.setattr("quantspec.kernels.w4a16.split_k_buffers", spy)
    wp, s, _ = _w4(torch.float32, False)
    x = torch.randn(20, K, generator=_gen(12))
    y = w4a16_linear(x, wp, s, G, config=W4A16Config(32, 16, 32, 2))
    torch.testing.assert_close(y, w4a16_linear_ref(x, wp, s, G), rtol=1e-4, atol=1e-4)
    w4a16_linear(x[:2], wp, s, G, config=W4A16Config(16, 16, 32, 2))
    assert asked == [False, True]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_a_gpu_the_last_splits_see_every_partial(monkeypatch):
    """The GPU's own launches of a 4096-wide layer at 1 and 16 rows (W4A16 split 8, W8A16, int8):
    the tiles' last splits give the finishing launch's numbers bitwise, launch after launch
    (a last split that read a partial before it was visible would differ)."""
    dev, gen = torch.device("cuda"), _gen(20)
    K_ = N_ = 4096
    wp = pack_int4(torch.randint(-8, 8, (N_, K_), dtype=torch.int8, generator=gen)).to(dev)
    s4 = (torch.rand(N_, K_ // G, generator=gen) * 0.02).half().to(dev)
    q8 = torch.randint(-127, 128, (N_, K_), dtype=torch.int8, generator=gen).to(dev)
    s8 = (torch.rand(N_, generator=gen) * 0.01 + 0.001).to(dev)
    for M in (1, 16):
        x = torch.randn(M, K_, generator=gen).half().to(dev)
        xq = torch.randint(-127, 128, (M, K_), dtype=torch.int8, generator=gen).to(dev)
        calls = [lambda: w4a16_linear(x, wp, s4, G), lambda: w8a16_linear(x, q8, s8.half()),
                 lambda: int8_gemm(xq, torch.full((1,), 0.02, device=dev), q8, s8, None, torch.float16)]
        for call in calls:
            with monkeypatch.context() as m:
                m.setattr(_common, "split_k_counters", lambda device, tiles: None)
                want = call()
            for _ in range(20):
                assert torch.equal(call(), want)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_counters_on_a_gpu_stay_zero_across_graph_replays():
    """The device's counters are made once outside a capture; a captured split launch replays
    with the eager numbers and leaves them zero; more tiles than counters finish in a launch of
    their own."""
    dev = torch.device("cuda")
    wp, s, z = (t.to(dev) if t is not None else None for t in _w4(torch.float16, True))
    x = torch.randn(1, K, generator=_gen(13)).half().to(dev)
    cfg = W4A16Config(16, 16, 32, SPLIT)
    eager = w4a16_linear(x, wp, s, G, z, config=cfg)
    counters = _common.split_k_counters(dev, 1)
    assert counters is not None and int(counters.abs().sum()) == 0
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = w4a16_linear(x, wp, s, G, z, config=cfg)
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, eager)
        assert int(counters.abs().sum()) == 0
    assert _common.split_k_counters(dev, _common.SPLIT_K_COUNTERS + 1) is None
