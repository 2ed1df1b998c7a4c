"""The decoder stack in one C++ call on CPU: the same kernels as the modules, without Python between them.

Once quantspec's CPU kernels serve every op of a layer (`dense_linear.PackedLinear` /
`QuantLinear`'s int8 / int4 row kernels, `cpu_layers`' norm / rotary / silu*up, the paged
attention kernel), what is left of a decode step beyond the weight reads is Python: ~11 module
calls and ~20 tensor ops a layer, ~150 µs a layer on the default model — a sixth of an fp32
decode step on two cores, more of an int8 / int4 one. `FusedDecoderLayers` gathers each
layer's tensors once into the extension's `DecoderPlan`, which runs the modules' very calls in
their order (rms_norm, qkv linear, rope over q and k, paged attention, o linear, add, rms_norm,
gate/up linear, silu*up, down linear, add) in one call, so its hidden states equal the module
path's bitwise (tested), in decode, verification and prefill steps alike.

It serves a step only when the module path would run exactly those kernels, and otherwise
returns None (the modules run):
- every layer is fused (`qkv_proj`, `gate_up_proj`), its norms / attention / MLP are the kernel
  versions, and every linear is a `PackedLinear` (fp32) or a `QuantLinear` on its int8 / int4
  row kernel — for a `QuantLinear` only in decode / verification steps or for rows up to its
  policy's `cpu_packed_max_m` (larger prefills take its other kernels);
- the step's attention goes through the CPU kernel (`AttentionMetadata.cpu_kernel`: a float
  KV cache; decode and verification rows, fresh prompts up to `PagedKVCache.cpu_kernel_max_prefill`);
- no forward hook or pre-hook is registered on a layer or its parts (calibration and tests
  observe the modules), and the modules and tensors are those the plan was built from (a
  module swapped or a tensor re-assigned after loading: rebuild with `use_fused_layers`).

`QUANTSPEC_FUSED_LAYERS=0` turns it off (the module path runs; benches compare the two).
"""

from __future__ import annotations

import operator
import os
import weakref

import torch
from torch import nn

from quantspec.infer.kv_cache import PagedAttention
from quantspec.infer.step_rows import in_decode_step

__all__ = ["ENV_SWITCH", "FusedDecoderLayers", "layer_plan_args", "linear_plan_args", "use_fused_layers", "watch_holds"]

ENV_SWITCH = "QUANTSPEC_FUSED_LAYERS"  # "0": never fuse the stack (the modules run)

_PARTS = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")
# torch's registries of hooks on every module (`nn.modules.module.register_module_forward_hook`)
_GLOBAL_HOOKS = ("_global_forward_hooks", "_global_forward_pre_hooks")


def _linear_spec(mod: nn.Module, dtype: torch.dtype):
    """(kind, tensors a/b/c/bias, N, group, max rows or None) for a linear the plan can run, else None."""
    from quantspec.infer.dense_linear import PackedInt8Linear, PackedLinear
    from quantspec.infer.quant_linear import KernelPath, QuantLinear

    empty = torch.empty(0)
    if type(mod) is PackedLinear:
        return 0, (mod.packed, empty, empty, empty if mod.bias is None else mod.bias), mod.out_features, 0, None
    if type(mod) is PackedInt8Linear:
        return 1, (mod.int8_cpu, mod.w_scale_vec, empty, empty), mod.out_features, 0, None
    if type(mod) is not QuantLinear or mod.dtype != dtype:
        return None
    bias = mod._gemv_bias()
    bias = empty if bias is None else bias
    limit = mod.policy.cpu_packed_max_m
    if mod._packed_path is KernelPath.CPU_GEMV_INT8 and mod.int8_cpu is not None:
        return 1, (mod.int8_cpu, mod.w_scale_vec, empty, bias), mod.out_features, 0, limit
    if mod._packed_path is KernelPath.CPU_GEMV_INT4 and mod.int4_cpu is not None:
        group = mod.in_features // mod.int4_cpu_scale.shape[1]
        return 2, (mod.int4_cpu, mod.int4_cpu_scale, mod.int4_cpu_offset, bias), mod.out_features, group, limit
    if mod._packed_path is KernelPath.CPU_INT4PACK and mod.int4pack is not None:
        # torch's op; QuantLinear adds its bias in the output's dtype
        bias = empty if mod.bias is None else mod.bias.to(dtype)
        return 3, (mod.int4pack, mod.int4_scales_zeros, empty, bias), mod.out_features, mod.traits.cpu_int4_group, limit
    return None


