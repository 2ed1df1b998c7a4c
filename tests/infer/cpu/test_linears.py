"""The CPU float linears (`infer/cpu/linears.py`: skinny-M `SkinnyLinear`, packed `PackedLinear`,
`PackedPairsLinear`, `PackedEmbedding`) against torch's own linear."""

import pytest
import torch
from torch import nn

from quantspec.infer.cpu.linears import (
    KERNEL_MAX_ROWS,
    MAX_ROWS,
    PackedEmbedding,
    PackedLinear,
    PackedPairsLinear,
    SkinnyLinear,
    pack_float_linears,
    skinny_linears,
)
from quantspec.infer.dispatch import DispatchPolicy
from quantspec.kernels.cpu import cpu_kernels


@pytest.mark.parametrize("in_features", [37, 96])  # 96: quantspec's CPU kernel where it is built
@pytest.mark.parametrize("rows", [1, 2, 3, MAX_ROWS, MAX_ROWS + 1, 9, 17])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_linear(rows, bias, in_features):
    torch.manual_seed(rows)
    ref = nn.Linear(in_features, 53, bias=bias)
    x = torch.randn(rows, in_features)
    want = ref(x)
    ref = SkinnyLinear(ref, cpu_kernels())
    torch.testing.assert_close(ref(x), want, atol=1e-5, rtol=1e-5)
    # 3-D input and a non-contiguous one
    x3 = torch.randn(1, rows, in_features)
    torch.testing.assert_close(ref(x3), torch.nn.functional.linear(x3, ref.weight, ref.bias), atol=1e-5, rtol=1e-5)
    xt = torch.randn(in_features, rows).t()
    torch.testing.assert_close(ref(xt), torch.nn.functional.linear(xt, ref.weight, ref.bias), atol=1e-5, rtol=1e-5)
    assert ref(x).is_contiguous()


@pytest.mark.skipif(cpu_kernels() is None, reason="quantspec's CPU kernels are not built here")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_rows_are_bitwise_those_of_one_row(dtype):
    """Every row the kernel serves (a verification step) equals that row alone (a decode step)."""
    torch.manual_seed(0)
    lin = SkinnyLinear(nn.Linear(96, 70, bias=True).to(dtype).requires_grad_(False), cpu_kernels())
    x = torch.randn(KERNEL_MAX_ROWS[dtype], 96).to(dtype)
    y = lin(x)
    want = torch.nn.functional.linear(x.float(), lin.weight.float(), lin.bias.float())
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(y.float(), want, atol=tol * float(want.abs().max()), rtol=tol)
    for i in range(x.shape[0]):
        assert torch.equal(lin(x[i:i + 1]), y[i:i + 1])
    # a row-invariant call (an engine decode step) takes the kernel for any number of rows
    x = torch.randn(KERNEL_MAX_ROWS[dtype] + 5, 96).to(dtype)
    y = lin(x, row_invariant=True)
    for i in (0, x.shape[0] - 1):
        assert torch.equal(lin(x[i:i + 1]), y[i:i + 1])


def test_which_cpu_linears_are_swapped():
    m = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4).to(torch.bfloat16), nn.Linear(4, 4).half())
    weights = [lin.weight for lin in m]
    bf16 = cpu_kernels() is not None  # bf16 linears gain only from quantspec's kernel
    assert skinny_linears(m, cpu_kernels()) == 1 + bf16
    assert type(m[0]) is SkinnyLinear and type(m[2]) is nn.Linear
    assert (type(m[1]) is SkinnyLinear) == bf16
    assert all(lin.weight is w for lin, w in zip(m, weights))  # the same parameters
    m2 = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4).to(torch.bfloat16))
    assert skinny_linears(m2) == 1 and m2[0].kernels is None


needs_kernels = pytest.mark.skipif(cpu_kernels() is None, reason="quantspec's CPU kernels are not built here")


