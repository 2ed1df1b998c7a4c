"""GPTQ and AWQ checkpoints in AutoGPTQ's / GPTQModel's and AutoAWQ's own formats
(`quantization_config.quant_method: "gptq"` / `"awq"`, as Qwen's `*-GPTQ-Int4` and `*-AWQ` releases
ship), read as the compressed-tensors scheme they are: int weights in groups along K with a float16
scale per group, which vLLM runs with its own `auto_gptq` / `auto_awq` methods.

- GPTQ: `qweight` [K / (32 / bits), N] int32, each word `32 / bits` codes of consecutive rows
  (row k in bits `bits · (k mod 32 / bits)`), unsigned with the symmetric offset (8 for 4 bits,
  128 for 8); `scales` [K / group, N]; `qzeros` (unused: symmetric); `g_idx` [K], the group of each
  row. As in vLLM, symmetric 4- and 8-bit weights only; `desc_act` reordering (a permuted `g_idx`)
  is refused where the checkpoint is run and followed where it is decompressed
  (`quant.artifact_plan`); `lm_head: true` quantizes the head; `modules_in_block_to_quantize` names
  the Linears quantized in each block. GPTQModel's per-module rules (`dynamic`: {regex: overrides},
  tried in order against each module's name with `re.match`, the first that matches deciding; a
  `-:` rule leaves the module float, a `+:` or bare one overrides `bits`, `group_size` and `sym`;
  `desc_act` is read from the tensors, as the base's) are read as vLLM's `get_dynamic_override`
  reads them: a config group per positive rule, an ignore entry per negative one, each regex
  guarded against the earlier rules' patterns (compressed-tensors' matching has no order; the
  guards make at most one rule match a module).
- AWQ (`version: "gemm"`, AutoAWQ's default): `qweight` [K, N / 8] int32, each word 8 codes of
  consecutive columns in AWQ's interleaved order (nibble i holds column `AWQ_ORDER[i]`), unsigned
  in [0, 15]; `qzeros` [K / group, N / 8] packed alike; `scales` [K / group, N]: w = (q − z) · s.
  `modules_to_not_convert` leaves float every module whose name contains one of its entries (vLLM's
  rule).

`AutoQuantTensors` shows each quantized Linear's tensors under compressed-tensors' pack-quantized
names (codes and zero points repacked, `g_idx` as `weight_g_idx`), so the loader and the
decompressing reader treat such a checkpoint as one more compressed-tensors artifact.
"""

from __future__ import annotations

import re
from typing import Any, Mapping

import torch

from quantspec.errors import QuantSpecError
from quantspec.model_zoo.layout import ShapedTensors, shapes_of
from quantspec.quant.args import FORMAT_PACK_QUANTIZED, QuantArgs, QuantType
from quantspec.quant.packing import pack_int32, packed_words

__all__ = ["AUTOQUANT_METHODS", "AWQ_ORDER", "AutoQuantTensors", "SCALE_LEAF", "config_from_autoquant"]

AUTOQUANT_METHODS = ("gptq", "awq")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an AWQ word holds column AWQ_ORDER[i] of its eight
_AWQ_COLUMNS = tuple(AWQ_ORDER.index(j) for j in range(len(AWQ_ORDER)))  # the nibble holding column j
SCALE_LEAF = "scales"
_WORD = 32


def _err(method: str, msg: str) -> QuantSpecError:
    return QuantSpecError(f"quantization_config (quant_method {method!r}): {msg}")


def _int(d: Mapping[str, Any], keys: tuple[str, ...], method: str, default: Any = None) -> int:
    v = next((d[k] for k in keys if d.get(k) is not None), default)
    if not isinstance(v, int) or isinstance(v, bool):
        raise _err(method, f"{keys[0]} must be an integer, got {v!r}")
    return v


def _weights(method: str, bits: int, group: int, symmetric: bool) -> QuantArgs:
    if group == -1:
        return QuantArgs(num_bits=bits, type="int", strategy="channel", symmetric=symmetric)
    if group <= 0:
        raise _err(method, f"group_size {group} must be > 0, or -1 (one group per row)")
    return QuantArgs(num_bits=bits, type="int", strategy="group", group_size=group, symmetric=symmetric)


def _gptq(d: Mapping[str, Any]) -> tuple[QuantArgs, list[str], tuple[str, ...]]:
    """(weight args, ignore, targets) of a GPTQ config."""
    bits, group = _int(d, ("bits",), "gptq"), _int(d, ("group_size",), "gptq", -1)
    if bits not in (4, 8):
        raise _err("gptq", f"bits {bits} is unsupported; quantspec runs 4- and 8-bit GPTQ weights")
    if d.get("sym", True) is not True:
        raise _err("gptq", "asymmetric weights (sym: false) are unsupported, as in vLLM; use a symmetric checkpoint")
    if d.get("checkpoint_format", "gptq") not in ("gptq", "gptq_v2"):
        raise _err("gptq", f"checkpoint_format {d['checkpoint_format']!r} is unsupported; use 'gptq' or 'gptq_v2'")
    blocks = d.get("modules_in_block_to_quantize") or []
    names = [n for b in blocks for n in (b if isinstance(b, list) else [b])]
    if not all(isinstance(n, str) and n for n in names):
        raise _err("gptq", "modules_in_block_to_quantize must list module names")
    targets = (f"re:.*\\.(?:{'|'.join(re.escape(n) for n in names)})$",) if names else ("Linear",)
    return _weights("gptq", bits, group, True), [] if d.get("lm_head") else ["lm_head"], targets


