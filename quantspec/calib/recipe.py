"""`quantize --recipe FILE`: an llm-compressor recipe read as quantspec's own options.

A recipe is the YAML (or JSON) llm-compressor reads and writes beside its artifacts as
`recipe.yaml`: stages (`<name>_stage`) of modifier groups (`<name>_modifiers`), each a mapping of
modifier class → its arguments. `read_recipe` turns one into the `QuantizeConfig` options that run
the same quantization, or refuses it in one line naming the modifier and the argument quantspec
cannot honour; nothing of a recipe is ignored unless it cannot change the artifact.

- **Schemes.** A quantization modifier's `scheme` (a preset name such as `W4A16`, or a mapping of
  preset names to targets) and its `config_groups` are read by compressed-tensors' own
  `preset_name_to_scheme` / `QuantizationScheme`, then matched against every quant type quantspec
  writes (`quant.presets.preset`, its group size, symmetry, float zero points, weight blocks or
  per-tensor FP8 weights, and static or per-token inputs from the scheme): the one whose
  compressed-tensors args equal the scheme's is the recipe's. A scheme that matches none
  (asymmetric inputs, 3-bit weights, ...) is refused, naming its group.
- **Targets.** The group targeting `Linear` gives `--quant-type`; the others become
  `--layer-quant-type TARGET=TYPE`. `lm_head` is a Linear to llm-compressor: where the recipe does
  not ignore it, it is quantized at the model's type, as llm-compressor would.
- **Methods.** `QuantizationModifier` rounds to nearest, `GPTQModifier` runs GPTQ (`block_size`,
  `dampening_frac`, and `actorder` static, its default, as `--act-order`), `AWQModifier` before
  either is `awq` / `awq+gptq`, `AutoRoundModifier` is `autoround` (`iters`, `lr`, `batch_size`);
  one method for the whole model. `SmoothQuantModifier`'s `smoothing_strength` is
  `--smoothquant-alpha`; `QuIPModifier` is `--quip` (Hadamard blocks), `SpinQuantModifier` is
  `--rotate` (R1 / R2 fused as random Hadamard matrices, R4 at run time as Hadamard blocks).
  Each with its default mappings only: those are quantspec's.
- **What the recipe leaves out** is llm-compressor's default, not quantspec's: no SmoothQuant and
  no float-input fallback for static a8w8 types unless `--smoothquant-alpha` / `--a8w8-fallback-*`
  are given beside the recipe (`Recipe.defaults`), and min/max weight ranges unless a scheme's
  observer is `mse`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from quantspec.errors import QuantSpecError

__all__ = ["Recipe", "read_recipe", "with_recipe"]

# lifecycle and bookkeeping fields (llm-compressor's recipe.yaml writes them all): they leave the artifact as it is
_NO_EFFECT = {"index", "group", "start", "end", "update", "requires_calibration_data"}
# what each modifier's arguments may be, beside `_NO_EFFECT`
_QUANT_ARGS = {"config_groups", "targets", "ignore", "scheme", "kv_cache_scheme", "weight_observer",
               "input_observer", "output_observer", "observer", "bypass_divisibility_checks"}
_MODIFIERS = {
    "QuantizationModifier": _QUANT_ARGS,
    "GPTQModifier": _QUANT_ARGS | {"block_size", "dampening_frac", "actorder", "offload_hessians",
                                   "batched_quantization"},
    "AutoRoundModifier": _QUANT_ARGS | {"iters", "lr", "batch_size", "enable_torch_compile", "device_ids"},
    "AWQModifier": {"mappings", "offload_device", "duo_scaling", "n_grid", "ignore", "targets"},
    "SmoothQuantModifier": {"smoothing_strength", "mappings", "ignore", "num_calibration_steps", "algorithm"},
    "QuIPModifier": {"rotations", "transform_type", "targets", "randomize", "learnable", "precision",
                     "transform_block_size", "ignore"},
    "SpinQuantModifier": {"rotations", "transform_type", "randomize", "learnable", "precision",
                          "transform_block_size"},
}
_METHODS = {"QuantizationModifier": "rtn", "GPTQModifier": "gptq", "AutoRoundModifier": "autoround"}
# SmoothQuant's Llama mappings in llm-compressor: [balance layers, smooth layer]
_SQ_MAPPINGS = [[["re:.*q_proj", "re:.*k_proj", "re:.*v_proj"], "re:.*input_layernorm"],
                [["re:.*gate_proj", "re:.*up_proj"], "re:.*post_attention_layernorm"]]
# the options a recipe sets, by the flag that sets them on the command line
FLAGS = {"quant_type": "--quant-type", "method": "--method", "group_size": "--group-size", "symmetric": "--sym/--asym",
         "zp_dtype": "--zp-dtype", "weight_observer": "--weight-observer", "ignore": "--ignore",
         "layer_quant_types": "--layer-quant-type", "awq_duo_scaling": "--awq-duo-scaling",
         "act_order": "--act-order", "block_size": "--block-size",
         "damp": "--damp", "iters": "--iters", "lr": "--lr", "batch_size": "--batch-size",
         "activations": "--activations", "weight_block": "--weight-block", "weight_strategy": "--weight-strategy",
         "smoothquant_alpha": "--smoothquant-alpha", "kv_cache": "--kv-cache", "kv_strategy": "--kv-strategy",
         "rotate": "--rotate", "quip": "--quip", "quip_block_size": "--quip-block-size"}
_FALLBACK = ("fallback_budget", "fallback_layers", "fallback_threshold")


@dataclass
class Recipe:
    """What a recipe file sets (`settings`: options the command line must not set again), the
    llm-compressor defaults it implies (`defaults`: the command line may override them), and the
    flags that say the same (`flags`, for the log and the provenance)."""

    path: str
    settings: dict = field(default_factory=dict)
    defaults: dict = field(default_factory=dict)

    @property
    def flags(self) -> list[str]:
        out = []
        for k, v in self.settings.items():
            if k == "symmetric":
                out.append("--sym" if v else "--asym")
            elif isinstance(v, tuple):
                out += [f"{FLAGS[k]} {x}" for x in v]
            elif v is True:
                out.append(FLAGS[k])
            elif v is not None and v is not False:
                out.append(f"{FLAGS[k]} {v}")
        return out

    def merge(self, options: dict) -> dict:
        """`options` (those the caller set) over the recipe's: one the recipe sets too is refused."""
        for k in options:
            if k in self.settings:
                raise QuantSpecError(f"{FLAGS[k]} and --recipe {self.path} both set {k.replace('_', ' ')}; "
                                     f"drop {FLAGS[k]} or edit the recipe")
        defaults = dict(self.defaults)
        if any(k in options for k in _FALLBACK):
            defaults.pop("fallback_layers", None)
        return {**defaults, **self.settings, **options}


