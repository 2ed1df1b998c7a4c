"""A quantized Linear's codes laid out for the CPU (`CpuWeight`), and the CPU paths over them.

Layouts, by what runs (`infer/dispatch.py` picks the path):
- quantspec's packed kernels (`kernels.cpu`, where built): int8 codes in column blocks
  `int8_cpu` [NB, K, 32]; int4 codes as nibbles `int4_cpu` [NB, K, 16] with per-group
  `int4_cpu_scale` / `int4_cpu_offset` [NB, G, 32]; NVFP4 / MXFP4 codes as E2M1 nibbles
  `fp4_cpu` [NB, K, 16] with one fp32 scale per group `fp4_cpu_scale` [NB, G, 32] (NVFP4's local
  over its global, as dequantize divides). These are then the codes' only copy (`codes()` unpacks
  them); FP8 layers of `dispatch.dense_fp8` keep their codes `weight_fp8` [N, K] and the weight
  dequantized once to fp32 in column blocks, `dense_cpu` [NB, K, 32]; `bias_fp32` [N] is the bias
  the kernels add.
- torch's packed ops (bf16 / fp16 models): `int8pack_scale` [N] in the model dtype beside the
  row-major codes; `int4pack` + `int4_scales_zeros` [K/g', N, 2] (`_convert_weight_to_int4pack_for_cpu`,
  w = (u − 8)·scale + zero with u the unsigned nibble, so zero = −zp·scale and a group of g is
  g / g' groups of g' with repeated scales).
- otherwise row-major int8 codes `qweight` [N, K], or for fp8 the codes upcast once to the model
  dtype `weight_upcast` [N, K] (exact: E4M3 ⊂ bf16 ⊂ fp32; converting fp8 on CPU per call costs
  more than the matmul); fp8 with block or group scales (and FP4 without quantspec's kernels) keeps its
  codes `weight_fp8` [N, K] and the weight dequantized once to the model dtype, `weight_dequant`
  [N, K] (a block's scale cannot wait for the epilogue: it changes along K).
The row path (`row_path`: the op a decode-sized call takes, decided once) gives each row the
same numbers whatever M.
"""

from __future__ import annotations

import torch

from quantspec.infer.dispatch import ROW_PATHS, KernelPath, LinearKind, dense_fp8, select_kernel
from quantspec.infer.quant_linear import PreparedWeight, QuantLinear, aligned, layer_traits
from quantspec.kernels import cpu as cg
from quantspec.quant.args import QuantArgs
from quantspec.quant.fp4 import e2m1_codes, e2m1_nibbles
from quantspec.quant.primitives import effective_scale

__all__ = ["CPU_INT4_GROUP_SIZES", "CpuWeight"]

CPU_INT4_GROUP_SIZES = (256, 128, 64, 32)  # what `_weight_int4pack_mm_for_cpu` accepts
CPU_INT8PACK_K_MULTIPLE = 16  # `_weight_int8pack_mm` crashes / is wrong for other K (torch 2.13)
CPU_INT4PACK_N_MULTIPLE = 16  # `_convert_weight_to_int4pack_for_cpu` refuses other N
_HALF_DTYPES = (torch.bfloat16, torch.float16)
_ONE = torch.ones(1)  # the input scale of float inputs
_LAYOUTS = ("qweight", "weight_upcast", "weight_fp8", "weight_dequant", "int4pack", "int4_scales_zeros", "int8pack_scale", "int4_cpu",
            "int4_cpu_scale", "int4_cpu_offset", "int8_cpu", "fp4_cpu", "fp4_cpu_scale", "dense_cpu", "bias_fp32")


def _group(w: QuantArgs, K: int) -> int | None:
    return w.group_size if w.strategy in ("group", "tensor_group") else K if w.strategy == "channel" else None


def _gemv_layout(kind: LinearKind, w: QuantArgs, K: int) -> bool:
    """Whether quantspec's CPU kernels take this layer's layout (int8: symmetric per channel or
    tensor; int4: groups dividing K, or per channel; FP4: groups dividing K; FP8: every layout, as
    the packed fp32 GEMM of the weight dequantized at load, where `dispatch.dense_fp8` takes it)."""
    if kind is LinearKind.W8A16:
        return w.symmetric and w.strategy in ("channel", "tensor")
    if kind in (LinearKind.W4A16, LinearKind.FP4):
        g = _group(w, K)
        return g is not None and 0 < g and K % g == 0
    return kind is LinearKind.FP8  # the packed fp32 GEMM takes any dequantized weight


