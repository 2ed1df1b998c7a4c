"""The compatibility matrix on the tiny Llama: dimensions, fields, unsupported pairs, resume, files.

Artifacts, calibration and perplexity are real (the API's verbs on the tiny model); generation is
scripted (`ScriptedPipeline.generate`) so that speedups, acceptance and losslessness are known
exactly and every test runs in seconds. `test_report_e2e.py` runs real generation.
"""

import json
import xml.etree.ElementTree as ET
from pathlib import Path
from types import SimpleNamespace

import pytest

from quantspec import api
from quantspec.errors import QuantSpecError
from quantspec.quant.args import QuantType
from quantspec.model_zoo.tiny import build_tiny_model
from quantspec.report import Pipeline, ReportConfig, run_report
from quantspec.report.config import NGRAM_COLUMN

SPEC_TPS, BASE_TPS = 30.0, 20.0


class ScriptedPipeline(Pipeline):
    """Real quantize / calibrate / evaluate; scripted generation.

    Without speculation every prompt yields [len(prompt) % 7, 1, 2]; with speculation the same,
    except on bases listed in `lossy` (an extra token: not lossless) and bases listed in `broken`
    (raises, as an unsupported kernel would).
    """

    def __init__(self, lossy=(), broken=()):
        super().__init__(quantize=api.quantize, evaluate=api.evaluate, calibrate=api.calibrate)
        self.lossy, self.broken = set(lossy), set(broken)
        self.calls = []  # (base artifact dir name, speculate_method, cachekv)
        self.spec_settings = set()  # (speculate_backoff, speculate_draft_head) of the speculative runs

    def _base(self, config) -> str:
        name = Path(config.model).name
        return next((q for q in ("weight_only_int8", "weight_only_int4", "a8w8_fp8", "a8w8") if f"-{q}-" in name),
                    "none")

    def generate(self, config, prompts, calib=None):
        base = self._base(config)
        spec = config.speculate_method != "none"
        self.calls.append((base, config.speculate_method, config.cachekv))
        assert (calib is not None) == (config.cachekv != "none")  # a static KV cache gets its table
        if spec:
            self.spec_settings.add((config.speculate_backoff, config.speculate_draft_head))
        if spec and base in self.broken:
            raise RuntimeError(f"no kernel for {base} on this device")
        extra = [9] if spec and base in self.lossy else []
        outs = [SimpleNamespace(token_ids=[len(p) % 7, 1, 2] + extra) for p in prompts]
        stats = {"tokens_per_s": SPEC_TPS if spec else BASE_TPS, "generated_tokens": 3 * len(prompts),
                 "peak_memory_mb": 123.0}
        if spec:
            stats.update(acceptance_rate=0.5, mean_accepted_length=2.0, acceptance_per_position=[0.75, 0.25])
        return outs, stats

    def spec_calls(self):
        return [c for c in self.calls if c[1] != "none"]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("report_cache")


def _config(model, out, cache_dir, **kw):
    base = dict(out=str(out), model=str(model), base_quant_types="none,weight_only_int8,weight_only_int4",
                draft_quant_types="weight_only_int8,none", cachekv="none", cache_dir=str(cache_dir),
                max_new_tokens=8, eval_seq_len=32, eval_windows=2, calib_num_samples=4, calib_seq_len=32)
    base.update(kw)
    return ReportConfig(**base)


