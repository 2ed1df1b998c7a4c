"""`LayerQuantizer`: what quantizing one decoder layer needs (`calib.ptq.quantize_model`) — the
Linears a config quantizes with their args and static input scales, where layers are read from,
and the codes of the part under way — and how a group of Linears sharing one input is quantized
(round-to-nearest or GPTQ, in QuIP's turned basis under `--quip`; a whole layer by AutoRound) and written in
compressed-tensors names."""

from __future__ import annotations

import torch
from torch import nn

from quantspec.calib.quip import QuipPlan
from quantspec.calib.targets import EMBED, check_input_scales, quantized_linears
from quantspec.errors import QuantSpecError
from quantspec.model_zoo.checkpoint import resident
from quantspec.model_zoo.layout import fuse_tensors
from quantspec.quant.args import QuantArgs
from quantspec.quant.artifact import linear_to_tensors
from quantspec.quant.config import QuantConfig
from quantspec.quant.fp4 import global_scale_from_absmax
from quantspec.quant.gptq import HessianAccumulator, gptq_quantize, rtn_by_rows, rtn_quantize
from quantspec.quant.shards import SAFETENSORS_DTYPES

__all__ = ["LayerQuantizer", "QUANT_DTYPE"]

# the dtype layers read from a checkpoint are quantized in
QUANT_DTYPE = torch.float32


