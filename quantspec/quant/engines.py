"""What each serving engine does with a compressed-tensors artifact: one verdict per engine.

`engine_verdicts(config, linears)` says, for vLLM, SGLang, transformers and quantspec, whether an
artifact with this `quantization_config` and these Linears loads with the scheme it was quantized
with, loads but ignores part of it, or is refused — and, per engine layer, which scheme the
engine picks. It models the engines' compressed-tensors decision code at the versions pinned in
`ENGINE_VERSIONS`; the conformance suite (tests/conformance) runs that code itself, lifted from
the engines' wheels, on every artifact type and checks these verdicts against it, so a change in
an engine shows up as a failing test, not as a wrong verdict. `target_refusal` turns the same
verdicts into the one-line refusals of `quantize --target`.

Engine layers: vLLM and SGLang fuse q/k/v into `qkv_proj` and gate/up into `gate_up_proj`
(`FUSED_LAYERS`) and pick one scheme per fused layer:
- vLLM matches a layer's name (exact or `re:`), then — through the model's
  `packed_modules_mapping` — all shard names of a fused layer, then its class name
  (`"Linear"` is contained in every linear class name);
- SGLang matches the name, then the class name (its Llama declares no `packed_modules_mapping`,
  so name targets for the shards of a fused layer are never reached).
A scheme written for the shards q/k/v therefore reaches both only as a regex that also matches
the fused name (`fused_targets`), and a class-target group must carry the fused layers' scheme.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Iterable, Mapping

from quantspec.errors import QuantSpecError
from quantspec.quant.args import (
    FORMAT_FLOAT_QUANTIZED,
    FORMAT_INT_QUANTIZED,
    FORMAT_NAIVE_QUANTIZED,
    FORMAT_PACK_QUANTIZED,
    QuantArgs,
)
from quantspec.quant.config import QuantConfig
from quantspec.quant.scheme import QuantScheme

__all__ = [
    "ENGINES", "ENGINE_NAMES", "ENGINE_VERSIONS", "TARGETS", "FUSED_LAYERS", "FP8_MIN_CAPABILITY",
    "LayerVerdict", "EngineVerdict", "engine_layers", "fused_targets", "engine_verdicts",
    "draft_verdicts", "DRAFT_REFUSALS", "target_refusal"
]

ENGINES = ("vllm", "sglang", "transformers", "quantspec")
ENGINE_NAMES = {"vllm": "vLLM", "sglang": "SGLang", "transformers": "transformers",
                "quantspec": "quantspec"}
# the releases these verdicts describe (tests/conformance fetches exactly these)
ENGINE_VERSIONS = {"vllm": "0.33.0", "sglang": "0.5.23", "transformers": "5.24.0"}
# `quantize --target`: "portable" = what both vLLM and SGLang load with the intended scheme
TARGETS = ("portable",) + ENGINES
TARGET_ENGINES = {"portable": ("vllm", "sglang"), "vllm": ("vllm",), "sglang": ("sglang",),
                  "transformers": ("transformers",), "quantspec": ()}
# engine layer → the checkpoint's Linears it fuses (vLLM's Llama `packed_modules_mapping`)
FUSED_LAYERS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
# the class of each Llama linear in vLLM / SGLang (name matching: "Linear" is in all of them)
LAYER_CLASSES = {"qkv_proj": "QKVParallelLinear", "gate_up_proj": "MergedColumnParallelLinear",
                 "o_proj": "RowParallelLinear", "down_proj": "RowParallelLinear"}
# draft modules (`model_zoo.mtp`, `.medusa`): why each engine but quantspec refuses one, read from
# its code at the pinned version (no model class, no speculative method that reads the layout)
DRAFT_REFUSALS = {
    "mtp": dict.fromkeys(("vllm", "sglang", "transformers"),
                         "it has no model class for a quantspec MTP module (quantspec's own layout)"),
    "medusa": {
        "vllm": f"vLLM {ENGINE_VERSIONS['vllm']} has no Medusa drafter (no 'medusa' in "
                "SpeculativeConfig.method, no Medusa class in its model registry)",
        "sglang": f"SGLang {ENGINE_VERSIONS['sglang']} has no Medusa drafter (no MEDUSA in "
                  "SpeculativeAlgorithm, no Medusa model class)",
        "transformers": "it has no model class for Medusa heads (architecture MedusaModel)",
    },
}
FP8_MIN_CAPABILITY = 89  # W8A8 FP8 kernels (Ada / Hopper); below it both run FP8 weight-only
_ACT_FORMATS = (FORMAT_NAIVE_QUANTIZED, FORMAT_INT_QUANTIZED, FORMAT_FLOAT_QUANTIZED)
# SGLang's static int8 scheme on a fused layer: `CompressedTensorsW8A8Int8.create_weights` makes one
# input_scale element, and `PerTensorScaleParameter._load_into_shard_id` (srt/layers/parameter.py)
# writes shard q/k/v (gate/up) at index 0/1/2 (0/1): whatever the scale's shape or value
SGLANG_FUSED_STATIC_INT8 = (f"SGLang {ENGINE_VERSIONS['sglang']}'s CompressedTensorsW8A8Int8.create_weights "
                            "gives a fused layer one input_scale element and "
                            "PerTensorScaleParameter._load_into_shard_id indexes it by shard, so the "
                            "k/v and up shards' input_scale raise IndexError")
_SHARD = re.compile(r"^(.*)\.([^.]+)$")


@dataclass(frozen=True)
class LayerVerdict:
    """The scheme one engine picks for one engine layer (None: left unquantized)."""

    scheme: str | None
    num_bits: int | None = None
    group_size: int | None = None  # None: per channel (or not grouped)
    symmetric: bool | None = None
    input_activations: str | None = None  # "int8 static" / "fp8 static" / None
    problem: str | None = None  # why the engine refuses or mis-runs this layer
    defect: bool = False  # the problem is the engine's bug: the layer is valid compressed-tensors

    def to_dict(self) -> dict:
        return {"scheme": self.scheme, "num_bits": self.num_bits, "group_size": self.group_size,
                "symmetric": self.symmetric, "input_activations": self.input_activations,
                "problem": self.problem, "defect": self.defect}


@dataclass(frozen=True)
class EngineVerdict:
    """One engine's verdict: `status` "loads" | "ignores" | "refused", the reasons (ignored parts
    or the refusal), what to do instead, the KV cache it runs, and the scheme per engine layer.
    `defect`: every reason is a bug of the engine on valid compressed-tensors (e.g. SGLang's
    static int8 layers), so `--target portable` still writes the artifact."""

    engine: str
    status: str
    reasons: tuple[str, ...] = ()
    fixes: tuple[str, ...] = ()
    kv_cache: str | None = None
    layers: Mapping[str, LayerVerdict] = field(default_factory=dict)
    defect: bool = False

    def line(self) -> str:
        """One line: "loads", "loads but ignores X" or "refused because Y"."""
        if self.status == "loads":
            return "loads"
        why = "; ".join(self.reasons)
        if self.defect:
            why += f" (a bug in {_ENGINE(self.engine)}: the artifact is valid compressed-tensors)"
        return f"loads but ignores {why}" if self.status == "ignores" else f"refused because {why}"

    def to_dict(self) -> dict:
        return {"engine": self.engine, "status": self.status, "verdict": self.line(),
                "reasons": list(self.reasons), "fixes": list(self.fixes), "kv_cache": self.kv_cache,
                "defect": self.defect, "layers": {n: v.to_dict() for n, v in self.layers.items()}}


def engine_layers(linears: Iterable[str]) -> dict[str, tuple[str, ...]]:
    """Engine layer name → the checkpoint Linears it holds, for the quantized `linears`.

    Example: q/k/v of `model.layers.0.self_attn` → {"model.layers.0.self_attn.qkv_proj":
    (q_proj, k_proj, v_proj names)}; o_proj stays itself.
    """
    out: dict[str, tuple[str, ...]] = {}
    names = list(linears)
    present = set(names)
    for name in names:
        m = _SHARD.match(name)
        fused = None
        if m is not None:
            for layer, shards in FUSED_LAYERS.items():
                if m.group(2) in shards:
                    members = tuple(f"{m.group(1)}.{s}" for s in shards)
                    if all(s in present for s in members):
                        fused = (f"{m.group(1)}.{layer}", members)
                    break
        key, members = fused or (name, (name,))
        out.setdefault(key, members)
    return out


def fused_targets(names: Iterable[str]) -> tuple[str, ...]:
    """Config targets for `names` that every engine resolves the same way: a whole fused unit
    (q/k/v or gate/up of one layer) becomes one regex matching its shards and the fused layer
    (`re:^model\\.layers\\.3\\.self_attn\\.(q_proj|k_proj|v_proj|qkv_proj)$`), anything else stays
    an exact name."""
    names = sorted(set(names))
    out: list[str] = []
    taken: set[str] = set()
    for layer, members in engine_layers(names).items():
        if len(members) > 1:
            prefix, fused = _SHARD.match(layer).groups()
            alts = "|".join(re.escape(s.rsplit(".", 1)[1]) for s in members) + f"|{fused}"
            out.append(f"re:^{re.escape(prefix)}\\.({alts})$")
            taken.update(members)
    out.extend(n for n in names if n not in taken)
    return tuple(out)


# ---- matching ------------------------------------------------------------------------------------

def _name_match(value: str, target: str) -> bool:
    if target.startswith("re:"):
        return re.match(target[3:], value) is not None
    return target == value


def _target_map(config: QuantConfig) -> dict[str, QuantScheme]:
    out: dict[str, QuantScheme] = {}
    for s in config.config_groups.values():
        for t in s.targets:
            out[t] = s  # a later group re-using a target replaces the earlier one
    return out


def _engine_scheme(engine: str, layer: str, shards: tuple[str, ...], targets: Mapping[str, QuantScheme]
                   ) -> QuantScheme | None:
    """The config group `engine` resolves engine layer `layer` to (see the module docstring)."""
    cls = LAYER_CLASSES.get(layer.rsplit(".", 1)[-1], "ReplicatedLinear")
    by_name = next((t for t in targets if _name_match(layer, t)), None)
    by_class = next((t for t in targets if not t.startswith("re:") and t.lower() in cls.lower()),
                    None)
    by_fused = None
    if engine == "vllm" and len(shards) > 1:
        hits = [next((t for t in targets if _name_match(s, t)), None) for s in shards]
        by_fused = hits[0] if all(hits) else None
    order = (by_name, by_fused, by_class) if engine == "vllm" else (by_name, by_class)
    hit = next((t for t in order if t is not None), None)
    return None if hit is None else targets[hit]


# ---- scheme selection ------------------------------------------------------------------------------

def _act(ia: QuantArgs | None) -> str | None:
    if ia is None:
        return None
    kind = "fp8" if ia.type == "float" else f"int{ia.num_bits}"
    return f"{kind} {'dynamic' if ia.dynamic else 'static'}"


def _select(engine: str, s: QuantScheme, K: int | None, shards: int, capability: int
            ) -> LayerVerdict:
    """The engine's scheme class for scheme `s` on a layer with input dim K and `shards` shards."""
    w, ia, fmt = s.weights, s.input_activations, s.format
    g = w.group_size if w.strategy == "group" else None
    base = dict(num_bits=w.num_bits, group_size=g, symmetric=w.symmetric)
    if w.zp_dtype is not None:
        return LayerVerdict(None, **base, problem=f"float zero points ({w.zp_dtype}): {_ENGINE(engine)} "
                                                  "reads integer zero points only")
    act_fmt = fmt in _ACT_FORMATS or (engine == "sglang" and fmt == FORMAT_PACK_QUANTIZED)
    if engine == "vllm" and fmt in _ACT_FORMATS and ia is None and w.type == "int":
        return LayerVerdict(None, **base, problem=f"integer weight-only weights in format {fmt!r} "
                                                  "(vLLM takes them only as pack-quantized)")
    channel_group = w.strategy in ("channel", "group") and not w.dynamic
    if w.type == "int" and ia is None and channel_group:
        ok_bits = range(2, 9) if engine == "vllm" else (4, 8)
        if fmt == FORMAT_PACK_QUANTIZED and w.num_bits in ok_bits:
            if engine == "sglang" and g is not None and K is not None and K % g:
                return LayerVerdict(None, **base, problem=f"group size {g} does not divide K={K}")
            return LayerVerdict("WNA16", **base)
        if engine == "sglang" or fmt == FORMAT_PACK_QUANTIZED:
            return LayerVerdict(None, **base, problem=f"no scheme for {w.num_bits}-bit integer "
                                                      f"weight-only in format {fmt!r}")
    if act_fmt:
        fp8_weights = w.type == "float" and w.symmetric and not w.dynamic and \
            w.strategy in ("tensor", "channel")
        if fp8_weights and ia is not None and ia.type == "float" and \
                (ia.dynamic or (ia.symmetric and ia.strategy == "tensor")):
            if capability >= FP8_MIN_CAPABILITY:
                return LayerVerdict("W8A8Fp8", **base, input_activations=_act(ia))
            return LayerVerdict("W8A16Fp8", **base)
        if fp8_weights:
            return LayerVerdict("W8A16Fp8", **base)
        if ia is not None and w.num_bits == ia.num_bits == 8 and w.type == ia.type == "int" and \
                w.strategy in ("tensor", "channel") and w.symmetric and not w.dynamic and \
                not ia.dynamic and ia.strategy == "tensor":
            if engine == "sglang" and shards > 1:
                return LayerVerdict(None, **base, input_activations=_act(ia), defect=True,
                                    problem=SGLANG_FUSED_STATIC_INT8)
            return LayerVerdict("W8A8Int8", **base, input_activations=_act(ia))
    return LayerVerdict(None, **base, problem=f"no {_ENGINE(engine)} scheme for weights "
                                              f"{w.type}{w.num_bits} {w.strategy}"
                                              f"{'' if w.symmetric else ' asymmetric'}, "
                                              f"activations {_act(ia) or 'none'}, format {fmt!r}")


