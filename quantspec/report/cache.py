"""A content-keyed store of the artifacts and calibration tables a report builds.

An entry's key is a hash of what determines its content — never of a path or a time:
- calibration table: model fingerprint + dataset fingerprint (a local file's bytes, else the hub
  id) + samples + sequence length + dtype;
- quantized artifact: model fingerprint + the quant config (`quant.presets.preset(...).to_dict()`)
  + method + the calibration key when the type needs static scales (the data's fingerprint,
  samples and length when the method reads data without one) + the quantspec version.
So a second report on the same model reuses every artifact, and a changed checkpoint, dataset or
quant config gets a new entry. Entries are written by `calib` / `api.quantize` atomically and
counted as present only when complete (`calibration.json` / `config.json` exists).
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

from quantspec.errors import QuantSpecError
from quantspec.report.config import CALIB_QUANT_TYPES, NO_QUANT, file_sha
from quantspec.report.pipeline import Pipeline

__all__ = ["ArtifactCache", "content_key"]


def content_key(parts: dict) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", Path(str(text)).name or str(text))[:40]


class ArtifactCache:
    """Build-or-reuse calibration tables and quantized artifacts under `root`."""

    def __init__(self, root: str | Path, pipeline: Pipeline):
        self.root = Path(root).expanduser()
        self.pipeline = pipeline
        self.built: list[str] = []  # entries built (not reused) by this process, for the report
        self._fp: dict[str, str] = {}

    def fingerprint(self, model: str) -> str:
        if model not in self._fp:
            self._fp[model] = self.pipeline.fingerprint(model)
        return self._fp[model]

    def dataset_fingerprint(self, dataset: str) -> str:
        p = Path(dataset).expanduser()
        return f"file:{file_sha(p)}" if p.is_file() else f"id:{dataset}"

    def calibration(self, model: str, dataset: str, *, num_samples: int, seq_len: int, dtype: str,
                    base: str | None = None) -> tuple[Path, str]:
        """(table directory, its key) — calibrating `model` on `dataset` once; `base`: a draft
        head's base, on whose hidden states it is measured."""
        parts = {"kind": "calibration", "model": self.fingerprint(model), "dataset": self.dataset_fingerprint(dataset),
                 "num_samples": num_samples, "seq_len": seq_len, "dtype": dtype}
        if base is not None:
            parts["base"] = self.fingerprint(base)
        key = content_key(parts)
        out = self.root / f"calib-{_slug(model)}-{key}"
        if not (out / "calibration.json").is_file():
            self.root.mkdir(parents=True, exist_ok=True)
            self.pipeline.calibrate(model, dataset, out, num_samples=num_samples, seq_len=seq_len, dtype=dtype,
                                    **({} if base is None else {"base": base}))
            self.built.append(out.name)
        return out, key

    def artifact(self, model: str, quant_type: str, *, method: str, group_size: int,
                 calib: tuple[Path, str] | None, symmetric: bool = True, zp_dtype: str | None = None,
                 data: tuple[str, int, int] | None = None, base: str | None = None) -> Path:
        """The directory of `model` quantized to `quant_type` (the model itself for `none`);
        `data`: (dataset, samples, sequence length) for a method that reads calibration data
        where no table gives it (GPTQ, AWQ on the weight-only types); `base`: a draft head's
        base, whose hidden states its GPTQ reads."""
        from quantspec import __version__
        if quant_type == NO_QUANT:
            return self.pipeline.resolve(model)
        needs_calib = quant_type in CALIB_QUANT_TYPES
        if needs_calib and calib is None:
            raise QuantSpecError(f"{quant_type} needs calibrated activation ranges; pass --calib-dataset")
        parts = {"kind": "artifact", "model": self.fingerprint(model),
                 "quant_config": _preset(quant_type, group_size, symmetric, zp_dtype).to_dict(), "method": method,
                 "calibration": calib[1] if needs_calib else None, "quantspec": __version__}
        if data is not None:  # a method reading data without a table: keyed by the data too
            parts["data"] = (self.dataset_fingerprint(data[0]), *data[1:])
        if base is not None:
            parts["base"] = self.fingerprint(base)
        key = content_key(parts)
        out = self.root / f"{_slug(model)}-{quant_type}-{key}"
        if not (out / "config.json").is_file():
            self.root.mkdir(parents=True, exist_ok=True)
            more = {} if data is None else dict(zip(("dataset", "num_samples", "seq_len"), data))
            more.update({} if base is None else {"base": base})
            self.pipeline.quantize(model, quant_type, out, calib=calib[0] if needs_calib else None,
                                   method=method, group_size=group_size, **_int4_kw(quant_type, symmetric, zp_dtype),
                                   **more)
            if not (out / "config.json").is_file():
                raise RuntimeError(f"quantize wrote no artifact at {out}")
            self.built.append(out.name)
        return out


def _int4_kw(quant_type: str, symmetric: bool, zp_dtype: str | None) -> dict:
    """The int4-only recipe settings (asymmetric, float zero points); other types ignore them."""
    if quant_type != "weight_only_int4" or (symmetric and zp_dtype is None):
        return {}
    return {"symmetric": symmetric, "zp_dtype": zp_dtype}


def _preset(quant_type: str, group_size: int, symmetric: bool, zp_dtype: str | None):
    from quantspec.quant.presets import preset

    return preset(quant_type, group_size=group_size, **_int4_kw(quant_type, symmetric, zp_dtype))
