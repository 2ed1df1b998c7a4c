"""quantize_model: tensors, per-layer group sizes, ignore patterns, GPTQ schedules, a8w8 scales."""

import pytest
import torch

from quantspec.quant.packing import unpack_int32

from quantspec.calib.ptq import quantize_model
from quantspec.errors import QuantSpecError
from quantspec.model_zoo.checkpoint import load_model
from quantspec.model_zoo.llama import DenseCausalAttention
from quantspec.quant.presets import preset
from quantspec.quant.artifact import linear_from_tensors
from quantspec.quant.gptq import gptq_quantize
from quantspec.quant.primitives import dequantize

torch.set_num_threads(1)

LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def _calib(n=4, S=32, seed=0):
    return torch.randint(3, 512, (n, S), generator=torch.Generator().manual_seed(seed))


def _hidden(model, ids):
    n, S = ids.shape
    with torch.no_grad():
        return model(ids.reshape(-1), torch.arange(S).repeat(n), DenseCausalAttention(n, S))


def test_rtn_int8_codes_and_unquantized_tensors(tiny_qwen2_dir):
    model, _ = load_model(tiny_qwen2_dir)
    orig = {k: v.clone() for k, v in model.state_dict().items()}
    res = quantize_model(model, preset("weight_only_int8"), "rtn")
    t = res.tensors
    for i in range(2):
        for lin in LINEARS:
            name = f"model.layers.{i}.{lin}"
            W = orig[f"{name}.weight"]
            # independent reference: symmetric per-row int8, scale = absmax / 127.5
            scale = W.abs().amax(dim=1, keepdim=True) / 127.5
            q_ref = torch.round(torch.clamp(W / scale, -128, 127)).to(torch.int8)
            # W8A16: 8-bit pack-quantized (what vLLM and SGLang load)
            assert t[f"{name}.weight_packed"].dtype == torch.int32
            assert torch.equal(unpack_int32(t[f"{name}.weight_packed"], 8, q_ref.shape), q_ref)
            torch.testing.assert_close(t[f"{name}.weight_scale"], scale)
            # the model now holds the dequantized weight
            torch.testing.assert_close(model.get_submodule(name).weight, q_ref.float() * scale)
        for b in ("q_proj", "k_proj", "v_proj"):  # qwen2 biases kept as they are
            assert torch.equal(t[f"model.layers.{i}.self_attn.{b}.bias"],
                               orig[f"model.layers.{i}.self_attn.{b}.bias"])
    for name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight",
                 "model.layers.0.input_layernorm.weight"):
        assert torch.equal(t[name], orig[name])
    assert "lm_head.weight_scale" not in t


def test_group_size_resolved_per_layer_and_ignore(tiny_llama_dir):
    model, _ = load_model(tiny_llama_dir)  # hidden 64, intermediate 128
    cfg = preset("weight_only_int4", group_size=128, ignore=("lm_head", "re:.*layers\\.1\\.mlp\\.up_proj"))
    res = quantize_model(model, cfg, "rtn")
    c = res.config
    assert c.weight_args_for("model.layers.0.self_attn.q_proj").group_size == 64  # K = 64
    assert c.weight_args_for("model.layers.0.mlp.down_proj").group_size == 128  # K = 128
    assert res.tensors["model.layers.0.self_attn.q_proj.weight_scale"].shape == (64, 1)
    assert res.tensors["model.layers.0.mlp.down_proj.weight_scale"].shape == (64, 1)
    assert res.tensors["model.layers.0.mlp.gate_proj.weight_packed"].dtype == torch.int32
    # the JSON round trip keeps the per-layer groups
    from quantspec.quant.config import QuantConfig
    back = QuantConfig.from_dict(c.to_dict())
    assert back.weight_args_for("model.layers.1.self_attn.o_proj").group_size == 64
    # ignored: kept in full precision, not quantized
    assert "model.layers.1.mlp.up_proj.weight" in res.tensors
    assert "model.layers.1.mlp.up_proj.weight_packed" not in res.tensors
    assert "model.layers.0.mlp.up_proj.weight_packed" in res.tensors


def test_asym_int4_roundtrip_matches_model_weights(tiny_llama_dir):
    model, _ = load_model(tiny_llama_dir)
    res = quantize_model(model, preset("weight_only_int4", group_size=32, symmetric=False), "rtn")
    name = "model.layers.1.mlp.down_proj"
    lq = linear_from_tensors(res.tensors, name, res.config)
    assert lq.zero_point is not None and lq.zero_point.abs().sum() > 0
    w = dequantize(lq.q, lq.scale, lq.zero_point, lq.args)
    assert torch.equal(w, model.get_submodule(name).weight)


