"""The multi-token-prediction (MTP) module: one extra block that drafts the token after next.

DeepSeek-V3 (arXiv:2412.19437, §2.2) predicts token t_{i+2} from two inputs: the base model's
pre-norm hidden state h_i (which produced t_{i+1}) and the embedding of t_{i+1}:

    x      = eh_proj([enorm(emb(t_{i+1})); hnorm(h_i)])      # [N, 2D] → [N, D]
    h'_i   = block(x)                                        # one Llama decoder layer
    logits = lm_head(norm(h'_i))                             # predicts t_{i+2}

h'_i is chained: (h'_i, t_{i+2}) drafts t_{i+3}, and so on for k drafts. The embedding table and
the head are the BASE's (shared, never stored here); the artifact holds only enorm, hnorm,
eh_proj, the block and the final norm. Concat order (embedding first) follows vLLM / HF
DeepSeek-V3 checkpoints.

Two choices keep drafting cheap on CPU (documented, because they differ from DeepSeek-V3):
- window-1 attention: the block attends only to its own position (`SelfOnlyAttention`), so the
  MTP keeps no KV cache and nothing has to be kept in step with accepted tokens; h_i already
  carries the context. The layer keeps the standard Llama parameter names (q/k included, unused
  by the window-1 attention) so the artifact is a decoder layer to every quantizer.
- a draft vocabulary: the head scores only `draft_vocab_ids` (the most frequent targets in the
  training data, rows gathered from the base's lm_head), since the [V, D] head projection is most
  of a draft's cost (49152 × 576 for SmolLM2 vs ~4M MACs for the block). Tokens outside it are
  never drafted; verification stays lossless (their draft probability is 0).

Artifact (`config.json`): `architectures: ["QuantSpecMTP"]`, `model_type: "quantspec_mtp"`,
the block's hyper-parameters under the usual HF names (`num_hidden_layers: 1`), and
`mtp_base` = {architecture, hidden_size, vocab_size, fingerprint}: a module for a different base
is refused with the mismatching field named. Tensors: see `mtp_weight_table`.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from quantspec.errors import QuantSpecError
from quantspec.model_zoo.llama import (
    ARCHITECTURES,
    NEUTRAL_MULTIPLIERS,
    DecoderLayer,
    ModelArgs,
    RMSNorm,
    Transformer,
    layer_weight_table,
)

__all__ = [
    "MTP_ARCHITECTURE",
    "MTP_MODEL_TYPE",
    "MTPArgs",
    "MTPModule",
    "SelfOnlyAttention",
    "base_fingerprint",
    "check_mtp_matches_base",
    "is_mtp_config",
    "load_mtp",
    "mtp_weight_table",
    "save_mtp",
]

MTP_ARCHITECTURE = "QuantSpecMTP"
MTP_MODEL_TYPE = "quantspec_mtp"
DRAFT_VOCAB_NAME = "draft_vocab_ids"
_STRUCTURAL = ("arch", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
               "head_dim", "vocab_size", "tie_word_embeddings")


def base_fingerprint(args: ModelArgs) -> str:
    """A short hash of the base's structure (not its weights, so quantized copies of the same base
    share it): 16 hex digits of sha256 over the structural ModelArgs fields, and the rotations
    fused into its weights where there are any (`calib.rotate`: they change its hidden states)."""
    fields = {k: getattr(args, k) for k in _STRUCTURAL}
    blob = json.dumps(fields | ({"rotation": args.rotation} if args.rotation else {}), sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def is_mtp_config(cfg: dict) -> bool:
    """True for an MTP artifact's config.json (what loaders and `quantize` branch on)."""
    return MTP_ARCHITECTURE in (cfg.get("architectures") or []) or cfg.get("model_type") == MTP_MODEL_TYPE


