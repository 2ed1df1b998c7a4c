"""Post-training quantization of a loaded model: a `QuantConfig` + a method → artifact tensors.

This file owns `quantize_model`: which Linears a config quantizes (compressed-tensors matching:
`ignore` first — `lm_head` by default — then exact names > `re:` regexes > class names; embeddings
and norms are not Linears and stay as they are), the per-layer group sizes (`resolve_group_size`:
a requested group size that does not divide a layer's K — SmolLM2's 576 with 128 — becomes the
largest power of two ≤ it that does, arranged into config groups by `QuantConfig.with_group_sizes`),
and the two methods:

- `rtn`: round-to-nearest with min/max qparams per weight (no data).
- `gptq`: Frantar et al. (arXiv:2210.17323) through `quant.gptq.gptq_quantize`, layer by layer
  with `calib.runner`. Linears that read the same input (q/k/v; gate/up) share one Hessian and
  are quantized in one call, concatenated along N (GPTQ treats rows independently). Two
  schedules, chosen by whether all calibration samples fit in one forward (`max_pass_tokens`):
  * one pass ("true sequential"): forward pre-hooks on the first Linear of each shared-input
    group see the whole batch's input, build the Hessian, quantize the group and swap in the
    dequantized weights before the forward continues, so o_proj is calibrated on the outputs of
    the quantized q/k/v, down_proj on those of the quantized gate/up, and the layer's output
    (the next layer's input) already comes from the quantized layer — one forward per layer;
  * two passes (memory-bounded, mini-batches): hooks accumulate all Hessians from the
    unquantized layer, the layer is quantized, then re-run (`propagate`) so the next layer sees
    the quantized outputs.

Weight types: int8 per-channel, int4 group (sym/asym) or per-channel, FP8 E4M3 per-channel; the
a8w8 types also need static per-tensor input scales (from `quantspec calibrate`), stored as
`input_scale`. On return the model's quantized Linears hold their dequantized weights (a
fake-quantized model, handy for checks); the returned tensors are the artifact's.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Mapping

import torch
from torch import nn

from quantspec.calib.runner import DEFAULT_BATCH_SIZE, LayerStep, run_layers
from quantspec.errors import QuantSpecError
from quantspec.model_zoo.llama import Transformer
from quantspec.quant.args import QuantArgs
from quantspec.quant.config import QuantConfig, resolve_group_size
from quantspec.quant.artifact import linear_to_tensors
from quantspec.quant.gptq import HessianAccumulator, gptq_quantize, rtn_quantize

__all__ = ["METHODS", "SHARED_INPUT_GROUPS", "PTQResult", "quantize_model", "quantized_linears",
           "resolve_layer_group_sizes"]

METHODS = ("rtn", "gptq")
# Linears of one decoder layer that read the same input tensor (names relative to the layer).
SHARED_INPUT_GROUPS = (
    ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    ("self_attn.o_proj",),
    ("mlp.gate_proj", "mlp.up_proj"),
    ("mlp.down_proj",),
)
# GPTQ runs all samples in one forward (one-pass schedule) up to this many tokens: 64 × 512
# SmolLM2 tokens peak at ≈ 1.5 GB of activations (the MLP's [T, 1536] intermediates).
DEFAULT_MAX_PASS_TOKENS = 65536

Progress = Callable[[int, int, str], None]


@dataclass
class PTQResult:
    """The artifact's tensors (compressed-tensors names) and the config with per-layer groups."""

    tensors: dict[str, torch.Tensor]
    config: QuantConfig
    layer_args: dict[str, QuantArgs]  # quantized Linear name → its weight args
    summary: dict = field(default_factory=dict)  # method, timings, GPTQ losses, ...


def quantized_linears(model: nn.Module, config: QuantConfig) -> dict[str, nn.Linear]:
    """Linear name → module for every Linear the config quantizes (ignore list honoured)."""
    out = {}
    for name, mod in model.named_modules():
        if isinstance(mod, nn.Linear):
            classes = tuple(c.__name__ for c in type(mod).__mro__)
            scheme = config.scheme_for(name, classes)
            if scheme is not None and scheme.weights is not None:
                out[name] = mod
    return out


def resolve_layer_group_sizes(model: nn.Module, config: QuantConfig) -> QuantConfig:
    """`config` with every grouped Linear at a group size that divides its K
    (`QuantConfig.with_group_sizes` arranges the groups so every loader resolves them)."""
    sizes = {}
    for name, mod in quantized_linears(model, config).items():
        args = config.weight_args_for(name)
        if args.strategy == "group":
            sizes[name] = resolve_group_size(mod.in_features, args.group_size)
    if all(g == config.weight_args_for(n).group_size for n, g in sizes.items()):
        return config
    return config.with_group_sizes(sizes)