def test_matrix_dimensions_and_cell_fields(tiny_llama_dir, tmp_path, cache_dir):
    pipe = ScriptedPipeline(lossy={"weight_only_int4"})
    cfg = _config(tiny_llama_dir, tmp_path / "out", cache_dir, cachekv="none,int8")
    rep = run_report(cfg, pipe)

    bases, drafts, kvs = cfg.base_quant_types, cfg.draft_quant_types, cfg.cachekv
    assert len(rep.cells) == len(bases) * len(drafts) * len(kvs) == 12
    assert {(c.base, c.draft, c.cachekv) for c in rep.cells} == {(b, d, k) for b in bases for d in drafts for k in kvs}
    # one baseline per (base, kv) row, one speculative run per cell
    assert len(pipe.spec_calls()) == 12 and len(pipe.calls) == 12 + len(bases) * len(kvs)
    # a pair is measured as its artifacts: k drafts every step, scored by the draft's own head
    assert pipe.spec_settings == {(False, "artifact")}
    for c in rep.cells:
        assert c.supported, c.reason
        assert c.reason is None
        assert c.lossless is (c.base != "weight_only_int4")
        assert c.mismatched_prompts == (8 if c.base == "weight_only_int4" else 0)
        assert c.speedup == pytest.approx(SPEC_TPS / BASE_TPS)
        assert (c.tokens_per_s, c.base_tokens_per_s) == (SPEC_TPS, BASE_TPS)
        assert c.acceptance_rate == 0.5 and c.mean_accepted_length == 2.0
        assert c.acceptance_per_position == [0.75, 0.25]
        assert c.peak_memory_mb == 123.0 and c.base_peak_memory_mb == 123.0
        assert c.base_artifact_mb > 0 and c.draft_artifact_mb > 0
        assert c.base_perplexity is not None and c.base_perplexity > 1.0
    by = {(c.base, c.draft, c.cachekv): c for c in rep.cells}
    # quantized artifacts are smaller than the fp32 checkpoint, int4 smaller than int8
    assert by["weight_only_int4", "none", "none"].base_artifact_mb < by["weight_only_int8", "none", "none"].base_artifact_mb \
        < by["none", "none", "none"].base_artifact_mb
    # perplexity is the base's: equal across a row, different between fp32 and int4
    assert by["none", "none", "none"].base_perplexity == by["none", "weight_only_int8", "int8"].base_perplexity
    assert by["none", "none", "none"].base_perplexity != by["weight_only_int4", "none", "none"].base_perplexity
    # static KV runs were given the calibration table
    assert ("none", "none", "int8") in pipe.calls
    assert set(rep.baselines) == {f"{b}/kv-{k}" for b in bases for k in kvs}


def test_ngram_has_one_draft_column(tiny_llama_dir, tmp_path, cache_dir):
    pipe = ScriptedPipeline()
    cfg = _config(tiny_llama_dir, tmp_path / "out", cache_dir, speculate_method="inference_with_reference",
                  base_quant_types="none,weight_only_int8")
    rep = run_report(cfg, pipe)
    assert cfg.draft_model is None and cfg.draft_quant_types == (NGRAM_COLUMN,)
    assert [(c.base, c.draft) for c in rep.cells] == [("none", NGRAM_COLUMN), ("weight_only_int8", NGRAM_COLUMN)]
    assert all(c.supported and c.draft_artifact_mb is None for c in rep.cells)


def test_incompatible_draft_is_each_cells_reason(tiny_llama_dir, tmp_path, cache_dir):
    other = build_tiny_model(tmp_path / "other_tok", "llama", tokenizer_variant=1)
    pipe = ScriptedPipeline()
    cfg = _config(tiny_llama_dir, tmp_path / "out", cache_dir, draft_model=str(other),
                  base_quant_types="none,weight_only_int8", draft_quant_types="weight_only_int8")
    rep = run_report(cfg, pipe)
    assert len(rep.cells) == 2
    for c in rep.cells:
        assert not c.supported and c.lossless is None and c.speedup is None
        assert "different tokenizer" in c.reason and str(other) in c.reason
    assert pipe.spec_calls() == []
    assert (Path(cfg.out) / "report.md").read_text().count("different tokenizer") >= 2


def test_one_failing_cell_does_not_stop_the_others(tiny_llama_dir, tmp_path, cache_dir):
    pipe = ScriptedPipeline(broken={"weight_only_int8"})
    cfg = _config(tiny_llama_dir, tmp_path / "out", cache_dir, base_quant_types="none,weight_only_int8,a8w8",
                  draft_quant_types="none")
    rep = run_report(cfg, pipe)
    by = {c.base: c for c in rep.cells}
    assert not by["weight_only_int8"].supported
    assert by["weight_only_int8"].reason == "RuntimeError: no kernel for weight_only_int8 on this device"
    assert by["none"].supported and by["a8w8"].supported  # a8w8 built with the calibration table
    assert by["a8w8"].base_artifact_mb > 0


