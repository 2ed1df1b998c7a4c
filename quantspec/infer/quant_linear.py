"""`QuantLinear`: a Linear whose weight is int4 / int8 / fp8 codes + scales (+ a static input
scale), built from a checkpoint's tensors (`quant/compressed.py`) and prepared for one device.

The layer keeps the checkpoint's qparams; its codes live in a `PreparedWeight` that the backend of
its device lays out (`infer/cpu/weights.py`, `infer/cuda/weights.py`). Each call picks a path
with `infer/dispatch.py`'s `select_kernel`: the reference (dequantize + matmul, here), one of
the CPU room's ops, or one of the CUDA room's Triton kernels. Every path computes the reference
`y = x̂ @ dequantize(q, scale, zp)ᵀ + b` (all numbers through `quant/primitives.py`;
activations are quantized in fp32 as the kernels do) up to float rounding order.
"""

from __future__ import annotations

from typing import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from quantspec.errors import QuantSpecError
from quantspec.infer.dispatch import (FLOAT_DTYPES, DispatchPolicy, KernelPath, LinearKind, LinearTraits,
                                      select_kernel)
from quantspec.quant.args import QuantArgs
from quantspec.quant.scheme import QuantScheme, is_w4a8
from quantspec.quant.compressed import QuantizedLinearTensors, read_quantized_linear
from quantspec.quant.primitives import choose_qparams, dequantize, quantize

__all__ = ["PreparedWeight", "QuantLinear", "aligned", "layer_traits", "linear_kind"]

# packed kernels take allocator-aligned operands: a tensor viewed straight out of a safetensors
# buffer may sit at any offset (torch's `_weight_int8pack_mm` segfaults on one), so buffers are
# re-homed
_ALIGN_BYTES = 64
_TRITON_PATHS = frozenset({KernelPath.TRITON_W4A16, KernelPath.TRITON_W8A16, KernelPath.TRITON_W8A8,
                           KernelPath.TRITON_FP8, KernelPath.TRITON_FP8_BLOCK, KernelPath.TRITON_NVFP4,
                           KernelPath.TRITON_MXFP4,
                           KernelPath.CUDA_DEQUANT_MM,
                           KernelPath.CUDA_SCALED_MM})


def aligned(t: torch.Tensor | None) -> torch.Tensor | None:
    """`t` contiguous and at an allocator-aligned address (cloned only when needed)."""
    if t is None:
        return None
    t = t.contiguous()
    return t if t.data_ptr() % _ALIGN_BYTES == 0 else t.clone()


def linear_kind(w: QuantArgs, ia: QuantArgs | None) -> LinearKind:
    """What a layer with weight args `w` and input args `ia` computes; refuses what quantspec does
    not run."""
    if w.is_fp4:
        return LinearKind.FP4
    if w.type == "float":
        return LinearKind.FP8
    if w.num_bits == 4:
        if ia is not None and not is_w4a8(w, ia):
            raise QuantSpecError(f"int4 weights take float inputs (W4A16) or 8-bit inputs quantized per token at "
                                 f"run time (W4A8, W4AFP8), not {ia.num_bits}-bit {ia.type} inputs "
                                 f"{'quantized at run time' if ia.dynamic else 'with static scales'} per "
                                 f"{ia.strategy}; re-quantize with --quant-type a8w4 or weight_only_int4")
        return LinearKind.W4A16  # W4A8: the int4 kernels on x as its quantizer leaves it (`QuantLinear.run`)
    if w.num_bits == 8:
        if ia is None:
            return LinearKind.W8A16
        if ia.type != "int" or ia.num_bits != 8:
            raise QuantSpecError("int8 weights need int8 activations (a8w8) or none; got "
                                 f"{ia.num_bits}-bit {ia.type} activations")
        return LinearKind.W8A8
    raise QuantSpecError(f"{w.num_bits}-bit int weights are unsupported; quantspec runs 4- and "
                         "8-bit int weights and fp8")


def layer_traits(layer: "QuantLinear", kind: LinearKind, **device_facts) -> LinearTraits:
    """The traits of `layer` from its scheme, with the facts of the device that prepared it
    (`cpu_gemv`, `fp8_native`, ...)."""
    w, ia = layer.weight_args, layer.input_args
    return LinearTraits(
        kind=kind, dtype=layer.dtype, weight_symmetric=w.symmetric, weight_strategy=w.strategy,
        act_mode=None if ia is None else ("dynamic" if ia.dynamic else "static"),
        act_symmetric=True if ia is None else ia.symmetric, **device_facts)


