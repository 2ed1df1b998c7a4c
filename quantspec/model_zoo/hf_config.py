"""`ModelArgs`' fields from a HF `config.json` (`args_fields`), with those it spells in more than
one way or that only some architectures have: the rotary embedding's (`rope_fields`) and the
per-layer layout's (`layer_fields`: sliding windows, NoPE layers, Granite's multipliers); and
the quantization config an older ModelOpt export keeps beside config.json (`modelopt_sidecar`)."""

from __future__ import annotations

import json
from pathlib import Path

from quantspec.errors import QuantSpecError

__all__ = ["ROTATION_KEY", "RUN_TIME_LOCATIONS", "TRANSFORM_TYPE", "args_fields", "layer_fields", "rope_fields",
           "modelopt_sidecar", "rotation_tag", "runs_at_run_time"]

ROTATION_KEY = "quantspec_rotation"  # config.json: the rotations fused into the weights and their seed (`calib.rotate`)
TRANSFORM_TYPE = "random-hadamard"  # the matrices quantspec's rotations are
RUN_TIME_LOCATIONS = ("input", "output")  # a `transform_config`'s places applied at run time, not fused


def args_fields(cfg: dict, architectures: dict[str, str]) -> dict:
    """`ModelArgs`' keyword arguments for a config.json; `architectures`: HF class → family tag.
    `architectures` names the class that wrote the weights; model_type is only a fallback for
    configs that omit it."""
    from quantspec.model_zoo.moe import moe_fields  # moe builds on the model's modules

    listed = cfg.get("architectures") or []
    arch = next((architectures[n] for n in listed if n in architectures), None)
    if arch is None and not listed:
        arch = {v: v for v in architectures.values()}.get(cfg.get("model_type", ""))
    if arch is None:
        found = (cfg.get("architectures") or [cfg.get("model_type", "?")])[0]
        raise QuantSpecError(f"unsupported architecture {found!r}; supported: {', '.join(sorted(architectures))}")
    eos = cfg.get("eos_token_id")
    eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
    attention_bias = bool(cfg.get("attention_bias", False))
    out = dict(
        arch=arch,
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=cfg["num_attention_heads"],
        num_kv_heads=cfg.get("num_key_value_heads") or cfg["num_attention_heads"],
        head_dim=cfg.get("head_dim") or 0,
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        **rope_fields(cfg),
        max_position_embeddings=cfg.get("max_position_embeddings", 4096),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        rotation=rotation_tag(cfg),
        qkv_bias={"qwen2": True, "qwen2_moe": bool(cfg.get("qkv_bias", True))}.get(arch, attention_bias),
        o_bias=False if arch in ("qwen2", "qwen2_moe") else attention_bias,
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        qk_norm=arch.startswith("qwen3") or arch in ("olmo2", "gemma3"),
        qk_norm_per_head=arch != "olmo2", post_norms=arch in ("olmo2", "gemma2", "gemma3"), pre_norms=arch != "olmo2",
        **layer_fields(cfg, arch),
        **moe_fields(cfg, arch),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=eos_ids,
    )
    return {**out, **gemma_fields(cfg, arch)} if arch.startswith("gemma") else out


def rotation_tag(cfg: dict) -> str:
    """What a config.json says is fused into its weights (`calib.rotate`): "" for nothing, else the
    rotations and their seed ("R1,R2 random-hadamard seed 0"), or the schemes of a
    `transform_config` another tool wrote ("R1:hadamard R2:hadamard"). A scheme that runs at run
    time (QuIP's, `quant.transforms.is_online_group`) undoes itself on each Linear and changes no
    hidden state: it is not counted."""
    mine = cfg.get(ROTATION_KEY)
    if isinstance(mine, dict) and mine.get("rotations"):
        return f"{','.join(mine['rotations'])} {mine.get('type', TRANSFORM_TYPE)} seed {int(mine.get('seed', 0))}"
    tc = (cfg.get("quantization_config") or {}).get("transform_config")
    groups = (tc.get("config_groups") or {}) if isinstance(tc, dict) else {}
    return " ".join(f"{k}:{v.get('type')}" for k, v in sorted(groups.items())
                    if isinstance(v, dict) and not runs_at_run_time(v))