def _check_input_scales(layer_args_in: Mapping[str, QuantArgs], config: QuantConfig,
                        input_scales: Mapping[str, torch.Tensor | float] | None) -> dict[str, torch.Tensor]:
    out = {}
    for name in layer_args_in:
        scheme = config.scheme_for(name)
        ia = scheme.input_activations
        if ia is None or ia.dynamic:
            continue
        if input_scales is None or name not in input_scales:
            qt = config.quant_type.value if config.quant_type else "this scheme"
            raise QuantSpecError(f"{qt} needs static activation scales and none were given for "
                                 f"{name}; run `quantspec calibrate` and pass --calib DIR")
        s = torch.as_tensor(input_scales[name], dtype=torch.float32).reshape(-1)
        if s.numel() != 1 or not torch.isfinite(s).all() or float(s) <= 0:
            raise QuantSpecError(f"input scale for {name} must be one positive finite number, got "
                                 f"{s.tolist()[:4]}; re-run `quantspec calibrate`")
        out[name] = s
    return out


@torch.no_grad()
def quantize_model(model: Transformer, config: QuantConfig, method: str = "rtn",
                   calib_batches: torch.Tensor | None = None, *, block_size: int = 128,
                   damp: float = 0.01, act_order: bool = False,
                   input_scales: Mapping[str, torch.Tensor | float] | None = None,
                   scale_dtype: torch.dtype | None = None, out_dtype: torch.dtype | None = None,
                   batch_size: int = DEFAULT_BATCH_SIZE,
                   max_pass_tokens: int = DEFAULT_MAX_PASS_TOKENS,
                   progress: Progress | None = None) -> PTQResult:
    """Quantize `model`'s Linears per `config` with `method`; see the module docstring.

    calib_batches: LongTensor [n, S] (GPTQ only). input_scales: Linear name → static input scale
    (a8w8 / a8w8_fp8). scale_dtype: dtype of the stored weight scales (default: the weight's);
    out_dtype: dtype of the unquantized tensors written (default: the model's).
    progress(layer, num_layers, phase) is called per layer (phase "start" / "done").
    """
    if method not in METHODS:
        raise QuantSpecError(f"unknown method {method!r}; use one of: {', '.join(METHODS)}")
    if not isinstance(config, QuantConfig):
        raise QuantSpecError(f"config must be a QuantConfig, got {type(config).__name__}")
    if any(s.weights is None for s in config.config_groups.values()):
        raise QuantSpecError("quantize_model quantizes weights; a config group without weights "
                             "(activation-only) is unsupported")
    if method == "gptq":
        if calib_batches is None:
            raise QuantSpecError("--method gptq needs calibration data; pass --dataset (a local "
                                 ".txt/.json/.jsonl/.parquet file or a hub id)")
        if any(s.weights.type == "float" for s in config.config_groups.values()):
            raise QuantSpecError("GPTQ rounds to an integer grid; use --method rtn for FP8 weights")
    t0 = time.perf_counter()
    config = resolve_layer_group_sizes(model, config)
    linears = quantized_linears(model, config)
    if not linears:
        raise QuantSpecError("the config quantizes no Linear of this model; check --ignore and "
                             "the config's targets")
    layer_args = {n: config.weight_args_for(n) for n in linears}
    in_scales = _check_input_scales(layer_args, config, input_scales)
    results: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}  # name → (q, s, zp)
    losses: dict[str, float] = {}

    def quantize_group(names: list[str], hessian: torch.Tensor | None) -> None:
        """Quantize Linears sharing one input (and Hessian); swap in dequantized weights."""
        buckets: dict[QuantArgs, list[str]] = {}
        for n in names:
            a = layer_args[n]
            key = a if a.strategy in ("channel", "group") else (a, n)  # per-tensor: alone
            buckets.setdefault(key, []).append(n)
        for key, members in buckets.items():
            args = layer_args[members[0]]
            W = torch.cat([linears[n].weight for n in members])  # [ΣN, K]
            sd = scale_dtype or W.dtype
            if hessian is None:
                r = rtn_quantize(W, args, scale_dtype=sd)
            else:
                r = gptq_quantize(W, hessian, args, block_size=block_size, damp=damp,
                                  act_order=act_order, scale_dtype=sd)
                losses[members[0] if len(members) == 1 else "+".join(members)] = r.loss
            row = 0
            for n in members:
                N = linears[n].out_features
                sl = slice(row, row + N)
                per_row = args.strategy in ("channel", "group")
                results[n] = (r.q[sl], r.scale[sl] if per_row else r.scale,
                              r.zero_point[sl] if per_row else r.zero_point)
                linears[n].weight.copy_(r.weight_dq[sl].to(linears[n].weight.dtype))
                row += N

    num_layers = len(model.model.layers)
    if method == "rtn":
        for i, layer in enumerate(model.model.layers):
            if progress is not None:
                progress(i, num_layers, "start")
            for group in _layer_groups(f"model.layers.{i}", layer, linears):
                quantize_group(group, None)
            if progress is not None:
                progress(i, num_layers, "done")
        # Linears outside the decoder layers that the config targets (e.g. an un-ignored lm_head)
        rest = [n for n in linears if n not in results]
        for n in rest:
            quantize_group([n], None)
    else:
        _run_gptq(model, calib_batches, linears, quantize_group, batch_size=batch_size,
                  max_pass_tokens=max_pass_tokens, progress=progress)
        rest = [n for n in linears if n not in results]
        if rest:
            raise QuantSpecError(f"GPTQ quantizes decoder-layer Linears only; add {rest[0]} to "
                                 "--ignore or use --method rtn")

    tensors = _artifact_tensors(model, linears, results, layer_args, in_scales,
                                out_dtype or model.model.norm.weight.dtype)
    summary = {"method": method, "num_quantized_linears": len(linears),
               "seconds": round(time.perf_counter() - t0, 3)}
    if method == "gptq":
        summary.update(block_size=block_size, damp=damp, act_order=act_order,
                       calibration_tokens=int(calib_batches.numel()),
                       gptq_loss_total=float(sum(losses.values())))
    return PTQResult(tensors=tensors, config=config, layer_args=layer_args, summary=summary)


