"""Per engine layer: which engine layer holds which checkpoint Linears, which config group an
engine resolves it to, and which of the engine's schemes (or which problem) that gives.

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
from dataclasses import replace
from typing import Iterable, Mapping, Sequence

from quantspec.quant.args import (
    FORMAT_FLOAT_QUANTIZED,
    FORMAT_INT_QUANTIZED,
    FORMAT_NAIVE_QUANTIZED,
    FORMAT_PACK_QUANTIZED,
    QuantArgs,
)
from quantspec.quant.config import QuantConfig
from quantspec.quant.engines.tables import (
    FP8_MIN_CAPABILITY,
    FUSED_LAYERS,
    HEAD_BLOCK_SCALES,
    LAYER_CLASSES,
    SGLANG_EMBEDDING,
    SGLANG_W8A16_FP8_MIN_CAPABILITY,
    SGLANG_FUSED_STATIC_INT8,
    SGLANG_W4A8,
    VLLM_EMBEDDING,
    VLLM_W4A8_INT_INPUTS,
    VLLM_W4A8_INT_QUANTIZED_INPUTS,
    W4A8_FP8_CAPABILITY,
    W4A8_INT_MIN_CAPABILITY,
    engine_name,
)
from quantspec.quant.engines.moe import EXPERT, expert_layers
from quantspec.quant.engines.microscaled import microscaled_verdict
from quantspec.quant.engines.verdict import LayerVerdict, activation_label as _act
from quantspec.quant.scheme import QuantScheme, embedding_problem, is_mxfp4_fp8_inputs, is_w4a8

__all__ = ["engine_layers", "fused_targets", "target_map", "ignored", "engine_layer", "quantspec_embedding",
           "quantspec_layer", "transformers_layer", "kv_verdict"]

_ACT_FORMATS = (FORMAT_NAIVE_QUANTIZED, FORMAT_INT_QUANTIZED, FORMAT_FLOAT_QUANTIZED)
_SHARD = re.compile(r"^(.*)\.([^.]+)$")
FUSED_UNSEEN = "a name target for fused shards it does not see"


def engine_layers(linears: Iterable[str]) -> dict[str, tuple[str, ...]]:
    """Engine layer name → the checkpoint Linears it holds, for the quantized `linears`.

    Example: q/k/v of `model.layers.0.self_attn` → {"model.layers.0.self_attn.qkv_proj":
    (q_proj, k_proj, v_proj names)}; o_proj stays itself; every expert's Linears of
    `model.layers.0.mlp.experts.*` → "model.layers.0.mlp.experts" (`moe.expert_layers`).
    """
    out: dict[str, tuple[str, ...]] = {}
    names = list(linears)
    present = set(names)
    experts = expert_layers(names)  # a mixture of experts: one fused-MoE layer per decoder layer
    for name in names:
        e = EXPERT.match(name)
        if e is not None:
            out.setdefault(e.group(1), experts[e.group(1)])
            continue
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


def target_map(config: QuantConfig) -> dict[str, QuantScheme]:
    out: dict[str, QuantScheme] = {}
    for s in config.config_groups.values():
        for t in s.targets:
            out[t] = s  # a later group re-using a target replaces the earlier one
    return out


def _engine_scheme(engine: str, layer: str, shards: tuple[str, ...], targets: Mapping[str, QuantScheme],
                   cls: str | None = None, shard_names: bool = True) -> QuantScheme | None:
    """The config group `engine` resolves engine layer `layer` (of class `cls`; None: the Llama
    layer's, `LAYER_CLASSES`) to (see the module docstring). `shard_names`: vLLM matches a fused
    layer's shard names (its model's `packed_modules_mapping` reaches the quant config)."""
    cls = cls or LAYER_CLASSES.get(layer.rsplit(".", 1)[-1], "ReplicatedLinear")
    by_name = next((t for t in targets if _name_match(layer, t)), None)
    by_class = next((t for t in targets if not t.startswith("re:") and t.lower() in cls.lower()),
                    None)
    by_fused = None
    if engine == "vllm" and shard_names and len(shards) > 1:
        hits = [next((t for t in targets if _name_match(s, t)), None) for s in shards]
        by_fused = hits[0] if all(hits) else None
    order = (by_name, by_fused, by_class) if engine == "vllm" else (by_name, by_class)
    hit = next((t for t in order if t is not None), None)
    return None if hit is None else targets[hit]


def ignored(layer: str, ignore: Iterable[str]) -> bool:
    """The engine skips `layer` by its name (an exact name or an `re:` regex in `ignore`)."""
    return any(_name_match(layer, t) for t in ignore)


# ---- scheme selection ------------------------------------------------------------------------------

def _w4a8(engine: str, s: QuantScheme, capability: int, base: dict) -> LayerVerdict | None:
    """The verdict on sub-byte int weights with 8-bit inputs quantized per token at run time
    (W4A8, W4AFP8; `tables.VLLM_W4A8_INT_INPUTS`, `SGLANG_W4A8`); None for every other scheme.
    vLLM: FP8 inputs → `CompressedTensorsW4A8Fp8` (Hopper, int4 groups of 128, `weight_packed`);
    int8 inputs → `CompressedTensorsWNA8Int` (pack-quantized) or `CompressedTensorsW4A8Int`
    (int-quantized: a code per int8), both set the input quantization aside on CUDA."""
    w, ia, fmt = s.weights, s.input_activations, s.format
    if not (w.type == "int" and w.num_bits < 8 and ia is not None and ia.num_bits == 8 and ia.per_token
            and w.strategy in ("channel", "group") and not w.dynamic
            and fmt in (FORMAT_PACK_QUANTIZED, *_ACT_FORMATS)):
        return None
    act = _act(ia)
    if engine == "sglang":
        return LayerVerdict(None, **base, input_activations=act, problem=SGLANG_W4A8)
    if ia.type == "float":
        problem = None
        if capability != W4A8_FP8_CAPABILITY:
            problem = (f"int4 weights with FP8 inputs on compute capability {capability / 10:.1f} (its W4A8 FP8 "
                       f"scheme runs on {W4A8_FP8_CAPABILITY / 10:.1f} only)")
        elif w.num_bits != 4 or w.strategy != "group" or not (w.symmetric and ia.symmetric):
            problem = "FP8 inputs beside other than symmetric int4 group-wise weights"
        elif w.group_size != 128:  # CompressedTensorsW4A8Fp8.__init__ raises ValueError
            problem = (f"int4 weights in groups of {w.group_size} with FP8 inputs (its W4A8 FP8 scheme takes "
                       "groups of 128 only)")
        elif fmt != FORMAT_PACK_QUANTIZED:
            problem = f"its W4A8 FP8 scheme loads weight_packed, which format {fmt!r} does not hold"
        return LayerVerdict("W4A8Fp8" if problem is None else None, **base, input_activations=act, problem=problem)
    if fmt == FORMAT_PACK_QUANTIZED:
        if capability < W4A8_INT_MIN_CAPABILITY:
            return LayerVerdict(None, **base, input_activations=act, problem=f"int4 weights with int8 inputs below "
                                f"compute capability {W4A8_INT_MIN_CAPABILITY / 10:.1f}")
        if not ia.symmetric:
            return LayerVerdict(None, **base, input_activations=act,
                                problem="asymmetric int8 inputs (CompressedTensorsWNA8Int takes symmetric ones)")
        return LayerVerdict("WNA8Int", **base, input_activations=act, problem=VLLM_W4A8_INT_INPUTS)
    if w.num_bits != 4 or not w.symmetric:
        return LayerVerdict(None, **base, input_activations=act,
                            problem=f"{w.num_bits}-bit{'' if w.symmetric else ' asymmetric'} weights with int8 inputs "
                                    f"in format {fmt!r} (its W4A8 scheme takes symmetric int4 there)")
    return LayerVerdict("W4A8Int", **base, input_activations=act, problem=VLLM_W4A8_INT_QUANTIZED_INPUTS)


def _w8a16_fp8(engine: str, w, ia, capability: int, base: dict) -> LayerVerdict:
    """The engine's FP8 weight-only layer (W8A16Fp8): FP8 weights with float inputs, or an FP8-input
    layer below the W8A8 FP8 kernels' compute capability. SGLang's takes no block scales and needs Ampere."""
    if engine == "sglang" and w.strategy == "block":
        when = "with float inputs" if ia is None else f"below compute capability {FP8_MIN_CAPABILITY / 10:.1f}"
        return LayerVerdict(None, **base, problem=f"FP8 block weights {when} (its weight-only FP8 takes "
                                                  "per-channel or per-tensor scales)")
    if engine == "sglang" and capability < SGLANG_W8A16_FP8_MIN_CAPABILITY:
        return LayerVerdict(None, **base, problem=f"FP8 weights below compute capability "
                                                  f"{SGLANG_W8A16_FP8_MIN_CAPABILITY / 10:.1f} (its weight-only FP8 "
                                                  "needs Ampere)")
    return LayerVerdict("W8A16Fp8", **base)


def _select(engine: str, s: QuantScheme, K: int | None, shards: int, capability: int,
            rows: Sequence[int | None] = ()) -> LayerVerdict:
    """The engine's scheme class for scheme `s` on a layer with input dim K and `shards` shards
    (of `rows` output rows each, where known)."""
    w, ia, fmt = s.weights, s.input_activations, s.format
    g = w.group_size if w.strategy in ("group", "tensor_group") else None
    base = dict(num_bits=w.num_bits, group_size=g, symmetric=w.symmetric, block=w.block_structure,
                per_tensor=w.strategy == "tensor")
    if w.microscaled:
        N = sum(rows) if rows and None not in rows else None
        return microscaled_verdict(engine, s, capability, base, N, K)
    if w.zp_dtype is not None:
        return LayerVerdict(None, **base, problem=f"float zero points ({w.zp_dtype}): {engine_name(engine)} "
                                                  "reads integer zero points only")
    act_fmt = fmt in _ACT_FORMATS or (engine == "sglang" and fmt == FORMAT_PACK_QUANTIZED)
    if engine == "vllm" and fmt in _ACT_FORMATS and ia is None and w.type == "int":
        return LayerVerdict(None, **base, problem=f"integer weight-only weights in format {fmt!r} "
                                                  "(vLLM takes them only as pack-quantized)")
    channel_group = w.strategy in ("channel", "group") and not w.dynamic
    w4a8 = _w4a8(engine, s, capability, base)
    if w4a8 is not None:
        return w4a8
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
            w.strategy in ("tensor", "channel", "block")
        w8a16 = _w8a16_fp8(engine, w, ia, capability, base)
        split = [n for n in rows[:-1] if n is not None and w.strategy == "block" and n % w.block_structure[0]]
        if fp8_weights and split:  # `validate_fp8_block_shape`: a merged linear splits its scales by block rows
            return LayerVerdict(None, **base, problem=f"FP8 blocks of {w.block_structure[0]} rows do not split its "
                                                      f"fused shards (one has {split[0]} rows)")
        if fp8_weights and ia is not None and ia.type == "float" and \
                (ia.dynamic or (ia.symmetric and ia.strategy == "tensor")):
            if capability >= FP8_MIN_CAPABILITY:
                return LayerVerdict("W8A8Fp8", **base, input_activations=_act(ia))
            return w8a16 if w8a16.problem else replace(
                w8a16, problem=f"FP8 input quantization below compute capability {FP8_MIN_CAPABILITY / 10:.1f} (it "
                               "runs the FP8 weights alone, inputs float)")
        if fp8_weights:
            return w8a16
        if ia is not None and w.num_bits == ia.num_bits == 8 and w.type == ia.type == "int" and \
                w.strategy in ("tensor", "channel") and w.symmetric and not w.dynamic and \
                ia.strategy == ("token" if ia.dynamic else "tensor"):
            if engine == "sglang" and shards > 1 and not ia.dynamic:  # (dynamic: no input_scale to load)
                return LayerVerdict(None, **base, input_activations=_act(ia), defect=True,
                                    problem=SGLANG_FUSED_STATIC_INT8)
            return LayerVerdict("W8A8Int8", **base, input_activations=_act(ia))
    return LayerVerdict(None, **base, problem=f"no {engine_name(engine)} scheme for weights "
                                              f"{w.type}{w.num_bits} {w.strategy}"
                                              f"{'' if w.symmetric else ' asymmetric'}, "
                                              f"activations {_act(ia) or 'none'}, format {fmt!r}")


def _same(a: QuantScheme, b: QuantScheme) -> bool:
    return a.weights == b.weights and a.input_activations == b.input_activations


def kv_verdict(engine: str, kv: QuantArgs | None) -> tuple[str | None, str | None, str | None]:
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


def engine_layer(engine: str, layer: str, shards: tuple[str, ...], intended: list[QuantScheme | None],
                 targets: Mapping[str, QuantScheme], K: int | None, capability: int, *,
                 cls: str | None = None, shard_names: bool = True, ignore: Iterable[str] = (),
                 unseen: str = FUSED_UNSEEN, rows: Sequence[int | None] = ()) -> LayerVerdict | None:
    """vLLM's or SGLang's verdict on one engine layer whose shards (checkpoint Linears) were
    quantized `intended` (None: float), or None when both leave it float. `cls` / `shard_names`:
    see `_engine_scheme`; `ignore`: the config's ignore list, matched against the engine's name
    `layer`; `unseen`: why a name target written for the checkpoint does not reach the layer;
    `rows`: the shards' output rows, where known."""
    if any(i is None for i in intended) and not all(i is None for i in intended):
        return LayerVerdict(None, problem="its fused shards were quantized with different schemes")
    embedding = layer.rsplit(".", 1)[-1] == "embed_tokens"
    got = None if ignored(layer, ignore) or (embedding and engine != "vllm") else \
        _engine_scheme(engine, layer, shards, targets, cls, shard_names)  # SGLang: never a quantized embedding
    want = intended[0]
    if want is None:
        if got is None:
            return None
        v = _select(engine, got, K, len(shards), capability, rows)
        return LayerVerdict(None, v.num_bits, v.group_size, v.symmetric, v.input_activations,
                            problem="it expects quantized weights where the checkpoint holds float "
                                    "ones (the ignore list does not name it as the engine does)")
    if any(not _same(want, i) for i in intended[1:]):
        return LayerVerdict(None, problem="its fused shards were quantized with different schemes")
    if embedding:
        return _embedding(engine, got, want, unseen)
    if got is None:
        return LayerVerdict(None, problem="no config target matches it, so it expects float weights")
    v = _select(engine, got, K, len(shards), capability, rows)
    if layer == "lm_head" and got.weights.strategy == "block":
        return LayerVerdict(None, v.num_bits, v.group_size, v.symmetric, v.input_activations,
                            problem=HEAD_BLOCK_SCALES, block=v.block)
    if _same(got, want):
        return v
    if v.defect and want.input_activations is None:
        # the checkpoint holds no input_scale here, so the defect's loader never runs: the layer
        # loads as static int8 with its scale unset
        v = LayerVerdict("W8A8Int8", v.num_bits, v.group_size, v.symmetric, v.input_activations)
    return _mismatch(engine, v, got, want, unseen) if v.scheme is not None else v


