"""Post-training quantization of a loaded model: a `QuantConfig` + a method → artifact tensors.

This file owns `quantize_model`: it quantizes the Linears a config names (`calib.targets`:
compressed-tensors matching, `ignore` first — `lm_head` by default — then exact names > `re:`
regexes > class names; embeddings and norms are not Linears and stay as they are) at per-layer
group sizes (a requested group size that does not divide a layer's K — SmolLM2's 576 with 128 —
becomes the largest power of two ≤ it that does, arranged into config groups by
`QuantConfig.with_group_sizes`), with the methods (`quant.presets.METHODS`):

- `rtn`: round-to-nearest with min/max qparams per weight (no data).
- `gptq`: Frantar et al. (arXiv:2210.17323) through `quant.gptq.gptq_quantize`, layer by layer
  with `calib.runner`. Linears that read the same input (q/k/v; gate/up) share one Hessian and
  are quantized in one call, concatenated along N (GPTQ treats rows independently). Two
  schedules, chosen by whether all calibration samples fit in one forward (`max_pass_tokens`
  tokens, and the MLP's intermediates for all of them within `max_pass_bytes`):
  * one pass ("true sequential"): forward pre-hooks on the first Linear of each shared-input
    group see the whole batch's input, build the Hessian, quantize the group and swap in the
    dequantized weights before the forward continues, so o_proj is calibrated on the outputs of
    the quantized q/k/v, down_proj on those of the quantized gate/up, and the layer's output
    (the next layer's input) already comes from the quantized layer — one forward per layer;
  * two passes (memory-bounded, mini-batches): hooks accumulate all Hessians from the
    unquantized layer, the layer is quantized, then re-run (`propagate`) so the next layer sees
    the quantized outputs.
- `awq`: Lin et al. (arXiv:2306.00978) through `calib.awq`: per layer, activation-aware factors
  folded into the layer, then round-to-nearest; two passes like GPTQ's. `awq+gptq`: the factors,
  then GPTQ on the layer, with the Hessians of AWQ's statistics (a sparse layer's experts: from
  one more forward).
- `autoround`: Cheng et al. (arXiv:2309.05516) through `calib.autoround`: per layer, the rounding
  and clipping tuned by SignSGD toward the float layer's outputs on the float model's inputs (a
  second stream of hidden states, run beside the quantized model's); two passes like GPTQ's.

Weight types: int8 per-channel, int4 group (sym/asym) or per-channel, FP8 E4M3 per-channel; the
a8w8 types also need static per-tensor input scales (from `quantspec calibrate`), stored as
`input_scale`.

One layer at a time: the artifact's tensors leave in parts — the tensors outside the decoder
layers (`REST`: embeddings, final norm, head), then each decoder layer's (`layer_key(i)`) — into
a `PartSink`. A model built on the `meta` device is read from its checkpoint one layer at a time
(`weights=`, a `model_zoo.checkpoint.CheckpointReader`, in float32 on `device`), smoothed there
when the a8w8 recipe says so (`smooth=`), quantized, handed to the sink and released; the
tensors outside the layers are copied from the checkpoint's bytes where their dtype is the
artifact's. A materialised model runs the same code: on return its quantized Linears hold their
dequantized weights (a fake-quantized model, handy for checks), and the default sink keeps the
artifact's tensors in memory (`PTQResult.tensors`). A sink that already holds some parts (a
resumed run) has them skipped; GPTQ then starts at the first missing layer, from the inputs the
sink kept for it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Mapping

import torch
from torch import nn

from quantspec.calib.awq import check_awq
from quantspec.calib.layer_quant import QUANT_DTYPE, LayerQuantizer
from quantspec.calib.runner import DEFAULT_BATCH_SIZE, LayerRunner, layer_prefix
from quantspec.calib.smooth import smooth_layer
from quantspec.calib.targets import check_outside, quantized_linears, resolve_layer_group_sizes
from quantspec.errors import QuantSpecError
from quantspec.model_zoo.checkpoint import CheckpointReader
from quantspec.model_zoo.layout import checkpoint_config
from quantspec.model_zoo.llama import MLP, Transformer
from quantspec.model_zoo.moe import all_experts
from quantspec.quant.args import QuantArgs
from quantspec.quant.config import QuantConfig
from quantspec.quant.presets import DATA_METHODS, METHODS
from quantspec.quant.gptq import HessianAccumulator

__all__ = ["DATA_METHODS", "METHODS", "REST", "decoder_layers", "SHARED_INPUT_GROUPS", "PTQResult", "PartSink", "layer_key", "quantize_model",
           "quantized_linears", "resolve_layer_group_sizes"]

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
# ... and while the MLP's four [tokens, intermediate] float32 tensors of that forward fit in this
DEFAULT_MAX_PASS_BYTES = 2 * 2**30
_MLP_LIVE_TENSORS = 4
# the part of the artifact's tensors outside the decoder layers
REST = "rest"

Progress = Callable[[int, int, str], None]


def layer_key(i: int) -> str:
    """The part key of decoder layer i's tensors."""
    return f"layer-{i:05d}"


