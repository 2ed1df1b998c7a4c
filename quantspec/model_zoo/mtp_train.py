"""The MTP training recipe: a frozen base, its hidden states as features, one trained block.

Model-free of data loading and generation (those live in `quantspec.api.train_mtp`, which is
allowed to import `calib/` and `infer/`): this file takes token sequences — optionally with
the base's hidden states already captured — and trains an `MTPModule`.

Words:
- position i of a sequence t_0..t_{L-1}: the base's pre-norm hidden h_i (it produced t_{i+1}).
- depth-1 example: (h_i, t_{i+1}) → target t*_{i+2}; depth-2 example: (MTP hidden of depth 1,
  t_{i+2}) → t*_{i+3}, the chained draft the proposer makes for its second token.
- self-distillation (`self_distill=True`): t*_{j+1} is the base's own greedy choice at position j
  (argmax of its logits), not the text's token: acceptance is measured against the base's
  choices, so that is what the MTP should predict. On the base's own greedy generations the two
  coincide.

Because the block's attention is window-1 (see `mtp.py`), every position is an independent
example: features are flattened to rows and each step trains on `batch_tokens` random rows
(drawn from a generator seeded by (seed, step), so a resumed run sees exactly the rows the
uninterrupted run would have). Loss = CE over the draft vocabulary (targets outside it are
ignored) at depth 1 + `chain_weight` × CE at depth 2. AdamW, linear warm-up then cosine decay,
all a function of the step (nothing else to resume). Every `save_every` steps the artifact
(config.json + model.safetensors) and `train_state.pt` (weights, optimizer, step, losses) are
replaced atomically in the output directory; `resume=True` continues from `train_state.pt`.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from quantspec.errors import QuantSpecError, positive_int
from quantspec.model_zoo.llama import MLP, DenseCausalAttention, Transformer
from quantspec.model_zoo.moe import copy_mlp, warm_mlp
from quantspec.model_zoo.mtp import MTPArgs, MTPModule, save_mtp

__all__ = [
    "CHAT_PROMPTS",
    "IGNORE",
    "MTPFeatures",
    "MTPTrainConfig",
    "STATE_NAME",
    "FEATURES_NAME",
    "atomic_torch_save",
    "choose_draft_vocab",
    "distill_prompts",
    "features_from_hidden",
    "extract_features",
    "features_key",
    "init_mtp",
    "load_features",
    "train_mtp",
]

STATE_NAME = "train_state.pt"
FEATURES_NAME = "train_features.pt"  # `api.train_mtp`'s training rows, kept until the run completes
IGNORE = -100  # CE ignore_index: no target (sequence end, or outside the draft vocabulary)


@dataclass
class MTPTrainConfig:
    steps: int = 300
    batch_tokens: int = 512  # examples (positions) per step
    lr: float = 1e-3
    weight_decay: float = 0.0
    warmup_frac: float = 0.05
    min_lr_frac: float = 0.1
    chain_weight: float = 0.5  # weight of the depth-2 (chained draft) loss
    save_every: int = 100
    seed: int = 0
    draft_vocab_size: int = 4096
    # soft targets: each depth's loss is the cross-entropy against the base's own distribution for
    # that token (its logits at the next position's hidden state, over the draft vocabulary)
    # instead of its argmax; only meaningful where the base's choices are the targets
    # (self-distillation). Soft targets regularise a small dataset; on a large one they do not
    # help.
    soft_targets: bool = False

    def __post_init__(self):
        for name in ("steps", "batch_tokens", "save_every", "draft_vocab_size"):
            positive_int(name, getattr(self, name))
        if not self.lr > 0:
            raise QuantSpecError(f"--lr {self.lr} must be > 0 (e.g. 1e-3)")

    def lr_at(self, step: int) -> float:
        warm = max(1, int(self.warmup_frac * self.steps))
        if step < warm:
            return self.lr * (step + 1) / warm
        t = (step - warm) / max(1, self.steps - warm)
        return self.lr * (self.min_lr_frac + (1 - self.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * t)))


@dataclass
class MTPFeatures:
    """Flattened training rows. hidden: [N, D] (bf16 to halve memory); in1, tgt1, in2, tgt2: [N]
    int64 (tgt* = IGNORE where absent)."""

    hidden: torch.Tensor
    in1: torch.Tensor
    tgt1: torch.Tensor
    in2: torch.Tensor
    tgt2: torch.Tensor

    def __len__(self) -> int:
        return self.hidden.shape[0]

    @staticmethod
    def cat(parts: list["MTPFeatures"]) -> "MTPFeatures":
        parts = [p for p in parts if len(p)]
        if not parts:
            raise QuantSpecError("no training positions: give sequences of at least 2 tokens")
        return MTPFeatures(*(torch.cat([getattr(p, f) for p in parts]) for f in ("hidden", "in1", "tgt1", "in2", "tgt2")))


def features_from_hidden(tokens: torch.Tensor, hidden: torch.Tensor, next_pred: torch.Tensor | None) -> MTPFeatures:
    """One sequence → rows. tokens: [L]; hidden: [L-1, D] (h_0..h_{L-2}); next_pred: [L-1] the
    base's greedy choice after each position (self-distillation targets) or None (text targets).

    Row i (0 ≤ i ≤ L-2): in1 = t_{i+1}, tgt1 = pred_{i+1} (or t_{i+2}); in2 = t_{i+2},
    tgt2 = pred_{i+2} (or t_{i+3}); missing entries are IGNORE.
    """
    L = tokens.shape[0]
    assert tokens.ndim == 1 and hidden.shape[0] == L - 1, (tokens.shape, hidden.shape)
    if L < 2:
        return MTPFeatures(hidden[:0].to(torch.bfloat16), *(torch.zeros(0, dtype=torch.int64) for _ in range(4)))
    if next_pred is None:
        nxt = tokens[1:]  # [L-1] token after position j
    else:
        assert next_pred.shape == (L - 1,)
        nxt = next_pred
    pad = torch.full((2,), IGNORE, dtype=torch.int64)
    nxt = torch.cat([nxt.long(), pad])  # [L+1]
    toks = torch.cat([tokens.long(), pad])  # [L+2]
    i = torch.arange(L - 1)
    in2 = toks[i + 2].clamp(min=0)  # [L-1]; padded where tgt2 is IGNORE
    return MTPFeatures(hidden.to(torch.bfloat16), toks[i + 1], nxt[i + 1], in2, nxt[i + 2])


@torch.no_grad()
def extract_features(base: Transformer, sequences: list[torch.Tensor] | torch.Tensor, *, self_distill: bool = True,
                     max_batch_tokens: int = 2048) -> MTPFeatures:
    """Run the frozen base over token sequences (a [B, S] tensor or a list of [L] tensors) and
    return the training rows. Equal-length sequences are batched up to `max_batch_tokens`."""
    if isinstance(sequences, torch.Tensor):
        assert sequences.ndim == 2
        sequences = list(sequences)
    groups: dict[int, list[torch.Tensor]] = {}
    for s in sequences:
        if s.numel() >= 3:
            groups.setdefault(int(s.numel()), []).append(s.long())
    parts = []
    for L, seqs in groups.items():
        per = max(1, max_batch_tokens // L)
        for start in range(0, len(seqs), per):
            chunk = torch.stack(seqs[start:start + per])  # [B, L]
            B = chunk.shape[0]
            pos = torch.arange(L).repeat(B)
            hidden = base(chunk.reshape(-1).to(base.model.norm.weight.device), pos.to(base.model.norm.weight.device),
                          DenseCausalAttention.of(base.args, B, L)).view(B, L, -1)  # [B, L, D]
            preds = None
            if self_distill:
                preds = base.compute_logits(hidden[:, :-1].reshape(B * (L - 1), -1)).argmax(-1).view(B, L - 1).cpu()
            for b in range(B):
                parts.append(features_from_hidden(chunk[b], hidden[b, :-1].cpu(), None if preds is None else preds[b]))
    return MTPFeatures.cat(parts)


def choose_draft_vocab(features: MTPFeatures, size: int, vocab_size: int, always: list[int] = ()) -> torch.Tensor:
    """The `size` most frequent targets (depth 1 and 2) plus `always` (e.g. eos), sorted: [Vd]."""
    t = torch.cat([features.tgt1, features.tgt2])
    counts = torch.bincount(t[t >= 0], minlength=vocab_size).double()  # [V]
    counts[list(always)] = float("inf")
    size = min(size, vocab_size)
    return counts.topk(size).indices.sort().values.to(torch.int64)


@torch.no_grad()
def init_mtp(base: Transformer, draft_vocab: torch.Tensor, seed: int = 0) -> MTPModule:
    """A fresh MTP for `base`: the block starts as a copy of the base's last decoder layer (of a
    mixture of experts, its MLP from `warm_mlp`) and the
    final norm as the base's (a head that already reads the base's residual stream), eh_proj
    random (uniform, fan-in scaled, from `seed`), so training starts from "predict with the base's
    last layer" rather than from noise. Same arguments → same weights."""
    args = MTPArgs.for_base(base.args, int(draft_vocab.numel()))
    mtp = MTPModule(args).to(base.model.norm.weight.device, base.model.norm.weight.dtype)
    w = mtp.model.eh_proj.weight  # [D, 2D]
    bound = 1.0 / math.sqrt(w.shape[1])
    g = torch.Generator().manual_seed(seed)
    w.copy_(torch.empty(w.shape).uniform_(-bound, bound, generator=g))
    block, last = mtp.model.layers[0], base.model.layers[-1]
    if isinstance(last.mlp, MLP):
        block.load_state_dict(last.state_dict())
    else:  # a mixture of experts: attention and norms from the last layer, the MLP as `warm_mlp` picks it
        block.load_state_dict({k: v for k, v in last.state_dict().items()
                               if not k.startswith(("mlp.", "block_sparse_moe."))}, strict=False)
        copy_mlp(block.mlp, warm_mlp(base, block.mlp))
    mtp.model.norm.weight.copy_(base.model.norm.weight)
    mtp.set_draft_vocab(draft_vocab)
    return mtp.bind_base(base)