@needs_kernels
def test_loaded_float_linears_are_packed_after_fusing(tiny_llama_dir):
    """With the kernels built, every fp32 linear of a loaded model (fused q/k/v and gate/up, the
    head) is a PackedLinear, and the model's logits still match the unpacked model's."""
    from quantspec.infer.loader import load_for_inference

    lm = load_for_inference(tiny_llama_dir, tokenizer=False)
    layer = lm.model.model.layers[0]
    for mod in (layer.self_attn.qkv_proj, layer.mlp.gate_up_proj, layer.self_attn.o_proj,
                layer.mlp.down_proj, lm.model.lm_head):
        assert type(mod) is PackedLinear
    assert not any(type(m) in (nn.Linear, SkinnyLinear) for m in lm.model.modules())
    assert type(lm.model.model.embed_tokens) is nn.Embedding  # untied: its own table
    plain = load_for_inference(tiny_llama_dir, tokenizer=False, fuse=False)
    assert type(plain.model.model.layers[0].self_attn.q_proj) is PackedLinear
    torch_ops = load_for_inference(tiny_llama_dir, tokenizer=False, policy=DispatchPolicy(cpu_kernels=False))
    head = torch_ops.model.lm_head
    assert type(head) is SkinnyLinear and head.kernels is None
    torch.testing.assert_close(lm.model.lm_head.dense_weight(), head.weight)


@needs_kernels
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_linear_for_any_rows(bias):
    torch.manual_seed(3)
    ref = nn.Linear(72, 45, bias=bias).requires_grad_(False)
    packed = PackedLinear(ref)
    for rows in (1, 3, 8, 11, 70):
        x = torch.randn(rows, 72)
        torch.testing.assert_close(packed(x), ref(x), atol=1e-5, rtol=1e-5)
        for i in (0, rows - 1):  # each row as in a decode step: the same bits
            assert torch.equal(packed(x[i:i + 1]), packed(x)[i:i + 1])
    x3 = torch.randn(2, 5, 72)
    torch.testing.assert_close(packed(x3), ref(x3), atol=1e-5, rtol=1e-5)
    xt = torch.randn(72, 4).t()  # non-contiguous
    torch.testing.assert_close(packed(xt), ref(xt), atol=1e-5, rtol=1e-5)
    assert torch.equal(packed.dense_weight(), ref.weight)
    assert "packed" not in packed.state_dict() and (packed.bias is not None) == bias


@needs_kernels
def test_pack_float_linears_takes_fp32_cpu_linears_and_even_bf16_ones():
    m = nn.Sequential(nn.Linear(4, 4), SkinnyLinear(nn.Linear(4, 6)), nn.Linear(4, 4).to(torch.bfloat16),
                      nn.Linear(5, 4).to(torch.bfloat16), nn.Linear(4, 4).half())
    pairs = bool(cpu_kernels().has_bf16_dot())
    assert pack_float_linears(m, pairs=pairs) == 2 + pairs
    assert type(m[0]) is PackedLinear and type(m[1]) is PackedLinear and m[1].out_features == 6
    assert type(m[2]) is (PackedPairsLinear if pairs else nn.Linear)
    assert type(m[3]) is nn.Linear and type(m[4]) is nn.Linear  # odd K; fp16


needs_pairs = pytest.mark.skipif(cpu_kernels() is None or not cpu_kernels().has_bf16_dot(),
                                 reason="needs quantspec's CPU kernels with AVX512-BF16")


@needs_pairs
@pytest.mark.parametrize("bias", [False, True])
def test_pairs_linear_matches_linear_for_any_rows(bias):
    """`PackedPairsLinear` (a bf16 weight in k-pairs) against torch's linear in float64 on the same
    bf16 numbers, every row bitwise the same alone or in a batch; fp32 x takes torch's linear;
    the unpacked weight and its rows are the original bf16 weight bitwise."""
    torch.manual_seed(3)
    lin = nn.Linear(96, 70, bias=bias).to(torch.bfloat16)
    w = lin.weight.detach().clone()
    p = PackedPairsLinear(lin)
    assert torch.equal(p.dense_weight(), w) and p.dense_weight().dtype == torch.bfloat16
    assert torch.equal(p.weight_rows([0, 33, 69]), w[[0, 33, 69]])
    assert torch.equal(p.weight_rows(torch.tensor([5, 64, 31])), w[[5, 64, 31]])
    for rows in (1, 2, 11, 12, 130):
        x = torch.randn(rows, 96).bfloat16()
        want = x.double() @ w.double().t() + (lin.bias.detach().double() if bias else 0)
        y = p(x)
        assert y.dtype == torch.bfloat16
        torch.testing.assert_close(y.double(), want, rtol=1e-2, atol=1e-2 * float(want.abs().max()))
        assert torch.equal(torch.cat([p(x[i:i + 1]) for i in range(rows)]), y)
    x = torch.randn(3, 96)
    torch.testing.assert_close(p(x), x @ w.float().t() + (lin.bias.float() if bias else 0))


