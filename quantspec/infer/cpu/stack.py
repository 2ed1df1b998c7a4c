"""The decoder stack in one C++ call on CPU: the modules' very kernel calls, without Python
between them (`CpuLayerStack`, a `model_zoo.llama.StackRunner`).

Once quantspec's CPU kernels serve every op of a layer (packed linears, the norm / rotary /
silu*up kernels of `infer/cpu/layers.py`, the paged attention kernel), what is left of a decode
step beyond the weight reads is Python: about a dozen module calls and twenty tensor ops a layer.
The extension's `DecoderPlan` (`infer/cpu/csrc/plans.cpp`) gathers each layer's tensors once and
runs the modules' calls in their order (rms_norm, qkv linear, rope over q and k, paged attention,
o linear, add, rms_norm, gate/up linear, silu*up, [the down linear's run-time input transform,
SpinQuant's R4: `infer.transformed`], down linear, add) in one call, so its hidden
states equal the modules' bitwise, in decode, verification and prefill steps alike. A step asked
to `capture` residual streams (EAGLE-3's aux features) runs one plan per segment of layers
between the captured ids, each plan over its layers' share of the tensors and caches.

It serves a step only when the modules would run exactly those kernels, and otherwise returns
None (the modules run):
- every layer is fused (`qkv_proj`, `gate_up_proj`), its norms / rotary / activation are the
  kernel versions, and every linear is a `PackedLinear` (fp32), a `PackedPairsLinear` (bf16) or
  a `QuantLinear` on its row kernel — for a `QuantLinear` only in row-invariant steps or for rows
  up to its row limit (larger prefills take its other kernels); `down_proj` may be a
  `TransformedLinear` with an input transform alone (R4's), whose block linear and inner linear
  are such linears;
- the step's attention goes through the cache's `CpuAttention` (`meta.kernel`);
- no forward hook or pre-hook is registered on a layer or its parts (calibration and tests
  observe the modules), and the modules and tensors are those the plan was built from (a module
  swapped or a tensor re-assigned after loading: prepare the model again).

`QUANTSPEC_FUSED_LAYERS=0` turns it off (the modules run).
"""

from __future__ import annotations

import operator
import os

import torch
from torch import nn

from quantspec.infer.cpu.attention import CpuAttention
from quantspec.infer.cpu.layers import CpuRMSNorm, CpuRotary, CpuSiluAndMul
from quantspec.infer.cpu.linears import PackedInt8Linear, PackedLinear, PackedPairsLinear
from quantspec.infer.kv_cache import PagedAttention
from quantspec.infer.quant_linear import QuantLinear
from quantspec.infer.transformed import TransformedLinear
from quantspec.kernels import cpu as cg
from quantspec.model_zoo.llama import MLP

__all__ = ["ENV_SWITCH", "CpuLayerStack", "layer_plan_args", "linear_plan_args", "watch_holds"]

ENV_SWITCH = "QUANTSPEC_FUSED_LAYERS"  # "0": never fuse the stack (the modules run)

_PARTS = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")
# torch's registries of hooks on every module (`nn.modules.module.register_module_forward_hook`)
_GLOBAL_HOOKS = ("_global_forward_hooks", "_global_forward_pre_hooks")
_EMPTY = torch.empty(0)
_LAYER_TENSORS, _LAYER_INTS = 22, 15  # a layer's share of a plan's tensors and ints (`make_layer`)
_NO_LINEAR = ([_EMPTY] * 4, [-1, 0, 0])  # a linear slot left empty (kind -1): no down input transform


def _linear_spec(mod: nn.Module, dtype: torch.dtype):
    """(kind, tensors a / b / c / bias, N, group, the module holding a, max rows or None) of a
    linear the plan can run, else None."""
    # packed float weights: fp32, or bf16 in k-pairs (whose fp32 x takes torch's linear instead)
    kind = 0 if type(mod) is PackedLinear else 5 if type(mod) is PackedPairsLinear and dtype == torch.bfloat16 \
        else None
    if kind is not None:
        bias = _EMPTY if mod.bias is None else mod.bias
        return kind, (mod.packed, _EMPTY, _EMPTY, bias), mod.out_features, 0, mod, None
    if type(mod) is PackedInt8Linear:
        return 1, (mod.int8_cpu, mod.w_scale_vec, _EMPTY, _EMPTY), mod.out_features, 0, mod, None
    if type(mod) is not QuantLinear or not hasattr(mod.prepared, "plan_linear"):
        return None
    spec = mod.prepared.plan_linear(mod, dtype)
    if spec is None:
        return None
    kind, tensors, n, group = spec
    return kind, tensors, n, group, mod.prepared, mod.prepared.row_limit


