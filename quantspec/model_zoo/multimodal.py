"""Multimodal checkpoints whose text decoder quantspec runs: Gemma 3's
`Gemma3ForConditionalGeneration` (4B, 12B, 27B) holds a `Gemma3ForCausalLM` under
`language_model.` beside its vision tower and projector. quantspec reads such a checkpoint as the
text-only model it holds: the config of its `text_config` (transformers' defaults filled in, as
transformers reads it, with the checkpoint's token ids and dtype), the decoder's tensors under a
text model's names; its artifacts are that text-only `Gemma3ForCausalLM`, which transformers, vLLM
and SGLang load as they load Gemma 3 1B. The vision tower and projector are left out."""

from __future__ import annotations

from typing import Iterable

__all__ = ["TEXT_DECODERS", "stored_names", "text_decoder_config"]

# multimodal class → (the text-only class of its decoder, transformers' config class of that decoder)
TEXT_DECODERS = {"Gemma3ForConditionalGeneration": ("Gemma3ForCausalLM", "Gemma3TextConfig")}
# carried from the multimodal config into the text one
_TOP_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id", "tie_word_embeddings", "torch_dtype", "dtype")


def _decoder(cfg: dict) -> str | None:
    return next((a for a in cfg.get("architectures") or () if a in TEXT_DECODERS), None)


def text_decoder_config(cfg: dict) -> dict | None:
    """The text-only config of a multimodal checkpoint's config.json; None for any other config."""
    arch = _decoder(cfg)
    if arch is None or not isinstance(cfg.get("text_config"), dict):
        return None
    import transformers

    causal, config_class = TEXT_DECODERS[arch]
    text = getattr(transformers, config_class)(**cfg["text_config"]).to_dict()
    for key in ("architectures", "id2label", "label2id", "_name_or_path", "transformers_version"):
        text.pop(key, None)
    return {**text, **{k: cfg[k] for k in _TOP_KEYS if cfg.get(k) is not None}, "architectures": [causal]}


def stored_names(cfg: dict, names: Iterable[str]) -> dict[str, str] | None:
    """{a text model's tensor name: the name the checkpoint stores it under} of the text decoder
    of a multimodal checkpoint whose config.json (as on disk) is `cfg` (`language_model.model.X` or
    `model.language_model.X` → `model.X`; `language_model.lm_head.X` → `lm_head.X`); None where
    the checkpoint is not one."""
    if _decoder(cfg) is None:
        return None
    out = {}
    for n in names:
        if n.startswith("language_model."):
            out[n[len("language_model."):]] = n
        elif n.startswith("model.language_model."):
            out["model." + n[len("model.language_model."):]] = n
        elif n.startswith("lm_head."):
            out[n] = n
    return out
