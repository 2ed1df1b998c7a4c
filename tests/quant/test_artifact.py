"""Artifact tensors and directory I/O: round trip, atomicity, refusal, truncation, sharding."""

import json

import pytest
import torch

import quantspec.quant.artifact as artifact
from quantspec.errors import QuantSpecError
from quantspec.quant import (QuantArgs, choose_qparams, kv_scale_tensors, linear_from_tensors,
                             linear_to_tensors, load_safetensors, preset, quantize,
                             read_artifact_config, read_quant_config, write_artifact)

P = "model.layers.0.self_attn.q_proj"


def _quantized(args, N=24, K=128, seed=0):
    w = torch.randn(N, K, generator=torch.Generator().manual_seed(seed))
    s, z = choose_qparams(w, args)
    return quantize(w, s, z, args), s, z


@pytest.mark.parametrize("args,names", [
    (QuantArgs(num_bits=4, strategy="group", group_size=32),
     {"weight_packed": (torch.int32, (24, 16)), "weight_scale": (torch.float32, (24, 4)),
      "weight_shape": (torch.int64, (2,))}),
    (QuantArgs(num_bits=4, strategy="group", group_size=32, symmetric=False),
     {"weight_packed": (torch.int32, (24, 16)), "weight_scale": (torch.float32, (24, 4)),
      "weight_shape": (torch.int64, (2,)), "weight_zero_point": (torch.int32, (3, 4))}),
    (QuantArgs(num_bits=4, strategy="group", group_size=32, symmetric=False, zp_dtype="float16"),
     {"weight_packed": (torch.int32, (24, 16)), "weight_scale": (torch.float32, (24, 4)),
      "weight_shape": (torch.int64, (2,)), "weight_zero_point": (torch.float16, (24, 4))}),
    (QuantArgs(num_bits=4, strategy="channel", symmetric=False, zp_dtype="bfloat16"),
     {"weight_packed": (torch.int32, (24, 16)), "weight_scale": (torch.float32, (24, 1)),
      "weight_shape": (torch.int64, (2,)), "weight_zero_point": (torch.bfloat16, (24, 1))}),
    (QuantArgs(num_bits=8, strategy="channel"),  # weight-only int8: 8-bit pack-quantized (W8A16)
     {"weight_packed": (torch.int32, (24, 32)), "weight_scale": (torch.float32, (24, 1)),
      "weight_shape": (torch.int64, (2,))}),
    (QuantArgs(num_bits=8, strategy="channel", symmetric=False),
     {"weight_packed": (torch.int32, (24, 32)), "weight_scale": (torch.float32, (24, 1)),
      "weight_shape": (torch.int64, (2,)), "weight_zero_point": (torch.int32, (6, 1))}),
    (QuantArgs(num_bits=8, type="float", strategy="channel"),
     {"weight": (torch.float8_e4m3fn, (24, 128)), "weight_scale": (torch.float32, (24, 1))}),
])
def test_linear_tensor_round_trip(args, names):
    q, s, z = _quantized(args)
    t = linear_to_tensors(P, q, s, z, args)
    assert {k.removeprefix(P + "."): (v.dtype, tuple(v.shape)) for k, v in t.items()} == names
    back = linear_from_tensors(t, P, args)
    assert torch.equal(back.q.float(), q.float()) and torch.equal(back.scale, s)
    if args.symmetric:
        assert back.zero_point is None
    else:
        assert torch.equal(back.zero_point, z)


def test_int_quantized_when_named():
    args = QuantArgs(num_bits=8, strategy="channel")
    q, s, z = _quantized(args)
    t = linear_to_tensors(P, q, s, z, args, format="int-quantized")
    assert set(t) == {P + ".weight", P + ".weight_scale"} and t[P + ".weight"].dtype == torch.int8
    assert torch.equal(linear_from_tensors(t, P, args, format="int-quantized").q, q)


def test_linear_from_tensors_uses_config_and_input_scale():
    cfg = preset("a8w8")
    args = cfg.weight_args_for(P)
    q, s, z = _quantized(args)
    t = linear_to_tensors(P, q, s, z, args, input_scale=torch.tensor(0.02))
    assert t[P + ".input_scale"].shape == (1,)
    back = linear_from_tensors(t, P, cfg)
    assert back.args == args and back.input_scale.item() == pytest.approx(0.02)
    with pytest.raises(QuantSpecError, match="does not quantize"):
        linear_from_tensors(t, "lm_head", cfg)
    with pytest.raises(QuantSpecError, match="missing"):
        linear_from_tensors({}, P, args)