def _int4_group(w: QuantArgs, K: int) -> int | None:
    """Largest group size torch's CPU int4 op takes that tiles the layer's groups exactly."""
    g = _group(w, K)
    if g is None:
        return None
    for cand in CPU_INT4_GROUP_SIZES:
        if g % cand == 0 and K % cand == 0:
            return cand
    return None


def _cpu_traits(layer: QuantLinear, kind: LinearKind):
    w, dtype, policy = layer.weight_args, layer.dtype, layer.policy
    N, K = layer.out_features, layer.in_features
    half = dtype in _HALF_DTYPES
    int4_group = _int4_group(w, K) if kind is LinearKind.W4A16 and half and N % CPU_INT4PACK_N_MULTIPLE == 0 else None
    int8pack = (kind is LinearKind.W8A16 and half and w.symmetric and w.strategy in ("channel", "tensor")
                and K % CPU_INT8PACK_K_MULTIPLE == 0)
    gemv = (dtype in cg.X_DTYPES and policy.fast and policy.cpu_kernels and _gemv_layout(kind, w, K)
            and cg.cpu_kernels() is not None)
    pairs = (gemv and dtype == torch.bfloat16 and K % 2 == 0 and cg.pair_path_available()
             and (kind is not LinearKind.W4A16 or _group(w, K) % 2 == 0))
    return layer_traits(layer, kind, cpu_int8pack=int8pack, cpu_int4_group=int4_group, cpu_gemv=gemv,
                        cpu_pairs=pairs)


