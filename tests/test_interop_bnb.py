"""bitsandbytes checkpoints as a source (`quant.bnb`): each Linear of a tiny model quantized by
bitsandbytes' own `quantize_4bit` (NF4 / FP4, with and without double quantization) or
`int8_vectorwise_quant` (LLM.int8) and saved in transformers' layout. The reference is
bitsandbytes' own dequantization: quantspec's reader must give its weights exactly, and an
artifact quantized from the bitsandbytes checkpoint must be the artifact quantized from a float
checkpoint of those weights."""

import json
import shutil
from pathlib import Path

import bitsandbytes.functional as F
import pytest
import torch
from safetensors.torch import load_file, save_file

from quantspec import api
from quantspec.errors import QuantSpecError
from quantspec.quant.artifact import load_safetensors, read_provenance, read_quant_config
from quantspec.quant.bnb import BnbReader

CASES = [("nf4", True), ("nf4", False), ("fp4", True), ("int8", False), ("nf4-bf16", True)]


def _is_linear(name: str, t: torch.Tensor) -> bool:
    return name.startswith("model.layers.") and name.endswith("_proj.weight") and t.ndim == 2


def _bnb_checkpoint(src: Path, out: Path, quant_type: str, double: bool) -> tuple[Path, Path]:
    """(`src` saved as bitsandbytes would save it, `src` with each Linear's weight replaced by
    bitsandbytes' own dequantization of it)."""
    tensors = load_file(str(src / "model.safetensors"))
    packed, dense = {}, dict(tensors)
    for name, w in tensors.items():
        if not _is_linear(name, w):
            packed[name] = w
            continue
        m = name[: -len(".weight")]
        if quant_type == "int8":
            cb, scb, _ = F.int8_vectorwise_quant(w.to(torch.float16))
            packed.update({name: cb, f"{m}.SCB": scb, f"{m}.weight_format": torch.tensor(0, dtype=torch.uint8)})
            dense[name] = F.int8_vectorwise_dequant(cb, scb).float()
            continue
        storage = torch.bfloat16 if quant_type.endswith("-bf16") else torch.uint8  # FSDP QLoRA's quant_storage
        q, st = F.quantize_4bit(w, blocksize=64, quant_type=quant_type.removesuffix("-bf16"),
                                compress_statistics=double, quant_storage=storage)
        packed[name] = q
        packed.update({f"{name}.{k}": v for k, v in st.as_dict(packed=True).items()})
        dense[name] = F.dequantize_4bit(q, st).float()
    qc = {"quant_method": "bitsandbytes", "load_in_4bit": quant_type != "int8", "load_in_8bit": quant_type == "int8",
          "bnb_4bit_quant_type": "nf4" if quant_type == "int8" else quant_type.removesuffix("-bf16"),
          "bnb_4bit_use_double_quant": double,
          "bnb_4bit_compute_dtype": "float32", "llm_int8_skip_modules": None, "llm_int8_threshold": 6.0}
    bnb, ref = out / "bnb", out / "dense"
    for d, t, extra in ((bnb, packed, {"quantization_config": qc}), (ref, dense, {})):
        shutil.copytree(src, d)
        save_file({k: v.contiguous() for k, v in t.items()}, str(d / "model.safetensors"))
        cfg = json.loads((src / "config.json").read_text())
        (d / "config.json").write_text(json.dumps({**cfg, **extra}))
    return bnb, ref


@pytest.mark.parametrize("quant_type,double", CASES, ids=[f"{q}{'-dq' if d else ''}" for q, d in CASES])
def test_reader_gives_bitsandbytes_own_weights(tmp_path, tiny_llama_dir, quant_type, double):
    bnb, ref = _bnb_checkpoint(tiny_llama_dir, tmp_path, quant_type, double)
    reader, want = BnbReader(bnb, json.loads((bnb / "config.json").read_text())), load_file(str(ref / "model.safetensors"))
    assert set(reader.shapes) == set(want)
    got = reader.read(sorted(want))
    for name, t in want.items():
        assert torch.equal(got[name].to(t.dtype), t), name
    assert reader.linears and not any(f"{m}.weight" in reader.ranges for m in reader.linears)


