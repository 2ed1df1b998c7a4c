"""A quantized Linear's codes laid out for CUDA (`CudaWeight`), and the Triton paths over them.

Layouts: int4 codes as stored in the checkpoint's words `weight_packed` int32 [N, K/8] (what the
Triton kernel reads) with their scale `w4_scale` [N, groups] (in the activations' dtype where that
holds it exactly, as a 16-bit checkpoint's scales are: the kernels then fold it into the weight
tile by two-value multiplies, with the same numbers; else fp32), or, with
`DispatchPolicy.cuda_int4_quartered` where K and the group size are multiples of 128, those words
in `kernels.w4a16.quarter_int4`'s layout (`quartered`; `k_order`: the k each position holds); int8
codes `qweight` [N, K], fp8 codes `weight_fp8` [N, K], NVFP4 / MXFP4 codes two a byte `weight_packed`
uint8 [N, K/2] with their group scales' bytes `fp4_scale` (FP8 E4M3 [N, K/16] / E8M0 uint8 [N, K/32]).
`triton_linear` runs the Triton kernels (`kernels.w4a16` / `w8a16` / `w8a8` / `fp8` / `fp8_block` /
`fp4` / `mxfp4`) for any prepared weight: on CUDA, or on CPU tensors
under TRITON_INTERPRET=1 (the tests).
"""

from __future__ import annotations

import torch

from quantspec.errors import QuantSpecError
from quantspec.infer.dispatch import KernelPath, LinearKind
from quantspec.infer.quant_linear import PreparedWeight, QuantLinear, aligned, layer_traits
from quantspec.quant.fp4 import mx_exponents_of, pack_fp4, unpack_fp4
from quantspec.quant.packing import pack_int4, unpack_int4

__all__ = ["CudaWeight", "triton_linear"]


class CudaWeight(PreparedWeight):
    """The CUDA layouts of one `QuantLinear` (module docstring)."""

    def __init__(self, layer: QuantLinear, kind: LinearKind, q: torch.Tensor, bias: torch.Tensor | None,
                 device: torch.device):
        fp8_native = False
        if kind is LinearKind.FP8 and torch.cuda.is_available():
            fp8_native = torch.cuda.get_device_capability(device) >= (8, 9)
        fp4_tiles = kind is LinearKind.FP4 and layer.in_features % 32 == 0
        super().__init__(layer_traits(layer, kind, fp8_native=fp8_native, fp4_tiles=fp4_tiles), layer.weight_scale,
                         layer.out_features)
        self.in_features = layer.in_features
        for name in ("qweight", "weight_packed", "w4_scale", "weight_fp8", "k_order", "fp4_scale"):
            self.register_buffer(name, None)
        self.quartered = False
        if kind is LinearKind.FP4:  # two E2M1 codes a byte and the group scales' bytes, as stored
            self.weight_packed = pack_fp4(q).to(device)  # [N, K/2]
            self.fp4_scale = _fp4_scale_bytes(layer).to(device)
        elif kind is LinearKind.FP8:
            self.weight_fp8 = q.to(device)
        elif kind is LinearKind.W4A16:
            self.weight_packed = pack_int4(q.to(torch.int8)).to(device)  # [N, ceil(K/8)]
            if layer.policy.cuda_int4_quartered and _quarterable(layer):
                from quantspec.kernels.w4a16 import quarter_int4, quartered_order

                self.weight_packed = quarter_int4(self.weight_packed, self.in_features)
                self.k_order = quartered_order(self.in_features).to(device)
                self.quartered = True
            s = _w4_scale(layer)
            narrow = s.to(layer.dtype)
            self.w4_scale = narrow if torch.equal(narrow.float(), s) else s
        else:
            self.qweight = q.to(device=device, dtype=torch.int8)  # [N, K]
        for name, buf in list(self._buffers.items()):
            self._buffers[name] = aligned(buf)

    def codes(self) -> torch.Tensor:
        if self.qweight is not None:
            return self.qweight
        if self.weight_fp8 is not None:
            return self.weight_fp8
        if self.fp4_scale is not None:
            return unpack_fp4(self.weight_packed, self.in_features)
        q = unpack_int4(self.weight_packed, (self.out_features, self.in_features))
        if self.quartered:  # position p holds k_order[p]
            q = torch.empty_like(q).index_copy_(1, self.k_order, q)
        return q

    def run(self, layer: QuantLinear, x: torch.Tensor, path: KernelPath) -> torch.Tensor:
        return triton_linear(layer, x, path)


def _fp4_scale_bytes(layer: QuantLinear) -> torch.Tensor:
    """An FP4 layer's group scales as stored: FP8 E4M3 (NVFP4, exact) or E8M0 exponents (MXFP4)."""
    if layer.weight_args.is_mx:
        return mx_exponents_of(layer.weight_scale)  # [N, K/32]
    return layer.weight_scale.to(torch.float8_e4m3fn)  # [N, K/16]


