"""A quantized output head: `quantize --layer-quant-type lm_head=TYPE`.

The head is quantized only where a target names it; a tied head is untied (the embedding stays
float, `tie_word_embeddings` false); GPTQ calibrates it on the last layer's normed outputs, AWQ and
RTN round it. References: the source checkpoint's own tensors (the embedding, copied bit for bit;
the head's weight, rounded by compressed-tensors' own decompression to what quantspec stored),
the library's GPTQ on the Hessian of the inference path's hidden states, transformers' logits on
the artifact, and the same run without the head quantized (the decoder layers' tensors are
identical).
"""

import json
from pathlib import Path

import pytest
import torch

from artifact_files import hf_logits, tensors as _tensors
from quantspec import api
from quantspec.errors import QuantSpecError
from quantspec.model_zoo.attention import DenseCausalAttention
from quantspec.infer.loader import load_for_inference
from quantspec.model_zoo.tiny import TINY_CORPUS

pytest.importorskip("compressed_tensors.quantization", reason="compressed-tensors is not installed")

IDS = torch.tensor([[7, 300, 41, 12, 99, 5, 260, 17, 33, 2, 150, 8, 71]])


def _our_logits(path: Path) -> torch.Tensor:
    lm = load_for_inference(path, tokenizer=False)
    with torch.no_grad():
        return lm.model.compute_logits(lm.model(IDS[0], torch.arange(IDS.shape[1]), DenseCausalAttention(1, IDS.shape[1])))


@pytest.mark.parametrize("head_type,group", [("weight_only_int8", None), ("weight_only_int4", 32)])
def test_tied_head_is_untied_and_quantized(tied_llama_dir, tmp_path, ct_decompressed, head_type, group):
    art = api.quantize(str(tied_llama_dir), "weight_only_int4", tmp_path / "a", group_size=32,
                       layer_quant_types=(f"lm_head={head_type}",))
    plain = api.quantize(str(tied_llama_dir), "weight_only_int4", tmp_path / "plain", group_size=32)
    cfg = json.loads((art / "config.json").read_text())
    assert cfg["tie_word_embeddings"] is False
    assert "lm_head" not in cfg["quantization_config"]["ignore"]
    ours, src = _tensors(art), _tensors(tied_llama_dir)
    assert torch.equal(ours["model.embed_tokens.weight"], src["model.embed_tokens.weight"])
    assert "lm_head.weight" not in ours and "lm_head.weight_packed" in ours
    same = _tensors(plain)  # the decoder layers are quantized as without the head
    for k, t in same.items():
        if k.startswith("model.layers."):
            assert torch.equal(ours[k], t), k
    # the stored head decompresses (compressed-tensors' own compressor) to the embedding rounded
    # to the head's grid: within half a step of every weight the grid holds (int4's MSE observer
    # clips a group's largest weights)
    dec, names = ct_decompressed(art, tmp_path / "dec")
    assert "lm_head" in names
    w, e = _tensors(dec)["lm_head.weight"].float(), src["model.embed_tokens.weight"].float()
    scale = ours["lm_head.weight_scale"].float()
    step = scale.repeat_interleave(group, dim=1) if group else scale
    inside = e.abs() <= (7 if group else 127) * step
    assert inside.float().mean() > 0.9
    assert ((w - e).abs() <= step / 2 + 1e-6)[inside].all()
    assert not torch.equal(w, e)
    # transformers runs the artifact as quantspec does
    torch.testing.assert_close(_our_logits(art), hf_logits(art, IDS), rtol=1e-4, atol=1e-4)


