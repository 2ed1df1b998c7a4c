"""The EAGLE-3 draft head (Li et al. 2025, arXiv:2503.01840) in the layout vLLM
(`Eagle3LlamaForCausalLM`) and SGLang (`LlamaForCausalLMEagle3`) load.

Words. The base's *aux features* at a position are its residual stream entering three decoder
layers (a low, a middle and a high one), the *aux layers*: id i is the input of layer i, i.e. the
output of layer i - 1 (id 0: the embeddings, id L: the last layer's output before the final
norm). By default they are (2, L // 2, L - 3), the layers vLLM's and SGLang's defaults capture
alike. A head row at position p reads the token t_{p+1}
and a D-wide hidden state and predicts t_{p+2}:

    g      = fc(cat(aux_low, aux_mid, aux_high))       # [T, D]  the base's row p (3·D → D)
           | the head's own pre-norm output of row p-1  # chained drafts skip `fc`
    x      = cat(input_layernorm(embed(t_{p+1})), hidden_norm(g))     # [T, 2·D]
    a      = g + o_proj(attention(q/k/v_proj(x), rotary at position p, causal over the head's KV))
    out    = a + mlp(post_attention_layernorm(a))      # pre-norm: the next draft row's hidden
    logits = lm_head(norm(out))                        # [T, Vd] over the draft vocabulary

The draft vocabulary maps to the base's by `d2t` [Vd] int64 (target id = d + d2t[d]); `t2d`
[V] bool marks the target ids that are in it. The head has no embedding of its own: it reads
the base's `embed_tokens` (vLLM and SGLang share the target's when the checkpoint has none).

Artifact: a Llama `config.json` with `num_hidden_layers` 1, `architectures`
["LlamaForCausalLMEagle3"], `draft_vocab_size`, `tie_word_embeddings` false (SGLang ties
`lm_head` to the full embedding otherwise), `target_hidden_size` and `eagle_config`
{`use_aux_hidden_state`: true}; a `quantspec` block records the base's layer count and
fingerprint. A head on the default aux layers writes no layer ids: the engines read explicit
`eagle_aux_hidden_state_layer_ids` one layer apart (vLLM captures the input of layer i, SGLang
the output of layer i), and without them both capture the default layers. A head on other
layers writes them in vLLM's (quantspec's) sense. Tensors: `eagle3_weight_table` (the published
names).

Variants (`VARIANT_FLAGS`, read as vLLM reads them; the speculators format's options, which
`model_zoo/speculators.py` reads): `norm_before_residual` adds the attention to hidden_norm(g);
`norm_before_fc` RMS-normalizes the concatenated aux features (`input_norm`), `fc_norm` each
one (`fc_norm.i`), before `fc`; `norm_output` chains norm(out) instead of out; a Qwen3 decoder
layer (`Eagle3Qwen3ForCausalLM`) normalizes each head's q and k. Any number of aux layers.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from quantspec.errors import QuantSpecError
from quantspec.model_zoo.llama import MLP, NEUTRAL_MULTIPLIERS, ModelArgs, RMSNorm, RotaryEmbedding, rope_cos_sin
from quantspec.model_zoo.mtp import base_fingerprint
from quantspec.model_zoo.speculators import LAYER_ARCHITECTURES, eagle3_config, is_speculators_config, to_plain_names

__all__ = ["EAGLE3_ARCHITECTURE", "EAGLE3_ATTENTION", "Eagle3Args", "Eagle3Head", "check_eagle3_matches_base",
           "default_aux_layers", "eagle3_weight_table", "is_eagle3_config", "load_eagle3", "save_eagle3"]

EAGLE3_ARCHITECTURE = "LlamaForCausalLMEagle3"  # in both vLLM's registry and SGLang's EntryClass
_ARCH_NAMES = (EAGLE3_ARCHITECTURE, "Eagle3LlamaForCausalLM", "Eagle3Qwen3ForCausalLM")
INT_BUFFERS = ("d2t", "t2d")  # kept in their own dtypes on load
EAGLE3_ATTENTION = "midlayer.self_attn"  # the head's attention, by its checkpoint name (its KV scales')
# the layer variants vLLM reads from a head's config (speculators' EAGLE-3 options), all off in the
# plain layout
VARIANT_FLAGS = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")

# attend(q [T, H, hd], k [T, KV, hd], v [T, KV, hd]) -> [T, H, hd]: the head's KV cache policy
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def is_eagle3_config(cfg: dict) -> bool:
    """An EAGLE-3 head's config.json (an EAGLE-3 architecture, an `eagle_config` block, or the
    speculators format's EAGLE-3, `model_zoo/speculators.py`)."""
    return any(a in _ARCH_NAMES for a in cfg.get("architectures") or ()) or "eagle_config" in cfg \
        or cfg.get("speculators_model_type") == "eagle3"


