"""Intel AutoRound checkpoints (`quantization_config.quant_method: "auto-round"`, as the
`*-AutoRound` / `*-int4-AutoRound` releases ship), read as vLLM reads them with its `inc` method:
int weights packed in AutoGPTQ's layout (`packing_format: "auto_round:auto_gptq"`, the default:
symmetric 4- and 8-bit) or AutoAWQ's (`"auto_round:auto_awq"`: 4-bit with zero points), whose
tensors `quant.autoquant` reads. Each Linear's settings resolve as vLLM's `INCConfigParser`
resolves them:

1. an `extra_config` entry named by the module's full name, or by the end of it after a dot
   (`lm_head`), gives its `bits` / `group_size` / `sym` (keys it leaves out: the config's);
2. else the module is quantized where its name starts with a block of `block_name_to_quantize`
   (without that list: every Linear but the output head), and an entry whose key holds regex
   characters and `re.search`es the name (the first, in order) gives its settings, its left-out
   keys the config's for a quantized module and 16 bits otherwise;
3. else the config's settings, or float.

AutoRound's block FP8 (`data_type: "fp"`, bits 8, `group_size` [128, 128]: `packing_format:
"auto_round:fp8"`, inputs FP8 per token and group of 128 at run time) is transformers' FP8 layout
(`weight`, `weight_scale_inv` per block), which vLLM runs with its FP8 method and quantspec reads
with `quant.hf_fp8`; its `extra_config` may only leave modules float (16 bits).

16 bits leaves a module float. Each entry becomes a compressed-tensors target: full names as
exact targets (which outrank regexes), the others as regexes guarded by the earlier rules'
patterns (compressed-tensors' matching has no order; the guards let at most one match a module),
float ones as ignore entries. MXFP AutoRound formats are refused in one line, as is what vLLM's
kernels do not run.
"""

from __future__ import annotations

import re
from typing import Any, Mapping

from quantspec.errors import QuantSpecError
from quantspec.quant.args import FORMAT_PACK_QUANTIZED, QuantArgs, QuantType

__all__ = ["AUTOROUND_METHOD", "PACKINGS", "config_from_autoround"]

AUTOROUND_METHOD = "auto-round"
# packing_format → the tool whose tensor layout it is (`quant.autoquant` reads both)
PACKINGS = {"auto_round:auto_gptq": "gptq", "auto_round:auto_awq": "awq"}
BACKENDS = ("auto", "gptq", "gptq:marlin", "awq", "awq:marlin", "marlin")  # vLLM's INCConfig.SUPPORTED_BACKENDS
_REGEX_CHARS = set(r"*+?^$()[]{}|\\")
_HEAD = r"(?:.*\.)?lm_head$"
FLOAT_BITS = 16


def _err(msg: str) -> QuantSpecError:
    return QuantSpecError(f"quantization_config (quant_method {AUTOROUND_METHOD!r}): {msg}")


def _args(where: str, bits: Any, group: Any, sym: Any, packing: str) -> QuantArgs | None:
    """The weight args of settings (bits, group_size, sym) under `packing`; None for float."""
    if not isinstance(bits, int) or isinstance(bits, bool) or not isinstance(group, int) or isinstance(group, bool):
        raise _err(f"{where}: bits and group_size must be integers, got {bits!r} / {group!r}")
    if bits >= FLOAT_BITS:
        return None
    if packing == "gptq" and (bits not in (4, 8) or sym is not True):
        raise _err(f"{where}: {bits}-bit {'symmetric' if sym else 'asymmetric'} weights in AutoGPTQ's layout are "
                   "unsupported, as in vLLM (Marlin runs symmetric 4- and 8-bit GPTQ)")
    if packing == "awq" and bits != 4:
        raise _err(f"{where}: bits {bits} in AutoAWQ's layout is unsupported; quantspec runs 4-bit AWQ weights")
    if group != -1 and group <= 0:
        raise _err(f"{where}: group_size {group} must be > 0, or -1 (one group per row)")
    strategy = dict(strategy="channel") if group == -1 else dict(strategy="group", group_size=group)
    return QuantArgs(num_bits=bits, type="int", symmetric=packing == "gptq", **strategy)


