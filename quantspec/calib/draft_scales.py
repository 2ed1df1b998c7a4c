"""Static scales of a draft module: `quantspec calibrate --model HEAD [--base B]`.

A draft module reads its base's hidden states, so the ranges its static scales cover are measured
where they occur: each calibration window (tokenized by the base's tokenizer) runs through the
float base once, and the module drafts on it as `calib.draft_calib.draft_passes` runs it (an
EAGLE-3 head unrolled for several drafts on its own outputs, an MTP module chained, every Medusa
head). The observers are the base tables' (`calib.calibrate.LayerObservers`), over the whole module:

- every Linear's input: `{linear}.input_absmax` (the chosen observer) and
  `{linear}.input_channel_absmax`, under the module's own Linear names (`fc`,
  `midlayer.self_attn.q_proj`, `lm_head`, ...);
- an EAGLE-3 head's K and V per KV head, post-rotary, as its cache stores them:
  `midlayer.self_attn.k_absmax` / `v_absmax` (the KV observer). An MTP module attends to its own
  row only and Medusa heads do not attend: they keep no KV cache and have no K/V entries.

calibration.json records, beside what a base table records, `draft`: the module's kind and the
base (directory and fingerprint) it was measured on. The table's fingerprint is the module's, so
`quantize --calib` takes it for that module only.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable, Mapping

import torch
from torch import nn

from quantspec.calib.calibrate import (CALIBRATION_DTYPES, DEFAULT_KV_OBSERVER, CalibrateConfig, CalibrationResult,
                                       LayerObservers, calibration_batches, resolve_calibration_dtype, table_meta)
from quantspec.calib.draft_calib import (DRAFT_WHAT, check_base, draft_base, draft_passes, load_base, load_draft,
                                        smoothing_refusal)
from quantspec.calib.tables import write_table
from quantspec.errors import QuantSpecError, about
from quantspec.model_zoo.eagle3 import EAGLE3_ATTENTION

__all__ = ["DRAFT_ALPHA", "DRAFT_FALLBACK_THRESHOLD", "calibrate_draft", "draft_sensitivity", "draft_smoothing",
           "draft_static_plan", "observe_draft", "smoothing_groups"]

# The static-input error (`draft_sensitivity`) above which a unit keeps float inputs by default.
# Measured on the default model's EAGLE-3 head (64 × 512 calibration tokens): int8 inputs cost
# q/k/v/o 0.001-0.002, gate/up 0.05-0.06, down_proj 0.37 and fc 0.47 (fc reads the base's raw
# residual streams, whose outlier channels reach 26,000 against a median channel max of 54); FP8
# inputs cost at most 0.0011 anywhere. At 0.01 the int8 head keeps 26.2 / 14.1 / 9.0 / 6.7% top-1
# agreement with the base per depth against the float head's 26.7 / 14.0 / 9.1 / 6.8, and 7.1 /
# 5.8 / 5.0 / 3.7 with every unit static (bench/draft_quant.py).
DRAFT_FALLBACK_THRESHOLD = 0.01
# SmoothQuant's α for a module's int8 inputs by default (FP8 inputs need none: their error is at most
# 0.0011 unsmoothed). On that head α 0.5 takes gate/up from 0.051 / 0.063 to 0.0055 / 0.0073 (static
# under the threshold) and down_proj from 0.37 to 0.14 (kept float); top-1 agreement per depth 26.4 /
# 14.1 / 9.2 / 7.0% against 26.2 / 14.1 / 9.0 / 6.7 unsmoothed (α 0.8: 26.0 / 14.0 / 9.0 / 6.7).
DRAFT_ALPHA = 0.5


@torch.no_grad()
def observe_draft(module, base, windows: torch.Tensor, *, observer: str = "minmax", percentile: float = 99.99,
                  kv_observer: str | None = None, on_window: Callable[[int], None] | None = None
                  ) -> dict[str, torch.Tensor]:
    """The table tensors of the draft `module` (module docstring), observed over its drafting
    passes on `base` (a float `Transformer` it was made for) over `windows` [n, S];
    `on_window(i)` after each window's pass."""
    from quantspec.model_zoo.eagle3 import Eagle3Head

    attn = module.midlayer.self_attn if isinstance(module, Eagle3Head) else None
    obs = LayerObservers("", observer, percentile, kv_observer or DEFAULT_KV_OBSERVER,
                         attention=EAGLE3_ATTENTION if attn is not None else None)
    cleanup = obs.attach(module)
    if attn is not None:
        attn.kv_hook = lambda k, v: obs.kv_hook(0, k, v)
    try:
        for i in draft_passes(module.eval(), base, windows):
            if on_window is not None:
                on_window(i)
    finally:
        cleanup()
        if attn is not None:
            del attn.kv_hook
    return obs.compute()