def test_gptq_one_pass_layer0_matches_direct_reference(tiny_llama_dir):
    ids = _calib()
    model, _ = load_model(tiny_llama_dir)
    ref_model, _ = load_model(tiny_llama_dir)
    cfg = preset("weight_only_int4", group_size=32)
    res = quantize_model(model, cfg, "gptq", ids)
    # reference for layer 0's q/k/v: Hessian of input_layernorm(embeddings), one concatenated call
    with torch.no_grad():
        x = ref_model.model.layers[0].input_layernorm(ref_model.model.embed_tokens(ids.reshape(-1)))
    H = 2.0 / x.shape[0] * x.T @ x
    att = ref_model.model.layers[0].self_attn
    W = torch.cat([att.q_proj.weight, att.k_proj.weight, att.v_proj.weight])
    r = gptq_quantize(W, H, res.config.weight_args_for("model.layers.0.self_attn.q_proj"))
    lq = linear_from_tensors(res.tensors, "model.layers.0.self_attn.k_proj", res.config)
    assert torch.equal(lq.q, r.q[64:96])
    torch.testing.assert_close(lq.scale, r.scale[64:96], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("group_size,act_order,observer,ratio", [
    (32, False, "minmax", 0.8), (-1, True, "minmax", 0.8),
    (32, False, "mse", 0.9), (-1, True, "mse", 0.9),  # RTN itself is better with mse
])
def test_gptq_beats_rtn_on_calibration_data(tiny_llama_dir, group_size, act_order, observer, ratio):
    ids = _calib(n=6, S=48, seed=1)
    ref, _ = load_model(tiny_llama_dir)
    target = _hidden(ref, ids)
    errs = {}
    for method in ("rtn", "gptq"):
        m, _ = load_model(tiny_llama_dir)
        quantize_model(m, preset("weight_only_int4", group_size=group_size, weight_observer=observer),
                       method, ids if method == "gptq" else None, act_order=act_order)
        errs[method] = (_hidden(m, ids) - target).pow(2).mean().item()
    assert errs["gptq"] < ratio * errs["rtn"], errs


@pytest.mark.parametrize("quant_type", ["weight_only_fp8", "a8w8_fp8"])
def test_gptq_on_fp8_weights(tiny_llama_dir, quant_type):
    """GPTQ rounds FP8 weights (per-channel scales, E4M3 codes) as it rounds integer ones: layer 0's
    q/k/v codes are `gptq_quantize`'s on the Hessian of their inputs, and the hidden states are
    closer to the float model's than round-to-nearest's."""
    ids = _calib(n=6, S=48, seed=3)
    ref, _ = load_model(tiny_llama_dir)
    target = _hidden(ref, ids)
    cfg = preset(quant_type, activations="dynamic" if quant_type == "a8w8_fp8" else None)
    errs = {}
    for method in ("rtn", "gptq"):
        m, _ = load_model(tiny_llama_dir)
        res = quantize_model(m, cfg, method, ids if method == "gptq" else None)
        errs[method] = (_hidden(m, ids) - target).pow(2).mean().item()
    assert errs["gptq"] < 0.9 * errs["rtn"], errs
    with torch.no_grad():
        x = ref.model.layers[0].input_layernorm(ref.model.embed_tokens(ids.reshape(-1)))
    att = ref.model.layers[0].self_attn
    W = torch.cat([att.q_proj.weight, att.k_proj.weight, att.v_proj.weight])
    r = gptq_quantize(W, 2.0 / x.shape[0] * x.T @ x, res.config.weight_args_for("model.layers.0.self_attn.q_proj"))
    lq = linear_from_tensors(res.tensors, "model.layers.0.self_attn.k_proj", res.config)
    assert lq.q.dtype == torch.float8_e4m3fn and torch.equal(lq.q.float(), r.q[64:96].float())


def test_gptq_two_pass_schedule_also_beats_rtn(tiny_llama_dir):
    ids = _calib(n=6, S=48, seed=2)
    ref, _ = load_model(tiny_llama_dir)
    target = _hidden(ref, ids)
    m1, _ = load_model(tiny_llama_dir)
    m2, _ = load_model(tiny_llama_dir)
    m3, _ = load_model(tiny_llama_dir)
    cfg = preset("weight_only_int4", group_size=32)
    quantize_model(m1, cfg, "gptq", ids)  # one pass
    quantize_model(m2, cfg, "gptq", ids, max_pass_tokens=10, batch_size=4)  # mini-batched
    quantize_model(m3, cfg, "rtn")
    e1, e2, e3 = ((_hidden(m, ids) - target).pow(2).mean().item() for m in (m1, m2, m3))
    assert e2 < 0.8 * e3 and e1 < 0.8 * e3, (e1, e2, e3)
    # layer 0's q/k/v see the same inputs in both schedules → the same codes, up to rare flips
    # from the Hessian being summed in a different order (one batch vs mini-batches)
    w1, w2 = (m.model.layers[0].self_attn.q_proj.weight for m in (m1, m2))
    assert ((w1 - w2).abs() > 1e-5).float().mean() < 0.01


def test_a8w8_needs_input_scales(tiny_llama_dir):
    model, _ = load_model(tiny_llama_dir)
    with pytest.raises(QuantSpecError, match="calibrate"):
        quantize_model(model, preset("a8w8"), "rtn")
    names = [f"model.layers.{i}.{lin}" for i in range(2) for lin in LINEARS]
    scales = {n: 0.05 for n in names}
    res = quantize_model(model, preset("a8w8"), "rtn", input_scales=scales)
    assert torch.equal(res.tensors["model.layers.1.mlp.down_proj.input_scale"], torch.tensor([0.05]))
    model, _ = load_model(tiny_llama_dir)
    res = quantize_model(model, preset("a8w8_fp8"), "rtn", input_scales=scales)
    assert res.tensors["model.layers.0.self_attn.q_proj.weight"].dtype == torch.float8_e4m3fn


def test_bad_requests(tiny_llama_dir):
    model, _ = load_model(tiny_llama_dir)
    with pytest.raises(QuantSpecError, match="unknown method"):
        quantize_model(model, preset("weight_only_int8"), "smoothrounding")
    with pytest.raises(QuantSpecError, match="--dataset"):
        quantize_model(model, preset("weight_only_int8"), "gptq")
    with pytest.raises(QuantSpecError, match="no Linear"):
        quantize_model(model, preset("weight_only_int8", ignore=("re:.*",)), "rtn")
