"""Build an engine's EAGLE-3 draft model from a quantspec head's config.json with the engine's own
code, lifted from its wheel, and load the head's tensors through the engine's own `load_weights`.

Run as a program in a fresh interpreter (one per engine, as `lift.py`):

    python lift_eagle3.py ENGINE SOURCE_DIR HEAD_DIR TARGET_LAYERS TARGET_VOCAB  →  JSON on stdout

The engine's code that runs unchanged: vLLM's `models/llama_eagle3.py` (`Eagle3LlamaForCausalLM`
and its `LlamaModel` / `LlamaDecoderLayer`: which config keys size `fc`, the 2·hidden q/k/v input,
`hidden_norm`, the draft-vocabulary `lm_head`, `draft_id_to_target_id`; `load_weights` with its
name mapping, d2t / t2d handling and skipped names) and `models/utils.py` (`AutoWeightsLoader`,
`WeightsMapper`: the stacking of q/k/v and gate/up); SGLang's `models/llama_eagle3.py`
(`LlamaForCausalLMEagle3`, its `LlamaModel` and decoder layer, `load_weights`). The functions
that pick the base's aux layers run alone, compiled from the wheels' files: vLLM's
`_get_eagle3_aux_layers_from_config` and `get_eagle3_default_aux_hidden_state_layers`, SGLang's
`set_eagle3_layers_to_capture`.

What is not the engines' code, and so stated here: the target Llama's layer pieces the EAGLE-3
files build on (the base decoder layer, attention and MLP of `models/llama.py`, and the
parallel linear / norm / embedding classes) are `Recorded*` stand-ins below: modules whose
parameters have the engine's shapes and a `weight_loader(param, tensor, shard_id)` that checks
the shard's shape, copies it into its rows and records it; `default_weight_loader` is a
recording copy; a head with a `kv_cache_scheme` gets the layer's attention as the engines' KV-cache
quant method leaves it: `self_attn.attn.k_scale` / `v_scale` (`_kv_scale`); configs the constructors read (vLLM's `VllmConfig`, SGLang's server-args
accessors) are plain objects with the target's layer count and vocabulary, and the draft's
quantization config they resolve is a marker (`DRAFT_QC`) whose checkpoint-name mappers are vLLM's
own. The result lists every parameter,
which shards of it were loaded from which checkpoint tensor, the engine's draft-to-target map,
and every layer the engine's EAGLE-3 code builds from a stand-in: the prefix (its name in the
engine) and whether it was given the draft's quantization config; `fc_class` is the class the
engine builds `fc` from; `variant`, how the engine's model read the head's layer variants
(vLLM's residual-norm method, the norms before `fc`, `norm_output`, the number of aux features).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import traceback
from types import SimpleNamespace

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import lift  # noqa: E402 — the stub machinery of the compressed-tensors lift

import torch  # noqa: E402
from torch import nn  # noqa: E402

LOADS: list[dict] = []  # (param, shard, checkpoint tensor's shape) per weight_loader call
BUILT: list[dict] = []  # (stand-in, the prefix and whether the draft's quant config) per layer the engine builds


class _DraftQuantConfig:
    """The marker the engines' draft quantization config resolves to here; what vLLM's
    `AutoWeightsLoader` asks of a quantization config it answers as vLLM's compressed-tensors
    config does, with the engine's own code: the KV-cache scale names and checkpoint renames of
    `QuantizationConfig` (base_config.py, which `CompressedTensorsConfig` does not override), no
    extra suffixes."""

    _ignore_unexpected_suffixes: list[str] = []

    @staticmethod
    def get_cache_scale_mapper():
        from vllm.model_executor.layers.quantization.base_config import QuantizationConfig

        return QuantizationConfig.get_cache_scale_mapper()

    @staticmethod
    def get_checkpoint_weight_mapper():
        from vllm.model_executor.layers.quantization.base_config import QuantizationConfig

        return QuantizationConfig.get_checkpoint_weight_mapper()


DRAFT_QC = _DraftQuantConfig()  # what the engine's draft quantization config resolves to


def _built(role: str, k: dict, quant_config=None) -> None:
    qc = k.get("quant_config", quant_config)
    BUILT.append({"role": role, "prefix": k.get("prefix"), "draft_quant_config": qc is DRAFT_QC,
                  "quant_config": None if qc is None or qc is DRAFT_QC else repr(qc)})
MODEL_MODULE = {"vllm": "vllm.model_executor.models.llama_eagle3", "sglang": "sglang.srt.models.llama_eagle3"}
REAL = {"vllm": [MODEL_MODULE["vllm"], "vllm.model_executor.models.utils",
                 "vllm.model_executor.layers.quantization.base_config"], "sglang": [MODEL_MODULE["sglang"]]}


def _param(shape, shards: dict | None = None) -> nn.Parameter:
    """A parameter of `shape` whose loader copies a shard (rows `shards[id]`) or the whole."""
    p = nn.Parameter(torch.full(shape, float("nan")), requires_grad=False)

    def weight_loader(param, w, shard_id=None):
        shard_id = getattr(w, "shard_id", None) if shard_id is None else shard_id
        rows = slice(None) if shard_id is None else slice(*shards[shard_id])
        dst = param.data[rows]
        if tuple(dst.shape) != tuple(w.shape):
            raise ValueError(f"shard {shard_id!r}: checkpoint shape {tuple(w.shape)} != {tuple(dst.shape)}")
        dst.copy_(w)
        LOADS.append({"param": id(param), "shard": shard_id, "shape": list(w.shape)})

    p.weight_loader = weight_loader
    return p


def _kv_scale() -> nn.Parameter:
    """A KV-cache scale of the engine's attention (vLLM's `Attention`, SGLang's `RadixAttention`,
    given one by their KV-cache quant method): its loader takes the checkpoint's scale whatever
    its shape and records it."""
    p = nn.Parameter(torch.tensor(float("nan")), requires_grad=False)

    def weight_loader(param, w, *a):
        param.data = w.detach().float().reshape(-1).amax().reshape(())
        LOADS.append({"param": id(param), "shard": None, "shape": list(w.shape)})

    p.weight_loader = weight_loader
    return p


def default_weight_loader(param, w):
    if tuple(param.shape) != tuple(w.shape):
        raise ValueError(f"checkpoint shape {tuple(w.shape)} != parameter {tuple(param.shape)}")
    param.data.copy_(w)
    LOADS.append({"param": id(param), "shard": None, "shape": list(w.shape)})


class RecordedLinear(nn.Module):
    def __init__(self, input_size, output_size, *a, bias=False, record=True, **k):
        super().__init__()
        if record:
            _built("ReplicatedLinear", k)
        self.weight = _param((output_size, input_size))


class RecordedQKV(nn.Module):
    def __init__(self, hidden_size, head_size, total_num_heads, total_num_kv_heads=None, bias=False, *a,
                 record=True, **k):
        super().__init__()
        if record:
            _built("QKVParallelLinear", k)
        kv = total_num_kv_heads or total_num_heads
        q, k_ = total_num_heads * head_size, kv * head_size
        self.weight = _param((q + 2 * k_, hidden_size), {"q": (0, q), "k": (q, q + k_), "v": (q + k_, q + 2 * k_)})


class RecordedNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6, *a, **k):
        super().__init__()
        self.weight = _param((hidden_size,))


class RecordedEmbedding(nn.Module):
    def __init__(self, num_embeddings, embedding_dim, *a, **k):
        super().__init__()
        _built("VocabParallelEmbedding", k)
        self.weight = _param((num_embeddings, embedding_dim))


class RecordedLMHead(RecordedEmbedding):
    def __init__(self, num_embeddings, embedding_dim, *a, **k):
        nn.Module.__init__(self)
        _built("ParallelLMHead", k)
        self.weight = _param((num_embeddings, embedding_dim))


class RecordedMLP(nn.Module):
    """The target's MLP (SGLang's EAGLE-3 layer builds it as `LlamaMLP(hidden, intermediate, act,
    quant_config, prefix)`)."""

    def __init__(self, hidden_size, intermediate_size, hidden_act=None, quant_config=None, prefix="", *a,
                 record=True, **k):
        super().__init__()
        if record:
            _built("LlamaMLP", {"prefix": prefix, "quant_config": quant_config})
        self.gate_up_proj = nn.Module()
        self.gate_up_proj.weight = _param((2 * intermediate_size, hidden_size),
                                          {0: (0, intermediate_size), 1: (intermediate_size, 2 * intermediate_size)})
        self.down_proj = RecordedLinear(intermediate_size, hidden_size, record=False)


class RecordedBaseLayer(nn.Module):
    """The target Llama's decoder layer as the EAGLE-3 layers subclass it (`config` keyword or
    first positional argument, as each engine passes it). Recorded: the prefix it is built with
    and the quant config its attention and MLP get — vLLM's takes `self.get_quant_config(vllm_config)`
    (models/llama.py `LlamaDecoderLayer.__init__`), SGLang's the `quant_config` argument."""

    def __init__(self, *args, config=None, **kwargs):
        super().__init__()
        vllm_config = args[0] if args and hasattr(args[0], "speculative_config") else None
        qc = self.get_quant_config(vllm_config) if vllm_config is not None else kwargs.get("quant_config")
        _built("LlamaDecoderLayer", {"prefix": kwargs.get("prefix"), "quant_config": qc})
        config = config or next((a for a in args if hasattr(a, "hidden_size")), None) or CONFIG
        D, H = config.hidden_size, config.num_attention_heads
        hd = getattr(config, "head_dim", None) or D // H
        self.hidden_size = D
        self.self_attn = nn.Module()
        self.self_attn.head_dim, self.self_attn.total_num_heads = hd, H
        self.self_attn.total_num_kv_heads = config.num_key_value_heads
        self.self_attn.qkv_proj = RecordedQKV(D, hd, H, config.num_key_value_heads, record=False)
        self.self_attn.o_proj = RecordedLinear(H * hd, D, record=False)
        if KV_SCHEME:  # the attention the engines build for the layer holds the KV-cache scales
            self.self_attn.attn = nn.Module()
            self.self_attn.attn.k_scale, self.self_attn.attn.v_scale = _kv_scale(), _kv_scale()
        self.mlp = RecordedMLP(D, config.intermediate_size, record=False)
        self.input_layernorm = RecordedNorm(D)
        self.post_attention_layernorm = RecordedNorm(D)