def test_resume_after_interruption_runs_only_the_rest(tiny_llama_dir, tmp_path, cache_dir):
    out = tmp_path / "out"
    cfg = _config(tiny_llama_dir, out, cache_dir)
    n_cells, stop_after = 6, 2

    class Stop(Exception):
        pass

    done = []

    def interrupt(event, cell, i, total, result):
        if event == "done":
            done.append(cell)
            if len(done) == stop_after:
                raise Stop

    first = ScriptedPipeline()
    with pytest.raises(Stop):
        run_report(cfg, first, progress=interrupt)
    assert len(list((out / "cells").glob("draft__*.json"))) == stop_after
    assert not (out / "report.json").exists()

    events = []
    second = ScriptedPipeline()
    rep = run_report(cfg, second, progress=lambda e, c, i, t, r: events.append((e, c)))
    assert [c for e, c in events if e == "skip"] == done
    started = [c for e, c in events if e == "start"]
    assert len(started) == n_cells - stop_after and not set(started) & set(done)
    assert len(second.spec_calls()) == n_cells - stop_after
    # the first row's baseline was persisted by the first run: only the other rows' baselines ran
    assert len(second.calls) - len(second.spec_calls()) == len({c.base for c in started} - {c.base for c in done})
    assert len(rep.cells) == n_cells and sorted(rep.skipped) == sorted(c.key(rep.meta["settings_hash"]) for c in done)

    third = ScriptedPipeline()
    run_report(cfg, third)
    assert third.calls == []  # everything finished: nothing recomputed
    forced = ScriptedPipeline()
    run_report(_config(tiny_llama_dir, out, cache_dir, force=True), forced)
    assert len(forced.spec_calls()) == n_cells


def test_cells_failing_for_a_missing_module_are_retried(tiny_llama_dir, tmp_path, cache_dir):
    class NoLoader(ScriptedPipeline):
        def generate(self, config, prompts, calib=None):
            raise ModuleNotFoundError("No module named 'quantspec.infer.loader'")

    cfg = _config(tiny_llama_dir, tmp_path / "out", cache_dir, base_quant_types="none", draft_quant_types="none")
    rep = run_report(cfg, NoLoader())
    assert "not available in this build" in rep.cells[0].reason and rep.cells[0].final is False
    rep2 = run_report(cfg, ScriptedPipeline())
    assert rep2.cells[0].supported and rep2.computed == [rep.cells[0].key]


