"""`quantspec quantize`: a validated `QuantizeConfig` and the pipeline that turns a checkpoint into an
artifact directory.

`QuantizeConfig` is the one place that checks what the user asked for: every rule `quantize`
applies (quant type, method, group size, zero points, the a8w8 recipe's knobs, the data they
need) fails when the config is built, in one line naming the flag. `run_quantize` then runs the
phases in order — check the output location and the device, read the source's headers and the
calibration table (or measure it first: `calib.oneshot`), check the disk, gather GPTQ's data, plan the
static-activation recipe (a8w8 types), quantize layer by layer (`calib.ptq`), write the artifact
atomically (`quant.artifact`) — each a small function below.

Models larger than memory: the model is built on the `meta` device and every pass — the recipe's
measurements and the quantization itself — reads one decoder layer at a time from the
checkpoint's safetensors (`model_zoo.checkpoint.CheckpointReader`) onto `device`, quantizes it
and writes its tensors into the run's working directory (`calib.stream`), so resident memory is
one layer's weights, its calibration activations and (GPTQ, AWQ) its Hessians, whatever the depth.
A big run keeps that directory when it does not complete, and the same command resumes it from
the last finished layer (`calib.stream`).

The a8w8 / a8w8_fp8 recipe by default: SmoothQuant α searched per smoothing group and the fewest
fused units (q/k/v, gate/up, o_proj, down_proj) kept at float activations (W8A16) that keep the
perplexity on held-back calibration windows within `fallback_budget` percent of the weight-only
model's (`calib.budget`, `calib.static_plan`). Data for the α search, the fallback and GPTQ comes
from `dataset`, or from the dataset the table names in its calibration.json.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable

import torch

from quantspec.calib.awq import AWQ_DUO
from quantspec.calib.draft_calib import DRAFT_WHAT, check_base, draft_hessians, draft_request, load_base, load_draft
from quantspec.calib.draft_scales import draft_static_plan
from quantspec.calib.oneshot import attach_table, calibrate_in_run, needs_table, one_shot
from quantspec.calib.quip import check_quip_recipe
from quantspec.calib.recipe_out import recipe_file
from quantspec.calib.recipe_checks import check_activation_recipe, check_method, per_token_smoothing, smooths_per_token
from quantspec.calib.targets import EMBED
from quantspec.errors import QuantSpecError, about, positive_int
from quantspec.outputs import check_output_dir

__all__ = ["COPIED_FILES", "QuantizeConfig", "run_quantize"]

# files copied from the source model into an artifact (those that exist)
COPIED_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
                "tokenizer.model", "added_tokens.json", "chat_template.jinja", "generation_config.json")
ZP_DTYPES = ("float16", "bfloat16", "float32")

Progress = Callable[[int, int, str], None]


@dataclass(frozen=True)
class QuantizeConfig:
    """Everything `quantize` needs; every rule is checked when the config is built.

    `method`: "rtn", "gptq", "awq", "awq+gptq" or "autoround" (`quant.presets.METHODS`; all but rtn
    read `dataset`; AWQ is for the weight-only types and inputs quantized per token; AutoRound for
    integer weights, tuned with `iters`, `lr` and `batch_size`).
    `smoothquant_alpha`: None (the recipe's default: "auto" for the static a8w8 types, no smoothing
    for inputs quantized per token), "auto", "none" or a number in (0, 1) (`calib.recipe_checks`).
    `device`: where each layer is quantized (`devices.resolve_device`);
    `resumable` / `restart`: see `calib.stream`. `target` ("portable" = vLLM and SGLang, "vllm",
    "sglang", "transformers", "quantspec"): options an engine of the target would refuse or ignore
    fail here, in one line naming the target and the alternative (`quant.engines.target_refusal`).
    `fallback_layers` / `fallback_threshold` choose the a8w8 fallback units by their measured error
    instead of `fallback_budget` (percent over the weight-only model on `holdout_samples`
    held-back windows; None → `calib.budget.DEFAULT_BUDGET_PCT`).
    """

    model: str = "smollm2-135m"
    quant_type: str = "weight_only_int8"
    out: str | None = None
    method: str = "rtn"
    group_size: int | None = None  # None: 128 for the int4 types, per channel for weight_only_int8
    symmetric: bool = True
    zp_dtype: str | None = None
    weight_observer: str | None = None  # None: `quant.presets.default_weight_observer`
    ignore: tuple[str, ...] = ()
    layer_quant_types: tuple[str, ...] = ()  # "TARGET=QUANT_TYPE": those Linears at another type (`calib.layer_types`)
    act_order: bool = False
    block_size: int = 128
    damp: float = 0.01
    iters: int | None = None  # AutoRound's steps per layer, step size, samples per step (None: `calib.autoround`'s)
    lr: float | None = None
    batch_size: int | None = None
    awq_duo_scaling: str = "true"  # AWQ's candidate scales: "true" | "false" | "both" (`calib.awq.candidate_scales`)
    dataset: str | None = None
    base: str | None = None  # a draft module's base: GPTQ measures the module's inputs on it (`calib.draft_calib`)
    split: str = "train"
    text_field: str = "text"
    num_samples: int = 128
    seq_len: int = 512
    seed: int = 0
    calib: str | None = None
    activations: str | None = None  # a8w8 types: "static" calibrated input scales, or "dynamic" at run time;
    # None: dynamic with `weight_block` and for the a8w4 types (dynamic only), else static
    weight_block: int | None = None  # a8w8_fp8 / weight_only_fp8: FP8 weights in blocks of this side (FP8_BLOCK)
    weight_strategy: str | None = None  # "tensor": FP8 weights one scale per Linear; None: per channel
    smoothquant_alpha: float | str | None = None
    kv_cache: str | None = None
    kv_strategy: str | None = None  # "tensor" | "head"; None: head for --target quantspec, else tensor
    target: str = "portable"
    compute_capability: str | None = None  # the serving GPU's ("9.0", ...) `target` is judged for; None: each type's
    capability: object = field(default=None, init=False, repr=False, compare=False)  # `compute_capability` parsed
    fallback_layers: int | None = None
    fallback_threshold: float | None = None
    fallback_budget: float | None = None
    search_samples: int = 4
    holdout_samples: int | None = None
    overwrite: bool = False
    device: str = "auto"  # where each layer is quantized: auto (CUDA when there is one), cpu, cuda[:N]
    restart: bool = False  # discard the state an interrupted run left for `out`
    recipe: dict | None = None  # the llm-compressor recipe these options came from: {path, flags} (`calib.recipe`)
    resumable: bool | None = None  # keep a state to resume from; None: for checkpoints ≥ 1 GiB
    # rotations fused into the weights first ("R1" or "R1,R2", `calib.rotate`; signs from `seed`), and R4 at run time
    rotate: str | None = None
    rotation: object = field(default=None, init=False, repr=False, compare=False)  # `rotate` parsed
    quip: str | None = None  # QuIP's run-time transforms ("v" or "v,u", `calib.quip`)
    quip_block_size: int | None = None  # their block (a power of two); None: the largest up to 128 that fits
    quip_spec: object = field(default=None, init=False, repr=False, compare=False)  # `quip` (or R4) parsed
    r4: bool = field(default=False, init=False, repr=False, compare=False)  # `rotate` names R4 (`calib.quip`)
    quant_config: object = field(default=None, init=False, repr=False, compare=False)
    # quant_config's groups of `layer_quant_types`: group key → the spec that made it
    layer_groups: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self):
        from quantspec.calib.ptq import METHODS
        from quantspec.calib.quip import Quip
        from quantspec.calib.rotate import Rotation, split_rotate
        from quantspec.quant.args import QuantType
        from quantspec.quant.presets import A8W4_TYPES, KV_STRATEGIES, check_weight_block, default_weight_observer, preset
        from quantspec.quant.engines import parse_capability, target_refusal

        qt = QuantType.parse(self.quant_type)
        if self.compute_capability is not None:
            object.__setattr__(self, "capability", parse_capability(self.compute_capability))
        object.__setattr__(self, "quant_type", qt.value)
        fused, r4 = split_rotate(self.rotate)
        object.__setattr__(self, "rotation", Rotation.parse(fused, self.seed))
        object.__setattr__(self, "quip_spec", Quip.parse(self.quip, self.quip_block_size))
        if r4 and self.quip_spec is not None:
            raise QuantSpecError("--rotate R4 and --quip both turn Linears at run time (R4: each down_proj's "
                                 "input); pass one of them")
        if r4:
            object.__setattr__(self, "quip_spec", Quip.r4())
            object.__setattr__(self, "r4", True)
        if self.activations is None:
            dynamic = (self.weight_block is not None and qt is QuantType.A8W8_FP8) or qt in A8W4_TYPES
            object.__setattr__(self, "activations", "dynamic" if dynamic else "static")
        check_weight_block(qt, self.weight_block, self.activations, self.weight_observer or "minmax")
        object.__setattr__(self, "ignore", (self.ignore,) if isinstance(self.ignore, str) else tuple(self.ignore))
        if isinstance(self.layer_quant_types, str):
            object.__setattr__(self, "layer_quant_types", (self.layer_quant_types,))
        if self.layer_quant_types:  # before the static recipe's checks: mixed types take no table
            from quantspec.calib.layer_types import check_model_type

            check_model_type(qt, self.activations)
        if self.method not in METHODS:
            raise QuantSpecError(f"unknown --method {self.method!r}; use one of: {', '.join(METHODS)}")
        if self.out is None:
            raise QuantSpecError("--out is required: the directory to write the artifact to")
        check_activation_recipe(self)
        check_method(self, qt)
        if self.method.endswith("gptq"):
            positive_int("block_size", self.block_size)
            if not self.damp > 0:
                raise QuantSpecError(f"--damp {self.damp} must be > 0 (e.g. 0.01)")
        elif self.act_order:
            raise QuantSpecError(f"--act-order orders GPTQ's columns and --method {self.method} runs no GPTQ; "
                                 "use --method gptq or awq+gptq, or drop --act-order")
        if self.zp_dtype is not None and self.zp_dtype not in ZP_DTYPES:
            raise QuantSpecError(f"--zp-dtype {self.zp_dtype!r}: use int, {', '.join(ZP_DTYPES)}")
        observer = self.weight_observer  # as given: a layer's own type takes it too (`calib.layer_types`)
        object.__setattr__(self, "weight_observer", self.weight_observer or default_weight_observer(qt, self.method))
        kv_strategy = self._check_target()
        config = preset(qt, group_size=self.group_size, int8_group_size=self.group_size, symmetric=self.symmetric,
                        zp_dtype=self.zp_dtype, weight_observer=self.weight_observer, kv_cache=self.kv_cache,
                        kv_strategy=KV_STRATEGIES[kv_strategy], activations=self.activations, weight_block=self.weight_block,
                        weight_strategy=self.weight_strategy, ignore=("lm_head", *[i for i in self.ignore if i != "lm_head"]))
        if self.layer_quant_types:  # judged once its targets name the model's Linears (`run_quantize`)
            config = self._with_layer_types(config, qt, observer)
        refusal = None if self.layer_quant_types else target_refusal(self.target, config, capability=self.capability)
        if refusal is not None:
            raise QuantSpecError(refusal)
        object.__setattr__(self, "quant_config", config)

    def _with_layer_types(self, config, qt, observer: str | None):
        """`config` with a group per `layer_quant_types` spec (`calib.layer_types.with_layer_types`)."""
        from quantspec.calib.layer_types import with_layer_types

        config, groups = with_layer_types(config, qt, self.layer_quant_types, group_size=self.group_size,
                                          symmetric=self.symmetric, zp_dtype=self.zp_dtype, observer=observer,
                                          weight_block=self.weight_block, weight_strategy=self.weight_strategy,
                                          method=self.method)
        if "lm_head" in self.ignore and "lm_head" not in config.ignore:
            raise QuantSpecError("--ignore lm_head keeps the head float and a --layer-quant-type names it; drop one")
        object.__setattr__(self, "layer_groups", groups)
        return config

    def _check_target(self) -> str:
        """Check `target` and `kv_strategy` and settle the KV strategy (`settle_kv_strategy`); → the strategy."""
        from quantspec.quant.presets import settle_kv_strategy

        kv_strategy = settle_kv_strategy(self.target, self.kv_strategy)
        if self.kv_strategy is not None and self.kv_cache is None:
            raise QuantSpecError("--kv-strategy shapes the KV-cache scales of --kv-cache; add --kv-cache "
                                 "or drop it")
        object.__setattr__(self, "kv_strategy", kv_strategy)
        return kv_strategy

    @property
    def static(self) -> bool:
        """Static input activations (a8w8, a8w8_fp8): a calibration table is needed."""
        return self.quant_type in ("a8w8", "a8w8_fp8") and self.activations == "static"

    @property
    def calibrated_inputs(self) -> bool:
        """Input scales from a calibration table: static a8w8 / a8w8_fp8 ones, NVFP4's global ones."""
        return self.static or self.quant_type == "nvfp4"

    @property
    def autoround(self):
        """The `calib.autoround.AutoRound` settings of `--method autoround` (None for the others)."""
        from quantspec.calib.autoround import DEFAULT_BATCH_SIZE, DEFAULT_ITERS, AutoRound

        if self.method != "autoround":
            return None
        return AutoRound(iters=DEFAULT_ITERS if self.iters is None else self.iters, lr=self.lr, seed=self.seed,
                         batch_size=DEFAULT_BATCH_SIZE if self.batch_size is None else self.batch_size)

    @property
    def by_rank(self) -> bool:
        """The a8w8 fallback is chosen by measured error rank, not by the budget."""
        return self.fallback_layers is not None or self.fallback_threshold is not None

    @property
    def alpha(self) -> float | str | None:
        """The SmoothQuant α the recipe runs: a number, "auto", or None (no smoothing)."""
        alpha = "auto" if self.smoothquant_alpha is None else self.smoothquant_alpha
        return None if alpha == "none" else alpha


