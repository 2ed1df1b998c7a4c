"""The model-level quantization config (compressed-tensors' `QuantizationConfig`): config
groups of schemes, `ignore`, the KV-cache scheme and the format, as the `quantization_config`
block of a checkpoint's config.json.

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
import logging
import re
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

from quantspec.errors import QuantSpecError
from quantspec.quant.args import (
    FORMAT_MIXED_PRECISION,
    MIN_GROUP_SIZE,
    QUANT_METHOD,
    STATUS_COMPRESSED,
    SUPPORTED_FORMATS,
    QuantArgs,
    QuantType,
    _err,
)
from quantspec.quant.hf_fp8 import HF_FP8_METHOD, config_from_hf_fp8
from quantspec.quant.scheme import QuantScheme, is_mxfp4_fp8_inputs, is_w4a8

_LOG = logging.getLogger(__name__)

__all__ = ["QuantConfig", "layer_size", "resolve_block_size", "resolve_group_size"]


def _infer_quant_type(groups: Mapping[str, QuantScheme]) -> QuantType | None:
    """Name the quant type a set of schemes implements (None when it is none of ours)."""
    found = set()
    for s in groups.values():
        w, a = s.weights, s.input_activations
        if w is None:
            return None
        if w.is_mxfp8:
            found.add(QuantType.WEIGHT_ONLY_MXFP8 if a is None else QuantType.MXFP8)
        elif w.is_mx:
            found.add(QuantType.WEIGHT_ONLY_MXFP4 if a is None else QuantType.A8W4_MXFP4 if is_mxfp4_fp8_inputs(a)
                      else QuantType.MXFP4)
        elif w.is_fp4:
            found.add(QuantType.WEIGHT_ONLY_NVFP4 if a is None else QuantType.NVFP4)
        elif w.type == "float":
            found.add(QuantType.A8W8_FP8 if a is not None else QuantType.WEIGHT_ONLY_FP8)
        elif w.num_bits == 4 and a is None:
            found.add(QuantType.WEIGHT_ONLY_INT4)
        elif is_w4a8(w, a):
            found.add(QuantType.A8W4 if a.type == "int" else QuantType.A8W4_FP8)
        elif w.num_bits == 8 and a is None:
            found.add(QuantType.WEIGHT_ONLY_INT8)
        elif w.num_bits == 8 and a is not None and a.type == "int":
            found.add(QuantType.A8W8)
        else:
            return None
    return found.pop() if len(found) == 1 else None


def _own_format_reader(quant_method: str):
    """The reader of a checkpoint in another tool's own format (its `quant_method`), or None."""
    if quant_method == HF_FP8_METHOD:
        return config_from_hf_fp8
    if quant_method == "modelopt":
        from quantspec.quant.modelopt import config_from_modelopt

        return config_from_modelopt
    if quant_method in ("gptq", "awq"):  # `quant.autoquant.AUTOQUANT_METHODS`
        from quantspec.quant.autoquant import config_from_autoquant

        return config_from_autoquant
    if quant_method == "auto-round":  # `quant.autoround.AUTOROUND_METHOD`
        from quantspec.quant.autoround import config_from_autoround

        return config_from_autoround
    if quant_method == "quark":  # `quant.quark.QUARK_METHOD`
        from quantspec.quant.quark import config_from_quark

        return config_from_quark
    if quant_method == "fbgemm_fp8":  # `quant.fbgemm.FBGEMM_METHOD`
        from quantspec.quant.fbgemm import config_from_fbgemm

        return config_from_fbgemm
    return None


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
    # compressed-tensors leaf name → the checkpoint's, where it names a tensor otherwise
    # (transformers' block FP8 checkpoints: weight_scale → weight_scale_inv, `quant.hf_fp8`)
    tensor_names: Mapping[str, str] = field(default_factory=dict)
    # the format of a checkpoint another tool wrote in its own layout ("modelopt": `quant.modelopt`;
    # "gptq", "awq": `quant.autoquant`)
    source: str | None = None
    # inputs clamped to ±this before their per-token quantizer (FBGEMM's activation_scale_ub:
    # `quant.fbgemm`); None: not bounded
    input_bound: float | None = None
    # rotations fused into the weights, as compressed-tensors records them (`calib.rotate`); None: none
    transform_config: Mapping[str, Any] | None = None

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
        } | ({"transform_config": dict(self.transform_config)} if self.transform_config else {})

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "QuantConfig":
        """Read a `quantization_config` written by compressed-tensors / llm-compressor / us, an
        FP8 checkpoint's own (`quant_method: "fp8"`, `quant.hf_fp8`), a ModelOpt NVFP4 / FP8
        checkpoint's (`quant_method: "modelopt"`, `quant.modelopt`), a GPTQ / AWQ one's
        (`quant_method: "gptq"` / `"awq"`, `quant.autoquant`), an AutoRound one's
        (`quant_method: "auto-round"`, `quant.autoround`), an AMD Quark one's (`quant_method:
        "quark"`, `quant.quark`) or an FBGEMM FP8 one's (`quant_method: "fbgemm_fp8"`, `quant.fbgemm`)."""
        w = "quantization_config"
        if not isinstance(d, Mapping):
            raise _err(w, f"expected a mapping, got {type(d).__name__}")
        qm = d.get("quant_method", QUANT_METHOD)
        reader = _own_format_reader(qm)
        if reader is not None:
            return reader(d)
        if qm == "bitsandbytes":  # `quant.bnb` reads it as a source
            raise _err(w, "bitsandbytes checkpoints have no kernel here (nor a method in vLLM 0.33); quantize one "
                          "into an artifact: quantspec quantize --model DIR --quant-type weight_only_int4 --out OUT")
        if qm != QUANT_METHOD:
            raise _err(w, f"quant_method {qm!r} is unsupported; quantspec reads {QUANT_METHOD!r}, "
                          f"{HF_FP8_METHOD!r}, 'modelopt' (NVFP4, FP8), 'gptq', 'awq', 'auto-round', 'quark' (FP8) "
                          "and 'fbgemm_fp8' checkpoints")
        known = {"config_groups", "quant_method", "kv_cache_scheme", "format",
                 "quantization_status", "global_compression_ratio", "ignore",
                 "moe_sparsity_config", "sparsity_config", "transform_config", "version"}
        unknown = sorted(set(d) - known)
        if unknown:
            raise _err(w, f"unknown key(s) {unknown}; remove them")
        if d.get("sparsity_config"):
            raise _err(w, "sparse checkpoints (sparsity_config) are unsupported")
        from quantspec.quant.transforms import read_transform_config

        transforms = read_transform_config(d.get("transform_config"), w)
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
            transform_config=transforms,
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

    def module_scheme(self, module_name: str) -> QuantScheme | None:
        """`scheme_for` a checkpoint module known by name only, as the engines build it: the input
        embedding (`*.embed_tokens`) an `Embedding`, every other module a `Linear`."""
        return self.scheme_for(module_name, ("Embedding",) if module_name.endswith("embed_tokens") else ("Linear",))

    def weight_args_for(self, module_name: str, module_classes: Iterable[str] = ("Linear",)
                        ) -> QuantArgs | None:
        s = self.scheme_for(module_name, module_classes)
        return None if s is None else s.weights

    # ---- per-layer group sizes ------------------------------------------------------------------
    def with_group_sizes(self, group_sizes: Mapping[str, int],
                         targets_for: Callable[[Iterable[str]], tuple[str, ...]] | None = None
                         ) -> "QuantConfig":
        """The config with each Linear in `group_sizes` quantized at its group size (-1 = per
        channel), arranged so that every loader resolves every layer to it.

        The base group's class target takes the size most of the fused Linears (q/k/v,
        gate/up: the layers vLLM and SGLang fuse) have, else the most common size; only the
        Linears with another size become extra groups, written with
        `engines.fused_targets` (a whole fused unit as one regex that also names the fused
        layer, which SGLang matches before class names; other Linears by exact name).
        Example, hidden 192 / intermediate 512 at 128: q/k/v/o/gate/up resolve to 64, down_proj
        to 128 → the class group gets 64 and down_proj alone is name-targeted at 128.
        `targets_for`: see `with_layer_group_sizes`.
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
                if len(set(sizes.values())) == 1:  # a name-targeted group whose Linears agree: resized whole
                    groups[group_name] = _with_size(base, next(iter(sizes.values())))
                else:  # else it keeps its size; the others move out
                    overrides.update(sizes)
                continue
            pool = [g for n, g in sizes.items() if n.rsplit(".", 1)[-1] in fused] or list(sizes.values())
            size = max(set(pool), key=lambda g: (pool.count(g), g))
            groups[group_name] = _with_size(base, size)
            overrides.update({n: g for n, g in sizes.items() if g != size})
        config = dataclasses.replace(self, config_groups=groups, format=None)
        return config.with_layer_group_sizes(overrides, targets_for) if overrides else config

    def with_layer_group_sizes(self, layer_group_sizes: Mapping[str, int],
                               targets_for: Callable[[Iterable[str]], tuple[str, ...]] | None = None
                               ) -> "QuantConfig":
        """Give some layers a different group size (-1 = per-channel) than their scheme says.

        Each distinct (scheme, group size) override becomes an extra config group whose
        `targets` are `engines.fused_targets` of the names (exact names, a whole fused unit as
        one regex), which outrank class targets in every compressed-tensors loader.
        `targets_for(names)`: the targets instead, for a module the engines name otherwise than
        its checkpoint (an EAGLE-3 head: `engines.eagle3_targets`).
        """
        from quantspec.quant.engines import fused_targets

        targets_for = targets_for or fused_targets
        groups = OrderedDict(self.config_groups)
        buckets: "OrderedDict[tuple[str, int], list[str]]" = OrderedDict()
        for name in sorted(layer_group_sizes):
            g = layer_group_sizes[name]
            s = self.scheme_for(name)
            if s is None or s.weights is None:
                raise QuantSpecError(f"with_layer_group_sizes: {name!r} is not quantized by this "
                                     "config; drop it from the overrides")
            current = layer_size(s)
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
            groups[f"group_{i}"] = dataclasses.replace(_with_size(base, g), targets=targets_for(names))
            i += 1
        return dataclasses.replace(self, config_groups=groups, format=None)

    def quantspec_metadata(self) -> dict:
        """quantspec's own fields (stored beside config.json by the artifact writer)."""
        return {"quant_type": None if self.quant_type is None else self.quant_type.value,
                "provenance": copy.deepcopy(dict(self.provenance))}