def test_kv_scales():
    t = kv_scale_tensors("model.layers.0.self_attn", torch.tensor([0.1, 0.2, 0.3]),
                         torch.tensor([0.4, 0.5, 0.6]))
    assert t["model.layers.0.self_attn.k_scale"].shape == (3, 1, 1)
    assert t["model.layers.0.self_attn.v_scale"].flatten().tolist() == pytest.approx([.4, .5, .6])
    t = kv_scale_tensors("a", torch.tensor(0.1), torch.tensor(0.2), QuantArgs(num_bits=8))
    assert t["a.k_scale"].shape == (1,)


def _write(out, **kw):
    cfg = {"architectures": ["LlamaForCausalLM"],
           "quantization_config": preset("weight_only_int4", group_size=32).to_dict()}
    q, s, z = _quantized(QuantArgs(num_bits=4, strategy="group", group_size=32))
    tensors = linear_to_tensors(P, q, s, z, QuantArgs(num_bits=4, strategy="group", group_size=32))
    tensors["model.norm.weight"] = torch.ones(128)
    return write_artifact(out, tensors, cfg, **kw), tensors


def test_directory_round_trip(tmp_path):
    tok = tmp_path / "tokenizer.json"
    tok.write_text("{}")
    out, tensors = _write(tmp_path / "art", extra_files={"tokenizer.json": tok},
                          provenance={"quant_type": "weight_only_int4", "provenance": {"x": 1}})
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json", "model.safetensors", "quantspec.json", "tokenizer.json"]
    loaded = load_safetensors(out)
    assert loaded.keys() == tensors.keys()
    assert all(torch.equal(loaded[k], tensors[k]) for k in tensors)
    assert read_artifact_config(out)["architectures"] == ["LlamaForCausalLM"]
    qc = read_quant_config(out)
    assert qc.quant_type.value == "weight_only_int4" and qc.provenance == {"x": 1}
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_refuses_non_empty_out_dir_unless_overwrite(tmp_path):
    out = tmp_path / "art"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    with pytest.raises(QuantSpecError, match="not empty.*overwrite"):
        _write(out)
    assert (out / "keep.txt").read_text() == "precious"
    _write(out, overwrite=True)
    assert not (out / "keep.txt").exists() and (out / "model.safetensors").is_file()
    assert [p.name for p in tmp_path.iterdir()] == ["art"]


def test_failure_midway_leaves_destination_untouched(tmp_path, monkeypatch):
    out, _ = _write(tmp_path / "art")
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def boom(*a, **k):
        raise RuntimeError("disk full")

    monkeypatch.setattr(artifact.shutil, "copyfile", boom)
    src = tmp_path / "tok.json"
    src.write_text("{}")
    with pytest.raises(RuntimeError, match="disk full"):
        _write(out, overwrite=True, extra_files={"tokenizer.json": src})
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["art", "tok.json"]  # no temp dir left
    with pytest.raises(RuntimeError):
        _write(tmp_path / "fresh", extra_files={"tokenizer.json": src})
    assert not (tmp_path / "fresh").exists()


def test_sharded_write_and_load(tmp_path):
    tensors = {f"t{i}": torch.full((256,), float(i)) for i in range(5)}  # 1 KiB each
    out = write_artifact(tmp_path / "art", tensors, {}, max_shard_bytes=2048)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == [
        "model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors",
        "model-00003-of-00003.safetensors"]
    assert index["metadata"]["total_size"] == 5 * 1024
    loaded = load_safetensors(out)
    assert all(torch.equal(loaded[k], v) for k, v in tensors.items()) and len(loaded) == 5
    (out / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(QuantSpecError, match="00002.*missing; re-download or re-create"):
        load_safetensors(out)


def test_truncated_file_is_named(tmp_path):
    out, _ = _write(tmp_path / "art")
    f = out / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-50])
    with pytest.raises(QuantSpecError, match=r"model\.safetensors is truncated or corrupt.*"
                                             r"re-download or re-create it"):
        load_safetensors(out)


def test_missing_config(tmp_path):
    with pytest.raises(QuantSpecError, match="no config.json"):
        read_artifact_config(tmp_path)


def test_float_zero_point_tensor_is_checked():
    args = QuantArgs(num_bits=4, strategy="group", group_size=32, symmetric=False, zp_dtype="float16")
    q, s, z = _quantized(args)
    t = linear_to_tensors(P, q, s, z, args)
    with pytest.raises(QuantSpecError, match="needs torch.float16"):
        linear_from_tensors(dict(t, **{P + ".weight_zero_point": z.float()}), P, args)
    with pytest.raises(QuantSpecError, match="needs a float zero_point"):
        linear_to_tensors(P, q, s, z.round().to(torch.int8), args)