CONFIG = None  # the head's transformers config, set in main()
KV_SCHEME = False  # whether its quantization_config has a kv_cache_scheme, set in main()
QUANT_SUFFIXES = tuple(f".{s}" for s in ("weight_scale", "weight_zero_point", "weight_packed", "weight_shape",
                                         "weight_global_scale", "input_scale", "input_global_scale",
                                         "input_zero_point", "weight_g_idx"))


def _overrides(engine: str, target_layers: int, target_vocab: int) -> dict:
    if engine == "vllm":
        model_config = SimpleNamespace(get_total_num_hidden_layers=lambda: target_layers,
                                       get_vocab_size=lambda: target_vocab, dtype=torch.float32)
        spec = SimpleNamespace(draft_model_config=SimpleNamespace(hf_config=CONFIG), parallel_drafting=False)
        vllm_config = SimpleNamespace(speculative_config=spec, model_config=model_config, load_config=None)
        linear = {"QKVParallelLinear": RecordedQKV, "ReplicatedLinear": RecordedLinear}
        return {
            "vllm.config": {"VllmConfig": SimpleNamespace(get_quantization_config=lambda *a: DRAFT_QC),
                            "get_current_vllm_config": lambda: vllm_config},
            "vllm.compilation.decorators": {"support_torch_compile": lambda *a, **k: (lambda cls: cls)},
            "vllm.model_executor.model_loader.reload": {"support_quantized_model_reload_from_hp_weights": lambda f: f},
            "vllm.model_executor.model_loader.weight_utils": {"default_weight_loader": default_weight_loader},
            "vllm.model_executor.layers.linear": linear,
            "vllm.model_executor.layers.layernorm": {"RMSNorm": RecordedNorm},
            "vllm.model_executor.layers.vocab_parallel_embedding": {"VocabParallelEmbedding": RecordedEmbedding,
                                                                    "ParallelLMHead": RecordedLMHead},
            "vllm.model_executor.layers.logits_processor": {"LogitsProcessor": lambda *a, **k: nn.Identity()},
            "vllm.model_executor.models.llama": {"LlamaDecoderLayer": RecordedBaseLayer,
                                                 "LlamaForCausalLM": nn.Module},
            "__config__": vllm_config,
        }
    return {
        "sglang.srt.runtime_context": {"get_spec": lambda: SimpleNamespace(speculative_draft_window_size=None),
                                       "get_parallel": lambda: SimpleNamespace(pp_group=None)},
        "sglang.srt.layers.layer_boundary": {"layer_stack": contextlib.nullcontext},
        "sglang.srt.model_loader.weight_utils": {"default_weight_loader": default_weight_loader},
        "sglang.srt.layers.linear": {"QKVParallelLinear": RecordedQKV},
        "sglang.srt.layers.layernorm": {"RMSNorm": RecordedNorm},
        "sglang.srt.layers.vocab_parallel_embedding": {"VocabParallelEmbedding": RecordedEmbedding,
                                                       "ParallelLMHead": RecordedLMHead},
        "sglang.srt.layers.logits_processor": {"LogitsProcessor": lambda *a, **k: nn.Identity()},
        "sglang.srt.models.llama": {"LlamaDecoderLayer": RecordedBaseLayer, "LlamaForCausalLM": nn.Module,
                                    "LlamaMLP": RecordedMLP},
        "sglang.srt.utils": {"add_prefix": lambda name, prefix: f"{prefix}.{name}" if prefix else name},
    }


