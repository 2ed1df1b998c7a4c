"""QuIP's incoherence transforms (`quantize --quip v` / `v,u`), as llm-compressor's
`QuIPModifier(transform_type="hadamard", transform_block_size=B)` writes them.

Each quantized Linear of the decoder layers is quantized in a turned basis: `v` turns its input
side, `u` its output side, by a block-diagonal Hadamard matrix (Sylvester's, blocks of B, divided
by √B; symmetric and orthogonal, so its own inverse). The stored weight is `U·W·V`; at run time
the engine turns the Linear's input by `V` before the matmul and its output by `U` after it
(vLLM's `CompressedTensorsLinearTransformMethod`, quantspec's `infer.transformed`), so the layer
computes what it did and the residual stream, the KV cache and the hidden states a draft head
reads are the model's own. Outliers of a row or a column spread over their block before rounding,
which is what rounding to 4 bits gains from.

GPTQ sees the turned problem: the weight `U·W·V` and the Hessian of the turned inputs `V·H·V`
(the same numbers as calibrating with the transform in the forward); after a group is quantized
its dequantized weight is turned back, so the layers after it see what the engine computes.

The artifact's `transform_config` holds one scheme per rotation (`v`: `input` at run time +
`weight_input` fused, inverse; `u`: `weight_output` fused + `output` at run time, inverse) over the
turned Linears, and each turned Linear stores its matrices as `{linear}.v_input.weight` /
`{linear}.u_output.weight` (±1), where vLLM's loader puts them.

SpinQuant's R4 (`quantize --rotate R4`, alone or after R1 / R2) is the same input transform on
each MLP's `down_proj` alone (`Quip.r4`), as llm-compressor's `SpinQuantModifier(rotations=[...,
"R4"], transform_type="hadamard", transform_block_size=B)` writes it: a scheme named `R4`, its
matrices stored as `{down_proj}.R4_input.weight`. It turns the Linear whose inputs (the MLP's
gated activations) hold the widest outliers, at the cost of one run-time transform a layer.

Static input scales go with R4: `calibrate --rotate R4` (or `R1,R2,R4`) and the a8w8 recipe's
measurements see the model as the engine runs it (`turned_inputs`: each `down_proj` reads its
weight turned and turns its input first), so the table and the plan hold the ranges and errors of
the inputs the engine quantizes. Refused in one line: static input scales beside `--quip`, AWQ (its
search measures the unturned weights), `u` on a Linear with a bias (vLLM runs none under an
output transform), a mixture of experts (vLLM's fused experts run no transform), draft modules,
and targets whose engines run no run-time transform (SGLang, transformers).
"""

from __future__ import annotations

import json
import math
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterable, Iterator

import torch

from quantspec.errors import QuantSpecError
from quantspec.model_zoo.checkpoint import CheckpointReader
from quantspec.quant.decompressed import float_nbytes, source_quantization
from quantspec.quant.transforms import sylvester

__all__ = ["QUIP_ROTATIONS", "InputTurnedReader", "Quip", "QuipPlan", "check_quip_recipe", "fwht", "r4_block",
           "turned_inputs"]

QUIP_ROTATIONS = ("v", "u")
MAX_BLOCK = 128  # vLLM's Hadamard kernel and llm-compressor's examples use blocks of 128
MIN_BLOCK = 8


