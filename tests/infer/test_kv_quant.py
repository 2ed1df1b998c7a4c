"""Static int8 / fp8 KV cache through the paged path vs the fp cache, on a tiny model.

Scales come from a real calibration pass (`calibrate_model`) over other random tokens.
Stated tolerances on |Δlogit| / std(logits) over 37 positions × 512 logits (tiny Llama):
int8 max ≤ 0.1, mean ≤ 0.01 (measured 0.054 / 0.0055); fp8 max ≤ 0.3, mean ≤ 0.03 (measured
0.133 / 0.016).
"""

import os

import pytest
import torch

from quantspec.calib.calibrate import calibrate_model
from quantspec.calib.tables import ScaleTable, read_table
from quantspec.errors import QuantSpecError
from quantspec.infer.engine import Engine, EngineConfig
from quantspec.infer.kv_cache import AttentionMetadata, PagedAttention, PagedKVCache
from quantspec.infer.sampler import SamplingParams
from quantspec.model_zoo.checkpoint import load_model
from quantspec.model_zoo.llama import DenseCausalAttention
from quantspec.quant.primitives import dequantize_kv, quantize_kv

torch.set_num_threads(1)
BLOCK = 16
TOL = {"int8": (0.1, 0.01), "fp8": (0.3, 0.03)}  # (max, mean)


@pytest.fixture(scope="module")
def setup(tiny_llama_dir):
    model, _ = load_model(tiny_llama_dir)
    g = torch.Generator().manual_seed(0)
    table = ScaleTable(calibrate_model(model, torch.randint(3, 500, (4, 48), generator=g)))
    prompt = torch.randint(3, 500, (37,), generator=torch.Generator().manual_seed(1))
    return model, table, prompt


class Recorder:
    """Wraps PagedAttention and keeps the K/V each layer writes."""

    def __init__(self, inner):
        self.inner, self.kv = inner, {}

    def __call__(self, i, q, k, v):
        self.kv[i] = (k.clone(), v.clone())
        return self.inner(i, q, k, v)


