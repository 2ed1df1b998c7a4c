"""The operations a report composes, behind one small object so the matrix never imports `api`.

`Pipeline` holds the four things a cell needs — calibrate a model, quantize it into an artifact,
measure a model's perplexity, generate for prompts — plus fingerprints and sizes. `api.report`
builds it from the API's own verbs (`quantize`, `evaluate`), so a report runs exactly what the
user's commands run; calibration and generation come straight from `calib/` and `infer/` (below
`report/` in the dependency order). A verb that is not available makes the cells that need it
report "unsupported: <why>" instead of failing the report.
"""

from __future__ import annotations

import inspect
import os
from pathlib import Path
from typing import Callable

from quantspec.errors import QuantSpecError

__all__ = ["Pipeline", "Unsupported", "artifact_mb", "call_with_supported_kwargs"]


class Unsupported(QuantSpecError):
    """A cell cannot run here (a verb is missing, a pair is incompatible); the message says why."""


def call_with_supported_kwargs(fn: Callable, *args, **kwargs):
    """Call `fn` with the keyword arguments its signature accepts (the verbs' optional knobs
    differ between versions; required ones are passed positionally)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return fn(*args, **kwargs)
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return fn(*args, **kwargs)
    return fn(*args, **{k: v for k, v in kwargs.items() if k in params})


def artifact_mb(model_dir: str | os.PathLike) -> float:
    """Size on disk of a model's weights (all *.safetensors in the directory), MiB."""
    d = Path(model_dir)
    return sum(f.stat().st_size for f in d.glob("*.safetensors")) / 2**20


_PROC_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")
_RESET_PEAK_RSS = "5"  # Linux ≥ 4.0: writing 5 to clear_refs resets VmHWM (the peak RSS)


def _reset_peak_rss() -> None:
    try:
        _CLEAR_REFS.write_text(_RESET_PEAK_RSS)
    except OSError:
        pass  # not Linux, or not permitted: VmHWM stays the lifetime peak


def _peak_rss_mb() -> float | None:
    """Peak resident memory of this process since the last reset (Linux), MiB."""
    try:
        for line in _PROC_STATUS.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