class LayerQuantizer:
    """What quantizing one layer needs: the Linears the config quantizes with their args and
    static input scales, where layers are read from, and the codes of the part under way."""

    def __init__(self, model, config: QuantConfig, *, block_size, damp, act_order, input_scales,
                 scale_dtype, weights, device, smooth, out_dtype, quip=None, hessians=None):
        self.linears = quantized_linears(model, config)
        if not self.linears:
            raise QuantSpecError("the config quantizes no Linear of this model; check --ignore and "
                                 "the config's targets")
        self.layer_args = {n: config.weight_args_for(n) for n in self.linears}
        self.formats = {n: config.scheme_for(n).format for n in self.linears}  # dynamic inputs: no input_scale
        self.in_scales = check_input_scales(self.layer_args, config, input_scales)
        self.block_size, self.damp, self.act_order = block_size, damp, act_order
        self.scale_dtype, self.out_dtype, self.smooth = scale_dtype, out_dtype, smooth or {}
        self.weights, self.device = weights, torch.device(device or "cpu")
        self.args = getattr(model, "args", None)
        self.tied = bool(getattr(self.args, "tie_word_embeddings", False))
        self.results: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}  # name → (q, s, zp)
        self.global_scales: dict[str, torch.Tensor] = {}  # NVFP4: name → the global scale of its input's group
        self.losses: dict[str, float] = {}
        # the Linears quantized in QuIP's turned basis (`quip`: a `calib.quip.Quip`)
        self.quip = None if quip is None else QuipPlan(quip, model, self.linears)
        self.tuner = None  # method "autoround": its `calib.autoround.AutoRound` settings
        # a draft module's GPTQ Hessians by Linear, measured before it is quantized (`calib.draft_calib`)
        self.hessians: dict[str, torch.Tensor] = dict(hessians or {})

    def autoround_layer(self, step, targets: torch.Tensor) -> None:
        """Quantize the decoder layer of the runner step `step` with AutoRound toward `targets`
        [n, S, D], the float layer's outputs on the float model's inputs (`calib.autoround`)."""
        mine = {n: m for n, m in self.linears.items() if n.startswith(step.name + ".")}
        if not mine:  # a layer the config leaves float
            return
        results, loss = self.tuner.tune_layer(step, mine, self.layer_args, self.scale_dtype, targets)
        self.results.update(results)
        self.losses[step.name] = loss

    def resident(self, module: nn.Module, prefix: str):
        """`module` materialised for the block (read from the checkpoint when on `meta`)."""
        return resident(module, prefix, self.weights, dtype=QUANT_DTYPE, device=self.device)

    def quantize_group(self, names: list[str], hessian: torch.Tensor | None) -> None:
        """Quantize Linears sharing one input (and Hessian, which GPTQ's last use consumes: the
        caller hands it over; None: the one measured beforehand in `hessians`, if any); swap in
        dequantized weights. Under `quip`, in its turned basis (`calib.quip.QuipPlan.quantize_group`)."""
        if hessian is None and names[0] in self.hessians:
            hessian = self.hessians.pop(names[0])
            for n in names[1:]:  # one input: one Hessian for the group
                self.hessians.pop(n, None)
        if self.quip is not None:
            return self.quip.quantize_group(self.linears, names, hessian, self._quantize_group)
        return self._quantize_group(names, hessian)

    def _quantize_group(self, names: list[str], hessian: torch.Tensor | None) -> None:
        buckets: dict[QuantArgs, list[str]] = {}
        for n in names:
            a = self.layer_args[n]
            # per-tensor args too: the Linears of one input take one scale, the largest, as the
            # engines' fused layers run them (they requantize a fused layer's shards to it)
            buckets.setdefault(a, []).append(n)
        for b, members in enumerate(buckets.values()):
            args, mods = self.layer_args[members[0]], [self.linears[n] for n in members]
            g = None
            if args.is_nvfp4:  # one global scale for the Linears of one input, as the engines' fused layers take it
                g = global_scale_from_absmax(torch.stack([m.weight.abs().amax() for m in mods]))
                self.global_scales.update(dict.fromkeys(members, g))
            if hessian is None and args.strategy in ("channel", "group", "tensor_group", "block"):
                for n, m in zip(members, mods):  # rows (of blocks) are independent: no concatenation
                    self.results[n] = rtn_by_rows(m.weight.data, args, self.scale_dtype or m.weight.dtype, g)
                continue
            W = torch.cat([m.weight for m in mods])  # [ΣN, K]
            sd = self.scale_dtype or W.dtype
            if hessian is None:
                r = rtn_quantize(W, args, scale_dtype=sd)
            else:
                r = gptq_quantize(W, hessian, args, block_size=self.block_size, damp=self.damp,
                                  act_order=self.act_order, scale_dtype=sd,
                                  consume_hessian=b == len(buckets) - 1, global_scale=g)
                self.losses[members[0] if len(members) == 1 else "+".join(members)] = r.loss
            row = 0
            per_row = args.strategy in ("channel", "group", "tensor_group")
            bn = args.block_structure[0] if args.strategy == "block" else None  # rows of a block of scales
            if bn and any(m.out_features % bn for m in mods[:-1]):  # blocks tile each Linear (`calib.targets`)
                raise QuantSpecError(f"FP8 blocks of {bn} rows do not split {', '.join(members)} at their seams")
            for n, m in zip(members, mods):
                sl = slice(row, row + m.out_features)
                qp = slice(row // bn, -(-(row + m.out_features) // bn)) if bn else sl if per_row else slice(None)
                self.results[n] = (r.q[sl], r.scale[qp], r.zero_point[qp])
                m.weight.copy_(r.weight_dq[sl].to(m.weight.dtype))
                row += m.out_features

    def part(self, prefix: str, module: nn.Module) -> dict[str, torch.Tensor]:
        """The artifact's tensors of `module` (named `prefix`): its quantized Linears in
        compressed-tensors names + every other tensor (norms, biases) cast to `out_dtype`, in the
        checkpoint's layout (a fused checkpoint's parts stacked: `layout.fuse_tensors`)."""
        tensors: dict[str, torch.Tensor] = {}
        mine = [n for n in self.results if n.startswith(prefix + ".") or n == prefix]
        quantized = {f"{n}.weight" for n in mine}
        for name, t in module.state_dict(prefix=f"{prefix}." if prefix else "").items():
            if name not in quantized:
                tensors[name] = t.to(self.out_dtype) if t.is_floating_point() else t
        for name in mine:
            qt, s, zp = self.results.pop(name)
            args, ins = self.layer_args[name], {"input_scale": self.in_scales.get(name)}
            ins = {"input_global_scale": ins["input_scale"]} if args.is_fp4 else ins
            tensors.update(linear_to_tensors(name, qt.contiguous(), s.contiguous(),
                                             None if args.symmetric else zp.contiguous(), args, **ins,
                                             format=self.formats[name], global_scale=self.global_scales.pop(name, None)))
            if self.quip is not None and name in self.quip.names:
                tensors.update(self.quip.tensors(name, self.out_dtype))
        return fuse_tensors(self.args, tensors)

    def rest_part(self, model: nn.Module, outside: list[str], head_inputs: torch.Tensor | None = None) -> dict:
        """The tensors outside the decoder layers (a tied head is the embedding, not written
        twice); a module there that the config quantizes (an un-ignored lm_head, a named
        embedding) with round-to-nearest, or the head with GPTQ on the last decoder layer's
        outputs `head_inputs` [n, S, D]. A tied model with either quantized is untied (and the
        artifact's config unties them): a quantized head beside the float embedding, a quantized
        embedding beside a float copy of itself as the head, or both quantized. From a model on
        `meta`, a tensor whose checkpoint dtype is `out_dtype` is copied from the checkpoint's
        bytes, never loaded."""
        tensors: dict = {}
        for name in outside:
            mod, rename = model.get_submodule(name), None
            if name == "lm_head" and self.tied:  # the artifact unties a quantized head: the embedding stays float
                w = mod.weight.detach()
                mod.weight = nn.Parameter(w.clone() if w.device.type != "meta" else torch.empty_like(w),
                                          requires_grad=False)
                rename = {"weight": "model.embed_tokens.weight"}
            hessian = None if name != "lm_head" or head_inputs is None else self.head_hessian(model, head_inputs)
            with resident(mod, name, self.weights, dtype=QUANT_DTYPE, device=self.device, rename=rename) as mod:
                self.quantize_group([name], hessian)
                tensors.update(self.part(name, mod))
        state = model.state_dict()
        for key, t in state.items():
            if key.startswith("model.layers.") or key in tensors or key.rsplit(".", 1)[0] in outside:
                continue
            src = key
            if key == "lm_head.weight" and self.tied:
                if EMBED not in outside:
                    continue
                src = f"{EMBED}.weight"  # the untied head: the float embedding's copy
            if t.device.type != "meta":
                tensors[key] = t.to(self.out_dtype) if t.is_floating_point() else t
            elif src in self.weights.ranges and self.weights.ranges[src].dtype == SAFETENSORS_DTYPES.get(self.out_dtype):
                tensors[key] = self.weights.ranges[src]
            else:
                tensors[key] = self.weights.read([src], dtype=QUANT_DTYPE)[src].to(self.out_dtype)
        return tensors

    def head_hessian(self, model: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        """GPTQ's Hessian of the output head: of the final norm of `hidden` [n, S, D], the last
        decoder layer's outputs."""
        norm = model.model.norm
        acc = HessianAccumulator(hidden.shape[-1], device=self.device)
        with self.resident(norm, "model.norm"):
            w = norm.weight
            for chunk in hidden.split(8):  # samples at a time: the normed copy stays small
                acc.update(norm(chunk.to(device=w.device, dtype=w.dtype)).float())
        return acc.take()