class CpuWeight(PreparedWeight):
    """The CPU layouts of one `QuantLinear` (module docstring), built once at load."""

    def __init__(self, layer: QuantLinear, kind: LinearKind, q: torch.Tensor, bias: torch.Tensor | None,
                 device: torch.device):
        traits = _cpu_traits(layer, kind)
        super().__init__(traits, layer.weight_scale, layer.out_features)
        self.in_features, self.dtype = layer.in_features, layer.dtype
        self.pairs = layer.policy.cpu_pairs  # the kernels' AVX512-BF16 path for bf16 x
        for name in _LAYOUTS:
            self.register_buffer(name, None)
        scale, zp = layer.weight_scale, layer.weight_zero_point
        if kind is LinearKind.FP4 and traits.cpu_gemv:
            self._pack_fp4(layer, q)
        elif kind is LinearKind.FP8 and traits.cpu_gemv and dense_fp8(traits):
            self.weight_fp8 = q.to(device)  # the codes (`codes()`), and their fp32 values packed for the GEMM
            self.dense_cpu = cg.pack_dense(layer.dequantized_weight(torch.float32, codes=self.weight_fp8))
        elif kind is LinearKind.FP4 or (kind is LinearKind.FP8 and traits.weight_strategy in ("block", "group")):
            self.weight_fp8 = q.to(device)
            self.weight_dequant = layer.dequantized_weight(layer.dtype, codes=self.weight_fp8)
        elif kind is LinearKind.FP8:
            self.weight_upcast = q.to(device).to(layer.dtype)  # [N, K], exact
        else:
            self.qweight = q.to(device=device, dtype=torch.int8)  # [N, K]
        if traits.cpu_int8pack:
            self.int8pack_scale = self.w_scale_vec.to(layer.dtype)  # [N]
        self.row_limit = layer.policy.cpu_packed_max_m
        if layer.policy.fast:  # the path of a decode-sized x of the prepared dtype, decided once
            path = select_kernel(traits, device, 1, layer.dtype, layer.policy)
            self.row_path = path if path in ROW_PATHS else None
        if self.row_path is KernelPath.CPU_GEMV_INT4:
            self._pack_w4(q, scale, zp)
        elif self.row_path is KernelPath.CPU_GEMV_INT8:
            self._pack_w8()
        if traits.cpu_int4_group and self.row_path is not KernelPath.CPU_GEMV_INT4:
            self._pack_int4pack(q, scale, zp, traits.cpu_int4_group)  # torch's int4 op is the path
        if traits.cpu_gemv and kind in (LinearKind.W8A16, LinearKind.W4A16):
            # the packed blocks serve every M torch's op does not (prefill included): they are the
            # codes' only copy (`codes()` unpacks them)
            if kind is LinearKind.W8A16 and self.int8_cpu is None:
                self._pack_w8()
            if kind is LinearKind.W4A16 and self.int4_cpu is None:
                self._pack_w4(q, scale, zp)
            self.qweight = None
        if self.row_path in (KernelPath.CPU_GEMV_INT4, KernelPath.CPU_GEMV_INT8, KernelPath.CPU_GEMV_FP4,
                             KernelPath.CPU_GEMV_DENSE) and bias is not None:
            self.bias_fp32 = bias.detach().to(device, torch.float32)
        for name, buf in list(self._buffers.items()):
            self._buffers[name] = aligned(buf)

    # ---- layouts -----------------------------------------------------------------------------
    def _pack_int4pack(self, q: torch.Tensor, scale: torch.Tensor, zp: torch.Tensor | None, g_cpu: int) -> None:
        N, K = q.shape
        u = (q.to(torch.int32) + 8).contiguous()  # [N, K] unsigned nibbles, u - 8 = q
        self.int4pack = torch._convert_weight_to_int4pack_for_cpu(u, 1)
        reps = K // g_cpu // scale.shape[1]  # each stored group → `reps` CPU groups
        s = scale.repeat_interleave(reps, dim=1)  # [N, K/g'] fp32
        z = torch.zeros_like(s) if zp is None else \
            -zp.to(torch.float32).repeat_interleave(reps, dim=1) * s  # w = q*s + (−zp*s)
        self.int4_scales_zeros = torch.stack([s.t(), z.t()], dim=-1).to(self.dtype).contiguous()

    def _pack_w4(self, q: torch.Tensor, scale: torch.Tensor, zp: torch.Tensor | None) -> None:
        s = scale.reshape(self.out_features, -1).float()  # [N, G] (G = 1 per channel)
        neg_zs = torch.zeros_like(s) if zp is None else -zp.to(torch.float32).reshape(s.shape) * s  # w = q*s + (−zp*s)
        self.int4_cpu, self.int4_cpu_scale, self.int4_cpu_offset = cg.pack_w4(q.to(torch.int8), s, neg_zs)

    def _pack_w8(self) -> None:
        self.int8_cpu = cg.pack_w8(self.qweight)  # [NB, K, 32]

    def _pack_fp4(self, layer: QuantLinear, q: torch.Tensor) -> None:
        # dequantize's own per-group scale (fp32), so the kernel's weights are the reference's
        s = effective_scale(layer.weight_scale, layer.weight_args, layer.weight_global_scale).float()
        self.fp4_cpu, self.fp4_cpu_scale = cg.pack_fp4_blocks(e2m1_nibbles(q), s.reshape(self.out_features, -1))

    def codes(self) -> torch.Tensor:
        if self.qweight is not None:
            return self.qweight
        if self.weight_upcast is not None:
            return self.weight_upcast
        if self.weight_fp8 is not None:
            return self.weight_fp8
        if self.int8_cpu is not None:
            return cg.unpack_w8(self.int8_cpu, self.out_features)
        if self.fp4_cpu is not None:
            return e2m1_codes(cg.unpack_fp4_blocks(self.fp4_cpu, self.out_features))
        return cg.unpack_w4(self.int4_cpu, self.out_features)

    def gemv_bias(self, layer: QuantLinear) -> torch.Tensor | None:
        """The fp32 bias quantspec's kernels add (None without a bias)."""
        if layer.bias is not None and self.bias_fp32 is None:
            self.bias_fp32 = layer.bias.float()
        return self.bias_fp32

    # ---- paths -------------------------------------------------------------------------------
    def run(self, layer: QuantLinear, x: torch.Tensor, path: KernelPath) -> torch.Tensor:
        if path is KernelPath.CPU_INT8PACK:
            # an unaligned x (a row slice of a larger buffer) segfaults this op: re-home it
            y = torch._weight_int8pack_mm(aligned(x), self.codes(), self.int8pack_scale)
            return y if layer.bias is None else y + layer.bias.to(y.dtype)
        if path is KernelPath.CPU_INT4PACK:
            if self.int4pack is None:  # prepared for quantspec's kernel (tests force this path)
                self._pack_int4pack(self.codes(), layer.weight_scale, layer.weight_zero_point,
                                    self.traits.cpu_int4_group)
            y = torch._weight_int4pack_mm_for_cpu(aligned(x), self.int4pack, self.traits.cpu_int4_group,
                                                  self.int4_scales_zeros)
            return y if layer.bias is None else y + layer.bias.to(y.dtype)
        if path is KernelPath.CPU_GEMV_INT8:
            if self.int8_cpu is None:  # prepared for another path (tests force this one)
                self._pack_w8()
            return cg.packed_w8_gemm(x.contiguous(), self.int8_cpu, self.w_scale_vec, self.out_features,
                                     self.gemv_bias(layer), pairs=self.pairs)
        if path is KernelPath.CPU_GEMV_INT4:
            if self.int4_cpu is None:  # prepared for torch's int4 op (tests force this path)
                self._pack_w4(self.codes(), layer.weight_scale, layer.weight_zero_point)
            g = self.in_features // self.int4_cpu_scale.shape[1]
            return cg.packed_w4_gemm(x.contiguous(), self.int4_cpu, self.int4_cpu_scale, self.int4_cpu_offset,
                                     g, self.out_features, self.gemv_bias(layer), pairs=self.pairs)
        if path is KernelPath.CPU_INT_MM:
            xq, s, _ = layer.quantize_input(x)  # [M, K] int8, [1] or [M, 1]
            acc = torch._int_mm(xq, self.qweight.t())  # [M, N] int32, exact
            return layer.epilogue(acc.float(), s, x.dtype)
        if path is KernelPath.CPU_GEMV_DENSE:
            if self.dense_cpu is None:  # prepared for another path (tests force this one)
                self.dense_cpu = cg.pack_dense(layer.dequantized_weight(torch.float32))
            return cg.packed_gemm(layer.fake_quantized_input(x).contiguous(), self.dense_cpu, self.out_features,
                                  self.gemv_bias(layer))
        if path is KernelPath.CPU_FP8_UPCAST:
            # (codes kept as bytes for the packed GEMM: upcast for this call, as tests force this path)
            w = self.weight_upcast if self.weight_upcast is not None else self.codes().to(layer.dtype)
            if layer.input_args is None:  # FP8 weights alone: x times the codes, then the weight scales
                return layer.epilogue((x @ w.t()).float(), _ONE, x.dtype)
            xq, s, _ = layer.quantize_input(x)  # [M, K] float8_e4m3fn
            acc = xq.to(w.dtype) @ w.t()  # [M, N]
            return layer.epilogue(acc.float(), s, x.dtype)
        if path is KernelPath.CPU_GEMV_FP4:
            if self.fp4_cpu is None:  # prepared for the dequantized path (tests force this one)
                self._pack_fp4(layer, self.codes())
            g = self.in_features // self.fp4_cpu_scale.shape[1]
            return cg.packed_fp4_gemm(layer.fake_quantized_input(x).contiguous(), self.fp4_cpu, self.fp4_cpu_scale,
                                      g, self.out_features, self.gemv_bias(layer), pairs=self.pairs)
        if path is KernelPath.CPU_DEQUANTIZED:  # (an FP4 layer prepared for its kernel: x of another dtype)
            w = self.weight_dequant if self.weight_dequant is not None else layer.dequantized_weight(x.dtype)
            return layer.linear_on(layer.fake_quantized_input(x), w)
        return super().run(layer, x, path)

    def plan_linear(self, layer: QuantLinear, dtype: torch.dtype):
        """(kind, tensors a / b / c / bias, N, group) of this layer's row path in the extension's
        plans (`infer/cpu/csrc/plans.cpp`), or None when a plan cannot run it for `dtype`."""
        if layer.dtype != dtype:
            return None
        empty = torch.empty(0)
        bias = self.gemv_bias(layer)
        bias = empty if bias is None else bias
        N = self.out_features
        if self.row_path is KernelPath.CPU_GEMV_INT8 and self.int8_cpu is not None:
            return 1, (self.int8_cpu, self.w_scale_vec, empty, bias), N, 0
        if self.row_path is KernelPath.CPU_GEMV_INT4 and self.int4_cpu is not None and layer.input_args is None:
            group = self.in_features // self.int4_cpu_scale.shape[1]
            return 2, (self.int4_cpu, self.int4_cpu_scale, self.int4_cpu_offset, bias), N, group
        if self.row_path is KernelPath.CPU_GEMV_FP4 and self.fp4_cpu is not None and layer.input_args is None:
            group = self.in_features // self.fp4_cpu_scale.shape[1]
            return 4, (self.fp4_cpu, self.fp4_cpu_scale, empty, bias), N, group
        if self.row_path is KernelPath.CPU_GEMV_DENSE and self.dense_cpu is not None and layer.input_args is None:
            return 0, (self.dense_cpu, empty, empty, bias), N, 0
        if self.row_path is KernelPath.CPU_INT4PACK and self.int4pack is not None and layer.input_args is None:
            # torch's op: the bias is added in the output's dtype, as `run` does
            bias = empty if layer.bias is None else layer.bias.to(dtype)
            return 3, (self.int4pack, self.int4_scales_zeros, empty, bias), N, self.traits.cpu_int4_group
        return None