def layer_plan_args(layer: nn.Module, args, dtype: torch.dtype, eps: float, tensors: list, ints: list,
                    watched: list, limits: list) -> bool:
    """Append one decoder layer's 18 tensors and 12 ints (the extension's `make_layer` layout),
    what must stay in place for them to be the layer's (`watched`) and its quantized linears' row
    limits; False (the lists then hold a partial layer: discard them) when a plan cannot run the
    layer's calls."""
    from quantspec.infer.cpu_layers import KernelAttention, KernelMLP, KernelRMSNorm

    attn, mlp = layer.self_attn, layer.mlp
    norms = (layer.input_layernorm, layer.post_attention_layernorm)
    if (any(type(n) is not KernelRMSNorm or n.weight.dtype != dtype or n.eps != eps for n in norms)
            or type(attn) is not KernelAttention or type(mlp) is not KernelMLP
            or attn.qkv_proj is None or mlp.gate_up_proj is None
            or (attn.num_heads, attn.num_kv_heads, attn.head_dim) != (args.num_heads, args.num_kv_heads, args.head_dim)):
        return False
    tensors += [norms[0].weight, norms[1].weight]
    for part in _PARTS:
        watched.append((layer._modules, part, layer._modules[part]))
    watched += [(n._parameters, "weight", n.weight) for n in norms]
    for owner, name in ((attn, "qkv_proj"), (attn, "o_proj"), (mlp, "gate_up_proj"), (mlp, "down_proj")):
        if not linear_plan_args(owner._modules, name, dtype, tensors, ints, watched, limits):
            return False
    return True


def linear_plan_args(table: dict, name: str, dtype: torch.dtype, tensors: list, ints: list,
                     watched: list, limits: list) -> bool:
    """Append the linear `table[name]`'s 4 tensors and (kind, N, group) for a plan (`table`: its
    owner's `_modules`, or any dict it is kept in); False when the plan cannot run it."""
    lin = table.get(name)
    spec = None if lin is None else _linear_spec(lin, dtype)
    if spec is None:
        return False
    kind, ts, n_out, group, limit = spec
    tensors += list(ts)
    ints += [kind, n_out, group]
    if limit is not None:
        limits.append(limit)
    watched.append((table, name, lin))
    watched += [(lin._buffers, key, b) for key, b in lin._buffers.items() if b is ts[0]]
    return True


def watch_holds(dicts: list, keys: list, objs: list, hook_dicts: list) -> bool:
    """Whether the watched (dict, key, object) triples still hold and no forward hook is
    registered on the watched modules (`hook_dicts`) or globally: checked per call at C speed."""
    if not all(map(operator.is_, map(dict.get, dicts, keys), objs)):
        return False
    if any(hook_dicts):
        return False
    return not any(getattr(nn.modules.module, name, None) for name in _GLOBAL_HOOKS)


