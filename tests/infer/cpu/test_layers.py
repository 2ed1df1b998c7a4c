"""The CPU kernel versions of RMSNorm, the rotary embedding and the MLP activation (`infer/cpu/layers.py`),
put in place of the zoo's modules at load."""

import pytest
import torch

from quantspec.infer.cpu.layers import CpuRMSNorm, CpuRotary, CpuSiluAndMul, use_cpu_layer_kernels
from quantspec.kernels.cpu import cpu_kernels
from quantspec.model_zoo.checkpoint import load_model
from quantspec.model_zoo.llama import RMSNorm, RotaryEmbedding

pytestmark = pytest.mark.skipif(cpu_kernels() is None, reason="quantspec's CPU kernels are not built here")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swapped_model_gives_the_same_hidden_states(tiny_llama_dir, dtype):
    from quantspec.infer.kv_cache import AttentionMetadata, PagedAttention, PagedKVCache

    ref = load_model(tiny_llama_dir, dtype=dtype)[0]
    fast = load_model(tiny_llama_dir, dtype=dtype)[0]
    norm_weight = fast.model.norm.weight
    n = use_cpu_layer_kernels(fast)
    a = fast.args
    assert n == 2 * a.num_layers + 1 + 2 * a.num_layers  # 2 norms per layer + final norm, rotaries, activations
    assert type(fast.model.norm) is CpuRMSNorm and fast.model.norm.weight is norm_weight
    assert type(fast.model.layers[0].self_attn.rotary_emb) is CpuRotary
    assert type(fast.model.layers[0].mlp.act_fn) is CpuSiluAndMul
    assert set(fast.state_dict()) == set(ref.state_dict())

    def hidden(model, rows):
        cache = PagedKVCache(num_layers=a.num_layers, num_blocks=8, block_size=16, num_kv_heads=a.num_kv_heads,
                             head_dim=a.head_dim, dtype=dtype)
        table = cache.allocator.allocate(6)
        ids = torch.arange(3, 3 + rows)
        meta = AttentionMetadata.build([rows], [rows], [table], 16, "cpu")
        with torch.no_grad():
            return model(ids, torch.arange(rows), PagedAttention(cache, meta))

    for rows in (3, 70):  # decode-sized, prefill-sized (rows split over the threads)
        want, got = hidden(ref, rows), hidden(fast, rows)
        if dtype == torch.bfloat16:
            assert torch.equal(got, want)
        else:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_only_cpu_float_modules_are_swapped(tiny_llama_dir):
    model = load_model(tiny_llama_dir, dtype=torch.float16)[0]
    assert use_cpu_layer_kernels(model) == 0
    assert type(model.model.norm) is RMSNorm and type(model.model.layers[0].self_attn.rotary_emb) is RotaryEmbedding


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_mlp_activation_matches_torch_and_is_row_invariant(tiny_llama_dir, dtype):
    """With gate/up fused, silu(gate) * up runs in one kernel call for decode-sized rows: equal
    to torch's expression up to the exp's last bit (bf16: at most one ulp on a few elements),
    and each row the same bits whatever rows come with it."""
    from quantspec.infer.fuse import fuse_projections

    model = load_model(tiny_llama_dir, dtype=dtype)[0]
    fuse_projections(model)
    use_cpu_layer_kernels(model)
    mlp = model.model.layers[0].mlp
    assert type(mlp.act_fn) is CpuSiluAndMul and mlp.gate_up_proj is not None
    gu = (torch.randn(7, mlp.gate_up_proj.out_features) * 4).to(dtype)
    got = mlp.act_fn(gu)
    gate, up = gu.chunk(2, dim=-1)
    want = torch.nn.functional.silu(gate) * up
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
    for i in range(7):
        assert torch.equal(mlp.act_fn(gu[i:i + 1]), got[i:i + 1])
    big = gu.repeat(20, 1)  # prefill-sized: rows split over the threads, the same bits per row
    assert torch.equal(mlp.act_fn(big), got.repeat(20, 1))