def _dynamic(d: Mapping[str, Any], bits: int, group: int, targets: tuple[str, ...]
             ) -> tuple[dict[tuple[str, ...], QuantArgs], list[str], tuple[str, ...]]:
    """GPTQModel's `dynamic` rules (module docstring) → ({targets: weight args} of the positive
    rules, the ignore entries of the negative ones, the base group's targets). A rule's regex
    is `(?!p1)…(?!pk)(?:p)`: p where no earlier rule's pattern matches (`re.match` anchors
    both at the start), and only among the Linears the base group quantizes."""
    rules = d.get("dynamic") or {}
    if not isinstance(rules, Mapping) or not all(isinstance(k, str) and isinstance(v, Mapping)
                                                 for k, v in rules.items()):
        raise _err("gptq", 'dynamic must map module regexes to overrides, e.g. {"+:.*down_proj": {"bits": 8}}')
    among = "" if targets == ("Linear",) else f"(?={targets[0][3:]})"  # the Linears quantized at all
    groups: dict[tuple[str, ...], QuantArgs] = {}
    ignore, earlier = [], ""
    for key, over in rules.items():
        pattern = key[2:] if key.startswith(("-:", "+:")) else key
        try:
            re.compile(pattern)
        except re.error as e:
            raise _err("gptq", f"dynamic rule {key!r} is not a regex ({e})") from None
        target = f"re:{earlier}{among}(?:{pattern})"
        earlier += f"(?!{pattern})"
        if key.startswith("-:"):
            ignore.append(target)
            continue
        b = _int(over, ("bits",), "gptq", bits)
        g = _int(over, ("group_size",), "gptq", group)
        if b not in (4, 8):
            raise _err("gptq", f"dynamic rule {key!r}: bits {b} is unsupported; quantspec runs 4- and 8-bit GPTQ weights")
        if over.get("sym", True) is not True:
            raise _err("gptq", f"dynamic rule {key!r}: asymmetric weights (sym: false) are unsupported, as in vLLM; "
                               "use a symmetric checkpoint")
        groups[(target,)] = _weights("gptq", b, g, True)
    base = targets if not rules or targets == ("Linear",) else (f"re:{earlier}{targets[0][3:]}",)
    return groups, ignore, base


def _awq(d: Mapping[str, Any]) -> tuple[QuantArgs, list[str], tuple[str, ...]]:
    """(weight args, ignore, targets) of an AWQ config."""
    bits, group = _int(d, ("bits", "w_bit"), "awq"), _int(d, ("group_size", "q_group_size"), "awq", -1)
    if bits != 4:
        raise _err("awq", f"bits {bits} is unsupported; quantspec runs 4-bit AWQ weights")
    if str(d.get("version", "gemm")).lower() != "gemm":
        raise _err("awq", f"version {d['version']!r} packs codes in another layout; quantspec reads 'gemm' "
                          "(AutoAWQ's default, vLLM's)")
    if d.get("zero_point", True) is not True:
        raise _err("awq", "weights without zero points (zero_point: false) are unsupported; use zero_point: true")
    skip = d.get("modules_to_not_convert") or []
    if not all(isinstance(s, str) and s for s in skip):
        raise _err("awq", "modules_to_not_convert must list module names")
    ignore = ["lm_head", *(f"re:.*{re.escape(s)}.*" for s in skip)]
    return _weights("awq", bits, group, False), ignore, ("Linear",)


def config_from_autoquant(d: Mapping[str, Any]):
    """The `QuantConfig` of a GPTQ / AWQ checkpoint's `quantization_config` (module docstring);
    one line naming the field for what quantspec does not run. Fields that do not change the
    numbers (damping, calibration settings, provenance) are not read, as in vLLM."""
    from quantspec.quant.config import QuantConfig
    from quantspec.quant.scheme import QuantScheme

    method = d["quant_method"]
    weights, ignore, targets = (_gptq if method == "gptq" else _awq)(d)
    rules: dict = {}
    if method == "gptq":
        group = weights.group_size if weights.strategy == "group" else -1
        rules, negative, targets = _dynamic(d, weights.num_bits, group, targets)
        ignore = [*ignore, *negative]
    groups = {"group_0": QuantScheme(targets=targets, weights=weights, format=FORMAT_PACK_QUANTIZED)}
    groups.update({f"dynamic_{i}": QuantScheme(targets=t, weights=w, format=FORMAT_PACK_QUANTIZED)
                   for i, (t, w) in enumerate(rules.items())})
    qt = QuantType.WEIGHT_ONLY_INT4 if weights.num_bits == 4 else QuantType.WEIGHT_ONLY_INT8
    return QuantConfig(config_groups=groups, ignore=tuple(ignore), format=FORMAT_PACK_QUANTIZED,
                       quant_type=qt, source=method)