def with_recipe(path: str, quant_type: str | None, options: dict, say) -> tuple[str, dict]:
    """(quant type, `QuantizeConfig` options): the recipe's, with `quant_type` (None: not given) and
    `options` (those the caller set) beside them (`Recipe.merge`); the provenance's `recipe`
    entry added, and the flags said through `say`."""
    r = read_recipe(path)
    options = r.merge({**({} if quant_type is None else {"quant_type": quant_type}), **options})
    say(f"recipe {path}: {' '.join(r.flags)}")
    return options.pop("quant_type"), {**options, "recipe": {"path": path, "flags": r.flags}}


def _load(path: str) -> list[tuple[str, dict]]:
    """[(modifier class, its arguments)] in the order the recipe runs them."""
    import yaml

    class Loader(yaml.SafeLoader):
        """YAML's safe subset; a Python object tag (llm-compressor writes AWQ's unset `offload_device`
        as one) reads as null: only arguments that cannot change the artifact carry them."""

    Loader.add_multi_constructor("tag:yaml.org,2002:python/", lambda loader, suffix, node: None)
    p = Path(path)
    if not p.is_file():
        raise QuantSpecError(f"--recipe {path} does not exist; pass an llm-compressor recipe file (.yaml or .json)")
    try:
        obj = yaml.load(p.read_text(encoding="utf-8"), Loader=Loader)  # JSON is YAML too
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise QuantSpecError(f"--recipe {path} is not valid YAML or JSON ({str(e).splitlines()[0]})") from None
    if not isinstance(obj, dict):
        raise QuantSpecError(f"--recipe {path} holds no mapping of stages; expected "
                             "`quant_stage: {quant_modifiers: {GPTQModifier: {...}}}`")
    if obj.get("args"):
        raise QuantSpecError(f"--recipe {path}: recipe variables (`args`) are not read by quantspec; write their "
                             "values into the modifiers")
    mods = []
    for stage, groups in obj.items():
        if not (str(stage).endswith("_stage") and isinstance(groups, dict)):
            continue
        for group, entries in groups.items():
            if not (str(group).endswith("_modifiers") and isinstance(entries, dict)):
                continue
            for name, args in entries.items():
                if name not in _MODIFIERS:
                    raise QuantSpecError(f"--recipe {path}: quantspec runs no {name}; it runs "
                                         f"{', '.join(_MODIFIERS)}")
                if not isinstance(args or {}, dict):
                    raise QuantSpecError(f"--recipe {path}: {name}'s arguments are not a mapping")
                args = dict(args or {})
                unknown = sorted(set(args) - _MODIFIERS[name] - _NO_EFFECT)
                if unknown:
                    raise QuantSpecError(f"--recipe {path}: {name} takes no {', '.join(unknown)} in quantspec")
                mods.append((name, args))
    if not mods:
        raise QuantSpecError(f"--recipe {path} names no modifier; expected "
                             "`quant_stage: {quant_modifiers: {GPTQModifier: {...}}}`")
    return mods