def build_and_load(engine: str, head_dir: str, target_layers: int, target_vocab: int) -> dict:
    import importlib

    from safetensors.torch import load_file

    overrides = _overrides(engine, target_layers, target_vocab)
    vllm_config = overrides.pop("__config__", None)
    sys.meta_path.insert(0, lift.EngineFinder(SOURCE, engine, REAL[engine], overrides))
    sys.meta_path.append(lift.MissingFinder(SOURCE))
    mod = importlib.import_module(MODEL_MODULE[engine])
    if engine == "vllm":
        model = mod.Eagle3LlamaForCausalLM(vllm_config=vllm_config)
    else:
        model = mod.LlamaForCausalLMEagle3(CONFIG, quant_config=DRAFT_QC)
    names = {id(p): n for n, p in model.named_parameters()}
    shapes = {n: list(p.shape) for n, p in model.named_parameters()}
    # a quantized head's scales and packed codes are `lift.py`'s to judge (the decision code): the
    # stand-ins hold a float weight per Linear, and the KV-cache scales where the head has them
    tensors = {n: t for n, t in load_file(os.path.join(head_dir, "model.safetensors")).items()
               if not n.endswith(QUANT_SUFFIXES)}
    model.load_weights(iter(tensors.items()))
    loads = {}
    for rec in LOADS:
        loads.setdefault(names[rec["param"]], []).append([rec["shard"], rec["shape"]])
    values = {n: p.detach().tolist() for n, p in model.named_parameters()
              if n in ("model.fc.weight",) or "draft_id_to_target_id" in n}
    out = {"params": shapes, "loads": loads, "nan_left": sorted(n for n, p in model.named_parameters()
                                                                 if bool(p.isnan().any())),
           "built": BUILT, "fc_class": f"{type(model.model.fc).__module__}.{type(model.model.fc).__name__}"}
    d2t = getattr(model, "draft_id_to_target_id", None)
    out["draft_id_to_target_id"] = None if d2t is None else d2t.tolist()
    hot = getattr(model, "hot_token_id", None)
    out["hot_token_id"] = None if hot is None else hot.tolist()
    out["fc_input_size"] = shapes.get("model.fc.weight", [None, None])[1]
    inner = model.model
    residual = getattr(inner.layers[0], "_residual_norm", None)  # vLLM's choice; SGLang has none
    out["variant"] = {"residual_norm": None if residual is None else residual.__name__,
                      "norm_before_fc": getattr(inner, "input_norm", None) is not None,
                      "fc_norm": getattr(inner, "fc_norm", None) is not None,
                      "norm_output": bool(getattr(inner, "norm_output", False)),
                      "num_aux": getattr(inner, "num_aux_hidden_states", None)}
    out["sample"] = {n: float(torch.tensor(v).float().sum()) for n, v in values.items()}
    return out