@dataclass
class _Source:
    """The checkpoint being quantized and what was read from it."""

    model_dir: Path
    config: dict
    dtype: torch.dtype  # the checkpoint's dtype: scales and unquantized tensors are written in it
    quant_config: object  # what is quantized: `QuantizeConfig.quant_config`, for a draft module's kind
    reader: object | None = None  # its CheckpointReader (None: an MTP module, read whole)
    table: object | None = None  # the calibration table (a8w8 types, static KV)
    transforms: dict | None = None  # the artifact's transform_config: the rotations fused into its weights
    base_dir: Path | None = None  # a draft module's base, for GPTQ (`calib.draft_calib`)
    kind: str | None = None  # the draft module's kind ("mtp", "medusa", "eagle3"); None: a base model
    calib_summary: dict = field(default_factory=dict)
    base: object | None = None  # `base_dir`'s float model, read once for a draft module's static plan and GPTQ

    def base_model(self, say=lambda _m: None):
        """The float base at `base_dir` (`calib.draft_calib.load_base`), read on first use."""
        if self.base is None:
            say(f"reading the base {self.base_dir}")
            self.base = load_base(self.base_dir)
        return self.base


def run_quantize(config: QuantizeConfig, *, progress: Progress | None = None,
                 on_status: Callable[[str], None] | None = None) -> Path:
    """Quantize `config.model` into the artifact directory `config.out`; returns its path.

    Written atomically: on any error, Ctrl-C or SIGTERM `out` is left as it was (a big run keeps
    its state to resume from, `calib.stream`). `progress(layer, num_layers, phase)` is called per
    decoder layer, `on_status(message)` at each phase (reading, measuring, writing).
    """
    from quantspec.calib.ptq import decoder_layers, quantize_model
    from quantspec.calib.stream import check_disk, open_run, run_identity, say_resume
    from quantspec.devices import resolve_device
    from quantspec.quant.decompressed import source_quantization

    t0 = time.perf_counter()
    say = on_status or (lambda _m: None)
    out = check_output_dir(config.out, "--out", overwrite=config.overwrite)
    device = resolve_device(config.device)
    src = _read_source(config)
    if src.reader is not None and src.reader.stored:  # `model_zoo.multimodal`
        say("reading the text decoder of a multimodal checkpoint (the artifact leaves its vision tower out)")
    if (was := source_quantization(src.reader)) is not None:
        say(f"decompressing the checkpoint's {was['quant_type'] or was['format']} weights ({was['quant_method']}) "
            "a layer at a time")
    model = _skeleton(config, src)
    if src.reader is not None:  # a fused checkpoint's modules (Phi-3's qkv_proj) by their parts' names, named whole
        from quantspec.model_zoo.layout import checkpoint_config, part_config

        src.quant_config = part_config(model.args, src.quant_config)
        checkpoint_config(model.args, src.quant_config)  # refuses a unit named in part, before any work
    if config.layer_quant_types:
        from quantspec.calib.layer_types import resolve_layer_types

        src.quant_config = resolve_layer_types(model, src.quant_config, config.layer_groups, config.target,
                                               config.capability)
    batches = _gptq_batches(config, src, say)
    if src.reader is not None and (config.method != "rtn" or config.static):  # windows run full attention
        model.args.check_context(config.seq_len, "--seq-len")
    resumable, key = run_identity(config, src, device)
    check_disk(config, src, model, out, key)
    with open_run(out, key, resumable=resumable, restart=config.restart) as run:
        if one_shot(config):
            calibrate_in_run(config, src, run, say, progress)
        qconfig, input_scales, factors, batches = _inputs(config, src, model, batches, say, run, device)
        hessians = draft_hessians(model, src.base_model(say), batches, qconfig, say) \
            if src.kind is not None and config.method == "gptq" else None
        sink = run.sink(keep_inputs=config.method != "rtn")
        say_resume(sink, len(decoder_layers(model)))
        say(f"quantizing {src.model_dir}" + (f" one layer at a time ({device})" if src.reader is not None else ""))
        res = quantize_model(model, qconfig, config.method, batches, block_size=config.block_size, damp=config.damp,
                             act_order=config.act_order, input_scales=input_scales, scale_dtype=src.dtype,
                             out_dtype=src.dtype, progress=progress, weights=src.reader, device=device,
                             smooth=factors, sink=sink, quip=config.quip_spec, autoround=config.autoround,
                             hessians=hessians, awq_duo=AWQ_DUO[config.awq_duo_scaling])
        say(f"writing {out}")
        return _write(config, src, res, run, out, time.perf_counter() - t0)