def calibrate_draft(config: CalibrateConfig, model_dir: Path, cfg: dict, out: Path,
                    say: Callable[[str], None], device="cpu") -> CalibrationResult:
    """The table of the draft module at `model_dir` (config.json `cfg`) → `out` (module
    docstring), the base and the module on `device`; everything is checked before the base runs."""
    from quantspec.model_zoo.checkpoint import draft_kind, model_fingerprint

    t0, cpu0 = time.perf_counter(), time.process_time()
    kind = draft_kind(cfg)
    if cfg.get("quantization_config"):
        raise QuantSpecError(f"{model_dir} is a quantized draft module; calibrate the float one it was made from")
    if config.rotate is not None:
        raise QuantSpecError(f"{model_dir} is {DRAFT_WHAT[kind]}: --rotate is for base models; drop --rotate")
    dtype_name = resolve_calibration_dtype(config.dtype)
    dtype = CALIBRATION_DTYPES[dtype_name]
    base_dir = draft_base(config.base, model_dir)
    module = load_draft(model_dir, cfg, dtype).to(device)
    check_base(module, base_dir)
    batches = calibration_batches(config, base_dir, say)  # the base's tokenizer
    base = load_base(base_dir, dtype, device)
    base.args.check_context(config.seq_len, "--seq-len")
    n, every = batches.shape[0], max(1, batches.shape[0] // 4)
    say(f"calibrating {model_dir} ({DRAFT_WHAT[kind]}) on {n} × {batches.shape[1]} tokens of its base {base_dir}")

    def on_window(i: int) -> None:
        if (i + 1) % every == 0 and i + 1 < n:
            say(f"observed {i + 1}/{n} windows")

    kv_observer = config.kv_observer or DEFAULT_KV_OBSERVER
    t1 = time.perf_counter()
    tensors = observe_draft(module, base, batches, observer=config.observer, percentile=config.percentile,
                            kv_observer=kv_observer, on_window=on_window)
    forward_s = time.perf_counter() - t1
    meta = {**table_meta(config, dtype_name, kv_observer, model_dir, forward_s, cpu0),
            "draft": {"kind": kind, "base": str(base_dir), "base_fingerprint": model_fingerprint(base_dir)}}
    meta["wall_s"] = round(time.perf_counter() - t0, 3)
    path = write_table(out, tensors, meta, overwrite=config.overwrite)
    return CalibrationResult(path=path, meta=meta, wall_s=meta["wall_s"], forward_s=forward_s)


def draft_static_plan(config, src, module, qconfig, batches: torch.Tensor | None):
    """The static a8w8 / a8w8_fp8 plan of the quantize run `config` (`calib.quantize.QuantizeConfig`)
    of the draft `module` (config `qconfig`), whose table is `src.table`, measured on its base
    (`src.base_dir`: `--base`, else the one the table was measured on; `src.base_model()`) → (`qconfig` with the
    fallback group, each static Linear's input scale from the table (q/k/v and gate/up at their
    group's largest, `calib.smooth.shared_group_scales`: the engines fuse them), GPTQ's windows:
    `batches`, or the table's own, by the base's tokenizer).

    SmoothQuant: the module is smoothed in place first (`draft_smoothing`) at
    `config.smoothquant_alpha`, by default `DRAFT_ALPHA` for int8 inputs where it has a norm to
    fold into (MTP, EAGLE-3), none otherwise. Fallback: the fused units whose static inputs cost
    the most keep float inputs (W8A16), scored by `draft_sensitivity` on the table's data (on the
    smoothed module): every unit above `config.fallback_threshold` (default
    `DRAFT_FALLBACK_THRESHOLD`), or the `config.fallback_layers` worst."""
    from quantspec.calib.data import TableWindows
    from quantspec.calib.static_plan import rank_units, select_fallback, with_fallback_layers
    from quantspec.model_zoo.eagle3 import Eagle3Head
    from quantspec.quant.engines import eagle3_targets, fused_targets

    table, kind = src.table, "fp8" if config.quant_type == "a8w8_fp8" else "int8"
    src.base_dir = _table_base(table, src.base_dir)
    alpha, factors, scales = _smoothed_scales(config, module, qconfig, table, kind)
    data = TableWindows(table.meta, src.base_dir, config.dataset, split=config.split, text_field=config.text_field,
                        seq_len=config.seq_len, seed=config.seed)
    errors = draft_sensitivity(module, src.base_model(), data.search_windows(config.search_samples), scales, kind)
    threshold = config.fallback_threshold
    if config.fallback_layers is None and threshold is None:
        threshold = DRAFT_FALLBACK_THRESHOLD
    fallback = select_fallback(errors, config.fallback_layers or 0, threshold)
    targets = eagle3_targets if isinstance(module, Eagle3Head) else fused_targets
    if config.method == "gptq" and batches is None:  # on the windows the table was calibrated on
        batches = data.table_windows()
        src.calib_summary.update(method_data=data.describe(0, batches.shape[0]))
    src.calib_summary.update(static_plan={
        "smoothquant_alphas": {"*": float(alpha)} if factors else None,
        "fallback_rule": {"by": "rank", "units": config.fallback_layers or 0, "threshold": threshold},
        "fallback_layers": fallback,
        "fallback_units": [{"linears": list(u), "error": round(e, 6)} for u, e in rank_units(errors)
                           if u[0] in fallback],
        "sensitivity": {n: round(e, 6) for n, e in errors.items()}, "held_back": None,
        "static_activation_linears": len(scales) - len(fallback)})
    return with_fallback_layers(qconfig, fallback, targets), scales, batches


def _table_base(table, base_dir: Path | None) -> Path:
    """The base a draft module's static plan is measured on: `base_dir` (`--base`), else the one
    its table was measured on; a table measured on another base is refused."""
    from quantspec.model_zoo.checkpoint import model_fingerprint, resolve_model_dir

    measured_on = table.meta.get("draft") or {}
    if base_dir is None:
        with about("--calib"):
            base_dir = resolve_model_dir(measured_on.get("base"))
    if measured_on.get("base_fingerprint") != model_fingerprint(base_dir):
        raise QuantSpecError(f"the table {table.path} was measured on another base than {base_dir}; pass "
                             f"the one it names ({measured_on.get('base')}) or recalibrate the module on this one")
    return base_dir


def _smoothed_scales(config, module, qconfig, table, kind: str):
    """(α, the SmoothQuant factors folded into `module`, the static input scale of each Linear
    `qconfig` gives static inputs) for `draft_static_plan`."""
    from quantspec.calib.smooth import shared_group_scales, smoothed_input_absmax
    from quantspec.calib.targets import quantized_linears
    from quantspec.quant.primitives import scale_from_absmax

    table.check_model(module)
    static = [n for n, m in quantized_linears(module, qconfig).items() if isinstance(m, nn.Linear)
              and (a := qconfig.scheme_for(n).input_activations) is not None and not a.dynamic]
    alpha = config.smoothquant_alpha
    if alpha is None:  # the recipe's default
        alpha = DRAFT_ALPHA if kind == "int8" and smoothing_groups(module) is not None else "none"
    factors = draft_smoothing(module, table, alpha)
    scales = shared_group_scales({n: scale_from_absmax(smoothed_input_absmax(table, n, factors.get(n)), kind)
                                  for n in static})
    return alpha, factors, scales


def smoothing_groups(module) -> tuple[nn.Module, str, tuple[str, ...]] | None:
    """(the decoder layer of the draft `module` SmoothQuant folds into, its name, the first Linear
    of each group it smooths): an MTP module's layer all three groups (q/k/v after its
    input_layernorm, gate/up, up → down); an EAGLE-3 head's gate/up and up → down (its q/k/v read
    two norms' outputs side by side, whose outliers are few: their static error is the least of
    the head's); None for Medusa heads (no norm, nothing to fold into)."""
    from quantspec.model_zoo.eagle3 import Eagle3Head
    from quantspec.model_zoo.mtp import MTPModule

    if isinstance(module, Eagle3Head):
        return module.midlayer, "midlayer", ("mlp.gate_proj", "mlp.down_proj")
    if isinstance(module, MTPModule):
        return module.model.layers[0], "model.layers.0", ("self_attn.q_proj", "mlp.gate_proj", "mlp.down_proj")
    return None


@torch.no_grad()
def draft_smoothing(module, table, alpha) -> dict[str, torch.Tensor]:
    """SmoothQuant with one `alpha` on the draft `module`'s groups (`smoothing_groups`), from its
    `table`'s per-channel input ranges, folded into the module in place → the factors {Linear:
    s [K]} (`calib.smooth`); {} for `alpha` None or "none"."""
    from quantspec.calib.smooth import layer_smoothing_factors, smooth_layer

    found = smoothing_groups(module)
    why = smoothing_refusal("medusa" if found is None else None, alpha)
    if why is not None:
        raise QuantSpecError(f"{why}; drop --smoothquant-alpha or change it")
    if alpha is None or alpha == "none":
        return {}
    layer, prefix, groups = found
    factors = layer_smoothing_factors(layer, prefix, table, {f"{prefix}.{g}": float(alpha) for g in groups})
    smooth_layer(layer, prefix, factors)
    return factors


@torch.no_grad()
def draft_sensitivity(module, base, windows: torch.Tensor, input_scales: Mapping[str, torch.Tensor],
                      kind: str) -> dict[str, float]:
    """{Linear: its static-input error} for each Linear of `input_scales`: the base models'
    sensitivity (`calib.sensitivity.linear_sensitivity`, mean_t ||fq(x_t)·Ŵᵀ − x_t·Ŵᵀ||² /
    ||x_t·Ŵᵀ||², Ŵ its per-channel int8 / fp8 weight), on the inputs it reads as it drafts on
    `base` over `windows` [n, S] (`calib.draft_calib.draft_passes`)."""
    from quantspec.calib.sensitivity import MAX_ROWS, fake_quant_weight, sample_rows, static_linear_error

    sums: dict[str, list[float]] = {}
    weights: dict[str, torch.Tensor] = {}

    def hook(m, args, name):
        if name not in weights:
            weights[name] = fake_quant_weight(m.weight, kind)
        e, r = static_linear_error(sample_rows(args[0], MAX_ROWS), [weights[name]], input_scales[name], kind,
                                   quantized=True)
        acc = sums.setdefault(name, [0.0, 0.0])
        acc[0], acc[1] = acc[0] + e, acc[1] + r

    handles = [m.register_forward_pre_hook(lambda m, a, _n=n: hook(m, a, _n)) for n, m in module.named_modules()
               if n in input_scales]
    try:
        for _ in draft_passes(module.eval(), base, windows):
            pass
    finally:
        for h in handles:
            h.remove()
    return {n: e / max(r, 1e-30) for n, (e, r) in sums.items()}