def default_aux_layers(num_layers: int) -> tuple[int, int, int]:
    """vLLM's default aux layer ids for a base of `num_layers` layers."""
    return 2, num_layers // 2, num_layers - 3


@dataclass(frozen=True)
class Eagle3Args:
    layer: ModelArgs  # the head's decoder layer (vocab_size: the base's)
    draft_vocab_size: int
    aux_layer_ids: tuple[int, ...] | None  # None: the base's default aux layers
    target_hidden_size: int
    base_num_layers: int | None = None
    base_fingerprint: str | None = None
    norm_before_residual: bool = False  # the attention's residual is hidden_norm(g), not g
    norm_before_fc: bool = False  # one RMSNorm (`input_norm`) over the concatenated aux features
    fc_norm: bool = False  # one RMSNorm per aux feature (`fc_norm.i`) before the concatenation
    norm_output: bool = False  # the next draft row's hidden is norm(out), not the pre-norm out

    @property
    def num_aux(self) -> int:
        return 3 if self.aux_layer_ids is None else len(self.aux_layer_ids)

    @property
    def variants(self) -> tuple[str, ...]:
        """The config flags set on this head beyond the plain EAGLE-3 layer (`VARIANT_FLAGS`)."""
        return tuple(f for f in VARIANT_FLAGS if getattr(self, f))

    def aux_layers(self, num_layers: int) -> tuple[int, ...]:
        """The aux layer ids on a base of `num_layers` layers."""
        return default_aux_layers(num_layers) if self.aux_layer_ids is None else self.aux_layer_ids

    @classmethod
    def for_base(cls, base: ModelArgs, draft_vocab_size: int, aux_layer_ids=None) -> "Eagle3Args":
        # a dense Llama layer, with a rotary embedding and no multipliers, whatever the base
        layer = ModelArgs(**{**base.__dict__, "num_layers": 1, "tie_word_embeddings": False, "qk_norm": False,
                             "qk_norm_per_head": True, "post_norms": False, "pre_norms": True,
                             "norm_unit_offset": False, "hidden_act": "silu", "sliding_window": None,
                             "window_layers": (), "local_rope_theta": 0.0, "attn_softcap": 0.0, "logit_softcap": 0.0,
                             "eos_token_ids": list(base.eos_token_ids), "num_experts": 0,
                             "dense_layers": (), "nope_layers": (), **NEUTRAL_MULTIPLIERS})
        ids = None if aux_layer_ids is None else tuple(int(i) for i in aux_layer_ids)
        if ids == default_aux_layers(base.num_layers):
            ids = None
        return cls(layer, int(draft_vocab_size), ids, base.hidden_size, base.num_layers, base_fingerprint(base))

    def to_config(self) -> dict:
        """The head's config.json in the plain layout (the variants' flags where set, as vLLM
        reads them; a Qwen3 layer under vLLM's `Eagle3Qwen3ForCausalLM`)."""
        b = self.layer
        qs = {k: v for k, v in (("base_num_layers", self.base_num_layers),
                                ("base_fingerprint", self.base_fingerprint)) if v is not None}
        eagle = {"use_aux_hidden_state": True}
        if self.aux_layer_ids is not None:
            eagle["eagle_aux_hidden_state_layer_ids"] = list(self.aux_layer_ids)
        model_type = "qwen3" if b.qk_norm else "llama"
        return {
            "architectures": [LAYER_ARCHITECTURES[model_type][0]], "model_type": model_type,
            "hidden_size": b.hidden_size, "intermediate_size": b.intermediate_size, "num_hidden_layers": 1,
            "num_attention_heads": b.num_heads, "num_key_value_heads": b.num_kv_heads, "head_dim": b.head_dim,
            "hidden_act": "silu", "rms_norm_eps": b.rms_norm_eps, "rope_theta": b.rope_theta,
            "rope_scaling": b.rope_scaling, "max_position_embeddings": b.max_position_embeddings,
            "vocab_size": b.vocab_size, "draft_vocab_size": self.draft_vocab_size,
            "target_hidden_size": self.target_hidden_size, "tie_word_embeddings": False,
            "attention_bias": False, "mlp_bias": False, "bias": False, "eagle_config": eagle, "quantspec": qs,
        } | ({"partial_rotary_factor": b.rotary_dim / b.head_dim} if b.rotary_dim != b.head_dim else {}) \
            | dict.fromkeys(self.variants, True)

    @classmethod
    def from_config(cls, cfg: dict, where: str = "config.json") -> "Eagle3Args":
        """The head's args from its config.json, plain or speculators format."""
        if is_speculators_config(cfg):
            cfg = eagle3_config(cfg, where)
        elif not is_eagle3_config(cfg):
            raise QuantSpecError(f"{where} is not an EAGLE-3 head (architectures {cfg.get('architectures')}); "
                                 "train one with `quantspec zoo train-draft-head --kind eagle3`")
        if cfg.get("num_hidden_layers", 1) != 1:
            raise QuantSpecError(f"{where}: num_hidden_layers {cfg.get('num_hidden_layers')}; quantspec runs "
                                 "EAGLE-3 heads of one decoder layer (midlayer)")
        qwen3 = "Eagle3Qwen3ForCausalLM" in (cfg.get("architectures") or ()) or cfg.get("model_type") == "qwen3"
        causal_lm = LAYER_ARCHITECTURES["qwen3" if qwen3 else "llama"][1]  # the layer's own class
        layer = ModelArgs.from_hf_config({**cfg, "architectures": [causal_lm]})
        layer.tie_word_embeddings = False
        eagle = cfg.get("eagle_config") or {}
        ids = eagle.get("eagle_aux_hidden_state_layer_ids") or cfg.get("eagle_aux_hidden_state_layer_ids")
        if ids is not None and (not ids or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids)):
            raise QuantSpecError(f"{where}: eagle_aux_hidden_state_layer_ids must list layer ids (got {ids!r}), "
                                 "e.g. [2, L // 2, L - 3] for a base of L layers")
        if eagle.get("use_aux_hidden_state") is False:
            raise QuantSpecError(f"{where}: use_aux_hidden_state false; quantspec runs EAGLE-3 heads that read "
                                 "the base's aux hidden states through fc")
        flags = {f: bool(eagle.get(f, cfg.get(f, False))) for f in VARIANT_FLAGS}
        if flags["norm_before_fc"] and flags["fc_norm"]:
            raise QuantSpecError(f"{where}: norm_before_fc and fc_norm are both set; a head has one of them "
                                 "(a single RMSNorm over the aux features, or one per feature)")
        vd = cfg.get("draft_vocab_size") or layer.vocab_size
        qs = cfg.get("quantspec") or {}
        return cls(layer, int(vd), None if ids is None else tuple(ids),
                   int(cfg.get("target_hidden_size") or layer.hidden_size),
                   qs.get("base_num_layers"), qs.get("base_fingerprint"), **flags)