def _inputs(config: QuantizeConfig, src: _Source, model, batches, say, run, device):
    """(the config to quantize with, the input scales, the smoothing factors, the calibration
    batches) of the run: static ones by the a8w8 plan (a draft module's as its table holds them),
    NVFP4's input global scales, or per-token inputs smoothed."""
    from quantspec.calib.static_plan import plan_from_table

    qconfig, input_scales, factors = src.quant_config, None, None
    if config.static and src.kind is not None:  # a draft module's: as its table holds them
        qconfig, input_scales, batches = draft_static_plan(config, src, model, qconfig, batches)
    elif config.static:
        qconfig, input_scales, factors, batches = plan_from_table(config, src, model, qconfig, batches, say, run,
                                                                  device)
    elif config.calibrated_inputs:  # NVFP4's input global scales
        input_scales = src.table.nvfp4_input_global_scales(model)
    elif smooths_per_token(config):
        factors = per_token_smoothing(config, src, model, say)
    return qconfig, input_scales, factors, batches


def _read_source(config: QuantizeConfig) -> _Source:
    """The source checkpoint (its headers checked before any work) and the calibration table.
    A draft module is checked against `--target` here (`quant.engines.target_refusal`); an
    EAGLE-3 head's config, in the plain layout whatever the source's format, leaves float what
    the target's engines load float (`quant.engines.eagle3_ignore`)."""
    from quantspec.calib.rotate import rotated_config
    from quantspec.model_zoo.checkpoint import draft_kind, read_config, resolve_model_dir, verify_checkpoint
    from quantspec.model_zoo.eagle3 import Eagle3Args
    from quantspec.model_zoo.llama import ModelArgs
    from quantspec.model_zoo.moe import expert_dims, router_ignore
    from quantspec.quant.presets import for_experts
    from quantspec.quant.decompressed import source_reader
    from quantspec.quant.engines import eagle3_ignore, eagle3_refusal, target_refusal

    qconfig = config.quant_config
    with about("--model"):
        model_dir = resolve_model_dir(config.model)
        cfg = read_config(model_dir)
        kind = draft_kind(cfg)
        if cfg.get("quantization_config") and kind is not None:
            raise QuantSpecError(f"{model_dir} is a quantized draft module; quantize the float one it was made from")
        what = DRAFT_WHAT.get(kind)
        if kind == "eagle3":
            qconfig = replace(qconfig, ignore=(*qconfig.ignore, *eagle3_ignore(config.target)))
            cfg = Eagle3Args.from_config(cfg, str(model_dir / "config.json")).to_config()
        args = ModelArgs.from_hf_config(cfg) if kind is None else None
        moe = args is not None and args.num_experts > 0
        if moe:  # routers and shared-expert gates stay float
            qconfig = for_experts(replace(qconfig, ignore=(*qconfig.ignore,
                                                           *(i for i in router_ignore(args) if i not in qconfig.ignore))))
        if what and config.layer_quant_types:
            raise QuantSpecError(f"--layer-quant-type is for base models, and {model_dir} is {what}; quantize it "
                                 "with one --quant-type")
        # with --layer-quant-type, judged once its targets name the model's Linears (`run_quantize`)
        refusal = target_refusal(config.target, qconfig, draft=kind, moe=moe, expert_dims=expert_dims(args),
                                 capability=config.capability) if (what or moe) and not config.layer_quant_types else None
        unfit = eagle3_refusal("sglang", cfg) if kind == "eagle3" and config.target == "sglang" else None
        if unfit is not None:  # the float head already: no quantization makes it SGLang's
            refusal = f"--target sglang: {unfit}; pass --target vllm (or quantspec)"
        if refusal is not None:
            raise QuantSpecError(f"{model_dir} is {what or 'a mixture of experts'}: {refusal}")
        reader = None if what else source_reader(model_dir, cfg)  # every header checked
        if reader is None:
            verify_checkpoint(model_dir)
    check_quip_recipe(config, draft=f"{config.model} is {what}" if what else None, moe=moe)
    cfg = rotated_config(config.rotation, cfg, f"{config.model} is {what}" if what else None)
    src = _Source(model_dir=model_dir, config=cfg, dtype=_dtype_of(cfg), quant_config=qconfig, reader=reader,
                  transforms=getattr(getattr(reader, "source", None), "transform_config", None))
    src.kind = kind
    src.base_dir = draft_request(config, model_dir, kind)
    if needs_table(config) and config.calib is not None:  # read before the model (one-shot: `run_quantize`)
        attach_table(config, src, config.calib, model_dir)
    return src