def atomic_torch_save(obj, path: Path) -> None:
    """torch.save to a temporary file beside `path`, renamed over it only when complete."""
    from quantspec.outputs import atomic_file

    with atomic_file(path) as tmp:
        torch.save(obj, tmp)


def _soft_ce(logits: torch.Tensor, teacher: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Mean over `valid` rows of −Σ softmax(teacher) · log_softmax(logits) ([N, Vd] each)."""
    ce = -(torch.softmax(teacher, -1) * torch.log_softmax(logits, -1)).sum(-1)  # [N]
    v = valid.to(ce.dtype)
    return (ce * v).sum() / v.sum().clamp(min=1)


def _losses(mtp: MTPModule, f: MTPFeatures, idx: torch.Tensor, lut: torch.Tensor, chain_weight: float,
            soft: bool = False):
    """Depth-1 and depth-2 losses on rows `idx`: CE against the targets mapped into the draft
    vocabulary by `lut`, or (`soft`) against the base's distribution at rows idx + 1 / idx + 2 —
    row i + d of the same sequence holds h_{i+d}, whose logits chose tgt_d of row i; it exists
    exactly where tgt_d is not IGNORE (`features_from_hidden`)."""
    dev = mtp.model.norm.weight.device
    dt = mtp.model.norm.weight.dtype

    def loss_at(m: torch.Tensor, depth: int, tgt: torch.Tensor) -> torch.Tensor:
        logits, t = mtp.draft_logits(m), tgt[idx]  # [N, Vd], [N] full-vocab targets (or IGNORE)
        if soft:
            with torch.no_grad():  # the base's logits for that depth's token
                teacher = mtp.teacher_logits(f.hidden[(idx + depth).clamp(max=len(f) - 1)].to(dev, dt))
            return _soft_ce(logits, teacher, (t >= 0).to(dev))
        return F.cross_entropy(logits, torch.where(t < 0, IGNORE, lut[t.clamp(min=0)]).to(dev),
                               ignore_index=IGNORE)

    m1 = mtp(f.hidden[idx].to(dev, dt), f.in1[idx].to(dev))  # [N, D]
    loss1 = loss_at(m1, 1, f.tgt1)
    if chain_weight > 0:
        loss2 = loss_at(mtp(m1, f.in2[idx].to(dev)), 2, f.tgt2)
    else:
        loss2 = torch.zeros((), device=dev)
    return loss1, loss2


def optimizer_step(opt: torch.optim.Optimizer, loss: torch.Tensor, params: list, max_norm: float = 1.0) -> float:
    """One step of `opt` on `loss` (gradients clipped to `max_norm`) → the loss as a float."""
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, max_norm)
    opt.step()
    return float(loss.detach())


def check_resumable(out_dir: str | os.PathLike, config: MTPTrainConfig, resume: bool) -> int | None:
    """Refuse, before any work, a run into a directory holding a checkpoint without `resume`, and a
    resume whose objective differs from the checkpoint's (see `_check_same_objective`). → the
    checkpoint's step, or None without one."""
    state_path = Path(out_dir) / STATE_NAME
    if not state_path.exists():
        return None
    if not resume:
        raise QuantSpecError(
            f"{out_dir} already holds a training checkpoint ({STATE_NAME}); pass --resume to continue it or "
            f"choose another --out"
        )
    try:
        state = torch.load(state_path, map_location="cpu", weights_only=False, mmap=True)
    except Exception as e:  # torn or not a checkpoint: say so in one line, touch nothing
        why = str(e).strip().splitlines()[0].split(". ")[0] if str(e).strip() else type(e).__name__
        raise QuantSpecError(f"{state_path} cannot be read ({why}); restore it, or choose another --out "
                             f"to start over") from None
    _check_same_objective(state.get("config", {}), config, state_path)
    return int(state["step"])


def _check_same_objective(saved: dict, config: MTPTrainConfig, state_path: Path) -> None:
    """A resumed run must minimise the loss the checkpoint was trained on: the targets (hard /
    soft) and the depth-2 weight. Steps, learning rate and saving cadence may change (extending a
    run is what --resume is for)."""
    was_soft = bool(saved.get("soft_targets", False))  # checkpoints from before --targets: hard
    if was_soft != config.soft_targets:
        have, want = ("soft", "hard") if was_soft else ("hard", "soft")
        raise QuantSpecError(f"{state_path} was trained with --targets {have}, not {want}; resume with "
                             f"--targets {have} or choose another --out")
    cw = saved.get("chain_weight", config.chain_weight)
    if float(cw) != float(config.chain_weight):
        raise QuantSpecError(f"{state_path} was trained with chain_weight={cw}, not {config.chain_weight}; "
                             f"resume with chain_weight={cw} or choose another --out")


def open_optimizer(module: torch.nn.Module, params: list, config: MTPTrainConfig, state_path: Path | None,
                   vocab_key: str, vocab: torch.Tensor, same_data: str = "the same data options", *,
                   strict: bool = True) -> tuple[torch.optim.Optimizer, int, list[float]]:
    """AdamW over `params`, and where the run starts: the checkpoint at `state_path` if there is
    one (its weights loaded into `module`, `strict` as `load_state_dict` takes it; its optimizer
    state, step and losses), refused when its `vocab_key` differs from the draft vocabulary
    `vocab` (`same_data`: the options that make the same); else step 0.
    → (optimizer, start step, losses so far)"""
    opt = torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay, betas=(0.9, 0.98))
    if state_path is None or not state_path.exists():
        return opt, 0, []
    state = torch.load(state_path, map_location="cpu", weights_only=False)
    if not torch.equal(state[vocab_key], vocab.cpu()):
        raise QuantSpecError(f"{state_path} was trained on other data (draft vocabulary differs); "
                             f"resume with {same_data}")
    module.load_state_dict(state["model"], strict=strict)
    opt.load_state_dict(state["optimizer"])
    return opt, int(state["step"]), list(state["losses"])