class PreparedWeight(nn.Module):
    """One `QuantLinear`'s codes laid out for a backend, and the paths the backend runs on them.

    A backend subclasses it (`infer/cpu/weights.CpuWeight`, `infer/cuda/weights.CudaWeight`),
    fills `traits` (the facts `select_kernel` reads) and keeps its layouts as buffers.
    `codes()` gives the codes [N, K] back (the reference path and re-stacking read them);
    `run(layer, x, path)` computes x [M, K] → [M, N] on one of the backend's paths.
    `row_path` is the path whose numbers for a row do not depend on the other rows, taken by every
    call of up to `row_limit` rows and by every row-invariant call (None: no such path).
    `w_scale_vec` [N] fp32 is the per-output weight scale (per channel / tensor layers).
    """

    row_path: KernelPath | None = None
    row_limit: int = 0

    def __init__(self, traits: LinearTraits, scale: torch.Tensor, out_features: int):
        super().__init__()
        self.traits = traits
        self.out_features = out_features
        vec = None
        if traits.weight_strategy in ("channel", "tensor"):
            vec = scale.reshape(-1).expand(out_features).contiguous()  # [N] fp32
        self.register_buffer("w_scale_vec", vec)

    def codes(self) -> torch.Tensor:
        raise NotImplementedError

    def run(self, layer: "QuantLinear", x: torch.Tensor, path: KernelPath) -> torch.Tensor:
        raise QuantSpecError(f"{layer.name or 'QuantLinear'}: path {path.value} does not run on this device")