def _dtype_of(cfg: dict) -> torch.dtype:
    """The checkpoint's float dtype by its config.json (fp32 where it names none)."""
    dtype = getattr(torch, str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"), torch.float32)
    return dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point else torch.float32


def _skeleton(config: QuantizeConfig, src: _Source):
    """The model on the `meta` device, its layers read from `src.reader` as they are quantized
    (an MTP module — one block —, Medusa heads or an EAGLE-3 head, quantized on their own, are
    read whole)."""
    from quantspec.model_zoo.checkpoint import build_model, check_checkpoint
    from quantspec.model_zoo.llama import ModelArgs

    module = load_draft(src.model_dir, src.config)
    if module is not None:
        if src.base_dir is not None:  # the base it is measured on: the one it was made for
            check_base(module, src.base_dir)
        return module
    with about("--model"):
        args = ModelArgs.from_hf_config(src.config)
        model = build_model(args, "meta")
        if config.rotation is not None:  # the checkpoint read as the rotated model's (`calib.rotate`)
            from quantspec.calib.rotate import RotatedReader

            src.reader = RotatedReader(src.reader, model, config.rotation)
            src.transforms = config.rotation.transform_config(model)
        check_checkpoint(src.reader.shapes, args, str(src.model_dir))
    return model


def _gptq_batches(config: QuantizeConfig, src: _Source, say) -> torch.Tensor | None:
    """GPTQ's / AWQ's calibration tokens [n, S] from `--dataset` (None for RTN, or when GPTQ
    takes the table's own windows)."""
    if config.method == "rtn" or config.dataset is None:
        return None
    from transformers import AutoTokenizer

    from quantspec.calib.data import build_calibration_batches, load_calibration_texts

    say(f"reading the calibration data {config.dataset}")
    with about("--dataset"):
        texts = load_calibration_texts(config.dataset, split=config.split, text_field=config.text_field)
    tok = AutoTokenizer.from_pretrained(str(src.base_dir or src.model_dir))  # a draft module's: its base's
    batches = build_calibration_batches(texts, tok, config.num_samples, config.seq_len, config.seed)
    src.calib_summary.update(**({"base": str(src.base_dir)} if src.base_dir else {}),
                             dataset=str(config.dataset), split=config.split, text_field=config.text_field,
                             num_samples=config.num_samples, seq_len=config.seq_len, seed=config.seed,
                             num_texts=len(texts))
    return batches


def _write(config: QuantizeConfig, src: _Source, res, run, out: Path, wall_s: float) -> Path:
    """The artifact: the source config + `quantization_config`, the tensors the run wrote (+ KV
    scales), the tokenizer files and `quantspec.json` provenance."""
    from quantspec import __version__
    from quantspec.model_zoo.checkpoint import model_fingerprint
    from quantspec.quant.artifact import write_artifact
    from quantspec.quant.decompressed import source_quantization

    if config.kv_cache is not None and "kv" not in run.writer.parts:
        # k_scale / v_scale per attention: [1] or [KV, 1, 1] (compressed-tensors)
        kv = src.quant_config.kv_cache_scheme
        run.writer.add("kv", src.table.kv_artifact_tensors("fp8" if kv.type == "float" else "int8", kv.strategy),
                       run.writer.meta)
    cfg = dict(src.config)
    transforms = {**(src.transforms or {})}
    if res.transforms:  # QuIP's run-time groups beside the fused rotations' (`calib.quip`)
        transforms["config_groups"] = {**transforms.get("config_groups", {}), **res.transforms}
    qc = res.config if not transforms else replace(res.config, transform_config=transforms)
    cfg["quantization_config"] = qc.to_dict()
    untie = res.config.scheme_for("lm_head") is not None or res.config.module_scheme(EMBED) is not None
    if cfg.get("tie_word_embeddings") and untie:
        cfg["tie_word_embeddings"] = False  # the head and the embedding written apart (`PTQ.rest_part`)
    extra = {f: src.model_dir / f for f in COPIED_FILES if (src.model_dir / f).is_file()}
    extra.update(recipe_file(config, src, run.dir))  # llm-compressor's recipe.yaml, where one stands for the run
    provenance = {
        "quantspec_version": __version__,
        "source_model": str(config.model), "source_dir": str(src.model_dir),
        "source_size_bytes": sum(f.stat().st_size for f in src.model_dir.glob("*.safetensors")),
        "model_fingerprint": model_fingerprint(src.model_dir),
        "source_quantization": source_quantization(src.reader),
        "quant_type": config.quant_type, "method": config.method,
        "args": {k: v for k, v in asdict(config).items()
                 if k in ("group_size", "symmetric", "zp_dtype", "weight_observer", "act_order", "block_size", "damp",
                          "awq_duo_scaling",
                          "kv_strategy", "target", "compute_capability", "activations", "weight_block", "weight_strategy",
                          "layer_quant_types", "rotate", "quip", "quip_block_size")}
        | {"ignore": list(res.config.ignore)},
        **({"recipe": config.recipe} if config.recipe else {}),
        "calibration": src.calib_summary or None,
        "ptq": res.summary,
        "wall_time_s": round(wall_s, 3),
    }
    return write_artifact(out, run.writer, cfg, extra_files=extra,
                          provenance={"quant_type": config.quant_type, "provenance": provenance},
                          overwrite=config.overwrite)
