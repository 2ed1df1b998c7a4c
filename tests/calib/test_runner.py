"""The layer runner reproduces the full forward, feeds hooks, supports sequential and offload."""

import pytest
import torch

from quantspec.calib.runner import LayerRunner, run_layers
from quantspec.errors import QuantSpecError
from quantspec.model_zoo.checkpoint import build_model, load_model, read_config
from quantspec.model_zoo.llama import DenseCausalAttention, ModelArgs

torch.set_num_threads(1)


def _ids(n, S, vocab, seed=0):
    return torch.randint(0, vocab, (n, S), generator=torch.Generator().manual_seed(seed))


def _full_forward(model, ids):
    n, S = ids.shape
    pos = torch.arange(S).repeat(n)
    return model(ids.reshape(-1), pos, DenseCausalAttention(n, S)).view(n, S, -1)


@pytest.mark.parametrize("arch_dir", ["tiny_llama_dir", "tiny_qwen2_dir", "tiny_qwen3_dir"])
def test_runner_reproduces_full_forward(arch_dir, request):
    model, _ = load_model(request.getfixturevalue(arch_dir))
    ids = _ids(5, 19, model.args.vocab_size)
    with torch.no_grad():
        ref = _full_forward(model, ids)
    out = run_layers(model, ids, batch_size=5)
    assert torch.equal(out, ref)
    # mini-batches of 2 samples (5 = 2 + 2 + 1): same numbers up to GEMM blocking
    out2 = run_layers(model, ids, batch_size=2)
    torch.testing.assert_close(out2, ref, rtol=1e-5, atol=1e-5)


def test_hooks_see_layer_inputs_and_kv(tiny_llama_dir):
    model, _ = load_model(tiny_llama_dir)
    ids = _ids(3, 11, model.args.vocab_size, seed=1)
    seen, kv = {}, []

    def before(step):
        h = step.layer.self_attn.q_proj.register_forward_pre_hook(
            lambda m, a: seen.setdefault(step.index, []).append(a[0].clone()))
        return h.remove

    def kv_hook(layer, k, v):
        kv.append((layer, tuple(k.shape), tuple(v.shape)))

    run_layers(model, ids, before=before, kv_hook=kv_hook, batch_size=2)
    # reference: layer 1's q_proj input is input_layernorm(output of layer 0)
    with torch.no_grad():
        x0 = model.model.embed_tokens(ids).view(-1, model.args.hidden_size)
        pos = torch.arange(11).repeat(3)
        cos, sin = model.cos[pos], model.sin[pos]
        x1 = model.model.layers[0](x0, cos, sin, DenseCausalAttention(3, 11))
        ref = model.model.layers[1].input_layernorm(x1)
    got = torch.cat(seen[1])
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    assert [k[0] for k in kv] == [0, 0, 1, 1]  # two mini-batches per layer
    assert kv[0][1] == (2, 11, model.args.num_kv_heads, model.args.head_dim)
    assert kv[1][1][0] == 1


def test_sequential_mode_propagates_modified_layer(tiny_llama_dir):
    ids = _ids(2, 9, 512, seed=2)
    model, _ = load_model(tiny_llama_dir)

    def after(step):
        if step.index == 0:
            step.layer.mlp.down_proj.weight.mul_(0.5)

    seq = run_layers(model, ids, after=after, sequential=True)
    with torch.no_grad():
        ref_modified = _full_forward(model, ids)  # the model now holds the modified layer 0
    torch.testing.assert_close(seq, ref_modified, rtol=1e-6, atol=1e-6)

    model2, _ = load_model(tiny_llama_dir)
    nonseq = run_layers(model2, ids, after=after, sequential=False)
    with torch.no_grad():
        ref_orig = _full_forward(load_model(tiny_llama_dir)[0], ids)
    torch.testing.assert_close(nonseq, ref_orig, rtol=1e-6, atol=1e-6)
    assert not torch.allclose(nonseq, seq)


def test_offload_mode_loads_one_layer_at_a_time(tiny_llama_dir):
    full, _ = load_model(tiny_llama_dir)
    ids = _ids(3, 13, full.args.vocab_size, seed=3)
    with torch.no_grad():
        ref = _full_forward(full, ids)
    meta = build_model(ModelArgs.from_hf_config(read_config(tiny_llama_dir)), device="meta")
    materialised = []
    runner = LayerRunner(meta, ids, weights=tiny_llama_dir)
    for step in runner:
        materialised.append(sum(p.device.type != "meta" for layer in meta.model.layers
                                for p in layer.parameters()))
        step.forward()
    torch.testing.assert_close(runner.hidden, ref, rtol=1e-6, atol=1e-6)
    per_layer = sum(1 for _ in meta.model.layers[0].parameters())
    assert materialised == [per_layer, per_layer]  # only the current layer is in memory
    assert all(p.device.type == "meta" for p in meta.model.layers.parameters())


def test_nan_names_the_layer(tiny_llama_dir):
    model, _ = load_model(tiny_llama_dir)
    with torch.no_grad():
        model.model.layers[1].mlp.up_proj.weight[0, 0] = float("nan")
    with pytest.raises(QuantSpecError, match=r"model\.layers\.1 produced NaN"):
        run_layers(model, _ids(2, 5, 512))


def test_bad_inputs(tiny_llama_dir):
    model, _ = load_model(tiny_llama_dir)
    with pytest.raises(QuantSpecError, match="LongTensor"):
        LayerRunner(model, torch.zeros(2, 3))
    with pytest.raises(QuantSpecError, match="outside"):
        LayerRunner(model, torch.full((1, 3), 10_000))
    meta = build_model(model.args, device="meta")
    with pytest.raises(QuantSpecError, match="weights="):
        LayerRunner(meta, _ids(1, 3, 512))
