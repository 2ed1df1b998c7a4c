"""The Llama family (Llama 2/3, Mistral, Qwen2, Qwen3, their MoE, Phi-3, SmolLM2 / 3, Granite, OLMo 2,
Gemma 2 / 3) as plain nn.Modules.

This file owns the architecture: `ModelArgs` read from a HF `config.json`, the modules (rotary
tables: `rope.py`; norms, activations and the rotary embedding: `ops.py`; dense causal attention:
`attention.py`); the HF weight-name table that `load_state_dict` is checked against is
`layout.py`'s. Module attribute names mirror HF's, so a checkpoint's tensor names (and
compressed-tensors' `...q_proj.weight_packed`) map one to one, except where a checkpoint fuses
modules (Phi-3's `qkv_proj` / `gate_up_proj`: `layout.py` splits and re-fuses them).

What runs the numbers is injected rather than built in:
- attention: the model computes q/k/v and rotary, then calls an `AttentionBackend`
  (`backend(layer_idx, q, k, v) -> out`), so the same modules run with the paged KV cache of
  `infer/` and with the plain causal attention (and observers) of `calib/`;
- linears, norms, the rotary embedding (`RotaryEmbedding`) and the MLP's activation (`SiluAndMul`,
  `GeluTanhAndMul`) are submodules: plain torch at build time, replaced by name by an inference backend;
- the whole decoder stack: `Transformer.forward(stack=...)` takes a `StackRunner` that may run
  every layer in one call (falling back to the modules when it returns None).
A forward asked to `capture` layer ids also returns the residual streams entering those layers
(id L, the number of layers: the last layer's output), e.g. EAGLE-3's aux features: the module
path keeps them in its loop, a stack runner serves the request itself or returns None.
A forward asked for `row_invariant` rows (a decode or verification step) gives every row the
numbers it would get alone: it passes the flag to the stack runner and to every linear that
declares `takes_row_invariant` (an inference backend's, whose kernel choice depends on the rows).

Tokens are flattened over the batch (`[T, D]`, no padding); positions come with them.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Protocol

import torch
from torch import nn

from quantspec.errors import QuantSpecError
from quantspec.model_zoo.attention import DenseCausalAttention, window_mask
from quantspec.model_zoo.hf_config import args_fields
from quantspec.model_zoo.layout import hf_weight_table, layer_weight_table
from quantspec.model_zoo.ops import ACTIVATIONS, GeluTanhAndMul, RMSNorm, RotaryEmbedding, SiluAndMul, rms_norm
from quantspec.model_zoo.rope import ROPE_TYPES, apply_rope, rope_cos_sin, rope_type

__all__ = [
    "ARCHITECTURES",
    "AttentionBackend",
    "DenseCausalAttention",
    "ModelArgs",
    "RotaryEmbedding",
    "SiluAndMul",
    "StackRunner",
    "Transformer",
    "apply_rope",
    "hf_weight_table",
    "layer_weight_table",
    "project",
    "rms_norm",
    "rope_cos_sin",
    "rope_tables",
    "window_mask",
]

# HF `architectures[0]` → our family tag. Everything here shares one module tree; the tag only
# changes biases and defaults.
ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
    "Phi3ForCausalLM": "phi3",
    "Olmo2ForCausalLM": "olmo2",
    "SmolLM3ForCausalLM": "smollm3",
    "GraniteForCausalLM": "granite",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
}
# Granite's multipliers at the values that scale nothing (every other architecture's)
NEUTRAL_MULTIPLIERS = {"embedding_multiplier": 1.0, "residual_multiplier": 1.0, "attention_multiplier": 0.0,
                       "logits_scaling": 1.0}


@dataclass
class ModelArgs:
    """Architecture hyper-parameters, from a HF config.json (`from_hf_config`)."""

    arch: str = "llama"
    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_layers: int = 32
    num_heads: int = 32
    num_kv_heads: int = 32
    head_dim: int = 0  # 0: hidden_size // num_heads
    rotary_dim: int = 0  # the leading dims of each head the rotary embedding turns (partial_rotary_factor); 0: all
    nope_layers: tuple[int, ...] = ()  # layers whose attention takes no rotary embedding (SmolLM3's NoPE layers)
    # Granite's scalars: embeddings × embedding_multiplier, each block's output × residual_multiplier
    # before its residual add, attention scores × attention_multiplier (0: head_dim ** -0.5), logits
    # ÷ logits_scaling
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: float = 0.0
    logits_scaling: float = 1.0  # (NEUTRAL_MULTIPLIERS: the values that scale nothing)
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    rotation: str = ""  # the rotations fused into the weights (`model_zoo.hf_config.rotation_tag`); "": none
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: each head's q and k RMS-normalized (over head_dim) before the rotary embedding
    qk_norm_per_head: bool = True  # False (OLMo 2): q and k normalized over the whole projection
    # OLMo 2, Gemma 3: each block's output is normalized before its add (`post_attention_layernorm`,
    # `post_feedforward_layernorm`), every norm scaling in fp32; with `pre_norms` (Gemma 3) the
    # MLP's input norm is `pre_feedforward_layernorm`, without (OLMo 2) the blocks read the residual
    post_norms: bool = False
    pre_norms: bool = True  # input_layernorm before attention, a norm before the MLP
    norm_unit_offset: bool = False  # Gemma: every norm scales by 1 + weight
    hidden_act: str = "silu"  # the MLP's gate activation: silu, or Gemma's gelu_pytorch_tanh
    # the tokens a layer attends back at most (Mistral v0.1's 4096, Phi-3's, Gemma 3's local layers';
    # Qwen's with use_sliding_window): the layers in `window_layers` attend within it
    # (`attention_window`); with none there, quantspec attends to the whole context, which equals
    # the model's up to this length (`check_context`)
    sliding_window: int | None = None
    window_layers: tuple[int, ...] = ()
    local_rope_theta: float = 0.0  # Gemma 3: the window layers' rotary base (default rope); 0: every layer's tables
    # Gemma 2: scores and logits soft-capped, s → cap · tanh(s / cap) (`model_zoo.attention`); 0: not capped
    attn_softcap: float = 0.0
    logit_softcap: float = 0.0
    # mixture of experts (Qwen2-MoE, Qwen3-MoE, Mixtral): the MLP of a layer not in `dense_layers`
    # is `num_experts` MLPs of `moe_intermediate_size`, `experts_per_token` of them mixed per token
    # by a router, plus (Qwen2-MoE) a gated shared expert of `shared_expert_intermediate_size`
    # (`moe.SparseMoE`); 0 experts: every MLP is dense
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    shared_expert_intermediate_size: int = 0
    dense_layers: tuple[int, ...] = ()
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self):
        if self.head_dim == 0:
            self.head_dim = self.hidden_size // self.num_heads
        if self.rotary_dim == 0:
            self.rotary_dim = self.head_dim
        if not (0 < self.rotary_dim <= self.head_dim and self.rotary_dim % 2 == 0):
            raise QuantSpecError(f"partial_rotary_factor gives {self.rotary_dim} rotary dimensions of a head of "
                                 f"{self.head_dim}; it must give an even number from 2 to {self.head_dim}; "
                                 "fix config.json")
        if self.num_heads % self.num_kv_heads:
            raise QuantSpecError(
                f"num_attention_heads={self.num_heads} is not a multiple of "
                f"num_key_value_heads={self.num_kv_heads}; fix config.json"
            )
        if rope_type(self) not in ROPE_TYPES:
            raise QuantSpecError(
                f"rope_scaling type {rope_type(self)!r} is not supported; supported: "
                f"{', '.join(sorted(ROPE_TYPES))}"
            )
        if self.hidden_act not in ACTIVATIONS:
            raise QuantSpecError(f"hidden_act {self.hidden_act!r} is not supported; supported: "
                                 f"{', '.join(ACTIVATIONS)}; fix config.json")
        if self.num_experts and not 1 <= self.experts_per_token <= self.num_experts:
            raise QuantSpecError(f"num_experts_per_tok={self.experts_per_token} must lie in 1..num_experts="
                                 f"{self.num_experts}; fix config.json")

    def is_moe_layer(self, i: int) -> bool:
        """Whether decoder layer i's MLP is a mixture of experts."""
        return self.num_experts > 0 and i not in self.dense_layers

    @property
    def attention_window(self) -> int | None:
        """The window the layers of `window_layers` attend within (the keys of the last this many
        positions, its own included), as the engine runs it; None: every layer the whole context."""
        return self.sliding_window if self.window_layers else None

    def context_limit(self) -> int | None:
        """The longest context quantspec runs as the model computes it (`check_context`), None:
        any up to the position tables."""
        limits = [self.sliding_window] if self._unslid_window else []
        if rope_type(self) in ("longrope", "su"):
            limits.append(int(self.rope_scaling["original_max_position_embeddings"]))
        return min(limits) if limits else None

    @property
    def _unslid_window(self) -> bool:
        return self.sliding_window is not None and not self.window_layers

    def check_context(self, length: int, flag: str) -> None:
        """Refuse, naming `flag`, a context longer than the model's sliding window where no layer
        slides it, or than the original context of a LongRoPE model (quantspec runs its short
        factors: `rope.py`)."""
        if rope_type(self) in ("longrope", "su"):
            short = int(self.rope_scaling["original_max_position_embeddings"])
            if length > short:
                raise QuantSpecError(f"{flag} {length} is over this model's original context of {short} tokens "
                                     "(rope_scaling longrope): quantspec runs its short factors, which hold up to "
                                     f"{short} tokens; use {flag} {short} or less")
        if self._unslid_window and length > self.sliding_window:
            raise QuantSpecError(f"{flag} {length} is over this model's sliding window of {self.sliding_window} tokens "
                                 "(config.json sliding_window): quantspec attends to the whole context, the same "
                                 f"up to {self.sliding_window} tokens only; use {flag} {self.sliding_window} or less")

    def scale_embeddings(self, x: torch.Tensor) -> torch.Tensor:
        """The embeddings the first layer takes: Granite's × embedding_multiplier; Gemma's ×
        √hidden_size rounded to the embeddings' dtype, as transformers scales them."""
        m = self.embedding_multiplier
        if m != 1.0 and self.arch.startswith("gemma"):
            m = float(torch.tensor(m, dtype=x.dtype))
        return x if m == 1.0 else x * m

    def scale_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The head's output as the model's logits: Granite's ÷ logits_scaling, Gemma 2's soft cap."""
        if self.logits_scaling != 1.0:
            logits = logits / self.logits_scaling
        return torch.tanh(logits / self.logit_softcap) * self.logit_softcap if self.logit_softcap else logits

    @property
    def multiplied(self) -> bool:
        """Whether Granite's multipliers scale anything (stack runners that leave them out decline)."""
        return any(getattr(self, k) != v for k, v in NEUTRAL_MULTIPLIERS.items())

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_hf_config(cls, cfg: dict) -> "ModelArgs":
        """The args of a HF config.json (`hf_config.args_fields`)."""
        return cls(**args_fields(cfg, ARCHITECTURES))