def _layer_groups(prefix: str, layer: nn.Module, linears: Mapping[str, nn.Linear]) -> list[list[str]]:
    """The quantized Linears of one layer, grouped by shared input (SHARED_INPUT_GROUPS first,
    any other Linear alone), in forward order."""
    groups, taken = [], set()
    for names in SHARED_INPUT_GROUPS:
        members = [f"{prefix}.{n}" for n in names if f"{prefix}.{n}" in linears]
        if members:
            groups.append(members)
            taken.update(members)
    for name, mod in layer.named_modules():
        full = f"{prefix}.{name}"
        if isinstance(mod, nn.Linear) and full in linears and full not in taken:
            groups.append([full])
    return groups


def _run_gptq(model: Transformer, calib_batches: torch.Tensor, linears, quantize_group, *,
              batch_size: int, max_pass_tokens: int, progress) -> None:
    if not isinstance(calib_batches, torch.Tensor) or calib_batches.ndim != 2:
        raise QuantSpecError("calib_batches must be a LongTensor [num_samples, seq_len]")
    n, S = calib_batches.shape
    one_pass = n * S <= max_pass_tokens
    state: dict = {}

    def before(step: LayerStep):
        groups = _layer_groups(step.name, step.layer, linears)
        handles = []
        accs = {}
        for group in groups:
            head = linears[group[0]]
            acc = HessianAccumulator(head.in_features, device=head.weight.device)
            accs[tuple(group)] = acc

            def hook(mod, inputs, group=group, acc=acc):
                acc.update(inputs[0])
                if one_pass:  # the whole batch is here: quantize before the forward goes on
                    quantize_group(group, acc.compute())
                    acc.H = None  # free [K, K]
            handles.append(head.register_forward_pre_hook(hook))
        state["accs"] = accs

        def cleanup():
            for h in handles:
                h.remove()
        return cleanup

    def after(step: LayerStep):
        if not one_pass:
            for group, acc in state.pop("accs").items():
                quantize_group(list(group), acc.compute())

    run_layers(model, calib_batches, before=before, after=after, sequential=not one_pass,
               batch_size=n if one_pass else batch_size, progress=progress)


def _artifact_tensors(model: Transformer, linears, results, layer_args, in_scales,
                      out_dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Quantized Linears in compressed-tensors names + every other tensor (embeddings, norms,
    lm_head, biases) as it is, cast to `out_dtype`."""
    tensors: dict[str, torch.Tensor] = {}
    quantized_weights = {f"{n}.weight" for n in linears}
    for name, t in model.state_dict().items():
        if name in quantized_weights:
            continue
        if name == "lm_head.weight" and model.args.tie_word_embeddings:
            continue  # tied: the checkpoint holds only the embedding
        tensors[name] = t.to(out_dtype) if t.is_floating_point() else t
    for name in linears:
        q, s, zp = results[name]
        args = layer_args[name]
        tensors.update(linear_to_tensors(name, q.contiguous(), s.contiguous(),
                                         None if args.symmetric else zp.contiguous(), args,
                                         input_scale=in_scales.get(name)))
    return tensors