class PartSink:
    """Where `quantize_model` puts the artifact's tensors, one part at a time (module docstring).

    This one keeps them in memory (`tensors`) with GPTQ's losses per shared-input group; the
    quantize pipeline's writes each part to disk as it comes (`calib.stream`). `done` holds the
    keys of the parts written (by an earlier run too); `inputs_for(i)` gives the inputs
    [n, S, D] of decoder layer i that an earlier run left (None: there are none).
    """

    def __init__(self) -> None:
        self.tensors, self.losses, self.done = {}, {}, set()  # name → tensor, group → loss, part keys

    def write(self, key: str, tensors: dict[str, torch.Tensor], losses: dict[str, float],
              inputs: torch.Tensor | None = None) -> None:
        """Take part `key`; `inputs` [n, S, D] are the next decoder layer's (GPTQ), or None."""
        self.tensors.update(tensors)
        self.losses.update(losses)
        self.done.add(key)

    def inputs_for(self, layer: int) -> torch.Tensor | None:
        return None


@dataclass
class PTQResult:
    """The artifact's tensors (compressed-tensors names) and the config with per-layer groups."""

    tensors: dict[str, torch.Tensor]
    config: QuantConfig
    layer_args: dict[str, QuantArgs]  # quantized Linear name → its weight args
    summary: dict = field(default_factory=dict)  # method, timings, GPTQ losses, ...
    transforms: dict | None = None  # `transform_config` groups of the run-time transforms (`calib.quip`)


def _check_request(method: str, config: QuantConfig, calib_batches, hessians) -> None:
    if method not in METHODS:
        raise QuantSpecError(f"unknown method {method!r}; use one of: {', '.join(METHODS)}")
    if not isinstance(config, QuantConfig):
        raise QuantSpecError(f"config must be a QuantConfig, got {type(config).__name__}")
    if any(s.weights is None for s in config.config_groups.values()):
        raise QuantSpecError("quantize_model quantizes weights; a config group without weights "
                             "(activation-only) is unsupported")
    if hessians is not None and method != "gptq":
        raise QuantSpecError(f"a draft module's measured Hessians are GPTQ's; --method {method} does not read them")
    if method in DATA_METHODS and hessians is None:
        if calib_batches is None:
            raise QuantSpecError(f"--method {method} needs calibration data; pass --dataset (a local "
                                 ".txt/.json/.jsonl/.parquet file or a hub id)")
        if not isinstance(calib_batches, torch.Tensor) or calib_batches.ndim != 2:
            raise QuantSpecError("calib_batches must be a LongTensor [num_samples, seq_len]")
        if method != "gptq" and any(s.weights.strategy == "block" for s in config.config_groups.values()):
            raise QuantSpecError(f"{method.upper()} has no rule for block scales; use --method rtn or gptq")