def runs_at_run_time(group: dict) -> bool:
    """Whether a dumped `transform_config` group applies a transform at run time (QuIP's): it
    turns and unturns each Linear it targets, so the model's hidden states are its own."""
    return any(isinstance(a, dict) and str(a.get("location")) in RUN_TIME_LOCATIONS for a in group.get("apply") or ())


def rope_fields(cfg: dict) -> dict:
    """rope_theta, rope_scaling (None for the default rotary embedding) and rotary_dim."""
    # transformers 5 writes `rope_parameters` (per layer type for Gemma 3: the full layers' here);
    # older configs `rope_theta` + `rope_scaling`.
    rope = dict(cfg.get("rope_parameters") or {})
    if "full_attention" in rope:
        rope = dict(rope["full_attention"] or {})
    theta = rope.pop("rope_theta", cfg.get("rope_theta", 10000.0))
    scaling = cfg.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
    partial = float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor")) or 1.0)
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    longrope = bool(scaling) and scaling.get("rope_type", scaling.get("type")) in ("longrope", "su")
    if longrope and "original_max_position_embeddings" not in scaling:  # Phi-3 keeps it beside the dict
        scaling = {**scaling, "original_max_position_embeddings": cfg.get("original_max_position_embeddings")
                   or cfg.get("max_position_embeddings", 4096)}
    return {"rope_theta": float(theta), "rope_scaling": scaling, "rotary_dim": int(head_dim * partial)}


def gemma_fields(cfg: dict, arch: str) -> dict:
    """Gemma 2's and 3's: four norms a layer, each scaling by 1 + weight; gelu-tanh MLPs;
    embeddings × √hidden_size; scores × query_pre_attn_scalar ** -0.5; scores and logits
    soft-capped (Gemma 2); Gemma 3's window layers' own rotary base (`rope_local_base_freq`, or
    transformers 5's `rope_parameters.sliding_attention`). Keys a config leaves out take
    transformers' defaults (query_pre_attn_scalar 256, 4 KV heads, the context; Gemma 2's caps)."""
    if cfg.get("use_bidirectional_attention"):
        raise QuantSpecError("config.json use_bidirectional_attention=true: an embedding model (EmbeddingGemma); "
                             "quantspec runs causal decoders: use a Gemma causal LM")
    local = (cfg.get("rope_parameters") or {}).get("sliding_attention") or {} if arch == "gemma3" else {}
    if local.get("rope_type", "default") != "default":
        raise QuantSpecError(f"rope_parameters.sliding_attention rope_type {local['rope_type']!r} is not supported "
                             "(Gemma 3's local layers turn by the default rotary embedding); fix config.json")
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    scalar = float(cfg.get("query_pre_attn_scalar") or 256)
    caps = {"attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0} if arch == "gemma2" else {}
    return dict(pre_norms=True, norm_unit_offset=True, hidden_act=cfg.get("hidden_activation") or "gelu_pytorch_tanh",
                embedding_multiplier=float(cfg["hidden_size"]) ** 0.5,
                attention_multiplier=0.0 if scalar == head_dim else scalar ** -0.5,
                local_rope_theta=float(local.get("rope_theta", cfg.get("rope_local_base_freq", 10000.0)))
                if arch == "gemma3" else 0.0,
                attn_softcap=float(cfg.get("attn_logit_softcapping", caps.get("attn_logit_softcapping")) or 0.0),
                logit_softcap=float(cfg.get("final_logit_softcapping", caps.get("final_logit_softcapping")) or 0.0),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
                **({} if "rope_theta" in cfg or "rope_parameters" in cfg or arch != "gemma3" else {"rope_theta": 1e6}),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)), num_kv_heads=cfg.get("num_key_value_heads") or 4,
                max_position_embeddings=cfg.get("max_position_embeddings", 8192 if arch == "gemma2" else 131072))


