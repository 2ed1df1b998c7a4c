"""Quantized linears for inference, and the policy that picks an op for each call.

This file owns:
- `read_quantized_linear`: the compressed-tensors tensors of one Linear (`weight_packed` /
  `weight`, `weight_scale`, `weight_zero_point`, `weight_shape`, `input_scale`, ...) → codes
  + qparams, reading the layout from the scheme's *format* (never from a file name), for the
  formats quantspec writes and the ones compressed-tensors / llm-compressor write for the same
  schemes (including 8-bit `pack-quantized`, llm-compressor's choice for W8A16).
- `QuantLinear`: an `nn.Module` built from those tensors with `forward(x [..., K]) -> [..., N]`.
- `select_kernel`: the dispatch rule (kernels are mechanism, the policy is here; gemlite's
  `get_matmul_type` style): a pure function of the layer's traits, the device, M (rows of x)
  and x's dtype → a `KernelPath`.

Numbers: every path computes the reference `y = x̂ @ dequantize(q, scale, zp)ᵀ + b` where x̂ is
x for weight-only schemes and `dequantize(quantize(x))` with the static (or dynamic per-token)
input scale for a8w8 / a8w8_fp8 (all through `quant/primitives.py`; activations are quantized in
fp32 like the kernels do). Fast paths differ from it only by float rounding order.

Dispatch rule (`DispatchPolicy` holds the thresholds):

CPU, where quantspec's CPU kernels are built (`kernels/cpu.py`, AVX-512; `DispatchPolicy.cpu_kernels`):
- weight-only int8, symmetric per channel / tensor: `packed_w8_gemm` (codes repacked once into
  column blocks) for fp32 or bf16 x, any M (the default model's layers at M = 1: ~4 ms a step vs
  ~6 ms for the row-major kernel it replaced, 1.6x at M = 8; 2 cores). Prefill through the
  default model's 30 layers, fp32 x, vs dequantize + matmul: int8 1.6x (130 rows) / 1.06x (512),
  int4 2.3x / 1.3x (`bench/kernels_cpu.py` prefill table);
- bf16 x where the CPU has AVX512-BF16 (`LinearTraits.cpu_pairs`; int8, and int4 with even
  groups): the same kernels' pair path, every M — bf16 x and the codes (exact in bf16) through
  vdpbf16ps, twice the fp32 FMA rate: over the default model's 30 layers (2 cores) int8 11 rows
  14.3 → 8.8 ms, 130 rows 148 → 71; int4 g64 vs torch's packed int4 op 1 row 3.73 → 3.57 ms,
  11 rows 17.0 → 8.5, 130 rows 205 → 104 (so torch's op is no longer taken there);
- weight-only int4 with groups dividing K (or per channel), without the pair path: torch's
  packed int4 op when it applies (bf16 x, M ≤ `cpu_packed_max_m`; ~10% faster than quantspec's
  fp32-chain kernel at M = 1 on Zen 4), else `packed_w4_gemm` (fp32 x, more rows, or a layout
  torch's op refuses: N % 16, groups below 32);
- the packed blocks are then the codes' only copy (no row-major int8 [N, K] kept beside them:
  −101 MiB for the default model's int8 and int4 artifacts); `codes()` unpacks them;
- each row's numbers are the same whatever M, and an engine decode step (`infer/step_rows.py`)
  takes these row paths for every M, so verification rows equal decode rows bitwise.

CPU, torch's ops (measured with 1 thread on SmolLM2's shapes, see the issue-3 report):
- weight-only int8, symmetric per-channel: `torch._weight_int8pack_mm` when x is bf16/fp16,
  M ≤ `cpu_packed_max_m` (64) and K % 16 == 0 (other K crash or return garbage in torch 2.13);
  else dequantize + matmul. The op's fp32 kernel is scalar: ~10× slower than an fp32 dense
  matmul, slower even than dequantizing on the fly, so fp32 activations always take
  dequantize + matmul (load the model in bf16 for the packed speed).
- weight-only int4 (sym or asym): `torch._weight_int4pack_mm_for_cpu` on a weight repacked once
  at load (`_convert_weight_to_int4pack_for_cpu`), same conditions (bf16/fp16, M ≤ 64), plus
  N % 16 == 0 and a CPU group size g' ∈ {32, 64, 128, 256} dividing the layer's group size (per-
  channel = one group of K): the op dequantizes w = (u − 8)·scale + zero with u the unsigned
  nibble, i.e. u − 8 = our code q, so zero = −zp·scale (integer or float zp; 0 when symmetric)
  and a group of g is g/g' groups of g' with repeated scales. Else dequantize + matmul. The packed ops cost grows
  linearly with M while dequantize + matmul has a fixed dequantize cost, hence the M bound.
- a8w8, symmetric weights and activations: quantize x with the static (or dynamic per-token)
  scale, `torch._int_mm` (exact int32 accumulate, fast on CPU for every shape tried), then
  acc · x_scale · w_scale (+ bias): the `int8_gemm_ref` epilogue. Asymmetric → reference.
- a8w8_fp8: quantize x to fp8 with the static scale, upcast (exact), matmul against the fp8 weight
  codes upcast once at load to the model dtype (converting fp8 on CPU costs ~35× the matmul, and
  `torch._scaled_mm` on CPU is ~80× slower than an fp32 matmul), then the `fp8_gemm_ref`
  epilogue. On CPU an fp8 layer therefore holds its codes in the model dtype (no memory saving).

CUDA (`kernels.triton_usable`): the Triton kernels — `w4a16_linear` / `w8a16_linear` for
M ≤ `cuda_weight_only_max_m` (64; above it the GEMM is compute-bound, cuBLAS on the dequantized
weight wins and the dequantize cost is amortised over M — this bound is not measured here, no
GPU), `w8a8_linear` and `fp8_linear` (compute capability ≥ 8.9) for every M; anything a kernel
does not take (asymmetric a8w8, group-wise int8/fp8, fp8 below sm_89) → dequantize + cuBLAS.
"""

