"""Loading any model or artifact for inference: `load_for_inference(path) -> LoadedModel`.

This file owns the model-level half of reading an artifact (the Linear-level half is
`quant/compressed.py`, the module `infer/quant_linear.py`):
- a plain HF directory (no `quantization_config`) → `model_zoo.load_model`;
- a compressed-tensors artifact (ours, or one written by compressed-tensors / llm-compressor):
  `quantization_config` → `QuantConfig.from_dict` (an unsupported method / format is one line
  naming it and the supported ones); the model is built on `meta`, every Linear the config
  targets (`scheme_for(name)`, compressed-tensors' matching rules) is replaced by a
  `QuantLinear` built from its tensors (a quantized input embedding by a `QuantEmbedding`), the
  remaining float tensors (embeddings, norms, ignored
  Linears such as `lm_head`, biases) are loaded with `assign=True`, and the whole checkpoint is
  checked against the expected names and shapes first (`quant.artifact_plan`: missing,
  mis-shaped and unexpected tensors are one clear error each). Tied embeddings stay tied unless
  the checkpoint quantized `lm_head`.
- static KV-cache scales: `model.layers.{i}.self_attn.k_scale` / `v_scale` ([1], [], [H_kv],
  or [H_kv, 1, 1]; per-tensor ones broadcast to every KV head) → `k_scale`, `v_scale`
  [num_layers, num_kv_heads] fp32, with the cache dtype from `kv_cache_scheme` (int8 / fp8).
- end-of-sequence ids: config.json ∪ generation_config.json ∪ the tokenizer's eos.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import torch
from torch import nn

from quantspec.errors import QuantSpecError
from quantspec.infer.backend import Runtime, prepare
from quantspec.infer.dispatch import DispatchPolicy
from quantspec.infer.quant_embedding import QuantEmbedding, check_embedding_scheme
from quantspec.infer.quant_linear import QuantLinear, linear_kind
from quantspec.infer.transformed import wrap_transformed
from quantspec.model_zoo.checkpoint import (
    CheckpointReader,
    CheckpointTensors,
    checkpoint_float_dtype,
    load_model,
    read_config,
    release_free_heap,
    resolve_model_dir,
)
from quantspec.model_zoo.llama import ModelArgs, Transformer
from quantspec.quant.config import QuantConfig
from quantspec.quant.scheme import is_w4a8
from quantspec.quant.artifact import read_provenance
from quantspec.quant.artifact_plan import KV_NAMES, attn_prefix, plan_artifact

__all__ = ["LoadedModel", "auto_dtype", "load_for_inference", "quantized_model", "read_eos_token_ids"]

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


@dataclass
class LoadedModel:
    """A model ready for the engine, with what the runtime needs from its directory.

    k_scale / v_scale: [num_layers, num_kv_heads] fp32 static KV-cache scales from the artifact
    (None when it has none); kv_cache_dtype: "int8" / "fp8" from its `kv_cache_scheme`, or None.
    runtime: what the device backend prepared for the model (`infer.backend.prepare`), handed to
    the engine and the drafters.
    """

    model: Transformer
    model_dir: Path
    tokenizer: Any | None
    args: ModelArgs
    quant_config: QuantConfig | None = None
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None
    kv_cache_dtype: str | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    provenance: dict = field(default_factory=dict)
    runtime: Runtime | None = None

    @property
    def is_quantized(self) -> bool:
        return self.quant_config is not None


def _load_tokenizer(model_dir: Path):
    if not any((model_dir / f).is_file() for f in _TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(model_dir))
    except Exception as e:  # a broken tokenizer is reported, the model itself still loads
        raise QuantSpecError(f"{model_dir}: the tokenizer files cannot be loaded "
                             f"({type(e).__name__}: {str(e).splitlines()[0][:120]}); copy the "
                             "source model's tokenizer files into it") from None


def _as_ids(v) -> list[int]:
    if v is None:
        return []
    if isinstance(v, int):
        return [v]
    return [int(i) for i in v]


def read_eos_token_ids(model_dir: Path, cfg: dict, tokenizer=None) -> list[int]:
    """End-of-sequence ids: config.json, then generation_config.json, then the tokenizer's."""
    ids = _as_ids(cfg.get("eos_token_id"))
    gen = Path(model_dir) / "generation_config.json"
    if gen.is_file():
        try:
            ids += _as_ids(json.loads(gen.read_text()).get("eos_token_id"))
        except json.JSONDecodeError:
            raise QuantSpecError(f"{gen} is not valid JSON; repair or delete it") from None
    if tokenizer is not None and getattr(tokenizer, "eos_token_id", None) is not None:
        ids.append(int(tokenizer.eos_token_id))
    return list(dict.fromkeys(ids))


SAMPLING_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_new_tokens")