def rope_tables(args: ModelArgs, max_positions: int, device=None) -> dict[bool, tuple[torch.Tensor, torch.Tensor]]:
    """{whether for Gemma 3's window layers (`Attention.local_rope`): cos / sin [max_positions,
    rotary_dim]}: the model's tables, and where its window layers turn by a rotary base of their own
    (`local_rope_theta`, the default rope), theirs."""
    tables = {False: rope_cos_sin(args, max_positions, device)}
    if args.local_rope_theta:
        tables[True] = rope_cos_sin(replace(args, rope_theta=args.local_rope_theta, rope_scaling=None),
                                    max_positions, device)
    return tables


# ---------------------------------------------------------------------------------------------
# attention backends


class AttentionBackend(Protocol):
    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [T, H, hd], k/v: [T, KV, hd] (rotary applied) → out [T, H, hd]."""


class StackRunner(Protocol):
    """Runs every decoder layer of a model in one call (an inference backend's)."""

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionBackend,
                 out_rows: torch.Tensor | None, row_invariant: bool, capture: tuple[int, ...] = ()
                 ) -> torch.Tensor | tuple[torch.Tensor, tuple[torch.Tensor, ...]] | None:
        """x [T, D] embeddings, cos / sin [T, hd] → the last layer's output ([T, D], or its
        `out_rows` rows); with `capture` (layer ids), (that output, the residual stream [T, D]
        entering each id's layer, in `capture`'s order; id L: the last layer's output over every
        row); None where the modules must run."""