@needs_pairs
def test_tied_bf16_embedding_reads_the_pairs_head():
    torch.manual_seed(6)
    m = nn.ModuleDict({"embed": nn.Embedding(70, 48), "head": nn.Linear(48, 70, bias=False)}).to(torch.bfloat16)
    m.head.weight = m.embed.weight
    table = m.embed.weight.detach().clone()
    assert pack_float_linears(m, pairs=True) == 1
    assert type(m.head) is PackedPairsLinear and type(m.embed) is PackedEmbedding
    ids = torch.tensor([[0, 31, 32, 69], [5, 5, 64, 33]])
    assert torch.equal(m.embed(ids), table[ids])
    many = torch.randint(0, 70, (3, 40))
    assert torch.equal(m.embed(many), table[many])
    with pytest.raises(IndexError, match="out of range"):
        m.embed(torch.tensor([70]))


@needs_kernels
def test_tied_embedding_reads_the_packed_head():
    """A tied embedding becomes a `PackedEmbedding` over the packed head: the same rows bitwise,
    no second [V, D] table, out-of-range ids refused; an untied embedding is left alone."""
    torch.manual_seed(5)
    m = nn.ModuleDict({"embed": nn.Embedding(70, 48), "head": nn.Linear(48, 70, bias=False),
                       "other": nn.Embedding(70, 48)})
    m.head.weight = m.embed.weight  # tied
    table, other = m.embed.weight.detach().clone(), m.other.weight
    assert pack_float_linears(m, pairs=False) == 1
    assert type(m.embed) is PackedEmbedding and type(m.other) is nn.Embedding and m.other.weight is other
    ids = torch.tensor([[0, 31, 32, 69], [5, 5, 64, 33]])
    assert torch.equal(m.embed(ids), table[ids])  # few ids: looked up one by one
    many = torch.randint(0, 70, (3, 40))  # more than _FEW_IDS: one gather
    assert torch.equal(m.embed(many), table[many])
    assert m.embed(torch.tensor([], dtype=torch.int64)).shape == (0, 48)
    assert not list(m.embed.parameters()) and not list(m.embed.buffers())  # the head holds the rows
    assert set(m.state_dict()) == {"other.weight"}  # the packed copy is not saved (a runtime layout)
    for bad in (torch.tensor([70]), torch.tensor([-1, 3]), torch.cat([many.reshape(-1), torch.tensor([70])])):
        with pytest.raises(IndexError, match="out of range"):
            m.embed(bad)


@needs_kernels
def test_tied_model_loads_with_one_table(tmp_path):
    """A tied checkpoint loads with its embedding reading the packed head, and its logits equal
    those of the same checkpoint loaded on torch's ops (no packing, the table kept)."""
    from quantspec.infer.loader import load_for_inference
    from quantspec.model_zoo.llama import DenseCausalAttention
    from quantspec.model_zoo.tiny import build_tiny_model

    d = build_tiny_model(tmp_path / "tied", "llama", tie_word_embeddings=True)
    lm = load_for_inference(d, tokenizer=False)
    ref = load_for_inference(d, tokenizer=False, policy=DispatchPolicy(cpu_kernels=False)).model
    assert type(lm.model.model.embed_tokens) is PackedEmbedding and type(ref.model.embed_tokens) is nn.Embedding
    ids = torch.tensor([3, 17, 500, 42, 42, 9])
    with torch.no_grad():
        got = lm.model.compute_logits(lm.model(ids, torch.arange(6), DenseCausalAttention(1, 6)))
        want = ref.compute_logits(ref(ids, torch.arange(6), DenseCausalAttention(1, 6)))
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