from __future__ import annotations

import enum
import sys
from dataclasses import dataclass
from typing import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from quantspec.errors import QuantSpecError
from quantspec.infer.step_rows import in_decode_step
from quantspec.kernels.cpu import X_DTYPES as _GEMV_DTYPES
from quantspec.quant.args import (
    FORMAT_FLOAT_QUANTIZED,
    FORMAT_INT_QUANTIZED,
    FORMAT_NAIVE_QUANTIZED,
    FORMAT_PACK_QUANTIZED,
    QuantArgs,
    QuantScheme,
)
from quantspec.quant.packing import pack_int4, unpack_int4
from quantspec.quant.primitives import (choose_qparams, dequantize, quantize, storage_dtype,
                                        zero_point_dtype)

__all__ = [
    "CPU_INT4_GROUP_SIZES",
    "DispatchPolicy",
    "KernelPath",
    "LinearKind",
    "LinearTraits",
    "QuantLinear",
    "QuantizedLinearTensors",
    "expected_linear_tensors",
    "read_quantized_linear",
    "select_kernel",
]

CPU_INT4_GROUP_SIZES = (256, 128, 64, 32)  # what `_weight_int4pack_mm_for_cpu` accepts
CPU_INT8PACK_K_MULTIPLE = 16  # `_weight_int8pack_mm` crashes / is wrong for other K (torch 2.13)
CPU_INT4PACK_N_MULTIPLE = 16  # `_convert_weight_to_int4pack_for_cpu` refuses other N
_HALF_DTYPES = (torch.bfloat16, torch.float16)
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_WORD_BITS = 32
# torch's packed CPU ops assume allocator-aligned operands: a tensor viewed straight out of a
# safetensors buffer (any offset) made `_weight_int8pack_mm` segfault, so buffers are re-homed
_ALIGN_BYTES = 64


class LinearKind(str, enum.Enum):
    """What a layer computes, from its scheme (names follow the kernels)."""

    W4A16 = "w4a16"  # int4 weights, float activations (weight_only_int4)
    W8A16 = "w8a16"  # int8 weights, float activations (weight_only_int8)
    W8A8 = "w8a8"  # int8 weights × int8 activations (a8w8)
    FP8 = "fp8"  # fp8 E4M3 weights (× fp8 activations: a8w8_fp8; or fp8 weight-only)


class KernelPath(str, enum.Enum):
    """The op one call runs."""

    DEQUANT = "dequant"  # quant/ dequantize (+ activation fake-quant) + F.linear: the reference
    CPU_INT8PACK = "cpu_int8pack"  # torch._weight_int8pack_mm
    CPU_INT4PACK = "cpu_int4pack"  # torch._weight_int4pack_mm_for_cpu
    CPU_GEMV_INT8 = "cpu_gemv_int8"  # quantspec's CPU kernel (kernels/cpu.py)
    CPU_GEMV_INT4 = "cpu_gemv_int4"  # quantspec's CPU kernel (kernels/cpu.py)
    CPU_INT_MM = "cpu_int_mm"  # int8 activations × int8 weights via torch._int_mm
    CPU_FP8_UPCAST = "cpu_fp8_upcast"  # fp8 codes upcast (exact), float matmul, scale epilogue
    TRITON_W4A16 = "triton_w4a16"
    TRITON_W8A16 = "triton_w8a16"
    TRITON_W8A8 = "triton_w8a8"
    TRITON_FP8 = "triton_fp8"


# CPU ops whose cost grows with M and that serve 1..cpu_packed_max_m rows with the same per-row
# numbers (decode and verification rows agree bitwise)
_CPU_ROW_PATHS = frozenset({KernelPath.CPU_INT8PACK, KernelPath.CPU_INT4PACK,
                            KernelPath.CPU_GEMV_INT8, KernelPath.CPU_GEMV_INT4})


