"""`quantize --quant-type a8w8 --calib T` with no other flag: α search, the fallback chosen under
the error budget on held-back windows of the table's data, recorded and shown; explicit flags
override each default; data problems are one line naming --dataset."""

import json

import pytest
import torch
from click.testing import CliRunner
from transformers import AutoTokenizer

from quantspec import api
from quantspec.calib.budget import DEFAULT_BUDGET_PCT, HOLDOUT_SAMPLES
from quantspec.calib.data import build_calibration_batches, load_calibration_texts
from quantspec.calib.static_plan import FALLBACK_GROUP
from quantspec.calib.tables import write_table
from quantspec.cli import main
from quantspec.errors import QuantSpecError
from quantspec.model_zoo.checkpoint import model_fingerprint
from quantspec.model_zoo.tiny import TINY_CORPUS

torch.set_num_threads(1)
SEQ, TABLE_SAMPLES = 32, 4
HEADS = ("self_attn.q_proj", "mlp.gate_proj", "mlp.down_proj")
UNITS = (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("self_attn.o_proj",),
         ("mlp.gate_proj", "mlp.up_proj"), ("mlp.down_proj",))


def _cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False, env={"COLUMNS": "400"})


@pytest.fixture(scope="module")
def table(tiny_llama_dir, tmp_path_factory):
    d = tmp_path_factory.mktemp("a8w8_defaults")
    data = d / "calib.txt"
    data.write_text(TINY_CORPUS)
    return api.calibrate(str(tiny_llama_dir), str(data), d / "calib", num_samples=TABLE_SAMPLES,
                         seq_len=SEQ, dtype="float32").path, data


@pytest.fixture(scope="module")
def default_art(tiny_llama_dir, table, tmp_path_factory):
    calib, _ = table
    return api.quantize(str(tiny_llama_dir), "a8w8", tmp_path_factory.mktemp("art") / "a8w8", calib=calib)


def _ppl(model_path, windows):
    """Perplexity through the inference path (paged KV, quantized linears) on these windows."""
    from quantspec.infer.evaluate import perplexity
    from quantspec.infer.loader import load_for_inference

    lm = load_for_inference(str(model_path), dtype=torch.float32, tokenizer=False)
    return perplexity(lm.model, windows.reshape(-1), seq_len=windows.shape[1]).perplexity


def test_default_recipe_stays_within_the_budget_on_held_back_windows(tiny_llama_dir, table, default_art):
    calib, data = table
    info = api.inspect(str(default_art))
    cal = info["calibration"]
    assert cal["smoothquant_alpha"] == "auto" and info["method"] == "rtn"
    fb = info["fallback"]
    assert fb["rule"] == {"by": "budget", "budget_pct": DEFAULT_BUDGET_PCT}
    held = fb["held_back"]
    # the held-back windows are the ones after the table's own, of the table's own data
    assert held["dataset"] == str(data.resolve()) and held["first_window"] == TABLE_SAMPLES
    assert held["windows"] == HOLDOUT_SAMPLES and held["seq_len"] == SEQ
    tok = AutoTokenizer.from_pretrained(str(tiny_llama_dir))
    texts = load_calibration_texts(str(data))
    windows = build_calibration_batches(texts, tok, TABLE_SAMPLES + HOLDOUT_SAMPLES, SEQ, 0)[TABLE_SAMPLES:]
    # measured again here, independently, through the inference path: the written artifact
    # against the float model and the weight-only int8 artifact (the same weights, unsmoothed)
    weight_only = api.quantize(str(tiny_llama_dir), "weight_only_int8", default_art.parent / "w8")
    base, ref, quant = (_ppl(p, windows) for p in (tiny_llama_dir, weight_only, default_art))
    assert held["float_perplexity"] == pytest.approx(base, rel=1e-4)
    assert held["weight_only_perplexity"] == pytest.approx(ref, rel=1e-4)
    delta = 100 * (quant / ref - 1)
    assert held["delta_pct"] == pytest.approx(delta, abs=0.02)
    assert held["over_float_pct"] == pytest.approx(100 * (quant / base - 1), abs=0.02)
    assert delta <= DEFAULT_BUDGET_PCT + 0.02
    chosen = {m["units"]: m["delta_pct"] for m in held["measured"]}
    assert chosen[held["chosen_units"]] == held["delta_pct"]
    if held["chosen_units"] > 0:  # one unit fewer missed the budget
        assert chosen[held["chosen_units"] - 1] > DEFAULT_BUDGET_PCT
    # the fallback group is exactly the chosen units, each whole, none of them smoothed
    cfg = json.loads((default_art / "config.json").read_text())["quantization_config"]
    targets = cfg["config_groups"].get(FALLBACK_GROUP, {}).get("targets", [])
    units = [u["linears"] for u in fb["units"]]
    assert len(units) == held["chosen_units"] and sorted(n for u in units for n in u) == sorted(targets)
    for u in units:
        prefix, rel = u[0].rsplit(".", 2)[0], [n.split(".", 3)[3] for n in u]
        assert tuple(rel) in UNITS and all(n.startswith(prefix) for n in u)
    alphas = cal["static_plan"]["smoothquant_alphas"]
    heads = {f"model.layers.{i}.{h}" for i in range(2) for h in HEADS}
    assert set(alphas) == heads - set(targets)