def check_eagle3_matches_base(args: Eagle3Args, base: ModelArgs, where: str = "the EAGLE-3 head") -> None:
    """Refuse a head built for another base, naming the first thing that differs and the fix."""
    fix = "train a head for this base with `quantspec zoo train-draft-head --kind eagle3 --model BASE`"
    for name, mine, theirs in (("hidden size", args.target_hidden_size, base.hidden_size),
                               ("hidden size", args.layer.hidden_size, base.hidden_size),
                               ("vocab size", args.layer.vocab_size, base.vocab_size)):
        if mine != theirs:
            raise QuantSpecError(f"{where} was trained for a base with {name} {mine}, this base has {theirs}; {fix}")
    if base.rotation:  # a head trained before the base was rotated can be turned rather than retrained
        fix += " (or turn one trained on the base before --rotate: `quantspec zoo rotate-head --model HEAD --base BASE`)"
    if args.base_fingerprint is not None and args.base_fingerprint != base_fingerprint(base):
        what = "layers / heads / sizes or rotations (quantize --rotate) differ"
        raise QuantSpecError(f"{where} was trained for another base (fingerprint {args.base_fingerprint} != "
                             f"{base_fingerprint(base)}: {what}); {fix}")
    if args.base_fingerprint is None and base.rotation:
        raise QuantSpecError(f"{where} records no base, and this base has rotations fused into its weights "
                             f"({base.rotation}), which change the hidden states the head reads; {fix}")
    bad = [i for i in args.aux_layers(base.num_layers) if not 0 <= i <= base.num_layers]
    if bad:
        raise QuantSpecError(f"{where} reads aux hidden states of layer {bad[0]}, outside this base's "
                             f"0..{base.num_layers}; {fix}")


