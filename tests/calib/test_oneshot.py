"""One-shot calibration (`calib.oneshot`): `quantize --dataset D` without `--calib` measures the
table it needs in the run, and writes the artifact that `calibrate` then `quantize --calib` write."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from quantspec import api
from quantspec.errors import QuantSpecError
from quantspec.model_zoo.tiny import TINY_CORPUS

torch.set_num_threads(1)

DATA = dict(num_samples=4, seq_len=32)
LLMC = Path(__file__).parent / "llmcompressor_recipes"


@pytest.fixture()
def data(tmp_path) -> str:
    p = tmp_path / "calib.txt"
    p.write_text(TINY_CORPUS)
    return str(p)


def _two_step(model, data, out: Path, quant_type: str, **options) -> Path:
    table = api.calibrate(str(model), data, out.with_name(out.name + ".table"), rotate=options.get("rotate"),
                          **DATA).path
    return api.quantize(str(model), quant_type, out, calib=str(table), dataset=data, **DATA, **options)


def _same_tensors(a: Path, b: Path) -> None:
    ta, tb = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    assert ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)


def _calibration(art: Path) -> dict:
    return json.loads((art / "quantspec.json").read_text())["provenance"]["calibration"]


def test_llm_compressor_fp8_kv_recipe_runs_in_one_command(tiny_llama_dir, data, tmp_path):
    """llm-compressor's FP8 KV-cache example recipe with --dataset: static FP8 inputs and KV scales
    measured in the run, the artifact `calibrate` + `quantize --calib` write with the same options."""
    one = api.quantize(str(tiny_llama_dir), out=tmp_path / "one", recipe=str(LLMC / "fp8_static_kv.yaml"),
                       dataset=data, **DATA)
    two = _two_step(tiny_llama_dir, data, tmp_path / "two", "a8w8_fp8", weight_strategy="tensor",
                    smoothquant_alpha="none", fallback_layers=0, kv_cache="fp8", kv_strategy="tensor")
    _same_tensors(one, two)
    stored = load_file(str(one / "model.safetensors"))
    assert "model.layers.0.self_attn.k_scale" in stored and "model.layers.0.self_attn.q_proj.input_scale" in stored
    got, want = _calibration(one), _calibration(two)
    assert got["calib"] is None and want["calib"] is not None
    skip = {"wall_s", "forward_s", "cpu_s", "out"}
    assert {k: v for k, v in got["calibration"].items() if k not in skip} == \
        {k: v for k, v in want["calibration"].items() if k not in skip}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["calib.txt", "one", "two", "two.table"]  # nothing left


@pytest.mark.parametrize("quant_type,options", [
    ("a8w8", dict()),  # SmoothQuant α searched and the fallback chosen on the table's data
    ("nvfp4", dict()),  # its input global scales
    ("a8w8", dict(activations="dynamic", smoothquant_alpha=0.5)),  # SmoothQuant's channel ranges
    # measured on the rotated model, R4's inputs turned, as `calibrate --rotate` measures it
    ("a8w8_fp8", dict(rotate="R1,R2,R4", smoothquant_alpha="none", fallback_layers=0, target="vllm")),
])
def test_one_shot_is_calibrate_then_quantize(tiny_llama_dir, data, tmp_path, quant_type, options):
    opts = dict(options, holdout_samples=2, search_samples=2) if quant_type == "a8w8" and not options else options
    one = api.quantize(str(tiny_llama_dir), quant_type, tmp_path / "one", dataset=data, **DATA, **opts)
    two = _two_step(tiny_llama_dir, data, tmp_path / "two", quant_type, **opts)
    _same_tensors(one, two)


def test_an_interrupted_resumable_run_keeps_its_table(tiny_llama_dir, data, tmp_path, monkeypatch):
    """A resumable run that stops after calibrating keeps the table in its state, and the command
    that resumes it quantizes from that table without calibrating again."""
    import quantspec.calib.calibrate as calibrate
    import quantspec.calib.ptq as ptq

    def stop(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(ptq, "quantize_model", stop)
    opts = dict(dataset=data, kv_cache="fp8", resumable=True, **DATA)
    with pytest.raises(KeyboardInterrupt):
        api.quantize(str(tiny_llama_dir), "weight_only_int8", tmp_path / "q", **opts)
    states = list(tmp_path.glob(".q.resume-*"))
    assert len(states) == 1 and (states[0] / "calibration" / "calibration.json").is_file()
    monkeypatch.undo()

    def again(*a, **k):
        raise AssertionError("the resumed run calibrated again")

    monkeypatch.setattr(calibrate, "run_calibration", again)
    art = api.quantize(str(tiny_llama_dir), "weight_only_int8", tmp_path / "q", **opts)
    monkeypatch.undo()
    _same_tensors(art, _two_step(tiny_llama_dir, data, tmp_path / "two", "weight_only_int8", kv_cache="fp8"))
    assert not list(tmp_path.glob(".q.*"))


def test_no_table_and_no_data_names_both_ways(tiny_llama_dir, tmp_path):
    for quant_type, options in (("a8w8_fp8", {}), ("weight_only_int8", dict(kv_cache="fp8"))):
        with pytest.raises(QuantSpecError, match="pass --dataset D to calibrate in this run, or --calib DIR"):
            api.quantize(str(tiny_llama_dir), quant_type, tmp_path / "q", **options)
