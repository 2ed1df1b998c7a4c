"""Self-distillation for draft modules: the frozen base's own greedy answers (and dataset windows)
turned into a draft module's training rows, and the EAGLE-3 head's recipe end to end. Composes
`calib` (data), `infer` (generation with hidden states) and `model_zoo` (the recipes); `api`'s
`train_mtp` / `train_draft_head` call it."""

from __future__ import annotations

from pathlib import Path

from quantspec.errors import about
from quantspec.outputs import check_output_dir

__all__ = ["base_rows", "self_distilled_rows", "train_eagle3_head"]


def train_eagle3_head(model, out, *, dataset, chat_prompts, max_new_tokens, resume, on_step, on_status,
                      aux_layer_ids=None, split="train", text_field="text", num_samples=16, gen_batch_size=64,
                      **train_options) -> dict:
    """`train_draft_head(kind="eagle3")`: the base's greedy answers (from the engine on the packed
    bf16 stack, `infer.hidden.generate_answers`) and `dataset` windows → the head's training rows
    (the float base's features, argmax and final state at every position, `eagle3_train.py`;
    reused from `out` by a later run) → the training-time-test recipe."""
    import time

    from transformers import AutoTokenizer

    from quantspec.infer.hidden import generate_answers
    from quantspec.model_zoo.checkpoint import load_model
    from quantspec.model_zoo.eagle3_train import (Eagle3TrainConfig, init_eagle3, prepared_rows, teacher_rows,
                                                   train_eagle3)
    from quantspec.model_zoo.mtp_train import check_resumable, distill_prompts

    config = Eagle3TrainConfig(**train_options)
    check_output_dir(out, "--out", overwrite=True)
    check_resumable(out, config, resume)  # before minutes of generation
    t0, say = time.perf_counter(), on_status or (lambda _m: None)
    with about("--model"):
        base, model_dir = load_model(model)
    base.requires_grad_(False)
    prompts = distill_prompts(chat_prompts)

    def sequences():
        tok, seqs = AutoTokenizer.from_pretrained(str(model_dir)), []
        if dataset is not None:
            from quantspec.calib.data import build_calibration_batches, load_calibration_texts

            with about("--dataset"):
                texts = load_calibration_texts(str(dataset), split=split, text_field=text_field)
            seqs += list(build_calibration_batches(texts, tok, num_samples, config.seq_len, config.seed, allow_fewer=True))
        say(f"self-distillation: the base answers {len(prompts)} chat prompts (≤ {max_new_tokens} tokens each)")
        return seqs + generate_answers(model_dir, prompts, max_new_tokens=max_new_tokens, batch_size=gen_batch_size,
                                       on_status=on_status)

    # "rows": rows with the base's final hidden states (the soft targets'); "answers": whose answers
    key = {"base": str(model_dir), "dataset": dataset and str(dataset), "prompts": prompts, "max_new_tokens":
           max_new_tokens, "aux": aux_layer_ids, "num_samples": num_samples, "vocab": config.draft_vocab_size,
           "rows": "final", "answers": "engine bf16"}
    rows, vocab, aux = prepared_rows(base, Path(out), key, sequences, config.draft_vocab_size, aux_layer_ids, say)
    data = {"base": str(model), "kind": "eagle3", "chat_prompts": len(prompts), "positions": rows.positions()}
    head = init_eagle3(base, vocab, aux)
    res = train_eagle3(head, rows, config, out, resume=resume, extra_config=data, on_step=on_step,
                       teacher_weight=teacher_rows(base, head) if config.soft_targets else None)
    return {**res, **data, "out": str(out), "wall_s": round(time.perf_counter() - t0, 1)}


