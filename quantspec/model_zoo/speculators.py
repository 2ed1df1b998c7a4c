"""EAGLE-3 heads in the speculators format (vllm-project/speculators, the format RedHatAI
publishes its heads in), read as the plain EAGLE-3 layout of `model_zoo/eagle3.py`.

A speculators config.json holds `speculators_model_type` ("eagle3"), a `speculators_config`
block (proposal methods, verifier), the decoder layer's own config as `transformer_layer_config`
(a Llama or a Qwen3 layer) and the head's fields at the top level: `draft_vocab_size`,
`target_hidden_size`, `eagle_aux_hidden_state_layer_ids` and the layer variants
`norm_before_residual`, `norm_before_fc`, `fc_norm`, `norm_output`. `eagle3_config` flattens it as
vLLM's `SpeculatorsConfig` does (vllm/transformers_utils/configs/speculators/algos.py
`update_eagle3`): the layer config, the head's fields over it, `norm_before_residual` true where
the file leaves it out, and the architecture vLLM registers for the layer's model_type.

Its tensors name the decoder layer `layers.0.` where the plain layout says `midlayer.`
(`to_plain_names`), and may carry `embed_tokens.weight`, a copy of the verifier's embedding.

Given as the model itself (vLLM's `vllm serve SPECULATOR`), a head stands for its verifier
speculating with it (`speculation_flags`): `speculators_config.verifier.name_or_path` is the
model, the head the draft, `proposal_methods[0].speculative_tokens` the drafts per step.
"""

from __future__ import annotations

from typing import Mapping, TypeVar

from quantspec.errors import QuantSpecError

__all__ = ["LAYER_ARCHITECTURES", "eagle3_config", "is_speculators_config", "speculation_flags", "to_plain_names"]

# transformer_layer_config model_type → (vLLM's EAGLE-3 architecture, the layer's causal-LM class)
LAYER_ARCHITECTURES = {"llama": ("LlamaForCausalLMEagle3", "LlamaForCausalLM"),
                       "qwen3": ("Eagle3Qwen3ForCausalLM", "Qwen3ForCausalLM")}
_FIX = "pass an EAGLE-3 head (speculators_model_type \"eagle3\") or train one with " \
       "`quantspec zoo train-draft-head --kind eagle3`"
T = TypeVar("T")


def is_speculators_config(cfg: dict) -> bool:
    """A config.json in the speculators format (any algorithm)."""
    return "speculators_model_type" in cfg or "speculators_config" in cfg


def eagle3_config(cfg: dict, where: str = "config.json") -> dict:
    """The flat EAGLE-3 config (the plain layout's keys) of a speculators config, or one line
    naming what quantspec does not read."""
    kind = cfg.get("speculators_model_type")
    if kind != "eagle3":
        raise QuantSpecError(f"{where}: a speculators {kind!r} model; quantspec reads speculators' EAGLE-3 "
                             f"heads only; {_FIX}")
    layer = cfg.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise QuantSpecError(f"{where}: a speculators EAGLE-3 config needs a transformer_layer_config object "
                             "(the decoder layer's config); re-save the head with speculators")
    model_type = layer.get("model_type", "llama")
    if model_type not in LAYER_ARCHITECTURES:
        raise QuantSpecError(f"{where}: transformer_layer_config model_type {model_type!r}; speculators EAGLE-3 "
                             f"heads of a {' or '.join(LAYER_ARCHITECTURES)} layer run here (as in vLLM)")
    out = {**layer, "model_type": model_type, "architectures": [LAYER_ARCHITECTURES[model_type][0]],
           "draft_vocab_size": cfg.get("draft_vocab_size"),
           "norm_before_residual": cfg.get("norm_before_residual", True),
           **{k: cfg.get(k, False) for k in ("norm_before_fc", "fc_norm", "norm_output")}}
    for key in ("target_hidden_size", "eagle_aux_hidden_state_layer_ids"):
        if cfg.get(key):
            out[key] = cfg[key]
    if "quantization_config" in cfg or "quantization_config" in layer:
        raise QuantSpecError(f"{where}: a quantized speculators-format head; quantspec reads that format "
                             "unquantized: quantize the float head with `quantspec quantize --model HEAD`")
    return out


def to_plain_names(tensors: Mapping[str, T]) -> dict[str, T]:
    """A speculators head's tensors under the plain layout's names (`layers.0.` → `midlayer.`)."""
    return {("midlayer." + k[len("layers.0."):] if k.startswith("layers.0.") else k): v for k, v in tensors.items()}


def speculation_flags(cfg: dict, head_dir: str) -> dict:
    """The `infer` / `serve` keywords a speculators head given as the model stands for (module
    docstring): model (the verifier), speculate_method, draft_model and, where the config
    names it, speculate_max_draft_token_num."""
    eagle3_config(cfg, f"{head_dir}/config.json")  # an EAGLE-3 head quantspec reads, or its refusal
    spec = cfg.get("speculators_config") or {}
    verifier = (spec.get("verifier") or {}).get("name_or_path")
    if not isinstance(verifier, str) or not verifier:
        raise QuantSpecError(f"--model {head_dir} is a speculators head without speculators_config.verifier."
                             "name_or_path; pass the base as --model and the head as --draft-model")
    out = {"model": verifier, "speculate_method": "eagle", "draft_model": head_dir}
    methods = spec.get("proposal_methods") or [{}]
    tokens = methods[0].get("speculative_tokens") if isinstance(methods[0], dict) else None
    if isinstance(tokens, int) and not isinstance(tokens, bool) and tokens >= 1:
        out["speculate_max_draft_token_num"] = tokens
    return out
