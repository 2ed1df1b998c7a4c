"""The verdicts on a whole artifact: one `EngineVerdict` per engine (`engine_verdicts`), and the
one-line refusals of `quantize --target` built from them (`target_refusal`)."""

from __future__ import annotations

from typing import Iterable, Mapping

from quantspec.errors import QuantSpecError
from quantspec.quant.config import QuantConfig
from quantspec.quant.engines.drafts import EAGLE3_LAYERS, draft_refusal, eagle3_kv_ignored, eagle3_layers
from quantspec.quant.engines.layers import (
    engine_layer,
    engine_layers,
    kv_verdict,
    quantspec_embedding,
    quantspec_layer,
    target_map,
    transformers_layer,
)
from quantspec.quant.engines.tables import (
    DEFAULT_CAPABILITY,
    ENGINES,
    FP8_MIN_CAPABILITY,
    NVFP4_W4A4_CAPABILITY,
    TARGET_ENGINES,
    TARGETS,
    TRANSFORMERS_EMBEDDING,
    engine_name,
)
from quantspec.quant.engines.moe import PROJECTIONS, TRANSFORMERS_REFUSAL, moe_layer
from quantspec.quant.engines.verdict import EngineVerdict, LayerVerdict
from quantspec.quant.transforms import run_time_transforms, turned_at_run_time

__all__ = ["engine_verdicts", "target_refusal"]


def engine_verdicts(config: QuantConfig, linears: Mapping[str, int | None] | Iterable[str], *,
                    capability: int = 90, draft: str | None = None, base_layers: int | None = None,
                    draft_config: dict | None = None, rows: Mapping[str, int] | None = None
                    ) -> dict[str, EngineVerdict]:
    """One `EngineVerdict` per engine in `ENGINES` for an artifact with `config` whose quantized
    Linears are `linears` (name → input dim K, or names alone when K is unknown).

    `capability`: the GPU's compute capability (90 = Hopper) for the engines' FP8 choice.
    `draft`: "mtp" / "medusa" / "eagle3" for a draft module: the engines of `DRAFT_REFUSALS`
    refuse it; vLLM and SGLang judge an EAGLE-3 head under their own layer names
    (`drafts.eagle3_layers`; `base_layers`: the target's layer count, see there), and refuse
    one they would run otherwise than trained (`drafts.eagle3_refusal` on its `draft_config`).
    `rows`: the Linears' output dims N, where known (a fused layer's FP8 blocks must split at its
    shards).
    """
    if not isinstance(linears, Mapping):
        linears = {n: None for n in linears}
    targets = target_map(config)
    layers = engine_layers(n for n in linears if config.module_scheme(n) is not None)
    out = {}
    for engine in ENGINES:
        if engine in ("vllm", "sglang") and draft == "eagle3":
            per_layer = eagle3_layers(engine, config, targets, linears, capability, base_layers)
        else:
            per_layer = None
        out[engine] = draft_refusal(engine, draft, draft_config) or \
            _verdict(engine, config, targets, layers, linears, capability, per_layer, rows or {}, draft)
    return out