class Eagle3Attention(nn.Module):
    """Attention of the head's layer: q/k/v read the 2·D input, o writes D; a Qwen3 layer
    RMS-normalizes each head's q and k before the rotary embedding. `kv_hook(k, v)`, when set,
    sees the keys [T, KV, hd] (post-rotary) and values its cache stores (calibration observes
    them there)."""

    kv_hook = None

    def __init__(self, a: ModelArgs):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = a.num_heads, a.num_kv_heads, a.head_dim
        self.q_proj = nn.Linear(2 * a.hidden_size, a.q_size, bias=False)
        self.k_proj = nn.Linear(2 * a.hidden_size, a.kv_size, bias=False)
        self.v_proj = nn.Linear(2 * a.hidden_size, a.kv_size, bias=False)
        self.o_proj = nn.Linear(a.q_size, a.hidden_size, bias=False)
        if a.qk_norm:
            self.q_norm, self.k_norm = RMSNorm(a.head_dim, a.rms_norm_eps), RMSNorm(a.head_dim, a.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = nn.Identity()
        self.rotary_emb = RotaryEmbedding()

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: Attend) -> torch.Tensor:
        T, H, KV, hd = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        q = self.rotary_emb(self.q_norm(self.q_proj(x).view(T, H, hd)), cos, sin)  # [T, H, hd]
        k = self.rotary_emb(self.k_norm(self.k_proj(x).view(T, KV, hd)), cos, sin)  # [T, KV, hd]
        v = self.v_proj(x).view(T, KV, hd)
        if self.kv_hook is not None:
            self.kv_hook(k, v)
        return self.o_proj(attend(q, k, v).reshape(T, H * hd))


