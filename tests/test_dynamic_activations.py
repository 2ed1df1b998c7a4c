"""`quantize --activations dynamic`: a8w8 / a8w8_fp8 with inputs quantized per token at run time
(llm-compressor's W8A8 and FP8_DYNAMIC schemes), written without a calibration table: the config
says so, no input_scale is stored, transformers (through compressed-tensors) runs it to the logits
quantspec's reference order gives, and a static KV cache still comes from --calib."""

import json

import pytest
import torch
from click.testing import CliRunner

from quantspec import api
from quantspec.cli import main
from quantspec.infer.dispatch import DispatchPolicy
from quantspec.infer.loader import load_for_inference
from quantspec.model_zoo.llama import DenseCausalAttention
from quantspec.quant.artifact import load_safetensors

torch.set_num_threads(1)
IDS = torch.tensor([7, 300, 41, 12, 99, 5, 260, 17, 33, 2, 150, 8, 71])


def _logits(model) -> torch.Tensor:
    T = IDS.numel()
    with torch.no_grad():
        return model.compute_logits(model(IDS, torch.arange(T), DenseCausalAttention(1, T)))


@pytest.mark.parametrize("quant_type, act_type", [("a8w8", "int"), ("a8w8_fp8", "float")])
def test_dynamic_artifact_runs_in_transformers_as_in_quantspec(tiny_llama_dir, tmp_path, quant_type, act_type):
    from transformers import AutoModelForCausalLM

    out = tmp_path / quant_type
    r = CliRunner().invoke(main, ["quantize", "--model", str(tiny_llama_dir), "--quant-type", quant_type,
                                  "--activations", "dynamic", "--out", str(out)], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    ia = qc["config_groups"]["group_0"]["input_activations"]
    assert (ia["type"], ia["strategy"], ia["dynamic"], ia["symmetric"]) == (act_type, "token", True, True)
    assert qc["format"] == ("int-quantized" if act_type == "int" else "float-quantized")
    tensors = load_safetensors(out)
    assert not any(k.endswith("input_scale") for k in tensors)
    assert tensors["model.layers.0.mlp.down_proj.weight"].dtype == (torch.int8 if act_type == "int"
                                                                    else torch.float8_e4m3fn)
    assert json.loads((out / "quantspec.json").read_text())["provenance"]["args"]["activations"] == "dynamic"
    info = api.inspect(out)
    assert {e: v["status"] for e, v in info["engines"].items()} == dict.fromkeys(info["engines"], "loads")
    assert (info["activation_linears"], info["static_activation_linears"]) == (len(info["layers"]), 0)
    assert {d["input_activations"] for d in info["layers"].values()} == {f"{act_type}8 token dynamic"}
    r = CliRunner().invoke(main, ["inspect", str(out)], env={"COLUMNS": "200"})
    assert "dynamic activations" in r.output and "static" not in r.output
    with torch.no_grad():
        theirs = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)(IDS[None]).logits[0]
    # per-token codes flip on a summation-order ulp, so compare in compressed-tensors' order, every
    # float op torch's own (quantspec's CPU kernels, where they build, reduce in another order)
    from quantspec.kernels.cpu import build

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(build, "_state", {"tried": True, "module": None, "error": "off: the reference's order"})
        ours = _logits(load_for_inference(out, tokenizer=False, policy=DispatchPolicy(fast=False)).model)
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)
    fast = _logits(load_for_inference(out, tokenizer=False).model)  # the fast kernels: close, not equal
    assert (fast - theirs).abs().max() < 0.25 * theirs.abs().max()
    fp32 = _logits(load_for_inference(tiny_llama_dir, tokenizer=False).model)
    assert (fp32 - theirs).abs().max() > 1e-3  # activations were quantized


def test_dynamic_activations_with_a_static_kv_cache(tiny_llama_dir, calibration_table, tmp_path):
    table = calibration_table(tiny_llama_dir)
    out = api.quantize(str(tiny_llama_dir), "a8w8_fp8", tmp_path / "fp8", activations="dynamic", kv_cache="fp8",
                       calib=table)
    tensors = load_safetensors(out)
    assert "model.layers.0.self_attn.k_scale" in tensors and not any(k.endswith("input_scale") for k in tensors)
    lm = load_for_inference(out, tokenizer=False)
    assert lm.kv_cache_dtype == "fp8" and bool((lm.k_scale > 0).all())