def layer_size(s: QuantScheme) -> int:
    """The size a layer of scheme `s` is tiled at: the group size, a block's side, the input groups
    of microscaled weights whose FP8 inputs are quantized per group (a8w4_mxfp4: the weights' groups
    are the format's own), or -1 (per channel or per tensor)."""
    w = s.weights
    if s.sized_by_inputs:
        return s.input_activations.group_size
    if w.strategy == "group":
        return w.group_size
    return w.block_structure[1] if w.strategy == "block" else -1


def _with_size(s: QuantScheme, g: int) -> QuantScheme:
    """Scheme `s` at size `g`: group size g, or g × g blocks with inputs in groups of g, or (microscaled
    weights, `QuantScheme.sized_by_inputs`) inputs in groups of g; -1: per channel (a block scheme's inputs then per
    token)."""
    w, ia = s.weights, s.input_activations
    if s.sized_by_inputs:
        ia = ia.replace(group_size=g) if g > 0 else ia.replace(strategy="token", group_size=None)
    elif w.strategy == "block":
        if g > 0:
            w = w.replace(block_structure=(g, g))
            ia = ia if ia is None else ia.replace(group_size=g)
        else:
            w = w.replace(strategy="channel", block_structure=None)
            ia = ia if ia is None else ia.replace(strategy="token", group_size=None)
    else:
        w = w.replace(group_size=g, strategy="group" if g > 0 else "channel")
    return dataclasses.replace(s, weights=w, input_activations=ia)


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


def resolve_block_size(K: int, N: int, requested: tuple[int, int]) -> int:
    """The side of the square blocks for a layer [N, K] when `requested` (bn, bk) was asked for:
    the largest power of two ≤ min(bn, bk) and ≥ 16 that divides both N and K (the engines
    quantize the inputs in groups of the block's width, and split fused layers on block rows);
    -1 (per channel) when none exists. Example: N=192, K=576, (128, 128) → 64."""
    side = min(requested)
    g = 1 << (side.bit_length() - 1)
    while g >= MIN_GROUP_SIZE and (K % g or N % g):
        g //= 2
    if g < MIN_GROUP_SIZE:
        _LOG.warning("no power-of-two block in [%d, %d] tiles a [%d, %d] weight; using per-channel "
                     "scales for this layer", MIN_GROUP_SIZE, side, N, K)
        return -1
    if g != side:
        _LOG.info("%d × %d blocks do not tile a [%d, %d] weight; using %d × %d for this layer",
                  side, side, N, K, g, g)
    return g
