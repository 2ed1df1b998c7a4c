"""Reading one quantized Linear from a compressed-tensors checkpoint.

`read_quantized_linear` turns the tensors of one Linear (`weight_packed` / `weight`,
`weight_scale`, `weight_zero_point`, `weight_shape`, `input_scale`, ...) into codes + qparams
(`QuantizedLinearTensors`), reading the layout from the scheme's *format* (never from a file
name): the formats quantspec writes and the ones compressed-tensors / llm-compressor write for the
same schemes (8-bit `pack-quantized` included, llm-compressor's choice for W8A16).
`expected_linear_tensors` lists the names and shapes a checkpoint must hold for it. Pure: tensors
in, tensors out; no model, no device.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Mapping

import torch

from quantspec.errors import QuantSpecError
from quantspec.quant.args import (
    FORMAT_FLOAT_QUANTIZED,
    FORMAT_INT_QUANTIZED,
    FORMAT_NAIVE_QUANTIZED,
    FORMAT_MXFP4_PACK_QUANTIZED,
    FORMAT_MXFP8_QUANTIZED,
    FORMAT_NVFP4_PACK_QUANTIZED,
    FORMAT_PACK_QUANTIZED,
    QuantArgs,
)
from quantspec.quant.fp4 import mx_values, unpack_fp4
from quantspec.quant.scheme import QuantScheme
from quantspec.quant.packing import unpack_int4
from quantspec.quant.primitives import storage_dtype, zero_point_dtype

__all__ = ["QuantizedLinearTensors", "check_present", "expected_linear_tensors", "read_quantized_linear"]

_WORD_BITS = 32


@dataclass
class QuantizedLinearTensors:
    """One quantized Linear decoded from a checkpoint: codes q [N, K] (int8 in [q_min, q_max]
    or float8_e4m3fn: fp8 or E2M1 values), scale / zero point shaped per strategy (zero point
    None when symmetric), the static input scale / zero point (None when weight-only or dynamic)
    and the float bias. NVFP4: `scale` the local scales (fp32 values of FP8), `global_scale` and,
    with NVFP4 inputs, `input_global_scale` (fp32 [1]); MXFP4: `scale` the power-of-two group
    scales (fp32)."""

    q: torch.Tensor
    scale: torch.Tensor
    zero_point: torch.Tensor | None
    weight_args: QuantArgs
    input_args: QuantArgs | None = None
    input_scale: torch.Tensor | None = None
    input_zero_point: torch.Tensor | None = None
    bias: torch.Tensor | None = None
    global_scale: torch.Tensor | None = None
    input_global_scale: torch.Tensor | None = None


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


def _scale_shape(prefix: str, w: QuantArgs, N: int, K: int) -> tuple[int, ...] | None:
    """The weight scale's shape per strategy (None: per tensor, [1] or [])."""
    if w.strategy in ("group", "tensor_group"):
        if K % w.group_size:
            raise QuantSpecError(f"{prefix}: group_size {w.group_size} does not divide K={K}; "
                                 "re-quantize this layer with a group size that divides it")
        return N, K // w.group_size
    if w.strategy == "block":
        return w.block_grid(N, K)
    if w.strategy == "channel":
        return N, 1
    if w.strategy == "tensor":
        return None
    raise QuantSpecError(f"{prefix}: weight strategy {w.strategy!r} is unsupported; use "
                         "tensor, channel, group, tensor_group or block")


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
    sshape = _scale_shape(prefix, w, N, K)
    if fmt == FORMAT_NVFP4_PACK_QUANTIZED:  # two codes a byte, the local scales, the global scales
        return {f"{prefix}.weight_packed": (N, K // 2), f"{prefix}.weight_scale": sshape,
                f"{prefix}.weight_global_scale": None,
                **({f"{prefix}.input_global_scale": None} if scheme.input_activations is not None else {})}
    if fmt == FORMAT_MXFP4_PACK_QUANTIZED:  # two codes a byte, the E8M0 exponents
        return {f"{prefix}.weight_packed": (N, K // 2), f"{prefix}.weight_scale": sshape}
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
    elif fmt in (FORMAT_INT_QUANTIZED, FORMAT_FLOAT_QUANTIZED, FORMAT_NAIVE_QUANTIZED, FORMAT_MXFP8_QUANTIZED):
        if w.type == "int" and w.num_bits not in (4, 8):
            raise QuantSpecError(f"{prefix}: {w.num_bits}-bit int weights in format {fmt!r} are "
                                 "unsupported; quantspec runs 4- and 8-bit int weights")
        out[f"{prefix}.weight"] = (N, K)
        if not w.symmetric:
            out[f"{prefix}.weight_zero_point"] = sshape
    else:
        raise QuantSpecError(f"{prefix}: weight format {fmt!r} is unsupported; supported: "
                             f"{FORMAT_PACK_QUANTIZED}, {FORMAT_INT_QUANTIZED}, "
                             f"{FORMAT_FLOAT_QUANTIZED}, {FORMAT_NAIVE_QUANTIZED}, {FORMAT_NVFP4_PACK_QUANTIZED}, "
                             f"{FORMAT_MXFP4_PACK_QUANTIZED}, {FORMAT_MXFP8_QUANTIZED}")
    out[f"{prefix}.weight_scale"] = sshape
    ia = scheme.input_activations
    if ia is not None and not ia.dynamic:
        out[f"{prefix}.input_scale"] = None
        if not ia.symmetric:
            out[f"{prefix}.input_zero_point"] = None
    return out


def _check_shape(name: str, have: tuple[int, ...], shape: tuple[int, ...] | None) -> None:
    if shape is not None and tuple(have) != tuple(shape):
        raise QuantSpecError(f"{name} has shape {tuple(have)}, expected {tuple(shape)} from "
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
    check_present(tensors, expected_linear_tensors(prefix, scheme, out_features, in_features))
    w = scheme.weights
    scale = tensors[f"{prefix}.weight_scale"]
    if w.is_mx:
        return _mx_linear(tensors, prefix, scheme, in_features)
    if not scale.is_floating_point():
        raise QuantSpecError(f"{prefix}.weight_scale has dtype {scale.dtype}; expected a float")
    if w.is_fp4:
        return _nvfp4_linear(tensors, prefix, scheme, in_features)
    if w.strategy == "tensor":
        scale = _scalar(f"{prefix}.weight_scale", scale)
    if scheme.format == FORMAT_PACK_QUANTIZED:
        q, zp = _packed_weight(tensors, prefix, w, (out_features, in_features), tuple(scale.shape))
    else:
        q, zp = _plain_weight(tensors, prefix, w)
    ia = scheme.input_activations
    in_scale, in_zp = _static_input_qparams(tensors, prefix, ia)
    return QuantizedLinearTensors(q=q, scale=scale, zero_point=zp, weight_args=w, input_args=ia,
                                  input_scale=in_scale, input_zero_point=in_zp,
                                  bias=tensors.get(f"{prefix}.bias"))


def _nvfp4_linear(tensors: Mapping[str, torch.Tensor], prefix: str, scheme: QuantScheme,
                  K: int) -> QuantizedLinearTensors:
    """An nvfp4-pack-quantized Linear: E2M1 codes as float8_e4m3fn, local scales as fp32 and the
    global scales, each global a finite value > 0."""
    q = unpack_fp4(tensors[f"{prefix}.weight_packed"], K)
    ia = scheme.input_activations
    g = {k: _scalar(f"{prefix}.{k}", tensors[f"{prefix}.{k}"]).float()
         for k in ("weight_global_scale", "input_global_scale") if ia is not None or k[0] == "w"}
    for k, v in g.items():
        if not bool(torch.isfinite(v).all()) or not bool((v > 0).all()):
            raise QuantSpecError(f"{prefix}.{k} is {float(v)}; it must be a finite value > 0 — re-quantize the model")
    return QuantizedLinearTensors(q=q, scale=tensors[f"{prefix}.weight_scale"].float(), zero_point=None,
                                  weight_args=scheme.weights, input_args=ia, bias=tensors.get(f"{prefix}.bias"),
                                  global_scale=g["weight_global_scale"], input_global_scale=g.get("input_global_scale"))


def _mx_linear(tensors: Mapping[str, torch.Tensor], prefix: str, scheme: QuantScheme,
               K: int) -> QuantizedLinearTensors:
    """An mxfp4-pack-quantized or mxfp8-quantized Linear: E2M1 / E4M3 codes as float8_e4m3fn and
    each group's power-of-two scale as fp32, from its E8M0 byte (255, E8M0's NaN, refused)."""
    e = tensors[f"{prefix}.weight_scale"]
    kind = scheme.weights.microscaled.upper()
    if e.dtype != torch.uint8:
        raise QuantSpecError(f"{prefix}.weight_scale has dtype {e.dtype}; {kind} stores uint8 E8M0 exponents")
    if bool((e == 255).any()):
        raise QuantSpecError(f"{prefix}.weight_scale holds E8M0's NaN (255); re-quantize the model")
    if scheme.weights.is_fp4:
        q = unpack_fp4(tensors[f"{prefix}.weight_packed"], K)
    else:
        q = tensors[f"{prefix}.weight"]
        if q.dtype != torch.float8_e4m3fn:
            raise QuantSpecError(f"{prefix}.weight has dtype {q.dtype}; MXFP8 stores float8_e4m3fn codes")
    return QuantizedLinearTensors(q=q, scale=mx_values(e, torch.float32),
                                  zero_point=None, weight_args=scheme.weights, input_args=scheme.input_activations,
                                  bias=tensors.get(f"{prefix}.bias"))


def check_present(tensors: Mapping[str, torch.Tensor], expected: Mapping[str, tuple | None]) -> None:
    """Refuse the first tensor of `expected` ({name: shape or None}, `expected_linear_tensors`)
    missing or mis-shaped; a mapping that knows its `shapes` (`layout.ShapedTensors`) is checked
    without reading any data."""
    shapes = getattr(tensors, "shapes", None)
    for name, shape in expected.items():
        if name not in tensors:
            if name.endswith(".input_scale"):
                raise QuantSpecError(f"{name.rsplit('.', 1)[0]} has no input_scale but its scheme "
                                     "has static input activations: quantize with --calib "
                                     "(a calibration table) to store one")
            raise QuantSpecError(f"tensor {name!r} is missing from the checkpoint; it is "
                                 "incomplete — re-download or re-create it")
        _check_shape(name, shapes[name] if shapes is not None else tuple(tensors[name].shape), shape)


def _packed_weight(tensors: Mapping[str, torch.Tensor], prefix: str, w: QuantArgs, shape: tuple[int, int],
                   scale_shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(q [N, K], zero point or None) of a pack-quantized weight of `shape` (N, K)."""
    stored = tuple(int(v) for v in tensors[f"{prefix}.weight_shape"].tolist())
    if stored != shape:
        raise QuantSpecError(f"{prefix}.weight_shape is {list(stored)} but the model needs "
                             f"{list(shape)}; the checkpoint does not match its config")
    q = _unpack_words(tensors[f"{prefix}.weight_packed"], w.num_bits, shape, 1, f"{prefix}.weight_packed")
    if w.symmetric:
        return q, None
    z = tensors[f"{prefix}.weight_zero_point"]
    if w.strategy in ("group", "channel") and w.zp_dtype is None:
        if z.is_floating_point():
            _weight_zero_point(f"{prefix}.weight_zero_point", z, w)  # raises
        return q, _unpack_words(z, w.num_bits, scale_shape, 0, f"{prefix}.weight_zero_point")
    z = _scalar(f"{prefix}.weight_zero_point", z) if w.strategy == "tensor" else z
    return q, _weight_zero_point(f"{prefix}.weight_zero_point", z, w)


def _plain_weight(tensors: Mapping[str, torch.Tensor], prefix: str,
                  w: QuantArgs) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(q [N, K], zero point or None) of an int- / float- / naive-quantized weight (one value a
    storage element)."""
    q = tensors[f"{prefix}.weight"]
    if q.dtype != storage_dtype(w):
        raise QuantSpecError(f"{prefix}.weight has dtype {q.dtype}, expected "
                             f"{storage_dtype(w)} for {w.num_bits}-bit {w.type} weights")
    if w.type == "int" and w.num_bits < 8 and q.numel():  # sub-byte codes, one an int8 (compressed-tensors' W4A8)
        lo, hi = -(1 << (w.num_bits - 1)), (1 << (w.num_bits - 1)) - 1  # signed with or without a zero point
        if int(q.min()) < lo or int(q.max()) > hi:
            raise QuantSpecError(f"{prefix}.weight holds codes outside [{lo}, {hi}], the range of "
                                 f"{w.num_bits}-bit weights; the checkpoint and its config disagree")
    if w.symmetric:
        return q, None
    zp = tensors[f"{prefix}.weight_zero_point"]
    zp = _scalar(f"{prefix}.weight_zero_point", zp) if w.strategy == "tensor" else zp
    return q, _weight_zero_point(f"{prefix}.weight_zero_point", zp, w)


def _static_input_qparams(tensors: Mapping[str, torch.Tensor], prefix: str,
                          ia: QuantArgs | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(input scale [1], input zero point [1] or None) of static input activations; (None, None)
    when the inputs stay float or are quantized dynamically."""
    if ia is None or ia.dynamic:
        return None, None
    in_scale = _scalar(f"{prefix}.input_scale", tensors[f"{prefix}.input_scale"]).float()
    if not bool((in_scale > 0).all()) or not bool(torch.isfinite(in_scale).all()):
        raise QuantSpecError(f"{prefix}.input_scale is {float(in_scale)}; it must be a finite "
                             "value > 0 — recalibrate the model")
    in_zp = None
    if not ia.symmetric:
        in_zp = _scalar(f"{prefix}.input_zero_point", tensors[f"{prefix}.input_zero_point"]).to(storage_dtype(ia))
    return in_scale, in_zp

