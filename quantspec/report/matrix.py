"""The per-pair compatibility matrix: run every cell, each on its own, resumably.

A cell is (speculation method, base quant type, draft quant type, KV-cache type). For a cell we
1. build (or reuse from the content-keyed cache) the base artifact and the draft artifact,
   calibrating once when static activation or KV scales are needed;
2. run the prompts greedily on the same base *without* speculation — the cell's baseline, shared
   by every cell of its (base, KV) row and kept in `cells/baseline-*.json` — and *with* it;
3. record: supported (or the reason), lossless (greedy token ids equal the baseline's for every
   prompt), acceptance rate (accepted / drafted tokens), mean accepted length (tokens emitted per
   base forward after prefill; 1.0 = no gain), tokens/s and speedup (spec tokens/s ÷ baseline
   tokens/s), peak memory, artifact sizes, and the base's held-out perplexity.

Isolation: anything raised while computing a cell (a missing verb, an incompatible draft,
missing scales, a quant type this device cannot run) becomes that cell's `reason`; the report
goes on. Only interrupts (and exceptions from the caller's `progress` callback) stop it.

Resume: each finished cell is written atomically to `out/cells/<key>.json` the moment it is done;
the key is the cell's coordinates + a hash of the run's settings (model fingerprints, prompts,
max new tokens, ...). A rerun reads finished cells instead of recomputing them; `force=True`
recomputes everything.
"""

from __future__ import annotations

import json
import os
import platform
import time
import traceback
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Callable

from quantspec.errors import QuantSpecError
from quantspec.outputs import check_output_dir, write_json, write_text
from quantspec.report.cache import ArtifactCache
from quantspec.report.config import NGRAM_COLUMN, Cell, ReportConfig, file_sha, settings_hash
from quantspec.report.defaults import DEFAULT_CALIB_TEXT, DEFAULT_EVAL_TEXT, DEFAULT_PROMPTS
from quantspec.report.pipeline import Pipeline, Unsupported, artifact_mb

__all__ = ["CellResult", "Report", "Progress", "run_report", "read_prompts", "check_writable"]

CELLS_DIR = "cells"
REPORT_VERSION = 1

# progress(event, cell, index, total, result): event is "start" (about to compute), "done"
# (computed and written), or "skip" (read back from a previous run). Exceptions it raises
# propagate (that is how a caller — or a test — interrupts a report).
Progress = Callable[[str, Cell, int, int, "CellResult | None"], None]


@dataclass
class CellResult:
    """One cell of the matrix; `None` means "not measured" (see `reason`)."""

    key: str
    method: str
    base: str
    draft: str
    cachekv: str
    kv_cache: str | None = None  # the KV cache the cell's generations ran, with its scales' origin
    supported: bool = False
    reason: str | None = None
    lossless: bool | None = None
    mismatched_prompts: int | None = None
    acceptance_rate: float | None = None
    mean_accepted_length: float | None = None
    acceptance_per_position: list[float] = field(default_factory=list)
    tokens_per_s: float | None = None
    base_tokens_per_s: float | None = None
    speedup: float | None = None
    generated_tokens: int | None = None
    peak_memory_mb: float | None = None
    base_peak_memory_mb: float | None = None
    base_artifact_mb: float | None = None
    draft_artifact_mb: float | None = None
    base_perplexity: float | None = None
    base_perplexity_reason: str | None = None
    elapsed_s: float = 0.0
    # False when the reason is this build, not the pair (a verb or module not there yet): a rerun
    # recomputes such a cell instead of reusing it
    final: bool = True

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "CellResult":
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