@dataclass
class MTPArgs:
    """The block's hyper-parameters (the base's, one layer) and the base it belongs to."""

    block: ModelArgs
    base_architecture: str
    base_fingerprint: str
    draft_vocab_size: int

    @classmethod
    def for_base(cls, base: ModelArgs, draft_vocab_size: int | None = None) -> "MTPArgs":
        block = ModelArgs(**{**base.__dict__, "num_layers": 1, "eos_token_ids": list(base.eos_token_ids),
                             "num_experts": 0, "dense_layers": (), "nope_layers": ()})  # a dense block, every base
        arch = next(k for k, v in ARCHITECTURES.items() if v == base.arch)
        vd = base.vocab_size if draft_vocab_size is None else min(int(draft_vocab_size), base.vocab_size)
        if vd < 1:
            raise QuantSpecError(f"draft_vocab_size={draft_vocab_size} must be >= 1")
        return cls(block, arch, base_fingerprint(base), vd)

    def to_config(self) -> dict:
        b = self.block
        cfg = {
            "architectures": [MTP_ARCHITECTURE],
            "model_type": MTP_MODEL_TYPE,
            "hidden_size": b.hidden_size,
            "intermediate_size": b.intermediate_size,
            "num_hidden_layers": 1,
            "num_attention_heads": b.num_heads,
            "num_key_value_heads": b.num_kv_heads,
            "head_dim": b.head_dim,
            "rms_norm_eps": b.rms_norm_eps,
            "rope_parameters": {"rope_theta": b.rope_theta, "rope_type": "default"}
            | ({"partial_rotary_factor": b.rotary_dim / b.head_dim} if b.rotary_dim != b.head_dim else {}),
            # the block is the base's layer: Granite's multipliers as its base has them (a Granite
            # config's attention_multiplier is the score scale itself; 0 here is head_dim ** -0.5)
            **({k: getattr(b, k) for k in NEUTRAL_MULTIPLIERS}
               | {"attention_multiplier": b.attention_multiplier or b.head_dim ** -0.5} if b.arch == "granite" else {}),
            # Gemma's score scale, activation and caps (`hf_config.gemma_fields`)
            **({"query_pre_attn_scalar": round(b.attention_multiplier ** -2, 6) if b.attention_multiplier
                else b.head_dim, "hidden_activation": b.hidden_act, "attn_logit_softcapping": b.attn_softcap or None,
                "final_logit_softcapping": b.logit_softcap or None} if b.arch.startswith("gemma") else {}),
            "max_position_embeddings": b.max_position_embeddings,
            "vocab_size": b.vocab_size,
            "tie_word_embeddings": b.tie_word_embeddings,
            "attention_bias": b.o_bias,
            "mlp_bias": b.mlp_bias,
            "draft_vocab_size": self.draft_vocab_size,
            "mtp_base": {
                "architecture": self.base_architecture,
                "hidden_size": b.hidden_size,
                "vocab_size": b.vocab_size,
                "fingerprint": self.base_fingerprint,
            },
        }
        return cfg

    @classmethod
    def from_config(cls, cfg: dict, where: str = "config.json") -> "MTPArgs":
        if not is_mtp_config(cfg):
            raise QuantSpecError(
                f"{where} is not an MTP module (architectures {cfg.get('architectures')}); pass a directory "
                f"written by `quantspec zoo train-mtp`"
            )
        base = cfg.get("mtp_base") or {}
        if "architecture" not in base or "fingerprint" not in base:
            raise QuantSpecError(f"{where} lacks mtp_base.architecture/fingerprint; re-create it with train-mtp")
        block = ModelArgs.from_hf_config({**cfg, "architectures": [base["architecture"]]})
        block.tie_word_embeddings = bool(cfg.get("tie_word_embeddings", False))
        return cls(block, base["architecture"], base["fingerprint"], int(cfg.get("draft_vocab_size", block.vocab_size)))


def check_mtp_matches_base(mtp: MTPArgs, base: ModelArgs, where: str = "the MTP module") -> None:
    """Refuse an MTP built for another base, naming the first field that differs."""
    b = mtp.block
    if b.hidden_size != base.hidden_size:
        raise QuantSpecError(
            f"{where} was trained for hidden size {b.hidden_size} but the base has {base.hidden_size}; "
            f"train an MTP for this base (quantspec zoo train-mtp --model BASE)"
        )
    if b.vocab_size != base.vocab_size:
        raise QuantSpecError(
            f"{where} was trained for vocab size {b.vocab_size} but the base has {base.vocab_size}; "
            f"train an MTP for this base (quantspec zoo train-mtp --model BASE)"
        )
    if mtp.base_fingerprint != base_fingerprint(base):
        raise QuantSpecError(
            f"{where} was trained for another base (fingerprint {mtp.base_fingerprint} != "
            f"{base_fingerprint(base)}: layers/heads/intermediate size or rotations (quantize --rotate) differ); "
            "train one for this base"
        )


