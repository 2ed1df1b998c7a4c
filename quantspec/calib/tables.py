"""The calibration table on disk: `scales.safetensors` + `calibration.json`.

This file owns the format that `quantspec calibrate` writes and that `quantize` (a8w8, a8w8_fp8,
SmoothQuant), `infer` and `eval` (static int8/fp8 KV cache) read. A table stores what the
observers measured (absmax, float32), never scales: scales are derived on read through
`quant.primitives.scale_from_absmax`, so one table serves int8 and fp8.

`scales.safetensors` tensors (all float32):
- `model.layers.{i}.self_attn.q_proj.input_absmax`          []   per-tensor, from the observer
  (minmax / percentile / mse) — one per Linear of every decoder layer;
- `model.layers.{i}.self_attn.q_proj.input_channel_absmax`  [K]  per input channel, always
  min/max (SmoothQuant's max|X_j|);
- `model.layers.{i}.self_attn.k_absmax` / `v_absmax`         [KV] per KV head, over the
  post-rotary keys / values the paged cache stores (the observer's choice).

`calibration.json`: format version, dataset, split, text_field, num_samples, seq_len, seed,
observer, percentile, batch_size, model (as given), model fingerprint, num_layers,
num_kv_heads, quantspec version, wall time (s).

A draft module's table (`calib.draft_scales`) holds the same entries under the module's own names
(`fc.input_absmax`, `midlayer.self_attn.k_absmax`, ...), and its calibration.json a `draft`
section: the module's kind and the base it was measured on.

A table records the fingerprint of the model it was measured on
(`model_zoo.checkpoint.model_fingerprint`) and refuses another model; an artifact without a
recorded source fingerprint is matched on the architecture part only.

Tables are written atomically (temporary directory beside the target, renamed into place).
"""

from __future__ import annotations

import json
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping

import torch

from quantspec.errors import QuantSpecError
from quantspec.model_zoo.checkpoint import model_fingerprint
from quantspec.outputs import atomic_dir
from quantspec.quant.primitives import scale_from_absmax

__all__ = [
    "TABLE_FORMAT_VERSION",
    "SCALES_NAME",
    "META_NAME",
    "INPUT_ABSMAX",
    "INPUT_CHANNEL_ABSMAX",
    "ScaleTable",
    "write_table",
    "read_table",
]

TABLE_FORMAT_VERSION = 1
SCALES_NAME = "scales.safetensors"
META_NAME = "calibration.json"
INPUT_ABSMAX = "input_absmax"
INPUT_CHANNEL_ABSMAX = "input_channel_absmax"
_K_ABSMAX, _V_ABSMAX = "k_absmax", "v_absmax"
_RUN_CALIBRATE = "run `quantspec calibrate --model M --dataset D --out DIR` first"


def _layer_attn(i: int) -> str:
    return f"model.layers.{i}.self_attn"


def _fingerprints_match(table_fp: str, model_fp: str) -> bool:
    t_arch, _, t_w = table_fp.partition("-")
    m_arch, _, m_w = model_fp.partition("-")
    if t_arch != m_arch:
        return False
    return not t_w or not m_w or t_w == m_w  # an artifact without provenance: arch only


# ---------------------------------------------------------------------------------------------
# the table


