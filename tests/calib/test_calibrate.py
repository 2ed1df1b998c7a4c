"""The calibration pass: tables vs an independent full-model reference, bad input, the CLI."""

import json

import pytest
import torch
from click.testing import CliRunner

from quantspec.calib.calibrate import CalibrateConfig, calibrate_model, run_calibration
from quantspec.calib.data import build_calibration_batches, load_calibration_texts
from quantspec.calib.tables import read_table
from quantspec.errors import QuantSpecError
from quantspec.model_zoo.checkpoint import load_model, model_fingerprint
from quantspec.model_zoo.llama import DenseCausalAttention
from quantspec.model_zoo.tiny import TINY_CORPUS

torch.set_num_threads(1)
N, S = 4, 32


@pytest.fixture(scope="module")
def calib_file(tmp_path_factory):
    p = tmp_path_factory.mktemp("data") / "calib.jsonl"
    docs = [d for d in TINY_CORPUS.split("\n") if d.strip()]
    p.write_text("\n".join(json.dumps({"text": d, "id": i}) for i, d in enumerate(docs)))
    return p


def _batches(model_dir, calib_file, seed=0):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    return build_calibration_batches(load_calibration_texts(str(calib_file)), tok, N, S, seed=seed)


def reference_absmax(model, ids):
    """Whole-model forward in one batch, plain hooks: absmax per Linear input / channel / KV head."""
    chan, kv = {}, {}
    hooks = []
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Linear) and name.startswith("model.layers."):
            def pre(mod, args, _n=name):
                a = args[0].abs().reshape(-1, args[0].shape[-1]).amax(dim=0)
                chan[_n] = a if _n not in chan else torch.maximum(chan[_n], a)
            hooks.append(m.register_forward_pre_hook(pre))

    def kv_hook(i, k, v):
        kv[i] = (k.abs().amax(dim=(0, 1, 3)), v.abs().amax(dim=(0, 1, 3)))

    n, s = ids.shape
    with torch.no_grad():
        model(ids.reshape(-1), torch.arange(s).repeat(n), DenseCausalAttention(n, s, kv_hook))
    for h in hooks:
        h.remove()
    return chan, kv