def read_sampling_defaults(model_dir: Path) -> dict:
    """The sampling fields a model's generation_config.json sets (those vLLM reads as request
    defaults: `SAMPLING_DEFAULT_KEYS`); {} where it has none or no such file."""
    gen = Path(model_dir) / "generation_config.json"
    if not gen.is_file():
        return {}
    try:
        cfg = json.loads(gen.read_text())
    except json.JSONDecodeError:
        raise QuantSpecError(f"{gen} is not valid JSON; repair or delete it") from None
    return {k: cfg[k] for k in SAMPLING_DEFAULT_KEYS if isinstance(cfg.get(k), (int, float))
            and not isinstance(cfg.get(k), bool)}


def _kv_scales(tensors: dict[str, torch.Tensor], args: ModelArgs, where: str
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """[L, KV] fp32 k/v scales from per-layer `self_attn.{k,v}_scale` tensors."""
    return kv_scale_rows(tensors, [attn_prefix(i) for i in range(args.num_layers)], args.num_kv_heads, where)


def kv_scale_rows(tensors: Mapping[str, torch.Tensor], attentions: list[str], num_kv_heads: int, where: str
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """[len(attentions), KV] fp32 k/v scales from each attention's `{attn}.k_scale` / `.v_scale`
    ([1], [], [KV] or [KV, 1, 1]; a per-tensor one broadcast to every KV head), checked finite
    and > 0."""
    out = []
    for kind in KV_NAMES:
        rows = []
        for attn in attentions:
            name = f"{attn}.{kind}"
            if name not in tensors:
                raise QuantSpecError(f"{where} has a kv_cache_scheme but lacks {name}; "
                                     "re-quantize with --calib (a calibration table with KV scales)")
            s = tensors[name].float().reshape(-1)
            if s.numel() == 1:
                s = s.expand(num_kv_heads)
            elif s.numel() != num_kv_heads:
                raise QuantSpecError(f"{where}: {name} has {s.numel()} values; expected 1 or "
                                     f"num_key_value_heads={num_kv_heads}")
            rows.append(s)
        t = torch.stack(rows).contiguous()  # [L, KV]
        if not bool(torch.isfinite(t).all()) or not bool((t > 0).all()):
            raise QuantSpecError(f"{where}: {kind} holds a value that is not finite and > 0; "
                                 "recalibrate the KV-cache scales")
        out.append(t)
    return out[0], out[1]


def _load_quantized(model_dir: Path, args: ModelArgs, qc: QuantConfig, *,
                    dtype: torch.dtype, device: torch.device, policy: DispatchPolicy | None
                    ) -> tuple[Transformer, torch.Tensor | None, torch.Tensor | None]:
    # tensor by tensor: what stays resident is the prepared weights, not the artifact as well
    return quantized_model(CheckpointTensors(CheckpointReader(model_dir)), args, qc, dtype=dtype,
                           device=device, policy=policy, where=str(model_dir))


def quantized_model(tensors: Mapping[str, torch.Tensor], args: ModelArgs, qc: QuantConfig, *,
                    dtype: torch.dtype, device: torch.device, policy: DispatchPolicy | None = None,
                    where: str = "the artifact") -> tuple[Transformer, torch.Tensor | None, torch.Tensor | None]:
    """An artifact's tensors (compressed-tensors names, as `quantize_model` or a checkpoint
    gives them, or a `CheckpointTensors` that reads each when looked up) → (the model with
    `QuantLinear`s on `device`, k_scale, v_scale). Every name and shape is checked against `args`
    and `qc`; `where` names the source in messages. The model is not yet prepared for its device
    (`infer.backend.prepare`)."""
    plan = plan_artifact(tensors, args, qc, where=where,
                         check_scheme=lambda s: linear_kind(s.weights, s.input_activations),
                         check_embedding=check_embedding_scheme)
    tensors, net, quantized = plan.tensors, plan.net, plan.quantized
    k_scale = v_scale = None
    if qc.kv_cache_scheme is not None:
        k_scale, v_scale = _kv_scales(tensors, args, where)
    # quantized Linears first: a missing or mis-shaped compressed tensor is named precisely
    for name, scheme in quantized.items():
        lin = net.get_submodule(name)
        if isinstance(lin, nn.Embedding):
            ql = QuantEmbedding.from_tensors(tensors, name, scheme, lin.num_embeddings, lin.embedding_dim,
                                             dtype=dtype, device=device)
        else:
            ql = QuantLinear.from_tensors(tensors, name, scheme, lin.out_features, lin.in_features,
                                          dtype=dtype, device=device, policy=policy)
            if ql.input_args is not None:
                ql.input_bound = qc.input_bound
        net.set_submodule(name, ql)
        release_free_heap()  # the codes' temporaries, freed between kept layouts: no growth per layer
    plan.refuse_unexpected(args, where)
    q_biases = {f"{name}.bias" for name in quantized}  # already inside their QuantLinear
    float_state = {k: tensors[k].to(device=device, dtype=dtype) for k in plan.float_table
                   if k not in q_biases}
    net.load_state_dict(float_state, strict=False, assign=True)
    if args.tie_word_embeddings and "lm_head" not in quantized:
        net.lm_head.weight = net.model.embed_tokens.weight
    left = [n for n, p in list(net.named_parameters()) + list(net.named_buffers())
            if p is not None and p.is_meta]
    if left:  # a bug, not bad input: every name was checked above
        raise RuntimeError(f"{where}: tensors left unloaded: {left[:3]}")
    wrap_transformed(net, plan.online, dtype=dtype, device=device)  # run-time transforms around their Linears
    net.setup_rope(args.max_position_embeddings, device)
    net.eval()
    return net, k_scale, v_scale


def auto_dtype(model: str | os.PathLike, device: torch.device | str = "cpu") -> torch.dtype:
    """The activation dtype `--dtype auto` picks: float16 on CUDA (what the Triton kernels are
    tuned for); on CPU bfloat16 for weight-only int8/int4 artifacts (torch's packed int8/int4 CPU
    kernels take bf16 activations and are ~10x slower in fp32), for int4 weights with inputs
    quantized per token (W4A8 / W4AFP8: the same int4 kernels) and for an unquantized checkpoint
    stored in bfloat16 (its weights are loaded as they are, never a float32 copy unless asked),
    float32 for everything else."""
    if torch.device(device).type == "cuda":
        return torch.float16
    model_dir = resolve_model_dir(model)
    qc = read_config(model_dir).get("quantization_config") or {}
    if not qc:
        return torch.bfloat16 if checkpoint_float_dtype(model_dir) == torch.bfloat16 else torch.float32
    schemes = QuantConfig.from_dict(qc).config_groups.values()  # any format quantspec reads, as its schemes
    int_kernels = bool(schemes) and all(  # weight-only int, or int4 codes beside inputs quantized per token
        (s.weights is None or s.weights.type == "int") and s.input_activations is None
        or is_w4a8(s.weights, s.input_activations) for s in schemes)
    return torch.bfloat16 if int_kernels else torch.float32


def load_for_inference(model: str | os.PathLike, *, dtype: torch.dtype = torch.float32,
                       device: torch.device | str = "cpu", policy: DispatchPolicy | None = None,
                       tokenizer: bool = True, fuse: bool = True) -> LoadedModel:
    """Load a zoo name, a HF directory, a hub id or a quantized artifact for inference.

    `dtype` is the activation/compute dtype (bf16 on CPU enables torch's packed int8/int4
    ops; see `infer/dispatch.py`); `policy` overrides the kernel dispatch thresholds;
    `tokenizer=False` skips loading the tokenizer; `fuse=False` keeps q/k/v and gate/up as
    separate modules (see `infer/fuse.py`). The model is prepared for `device` by its backend
    (`infer.backend.prepare`): `LoadedModel.runtime`.
    """
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise QuantSpecError(f"dtype {dtype} unsupported; use float32, bfloat16 or float16")
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise QuantSpecError("device 'cuda' requested but CUDA is not available; use --device cpu")
    model_dir = resolve_model_dir(model)
    cfg = read_config(model_dir)
    from quantspec.model_zoo.mtp import is_mtp_config

    if is_mtp_config(cfg):
        raise QuantSpecError(
            f"{model_dir} is an MTP module, not a model; pass it as --draft-model with --speculate-method mtp"
        )
    args = ModelArgs.from_hf_config(cfg)
    qc_dict = cfg.get("quantization_config")
    k_scale = v_scale = None
    quant_config = None
    kv_dtype = None
    if not qc_dict:
        net, _ = load_model(model_dir, dtype=dtype, device=device)
    else:
        quant_config = QuantConfig.from_dict(qc_dict)
        meta = read_provenance(model_dir)
        if meta.get("quant_type") or meta.get("provenance"):
            quant_config = dataclasses.replace(
                quant_config, quant_type=meta.get("quant_type") or quant_config.quant_type,
                provenance=meta.get("provenance") or {})
        net, k_scale, v_scale = _load_quantized(model_dir, args, quant_config, dtype=dtype,
                                                device=device, policy=policy)
        if quant_config.kv_cache_scheme is not None:
            kv_dtype = "fp8" if quant_config.kv_cache_scheme.type == "float" else "int8"
            k_scale, v_scale = k_scale.to(device), v_scale.to(device)
    tok = _load_tokenizer(model_dir) if tokenizer else None
    runtime = prepare(net, device, policy=policy, fuse=fuse)
    return LoadedModel(model=net, model_dir=model_dir, tokenizer=tok, args=args,
                       quant_config=quant_config, k_scale=k_scale, v_scale=v_scale,
                       kv_cache_dtype=kv_dtype, eos_token_ids=read_eos_token_ids(model_dir, cfg, tok),
                       provenance=read_provenance(model_dir), runtime=runtime)