@torch.no_grad()
def quantize_model(model: Transformer, config: QuantConfig, method: str = "rtn",
                   calib_batches: torch.Tensor | None = None, *, block_size: int = 128,
                   damp: float = 0.01, act_order: bool = False,
                   input_scales: Mapping[str, torch.Tensor | float] | None = None,
                   scale_dtype: torch.dtype | None = None, out_dtype: torch.dtype | None = None,
                   batch_size: int = DEFAULT_BATCH_SIZE,
                   max_pass_tokens: int = DEFAULT_MAX_PASS_TOKENS,
                   max_pass_bytes: int = DEFAULT_MAX_PASS_BYTES,
                   progress: Progress | None = None, weights: CheckpointReader | None = None,
                   device: str | torch.device | None = None,
                   smooth: Mapping[str, torch.Tensor] | None = None,
                   sink: PartSink | None = None, quip=None, autoround=None, hessians=None,
                   awq_duo: bool | str = True) -> PTQResult:
    """Quantize `model`'s Linears per `config` with `method`; see the module docstring.

    calib_batches: LongTensor [n, S] (the methods that read data: GPTQ, AWQ, AutoRound).
    input_scales: Linear name → static input scale (a8w8 / a8w8_fp8) or input global scale (nvfp4). scale_dtype: dtype of the stored weight scales (default: the weight's);
    out_dtype: dtype of the unquantized tensors written (default: the model's).
    weights / device: a model on `meta` is read from `weights` one layer at a time onto `device`;
    smooth: {Linear: s [K]} folded into each layer before it is quantized (`calib.smooth`);
    sink: where the parts go (default: kept in memory, `PTQResult.tensors`);
    quip: a `calib.quip.Quip`: the decoder layers' Linears quantized in QuIP's turned basis;
    autoround: the `calib.autoround.AutoRound` settings of method "autoround" (None: its defaults);
    hessians: {Linear: H [K, K]} of a draft module (`calib.draft_calib`), for GPTQ without `calib_batches`;
    awq_duo: AWQ's candidates (`calib.awq.candidate_scales`); progress(layer, num_layers, phase) per layer.
    """
    _check_request(method, config, calib_batches, hessians)
    t0 = time.perf_counter()
    config = resolve_layer_group_sizes(model, config)
    q = LayerQuantizer(model, config, block_size=block_size, damp=damp, act_order=act_order,
                       input_scales=input_scales, scale_dtype=scale_dtype, weights=weights, device=device,
                       smooth=smooth, out_dtype=out_dtype or next(model.parameters()).dtype, quip=quip,
                       hessians=hessians)
    outside = [n for n in q.linears if not n.startswith("model.layers.")]
    check_outside(method, outside, measured=hessians is not None)
    if "awq" in (parts := method.split("+")):  # awq+gptq: AWQ's factors, then GPTQ
        check_awq(config, q.layer_args)
    q.tuner, q.awq_duo = (_autoround_tuner(q, autoround) if method == "autoround" else None), awq_duo
    sink = sink if sink is not None else PartSink()
    # GPTQ's head: its Hessian is of the last layer's normed outputs, so its part follows the layers
    head_gptq = "gptq" in parts and "lm_head" in outside and hessians is None
    if not head_gptq:
        _write_rest(model, q, sink, outside)
    if method == "rtn" or hessians is not None:  # (measured Hessians: `quantize_group` takes them)
        _rtn_layers(model, q, sink, progress)
    else:
        one_pass = method == "gptq" and _one_pass(model, calib_batches, max_pass_tokens, max_pass_bytes)
        last = _data_layers(model, calib_batches, q, sink, method=method, batch_size=batch_size,
                            progress=progress, one_pass=one_pass, keep_last=head_gptq)
        if head_gptq:
            _write_rest(model, q, sink, outside, gptq_head=True,
                        head_inputs=last if last is not None else sink.inputs_for(len(model.model.layers)))
    summary = {"method": method, "num_quantized_linears": len(q.linears), "seconds": round(time.perf_counter() - t0, 3)}
    if method in DATA_METHODS:  # (the Linears it rounded to nearest: those outside the layers, GPTQ's head aside)
        rtn = [n for n in outside if not (head_gptq and n == "lm_head")] if hessians is None else []
        summary.update(_data_summary(parts, q, sink, calib_batches, rtn))
    # the artifact's config in the checkpoint's module names (a fused checkpoint's units whole)
    config = checkpoint_config(getattr(model, "args", None), config)
    return PTQResult(tensors=sink.tensors, config=config, layer_args=q.layer_args, summary=summary,
                     transforms=None if q.quip is None else q.quip.transform_config())


def _autoround_tuner(q: LayerQuantizer, settings):
    """The AutoRound settings for `q`'s Linears (refused: those it does not tune, QuIP's basis)."""
    from quantspec.calib.autoround import AutoRound, check_autoround

    check_autoround({n: a for n, a in q.layer_args.items() if n.startswith("model.layers.")})
    if q.quip is not None:
        raise QuantSpecError("AutoRound tunes weights in the model's own basis and --quip / --rotate R4 quantize "
                             "in a turned one; use --method rtn or gptq with them")
    return settings or AutoRound()


def _data_summary(parts: list[str], q: LayerQuantizer, sink: PartSink, calib_batches: torch.Tensor | None,
                  rtn_linears: list[str]) -> dict:
    """What a GPTQ / AWQ / AutoRound run adds to the summary: GPTQ's settings or AutoRound's,
    its tokens, the Linears it rounded to nearest, each method's loss total (AWQ's objectives are
    keyed "awq:<group>", `calib.awq.awq_layer`; AutoRound's losses are its layers')."""
    out: dict = dict(block_size=q.block_size, damp=q.damp, act_order=q.act_order) if "gptq" in parts else {}
    if q.tuner is not None:
        out.update(iters=q.tuner.iters, lr=q.tuner.step_size, batch_size=q.tuner.batch_size)
    if calib_batches is not None:  # (a draft module's tokens are its caller's to report)
        out["calibration_tokens"] = int(calib_batches.numel())
    if rtn_linears:
        out["rtn_linears"] = rtn_linears
    for part in parts:
        out[f"{part}_loss_total"] = float(sum(v for k, v in sink.losses.items()
                                              if k.startswith("awq:") == (part == "awq")))
    return out