@dataclass
class Report:
    """What `run_report` returns and writes to report.json."""

    config: dict
    cells: list[CellResult]
    perplexity: dict[str, dict]  # base quant type → {"perplexity": float} or {"reason": str}
    baselines: dict[str, dict]  # "<base>/kv-<cachekv>" → tokens_per_s, peak memory, or reason
    meta: dict
    computed: list[str] = field(default_factory=list)  # keys computed by this run
    skipped: list[str] = field(default_factory=list)  # keys read back from a previous run

    def to_dict(self) -> dict:
        return {"version": REPORT_VERSION, "config": self.config, "meta": self.meta,
                "perplexity": self.perplexity, "baselines": self.baselines,
                "cells": [c.to_dict() for c in self.cells]}

    def cell(self, base: str, draft: str, cachekv: str) -> CellResult | None:
        return next((c for c in self.cells if (c.base, c.draft, c.cachekv) == (base, draft, cachekv)), None)


# ---------------------------------------------------------------------------------------------
# files


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None  # a missing or damaged file is recomputed


def check_writable(out: Path, cache_dir: Path | None = None) -> None:
    """Prove, before any cell runs, that `out` (resumed when it holds an earlier run) and the
    artifact cache can be written, or raise one line naming the flag."""
    check_output_dir(out, "--out", overwrite=True)
    if cache_dir is not None:
        check_output_dir(cache_dir, "--cache-dir", overwrite=True)


def read_prompts(path: str | None) -> list[str]:
    if path is None:
        return list(DEFAULT_PROMPTS)
    from quantspec.infer.predictor import read_jsonl

    return [r["src"] for r in read_jsonl(path, flag="--prompts-file")]


def _is_transient(e: BaseException) -> bool:
    """Failures of the build (a missing module or verb), which a rerun after an upgrade may fix."""
    return isinstance(e, (ImportError, Unsupported)) and "not available in this build" in _reason(e)


def _reason(e: BaseException) -> str:
    """One line for a cell's failure: the user-facing message, or the exception type + message."""
    if isinstance(e, QuantSpecError):
        msg = str(e)
    elif isinstance(e, ImportError):
        msg = f"not available in this build ({e})"
    elif isinstance(e, NotImplementedError):
        msg = f"not implemented: {e}" if str(e) else "not implemented"
    else:
        msg = f"{type(e).__name__}: {e}"
    return " ".join(msg.split())[:300]


class _Failed(Exception):
    """A shared step (artifact, baseline) failed earlier; re-raised for every cell that needs it."""

    def __init__(self, reason: str, transient: bool = False):
        super().__init__(reason)
        self.transient = transient


# ---------------------------------------------------------------------------------------------
# the run


