"""Typed quantization config: per-tensor args → scheme (targets + args) → model-level config.

This module owns the *description* of a quantization (no numbers are computed here). It mirrors
compressed-tensors' `QuantizationArgs` / `QuantizationScheme` / `QuantizationConfig` so that
`QuantConfig.to_dict()` is exactly the `quantization_config` block of a compressed-tensors
checkpoint (loadable by transformers, vLLM and SGLang) and `QuantConfig.from_dict()` reads the
configs that compressed-tensors / llm-compressor write. Every object is validated when it is
built; bad input raises `QuantSpecError` with one line naming the field and the fix.

Target matching (`QuantConfig.scheme_for`) follows compressed-tensors' `apply_quantization_config`:
a module listed in (or matched by) `ignore` is never quantized; otherwise among all targets of all
groups (a later group re-using a target replaces the earlier one), exact module names win over
`re:` regexes (matched with `re.match`, i.e. anchored at the start), which win over class names
(`"Linear"`); ties are broken alphabetically. Per-layer group sizes are therefore expressed as an
extra config group whose `targets` are explicit module names (see `with_layer_group_sizes`).
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import logging
import re
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

from quantspec.errors import QuantSpecError

__all__ = [
    "QuantType",
    "QuantArgs",
    "QuantScheme",
    "QuantConfig",
    "preset",
    "resolve_group_size",
    "scheme_format",
    "QUANT_METHOD",
    "SUPPORTED_FORMATS",
    "FORMAT_PACK_QUANTIZED",
    "FORMAT_INT_QUANTIZED",
    "FORMAT_FLOAT_QUANTIZED",
    "FORMAT_NAIVE_QUANTIZED",
    "FORMAT_MIXED_PRECISION",
    "MIN_GROUP_SIZE",
    "ZP_FLOAT_DTYPES",
]

_LOG = logging.getLogger(__name__)

QUANT_METHOD = "compressed-tensors"
FORMAT_PACK_QUANTIZED = "pack-quantized"
FORMAT_INT_QUANTIZED = "int-quantized"
FORMAT_FLOAT_QUANTIZED = "float-quantized"
FORMAT_NAIVE_QUANTIZED = "naive-quantized"
FORMAT_MIXED_PRECISION = "mixed-precision"
# formats whose tensors quantspec can read and write (the rest of compressed-tensors' formats —
# sparse, marlin, nvfp4/mxfp — are refused on load with one line)
SUPPORTED_FORMATS = (
    FORMAT_PACK_QUANTIZED,
    FORMAT_INT_QUANTIZED,
    FORMAT_FLOAT_QUANTIZED,
    FORMAT_NAIVE_QUANTIZED,
)
STATUS_COMPRESSED = "compressed"
# smallest group size `resolve_group_size` hands out: torch's CPU int4 op takes 32..256 and the
# Triton kernels need a power of two ≥ 16
MIN_GROUP_SIZE = 16

_TYPES = ("int", "float")
_STRATEGIES = ("tensor", "channel", "group", "token", "attn_head")
_ACTIVATION_STRATEGIES = ("tensor", "token", "group", "attn_head")
_ACTORDER = {"weight": "weight", "static": "weight"}
# float zero-point dtypes (compressed-tensors' `zp_dtype`): the zero point is cast, not rounded,
# so w = (q - zp) * scale can sit on a float-offset grid such as GGUF Q4_1 (w = d*q + m)
ZP_FLOAT_DTYPES = ("float16", "bfloat16", "float32")
# integer dtypes another tool may name as zp_dtype: the default integer zero points
_ZP_INT_DTYPES = ("int8", "int16", "int32", "int64", "uint8")


class QuantType(str, enum.Enum):
    """The four quantization types quantspec produces (names from the project documents)."""

    WEIGHT_ONLY_INT8 = "weight_only_int8"  # int8 weights, per output channel
    WEIGHT_ONLY_INT4 = "weight_only_int4"  # int4 weights, per group along K
    A8W8 = "a8w8"  # int8 per-channel weights + static per-tensor int8 activation scales
    A8W8_FP8 = "a8w8_fp8"  # FP8 E4M3 per-channel weights + static per-tensor FP8 activations

    @classmethod
    def parse(cls, value: "QuantType | str") -> "QuantType":
        if isinstance(value, QuantType):
            return value
        try:
            return cls(str(value).lower())
        except ValueError:
            names = ", ".join(t.value for t in cls)
            raise QuantSpecError(f"unknown --quant-type {value!r}; use one of: {names}") from None


def _err(where: str, msg: str) -> QuantSpecError:
    return QuantSpecError(f"{where}: {msg}")


@dataclass(frozen=True)
class QuantArgs:
    """How one tensor (a weight, an activation, the KV cache) is quantized.

    `strategy` decides the granularity of the scales: `tensor` (one), `channel` (one per output
    row of a weight [N, K] → [N, 1]), `group` (one per `group_size` consecutive input columns →
    [N, K // g]), `token` (one per row of an activation, dynamic only), `attn_head` (one per KV
    head, KV cache only → [H, 1, 1]). Left as None it is inferred like compressed-tensors does:
    no group_size → tensor, group_size > 0 → group, group_size == -1 → channel.

    `zp_dtype` (asymmetric int args only): None keeps integer zero points (compressed-tensors'
    default); "float16" | "bfloat16" | "float32" stores the zero point as that float, unrounded
    (compressed-tensors' `zp_dtype`), so the grid's offset need not be a whole step.
    """

    num_bits: int = 8
    type: str = "int"
    symmetric: bool = True
    strategy: str | None = None
    group_size: int | None = None
    dynamic: bool = False
    observer: str | None = None
    actorder: str | None = None
    zp_dtype: str | None = None

    def __post_init__(self) -> None:
        w = "QuantArgs"
        if not isinstance(self.num_bits, int) or isinstance(self.num_bits, bool):
            raise _err(w, f"num_bits must be an int, got {self.num_bits!r}")
        t = str(self.type.value if isinstance(self.type, enum.Enum) else self.type).lower()
        if t not in _TYPES:
            raise _err(w, f"type must be 'int' or 'float', got {self.type!r}")
        object.__setattr__(self, "type", t)
        if t == "int" and not 2 <= self.num_bits <= 8:
            raise _err(w, f"num_bits={self.num_bits} unsupported for type 'int'; use 2..8 (4 or 8)")
        if t == "float" and self.num_bits != 8:
            raise _err(w, f"num_bits={self.num_bits} unsupported for type 'float'; only FP8 "
                          "(num_bits=8, E4M3) is supported")
        if t == "float" and not self.symmetric:
            raise _err(w, "asymmetric FP8 is unsupported; set symmetric=True")
        if self.group_size is not None:
            if not isinstance(self.group_size, int) or isinstance(self.group_size, bool) or \
                    self.group_size == 0 or self.group_size < -1:
                raise _err(w, f"group_size must be a positive int (strategy 'group') or -1 "
                              f"(strategy 'channel'), got {self.group_size!r}")
        strategy = self.strategy
        if isinstance(strategy, enum.Enum):
            strategy = strategy.value
        if strategy is None:
            if self.group_size is None:
                strategy = "tensor"
            elif self.group_size > 0:
                strategy = "group"
            else:
                strategy = "channel"
        strategy = str(strategy).lower()
        if strategy not in _STRATEGIES:
            raise _err(w, f"strategy {strategy!r} unsupported; use one of {', '.join(_STRATEGIES)}")
        object.__setattr__(self, "strategy", strategy)
        if strategy == "group" and (self.group_size is None or self.group_size <= 0):
            raise _err(w, "strategy 'group' needs group_size > 0; set group_size (e.g. 128)")
        if self.group_size is not None and self.group_size > 0 and strategy != "group":
            raise _err(w, f"group_size={self.group_size} needs strategy 'group', "
                          f"got strategy {strategy!r}")
        if self.group_size == -1 and strategy != "channel":
            raise _err(w, f"group_size=-1 means per-channel; got strategy {strategy!r}")
        if not isinstance(self.dynamic, bool):
            raise _err(w, f"dynamic must be True or False, got {self.dynamic!r} "
                          "(locally dynamic scales are unsupported)")
        if strategy == "token" and not self.dynamic:
            raise _err(w, "strategy 'token' is only possible with dynamic=True")
        if self.dynamic and strategy not in ("token", "tensor", "group"):
            raise _err(w, f"dynamic=True needs strategy token, tensor or group, got {strategy!r}")
        if self.actorder is not None:
            a = str(self.actorder).lower()
            if a not in _ACTORDER:
                raise _err(w, f"actorder {self.actorder!r} unsupported; use 'weight' "
                              "(alias 'static') or None")
            object.__setattr__(self, "actorder", _ACTORDER[a])
        if self.zp_dtype is not None:
            z = str(self.zp_dtype).removeprefix("torch.")  # also takes a torch.dtype
            if z not in ZP_FLOAT_DTYPES:
                raise _err(w, f"zp_dtype {self.zp_dtype!r} unsupported; use one of "
                              f"{', '.join(ZP_FLOAT_DTYPES)} or None (integer zero points)")
            if t != "int" or self.symmetric:
                raise _err(w, "a float zp_dtype needs asymmetric int weights; set "
                              "symmetric=False (--asym) or drop zp_dtype")
            object.__setattr__(self, "zp_dtype", z)

    # ---- derived -------------------------------------------------------------------------
    @property
    def q_min(self) -> float:
        """Smallest quantized value (int: -2^(b-1); fp8 E4M3: -448)."""
        return -float(2 ** (self.num_bits - 1)) if self.type == "int" else -448.0

    @property
    def q_max(self) -> float:
        """Largest quantized value (int: 2^(b-1) - 1; fp8 E4M3: 448)."""
        return float(2 ** (self.num_bits - 1) - 1) if self.type == "int" else 448.0

    @property
    def is_fp8(self) -> bool:
        return self.type == "float"

    def replace(self, **changes: Any) -> "QuantArgs":
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    # ---- compressed-tensors JSON ------------------------------------------------------------
    def to_dict(self) -> dict:
        """The compressed-tensors `QuantizationArgs.model_dump()` of these args."""
        d: dict[str, Any] = {
            "num_bits": self.num_bits,
            "type": self.type,
            "symmetric": self.symmetric,
            "group_size": self.group_size,
            "strategy": self.strategy,
            "dynamic": self.dynamic,
        }
        if self.actorder is not None:
            d["actorder"] = self.actorder
        if self.observer is not None:
            d["observer"] = self.observer
        if self.zp_dtype is not None:
            d["zp_dtype"] = f"torch.{self.zp_dtype}"  # compressed-tensors writes str(torch.dtype)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], where: str = "QuantArgs") -> "QuantArgs":
        """Read compressed-tensors' JSON for one `QuantizationArgs`; refuse what we cannot run."""
        if not isinstance(d, Mapping):
            raise _err(where, f"expected a mapping, got {type(d).__name__}")
        known = {"num_bits", "type", "symmetric", "group_size", "strategy", "dynamic",
                 "observer", "actorder", "block_structure", "scale_dtype", "zp_dtype",
                 "observer_kwargs"}
        unknown = sorted(set(d) - known)
        if unknown:
            raise _err(where, f"unknown key(s) {unknown}; remove them")
        if d.get("block_structure") is not None:
            raise _err(where, "block quantization (block_structure) is unsupported; "
                              "re-quantize with strategy 'channel' or 'group'")
        if d.get("scale_dtype") is not None:
            raise _err(where, f"scale_dtype={d['scale_dtype']!r} (MX/NV FP4 scales) is "
                              "unsupported; use float scales")
        strategy = d.get("strategy")
        if strategy in ("block", "tensor_group"):
            raise _err(where, f"strategy {strategy!r} is unsupported; use tensor, channel, "
                              "group, token or attn_head")
        dynamic = d.get("dynamic", False)
        if isinstance(dynamic, str):
            raise _err(where, f"dynamic={dynamic!r} (locally dynamic) is unsupported")
        actorder = d.get("actorder")
        if actorder is False:
            actorder = None
        zp_dtype = d.get("zp_dtype")
        if zp_dtype is not None:
            z = str(zp_dtype).removeprefix("torch.")
            if z in _ZP_INT_DTYPES or d.get("symmetric", True):
                zp_dtype = None  # integer zero points (the default), or none at all (symmetric)
            elif z not in ZP_FLOAT_DTYPES:
                raise _err(where, f"zp_dtype {zp_dtype!r} is unsupported; quantspec reads "
                                  f"integer or {'/'.join(ZP_FLOAT_DTYPES)} zero points")
        try:
            return cls(
                num_bits=d.get("num_bits", 8),
                type=d.get("type", "int"),
                symmetric=d.get("symmetric", True),
                strategy=strategy,
                group_size=d.get("group_size"),
                dynamic=dynamic,
                observer=d.get("observer"),
                actorder=actorder,
                zp_dtype=zp_dtype,
            )
        except QuantSpecError as e:
            raise QuantSpecError(f"{where}: {e}") from None


def scheme_format(weights: QuantArgs | None, input_activations: QuantArgs | None = None) -> str:
    """The compressed-tensors format name for a scheme's weights.

    fp8 → "float-quantized" (float8_e4m3fn `weight`); int with quantized input activations (W8A8)
    → "int-quantized" (plain int8 `weight`); int weight-only (W4A16, W8A16) → "pack-quantized"
    (int32 words), what compressed-tensors writes for them and the only integer weight-only
    format vLLM and SGLang load.
    """
    if weights is None:
        raise QuantSpecError("scheme_format: a scheme without weights has no weight format")
    if weights.type == "float":
        return FORMAT_FLOAT_QUANTIZED
    if weights.num_bits < 8 or input_activations is None:
        return FORMAT_PACK_QUANTIZED
    return FORMAT_INT_QUANTIZED


@dataclass(frozen=True)
class QuantScheme:
    """Which modules (`targets`) get which weight / input-activation args, and their format."""

    targets: tuple[str, ...]
    weights: QuantArgs | None = None
    input_activations: QuantArgs | None = None
    format: str | None = None

    def __post_init__(self) -> None:
        w = "QuantScheme"
        targets = self.targets
        if isinstance(targets, str) or not isinstance(targets, Iterable):
            raise _err(w, f"targets must be a list of names, got {targets!r}")
        targets = tuple(targets)
        if not targets or not all(isinstance(t, str) and t for t in targets):
            raise _err(w, f"targets must be a non-empty list of non-empty strings, got {targets!r}")
        for t in targets:
            if t.startswith("re:"):
                try:
                    re.compile(t[3:])
                except re.error as e:
                    raise _err(w, f"target {t!r} is not a valid regex ({e})") from None
        object.__setattr__(self, "targets", targets)
        if self.weights is not None and not isinstance(self.weights, QuantArgs):
            raise _err(w, f"weights must be QuantArgs, got {type(self.weights).__name__}")
        ia = self.input_activations
        if ia is not None:
            if not isinstance(ia, QuantArgs):
                raise _err(w, f"input_activations must be QuantArgs, got {type(ia).__name__}")
            if ia.strategy not in _ACTIVATION_STRATEGIES or ia.strategy == "attn_head":
                raise _err(w, f"input_activations strategy {ia.strategy!r} unsupported; use "
                              "tensor (static) or token (dynamic)")
        if self.weights is None and ia is None:
            raise _err(w, "a scheme needs weights and/or input_activations")
        fmt = self.format
        if fmt is None and self.weights is not None:
            fmt = scheme_format(self.weights, ia)
        if fmt is not None and fmt not in SUPPORTED_FORMATS:
            raise _err(w, f"format {fmt!r} is unsupported; use one of {', '.join(SUPPORTED_FORMATS)}")
        if fmt == FORMAT_PACK_QUANTIZED and self.weights is not None and self.weights.type != "int":
            raise _err(w, "format 'pack-quantized' needs int weights; use 'float-quantized' for FP8")
        object.__setattr__(self, "format", fmt)

    def to_dict(self) -> dict:
        return {
            "targets": list(self.targets),
            "weights": None if self.weights is None else self.weights.to_dict(),
            "input_activations": None if self.input_activations is None
            else self.input_activations.to_dict(),
            "output_activations": None,
            "format": self.format,
        }

    @classmethod
    def from_dict(cls, d: Any, where: str = "QuantScheme", default_format: str | None = None
                  ) -> "QuantScheme":
        if isinstance(d, (list, tuple)):
            raise _err(where, "preset-name config groups (a group named after a preset with a "
                              "list of targets) are unsupported; write the scheme out in full")
        if not isinstance(d, Mapping):
            raise _err(where, f"expected a mapping, got {type(d).__name__}")
        known = {"targets", "weights", "input_activations", "output_activations", "format"}
        unknown = sorted(set(d) - known)
        if unknown:
            raise _err(where, f"unknown key(s) {unknown}; remove them")
        if d.get("output_activations") is not None:
            raise _err(where, "output_activations quantization is unsupported; remove it")
        fmt = d.get("format") or default_format
        if fmt == FORMAT_MIXED_PRECISION:
            fmt = None
        if fmt is not None and fmt not in SUPPORTED_FORMATS:
            raise _err(where, f"format {fmt!r} is unsupported by quantspec; supported: "
                              f"{', '.join(SUPPORTED_FORMATS)}")
        weights = d.get("weights")
        ia = d.get("input_activations")
        try:
            return cls(
                targets=tuple(d.get("targets") or ()),
                weights=None if weights is None else QuantArgs.from_dict(weights, f"{where}.weights"),
                input_activations=None if ia is None
                else QuantArgs.from_dict(ia, f"{where}.input_activations"),
                format=fmt,
            )
        except QuantSpecError as e:
            msg = str(e)
            raise QuantSpecError(msg if msg.startswith(where) else f"{where}: {msg}") from None


def _infer_quant_type(groups: Mapping[str, QuantScheme]) -> QuantType | None:
    """Name the quant type a set of schemes implements (None when it is none of ours)."""
    found = set()
    for s in groups.values():
        w, a = s.weights, s.input_activations
        if w is None:
            return None
        if w.type == "float":
            found.add(QuantType.A8W8_FP8)
        elif w.num_bits == 4 and a is None:
            found.add(QuantType.WEIGHT_ONLY_INT4)
        elif w.num_bits == 8 and a is None:
            found.add(QuantType.WEIGHT_ONLY_INT8)
        elif w.num_bits == 8 and a is not None and a.type == "int":
            found.add(QuantType.A8W8)
        else:
            return None
    return found.pop() if len(found) == 1 else None


@dataclass(frozen=True)
class QuantConfig:
    """A model's quantization: named config groups, the ignore list and the KV-cache args.

    `quant_type` and `provenance` are quantspec's own (not part of compressed-tensors' JSON);
    the artifact writer stores them beside the config.
    """

    config_groups: Mapping[str, QuantScheme]
    ignore: tuple[str, ...] = ("lm_head",)
    kv_cache_scheme: QuantArgs | None = None
    format: str | None = None
    quant_type: QuantType | None = None
    provenance: Mapping[str, Any] = field(default_factory=dict)
    quantization_status: str = STATUS_COMPRESSED

    def __post_init__(self) -> None:
        w = "QuantConfig"
        if not isinstance(self.config_groups, Mapping) or not self.config_groups and \
                self.kv_cache_scheme is None:
            raise _err(w, "config_groups must be a non-empty mapping of name → QuantScheme")
        groups = OrderedDict()
        for name, s in self.config_groups.items():
            if not isinstance(s, QuantScheme):
                raise _err(w, f"config_groups[{name!r}] must be a QuantScheme, "
                              f"got {type(s).__name__}")
            groups[str(name)] = s
        object.__setattr__(self, "config_groups", groups)
        ignore = self.ignore
        if isinstance(ignore, str) or ignore is None:
            raise _err(w, f"ignore must be a list of module names, got {ignore!r}")
        object.__setattr__(self, "ignore", tuple(ignore))
        kv = self.kv_cache_scheme
        if kv is not None:
            if not isinstance(kv, QuantArgs):
                raise _err(w, f"kv_cache_scheme must be QuantArgs, got {type(kv).__name__}")
            if kv.num_bits != 8 or kv.strategy not in ("tensor", "attn_head") or kv.dynamic:
                raise _err(w, "kv_cache_scheme must be static 8-bit (int8 or fp8) with strategy "
                              f"'tensor' or 'attn_head', got {kv.to_dict()}")
        formats = {s.format for s in groups.values() if s.format is not None}
        fmt = self.format
        if fmt is None:
            fmt = formats.pop() if len(formats) == 1 else (
                FORMAT_MIXED_PRECISION if formats else "dense")
        elif fmt not in SUPPORTED_FORMATS + (FORMAT_MIXED_PRECISION, "dense"):
            raise _err(w, f"format {fmt!r} is unsupported; use one of {', '.join(SUPPORTED_FORMATS)}")
        object.__setattr__(self, "format", fmt)
        qt = self.quant_type
        if qt is None:
            qt = _infer_quant_type(groups)
        else:
            qt = QuantType.parse(qt)
        object.__setattr__(self, "quant_type", qt)
        if not isinstance(self.provenance, Mapping):
            raise _err(w, "provenance must be a mapping")
        object.__setattr__(self, "provenance", dict(self.provenance))

    # ---- compressed-tensors JSON ------------------------------------------------------------
    def to_dict(self) -> dict:
        """The exact compressed-tensors `quantization_config` JSON."""
        return {
            "config_groups": {n: s.to_dict() for n, s in self.config_groups.items()},
            "quant_method": QUANT_METHOD,
            "kv_cache_scheme": None if self.kv_cache_scheme is None else self.kv_cache_scheme.to_dict(),
            "format": self.format,
            "quantization_status": self.quantization_status,
            "global_compression_ratio": None,
            "ignore": list(self.ignore),
            "moe_sparsity_config": None,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "QuantConfig":
        """Read a `quantization_config` written by compressed-tensors / llm-compressor / us."""
        w = "quantization_config"
        if not isinstance(d, Mapping):
            raise _err(w, f"expected a mapping, got {type(d).__name__}")
        qm = d.get("quant_method", QUANT_METHOD)
        if qm != QUANT_METHOD:
            raise _err(w, f"quant_method {qm!r} is unsupported; quantspec reads "
                          f"{QUANT_METHOD!r} checkpoints only")
        known = {"config_groups", "quant_method", "kv_cache_scheme", "format",
                 "quantization_status", "global_compression_ratio", "ignore",
                 "moe_sparsity_config", "sparsity_config", "transform_config", "version"}
        unknown = sorted(set(d) - known)
        if unknown:
            raise _err(w, f"unknown key(s) {unknown}; remove them")
        if d.get("sparsity_config"):
            raise _err(w, "sparse checkpoints (sparsity_config) are unsupported")
        if d.get("transform_config"):
            raise _err(w, "transformed checkpoints (transform_config) are unsupported")
        if d.get("moe_sparsity_config"):
            raise _err(w, "moe_sparsity_config is unsupported")
        fmt = d.get("format")
        if fmt is not None and fmt not in SUPPORTED_FORMATS + (FORMAT_MIXED_PRECISION,):
            raise _err(w, f"format {fmt!r} is unsupported by quantspec; supported: "
                          f"{', '.join(SUPPORTED_FORMATS)}")
        status = d.get("quantization_status", STATUS_COMPRESSED)
        if status not in (STATUS_COMPRESSED, "frozen"):
            raise _err(w, f"quantization_status {status!r}: quantspec reads compressed "
                          "checkpoints only; compress it first")
        groups_in = d.get("config_groups") or {}
        if not isinstance(groups_in, Mapping):
            raise _err(w, "config_groups must be a mapping of name → scheme")
        default_fmt = fmt if fmt != FORMAT_MIXED_PRECISION else None
        groups = OrderedDict(
            (name, QuantScheme.from_dict(s, f"{w}.config_groups[{name!r}]", default_fmt))
            for name, s in groups_in.items()
        )
        kv = d.get("kv_cache_scheme")
        ignore = d.get("ignore") or ()
        return cls(
            config_groups=groups,
            ignore=tuple(ignore),
            kv_cache_scheme=None if kv is None else QuantArgs.from_dict(kv, f"{w}.kv_cache_scheme"),
            format=fmt,
            quantization_status=STATUS_COMPRESSED,
        )

    # ---- matching ----------------------------------------------------------------------------
    def is_ignored(self, module_name: str, module_classes: Iterable[str] = ("Linear",)) -> bool:
        """True when `ignore` names this module (exact name, `re:` regex or class name)."""
        classes = (module_classes,) if isinstance(module_classes, str) else tuple(module_classes)
        return any(_match_name(module_name, t) or t in classes for t in self.ignore)

    def scheme_for(self, module_name: str, module_classes: Iterable[str] = ("Linear",)
                   ) -> QuantScheme | None:
        """The scheme compressed-tensors would attach to this module, or None.

        `module_classes` are the class names in the module's MRO (a `torch.nn.Linear` is
        `("Linear",)`). Priority: ignore list, then exact name > regex > class name.
        """
        classes = (module_classes,) if isinstance(module_classes, str) else tuple(module_classes)
        if self.is_ignored(module_name, classes):
            return None
        target_to_scheme: "OrderedDict[str, QuantScheme]" = OrderedDict()
        for s in self.config_groups.values():
            for t in s.targets:
                target_to_scheme[t] = s
        ordered = sorted(target_to_scheme, key=lambda t: (t.startswith("re:"), t))
        for t in ordered:
            if _match_name(module_name, t):
                return target_to_scheme[t]
        for t in ordered:
            if t in classes:
                return target_to_scheme[t]
        return None

    def weight_args_for(self, module_name: str, module_classes: Iterable[str] = ("Linear",)
                        ) -> QuantArgs | None:
        s = self.scheme_for(module_name, module_classes)
        return None if s is None else s.weights

    # ---- per-layer group sizes ------------------------------------------------------------------
    def with_group_sizes(self, group_sizes: Mapping[str, int]) -> "QuantConfig":
        """The config with each Linear in `group_sizes` quantized at its group size (-1 = per
        channel), arranged so that every loader resolves every layer to it.

        The base group's class target takes the size most of the fused Linears (q/k/v,
        gate/up: the layers vLLM and SGLang fuse) have, else the most common size; only the
        Linears with another size become extra groups, written with
        `engines.fused_targets` (a whole fused unit as one regex that also names the fused
        layer, which SGLang matches before class names; other Linears by exact name).
        Example, hidden 192 / intermediate 512 at 128: q/k/v/o/gate/up resolve to 64, down_proj
        to 128 → the class group gets 64 and down_proj alone is name-targeted at 128.
        """
        from quantspec.quant.engines import FUSED_LAYERS

        fused = {s for shards in FUSED_LAYERS.values() for s in shards}
        by_base: "OrderedDict[str, dict[str, int]]" = OrderedDict()
        for name in sorted(group_sizes):
            s = self.scheme_for(name)
            if s is None or s.weights is None:
                raise QuantSpecError(f"with_group_sizes: {name!r} is not quantized by this "
                                     "config; drop it from the sizes")
            group_name = next(n for n, v in self.config_groups.items() if v is s)
            by_base.setdefault(group_name, {})[name] = group_sizes[name]
        groups = OrderedDict(self.config_groups)
        overrides: dict[str, int] = {}
        for group_name, sizes in by_base.items():
            base = groups[group_name]
            if not any(not t.startswith("re:") and "." not in t for t in base.targets):
                overrides.update(sizes)  # a name-targeted group keeps its size; others move out
                continue
            pool = [g for n, g in sizes.items() if n.rsplit(".", 1)[-1] in fused] or list(sizes.values())
            size = max(set(pool), key=lambda g: (pool.count(g), g))
            groups[group_name] = dataclasses.replace(base, weights=_with_size(base.weights, size))
            overrides.update({n: g for n, g in sizes.items() if g != size})
        config = dataclasses.replace(self, config_groups=groups, format=None)
        return config.with_layer_group_sizes(overrides) if overrides else config

    def with_layer_group_sizes(self, layer_group_sizes: Mapping[str, int]) -> "QuantConfig":
        """Give some layers a different group size (-1 = per-channel) than their scheme says.

        Each distinct (scheme, group size) override becomes an extra config group whose
        `targets` are `engines.fused_targets` of the names (exact names, a whole fused unit as
        one regex), which outrank class targets in every compressed-tensors loader.
        """
        from quantspec.quant.engines import fused_targets

        groups = OrderedDict(self.config_groups)
        buckets: "OrderedDict[tuple[str, int], list[str]]" = OrderedDict()
        for name in sorted(layer_group_sizes):
            g = layer_group_sizes[name]
            s = self.scheme_for(name)
            if s is None or s.weights is None:
                raise QuantSpecError(f"with_layer_group_sizes: {name!r} is not quantized by this "
                                     "config; drop it from the overrides")
            current = s.weights.group_size if s.weights.strategy == "group" else -1
            if g == current:
                continue
            group_name = next(n for n, v in self.config_groups.items() if v is s)
            buckets.setdefault((group_name, g), []).append(name)
        i = len(groups)
        for (group_name, g), names in buckets.items():
            base = self.config_groups[group_name]
            while f"group_{i}" in groups:
                i += 1
            # the name-targeted group must not also hold the class targets of its base group
            groups[f"group_{i}"] = QuantScheme(targets=fused_targets(names),
                                               weights=_with_size(base.weights, g),
                                               input_activations=base.input_activations,
                                               format=base.format)
            i += 1
        return dataclasses.replace(self, config_groups=groups, format=None)

    def quantspec_metadata(self) -> dict:
        """quantspec's own fields (stored beside config.json by the artifact writer)."""
        return {"quant_type": None if self.quant_type is None else self.quant_type.value,
                "provenance": copy.deepcopy(dict(self.provenance))}


def _with_size(w: QuantArgs, g: int) -> QuantArgs:
    return w.replace(group_size=g, strategy="group" if g > 0 else "channel")


def _match_name(name: str, target: str) -> bool:
    if target.startswith("re:"):
        return re.match(target[3:], name) is not None
    return target == name


def resolve_group_size(K: int, requested: int) -> int:
    """The group size to use for a layer with input dim `K` when `requested` was asked for.

    The largest power of two ≤ `requested` that divides K and is ≥ 16 (torch's CPU int4 ops take
    32/64/128/256, the Triton kernels any power of two ≥ 16); -1 (per-channel) when none exists
    or when -1 was requested. Example: K=576, requested=128 → 64; K=1536 → 128; K=100 → -1.
    """
    if not isinstance(K, int) or K <= 0:
        raise QuantSpecError(f"resolve_group_size: K must be a positive int, got {K!r}")
    if requested == -1:
        return -1
    if not isinstance(requested, int) or requested < MIN_GROUP_SIZE:
        raise QuantSpecError(f"--group-size {requested!r} is too small; use a power of two "
                             f"≥ {MIN_GROUP_SIZE} (e.g. 128) or -1 for per-channel")
    g = 1 << (requested.bit_length() - 1)  # largest power of two ≤ requested
    while g >= MIN_GROUP_SIZE:
        if K % g == 0:
            if g != requested:
                _LOG.info("group_size %d does not divide K=%d; using %d for this layer",
                          requested, K, g)
            return g
        g //= 2
    _LOG.warning("no power-of-two group size in [%d, %d] divides K=%d; using per-channel scales "
                 "for this layer", MIN_GROUP_SIZE, requested, K)
    return -1


WEIGHT_OBSERVERS = ("minmax", "mse")  # how quantize picks weight scales (choose_qparams)


def default_weight_observer(quant_type: QuantType | str) -> str:
    """mse for weight_only_int4, minmax for the 8-bit types.

    With 16 levels the clipping search pays: on the default model GPTQ g64 (64 × 512 calibration
    tokens, act-order) held-out ppl 28.19 → 26.74, RTN g64 31.51 → 31.02; at 8 bits min/max is
    already close to the best range, and the a8w8 weights are smoothed against their inputs.
    """
    return "mse" if QuantType.parse(quant_type) is QuantType.WEIGHT_ONLY_INT4 else "minmax"


def preset(quant_type: QuantType | str, group_size: int = 128, symmetric: bool = True,
           ignore: Iterable[str] = ("lm_head",), kv_cache: str | None = None,
           kv_strategy: str = "attn_head", zp_dtype: str | None = None,
           weight_observer: str | None = None) -> QuantConfig:
    """The config for one of quantspec's quant types, as plain data.

    weight_only_int8: int8 per-channel weights (8-bit "pack-quantized").
    weight_only_int4: int4 group-wise weights ("pack-quantized"); `group_size` applies, and with
    symmetric=False `zp_dtype` ("float16" | "bfloat16" | "float32") gives float zero points.
    a8w8: int8 per-channel weights + static per-tensor int8 input scales ("int-quantized").
    a8w8_fp8: FP8 E4M3 per-channel weights + static per-tensor FP8 input scales ("float-quantized").
    `kv_cache` ("int8" | "fp8" | None) adds a static KV-cache scheme (`kv_strategy` "attn_head"
    = one scale per KV head, or "tensor"). `weight_observer` "mse" searches each weight scale's
    range (see `quant.primitives.mse_qparams`) and is recorded as the weights' `observer`;
    None → `default_weight_observer(quant_type)`.
    """
    qt = QuantType.parse(quant_type)
    weight_observer = weight_observer or default_weight_observer(qt)
    if weight_observer not in WEIGHT_OBSERVERS:
        raise QuantSpecError(f"unknown --weight-observer {weight_observer!r}; use one of: "
                             f"{', '.join(WEIGHT_OBSERVERS)}")
    if zp_dtype is not None:
        if qt is not QuantType.WEIGHT_ONLY_INT4:
            raise QuantSpecError(f"--zp-dtype {zp_dtype} is for weight_only_int4 only; "
                                 f"drop it for {qt.value}")
        if symmetric:
            raise QuantSpecError(f"--zp-dtype {zp_dtype} needs asymmetric weights; add --asym")
    ia = None
    if qt is QuantType.WEIGHT_ONLY_INT8:
        w = QuantArgs(num_bits=8, type="int", symmetric=symmetric, strategy="channel")
    elif qt is QuantType.WEIGHT_ONLY_INT4:
        if group_size != -1 and (isinstance(group_size, bool) or not isinstance(group_size, int)
                                 or group_size < MIN_GROUP_SIZE):
            raise QuantSpecError(f"--group-size {group_size!r} must be -1 (per channel) or at least "
                                 f"{MIN_GROUP_SIZE}, e.g. 128")
        if group_size == -1:
            w = QuantArgs(num_bits=4, type="int", symmetric=symmetric, strategy="channel",
                          zp_dtype=zp_dtype)
        else:
            w = QuantArgs(num_bits=4, type="int", symmetric=symmetric, strategy="group",
                          group_size=group_size, zp_dtype=zp_dtype)
    elif qt is QuantType.A8W8:
        w = QuantArgs(num_bits=8, type="int", symmetric=symmetric, strategy="channel")
        ia = QuantArgs(num_bits=8, type="int", symmetric=True, strategy="tensor",
                       dynamic=False, observer="minmax")
    else:
        if not symmetric:
            raise QuantSpecError("a8w8_fp8 is symmetric only; drop --asym")
        w = QuantArgs(num_bits=8, type="float", symmetric=True, strategy="channel")
        ia = QuantArgs(num_bits=8, type="float", symmetric=True, strategy="tensor",
                       dynamic=False, observer="minmax")
    if weight_observer != "minmax":
        w = w.replace(observer=weight_observer)
    kv = None
    if kv_cache is not None:
        kind = str(kv_cache).lower().removeprefix("cachekv_")
        if kind not in ("int8", "fp8"):
            raise QuantSpecError(f"--kv-cache {kv_cache!r} unsupported; use int8 or fp8")
        kv = QuantArgs(num_bits=8, type="int" if kind == "int8" else "float", symmetric=True,
                       strategy=kv_strategy, dynamic=False)
    scheme = QuantScheme(targets=("Linear",), weights=w, input_activations=ia)
    return QuantConfig(config_groups={"group_0": scheme}, ignore=tuple(ignore),
                       kv_cache_scheme=kv, quant_type=qt)
