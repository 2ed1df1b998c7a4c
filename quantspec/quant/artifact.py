"""The on-disk artifact: compressed-tensors tensor names, atomic directory writes, safe loads.

A quantized model is a HF-style directory: `config.json` (with `quantization_config` in the
compressed-tensors layout), `model.safetensors` (or `model-0000i-of-0000n.safetensors` shards with
`model.safetensors.index.json` above `DEFAULT_MAX_SHARD_BYTES`), extra files (tokenizer, ...) and
quantspec's provenance in `quantspec.json`. The tensors are written part by part through
`quant.shards.ShardWriter` (one part in memory at a time).

Tensor names per quantized Linear `{prefix}` (e.g. `model.layers.0.self_attn.q_proj`), by format:
- pack-quantized (integer weight-only, 4 or 8 bits, c = 32/bits codes per word): `weight_packed`
  int32 [N, ceil(K/c)], `weight_scale` [N, K/g] (or [N, 1]), `weight_shape` int64 [2] = [N, K],
  and, asymmetric only, `weight_zero_point` int32 [ceil(N/c), K/g] (integer zero points packed
  along N) or, with a float `zp_dtype`, unpacked [N, K/g] (or [N, 1]) in that float dtype
  (compressed-tensors packs only integer zero points).
- int-quantized (int8 weights with quantized input activations, W8A8): `weight` int8 [N, K],
  `weight_scale` [N, 1] (+ `weight_zero_point` int8 when asymmetric).
- float-quantized (fp8): `weight` float8_e4m3fn [N, K], `weight_scale` [N, 1] or [1].
- nvfp4-pack-quantized (NVFP4): `weight_packed` uint8 [N, K/2] (two E2M1 codes a byte,
  `quant.fp4.pack_fp4`), `weight_scale` float8_e4m3fn [N, K/16], `weight_global_scale` fp32 [1],
  and with NVFP4 inputs `input_global_scale` fp32 [1].
- mxfp4-pack-quantized (MXFP4): `weight_packed` as NVFP4's, `weight_scale` uint8 [N, K/32] (each
  group's E8M0 exponent: its scale is 2^(e - 127)); no global scale.
- mxfp8-quantized (MXFP8): `weight` float8_e4m3fn [N, K], `weight_scale` uint8 [N, K/32] (E8M0
  exponents, as MXFP4's).
- static input activations: `input_scale` [1] (+ `input_zero_point` when asymmetric).
KV cache, on the attention module `{attn}` (e.g. `model.layers.0.self_attn`): `k_scale`,
`v_scale`, shaped [1] (strategy tensor) or [H_kv, 1, 1] (strategy attn_head).
Scales keep the dtype they were computed in (compressed-tensors uses the weight's dtype).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import torch
from safetensors import safe_open

from quantspec.errors import QuantSpecError
from quantspec.model_zoo.checkpoint import reading_safetensors
from quantspec.model_zoo.hf_config import modelopt_sidecar
from quantspec.outputs import atomic_dir
from quantspec.quant.args import FORMAT_PACK_QUANTIZED, QuantArgs
from quantspec.quant.fp4 import mx_exponents_of, mx_values, pack_fp4, unpack_fp4
from quantspec.quant.config import QuantConfig
from quantspec.quant.scheme import scheme_format
from quantspec.quant.packing import pack_int32, unpack_int32
from quantspec.quant.primitives import storage_dtype, zero_point_dtype
from quantspec.quant.shards import (DEFAULT_MAX_SHARD_BYTES, SAFETENSORS_INDEX_NAME, SAFETENSORS_NAME,
                                    ShardWriter)

__all__ = [
    "CONFIG_NAME",
    "SAFETENSORS_NAME",
    "SAFETENSORS_INDEX_NAME",
    "PROVENANCE_NAME",
    "DEFAULT_MAX_SHARD_BYTES",
    "LinearQuant",
    "linear_to_tensors",
    "linear_from_tensors",
    "kv_scale_tensors",
    "write_artifact",
    "read_artifact_config",
    "read_quant_config",
    "read_provenance",
    "load_safetensors",
    "quantized_layers",
    "layer_info",
]

CONFIG_NAME = "config.json"
PROVENANCE_NAME = "quantspec.json"


def _packs(args: QuantArgs, fmt: str | None, has_input: bool) -> bool:
    """pack-quantized (int32 words): the format named, else the one `scheme_format` gives."""
    if fmt is None:
        fmt = scheme_format(args, args if has_input else None)
    return fmt == FORMAT_PACK_QUANTIZED and args.type == "int"


def _packs_zero_point(args: QuantArgs) -> bool:
    # compressed-tensors packs integer zero points only for group/channel strategies; float
    # zero points (a float zp_dtype) are stored as they are
    return not args.symmetric and args.strategy in ("group", "channel") and args.zp_dtype is None


@dataclass
class LinearQuant:
    """One quantized Linear as read back: codes q [N, K] (int8 / float8_e4m3fn), scale, zero
    point (None when symmetric), the args, and the static input scale/zero point (or None)."""

    q: torch.Tensor
    scale: torch.Tensor
    zero_point: torch.Tensor | None
    args: QuantArgs
    input_scale: torch.Tensor | None = None
    input_zero_point: torch.Tensor | None = None
    global_scale: torch.Tensor | None = None  # NVFP4's weight_global_scale
    input_global_scale: torch.Tensor | None = None  # NVFP4 inputs'


def _fp4_tensors(prefix: str, q: torch.Tensor, scale: torch.Tensor, args: QuantArgs,
                 global_scale: torch.Tensor | None, input_global_scale: torch.Tensor | None) -> dict[str, torch.Tensor]:
    if args.is_mx:
        return {f"{prefix}.weight_packed": pack_fp4(q), f"{prefix}.weight_scale": mx_exponents_of(scale)}
    if global_scale is None:
        raise QuantSpecError(f"{prefix}: NVFP4 weights need their global scale")
    out = {f"{prefix}.weight_packed": pack_fp4(q), f"{prefix}.weight_scale": scale.to(torch.float8_e4m3fn),
           f"{prefix}.weight_global_scale": global_scale.detach().float().reshape(1)}
    if input_global_scale is not None:
        out[f"{prefix}.input_global_scale"] = input_global_scale.detach().float().reshape(1)
    return out


def linear_to_tensors(prefix: str, q: torch.Tensor, scale: torch.Tensor,
                      zero_point: torch.Tensor | None, args: QuantArgs, *,
                      input_scale: torch.Tensor | None = None,
                      input_zero_point: torch.Tensor | None = None,
                      format: str | None = None, global_scale: torch.Tensor | None = None,
                      input_global_scale: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """The compressed-tensors tensors for one quantized Linear (names in the module docstring).

    q [N, K]: codes from `primitives.quantize` (int8 in [q_min, q_max], or float8_e4m3fn: fp8
    or E2M1 values). NVFP4: `scale` the local scales, `global_scale` / `input_global_scale` fp32;
    MXFP4 / MXFP8: `scale` the power-of-two scales (stored as their E8M0 exponents).
    `format`: the Linear's scheme format; None → `scheme_format` (int weights with an
    `input_scale` are int-quantized, without one pack-quantized).
    """
    if not isinstance(q, torch.Tensor) or q.ndim != 2:
        raise QuantSpecError(f"{prefix}: q must be a 2-D code tensor [N, K], got "
                             f"{getattr(q, 'shape', type(q))}")
    if q.dtype != storage_dtype(args):
        raise QuantSpecError(f"{prefix}: q has dtype {q.dtype} but {args.num_bits}-bit "
                             f"{args.type} codes are stored as {storage_dtype(args)}")
    if not scale.is_floating_point():
        raise QuantSpecError(f"{prefix}: weight_scale must be a float tensor, got {scale.dtype}")
    N, K = q.shape
    _check_scale_shape(prefix, scale, args, N, K)
    if args.is_fp4:
        return _fp4_tensors(prefix, q, scale, args, global_scale, input_global_scale)
    if args.is_mxfp8:
        return {f"{prefix}.weight": q, f"{prefix}.weight_scale": mx_exponents_of(scale)}
    out: dict[str, torch.Tensor] = {}
    packs = _packs(args, format, input_scale is not None)
    if packs:
        out[f"{prefix}.weight_packed"] = pack_int32(q, args.num_bits)  # [N, ceil(K·b/32)]
        out[f"{prefix}.weight_shape"] = torch.tensor([N, K], dtype=torch.int64)
    else:
        out[f"{prefix}.weight"] = q
    out[f"{prefix}.weight_scale"] = scale
    if not args.symmetric:
        if zero_point is None or zero_point.shape != scale.shape:
            raise QuantSpecError(f"{prefix}: asymmetric args need a zero_point shaped like the "
                                 f"scale {tuple(scale.shape)}")
        if args.zp_dtype is not None:
            if not zero_point.is_floating_point():
                raise QuantSpecError(f"{prefix}: zp_dtype {args.zp_dtype} needs a float "
                                     f"zero_point, got {zero_point.dtype}; use choose_qparams "
                                     "with these args")
            out[f"{prefix}.weight_zero_point"] = zero_point.to(zero_point_dtype(args))
        else:
            zp = zero_point.to(torch.int8)
            out[f"{prefix}.weight_zero_point"] = pack_int32(zp, args.num_bits, packed_dim=0) \
                if packs and _packs_zero_point(args) else zp
    if input_scale is not None:
        out[f"{prefix}.input_scale"] = input_scale.reshape(-1) if input_scale.ndim == 0 \
            else input_scale
        if input_zero_point is not None:
            out[f"{prefix}.input_zero_point"] = input_zero_point
    return out


def _check_scale_shape(prefix: str, scale: torch.Tensor, args: QuantArgs, N: int, K: int) -> None:
    if args.strategy in ("group", "tensor_group"):
        want = (N, K // args.group_size)
        if K % args.group_size:
            raise QuantSpecError(f"{prefix}: group_size {args.group_size} does not divide K={K}")
    elif args.strategy == "channel":
        want = (N, 1)
    elif args.strategy == "block":
        want = args.block_grid(N, K)
    else:
        want = (1,)
    if tuple(scale.shape) != want:
        raise QuantSpecError(f"{prefix}: weight_scale has shape {tuple(scale.shape)}, expected "
                             f"{want} for strategy {args.strategy!r}")


def linear_from_tensors(tensors: Mapping[str, torch.Tensor], prefix: str,
                        args_or_config: QuantArgs | QuantConfig, format: str | None = None
                        ) -> LinearQuant:
    """Inverse of `linear_to_tensors`: read one Linear's codes and qparams from a state dict.

    `args_or_config` is the weight QuantArgs, or the model's QuantConfig (the scheme and its
    format are looked up by `prefix` with compressed-tensors' matching rules). With bare args,
    `format` None means the one `linear_to_tensors` writes (an `input_scale` present →
    int-quantized).
    """
    if isinstance(args_or_config, QuantConfig):
        scheme = args_or_config.scheme_for(prefix)
        if scheme is None or scheme.weights is None:
            raise QuantSpecError(f"{prefix}: the quantization_config does not quantize this "
                                 "module's weight")
        args, format = scheme.weights, scheme.format
    else:
        args = args_or_config

    def get(name: str) -> torch.Tensor:
        key = f"{prefix}.{name}"
        if key not in tensors:
            raise QuantSpecError(f"tensor {key!r} is missing from the artifact; re-create it")
        return tensors[key]

    scale = get("weight_scale")
    if args.microscaled:
        return _microscaled_from_tensors(tensors, get, prefix, scale, args)
    packs = _packs(args, format, f"{prefix}.input_scale" in tensors)
    if packs:
        shape = tuple(int(v) for v in get("weight_shape").tolist())
        q = unpack_int32(get("weight_packed"), args.num_bits, shape)  # [N, K]
    else:
        q = get("weight")
        if q.dtype != storage_dtype(args):
            raise QuantSpecError(f"{prefix}.weight has dtype {q.dtype}, expected "
                                 f"{storage_dtype(args)} for the config's args")
    N, K = q.shape
    _check_scale_shape(prefix, scale, args, N, K)
    zp = None
    if not args.symmetric:
        zp = get("weight_zero_point")
        if args.zp_dtype is not None:
            if zp.dtype != zero_point_dtype(args) or zp.shape != scale.shape:
                raise QuantSpecError(f"{prefix}.weight_zero_point is {zp.dtype} "
                                     f"{tuple(zp.shape)} but zp_dtype {args.zp_dtype} needs "
                                     f"{zero_point_dtype(args)} {tuple(scale.shape)}; the "
                                     "checkpoint does not match its config")
        elif packs and _packs_zero_point(args):
            zp = unpack_int32(zp, args.num_bits, tuple(scale.shape), packed_dim=0)
    return LinearQuant(q=q, scale=scale, zero_point=zp, args=args,
                       input_scale=tensors.get(f"{prefix}.input_scale"),
                       input_zero_point=tensors.get(f"{prefix}.input_zero_point"))


def _microscaled_from_tensors(tensors: Mapping[str, torch.Tensor], get, prefix: str, scale: torch.Tensor,
                              args: QuantArgs) -> LinearQuant:
    """`linear_from_tensors` for NVFP4 / MXFP4 (E2M1 codes two a byte) and MXFP8 (E4M3 codes) weights:
    MX scales as the values of their E8M0 bytes, NVFP4's with their global scales."""
    q = get("weight") if args.is_mxfp8 else unpack_fp4(get("weight_packed"), get("weight_packed").shape[1] * 2)
    _check_scale_shape(prefix, scale, args, *q.shape)
    if args.is_mx:
        return LinearQuant(q=q, scale=mx_values(scale, torch.float32), zero_point=None, args=args)
    return LinearQuant(q=q, scale=scale.float(), zero_point=None, args=args,
                       global_scale=get("weight_global_scale").float(),
                       input_global_scale=tensors.get(f"{prefix}.input_global_scale"))


