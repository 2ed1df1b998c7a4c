"""Draft modules quantized on their own: an MTP module (`model_zoo.mtp`), Medusa heads
(`.medusa`) and an EAGLE-3 head (`.eagle3`), as each engine's code at the pinned version treats
them.

MTP and Medusa: every engine but quantspec refuses them (no model class, no speculative method
that reads the layout), `DRAFT_REFUSALS`.

EAGLE-3: vLLM (`Eagle3LlamaForCausalLM`, vllm/model_executor/models/llama_eagle3.py) and SGLang
(`LlamaForCausalLMEagle3`, sglang/srt/models/llama_eagle3.py) load the head with the draft's own
`quantization_config`, under their own layer names (`EAGLE3_LAYERS`), not the checkpoint's:
- vLLM passes the draft's config (`get_draft_quant_config`, models/utils.py: a fresh config per
  call, so no `packed_modules_mapping` reaches it and fused layers match by their own name or
  class only) to `fc` (a ReplicatedLinear named `model.fc`), to the decoder layer's qkv / o /
  gate_up / down (named `model.layers.<L>.…`, L the target's layer count: `start_layer_id`) and
  to `lm_head`;
- SGLang passes it to the decoder layer's linears, built with the model's prefix (`model.qkv_proj`,
  `model.self_attn.o_proj`, `model.gate_up_proj`, `model.down_proj`) and to `lm_head`, but builds
  `fc` as a plain `torch.nn.Linear` (`SGLANG_EAGLE3_FC`).
So a head portable to both leaves `fc` float (`eagle3_ignore`), and a name target reaches the
engines only when it also names their layers (`eagle3_targets`). transformers has no EAGLE-3
class.

The head's layer variants (`model_zoo.eagle3.VARIANT_FLAGS`, a Qwen3 decoder layer) and the
speculators format are vLLM's: SGLang's EAGLE-3 class adds the attention to the raw hidden state
whatever the config says, has no q / k norms and no EAGLE-3 class for a Qwen3 layer, and reads
no speculators config (`eagle3_refusal`).
"""

from __future__ import annotations

import re
from typing import Iterable, Mapping

from quantspec.quant.config import QuantConfig
from quantspec.quant.engines.layers import engine_layer
from quantspec.quant.engines.tables import ENGINE_VERSIONS, ENGINES, engine_name
from quantspec.quant.engines.verdict import EngineVerdict, LayerVerdict
from quantspec.quant.scheme import QuantScheme

__all__ = ["DRAFT_REFUSALS", "EAGLE3_LAYERS", "SGLANG_EAGLE3_FC", "SGLANG_EAGLE3_KV", "draft_verdicts",
           "draft_refusal", "eagle3_kv_ignored", "eagle3_layers", "eagle3_ignore", "eagle3_refusal", "eagle3_targets"]

_QKV = tuple(f"midlayer.self_attn.{s}_proj" for s in "qkv")
_GATE_UP = ("midlayer.mlp.gate_proj", "midlayer.mlp.up_proj")
_O, _DOWN = ("midlayer.self_attn.o_proj",), ("midlayer.mlp.down_proj",)
# engine layer name → (its class, the checkpoint Linears it holds); "{L}": vLLM's index of the
# head's layer, the target's layer count (llama_eagle3.py `LlamaModel(start_layer_id=...)`)
EAGLE3_LAYERS: dict[str, dict[str, tuple[str, tuple[str, ...]]]] = {
    "vllm": {
        "model.fc": ("ReplicatedLinear", ("fc",)),
        "model.layers.{L}.self_attn.qkv_proj": ("QKVParallelLinear", _QKV),
        "model.layers.{L}.self_attn.o_proj": ("RowParallelLinear", _O),
        "model.layers.{L}.mlp.gate_up_proj": ("MergedColumnParallelLinear", _GATE_UP),
        "model.layers.{L}.mlp.down_proj": ("RowParallelLinear", _DOWN),
        "lm_head": ("ParallelLMHead", ("lm_head",)),
    },
    "sglang": {
        "model.qkv_proj": ("QKVParallelLinear", _QKV),
        "model.self_attn.o_proj": ("RowParallelLinear", _O),
        "model.gate_up_proj": ("MergedColumnParallelLinear", _GATE_UP),
        "model.down_proj": ("RowParallelLinear", _DOWN),
        "lm_head": ("ParallelLMHead", ("lm_head",)),
    },
}
SGLANG_EAGLE3_FC = (f"SGLang {ENGINE_VERSIONS['sglang']} builds fc as a plain torch.nn.Linear without "
                    "quant_config (llama_eagle3.py LlamaModel.__init__), so "
                    "LlamaForCausalLMEagle3.load_weights skips fc's quantized tensors (no such "
                    "parameter) and fc runs its random initial weight")
SGLANG_EAGLE3_KV = (f"SGLang {ENGINE_VERSIONS['sglang']}'s LlamaForCausalLMEagle3.load_weights looks the head's "
                    "layers.0.self_attn.k_scale / v_scale up under those names, its attention holds them as "
                    "self_attn.attn.k_scale / v_scale, and it skips a name it does not find: the head's KV cache "
                    "runs at its default scale")
# checkpoint Linear → why an engine cannot take it quantized
_FLOAT_ONLY = {"sglang": {"fc": SGLANG_EAGLE3_FC}}
_EAGLE3_UNSEEN = "name targets written for the checkpoint's names do not reach {engine}'s name for it, {layer}"

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
    "eagle3": {
        "transformers": f"transformers {ENGINE_VERSIONS['transformers']} has no model class for an "
                        "EAGLE-3 head (architecture LlamaForCausalLMEagle3)",
    },
}