def _ENGINE(engine: str) -> str:
    return ENGINE_NAMES[engine]


def _same(a: QuantScheme, b: QuantScheme) -> bool:
    return a.weights == b.weights and a.input_activations == b.input_activations


def _kv(engine: str, kv: QuantArgs | None) -> tuple[str | None, str | None, str | None]:
    """(KV cache the engine runs, what it ignores, why it refuses) for `kv_cache_scheme`."""
    if kv is None:
        return None, None, None
    kind = f"{'fp8' if kv.type == 'float' else 'int8'} per-{'head' if kv.strategy == 'attn_head' else 'tensor'}"
    if engine == "quantspec":
        return kind, None, None
    if engine == "transformers":
        return None, f"the {kind} KV-cache scales (k_scale/v_scale: it runs a float KV cache)", None
    ok_type = kv.type == "float" and kv.num_bits == 8 and kv.symmetric and not kv.dynamic
    if engine == "vllm":
        if not ok_type or kv.strategy not in ("tensor", "attn_head"):
            return None, None, f"its KV cache takes float 8-bit scales only, not {kind}"
        return kind, None, None
    if ok_type and kv.strategy == "tensor":
        return kind, None, None
    return None, f"the {kind} KV-cache scales (it loads per-tensor FP8 scales only)", None