def triton_linear(layer: QuantLinear, x: torch.Tensor, path: KernelPath) -> torch.Tensor:
    """x [M, K] → [M, N] through the Triton kernel of `path` over `layer`'s prepared codes."""
    from quantspec import kernels

    p = layer.prepared
    b = None if layer.bias is None else layer.bias.to(x.dtype)
    if path is KernelPath.TRITON_W4A16:
        w = getattr(p, "weight_packed", None)
        w = w if w is not None else pack_int4(layer.codes())
        return kernels.w4a16_linear(x, w, _prepared_w4_scale(layer), _w4_group(layer), layer.weight_zero_point, b,
                                    quartered=getattr(p, "quartered", False))
    if path is KernelPath.TRITON_W8A16:  # per-channel scales, or group ones (group-wise int8, MXFP8)
        if layer.input_args is not None:  # MXFP8 inputs: quantized per group first
            x = layer.fake_quantized_input(x)
        scale = p.w_scale_vec if p.w_scale_vec is not None else layer.weight_scale
        return kernels.w8a16_linear(x, _w8_codes(layer), scale, b)
    if path is KernelPath.TRITON_W8A8:
        return kernels.w8a8_linear(x, layer.codes(), p.w_scale_vec,
                                   None if layer.input_args.dynamic else layer.input_scale, b)
    if path in (KernelPath.TRITON_FP8, KernelPath.CUDA_SCALED_MM):
        w = _w8_codes(layer)
        op = kernels.fp8_linear if path is KernelPath.TRITON_FP8 else kernels.fp8_scaled_mm_linear
        return op(x, w, p.w_scale_vec, layer.input_scale, b)
    if path is KernelPath.TRITON_FP8_BLOCK:
        w = _w8_codes(layer)
        return kernels.fp8_block_linear(x, w, layer.weight_scale, layer.weight_args.block_structure, b)
    if path in (KernelPath.TRITON_NVFP4, KernelPath.TRITON_MXFP4):
        if getattr(p, "fp4_scale", None) is not None:
            packed, scale = p.weight_packed, p.fp4_scale
        else:  # a layer prepared for the CPU (tests under the interpreter)
            packed, scale = pack_fp4(layer.codes()), _fp4_scale_bytes(layer)
        if path is KernelPath.TRITON_MXFP4:
            ia = layer.input_args
            if ia is not None and not ia.is_mx:  # FP8 inputs (a8w4_mxfp4): quantized per token / group first
                x = layer.fake_quantized_input(x)
            return kernels.mxfp4_linear(x, packed, scale, b, quantize_input=ia is not None and ia.is_mx)
        return kernels.nvfp4_linear(x, packed, scale, layer.weight_global_scale, b, layer.input_global_scale)
    if path is KernelPath.CUDA_DEQUANT_MM:
        return torch.nn.functional.linear(x, _dequantized(layer, x.dtype), b)
    raise QuantSpecError(f"unknown kernel path {path!r}")


def _dequantized(layer: QuantLinear, dtype: torch.dtype) -> torch.Tensor:
    """The layer's [N, K] weight in `dtype` by the Triton dequantize kernels (a quartered int4
    layer's in k order too: the kernel writes each code to its k)."""
    from quantspec import kernels

    if layer.traits.kind is LinearKind.W4A16:
        p = layer.prepared
        w = getattr(p, "weight_packed", None)
        w = w if w is not None else pack_int4(layer.codes())
        return kernels.w4a16_dequantize(w, _prepared_w4_scale(layer), _w4_group(layer), layer.in_features,
                                        layer.weight_zero_point, dtype, quartered=getattr(p, "quartered", False))
    return kernels.w8a16_dequantize(_w8_codes(layer), layer.prepared.w_scale_vec, dtype)


def _w8_codes(layer: QuantLinear) -> torch.Tensor:
    """An 8-bit layer's codes as the Triton kernels take them: int8, or FP8 E4M3 (a layer prepared
    for the CPU keeps FP8 codes upcast to its dtype: exact, so cast back)."""
    w = layer.codes()
    return w if w.dtype in (torch.int8, torch.float8_e4m3fn) else w.to(torch.float8_e4m3fn)


def _w4_group(layer: QuantLinear) -> int:
    """The k per scale of an int4 layer (the whole row for a per-channel or per-tensor scale)."""
    return layer.weight_args.group_size if layer.weight_args.strategy == "group" else layer.in_features


def _quarterable(layer: QuantLinear) -> bool:
    """Whether an int4 layer can take the quartered layout: K and the group size multiples of
    128, integer zero points (the nibble-dots launches apply the scale after each tile's dot)."""
    from quantspec.kernels.w4a16 import QUARTER_BLOCK  # triton: only where the layout is asked for

    zp = layer.weight_zero_point
    return (layer.in_features % QUARTER_BLOCK == 0 and _w4_group(layer) % QUARTER_BLOCK == 0
            and (zp is None or not zp.is_floating_point()))


def _w4_scale(layer: QuantLinear) -> torch.Tensor:
    """The W4A16 kernels' [N, groups] scale (a per-tensor scale broadcast over the rows)."""
    if layer.weight_scale.ndim == 2:
        return layer.weight_scale
    return layer.weight_scale.reshape(1, 1).expand(layer.out_features, 1).contiguous()


def _prepared_w4_scale(layer: QuantLinear) -> torch.Tensor:
    """`CudaWeight.w4_scale` where the layer was prepared for CUDA, else `_w4_scale`."""
    s = getattr(layer.prepared, "w4_scale", None)
    return s if s is not None else _w4_scale(layer)