def test_inspect_shows_the_budget_the_measurements_and_the_units(default_art):
    out = _cli("inspect", default_art).output
    info = api.inspect(str(default_art))
    held = info["fallback"]["held_back"]
    assert f"within +{DEFAULT_BUDGET_PCT:g}% of the weight-only model's" in out and "held-back measured" in out
    k = held["chosen_units"]
    assert f"{k} unit{'' if k == 1 else 's'} {held['delta_pct']:+.2f}% (chosen; {held['over_float_pct']:+.2f}%" in out
    for u in info["fallback"]["units"]:
        assert u["linears"][0].rsplit(".", 1)[0] in out


def test_explicit_flags_override_each_default(tiny_llama_dir, table, tmp_path):
    calib, _ = table
    art = api.quantize(str(tiny_llama_dir), "a8w8", tmp_path / "fixed", calib=calib, smoothquant_alpha=0.5,
                       fallback_layers=0)
    plan = api.inspect(str(art))["calibration"]["static_plan"]
    assert plan["smoothquant_alphas"] == {"*": 0.5} and plan["fallback_layers"] == []
    assert plan["fallback_rule"] == {"by": "none"} and plan["held_back"] is None
    art = api.quantize(str(tiny_llama_dir), "a8w8", tmp_path / "rank", calib=calib, smoothquant_alpha="none",
                       fallback_layers=1)
    plan = api.inspect(str(art))["calibration"]["static_plan"]
    assert plan["smoothquant_alphas"] is None and plan["fallback_rule"]["by"] == "rank"
    assert len(plan["fallback_units"]) == 1 and plan["held_back"] is None
    art = api.quantize(str(tiny_llama_dir), "a8w8_fp8", tmp_path / "loose", calib=calib, fallback_budget=1e6)
    plan = api.inspect(str(art))["calibration"]["static_plan"]
    assert plan["fallback_rule"] == {"by": "budget", "budget_pct": 1e6} and plan["fallback_layers"] == []
    assert [m["units"] for m in plan["held_back"]["measured"]] == [plan["held_back"]["units"], 0]
    r = _cli("quantize", "--model", tiny_llama_dir, "--quant-type", "a8w8", "--calib", calib,
             "--a8w8-fallback-layers", "1", "--a8w8-fallback-budget", "3", "--out", tmp_path / "x")
    assert r.exit_code == 2 and "one way" in r.output and len(r.output.strip().splitlines()) == 1
    r = _cli("quantize", "--model", tiny_llama_dir, "--quant-type", "weight_only_int8",
             "--a8w8-fallback-budget", "3", "--out", tmp_path / "x")
    assert r.exit_code == 2 and "a8w8" in r.output
    for flag, value in (("--a8w8-fallback-budget", "0"), ("--a8w8-fallback-layers", "-1")):
        r = _cli("quantize", "--model", tiny_llama_dir, "--quant-type", "a8w8", "--calib", calib, flag, value,
                 "--out", tmp_path / "x")
        assert r.exit_code == 2 and flag in r.output and len(r.output.strip().splitlines()) == 1