def train_mtp(mtp: MTPModule, features: MTPFeatures, config: MTPTrainConfig, out_dir: str | os.PathLike, *,
              resume: bool = False, extra_config: dict | None = None,
              on_step: Callable[[int, int, float], None] | None = None) -> dict:
    """Train `mtp` (bound to its frozen base) on `features`; checkpoints into `out_dir`.

    Returns {"steps", "start_step", "loss_first", "loss_last", "losses"} (losses: one mean depth-1
    loss per step of this run). `on_step(step, total, loss)` reports progress.
    """
    out = Path(out_dir)
    state_path = out / STATE_NAME
    check_resumable(out, config, resume)  # also the objective of a checkpoint to resume
    out.mkdir(parents=True, exist_ok=True)
    params = [p for p in mtp.model.parameters()]
    opt, start, history = open_optimizer(mtp.model, params, config, state_path if resume else None,
                                         "draft_vocab_ids", mtp.draft_vocab_ids,
                                         "the same --dataset/--seq-len/--self-distill options")
    if start >= config.steps:
        return {"steps": config.steps, "start_step": start, "loss_first": None, "loss_last": None, "losses": []}

    V = mtp.args.block.vocab_size
    lut = torch.full((V,), IGNORE, dtype=torch.int64)  # full id → draft-vocab index
    lut[mtp.draft_vocab_ids.cpu()] = torch.arange(mtp.args.draft_vocab_size)
    N = len(features)
    mtp.train()

    def save(step: int) -> None:
        save_mtp(mtp, out, {"quantspec_training": {**(extra_config or {}), "step": step, **asdict(config)}})
        atomic_torch_save({"step": step, "model": mtp.model.state_dict(), "optimizer": opt.state_dict(),
                           "draft_vocab_ids": mtp.draft_vocab_ids.cpu(), "losses": history,
                           "config": asdict(config)}, state_path)

    run_losses = []
    for step in range(start, config.steps):
        g = torch.Generator().manual_seed(config.seed * 1_000_003 + step)
        idx = torch.randint(N, (config.batch_tokens,), generator=g)  # rows, with replacement
        for group in opt.param_groups:
            group["lr"] = config.lr_at(step)
        loss1, loss2 = _losses(mtp, features, idx, lut, config.chain_weight, config.soft_targets)
        loss = loss1 + config.chain_weight * loss2
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        l1 = float(loss1.detach())
        history.append(l1)
        run_losses.append(l1)
        if on_step is not None:
            on_step(step + 1, config.steps, l1)
        if (step + 1) % config.save_every == 0 or step + 1 == config.steps:
            save(step + 1)
    mtp.eval()
    return {"steps": config.steps, "start_step": start, "loss_first": run_losses[0], "loss_last": run_losses[-1],
            "losses": run_losses}