class _Run:
    """State shared by the cells of one report: memoized artifacts, baselines, perplexities."""

    def __init__(self, config: ReportConfig, pipeline: Pipeline, out: Path):
        self.config, self.pipeline, self.out = config, pipeline, out
        self.cache = ArtifactCache(config.artifact_cache, pipeline)
        self.prompts = read_prompts(config.prompts_file)
        self._memo: dict[tuple, object] = {}
        self.settings = self._settings()
        self.hash = settings_hash(self.settings)

    # -- keys --------------------------------------------------------------------------------

    def _settings(self) -> dict:
        c = self.config
        s = c.settings()
        s["model_fingerprint"] = self.cache.fingerprint(c.model)
        if c.draft_model:
            s["draft_fingerprint"] = self.cache.fingerprint(c.draft_model)
        s["prompts"] = file_sha(c.prompts_file) if c.prompts_file else "builtin"
        s["eval_text"] = file_sha(c.eval_text) if c.eval_text else "builtin"
        s["calib_dataset"] = self.cache.dataset_fingerprint(c.calib_dataset) if c.calib_dataset else "builtin"
        for k in ("model", "draft_model", "prompts_file"):
            s.pop(k, None)
        return s

    def _memoized(self, key: tuple, fn):
        """Compute once; a failure is remembered and re-raised (as its one-line reason)."""
        if key not in self._memo:
            try:
                self._memo[key] = ("ok", fn())
            except (KeyboardInterrupt, SystemExit):
                raise
            except _Failed as e:
                self._memo[key] = ("err", (str(e), e.transient))
            except Exception as e:  # noqa: BLE001 — becomes the reason of every cell that needs it
                self._memo[key] = ("err", (_reason(e), _is_transient(e)))
        status, value = self._memo[key]
        if status == "err":
            raise _Failed(*value)
        return value

    def _builtin_file(self, name: str, text: str) -> Path:
        path = self.config.artifact_cache / name
        if not path.is_file() or path.read_text() != text:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_text(path, text)
        return path

    # -- shared steps --------------------------------------------------------------------------

    def calibration(self, model: str) -> tuple[Path, str]:
        c = self.config

        def build():
            dataset, num_samples, seq_len = self.calibration_data()
            return self.cache.calibration(model, dataset, num_samples=num_samples, seq_len=seq_len,
                                          dtype=_float_dtype(c.dtype), base=c.model if self._head(model) else None)

        return self._memoized(("calib", model), build)

    def calibration_data(self) -> tuple[str, int, int]:
        """(dataset, samples, sequence length) of the tables and of GPTQ / AWQ on weight-only types."""
        c = self.config
        dataset = c.calib_dataset or str(self._builtin_file("builtin-calib.txt", DEFAULT_CALIB_TEXT))
        # the built-in text holds ~1000 tokens: two windows of 256 for the table and one held
        # back for a8w8's fallback budget; pass --calib-dataset for more
        return dataset, c.calib_num_samples if c.calib_dataset else min(c.calib_num_samples, 2), c.calib_seq_len

    def _head(self, model: str) -> bool:
        """Whether `model` is a draft head (MTP, Medusa, EAGLE-3) of the report's base: its
        calibration runs on the base's hidden states (`calib.draft_calib`, `calib.draft_scales`)."""
        return model != self.config.model and self.config.speculate_method != "draft"

    def artifact(self, model: str, quant_type: str) -> Path:
        c = self.config

        def build():
            from quantspec.report.config import CALIB_QUANT_TYPES

            calib = self.calibration(model) if quant_type in CALIB_QUANT_TYPES else None
            # a draft head (MTP, Medusa, EAGLE-3) takes GPTQ on the base's hidden states (`calib.draft_calib`);
            # the other methods are for base models, and it is rounded to nearest under them
            head = self._head(model)
            method = "rtn" if head and c.quant_method != "gptq" else c.quant_method
            data = self.calibration_data() if method != "rtn" and calib is None else None
            return self.cache.artifact(model, quant_type, method=method, group_size=c.group_size,
                                       calib=calib, symmetric=c.symmetric, zp_dtype=c.zp_dtype, data=data,
                                       base=c.model if head and method == "gptq" else None)

        return self._memoized(("artifact", model, quant_type), build)

    def generate(self, model: Path, cachekv: str, *, speculate: bool, draft: Path | None = None):
        """(outputs, stats) of the report's prompts on `model` with the KV cache `cachekv`."""
        from quantspec.infer.predictor import InferConfig

        c = self.config
        kw = {}
        calib = self.calibration(c.model)[0] if cachekv != "none" else None
        if speculate:
            kw.update(speculate_method=c.speculate_method,
                      speculate_max_draft_token_num=c.speculate_max_draft_token_num,
                      speculate_max_ngram_size=c.speculate_max_ngram_size,
                      # measure the pair itself: always draft k tokens (the runtime's back-off and
                      # a head's confidence gate would stop drafting where it does not pay, hiding
                      # the pair's acceptance)
                      speculate_backoff=False, speculate_min_confidence=0.0)
            if c.speculate_method == "draft":  # ... with the draft artifact's own head
                kw["speculate_draft_head"] = "artifact"
            if draft is not None:
                kw["draft_model"] = str(draft)
        config = InferConfig(model=str(model), dtype=c.dtype, device=c.device, max_new_tokens=c.max_new_tokens,
                             max_length=self._max_length(), decode_strategy="greedy", cachekv=cachekv, **kw)
        return self.pipeline.generate(config, self.prompts, calib)

    def _max_length(self) -> int:
        # a few hundred prompt tokens is plenty for report prompts; a small cache keeps memory low
        return max(512, self.config.max_new_tokens + 384)

    def baseline(self, base: str, cachekv: str) -> dict:
        """The base (quantized as `base`, KV as `cachekv`) without speculation; persisted."""
        path = self.out / CELLS_DIR / f"baseline__{base}__kv-{cachekv}__{self.hash}.json"

        def build():
            if not self.config.force and (cached := _read_json(path)) is not None:
                return cached
            model = self.artifact(self.config.model, base)
            outs, stats = self.generate(model, cachekv, speculate=False)
            rec = {"token_ids": [list(o.token_ids) for o in outs], "tokens_per_s": stats["tokens_per_s"],
                   "generated_tokens": stats["generated_tokens"], "peak_memory_mb": stats.get("peak_memory_mb"),
                   "wall_s": stats.get("wall_s")}
            write_json(path, rec)
            return rec

        return self._memoized(("baseline", base, cachekv), build)

    def perplexity(self, base: str) -> dict:
        path = self.out / CELLS_DIR / f"perplexity__{base}__{self.hash}.json"
        c = self.config

        def build():
            if not c.force and (cached := _read_json(path)) is not None and cached.get("final", True):
                return cached
            try:
                model = self.artifact(c.model, base)
                text = Path(c.eval_text) if c.eval_text else self._builtin_file("builtin-eval.txt", DEFAULT_EVAL_TEXT)
                rec = {"perplexity": self.pipeline.perplexity(str(model), text, windows=c.eval_windows,
                                                              seq_len=c.eval_seq_len, dtype=_float_dtype(c.dtype),
                                                              device=c.device)}
            except (KeyboardInterrupt, SystemExit):
                raise
            except _Failed as e:
                rec = {"reason": str(e), "final": not e.transient}
            except Exception as e:  # noqa: BLE001
                rec = {"reason": _reason(e), "final": not _is_transient(e)}
            write_json(path, rec)
            return rec

        return self._memoized(("ppl", base), build)

    def check_draft_compatible(self) -> None:
        """The draft must share the base's tokenizer (its token ids are verified by the base)."""
        c = self.config

        def check():
            if c.speculate_method != "draft" or c.draft_model == c.model:
                return True
            self.pipeline.check_draft_compatible(c.model, c.draft_model)
            return True

        self._memoized(("draft-compatible",), check)

    # -- one cell ------------------------------------------------------------------------------

    def run_cell(self, cell: Cell, key: str) -> CellResult:
        c = self.config
        r = CellResult(key=key, method=cell.method, base=cell.base, draft=cell.draft, cachekv=cell.cachekv,
                       kv_cache="float" if cell.cachekv == "none"
                       else f"{cell.cachekv} static (calibration table scales)")
        t0 = time.perf_counter()
        ppl = self.perplexity(cell.base)
        r.base_perplexity, r.base_perplexity_reason = ppl.get("perplexity"), ppl.get("reason")
        try:
            self.check_draft_compatible()
            base_dir = self.artifact(c.model, cell.base)
            r.base_artifact_mb = artifact_mb(base_dir)
            draft_dir = None
            if cell.draft != NGRAM_COLUMN:
                draft_dir = self.artifact(c.draft_model, cell.draft)
                r.draft_artifact_mb = artifact_mb(draft_dir)
            try:
                base = self.baseline(cell.base, cell.cachekv)
            except _Failed as e:
                raise _Failed(f"base without speculation failed: {e}", e.transient) from None
            r.base_tokens_per_s, r.base_peak_memory_mb = base["tokens_per_s"], base["peak_memory_mb"]
            outs, stats = self.generate(base_dir, cell.cachekv, speculate=True, draft=draft_dir)
            r.kv_cache = stats.get("kv_cache") or r.kv_cache  # what ran (an artifact may carry scales)
            ids = [list(o.token_ids) for o in outs]
            r.mismatched_prompts = sum(a != b for a, b in zip(ids, base["token_ids"]))
            r.lossless = r.mismatched_prompts == 0 and len(ids) == len(base["token_ids"])
            r.acceptance_rate = stats.get("acceptance_rate")
            r.mean_accepted_length = stats.get("mean_accepted_length")
            r.acceptance_per_position = list(stats.get("acceptance_per_position") or [])
            r.tokens_per_s = stats["tokens_per_s"]
            r.speedup = r.tokens_per_s / r.base_tokens_per_s if r.base_tokens_per_s else None
            r.generated_tokens = stats.get("generated_tokens")
            r.peak_memory_mb = stats.get("peak_memory_mb")
            r.supported = True
        except (KeyboardInterrupt, SystemExit):
            raise
        except _Failed as e:
            r.reason, r.final = str(e), not e.transient
        except Exception as e:  # noqa: BLE001 — a cell fails alone
            r.reason, r.final = _reason(e), not _is_transient(e)
            if os.environ.get("QUANTSPEC_REPORT_DEBUG"):
                traceback.print_exc()
        r.elapsed_s = round(time.perf_counter() - t0, 3)
        return r