def linear_plan_args(table: dict, name: str, dtype: torch.dtype, tensors: list, ints: list,
                     watched: list, limits: list) -> bool:
    """Append the linear `table[name]`'s 4 tensors and (kind, N, group) for a plan (`table`: its
    owner's `_modules`, or any dict it is kept in); False when the plan cannot run it."""
    lin = table.get(name)
    spec = None if lin is None else _linear_spec(lin, dtype)
    if spec is None:
        return False
    kind, ts, n_out, group, holder, limit = spec
    tensors += list(ts)
    ints += [kind, n_out, group]
    if limit is not None:
        limits.append(limit)
    watched.append((table, name, lin))
    if holder is not lin:
        watched.append((lin._modules, "prepared", holder))
    watched += [(holder._buffers, key, b) for key, b in holder._buffers.items() if b is ts[0]]
    return True


def layer_plan_args(layer: nn.Module, args, dtype: torch.dtype, eps: float, tensors: list, ints: list,
                    watched: list, limits: list) -> bool:
    """Append one decoder layer's 22 tensors and 15 ints (the plans' `make_layer` layout), what
    must stay in place for them to be the layer's (`watched`) and its quantized linears' row
    limits; False (the lists then hold a partial layer: discard them) when a plan cannot run the
    layer's calls."""
    attn, mlp = layer.self_attn, layer.mlp
    norms = (layer.input_layernorm, layer.post_attention_layernorm)
    if not isinstance(mlp, MLP):  # a mixture of experts: the plans run one dense MLP
        return False
    if (any(type(n) is not CpuRMSNorm or n.weight.dtype != dtype or n.eps != eps for n in norms)
            or type(attn.rotary_emb) is not CpuRotary or type(mlp.act_fn) is not CpuSiluAndMul
            or attn.qkv_proj is None or mlp.gate_up_proj is None or attn.q_norm is not None  # no q/k norms in plans
            or (attn.num_heads, attn.num_kv_heads, attn.head_dim) != (args.num_heads, args.num_kv_heads, args.head_dim)
            or args.rotary_dim != args.head_dim or not attn.use_rope):  # the plans rotate whole heads, every layer
        return False
    tensors += [norms[0].weight, norms[1].weight]
    for part in _PARTS:
        watched.append((layer._modules, part, layer._modules[part]))
    watched += [(attn._modules, "rotary_emb", attn.rotary_emb), (mlp._modules, "act_fn", mlp.act_fn)]
    watched += [(n._parameters, "weight", n.weight) for n in norms]
    down = mlp.down_proj
    transformed = type(down) is TransformedLinear
    if transformed and (down.output_t is not None or down.input_t is None):
        return False  # the plans run an input transform alone (R4's)
    for owner, name in ((attn, "qkv_proj"), (attn, "o_proj"), (mlp, "gate_up_proj"),
                        (down, "inner") if transformed else (mlp, "down_proj")):
        if not linear_plan_args(owner._modules, name, dtype, tensors, ints, watched, limits):
            return False
    if not transformed:
        tensors += _NO_LINEAR[0]
        ints += _NO_LINEAR[1]
        return True
    watched.append((mlp._modules, "down_proj", down))
    return linear_plan_args(down._modules, "input_block", dtype, tensors, ints, watched, limits)


def watch_holds(dicts: list, keys: list, objs: list, hook_dicts: list) -> bool:
    """Whether the watched (dict, key, object) triples still hold and no forward hook is
    registered on the watched modules (`hook_dicts`) or globally: checked per call at C speed."""
    if not all(map(operator.is_, map(dict.get, dicts, keys), objs)):
        return False
    if any(hook_dicts):
        return False
    return not any(getattr(nn.modules.module, name, None) for name in _GLOBAL_HOOKS)