def _write_rest(model, q: "LayerQuantizer", sink: PartSink, outside: list[str], *, gptq_head: bool = False,
                head_inputs: torch.Tensor | None = None) -> None:
    """The part outside the decoder layers, once (`LayerQuantizer.rest_part`); `gptq_head`: the
    head by GPTQ on `head_inputs`, the last decoder layer's outputs."""
    if REST in sink.done:
        return
    if gptq_head and head_inputs is None:
        raise QuantSpecError("the interrupted run kept no outputs of the last decoder layer for GPTQ's head; "
                             "start over with --restart")
    tensors = q.rest_part(model, outside, head_inputs)
    losses, q.losses = q.losses, {}
    sink.write(REST, tensors, losses)


def _one_pass(model, calib_batches: torch.Tensor, max_pass_tokens: int, max_pass_bytes: int) -> bool:
    """GPTQ's one-pass schedule: all samples in one forward (module docstring)."""
    tokens = calib_batches.numel()
    inter = model.args.intermediate_size
    return tokens <= max_pass_tokens and tokens * inter * 4 * _MLP_LIVE_TENSORS <= max_pass_bytes


def _layer_groups(prefix: str, layer: nn.Module, linears: Mapping[str, nn.Linear]) -> list[list[str]]:
    """The quantized Linears of one layer, grouped by shared input (SHARED_INPUT_GROUPS first,
    any other Linear alone), in forward order."""
    groups, taken = [], set()
    for names in SHARED_INPUT_GROUPS:
        members = [f"{prefix}.{n}" for n in names if f"{prefix}.{n}" in linears]
        if members:
            groups.append(members)
            taken.update(members)
    name_of = {id(mod): f"{prefix}.{name}" for name, mod in layer.named_modules()}
    for name, mod in layer.named_modules():
        full = f"{prefix}.{name}"
        if isinstance(mod, MLP):  # an expert's (or shared expert's) gate / up read one input
            pair = [name_of.get(id(mod.gate_proj)), name_of.get(id(mod.up_proj))]
            if all(n in linears and n not in taken for n in pair):
                groups.append(pair)
                taken.update(pair)
        elif isinstance(mod, nn.Linear) and full in linears and full not in taken:
            groups.append([full])
            taken.add(full)
    return groups


def decoder_layers(model: nn.Module) -> list:
    """The model's decoder layers (none for a draft module without them, e.g. Medusa heads:
    every Linear is then in the rest part)."""
    return getattr(getattr(model, "model", None), "layers", [])


def _rtn_layers(model, q: LayerQuantizer, sink: PartSink, progress) -> None:
    layers = decoder_layers(model)
    for i, layer in enumerate(layers):
        if layer_key(i) in sink.done:
            continue
        if progress is not None:
            progress(i, len(layers), "start")
        prefix = layer_prefix(i)
        with q.resident(layer, prefix):
            if q.smooth:
                smooth_layer(layer, prefix, q.smooth)
            for group in _layer_groups(prefix, layer, q.linears):
                q.quantize_group(group, None)
            sink.write(layer_key(i), q.part(prefix, layer), {})
        if progress is not None:
            progress(i, len(layers), "done")
    if q.hessians:  # a measured Hessian is spent by its group's quantization: none is left unused
        raise QuantSpecError(f"measured Hessians of Linears the config does not quantize: {', '.join(sorted(q.hessians))}")


def _gptq_layer(step, q: LayerQuantizer, one_pass: bool) -> None:
    """Quantize the decoder layer of `step` with GPTQ (its forward builds the Hessians)."""
    accs, cleanup = _gptq_hooks(step, q, one_pass)
    try:
        with all_experts(step.layer):  # every expert's Hessian from every token (model_zoo.moe)
            step.forward()
    finally:
        cleanup()
    for group, acc in accs.items():
        if not one_pass or acc.H is not None:  # two passes, or a Linear the forward never reached
            q.quantize_group(list(group), acc.take() if acc.num_samples else None)