def _schemes(name: str, args: dict, where: str) -> dict:
    """A quantization modifier's config groups, as compressed-tensors resolves them: group name →
    `QuantizationScheme` (its `scheme` presets or its `config_groups`, observers overridden)."""
    from compressed_tensors.quantization import QuantizationScheme, is_preset_scheme, preset_name_to_scheme

    scheme, groups = args.get("scheme"), args.get("config_groups")
    targets = args.get("targets", ["Linear"])
    targets = [targets] if isinstance(targets, str) else list(targets)
    if scheme is not None and groups is not None:
        raise QuantSpecError(f"{where}: {name} gives both `scheme` and `config_groups`; keep one")
    try:
        if scheme is not None:
            scheme = {scheme: targets} if isinstance(scheme, str) else scheme
            out = {}
            for i, (preset, tg) in enumerate(scheme.items()):
                if not is_preset_scheme(preset):
                    raise QuantSpecError(f"{where}: {name} scheme {preset!r} is no compressed-tensors preset")
                out[f"group_{i}"] = preset_name_to_scheme(preset, [tg] if isinstance(tg, str) else list(tg))
        else:
            out = {g: QuantizationScheme.model_validate(s) for g, s in groups.items()}
    except ValueError as e:  # pydantic's ValidationError is one
        raise QuantSpecError(f"{where}: {name}'s schemes do not validate in compressed-tensors "
                             f"({str(e).splitlines()[0]})") from None
    observers = {**(args.get("observer") or {}), **{k: args[f"{k}_observer"] for k in ("weight", "input")
                                                   if args.get(f"{k}_observer")}}
    for s in out.values():
        obs = observers.get("weight") or observers.get("weights")
        if obs and s.weights is not None:
            s.weights = s.weights.model_copy(update={"observer": obs})
    return out


def _value(x):
    return getattr(x, "value", x)


def _key(a) -> tuple | None:
    """What of compressed-tensors' `QuantizationArgs` decides the artifact (not its observer)."""
    if a is None:
        return None
    grouped = _value(a.strategy) in ("group", "tensor_group")
    return (a.num_bits, _value(a.type), a.symmetric, _value(a.strategy), a.group_size if grouped else None,
            tuple(a.block_structure) if a.block_structure else None, str(_value(a.dynamic)).lower())