def _verdict(engine, config, targets, layers, linears, capability, per_layer=None, rows=None,
             draft=None) -> EngineVerdict:
    """One engine's verdict; `per_layer`: its layer verdicts when the caller judged them (an
    EAGLE-3 head's engine layers), else judged here from the checkpoint's `layers`; `draft`: the
    draft module's kind (an EAGLE-3 head's KV-cache scales, `drafts.eagle3_kv_ignored`)."""
    if engine == "quantspec":
        kv, _, _ = kv_verdict(engine, config.kv_cache_scheme)
        per_layer = {layer: (quantspec_embedding if _short(layer) == "embed_tokens" else quantspec_layer)(
                     config.module_scheme(shards[0])) for layer, shards in layers.items()}
        refused = _collapse([f"{_short(n)}: {v.problem}" for n, v in per_layer.items() if v.problem])
        return EngineVerdict(engine, "refused" if refused else "loads", tuple(refused), (), kv, per_layer)
    if per_layer is None:
        per_layer = {}
        for layer, shards in layers.items():
            intended = [config.module_scheme(s) for s in shards]
            if layer.endswith((".mlp.experts", ".block_sparse_moe.experts")):  # a fused-MoE layer (`moe`)
                per_layer[layer] = LayerVerdict(None, problem=TRANSFORMERS_REFUSAL) if engine == "transformers" \
                    else moe_layer(engine, layer, config, shards, capability, linears)
            elif engine == "transformers" and _short(layer) == "embed_tokens":
                per_layer[layer] = LayerVerdict(None, problem=TRANSFORMERS_EMBEDDING)
            elif engine == "transformers":  # compressed-tensors' own matching, per checkpoint Linear
                vs = [transformers_layer(i) for i in intended]
                per_layer[layer] = next((x for x in vs if x.problem is not None), vs[0])
            else:
                per_layer[layer] = engine_layer(engine, layer, shards, intended, targets,
                                                linears.get(shards[0]), capability,
                                                rows=tuple((rows or {}).get(s) for s in shards))
    skipped = run_time_transforms(config) if engine in ("sglang", "transformers") else ""
    unturned = f"the run-time transforms ({skipped}), so its outputs are wrong" if skipped else None
    if unturned:  # they load a turned Linear's quantized weight and pass over its transforms
        per_layer = _unturned(per_layer, layers, config, unturned)
    refused = [f"{_short(n)}: {v.problem}" for n, v in per_layer.items() if v.problem and v.scheme is None]
    ignored = [f"{_short(n)}: {v.problem}" for n, v in per_layer.items() if v.problem and v.scheme]
    kv, kv_ignored, kv_refused = kv_verdict(engine, config.kv_cache_scheme)
    if draft == "eagle3" and not kv_refused and (dropped := eagle3_kv_ignored(engine, config)):
        kv, kv_ignored = None, dropped
    if kv_refused:
        refused.append(kv_refused)
    if kv_ignored:
        ignored.append(kv_ignored)
    if unturned and not any(v.problem == unturned for v in per_layer.values()):  # on float Linears only
        ignored.append(unturned)
    refused, ignored = _collapse(refused), _collapse(ignored)
    fixes = _fixes(engine, config, refused + ignored)
    status = "refused" if refused else "ignores" if ignored else "loads"
    problems = [v for v in per_layer.values() if v.problem is not None]
    defect = bool(problems) and all(v.defect for v in problems) and not (kv_refused or kv_ignored)
    return EngineVerdict(engine, status, tuple(refused or ignored), tuple(fixes), kv, per_layer, defect)


def _unturned(per_layer: dict, layers: Mapping, config: QuantConfig, problem: str) -> dict:
    """`per_layer` with `problem` on each loaded layer one of whose shards the run-time transforms turn."""
    from dataclasses import replace

    out = dict(per_layer)
    for layer, v in per_layer.items():
        if v.scheme is not None and v.problem is None \
                and any(turned_at_run_time(config, s) for s in layers.get(layer, ())):
            out[layer] = replace(v, problem=problem)
    return out


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


# W4A8 / W4AFP8 problems (a phrase of the verdict) → the fix named beside them, in this order
_W4A8_FIXES = (
    ("8-bit inputs in fused-MoE experts only", "pass --target vllm with --quant-type a8w4_fp8 (vLLM runs FP8 "
                                               "inputs on Hopper), or use --quant-type weight_only_int4"),
    ("int4 experts with int8 inputs on CPUs only", "use --quant-type a8w4_fp8 (vLLM runs int4 experts with FP8 inputs)"),
    ("pack-quantized throughout", "leave the other Linears float (--ignore 're:.*self_attn.*') or weight-only int4"),
    ("groups of 128", "use --group-size 128"),
    ("before Humming", "use --quant-type a8w4_fp8 (FP8 inputs, which vLLM quantizes on Hopper) or weight_only_int4"),
)