class QuantLinear(nn.Module):
    """A Linear whose weight is int4 / int8 / fp8 codes + scales (+ static input scale).

    Buffers (fp32 scales): weight_scale [N, K/g] | [N, 1] | [1] | [N/bn, K/bk] (blocks), weight_zero_point like it
    (asymmetric; int8, or fp32 for a float zp_dtype) or None, input_scale [1] / input_zero_point
    [1] (static activations) or None, bias [N] (model dtype) or None; NVFP4: weight_global_scale
    [1] and, with NVFP4 inputs, input_global_scale [1] (else None). `prepared`: the codes in
    the device backend's layouts (`PreparedWeight`). The layer is prepared for one device and
    dtype (`device`, `dtype` at construction); move a model by loading it again.

    `forward(x, row_invariant=True)` gives every row of x the numbers it gets alone, whatever M
    (a decode or verification step); the default dispatches on M.
    """

    takes_row_invariant = True  # model_zoo.llama: the model passes its forward's row_invariant

    def __init__(self, t: QuantizedLinearTensors, *, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", policy: DispatchPolicy | None = None,
                 name: str = "") -> None:
        super().__init__()
        if dtype not in FLOAT_DTYPES:
            raise QuantSpecError(f"dtype {dtype} unsupported; use float32, bfloat16 or float16")
        device = torch.device(device)
        w, ia = t.weight_args, t.input_args
        if t.q.ndim != 2:
            raise QuantSpecError(f"{name}: codes must be 2-D [N, K], got {tuple(t.q.shape)}")
        if ia is not None and not ia.dynamic and t.input_scale is None:
            raise QuantSpecError(f"{name} has no input_scale but its scheme has static input "
                                 "activations: quantize with --calib to store one")
        if ia is not None and ia.strategy not in ("tensor", "token") and not (
                ia.strategy in ("group", "tensor_group") and ia.dynamic):
            raise QuantSpecError(f"{name}: input activation strategy {ia.strategy!r} is "
                                 "unsupported; use tensor (static), token or group (dynamic)")
        if ia is not None and ia.is_nvfp4 and t.input_global_scale is None:
            raise QuantSpecError(f"{name} has no input_global_scale but its scheme has NVFP4 inputs: "
                                 "quantize with --calib to store one")
        if ia is not None and ia.strategy in ("group", "tensor_group") and t.q.shape[1] % ia.group_size:
            raise QuantSpecError(f"{name}: input groups of {ia.group_size} do not divide K={t.q.shape[1]} "
                                 "(its scheme's input group size, an FP8 block's width); re-quantize it with "
                                 "`quantspec quantize`, which fits blocks and input groups to each layer's K")
        self.name = name
        self.out_features, self.in_features = t.q.shape
        self.weight_args, self.input_args = w, ia
        self.input_bound: float | None = None  # inputs clamped to ±it first (`QuantConfig.input_bound`)
        self.dtype = dtype
        self.policy = policy or DispatchPolicy()
        kind = linear_kind(w, ia)
        scale = t.scale.detach().to(device=device, dtype=torch.float32)
        zp = None
        if t.zero_point is not None:  # int8, or fp32 for a float zp_dtype (exact upcast)
            zp = t.zero_point.detach().to(device, torch.float32 if w.zp_dtype else torch.int8)
        self.register_buffer("weight_scale", scale)
        self.register_buffer("weight_zero_point", zp)
        self.register_buffer("input_scale", None if t.input_scale is None
                             else t.input_scale.detach().reshape(1).to(device, torch.float32))
        self.register_buffer("input_zero_point", None if t.input_zero_point is None
                             else t.input_zero_point.detach().reshape(1).to(device))
        self.register_buffer("bias", None if t.bias is None
                             else t.bias.detach().to(device=device, dtype=dtype))
        for buf, v in (("weight_global_scale", t.global_scale), ("input_global_scale", t.input_global_scale)):
            self.register_buffer(buf, None if v is None else v.detach().reshape(1).to(device, torch.float32))
        from quantspec.infer.backend import prepare_weight

        self.prepared = prepare_weight(self, kind, t.q.detach(), t.bias, device)
        for name_, buf in list(self._buffers.items()):
            self._buffers[name_] = aligned(buf)

    @property
    def traits(self) -> LinearTraits:
        return self.prepared.traits

    # ---- numbers -----------------------------------------------------------------------------
    def codes(self) -> torch.Tensor:
        """The weight codes [N, K] (int8, or the fp8 codes as float); unpacked (a copy) where
        only a packed layout is kept."""
        return self.prepared.codes()

    def dequantized_weight(self, dtype: torch.dtype | None = None, codes: torch.Tensor | None = None
                           ) -> torch.Tensor:
        """dequantize(q, scale, zp) from quant/primitives (fp32), as `dtype` → [N, K]; `codes`:
        q (default `codes()`)."""
        w = dequantize(self.codes() if codes is None else codes, self.weight_scale, self.weight_zero_point,
                       self.weight_args, dtype=torch.float32, global_scale=self.weight_global_scale)
        return w.to(dtype or self.dtype)

    def _act_qparams(self, xf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        ia = self.input_args
        if ia.dynamic:  # [M, 1] per token, [1] per tensor, [M, K/g] per group
            return choose_qparams(xf, ia, global_scale=self.input_global_scale)
        return self.input_scale, self.input_zero_point

    def quantize_input(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(codes, scale, zero point) of x [M, K] under the input args, computed in fp32."""
        xf = x.float()
        s, z = self._act_qparams(xf)
        return quantize(xf, s, z, self.input_args, global_scale=self.input_global_scale), s, z

    def epilogue(self, acc: torch.Tensor, x_scale: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        """acc [M, N] fp32 · x_scale ([1] or [M, 1]) · w_scale [N] (+ bias), in the order of
        `int8_gemm_ref` / `fp8_gemm_ref`."""
        y = acc * x_scale.reshape(-1, 1) * self.prepared.w_scale_vec[None, :]
        if self.bias is not None:
            y = y + self.bias.float()
        return y.to(out_dtype)

    # ---- dispatch ----------------------------------------------------------------------------
    def kernel_for(self, x: torch.Tensor) -> KernelPath:
        """The path `forward(x)` takes (x [..., K])."""
        M = x.numel() // x.shape[-1] if x.shape[-1] else 0
        return select_kernel(self.traits, x.device, M, x.dtype, self.policy)

    def forward(self, x: torch.Tensor, row_invariant: bool = False) -> torch.Tensor:
        """x [..., K] → [..., N] in x's dtype; `row_invariant`: each row's numbers as it gets
        alone, whatever the number of rows (the prepared row path for every M)."""
        p = self.prepared
        if (p.row_path is not None and x.dim() == 2 and x.dtype == self.dtype
                and x.shape[1] == self.in_features and x.device.type == "cpu" and 0 < x.shape[0]
                and (x.shape[0] <= p.row_limit or row_invariant)):
            return p.run(self, self._w4a8_input(self._bounded(x)), p.row_path)
        if x.shape[-1] != self.in_features:
            raise QuantSpecError(f"{self.name or 'QuantLinear'}: input has {x.shape[-1]} features, "
                                 f"expected {self.in_features}")
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features).contiguous()  # [M, K]
        y = self.run(x2, self.kernel_for(x2))
        return y.reshape(*lead, self.out_features)

    def run(self, x: torch.Tensor, path: KernelPath) -> torch.Tensor:
        """Run one path on x [M, K] → [M, N] (tests call it to force a path)."""
        x = self._bounded(x)
        if path is KernelPath.DEQUANT:
            return self._dequant(x)
        x = self._w4a8_input(x)
        if path in _TRITON_PATHS:  # the CUDA backend's kernels (on CPU tensors under the interpreter)
            from quantspec.infer.backend import triton_linear

            return triton_linear(self, x, path)
        return self.prepared.run(self, x, path)

    def _bounded(self, x: torch.Tensor) -> torch.Tensor:
        """x clamped to ±`input_bound` (FBGEMM's scale bound: a token's maximum taken as at most
        it, larger values saturating), x itself where the layer has none."""
        return x if self.input_bound is None else x.clamp(-self.input_bound, self.input_bound)

    def _w4a8_input(self, x: torch.Tensor) -> torch.Tensor:
        """x as the int4 kernels take it: quantized per token and dequantized for a W4A8 / W4AFP8
        layer (the numbers of an integer or FP8 GEMM with the scales in its epilogue, up to the
        order of fp32 sums), x itself for every other layer (the other kernels quantize x, or
        take it float)."""
        ia = self.input_args
        if ia is None or self.weight_args.num_bits != 4 or self.weight_args.type != "int":
            return x
        if not ia.symmetric:
            return self.fake_quantized_input(x)
        # symmetric per token: `fake_quantized_input`'s numbers (compressed-tensors' scale absmax /
        # (q_max - q_min) * 2, eps for an all-zero row; clamp, round half to even or the E4M3 cast;
        # codes times scale) in a few in-place ops, as a decode step runs it once per layer
        xf = x.float()
        lim = 448.0 if ia.type == "float" else 127.5
        s = xf.abs().amax(-1, keepdim=True).div_(lim)
        s.masked_fill_(s == 0, torch.finfo(torch.float32).eps)
        q = (xf / s).clamp_(-lim if ia.type == "float" else -128.0, 448.0 if ia.type == "float" else 127.0)
        q = q.to(torch.float8_e4m3fn).float() if ia.type == "float" else q.round_()
        return q.mul_(s).to(x.dtype)

    def fake_quantized_input(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] as the layer's input quantizer leaves it (dequantize(quantize(x)) in fp32, in
        x's dtype); x itself for float inputs."""
        if self.input_args is None:
            return x
        xq, s, z = self.quantize_input(x)
        return dequantize(xq, s, z, self.input_args, dtype=torch.float32,
                          global_scale=self.input_global_scale).to(x.dtype)

    def linear_on(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """F.linear(x, w, bias) in x's dtype."""
        return F.linear(x, w.to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))

    def _dequant(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_on(self.fake_quantized_input(x), self.dequantized_weight(x.dtype))

    def extra_repr(self) -> str:
        w = self.weight_args
        g = f", group_size={w.group_size}" if w.strategy == "group" else ""
        act = "" if self.input_args is None else f", act={self.traits.act_mode}"
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"kind={self.traits.kind.value}, {w.strategy}{g}, "
                f"{'sym' if w.symmetric else 'asym'}{act}, dtype={self.dtype}")

    @classmethod
    def from_tensors(cls, tensors: Mapping[str, torch.Tensor], prefix: str, scheme: QuantScheme,
                     out_features: int, in_features: int, *, dtype: torch.dtype = torch.float32,
                     device: torch.device | str = "cpu", policy: DispatchPolicy | None = None
                     ) -> "QuantLinear":
        """Build from a checkpoint's tensors (compressed-tensors names under `prefix`)."""
        t = read_quantized_linear(tensors, prefix, scheme, out_features, in_features)
        return cls(t, dtype=dtype, device=device, policy=policy, name=prefix)