def _function(path: str, name: str):
    """The function `name` defined anywhere in the engine's file `path` (a method: unbound),
    compiled alone from the wheel's source."""
    import __future__
    import ast
    from typing import List, Optional

    tree = ast.parse(open(os.path.join(SOURCE, path)).read())
    node = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == name)
    ns = {"Optional": Optional, "List": List, "torch": torch}
    exec(compile(ast.Module([node], []), path, "exec", flags=__future__.annotations.compiler_flag), ns)
    return ns[name]


def aux_layers(engine: str, num_layers: int) -> dict:
    """Which aux layers the engine takes: from the head's config, and by default on a base of
    `num_layers` layers (vLLM: the layer ids whose input it captures; SGLang: `layers_to_capture`,
    the layers at whose input it captures)."""
    ns = SimpleNamespace
    if engine == "vllm":
        from_config = _function("vllm/v1/worker/gpu_model_runner.py", "_get_eagle3_aux_layers_from_config")
        default = _function("vllm/model_executor/models/interfaces.py", "get_eagle3_default_aux_hidden_state_layers")
        ids = from_config(ns(speculative_config=ns(draft_model_config=ns(hf_config=CONFIG))))
        return {"from_config": None if ids is None else list(ids),
                "default": list(default(ns(model=ns(layers=[None] * num_layers))))}
    capture = _function("sglang/srt/models/llama.py", "set_eagle3_layers_to_capture")
    eagle = getattr(CONFIG, "eagle_config", None) or {}
    out = {}
    for key, ids in (("from_config", eagle.get("eagle_aux_hidden_state_layer_ids")), ("default", None)):
        target = ns(pp_group=ns(is_last_rank=True), config=ns(num_hidden_layers=num_layers), model=ns())
        capture(target, ids)
        out[key] = target.model.layers_to_capture if key == "default" or ids is not None else None
    return out


def main() -> None:
    global CONFIG, KV_SCHEME, SOURCE
    engine, SOURCE, head_dir, target_layers, target_vocab = sys.argv[1:6]
    from transformers import LlamaConfig

    cfg = json.load(open(os.path.join(head_dir, "config.json")))
    KV_SCHEME = bool((cfg.get("quantization_config") or {}).get("kv_cache_scheme"))
    CONFIG = LlamaConfig(**{k: v for k, v in cfg.items() if k not in ("architectures", "model_type")})
    CONFIG.architectures = cfg["architectures"]
    try:
        out = {"result": build_and_load(engine, head_dir, int(target_layers), int(target_vocab)),
               "aux": aux_layers(engine, 30),
               "stubbed": sorted(set(lift.STUBBED))}
    except Exception:  # noqa: BLE001
        out = {"fatal": traceback.format_exc()}
    json.dump(out, sys.stdout, default=repr)


SOURCE = ""

if __name__ == "__main__":
    main()
