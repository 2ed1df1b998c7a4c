"""`quantspec quantize`: a validated `QuantizeConfig` and the pipeline that turns a checkpoint into an
artifact directory.

`QuantizeConfig` is the one place that checks what the user asked for: every rule `quantize`
applies (quant type, method, group size, zero points, the a8w8 recipe's knobs, the data they
need) fails when the config is built, in one line naming the flag. `run_quantize` then runs the
phases in order — check the output location, read the source and the calibration table, load
the model, gather GPTQ's data, plan the static-activation recipe (a8w8 types), quantize layer by
layer (`calib.ptq`), write the artifact atomically (`quant.artifact`) — each a small function
below.

The a8w8 / a8w8_fp8 recipe by default: SmoothQuant α searched per smoothing group and the fewest
fused units (q/k/v, gate/up, o_proj, down_proj) kept at float activations (W8A16) that keep the
perplexity on held-back calibration windows within `fallback_budget` percent of the weight-only
model's (`calib.budget`, `calib.sensitivity`). Data for the α search, the fallback and GPTQ comes
from `dataset`, or from the dataset the table names in its calibration.json.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch

from quantspec.errors import QuantSpecError, about, positive_int
from quantspec.outputs import check_output_dir

__all__ = ["COPIED_FILES", "QuantizeConfig", "run_quantize"]

# files copied from the source model into an artifact (those that exist)
COPIED_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
                "tokenizer.model", "added_tokens.json", "chat_template.jinja", "generation_config.json")
ALPHA_CHOICES = ("auto", "none")  # --smoothquant-alpha besides a number in (0, 1)
ZP_DTYPES = ("float16", "bfloat16", "float32")
KV_STRATEGIES = {"tensor": "tensor", "head": "attn_head"}  # --kv-strategy → compressed-tensors' strategy

Progress = Callable[[int, int, str], None]


@dataclass(frozen=True)
class QuantizeConfig:
    """Everything `quantize` needs; every rule is checked when the config is built.

    `smoothquant_alpha`: None (the recipe's default: "auto" for the a8w8 types), "auto", "none"
    or a number in (0, 1). `target` ("portable" = vLLM and SGLang, "vllm", "sglang",
    "transformers", "quantspec"): options an engine of the target would refuse or ignore fail here,
    in one line naming the target and the alternative (`quant.engines.target_refusal`).
    `fallback_layers` / `fallback_threshold` choose the a8w8 fallback
    units by their measured error instead of `fallback_budget` (percent over the weight-only
    model on `holdout_samples` held-back windows; None → `calib.budget.DEFAULT_BUDGET_PCT`).
    """

    model: str = "smollm2-135m"
    quant_type: str = "weight_only_int8"
    out: str | None = None
    method: str = "rtn"
    group_size: int = 128
    symmetric: bool = True
    zp_dtype: str | None = None
    weight_observer: str | None = None  # None: `quant.presets.default_weight_observer`
    ignore: tuple[str, ...] = ()
    act_order: bool = False
    block_size: int = 128
    damp: float = 0.01
    dataset: str | None = None
    split: str = "train"
    text_field: str = "text"
    num_samples: int = 128
    seq_len: int = 512
    seed: int = 0
    calib: str | None = None
    smoothquant_alpha: float | str | None = None
    kv_cache: str | None = None
    kv_strategy: str | None = None  # "tensor" | "head"; None: head for --target quantspec, else tensor
    target: str = "portable"
    fallback_layers: int | None = None
    fallback_threshold: float | None = None
    fallback_budget: float | None = None
    search_samples: int = 4
    holdout_samples: int | None = None
    overwrite: bool = False
    quant_config: object = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self):
        from quantspec.calib.ptq import METHODS
        from quantspec.quant.args import QuantType
        from quantspec.quant.presets import default_weight_observer, preset
        from quantspec.quant.engines import target_refusal

        qt = QuantType.parse(self.quant_type)
        object.__setattr__(self, "quant_type", qt.value)
        object.__setattr__(self, "ignore", (self.ignore,) if isinstance(self.ignore, str) else tuple(self.ignore))
        if self.method not in METHODS:
            raise QuantSpecError(f"unknown --method {self.method!r}; use one of: {', '.join(METHODS)}")
        if self.out is None:
            raise QuantSpecError("--out is required: the directory to write the artifact to")
        self._check_static_recipe()
        if self.method == "gptq":
            if self.dataset is None and not (self.static and self.calib is not None):
                raise QuantSpecError("--method gptq needs calibration data; pass --dataset (a local "
                                     ".txt/.json/.jsonl/.parquet file or a hub id)")
            positive_int("num_samples", self.num_samples)
            positive_int("seq_len", self.seq_len)
            positive_int("block_size", self.block_size)
            if not self.damp > 0:
                raise QuantSpecError(f"--damp {self.damp} must be > 0 (e.g. 0.01)")
        if self.zp_dtype is not None and self.zp_dtype not in ZP_DTYPES:
            raise QuantSpecError(f"--zp-dtype {self.zp_dtype!r}: use int, {', '.join(ZP_DTYPES)}")
        observer = self.weight_observer or default_weight_observer(qt)
        object.__setattr__(self, "weight_observer", observer)
        kv_strategy = self._check_target()
        config = preset(qt, group_size=self.group_size, symmetric=self.symmetric, zp_dtype=self.zp_dtype,
                        weight_observer=observer, kv_cache=self.kv_cache, kv_strategy=KV_STRATEGIES[kv_strategy],
                        ignore=("lm_head", *[i for i in self.ignore if i != "lm_head"]))
        refusal = target_refusal(self.target, config)
        if refusal is not None:
            raise QuantSpecError(refusal)
        object.__setattr__(self, "quant_config", config)

    def _check_target(self) -> str:
        """Check `target` and `kv_strategy` and settle the KV strategy (per head for the
        quantspec target, else per tensor, which both engines load); → the strategy."""
        from quantspec.quant.engines import TARGETS

        if self.target not in TARGETS:
            raise QuantSpecError(f"unknown --target {self.target!r}; use one of: {', '.join(TARGETS)}")
        kv_strategy = self.kv_strategy or ("head" if self.target == "quantspec" else "tensor")
        if kv_strategy not in KV_STRATEGIES:
            raise QuantSpecError(f"--kv-strategy {kv_strategy!r}: use {' or '.join(KV_STRATEGIES)}")
        if self.kv_strategy is not None and self.kv_cache is None:
            raise QuantSpecError("--kv-strategy shapes the KV-cache scales of --kv-cache; add --kv-cache "
                                 "or drop it")
        object.__setattr__(self, "kv_strategy", kv_strategy)
        return kv_strategy

    @property
    def static(self) -> bool:
        """Static input activations (a8w8, a8w8_fp8): a calibration table is needed."""
        return self.quant_type in ("a8w8", "a8w8_fp8")

    @property
    def by_rank(self) -> bool:
        """The a8w8 fallback is chosen by measured error rank, not by the budget."""
        return self.fallback_layers is not None or self.fallback_threshold is not None

    @property
    def alpha(self) -> float | str | None:
        """The SmoothQuant α the recipe runs: a number, "auto", or None (no smoothing)."""
        alpha = "auto" if self.smoothquant_alpha is None else self.smoothquant_alpha
        return None if alpha == "none" else alpha

    def _check_static_recipe(self) -> None:
        a = self.smoothquant_alpha
        if a is not None:
            if not self.static:
                raise QuantSpecError("--smoothquant-alpha only helps a8w8 / a8w8_fp8 (it moves activation "
                                     "outliers into the weights); drop it")
            if a not in ALPHA_CHOICES and (isinstance(a, (str, bool)) or not 0 < a < 1):
                raise QuantSpecError(f"--smoothquant-alpha {a} must be in (0, 1), 'auto' or 'none'")
        if (self.by_rank or self.fallback_budget is not None) and not self.static:
            raise QuantSpecError("the --a8w8-fallback-* flags are for a8w8 / a8w8_fp8 (weight-only types have "
                                 "no activation quantization to fall back from); drop them")
        if self.by_rank and self.fallback_budget is not None:
            raise QuantSpecError("choose the fallback one way: --a8w8-fallback-budget, or "
                                 "--a8w8-fallback-layers / --a8w8-fallback-threshold")
        if self.fallback_budget is not None and not self.fallback_budget > 0:
            raise QuantSpecError(f"--a8w8-fallback-budget {self.fallback_budget} must be a positive percentage, "
                                 "e.g. 1.5")
        n = self.fallback_layers
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 0):
            raise QuantSpecError(f"--a8w8-fallback-layers {n} must be 0 (no fallback) or more")
        if self.static and self.calib is None:
            raise QuantSpecError(f"{self.quant_type} needs static activation scales; run `quantspec calibrate "
                                 "--out DIR` and pass --calib DIR")
        if self.kv_cache is not None and self.calib is None:
            raise QuantSpecError(f"--kv-cache {self.kv_cache} stores static KV scales in the artifact; run "
                                 "`quantspec calibrate --out DIR` and pass --calib DIR")


@dataclass
class _Source:
    """The checkpoint being quantized and what was read from it."""

    model_dir: Path
    config: dict
    dtype: torch.dtype  # the checkpoint's dtype: scales and unquantized tensors are written in it
    table: object | None = None  # the calibration table (a8w8 types, static KV)
    calib_summary: dict = field(default_factory=dict)


def run_quantize(config: QuantizeConfig, *, progress: Progress | None = None,
                 on_status: Callable[[str], None] | None = None) -> Path:
    """Quantize `config.model` into the artifact directory `config.out`; returns its path.

    Written atomically: on any error, Ctrl-C or SIGTERM `out` is left as it was.
    `progress(layer, num_layers, phase)` is called per decoder layer, `on_status(message)` at each
    phase (loading, measuring, writing).
    """
    from quantspec.calib.ptq import quantize_model

    t0 = time.perf_counter()
    say = on_status or (lambda _m: None)
    out = check_output_dir(config.out, "--out", overwrite=config.overwrite)
    src = _read_source(config)
    say(f"loading {src.model_dir}")
    net = _load_model(config, src)
    batches = _gptq_batches(config, src, say)
    qconfig, input_scales = config.quant_config, None
    if config.static:
        qconfig, input_scales, batches = _plan_static(config, src, net, qconfig, batches, say)
    res = quantize_model(net, qconfig, config.method, batches, block_size=config.block_size, damp=config.damp,
                         act_order=config.act_order, input_scales=input_scales, scale_dtype=src.dtype,
                         out_dtype=src.dtype, progress=progress)
    say(f"writing {out}")
    return _write(config, src, res, out, time.perf_counter() - t0)


def _read_source(config: QuantizeConfig) -> _Source:
    """The source checkpoint (checked whole before any work) and the calibration table."""
    from quantspec.model_zoo.checkpoint import read_config, resolve_model_dir, verify_checkpoint
    from quantspec.model_zoo.mtp import is_mtp_config
    from quantspec.quant.engines import target_refusal

    with about("--model"):
        model_dir = resolve_model_dir(config.model)
        cfg = read_config(model_dir)
        if cfg.get("quantization_config"):
            raise QuantSpecError(f"{model_dir} is already quantized; quantize the original checkpoint")
        refusal = target_refusal(config.target, config.quant_config, mtp=True) if is_mtp_config(cfg) else None
        if refusal is not None:  # no engine has an MTP module's model class
            raise QuantSpecError(f"{model_dir} is an MTP module: {refusal}")
        verify_checkpoint(model_dir)
    dtype = getattr(torch, str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"), torch.float32)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        dtype = torch.float32
    src = _Source(model_dir=model_dir, config=cfg, dtype=dtype)
    if config.static or config.kv_cache is not None:  # read before the model: a bad table fails at once
        from quantspec.calib.tables import read_table

        with about("--calib"):
            src.table = read_table(config.calib, model_dir=model_dir)
        src.calib_summary.update(calib=str(config.calib), calibration=src.table.meta, kv_cache=config.kv_cache)
    return src


def _load_model(config: QuantizeConfig, src: _Source):
    """The source model in fp32 (an MTP module is quantized on its own, weight-only, with RTN)."""
    from quantspec.model_zoo.checkpoint import load_model
    from quantspec.model_zoo.mtp import is_mtp_config, load_mtp

    if is_mtp_config(src.config):
        if config.method != "rtn" or config.static or config.kv_cache is not None:
            raise QuantSpecError(f"{src.model_dir} is an MTP module: quantize it with --method rtn to "
                                 "weight_only_int8 / weight_only_int4 (GPTQ and static activation or KV "
                                 "scales need its base's hidden states)")
        with about("--model"):
            return load_mtp(src.model_dir)
    with about("--model"):
        return load_model(src.model_dir, dtype=torch.float32)[0]


def _gptq_batches(config: QuantizeConfig, src: _Source, say) -> torch.Tensor | None:
    """GPTQ's calibration tokens [n, S] from `--dataset` (None for RTN, or when GPTQ takes the
    table's own windows)."""
    if config.method != "gptq" or config.dataset is None:
        return None
    from transformers import AutoTokenizer

    from quantspec.calib.data import build_calibration_batches, load_calibration_texts

    say(f"reading the calibration data {config.dataset}")
    with about("--dataset"):
        texts = load_calibration_texts(config.dataset, split=config.split, text_field=config.text_field)
    tok = AutoTokenizer.from_pretrained(str(src.model_dir))
    batches = build_calibration_batches(texts, tok, config.num_samples, config.seq_len, config.seed)
    src.calib_summary.update(dataset=str(config.dataset), split=config.split, text_field=config.text_field,
                             num_samples=config.num_samples, seq_len=config.seq_len, seed=config.seed,
                             num_texts=len(texts))
    return batches


def _plan_static(config: QuantizeConfig, src: _Source, net, qconfig, batches, say):
    """The a8w8 recipe on `net` (smoothed in place): → (config with the fallback group, static
    input scales, GPTQ batches)."""
    from quantspec.calib.budget import DEFAULT_BUDGET_PCT, HOLDOUT_SAMPLES
    from quantspec.calib.data import TableWindows
    from quantspec.calib.sensitivity import plan_static_quant, with_fallback_layers

    table = src.table
    table.check_model(net)
    alpha = config.alpha
    budget = None if config.by_rank else (config.fallback_budget or DEFAULT_BUDGET_PCT)
    data = TableWindows(table.meta, src.model_dir, config.dataset, split=config.split,
                        text_field=config.text_field, seq_len=config.seq_len, seed=config.seed)
    search_ids = holdout_ids = None
    if alpha == "auto" or config.fallback_layers or config.fallback_threshold is not None or budget is not None:
        search_ids = data.search_windows(config.search_samples)
    if config.method == "gptq" and batches is None:  # GPTQ on the windows the table was calibrated on
        batches = data.table_windows()
        src.calib_summary.update(gptq_data=data.describe(0, batches.shape[0]))
    if budget is not None:
        holdout_ids = data.held_back_windows(config.holdout_samples or HOLDOUT_SAMPLES)
    if search_ids is not None:
        say(f"measuring static-activation error on {search_ids.shape[0]} × {search_ids.shape[1]} tokens "
            "(SmoothQuant α search, fallback ranking)"
            + ("" if holdout_ids is None else f" and the fallback budget on {holdout_ids.shape[0]} "
               "held-back windows"))
    (base,) = qconfig.config_groups.values()  # the a8w8 presets are one group
    # smooths `net` in place (all but the fallback units) and picks the fallback units
    plan = plan_static_quant(net, table, config.quant_type, smoothquant_alpha=alpha, input_ids=search_ids,
                             fallback_layers=config.fallback_layers or 0,
                             fallback_threshold=config.fallback_threshold, fallback_budget=budget,
                             holdout_ids=holdout_ids, weight_args=base.weights)
    summary = plan.summary()
    if summary["held_back"] is not None:
        summary["held_back"].update(data.describe(data.held_back_start, holdout_ids.shape[0]))
    src.calib_summary.update(smoothquant_alpha=alpha, static_plan=summary,
                             search_samples=None if search_ids is None else int(search_ids.shape[0]))
    return with_fallback_layers(qconfig, plan.fallback), plan.input_scales, batches


def _write(config: QuantizeConfig, src: _Source, res, out: Path, wall_s: float) -> Path:
    """The artifact: the source config + `quantization_config`, the tensors (+ KV scales), the
    tokenizer files and `quantspec.json` provenance."""
    from quantspec import __version__
    from quantspec.model_zoo.checkpoint import model_fingerprint
    from quantspec.quant.artifact import write_artifact

    if config.kv_cache is not None:  # k_scale / v_scale per attention: [1] or [KV, 1, 1] (compressed-tensors)
        kv = config.quant_config.kv_cache_scheme
        res.tensors.update(src.table.kv_artifact_tensors("fp8" if kv.type == "float" else "int8", kv.strategy))
    cfg = dict(src.config)
    cfg["quantization_config"] = res.config.to_dict()
    extra = {f: src.model_dir / f for f in COPIED_FILES if (src.model_dir / f).is_file()}
    provenance = {
        "quantspec_version": __version__,
        "source_model": str(config.model), "source_dir": str(src.model_dir),
        "source_size_bytes": sum(f.stat().st_size for f in src.model_dir.glob("*.safetensors")),
        "model_fingerprint": model_fingerprint(src.model_dir),
        "quant_type": config.quant_type, "method": config.method,
        "args": {k: v for k, v in asdict(config).items()
                 if k in ("group_size", "symmetric", "zp_dtype", "weight_observer", "act_order", "block_size", "damp",
                          "kv_strategy", "target")}
        | {"ignore": list(res.config.ignore)},
        "calibration": src.calib_summary or None,
        "ptq": res.summary,
        "wall_time_s": round(wall_s, 3),
    }
    return write_artifact(out, res.tensors, cfg, extra_files=extra,
                          provenance={"quant_type": config.quant_type, "provenance": provenance},
                          overwrite=config.overwrite)