@dataclass(frozen=True)
class DispatchPolicy:
    """Thresholds of the dispatch rule (module docstring). `fast=False` forces the reference."""

    # up to 64 rows on torch's packed ops (slower than dequant + matmul above ~32 rows, but the
    # same per-row numbers as a 1-row decode step: bf16 speculative verification of a batch stays
    # lossless), and every row of an engine decode step (`infer/step_rows.py`); prefill-sized
    # inputs take dequant + matmul. quantspec's packed kernels take every M.
    cpu_packed_max_m: int = 64
    cuda_weight_only_max_m: int = 64
    fast: bool = True
    cpu_kernels: bool = True  # False: torch's ops only on CPU, never quantspec's kernels

    def __post_init__(self) -> None:
        for name in ("cpu_packed_max_m", "cuda_weight_only_max_m"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 0:
                raise QuantSpecError(f"DispatchPolicy.{name} must be an int >= 0, got {v!r}")


@dataclass(frozen=True)
class LinearTraits:
    """The static facts about one layer that the dispatch rule reads."""

    kind: LinearKind
    dtype: torch.dtype  # the model (compute) dtype the layer was prepared for
    weight_symmetric: bool
    weight_strategy: str  # tensor / channel / group
    act_mode: str | None  # None (weight-only), "static" or "dynamic"
    act_symmetric: bool = True
    cpu_int8pack: bool = False  # layout allows torch._weight_int8pack_mm
    cpu_int4_group: int | None = None  # group size for torch's CPU int4 op, when it applies
    cpu_gemv: bool = False  # quantspec's CPU kernels are built here and take this layout
    cpu_pairs: bool = False  # ... and run bf16 x through AVX512-BF16's dot product (int4: even groups)
    fp8_native: bool = False  # CUDA device with compute capability >= 8.9


def select_kernel(traits: LinearTraits, device: torch.device | str, M: int, x_dtype: torch.dtype,
                  policy: DispatchPolicy = DispatchPolicy()) -> KernelPath:
    """The op for one call: layer `traits`, x on `device` with M rows of dtype `x_dtype`.

    Example: an int8 per-channel layer prepared for bf16 on CPU with K % 16 == 0 →
    CPU_INT8PACK for a bf16 x with M=1, DEQUANT for M=65 or for an fp32 x (where quantspec's CPU
    kernels are not built).
    """
    device = torch.device(device)
    t = traits
    if not policy.fast or M == 0:
        return KernelPath.DEQUANT
    if device.type == "cuda":
        from quantspec.kernels import triton_usable

        if not triton_usable(device) or x_dtype not in _FLOAT_DTYPES:
            return KernelPath.DEQUANT
        if t.kind is LinearKind.W4A16:
            return KernelPath.TRITON_W4A16 if M <= policy.cuda_weight_only_max_m \
                else KernelPath.DEQUANT
        if t.kind is LinearKind.W8A16:
            ok = t.weight_symmetric and t.weight_strategy in ("channel", "tensor")
            return KernelPath.TRITON_W8A16 if ok and M <= policy.cuda_weight_only_max_m \
                else KernelPath.DEQUANT
        if t.kind is LinearKind.W8A8:
            ok = t.weight_symmetric and t.act_symmetric and t.weight_strategy in ("channel", "tensor")
            return KernelPath.TRITON_W8A8 if ok else KernelPath.DEQUANT
        ok = (t.fp8_native and t.act_mode == "static"
              and t.weight_strategy in ("channel", "tensor"))
        return KernelPath.TRITON_FP8 if ok else KernelPath.DEQUANT
    if device.type != "cpu":
        return KernelPath.DEQUANT
    packed_ok = x_dtype in _HALF_DTYPES and x_dtype == t.dtype and M <= policy.cpu_packed_max_m
    # quantspec's packed kernels take every M: their 8-row tiles run prefill at the FMA rate, no
    # slower than dequantize + matmul on the default model's layers (bench/kernels_cpu.py)
    gemv_ok = t.cpu_gemv and policy.cpu_kernels and x_dtype in _GEMV_DTYPES and x_dtype == t.dtype
    if t.kind is LinearKind.W8A16:
        if gemv_ok:
            return KernelPath.CPU_GEMV_INT8
        return KernelPath.CPU_INT8PACK if packed_ok and t.cpu_int8pack else KernelPath.DEQUANT
    if t.kind is LinearKind.W4A16:
        if gemv_ok and t.cpu_pairs and x_dtype == torch.bfloat16:
            return KernelPath.CPU_GEMV_INT4  # quantspec's pair path: ≤ torch's op at M = 1, 2x at 11 rows
        if packed_ok and t.cpu_int4_group:
            return KernelPath.CPU_INT4PACK
        return KernelPath.CPU_GEMV_INT4 if gemv_ok else KernelPath.DEQUANT
    if t.kind is LinearKind.W8A8:
        ok = t.weight_symmetric and t.act_symmetric and t.weight_strategy in ("channel", "tensor")
        return KernelPath.CPU_INT_MM if ok else KernelPath.DEQUANT
    ok = t.act_mode is not None and t.weight_strategy in ("channel", "tensor")
    return KernelPath.CPU_FP8_UPCAST if ok else KernelPath.DEQUANT


# ---------------------------------------------------------------------------------------------
# reading one Linear's compressed-tensors tensors
# ---------------------------------------------------------------------------------------------

@dataclass
class QuantizedLinearTensors:
    """One quantized Linear decoded from a checkpoint: codes q [N, K] (int8 in [q_min, q_max]
    or float8_e4m3fn), scale / zero point shaped per strategy (zero point None when symmetric),
    the static input scale / zero point (None when weight-only or dynamic) and the float bias."""

    q: torch.Tensor
    scale: torch.Tensor
    zero_point: torch.Tensor | None
    weight_args: QuantArgs
    input_args: QuantArgs | None = None
    input_scale: torch.Tensor | None = None
    input_zero_point: torch.Tensor | None = None
    bias: torch.Tensor | None = None


def _packed_words(cols: int, num_bits: int) -> int:
    return -(-cols * num_bits // _WORD_BITS)


def _unpack_int8_words(packed: torch.Tensor, shape: tuple[int, int], packed_dim: int = 1
                       ) -> torch.Tensor:
    """compressed-tensors' 8-bit `pack_to_int32` inverse: 4 codes per int32 word, element i in
    byte i % 4 (lowest first) holding q + 128 → int8 codes of `shape`."""
    if sys.byteorder != "little":
        raise QuantSpecError("reading 8-bit pack-quantized weights needs a little-endian host")
    p = packed.t() if packed_dim == 0 else packed
    rows, cols = (shape[1], shape[0]) if packed_dim == 0 else shape
    u = p.contiguous().view(torch.uint8).reshape(p.shape[0], -1)[:rows, :cols]  # [rows, cols]
    q = (u.to(torch.int16) - 128).to(torch.int8)
    return (q.t() if packed_dim == 0 else q).contiguous()


def _unpack_words(packed: torch.Tensor, num_bits: int, shape: tuple[int, int], packed_dim: int,
                  where: str) -> torch.Tensor:
    if packed.dtype != torch.int32 or packed.ndim != 2:
        raise QuantSpecError(f"{where} must be a 2-D int32 tensor, got {packed.dtype} "
                             f"{tuple(packed.shape)}; the checkpoint is corrupt")
    if num_bits == 4:
        return unpack_int4(packed, shape, packed_dim=packed_dim)
    if num_bits == 8:
        want_words = _packed_words(shape[packed_dim], 8)
        have = packed.shape[packed_dim]
        other = shape[1 - packed_dim]
        if have != want_words or packed.shape[1 - packed_dim] != other:
            raise QuantSpecError(f"{where} has shape {tuple(packed.shape)}, which cannot hold "
                                 f"8-bit codes of shape {tuple(shape)}; the checkpoint is corrupt")
        return _unpack_int8_words(packed, shape, packed_dim)
    raise QuantSpecError(f"{where}: {num_bits}-bit packed weights are unsupported; quantspec "
                         "runs 4- and 8-bit int weights")


def expected_linear_tensors(prefix: str, scheme: QuantScheme, out_features: int,
                            in_features: int) -> dict[str, tuple[int, ...] | None]:
    """The tensors a checkpoint must hold for one quantized Linear, with their shapes
    (None where several shapes are accepted, e.g. a per-tensor scale as [1] or [])."""
    w = scheme.weights
    if w is None:
        raise QuantSpecError(f"{prefix}: the scheme quantizes only activations; quantspec needs "
                             "quantized weights (or add the module to `ignore`)")
    N, K = out_features, in_features
    fmt = scheme.format
    if w.strategy == "group":
        if K % w.group_size:
            raise QuantSpecError(f"{prefix}: group_size {w.group_size} does not divide K={K}; "
                                 "re-quantize this layer with a group size that divides it")
        sshape: tuple[int, ...] | None = (N, K // w.group_size)
    elif w.strategy == "channel":
        sshape = (N, 1)
    elif w.strategy == "tensor":
        sshape = None
    else:
        raise QuantSpecError(f"{prefix}: weight strategy {w.strategy!r} is unsupported; use "
                             "tensor, channel or group")
    out: dict[str, tuple[int, ...] | None] = {}
    if fmt == FORMAT_PACK_QUANTIZED:
        if w.type != "int" or w.num_bits not in (4, 8):
            raise QuantSpecError(f"{prefix}: pack-quantized {w.num_bits}-bit {w.type} weights are "
                                 "unsupported; quantspec runs 4- and 8-bit int weights")
        out[f"{prefix}.weight_packed"] = (N, _packed_words(K, w.num_bits))
        out[f"{prefix}.weight_shape"] = (2,)
        if not w.symmetric:
            if w.strategy in ("group", "channel") and w.zp_dtype is not None:
                out[f"{prefix}.weight_zero_point"] = sshape  # float zero points: unpacked
            elif w.strategy in ("group", "channel"):
                G = sshape[1]
                out[f"{prefix}.weight_zero_point"] = (_packed_words(N, w.num_bits), G)
            else:
                out[f"{prefix}.weight_zero_point"] = None
    elif fmt in (FORMAT_INT_QUANTIZED, FORMAT_FLOAT_QUANTIZED, FORMAT_NAIVE_QUANTIZED):
        if w.type == "int" and w.num_bits != 8:
            raise QuantSpecError(f"{prefix}: {w.num_bits}-bit int weights in format {fmt!r} are "
                                 "unsupported; quantspec runs them as pack-quantized")
        out[f"{prefix}.weight"] = (N, K)
        if not w.symmetric:
            out[f"{prefix}.weight_zero_point"] = sshape
    else:
        raise QuantSpecError(f"{prefix}: weight format {fmt!r} is unsupported; supported: "
                             f"{FORMAT_PACK_QUANTIZED}, {FORMAT_INT_QUANTIZED}, "
                             f"{FORMAT_FLOAT_QUANTIZED}, {FORMAT_NAIVE_QUANTIZED}")
    out[f"{prefix}.weight_scale"] = sshape
    ia = scheme.input_activations
    if ia is not None and not ia.dynamic:
        out[f"{prefix}.input_scale"] = None
        if not ia.symmetric:
            out[f"{prefix}.input_zero_point"] = None
    return out


def _check_shape(name: str, t: torch.Tensor, shape: tuple[int, ...] | None) -> None:
    if shape is not None and tuple(t.shape) != tuple(shape):
        raise QuantSpecError(f"{name} has shape {tuple(t.shape)}, expected {tuple(shape)} from "
                             "config.json; the checkpoint does not match its config")


def _scalar(name: str, t: torch.Tensor) -> torch.Tensor:
    if t.numel() != 1:
        raise QuantSpecError(f"{name} must hold one value (per-tensor), got shape "
                             f"{tuple(t.shape)}; per-token/-channel static scales are unsupported")
    return t.reshape(1)


def _weight_zero_point(name: str, z: torch.Tensor, w: QuantArgs) -> torch.Tensor:
    """The stored zero point checked against the scheme: a float `zp_dtype` needs that float
    tensor (kept as fp32, exact), integer zero points an integer tensor (→ int8)."""
    if w.zp_dtype is not None:
        want = zero_point_dtype(w)
        if z.dtype != want:
            raise QuantSpecError(f"{name} has dtype {z.dtype} but the config's zp_dtype is "
                                 f"{w.zp_dtype}; the checkpoint does not match its config")
        return z.float()
    if z.is_floating_point():
        raise QuantSpecError(f"{name} holds float zero points ({z.dtype}) but the config has no "
                             "float zp_dtype; add zp_dtype to its weights args or re-quantize")
    return z.to(torch.int8)


def read_quantized_linear(tensors: Mapping[str, torch.Tensor], prefix: str, scheme: QuantScheme,
                          out_features: int, in_features: int) -> QuantizedLinearTensors:
    """Decode one Linear's compressed-tensors tensors (layout from `scheme.format`).

    Raises `QuantSpecError` naming the first missing or mis-shaped tensor; a static a8w8 /
    a8w8_fp8 scheme without `input_scale` says to re-quantize with calibration.
    """
    expected = expected_linear_tensors(prefix, scheme, out_features, in_features)
    for name, shape in expected.items():
        if name not in tensors:
            if name.endswith(".input_scale"):
                raise QuantSpecError(f"{name.rsplit('.', 1)[0]} has no input_scale but its scheme "
                                     "has static input activations: quantize with --calib "
                                     "(a calibration table) to store one")
            raise QuantSpecError(f"tensor {name!r} is missing from the checkpoint; it is "
                                 "incomplete — re-download or re-create it")
        _check_shape(name, tensors[name], shape)
    w = scheme.weights
    N, K = out_features, in_features
    scale = tensors[f"{prefix}.weight_scale"]
    if not scale.is_floating_point():
        raise QuantSpecError(f"{prefix}.weight_scale has dtype {scale.dtype}; expected a float")
    if w.strategy == "tensor":
        scale = _scalar(f"{prefix}.weight_scale", scale)
    zp = None
    if scheme.format == FORMAT_PACK_QUANTIZED:
        shape = tuple(int(v) for v in tensors[f"{prefix}.weight_shape"].tolist())
        if shape != (N, K):
            raise QuantSpecError(f"{prefix}.weight_shape is {list(shape)} but the model needs "
                                 f"[{N}, {K}]; the checkpoint does not match its config")
        q = _unpack_words(tensors[f"{prefix}.weight_packed"], w.num_bits, (N, K), 1,
                          f"{prefix}.weight_packed")
        if not w.symmetric:
            z = tensors[f"{prefix}.weight_zero_point"]
            if w.strategy in ("group", "channel") and w.zp_dtype is None:
                if z.is_floating_point():
                    _weight_zero_point(f"{prefix}.weight_zero_point", z, w)  # raises
                zp = _unpack_words(z, w.num_bits, tuple(scale.shape), 0,
                                   f"{prefix}.weight_zero_point")
            else:
                z = _scalar(f"{prefix}.weight_zero_point", z) if w.strategy == "tensor" else z
                zp = _weight_zero_point(f"{prefix}.weight_zero_point", z, w)
    else:
        q = tensors[f"{prefix}.weight"]
        if q.dtype != storage_dtype(w):
            raise QuantSpecError(f"{prefix}.weight has dtype {q.dtype}, expected "
                                 f"{storage_dtype(w)} for {w.num_bits}-bit {w.type} weights")
        if not w.symmetric:
            zp = tensors[f"{prefix}.weight_zero_point"]
            zp = _scalar(f"{prefix}.weight_zero_point", zp) if w.strategy == "tensor" else zp
            zp = _weight_zero_point(f"{prefix}.weight_zero_point", zp, w)
    ia = scheme.input_activations
    in_scale = in_zp = None
    if ia is not None and not ia.dynamic:
        in_scale = _scalar(f"{prefix}.input_scale", tensors[f"{prefix}.input_scale"]).float()
        if not bool((in_scale > 0).all()) or not bool(torch.isfinite(in_scale).all()):
            raise QuantSpecError(f"{prefix}.input_scale is {float(in_scale)}; it must be a finite "
                                 "value > 0 — recalibrate the model")
        if not ia.symmetric:
            in_zp = _scalar(f"{prefix}.input_zero_point",
                            tensors[f"{prefix}.input_zero_point"]).to(storage_dtype(ia))
    return QuantizedLinearTensors(q=q, scale=scale, zero_point=zp, weight_args=w, input_args=ia,
                                  input_scale=in_scale, input_zero_point=in_zp,
                                  bias=tensors.get(f"{prefix}.bias"))


# ---------------------------------------------------------------------------------------------
# the module
# ---------------------------------------------------------------------------------------------

def _aligned(t: torch.Tensor | None) -> torch.Tensor | None:
    """`t` contiguous and at an allocator-aligned address (cloned only when needed)."""
    if t is None:
        return None
    t = t.contiguous()
    return t if t.data_ptr() % _ALIGN_BYTES == 0 else t.clone()


def _kind(w: QuantArgs, ia: QuantArgs | None) -> LinearKind:
    if w.type == "float":
        return LinearKind.FP8
    if w.num_bits == 4:
        if ia is not None:
            raise QuantSpecError("int4 weights with quantized activations (W4A8) are unsupported; "
                                 "use weight_only_int4")
        return LinearKind.W4A16
    if w.num_bits == 8:
        if ia is None:
            return LinearKind.W8A16
        if ia.type != "int" or ia.num_bits != 8:
            raise QuantSpecError("int8 weights need int8 activations (a8w8) or none; got "
                                 f"{ia.num_bits}-bit {ia.type} activations")
        return LinearKind.W8A8
    raise QuantSpecError(f"{w.num_bits}-bit int weights are unsupported; quantspec runs 4- and "
                         "8-bit int weights and fp8")


def _cpu_gemv_layout(kind: LinearKind, w: QuantArgs, K: int) -> bool:
    """Whether quantspec's CPU kernels take this layer's layout (int8: symmetric per channel or
    tensor; int4: groups dividing K, or per channel)."""
    if kind is LinearKind.W8A16:
        return w.symmetric and w.strategy in ("channel", "tensor")
    if kind is LinearKind.W4A16:
        g = w.group_size if w.strategy == "group" else K if w.strategy == "channel" else None
        return g is not None and 0 < g and K % g == 0
    return False


def _cpu_int4_group(w: QuantArgs, K: int) -> int | None:
    """Largest group size torch's CPU int4 op takes that tiles the layer's groups exactly."""
    g = w.group_size if w.strategy == "group" else K if w.strategy == "channel" else None
    if g is None:
        return None
    for cand in CPU_INT4_GROUP_SIZES:
        if g % cand == 0 and K % cand == 0:
            return cand
    return None


class QuantLinear(nn.Module):
    """A Linear whose weight is int4 / int8 / fp8 codes + scales (+ static input scale).

    Buffers (fp32 scales; codes in their storage dtype):
      weight_scale [N, K/g] | [N, 1] | [1], weight_zero_point like it (asymmetric; int8, or
      fp32 for a float zp_dtype) or None,
      input_scale [1] / input_zero_point [1] (static activations) or None, bias [N] or None;
      codes: `qweight` int8 [N, K] (int8; int4 on CPU; None where quantspec's CPU kernels keep
      them packed: `int8_cpu` [NB, K, 32], `int4_cpu` [NB, K, 16]), `weight_packed` int32 [N, K/8] (int4 on
      CUDA, read as stored by the Triton kernel), `weight_fp8` float8 [N, K] (fp8 on CUDA) or
      `weight_upcast` [N, K] in the model dtype (fp8 on CPU);
      CPU packed-op layouts when they apply (bf16/fp16 models): `int4pack` + `int4_scales_zeros`
      [K/g', N, 2], `int8pack_scale` [N].
    The layer is prepared for one device and dtype (`device`, `dtype` at construction); move a
    model by loading it again on the other device.
    """

    def __init__(self, t: QuantizedLinearTensors, *, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", policy: DispatchPolicy | None = None,
                 name: str = "") -> None:
        super().__init__()
        if dtype not in _FLOAT_DTYPES:
            raise QuantSpecError(f"dtype {dtype} unsupported; use float32, bfloat16 or float16")
        device = torch.device(device)
        w, ia = t.weight_args, t.input_args
        if t.q.ndim != 2:
            raise QuantSpecError(f"{name}: codes must be 2-D [N, K], got {tuple(t.q.shape)}")
        if ia is not None and not ia.dynamic and t.input_scale is None:
            raise QuantSpecError(f"{name} has no input_scale but its scheme has static input "
                                 "activations: quantize with --calib to store one")
        if ia is not None and ia.strategy not in ("tensor", "token"):
            raise QuantSpecError(f"{name}: input activation strategy {ia.strategy!r} is "
                                 "unsupported; use tensor (static) or token (dynamic)")
        self.name = name
        self.out_features, self.in_features = N, K = t.q.shape
        self.weight_args, self.input_args = w, ia
        self.dtype = dtype
        self.policy = policy or DispatchPolicy()
        kind = _kind(w, ia)
        on_cpu = device.type == "cpu"
        half = dtype in _HALF_DTYPES
        cpu_int4_group = _cpu_int4_group(w, K) if (kind is LinearKind.W4A16 and on_cpu and half
                                                   and N % CPU_INT4PACK_N_MULTIPLE == 0) else None
        cpu_int8pack = (kind is LinearKind.W8A16 and on_cpu and half and w.symmetric
                        and w.strategy in ("channel", "tensor") and K % CPU_INT8PACK_K_MULTIPLE == 0)
        cpu_gemv = False
        if on_cpu and dtype in _GEMV_DTYPES and self.policy.fast and self.policy.cpu_kernels \
                and _cpu_gemv_layout(kind, w, K):
            from quantspec.kernels.cpu import cpu_kernels

            cpu_gemv = cpu_kernels() is not None
        cpu_pairs = False
        if cpu_gemv and dtype == torch.bfloat16 and K % 2 == 0:
            from quantspec.kernels.cpu import pair_path_available

            group = w.group_size if w.strategy == "group" else K
            cpu_pairs = pair_path_available() and (kind is not LinearKind.W4A16 or group % 2 == 0)
        fp8_native = False
        if kind is LinearKind.FP8 and device.type == "cuda" and torch.cuda.is_available():
            fp8_native = torch.cuda.get_device_capability(device) >= (8, 9)
        self.traits = LinearTraits(
            kind=kind, dtype=dtype, weight_symmetric=w.symmetric, weight_strategy=w.strategy,
            act_mode=None if ia is None else ("dynamic" if ia.dynamic else "static"),
            act_symmetric=True if ia is None else ia.symmetric,
            cpu_int8pack=cpu_int8pack, cpu_int4_group=cpu_int4_group, cpu_gemv=cpu_gemv, cpu_pairs=cpu_pairs,
            fp8_native=fp8_native)

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
        q = t.q.detach()
        for buf in ("qweight", "weight_packed", "weight_fp8", "weight_upcast", "int4pack",
                    "int4_scales_zeros", "int8pack_scale", "w_scale_vec", "int4_cpu",
                    "int4_cpu_scale", "int4_cpu_offset", "int8_cpu", "bias_fp32"):
            self.register_buffer(buf, None)
        if kind is LinearKind.FP8:
            if on_cpu:
                self.weight_upcast = q.to(device).to(dtype)  # [N, K], exact: E4M3 ⊂ bf16 ⊂ fp32
            else:
                self.weight_fp8 = q.to(device)
        elif kind is LinearKind.W4A16 and not on_cpu:
            self.weight_packed = pack_int4(q.to(torch.int8)).to(device)  # [N, ceil(K/8)]
        else:
            self.qweight = q.to(device=device, dtype=torch.int8)  # [N, K]
        if w.strategy in ("channel", "tensor"):
            self.w_scale_vec = scale.reshape(-1).expand(N).contiguous()  # [N] fp32
        if cpu_int8pack:
            self.int8pack_scale = self.w_scale_vec.to(dtype)  # [N]
        # the path a decode-sized x of the prepared dtype takes on CPU, decided once (forward's
        # shortcut; `select_kernel` gives the same answer, at a few µs per call)
        self._packed_path = None
        if on_cpu and self.policy.fast:
            path = select_kernel(self.traits, device, 1, dtype, self.policy)
            self._packed_path = path if path in _CPU_ROW_PATHS else None
        if self._packed_path is KernelPath.CPU_GEMV_INT4:
            self._prepare_gemv_int4(q, scale, zp)
        elif self._packed_path is KernelPath.CPU_GEMV_INT8:
            self._prepare_gemv_int8()
        if cpu_int4_group and self._packed_path is not KernelPath.CPU_GEMV_INT4:
            self._prepare_cpu_int4(q, scale, zp, cpu_int4_group)  # torch's int4 op is the path
        if cpu_gemv and kind in (LinearKind.W8A16, LinearKind.W4A16):
            # quantspec's packed blocks serve every M torch's op does not (prefill included), so
            # they are the codes' only copy: no row-major [N, K] int8 beside them (`codes()` unpacks)
            if kind is LinearKind.W8A16 and self.int8_cpu is None:
                self._prepare_gemv_int8()
            if kind is LinearKind.W4A16 and self.int4_cpu is None:
                self._prepare_gemv_int4(q, scale, zp)
            self.qweight = None
        if self._packed_path in (KernelPath.CPU_GEMV_INT4, KernelPath.CPU_GEMV_INT8) \
                and t.bias is not None:
            self.bias_fp32 = t.bias.detach().to(device, torch.float32)
        for name, buf in list(self._buffers.items()):
            self._buffers[name] = _aligned(buf)

    def _prepare_cpu_int4(self, q: torch.Tensor, scale: torch.Tensor, zp: torch.Tensor | None,
                          g_cpu: int) -> None:
        N, K = q.shape
        u = (q.to(torch.int32) + 8).contiguous()  # [N, K] unsigned nibbles, u - 8 = q
        self.int4pack = torch._convert_weight_to_int4pack_for_cpu(u, 1)
        reps = K // g_cpu // scale.shape[1]  # each stored group → `reps` CPU groups
        s = scale.repeat_interleave(reps, dim=1)  # [N, K/g'] fp32
        z = torch.zeros_like(s) if zp is None else \
            -zp.to(torch.float32).repeat_interleave(reps, dim=1) * s  # w = q*s + (−zp*s)
        self.int4_scales_zeros = torch.stack([s.t(), z.t()], dim=-1).to(self.dtype).contiguous()

    def _prepare_gemv_int4(self, q: torch.Tensor, scale: torch.Tensor, zp: torch.Tensor | None) -> None:
        from quantspec.kernels.cpu import pack_w4

        s = scale.reshape(self.out_features, -1).float()  # [N, G] (G = 1 per channel)
        neg_zs = torch.zeros_like(s) if zp is None else -zp.to(torch.float32).reshape(s.shape) * s  # w = q*s + (−zp*s)
        # column blocks [NB, K, 16] bytes, [NB, G, 32] scale / offset (kernels/cpu.py)
        self.int4_cpu, self.int4_cpu_scale, self.int4_cpu_offset = pack_w4(q.to(torch.int8), s, neg_zs)

    def _prepare_gemv_int8(self) -> None:
        from quantspec.kernels.cpu import pack_w8

        self.int8_cpu = pack_w8(self.qweight)  # [NB, K, 32] column blocks (kernels/cpu.py)

    # ---- numbers -----------------------------------------------------------------------------
    def codes(self) -> torch.Tensor:
        """The weight codes [N, K] (int8, or the fp8 codes as float); unpacked (a copy) where
        only a packed layout is kept."""
        for c in (self.qweight, self.weight_upcast, self.weight_fp8):
            if c is not None:
                return c
        if self.int8_cpu is not None:
            from quantspec.kernels.cpu import unpack_w8

            return unpack_w8(self.int8_cpu, self.out_features)
        if self.int4_cpu is not None:
            from quantspec.kernels.cpu import unpack_w4

            return unpack_w4(self.int4_cpu, self.out_features)
        return unpack_int4(self.weight_packed, (self.out_features, self.in_features))

    def dequantized_weight(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """dequantize(q, scale, zp) from quant/primitives (fp32), as `dtype` → [N, K]."""
        w = dequantize(self.codes(), self.weight_scale, self.weight_zero_point, self.weight_args,
                       dtype=torch.float32)
        return w.to(dtype or self.dtype)

    def _act_qparams(self, xf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        ia = self.input_args
        if ia.dynamic:
            return choose_qparams(xf, ia)  # [M, 1] per token (or [1] per tensor)
        return self.input_scale, self.input_zero_point

    def quantize_input(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(codes, scale, zero point) of x [M, K] under the input args, computed in fp32."""
        xf = x.float()
        s, z = self._act_qparams(xf)
        return quantize(xf, s, z, self.input_args), s, z

    # ---- dispatch ----------------------------------------------------------------------------
    def kernel_for(self, x: torch.Tensor) -> KernelPath:
        """The path `forward(x)` takes (x [..., K])."""
        M = x.numel() // x.shape[-1] if x.shape[-1] else 0
        return select_kernel(self.traits, x.device, M, x.dtype, self.policy)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] → [..., N] in x's dtype."""
        if (self._packed_path is not None and x.dim() == 2 and x.dtype == self.dtype
                and x.shape[1] == self.in_features and x.device.type == "cpu" and 0 < x.shape[0]
                and (x.shape[0] <= self.policy.cpu_packed_max_m or in_decode_step())):
            return self.run(x, self._packed_path)  # a decode / verify step on CPU (any M: step_rows)
        if x.shape[-1] != self.in_features:
            raise QuantSpecError(f"{self.name or 'QuantLinear'}: input has {x.shape[-1]} features, "
                                 f"expected {self.in_features}")
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features).contiguous()  # [M, K]
        y = self.run(x2, self.kernel_for(x2))
        return y.reshape(*lead, self.out_features)

    def run(self, x: torch.Tensor, path: KernelPath) -> torch.Tensor:
        """Run one path on x [M, K] → [M, N] (tests call it to force a path)."""
        if path is KernelPath.DEQUANT:
            return self._dequant(x)
        if path is KernelPath.CPU_INT8PACK:
            # an unaligned x (a row slice of a larger buffer) segfaults this op: re-home it
            y = torch._weight_int8pack_mm(_aligned(x), self.codes(), self.int8pack_scale)
            return y if self.bias is None else y + self.bias.to(y.dtype)
        if path is KernelPath.CPU_INT4PACK:
            if self.int4pack is None:  # prepared for quantspec's kernel (tests force this path)
                self._prepare_cpu_int4(self.codes(), self.weight_scale, self.weight_zero_point,
                                       self.traits.cpu_int4_group)
            y = torch._weight_int4pack_mm_for_cpu(_aligned(x), self.int4pack, self.traits.cpu_int4_group,
                                                  self.int4_scales_zeros)
            return y if self.bias is None else y + self.bias.to(y.dtype)
        if path is KernelPath.CPU_GEMV_INT8:
            from quantspec.kernels.cpu import packed_w8_gemm

            if self.int8_cpu is None:  # prepared for another path (tests force this one)
                self._prepare_gemv_int8()
            return packed_w8_gemm(x.contiguous(), self.int8_cpu, self.w_scale_vec, self.out_features,
                                  self._gemv_bias())
        if path is KernelPath.CPU_GEMV_INT4:
            from quantspec.kernels.cpu import packed_w4_gemm

            if self.int4_cpu is None:  # prepared for torch's int4 op (tests force this path)
                self._prepare_gemv_int4(self.codes(), self.weight_scale, self.weight_zero_point)
            g = self.in_features // self.int4_cpu_scale.shape[1]
            return packed_w4_gemm(x.contiguous(), self.int4_cpu, self.int4_cpu_scale, self.int4_cpu_offset,
                                  g, self.out_features, self._gemv_bias())
        if path is KernelPath.CPU_INT_MM:
            xq, s, _ = self.quantize_input(x)  # [M, K] int8, [1] or [M, 1]
            acc = torch._int_mm(xq, self.qweight.t())  # [M, N] int32, exact
            return self._epilogue(acc.float(), s, x.dtype)
        if path is KernelPath.CPU_FP8_UPCAST:
            xq, s, _ = self.quantize_input(x)  # [M, K] float8_e4m3fn
            acc = xq.to(self.weight_upcast.dtype) @ self.weight_upcast.t()  # [M, N]
            return self._epilogue(acc.float(), s, x.dtype)
        return self._triton(x, path)

    def _gemv_bias(self) -> torch.Tensor | None:
        if self.bias is not None and self.bias_fp32 is None:
            self.bias_fp32 = self.bias.float()
        return self.bias_fp32

    def _epilogue(self, acc: torch.Tensor, x_scale: torch.Tensor, out_dtype: torch.dtype
                  ) -> torch.Tensor:
        # acc [M, N] fp32 · x_scale ([1] or [M, 1]) · w_scale [N] (+ bias): int8/fp8_gemm_ref's order
        y = acc * x_scale.reshape(-1, 1) * self.w_scale_vec[None, :]
        if self.bias is not None:
            y = y + self.bias.float()
        return y.to(out_dtype)

    def _dequant(self, x: torch.Tensor) -> torch.Tensor:
        if self.input_args is not None:
            xq, s, z = self.quantize_input(x)
            x = dequantize(xq, s, z, self.input_args, dtype=torch.float32).to(x.dtype)
        w = self.dequantized_weight(x.dtype)
        return F.linear(x, w, None if self.bias is None else self.bias.to(x.dtype))

    def _triton(self, x: torch.Tensor, path: KernelPath) -> torch.Tensor:
        from quantspec import kernels

        b = None if self.bias is None else self.bias.to(x.dtype)
        if path is KernelPath.TRITON_W4A16:
            w = self.weight_packed if self.weight_packed is not None else pack_int4(self.codes())
            g = self.weight_args.group_size if self.weight_args.strategy == "group" \
                else self.in_features
            s = self.weight_scale if self.weight_scale.ndim == 2 else \
                self.weight_scale.reshape(1, 1).expand(self.out_features, 1).contiguous()
            return kernels.w4a16_linear(x, w, s, g, self.weight_zero_point, b)
        if path is KernelPath.TRITON_W8A16:
            return kernels.w8a16_linear(x, self.codes(), self.w_scale_vec, b)
        if path is KernelPath.TRITON_W8A8:
            return kernels.w8a8_linear(x, self.codes(), self.w_scale_vec,
                                       None if self.input_args.dynamic else self.input_scale, b)
        if path is KernelPath.TRITON_FP8:
            w = self.weight_fp8 if self.weight_fp8 is not None else \
                self.weight_upcast.to(torch.float8_e4m3fn)
            return kernels.fp8_linear(x, w, self.w_scale_vec, self.input_scale, b)
        raise QuantSpecError(f"unknown kernel path {path!r}")

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
