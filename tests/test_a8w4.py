"""int4 weights with 8-bit inputs quantized per token at run time: `quantize --quant-type a8w4`
(int8 inputs, compressed-tensors' W4A8) and `a8w4_fp8` (FP8 inputs, W4AFP8).

References: compressed-tensors' own presets (the config quantspec writes), transformers' run of
the artifact (compressed-tensors decompresses the weights and quantizes the inputs), Linear by
Linear, and the weight_only_int4 artifact of the same run (the same codes, float inputs).
Reading compressed-tensors' own W4A8 / W4AFP8 checkpoints: tests/test_interop_compressed_tensors.py;
the kernel paths: tests/infer/test_quant_linear.py.
"""

import json

import pytest
import torch

from artifact_files import hf_logits, tensors as _tensors
from quantspec import api
from quantspec.errors import QuantSpecError
from quantspec.infer.loader import load_for_inference
from quantspec.infer.quant_linear import QuantLinear
from quantspec.model_zoo.attention import DenseCausalAttention

ct_q = pytest.importorskip("compressed_tensors.quantization", reason="compressed-tensors is not installed")

IDS = torch.tensor([[7, 300, 41, 12, 99, 5, 260, 17, 33, 2, 150, 8, 71]])
PRESETS = {"a8w4": "W4A8", "a8w4_fp8": "W4AFP8"}


def _logits(lm) -> torch.Tensor:
    T = IDS.shape[1]
    with torch.no_grad():
        return lm.model.compute_logits(lm.model(IDS[0], torch.arange(T), DenseCausalAttention(1, T)))


def _args(d: dict, *drop: str) -> dict:
    """compressed-tensors' view of quantization args (its defaults filled in), less `drop`."""
    return {k: v for k, v in ct_q.QuantizationArgs(**d).model_dump().items() if k not in drop}


@pytest.mark.parametrize("quant_type", list(PRESETS))
def test_artifact_is_compressed_tensors_preset_and_runs_as_transformers_does(tiny_llama_dir, tmp_path, quant_type):
    from compressed_tensors.quantization.quant_scheme import preset_name_to_scheme

    art = api.quantize(str(tiny_llama_dir), quant_type, tmp_path / quant_type, group_size=32, target="transformers")
    plain = api.quantize(str(tiny_llama_dir), "weight_only_int4", tmp_path / "w4", group_size=32)
    group = json.loads((art / "config.json").read_text())["quantization_config"]["config_groups"]["group_0"]
    theirs = preset_name_to_scheme(PRESETS[quant_type], ["Linear"])
    assert _args(group["input_activations"]) == _args(theirs.input_activations.model_dump())
    assert _args(group["weights"], "group_size", "observer") == \
        _args(theirs.weights.model_dump(), "group_size", "observer")
    assert group["format"] == "pack-quantized"
    ours, w4 = _tensors(art), _tensors(plain)
    assert not any(k.endswith("input_scale") for k in ours)  # scales per token at run time
    for k, t in w4.items():  # the same codes and scales as weight-only int4
        assert torch.equal(ours[k], t), k

    # transformers' own run of the artifact, Linear by Linear: each quantspec layer given the
    # input transformers gave its twin returns transformers' output (one rounding of an input
    # code, from a last-bit difference upstream, moves a whole run's logits by ~0.05, so the
    # layers are compared, not the logits)
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(art), dtype=torch.float32)
    seen = {}
    for n, mod in hf.named_modules():
        if isinstance(mod, torch.nn.Linear) and n != "lm_head":
            mod.register_forward_hook(lambda m, a, o, n=n: seen.__setitem__(n, (a[0][0].detach(), o[0].detach())))
    with torch.no_grad():
        hf(IDS)
    ours_lm, plain_lm = (dict(load_for_inference(p, tokenizer=False, fuse=False).model.named_modules())
                         for p in (art, plain))
    assert len(seen) == 14
    for n, (x, y) in seen.items():
        assert ours_lm[n].input_args is not None
        torch.testing.assert_close(ours_lm[n](x), y, rtol=1e-5, atol=1e-6)
        assert (plain_lm[n](x) - y).abs().max() > 1e-3  # teeth: the same codes with float inputs
    # and end to end, closer to transformers than the float-input run of the same codes
    lm = load_for_inference(art, tokenizer=False)
    want = hf_logits(art, IDS)
    assert (_logits(lm) - want).abs().max() < 0.5 * (_logits(load_for_inference(plain, tokenizer=False)) - want).abs().max()


