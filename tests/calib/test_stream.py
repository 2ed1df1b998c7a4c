"""Streamed quantization (one decoder layer read from the checkpoint at a time) against the
whole model loaded in memory, bitwise; resuming an interrupted run; starting over."""

import json
import logging
import os
import shutil

import pytest
import torch
from safetensors.torch import save_file

import quantspec.calib.quantize as qmod
from quantspec import api
from quantspec.calib import ptq, stream
from quantspec.errors import QuantSpecError
from quantspec.model_zoo.checkpoint import CheckpointReader, load_checkpoint_tensors, load_model
from quantspec.model_zoo.tiny import TINY_CORPUS
from quantspec.outputs import remove_leftovers
from quantspec.quant.artifact import load_safetensors, read_artifact_config

torch.set_num_threads(1)
GPTQ = dict(method="gptq", num_samples=4, seq_len=32)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    f = tmp_path_factory.mktemp("data") / "calib.txt"
    f.write_text(TINY_CORPUS)
    return f


@pytest.fixture(scope="module")
def table(tiny_llama_dir, data, tmp_path_factory):
    return api.calibrate(str(tiny_llama_dir), str(data), tmp_path_factory.mktemp("t") / "table", num_samples=8,
                         seq_len=32).path


@pytest.fixture(scope="module")
def bf16_sharded(tiny_qwen2_dir, tmp_path_factory):
    """The tiny Qwen2 (biases) in bfloat16, in three shards with an index."""
    d = tmp_path_factory.mktemp("bf16")
    for f in tiny_qwen2_dir.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, d / f.name)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(dict(cfg, torch_dtype="bfloat16", dtype="bfloat16")))
    tensors = load_checkpoint_tensors(tiny_qwen2_dir)
    names = sorted(tensors)
    weight_map = {}
    for i in range(3):
        f = f"model-{i + 1:05d}-of-00003.safetensors"
        chunk = names[i::3]
        save_file({k: tensors[k].to(torch.bfloat16) for k in chunk}, str(d / f))
        weight_map.update({k: f for k in chunk})
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return d


def _whole_model(monkeypatch):
    """The pipeline on the whole model loaded in memory (`load_model`) instead of the skeleton
    whose layers are read one at a time: the reference."""
    monkeypatch.setattr(qmod, "_skeleton", lambda config, src: load_model(src.model_dir)[0])


def _artifact(path):
    cfg = read_artifact_config(path)
    return cfg["quantization_config"], load_safetensors(path)


def _assert_bitwise(a, b):
    (ca, ta), (cb, tb) = _artifact(a), _artifact(b)
    assert ca == cb
    assert sorted(ta) == sorted(tb)
    for k in ta:
        assert ta[k].dtype == tb[k].dtype and ta[k].shape == tb[k].shape, k
        assert torch.equal(ta[k].view(torch.uint8), tb[k].view(torch.uint8)), k