# what a GPU's kernels do with a type's inputs, and the type that writes what they run there
_GPU_FIXES = ((f"FP8 input quantization below compute capability {FP8_MIN_CAPABILITY / 10:.1f}",
               "use --quant-type weight_only_fp8 (the FP8 weights alone, what runs there)"),
              ("NVFP4 input quantization below", "use --quant-type weight_only_nvfp4 (what runs there)"),
              ("MXFP4 input quantization", "use --quant-type weight_only_mxfp4 (what runs there)"),
              ("FP8 inputs to MXFP4 weights below", "use --quant-type weight_only_mxfp4 (what runs there)"),
              ("MXFP8 input quantization", "use --quant-type weight_only_mxfp8 (what runs there)"),
              ("asks for MXFP4 inputs", "use --quant-type mxfp4 (its inputs are quantized there)"),
              ("asks for MXFP8 inputs", "use --quant-type mxfp8 (its inputs are quantized there)"),
              ("FP8 weights below compute capability", "pass --target vllm (it runs FP8 weights from 7.5)"))


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
        if "the head's KV-cache scales" in text:
            out.append("drop --kv-cache, or pass --target vllm (which loads them)")
        elif engine == "transformers":
            out.append("drop --kv-cache")
        elif kv.type == "int":
            out.append("use --kv-cache fp8")
        elif kv.strategy == "attn_head":
            out.append("use --kv-strategy tensor")
    if "weight-only scheme is not pack-quantized" in text:
        out.append("use --quant-type weight_only_int8 (or a8w8_fp8 --activations dynamic: FP8 experts with "
                   "inputs per token)")
    if "FP8 block weights with float inputs" in text:
        out.append("drop --weight-block (per-channel FP8 weights), or pass --target vllm")
    if "one input_scale element" in text:
        out.append("serve it with vLLM (which loads static int8), or use --activations dynamic or "
                   "--quant-type a8w8_fp8")
    if "static int8 activations" in text:
        out.append("use --activations dynamic or --quant-type a8w8_fp8")
    elif "int8-activation experts" in text:
        out.append("use --quant-type a8w8_fp8")
    if engine == "sglang" and "MXFP4" in text:
        out.append("pass --target vllm (vLLM runs MXFP4) or use --quant-type weight_only_nvfp4 / nvfp4 (NVFP4, "
                   "which SGLang runs)")
    if engine == "sglang" and "MXFP8 weights" in text:
        out.append("pass --target vllm (vLLM runs MXFP8) or use --quant-type weight_only_fp8 / a8w8_fp8 (FP8 per "
                   "channel, which SGLang runs)")
    if "MXFP8 experts" in text:
        out.append("add the experts to --ignore, or use --quant-type weight_only_fp8 / a8w8_fp8")
    if "MXFP4 experts with FP8 inputs" in text:
        out.append("add the experts to --ignore, or use --quant-type weight_only_mxfp4 / mxfp4")
    out += [fix for problem, fix in _GPU_FIXES if problem in text]
    out += [fix for problem, fix in _W4A8_FIXES if problem in text]
    if "has no quantized embedding" in text:
        out.append("pass --target vllm (vLLM looks up quantized embedding rows) or leave model.embed_tokens float")
    elif "compressed embedding" in text:
        out.append("leave model.embed_tokens float")
    if "run-time transforms" in text:
        out.append("serve it with vLLM or quantspec (which run them), or re-quantize without --quip (or R4 in "
                   "--rotate)")
    if "builds fc as a plain torch.nn.Linear" in text:
        out.append("re-quantize with --target portable or sglang (fc stays float), or serve it with vLLM")
    if any(k in text for k in ("instead of", "fallback", "format 'int-quantized'", "different schemes",
                               "no config target", "the ignore list does not name it")):
        out.append("re-quantize with this quantspec (it writes what both engines load)")
    return out


# ---- quantize --target ----------------------------------------------------------------------------