# Varied chat instructions for self-distillation (the base answers them; the MTP learns its
# answers). Evaluation prompts must come from elsewhere: bench/data/spec_prompts.jsonl's chat
# prompts share no topic with these (tests/model_zoo/test_mtp.py checks it).
_TASKS = [
    "Explain {t} to a ten-year-old.", "Write a short poem about {t}.", "Give three tips about {t}.",
    "What are the pros and cons of {t}?", "Summarize the history of {t} in a few sentences.",
    "Write a friendly email inviting a colleague to talk about {t}.", "List five facts about {t}.",
    "How would you teach a beginner about {t}?", "Describe a typical day involving {t}.",
    "What common mistakes do people make with {t}?", "Write a short story that involves {t}.",
    "What questions do people often ask about {t}? Answer two of them.",
    "Compare {t} with something similar and explain the difference.", "Why does {t} matter?",
    "Write a product description for a book about {t}.", "Give a step-by-step guide related to {t}.",
]
_TOPICS = [
    "photosynthesis", "the water cycle", "saving money", "learning a new language", "healthy breakfast",
    "black holes", "climate change", "the Roman Empire", "machine learning", "gardening", "time management",
    "the French Revolution", "volcanoes", "electric cars", "meditation", "writing a resume", "chess",
    "recycling", "the human heart", "python programming", "baking bread", "public speaking", "the moon",
    "job interviews", "honeybees", "the internet", "first aid", "running a marathon", "ancient Egypt",
    "renewable energy", "sleep", "friendship", "the stock market", "dinosaurs", "coffee",
    "earthquakes", "the printing press", "vitamins", "jazz music", "rain forests", "credit cards",
    "sharks", "the Olympic Games", "solar panels", "yoga", "the immune system", "origami", "pirates",
    "the Great Wall of China", "smartphones", "composting", "marine biology", "the Renaissance",
    "podcasts", "hiking", "bridges", "penguins", "cryptography", "fermentation", "the piano",
    "board games", "airplanes", "tides", "kindness", "budget travel", "the periodic table", "glaciers",
    "video editing", "wolves", "democracy", "knitting", "mountains", "spreadsheets", "the Vikings",
    "coral reefs", "minimalism", "fire safety", "opera", "trains", "vaccines", "rainbows", "owls",
    "museums", "robots", "tea ceremonies", "lighthouses", "the metric system", "photography",
    "the Amazon river", "submarines", "puzzles", "libraries", "snow", "magnets", "deserts", "music theory",
    "open source software", "bees and flowers", "volunteering", "fossils",
]
_EXTRAS = [
    "What is the capital of Australia?", "How do I reverse a list in Python?", "Translate 'good morning' into Spanish.",
    "What is 15% of 240?", "Suggest a name for a pet turtle.", "How do vaccines work?",
    "Write a SQL query that counts rows in a table.", "What should I pack for a weekend camping trip?",
    "Tell me a short story about a robot who learns to paint.", "How do I make a cup of tea?",
    "What is the difference between weather and climate?", "Give me a recipe for pancakes.",
    "How can I improve my handwriting?", "Explain what a prime number is.", "Write a limerick about a cat.",
    "What are the planets in our solar system?", "Write a function in JavaScript that adds two numbers.",
    "How do I change a flat tire?",
]