class SelfOnlyAttention:
    """Window-1 attention: each token attends only to itself, so softmax = 1 and the output is
    its own value vector, repeated over the query heads of its KV group. No KV cache."""

    def __call__(self, layer_idx, q, k, v):  # q [T, H, hd], v [T, KV, hd] → [T, H, hd]
        return v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)


class _MTPTrunk(nn.Module):
    """HF-style `model.*` subtree of the MTP artifact."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        D = args.hidden_size
        self.enorm = RMSNorm(D, args.rms_norm_eps)
        self.hnorm = RMSNorm(D, args.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * D, D, bias=False)
        self.layers = nn.ModuleList([DecoderLayer(args, 0)])
        self.norm = RMSNorm(D, args.rms_norm_eps)


class MTPModule(nn.Module):
    """One MTP depth. `bind_base(base)` attaches the base's embedding and head (shared, not
    parameters of this module); then `forward(hidden, token_ids)` → the MTP's hidden and
    `draft_logits(mtp_hidden)` scores the draft vocabulary."""

    def __init__(self, args: MTPArgs):
        super().__init__()
        self.args = args
        self.model = _MTPTrunk(args.block)
        self.register_buffer("draft_vocab_ids", torch.arange(args.draft_vocab_size, dtype=torch.int64))
        self._shared: dict = {}  # base modules/tensors; a dict so they stay out of state_dict()
        self._attn = SelfOnlyAttention()
        self._cos = self._sin = None

    # -- the base's shared parts -----------------------------------------------------------------

    def bind_base(self, base: Transformer) -> "MTPModule":
        """Share `base`'s embedding and gather the draft vocabulary's rows of its head."""
        check_mtp_matches_base(self.args, base.args)
        w = base.head_weight()  # [V, D]
        self._shared = {
            "embed": base.model.embed_tokens,
            "base_norm": base.model.norm,  # the base's final norm: `teacher_logits` (training)
            "head": w[self.draft_vocab_ids.to(w.device)].to(self.model.norm.weight.dtype).contiguous(),  # [Vd, D]
        }
        return self

    def set_draft_vocab(self, ids: torch.Tensor) -> None:
        """ids: [Vd] int64 full-vocab token ids the head scores (re-bind the base afterwards)."""
        assert ids.ndim == 1 and ids.dtype == torch.int64
        self.draft_vocab_ids = ids.to(self.draft_vocab_ids.device).clone()
        self.args.draft_vocab_size = int(ids.numel())
        self._shared = {}

    # -- compute -------------------------------------------------------------------------------

    def forward(self, hidden: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        """hidden: [N, D] pre-norm (base's, or this module's for chained drafts); token_ids: [N]
        (the token each hidden produced) → MTP pre-norm hidden [N, D]."""
        assert hidden.ndim == 2 and token_ids.shape == hidden.shape[:1], (hidden.shape, token_ids.shape)
        if not self._shared:
            raise QuantSpecError("MTP module is not bound to its base; call bind_base(base) first")
        emb = self._shared["embed"](token_ids).to(hidden.dtype)  # [N, D]
        m = self.model
        x = m.eh_proj(torch.cat([m.enorm(emb), m.hnorm(hidden)], dim=-1))  # [N, D]
        n, hd = x.shape[0], self.args.block.head_dim
        if self._cos is None or self._cos.shape[0] < n or self._cos.device != x.device:
            # identity rotation: with window-1 attention positions cannot matter
            self._cos = torch.ones(max(n, 64), hd, device=x.device)
            self._sin = torch.zeros(max(n, 64), hd, device=x.device)
        return m.layers[0](x, self._cos[:n], self._sin[:n], self._attn)  # [N, D]

    def draft_logits(self, mtp_hidden: torch.Tensor, head: nn.Module | None = None) -> torch.Tensor:
        """mtp_hidden: [N, D] → logits over the draft vocabulary [N, Vd] fp32 (map column j to
        token `draft_vocab_ids[j]`). `head`: a module computing the product with the shared head's
        rows (an inference backend's, e.g. those rows rounded to int8); None: `F.linear` with them.
        Scaled as the base scales its own (`ModelArgs.scale_logits`: Granite's, Gemma 2's soft cap)."""
        x = self.model.norm(mtp_hidden)
        return self._scaled((head(x) if head is not None else F.linear(x, self._shared["head"])).float())

    def teacher_logits(self, base_hidden: torch.Tensor) -> torch.Tensor:
        """The base's own logits over the draft vocabulary for its pre-norm hidden states
        [N, D] → [N, Vd] fp32 (the soft targets of `zoo train-mtp`)."""
        if not self._shared:
            raise QuantSpecError("MTP module is not bound to its base; call bind_base(base) first")
        return self._scaled(F.linear(self._shared["base_norm"](base_hidden), self._shared["head"]).float())

    def _scaled(self, logits: torch.Tensor) -> torch.Tensor:
        return self.args.block.scale_logits(logits)

    def full_logits(self, mtp_hidden: torch.Tensor) -> torch.Tensor:
        """[N, D] → [N, V] fp32 with -inf outside the draft vocabulary (for sampled drafts)."""
        return self.to_full_vocab(self.draft_logits(mtp_hidden))

    def to_full_vocab(self, d: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits [N, Vd] → [N, V] fp32, -inf outside the draft vocabulary."""
        out = torch.full((d.shape[0], self.args.block.vocab_size), float("-inf"), device=d.device)
        return out.index_copy_(1, self.draft_vocab_ids, d.float())


# ---------------------------------------------------------------------------------------------
# artifact


def mtp_weight_table(args: MTPArgs) -> dict[str, tuple[int, ...]]:
    """Every tensor of an (unquantized) MTP artifact, with its shape. The block is named like a
    decoder layer (`model.layers.0.*`), so compressed-tensors targets apply unchanged."""
    b = args.block
    D = b.hidden_size
    table: dict[str, tuple[int, ...]] = {
        "model.enorm.weight": (D,),
        "model.hnorm.weight": (D,),
        "model.eh_proj.weight": (D, 2 * D),
        "model.norm.weight": (D,),
        DRAFT_VOCAB_NAME: (args.draft_vocab_size,),
    }
    table.update(layer_weight_table(b, "model.layers.0."))
    return table


def save_mtp(mtp: MTPModule, out_dir: str | os.PathLike, extra_config: dict | None = None) -> Path:
    """Write config.json + model.safetensors into `out_dir`, each file replaced atomically."""
    from quantspec.model_zoo.checkpoint import save_module

    cfg = mtp.args.to_config()
    cfg.update(extra_config or {})
    return save_module(mtp, out_dir, cfg)


def load_mtp(path: str | os.PathLike, base: Transformer | None = None, *, dtype: torch.dtype = torch.float32,
             device: str | torch.device = "cpu") -> MTPModule:
    """Load an unquantized MTP artifact (built on meta, `assign=True`), checked against its weight
    table and — given `base` — against the base (then bound to it)."""
    from quantspec.model_zoo.checkpoint import (
        check_against_table,
        load_checkpoint_tensors,
        read_config,
    )

    path = Path(path).expanduser()
    if not (path / "config.json").exists():
        raise QuantSpecError(f"MTP module {path} has no config.json; pass a directory from `quantspec zoo train-mtp`")
    cfg = read_config(path)
    args = MTPArgs.from_config(cfg, where=str(path / "config.json"))
    if cfg.get("quantization_config"):
        raise QuantSpecError(f"{path} is a quantized MTP artifact; load it with quantspec.infer.spec.mtp.load_mtp_for_inference")
    if base is not None:
        check_mtp_matches_base(args, base.args, where=f"MTP module {path}")
    tensors = load_checkpoint_tensors(path)
    table = mtp_weight_table(args)
    check_against_table(tensors, table, str(path))
    unexpected = sorted(set(tensors) - set(table))
    if unexpected:
        raise QuantSpecError(f"{path}: unexpected tensor {unexpected[0]} for an MTP module")
    with torch.device("meta"):
        mtp = MTPModule(args)
    mtp.load_state_dict({k: (v if k == DRAFT_VOCAB_NAME else v.to(dtype)) for k, v in tensors.items()},
                        assign=True)
    mtp.to(device).eval()
    if base is not None:
        mtp.bind_base(base)
    return mtp