def _regex_keys(extra: Mapping[str, Any]) -> list[str]:
    """The `extra_config` keys vLLM reads as regexes (those holding regex characters), in order;
    one line naming a key that does not compile."""
    keys = [k for k in extra if _REGEX_CHARS & set(k)]
    for k in keys:
        try:
            re.compile(k)
        except re.error as e:
            raise _err(f"extra_config key {k!r} is not a regex ({e})") from None
    return keys


# block FP8's input settings, as vLLM's INCConfig asserts them (`_validate_raw_config`)
_FP8_INPUTS = {"act_bits": 8, "act_data_type": "fp", "act_sym": True, "act_dynamic": True,
               "activation_scheme": "dynamic", "fmt": "e4m3"}


def _fp8_block(d: Mapping[str, Any], extra: Mapping[str, Any], blocks: list[str]):
    """The `QuantConfig` of AutoRound's block FP8 (module docstring): transformers' FP8 config of
    its block, float where `extra_config` says 16 bits or outside `block_name_to_quantize`."""
    from dataclasses import replace

    from quantspec.quant.hf_fp8 import config_from_hf_fp8

    group = d.get("group_size")
    if d.get("bits") != 8 or not isinstance(group, list) or len(group) != 2 or d.get("sym", True) is not True \
            or d.get("packing_format", "auto_round:fp8") != "auto_round:fp8":
        raise _err(f"FP8 with bits {d.get('bits')!r}, group_size {group!r} is unsupported; quantspec reads "
                   "AutoRound's symmetric block FP8 (bits 8, a [rows, columns] group_size, packing auto_round:fp8)")
    wrong = {k: d.get(k) for k, v in _FP8_INPUTS.items() if d.get(k, v) != v}
    if d.get("act_group_size", group[0]) != group[0]:
        wrong["act_group_size"] = d["act_group_size"]
    if wrong:
        raise _err(f"block FP8 with {wrong} is unsupported, as in vLLM: inputs FP8 E4M3, dynamic, per group of "
                   f"{group[0]}")
    if not isinstance(extra, Mapping) or any(not isinstance(c, Mapping) or set(c) - {"bits"}
                                             or c.get("bits", FLOAT_BITS) < FLOAT_BITS for c in extra.values()):
        raise _err("extra_config settings other than 16 bits (float) are unsupported for block FP8")
    config = config_from_hf_fp8({"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                 "weight_block_size": group})
    inside = [f"re:(?!(?:{'|'.join(re.escape(b) for b in blocks)}))"] if blocks else []
    regexes = _regex_keys(extra)
    floats = [t for k in extra for t in ((f"re:.*?(?:{k})",) if k in regexes else (k, f"re:.*\\.{re.escape(k)}$"))]
    return replace(config, ignore=tuple(dict.fromkeys([*config.ignore, *inside, *floats])))


def _settings(d: Mapping[str, Any]) -> tuple[str, tuple, list[str], dict]:
    """(packing, the config's (bits, group_size, sym), the block prefixes, extra_config), checked."""
    if d.get("data_type", "int") != "int":
        raise _err(f"data_type {d['data_type']!r} is unsupported; quantspec reads int and block FP8 ('fp') "
                   "AutoRound checkpoints")
    packing = d.get("packing_format") or "auto_round:auto_gptq"
    if packing not in PACKINGS:
        raise _err(f"packing_format {packing!r} is unsupported; quantspec reads {', '.join(PACKINGS)}")
    backend = d.get("backend", d.get("vllm_backend", "auto"))
    if backend not in BACKENDS:
        raise _err(f"backend {backend!r} is unsupported, as in vLLM; use one of {', '.join(BACKENDS)}")
    if d.get("act_bits", FLOAT_BITS) < FLOAT_BITS:
        raise _err(f"act_bits {d['act_bits']} (quantized activations) is unsupported; quantspec reads weight-only ones")
    blocks = d.get("block_name_to_quantize", d.get("to_quant_block_names"))
    blocks = blocks.split(",") if isinstance(blocks, str) else list(blocks or [])
    extra = d.get("extra_config") or {}
    if not isinstance(extra, Mapping) or not all(isinstance(k, str) and isinstance(v, Mapping) for k, v in extra.items()):
        raise _err('extra_config must map module names to settings, e.g. {"lm_head": {"bits": 16}}')
    if not all(isinstance(b, str) and b for b in blocks):
        raise _err("block_name_to_quantize must name blocks, e.g. \"model.layers\"")
    return PACKINGS[packing], (d.get("bits"), d.get("group_size"), d.get("sym", True)), blocks, dict(extra)


def config_from_autoround(d: Mapping[str, Any]):
    """The `QuantConfig` of an AutoRound checkpoint's `quantization_config` (module docstring)."""
    from quantspec.quant.config import QuantConfig
    from quantspec.quant.scheme import QuantScheme

    if d.get("data_type") in ("fp", "fp8"):  # block FP8: transformers' layout (`_fp8_block`)
        blocks = d.get("block_name_to_quantize", d.get("to_quant_block_names"))
        return _fp8_block(d, d.get("extra_config") or {},
                          blocks.split(",") if isinstance(blocks, str) else list(blocks or []))
    packing, base, blocks, extra = _settings(d)
    base_args = _args("bits / group_size", *base, packing)
    if base_args is None:
        raise _err(f"bits {base[0]} quantizes nothing")

    def own(key: str, quantized: bool = True) -> QuantArgs | None:
        cfg = extra[key]
        default = base if quantized else (FLOAT_BITS, -1, True)
        return _args(f"extra_config[{key!r}]", *(cfg.get(k, v) for k, v in zip(("bits", "group_size", "sym"), default)),
                     packing)

    inside = f"(?:{'|'.join(re.escape(b) for b in blocks)})" if blocks else f"(?!{_HEAD})"
    exact = [k for k in extra if not _REGEX_CHARS & set(k)]
    kept = [k for k in exact if own(k) is not None]
    not_exact = f"(?!(?:{'|'.join(re.escape(k) for k in kept)})$)" if kept else ""
    rules: list[tuple[str, QuantArgs | None]] = [(k, own(k)) for k in exact]  # exact names first
    guards = ""
    for k in exact:  # a name ending in ".key"
        pattern = f".*\\.{re.escape(k)}$"
        rules.append((f"re:{guards}{pattern}", own(k)))
        guards += f"(?!{pattern})"
    for k in _regex_keys(extra):
        pattern = f".*?(?:{k})"
        rules.append((f"re:{guards}(?={inside}){pattern}", own(k)))
        rules.append((f"re:{guards}(?!{inside}){pattern}", own(k, quantized=False)))
        guards += f"(?!{pattern})"
    rules.append((f"re:{guards}(?={inside})", base_args))
    groups: dict[QuantArgs, list[str]] = {}
    ignore = []
    for target, args in rules:
        if args is not None:
            groups.setdefault(args, []).append(target)
        elif target.startswith("re:"):  # the ignore list outranks exact targets: keep theirs
            ignore.append(f"re:{not_exact}{target[3:]}")
        else:
            ignore.append(target)
    config_groups = {f"group_{i}": QuantScheme(targets=tuple(t), weights=a, format=FORMAT_PACK_QUANTIZED)
                     for i, (a, t) in enumerate(groups.items())}
    qt = QuantType.WEIGHT_ONLY_INT4 if base_args.num_bits == 4 else QuantType.WEIGHT_ONLY_INT8
    return QuantConfig(config_groups=config_groups, ignore=tuple(ignore), format=FORMAT_PACK_QUANTIZED,
                       quant_type=qt, source=packing)