def self_distilled_rows(model, out, dataset, *, split, text_field, num_samples, seq_len, seed, self_distill,
                        chat_prompts, max_new_tokens, gen_batch_size, draft_vocab_size, on_status):
    """The frozen base and the training rows of a draft module (MTP, Medusa): dataset windows and
    the base's own greedy answers to chat prompts, with the base's hidden states, and the draft
    vocabulary (the most frequent targets). Saved to `out/train_features.pt` first and reused
    by a later run with the same key. → (base, features, vocab, data summary)."""
    import torch
    from transformers import AutoTokenizer

    from quantspec.calib.data import load_calibration_texts
    from quantspec.model_zoo.checkpoint import load_model
    from quantspec.model_zoo.mtp_train import (FEATURES_NAME, atomic_torch_save, distill_prompts, features_key,
                                               load_features)

    features_path = Path(out) / FEATURES_NAME
    say = on_status or (lambda _m: None)
    texts = None
    if dataset is not None:
        with about("--dataset"):
            texts = load_calibration_texts(str(dataset), split=split, text_field=text_field)
    with about("--model"):
        base, model_dir = load_model(model)
    for p in base.parameters():
        p.requires_grad_(False)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    prompts = distill_prompts(chat_prompts) if self_distill else None
    # everything the training rows and the draft vocabulary are a function of: a run into `out`
    # with the same key reuses the rows an interrupted run saved there (the self-distillation
    # answers are most of the default recipe's time) instead of preparing them again
    key = features_key(base, model_dir, dataset, split, text_field, num_samples, seq_len, seed, self_distill,
                        prompts, max_new_tokens, draft_vocab_size)
    cached = load_features(features_path, key)
    if cached is not None:
        features, vocab, data = cached
        say(f"reusing the {len(features)} training positions saved in {features_path.name} by an earlier run")
    else:
        features, vocab, data = base_rows(
            base, tokenizer, texts, prompts, dataset=dataset, text_field=text_field, num_samples=num_samples,
            seq_len=seq_len, seed=seed, self_distill=self_distill, max_new_tokens=max_new_tokens,
            gen_batch_size=gen_batch_size, draft_vocab_size=draft_vocab_size, on_status=on_status)
        Path(out).mkdir(parents=True, exist_ok=True)
        atomic_torch_save({"key": key, "features": features, "vocab": vocab, "data": data}, features_path)
    covered = torch.isin(features.tgt1[features.tgt1 >= 0], vocab).float().mean().item()
    say(f"{len(features)} training positions; draft vocabulary {vocab.numel()} tokens covers {covered:.1%} of targets")
    data["draft_vocab_coverage"] = round(covered, 4)
    return base, features, vocab, data


def base_rows(base, tokenizer, texts, prompts, *, dataset, text_field, num_samples, seq_len, seed, self_distill,
              max_new_tokens, gen_batch_size, draft_vocab_size, on_status):
    """The training rows the base gives on the dataset's windows and on its own answers to
    `prompts` (when `self_distill`), and the draft vocabulary. → (features, vocab, data summary)"""
    import torch

    from quantspec.calib.data import build_calibration_batches
    from quantspec.infer.hidden import generate_with_hidden
    from quantspec.model_zoo.mtp_train import (MTPFeatures, choose_draft_vocab, extract_features,
                                               features_from_hidden)

    say = on_status or (lambda _m: None)
    parts, data = [], {"self_distill": self_distill}
    if dataset is not None:
        batches = build_calibration_batches(texts, tokenizer, num_samples, seq_len, seed, allow_fewer=True)
        say(f"base features for {batches.shape[0]} × {seq_len} dataset tokens")
        parts.append(extract_features(base, batches, self_distill=self_distill))
        data.update(dataset=str(dataset), text_field=text_field, num_samples=int(batches.shape[0]),
                    seq_len=seq_len)
    if self_distill:
        say(f"self-distillation: the base answers {len(prompts)} chat prompts (≤ {max_new_tokens} tokens each)")
        gens = generate_with_hidden(base, tokenizer, prompts, max_new_tokens=max_new_tokens,
                                     batch_size=gen_batch_size, on_status=on_status)
        parts.extend(features_from_hidden(t, h, None) for t, h in gens)  # greedy: next token = base's choice
        data.update(chat_prompts=len(prompts), chat_tokens=sum(len(t) for t, _ in gens),
                    max_new_tokens=max_new_tokens)
    features = MTPFeatures.cat(parts)
    with torch.no_grad():
        vocab = choose_draft_vocab(features, draft_vocab_size, base.args.vocab_size, base.args.eos_token_ids)
    return features, vocab, data
