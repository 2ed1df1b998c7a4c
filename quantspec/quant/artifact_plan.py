"""An artifact's tensors checked against its model and its `quantization_config` before any is
read for its numbers: the part every reader of a quantized checkpoint shares (the inference
loader builds `QuantLinear`s from the plan, `quant.decompressed` shows the float checkpoint it
decompresses to).

The tensors are seen under compressed-tensors' names whatever tool wrote them (transformers'
FP8 names through `RenamedLeaves`, ModelOpt's through `quant.modelopt.ModelOptTensors`, GPTQ's and
AWQ's through `quant.autoquant.AutoQuantTensors`) and a
fused checkpoint's modules under their parts' names (`SplitTensors`). Every float tensor the
model needs is present with its shape, each quantized Linear's compressed tensors are known by
name and shape (`expected_linear_tensors`), and the names left over are refused by
`ArtifactPlan.refuse_unexpected`. KV-cache scales (`self_attn.k_scale` / `v_scale`) are allowed
where the config has a `kv_cache_scheme`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping

import torch
from torch import nn

from quantspec.errors import QuantSpecError
from quantspec.model_zoo.checkpoint import build_model, check_against_table
from quantspec.model_zoo.layout import RenamedLeaves, SplitTensors, checkpoint_name
from quantspec.model_zoo.llama import ModelArgs, Transformer, hf_weight_table
from quantspec.quant.autoquant import AUTOQUANT_METHODS, AutoQuantTensors
from quantspec.quant.compressed import expected_linear_tensors
from quantspec.quant.config import QuantConfig
from quantspec.quant.scheme import QuantScheme
from quantspec.quant.transforms import online_transforms

__all__ = ["ArtifactPlan", "IGNORED_SUFFIXES", "KV_NAMES", "attn_prefix", "plan_artifact", "weight_dims"]

IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)  # recomputed tensors some exporters write
KV_NAMES = ("k_scale", "v_scale")


def attn_prefix(i: int) -> str:
    """The attention module of decoder layer `i` (where its KV-cache scales live)."""
    return f"model.layers.{i}.self_attn"


def weight_dims(mod: nn.Module) -> tuple[int, int]:
    """A quantized module's weight [N, K]: a Linear's (out, in), an embedding's (rows, width)."""
    if isinstance(mod, nn.Embedding):
        return mod.num_embeddings, mod.embedding_dim
    return mod.out_features, mod.in_features