def _match(scheme, where: str) -> dict:
    """The quantspec options whose preset writes `scheme` (a compressed-tensors `QuantizationScheme`)."""
    from compressed_tensors.quantization import QuantizationArgs

    from quantspec.quant.args import ZP_FLOAT_DTYPES, QuantType
    from quantspec.quant.presets import preset

    w, x = scheme.weights, scheme.input_activations
    if w is None or scheme.output_activations is not None:
        raise QuantSpecError(f"{where}: quantspec quantizes weights (and their inputs), and this scheme has "
                             + ("no weights" if w is None else "output activations"))
    strategy = _value(w.strategy)
    group = w.group_size if strategy in ("group", "tensor_group") else -1 if strategy == "channel" else None
    zp = str(w.zp_dtype).removeprefix("torch.") if w.zp_dtype is not None else None
    zp = zp if zp in ZP_FLOAT_DTYPES else None
    block = w.block_structure[0] if w.block_structure else None
    per_tensor = "tensor" if strategy == "tensor" else None
    want = (_key(w), _key(x))
    for qt in QuantType:
        for activations in ("static", "dynamic"):
            try:
                config = preset(qt, group_size=group, int8_group_size=group, symmetric=w.symmetric, zp_dtype=zp,
                                weight_observer="minmax", activations=activations, weight_block=block,
                                weight_strategy=per_tensor)
            except QuantSpecError:
                continue
            ours = config.config_groups["group_0"]
            got = tuple(None if a is None else _key(QuantizationArgs.model_validate(a.to_dict()))
                        for a in (ours.weights, ours.input_activations))
            if got == want:
                return {"quant_type": qt.value, "group_size": group, "symmetric": w.symmetric, "zp_dtype": zp,
                        "activations": activations, "weight_block": block, "weight_strategy": per_tensor,
                        "observer": _value(w.observer), "actorder": _value(w.actorder)}
    inputs = "no inputs" if x is None else f"inputs {_value(x.type)} {x.num_bits}-bit {_value(x.strategy)} " \
                                           f"{'dynamic' if x.dynamic else 'static'}{'' if x.symmetric else ' asym'}"
    raise QuantSpecError(f"{where}: weights {_value(w.type)} {w.num_bits}-bit {strategy}"
                         f"{'' if w.symmetric else ' asym'} with {inputs} are none of quantspec's quant types "
                         "(see `quantspec quantize --help`); change the scheme")


def read_recipe(path: str) -> Recipe:
    """The options of the llm-compressor recipe at `path` (module docstring); refused in one line
    naming the modifier and argument where quantspec cannot run it as written."""
    where = f"--recipe {path}"
    mods = _load(path)
    recipe = Recipe(path=str(path))
    quant = [(n, a) for n, a in mods if n in _METHODS]
    method, names = _method(quant, where), [n for n, _ in mods]
    if "AWQModifier" in names:
        if method == "autoround" or names.index("AWQModifier") > names.index(quant[0][0]):
            raise QuantSpecError(f"{where}: AWQModifier scales the weights before a QuantizationModifier or "
                                 "GPTQModifier quantizes them; put it first")
        method = "awq" if method == "rtn" else "awq+gptq"
    s = recipe.settings
    s["method"] = method
    try:
        _read_schemes(quant, where, s)
        for name, args in mods:
            _READERS.get(name, lambda *_: None)(args, f"{where}: {name}", s)
    except QuantSpecError:
        raise
    except (TypeError, ValueError, AttributeError) as e:  # an argument of the wrong kind
        raise QuantSpecError(f"{where}: an argument is not of the kind llm-compressor takes ({e})") from None
    if s["quant_type"] in ("a8w8", "a8w8_fp8") and s.get("activations") == "static":
        if "smoothquant_alpha" not in s:
            recipe.defaults["smoothquant_alpha"] = "none"
        recipe.defaults["fallback_layers"] = 0
    return recipe


