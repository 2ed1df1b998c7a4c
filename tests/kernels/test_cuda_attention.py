"""The CUDA room's paged attention (`infer/cuda/attention.py`) driven the way the engine drives it:
a `PagedKVCache` whose kernel is `TritonAttention`, steps described by `AttentionMetadata`,
against the generic SDPA path on the same steps (interpreter on CPU, real kernels on CUDA); and a
verification row equals the decode step at its position bit for bit."""

import pytest
import torch

from quantspec.infer.cuda.attention import TritonAttention
from quantspec.infer.kv_cache import AttentionMetadata, PagedAttention, PagedKVCache

DEV = "cuda" if torch.cuda.is_available() else "cpu"
L, KV, H, HD, BS = 2, 2, 4, 64, 4
pytestmark = pytest.mark.gpu  # runs everywhere; on CUDA with the real kernels


def _cache(kv: str, kernel: bool) -> PagedKVCache:
    scale = torch.full((L, KV), 0.05) if kv != "auto" else None
    return PagedKVCache(num_layers=L, num_blocks=32, block_size=BS, num_kv_heads=KV, head_dim=HD,
                        dtype=torch.float32, device=DEV, kv_dtype=kv, k_scale=scale, v_scale=scale,
                        kernel=TritonAttention if kernel else None)


def _step(cache, q_lens, seq_lens, tables, gen):
    T = sum(q_lens)
    q = torch.randn(T, H, HD, generator=gen).to(DEV)
    k = torch.randn(T, KV, HD, generator=gen).to(DEV)
    v = torch.randn(T, KV, HD, generator=gen).to(DEV)
    meta = AttentionMetadata.build(q_lens, seq_lens, tables, BS, DEV, kernel=cache.kernel)
    return [PagedAttention(cache, meta)(layer, q, k, v) for layer in range(L)]


# scattered blocks (no consecutive runs) so the kernel follows the block tables
TABLES = [[3, 7, 1, 9], [12, 2, 15, 4, 20], [6, 11, 8]]


@pytest.mark.parametrize("kv", ["auto", "int8"])
def test_triton_attention_matches_sdpa_over_engine_steps(kv):
    outs = {}
    for kernel in (True, False):
        cache, gen = _cache(kv, kernel), torch.Generator().manual_seed(0)
        assert (cache.kernel is not None) == kernel
        steps = [([5, 9, 3], [5, 9, 3]),  # fresh prompts
                 ([1, 4, 2], [6, 13, 5]),  # decode, a verification of 1 + 3 rows, a 2-row chunk
                 ([1, 1, 1], [7, 14, 6])]
        outs[kernel] = [_step(cache, ql, sl, TABLES, gen) for ql, sl in steps]
    for got, ref in zip(outs[True], outs[False]):
        for g, r in zip(got, ref):
            torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-4)


def test_verification_rows_equal_decode_steps_bitwise():
    """The rows of one 1 + 3 row step equal four 1-row steps over the same keys."""
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(4, H, HD, generator=gen).to(DEV)
    k = torch.randn(14, KV, HD, generator=gen).to(DEV)
    v = torch.randn(14, KV, HD, generator=gen).to(DEV)
    table = [[12, 2, 15, 4]]

    def run(chunks):
        cache = _cache("auto", True)
        meta = AttentionMetadata.build([10], [10], table, BS, DEV, kernel=cache.kernel)
        PagedAttention(cache, meta)(0, torch.zeros(10, H, HD, device=DEV), k[:10], v[:10])
        out, pos = [], 10
        for n in chunks:
            meta = AttentionMetadata.build([n], [pos + n], table, BS, DEV, kernel=cache.kernel)
            i = pos - 10
            out.append(PagedAttention(cache, meta)(0, q[i:i + n], k[pos:pos + n], v[pos:pos + n]))
            pos += n
        return torch.cat(out)

    assert torch.equal(run([4]), run([1, 1, 1, 1]))