def test_minmax_table_matches_reference(tmp_path, tiny_llama_dir, calib_file):
    r = run_calibration(CalibrateConfig(dataset=str(calib_file), out=str(tmp_path / "t"),
                                        model=str(tiny_llama_dir), num_samples=N, seq_len=S,
                                        batch_size=3, kv_observer="minmax", dtype="float32"))
    table = read_table(r.path, model_dir=tiny_llama_dir)
    assert table.meta["dtype"] == "float32"
    assert table.meta["model_fingerprint"] == model_fingerprint(tiny_llama_dir)
    assert table.meta["num_samples"] == N and table.meta["observer"] == "minmax"
    model, _ = load_model(tiny_llama_dir)
    chan, kv = reference_absmax(model, _batches(tiny_llama_dir, calib_file))
    assert set(table.linear_names) == set(chan)
    for name, a in chan.items():
        torch.testing.assert_close(table.input_channel_absmax(name), a, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(table.input_absmax(name), a.amax(), rtol=1e-5, atol=1e-6)
    k, v = table.kv_absmax()
    for i, (ka, va) in kv.items():
        torch.testing.assert_close(k[i], ka, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(v[i], va, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("native", [True, False])
def test_auto_dtype_is_bf16_only_where_native(native, monkeypatch, tmp_path, tiny_llama_dir, calib_file):
    """--dtype auto (the default) observes in bfloat16 only on hardware that computes it natively,
    records the dtype it used, and its scales stay close to the float32 table's."""
    from quantspec.calib import calibrate as cal

    monkeypatch.setattr(cal, "_cpu_has_native_bf16", lambda: native)
    assert CalibrateConfig(dataset="x", out="y").dtype == "auto"
    kw = dict(dataset=str(calib_file), model=str(tiny_llama_dir), num_samples=N, seq_len=S)
    auto = read_table(run_calibration(CalibrateConfig(out=str(tmp_path / "a"), **kw)).path)
    assert auto.meta["dtype"] == ("bfloat16" if native else "float32")
    ref = read_table(run_calibration(CalibrateConfig(out=str(tmp_path / "f"), dtype="float32", **kw)).path)
    for name in ref.linear_names:
        torch.testing.assert_close(auto.input_absmax(name), ref.input_absmax(name),
                                   rtol=0.05 if native else 0, atol=0)
    assert cal.resolve_calibration_dtype("float16") == "float16"


def test_default_kv_observer_is_mse(tmp_path, tiny_llama_dir, calib_file):
    """K/V scales default to the MSE observer (measured best for the static KV cache): the same
    per-head values as an explicit kv_observer="mse", clipped at or below the minmax absmax."""
    from quantspec.calib.calibrate import DEFAULT_KV_OBSERVER

    assert DEFAULT_KV_OBSERVER == "mse"
    kw = dict(dataset=str(calib_file), model=str(tiny_llama_dir), num_samples=N, seq_len=S)
    d = read_table(run_calibration(CalibrateConfig(out=str(tmp_path / "d"), **kw)).path)
    m = read_table(run_calibration(CalibrateConfig(out=str(tmp_path / "m"), kv_observer="mse", **kw)).path)
    x = read_table(run_calibration(CalibrateConfig(out=str(tmp_path / "x"), kv_observer="minmax", **kw)).path)
    assert d.meta["kv_observer"] == "mse" and x.meta["kv_observer"] == "minmax"
    for a, b, c in zip(d.kv_absmax(), m.kv_absmax(), x.kv_absmax()):
        assert torch.equal(a, b) and bool((a <= c * (1 + 1e-6)).all())
    for name in d.linear_names:  # Linear inputs keep the --observer (minmax)
        assert torch.equal(d.input_absmax(name), x.input_absmax(name))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_streamed_layers_equal_the_whole_model(dtype, tiny_qwen2_dir, calib_file, tmp_path):
    """run_calibration reads one layer at a time from the checkpoint: its table is bitwise the
    one of the whole model loaded in memory."""
    a = read_table(run_calibration(CalibrateConfig(dataset=str(calib_file), out=str(tmp_path / "a"), dtype=dtype,
                                                   model=str(tiny_qwen2_dir), num_samples=N, seq_len=S)).path)
    model, _ = load_model(tiny_qwen2_dir, dtype=getattr(torch, dtype))
    b = calibrate_model(model, _batches(tiny_qwen2_dir, calib_file), kv_observer="mse")
    assert set(a.tensors) == set(b)
    assert all(torch.equal(a.tensors[k], b[k]) for k in b)


def test_an_interrupted_calibration_resumes_at_its_last_layer(tiny_llama_dir, calib_file, tmp_path, caplog):
    import logging

    kw = dict(dataset=str(calib_file), model=str(tiny_llama_dir), num_samples=N, seq_len=S, resumable=True)
    ref = read_table(run_calibration(CalibrateConfig(out=str(tmp_path / "ref"), **kw)).path)

    def stop_at_1(i, n, phase):
        if i == 1:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_calibration(CalibrateConfig(out=str(tmp_path / "t"), **kw), progress=stop_at_1)
    assert len(list(tmp_path.glob(".t.resume-*"))) == 1 and not (tmp_path / "t").exists()

    def not_0(i, n, phase):
        assert i != 0, "layer 0 was done already"

    with caplog.at_level(logging.WARNING, logger="quantspec"):
        t = read_table(run_calibration(CalibrateConfig(out=str(tmp_path / "t"), **kw), progress=not_0).path)
    assert "resuming at layer 2/2" in caplog.text and not list(tmp_path.glob(".t.resume-*"))
    assert set(t.tensors) == set(ref.tensors) and all(torch.equal(t.tensors[k], ref.tensors[k]) for k in t.tensors)


@pytest.mark.parametrize("observer", ["percentile", "mse"])
def test_clipping_observers_stay_below_max(observer, tiny_llama_dir, calib_file):
    model, _ = load_model(tiny_llama_dir)
    ids = _batches(tiny_llama_dir, calib_file)
    mm = calibrate_model(model, ids, observer="minmax")
    clip = calibrate_model(model, ids, observer=observer, percentile=99.0)
    assert set(mm) == set(clip)
    for key in mm:
        if key.endswith("channel_absmax"):  # always min/max (SmoothQuant)
            assert torch.equal(mm[key], clip[key])
        else:
            assert (clip[key] <= mm[key] + 1e-6).all() and (clip[key] > 0).all()
    assert any((clip[k] < 0.99 * mm[k]).any() for k in mm if k.endswith("input_absmax"))


def test_nan_activation_names_the_layer(tiny_llama_dir, calib_file):
    model, _ = load_model(tiny_llama_dir)
    with torch.no_grad():
        model.model.layers[1].post_attention_layernorm.weight[3] = float("nan")
    with pytest.raises(QuantSpecError, match=r"model\.layers\.1\.mlp\.gate_proj.*NaN"):
        calibrate_model(model, _batches(tiny_llama_dir, calib_file))


def test_bad_data(tmp_path, tiny_llama_dir, calib_file):
    cfg = dict(model=str(tiny_llama_dir), out=str(tmp_path / "t"), seq_len=S)
    with pytest.raises(QuantSpecError, match=r"only \d+ samples of --seq-len 32, but --num-samples 100000"):
        run_calibration(CalibrateConfig(dataset=str(calib_file), num_samples=100000, **cfg))
    with pytest.raises(QuantSpecError, match="no field 'body'; fields are: text, id"):
        run_calibration(CalibrateConfig(dataset=str(calib_file), text_field="body", num_samples=2, **cfg))
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(QuantSpecError, match="is empty"):
        run_calibration(CalibrateConfig(dataset=str(empty), num_samples=2, **cfg))
    blank = tmp_path / "blank.jsonl"
    blank.write_text('{"text": "  "}\n{"text": ""}\n')
    with pytest.raises(QuantSpecError, match="only blank texts"):
        run_calibration(CalibrateConfig(dataset=str(blank), num_samples=2, **cfg))
    assert not (tmp_path / "t").exists()  # nothing partial was written
    with pytest.raises(QuantSpecError, match="observer 'max' unknown"):
        CalibrateConfig(dataset="x", out="y", observer="max")


def test_cli_calibrate(tmp_path, tiny_llama_dir, calib_file):
    from quantspec.cli import main

    out = tmp_path / "t"
    args = ["calibrate", "--model", str(tiny_llama_dir), "--dataset", str(calib_file),
            "--num-samples", "2", "--seq-len", "16", "--observer", "percentile",
            "--percentile", "99.9", "--out", str(out)]
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 0, res.output
    table = read_table(out, model_dir=tiny_llama_dir)
    assert table.meta["observer"] == "percentile" and table.meta["percentile"] == 99.9
    assert table.meta["seq_len"] == 16 and table.num_layers == 2
    bad = CliRunner().invoke(main, args[:-1] + [str(tmp_path / "u"), "--text-field", "body"])
    assert bad.exit_code == 2
    assert "no field 'body'" in bad.output and "Traceback" not in bad.output
