"""The fused small ops of a decoder layer (`kernels/fused.py`) against the torch modules they
replace, and `infer/cuda/layers.fused_stack` against the modules' layer loop."""

import pytest
import torch

from quantspec.errors import QuantSpecError
from quantspec.kernels import add_rms_norm, add_rms_norm_ref, rope_qk_, rope_qk_ref, silu_mul, silu_mul_ref

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# one rounding step of each dtype, relative (the norm's sum order and SiLU's exponential differ)
TOL = {torch.float32: 1e-5, torch.float16: 2 ** -10, torch.bfloat16: 2 ** -7}


def _randn(*shape, dtype, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("D", [96, 256])
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_is_the_residual_add_and_the_norm_module(dtype, with_residual, D, same_rounding):
    """The residual stream is the modules' `x + residual` bit for bit; the normalized row is
    the RMSNorm module's within one rounding step (the sum of squares is taken in another order)."""
    x = _randn(5, D, dtype=dtype, seed=1) * 3
    r = _randn(5, D, dtype=dtype, seed=2) if with_residual else None
    w = (_randn(D, dtype=dtype, seed=3) * 0.2 + 1).to(dtype)
    out, h = add_rms_norm(x, r, w, 1e-5)
    ref_out, ref_h = add_rms_norm_ref(x, r, w, 1e-5)
    same_rounding(h, ref_h)
    assert out.dtype == dtype and out.shape == x.shape
    torch.testing.assert_close(out.float(), ref_out.float(), rtol=2 * TOL[dtype], atol=2 * TOL[dtype])


@pytest.mark.parametrize("hd", [64, 80])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_rotates_q_and_k_in_place_as_apply_rope(dtype, hd):
    """q and k heads of a fused q/k/v output are rotated in place with `apply_rope`'s numbers
    (each product and the sum rounded to the dtype, no fused multiply-add): bit for bit, but
    under the CPU interpreter in bf16, which truncates each of the three roundings (within a
    rounding step of the inputs' scale); v is untouched."""
    T, H, KV = 4, 3, 1
    x = _randn(T, H + 2 * KV, hd, dtype=dtype, seed=4)
    pos = torch.arange(7, 7 + T, dtype=torch.float32)
    inv = 1.0 / (10000 ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
    ang = torch.cat([pos[:, None] * inv[None, :]] * 2, dim=-1)
    cos, sin = ang.cos().to(dtype), ang.sin().to(dtype)
    ref = rope_qk_ref(x, H + KV, cos, sin)
    y = x.clone()
    assert rope_qk_(y, H + KV, cos, sin) is y or torch.cuda.is_available()
    if dtype == torch.bfloat16 and not torch.cuda.is_available():
        torch.testing.assert_close(y.float(), ref.float(), rtol=0, atol=2 ** -6 * float(x.float().abs().max()))
    else:
        assert torch.equal(y, ref)
    assert torch.equal(y[:, H + KV:], x[:, H + KV:])


@pytest.mark.parametrize("I", [40, 1500])
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_is_the_module(dtype, I):
    gate_up = _randn(3, 2 * I, dtype=dtype, seed=5) * 4
    y = silu_mul(gate_up)
    assert y.shape == (3, I) and y.dtype == dtype
    torch.testing.assert_close(y.float(), silu_mul_ref(gate_up).float(), rtol=2 * TOL[dtype], atol=2 * TOL[dtype])


def test_fused_ops_refuse_bad_shapes():
    x = torch.randn(2, 8)
    with pytest.raises(QuantSpecError, match="weight"):
        add_rms_norm(x, None, torch.ones(6), 1e-5)
    with pytest.raises(QuantSpecError, match="residual has shape"):
        add_rms_norm(x, torch.randn(3, 8), torch.ones(8), 1e-5)
    with pytest.raises(QuantSpecError, match="weight has dtype float16"):
        add_rms_norm(x, None, torch.ones(8, dtype=torch.float16), 1e-5)
    with pytest.raises(QuantSpecError, match="cos has shape"):
        rope_qk_(torch.randn(2, 3, 8), 2, torch.randn(2, 6), torch.randn(2, 6))
    with pytest.raises(QuantSpecError, match="heads=4"):
        rope_qk_(torch.randn(2, 3, 8), 4, torch.randn(2, 8), torch.randn(2, 8))
    with pytest.raises(QuantSpecError, match="even"):
        silu_mul(torch.randn(2, 7))


# the tiny models of the fused-stack tests: Llama, Qwen3 (per-head q / k norms), a Phi-3 whose
# rotary embedding turns half of each head (partial_rotary_factor, as Phi-4-mini's 3/4) and a
# SmolLM3 whose second layer takes none (NoPE)
ARCHS = {"llama": {}, "qwen3": {}, "phi3-partial": {"rope_scaling": {"partial_rotary_factor": 0.5}}, "smollm3": {}}


def _tiny(path, arch):
    from quantspec.model_zoo.tiny import build_tiny_model

    return build_tiny_model(path, arch.split("-")[0], hidden=128, heads=2, kv_heads=1, intermediate=256,
                            num_layers=2, **ARCHS[arch])


@pytest.mark.parametrize("arch", list(ARCHS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_stack_computes_the_layers(tmp_path, dtype, arch):
    """`fused_stack` over a tiny model's (`ARCHS`) fused projections
    gives the modules' layer loop's last hidden states (within a few roundings of the dtype, over
    two layers), for a prefill and a decode row; the layers are `fusable` only with fused
    projections and norms in the dtype."""
    from quantspec.infer.cuda.layers import fusable, fused_stack
    from quantspec.infer.fuse import fuse_projections
    from quantspec.model_zoo.checkpoint import load_model
    from quantspec.model_zoo.llama import DenseCausalAttention

    device = "cuda" if torch.cuda.is_available() else "cpu"
    net, _ = load_model(_tiny(tmp_path / "m", arch), dtype=dtype, device=device)
    layers = net.model.layers
    assert not fusable(layers, dtype)
    fuse_projections(net)
    assert fusable(layers, dtype) and not fusable(layers, torch.float16)
    T = 9
    net.setup_rope(T, device=device)
    ids = torch.randint(net.args.vocab_size, (T,), generator=torch.Generator().manual_seed(6)).to(device)
    x = net.model.embed_tokens(ids)
    cos, sin = net.cos[:T].to(dtype), net.sin[:T].to(dtype)
    with torch.inference_mode():
        ref = x
        for layer in layers:
            ref = layer(ref, cos, sin, DenseCausalAttention(1, T))
        got = fused_stack(layers, x, cos, sin, DenseCausalAttention(1, T), False)
    scale = float(ref.float().abs().max())
    assert float((got.float() - ref.float()).abs().max()) <= 8 * TOL[dtype] * scale


@pytest.mark.parametrize("arch", list(ARCHS))
def test_cuda_runtime_with_fused_ops_keeps_greedy_and_speculation(tmp_path, monkeypatch, arch):
    """The CUDA backend's runtime with `cuda_fused_ops` (on a machine without CUDA, its eager
    fused path under the interpreter; with CUDA, graphs too), for each of `ARCHS`: every step goes through the fused layers, greedy tokens are the modules' (fp32), and
    n-gram speculation over three sequences with different draft counts gives the tokens of plain
    decoding."""
    from quantspec.infer.cuda import graphs, prepare
    from quantspec.infer.dispatch import DispatchPolicy
    from quantspec.infer.engine import Engine, EngineConfig
    from quantspec.infer.sampler import SamplingParams
    from quantspec.infer.spec.proposers import ReferenceProposer
    from quantspec.model_zoo.checkpoint import load_model

    device = "cuda" if torch.cuda.is_available() else "cpu"
    d = _tiny(tmp_path / "m", arch)
    calls = []
    real = graphs.fused_stack
    monkeypatch.setattr(graphs, "fused_stack", lambda *a: calls.append(a[1].shape[0]) or real(*a))
    gen = torch.Generator().manual_seed(5)
    seg = [torch.randint(200, (12,), generator=gen).tolist() for _ in range(3)]
    prompts = [(s * 4)[: 20 + 7 * i] for i, s in enumerate(seg)]  # repeating: n-gram drafts match

    def tokens(fused: bool, proposer=None, k=0):
        net, _ = load_model(d, device=device)
        runtime = prepare(net, torch.device(device), DispatchPolicy(cuda_fused_ops=fused))
        assert (runtime.stack is not None and runtime.stack.fused) == fused
        eng = Engine(net, EngineConfig(max_batch_size=3, max_length=96, spec_max_draft_tokens=k),
                     eos_token_ids=[], proposer=proposer, runtime=runtime)
        seqs = [eng.add_request(p, SamplingParams(max_new_tokens=12)) for p in prompts]
        eng.run()
        return [list(s.output_ids) for s in seqs], runtime.stack

    modules, _ = tokens(False)
    assert not calls
    plain, stack = tokens(True)
    assert plain == modules and len(calls) + stack.replays >= 12  # eager fused steps, or replays of them
    assert tokens(True, ReferenceProposer(2, 4), k=4)[0] == plain
