"""The EAGLE-3 recipe's soft targets: the rows carry the base's final hidden states (its logits
through `teacher_rows`), the forward-KL loss reduces to the hard one for a one-hot teacher, soft
training lowers the loss, a resume must keep the targets, and the CLI refuses soft Medusa heads."""

import pytest
import torch
from click.testing import CliRunner

from quantspec.cli import main
from quantspec.errors import QuantSpecError
from quantspec.model_zoo.checkpoint import load_model
from quantspec.model_zoo.eagle3_train import (Eagle3TrainConfig, choose_eagle3_vocab, eagle3_rows, init_eagle3,
                                              teacher_rows, train_eagle3, ttt_losses)
from quantspec.model_zoo.mtp_train import IGNORE

torch.set_num_threads(1)
AUX = (0, 1, 2)


@pytest.fixture(scope="module")
def base(tiny_llama_dir):
    return load_model(tiny_llama_dir)[0]


@pytest.fixture(scope="module")
def rows(base):
    g = torch.Generator().manual_seed(3)
    seqs = [torch.randint(3, 500, (n,), generator=g) for n in (20, 17, 24, 12)]
    return eagle3_rows(base, seqs, AUX)


def _lut(head, V):
    lut = torch.full((V,), IGNORE, dtype=torch.int64)
    lut[head.target_ids(torch.arange(head.args.draft_vocab_size))] = torch.arange(head.args.draft_vocab_size)
    return lut


def test_rows_give_the_base_logits_over_the_draft_vocab(base, rows):
    vocab = choose_eagle3_vocab(rows, 128, 512, [0])
    head = init_eagle3(base, vocab, AUX)
    w = teacher_rows(base, head)  # [Vd, D]
    with torch.no_grad():
        full = base.compute_logits(base(rows.tokens[0], torch.arange(20), _dense(20)))  # [L, V]
    teacher = rows.final[0].float() @ w.T
    torch.testing.assert_close(teacher, full[:, vocab], atol=3e-2, rtol=3e-2)  # bf16 rows
    assert torch.equal(full.argmax(-1), rows.nxt[0])


def _dense(n):
    from quantspec.model_zoo.llama import DenseCausalAttention

    return DenseCausalAttention(1, n)


def test_one_hot_teacher_gives_the_hard_loss(base, rows):
    vocab = choose_eagle3_vocab(rows, 128, 512, [0])
    head = init_eagle3(base, vocab, AUX)
    lut = _lut(head, 512)
    tokens, feats, nxt = rows.tokens[2], rows.feats[2].float(), rows.nxt[2]
    one_hot = torch.full((tokens.numel(), 128), -1e4)
    d = lut[nxt]
    one_hot[d >= 0, d[d >= 0]] = 1e4
    with torch.no_grad():
        hard, acc_h = ttt_losses(head, tokens, feats, nxt, lut, 3)
        soft, acc_s = ttt_losses(head, tokens, feats, nxt, lut, 3, teacher=one_hot)
    assert len(hard) == len(soft) == 3 and acc_h == acc_s
    for h, s in zip(hard, soft):
        torch.testing.assert_close(h, s)


def test_soft_training_lowers_the_loss_and_resumes_only_soft(base, rows, tmp_path):
    vocab = choose_eagle3_vocab(rows, 128, 512, [0])
    cfg = dict(lr=3e-3, seqs_per_step=2, save_every=5, draft_vocab_size=128, ttt_steps=2)
    head = init_eagle3(base, vocab, AUX)
    with pytest.raises(QuantSpecError, match="teacher"):
        train_eagle3(head, rows, Eagle3TrainConfig(steps=10, **cfg), tmp_path / "x")
    res = train_eagle3(head, rows, Eagle3TrainConfig(steps=10, **cfg), tmp_path / "h",
                       teacher_weight=teacher_rows(base, head))
    assert res["loss_last"] < res["loss_first"]
    with pytest.raises(QuantSpecError, match="hard"):
        train_eagle3(init_eagle3(base, vocab, AUX), rows, Eagle3TrainConfig(steps=12, soft_targets=False, **cfg),
                     tmp_path / "h", resume=True)


def test_cli_refuses_soft_medusa_heads(tiny_llama_dir, tmp_path):
    res = CliRunner().invoke(main, ["zoo", "train-draft-head", "--kind", "medusa", "--targets", "soft",
                                    "--model", str(tiny_llama_dir), "--out", str(tmp_path / "m")])
    assert res.exit_code != 0 and "--targets soft" in res.output