def kv_scale_tensors(attn_prefix: str, k_scale: torch.Tensor, v_scale: torch.Tensor,
                     args: QuantArgs | None = None) -> dict[str, torch.Tensor]:
    """`{attn_prefix}.k_scale` / `.v_scale` (attn_prefix like `model.layers.0.self_attn`).

    Shapes: [1] (strategy tensor; a 0-d scale is reshaped) or [H_kv, 1, 1] (attn_head; a [H_kv]
    vector is reshaped).
    """
    out = {}
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        if not isinstance(s, torch.Tensor) or not s.is_floating_point():
            raise QuantSpecError(f"{attn_prefix}.{name} must be a float tensor")
        strategy = args.strategy if args is not None else ("tensor" if s.numel() == 1
                                                           else "attn_head")
        if strategy == "tensor":
            if s.numel() != 1:
                raise QuantSpecError(f"{attn_prefix}.{name}: per-tensor KV scale must have one "
                                     f"element, got shape {tuple(s.shape)}")
            s = s.reshape(1)
        elif strategy == "attn_head":
            s = s.reshape(-1, 1, 1)  # [H_kv, 1, 1]
        else:
            raise QuantSpecError(f"KV cache strategy {strategy!r} unsupported; use tensor or "
                                 "attn_head")
        out[f"{attn_prefix}.{name}"] = s
    return out