# ---------------------------------------------------------------------------------------------
# modules


def project(linear: nn.Module, x: torch.Tensor, row_invariant: bool) -> torch.Tensor:
    """`linear(x)`; in a row-invariant forward, a linear that declares `takes_row_invariant` is
    called with `row_invariant=True` (its numbers for a row then do not depend on the others)."""
    if row_invariant and getattr(type(linear), "takes_row_invariant", False):
        return linear(x, row_invariant=True)
    return linear(x)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = args.num_heads, args.num_kv_heads, args.head_dim
        self.q_proj = nn.Linear(args.hidden_size, args.q_size, bias=args.qkv_bias)
        self.k_proj = nn.Linear(args.hidden_size, args.kv_size, bias=args.qkv_bias)
        self.v_proj = nn.Linear(args.hidden_size, args.kv_size, bias=args.qkv_bias)
        self.o_proj = nn.Linear(args.q_size, args.hidden_size, bias=args.o_bias)
        self.qkv_proj: nn.Module | None = None  # q/k/v stacked in one projection (`infer.fuse`)
        n, self.qk_norm_per_head = (args.head_dim if args.qk_norm_per_head else None), args.qk_norm_per_head
        self.q_norm = RMSNorm.of(args, n or args.q_size) if args.qk_norm else None
        self.k_norm = RMSNorm.of(args, n or args.kv_size) if args.qk_norm else None
        self.rotary_emb = RotaryEmbedding()
        self.use_rope = layer_idx not in args.nope_layers  # False: a NoPE layer (positions from the mask alone)
        # Gemma 3's window layers turn by their own rotary tables (`Transformer.local_cos`)
        self.local_rope = bool(args.local_rope_theta) and layer_idx in args.window_layers
        # Granite's attention_multiplier as a factor on q: the backends scale scores by head_dim ** -0.5
        self.q_scale = args.attention_multiplier * args.head_dim ** 0.5 if args.attention_multiplier else None

    def forward(self, x, cos, sin, attn: AttentionBackend, row_invariant: bool = False):
        T = x.shape[0]
        H, KV, hd = self.num_heads, self.num_kv_heads, self.head_dim
        if self.qkv_proj is not None:
            qkv = project(self.qkv_proj, x, row_invariant).view(T, H + 2 * KV, hd)
            qk = qkv[:, :H + KV]
            if self.q_norm is not None:
                qk = torch.cat(self._qk_norm(qk[:, :H], qk[:, H:]), dim=1)
            if self.use_rope:
                qk = self.rotary_emb(qk, cos, sin)  # q and k rotated in one pass
            q, k, v = qk[:, :H], qk[:, H:], qkv[:, H + KV:]
            if self.q_scale is not None:
                q = q * self.q_scale
        else:
            q = project(self.q_proj, x, row_invariant).view(T, H, hd)  # [T, H, hd]
            k = project(self.k_proj, x, row_invariant).view(T, KV, hd)  # [T, KV, hd]
            v = project(self.v_proj, x, row_invariant).view(T, KV, hd)
            if self.q_norm is not None:
                q, k = self._qk_norm(q, k)
            if self.use_rope:
                q, k = self.rotary_emb(q, cos, sin), self.rotary_emb(k, cos, sin)
            if self.q_scale is not None:
                q = q * self.q_scale
        out = attn(self.layer_idx, q, k, v)  # [T, H, hd]
        return project(self.o_proj, out.reshape(T, self.num_heads * self.head_dim), row_invariant)

    def _qk_norm(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, H, hd], k [T, KV, hd] normalized per head, or over each whole projection."""
        if self.qk_norm_per_head:
            return self.q_norm(q), self.k_norm(k)
        T = q.shape[0]
        return self.q_norm(q.reshape(T, -1)).view(q.shape), self.k_norm(k.reshape(T, -1)).view(k.shape)


class MLP(nn.Module):
    def __init__(self, args: ModelArgs, intermediate: int | None = None):
        super().__init__()
        inter = intermediate or args.intermediate_size
        self.gate_proj = nn.Linear(args.hidden_size, inter, bias=args.mlp_bias)
        self.up_proj = nn.Linear(args.hidden_size, inter, bias=args.mlp_bias)
        self.down_proj = nn.Linear(inter, args.hidden_size, bias=args.mlp_bias)
        self.gate_up_proj: nn.Module | None = None  # gate/up stacked in one projection (`infer.fuse`)
        self.act = ACTIVATIONS[args.hidden_act]
        self.act_fn = SiluAndMul() if args.hidden_act == "silu" else GeluTanhAndMul()

    def forward(self, x, row_invariant: bool = False):
        if self.gate_up_proj is not None:
            return project(self.down_proj, self.act_fn(project(self.gate_up_proj, x, row_invariant)), row_invariant)
        h = self.act(project(self.gate_proj, x, row_invariant)) * project(self.up_proj, x, row_invariant)
        return project(self.down_proj, h, row_invariant)


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int):
        super().__init__()
        self.residual_multiplier = args.residual_multiplier  # Granite's: each block's output before its add
        # `ModelArgs.post_norms` / `pre_norms`: OLMo 2's layers have no input_layernorm; Gemma's have four norms
        self.post_norms, self.pre_norms, D = args.post_norms, args.pre_norms, args.hidden_size
        self.input_layernorm = RMSNorm.of(args, D) if args.pre_norms else None
        self.self_attn = Attention(args, layer_idx)
        self.post_attention_layernorm = RMSNorm.of(args, D)
        if args.post_norms:
            self.post_feedforward_layernorm = RMSNorm.of(args, D)
            self.pre_feedforward_layernorm = RMSNorm.of(args, D) if args.pre_norms else None
        if args.is_moe_layer(layer_idx):
            from quantspec.model_zoo.moe import SparseMoE  # moe builds on this file's MLP

            # Mixtral names it block_sparse_moe; `mlp` reaches it all the same (`__getattr__`)
            setattr(self, "block_sparse_moe" if args.arch == "mixtral" else "mlp", SparseMoE(args))
        else:
            self.mlp = MLP(args)

    def __getattr__(self, name: str):
        if name == "mlp" and "block_sparse_moe" in self._modules:
            return self._modules["block_sparse_moe"]
        return super().__getattr__(name)

    def forward(self, x, cos, sin, attn, row_invariant: bool = False):
        if self.post_norms:
            a = x if self.input_layernorm is None else self.input_layernorm(x)
            x = x + self.post_attention_layernorm(self.self_attn(a, cos, sin, attn, row_invariant))
            m = x if self.pre_feedforward_layernorm is None else self.pre_feedforward_layernorm(x)
            return x + self.post_feedforward_layernorm(self.mlp(m, row_invariant))
        r = self.residual_multiplier
        h = self.self_attn(self.input_layernorm(x), cos, sin, attn, row_invariant)
        x = x + (h if r == 1.0 else h * r)
        h = self.mlp(self.post_attention_layernorm(x), row_invariant)
        return x + (h if r == 1.0 else h * r)


class Decoder(nn.Module):
    """HF's `model.*` subtree: embeddings, layers, final norm."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(args, i) for i in range(args.num_layers))
        self.norm = RMSNorm.of(args, args.hidden_size)