# the Linears of a one-layer Llama with hidden 4096: `target_refusal` asks the verdicts about them
_PROBE = {f"model.layers.0.{n}": 4096
          for n in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                    "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}


def _moe_probe(hidden: int = 4096, intermediate: int = 4096) -> dict[str, int]:
    """The probe's mixture-of-experts twin: two experts of `intermediate` in place of the MLP."""
    return {**{n: k for n, k in _PROBE.items() if ".mlp." not in n},
            **{f"model.layers.0.mlp.experts.{e}.{p}": intermediate if p == "down_proj" else hidden
               for e in range(2) for p in PROJECTIONS}}


# ... and of an EAGLE-3 head on that Llama (fc reads 3 hidden states, q/k/v 2)
_EAGLE3_PROBE = {s: 4096 * {"fc": 3, "midlayer.self_attn.q_proj": 2, "midlayer.self_attn.k_proj": 2,
                            "midlayer.self_attn.v_proj": 2}.get(s, 1)
                 for _, shards in EAGLE3_LAYERS["vllm"].values() for s in shards if s != "lm_head"}


def target_refusal(target: str, config: QuantConfig, *, draft: str | None = None, moe: bool = False,
                   expert_dims: tuple[int, int] | None = None, capability: int | None = None) -> str | None:
    """The one-line refusal of `quantize --target target` for a preset `config` (None: allowed).

    Evaluates `engine_verdicts` on a probe Llama: an engine of the target that would refuse the
    artifact, or ignore part of it, refuses the options up front, naming the target, what the
    engine does and the alternative. `portable` lets through what an engine refuses only by its
    own bug (`EngineVerdict.defect`: valid compressed-tensors, e.g. static int8 in SGLang); the
    artifact's verdict for that engine says so. Naming that engine as the target refuses it.
    `draft`: "mtp" / "medusa" for a draft module, which every target but quantspec refuses;
    "eagle3" for an EAGLE-3 head, probed as one (`config` holds what the target leaves float,
    `drafts.eagle3_ignore`). `moe`: the model's MLPs are mixtures of experts, probed as two, of
    the model's hidden and expert intermediate sizes where `expert_dims` gives them. `capability`:
    the serving GPU's compute capability (`quantize --compute-capability`; None: the GPU each type
    is made for, below).
    """
    if target not in TARGETS:
        raise QuantSpecError(f"unknown --target {target!r}; use one of: {', '.join(TARGETS)}")
    probe = {n: k for n, k in _EAGLE3_PROBE.items() if config.scheme_for(n) is not None} \
        if draft == "eagle3" else _moe_probe(*(expert_dims or ())) if moe else _PROBE
    if draft is None and config.scheme_for("lm_head") is not None:  # a quantized output head
        probe = {**probe, "lm_head": 4096}
    if draft is None and config.module_scheme("model.embed_tokens") is not None:  # ... embedding
        probe = {**probe, "model.embed_tokens": 4096}
    # FP4 and MXFP8 inputs (NVFP4, MXFP4, MXFP8) are for Blackwell's tensor cores: probed on the GPU
    # they are made for (below it the engines run the weights alone, which `inspect`'s Hopper
    # verdict says); weight-only ones on Hopper, the default (where vLLM runs MXFP4A16 / MXFP8A16
    # weight-only, as written)
    microscaled_inputs = any(s.input_activations is not None and s.input_activations.microscaled
                             for s in config.config_groups.values())
    on = "" if capability is None else f" on compute capability {capability // 10}.{capability % 10}"
    if capability is None:
        capability = NVFP4_W4A4_CAPABILITY if microscaled_inputs else DEFAULT_CAPABILITY
    verdicts = engine_verdicts(config, probe, draft=draft, capability=capability)
    for engine in TARGET_ENGINES[target]:
        v = verdicts[engine]
        if v.status != "loads" and not (target == "portable" and v.defect):
            fix = " or ".join(f for f in v.fixes if not f.startswith("re-quantize"))
            fix = f"{fix}, or pass --target quantspec" if fix else "pass --target quantspec"
            return f"--target {target}{on}: {engine_name(engine)} {v.line()}; {fix}"
    return None