def run_report(config: ReportConfig, pipeline: Pipeline | None = None, progress: Progress | None = None,
               *, write_files: bool = True) -> Report:
    """Run (or resume) every cell of `config`, write `out/` and return the `Report`.

    `pipeline` defaults to one without quantize/evaluate verbs (`api.report` passes the API's).
    Files written: `cells/*.json` (one per finished cell, as it finishes), then `report.json`,
    `report.md` and `report.png` (or `.svg`) — see `report/render.py`.
    """
    import torch

    out = Path(config.out).expanduser()
    check_writable(out, config.artifact_cache)
    pipeline = pipeline or Pipeline()
    t0 = time.perf_counter()
    run = _Run(config, pipeline, out)
    cells = config.cells()
    results: list[CellResult] = []
    computed, skipped = [], []
    for i, cell in enumerate(cells):
        key = cell.key(run.hash)
        path = out / CELLS_DIR / f"{key}.json"
        previous = None if config.force else _read_json(path)
        if previous is not None and previous.get("final", True):
            res = CellResult.from_dict(previous)
            results.append(res)
            skipped.append(key)
            if progress:
                progress("skip", cell, i, len(cells), res)
            continue
        if progress:
            progress("start", cell, i, len(cells), None)
        res = run.run_cell(cell, key)
        write_json(path, res.to_dict())
        results.append(res)
        computed.append(key)
        if progress:
            progress("done", cell, i, len(cells), res)
    pipeline.release()

    perplexity = {b: run.perplexity(b) for b in config.base_quant_types}
    baselines = _baselines(config, out, run.hash)
    cfg = {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(config).items()}
    meta = {"settings_hash": run.hash, "settings": run.settings, "num_prompts": len(run.prompts),
            "wall_s_this_run": round(time.perf_counter() - t0, 2), "artifacts_built": run.cache.built,
            "artifact_cache": str(config.artifact_cache), "torch": torch.__version__,
            "threads": torch.get_num_threads(), "machine": platform.machine(),
            "device": config.device if config.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"),
            "peak_memory_note": "CPU: peak resident memory of the process during the run (Linux VmHWM, "
                                "reset before each run; includes torch itself); CUDA: peak allocated"}
    report = Report(config=cfg, cells=results, perplexity=perplexity, baselines=baselines, meta=meta,
                    computed=computed, skipped=skipped)
    if write_files:
        from quantspec.report.render import write_outputs

        write_outputs(report, out)
    return report


def _baselines(config: ReportConfig, out: Path, settings_hash: str) -> dict[str, dict]:
    """{"base/kv-cache": the no-speculation run's record without its token ids} of every base and
    KV cache whose baseline `out` holds."""
    baselines = {}
    for b in config.base_quant_types:
        for kv in config.cachekv:
            rec = _read_json(out / CELLS_DIR / f"baseline__{b}__kv-{kv}__{settings_hash}.json")
            if rec is not None:
                baselines[f"{b}/kv-{kv}"] = {k: v for k, v in rec.items() if k != "token_ids"}
    return baselines


def _float_dtype(dtype: str) -> str:
    """Calibration and perplexity run the float model: `auto` means float32 there."""
    return "float32" if dtype == "auto" else dtype
