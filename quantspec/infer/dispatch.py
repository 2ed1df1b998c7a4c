"""Which op one quantized-linear call runs: a pure function of the layer's traits, the device, the
rows M of x and x's dtype (kernels are mechanism, this is the policy; gemlite's
`get_matmul_type` style).

Every path computes the reference `y = x̂ @ dequantize(q, scale, zp)ᵀ + b` (x̂ = x for weight-only
schemes, `dequantize(quantize(x))` with the static or dynamic per-token input scale for a8w8 /
a8w8_fp8); fast paths differ from it only by float rounding order.

CPU, where quantspec's CPU kernels are built (`LinearTraits.cpu_gemv`, `DispatchPolicy.cpu_kernels`):
- weight-only int8, symmetric per channel / tensor: `packed_w8_gemm` (codes repacked once into
  column blocks) for fp32 or bf16 x, any M;
- weight-only int4 with groups dividing K (or per channel): with bf16 x on a CPU with
  AVX512-BF16 (`LinearTraits.cpu_pairs`) `packed_w4_gemm`'s pair path for every M; else torch's
  packed int4 op for bf16 x and M ≤ `cpu_packed_max_m`, and `packed_w4_gemm` otherwise;
- NVFP4 / MXFP4 (weight-only, or with FP4 inputs fake-quantized per row and group of 16 / 32 in
  torch first): `packed_fp4_gemm` over the E2M1 nibbles and one fp32 scale per group (NVFP4's
  local over global, MXFP4's power of two) for fp32 or bf16 x, any M;
- FP8 weights alone (weight_only_fp8: per channel or block; weight_only_mxfp8), and FP8 block or
  MXFP8 weights whose inputs are quantized per group (x fake-quantized per row and group first):
  `packed_gemm` over the weight dequantized once at load to fp32 and packed in column blocks,
  for fp32 or bf16 x, any M (an fp32 model's weight memory, beside the one-byte codes).
Each of these computes a row's numbers the same way whatever M.

CPU, torch's ops:
- weight-only int8, symmetric per channel: `torch._weight_int8pack_mm` for bf16 / fp16 x,
  M ≤ `cpu_packed_max_m` and K % 16 == 0 (other K crash or return garbage in torch 2.13); else
  dequantize + matmul (the op's fp32 kernel is scalar: fp32 activations always dequantize);
- weight-only int4: `torch._weight_int4pack_mm_for_cpu` on a weight repacked once at load, for
  bf16 / fp16 x, M ≤ `cpu_packed_max_m`, N % 16 == 0 and a CPU group size g' ∈ {32, 64, 128, 256}
  dividing the layer's group size (per channel: one group of K). Its cost grows with M while
  dequantize + matmul pays a fixed dequantize cost, hence the M bound;
- a8w8, symmetric weights and activations: x quantized with its static (or dynamic per-token)
  scale, `torch._int_mm` (exact int32 accumulation), then acc · x_scale · w_scale (+ bias): the
  `int8_gemm_ref` epilogue. Asymmetric → the reference;
- a8w8_fp8: x quantized to fp8 with its static scale and upcast (exact), a float matmul against
  the fp8 codes upcast once at load to the model dtype, then the `fp8_gemm_ref` epilogue;
  weight_only_fp8 the same with x as it comes (of the model dtype);
  block scales (FP8_BLOCK) and group scales (MXFP8): x fake-quantized per token and group (MXFP8
  inputs) or as it comes, a float matmul against the weight dequantized once at load (the
  reference's numbers, without its per-call dequantize);
  NVFP4 / MXFP4 without quantspec's kernels (or fp16 x) the same.

CUDA (`kernels.triton_usable`): the Triton kernels `w4a16_linear` / `w8a16_linear` for
M ≤ `cuda_weight_only_max_m`; above it the GEMM is compute-bound and cuBLAS runs on the weight
dequantized by a Triton kernel (`w4a16_dequantize` / `w8a16_dequantize`, which amortises over
the rows); group-wise int8 and MXFP8 weights `w8a16_linear` with their group scales for every M
(mxfp8's inputs fake-quantized per group first); `w8a8_linear` for every M; a8w8_fp8 (compute capability ≥ 8.9): `fp8_linear` below
`cuda_scaled_mm_min_m` rows, torch's `_scaled_mm` (cuBLASLt's FP8 GEMM, `fp8_scaled_mm_linear`)
from there for fp16 / bf16 activations; block-scaled fp8 with dynamic per-group inputs:
`fp8_block_linear` for every M; FP8 weights alone (weight_only_fp8, per channel) the int8
weight-only path, `w8a16_linear` decoding their E4M3 bytes (any compute capability); NVFP4 /
MXFP4 (weight-only or FP4 inputs, K a multiple of 32): `nvfp4_linear` / `mxfp4_linear` for every
M (any compute capability: they decode E2M1 without FP4 or FP8 instructions); what a kernel does
not take (asymmetric a8w8 or int8, fp8 inputs below sm_89) → the reference, dequantize + matmul.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from quantspec.errors import QuantSpecError
from quantspec.kernels.cpu import X_DTYPES as _GEMV_DTYPES

__all__ = ["DispatchPolicy", "KernelPath", "LinearKind", "LinearTraits", "ROW_PATHS", "dense_fp8", "select_kernel"]

_HALF_DTYPES = (torch.bfloat16, torch.float16)
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class LinearKind(str, enum.Enum):
    """What a layer computes, from its scheme (names follow the kernels)."""

    W4A16 = "w4a16"  # int4 weights, float activations (weight_only_int4)
    W8A16 = "w8a16"  # int8 weights, float activations (weight_only_int8)
    W8A8 = "w8a8"  # int8 weights × int8 activations (a8w8)
    FP8 = "fp8"  # fp8 E4M3 weights (× fp8 activations: a8w8_fp8; or fp8 weight-only)
    FP4 = "fp4"  # NVFP4 / MXFP4 weights (× FP4 activations: nvfp4, mxfp4; or weight-only)


class KernelPath(str, enum.Enum):
    """The op one call runs."""

    DEQUANT = "dequant"  # quant/ dequantize (+ activation fake-quant) + F.linear: the reference
    CPU_INT8PACK = "cpu_int8pack"  # torch._weight_int8pack_mm
    CPU_INT4PACK = "cpu_int4pack"  # torch._weight_int4pack_mm_for_cpu
    CPU_GEMV_INT8 = "cpu_gemv_int8"  # quantspec's CPU kernel (kernels/cpu)
    CPU_GEMV_INT4 = "cpu_gemv_int4"  # quantspec's CPU kernel (kernels/cpu)
    CPU_GEMV_FP4 = "cpu_gemv_fp4"  # quantspec's CPU kernel over E2M1 nibbles (x fake-quantized first for FP4 inputs)
    CPU_GEMV_DENSE = "cpu_gemv_dense"  # quantspec's packed fp32 GEMM over FP8 weights dequantized at load
    CPU_INT_MM = "cpu_int_mm"  # int8 activations × int8 weights via torch._int_mm
    CPU_FP8_UPCAST = "cpu_fp8_upcast"  # fp8 codes upcast (exact), float matmul, scale epilogue
    CPU_DEQUANTIZED = "cpu_dequantized"  # x fake-quantized per group, matmul on the weight dequantized at load
    TRITON_W4A16 = "triton_w4a16"
    TRITON_W8A16 = "triton_w8a16"
    TRITON_W8A8 = "triton_w8a8"
    TRITON_FP8 = "triton_fp8"
    TRITON_FP8_BLOCK = "triton_fp8_block"  # x quantized per token group, block-scaled fp8 GEMM
    TRITON_NVFP4 = "triton_nvfp4"  # E2M1 nibbles decoded in the GEMM (x quantized in it for NVFP4 inputs)
    TRITON_MXFP4 = "triton_mxfp4"  # the same with E8M0 group scales (x quantized in it for MXFP4 inputs)
    CUDA_DEQUANT_MM = "cuda_dequant_mm"  # Triton dequantize to the activation dtype + cuBLAS
    CUDA_SCALED_MM = "cuda_scaled_mm"  # x quantized by Triton, torch._scaled_mm (cuBLASLt / CUTLASS FP8)


# the CPU ops whose numbers for a row do not depend on the other rows of the call: a decode row
# and the same row inside a verification step agree bitwise on them
ROW_PATHS = frozenset({KernelPath.CPU_INT8PACK, KernelPath.CPU_INT4PACK,
                       KernelPath.CPU_GEMV_INT8, KernelPath.CPU_GEMV_INT4, KernelPath.CPU_GEMV_FP4,
                       KernelPath.CPU_GEMV_DENSE})


@dataclass(frozen=True)
class DispatchPolicy:
    """Thresholds and switches of the dispatch rule (module docstring).

    cuda_weight_only_max_m: rows up to which a weight-only call runs its Triton kernel on CUDA
        (above: dequantize + cuBLAS). On an H100 at 256 rows the Triton kernels take 30% (W4A16)
        and 6% (W8A16) less time than dequantize + cuBLAS over a Llama-3-8B layer's four
        projections; at 4096 rows dequantize + cuBLAS wins (`bench/kernels.py`).
    cuda_scaled_mm_min_m: rows from which an FP8 call with fp16 / bf16 activations runs
        `torch._scaled_mm` (below, and for fp32 activations: Triton).
    cpu_packed_max_m: rows up to which torch's packed CPU ops serve a call (prefill-sized inputs
        take dequantize + matmul); a row-invariant call (a decode or verification step) takes them
        for every M. quantspec's packed kernels take every M.
    fast: False forces the reference everywhere.
    cpu_kernels: False keeps quantspec's CPU kernels out (torch's ops only).
    cpu_pairs: quantspec's CPU kernels run bf16 x through AVX512-BF16's dot product where they
        have that path (False: their fp32 chain; benches and tests compare the two).
    cuda_graphs: on CUDA, decode steps replay CUDA graphs of the decoder stack
        (`infer/cuda/graphs.py`); False launches every kernel from Python (eager).
    cuda_fused_ops: on CUDA, the decoder stack runs its residual adds, norms, rotary embedding
        and SiLU as four fused Triton kernels per layer (`infer/cuda/layers.py`) instead of the
        modules' torch ops, in every step that does not capture residual streams (an H100's
        Llama-3-8B-shaped decode: 14–18% more tokens/s at batch 1, `bench/gpu_e2e.py`).
    cuda_int4_quartered: on CUDA, int4 layers whose K and group size are multiples of 128 (and
        whose zero points, if any, are integers) keep their codes in `kernels.w4a16.quarter_int4`'s
        layout, whose nibble-dots tiles meet x's columns as they are (sm_90: a third fewer
        instructions per weight at 17–256 rows, no trip through shared memory; on an H100 faster
        than the standard layout at 15 of the 16 Llama-3-8B shapes × M from 1 to 256, 1.2–1.35×
        at 64 rows, and a 5% shorter decode step at batch 32, the same within 2% at batch 1);
        `bench/kernels.py`'s "quartered" column and `bench/gpu_e2e.py`'s int4std model (False)
        measure it against the standard layout.
    cuda_pdl: on a GPU of compute capability 9.0 or more, the decoder stack's Triton kernels
        (in the CUDA graphs and the eager fused path) are programmatic dependent launches
        (`kernels._common.programmatic_launches`): each kernel's programs may start while the one
        before it finishes, and wait for its writes before they read; the same numbers, a shorter
        gap between kernels. Off by default; `bench/gpu_e2e.py`'s "programmatic launches" rows
        measure it against the default.
    cuda_split_kv: on CUDA, steps of at most 64 rows split each row's keys across programs in
        chunks at fixed positions (`infer/cuda/attention.py`, flash-decoding: a 4096-key context
        is read by 16 programs per head instead of one); a context within one chunk (256 keys, or
        the cache's longest sequence / 16) gets the same numbers. Off by default;
        `bench/gpu_e2e.py`'s "split-KV attention" rows measure it against the default.
    """

    cpu_packed_max_m: int = 64
    cuda_weight_only_max_m: int = 256
    cuda_scaled_mm_min_m: int = 512
    fast: bool = True
    cpu_kernels: bool = True
    cpu_pairs: bool = True
    cuda_graphs: bool = True
    cuda_fused_ops: bool = True
    cuda_int4_quartered: bool = True
    cuda_pdl: bool = False
    cuda_split_kv: bool = False

    def __post_init__(self) -> None:
        for name in ("cpu_packed_max_m", "cuda_weight_only_max_m", "cuda_scaled_mm_min_m"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 0:
                raise QuantSpecError(f"DispatchPolicy.{name} must be an int >= 0, got {v!r}")


@dataclass(frozen=True)
class LinearTraits:
    """The static facts about one layer that the dispatch rule reads (the backend that prepared
    the layer fills the device-specific ones)."""

    kind: LinearKind
    dtype: torch.dtype  # the model (compute) dtype the layer was prepared for
    weight_symmetric: bool
    weight_strategy: str  # tensor / channel / group / block
    act_mode: str | None  # None (weight-only), "static" or "dynamic"
    act_symmetric: bool = True
    cpu_int8pack: bool = False  # layout allows torch._weight_int8pack_mm
    cpu_int4_group: int | None = None  # group size for torch's CPU int4 op, when it applies
    cpu_gemv: bool = False  # quantspec's CPU kernels are built here and take this layout
    cpu_pairs: bool = False  # ... and run bf16 x through AVX512-BF16's dot product (int4: even groups)
    fp8_native: bool = False  # CUDA device with compute capability >= 8.9
    fp4_tiles: bool = False  # FP4 with K a multiple of 32: the Triton FP4 kernels' k tiles hold it


def _select_cuda(t: LinearTraits, device: torch.device, M: int, x_dtype: torch.dtype,
                 policy: DispatchPolicy) -> KernelPath:
    from quantspec.kernels import triton_usable

    if not triton_usable(device) or x_dtype not in FLOAT_DTYPES:
        return KernelPath.DEQUANT
    small = M <= policy.cuda_weight_only_max_m
    if t.kind is LinearKind.W4A16:
        return KernelPath.TRITON_W4A16 if small else KernelPath.CUDA_DEQUANT_MM
    if t.kind is LinearKind.W8A16:
        if not t.weight_symmetric or t.weight_strategy not in ("channel", "tensor", "group"):
            return KernelPath.DEQUANT
        # group scales: the kernel for every M (the dequantize kernel takes one scale a row)
        return KernelPath.TRITON_W8A16 if small or t.weight_strategy == "group" else KernelPath.CUDA_DEQUANT_MM
    if t.kind is LinearKind.W8A8:
        ok = t.weight_symmetric and t.act_symmetric and t.weight_strategy in ("channel", "tensor")
        return KernelPath.TRITON_W8A8 if ok else KernelPath.DEQUANT
    if t.kind is LinearKind.FP4:  # MXFP4's strategy is "group", NVFP4's "tensor_group"
        if not t.fp4_tiles:
            return KernelPath.DEQUANT
        return KernelPath.TRITON_MXFP4 if t.weight_strategy == "group" else KernelPath.TRITON_NVFP4
    if t.weight_strategy == "block":
        return KernelPath.TRITON_FP8_BLOCK if t.fp8_native and t.act_mode == "dynamic" else KernelPath.DEQUANT
    if t.weight_strategy == "group":  # MXFP8: W8A16's kernel with group scales (MXFP8 inputs fake-quantized first)
        return KernelPath.TRITON_W8A16
    if t.act_mode is None and t.weight_strategy in ("channel", "tensor"):  # FP8 weights alone: W8A16's kernels
        return KernelPath.TRITON_W8A16 if small else KernelPath.CUDA_DEQUANT_MM
    if not (t.fp8_native and t.act_mode == "static" and t.weight_strategy in ("channel", "tensor")):
        return KernelPath.DEQUANT
    # `_scaled_mm` writes bf16: half-precision activations only (an fp32 model keeps fp32 outputs)
    big = M >= policy.cuda_scaled_mm_min_m and x_dtype in _HALF_DTYPES
    return KernelPath.CUDA_SCALED_MM if big else KernelPath.TRITON_FP8


def dense_fp8(t: LinearTraits) -> bool:
    """An FP8 layer that quantspec's packed fp32 GEMM runs on its weight dequantized at load: FP8
    weights alone, or block / group (MXFP8) weights, whose inputs are quantized per group (per-channel
    weights with FP8 inputs keep their exact FP8 products: `CPU_FP8_UPCAST`)."""
    return t.kind is LinearKind.FP8 and (t.act_mode is None or t.weight_strategy in ("block", "group"))


def _select_cpu(t: LinearTraits, M: int, x_dtype: torch.dtype, policy: DispatchPolicy) -> KernelPath:
    packed_ok = x_dtype in _HALF_DTYPES and x_dtype == t.dtype and M <= policy.cpu_packed_max_m
    # quantspec's packed kernels take every M (their 8-row tiles run prefill at the FMA rate)
    gemv_ok = t.cpu_gemv and policy.cpu_kernels and x_dtype in _GEMV_DTYPES and x_dtype == t.dtype
    if t.kind is LinearKind.W8A16:
        if gemv_ok:
            return KernelPath.CPU_GEMV_INT8
        return KernelPath.CPU_INT8PACK if packed_ok and t.cpu_int8pack else KernelPath.DEQUANT
    if t.kind is LinearKind.W4A16:
        if gemv_ok and t.cpu_pairs and x_dtype == torch.bfloat16:
            return KernelPath.CPU_GEMV_INT4  # the pair path: before torch's op for every M
        if packed_ok and t.cpu_int4_group:
            return KernelPath.CPU_INT4PACK
        return KernelPath.CPU_GEMV_INT4 if gemv_ok else KernelPath.DEQUANT
    if t.kind is LinearKind.W8A8:
        ok = t.weight_symmetric and t.act_symmetric and t.weight_strategy in ("channel", "tensor")
        return KernelPath.CPU_INT_MM if ok else KernelPath.DEQUANT
    if t.kind is LinearKind.FP4:
        return KernelPath.CPU_GEMV_FP4 if gemv_ok else KernelPath.CPU_DEQUANTIZED
    if gemv_ok and dense_fp8(t):
        return KernelPath.CPU_GEMV_DENSE
    if t.weight_strategy in ("block", "group"):  # FP8 block or group scales (MXFP8's power-of-two ones)
        return KernelPath.CPU_DEQUANTIZED
    # FP8 inputs (a8w8_fp8), or float inputs of the dtype the codes are upcast to (weight_only_fp8)
    ok = (t.act_mode is not None or x_dtype == t.dtype) and t.weight_strategy in ("channel", "tensor")
    return KernelPath.CPU_FP8_UPCAST if ok else KernelPath.DEQUANT


def select_kernel(traits: LinearTraits, device: torch.device | str, M: int, x_dtype: torch.dtype,
                  policy: DispatchPolicy = DispatchPolicy()) -> KernelPath:
    """The op for one call: layer `traits`, x on `device` with M rows of dtype `x_dtype`.

    Example: an int8 per-channel layer prepared for bf16 on CPU with K % 16 == 0 and without
    quantspec's kernels → CPU_INT8PACK for a bf16 x with M=1, DEQUANT for M=65 or an fp32 x.
    """
    device = torch.device(device)
    if not policy.fast or M == 0:
        return KernelPath.DEQUANT
    if device.type == "cuda":
        return _select_cuda(traits, device, M, x_dtype, policy)
    if device.type != "cpu":
        return KernelPath.DEQUANT
    return _select_cpu(traits, M, x_dtype, policy)