def test_files_written_and_consistent(tiny_llama_dir, tmp_path, cache_dir):
    out = tmp_path / "out"
    rep = run_report(_config(tiny_llama_dir, out, cache_dir, cachekv="none,int8"),
                     ScriptedPipeline(lossy={"weight_only_int4"}, broken={"weight_only_int8"}))
    data = json.loads((out / "report.json").read_text())
    assert data["cells"] == [c.to_dict() for c in rep.cells]
    assert data["config"]["base_quant_types"] == ["none", "weight_only_int8", "weight_only_int4"]
    for c in data["cells"]:
        assert json.loads((out / "cells" / f"{c['key']}.json").read_text()) == c
    png = (out / "report.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    md = (out / "report.md").read_text()
    assert "![speedup and acceptance per pair](report.png)" in md
    assert md.count("## KV cache:") == 2
    assert "1.50× 50% ✓" in md and "1.50× 50% ✗ lossy" in md
    assert "no: RuntimeError: no kernel for weight_only_int8" in md
    for b in ("none", "weight_only_int8", "weight_only_int4"):
        ppl = data["perplexity"][b]["perplexity"]
        assert f"| {b} | {ppl:.3f} |" in md


def test_svg_heatmap_without_matplotlib(tiny_llama_dir, tmp_path, cache_dir):
    from quantspec.report.render import _heatmap_svg

    rep = run_report(_config(tiny_llama_dir, tmp_path / "out", cache_dir, base_quant_types="none,weight_only_int8",
                             draft_quant_types="none"), ScriptedPipeline(broken={"weight_only_int8"}),
                     write_files=False)
    svg = _heatmap_svg(rep, tmp_path / "report.svg").read_text()
    root = ET.fromstring(svg)
    texts = [t.text for t in root.iter("{http://www.w3.org/2000/svg}text")]
    assert "1.50×" in texts and "n/a" in texts and "base weight_only_int8" in texts


def test_bad_input(tiny_llama_dir, tmp_path):
    with pytest.raises(QuantSpecError, match=r"--base-quant-types: unknown quant type 'int3'; use one of: none, "
                                             r"weight_only_int8, weight_only_int4, a8w8, a8w8_fp8"):
        ReportConfig(out=str(tmp_path), base_quant_types="none,int3")
    with pytest.raises(QuantSpecError, match="--draft-quant-types: unknown quant type 'w4'"):
        ReportConfig(out=str(tmp_path), draft_quant_types=["w4"])
    with pytest.raises(QuantSpecError, match="--cachekv: unknown KV cache type 'int4'"):
        ReportConfig(out=str(tmp_path), cachekv="none,int4")
    with pytest.raises(QuantSpecError, match="mtp needs --draft-model"):
        ReportConfig(out=str(tmp_path), speculate_method="mtp")
    with pytest.raises(QuantSpecError, match="eagle needs --draft-model EAGLE3_DIR"):
        ReportConfig(out=str(tmp_path), speculate_method="eagle")
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    with pytest.raises(QuantSpecError, match="--out .*a_file is not a directory"):
        run_report(ReportConfig(out=str(blocker / "sub"), model=str(tiny_llama_dir)), ScriptedPipeline())
    with pytest.raises(QuantSpecError, match="--out .*a_file exists and is not a directory"):
        run_report(ReportConfig(out=str(blocker), model=str(tiny_llama_dir)), ScriptedPipeline())


def test_cli_bad_input_is_one_line(tmp_path):
    from click.testing import CliRunner

    from quantspec.cli import main

    res = CliRunner().invoke(main, ["report", "--out", str(tmp_path), "--base-quant-types", "none,int3"])
    assert res.exit_code == 2
    (line,) = res.output.strip().splitlines()
    head, _, listed = line.partition("; use one of: ")
    assert head == "error: --base-quant-types: unknown quant type 'int3'"
    assert listed.split(", ") == ["none"] + [t.value for t in QuantType]


def test_int4_recipe_asym_float_zero_points(tiny_llama_dir, tmp_path, cache_dir):
    """--asym --zp-dtype reach the int4 artifacts (and only them), and key their cache entries."""
    from quantspec.quant.artifact import read_quant_config

    run_report(_config(tiny_llama_dir, tmp_path / "r", cache_dir, base_quant_types="weight_only_int4",
                       draft_quant_types="weight_only_int8", group_size=32, symmetric=False,
                       zp_dtype="float16"), ScriptedPipeline())
    built = {p.name: read_quant_config(p) for p in Path(cache_dir).iterdir() if (p / "config.json").is_file()}
    int4 = [qc for name, qc in built.items() if "-weight_only_int4-" in name]
    fzp = [qc for qc in int4 if qc.config_groups["group_0"].weights.zp_dtype == "float16"]
    assert fzp and not fzp[0].config_groups["group_0"].weights.symmetric
    int8 = [qc for name, qc in built.items() if "-weight_only_int8-" in name]
    assert all(qc.config_groups["group_0"].weights.zp_dtype is None for qc in int8)
    with pytest.raises(QuantSpecError, match="--zp-dtype needs --asym"):
        ReportConfig(out=str(tmp_path), zp_dtype="float16")


@pytest.mark.parametrize("method", ["gptq", "awq+gptq", "autoround"])
def test_data_methods_quantize_weight_only_columns_on_the_calibration_data(method, tiny_llama_dir, tmp_path,
                                                                            cache_dir):
    """--quant-method gptq / awq+gptq / autoround on weight-only types read the report's calibration data (no
    table holds it), key their cache entries by it, and a draft model quantizes the same way."""
    from quantspec.quant.artifact import read_provenance

    calib = tmp_path / "calib.txt"
    calib.write_text("The quick brown fox jumps over the lazy dog. " * 80)
    run_report(_config(tiny_llama_dir, tmp_path / "r", cache_dir, speculate_method="draft",
                       base_quant_types="weight_only_int4", draft_quant_types="weight_only_int8",
                       quant_method=method, calib_dataset=str(calib), group_size=32), ScriptedPipeline())
    built = [p for p in Path(cache_dir).iterdir() if (p / "config.json").is_file()
             and read_provenance(p)["provenance"]["method"] == method]
    kinds = {name for p in built for name in ("weight_only_int4", "weight_only_int8") if f"-{name}-" in p.name}
    assert kinds == {"weight_only_int4", "weight_only_int8"}
    prov = read_provenance(built[0])["provenance"]
    assert prov["calibration"]["dataset"] == str(calib) and prov["calibration"]["num_samples"] == 4
    with pytest.raises(QuantSpecError, match="--quant-method awq is for weight-only types, not a8w8"):
        ReportConfig(out=str(tmp_path), quant_method="awq", base_quant_types="none,a8w8")
    with pytest.raises(QuantSpecError, match="--quant-method autoround tunes integer weights, and a8w8_fp8's"):
        ReportConfig(out=str(tmp_path), quant_method="autoround", base_quant_types="none,weight_only_int4,a8w8_fp8")


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_draft_heads_take_gptq_on_the_base_and_are_rounded_otherwise(method, tiny_llama_dir, tmp_path):
    """A Medusa column under --quant-method gptq: GPTQ on the report's base's hidden states over the
    calibration data (`calib.draft_calib`); under a method for base models alone, round to nearest."""
    from quantspec.quant.artifact import read_provenance
    from test_report_e2e import _head

    calib = tmp_path / "calib.txt"
    calib.write_text("The quick brown fox jumps over the lazy dog. " * 80)
    heads = _head("medusa", tiny_llama_dir, tmp_path / "medusa")
    cache_dir = tmp_path / "cache"  # its own: the head's entries alone
    run_report(_config(tiny_llama_dir, tmp_path / "r", cache_dir, speculate_method="medusa", draft_model=str(heads),
                       base_quant_types="none", draft_quant_types="weight_only_int4", quant_method=method,
                       calib_dataset=str(calib), group_size=32), ScriptedPipeline())
    built = [p for p in Path(cache_dir).iterdir() if (p / "config.json").is_file() and p.name.startswith("medusa-")]
    assert len(built) == 1
    prov = read_provenance(built[0])["provenance"]
    assert prov["method"] == ("gptq" if method == "gptq" else "rtn")
    if method == "gptq":
        assert prov["calibration"]["base"] == str(tiny_llama_dir) and prov["calibration"]["dataset"] == str(calib)


def test_a_static_draft_head_column_is_calibrated_on_the_base(tiny_llama_dir, tmp_path):
    """An a8w8 Medusa column: the heads' own table, measured on the report's base's hidden states
    (`calib.draft_scales`), gives their static input scales."""
    from quantspec.quant.artifact import read_provenance
    from test_report_e2e import _head

    calib = tmp_path / "calib.txt"
    calib.write_text("The quick brown fox jumps over the lazy dog. " * 80)
    heads = _head("medusa", tiny_llama_dir, tmp_path / "medusa")
    cache_dir = tmp_path / "cache"
    run_report(_config(tiny_llama_dir, tmp_path / "r", cache_dir, speculate_method="medusa", draft_model=str(heads),
                       base_quant_types="none", draft_quant_types="a8w8", calib_dataset=str(calib)),
               ScriptedPipeline())
    (built,) = [p for p in Path(cache_dir).iterdir() if (p / "config.json").is_file() and p.name.startswith("medusa-")]
    table = read_provenance(built)["provenance"]["calibration"]["calibration"]
    assert table["draft"] == {"kind": "medusa", "base": str(tiny_llama_dir),
                              "base_fingerprint": table["draft"]["base_fingerprint"]}
    assert json.loads((built / "config.json").read_text())["quantization_config"]["config_groups"]
