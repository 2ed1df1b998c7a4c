"""Per-tensor quantization args (`QuantArgs`), the quant types and the format names: the first
tier of the typed config (args → scheme → config, as compressed-tensors splits them:
`quant/scheme.py`, `quant/config.py`; quantspec's presets in `quant/presets.py`).

This package's config modules own the *description* of a quantization (no numbers are computed
here). They mirror compressed-tensors' `QuantizationArgs` / `QuantizationScheme` /
`QuantizationConfig` so that `QuantConfig.to_dict()` is exactly the `quantization_config` block of
a compressed-tensors checkpoint (loadable by transformers, vLLM and SGLang) and
`QuantConfig.from_dict()` reads the configs that compressed-tensors / llm-compressor write. Every
object is validated when it is built; bad input raises `QuantSpecError` with one line naming the
field and the fix.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from typing import Any, Mapping

from quantspec.errors import QuantSpecError

__all__ = ["FORMAT_FLOAT_QUANTIZED", "FORMAT_INT_QUANTIZED", "FORMAT_MIXED_PRECISION", "FORMAT_NAIVE_QUANTIZED",
           "FORMAT_MXFP4_PACK_QUANTIZED", "FORMAT_MXFP8_QUANTIZED", "FORMAT_NVFP4_PACK_QUANTIZED", "FORMAT_PACK_QUANTIZED", "MIN_GROUP_SIZE",
           "MX_GROUP_SIZE", "NVFP4_GROUP_SIZE", "QUANT_METHOD",
           "STATUS_COMPRESSED", "SUPPORTED_FORMATS", "ZP_FLOAT_DTYPES", "QuantArgs", "QuantType"]


QUANT_METHOD = "compressed-tensors"
FORMAT_PACK_QUANTIZED = "pack-quantized"
FORMAT_INT_QUANTIZED = "int-quantized"
FORMAT_FLOAT_QUANTIZED = "float-quantized"
FORMAT_NAIVE_QUANTIZED = "naive-quantized"
FORMAT_MIXED_PRECISION = "mixed-precision"
FORMAT_NVFP4_PACK_QUANTIZED = "nvfp4-pack-quantized"
FORMAT_MXFP4_PACK_QUANTIZED = "mxfp4-pack-quantized"
FORMAT_MXFP8_QUANTIZED = "mxfp8-quantized"
# formats whose tensors quantspec can read and write (the rest of compressed-tensors' formats —
# sparse, marlin, MXFP6 — are refused on load with one line)
SUPPORTED_FORMATS = (
    FORMAT_PACK_QUANTIZED,
    FORMAT_INT_QUANTIZED,
    FORMAT_FLOAT_QUANTIZED,
    FORMAT_NAIVE_QUANTIZED,
    FORMAT_NVFP4_PACK_QUANTIZED,
    FORMAT_MXFP4_PACK_QUANTIZED,
    FORMAT_MXFP8_QUANTIZED,
)
STATUS_COMPRESSED = "compressed"
# smallest group size `resolve_group_size` hands out: torch's CPU int4 op takes 32..256 and the
# Triton kernels need a power of two ≥ 16
MIN_GROUP_SIZE = 16
# NVFP4: E2M1 values in groups of 16 along K, one FP8 E4M3 scale per group under one fp32 global
# scale per tensor (strategy "tensor_group")
NVFP4_GROUP_SIZE = 16
_NVFP4_SCALE_DTYPE = "float8_e4m3fn"
# OCP microscaling (MXFP4: E2M1 values, MXFP8: E4M3 values) in groups of 32 along K, one
# power-of-two scale per group stored as its E8M0 exponent (uint8, bias 127), no global scale
# (strategy "group")
MX_GROUP_SIZE = 32
_MX_SCALE_DTYPE = "uint8"

_TYPES = ("int", "float")
_STRATEGIES = ("tensor", "channel", "group", "tensor_group", "block", "token", "attn_head")
_ACTIVATION_STRATEGIES = ("tensor", "token", "group", "tensor_group", "attn_head")
_GROUPED = ("group", "tensor_group")  # the strategies that take a group_size
_ACTORDER = {"weight": "weight", "static": "weight"}
# float zero-point dtypes (compressed-tensors' `zp_dtype`): the zero point is cast, not rounded,
# so w = (q - zp) * scale can sit on a float-offset grid such as GGUF Q4_1 (w = d*q + m)
ZP_FLOAT_DTYPES = ("float16", "bfloat16", "float32")
# integer dtypes another tool may name as zp_dtype: the default integer zero points
_ZP_INT_DTYPES = ("int8", "int16", "int32", "int64", "uint8")


class QuantType(str, enum.Enum):
    """The quantization types quantspec produces."""

    WEIGHT_ONLY_INT8 = "weight_only_int8"  # int8 weights, per output channel
    WEIGHT_ONLY_INT4 = "weight_only_int4"  # int4 weights, per group along K
    A8W8 = "a8w8"  # int8 per-channel weights + static per-tensor int8 activation scales
    A8W8_FP8 = "a8w8_fp8"  # FP8 E4M3 per-channel weights + static per-tensor FP8 activations
    WEIGHT_ONLY_FP8 = "weight_only_fp8"  # FP8 E4M3 per-channel weights, float activations (W8A16 FP8)
    WEIGHT_ONLY_NVFP4 = "weight_only_nvfp4"  # NVFP4 weights, float activations (NVFP4A16)
    NVFP4 = "nvfp4"  # NVFP4 weights × NVFP4 activations (per-group scales at run time, static global)
    WEIGHT_ONLY_MXFP4 = "weight_only_mxfp4"  # MXFP4 weights, float activations (MXFP4A16)
    MXFP4 = "mxfp4"  # MXFP4 weights × MXFP4 activations (power-of-two group scales at run time)
    WEIGHT_ONLY_MXFP8 = "weight_only_mxfp8"  # MXFP8 weights, float activations (MXFP8A16)
    MXFP8 = "mxfp8"  # MXFP8 weights × MXFP8 activations (power-of-two group scales at run time)
    A8W4 = "a8w4"  # int4 group-wise weights × int8 activations quantized per token at run time (W4A8)
    A8W4_FP8 = "a8w4_fp8"  # int4 group-wise weights × FP8 activations quantized per token at run time (W4AFP8)
    A8W4_MXFP4 = "a8w4_mxfp4"  # MXFP4 weights × FP8 activations per group of 128 at run time (MXFP4XFP8)

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


_W = "QuantArgs"  # where QuantArgs' errors say they come from


def _checked_type(num_bits, type_, symmetric) -> str:
    """The lower-case type ("int" | "float") after checking the bit width and symmetry it allows."""
    if not isinstance(num_bits, int) or isinstance(num_bits, bool):
        raise _err(_W, f"num_bits must be an int, got {num_bits!r}")
    t = str(type_.value if isinstance(type_, enum.Enum) else type_).lower()
    if t not in _TYPES:
        raise _err(_W, f"type must be 'int' or 'float', got {type_!r}")
    if t == "int" and not 2 <= num_bits <= 8:
        raise _err(_W, f"num_bits={num_bits} unsupported for type 'int'; use 2..8 (4 or 8)")
    if t == "float" and num_bits not in (8, 4):
        raise _err(_W, f"num_bits={num_bits} unsupported for type 'float'; quantspec runs FP8 "
                       "(num_bits=8, E4M3) and NVFP4 / MXFP4 (num_bits=4, E2M1)")
    if t == "float" and not symmetric:
        raise _err(_W, f"asymmetric FP{num_bits} is unsupported; set symmetric=True")
    return t


def _checked_strategy(strategy, group_size) -> str:
    """The lower-case strategy, inferred from `group_size` when None, and checked against it."""
    if group_size is not None:
        if not isinstance(group_size, int) or isinstance(group_size, bool) or \
                group_size == 0 or group_size < -1:
            raise _err(_W, f"group_size must be a positive int (strategy 'group') or -1 "
                           f"(strategy 'channel'), got {group_size!r}")
    if isinstance(strategy, enum.Enum):
        strategy = strategy.value
    if strategy is None:
        if group_size is None:
            strategy = "tensor"
        elif group_size > 0:
            strategy = "group"
        else:
            strategy = "channel"
    strategy = str(strategy).lower()
    if strategy not in _STRATEGIES:
        raise _err(_W, f"strategy {strategy!r} unsupported; use one of {', '.join(_STRATEGIES)}")
    if strategy in _GROUPED and (group_size is None or group_size <= 0):
        raise _err(_W, f"strategy {strategy!r} needs group_size > 0; set group_size (e.g. 128)")
    if group_size is not None and group_size > 0 and strategy not in _GROUPED:
        raise _err(_W, f"group_size={group_size} needs strategy 'group', "
                       f"got strategy {strategy!r}")
    if group_size == -1 and strategy != "channel":
        raise _err(_W, f"group_size=-1 means per-channel; got strategy {strategy!r}")
    return strategy


def _checked_block(block_structure, strategy: str) -> tuple[int, int] | None:
    """(rows, columns) of a block strategy's blocks ([bn, bk], or compressed-tensors' older
    "bnxbk" string); None for every other strategy."""
    if strategy != "block":
        if block_structure is not None:
            raise _err(_W, f"block_structure needs strategy 'block', got strategy {strategy!r}")
        return None
    b = block_structure.lower().split("x") if isinstance(block_structure, str) else block_structure
    try:
        dims = tuple(int(v) if isinstance(v, str) else v for v in b)
    except (TypeError, ValueError):
        dims = ()
    if len(dims) != 2 or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in dims):
        raise _err(_W, f"strategy 'block' needs block_structure [rows, columns] of two positive ints, "
                       f"got {block_structure!r}; e.g. [128, 128]")
    return dims


def _checked_dynamic(dynamic, strategy: str) -> bool | str:
    """True | False, or "local" (NVFP4 inputs: group scales at run time under a static global
    scale, compressed-tensors' `DynamicType.LOCAL`)."""
    if isinstance(dynamic, enum.Enum):
        dynamic = dynamic.value
    if isinstance(dynamic, str) and dynamic.lower() == "local":
        if strategy != "tensor_group":
            raise _err(_W, f"dynamic='local' needs strategy 'tensor_group' (NVFP4 inputs), got {strategy!r}")
        return "local"
    if not isinstance(dynamic, bool):
        raise _err(_W, f"dynamic must be True, False or 'local', got {dynamic!r}")
    _check_dynamic(dynamic, strategy)
    return dynamic


def _check_dynamic(dynamic: bool, strategy: str) -> None:
    if strategy == "token" and not dynamic:
        raise _err(_W, "strategy 'token' is only possible with dynamic=True")
    if dynamic and strategy not in ("token", "tensor", "group"):
        raise _err(_W, f"dynamic=True needs strategy token, tensor or group, got {strategy!r}")


def _checked_actorder(actorder) -> str:
    a = str(actorder).lower()
    if a not in _ACTORDER:
        raise _err(_W, f"actorder {actorder!r} unsupported; use 'weight' "
                       "(alias 'static') or None")
    return _ACTORDER[a]


def _checked_zp_dtype(zp_dtype, t: str, symmetric) -> str:
    """A float zero-point dtype's name; only asymmetric int args take one."""
    z = str(zp_dtype).removeprefix("torch.")  # also takes a torch.dtype
    if z not in ZP_FLOAT_DTYPES:
        raise _err(_W, f"zp_dtype {zp_dtype!r} unsupported; use one of "
                       f"{', '.join(ZP_FLOAT_DTYPES)} or None (integer zero points)")
    if t != "int" or symmetric:
        raise _err(_W, "a float zp_dtype needs asymmetric int weights; set "
                       "symmetric=False (--asym) or drop zp_dtype")
    return z


def _checked_scale_dtype(a: "QuantArgs", t: str, strategy: str) -> str | None:
    """The scale dtype of FP4 args — "float8_e4m3fn" (NVFP4) or "uint8" (MXFP4's E8M0
    exponents) — and of MXFP8 args ("uint8"), after checking the layout each takes; None for every
    other type (which takes no `scale_dtype`)."""
    fp4 = t == "float" and a.num_bits == 4
    sd = None if a.scale_dtype is None else str(a.scale_dtype).removeprefix("torch.")
    if sd == "float8_e8m0fnu":
        sd = _MX_SCALE_DTYPE  # the same exponent byte under torch's own E8M0 dtype
    mx = strategy == "group" and a.group_size == MX_GROUP_SIZE and sd == _MX_SCALE_DTYPE
    if fp4 and not ((strategy == "tensor_group" and a.group_size == NVFP4_GROUP_SIZE and sd in (None, _NVFP4_SCALE_DTYPE))
                    or mx):
        raise _err(_W, f"FP4 takes NVFP4's layout (strategy 'tensor_group', group_size {NVFP4_GROUP_SIZE}, "
                       f"scale_dtype {_NVFP4_SCALE_DTYPE}) or MXFP4's (strategy 'group', group_size "
                       f"{MX_GROUP_SIZE}, scale_dtype {_MX_SCALE_DTYPE}); got {strategy!r}, "
                       f"group_size={a.group_size}, scale_dtype={a.scale_dtype!r}")
    if strategy == "tensor_group" and not fp4:
        raise _err(_W, f"strategy 'tensor_group' is NVFP4's (type 'float', num_bits 4); got "
                       f"{a.num_bits}-bit {t}")
    if fp4:
        return _MX_SCALE_DTYPE if mx else _NVFP4_SCALE_DTYPE
    if sd is not None and not (mx and t == "float" and a.num_bits == 8):
        raise _err(_W, f"scale_dtype {a.scale_dtype!r} unsupported here: FP4 args take one "
                       f"({_NVFP4_SCALE_DTYPE} for NVFP4, {_MX_SCALE_DTYPE} for MXFP4), and FP8 args "
                       f"{_MX_SCALE_DTYPE} in MXFP8's layout (strategy 'group', group_size {MX_GROUP_SIZE})")
    return sd


@dataclass(frozen=True)
class QuantArgs:
    """How one tensor (a weight, an activation, the KV cache) is quantized.

    `strategy` decides the granularity of the scales: `tensor` (one), `channel` (one per output
    row of a weight [N, K] → [N, 1]), `group` (one per `group_size` consecutive input columns →
    [N, K // g]; for an activation, per row and group), `block` (one per `block_structure`
    [bn, bk] tile of a weight → [ceil(N / bn), ceil(K / bk)], compressed-tensors' FP8_BLOCK),
    `token` (one per row of an activation, dynamic only), `attn_head` (one per KV head, KV
    cache only → [H, 1, 1]). Left as None it is inferred like compressed-tensors does:
    no group_size → tensor, group_size > 0 → group, group_size == -1 → channel.

    `zp_dtype` (asymmetric int args only): None keeps integer zero points (compressed-tensors'
    default); "float16" | "bfloat16" | "float32" stores the zero point as that float, unrounded
    (compressed-tensors' `zp_dtype`), so the grid's offset need not be a whole step.

    NVFP4 (type "float", num_bits 4): E2M1 values, strategy `tensor_group` with group_size 16 —
    one FP8 E4M3 scale per group of 16 along K ([N, K/16]) under one fp32 global scale per
    tensor; `scale_dtype` "float8_e4m3fn" (compressed-tensors writes it; None reads as it).
    Its input activations take `dynamic="local"`: group scales computed at run time under a
    static (calibrated) global scale.

    MXFP4 (type "float", num_bits 4, strategy `group` with group_size 32, `scale_dtype` "uint8"):
    E2M1 values with one power-of-two scale per group of 32 along K, stored as its E8M0 exponent
    byte ([N, K/32]); no global scale. Its input activations are `dynamic=True` with the same
    layout (scales computed at run time). MXFP8 (num_bits 8, the same layout): E4M3 values.
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
    block_structure: tuple[int, int] | None = None
    scale_dtype: str | None = None

    def __post_init__(self) -> None:
        t = _checked_type(self.num_bits, self.type, self.symmetric)
        object.__setattr__(self, "type", t)
        strategy = _checked_strategy(self.strategy, self.group_size)
        object.__setattr__(self, "strategy", strategy)
        object.__setattr__(self, "block_structure", _checked_block(self.block_structure, strategy))
        object.__setattr__(self, "dynamic", _checked_dynamic(self.dynamic, strategy))
        object.__setattr__(self, "scale_dtype", _checked_scale_dtype(self, t, strategy))
        if self.actorder is not None:
            object.__setattr__(self, "actorder", _checked_actorder(self.actorder))
        if self.zp_dtype is not None:
            object.__setattr__(self, "zp_dtype", _checked_zp_dtype(self.zp_dtype, t, self.symmetric))

    # ---- derived -------------------------------------------------------------------------
    @property
    def q_min(self) -> float:
        """Smallest quantized value (int: -2^(b-1); fp8 E4M3: -448; fp4 E2M1: -6)."""
        return -float(2 ** (self.num_bits - 1)) if self.type == "int" else -self.q_max

    @property
    def q_max(self) -> float:
        """Largest quantized value (int: 2^(b-1) - 1; fp8 E4M3: 448; fp4 E2M1: 6)."""
        if self.type == "int":
            return float(2 ** (self.num_bits - 1) - 1)
        return 6.0 if self.num_bits == 4 else 448.0

    def block_grid(self, N: int, K: int) -> tuple[int, int]:
        """(block rows, block columns) of block args over a weight [N, K], a partial edge block
        counted: the shape of its scale."""
        bn, bk = self.block_structure
        return -(-N // bn), -(-K // bk)

    @property
    def per_token(self) -> bool:
        """Quantized per token at run time (one scale per row, computed from the row)."""
        return self.dynamic is True and self.strategy == "token"

    @property
    def is_fp8(self) -> bool:
        return self.type == "float" and self.num_bits == 8

    @property
    def is_fp4(self) -> bool:
        """E2M1 values: NVFP4 or MXFP4."""
        return self.type == "float" and self.num_bits == 4

    @property
    def is_mx(self) -> bool:
        """OCP microscaling (MXFP4, MXFP8): power-of-two (E8M0) group scales, no global scale."""
        return self.scale_dtype == _MX_SCALE_DTYPE

    @property
    def is_mxfp8(self) -> bool:
        """MXFP8: E4M3 values with power-of-two (E8M0) scales per group of 32."""
        return self.is_fp8 and self.is_mx

    @property
    def microscaled(self) -> str | None:
        """"nvfp4" | "mxfp4" | "mxfp8" for args whose group layout and scales are their format's own,
        None for every other."""
        if self.is_fp4:
            return "mxfp4" if self.is_mx else "nvfp4"
        return "mxfp8" if self.is_mxfp8 else None

    @property
    def is_nvfp4(self) -> bool:
        """NVFP4: E2M1 values with FP8 group scales under a per-tensor global scale."""
        return self.is_fp4 and not self.is_mx

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
        if self.block_structure is not None:
            d["block_structure"] = list(self.block_structure)
        if self.scale_dtype is not None:
            d["scale_dtype"] = f"torch.{self.scale_dtype}"
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
        scale_dtype = d.get("scale_dtype")
        if scale_dtype is not None:
            scale_dtype = str(scale_dtype).removeprefix("torch.")
            if scale_dtype in ("uint8", "float8_e8m0fnu") and not (d.get("type") == "float" and d.get("num_bits") in (4, 8)):
                raise _err(where, f"scale_dtype={d['scale_dtype']!r} with {d.get('num_bits')}-bit {d.get('type')} values "
                                  "(MXFP6, or another microscaling format) is unsupported; quantspec runs MXFP4, MXFP8, "
                                  "NVFP4 and float scales")
        strategy = d.get("strategy")
        dynamic = d.get("dynamic", False)
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
                block_structure=d.get("block_structure"),
                scale_dtype=scale_dtype,
            )
        except QuantSpecError as e:
            raise QuantSpecError(f"{where}: {e}") from None


