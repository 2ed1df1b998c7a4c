"""The MTP module (artifact round trip, refusing another base) and its training recipe (loss goes
down, resume continues exactly), on the tiny Llama."""

import json
from dataclasses import asdict

import pytest
import torch

from quantspec.errors import QuantSpecError
from quantspec.model_zoo.checkpoint import load_model
from quantspec.model_zoo.llama import DenseCausalAttention
from quantspec.model_zoo.mtp import (MTP_ARCHITECTURE, MTPArgs, is_mtp_config, load_mtp, mtp_weight_table,
                                     save_mtp)
from quantspec.model_zoo.mtp_train import (IGNORE, STATE_NAME, MTPTrainConfig, choose_draft_vocab,
                                           extract_features, features_from_hidden, init_mtp, train_mtp)
from quantspec.model_zoo.tiny import TINY_CORPUS, build_tiny_model, build_tiny_tokenizer

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def base(tiny_llama_dir):
    model, _ = load_model(tiny_llama_dir)
    return model


@pytest.fixture(scope="module")
def corpus_ids():
    tok = build_tiny_tokenizer()
    ids = tok(TINY_CORPUS, add_special_tokens=False).input_ids
    return torch.tensor(ids[: 8 * 48]).view(8, 48)  # [B, S]


def _random_vocab(n, size, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randperm(n, generator=g)[:size].sort().values


def test_features_from_hidden_rows():
    tokens = torch.tensor([10, 11, 12, 13])
    hidden = torch.arange(3 * 2, dtype=torch.float32).view(3, 2)
    text = features_from_hidden(tokens, hidden, None)
    assert text.in1.tolist() == [11, 12, 13]
    assert text.tgt1.tolist() == [12, 13, IGNORE]
    assert text.in2.tolist()[:2] == [12, 13] and text.tgt2.tolist() == [13, IGNORE, IGNORE]
    distill = features_from_hidden(tokens, hidden, torch.tensor([20, 21, 22]))  # base's choices
    assert distill.tgt1.tolist() == [21, 22, IGNORE] and distill.tgt2.tolist() == [22, IGNORE, IGNORE]


def test_save_load_round_trip(base, tmp_path):
    mtp = init_mtp(base, _random_vocab(base.args.vocab_size, 100))
    with torch.no_grad():
        for p in mtp.model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    save_mtp(mtp, tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["architectures"] == [MTP_ARCHITECTURE] and is_mtp_config(cfg)
    assert cfg["mtp_base"]["hidden_size"] == base.args.hidden_size and cfg["num_hidden_layers"] == 1
    loaded = load_mtp(tmp_path, base)
    assert set(loaded.state_dict()) == set(mtp_weight_table(loaded.args))
    assert torch.equal(loaded.draft_vocab_ids, mtp.draft_vocab_ids)
    h = torch.randn(5, base.args.hidden_size)
    t = torch.tensor([3, 7, 100, 200, 511])
    with torch.no_grad():
        a, b = mtp(h, t), loaded(h, t)
        assert torch.equal(a, b)
        assert torch.equal(mtp.draft_logits(a), loaded.draft_logits(b))
        full = loaded.full_logits(b)  # [N, V], -inf outside the draft vocabulary
    assert full.shape == (5, base.args.vocab_size)
    assert torch.isfinite(full).sum(-1).tolist() == [100] * 5
    assert torch.equal(full[:, loaded.draft_vocab_ids], loaded.draft_logits(b))


def test_config_round_trip_keeps_block_args(base):
    args = MTPArgs.for_base(base.args, 64)
    back = MTPArgs.from_config(args.to_config())
    for f in ("hidden_size", "intermediate_size", "num_heads", "num_kv_heads", "head_dim", "vocab_size", "qkv_bias"):
        assert getattr(back.block, f) == getattr(args.block, f), f
    assert back.base_fingerprint == args.base_fingerprint and back.draft_vocab_size == 64


@pytest.mark.parametrize("change, words", [
    ({"hidden": 32, "heads": 2, "kv_heads": 1}, "hidden size"),
    ({"vocab_pad_to": 100}, "vocab size"),
    ({"num_layers": 3}, "another base"),
])
def test_mtp_for_another_base_is_refused(base, tmp_path, change, words):
    mtp_dir = tmp_path / "mtp"
    save_mtp(init_mtp(base, _random_vocab(base.args.vocab_size, 50)), mtp_dir)
    other, _ = load_model(build_tiny_model(tmp_path / "other", "llama", **change))
    with pytest.raises(QuantSpecError, match=words):
        load_mtp(mtp_dir, other)
    load_mtp(mtp_dir)  # without a base it loads (e.g. to quantize it)


def test_non_mtp_directory_is_refused(tiny_llama_dir):
    with pytest.raises(QuantSpecError, match="not an MTP module"):
        load_mtp(tiny_llama_dir)


def test_training_lowers_loss(base, corpus_ids):
    feats = extract_features(base, corpus_ids, self_distill=True)
    assert len(feats) == corpus_ids.shape[0] * (corpus_ids.shape[1] - 1)
    vocab = choose_draft_vocab(feats, 10_000, base.args.vocab_size)
    mtp = init_mtp(base, vocab)
    cfg = MTPTrainConfig(steps=40, batch_tokens=128, lr=3e-3, save_every=40)
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        res = train_mtp(mtp, feats, cfg, d)
    losses = res["losses"]
    assert len(losses) == 40
    assert sum(losses[-5:]) / 5 < 0.7 * sum(losses[:5]) / 5


def test_teacher_logits_are_the_bases_own(base, corpus_ids):
    """teacher_logits(h) = the base's compute_logits(h) at the draft vocabulary's columns."""
    vocab = _random_vocab(base.args.vocab_size, 50)
    mtp = init_mtp(base, vocab)
    ids = corpus_ids[0]
    with torch.no_grad():
        h = base(ids, torch.arange(ids.numel()), DenseCausalAttention(1, ids.numel()))  # [L, D]
        torch.testing.assert_close(mtp.teacher_logits(h), base.compute_logits(h)[:, vocab].float())


def test_soft_targets_are_the_bases_distribution_at_the_next_row(base, corpus_ids):
    """The soft loss of row i is the CE against softmax(base logits at h_{i+1}) (depth 1) and
    h_{i+2} (depth 2) over the draft vocabulary, from a dense forward of the sequence; rows
    without a next position (a sequence's last rows) are left out, never paired with the next
    sequence's first row."""
    from quantspec.model_zoo.mtp_train import _losses

    feats = extract_features(base, corpus_ids[:2], self_distill=True)  # 2 sequences × 47 rows
    vocab = choose_draft_vocab(feats, 60, base.args.vocab_size)
    mtp = init_mtp(base, vocab, seed=3)
    lut = torch.full((base.args.vocab_size,), IGNORE, dtype=torch.int64)
    lut[vocab] = torch.arange(vocab.numel())
    L = corpus_ids.shape[1]
    with torch.no_grad():
        dense = base(corpus_ids[0], torch.arange(L), DenseCausalAttention(1, L))  # [L, D] sequence 0

        def expected(i, depth):
            h = feats.hidden[i:i + 1].float()
            m = mtp(h, feats.in1[i:i + 1])
            if depth == 2:
                m = mtp(m, feats.in2[i:i + 1])
            p = torch.softmax(base.compute_logits(dense[i + depth:i + depth + 1])[:, vocab].float(), -1)
            return -(p * torch.log_softmax(mtp.draft_logits(m), -1)).sum()

        for i in (0, 10, L - 4):
            l1, l2 = _losses(mtp, feats, torch.tensor([i]), lut, 0.5, soft=True)
            torch.testing.assert_close(l1, expected(i, 1), atol=2e-2, rtol=2e-2)  # hidden kept in bf16
            torch.testing.assert_close(l2, expected(i, 2), atol=2e-2, rtol=2e-2)
        last = L - 2  # sequence 0's last row: no h_{i+1} in it; row `last + 1` is sequence 1's first
        l1, l2 = _losses(mtp, feats, torch.tensor([last, last - 1]), lut, 0.5, soft=True)
        torch.testing.assert_close(l1, _losses(mtp, feats, torch.tensor([last - 1]), lut, 0.5, soft=True)[0])
        assert float(l2) == 0.0  # neither row has an h_{i+2} in its sequence


def test_soft_training_moves_the_draft_towards_the_base(base, corpus_ids):
    """A short soft-target run lowers the soft loss and raises top-1 agreement with the base."""
    feats = extract_features(base, corpus_ids, self_distill=True)
    vocab = choose_draft_vocab(feats, 10_000, base.args.vocab_size)
    mtp = init_mtp(base, vocab)
    keep = feats.tgt1 >= 0
    lut = torch.full((base.args.vocab_size,), IGNORE, dtype=torch.int64)
    lut[vocab] = torch.arange(vocab.numel())

    def agreement():
        with torch.no_grad():
            pred = mtp.draft_logits(mtp(feats.hidden[keep].float(), feats.in1[keep])).argmax(-1)
        return (pred == lut[feats.tgt1[keep]]).float().mean().item()

    before = agreement()
    cfg = MTPTrainConfig(steps=40, batch_tokens=128, lr=3e-3, save_every=40, soft_targets=True)
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        losses = train_mtp(mtp, feats, cfg, d)["losses"]
    assert sum(losses[-5:]) / 5 < 0.8 * sum(losses[:5]) / 5
    assert agreement() > before + 0.1


def test_resume_continues_exactly(base, corpus_ids, tmp_path):
    feats = extract_features(base, corpus_ids[:4], self_distill=False)
    vocab = choose_draft_vocab(feats, 200, base.args.vocab_size)
    cfg = MTPTrainConfig(steps=6, batch_tokens=64, lr=1e-3, save_every=3)

    straight = init_mtp(base, vocab)
    train_mtp(straight, feats, cfg, tmp_path / "a")

    class Interrupted(Exception):
        pass

    def stop_after_3(step, total, loss):
        if step == 4:
            raise Interrupted

    first = init_mtp(base, vocab)
    with pytest.raises(Interrupted):
        train_mtp(first, feats, cfg, tmp_path / "b", on_step=stop_after_3)
    assert torch.load(tmp_path / "b" / STATE_NAME, weights_only=False)["step"] == 3
    with pytest.raises(QuantSpecError, match="--resume"):
        train_mtp(init_mtp(base, vocab), feats, cfg, tmp_path / "b")
    with pytest.raises(QuantSpecError, match="chain_weight=0.5, not 0.25"):
        train_mtp(init_mtp(base, vocab), feats, MTPTrainConfig(**{**asdict(cfg), "chain_weight": 0.25}),
                  tmp_path / "b", resume=True)
    resumed = init_mtp(base, vocab)
    res = train_mtp(resumed, feats, cfg, tmp_path / "b", resume=True)
    assert res["start_step"] == 3 and len(res["losses"]) == 3
    for (n, a), (_, b) in zip(straight.model.state_dict().items(), resumed.model.state_dict().items()):
        assert torch.equal(a, b), n
    # the artifact on disk is the final state
    again = load_mtp(tmp_path / "b", base)
    assert torch.equal(again.model.eh_proj.weight, straight.model.eh_proj.weight)


def test_api_train_mtp_end_to_end(tiny_llama_dir, tmp_path):
    from quantspec import api

    data = tmp_path / "text.jsonl"
    data.write_text("\n".join(json.dumps({"body": p}) for p in TINY_CORPUS.split("\n\n")))
    kw = dict(text_field="body", steps=4, seq_len=32, batch_size=2, num_samples=8, save_every=2,
              chat_prompts=["Tell me about the sea.", "What is two plus two?"], max_new_tokens=12)
    res = api.train_mtp(str(tiny_llama_dir), str(data), tmp_path / "mtp", **kw)
    assert res["steps"] == 4 and res["chat_prompts"] == 2 and res["positions"] > 8 * 31
    cfg = json.loads((tmp_path / "mtp" / "config.json").read_text())
    assert cfg["quantspec_training"]["step"] == 4 and cfg["quantspec_training"]["self_distill"] is True
    assert cfg["quantspec_training"]["targets"] == "hard" and cfg["quantspec_training"]["soft_targets"] is False
    res = api.train_mtp(str(tiny_llama_dir), str(data), tmp_path / "soft", targets="soft", **kw)
    cfg = json.loads((tmp_path / "soft" / "config.json").read_text())["quantspec_training"]
    assert cfg["targets"] == "soft" and cfg["soft_targets"] is True and res["loss_last"] is not None
    with pytest.raises(QuantSpecError, match="--resume"):
        api.train_mtp(str(tiny_llama_dir), str(data), tmp_path / "mtp", **kw)
    with pytest.raises(QuantSpecError, match="trained with --targets hard, not soft; resume with --targets hard"):
        api.train_mtp(str(tiny_llama_dir), str(data), tmp_path / "mtp", resume=True, targets="soft",
                      **{**kw, "steps": 6})
    assert json.loads((tmp_path / "mtp" / "config.json").read_text())["quantspec_training"]["step"] == 4
    res = api.train_mtp(str(tiny_llama_dir), str(data), tmp_path / "mtp", resume=True, **{**kw, "steps": 6})
    assert res["start_step"] == 4 and res["steps"] == 6
    with pytest.raises(QuantSpecError, match="trained with --targets soft, not hard"):
        api.train_mtp(str(tiny_llama_dir), str(data), tmp_path / "soft", resume=True, **{**kw, "steps": 6})
    with pytest.raises(QuantSpecError, match="soft targets are the base's own distribution"):
        api.train_mtp(str(tiny_llama_dir), str(data), tmp_path / "mtp3", self_distill=False, targets="soft", **kw)
    with pytest.raises(QuantSpecError, match="--targets 'kl'"):
        api.train_mtp(str(tiny_llama_dir), str(data), tmp_path / "mtp3", targets="kl", **kw)
    with pytest.raises(QuantSpecError, match="text_field|fields are"):
        api.train_mtp(str(tiny_llama_dir), str(data), tmp_path / "mtp2", **{**kw, "text_field": "nope"})


def test_interrupted_run_reuses_its_prepared_data(tiny_llama_dir, tmp_path, monkeypatch):
    """A run interrupted after a checkpoint is resumed on the rows it saved (no second
    self-distillation), and ends exactly where an uninterrupted run ends; the saved rows go when
    the run completes; other data options prepare them again; a resume with nothing left to train
    prepares nothing."""
    from quantspec import api
    from quantspec.model_zoo.mtp_train import FEATURES_NAME

    data = tmp_path / "text.jsonl"
    data.write_text("\n".join(json.dumps({"text": p}) for p in TINY_CORPUS.split("\n\n")))
    kw = dict(steps=6, seq_len=32, batch_size=2, num_samples=4, save_every=2,
              chat_prompts=["Tell me about the sea.", "What is two plus two?"], max_new_tokens=10)
    straight = api.train_mtp(str(tiny_llama_dir), str(data), tmp_path / "straight", **kw)
    assert not (tmp_path / "straight" / FEATURES_NAME).exists()

    class Stop(Exception):
        pass

    def stop_at_4(step, total, loss):
        if step == 4:
            raise Stop
    with pytest.raises(Stop):
        api.train_mtp(str(tiny_llama_dir), str(data), tmp_path / "cut", on_step=stop_at_4, **kw)
    assert (tmp_path / "cut" / FEATURES_NAME).exists()
    generated = []
    import quantspec.infer.hidden as hidden

    real = hidden.generate_with_hidden
    monkeypatch.setattr(hidden, "generate_with_hidden", lambda *a, **k: generated.append(1) or real(*a, **k))
    said = []
    res = api.train_mtp(str(tiny_llama_dir), str(data), tmp_path / "cut", resume=True, on_status=said.append, **kw)
    assert not generated and any("reusing" in m for m in said)
    assert res["start_step"] == 2 and res["positions"] == straight["positions"]  # the last checkpoint: step 2
    assert res["chat_tokens"] == straight["chat_tokens"] and res["losses"] == straight["losses"][2:]
    assert not (tmp_path / "cut" / FEATURES_NAME).exists()
    a = load_mtp(tmp_path / "straight", base=load_model(tiny_llama_dir)[0])
    b = load_mtp(tmp_path / "cut", base=load_model(tiny_llama_dir)[0])
    for (n, x), (_, y) in zip(a.model.state_dict().items(), b.model.state_dict().items()):
        assert torch.equal(x, y), n
    # nothing left to train: no data prepared, the checkpoint untouched
    res = api.train_mtp(str(tiny_llama_dir), str(data), tmp_path / "cut", resume=True, **kw)
    assert res["start_step"] == 6 and res["positions"] is None and not generated
    # a saved file for other data options (here: one more prompt) is not reused
    with pytest.raises(Stop):
        api.train_mtp(str(tiny_llama_dir), str(data), tmp_path / "other", on_step=stop_at_4, **kw)
    res = api.train_mtp(str(tiny_llama_dir), str(data), tmp_path / "other", resume=True,
                        **{**kw, "chat_prompts": kw["chat_prompts"] + ["Why?"]})
    assert generated and res["chat_prompts"] == 3
    # a damaged file is only a cache: the rows are prepared again
    generated.clear()
    with pytest.raises(Stop):
        api.train_mtp(str(tiny_llama_dir), str(data), tmp_path / "torn", on_step=stop_at_4, **kw)
    path = tmp_path / "torn" / FEATURES_NAME
    path.write_bytes(path.read_bytes()[:100])
    res = api.train_mtp(str(tiny_llama_dir), str(data), tmp_path / "torn", resume=True, **kw)
    assert generated and res["losses"] == straight["losses"][2:]


def test_api_train_mtp_builtin_prompt_count(tiny_llama_dir, tmp_path):
    """chat_prompts=N answers the first N built-in prompts; N < 1 is refused with one line."""
    from quantspec import api

    kw = dict(steps=1, save_every=1, max_new_tokens=6)
    res = api.train_mtp(str(tiny_llama_dir), None, tmp_path / "mtp", chat_prompts=3, **kw)
    assert res["chat_prompts"] == 3
    with pytest.raises(QuantSpecError, match="--chat-prompts 0 must be >= 1"):
        api.train_mtp(str(tiny_llama_dir), None, tmp_path / "mtp2", chat_prompts=0, **kw)


def test_builtin_chat_prompts_are_varied_and_disjoint_from_the_bench():
    """Every topic is asked once before any is asked twice, the default set has no duplicates, and
    no self-distillation prompt touches a topic of the bench's held-out chat prompts."""
    from pathlib import Path

    from quantspec.model_zoo.mtp_train import _EXTRAS, _TOPICS, CHAT_PROMPTS, chat_prompts

    everything = chat_prompts()
    assert len(set(everything)) == len(everything) and CHAT_PROMPTS == everything[:len(CHAT_PROMPTS)]
    first_round = everything[len(_EXTRAS):len(_EXTRAS) + len(_TOPICS)]
    assert all(t in p for t, p in zip(_TOPICS, first_round))
    bench = Path(__file__).parents[2] / "bench" / "data" / "spec_prompts.jsonl"
    rows = [json.loads(line) for line in bench.read_text().splitlines() if line.strip()]
    held_out = [r["src"] for r in rows if r["kind"] == "chat"]
    assert len(held_out) >= 6
    # the distinctive word(s) of each held-out chat prompt
    for key in ("focused", "sky", "autumn", "tuple", "vegetarian", "bicycle"):
        assert any(key in p.lower() for p in held_out), key
        assert not [p for p in everything if key in p.lower()], key


def test_dense_and_engine_hidden_agree(base, monkeypatch):
    """The hidden states the api captures during generation are the ones a dense forward gives,
    for every sequence, also when prompts are admitted (and prefilled in steps of their own) while
    others are still decoding: 5 prompts, 2 at a time, answers of different lengths."""
    from quantspec.infer.hidden import generate_with_hidden

    tok = build_tiny_tokenizer()
    prompts = ["Tell me a story.", "What is two plus two?", "Name a colour.", "Say hello to the sea.", "Why?"]
    first = generate_with_hidden(base, tok, prompts[:1], max_new_tokens=10, batch_size=1)[0][0]
    n0 = len(tok(tok.apply_chat_template([{"role": "user", "content": prompts[0]}], tokenize=False,
                                         add_generation_prompt=True), add_special_tokens=False).input_ids)
    # a token the first answer emits early becomes the eos: that answer ends while the next decodes
    monkeypatch.setattr(base.args, "eos_token_ids", [int(first[n0 + 2])])
    gens = generate_with_hidden(base, tok, prompts, max_new_tokens=10, batch_size=2)
    assert len(gens) == 5
    assert gens[0][0].numel() == n0 + 3 and len({t.numel() for t, _ in gens[:2]}) == 2  # staggered
    for tokens, hidden in gens:
        L = tokens.numel()
        with torch.no_grad():
            dense = base(tokens, torch.arange(L), DenseCausalAttention(1, L))[:-1]
        assert hidden.shape == dense.shape
        torch.testing.assert_close(hidden.float(), dense, atol=0.05, rtol=0.02)  # hidden kept in bf16


def test_cli_train_mtp(tiny_llama_dir, tmp_path):
    from click.testing import CliRunner

    from quantspec.cli import main

    data = tmp_path / "text.jsonl"
    data.write_text("\n".join(json.dumps({"text": p}) for p in TINY_CORPUS.split("\n\n")))
    args = ["zoo", "train-mtp", "--model", str(tiny_llama_dir), "--dataset", str(data), "--steps", "2",
            "--seq-len", "16", "--batch-size", "1", "--num-samples", "4", "--no-self-distill",
            "--out", str(tmp_path / "mtp")]
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 0, r.output
    assert (tmp_path / "mtp" / "model.safetensors").exists() and (tmp_path / "mtp" / STATE_NAME).exists()
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 2 and "--resume" in r.output and "Traceback" not in r.output
    r = CliRunner().invoke(main, args + ["--resume", "--steps", "3"])
    assert r.exit_code == 0, r.output
    trained = json.loads((tmp_path / "mtp" / "config.json").read_text())["quantspec_training"]
    assert trained["step"] == 3 and trained["targets"] == "hard"  # text targets without self-distillation
    r = CliRunner().invoke(main, args + ["--resume", "--steps", "3"])
    assert r.exit_code == 0 and "already trained to 3 steps" in r.output, r.output
    state = tmp_path / "mtp" / STATE_NAME  # a torn checkpoint: one line, the file left as it is
    state.write_bytes(state.read_bytes()[:200])
    r = CliRunner().invoke(main, args + ["--resume", "--steps", "4"])
    assert r.exit_code == 2 and "cannot be read" in r.output and "Traceback" not in r.output, r.output
    assert state.stat().st_size == 200


def test_generate_answers_are_the_bf16_engines_greedy_answers(tiny_llama_dir):
    """`generate_answers` (one batched engine run) gives, for every prompt, the chat-templated
    prompt followed by the answer `quantspec infer --dtype bfloat16` gives that prompt alone."""
    from quantspec.infer.hidden import chat_encode, generate_answers
    from quantspec.infer.predictor import InferConfig, Predictor

    prompts = ["Tell me a story.", "What is two plus two?", "Name a colour."]
    seqs = generate_answers(str(tiny_llama_dir), prompts, max_new_tokens=9, batch_size=2)
    pred = Predictor(InferConfig(model=str(tiny_llama_dir), dtype="bfloat16", max_new_tokens=9, max_length=256))
    for p, ids, seq in zip(prompts, chat_encode(pred.tokenizer, prompts), seqs):
        assert seq.dtype == torch.int64
        assert seq.tolist() == ids + pred.generate([p])[0].token_ids