def layer_fields(cfg: dict, arch: str) -> dict:
    """sliding_window and the layers that slide it (`window_layers`), nope_layers and (Granite) the
    embedding, residual, attention and logits multipliers."""
    window = _sliding_window(cfg, arch)
    out = {"sliding_window": window, "nope_layers": _nope_layers(cfg, arch),
           "window_layers": () if window is None else _window_layers(cfg, arch)}
    if arch == "granite":
        out.update(embedding_multiplier=float(cfg.get("embedding_multiplier", 1.0)),
                   residual_multiplier=float(cfg.get("residual_multiplier", 1.0)),
                   attention_multiplier=float(cfg.get("attention_multiplier", 1.0)),
                   logits_scaling=float(cfg.get("logits_scaling", 1.0)))
    return out


# the families whose every layer attends within `sliding_window` (transformers' Mistral, Mixtral and
# Phi-3 pass it to each layer); Gemma's `layer_types` name its sliding layers; Qwen's and SmolLM3's
# pick theirs family by family, which quantspec does not follow (it attends to the whole context)
WINDOW_EVERY_LAYER = ("mistral", "mixtral", "phi3")


def _window_layers(cfg: dict, arch: str) -> tuple[int, ...]:
    n = cfg["num_hidden_layers"]
    if arch in WINDOW_EVERY_LAYER:
        return tuple(range(n))
    if not arch.startswith("gemma"):
        return ()
    # configs before transformers 5: every `sliding_window_pattern`-th layer is full (Gemma 2: every other)
    every = int(cfg.get("sliding_window_pattern", 6)) if arch == "gemma3" else 2
    types = cfg.get("layer_types") or ["full_attention" if (i + 1) % every == 0 else "sliding_attention"
                                       for i in range(n)]
    if len(types) != n or set(types) - {"sliding_attention", "full_attention"}:
        raise QuantSpecError(f"layer_types {types!r} must name sliding_attention or full_attention for each of the "
                             f"{n} layers; fix config.json")
    return tuple(i for i, t in enumerate(types) if t == "sliding_attention")


def _sliding_window(cfg: dict, arch: str) -> int | None:
    """The attention window of a config's layers where any has one: Mistral's and Phi-3's `sliding_window`;
    Qwen's where `use_sliding_window` (and a layer type) says its layers use it."""
    window = cfg.get("sliding_window", 4096 if arch.startswith("gemma") else None)  # (transformers' Gemma default)
    if not isinstance(window, int) or isinstance(window, bool) or window <= 0:
        return None
    if arch in WINDOW_EVERY_LAYER or arch.startswith("gemma"):
        return window
    layer_types = cfg.get("layer_types") or ()
    if arch.startswith(("qwen", "smollm3")) and cfg.get("use_sliding_window") and (
            not layer_types or "sliding_attention" in layer_types):
        return window
    return None


def _nope_layers(cfg: dict, arch: str) -> tuple[int, ...]:
    """SmolLM3's layers without a rotary embedding: `no_rope_layers` holds 1 where a layer takes
    one (default: all but every `no_rope_layer_interval`-th)."""
    if arch != "smollm3":
        return ()
    n = cfg["num_hidden_layers"]
    uses = cfg.get("no_rope_layers") or [int((i + 1) % int(cfg.get("no_rope_layer_interval", 4)) != 0)
                                         for i in range(n)]
    if len(uses) != n:
        raise QuantSpecError(f"no_rope_layers has {len(uses)} entries for {n} layers; fix config.json")
    return tuple(i for i, use in enumerate(uses) if not use)


MODELOPT_SIDECAR = "hf_quant_config.json"


def modelopt_sidecar(model_dir, cfg: dict) -> dict:
    """`cfg` with an older ModelOpt export's quantization config — its `hf_quant_config.json`
    (`{"producer": ..., "quantization": {"quant_algo": ...}}`), where config.json holds none — as
    `quantization_config` (`quant_method: "modelopt"`, `quant.modelopt`); else `cfg` itself."""
    side = Path(model_dir) / MODELOPT_SIDECAR
    if cfg.get("quantization_config") or not side.is_file():
        return cfg
    try:
        d = json.loads(side.read_text())
    except (OSError, ValueError) as e:
        raise QuantSpecError(f"{side} is not readable JSON ({e}); re-download it") from None
    if not isinstance(d, dict) or not isinstance(d.get("quantization"), dict):
        raise QuantSpecError(f"{side} has no 'quantization' object; re-download it")
    return {**cfg, "quantization_config": {"quant_method": "modelopt", "quantization": d["quantization"]}}