def eagle3_kv_ignored(engine: str, config: QuantConfig) -> str | None:
    """What `engine` ignores of an EAGLE-3 head's KV-cache scales (None: nothing, or none written).
    vLLM's `AutoWeightsLoader` maps `midlayer.self_attn.k_scale` to its attention's `attn.k_scale`
    (`QuantizationConfig.get_cache_scale_mapper`, after the head's `midlayer.` → `layers.0.`);
    SGLang's loader does not (`SGLANG_EAGLE3_KV`)."""
    if engine != "sglang" or config.kv_cache_scheme is None:
        return None
    return f"the head's KV-cache scales ({SGLANG_EAGLE3_KV})"


def draft_verdicts(draft: str, config: dict | None = None) -> dict[str, EngineVerdict]:
    """The verdicts on an unquantized draft module of kind `draft` ("mtp" / "medusa" / "eagle3")
    with config.json `config`: quantspec loads it, the engines in `DRAFT_REFUSALS[draft]` refuse
    it (and SGLang an EAGLE-3 head it would run otherwise than trained, `eagle3_refusal`), the
    others load it."""
    return {e: draft_refusal(e, draft, config) or EngineVerdict(e, "loads") for e in ENGINES}


def draft_refusal(engine: str, draft: str | None, config: dict | None = None) -> EngineVerdict | None:
    """`engine`'s refusal of a draft module of kind `draft` with config.json `config` (None:
    not a draft, or loaded)."""
    why = None if draft is None else DRAFT_REFUSALS[draft].get(engine)
    if why is not None:
        return EngineVerdict(engine, "refused", (why,), ("serve it with quantspec",))
    why = eagle3_refusal(engine, config) if draft == "eagle3" and config is not None else None
    return None if why is None else EngineVerdict(engine, "refused", (why,), ("serve it with vLLM or quantspec",))


def eagle3_refusal(engine: str, config: dict) -> str | None:
    """Why `engine` cannot run the EAGLE-3 head of config.json `config` as it was trained (None:
    it can). Only SGLang has such limits (module docstring)."""
    from quantspec.model_zoo.eagle3 import Eagle3Args
    from quantspec.model_zoo.speculators import is_speculators_config

    if engine != "sglang":
        return None
    sglang = f"SGLang {ENGINE_VERSIONS['sglang']}"
    if is_speculators_config(config):
        return f"{sglang} reads no speculators-format config (no 'speculators' model type or converter)"
    args = Eagle3Args.from_config(config)
    if args.layer.qk_norm:
        return (f"{sglang} has no EAGLE-3 class for a Qwen3 decoder layer (no Eagle3Qwen3ForCausalLM; its "
                "LlamaForCausalLMEagle3 has no q_norm / k_norm and its load_weights skips them)")
    if args.norm_before_residual:
        return (f"{sglang}'s LlamaForCausalLMEagle3 adds the attention to the raw hidden state (its decoder "
                "layer reads no norm_before_residual), not to hidden_norm(hidden) as the head was trained")
    return None


def eagle3_layers(engine: str, config: QuantConfig, targets: Mapping[str, QuantScheme],
                  linears: Mapping[str, int | None], capability: int, base_layers: int | None = None
                  ) -> dict[str, LayerVerdict]:
    """vLLM's or SGLang's verdict per engine layer of an EAGLE-3 head quantized with `config`
    (`linears`: quantized Linear → K; `base_layers`: the target's layer count, vLLM's index of the
    head's layer — name targets that pin it are read at this index, 1 when unknown). Layers both
    the checkpoint and the engine leave float are left out."""
    out: dict[str, LayerVerdict] = {}
    for name, why in _FLOAT_ONLY.get(engine, {}).items():
        if config.scheme_for(name) is not None:
            out[name] = LayerVerdict(None, problem=why)
    for layer, (cls, shards) in EAGLE3_LAYERS[engine].items():
        layer = layer.format(L=base_layers or 1)
        intended = [config.scheme_for(s) for s in shards]
        v = engine_layer(engine, layer, shards, intended, targets, linears.get(shards[0]), capability,
                         cls=cls, shard_names=False, ignore=config.ignore,
                         unseen=_EAGLE3_UNSEEN.format(engine=engine_name(engine), layer=layer))
        if v is not None:
            out[layer] = v
    return out


def eagle3_targets(names: Iterable[str]) -> tuple[str, ...]:
    """Config targets for some of an EAGLE-3 head's Linears that reach them under every name they
    go by: the checkpoint's (quantspec, compressed-tensors) and vLLM's and SGLang's
    (`EAGLE3_LAYERS`). A whole engine layer becomes one regex, e.g. o_proj →
    `re:^(midlayer\\.self_attn\\.o_proj|model\\.layers\\.\\d+\\.self_attn\\.o_proj|model\\.self_attn\\.o_proj)$`;
    a part of a fused layer (q_proj alone) stays its exact name (no engine can tell it apart)."""
    names = set(names)
    out, taken = [], set()
    for layer, (_, shards) in EAGLE3_LAYERS["vllm"].items():
        if not set(shards) <= names:
            continue
        alts = [re.escape(s) for s in shards] + [re.escape(layer).replace(re.escape("{L}"), r"\d+")]
        alts += [re.escape(n) for n, (_, s) in EAGLE3_LAYERS["sglang"].items() if s == shards and n != layer]
        out.append(f"re:^({'|'.join(alts)})$")
        taken.update(shards)
    return tuple(out) + tuple(sorted(names - taken))


def eagle3_ignore(target: str) -> tuple[str, ...]:
    """What an EAGLE-3 head quantized for `--target target` leaves float besides lm_head: `fc`
    for the targets that include SGLang (`SGLANG_EAGLE3_FC`), named as vLLM names it too."""
    return eagle3_targets(("fc",)) if target in ("portable", "sglang") else ()