class Eagle3Layer(nn.Module):
    """`midlayer`: the decoder layer over [input_layernorm(embedding) ; hidden_norm(hidden)];
    `norm_before_residual`: the attention adds to hidden_norm(hidden), not to hidden."""

    def __init__(self, a: ModelArgs, norm_before_residual: bool = False):
        super().__init__()
        self.norm_before_residual = norm_before_residual
        self.hidden_norm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.input_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.self_attn = Eagle3Attention(a)
        self.post_attention_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.mlp = MLP(a)

    def forward(self, emb, hidden, cos, sin, attend: Attend) -> torch.Tensor:
        normed = self.hidden_norm(hidden)
        x = torch.cat([self.input_layernorm(emb), normed], dim=-1)  # [T, 2D]
        h = (normed if self.norm_before_residual else hidden) + self.self_attn(x, cos, sin, attend)
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3Head(nn.Module):
    """The head (module docstring). `embed` is the base's embedding, bound with `bind_embedding`.
    `kv_cache`: the static KV cache its artifact asks for (`infer.spec.head_kv.HeadKV`), None for
    a float one."""

    kv_cache = None

    def __init__(self, args: Eagle3Args):
        super().__init__()
        self.args = args
        a, n = args.layer, args.num_aux
        T = args.target_hidden_size
        if args.norm_before_fc:
            self.input_norm = RMSNorm(n * T, a.rms_norm_eps)
        if args.fc_norm:
            self.fc_norm = nn.ModuleList(RMSNorm(T, a.rms_norm_eps) for _ in range(n))
        self.fc = nn.Linear(n * T, a.hidden_size, bias=False)
        self.midlayer = Eagle3Layer(a, args.norm_before_residual)
        self.norm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.lm_head = nn.Linear(a.hidden_size, args.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(args.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.zeros(a.vocab_size, dtype=torch.bool))
        self._embed: list[nn.Module] = []  # the base's (a list: not a submodule, not saved)
        self.own_embed: tuple[str, torch.Tensor] | None = None  # a head file's copy, until bound
        self.cos: torch.Tensor | None = None
        self.sin: torch.Tensor | None = None

    def bind_embedding(self, embed: nn.Module) -> "Eagle3Head":
        """Read the base's embedding. A head file's own copy (`own_embed`: where it came from,
        the tensor) must be that embedding (a quantized one's float source: rounding to its codes):
        the head runs on the base's, where vLLM would run a distinct copy of its own, so a head
        trained on another embedding is refused here."""
        if self.own_embed is not None:
            where, own = self.own_embed
            if hasattr(embed, "codes_match"):  # a `QuantEmbedding`: the copy must round to its codes
                same = embed.codes_match(own)
            else:
                base = embed.weight.detach()
                same = own.shape == base.shape and torch.allclose(own.to(base.device, torch.float32), base.float(),
                                                                  rtol=1e-2, atol=1e-3)
            if not same:
                raise QuantSpecError(f"{where}: the head's embed_tokens differs from the base's embedding; the "
                                     "head belongs to another base: pass its own base, or train one with "
                                     "`quantspec zoo train-draft-head --kind eagle3 --model BASE`")
            self.own_embed = None
        self._embed[:] = [embed]
        return self

    def set_draft_vocab(self, ids: torch.Tensor) -> None:
        """The draft vocabulary as target ids [Vd] (sorted ascending, as the published maps are)."""
        ids = ids.to(torch.int64).sort().values
        self.d2t.copy_(ids - torch.arange(ids.numel(), device=ids.device))
        self.t2d.zero_()
        self.t2d[ids] = True

    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        """The base's aux features [T, n·T_D] (the aux layers' rows side by side) → the head's
        hidden [T, D]: `fc`, after `input_norm` or the per-feature `fc_norm` where the head has them."""
        if self.args.norm_before_fc:
            aux = self.input_norm(aux)
        if self.args.fc_norm:
            aux = torch.cat([norm(x) for norm, x in zip(self.fc_norm, aux.chunk(self.args.num_aux, dim=-1))], dim=-1)
        return self.fc(aux)

    def target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        need = int(positions.max()) + 1
        if self.cos is None or self.cos.shape[0] < need or self.cos.device != positions.device:
            n = max(need, 2 * (0 if self.cos is None else self.cos.shape[0]), 4096)
            self.cos, self.sin = rope_cos_sin(self.args.layer, n, positions.device)
        return self.cos[positions].to(dtype), self.sin[positions].to(dtype)  # [T, hd]

    def forward(self, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, attend: Attend
                ) -> torch.Tensor:
        """tokens [T] (t_{p+1}), hidden [T, D] (`fuse`d aux features or the head's own output),
        positions [T] (p) → the head's output [T, D], the next draft row's hidden: pre-norm, or
        normed with `norm_output`."""
        emb = self._embed[0](tokens).to(hidden.dtype)  # [T, D]
        cos, sin = self.rope(positions, hidden.dtype)
        out = self.midlayer(emb, hidden, cos, sin, attend)
        return self.norm(out) if self.args.norm_output else out

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """out [T, D] (`forward`'s) → draft logits [T, Vd] fp32."""
        return self.lm_head(out if self.args.norm_output else self.norm(out)).float()


def eagle3_weight_table(args: Eagle3Args) -> dict[str, tuple[int, ...]]:
    """Every tensor of an unquantized head, with its shape (the names vLLM and SGLang read)."""
    a, D, n, T = args.layer, args.layer.hidden_size, args.num_aux, args.target_hidden_size
    p = "midlayer."
    variant = ({"input_norm.weight": (n * T,)} if args.norm_before_fc else {}) \
        | ({f"fc_norm.{i}.weight": (T,) for i in range(n)} if args.fc_norm else {}) \
        | ({p + "self_attn.q_norm.weight": (a.head_dim,), p + "self_attn.k_norm.weight": (a.head_dim,)}
           if a.qk_norm else {})
    return variant | {
        "fc.weight": (D, n * T),
        p + "hidden_norm.weight": (D,), p + "input_layernorm.weight": (D,),
        p + "self_attn.q_proj.weight": (a.q_size, 2 * D), p + "self_attn.k_proj.weight": (a.kv_size, 2 * D),
        p + "self_attn.v_proj.weight": (a.kv_size, 2 * D), p + "self_attn.o_proj.weight": (D, a.q_size),
        p + "post_attention_layernorm.weight": (D,), p + "mlp.gate_proj.weight": (a.intermediate_size, D),
        p + "mlp.up_proj.weight": (a.intermediate_size, D), p + "mlp.down_proj.weight": (D, a.intermediate_size),
        "norm.weight": (D,), "lm_head.weight": (args.draft_vocab_size, D),
        "d2t": (args.draft_vocab_size,), "t2d": (a.vocab_size,),
    }


def check_draft_maps(head: Eagle3Head, where: str) -> None:
    """`d2t` must map every draft id into the base's vocabulary."""
    tgt = head.target_ids(torch.arange(head.args.draft_vocab_size, device=head.d2t.device))
    V = head.args.layer.vocab_size
    if tgt.numel() and (int(tgt.min()) < 0 or int(tgt.max()) >= V):
        raise QuantSpecError(f"{where}: d2t maps draft ids to target ids outside the base's vocabulary of {V}; "
                             "the head belongs to another base: train one with `quantspec zoo train-draft-head "
                             "--kind eagle3 --model BASE`")


def save_eagle3(head: Eagle3Head, out_dir: str | os.PathLike, extra_config: dict | None = None) -> Path:
    """Write config.json + model.safetensors into `out_dir`, each file replaced atomically."""
    from quantspec.model_zoo.checkpoint import save_module

    return save_module(head, out_dir, head.args.to_config(), extra_config)


def load_eagle3(path: str | os.PathLike, base: ModelArgs | None = None, *, dtype: torch.dtype = torch.float32,
                device: str | torch.device = "cpu") -> Eagle3Head:
    """Load an unquantized head (built on meta, `assign=True`), checked against the weight table
    and, given the base's args, against the base. Bind the base's embedding before running it."""
    from quantspec.model_zoo.checkpoint import check_exactly_table, load_checkpoint_tensors, read_config

    path = Path(path).expanduser()
    cfg = read_config(path)
    if cfg.get("quantization_config"):
        raise QuantSpecError(f"{path} is quantized; load it with quantspec.infer.spec.eagle.load_eagle3_for_inference")
    args = Eagle3Args.from_config(cfg, where=str(path / "config.json"))
    if base is not None:
        check_eagle3_matches_base(args, base, where=f"EAGLE-3 head {path}")
    tensors = to_plain_names(load_checkpoint_tensors(path))
    own_embed = tensors.pop("embed_tokens.weight", None)  # a copy of the base's (checked when bound)
    if not {"d2t", "t2d"} & set(tensors) and args.draft_vocab_size == args.layer.vocab_size:
        # a head over the whole vocabulary may leave out its (identity) maps, as vLLM allows
        tensors["d2t"] = torch.zeros(args.draft_vocab_size, dtype=torch.int64)
        tensors["t2d"] = torch.ones(args.layer.vocab_size, dtype=torch.bool)
    check_exactly_table(tensors, eagle3_weight_table(args), str(path), "an EAGLE-3 head")
    with torch.device("meta"):
        head = Eagle3Head(args)
    head.load_state_dict({k: (v if k in INT_BUFFERS else v.to(dtype)) for k, v in tensors.items()}, assign=True)
    check_draft_maps(head, str(path))
    head.own_embed = None if own_embed is None else (str(path), own_embed)
    return head.to(device).eval()


def causal_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Plain causal attention over one sequence's rows: q [T, H, hd], k / v [T, KV, hd]."""
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                         is_causal=True, enable_gqa=q.shape[1] != k.shape[1])  # (1, H, T, hd)
    return out[0].transpose(0, 1)