def _embedding(engine: str, got: QuantScheme | None, want: QuantScheme, unseen: str) -> LayerVerdict:
    """vLLM's or SGLang's verdict on the input embedding stored quantized `want` that the engine
    resolves to `got` (SGLang: never quantized): `VLLM_EMBEDDING`, `SGLANG_EMBEDDING`."""
    w = want.weights
    base = dict(num_bits=w.num_bits, group_size=w.group_size if w.strategy == "group" else None,
                symmetric=w.symmetric)
    if engine == "sglang":
        return LayerVerdict(None, **base, problem=SGLANG_EMBEDDING)
    if got is None:
        return LayerVerdict(None, **base, problem="no config target matches it, so it expects float weights")
    g = got.weights
    if g.type != "int" or g.strategy not in ("channel", "group") or g.dynamic or got.input_activations is not None \
            or got.format != FORMAT_PACK_QUANTIZED or not g.symmetric:
        return LayerVerdict(None, **base, problem=VLLM_EMBEDDING)
    if not _same(got, want):
        return _mismatch(engine, LayerVerdict("EmbeddingWNA16Int", **base), got, want, unseen)
    return LayerVerdict("EmbeddingWNA16Int", **base)


def quantspec_layer(s: QuantScheme) -> LayerVerdict:
    """quantspec's reader (`infer/quant_linear.py` `linear_kind`): int4 weights alone or with 8-bit
    activations per token at run time, int8 weights alone or with int8 activations, fp8 weights, FP4
    weights alone or with FP4 inputs (MXFP4's also with FP8 ones);
    activations static per tensor or dynamic per token."""
    w, ia = s.weights, s.input_activations
    g = w.group_size if w.strategy in ("group", "tensor_group") else None
    problem = None
    if w.type == "int" and w.num_bits not in (4, 8):
        problem = f"{w.num_bits}-bit integer weights (quantspec runs 4 and 8 bits)"
    elif ia is not None and w.type == "int" and w.num_bits == 4 and not is_w4a8(w, ia):
        problem = f"4-bit weights with {_act(ia)} activations per {ia.strategy} (quantspec runs 8-bit ones per token)"
    elif ia is not None and w.type == "int" and w.num_bits == 8 and (ia.type != "int" or ia.num_bits != 8):
        problem = f"{w.num_bits}-bit weights with {_act(ia)} activations"
    elif ia is not None and ia.type == "float" and ia.is_fp4 != w.is_fp4 and not (
            w.microscaled == "mxfp4" and is_mxfp4_fp8_inputs(ia)):
        problem = f"{w.num_bits}-bit {w.type} weights with {_act(ia)} activations"
    elif ia is not None and ia.strategy not in ("tensor", "token") and not (
            ia.strategy in ("group", "tensor_group") and ia.dynamic):
        problem = f"{ia.strategy} activation scales (quantspec runs per tensor, per token or per group)"
    if problem is not None:
        return LayerVerdict(None, w.num_bits, g, w.symmetric, _act(ia), problem=problem, block=w.block_structure)
    return LayerVerdict("QuantLinear", w.num_bits, g, w.symmetric, _act(ia), block=w.block_structure,
                        per_tensor=w.strategy == "tensor")