class Pipeline:
    """calibrate / quantize / perplexity / generate for a report (see the module docstring).

    quantize(model, quant_type, out, *, method, group_size, calib, overwrite) writes an artifact
    directory; evaluate(model, *, text_file, max_windows, seq_len, dtype, device) returns a
    perplexity (a float, or a dict/object with `perplexity`); calibrate(model, dataset, out, *,
    num_samples, seq_len, dtype, overwrite) writes a scale table; kv_scales(calib, model, kind)
    returns a table's static KV-cache scales (k, v). Any may be None: the cells that need it
    report why they cannot run.
    """

    def __init__(self, *, quantize: Callable | None = None, evaluate: Callable | None = None,
                 calibrate: Callable | None = None, kv_scales: Callable | None = None):
        self._quantize, self._evaluate, self._calibrate = quantize, evaluate, calibrate
        self._kv_scales = kv_scales
        self._loaded: dict[tuple, object] = {}

    # -- models ------------------------------------------------------------------------------

    def resolve(self, model: str) -> Path:
        from quantspec.model_zoo.checkpoint import resolve_model_dir

        return Path(resolve_model_dir(model))

    def fingerprint(self, model: str | os.PathLike) -> str:
        from quantspec.model_zoo.checkpoint import model_fingerprint

        return model_fingerprint(model)

    def check_draft_compatible(self, base: str, draft: str) -> None:
        """Raise (one line) when `draft` cannot draft for `base`: the speculative runtime's own
        check (`infer.spec.draft.check_draft_compatible`: same vocab, special tokens, merges),
        run on the tokenizers alone, before any artifact is built."""
        from transformers import AutoTokenizer

        from quantspec.infer.spec.draft import check_draft_compatible

        tok = lambda m: AutoTokenizer.from_pretrained(str(self.resolve(str(m))))  # noqa: E731
        check_draft_compatible(tok(base), tok(draft), str(base), str(draft))

    # -- verbs -------------------------------------------------------------------------------

    def calibrate(self, model: str, dataset: str, out: Path, *, num_samples: int, seq_len: int,
                  dtype: str, **base) -> None:
        """`api.calibrate`; `base`: a draft head's base (`base=`)."""
        if self._calibrate is None:
            raise Unsupported("calibrate is not available in this build (api.calibrate missing)")
        call_with_supported_kwargs(self._calibrate, model, dataset, str(out), num_samples=num_samples,
                                   seq_len=seq_len, dtype=dtype, overwrite=True, **base)

    def quantize(self, model: str, quant_type: str, out: Path, *, calib: Path | None, method: str,
                 group_size: int, symmetric: bool = True, zp_dtype: str | None = None, **data) -> None:
        """`api.quantize`; `data`: dataset, num_samples, seq_len for GPTQ / AWQ without a table."""
        if self._quantize is None:
            raise Unsupported("quantize is not available in this build (api.quantize missing)")
        int4 = {"symmetric": symmetric, "zp_dtype": zp_dtype} if quant_type == "weight_only_int4" else {}
        # the report runs its artifacts in quantspec: every option quantspec runs is allowed
        # (float zero points, MTP modules)
        call_with_supported_kwargs(self._quantize, model, quant_type, str(out), method=method,
                                   group_size=group_size, calib=None if calib is None else str(calib),
                                   overwrite=True, target="quantspec", **int4, **data)

    def perplexity(self, model: str, text_file: Path, *, windows: int, seq_len: int, dtype: str,
                   device: str) -> float:
        if self._evaluate is None:
            raise Unsupported("perplexity is not available in this build (api.evaluate missing)")
        if device == "auto":
            import torch

            device = "cuda" if torch.cuda.is_available() else "cpu"
        res = call_with_supported_kwargs(self._evaluate, model, text_file=str(text_file), max_windows=windows,
                                         seq_len=seq_len, dtype=dtype, device=device)
        if isinstance(res, dict):
            res = res.get("perplexity", res.get("ppl"))
        elif not isinstance(res, (int, float)):
            res = getattr(res, "perplexity", None)
        if res is None:
            raise Unsupported("evaluate returned no perplexity")
        return float(res)

    def generate(self, config, prompts: list[str], calib: Path | None = None) -> tuple[list, dict]:
        """Run `prompts` with an `infer.predictor.InferConfig` (its static KV cache with the scales
        of the table `calib`, when given); → (RequestOutputs, stats).

        The base model stays loaded between its runs with and without speculation.
        """
        import torch

        from quantspec.infer.predictor import Predictor, resolve_dtype

        key = (str(config.model), config.dtype, config.device)
        loaded = self._loaded.get(key)
        if loaded is None:
            from quantspec.infer.loader import load_for_inference

            self._loaded.clear()  # one base in memory at a time
            loaded = load_for_inference(config.model, dtype=resolve_dtype(config), device=config.device)
            self._loaded[key] = loaded
        cuda = str(config.device).startswith("cuda")
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        else:
            _reset_peak_rss()
        kv_scales = None
        if calib is not None:
            if self._kv_scales is None:
                raise Unsupported("static KV-cache scales are not available in this build (api.table_kv_scales missing)")
            kv_scales = self._kv_scales(str(calib), config.model, config.cachekv)
        predictor = Predictor(config, loaded=loaded, kv_scales=kv_scales)
        outs, stats = predictor.run(list(prompts))
        if not cuda and (rss := _peak_rss_mb()) is not None:
            stats["peak_memory_mb"] = rss  # this run's peak, not the process's lifetime maximum
        return outs, stats

    def release(self) -> None:
        self._loaded.clear()