class FusedDecoderLayers:
    """Runs `model.model.layers` through the extension's `DecoderPlan` (module docstring).
    Build it with `FusedDecoderLayers.build(model)` (None when some layer cannot be fused)."""

    def __init__(self, model: nn.Module, kernels, dtype: torch.dtype, tensors: list[torch.Tensor],
                 ints: list[int], watched: list[tuple], max_quant_rows: int | None):
        self.kernels, self.dtype = kernels, dtype
        self.args = model.args
        self._layers = list(model.model.layers)
        self._tensors, self._ints = tensors, ints
        # what must still hold for the plan to be the modules' computation, checked per step at C
        # speed: (owner's _modules / _parameters / _buffers dict, key, object) triples, and each
        # module's hook dicts (torch adds hooks to these very dicts)
        self._watch_dicts, self._watch_keys, self._watch_objs = (list(t) for t in zip(*watched))
        self._hook_dicts = [d for layer in self._layers for m in layer.modules()
                            for d in (m._forward_hooks, m._forward_pre_hooks)]
        self.max_quant_rows = max_quant_rows  # rows beyond which a QuantLinear leaves its row kernel

    @classmethod
    def build(cls, model: nn.Module) -> "FusedDecoderLayers | None":
        from quantspec.kernels.cpu import cpu_kernels

        kernels = cpu_kernels()
        layers = getattr(getattr(model, "model", None), "layers", None)
        if kernels is None or not hasattr(kernels, "DecoderPlan") or not layers:
            return None
        args = model.args
        if args.head_dim not in (64, 128) or args.num_heads % args.num_kv_heads:
            return None
        dtype = layers[0].input_layernorm.weight.dtype
        if dtype not in (torch.float32, torch.bfloat16) or layers[0].input_layernorm.weight.device.type != "cpu":
            return None
        tensors: list[torch.Tensor] = []
        ints: list[int] = []
        watched: list[tuple] = []
        limits: list[int] = []
        for layer in layers:
            if not layer_plan_args(layer, args, dtype, layers[0].input_layernorm.eps, tensors, ints, watched, limits):
                return None
        return cls(model, kernels, dtype, tensors, ints, watched, min(limits) if limits else None)

    def serves(self, x: torch.Tensor, attn) -> bool:
        """Whether this step can take the plan (module docstring)."""
        if type(attn) is not PagedAttention:
            return False
        meta = attn.meta
        if not meta.cpu_kernel or x.dtype != self.dtype or x.dim() != 2 or x.shape[0] == 0:
            return False
        if self.max_quant_rows is not None and x.shape[0] > self.max_quant_rows and not in_decode_step():
            return False
        return watch_holds(self._watch_dicts, self._watch_keys, self._watch_objs, self._hook_dicts)

    def _plan_for(self, cache):
        """This stack's plan over `cache`'s tensors. The cache owns it (a plan holds the cache's
        tensors: kept by the runner, it would keep a discarded engine's cache alive)."""
        plans = cache.__dict__.get("_fused_plans")
        if plans is None:
            plans = cache._fused_plans = weakref.WeakKeyDictionary()  # runner → (slots list, plan)
        entry = plans.get(self)
        if entry is None or entry[0] is not cache.k_slots:
            a = self.args
            plan = self.kernels.DecoderPlan(self._tensors, self._ints, list(cache.k_slots), list(cache.v_slots),
                                            a.num_heads, a.num_kv_heads, a.head_dim, cache.block_size,
                                            float(self._layers[0].input_layernorm.eps), a.head_dim ** -0.5)
            entry = plans[self] = (cache.k_slots, plan)
        return entry[1]

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn,
                 out_rows: torch.Tensor | None = None) -> torch.Tensor | None:
        """The hidden states after the last layer (only the rows `out_rows` [N], int64, when
        given: the last layer's o projection and MLP run on those alone), or None where the
        modules must run."""
        if not self.serves(x, attn):
            return None
        meta = attn.meta
        plan = self._plan_for(attn.cache)
        return plan.forward(x, cos.contiguous(), sin.contiguous(), meta.slot_mapping, meta.block_tables,
                            meta.q_lens, meta.seq_lens, out_rows)


def use_fused_layers(model: nn.Module) -> bool:
    """Attach a `FusedDecoderLayers` to `model` (a `model_zoo.llama.Transformer` prepared for CPU
    inference: fused, packed, kernel layers) where it applies; returns whether it did. Call it
    again after changing the model's modules or tensors."""
    runner = None if os.environ.get(ENV_SWITCH, "1") == "0" else FusedDecoderLayers.build(model)
    model.fused_layers = runner
    return runner is not None