def test_auto_dtype_runs_the_int4_kernels_in_bf16(tiny_llama_dir, tmp_path):
    """`--dtype auto` on CPU: bf16 for W4A8 / W4AFP8, as for weight-only int4 (the same int4 kernels),
    fp32 for int8 weights with int8 inputs (the int8 GEMM path)."""
    from quantspec.infer.loader import auto_dtype

    for qt, kw, want in (("a8w4", {}, torch.bfloat16), ("a8w4_fp8", {}, torch.bfloat16),
                         ("weight_only_int4", {}, torch.bfloat16), ("a8w8", dict(activations="dynamic"), torch.float32)):
        art = api.quantize(str(tiny_llama_dir), qt, tmp_path / qt, group_size=32, target="quantspec", **kw)
        assert auto_dtype(art) == want, qt


def test_decoder_plans_leave_w4a8_layers_to_the_layer(tiny_llama_dir, tmp_path):
    """The CPU decode plans run a layer's int4 kernel on x as given, so they take weight-only int4
    layers and leave W4A8 ones to `QuantLinear` (which quantizes x first)."""
    art = api.quantize(str(tiny_llama_dir), "a8w4", tmp_path / "a", group_size=32, target="quantspec")
    plain = api.quantize(str(tiny_llama_dir), "weight_only_int4", tmp_path / "w", group_size=32)
    for path, planned in ((art, False), (plain, True)):
        lm = load_for_inference(path, tokenizer=False, dtype=torch.bfloat16)
        layers = [m for m in lm.model.modules() if isinstance(m, QuantLinear)]
        plans = [m.prepared.plan_linear(m, torch.bfloat16) for m in layers if hasattr(m.prepared, "plan_linear")]
        assert plans and all((p is not None) == planned for p in plans)


def test_gptq_and_a_layer_type(tiny_llama_dir, tmp_path):
    """GPTQ rounds a8w4's weights as it rounds weight_only_int4's; a8w4 is a layer type beside a
    weight-only model (the output head here), its inputs per token."""
    data = tmp_path / "d.txt"
    data.write_text(" ".join(str(i) for i in range(2000)))
    kw = dict(group_size=32, method="gptq", dataset=str(data), num_samples=4, seq_len=32)
    a = api.quantize(str(tiny_llama_dir), "a8w4", tmp_path / "a", target="quantspec", **kw)
    w = api.quantize(str(tiny_llama_dir), "weight_only_int4", tmp_path / "w", **kw)
    ours, w4 = _tensors(a), _tensors(w)
    assert all(torch.equal(ours[k], t) for k, t in w4.items() if k.endswith("weight_packed"))
    mixed = api.quantize(str(tiny_llama_dir), "weight_only_int8", tmp_path / "m", target="quantspec",
                         layer_quant_types=("re:.*mlp\\.down_proj$=a8w4",), group_size=32)
    lm = load_for_inference(mixed, tokenizer=False, fuse=False)
    kinds = {n.rsplit(".", 1)[-1]: (m.weight_args.num_bits, m.input_args is not None)
             for n, m in lm.model.named_modules() if isinstance(m, QuantLinear)}
    assert kinds["down_proj"] == (4, True) and kinds["up_proj"] == (8, False)