def _is_trivial_g_idx(g_idx: torch.Tensor, K: int, group_size: int | None) -> bool:
    """Whether `g_idx` says the groups in order (per channel: one group of every row)."""
    if g_idx.numel() != K:
        return False
    g = group_size if group_size and group_size > 0 else K
    return torch.equal(g_idx.to(torch.int64).reshape(-1), torch.arange(K) // g)


def _quantized_modules(net: Transformer, qc: QuantConfig, where: str,
                       check_scheme: Callable[[QuantScheme], object] | None,
                       check_embedding: Callable[[QuantScheme], object] | None = None) -> dict[str, QuantScheme]:
    """{module name: its scheme} for every Linear the config quantizes (a part of a fused
    checkpoint module takes that module's: `layout.checkpoint_name`) and a quantized input
    embedding; refuses a scheme `check_scheme` (a Linear's) or `check_embedding` refuses, and a
    tied head beside a quantized embedding (no float weights to tie it to)."""
    out = {}
    for name, mod in net.named_modules():
        embedding = isinstance(mod, nn.Embedding)
        if not embedding and not isinstance(mod, nn.Linear):
            continue
        scheme = qc.scheme_for(name, ("Embedding",)) if embedding else \
            qc.scheme_for(checkpoint_name(net.args, name), ("Linear",))
        if scheme is None or (embedding and scheme.weights is None):
            continue
        if scheme.weights is None:
            raise QuantSpecError(f"{where}: {name} has activation-only quantization, "
                                 "which quantspec does not run; add it to `ignore`")
        check = check_embedding if embedding else check_scheme
        try:  # a scheme quantspec does not run is named before its tensors are read
            if check is not None:
                check(scheme)
        except QuantSpecError as e:
            raise QuantSpecError(f"{where}: {name}: {e}") from None
        if embedding and net.args.tie_word_embeddings and qc.scheme_for("lm_head") is None:
            raise QuantSpecError(f"{where}: {name} is quantized and config.json ties the output head to it "
                                 "(tie_word_embeddings), which leaves the head no float weights; re-quantize "
                                 "with quantspec (it unties them) or set tie_word_embeddings false with an lm_head")
        out[name] = scheme
    if not out:
        raise QuantSpecError(f"{where}: the quantization_config targets no Linear of this model "
                             "(check config_groups targets and ignore)")
    return out


def _float_table(args: ModelArgs, net: Transformer, quantized: dict, shapes: Mapping[str, tuple],
                 where: str) -> tuple[dict[str, tuple], dict[str, dict]]:
    """(the float tensors the checkpoint must hold, with shapes; the compressed names per quantized
    Linear), the float ones checked against the checkpoint's `shapes`."""
    table = hf_weight_table(args)
    if "lm_head" in quantized and "lm_head.weight" not in table:
        table["lm_head.weight"] = (args.vocab_size, args.hidden_size)
    q_expected: dict[str, dict] = {}
    for name, scheme in quantized.items():
        table.pop(f"{name}.weight", None)
        q_expected[name] = expected_linear_tensors(name, scheme, *weight_dims(net.get_submodule(name)))
    missing = [n for n in table if n not in shapes]
    if missing:
        more = f" (+{len(missing) - 3} more)" if len(missing) > 3 else ""
        raise QuantSpecError(f"{where} lacks {', '.join(missing[:3])}{more}; the "
                             "checkpoint is incomplete")
    check_against_table(shapes, table, where)
    return table, q_expected


def _optional_tensors(tensors: dict, net: Transformer, quantized: dict, q_expected: dict, where: str,
                      permuted: set[str] | None) -> set[str]:
    """The quantized Linears' tensors a checkpoint may hold: the expected ones, zero points of
    symmetric args (all zero) and a trivial act-order index, which compressed-tensors may store
    and which are dropped; anything else of theirs is refused. A permuted act-order index is
    refused too, unless `permuted` (a set) collects the Linears that hold one."""
    allowed: set[str] = set()
    for name, exp in q_expected.items():
        allowed.update(exp)
        for opt in ("input_zero_point", "weight_zero_point"):
            key = f"{name}.{opt}"
            if key in tensors and key not in exp:
                if bool((tensors[key].float() != 0).any()):
                    raise QuantSpecError(f"{where}: {key} is non-zero but the config says the "
                                         "args are symmetric; the checkpoint and config disagree")
                allowed.add(key)
        gkey = f"{name}.weight_g_idx"
        if gkey in tensors:
            w = quantized[name].weights
            if not _is_trivial_g_idx(tensors[gkey], weight_dims(net.get_submodule(name))[1], w.group_size):
                if permuted is None:
                    raise QuantSpecError(
                        f"{where}: {gkey} holds a permuted act-order group index (GPTQ's desc_act), which neither "
                        "quantspec nor vLLM runs; re-quantize it into static act-order groups: quantspec quantize "
                        f"--model {where} --quant-type weight_only_int{w.num_bits} --method gptq --act-order "
                        "--dataset D")
                permuted.add(name)
            allowed.add(gkey)
    return allowed


def _refuse_unexpected(names: set[str], allowed: set[str], kv_names: set[str], args: ModelArgs, where: str) -> None:
    unexpected = sorted(names - allowed)
    if unexpected:
        u = unexpected[0]
        if u in kv_names:
            raise QuantSpecError(f"{where}: {u} is present but config.json has no "
                                 "kv_cache_scheme; add it or drop the KV scales")
        more = f" (+{len(unexpected) - 1} more)" if len(unexpected) > 1 else ""
        raise QuantSpecError(f"{where}: unexpected tensor {u}{more} for this {args.arch} "
                             "checkpoint and its quantization_config; the checkpoint and "
                             "config.json disagree")


@dataclass
class ArtifactPlan:
    """An artifact's tensors checked against its model and config from their shapes alone:
    `tensors` seen under compressed-tensors' names and the parts' names of fused modules,
    `net` the model on `meta`, `quantized` {Linear: scheme}, `float_table` {float tensor: shape}
    (each present and of that shape), `q_expected` {Linear: {compressed tensor: shape or None}}."""

    tensors: Mapping[str, torch.Tensor]
    net: Transformer
    quantized: dict[str, QuantScheme]
    float_table: dict[str, tuple]
    q_expected: dict[str, dict]
    names: set[str]
    allowed: set[str]
    kv_names: set[str]
    permuted: set[str]  # Linears whose act-order index is permuted (only with `permuted_g_idx`)
    online: dict  # {Linear: {"input" | "output": transform}}: run-time transforms (`quant.transforms`)

    def refuse_unexpected(self, args: ModelArgs, where: str) -> None:
        """One line naming the first tensor that neither the model nor the config explains."""
        _refuse_unexpected(self.names, self.allowed, self.kv_names, args, where)


def plan_artifact(tensors: Mapping[str, torch.Tensor], args: ModelArgs, qc: QuantConfig, *,
                  where: str = "the artifact", check_scheme: Callable[[QuantScheme], object] | None = None,
                  check_embedding: Callable[[QuantScheme], object] | None = None,
                  permuted_g_idx: bool = False) -> ArtifactPlan:
    """The `ArtifactPlan` of an artifact's tensors (a dict, or a mapping that reads each when
    looked up); refuses, one line each, what no loader takes: a scheme `check_scheme` (a
    Linear's) or `check_embedding` (a quantized input embedding's) refuses (a `QuantSpecError`),
    a quantized embedding the head is tied to, a float tensor missing or mis-shaped, an
    optional compressed tensor that contradicts the config, and a permuted act-order index unless
    `permuted_g_idx` (a reader that dequantizes its Linears can follow one)."""
    if qc.tensor_names:  # tensors another tool names otherwise (`quant.hf_fp8`)
        tensors = RenamedLeaves(tensors, qc.tensor_names)
    if qc.source == "modelopt":  # ModelOpt's names and reciprocal global scales (`quant.modelopt`)
        from quantspec.quant.modelopt import ModelOptTensors

        tensors = ModelOptTensors(tensors, qc)
    elif qc.source in AUTOQUANT_METHODS:  # their own packing, repacked as compressed-tensors' (`quant.autoquant`)
        tensors = AutoQuantTensors(tensors, qc)
    elif qc.source == "quark":  # its KV scales on k_proj / v_proj (`quant.quark`)
        from quantspec.quant.quark import QuarkTensors

        tensors = QuarkTensors(tensors)
    elif qc.source == "fbgemm_fp8":  # its input bound is the config's (`quant.fbgemm`)
        from quantspec.quant.fbgemm import FbgemmTensors

        tensors = FbgemmTensors(tensors)
    tensors = SplitTensors(tensors, args)  # a fused checkpoint's modules under their parts' names
    shapes = tensors.shapes
    names = {k for k in shapes if not k.endswith(IGNORED_SUFFIXES)}
    net = build_model(args, device="meta")
    quantized = _quantized_modules(net, qc, where, check_scheme, check_embedding)
    if qc.source in AUTOQUANT_METHODS:  # a Linear a GPTQ / AWQ checkpoint stores float (a mixture of
        # experts' router) is float, as vLLM finds the quantized ones by their tensors' dtypes
        quantized = {n: s for n, s in quantized.items() if f"{n}.weight" not in shapes}
    if args.tie_word_embeddings and "lm_head" not in quantized:
        names.discard("lm_head.weight")  # some exporters write the tied copy anyway
    float_table, q_expected = _float_table(args, net, quantized, shapes, where)
    permuted: set[str] | None = set() if permuted_g_idx else None
    allowed = set(float_table) | _optional_tensors(tensors, net, quantized, q_expected, where, permuted)
    kv_names = {f"{attn_prefix(i)}.{k}" for i in range(args.num_layers) for k in KV_NAMES}
    if qc.kv_cache_scheme is not None:
        allowed |= kv_names
    online, transform_tensors = online_transforms(qc.transform_config, net, tensors, where)
    allowed |= transform_tensors
    return ArtifactPlan(tensors, net, quantized, float_table, q_expected, names, allowed, kv_names, permuted or set(),
                        online)