def _method(quant: list[tuple[str, dict]], where: str) -> str:
    """The one method of the quantization modifiers: theirs where they bring schemes; a GPTQModifier
    or AutoRoundModifier without schemes runs its method on the schemes before it."""
    schemed = [n for n, a in quant if a.get("scheme") is not None or a.get("config_groups") is not None]
    if not schemed:
        raise QuantSpecError(f"{where} quantizes no weights, and quantspec writes KV-cache scales beside quantized "
                             "weights (or beside an artifact's: --quant-type keep --calib T --kv-cache fp8)")
    methods = {_METHODS[n] for n in schemed}
    over = {_METHODS[n] for n, _ in quant if n not in schemed} - {"rtn"}
    if len(methods | over) > 1 and not (methods == {"rtn"} and len(over) == 1):
        raise QuantSpecError(f"{where} runs {' and '.join(sorted(methods | over))} on different layers, and "
                             "quantspec runs one method for the whole model; use one quantization modifier class")
    return (over or methods).pop()


def _read_schemes(quant: list[tuple[str, dict]], where: str, s: dict) -> None:
    """The quantization modifiers' schemes, ignore lists and KV-cache scheme into `s`."""
    from quantspec.quant.args import QuantType
    from quantspec.quant.presets import FP8_TYPES, INT4_TYPES, integer_weights

    matched, ignore, kv = [], [], []
    for name, args in quant:
        schemed = args.get("scheme") is not None or args.get("config_groups") is not None
        for g, scheme in (_schemes(name, args, where) if schemed else {}).items():
            matched.append((f"{where}: {name} group {g}", scheme.targets, _match(scheme, f"{where}: {name} group {g}")))
        ign = args.get("ignore") or []
        ignore += [i for i in ([ign] if isinstance(ign, str) else ign) if i not in ignore]
        if args.get("kv_cache_scheme") is not None:
            kv.append(args["kv_cache_scheme"])
        if name == "GPTQModifier":
            _read_gptq(args, matched, f"{where}: {name}", s)
    base = [m for m in matched if "Linear" in m[1]]
    if len(base) != 1:
        raise QuantSpecError(f"{where}: quantspec quantizes every Linear not ignored at one --quant-type, and "
                             + ("no config group targets `Linear`; add one" if not base else
                                "several config groups target `Linear`; keep one"))
    m = base[0][2]
    s["quant_type"] = m["quant_type"]
    layers = [f"{t}={mm['quant_type']}" for _, targets, mm in matched if mm is not m for t in targets]
    named = any(_names_head(t) for _, targets, mm in matched if mm is not m for t in targets)
    if "lm_head" not in ignore and not named:  # a Linear to llm-compressor: its scheme is the model's
        layers.append(f"lm_head={m['quant_type']}")
    knobs = {}
    for w, _, mm in matched:
        qt = QuantType.parse(mm["quant_type"])
        if qt is QuantType.WEIGHT_ONLY_INT8 and mm is not m and mm["group_size"] != -1:
            raise QuantSpecError(f"{w}: int8 layers beside the model's type are per channel in quantspec; give them "
                                 "weights strategy: channel")
        grouped = qt in INT4_TYPES or (qt is QuantType.WEIGHT_ONLY_INT8 and mm is m)
        for k, applies in (("group_size", grouped), ("zp_dtype", qt in INT4_TYPES),
                           ("symmetric", integer_weights(qt)), ("weight_block", mm["weight_block"] is not None),
                           ("weight_strategy", qt in FP8_TYPES)):
            if applies and knobs.setdefault(k, mm[k]) != mm[k]:
                raise QuantSpecError(f"{w}: its {k.replace('_', ' ')} {mm[k]} differs from another group's "
                                     f"({knobs[k]}), and quantspec gives every layer the model's")
    s.update({k: knobs[k] for k in ("group_size", "zp_dtype", "weight_block", "weight_strategy")
              if knobs.get(k) is not None})
    if "symmetric" in knobs:
        s["symmetric"] = knobs["symmetric"]
    if (observer := _weight_observer(matched, s["method"])) is not None:
        s["weight_observer"] = observer
    if m["quant_type"] in ("a8w8", "a8w8_fp8"):
        s["activations"] = m["activations"]
    s["ignore"], s["layer_quant_types"] = tuple(ignore), tuple(layers)
    if kv:
        _read_kv(kv, where, s)


