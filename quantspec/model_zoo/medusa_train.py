"""Training Medusa heads (`model_zoo/medusa.py`) by self-distillation, on the MTP recipe's rows.

The rows are the MTP recipe's (`mtp_train.MTPFeatures`: the frozen base's hidden state h_i and
its own greedy choices); head k learns the base's choice k + 2 tokens ahead of h_i, which is row
i + k's `tgt1` when rows i..i + k belong to one sequence (a sequence's last row has no `tgt1`).
Each head starts as the Medusa authors' do: ResBlocks with zero weights (the identity) and the
projection a copy of the base's lm_head, which stays frozen; only the ResBlocks train, with the
loss over the draft vocabulary (the projection's rows for the most frequent targets), so a step
costs Vd instead of V columns. Checkpoints are resumable (`mtp_train.check_resumable`).
"""

from __future__ import annotations

import os
from dataclasses import asdict
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from quantspec.model_zoo.llama import Transformer
from quantspec.model_zoo.medusa import MEDUSA_VOCAB_NAME, MedusaArgs, MedusaHeads, save_medusa
from quantspec.model_zoo.mtp_train import (IGNORE, STATE_NAME, MTPFeatures, MTPTrainConfig, atomic_torch_save,
                                           check_resumable, open_optimizer)

__all__ = ["init_medusa", "medusa_targets", "train_medusa"]


def init_medusa(base: Transformer, draft_vocab: torch.Tensor, num_heads: int = 4, num_layers: int = 1) -> MedusaHeads:
    """Fresh heads for `base` (module docstring); same arguments → same weights."""
    a = base.args
    heads = MedusaHeads(MedusaArgs(num_heads, num_layers, a.hidden_size, a.vocab_size, int(draft_vocab.numel()),
                                    a.rotation))
    heads.to(base.model.norm.weight.device, base.model.norm.weight.dtype)
    with torch.no_grad():
        for head in heads.medusa_head:
            for block in list(head)[:-1]:
                block.linear.weight.zero_()
                block.linear.bias.zero_()
            head[-1].weight.copy_(base.lm_head.weight)
            head[-1].weight.requires_grad_(False)
        getattr(heads, MEDUSA_VOCAB_NAME).copy_(draft_vocab)
    return heads


def medusa_targets(features: MTPFeatures, num_heads: int) -> torch.Tensor:
    """[N, num_heads] int64: head k's target at row i (IGNORE across a sequence's end)."""
    t = features.tgt1
    N = t.shape[0]
    out = torch.full((N, num_heads), IGNORE, dtype=torch.int64)
    ok = torch.ones(N, dtype=torch.bool)
    for k in range(num_heads):
        shifted = torch.full((N,), IGNORE, dtype=torch.int64)
        shifted[:N - k] = t[k:]
        ok &= shifted >= 0  # rows i..i+k all have a target: one sequence
        out[:, k] = torch.where(ok, shifted, IGNORE)
    return out


def train_medusa(heads: MedusaHeads, base: Transformer, features: MTPFeatures, config: MTPTrainConfig,
                 out_dir: str | os.PathLike, *, resume: bool = False, extra_config: dict | None = None,
                 on_step: Callable[[int, int, float], None] | None = None) -> dict:
    """Train the heads' ResBlocks on `features`; checkpoints into `out_dir`. → {"steps",
    "start_step", "loss_first", "loss_last", "losses"} (mean loss over heads per step)."""
    out = Path(out_dir)
    state_path = out / STATE_NAME
    check_resumable(out, config, resume)
    out.mkdir(parents=True, exist_ok=True)
    params = [p for p in heads.parameters() if p.requires_grad]
    vocab = getattr(heads, MEDUSA_VOCAB_NAME)
    opt, start, history = open_optimizer(heads, params, config, state_path if resume else None,
                                         "draft_vocab_ids", vocab, strict=False)
    if start >= config.steps:
        return {"steps": config.steps, "start_step": start, "loss_first": None, "loss_last": None, "losses": []}
    lut = torch.full((heads.args.vocab_size,), IGNORE, dtype=torch.int64)  # full id → draft index
    lut[vocab.cpu()] = torch.arange(vocab.numel())
    targets = medusa_targets(features, heads.args.num_heads)
    w_sub = heads.medusa_head[0][-1].weight[vocab].detach()  # [Vd, D], frozen and shared
    dev = w_sub.device

    def save(step: int) -> None:
        save_medusa(heads, out, {"training": {**(extra_config or {}), "step": step, **asdict(config)}})
        trained = {k: v for k, v in heads.state_dict().items() if ".linear." in k}  # not the frozen projections
        atomic_torch_save({"step": step, "model": trained, "optimizer": opt.state_dict(),
                           "draft_vocab_ids": vocab.cpu(), "losses": history, "config": asdict(config)}, state_path)

    run_losses = []
    heads.train()
    for step in range(start, config.steps):
        g = torch.Generator().manual_seed(config.seed * 1_000_003 + step)
        idx = torch.randint(len(features), (config.batch_tokens,), generator=g)
        for group in opt.param_groups:
            group["lr"] = config.lr_at(step)
        with torch.no_grad():
            h = base.model.norm(features.hidden[idx].to(dev, w_sub.dtype))  # [n, D]
        x = heads.features(h)  # [K, n, D]
        tgt = lut[targets[idx].clamp(min=0)].masked_fill(targets[idx] < 0, IGNORE).to(dev)  # [n, K]
        losses = [F.cross_entropy(x[k] @ w_sub.T, tgt[:, k], ignore_index=IGNORE) for k in range(x.shape[0])]
        loss = torch.stack(losses).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        history.append(float(loss.detach()))
        run_losses.append(history[-1])
        if on_step is not None:
            on_step(step + 1, config.steps, history[-1])
        if (step + 1) % config.save_every == 0 or step + 1 == config.steps:
            save(step + 1)
    heads.eval()
    return {"steps": config.steps, "start_step": start, "loss_first": run_losses[0], "loss_last": run_losses[-1],
            "losses": run_losses}
