"""What a report measures: the typed `ReportConfig`, its axes, and the coordinates of one cell.

A report is a matrix for one speculation method: base quant type (rows) × draft quant type
(columns) × KV-cache type (panels). The draft is a model (`draft`) or a module trained for the
base (`mtp`, `medusa`, `eagle`: `--draft-model` names it), quantized on its own per column. `none` on the base or draft axis means "unquantized".
`inference_with_reference` (n-gram) has no draft model, so its draft axis is the single column
`ngram`. Every list is validated when the config is built; an unknown name raises
`QuantSpecError` naming it and listing the valid ones.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from quantspec.errors import QuantSpecError, positive_int
from quantspec.model_zoo.default import DEFAULT_MODEL, cache_dir
from quantspec.quant.args import QuantType

__all__ = [
    "NO_QUANT",
    "NGRAM_COLUMN",
    "QUANT_CHOICES",
    "CACHEKV_CHOICES",
    "METHODS",
    "HEAD_METHODS",
    "CALIB_QUANT_TYPES",
    "DEFAULT_BASE_QUANT_TYPES",
    "DEFAULT_DRAFT_QUANT_TYPES",
    "DEFAULT_CACHEKV",
    "Cell",
    "ReportConfig",
    "default_cache_dir",
    "file_sha",
    "parse_list",
    "settings_hash",
]

NO_QUANT = "none"  # the unquantized checkpoint
NGRAM_COLUMN = "ngram"  # the one "draft" column of inference_with_reference
QUANT_CHOICES = (NO_QUANT,) + tuple(t.value for t in QuantType)
CACHEKV_CHOICES = ("none", "int8", "fp8")
METHODS = ("draft", "mtp", "medusa", "eagle", "inference_with_reference")
# methods whose draft is a module of its own, trained for the base: --draft-model names it
HEAD_METHODS = {"mtp": "MTP_DIR (the MTP module)", "medusa": "MEDUSA_DIR (the Medusa heads)",
                "eagle": "EAGLE3_DIR (the EAGLE-3 head)"}
# quant types whose artifacts need static activation scales from a calibration table
CALIB_QUANT_TYPES = (QuantType.A8W8.value, QuantType.A8W8_FP8.value, QuantType.NVFP4.value)

# The default cell set: chosen so that `quantspec report` on smollm2-135m finishes within 20
# minutes on 2 CPU cores (measured; see docs/report.md).
DEFAULT_BASE_QUANT_TYPES = (NO_QUANT, "weight_only_int8", "weight_only_int4")
DEFAULT_DRAFT_QUANT_TYPES = ("weight_only_int8", "weight_only_int4")
DEFAULT_CACHEKV = ("none",)  # int8 / fp8 on request: --cachekv none,int8


def default_cache_dir() -> Path:
    """Where built artifacts and calibration tables are kept between reports."""
    return cache_dir() / "report-artifacts"


def parse_list(value, choices: tuple[str, ...], flag: str) -> tuple[str, ...]:
    """`"a,b"` or `["a", "b"]` → a de-duplicated tuple, each name checked against `choices`."""
    if isinstance(value, str):
        items = [v.strip() for v in value.split(",")]
    else:
        items = [str(v).strip() for v in value]
    items = [v.lower() for v in items if v]
    if not items:
        raise QuantSpecError(f"{flag} is empty; give a comma-separated list from: {', '.join(choices)}")
    for v in items:
        if v not in choices:
            raise QuantSpecError(f"{flag}: unknown {'KV cache type' if flag == '--cachekv' else 'quant type'} "
                                 f"{v!r}; use one of: {', '.join(choices)}")
    return tuple(dict.fromkeys(items))


@dataclass(frozen=True)
class Cell:
    """The coordinates of one cell of the matrix."""

    method: str
    base: str
    draft: str
    cachekv: str

    @property
    def name(self) -> str:
        return f"{self.method}__{self.base}__{self.draft}__kv-{self.cachekv}"

    def key(self, settings_hash: str) -> str:
        """File-name-safe key: readable coordinates + the hash of the run's settings (so a
        rerun with other prompts or models never reuses a finished cell)."""
        return f"{self.name}__{settings_hash}"


@dataclass(frozen=True)
class ReportConfig:
    """Everything `quantspec report` needs; validated when built."""

    out: str
    model: str = DEFAULT_MODEL
    speculate_method: str = "draft"
    draft_model: str | None = None  # default for `draft`: the base model itself
    base_quant_types: tuple[str, ...] = DEFAULT_BASE_QUANT_TYPES
    draft_quant_types: tuple[str, ...] = DEFAULT_DRAFT_QUANT_TYPES
    cachekv: tuple[str, ...] = DEFAULT_CACHEKV
    prompts_file: str | None = None
    calib_dataset: str | None = None
    calib_num_samples: int = 16
    calib_seq_len: int = 256
    eval_text: str | None = None
    eval_windows: int = 4
    eval_seq_len: int = 256
    max_new_tokens: int = 64
    speculate_max_draft_token_num: int = 4
    speculate_max_ngram_size: int = 3
    quant_method: str = "rtn"
    group_size: int = 128
    symmetric: bool = True  # weight_only_int4 only: False = asymmetric (zero points)
    zp_dtype: str | None = None  # weight_only_int4 --asym only: float zero points (e.g. "float16")
    dtype: str = "auto"  # inference: the loader's per-artifact choice; calibration/eval: float32
    device: str = "auto"
    cache_dir: str | None = None
    force: bool = False
    extra: dict = field(default_factory=dict)  # free-form notes copied into report.json

    def __post_init__(self):
        if not self.out:
            raise QuantSpecError("--out is empty; pass --out DIR for the report")
        if self.speculate_method not in METHODS:
            raise QuantSpecError(f"--speculate-method {self.speculate_method!r} unknown; use one of: "
                                 f"{', '.join(METHODS)}")
        set_ = lambda name, v: object.__setattr__(self, name, v)  # noqa: E731 (frozen dataclass)
        set_("base_quant_types", parse_list(self.base_quant_types, QUANT_CHOICES, "--base-quant-types"))
        if self.speculate_method == "inference_with_reference":
            if self.draft_model:
                raise QuantSpecError("--draft-model is not used by inference_with_reference (n-gram); drop it")
            set_("draft_quant_types", (NGRAM_COLUMN,))
        else:
            set_("draft_quant_types", parse_list(self.draft_quant_types, QUANT_CHOICES, "--draft-quant-types"))
            if self.speculate_method in HEAD_METHODS and not self.draft_model:
                raise QuantSpecError(f"--speculate-method {self.speculate_method} needs --draft-model "
                                     f"{HEAD_METHODS[self.speculate_method]}")
            if self.draft_model is None:
                set_("draft_model", self.model)
        set_("cachekv", parse_list(self.cachekv, CACHEKV_CHOICES, "--cachekv"))
        self._check_quant_method()
        for name in ("calib_num_samples", "calib_seq_len", "eval_windows", "eval_seq_len", "max_new_tokens",
                     "speculate_max_draft_token_num", "speculate_max_ngram_size"):
            positive_int(name, getattr(self, name))
        if self.group_size != -1:
            positive_int("group_size", self.group_size)
        if self.zp_dtype is not None and self.symmetric:
            raise QuantSpecError("--zp-dtype needs --asym (symmetric int4 has no zero points)")
        for name in ("prompts_file", "eval_text"):
            p = getattr(self, name)
            if p is not None and not Path(p).expanduser().is_file():
                raise QuantSpecError(f"--{name.replace('_', '-')} {p} does not exist; check the path")

    def _check_quant_method(self) -> None:
        from quantspec.quant.presets import METHODS as QUANT_METHODS

        if self.quant_method not in QUANT_METHODS:
            raise QuantSpecError(f"--quant-method {self.quant_method!r} unknown; use one of: {', '.join(QUANT_METHODS)}")
        full = set(self.base_quant_types) | (set(self.draft_quant_types) if self.speculate_method == "draft" else set())
        static = sorted(full & set(CALIB_QUANT_TYPES))
        if self.quant_method.startswith("awq") and static:
            raise QuantSpecError(f"--quant-method {self.quant_method} is for weight-only types, not {static[0]}; "
                                 "drop it from the quant types or use --quant-method rtn or gptq")
        if self.quant_method == "autoround":
            from quantspec.quant.presets import integer_weights

            unfit = sorted(t for t in full if t != "none" and not integer_weights(t))
            if unfit:
                raise QuantSpecError(f"--quant-method autoround tunes integer weights, and {unfit[0]}'s are not; "
                                     "drop it from the quant types or use --quant-method rtn or gptq")

    @property
    def needs_calibration(self) -> bool:
        """Static KV scales or static activation scales are needed somewhere in the matrix."""
        quant = set(self.base_quant_types) | set(self.draft_quant_types)
        return any(c != "none" for c in self.cachekv) or bool(quant & set(CALIB_QUANT_TYPES))

    @property
    def artifact_cache(self) -> Path:
        return Path(self.cache_dir).expanduser() if self.cache_dir else default_cache_dir()

    def cells(self) -> list[Cell]:
        """Every cell, in the order they run: per KV type, per base row, per draft column."""
        return [Cell(self.speculate_method, b, d, kv) for kv in self.cachekv
                for b in self.base_quant_types for d in self.draft_quant_types]

    def settings(self) -> dict:
        """The settings a cell's result depends on besides its coordinates (for the cell key)."""
        d = asdict(self)
        for k in ("out", "base_quant_types", "draft_quant_types", "cachekv", "force", "cache_dir", "extra"):
            d.pop(k)
        return d


def settings_hash(settings: dict) -> str:
    return hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()[:10]


def file_sha(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()[:16]