# ---- the verdicts ---------------------------------------------------------------------------------

def engine_verdicts(config: QuantConfig, linears: Mapping[str, int | None] | Iterable[str], *,
                    capability: int = 90, draft: str | None = None
                    ) -> dict[str, EngineVerdict]:
    """One `EngineVerdict` per engine in `ENGINES` for an artifact with `config` whose quantized
    Linears are `linears` (name → input dim K, or names alone when K is unknown).

    `capability`: the GPU's compute capability (90 = Hopper) for the engines' FP8 choice.
    `draft`: "mtp" / "medusa" for a draft module (`DRAFT_REFUSALS`): every engine then refuses
    it except quantspec.
    """
    if not isinstance(linears, Mapping):
        linears = {n: None for n in linears}
    targets = _target_map(config)
    layers = engine_layers(n for n in linears if config.scheme_for(n) is not None)
    out = {}
    for engine in ENGINES:
        out[engine] = _draft_refusal(engine, draft) or \
            _verdict(engine, config, targets, layers, linears, capability)
    return out


def draft_verdicts(draft: str) -> dict[str, EngineVerdict]:
    """The verdicts on an unquantized draft module of kind `draft` ("mtp" / "medusa"): quantspec
    loads it, every other engine refuses it (`DRAFT_REFUSALS`)."""
    return {e: _draft_refusal(e, draft) or EngineVerdict(e, "loads") for e in ENGINES}