class Transformer(nn.Module):
    """A decoder-only LM. `forward` returns pre-norm hidden states `[T, D]` (what an MTP module
    consumes); `compute_logits` applies the final norm and the head to the rows you need."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model = Decoder(args)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        if args.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self._rope_len = 0
        self.cos: torch.Tensor | None = None
        self.sin: torch.Tensor | None = None
        self.local_cos: torch.Tensor | None = None  # Gemma 3's window layers' (`ModelArgs.local_rope_theta`)
        self.local_sin: torch.Tensor | None = None

    def setup_rope(self, max_positions: int, device=None) -> None:
        """(Re)build the rotary tables; called after weights are materialised."""
        device = device or self.model.norm.weight.device
        tables = rope_tables(self.args, max_positions, device)
        (self.cos, self.sin), (self.local_cos, self.local_sin) = tables[False], tables.get(True, (None, None))
        self._rope_len = max_positions

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend,
                out_rows: torch.Tensor | None = None, *, row_invariant: bool = False,
                stack: StackRunner | None = None, capture: tuple[int, ...] = ()
                ) -> torch.Tensor | tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """input_ids, positions: [T] → hidden [T, D] before the final norm; with `out_rows` [N]
        (int64 row indices) only those rows, [N, D]. Every row still runs through every layer's
        attention (its keys / values are cached); a stack runner may skip the last layer's o
        projection and MLP for the rows not asked for. `row_invariant`: each row's numbers as it
        gets alone, whatever the other rows (module docstring). `stack`: a `StackRunner` tried
        before the modules. `capture`: layer ids in 0..L → (the hidden states, the residual
        streams [T, D] entering those layers in `capture`'s order; id L: the last layer's output,
        every row of it whatever `out_rows`)."""
        assert input_ids.ndim == 1 and positions.shape == input_ids.shape
        capture = tuple(capture)
        if any(not 0 <= i <= self.args.num_layers for i in capture):
            raise QuantSpecError(f"capture ids {capture} must lie in 0..{self.args.num_layers} (the number of layers)")
        if self.cos is None or int(positions.max()) >= self._rope_len:
            need = max(int(positions.max()) + 1, self.args.max_position_embeddings)
            self.setup_rope(need)
        x = self.embed(input_ids)  # [T, D]
        # HF casts the fp32 tables to the activations' dtype
        cos, sin = self.cos[positions].to(x.dtype), self.sin[positions].to(x.dtype)  # [T, hd]
        local = None if self.local_cos is None else (self.local_cos[positions].to(x.dtype),
                                                     self.local_sin[positions].to(x.dtype))
        if stack is not None and local is None:  # (stack runners turn every layer by one table)
            out = stack(x, cos, sin, attn, out_rows, row_invariant, capture)
            if out is not None:
                return out
        streams: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.model.layers):
            if i in capture:
                streams[i] = x
            x = layer(x, *(local if layer.self_attn.local_rope else (cos, sin)), attn, row_invariant)
        streams[len(self.model.layers)] = x
        out = x if out_rows is None else x[out_rows]
        return (out, tuple(streams[i] for i in capture)) if capture else out

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The embeddings the first layer takes (`ModelArgs.scale_embeddings`)."""
        return self.args.scale_embeddings(self.model.embed_tokens(input_ids))

    def compute_logits(self, hidden: torch.Tensor, row_invariant: bool = False) -> torch.Tensor:
        """hidden: [N, D] (pre-norm) → logits [N, V] in fp32 (`ModelArgs.scale_logits`)."""
        return self.args.scale_logits(project(self.lm_head, self.model.norm(hidden), row_invariant).float())

    def head_weight(self) -> torch.Tensor:
        """The head's effective weight [V, D]: a float head's own (an inference-packed one
        unpacked through its `dense_weight()`), a quantized head's head(I)ᵀ."""
        head, a = self.lm_head, self.args
        w = head.dense_weight() if hasattr(head, "dense_weight") else getattr(head, "weight", None)
        if not isinstance(w, torch.Tensor) or not w.is_floating_point() or w.shape != (a.vocab_size, a.hidden_size):
            x = self.model.norm.weight
            eye = torch.eye(a.hidden_size, dtype=x.dtype, device=x.device)
            with torch.no_grad():
                w = head(eye).t()
        return w.detach()