@pytest.mark.parametrize("quant_type,kw,named", [
    ("a8w4", dict(activations="static"), "--activations dynamic"),
    ("a8w4_fp8", dict(symmetric=False, target="vllm"), "drop --asym"),
    ("a8w4", dict(method="awq", target="quantspec"), "--dataset"),  # AWQ takes per-token inputs: data needed
    ("a8w4", dict(), "--target"),  # portable: SGLang has no such Linear scheme, vLLM sets the inputs aside
    ("a8w4", dict(target="vllm"), "a8w4_fp8"),
    ("a8w4_fp8", dict(target="sglang"), "--target vllm"),
])
def test_refusals_name_the_fix(tiny_llama_dir, tmp_path, quant_type, kw, named):
    with pytest.raises(QuantSpecError) as e:
        api.quantize(str(tiny_llama_dir), quant_type, tmp_path / "x", **kw)
    assert named in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "x").exists()


def _with_outlier_channels(src, dst):
    """`src` with four input channels of every norm scaled 40× (the channel outliers SmoothQuant
    is for; the float model's function changes, which both runs below share)."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    t = load_file(str(dst / "model.safetensors"))
    for k in t:
        if k.endswith("layernorm.weight"):
            t[k][:4] *= 40
    save_file(t, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize("quant_type,kw", [("a8w4", {}), ("a8w8", dict(activations="dynamic"))])
def test_smoothquant_beside_inputs_quantized_per_token(tiny_llama_dir, calibration_table, tmp_path, quant_type, kw):
    """`--smoothquant-alpha A --calib T` beside per-token inputs: each norm takes γ / s with s from
    the table's channel ranges (`quant.smoothquant`), so the outlier channels do not set every
    token's int8 step: the logits are closer to the float model's than without it."""
    from quantspec.quant.smoothquant import smoothquant_scales

    src = _with_outlier_channels(tiny_llama_dir, tmp_path / "src")
    table = calibration_table(src)
    base = dict(group_size=32, target="quantspec", **kw)
    plain = api.quantize(str(src), quant_type, tmp_path / "plain", **base)
    smooth = api.quantize(str(src), quant_type, tmp_path / "smooth", calib=str(table), smoothquant_alpha=0.5, **base)
    ours, source = _tensors(smooth), _tensors(src)
    assert json.loads((smooth / "quantspec.json").read_text())["provenance"]["calibration"]["smoothquant_alpha"] == 0.5
    # the first norm: γ / s, s = max|X_j|^α / max|W_:,j|^(1-α) over q / k / v's columns
    from quantspec.calib.tables import read_table

    x_max = read_table(table).input_channel_absmax("model.layers.0.self_attn.q_proj")
    w = torch.cat([source[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv"])
    s = smoothquant_scales(x_max, w.abs().amax(0), 0.5)
    g = "model.layers.0.input_layernorm.weight"
    torch.testing.assert_close(ours[g], source[g] / s, rtol=1e-5, atol=1e-6)
    fp32 = _logits(load_for_inference(src, tokenizer=False))
    err = {p.name: float((_logits(load_for_inference(p, tokenizer=False)) - fp32).abs().mean()) for p in (plain, smooth)}
    assert err["smooth"] < 0.8 * err["plain"], err


def test_awq_folds_its_factors_before_the_per_token_quantizer(tiny_llama_dir, tmp_path):
    """AWQ (+ GPTQ) on a8w4: the weights, norms and codes are weight-only int4's of the same run
    (the factors come from float inputs either way), the inputs quantized per token after them."""
    data = tmp_path / "d.txt"
    data.write_text(" ".join(str(i) for i in range(2000)))
    kw = dict(group_size=32, method="awq+gptq", act_order=True, dataset=str(data), num_samples=4, seq_len=32)
    a = api.quantize(str(tiny_llama_dir), "a8w4", tmp_path / "a", target="quantspec", **kw)
    w = api.quantize(str(tiny_llama_dir), "weight_only_int4", tmp_path / "w", **kw)
    ours, w4, src = _tensors(a), _tensors(w), _tensors(tiny_llama_dir)
    assert ours.keys() == w4.keys() and all(torch.equal(ours[k], t) for k, t in w4.items())
    g = "model.layers.0.input_layernorm.weight"
    assert not torch.equal(ours[g], src[g])  # the factors are folded into the norm
    lm = load_for_inference(a, tokenizer=False)
    assert all(m.input_args is not None for m in lm.model.modules() if isinstance(m, QuantLinear))
