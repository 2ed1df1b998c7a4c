"""The activation recipe's flags and the method's, checked (`check_activation_recipe`,
`check_method`), and SmoothQuant for inputs quantized per token at run time (`per_token_smoothing`).

SmoothQuant (`calib.smooth`) divides each input channel of a smoothing group by s and multiplies
the weight's columns by it, folded into the norm (or up_proj's rows) before them: the float
model is unchanged and the channel outliers move into the weights. The static a8w8 types search
α per group against their static scales (`calib.static_plan`); the types whose inputs are
quantized per token (a8w8 and a8w8_fp8 with `--activations dynamic`, a8w4, a8w4_fp8: llm-compressor's
SmoothQuant + W8A8 / W4A8 recipes) take one α for every group, and s from the calibration table's
per-channel input ranges (`--calib`), as llm-compressor's SmoothQuantModifier takes them from its
calibration pass.
"""

from __future__ import annotations

from typing import Callable

from quantspec.calib.oneshot import refuse_missing_table
from quantspec.errors import QuantSpecError, positive_int
from quantspec.quant.args import QuantType
from quantspec.quant.presets import PER_TOKEN_TYPES, awq_unfit

__all__ = ["ALPHA_CHOICES", "check_activation_recipe", "check_method", "per_token_smoothing", "smooths_per_token"]

ALPHA_CHOICES = ("auto", "none")  # --smoothquant-alpha besides a number in (0, 1)


def _per_token(c) -> bool:
    return c.activations == "dynamic" and c.quant_type in PER_TOKEN_TYPES


def smooths_per_token(c) -> bool:
    """Whether `c` (a `QuantizeConfig`) smooths inputs that are quantized per token: a number for
    `--smoothquant-alpha` beside such inputs."""
    a = c.smoothquant_alpha
    return _per_token(c) and a is not None and a not in ALPHA_CHOICES


def _check_smoothing(c) -> None:
    a = c.smoothquant_alpha
    if a is None:
        return
    if not (c.static or _per_token(c)):
        raise QuantSpecError(f"--smoothquant-alpha moves activation outliers into the weights, and {c.quant_type} "
                             "keeps float activations; drop it")
    if a not in ALPHA_CHOICES and (isinstance(a, (str, bool)) or not 0 < a < 1):
        raise QuantSpecError(f"--smoothquant-alpha {a} must be in (0, 1), 'auto' or 'none'")
    if c.static:
        return
    if a == "auto":
        raise QuantSpecError("--smoothquant-alpha auto searches α against static activation scales; give inputs "
                             "quantized per token a number, e.g. 0.5 (or drop it)")
    if smooths_per_token(c) and c.layer_quant_types:
        raise QuantSpecError("--smoothquant-alpha folds into the norms that every --layer-quant-type layer reads "
                             "too; drop one of them")
    if smooths_per_token(c):
        refuse_missing_table(c, f"--smoothquant-alpha {a} takes each input channel's range from a calibration table")


def _check_fallback(c) -> None:
    dynamic = c.activations == "dynamic"
    if (c.by_rank or c.fallback_budget is not None) and not c.static:
        raise QuantSpecError("the --a8w8-fallback-* flags are for a8w8 / a8w8_fp8 with static activation "
                             "scales (" + ("dynamic per-token scales need no fallback" if dynamic else
                                          "weight-only types have no activation quantization to fall back from")
                             + "); drop them")
    if c.by_rank and c.fallback_budget is not None:
        raise QuantSpecError("choose the fallback one way: --a8w8-fallback-budget, or "
                             "--a8w8-fallback-layers / --a8w8-fallback-threshold")
    if c.fallback_budget is not None and not c.fallback_budget > 0:
        raise QuantSpecError(f"--a8w8-fallback-budget {c.fallback_budget} must be a positive percentage, "
                             "e.g. 1.5")
    n = c.fallback_layers
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 0):
        raise QuantSpecError(f"--a8w8-fallback-layers {n} must be 0 (no fallback) or more")