CASES = {
    "int8": dict(quant_type="weight_only_int8"),
    "int4": dict(quant_type="weight_only_int4", group_size=32),
    "int4-asym": dict(quant_type="weight_only_int4", group_size=32, symmetric=False),
    "int4-asym-fp16-zp": dict(quant_type="weight_only_int4", symmetric=False, zp_dtype="float16", target="quantspec"),
    "int4-gptq": dict(quant_type="weight_only_int4", group_size=32, **GPTQ),
    "int8-gptq-act-order": dict(quant_type="weight_only_int8", act_order=True, **GPTQ),
    "int4-awq": dict(quant_type="weight_only_int4", group_size=32, **dict(GPTQ, method="awq")),
    "int4-awq-gptq": dict(quant_type="weight_only_int4", group_size=32, **dict(GPTQ, method="awq+gptq")),
    "int4-asym-autoround": dict(quant_type="weight_only_int4", group_size=32, symmetric=False,
                                **dict(GPTQ, method="autoround", iters=20, batch_size=2)),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("model", ["tiny_llama_dir", "bf16_sharded"])
def test_streamed_equals_whole_model(case, model, request, data, tmp_path, monkeypatch):
    src = request.getfixturevalue(model)
    kw = dict(CASES[case], dataset=str(data) if "method" in CASES[case] else None)
    monkeypatch.setattr(stream, "MAX_SHARD_BYTES", 40_000)  # several shards
    streamed = api.quantize(str(src), out=tmp_path / "streamed", **kw)
    assert len(list(streamed.glob("model-*-of-*.safetensors"))) > 1
    _whole_model(monkeypatch)
    _assert_bitwise(streamed, api.quantize(str(src), out=tmp_path / "whole", **kw))


def test_gptq_two_pass_schedule_streamed(tiny_llama_dir, data, tmp_path, monkeypatch):
    monkeypatch.setattr(ptq, "_one_pass", lambda *a: False)
    kw = dict(quant_type="weight_only_int4", group_size=32, dataset=str(data), **GPTQ)
    streamed = api.quantize(str(tiny_llama_dir), out=tmp_path / "streamed", **kw)
    _whole_model(monkeypatch)
    _assert_bitwise(streamed, api.quantize(str(tiny_llama_dir), out=tmp_path / "whole", **kw))


@pytest.mark.parametrize("kw", [
    dict(quant_type="a8w8", kv_cache="int8", target="quantspec"),  # the default recipe: α search + fallback under a budget
    dict(quant_type="a8w8_fp8"),
    dict(quant_type="a8w8", smoothquant_alpha=0.5, fallback_layers=1, method="gptq"),
    dict(quant_type="a8w8", smoothquant_alpha=0.5, fallback_layers=1, method="autoround", iters=10),
], ids=["a8w8-budget-kv", "a8w8_fp8-budget", "a8w8-rank-gptq", "a8w8-rank-autoround"])
def test_streamed_static_recipe_equals_whole_model(kw, tiny_llama_dir, table, tmp_path, monkeypatch):
    kw = dict(kw, calib=str(table), search_samples=2, holdout_samples=2, seq_len=32)
    streamed = api.quantize(str(tiny_llama_dir), out=tmp_path / "streamed", **kw)
    _whole_model(monkeypatch)
    whole = api.quantize(str(tiny_llama_dir), out=tmp_path / "whole", **kw)
    _assert_bitwise(streamed, whole)
    plans = [json.loads((d / "quantspec.json").read_text())["provenance"]["calibration"]["static_plan"]
             for d in (streamed, whole)]
    assert plans[0] == plans[1]


def test_one_decoder_layer_resident_at_a_time(tiny_llama_dir, data, tmp_path, monkeypatch):
    built, loads = [], []
    skeleton, load = qmod._skeleton, CheckpointReader.load

    def recording_load(self, module, prefix, **kw):
        layers = built[0].model.layers
        loads.append((prefix, sum(any(p.device.type != "meta" for p in layer.parameters()) for layer in layers)))
        return load(self, module, prefix, **kw)

    monkeypatch.setattr(qmod, "_skeleton", lambda config, src: built.append(skeleton(config, src)) or built[-1])
    monkeypatch.setattr(CheckpointReader, "load", recording_load)
    api.quantize(str(tiny_llama_dir), "weight_only_int4", tmp_path / "q", dataset=str(data), **GPTQ)
    assert [p for p, _ in loads] == ["model.layers.0", "model.layers.1"]
    assert all(resident == 0 for _, resident in loads)  # the layer before was released


def _interrupt_at(layer):
    def progress(i, n, phase):
        if i == layer and phase == "start":
            raise KeyboardInterrupt
    return progress


@pytest.mark.parametrize("kw", [
    dict(quant_type="weight_only_int4", group_size=32),
    dict(quant_type="weight_only_int4", group_size=32, **GPTQ),
    dict(quant_type="weight_only_int4", group_size=32, **dict(GPTQ, method="awq")),
    dict(quant_type="weight_only_int4", group_size=32, **dict(GPTQ, method="autoround", iters=20, batch_size=2)),
    dict(quant_type="a8w8", search_samples=2, holdout_samples=2, seq_len=32),
], ids=["rtn", "gptq", "awq", "autoround", "a8w8"])
def test_an_interrupted_run_resumes_at_its_last_layer(kw, tiny_llama_dir, data, table, tmp_path, caplog,
                                                      monkeypatch):
    kw = dict(kw, dataset=str(data), resumable=True, calib=str(table) if kw["quant_type"] == "a8w8" else None)
    ref = api.quantize(str(tiny_llama_dir), out=tmp_path / "ref", **kw)
    out = tmp_path / "art"
    with pytest.raises(KeyboardInterrupt):
        api.quantize(str(tiny_llama_dir), out=out, progress=_interrupt_at(1), **kw)
    (state,) = [p for p in tmp_path.iterdir() if p.name.startswith(".art.resume-")]
    assert not out.exists() and "shards" in os.listdir(state)
    assert remove_leftovers(out) == [] and state.is_dir()  # leftover-cleaning keeps a resumable state
    calls = []
    if kw["quant_type"] == "a8w8":  # the plan is reused, not measured again
        monkeypatch.setattr("quantspec.calib.static_plan.plan_static_quant", lambda *a, **k: calls.append(1))
    with caplog.at_level(logging.WARNING, logger="quantspec"):
        api.quantize(str(tiny_llama_dir), out=out, progress=_refuse_layer(0), **kw)
    assert "resuming at layer 2/2" in caplog.text
    assert not calls and not state.exists()
    _assert_bitwise(out, ref)


def _refuse_layer(layer):
    def progress(i, n, phase):
        assert i != layer, f"layer {layer} was done already"
    return progress


def test_a_state_written_halfway_is_resumed_from_its_last_complete_part(tiny_llama_dir, tmp_path, monkeypatch):
    kw = dict(quant_type="weight_only_int8", resumable=True)
    ref = api.quantize(str(tiny_llama_dir), out=tmp_path / "ref", **kw)
    _killed_at_save(3, monkeypatch, tiny_llama_dir, tmp_path / "art", kw)  # rest, layer 0, then killed
    out = api.quantize(str(tiny_llama_dir), out=tmp_path / "art", progress=_refuse_layer(0), **kw)
    _assert_bitwise(out, ref)


def _killed_at_save(n: int, monkeypatch, model, out, kw) -> None:
    """A quantize run into `out` killed before the state of its `n`-th part is written."""
    save = stream.ShardWriter._save
    calls = []

    def dies(self):
        calls.append(1)
        if len(calls) == n:
            raise SystemExit("killed")
        save(self)

    monkeypatch.setattr(stream.ShardWriter, "_save", dies)
    with pytest.raises(SystemExit):
        api.quantize(str(model), out=out, **kw)
    monkeypatch.undo()


def test_gptq_on_the_head_resumes_from_the_last_layers_outputs(tiny_llama_dir, data, tmp_path, monkeypatch):
    """GPTQ quantizes the output head after the layers, on the last one's outputs: a run killed
    before the head's part is written resumes there from the outputs its state kept."""
    kw = dict(quant_type="weight_only_int4", group_size=32, method="gptq", dataset=str(data), num_samples=4,
              seq_len=32, resumable=True, layer_quant_types=("lm_head=weight_only_int8",))
    ref = api.quantize(str(tiny_llama_dir), out=tmp_path / "ref", **kw)
    _killed_at_save(3, monkeypatch, tiny_llama_dir, tmp_path / "art", kw)  # layers 0 and 1, then killed
    out = api.quantize(str(tiny_llama_dir), out=tmp_path / "art", progress=_refuse_layer(1), **kw)
    _assert_bitwise(out, ref)


def test_restart_other_options_and_a_live_run(tiny_llama_dir, tmp_path, caplog):
    kw = dict(quant_type="weight_only_int8", resumable=True)
    out = tmp_path / "art"
    with pytest.raises(KeyboardInterrupt):
        api.quantize(str(tiny_llama_dir), out=out, progress=_interrupt_at(1), **kw)
    (state,) = tmp_path.glob(".art.resume-*")
    with caplog.at_level(logging.WARNING, logger="quantspec"):  # --restart: layer 0 again
        with pytest.raises(KeyboardInterrupt):
            api.quantize(str(tiny_llama_dir), out=out, progress=_interrupt_at(0), restart=True, **kw)
    assert "--restart" in caplog.text and "resuming" not in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="quantspec"):  # other options: the old state goes
        api.quantize(str(tiny_llama_dir), out=out, quant_type="weight_only_int4", resumable=True)
    assert "its inputs or options differ" in caplog.text
    assert [p.name for p in tmp_path.iterdir()] == ["art"]
    with pytest.raises(KeyboardInterrupt):
        api.quantize(str(tiny_llama_dir), out=tmp_path / "b", progress=_interrupt_at(1), **kw)
    (state,) = tmp_path.glob(".b.resume-*")
    (state / "owner").write_text(str(os.getppid()))  # a live process holds it
    with pytest.raises(QuantSpecError, match=r"another quantspec run \(PID \d+\) is writing --out"):
        api.quantize(str(tiny_llama_dir), out=tmp_path / "b", **kw)


@pytest.mark.slow
@pytest.mark.parametrize("kw", [dict(quant_type="weight_only_int8"), dict(quant_type="weight_only_int4"),
                                dict(quant_type="weight_only_int4", symmetric=False)],
                         ids=["int8", "int4", "int4-asym"])
def test_default_model_streamed_equals_whole_model(kw, tmp_path, monkeypatch):
    streamed = api.quantize("smollm2-135m", out=tmp_path / "streamed", **kw)
    _whole_model(monkeypatch)
    _assert_bitwise(streamed, api.quantize("smollm2-135m", out=tmp_path / "whole", **kw))


def test_a_small_interrupted_run_leaves_nothing(tiny_llama_dir, tmp_path):
    """Below the resumable size the working directory goes with the run, and so do the
    directories made for --out."""
    with pytest.raises(KeyboardInterrupt):
        api.quantize(str(tiny_llama_dir), "weight_only_int8", tmp_path / "new" / "sub" / "art",
                     progress=_interrupt_at(1))
    assert list(tmp_path.iterdir()) == []