def _names_head(target: str) -> bool:
    """A group's `target` names the output head (by name or `re:` regex: outranking `Linear`)."""
    import re

    return target == "lm_head" or (target.startswith("re:") and re.match(target[3:], "lm_head") is not None)


def _weight_observer(matched: list, method: str) -> str | None:
    """`--weight-observer` of the matched groups' observers: their one value (min/max or mse), or None
    where they differ and each is its type's own default (`quant.presets.default_weight_observer`)."""
    from quantspec.quant.presets import default_weight_observer

    ours = []
    for w, _, mm in matched:
        if mm["observer"] not in (None, "mse", "minmax", "memoryless_minmax", "static_minmax"):
            raise QuantSpecError(f"{w}: weight observer {mm['observer']!r} is not quantspec's; use minmax or mse")
        ours.append(("mse" if mm["observer"] == "mse" else "minmax", default_weight_observer(mm["quant_type"], method)))
    if len({o for o, _ in ours}) == 1:
        return ours[0][0]
    if all(o == d for o, d in ours):
        return None
    w = next(w for (w, _, _), (o, _) in zip(matched, ours) if o != ours[0][0])
    raise QuantSpecError(f"{w}: its weight observer differs from another group's, and quantspec gives every layer one "
                         "observer or each type its own default (mse for int4, minmax for the rest)")


def _read_gptq(args: dict, matched: list, where: str, s: dict) -> None:
    """GPTQModifier's block, damping and column order (its default `actorder` static: `--act-order`)."""
    s["block_size"] = int(args.get("block_size", 128))
    damp = args.get("dampening_frac", 0.01)
    if damp is None or not damp > 0:
        raise QuantSpecError(f"{where}: dampening_frac {damp} must be > 0 in quantspec (e.g. 0.01)")
    s["damp"] = float(damp)
    orders = {str(_value(mm["actorder"])).lower() for *_, mm in matched if mm["actorder"] is not None}
    order = str(_value(args.get("actorder", "static"))).lower()  # null: "none"
    if "actorder" in args and orders and orders != {order}:
        raise QuantSpecError(f"{where}: actorder {order} and its config groups' actorder differ; set one of them")
    orders = orders or {order}
    if orders - {"static", "weight", "none", "false"} or len(orders) > 1:
        raise QuantSpecError(f"{where}: actorder {', '.join(sorted(orders))}: quantspec orders GPTQ's columns with "
                             "static groups (actorder static) or not at all (null)")
    s["act_order"] = orders.pop() in ("static", "weight")


def _read_kv(schemes: list, where: str, s: dict) -> None:
    from compressed_tensors.quantization import QuantizationArgs

    try:
        kvs = [QuantizationArgs.model_validate(k) for k in schemes]
    except ValueError as e:
        raise QuantSpecError(f"{where}: kv_cache_scheme does not validate ({str(e).splitlines()[0]})") from None
    keys = {_key(k) for k in kvs}
    k = kvs[0]
    strategy = {"tensor": "tensor", "attn_head": "head"}.get(_value(k.strategy))
    if len(keys) > 1 or k.num_bits != 8 or not k.symmetric or k.dynamic or strategy is None:
        raise QuantSpecError(f"{where}: kv_cache_scheme must be one static symmetric 8-bit int or float scheme per "
                             "tensor or per attention head (what quantspec's --kv-cache writes)")
    s["kv_cache"], s["kv_strategy"] = ("fp8" if _value(k.type) == "float" else "int8"), strategy


def _same_mappings(mappings, default) -> bool:
    import json

    return mappings is None or json.loads(json.dumps(mappings)) == default