def chat_prompts(n: int | None = None) -> list[str]:
    """The first `n` (all: None) built-in self-distillation prompts: every topic once before any
    topic twice, each topic's tasks rotated so that consecutive topics ask different things; the
    free-form extras first. Deterministic."""
    out = list(_EXTRAS)
    for r in range(len(_TASKS)):
        out += [_TASKS[(i * 7 + r) % len(_TASKS)].format(t=t) for i, t in enumerate(_TOPICS)]
    return out if n is None else out[: max(0, int(n))]


CHAT_PROMPTS = chat_prompts()  # `quantspec zoo train-mtp`'s default: all of them (--chat-prompts N: the first N)


def distill_prompts(prompts: int | list[str] | None) -> list[str]:
    """The chat prompts a base answers for self-distillation: every built-in one (None), the
    first `n` built-in ones (an int), or the given prompts; none at all is refused."""
    if prompts is None:
        out = list(CHAT_PROMPTS)
    elif isinstance(prompts, int) and not isinstance(prompts, bool):
        if prompts < 1:
            raise QuantSpecError(f"--chat-prompts {prompts} must be >= 1 (at most {len(chat_prompts())} built in)")
        out = chat_prompts(prompts)
    else:
        out = list(prompts)
    if not out:
        raise QuantSpecError("chat_prompts is empty: give prompts, or a count of built-in ones")
    return out