def paged_run(model, prompt, kind, table, decode=4):
    """Prefill the prompt minus `decode` tokens, then feed the rest one by one (teacher forcing).
    Returns (logits of every fed position [T, V], cache, recorded K/V of the prefill, block table)."""
    args = model.args
    ks, vs = (None, None) if kind == "auto" else table.kv_scales(kind)
    cache = PagedKVCache(num_layers=args.num_layers, num_blocks=8, block_size=BLOCK,
                         num_kv_heads=args.num_kv_heads, head_dim=args.head_dim,
                         dtype=torch.float32, kv_dtype=kind, k_scale=ks, v_scale=vs)
    blocks = cache.allocator.allocate(-(-len(prompt) // BLOCK))
    T0 = len(prompt) - decode
    out, rec = [], None
    with torch.no_grad():
        for start, end in [(0, T0)] + [(t, t + 1) for t in range(T0, len(prompt))]:
            meta = AttentionMetadata.build([end - start], [end], [blocks], BLOCK, "cpu")
            attn = Recorder(PagedAttention(cache, meta))
            h = model(prompt[start:end], torch.arange(start, end), attn)
            out.append(model.compute_logits(h))
            rec = rec or attn.kv
    return torch.cat(out), cache, rec, torch.tensor([blocks])


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_quantized_cache_logits_close_to_fp(setup, kind):
    model, table, prompt = setup
    ref, *_ = paged_run(model, prompt, "auto", table)
    got, *_ = paged_run(model, prompt, kind, table)
    # the fp paged path itself equals dense attention
    n = len(prompt)
    with torch.no_grad():
        dense = model.compute_logits(model(prompt, torch.arange(n), DenseCausalAttention(1, n)))
    torch.testing.assert_close(ref, dense, rtol=1e-4, atol=1e-4)
    err = (got - ref).abs() / ref.std()
    assert err.max() <= TOL[kind][0] and err.mean() <= TOL[kind][1], (err.max(), err.mean())
    assert (got - ref).abs().max() > 0  # the cache really was quantized


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_cache_holds_exact_quantize_dequantize(setup, kind):
    model, table, prompt = setup
    _, cache, rec, blocks = paged_run(model, prompt, kind, table, decode=0)
    ks, vs = table.kv_scales(kind)
    n = len(prompt)
    for layer, (k, v) in rec.items():
        kc, vc = cache.gather(layer, blocks)  # [1, nb*BLOCK, KV, hd]
        assert torch.equal(kc[0, :n], dequantize_kv(quantize_kv(k, ks[layer], kind), ks[layer]))
        assert torch.equal(vc[0, :n], dequantize_kv(quantize_kv(v, vs[layer], kind), vs[layer]))
    # layer 0 sees the same K/V as plain dense attention (nothing upstream is quantized)
    seen = {}
    with torch.no_grad():
        model(prompt, torch.arange(n), DenseCausalAttention(1, n, lambda i, k, v: seen.setdefault(i, (k[0], v[0]))))
    assert torch.equal(seen[0][0], rec[0][0])


def test_engine_with_static_cache(setup):
    model, table, prompt = setup
    ks, vs = table.kv_scales("int8")
    captured = {}
    orig = model.compute_logits
    for kind in ("auto", "int8"):
        eng = Engine(model, EngineConfig(block_size=BLOCK, max_batch_size=1, max_length=64,
                                         kv_cache_dtype=kind),
                     k_scale=None if kind == "auto" else ks, v_scale=None if kind == "auto" else vs)
        assert eng.cache.k.dtype == (torch.float32 if kind == "auto" else torch.int8)
        model.compute_logits = lambda h, row_invariant=False, _k=kind: captured.setdefault(_k, orig(h, row_invariant))
        try:
            eng.add_request(prompt.tolist(), SamplingParams(max_new_tokens=1))
            eng.step()
        finally:
            del model.compute_logits
    rel = ((captured["int8"] - captured["auto"]).abs().max() / captured["auto"].std()).item()
    assert 0 < rel <= TOL["int8"][0]


def test_missing_scales_are_clear_errors(setup, tmp_path):
    model, _, _ = setup
    with pytest.raises(QuantSpecError, match="run `quantspec calibrate`"):
        Engine(model, EngineConfig(block_size=BLOCK, max_length=64, kv_cache_dtype="int8"))
    with pytest.raises(QuantSpecError, match="does not exist; run `quantspec calibrate"):
        read_table(tmp_path / "no_table")
    with pytest.raises(QuantSpecError, match=r"k_scale has shape \(2,\), the model needs \(2, 2\)"):
        Engine(model, EngineConfig(block_size=BLOCK, max_length=64, kv_cache_dtype="fp8"),
               k_scale=torch.ones(2), v_scale=torch.ones(2))


def test_artifact_kv_scales_need_no_flag(tmp_path, tiny_llama_dir):
    """quantize(calib, kv_cache) stores k_scale/v_scale; infer then runs an int8 cache unasked,
    with exactly the table's scales; `--calib` for a missing table is one clear line."""
    from quantspec import api
    from quantspec.infer.predictor import InferConfig, Predictor
    from quantspec.model_zoo.tiny import TINY_CORPUS

    data = tmp_path / "calib.txt"
    data.write_text(TINY_CORPUS)
    calib = api.calibrate(str(tiny_llama_dir), str(data), tmp_path / "calib", num_samples=2,
                          seq_len=32).path
    art = api.quantize(str(tiny_llama_dir), "weight_only_int8", tmp_path / "art", calib=calib,
                       kv_cache="int8", target="quantspec")
    pred = Predictor(InferConfig(model=str(art), device="cpu", dtype="float32", max_length=64,
                                 max_new_tokens=4))
    ks, vs = read_table(calib, model_dir=tiny_llama_dir).kv_scales("int8")
    assert pred.engine.cache.k.dtype == torch.int8
    assert torch.equal(pred.engine.cache.k_scale, ks) and torch.equal(pred.engine.cache.v_scale, vs)
    with pytest.raises(QuantSpecError, match="--calib: .*does not exist; run `quantspec calibrate"):
        api.infer(InferConfig(model=str(tiny_llama_dir), device="cpu", dtype="float32", cachekv="fp8"),
                  ["hi"], calib=str(tmp_path / "missing"))


def test_cpu_attention_kernel_only_for_power_of_two_blocks():
    """The CPU kernel finds a key's slot by shift and mask: a cache whose block size is not a power
    of two keeps torch's attention (same results: a 29-token prefill, which the kernel takes for
    prompts of up to 512 tokens, then a decode query over 30 keys, in blocks of 24 and 16)."""
    from quantspec.infer.cpu.attention import CpuAttention
    from quantspec.kernels.cpu import cpu_kernels

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(30, 4, 64, generator=g), torch.randn(30, 2, 64, generator=g),
               torch.randn(30, 2, 64, generator=g))
    outs = []
    for bs in (24, 16):
        cache = PagedKVCache(num_layers=1, num_blocks=4, block_size=bs, num_kv_heads=2, head_dim=64,
                             dtype=torch.float32, kernel=CpuAttention.for_cache)
        assert (cache.kernel is not None) == (bs == 16 and cpu_kernels() is not None)
        table = cache.allocator.allocate(2)
        prefill = AttentionMetadata.build([29], [29], [table], bs, "cpu", cache.kernel)
        assert prefill.kernel == (cache.kernel is not None)
        first = PagedAttention(cache, prefill)(0, q[:29], k[:29], v[:29])
        decode = AttentionMetadata.build([1], [30], [table], bs, "cpu", cache.kernel)
        outs.append(torch.cat([first, PagedAttention(cache, decode)(0, q[29:], k[29:], v[29:])]))
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)
    from quantspec.kernels.cpu import pair_path_available

    # beyond 512 tokens: SDPA, except on fp32's blocked prefill path and bf16's AVX512-BF16 pair
    # path, which take any length
    for dtype, takes in ((torch.float32, True), (torch.bfloat16, pair_path_available())):
        cache = PagedKVCache(num_layers=1, num_blocks=4, block_size=16, num_kv_heads=2, head_dim=64, dtype=dtype,
                             kernel=CpuAttention.for_cache)
        meta = AttentionMetadata.build([600], [600], [list(range(40))], 16, "cpu", cache.kernel)
        assert meta.fresh_prefill and meta.kernel == (takes and cache.kernel is not None)
        if cache.kernel is not None:
            assert cache.kernel.serves([512], [512]) and cache.kernel.serves([600], [600]) == takes


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs /proc")
def test_cpu_cache_takes_memory_as_it_fills():
    """A CPU cache's blocks are zeros that take memory only once written: a cache costs
    next to nothing until used (1 GB here), a written block reads back, every other block reads zero."""
    before = _resident_bytes()
    cache = PagedKVCache(num_layers=8, num_blocks=2048, block_size=16, num_kv_heads=8, head_dim=128,
                         dtype=torch.bfloat16)
    assert cache.k.numel() * 2 + cache.v.numel() * 2 == 2**30
    assert _resident_bytes() - before < 64 * 2**20
    cache.k[3, 7].fill_(1.5)
    assert _resident_bytes() - before < 64 * 2**20
    assert bool((cache.k[3, 7] == 1.5).all())
    assert sum(int(cache.k[i].count_nonzero()) for i in range(8)) == 16 * 8 * 128
    assert sum(int(cache.v[i].count_nonzero()) for i in range(8)) == 0