def quantspec_embedding(s: QuantScheme) -> LayerVerdict:
    """quantspec's reader of a quantized input embedding (`infer/quant_embedding.py`): 4- and
    8-bit integer weight-only codes per row or per group."""
    w = s.weights
    g = w.group_size if w.strategy == "group" else None
    problem = embedding_problem(s)
    if problem is not None:
        return LayerVerdict(None, w.num_bits, g, w.symmetric, _act(s.input_activations), problem=problem)
    return LayerVerdict("QuantEmbedding", w.num_bits, g, w.symmetric)


def transformers_layer(s: QuantScheme) -> LayerVerdict:
    """compressed-tensors (what transformers loads through) decompresses every format quantspec
    writes, except float zero points (its pack-quantized decompressor unpacks every zero point
    from int32) and packed integer zero points (transformers sizes them unpacked, [N, K/g])."""
    w = s.weights
    v = quantspec_layer(s)
    if w.zp_dtype is not None:
        return LayerVerdict(None, problem=f"float zero points ({w.zp_dtype}) fail compressed-tensors' "
                                          "decompression")
    if not w.symmetric and s.format == FORMAT_PACK_QUANTIZED:
        return LayerVerdict(None, problem="packed integer zero points do not fit the shapes it "
                                          "allocates")
    return LayerVerdict("CompressedLinear", v.num_bits, v.group_size, v.symmetric, v.input_activations,
                        block=v.block, per_tensor=v.per_tensor)


def _mismatch(engine: str, v: LayerVerdict, got: QuantScheme, want: QuantScheme, unseen: str) -> LayerVerdict:
    gw, ww = got.weights, want.weights
    if gw != ww:
        gg = gw.group_size if gw.strategy == "group" else "per-channel"
        wg = ww.group_size if ww.strategy == "group" else "per-channel"
        what = f"group size {gg} instead of {wg}" if (gg != wg) else "other weight args than stored"
        return LayerVerdict(None, v.num_bits, v.group_size, v.symmetric, v.input_activations,
                            problem=f"it resolves {what} ({unseen})")
    a_got, a_want = _act(got.input_activations), _act(want.input_activations)
    return LayerVerdict(v.scheme, v.num_bits, v.group_size, v.symmetric, v.input_activations,
                        problem=f"the weight-only fallback (runs {a_got} activations where "
                                f"{a_want or 'none'} were calibrated)")