def _draft_refusal(engine: str, draft: str | None) -> EngineVerdict | None:
    if draft is None or engine == "quantspec":
        return None
    return EngineVerdict(engine, "refused", (DRAFT_REFUSALS[draft][engine],), ("serve it with quantspec",))


def _verdict(engine, config, targets, layers, linears, capability) -> EngineVerdict:
    refused: list[str] = []
    ignored: list[str] = []
    fixes: list[str] = []
    per_layer: dict[str, LayerVerdict] = {}
    if engine == "quantspec":
        kv, _, _ = _kv(engine, config.kv_cache_scheme)
        per_layer = {layer: _quantspec_layer(config.scheme_for(shards[0]))
                     for layer, shards in layers.items()}
        refused = _collapse([f"{_short(n)}: {v.problem}" for n, v in per_layer.items() if v.problem])
        return EngineVerdict(engine, "refused" if refused else "loads", tuple(refused), (), kv, per_layer)
    for layer, shards in layers.items():
        intended = [config.scheme_for(s) for s in shards]
        K = linears.get(shards[0])
        if engine == "transformers":  # compressed-tensors' own matching, per checkpoint Linear
            vs = [_transformers_layer(i) for i in intended]
            v = next((x for x in vs if x.problem is not None), vs[0])
        else:
            v = _engine_layer(engine, layer, shards, intended, targets, K, capability)
        per_layer[layer] = v
        if v.problem is not None and v.scheme is None:
            refused.append(f"{_short(layer)}: {v.problem}")
        elif v.problem is not None:
            ignored.append(f"{_short(layer)}: {v.problem}")
    kv, kv_ignored, kv_refused = _kv(engine, config.kv_cache_scheme)
    if kv_refused:
        refused.append(kv_refused)
    if kv_ignored:
        ignored.append(kv_ignored)
    refused, ignored = _collapse(refused), _collapse(ignored)
    fixes = _fixes(engine, config, refused + ignored)
    status = "refused" if refused else "ignores" if ignored else "loads"
    problems = [v for v in per_layer.values() if v.problem is not None]
    defect = bool(problems) and all(v.defect for v in problems) and not (kv_refused or kv_ignored)
    return EngineVerdict(engine, status, tuple(refused or ignored), tuple(fixes), kv, per_layer, defect)