class CpuLayerStack:
    """Runs `model.model.layers` through the extension's `DecoderPlan` (module docstring).
    Build it with `CpuLayerStack.build(model)` (None when some layer cannot be fused)."""

    def __init__(self, model: nn.Module, dtype: torch.dtype, tensors: list[torch.Tensor], ints: list[int],
                 watched: list[tuple], max_quant_rows: int | None, pairs: bool):
        self.dtype, self.pairs = dtype, pairs
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
    def build(cls, model: nn.Module, *, pairs: bool = True) -> "CpuLayerStack | None":
        """The stack runner of a CPU-prepared `Transformer`, or None where a plan cannot run it;
        `pairs`: the kernels' AVX512-BF16 path (the policy's `cpu_pairs`)."""
        if os.environ.get(ENV_SWITCH, "1") == "0":
            return None
        kernels = cg.cpu_kernels()
        layers = getattr(getattr(model, "model", None), "layers", None)
        if kernels is None or not hasattr(kernels, "DecoderPlan") or not layers:
            return None
        args = model.args
        if args.head_dim not in (64, 128) or args.num_heads % args.num_kv_heads or args.multiplied:
            return None  # (Granite's multipliers: the plans leave them out)
        norm = layers[0].input_layernorm  # None: OLMo 2's post-norm layers, which the plans do not run
        if norm is None or norm.weight.dtype not in (torch.float32, torch.bfloat16) or norm.weight.device.type != "cpu":
            return None
        tensors: list[torch.Tensor] = []
        ints: list[int] = []
        watched: list[tuple] = []
        limits: list[int] = []
        for layer in layers:
            if not layer_plan_args(layer, args, norm.weight.dtype, norm.eps, tensors, ints, watched, limits):
                return None
        return cls(model, norm.weight.dtype, tensors, ints, watched, min(limits) if limits else None, pairs)

    def serves(self, x: torch.Tensor, attn, row_invariant: bool) -> bool:
        """Whether this step can take the plan (module docstring)."""
        if type(attn) is not PagedAttention or not attn.meta.kernel:
            return False
        kernel = attn.cache.kernel
        if not isinstance(kernel, CpuAttention) or kernel.pairs != self.pairs:
            return False
        if x.dtype != self.dtype or x.dim() != 2 or x.shape[0] == 0:
            return False
        if self.max_quant_rows is not None and x.shape[0] > self.max_quant_rows and not row_invariant:
            return False
        return watch_holds(self._watch_dicts, self._watch_keys, self._watch_objs, self._hook_dicts)

    def _plan_for(self, kernel: CpuAttention, block_size: int = 0, start: int = 0, stop: int | None = None):
        """This stack's plan of layers [start, stop) (None: to the last) over `kernel`'s cache,
        for block tables of `block_size` (0: the cache's; a token tree's step: 1). The cache's
        kernel owns it (a plan holds the cache's tensors: kept by the runner, it would keep a
        discarded engine's cache alive)."""
        plans = kernel.plans.setdefault(self, {})
        block_size = block_size or kernel.cache.block_size
        stop = len(self._layers) if stop is None else stop
        plan = plans.get((block_size, start, stop))
        if plan is None:
            a = self.args
            plan = plans[(block_size, start, stop)] = cg.cpu_kernels().DecoderPlan(
                self._tensors[_LAYER_TENSORS * start:_LAYER_TENSORS * stop],
                self._ints[_LAYER_INTS * start:_LAYER_INTS * stop], kernel.k_slots[start:stop],
                kernel.v_slots[start:stop], a.num_heads, a.num_kv_heads, a.head_dim, block_size,
                float(self._layers[0].input_layernorm.eps), a.head_dim ** -0.5, self.pairs, kernel.prefill_blocks)
        return plan

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn,
                 out_rows: torch.Tensor | None = None, row_invariant: bool = False, capture: tuple[int, ...] = ()
                 ) -> torch.Tensor | tuple[torch.Tensor, tuple[torch.Tensor, ...]] | None:
        """The hidden states after the last layer (only the rows `out_rows` [N], int64, when
        given: the last layer's o projection and MLP run on those alone), or None where the
        modules must run. `capture` (layer ids, L: the last layer's output): the plans run the
        layers in segments cut at the ids, and return (the hidden states, each id's residual
        stream [T, D] in `capture`'s order), as `Transformer.forward` does."""
        if not self.serves(x, attn, row_invariant):
            return None
        meta, kernel = attn.meta, attn.cache.kernel
        step = (cos.contiguous(), sin.contiguous(), meta.slot_mapping, meta.block_tables, meta.q_lens, meta.seq_lens)
        if not capture:
            return self._plan_for(kernel, meta.block_size).forward(x, *step, out_rows)
        last = len(self._layers)
        cuts = sorted(set(capture) | {0, last})
        streams = {0: x}
        for start, stop in zip(cuts, cuts[1:]):
            rows = out_rows if stop == last and last not in capture else None  # id L wants every row
            x = streams[stop] = self._plan_for(kernel, meta.block_size, start, stop).forward(x, *step, rows)
        if out_rows is not None and last in capture:
            x = x[out_rows]
        return x, tuple(streams[i] for i in capture)