def _gptq_hooks(step, q: LayerQuantizer, one_pass: bool):
    """Forward pre-hooks that build each shared-input group's Hessian (and, in one pass,
    quantize the group before the forward goes on) → (accumulators, cleanup)."""
    accs, handles = {}, []
    for group in _layer_groups(step.name, step.layer, q.linears):
        head = q.linears[group[0]]
        acc = HessianAccumulator(head.in_features, device=head.weight.device)
        accs[tuple(group)] = acc

        def hook(mod, inputs, group=group, acc=acc):
            acc.update(inputs[0])
            if one_pass:  # the whole batch is here: quantize before the forward goes on
                q.quantize_group(group, acc.take())  # the [K, K] is freed once quantized
        handles.append(head.register_forward_pre_hook(hook))

    def cleanup():
        for h in handles:
            h.remove()
    return accs, cleanup


def _data_layers(model, calib_batches: torch.Tensor, q: LayerQuantizer, sink: PartSink, *,
                 method: str, batch_size: int, progress, one_pass: bool, keep_last: bool = False
                 ) -> torch.Tensor | None:
    """GPTQ, AWQ or AutoRound, layer by layer on the calibration batch (two passes: each layer
    re-run once quantized, so the next calibrates on its outputs) → the last layer's outputs
    [n, S, D] (None when an earlier run quantized every layer); `keep_last`: the sink keeps them too."""
    L = len(model.model.layers)
    start = next((i for i in range(L) if layer_key(i) not in sink.done), L)
    if start == L:
        return None
    n = calib_batches.shape[0]
    streamed = q.weights is not None
    inputs = sink.inputs_for(start) if start else None
    # AutoRound's targets come from the float model's inputs: a second stream, kept beside the first
    floats = _FloatStream(inputs) if method == "autoround" else None
    runner = LayerRunner(model, calib_batches, batch_size=n if one_pass else batch_size, weights=q.weights,
                         device=q.device if streamed else None, dtype=QUANT_DTYPE if streamed else None,
                         progress=progress, start=start, inputs=inputs if floats is None else floats.quantized)
    for step in runner:
        if q.smooth:
            smooth_layer(step.layer, step.name, q.smooth)
        if floats is not None:  # AutoRound, toward the float layer's outputs on the float stream
            q.autoround_layer(step, floats.advance(step))
        else:
            _gptq_or_awq_layer(step, q, method, one_pass)
        if not one_pass:  # then re-run so the next layer sees the quantized layer's outputs
            step.propagate()
        losses, q.losses = q.losses, {}
        kept = step.outputs if floats is None else floats.kept(step.outputs)
        sink.write(layer_key(step.index), q.part(step.name, step.layer), losses,
                   inputs=kept if step.index + 1 < L or keep_last else None)
    return runner.hidden  # (the steps' outputs are freed as the runner moves on)


def _gptq_or_awq_layer(step, q: LayerQuantizer, method: str, one_pass: bool) -> None:
    """Quantize the decoder layer of `step` by GPTQ, AWQ (then round to nearest) or AWQ + GPTQ."""
    hessians = {} if method == "awq+gptq" else None  # AWQ's statistics are GPTQ's Hessians
    if method.startswith("awq"):
        from quantspec.calib.awq import awq_layer

        q.losses.update(awq_layer(step, q.linears, q.layer_args, hessians, duo=q.awq_duo))
    groups = _layer_groups(step.name, step.layer, q.linears)
    if hessians and all(g[0] in hessians for g in groups):  # of the inputs as AWQ's factors left them
        for g in groups:
            q.quantize_group(g, hessians.pop(g[0]))
    elif method.endswith("gptq"):  # (a mixture of experts' experts: from the forward)
        _gptq_layer(step, q, one_pass)
    else:
        for g in groups:
            q.quantize_group(g, None)


class _FloatStream:
    """The float model's hidden states beside the quantized one's (AutoRound): `advance(step)` runs
    the still-float layer of `step` on them → its outputs [n, S, D], the layer's targets and the next
    layer's float inputs. A resumed run's kept inputs are the two streams stacked [2, n, S, D]."""

    def __init__(self, kept: torch.Tensor | None):
        self.quantized, self.hidden = (None, None) if kept is None else kept.unbind(0)

    def advance(self, step) -> torch.Tensor:
        self.hidden = step.run(step.inputs if self.hidden is None else self.hidden.to(step.inputs))
        return self.hidden

    def kept(self, outputs: torch.Tensor) -> torch.Tensor:
        """What a resumed run needs of this step: its quantized outputs and the float ones."""
        return torch.stack((outputs, self.hidden))