# ---------------------------------------------------------------------------------------------
# directory I/O
# ---------------------------------------------------------------------------------------------

def write_artifact(out_dir: str | os.PathLike, tensors: Mapping[str, torch.Tensor] | ShardWriter,
                   config: Mapping[str, Any], extra_files: Mapping[str, str | os.PathLike] | None
                   = None, provenance: Mapping[str, Any] | None = None, overwrite: bool = False,
                   max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> Path:
    """Write an artifact directory atomically; returns its path.

    `tensors`: a mapping, or a `quant.shards.ShardWriter` that holds them already (written part
    by part, e.g. one decoder layer at a time); its shards are linked into the artifact.
    Everything goes into a temporary directory beside `out_dir` that is renamed into place only
    when complete (`outputs.atomic_dir`); on any error the temporary directory is removed and
    `out_dir` is untouched.
    An existing non-empty `out_dir` is refused unless `overwrite=True`.
    `config` is the HF config.json dict (including `quantization_config`); `extra_files` maps
    a file name in the artifact to a source path (tokenizer files, ...); `provenance` goes to
    `quantspec.json`.
    """
    out = Path(out_dir)
    if not isinstance(config, Mapping):
        raise QuantSpecError("config must be a mapping (the HF config.json dict)")
    reserved = {CONFIG_NAME, SAFETENSORS_INDEX_NAME, PROVENANCE_NAME}
    for name in (extra_files or {}):
        if name in reserved or name.endswith(".safetensors") or "/" in name or name.startswith("."):
            raise QuantSpecError(f"extra file name {name!r} is reserved or not a plain file name")
        if not Path(extra_files[name]).is_file():
            raise QuantSpecError(f"extra file source {extra_files[name]} does not exist")
    with atomic_dir(out, overwrite=overwrite) as tmp:
        if isinstance(tensors, ShardWriter):
            tensors.finish(tmp)
        else:
            writer = ShardWriter(tmp / ".parts", max_shard_bytes)
            writer.add("tensors", tensors)
            writer.finish(tmp)
            shutil.rmtree(writer.dir)
        (tmp / CONFIG_NAME).write_text(json.dumps(dict(config), indent=2, default=str))
        for name, src in (extra_files or {}).items():
            shutil.copyfile(src, tmp / name)
        (tmp / PROVENANCE_NAME).write_text(json.dumps(dict(provenance or {}), indent=2,
                                                      default=str))
    return out


def read_artifact_config(path: str | os.PathLike) -> dict:
    """config.json of an artifact directory."""
    p = Path(path) / CONFIG_NAME
    if not p.is_file():
        raise QuantSpecError(f"no {CONFIG_NAME} in {path}; point at a model/artifact directory")
    try:
        return modelopt_sidecar(path, json.loads(p.read_text()))
    except json.JSONDecodeError as e:
        raise QuantSpecError(f"{p} is not valid JSON ({e.msg} at line {e.lineno}); "
                             "re-download or re-create it") from None


def read_quant_config(path: str | os.PathLike) -> QuantConfig | None:
    """The artifact's QuantConfig (None for an unquantized model), with quantspec's metadata."""
    cfg = read_artifact_config(path)
    qc = cfg.get("quantization_config")
    if qc is None:
        return None
    config = QuantConfig.from_dict(qc)
    meta = read_provenance(path)
    if meta.get("quant_type") or meta.get("provenance"):
        config = dataclasses.replace(config, quant_type=meta.get("quant_type") or config.quant_type,
                                     provenance=meta.get("provenance") or {})
    return config


def read_provenance(path: str | os.PathLike) -> dict:
    """quantspec.json of an artifact ({} when absent, e.g. a checkpoint made by another tool)."""
    p = Path(path) / PROVENANCE_NAME
    if not p.is_file():
        return {}
    try:
        return json.loads(p.read_text())
    except json.JSONDecodeError:
        raise QuantSpecError(f"{p} is not valid JSON; re-create the artifact") from None


def _load_file(f: Path, device: str, names: set[str] | None = None) -> dict[str, torch.Tensor]:
    with reading_safetensors(f), safe_open(str(f), framework="pt", device=device) as h:
        keys = h.keys() if names is None else [k for k in h.keys() if k in names]
        return {k: h.get_tensor(k) for k in keys}


def load_safetensors(path: str | os.PathLike, device: str = "cpu") -> dict[str, torch.Tensor]:
    """All tensors of a directory (sharded via its index, or every *.safetensors) or one file."""
    p = Path(path)
    if p.is_file():
        return _load_file(p, device)
    if not p.is_dir():
        raise QuantSpecError(f"{p} does not exist; point at a model/artifact directory")
    index = p / SAFETENSORS_INDEX_NAME
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise QuantSpecError(f"{index} is corrupt (no weight_map); re-download or "
                                 "re-create it") from None
        by_file: dict[str, set[str]] = {}
        for name, fname in weight_map.items():
            by_file.setdefault(fname, set()).add(name)
        out: dict[str, torch.Tensor] = {}
        for fname, names in by_file.items():
            got = _load_file(p / fname, device, names)
            missing = names - set(got)
            if missing:
                raise QuantSpecError(f"{p / fname} lacks {len(missing)} tensor(s) its index "
                                     f"lists (e.g. {sorted(missing)[0]!r}); re-download or "
                                     "re-create it")
            out.update(got)
        return out
    files = sorted(p.glob("*.safetensors"))
    if not files:
        raise QuantSpecError(f"no .safetensors files in {p}; point at a model/artifact directory")
    out = {}
    for f in files:
        out.update(_load_file(f, device))
    return out


def quantized_layers(qc, names: list[str], where) -> dict:
    """`inspect`'s `layers` of an artifact of config `qc` and tensor `names`: each quantized Linear (a
    tensor of its weight scale's name) described by its scheme (`layer_info`)."""
    from quantspec.quant.autoquant import AUTOQUANT_METHODS, SCALE_LEAF

    scale_leaf = "." + qc.tensor_names.get("weight_scale", SCALE_LEAF if qc.source in AUTOQUANT_METHODS else "weight_scale")
    layers = {}
    for n in sorted({k.rsplit(".", 1)[0] for k in names if k.endswith(scale_leaf)}):
        s = qc.module_scheme(n)
        if s is None or s.weights is None:
            raise QuantSpecError(f"{where}: {n} has quantized tensors but the quantization_config does "
                                 "not quantize it; the artifact is inconsistent")
        layers[n] = layer_info(s)
    return layers


def layer_info(s) -> dict:
    """One quantized Linear's row of `inspect`'s `layers`, from its scheme."""
    w, ia = s.weights, s.input_activations
    return {"bits": w.num_bits, "type": w.type, "strategy": w.strategy,
            "group_size": w.group_size if w.strategy in ("group", "tensor_group") else None,
            "block": None if w.block_structure is None else list(w.block_structure),
            "symmetric": w.symmetric, "zp_dtype": None if w.symmetric else (w.zp_dtype or "int"),
            "format": s.format,
            "input_activations": None if ia is None else f"{ia.type}{ia.num_bits} {ia.strategy}"
            + (f" {ia.group_size}" if ia.strategy in ("group", "tensor_group") else "")
            + f" {'dynamic' if ia.dynamic else 'static'}"}