def features_key(base, model_dir, dataset, split, text_field, num_samples, seq_len, seed, self_distill, prompts,
                  max_new_tokens, draft_vocab_size) -> dict:
    """What `api.train_mtp`'s training rows and draft vocabulary are computed from (see there): the
    base (its directory and weight files as they are now), the data options, the prompts."""
    import hashlib
    import os

    from quantspec.model_zoo.mtp import base_fingerprint

    ds = None
    if dataset is not None:
        ds = {"dataset": str(dataset), "split": split, "text_field": text_field, "num_samples": num_samples,
              "seq_len": seq_len, "seed": seed}
        if os.path.exists(str(dataset)):  # a local file or directory: its contents may change
            st = os.stat(str(dataset))
            ds.update(size=st.st_size, mtime_ns=st.st_mtime_ns)
    chat = None
    if prompts is not None:
        chat = {"prompts": hashlib.sha256("\0".join(prompts).encode()).hexdigest(), "count": len(prompts),
                "max_new_tokens": max_new_tokens}
    weights = sorted((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in Path(model_dir).iterdir()
                     if f.suffix in (".safetensors", ".bin", ".gguf")) if Path(model_dir).is_dir() else []
    return {"version": 1, "base": str(Path(model_dir).resolve()), "weights": weights,
            "base_fingerprint": base_fingerprint(base.args),
            "self_distill": bool(self_distill), "dataset": ds, "chat": chat, "draft_vocab_size": draft_vocab_size}


def load_features(path, key):
    """(features, vocab, data) saved by an earlier `train_mtp` into its `out` for the same `key`,
    else None (no file, another key, or a file that cannot be read: the rows are prepared again)."""
    import torch

    if not path.exists():
        return None
    try:
        blob = torch.load(path, map_location="cpu", weights_only=False)
    except Exception:  # a damaged cache is only a cache
        return None
    if not isinstance(blob, dict) or blob.get("key") != key:
        return None
    return blob["features"], blob["vocab"], blob["data"]