def fwht(x: torch.Tensor, block: int) -> torch.Tensor:
    """x's last dimension, in blocks of `block` (a power of two), times Sylvester's matrix of that
    size divided by √block (the fast Walsh–Hadamard transform), in x's dtype (bf16 / fp16 inputs are
    transformed in float32). Its own inverse."""
    dtype = x.dtype
    y = x.float() if dtype in (torch.bfloat16, torch.float16) else x
    shape = y.shape
    y = y.reshape(-1, shape[-1] // block, block)
    h = 1
    while h < block:
        y = y.view(y.shape[0], y.shape[1], block // (2 * h), 2, h)
        a, b = y[..., 0, :], y[..., 1, :]
        y = torch.stack((a + b, a - b), dim=-2)
        h *= 2
    return (y.reshape(shape) * (1.0 / math.sqrt(block))).to(dtype)


@dataclass(frozen=True)
class Quip:
    """Which transforms (`QUIP_ROTATIONS`, in that order) and their block size (None: chosen per
    model by `block_for`); `down_only`: SpinQuant's R4, `v` on each MLP's `down_proj` alone."""

    rotations: tuple[str, ...]
    block_size: int | None = None
    down_only: bool = False

    @classmethod
    def r4(cls) -> "Quip":
        """SpinQuant's R4 (`--rotate R4`), its block chosen per model."""
        return cls(("v",), None, down_only=True)

    @property
    def flag(self) -> str:
        """The flag that asks for these transforms, for messages."""
        return "--rotate R4" if self.down_only else "--quip"

    def scheme(self, rotation: str) -> str:
        """The `transform_config` scheme of `rotation` ("v" / "u"): "R4" for R4's."""
        return "R4" if self.down_only else rotation

    @classmethod
    def parse(cls, spec: str | None, block_size: int | None = None) -> "Quip | None":
        """`--quip` ("v", "v,u", "u"; "none" / None → None) and `--quip-block-size`, one line
        naming the flag otherwise."""
        if spec is None or str(spec).strip().lower() in ("", "none"):
            if block_size is not None:
                raise QuantSpecError("--quip-block-size sizes the transforms of --quip; add --quip v (or v,u)")
            return None
        names = [s.strip().lower() for s in str(spec).split(",") if s.strip()]
        if not names or any(n not in QUIP_ROTATIONS for n in names) or len(set(names)) != len(names):
            raise QuantSpecError(f"--quip {spec!r}: use v (each Linear's input side), v,u (and its output side) "
                                 "or none")
        if block_size is not None and (block_size < 2 or block_size & (block_size - 1)):
            raise QuantSpecError(f"--quip-block-size {block_size}: use a power of two (Sylvester's Hadamard "
                                 "matrices), e.g. 64 or 128")
        return cls(tuple(n for n in QUIP_ROTATIONS if n in names), block_size)

    def block_for(self, sizes: Iterable[int]) -> int:
        """The block size for Linears of these input / output sizes: `block_size`, or the largest
        power of two up to `MAX_BLOCK` dividing every size."""
        sizes = sorted(set(sizes))
        if self.block_size is not None:
            bad = [s for s in sizes if s % self.block_size]
            if bad:
                raise QuantSpecError(f"--quip-block-size {self.block_size} does not divide the Linears' size {bad[0]}; "
                                     f"use a power of two dividing {math.gcd(*sizes)}")
            return self.block_size
        g = math.gcd(*sizes)
        b = min(MAX_BLOCK, g & -g)
        if b < MIN_BLOCK:
            raise QuantSpecError(f"{self.flag}: no power-of-two block of at least {MIN_BLOCK} divides every turned "
                                 f"Linear's sizes (their common divisor is {g}); quantize without {self.flag}")
        return b


def check_quip_recipe(config, *, draft: str | None, moe: bool) -> None:
    """Refuse, in one line naming the flag, what `--quip` cannot go with (module docstring):
    `config` is a `calib.quantize.QuantizeConfig`, `draft` says what the source is when it is a
    draft module, `moe` whether its MLPs are mixtures of experts."""
    if config.quip_spec is None:
        return
    method, target, flag = config.method, config.target, config.quip_spec.flag
    if draft:
        raise QuantSpecError(f"{flag} turns a base model's Linears, and {draft}; quantize it without {flag}")
    if moe:
        raise QuantSpecError(f"{flag}: vLLM's fused experts run no run-time transform, so a mixture of experts "
                             f"cannot take one; quantize without {flag}")
    if target in ("portable", "sglang", "transformers"):
        skips = "transformers" if target == "transformers" else "SGLang"
        raise QuantSpecError(f"{flag} writes transforms that run at run time, which {skips} skips (its outputs "
                             "would be wrong); pass --target vllm (or quantspec)")
    if "awq" in method.split("+"):
        raise QuantSpecError(f"{flag}: AWQ's search measures the weights before the transform; use --method gptq "
                             f"or rtn with {flag}")
    if config.static and not config.quip_spec.down_only:
        raise QuantSpecError(f"{flag}: static input scales are measured on the inputs before the transform; pass "
                             f"--activations dynamic, or --rotate R4 (static scales measured after it)")
    if config.calibrated_inputs and not config.static:
        raise QuantSpecError(f"{flag}: NVFP4's input global scales are measured on the inputs before the "
                             f"transform; quantize without {flag}")


class QuipPlan:
    """The Linears `--quip` turns in one model and how: `names` (the quantized Linears of the
    decoder layers), `block` and the turning of their weights and Hessians (each its own inverse)."""

    def __init__(self, quip: Quip, model, linears: dict):
        from quantspec.calib.rotate import layer_targets
        from quantspec.model_zoo.layout import fused_units

        if fused_units(model.args) and not quip.down_only:  # R4's down_proj is never stored fused
            raise QuantSpecError(f"--quip: a {model.args.arch} checkpoint stores its projections fused, where each "
                                 "part's transform has no place of its own; quantize without --quip")
        self.quip = quip
        self.v, self.u = "v" in quip.rotations, "u" in quip.rotations
        downs = _downs(model) if quip.down_only else None
        self.names = [n for n in linears if n.startswith("model.layers.") and (downs is None or n in downs)]
        if not self.names:
            raise QuantSpecError(f"{quip.flag}: the config quantizes no Linear it turns; quantize without {quip.flag}")
        turned = set(self.names)
        self.targets = layer_targets(self.names)
        # the decoder layers' Linears those targets match that keep their weights (ignored ones)
        self.ignore = [n for n, m in model.named_modules() if n.startswith("model.layers.") and n not in turned
                       and isinstance(m, torch.nn.Linear) and layer_targets([n])[0] in self.targets]
        if self.u:
            biased = [n for n in self.names if getattr(linears[n], "bias", None) is not None]
            if biased:
                raise QuantSpecError(f"--quip u: {biased[0]} has a bias, which vLLM runs under no output transform; "
                                     "use --quip v")
        sizes = [s for n in self.names for s in
                 ((linears[n].in_features,) if self.v else ()) + ((linears[n].out_features,) if self.u else ())]
        self.block = quip.block_for(sizes)

    def quantize_group(self, linears: dict, names: list[str], hessian: torch.Tensor | None, quantize) -> None:
        """`quantize(names, hessian)` (`calib.layer_quant.LayerQuantizer`'s) of Linears sharing one
        input, in the turned basis where they are turned: their weights turned in place first (and
        the Hessian), the dequantized weights it leaves turned back."""
        turned = [n for n in names if n in self.names]
        if not turned:
            return quantize(names, hessian)
        if len(turned) != len(names):  # one input: the same transform for every Linear reading it
            raise QuantSpecError(f"--quip: {turned[0]} and {next(n for n in names if n not in turned)} read one "
                                 "input and only one is quantized; quantize both or neither (--ignore)")
        with torch.no_grad():
            for n in names:
                linears[n].weight.copy_(self.weight(linears[n].weight))
            try:
                quantize(names, None if hessian is None else self.hessian(hessian))
            finally:
                for n in names:
                    linears[n].weight.copy_(self.weight(linears[n].weight))

    def weight(self, w: torch.Tensor) -> torch.Tensor:
        """`U·W·V` of a weight [N, K] (and W of `U·W·V`)."""
        if self.v:
            w = fwht(w, self.block)
        if self.u:
            w = fwht(w.t(), self.block).t()
        return w.contiguous()

    def hessian(self, h: torch.Tensor) -> torch.Tensor:
        """`V·H·V` of an input Hessian [K, K]: the turned inputs' (H itself without `v`)."""
        return fwht(fwht(h, self.block).t(), self.block).t().contiguous() if self.v else h

    def tensors(self, name: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """The matrices a turned Linear stores, where vLLM's loader reads them."""
        s, scheme = sylvester(self.block).to(dtype), self.quip.scheme
        return ({f"{name}.{scheme('v')}_input.weight": s} if self.v else {}) | \
            ({f"{name}.{scheme('u')}_output.weight": s.clone()} if self.u else {})

    def transform_config(self) -> dict:
        """The `transform_config` groups (compressed-tensors' own classes, dumped) of these transforms."""
        from compressed_tensors.transform import TransformArgs, TransformConfig, TransformScheme

        where = dict(targets=self.targets, ignore=self.ignore)
        kind = dict(type="hadamard", head_dim=self.block, precision=torch.float64)
        groups = {}
        if self.v:
            groups[self.quip.scheme("v")] = TransformScheme(**kind, apply=[
                TransformArgs(**where, location="input"), TransformArgs(**where, location="weight_input", inverse=True)])
        if self.u:
            groups[self.quip.scheme("u")] = TransformScheme(**kind, apply=[
                TransformArgs(**where, location="weight_output"), TransformArgs(**where, location="output", inverse=True)])
        return json.loads(json.dumps(TransformConfig(config_groups=groups).model_dump()))["config_groups"]


def _downs(model) -> set[str]:
    """The `down_proj` of each decoder layer's MLPs (R4's Linears), by module name."""
    from quantspec.calib.smooth import layer_mlps

    return {f"model.layers.{i}.{down}" for i, layer in enumerate(model.model.layers) for _, down in layer_mlps(layer)}


def r4_block(model) -> int:
    """The block of R4's transform for `model`: the largest power of two up to `MAX_BLOCK`
    dividing every `down_proj`'s input size; one line where R4 cannot turn the model."""
    if any(model.args.is_moe_layer(i) for i in range(model.args.num_layers)):
        raise QuantSpecError("--rotate R4: vLLM's fused experts run no run-time transform, so a mixture of experts "
                             "cannot take one; drop R4 from --rotate")
    downs = _downs(model)
    return Quip.r4().block_for(m.in_features for n, m in model.named_modules() if n in downs)


class InputTurnedReader(CheckpointReader):
    """`inner` (a `CheckpointReader`) with the weights of the Linears `names` read turned on their
    input side (W·V, `fwht` in float64, returned in the stored dtype or `dtype`); every other tensor
    as stored, its `ranges` kept."""

    def __init__(self, inner: CheckpointReader, names: Iterable[str], block: int):
        self.inner, self.block, self.model_dir = inner, block, inner.model_dir
        self.stored, self.splits = inner.stored, {}
        self.source_quantization = source_quantization(inner)
        self.shapes = dict(inner.shapes)
        self.turned = {f"{n}.weight" for n in names} & set(self.shapes)
        self.ranges = {n: r for n, r in inner.ranges.items() if n not in self.turned}

    def nbytes(self, names: Iterable[str] | None = None) -> int:
        return float_nbytes(self, self.shapes if names is None else names)

    def read(self, names: list[str], *, dtype: torch.dtype | None = None,
             device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
        out = self.inner.read(list(names), dtype=None, device=device)
        for n, t in out.items():
            w = fwht(t.to(torch.float64), self.block) if n in self.turned else t
            out[n] = w.to(dtype or t.dtype)
        return out

    def rows(self, name: str, ids: torch.Tensor, *, dtype: torch.dtype | None = None,
             device: str | torch.device = "cpu") -> torch.Tensor:
        return self.inner.rows(name, ids, dtype=dtype, device=device)


@contextmanager
def turned_inputs(model, reader: CheckpointReader, r4: bool = True) -> Iterator[CheckpointReader]:
    """`model` (its layers read from `reader`, e.g. on `meta`) as the engine runs it under R4:
    each `down_proj` turns its input by a forward pre-hook and reads its weight turned (the yielded
    `InputTurnedReader`), so the model computes what it did and every hook registered after it (the
    observers', the measurements') sees the inputs the engine quantizes. The hooks go on exit.
    Without `r4`, the model as it is (`reader` yielded)."""
    if not r4:
        yield reader
        return
    downs, block = _downs(model), r4_block(model)
    handles = [m.register_forward_pre_hook(lambda _m, args: (fwht(args[0], block), *args[1:]))
               for n, m in model.named_modules() if n in downs]
    try:
        yield InputTurnedReader(reader, downs, block)
    finally:
        for h in handles:
            h.remove()