@pytest.mark.parametrize("quant_type,double", [("nf4", True), ("int8", False)], ids=["nf4-dq", "int8"])
def test_quantizing_from_bitsandbytes_is_quantizing_its_weights(tmp_path, tiny_llama_dir, quant_type, double):
    bnb, ref = _bnb_checkpoint(tiny_llama_dir, tmp_path, quant_type, double)
    a = api.quantize(str(bnb), "weight_only_int4", tmp_path / "from_bnb", group_size=32)
    b = api.quantize(str(ref), "weight_only_int4", tmp_path / "from_dense", group_size=32)
    ta, tb = load_safetensors(a), load_safetensors(b)
    assert set(ta) == set(tb)
    for k in ta:
        assert torch.equal(ta[k], tb[k]), k
    was = read_provenance(a)["provenance"]["source_quantization"]
    assert was["quant_method"] == "bitsandbytes" and was["format"] == quant_type
    assert "quantization_config" in json.loads((a / "config.json").read_text())
    info = api.inspect(bnb)
    assert info["quant_type"] == f"bitsandbytes {quant_type}{' double-quant' if double else ''}"
    assert info["quantized_linears"] == 14  # 2 layers × q, k, v, o, gate, up, down
    assert {e: v["status"] for e, v in info["engines"].items()} == {
        "vllm": "refused", "sglang": "loads", "transformers": "loads", "quantspec": "refused"}
    assert "quantspec quantize --model" in info["engines"]["vllm"]["fixes"][0]
    with pytest.raises(QuantSpecError, match="bitsandbytes checkpoints have no kernel here.*quantspec quantize"):
        read_quant_config(bnb)  # what infer / serve / eval read first


def test_transformers_runs_the_checkpoint_near_its_dequantized_weights(tmp_path, tiny_llama_dir):
    """The checkpoints these tests write are bitsandbytes' own: transformers (through bitsandbytes)
    loads one and runs it to the logits of its dequantized weights (bitsandbytes' CPU kernels
    compute in their own order: close, not equal)."""
    from transformers import AutoModelForCausalLM

    bnb, ref = _bnb_checkpoint(tiny_llama_dir, tmp_path, "nf4", True)
    ids = torch.tensor([[1, 17, 254, 90, 3, 411, 77]])
    with torch.no_grad():
        m = AutoModelForCausalLM.from_pretrained(str(bnb), dtype=torch.float32)
        got, want = m(ids).logits, AutoModelForCausalLM.from_pretrained(str(ref), dtype=torch.float32)(ids).logits
    assert type(m.model.layers[0].self_attn.q_proj).__name__ == "Linear4bit"
    assert (got - want).abs().max() < 0.02 * want.abs().max()


def test_malformed_bitsandbytes_configs_are_one_line(tmp_path, tiny_llama_dir):
    bnb, _ = _bnb_checkpoint(tiny_llama_dir, tmp_path, "nf4", False)
    cfg = json.loads((bnb / "config.json").read_text())
    cfg["quantization_config"]["load_in_8bit"] = True
    (bnb / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(QuantSpecError, match="exactly one of load_in_4bit / load_in_8bit"):
        api.quantize(str(bnb), "weight_only_int8", tmp_path / "x")
    cfg["quantization_config"]["load_in_8bit"] = False
    (bnb / "config.json").write_text(json.dumps(cfg))
    t = load_file(str(bnb / "model.safetensors"))
    save_file({k: v for k, v in t.items() if "quant_state" not in k or "layers.1.mlp.up_proj" not in k},
              str(bnb / "model.safetensors"))
    with pytest.raises(QuantSpecError, match="up_proj has 4-bit scales but no weight.quant_state"):
        api.quantize(str(bnb), "weight_only_int8", tmp_path / "x")
    assert not (tmp_path / "x").exists()


def test_a_rotated_artifact_from_bitsandbytes_keeps_its_provenance(tmp_path, tiny_llama_dir):
    bnb, ref = _bnb_checkpoint(tiny_llama_dir, tmp_path, "nf4", True)
    a = api.quantize(str(bnb), "weight_only_int8", tmp_path / "a", rotate="R1,R2")
    b = api.quantize(str(ref), "weight_only_int8", tmp_path / "b", rotate="R1,R2")
    ta, tb = load_safetensors(a), load_safetensors(b)
    assert set(ta) == set(tb) and all(torch.equal(ta[k], tb[k]) for k in ta)
    assert api.inspect(a)["source_quantization"]["quant_method"] == "bitsandbytes"
    assert api.inspect(a)["rotation"] == "R1,R2 random-hadamard seed 0"



def test_a_truncated_quant_state_is_one_line(tmp_path, tiny_llama_dir):
    bnb, _ = _bnb_checkpoint(tiny_llama_dir, tmp_path, "nf4", True)
    t = load_file(str(bnb / "model.safetensors"))
    key = "model.layers.0.mlp.down_proj.weight.nested_absmax"
    t[key] = t[key][:0]
    save_file(t, str(bnb / "model.safetensors"))
    with pytest.raises(QuantSpecError, match="down_proj.weight.nested_absmax is 0 values, not the 1"):
        api.quantize(str(bnb), "weight_only_int8", tmp_path / "x")
    assert not (tmp_path / "x").exists()
