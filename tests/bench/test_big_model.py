"""`bench/big_model.py`: it builds the sharded random checkpoint it claims to and measures every
command it lists (infer on the bf16 checkpoint and on a quantized artifact too, quantizing it
first where no command has; GPTQ from a block-FP8 artifact it writes first), with a step size that follows the shape and each command's target."""

import json

import pytest

pytestmark = pytest.mark.bench


def test_builds_a_sharded_checkpoint_and_measures_each_command(big_model, tmp_path, capsys):
    rows = big_model.main(["--models", "tiny", "--commands", "int8,a8w8,infer,infer-int8,infer-int4,fp8-int4-gptq",
                           "--num-samples", "4", "--seq-len", "32", "--device", "cpu", "--dir", str(tmp_path), "--keep"])
    assert [r["command"] for r in rows] == ["quantize int8", "calibrate", "quantize a8w8", "infer bf16", "infer int8",
                                            "quantize int4", "infer int4", "quantize fp8 block",
                                            "quantize int4 gptq from fp8"]
    assert all(r["peak_gb"] > 0 and r["wall_s"] > 0 and r["ratio"] > 0 for r in rows)
    ckpt = tmp_path / "tiny-random"
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {"model-00001-of-00001.safetensors"}
    layer, acts = big_model.step_bytes("tiny", 4 * 32)
    assert acts == 2 * 4 * 32 * 128 * 4 and layer == (128 * 128 * 2 + 128 * 64 * 2 + 3 * 128 * 256 + 256) * 4
    _, with_h = big_model.step_bytes("tiny", 4 * 32, hessians=True)
    assert with_h == acts + (2 * 128 * 128 + 128 * 128 + 256 * 256) * 4
    assert all(abs(r["target_gb"] - (2 * r["step_gb"] + 1)) < 0.02 for r in rows[:3])
    for r in (rows[3], rows[4], rows[6]):
        assert abs(r["target_gb"] - (r["checkpoint_gb"] + 1)) < 0.02
    assert big_model.hf_config("tiny", layers=2)["num_hidden_layers"] == 2
    assert big_model.hf_config("tiny")["num_hidden_layers"] == big_model.SHAPES["tiny"][3]
    out = capsys.readouterr().out
    assert "peak ÷ step" in out and "within" in out