def _nibbles(words: torch.Tensor, bits: int) -> torch.Tensor:
    """words [..., W] int32 → their codes [..., W, 32 / bits] (code i in bits bits·i), unsigned."""
    shifts = torch.arange(0, _WORD, bits, dtype=torch.int32)
    return (words.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)


class AutoQuantTensors(ShapedTensors):
    """A GPTQ / AWQ checkpoint's tensors under compressed-tensors' pack-quantized names (module
    docstring): for each Linear `config` quantizes whose `qweight` is there, `weight_packed`,
    `weight_shape`, `weight_scale` (`scales` transposed), `weight_zero_point` (AWQ) and
    `weight_g_idx` (GPTQ's `g_idx`); every other tensor as stored."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], config):
        self.base, self.method = tensors, config.source
        base_shapes = shapes_of(tensors)
        self.names: dict[str, tuple[str, str]] = {}  # shown → (module, leaf shown)
        self.dims: dict[str, tuple[int, int, QuantArgs]] = {}  # module → (N, K, weight args)
        quantized = {k.rsplit(".", 1)[0] for k in base_shapes if k.endswith(".qweight")}
        self.shapes = {}
        for k, shape in base_shapes.items():
            module, _, leaf = k.rpartition(".")
            if module not in quantized or config.scheme_for(module) is None:
                self.names[k], self.shapes[k] = (k, ""), tuple(shape)
        for module in quantized:
            scheme = config.scheme_for(module)
            if scheme is not None:
                self._show(module, scheme.weights, base_shapes)

    def _show(self, module: str, w: QuantArgs, base_shapes: Mapping[str, tuple]) -> None:
        per = _WORD // w.num_bits
        rows, cols = base_shapes[f"{module}.qweight"]
        N, K = (cols * per, rows) if self.method == "awq" else (cols, rows * per)
        self.dims[module] = (N, K, w)
        needed = (SCALE_LEAF,) if w.symmetric else (SCALE_LEAF, "qzeros")
        missing = next((f"{module}.{leaf}" for leaf in needed if f"{module}.{leaf}" not in base_shapes), None)
        if missing is not None:  # named as stored: the compressed-tensors names are this view's
            raise QuantSpecError(f"tensor {missing!r} is missing from the checkpoint; it is incomplete — "
                                 "re-download or re-create it")
        G = base_shapes[f"{module}.{SCALE_LEAF}"][0]
        shown = {"weight_packed": (N, packed_words(K, w.num_bits)), "weight_shape": (2,), "weight_scale": (N, G)}
        if not w.symmetric:
            shown["weight_zero_point"] = (packed_words(N, w.num_bits), G)
        if f"{module}.g_idx" in base_shapes:
            shown["weight_g_idx"] = tuple(base_shapes[f"{module}.g_idx"])
        if f"{module}.bias" in base_shapes:
            shown["bias"] = tuple(base_shapes[f"{module}.bias"])
        for leaf, shape in shown.items():
            self.names[f"{module}.{leaf}"], self.shapes[f"{module}.{leaf}"] = (module, leaf), shape

    def _codes(self, module: str, leaf: str) -> torch.Tensor:
        """The unsigned codes [K, N] of `qweight`, or the zero points [G, N] of `qzeros`."""
        N, K, w = self.dims[module]
        words = self.base[f"{module}.{leaf}"]
        q = _nibbles(words, w.num_bits)  # [rows, cols, per]
        if self.method == "awq":  # nibble i holds column AWQ_ORDER[i] of its eight
            return q[..., list(_AWQ_COLUMNS)].reshape(words.shape[0], -1)[:, :N]
        return q.permute(0, 2, 1).reshape(-1, words.shape[1])[:K]  # GPTQ: codes of consecutive rows

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self.names:
            raise KeyError(name)
        module, leaf = self.names[name]
        if not leaf:
            return self.base[name]
        N, K, w = self.dims[module]
        offset = 1 << (w.num_bits - 1)  # unsigned codes around the symmetric midpoint
        if leaf == "weight_packed":
            q = (self._codes(module, "qweight").t() - offset).to(torch.int8)
            return pack_int32(q.contiguous(), w.num_bits, 1)
        if leaf == "weight_shape":
            return torch.tensor([N, K], dtype=torch.int64)
        if leaf == "weight_scale":
            return self.base[f"{module}.{SCALE_LEAF}"].t().contiguous()
        if leaf == "weight_zero_point":
            z = (self._codes(module, "qzeros").t() - offset).to(torch.int8)  # [N, G]
            return pack_int32(z.contiguous(), w.num_bits, 0)
        return self.base[f"{module}.{'g_idx' if leaf == 'weight_g_idx' else leaf}"]
