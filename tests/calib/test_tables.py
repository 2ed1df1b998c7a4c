"""The calibration table format: round trip, derived scales, fingerprints, one-line errors."""

import json
import shutil

import pytest
import torch

from quantspec.calib.tables import META_NAME, SCALES_NAME, ScaleTable, read_table, write_table
from quantspec.errors import QuantSpecError
from quantspec.model_zoo.checkpoint import model_fingerprint
from quantspec.model_zoo.tiny import build_tiny_model

LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def fake_tensors(num_layers=2, kv=2, D=64, I=128, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = {}
    for i in range(num_layers):
        p = f"model.layers.{i}"
        for lin in LINEARS:
            K = I if lin == "mlp.down_proj" else D
            ch = torch.rand(K, generator=g) * 10
            t[f"{p}.{lin}.input_channel_absmax"] = ch
            t[f"{p}.{lin}.input_absmax"] = ch.amax()
        t[f"{p}.self_attn.k_absmax"] = torch.rand(kv, generator=g) * 5
        t[f"{p}.self_attn.v_absmax"] = torch.rand(kv, generator=g) * 5
    return t


def test_round_trip_and_derived_scales(tmp_path):
    t = fake_tensors()
    meta = {"model_fingerprint": "a-b", "observer": "minmax", "num_samples": 4}
    write_table(tmp_path / "c", t, meta)
    table = read_table(tmp_path / "c", expect_fingerprint="a-b", expect_layers=2, expect_kv_heads=2)
    assert set(table.tensors) == set(t)
    for k in t:
        assert torch.equal(table.tensors[k], t[k])
    assert table.meta["observer"] == "minmax" and table.meta["format_version"] == 1
    assert table.num_layers == 2
    assert len(table.linear_names) == 14
    k, v = table.kv_absmax()
    assert k.shape == (2, 2)
    ks, vs = table.kv_scales("int8")
    assert torch.allclose(ks[1], t["model.layers.1.self_attn.k_absmax"] / 127.5, rtol=0, atol=1e-7)
    ks8, vs8 = table.kv_scales("fp8")
    assert torch.allclose(vs8[0], t["model.layers.0.self_attn.v_absmax"] / 448.0, rtol=1e-6, atol=0)
    name = "model.layers.0.mlp.down_proj"
    assert torch.allclose(table.input_scale(name, "int8"),
                          t[f"{name}.input_absmax"].reshape(1) / 127.5, rtol=1e-6, atol=0)
    assert table.input_channel_absmax(name).shape == (128,)
    art = table.kv_artifact_tensors("int8")
    assert art["model.layers.1.self_attn.v_scale"].shape == (2, 1, 1)
    assert torch.equal(art["model.layers.1.self_attn.v_scale"].reshape(-1), vs[1])


def test_write_is_atomic_and_refuses_existing(tmp_path):
    out = tmp_path / "c"
    write_table(out, fake_tensors(seed=0), {"model_fingerprint": "a-b"})
    with pytest.raises(QuantSpecError, match="already exists"):
        write_table(out, fake_tensors(seed=1), {"model_fingerprint": "a-b"})
    bad = fake_tensors(seed=1)
    bad["model.layers.0.self_attn.k_absmax"][0] = float("nan")
    with pytest.raises(QuantSpecError, match="NaN"):
        write_table(out, bad, {}, overwrite=True)
    # the failed overwrite left the original in place and no temporary directory behind
    assert torch.equal(read_table(out).tensors["model.layers.0.self_attn.k_absmax"],
                       fake_tensors(seed=0)["model.layers.0.self_attn.k_absmax"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]
    write_table(out, fake_tensors(seed=1), {}, overwrite=True)
    assert torch.equal(read_table(out).tensors["model.layers.1.self_attn.v_absmax"],
                       fake_tensors(seed=1)["model.layers.1.self_attn.v_absmax"])


def test_missing_and_corrupt_tables(tmp_path):
    with pytest.raises(QuantSpecError, match="does not exist; run `quantspec calibrate"):
        read_table(tmp_path / "nope")
    with pytest.raises(QuantSpecError, match="no calibration table given"):
        read_table(None)
    out = write_table(tmp_path / "c", fake_tensors(), {})
    (out / SCALES_NAME).unlink()
    with pytest.raises(QuantSpecError, match=f"no {SCALES_NAME}"):
        read_table(out)
    out2 = write_table(tmp_path / "d", fake_tensors(), {})
    (out2 / SCALES_NAME).write_bytes(b"garbage")
    with pytest.raises(QuantSpecError, match="corrupt"):
        read_table(out2)
    out3 = write_table(tmp_path / "e", fake_tensors(), {})
    (out3 / META_NAME).write_text(json.dumps({"format_version": 99}))
    with pytest.raises(QuantSpecError, match="format version 99"):
        read_table(out3)


def test_table_missing_a_layer(tmp_path):
    out = write_table(tmp_path / "c", fake_tensors(num_layers=2), {})
    with pytest.raises(QuantSpecError, match=r"2 layer\(s\) but the model has 3 \(model.layers.2"):
        read_table(out, expect_layers=3)
    with pytest.raises(QuantSpecError, match="2 KV heads per layer but the model has 4"):
        read_table(out, expect_layers=2, expect_kv_heads=4)
    t = fake_tensors(num_layers=2)
    del t["model.layers.1.mlp.up_proj.input_absmax"]
    table = ScaleTable(t)
    with pytest.raises(QuantSpecError, match="no input scale for model.layers.1.mlp.up_proj"):
        table.check_layers(2, 2, [f"model.layers.{i}.{n}" for i in range(2) for n in LINEARS])
    with pytest.raises(QuantSpecError, match="input absmax for model.layers.1.mlp.up_proj"):
        table.input_scale("model.layers.1.mlp.up_proj", "int8")


def test_fingerprint_stable_and_weight_sensitive(tmp_path, tiny_llama_dir):
    fp = model_fingerprint(tiny_llama_dir)
    assert fp == model_fingerprint(tiny_llama_dir)
    copy = tmp_path / "copy"
    shutil.copytree(tiny_llama_dir, copy)
    assert model_fingerprint(copy) == fp  # a copy elsewhere is the same model
    other = build_tiny_model(tmp_path / "seed1", "llama", seed=1)  # same shape, other weights
    fp1 = model_fingerprint(other)
    assert fp1.split("-")[0] == fp.split("-")[0] and fp1 != fp
    bigger = build_tiny_model(tmp_path / "l3", "llama", num_layers=3)
    assert model_fingerprint(bigger).split("-")[0] != fp.split("-")[0]


def test_fingerprint_mismatch_names_both(tmp_path, tiny_llama_dir):
    other = build_tiny_model(tmp_path / "seed1", "llama", seed=1)
    fp, fp1 = model_fingerprint(tiny_llama_dir), model_fingerprint(other)
    out = write_table(tmp_path / "c", fake_tensors(), {"model_fingerprint": fp, "model": "tiny"})
    assert read_table(out, model_dir=tiny_llama_dir).num_layers == 2
    with pytest.raises(QuantSpecError) as e:
        read_table(out, model_dir=other)
    msg = str(e.value)
    assert fp in msg and fp1 in msg and "\n" not in msg


def test_artifact_fingerprint_from_provenance(tmp_path, tiny_llama_dir):
    art = tmp_path / "art"
    art.mkdir()
    cfg = json.loads((tiny_llama_dir / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "compressed-tensors"}
    (art / "config.json").write_text(json.dumps(cfg))
    src_fp = model_fingerprint(tiny_llama_dir)
    assert model_fingerprint(art) == src_fp.split("-")[0] + "-"  # no provenance: architecture only
    (art / "quantspec.json").write_text(json.dumps({"provenance": {"model_fingerprint": src_fp}}))
    assert model_fingerprint(art) == src_fp