def test_head_under_gptq_is_calibrated_on_the_last_layer(tiny_llama_dir, tmp_path):
    from transformers import AutoTokenizer

    from quantspec.calib.data import build_calibration_batches, load_calibration_texts
    from quantspec.quant.artifact import linear_from_tensors, load_safetensors, read_quant_config
    from quantspec.quant.gptq import HessianAccumulator, gptq_quantize, rtn_quantize
    from quantspec.quant.primitives import dequantize

    data = tmp_path / "calib.txt"
    data.write_text(TINY_CORPUS)
    head = ("lm_head=weight_only_int4",)
    opts = dict(group_size=32, dataset=str(data), num_samples=4, seq_len=32)
    gptq = api.quantize(str(tiny_llama_dir), "weight_only_int4", tmp_path / "gptq", method="gptq",
                        layer_quant_types=head, **opts)
    plain = api.quantize(str(tiny_llama_dir), "weight_only_int4", tmp_path / "plain", method="gptq", **opts)
    ours, same = _tensors(gptq), _tensors(plain)
    for k, t in same.items():  # the head follows the layers: they are quantized as without it
        if k.startswith("model.layers."):
            assert torch.equal(ours[k], t), k
    ptq = json.loads((gptq / "quantspec.json").read_text())["provenance"]["ptq"]
    assert "rtn_linears" not in ptq and ptq["gptq_loss_total"] > 0
    # the reference: GPTQ (the library's) on the Hessian of the calibration windows' final normed
    # hidden states, run through the artifact without the head by the inference path
    tok = AutoTokenizer.from_pretrained(str(tiny_llama_dir))
    windows = build_calibration_batches(load_calibration_texts(str(data)), tok, 4, 32, 0)
    lm = load_for_inference(plain, tokenizer=False)
    with torch.no_grad():
        x = torch.cat([lm.model.model.norm(lm.model(w, torch.arange(len(w)), DenseCausalAttention(1, len(w))))
                       for w in windows]).float()
    acc = HessianAccumulator(x.shape[1])
    acc.update(x)
    w = _tensors(tiny_llama_dir)["lm_head.weight"].float()
    qc = read_quant_config(gptq)
    want = gptq_quantize(w.clone(), acc.take(), qc.weight_args_for("lm_head"))
    got = linear_from_tensors(load_safetensors(gptq), "lm_head", qc)
    assert (got.q == want.q).float().mean() > 0.999
    err = lambda wq: float(((x @ (w - wq).T) ** 2).sum())  # noqa: E731 — GPTQ's objective
    e_got = err(dequantize(got.q, got.scale, got.zero_point, got.args, dtype=torch.float32))
    assert e_got == pytest.approx(err(want.weight_dq), rel=1e-3)
    assert e_got < 0.8 * err(rtn_quantize(w.clone(), qc.weight_args_for("lm_head")).weight_dq)
    torch.testing.assert_close(_our_logits(gptq), hf_logits(gptq, IDS), rtol=1e-4, atol=1e-4)


def test_head_under_awq_is_rounded_to_nearest(tiny_llama_dir, tmp_path):
    data = tmp_path / "calib.txt"
    data.write_text(TINY_CORPUS)
    art = api.quantize(str(tiny_llama_dir), "weight_only_int4", tmp_path / "a", group_size=32, method="awq",
                       dataset=str(data), num_samples=4, seq_len=32, layer_quant_types=("lm_head=weight_only_int8",))
    w = _tensors(tiny_llama_dir)["lm_head.weight"].float()
    s = (w.abs().amax(1, keepdim=True) / 127.5).clamp_min(torch.finfo(torch.float32).eps)  # (q_max - q_min) / 2
    assert torch.allclose(_tensors(art)["lm_head.weight_scale"].float(), s, rtol=1e-6)
    assert json.loads((art / "quantspec.json").read_text())["provenance"]["ptq"]["rtn_linears"] == ["lm_head"]


def test_only_a_target_naming_the_head_quantizes_it(tiny_llama_dir, tmp_path):
    art = api.quantize(str(tiny_llama_dir), "weight_only_int4", tmp_path / "a", group_size=32,
                       layer_quant_types=(r"re:.*mlp\.down_proj$=weight_only_int8",))
    assert "lm_head.weight" in _tensors(art)
    assert json.loads((art / "config.json").read_text())["quantization_config"]["ignore"] == ["lm_head"]


def test_ignoring_the_head_and_naming_it_is_refused(tiny_llama_dir, tmp_path):
    with pytest.raises(QuantSpecError, match="--ignore lm_head keeps the head float"):
        api.quantize(str(tiny_llama_dir), "weight_only_int4", tmp_path / "a", ignore=("lm_head",),
                     layer_quant_types=("lm_head=weight_only_int8",))
    assert not (tmp_path / "a").exists()


def test_block_scales_on_the_head_are_refused_for_the_engines(tiny_llama_dir, tmp_path):
    opts = dict(activations="dynamic", weight_block=32, layer_quant_types=("lm_head=a8w8_fp8",))
    with pytest.raises(QuantSpecError, match=r"--target portable: vLLM refused because its output-head loader"):
        api.quantize(str(tiny_llama_dir), "a8w8_fp8", tmp_path / "a", **opts)
    assert not (tmp_path / "a").exists()
    art = api.quantize(str(tiny_llama_dir), "a8w8_fp8", tmp_path / "b", target="quantspec", **opts)
    assert list(_tensors(art)["lm_head.weight_scale"].shape) == [512 // 32, 64 // 32]
    assert _our_logits(art).shape == (IDS.shape[1], 512)


def test_data_methods_take_the_head_but_no_other_linear_outside_the_layers():
    from quantspec.calib.targets import check_outside

    for method in ("rtn", "gptq", "awq", "awq+gptq"):
        check_outside(method, ["lm_head"])
    check_outside("rtn", ["fc", "lm_head"])
    with pytest.raises(QuantSpecError, match="GPTQ quantizes decoder-layer Linears only; add fc to --ignore"):
        check_outside("gptq", ["lm_head", "fc"])
