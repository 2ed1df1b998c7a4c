"""Training an EAGLE-3 head (`model_zoo/eagle3.py`) for a frozen base by self-distillation, with
EAGLE-3's multi-step *training-time test*.

Rows. A training sequence is tokens t_0..t_{L-1} (the base's own greedy answers to chat prompts,
or dataset windows) with the base's aux features at every position and its argmax `nxt[p]` (its
choice for t_{p+1}): the target of a draft for position p + 1 is the base's choice there, so the
head learns the base, not the text (`eagle3_rows`).

Training-time test. Step 0 runs the head as drafting's catch-up does: row p reads fc(aux_p) and
t_{p+1} at position p, attends causally over step 0's keys, and is scored against nxt[p + 1].
Step s ≥ 1 unrolls the head on its own output: row p reads the previous step's output of row p and
the token t_{p+1+s} at position p + s, is scored against nxt[p + 1 + s], and attends to step 0's
keys of positions ≤ p plus its own chain's keys of steps 1..s (row p of each step) — exactly what
the s-th draft after position p sees at inference. Step s's loss weighs `step_decay`^s.

Loss. By default (`soft_targets`) the forward KL from the base's distribution over the draft
vocabulary at the target position (its logits there: the rows' final-normed hidden state times
its lm_head rows of the draft vocabulary, `teacher_rows`), as EAGLE-3 trains: more signal per
position than the argmax, which regularises a head trained on a few hundred answers. Hard targets:
the cross-entropy against the base's argmax. Either way over the draft vocabulary (the most
frequent targets); positions whose argmax is outside it are not scored.

Initialisation (same arguments → same weights): the layer from the base's last decoder layer (q /
k / v read the hidden half, the embedding half zero; of a mixture of experts, the MLP as
`moe.warm_mlp` picks it), `fc` picking the highest aux feature, the
final norm and `lm_head`'s rows from the base's. Checkpoints are resumable
(`mtp_train.check_resumable`).
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from quantspec.errors import QuantSpecError
from quantspec.model_zoo.eagle3 import Eagle3Args, Eagle3Head, save_eagle3
from quantspec.model_zoo.llama import DenseCausalAttention, Transformer
from quantspec.model_zoo.moe import copy_mlp, warm_mlp
from quantspec.model_zoo.mtp_train import (IGNORE, STATE_NAME, MTPTrainConfig, atomic_torch_save, check_resumable,
                                           open_optimizer, optimizer_step)

__all__ = ["Eagle3Rows", "Eagle3TrainConfig", "choose_eagle3_vocab", "eagle3_rows", "init_eagle3", "prepared_rows",
           "teacher_rows", "train_eagle3", "ttt_losses", "ttt_outputs"]


@dataclass
class Eagle3Rows:
    """Training sequences: tokens [L] int64, feats [L, 3·D] bf16, nxt [L] int64 (the base's argmax),
    final [L, D] bf16 (the base's final-normed hidden state: its logits are final @ lm_headᵀ)."""

    tokens: list[torch.Tensor]
    feats: list[torch.Tensor]
    nxt: list[torch.Tensor]
    final: list[torch.Tensor]

    def __len__(self) -> int:
        return len(self.tokens)

    def positions(self) -> int:
        return sum(int(t.numel()) for t in self.tokens)


@torch.no_grad()
def eagle3_rows(base: Transformer, sequences: list[torch.Tensor], aux_layer_ids: tuple[int, ...]) -> Eagle3Rows:
    """The base's aux features, final-normed hidden state and argmax at every position of each
    sequence (one forward each, capturing the aux layers' streams)."""
    rows = Eagle3Rows([], [], [], [])
    for seq in sequences:
        ids = seq.to(torch.int64)
        n = ids.numel()
        hidden, streams = base(ids, torch.arange(n), DenseCausalAttention.of(base.args, 1, n),
                               capture=tuple(aux_layer_ids))
        rows.tokens.append(ids.cpu())
        rows.feats.append(torch.cat(streams, dim=-1).to(torch.bfloat16).cpu())  # [n, 3D]
        rows.nxt.append(base.compute_logits(hidden).argmax(-1).cpu())
        rows.final.append(base.model.norm(hidden).to(torch.bfloat16).cpu())
    return rows


def init_eagle3(base: Transformer, draft_vocab: torch.Tensor, aux_layer_ids=None) -> Eagle3Head:
    """A fresh head for `base` (module docstring)."""
    a = base.args
    head = Eagle3Head(Eagle3Args.for_base(a, int(draft_vocab.numel()), aux_layer_ids))
    w = base.model.norm.weight
    head.to(w.device, w.dtype)
    src, D = base.model.layers[-1], a.hidden_size
    with torch.no_grad():
        head.fc.weight.zero_()
        head.fc.weight[:, -D:].copy_(torch.eye(D))
        mid = head.midlayer
        for name in ("q_proj", "k_proj", "v_proj"):
            mine = getattr(mid.self_attn, name).weight
            mine.zero_()
            mine[:, D:].copy_(getattr(src.self_attn, name).weight)
        mid.self_attn.o_proj.weight.copy_(src.self_attn.o_proj.weight)
        copy_mlp(mid.mlp, warm_mlp(base, mid.mlp))
        norms = [(head.norm, base.model.norm)]
        if not src.post_norms:  # a post-norm base's (OLMo 2's) norms sit elsewhere: the head's start at ones
            norms += [(mid.hidden_norm, src.input_layernorm), (mid.input_layernorm, src.input_layernorm),
                      (mid.post_attention_layernorm, src.post_attention_layernorm)]
        for mine, theirs in norms:  # (the scale of a Gemma norm is 1 + its weight)
            mine.weight.copy_(theirs.weight + 1.0 if theirs.unit_offset else theirs.weight)
        head.set_draft_vocab(draft_vocab.to(w.device))
        head.lm_head.weight.copy_(teacher_rows(base, head))
    return head.bind_embedding(base.model.embed_tokens)


def _ttt_attend(keys: list[torch.Tensor], values: list[torch.Tensor], kv=None):
    """attend() of training-time-test step len(keys): step 0 causal, later steps the diagonal;
    with `kv` (a quantized head's static KV cache, `infer.spec.head_kv.HeadKV`) the keys and
    values are read as that cache stores them."""
    def attend(q, k, v):  # q [n, H, hd], k / v [n, KV, hd]
        if kv is not None:
            k, v = kv.load(*kv.store(k, v), q.dtype)
        keys.append(k)
        values.append(v)
        n = q.shape[0]
        idx = torch.arange(n, device=q.device)
        blocks = [idx[None, :] <= idx[:, None]] + [torch.eye(n, dtype=torch.bool, device=q.device)] * (len(keys) - 1)
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], torch.cat(keys).transpose(0, 1)[None], torch.cat(values).transpose(0, 1)[None],
            attn_mask=torch.cat(blocks, dim=1), enable_gqa=q.shape[1] != k.shape[1])  # (1, H, n, hd)
        return out[0].transpose(0, 1)
    return attend