def _engine_layer(engine: str, layer: str, shards: tuple[str, ...], intended: list[QuantScheme],
                  targets: Mapping[str, QuantScheme], K: int | None, capability: int) -> LayerVerdict:
    """vLLM's or SGLang's verdict on one engine layer whose shards were quantized `intended`."""
    if any(not _same(intended[0], i) for i in intended[1:]):
        return LayerVerdict(None, problem="its fused shards were quantized with different schemes")
    got = _engine_scheme(engine, layer, shards, targets)
    if got is None:
        return LayerVerdict(None, problem="no config target matches it, so it expects float weights")
    v = _select(engine, got, K, len(shards), capability)
    want = intended[0]
    if _same(got, want):
        return v
    if v.defect and want.input_activations is None:
        # the checkpoint holds no input_scale here, so the defect's loader never runs: the layer
        # loads as static int8 with its scale unset
        v = LayerVerdict("W8A8Int8", v.num_bits, v.group_size, v.symmetric, v.input_activations)
    return _mismatch(engine, v, got, want) if v.scheme is not None else v


def _quantspec_layer(s: QuantScheme) -> LayerVerdict:
    """quantspec's reader (`infer/quant_linear.py` `linear_kind`): int4 weights alone, int8 weights
    alone or with int8 activations, fp8 weights; activations static per tensor or dynamic per
    token."""
    w, ia = s.weights, s.input_activations
    g = w.group_size if w.strategy == "group" else None
    problem = None
    if w.type == "int" and w.num_bits not in (4, 8):
        problem = f"{w.num_bits}-bit integer weights (quantspec runs 4 and 8 bits)"
    elif ia is not None and w.type == "int" and (w.num_bits != 8 or ia.type != "int" or ia.num_bits != 8):
        problem = f"{w.num_bits}-bit weights with {_act(ia)} activations"
    elif ia is not None and ia.strategy not in ("tensor", "token"):
        problem = f"{ia.strategy} activation scales (quantspec runs per tensor or per token)"
    if problem is not None:
        return LayerVerdict(None, w.num_bits, g, w.symmetric, _act(ia), problem=problem)
    return LayerVerdict("QuantLinear", w.num_bits, g, w.symmetric, _act(ia))


def _transformers_layer(s: QuantScheme) -> LayerVerdict:
    """compressed-tensors (what transformers loads through) decompresses every format quantspec
    writes, except float zero points (its pack-quantized decompressor unpacks every zero point
    from int32) and packed integer zero points (transformers sizes them unpacked, [N, K/g])."""
    w = s.weights
    v = _quantspec_layer(s)
    if w.zp_dtype is not None:
        return LayerVerdict(None, problem=f"float zero points ({w.zp_dtype}) fail compressed-tensors' "
                                          "decompression")
    if not w.symmetric and s.format == FORMAT_PACK_QUANTIZED:
        return LayerVerdict(None, problem="packed integer zero points do not fit the shapes it "
                                          "allocates")
    return LayerVerdict("CompressedLinear", v.num_bits, v.group_size, v.symmetric, v.input_activations)