def check_activation_recipe(c) -> None:
    """Refuse, in one line naming the flag, what `c` (a `QuantizeConfig`) asks of the activation
    recipe and cannot have: SmoothQuant beside float inputs, `auto` or no table beside inputs
    quantized per token; the a8w8 fallback beside other than static scales; AWQ's factors beside
    input scales fitted without them; `--calib` that nothing reads; static scales or KV scales
    without one (`--calib`, or `--dataset` to measure one in the run: `calib.oneshot`)."""
    _check_smoothing(c)
    _check_fallback(c)
    per_token = _per_token(c) and c.weight_block is None
    if c.method.startswith("awq") and "inputs" in awq_unfit(QuantType.parse(c.quant_type), per_token):
        raise QuantSpecError(f"--method {c.method} is for weight-only types and 8-bit inputs quantized at run time "
                             f"(per token, a8w4_mxfp4's per group; {c.quant_type} quantizes its inputs with static or "
                             "microscaled scales); use --method rtn or gptq")
    dynamic = c.activations == "dynamic"
    if c.calib is not None and not c.calibrated_inputs and c.kv_cache is None and not smooths_per_token(c):
        raise QuantSpecError(f"--calib gives static activation and KV-cache scales and SmoothQuant's channel ranges, "
                             f"and {c.quant_type}" + (" with --activations dynamic" if dynamic else "")
                             + " reads none of them without --kv-cache or --smoothquant-alpha; drop --calib")
    if c.calibrated_inputs:
        refuse_missing_table(c, f"{c.quant_type} needs calibrated activation ranges")
    if c.kv_cache is not None:
        refuse_missing_table(c, f"--kv-cache {c.kv_cache} stores static KV scales in the artifact")


def check_method(c, qt) -> None:
    """Refuse, naming the flag, a `--method` that the weights of `c`'s quant type `qt` or its data do not take."""
    from quantspec.calib.ptq import DATA_METHODS

    if c.method.startswith("awq") and "fp8" in awq_unfit(qt, c.activations == "dynamic"):
        raise QuantSpecError(f"--method {c.method}: AWQ scales integer or FP4 weights, and {qt.value}'s "
                             "are FP8; use --method rtn or gptq")
    from quantspec.calib.awq import AWQ_DUO

    if c.awq_duo_scaling not in AWQ_DUO or (c.awq_duo_scaling != "true" and not c.method.startswith("awq")):
        raise QuantSpecError(f"--awq-duo-scaling {c.awq_duo_scaling} picks the form of AWQ's candidate scales "
                             f"({' | '.join(AWQ_DUO)}), for --method awq or awq+gptq")
    if c.method == "autoround":
        _check_autoround(c, qt)
    elif (c.iters, c.lr, c.batch_size) != (None, None, None):
        raise QuantSpecError(f"--iters, --lr and --batch-size tune AutoRound and --method {c.method} runs none; "
                             "use --method autoround or drop them")
    if c.base is not None and c.method != "gptq" and not c.static:
        raise QuantSpecError(f"--base gives a draft module's GPTQ and static scales its base, and --method "
                             f"{c.method} of {c.quant_type} reads none; use --method gptq or drop --base")
    if c.method in DATA_METHODS:
        if c.dataset is None and not (c.static and c.calib is not None):
            raise QuantSpecError(f"--method {c.method} needs calibration data; pass --dataset (a local "
                                 ".txt/.json/.jsonl/.parquet file or a hub id)")
        positive_int("num_samples", c.num_samples)
        positive_int("seq_len", c.seq_len)


def _check_autoround(c, qt) -> None:
    """Refuse, naming the flag, what `--method autoround` does not tune (`calib.autoround`)."""
    from quantspec.quant.presets import integer_weights

    if not integer_weights(qt):
        raise QuantSpecError(f"--method autoround tunes integer weights, and {qt.value}'s are not; use --method rtn "
                             "or gptq")
    if c.zp_dtype is not None:
        raise QuantSpecError("--method autoround rounds integer zero points; drop --zp-dtype")
    if c.weight_observer == "mse":
        raise QuantSpecError("--weight-observer mse picks round-to-nearest's clipping, and AutoRound tunes its own "
                             "from min/max; drop --weight-observer")
    if c.quip_spec is not None:
        raise QuantSpecError("--method autoround tunes weights in the model's own basis, and --quip / --rotate R4 "
                             "quantize in a turned one; use --method rtn or gptq with them")
    c.autoround  # its settings checked: --iters, --lr, --batch-size


def per_token_smoothing(c, src, model, say: Callable[[str], None]) -> dict:
    """{Linear name: s [K]} of SmoothQuant at `c.smoothquant_alpha` for every smoothing group of
    `model` (the checkpoint read a layer at a time from `src.reader`; but down_proj's under R4), from
    `src.table`'s channel ranges; recorded in the provenance."""
    from quantspec.calib.smooth import smoothing_factors

    src.table.check_model(model)
    alpha = float(c.smoothquant_alpha)
    say(f"SmoothQuant α = {alpha} from the table's channel ranges")
    src.calib_summary.update(smoothquant_alpha=alpha)
    # under R4 the table's down_proj ranges are of turned inputs, and R4 takes that group's outliers
    return smoothing_factors(model, src.table, alpha, weights=src.reader, smooth_down=not c.r4)