def ttt_outputs(head: Eagle3Head, tokens: torch.Tensor, feats: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """The head's pre-norm outputs [L-1, D] at each training-time-test step (module docstring):
    step s, row p at position p + s reads the token t_{p+1+s} (rows whose token is past the end
    read token 0 and are never scored)."""
    L, dev = tokens.numel(), head.norm.weight.device
    n = L - 1  # rows p = 0..L-2 read t_{p+1}
    p = torch.arange(n, device=dev)
    hidden = head.fuse(feats[:n].to(dev, head.norm.weight.dtype))  # [n, D]
    attend = _ttt_attend([], [], head.kv_cache)
    outs = []
    for s in range(min(steps, n)):
        tok = torch.cat([tokens[1 + s:], tokens.new_zeros(s)]).to(dev)  # [n]
        hidden = head(tok, hidden, p + s, attend)  # [n, D]
        outs.append(hidden)
    return outs


def ttt_losses(head: Eagle3Head, tokens: torch.Tensor, feats: torch.Tensor, nxt: torch.Tensor, lut: torch.Tensor,
               steps: int, teacher: torch.Tensor | None = None) -> tuple[list[torch.Tensor], list[float]]:
    """The training-time test over one sequence: per step, the mean loss over its scored rows
    (row p of step s against the base's choice for position p + 2 + s) and its top-1 accuracy.
    tokens / nxt [L] int64, feats [L, 3D]; `lut` maps target ids to draft ids (IGNORE: none).
    `teacher` [L, Vd] (the base's logits over the draft vocabulary): the loss is the forward KL
    from the base's distribution there (cross-entropy against it), else the cross-entropy
    against its argmax. Rows whose argmax is outside the draft vocabulary are not scored."""
    n = tokens.numel() - 1
    losses, accs = [], []
    for s, hidden in enumerate(ttt_outputs(head, tokens, feats, steps)):
        tgt = torch.full((n,), IGNORE, dtype=torch.int64, device=hidden.device)
        tgt[:n - 1 - s] = lut[nxt[1 + s:n].to(hidden.device)]
        ok = tgt >= 0
        if not bool(ok.any()):
            break
        logits = head.logits(hidden[ok])  # [m, Vd]
        if teacher is None:
            losses.append(F.cross_entropy(logits, tgt[ok]))
        else:
            want = teacher[1 + s:n].to(hidden.device)[ok[:n - 1 - s]].float()  # [m, Vd]
            losses.append(-(torch.softmax(want, -1) * torch.log_softmax(logits, -1)).sum(-1).mean())
        accs.append(float((logits.argmax(-1) == tgt[ok]).float().mean()))
    return losses, accs


# the default recipe (`zoo train-draft-head --kind eagle3`), about 20 minutes on 2 idle CPU cores
# with the self-distillation: the first 512 built-in chat prompts answered, 900 steps of 4
# sequences (all 1,618 prompts take about 35 minutes and accept no more on held-out chat)
EAGLE3_CHAT_PROMPTS = 512
EAGLE3_STEPS = 900


@dataclass
class Eagle3TrainConfig(MTPTrainConfig):
    ttt_steps: int = 4  # training-time-test depth
    soft_targets: bool = True  # forward KL from the base's distribution over the draft vocabulary
    step_decay: float = 0.8
    seq_len: int = 256  # longest window of a sequence per example
    seqs_per_step: int = 4


def _batch_losses(head: Eagle3Head, rows: Eagle3Rows, config: Eagle3TrainConfig, lut: torch.Tensor,
                  teacher_weight: torch.Tensor | None, g: torch.Generator) -> tuple[list, list[list[float]]]:
    """One step's sequences (a random window of `seq_len` of each): their training-time-test
    losses, each weighed `step_decay`^s, and per-sequence accuracies."""
    total, accs = [], []
    for i in torch.randint(len(rows), (config.seqs_per_step,), generator=g).tolist():
        L = rows.tokens[i].numel()
        a = int(torch.randint(max(1, L - config.seq_len + 1), (1,), generator=g))
        sl = slice(a, a + config.seq_len)
        teacher = None
        if config.soft_targets:
            w = teacher_weight.to(head.norm.weight.device)
            teacher = rows.final[i][sl].to(w.device, w.dtype) @ w.T  # [l, Vd] the base's logits
        losses, acc = ttt_losses(head, rows.tokens[i][sl], rows.feats[i][sl], rows.nxt[i][sl], lut, config.ttt_steps,
                                 teacher)
        total += [config.step_decay ** s * loss for s, loss in enumerate(losses)]
        accs.append(acc)
    return total, accs


def train_eagle3(head: Eagle3Head, rows: Eagle3Rows, config: Eagle3TrainConfig, out_dir: str | os.PathLike, *,
                 resume: bool = False, extra_config: dict | None = None, teacher_weight: torch.Tensor | None = None,
                 on_step: Callable[[int, int, float, list[float]], None] | None = None) -> dict:
    """Train the head (fc, midlayer, norm, lm_head) on `rows`; checkpoints into `out_dir`. →
    {"steps", "start_step", "loss_first", "loss_last", "losses", "accuracy_last"} (accuracy: top-1
    per training-time-test step over the last step's sequences). `on_step(step, total, loss, accs)`.
    `config.soft_targets` needs `teacher_weight` [Vd, D]: the base's lm_head rows of the draft
    vocabulary in draft-id order (`teacher_rows`)."""
    if config.soft_targets and teacher_weight is None:
        raise QuantSpecError("soft targets need the base's lm_head rows of the draft vocabulary (teacher_weight)")
    out = Path(out_dir)
    state_path = out / STATE_NAME
    check_resumable(out, config, resume)
    out.mkdir(parents=True, exist_ok=True)
    params = list(head.parameters())
    opt, start, history = open_optimizer(head, params, config, state_path if resume else None, "d2t", head.d2t)
    if start >= config.steps:
        return {"steps": config.steps, "start_step": start, "loss_first": None, "loss_last": None, "losses": []}
    V = head.args.layer.vocab_size
    lut = torch.full((V,), IGNORE, dtype=torch.int64, device=head.d2t.device)  # target id → draft id
    lut[head.target_ids(torch.arange(head.args.draft_vocab_size, device=head.d2t.device))] = \
        torch.arange(head.args.draft_vocab_size, device=head.d2t.device)

    def save(step: int) -> None:
        save_eagle3(head, out, {"training": {**(extra_config or {}), "step": step, **asdict(config)}})
        atomic_torch_save({"step": step, "model": head.state_dict(), "optimizer": opt.state_dict(),
                           "d2t": head.d2t.cpu(), "losses": history, "config": asdict(config)}, state_path)

    run_losses, accs = [], []
    head.train()
    for step in range(start, config.steps):
        g = torch.Generator().manual_seed(config.seed * 1_000_003 + step)
        for group in opt.param_groups:
            group["lr"] = config.lr_at(step)
        total, accs = _batch_losses(head, rows, config, lut, teacher_weight, g)
        if not total:
            continue
        history.append(optimizer_step(opt, torch.stack(total).sum() / config.seqs_per_step, params))
        run_losses.append(history[-1])
        per_step = [sum(a[s] for a in accs if len(a) > s) / max(1, sum(len(a) > s for a in accs))
                    for s in range(max(map(len, accs)))]
        if on_step is not None:
            on_step(step + 1, config.steps, history[-1], per_step)
        if (step + 1) % config.save_every == 0 or step + 1 == config.steps:
            save(step + 1)
    head.eval()
    return {"steps": config.steps, "start_step": start, "loss_first": run_losses[0] if run_losses else None,
            "loss_last": run_losses[-1] if run_losses else None, "losses": run_losses}


def teacher_rows(base: Transformer, head: Eagle3Head) -> torch.Tensor:
    """The base's lm_head rows of the head's draft vocabulary, in draft-id order: [Vd, D] (a frozen
    copy: the head's own `lm_head` starts from them and trains)."""
    ids = head.target_ids(torch.arange(head.args.draft_vocab_size, device=head.d2t.device))
    return base.head_weight()[ids.to(base.model.norm.weight.device)].detach().clone()


def choose_eagle3_vocab(rows: Eagle3Rows, size: int, vocab_size: int, always=()) -> torch.Tensor:
    """The `size` most frequent base choices plus `always` (e.g. eos), sorted: [Vd] target ids."""
    t = torch.cat(rows.nxt)
    counts = torch.bincount(t, minlength=vocab_size).double()  # [V]
    counts[list(always)] = float("inf")
    return counts.topk(min(size, vocab_size)).indices.sort().values.to(torch.int64)


def prepared_rows(base: Transformer, out: Path, key: dict, sequences: Callable[[], list[torch.Tensor]],
                  draft_vocab_size: int, aux_layer_ids, say=lambda _m: None
                  ) -> tuple[Eagle3Rows, torch.Tensor, tuple[int, ...]]:
    """The training sequences' rows, the draft vocabulary and the aux layer ids: from
    `out/train_features.pt` when an earlier run with the same `key` saved them, else from
    `sequences()` (token tensors) and saved there first."""
    from quantspec.model_zoo.eagle3 import default_aux_layers
    from quantspec.model_zoo.mtp_train import FEATURES_NAME

    path = out / FEATURES_NAME
    L = base.args.num_layers
    aux = Eagle3Args.for_base(base.args, 1, aux_layer_ids).aux_layers(L)
    if len(aux) != 3 or not all(0 <= i <= L for i in aux):
        raise QuantSpecError(f"--aux-layer-ids {','.join(map(str, aux))}: give 3 layer ids in 0..{L} for this base "
                             f"(id i reads the input of layer i; default {','.join(map(str, default_aux_layers(L)))})")
    blob = torch.load(path, map_location="cpu", weights_only=False) if path.exists() else None
    if isinstance(blob, dict) and blob.get("key") == key:
        say(f"reusing the {blob['rows'].positions()} training positions saved in {path.name} by an earlier run")
        return blob["rows"], blob["vocab"], aux
    seqs = sequences()
    say(f"base aux features (layers {list(aux)}) for {len(seqs)} sequences")
    rows = eagle3_rows(base, seqs, aux)
    vocab = choose_eagle3_vocab(rows, draft_vocab_size, base.args.vocab_size, base.args.eos_token_ids)
    out.mkdir(parents=True, exist_ok=True)
    atomic_torch_save({"key": key, "rows": rows, "vocab": vocab}, path)
    return rows, vocab, aux