def test_a_table_without_usable_data_names_dataset(tiny_llama_dir, table, tmp_path):
    from quantspec.calib.calibrate import calibrate_model
    from quantspec.model_zoo.checkpoint import load_model

    calib, data = table
    model, _ = load_model(tiny_llama_dir)
    ids = torch.randint(3, 500, (2, SEQ), generator=torch.Generator().manual_seed(0))
    bare = write_table(tmp_path / "bare", calibrate_model(model, ids),
                       {"model_fingerprint": model_fingerprint(tiny_llama_dir)})  # no dataset named
    r = _cli("quantize", "--model", tiny_llama_dir, "--quant-type", "a8w8", "--calib", bare, "--out", tmp_path / "x")
    assert r.exit_code == 2 and "--dataset" in r.output and len(r.output.strip().splitlines()) == 1
    assert not (tmp_path / "x").exists()
    # the flags that need no data make it usable; --dataset makes the defaults usable
    api.quantize(str(tiny_llama_dir), "a8w8", tmp_path / "fixed", calib=bare, smoothquant_alpha=0.5,
                 fallback_layers=0)
    art = api.quantize(str(tiny_llama_dir), "a8w8", tmp_path / "given", calib=bare, dataset=str(data),
                       seq_len=SEQ)
    held = api.inspect(str(art))["fallback"]["held_back"]
    assert held["dataset"] == str(data) and held["first_window"] == 4  # past the α search's windows
    # a table whose data the table used up leaves no held-back window
    tok = AutoTokenizer.from_pretrained(str(tiny_llama_dir))
    small = tmp_path / "small.txt"
    small.write_text(TINY_CORPUS[:1500])
    n = (len(tok(TINY_CORPUS[:1500], add_special_tokens=False).input_ids) + 1) // SEQ  # + eos
    used = api.calibrate(str(tiny_llama_dir), str(small), tmp_path / "used", num_samples=n, seq_len=SEQ).path
    with pytest.raises(QuantSpecError, match=rf"no {SEQ}-token window past the {n} .*--dataset"):
        api.quantize(str(tiny_llama_dir), "a8w8", tmp_path / "y", calib=used)
    small.unlink()  # the table's dataset is gone
    with pytest.raises(QuantSpecError, match="the table's dataset cannot be read .*--dataset"):
        api.quantize(str(tiny_llama_dir), "a8w8", tmp_path / "y", calib=used)


def test_a_budget_no_static_activation_fits_is_one_line(tiny_llama_dir, table, tmp_path, monkeypatch):
    """When the search keeps every unit at float activations (see test_budget), quantize says
    so in one line naming the budget flag instead of writing an a8w8 artifact without any."""
    import quantspec.calib.static_plan as static_plan

    calib, _ = table
    real = static_plan.fallback_under_budget

    def none_fit(model, ranked, *args, **kwargs):
        search = real(model, ranked, *args, **kwargs)
        search.chosen_units = len(ranked)
        return search

    monkeypatch.setattr(static_plan, "fallback_under_budget", none_fit)
    r = _cli("quantize", "--model", tiny_llama_dir, "--quant-type", "a8w8", "--calib", calib, "--out", tmp_path / "x")
    # found after the measuring: the status lines a slow run prints before it may precede the error
    last = r.output.strip().splitlines()[-1]
    assert r.exit_code == 2 and "no static activation fits" in last and "--a8w8-fallback-budget" in last
    assert "Traceback" not in r.output and not (tmp_path / "x").exists()