def _read_smoothquant(args: dict, where: str, s: dict) -> None:
    if args.get("algorithm", "smoothquant") != "smoothquant":
        raise QuantSpecError(f"{where}: quantspec runs SmoothQuant's smoothing, not {args['algorithm']}; set "
                             "algorithm: smoothquant")
    if not _same_mappings(args.get("mappings"), _SQ_MAPPINGS) or args.get("ignore") or \
            args.get("num_calibration_steps") is not None:
        raise QuantSpecError(f"{where}: quantspec smooths each decoder layer's q/k/v and gate/up groups (its "
                             "default mappings) over its calibration table; drop mappings, ignore and "
                             "num_calibration_steps")
    s["smoothquant_alpha"] = float(args.get("smoothing_strength", 0.5))


def _read_awq(args: dict, where: str, s: dict) -> None:
    from quantspec.calib.awq import AWQ_GRID

    duo = {True: "true", False: "false", "both": "both"}.get(args.get("duo_scaling", True))
    if args.get("mappings") is not None or args.get("ignore") or duo is None \
            or args.get("n_grid", AWQ_GRID) != AWQ_GRID or args.get("targets", "Linear") not in ("Linear", ["Linear"]):
        raise QuantSpecError(f"{where}: quantspec's AWQ searches its default mappings over {AWQ_GRID} points "
                             "(duo_scaling true, false or both); drop mappings, ignore, targets and n_grid")
    if duo != "true":
        s["awq_duo_scaling"] = duo


def _read_autoround(args: dict, where: str, s: dict) -> None:
    s.update(iters=int(args.get("iters", 200)), batch_size=int(args.get("batch_size", 8)))
    if args.get("lr") is not None:
        s["lr"] = float(args["lr"])


def _check_transform(args: dict, where: str, want_type: str, what: str) -> None:
    if args.get("randomize") or args.get("learnable") or args.get("transform_type", want_type) != want_type:
        raise QuantSpecError(f"{where}: quantspec's {what} are {want_type} matrices, neither randomized nor "
                             f"learned; set transform_type: {want_type} and drop randomize / learnable")


def _read_quip(args: dict, where: str, s: dict) -> None:
    default = "random-hadamard"  # QuIPModifier's default transform_type
    _check_transform({"transform_type": default, **args}, where, "hadamard", "--quip transforms")
    rotations = args.get("rotations", ["v"])
    if not set(rotations) <= {"v", "u"} or args.get("targets", "Linear") not in ("Linear", ["Linear"]) \
            or args.get("ignore", "lm_head") not in ("lm_head", ["lm_head"]):
        raise QuantSpecError(f"{where}: quantspec turns every decoder Linear (rotations v and u, targets Linear, "
                             "ignore lm_head)")
    s["quip"] = ",".join(r for r in ("v", "u") if r in rotations)
    if args.get("transform_block_size") is not None:
        s["quip_block_size"] = int(args["transform_block_size"])


def _read_spinquant(args: dict, where: str, s: dict) -> None:
    rotations = list(args.get("rotations", ["R1", "R2"]))
    fused = [r for r in rotations if r in ("R1", "R2")]
    if not set(rotations) <= {"R1", "R2", "R4"} or (fused and "R4" in rotations):
        raise QuantSpecError(f"{where}: rotations {rotations}: quantspec fuses R1 / R2 (random Hadamard) and runs "
                             "R4 (Hadamard blocks); give them in two SpinQuantModifiers, R3 is not run")
    _check_transform({"transform_type": "hadamard", **args}, where, "random-hadamard" if fused else "hadamard",
                     "R1 / R2 rotations" if fused else "R4 transforms")
    if args.get("transform_block_size") is not None:
        raise QuantSpecError(f"{where}: quantspec sizes its rotations by the model; drop transform_block_size")
    have = [r for r in (s.get("rotate") or "").split(",") if r]
    s["rotate"] = ",".join(r for r in ("R1", "R2", "R4") if r in have + rotations)


_READERS = {"SmoothQuantModifier": _read_smoothquant, "AWQModifier": _read_awq, "AutoRoundModifier": _read_autoround,
            "QuIPModifier": _read_quip, "SpinQuantModifier": _read_spinquant}