def _mismatch(engine: str, v: LayerVerdict, got: QuantScheme, want: QuantScheme) -> LayerVerdict:
    gw, ww = got.weights, want.weights
    if gw != ww:
        gg = gw.group_size if gw.strategy == "group" else "per-channel"
        wg = ww.group_size if ww.strategy == "group" else "per-channel"
        what = f"group size {gg} instead of {wg}" if (gg != wg) else "other weight args than stored"
        return LayerVerdict(None, v.num_bits, v.group_size, v.symmetric, v.input_activations,
                            problem=f"it resolves {what} (a name target for fused shards it does "
                                    "not see)")
    a_got, a_want = _act(got.input_activations), _act(want.input_activations)
    return LayerVerdict(v.scheme, v.num_bits, v.group_size, v.symmetric, v.input_activations,
                        problem=f"the weight-only fallback (runs {a_got} activations where "
                                f"{a_want or 'none'} were calibrated)")


def _short(layer: str) -> str:
    return layer.rsplit(".", 1)[-1]


def _collapse(items: list[str]) -> list[str]:
    """'qkv_proj: X', 'o_proj: X', ... (per decoder layer) → one 'X (qkv_proj ×2, o_proj ×2)'."""
    by_problem: dict[str, dict[str, int]] = {}
    for i in items:
        layer, problem = i.split(": ", 1) if ": " in i and " " not in i.split(": ", 1)[0] else ("", i)
        counts = by_problem.setdefault(problem, {})
        if layer:
            counts[layer] = counts.get(layer, 0) + 1
    out = []
    for problem, counts in by_problem.items():
        where = ", ".join(f"{n} ×{c}" if c > 1 else n for n, c in counts.items())
        out.append(f"{problem} ({where})" if where else problem)
    return out


def _fixes(engine: str, config: QuantConfig, problems: list[str]) -> list[str]:
    if not problems:
        return []
    text = " ".join(problems)
    out = []
    if "float zero points" in text:
        out.append("drop --zp-dtype (integer zero points)")
    if "packed integer zero points" in text or "asymmetric" in text:
        out.append("drop --asym")
    kv = config.kv_cache_scheme
    if "KV" in text and kv is not None:
        if engine == "transformers":
            out.append("drop --kv-cache")
        elif kv.type == "int":
            out.append("use --kv-cache fp8")
        elif kv.strategy == "attn_head":
            out.append("use --kv-strategy tensor")
    if "one input_scale element" in text:
        out.append("serve it with vLLM (which loads static int8), or use --quant-type a8w8_fp8")
    if any(k in text for k in ("instead of", "fallback", "format 'int-quantized'", "different schemes",
                               "no config target")):
        out.append("re-quantize with this quantspec (it writes what both engines load)")
    return out


# ---- quantize --target ----------------------------------------------------------------------------

# the Linears of a one-layer Llama with hidden 4096: `target_refusal` asks the verdicts about them
_PROBE = {f"model.layers.0.{n}": 4096
          for n in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                    "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}


def target_refusal(target: str, config: QuantConfig, *, draft: str | None = None) -> str | None:
    """The one-line refusal of `quantize --target target` for a preset `config` (None: allowed).

    Evaluates `engine_verdicts` on a probe Llama: an engine of the target that would refuse the
    artifact, or ignore part of it, refuses the options up front, naming the target, what the
    engine does and the alternative. `portable` lets through what an engine refuses only by its
    own bug (`EngineVerdict.defect`: valid compressed-tensors, e.g. static int8 in SGLang); the
    artifact's verdict for that engine says so. Naming that engine as the target refuses it.
    `draft`: "mtp" / "medusa" for a draft module, which every target but quantspec refuses.
    """
    if target not in TARGETS:
        raise QuantSpecError(f"unknown --target {target!r}; use one of: {', '.join(TARGETS)}")
    verdicts = engine_verdicts(config, _PROBE, draft=draft)
    for engine in TARGET_ENGINES[target]:
        v = verdicts[engine]
        if v.status != "loads" and not (target == "portable" and v.defect):
            fix = " or ".join(f for f in v.fixes if not f.startswith("re-quantize"))
            fix = f"{fix}, or pass --target quantspec" if fix else "pass --target quantspec"
            return f"--target {target}: {_ENGINE(engine)} {v.line()}; {fix}"
    return None