@dataclass
class ScaleTable:
    """A calibration table in memory: the absmax tensors and the metadata (module docstring)."""

    tensors: dict[str, torch.Tensor]
    meta: dict[str, Any] = field(default_factory=dict)
    path: Path | None = None

    # ---- what is in it ---------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        """Number of decoder layers with K/V entries (layers 0..n-1 must all be present)."""
        n = 0
        while f"{_layer_attn(n)}.{_K_ABSMAX}" in self.tensors:
            n += 1
        return n

    @property
    def draft(self) -> str | None:
        """The kind of draft module the table was measured for ("mtp", "medusa", "eagle3";
        `calib.draft_scales`), None for a base model's."""
        return (self.meta.get("draft") or {}).get("kind")

    @property
    def attentions(self) -> list[str]:
        """The attentions with K/V entries, in order: a base model's `model.layers.{i}.self_attn`,
        a draft module's by its own names."""
        if self.draft is None:
            return [_layer_attn(i) for i in range(self.num_layers)]
        suffix = "." + _K_ABSMAX
        return sorted(k[: -len(suffix)] for k in self.tensors if k.endswith(suffix))

    @property
    def linear_names(self) -> list[str]:
        """Every Linear with a per-tensor input absmax, sorted."""
        suffix = "." + INPUT_ABSMAX
        return sorted(k[: -len(suffix)] for k in self.tensors if k.endswith(suffix))

    def _where(self) -> str:
        return f"calibration table {self.path}" if self.path else "calibration table"

    def _get(self, key: str, what: str) -> torch.Tensor:
        t = self.tensors.get(key)
        if t is None:
            raise QuantSpecError(f"{self._where()} has no {what} ({key!r}); it was calibrated for "
                                 f"another model — re-run quantspec calibrate for this one")
        return t

    # ---- absmax ------------------------------------------------------------------------------
    def input_absmax(self, linear: str) -> torch.Tensor:
        """The per-tensor absmax of `linear`'s input (0-d float32)."""
        return self._get(f"{linear}.{INPUT_ABSMAX}", f"input absmax for {linear}")

    def nvfp4_input_global_scales(self, model) -> dict[str, torch.Tensor]:
        """NVFP4's input global scale of every Linear in the table: 448 · 6 / its input's absmax
        (the table checked against `model` first)."""
        from quantspec.quant.fp4 import global_scale_from_absmax

        self.check_model(model)
        return {n: global_scale_from_absmax(self.input_absmax(n)) for n in self.linear_names}

    def input_channel_absmax(self, linear: str) -> torch.Tensor:
        """max |X_j| per input channel of `linear`: [K] float32 (for SmoothQuant)."""
        return self._get(f"{linear}.{INPUT_CHANNEL_ABSMAX}", f"per-channel input absmax for {linear}")

    def kv_absmax(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(k_absmax, v_absmax): [L, KV] float32, one row per attention (`attentions`)."""
        names = self.attentions
        if not names:
            raise QuantSpecError(f"{self._where()} has no K/V entries; {_RUN_CALIBRATE}")
        k = torch.stack([self.tensors[f"{a}.{_K_ABSMAX}"] for a in names])
        v = torch.stack([self._get(f"{a}.{_V_ABSMAX}", f"{a} V absmax") for a in names])
        return k, v  # [L, KV]

    # ---- scales (derived on read) --------------------------------------------------------------
    def input_scale(self, linear: str, kind: str) -> torch.Tensor:
        """Static per-tensor input scale [1] for "int8" (absmax / 127.5) or "fp8" (absmax / 448)."""
        return scale_from_absmax(self.input_absmax(linear), kind)

    def kv_scales(self, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(k_scale, v_scale): [L, KV] float32 for an "int8" | "fp8" KV cache."""
        k, v = self.kv_absmax()
        return scale_from_absmax(k, kind), scale_from_absmax(v, kind)

    def kv_artifact_tensors(self, kind: str, strategy: str = "attn_head") -> dict[str, torch.Tensor]:
        """compressed-tensors KV tensors for an artifact: `{attn}.k_scale` / `.v_scale`, [KV, 1, 1]
        (strategy attn_head) or [1] (strategy tensor: the largest head's scale, which covers every
        head's range), matching `quant.presets.preset(..., kv_cache=kind, kv_strategy=strategy)`."""
        from quantspec.quant.artifact import kv_scale_tensors
        from quantspec.quant.primitives import static_args

        k, v = self.kv_scales(kind)  # [L, KV]
        if strategy == "tensor":
            k, v = k.amax(dim=1, keepdim=True), v.amax(dim=1, keepdim=True)  # [L, 1]
        args = static_args(kind).replace(strategy=strategy)
        out: dict[str, torch.Tensor] = {}
        for i, attn in enumerate(self.attentions):
            out.update(kv_scale_tensors(attn, k[i], v[i], args))
        return out

    # ---- checks ------------------------------------------------------------------------------
    def check_layers(self, num_layers: int, num_kv_heads: int | None = None,
                     linear_names: Iterable[str] | None = None) -> None:
        """Raise one line if the table lacks a layer / Linear the model has or has other shapes."""
        have = self.num_layers
        if have < num_layers:
            raise QuantSpecError(
                f"{self._where()} has scales for {have} layer(s) but the model has {num_layers} "
                f"(model.layers.{have} is missing); re-run quantspec calibrate for this model")
        if num_kv_heads is not None:
            k, _ = self.kv_absmax()
            if k.shape[1] != num_kv_heads:
                raise QuantSpecError(
                    f"{self._where()} has {k.shape[1]} KV heads per layer but the model has "
                    f"{num_kv_heads}; it was calibrated for another model — re-run quantspec calibrate")
        if linear_names is not None:
            have_lin = set(self.linear_names)
            missing = [n for n in linear_names if n not in have_lin]
            if missing:
                raise QuantSpecError(
                    f"{self._where()} has no input scale for {missing[0]}"
                    f"{f' (+{len(missing) - 1} more)' if len(missing) > 1 else ''}; re-run "
                    "quantspec calibrate for this model")

    def check_model(self, model) -> None:
        """Check against a `Transformer` (every layer's K/V heads and every decoder Linear) or, for
        a draft module's table, against the module (every Linear, an EAGLE-3 head's K/V heads)."""
        if self.draft is not None:
            return self._check_draft(model)
        names = [n for n, m in model.named_modules()
                 if isinstance(m, torch.nn.Linear) and n.startswith("model.layers.")]
        self.check_layers(model.args.num_layers, model.args.num_kv_heads, names)

    def _check_draft(self, module) -> None:
        from quantspec.model_zoo.eagle3 import Eagle3Head

        self.check_layers(0, linear_names=[n for n, m in module.named_modules() if isinstance(m, torch.nn.Linear)])
        if isinstance(module, Eagle3Head):
            k, _ = self.kv_absmax()
            if k.shape[1] != module.midlayer.self_attn.num_kv_heads:
                raise QuantSpecError(f"{self._where()} has {k.shape[1]} KV heads but the EAGLE-3 head has "
                                     f"{module.midlayer.self_attn.num_kv_heads}; re-run quantspec calibrate for it")


# ---------------------------------------------------------------------------------------------
# I/O


def write_table(out: str | os.PathLike, tensors: Mapping[str, torch.Tensor],
                meta: Mapping[str, Any], *, overwrite: bool = False) -> Path:
    """Write `scales.safetensors` + `calibration.json` into `out` atomically; returns the path.

    An existing non-empty `out` is refused unless `overwrite`; on error `out` is left untouched.
    """
    from safetensors.torch import save_file

    out = Path(out)
    clean = {}
    for k, t in tensors.items():
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise QuantSpecError(f"table entry {k!r} must be a float tensor")
        if not torch.isfinite(t).all():
            raise QuantSpecError(f"table entry {k!r} holds NaN/Inf; calibration went wrong")
        clean[k] = t.detach().to("cpu", torch.float32).contiguous()
    with atomic_dir(out, overwrite=overwrite) as tmp:
        save_file(clean, str(tmp / SCALES_NAME), metadata={"format": "quantspec-calib"})
        full_meta = {"format_version": TABLE_FORMAT_VERSION, **dict(meta)}
        (tmp / META_NAME).write_text(json.dumps(full_meta, indent=2, default=str))
    return out


def read_table(path: str | os.PathLike, *, expect_fingerprint: str | None = None,
               model_dir: str | os.PathLike | None = None, expect_layers: int | None = None,
               expect_kv_heads: int | None = None) -> ScaleTable:
    """Read a table written by `quantspec calibrate`, with one-line errors.

    `expect_fingerprint`: refuse a table from another model (both fingerprints named).
    `model_dir`: shorthand for the model's fingerprint + its config's layer / KV-head counts.
    `expect_layers` / `expect_kv_heads`: refuse a table missing a layer the model has.
    """
    table = _load_table(path)
    if model_dir is not None:
        from quantspec.model_zoo.checkpoint import read_config, resolve_model_dir

        d = resolve_model_dir(model_dir)
        cfg = read_config(d)
        expect_fingerprint = expect_fingerprint or model_fingerprint(d)
        if expect_layers is None:
            expect_layers = cfg.get("num_hidden_layers")
        if expect_kv_heads is None:
            expect_kv_heads = cfg.get("num_key_value_heads") or cfg.get("num_attention_heads")
    if expect_fingerprint is not None:
        _check_fingerprint(table, expect_fingerprint, model_dir)
    if expect_layers is not None and table.draft is None:  # a draft module's: `ScaleTable.check_model`
        table.check_layers(int(expect_layers), expect_kv_heads)
    return table


def _load_table(path: str | os.PathLike) -> ScaleTable:
    """The table in directory `path`, refused in one line when it is missing, of another format
    version, or unreadable."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    if path is None:
        raise QuantSpecError(f"no calibration table given; {_RUN_CALIBRATE} and pass --calib DIR")
    p = Path(path).expanduser()
    if not p.exists():
        raise QuantSpecError(f"calibration table {p} does not exist; {_RUN_CALIBRATE}")
    if not p.is_dir():
        raise QuantSpecError(f"calibration table {p} is a file; pass the directory that "
                             f"`quantspec calibrate --out` wrote")
    for name in (SCALES_NAME, META_NAME):
        if not (p / name).is_file():
            raise QuantSpecError(f"calibration table {p} has no {name}; {_RUN_CALIBRATE}")
    try:
        meta = json.loads((p / META_NAME).read_text())
    except json.JSONDecodeError as e:
        raise QuantSpecError(f"{p / META_NAME} is not valid JSON (line {e.lineno}); re-run "
                             "quantspec calibrate") from None
    if not isinstance(meta, dict):
        raise QuantSpecError(f"{p / META_NAME} is not a JSON object; re-run quantspec calibrate")
    version = meta.get("format_version")
    if version != TABLE_FORMAT_VERSION:
        raise QuantSpecError(f"calibration table {p} has format version {version!r}, this quantspec "
                             f"reads {TABLE_FORMAT_VERSION}; re-run quantspec calibrate")
    try:
        tensors = load_file(str(p / SCALES_NAME))
    except (SafetensorError, OSError, RuntimeError) as e:
        reason = str(e).splitlines()[0][:120] if str(e) else type(e).__name__
        raise QuantSpecError(f"{p / SCALES_NAME} is truncated or corrupt ({reason}); re-run "
                             "quantspec calibrate") from None
    return ScaleTable(tensors=tensors, meta=meta, path=p)


def _check_fingerprint(table: ScaleTable, expect: str, model_dir) -> None:
    """Refuse a table made for another model; warn when the model records only its architecture."""
    p, meta = table.path, table.meta
    have = meta.get("model_fingerprint")
    if not isinstance(have, str) or not _fingerprints_match(have, expect):
        raise QuantSpecError(
            f"calibration table {p} was made for model {meta.get('model', '?')!r} (fingerprint "
            f"{have}) but this model's fingerprint is {expect}; calibrate this model "
            "(quantspec calibrate --model ...) and pass its table")
    if expect.endswith("-") and have.partition("-")[2]:
        # stacklevel 3: the warning names read_table's caller
        warnings.warn(f"{model_dir or 'the model'} records no source fingerprint; the table {p} "
                      "is matched on the architecture only", stacklevel=3)
