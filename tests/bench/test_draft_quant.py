"""`bench/draft_quant.py`: per-depth agreement of EAGLE-3 heads with the base on held-out text; its
first depth counted against the head's own drafts from scratch."""

import pytest
import torch

pytestmark = pytest.mark.bench


def test_agreement_per_depth(draft_quant, tiny_llama_dir, tmp_path, capsys):
    from quantspec import api
    from quantspec.model_zoo.checkpoint import load_model
    from quantspec.model_zoo.eagle3 import causal_attend, load_eagle3, save_eagle3
    from quantspec.model_zoo.eagle3_train import init_eagle3
    from quantspec.model_zoo.llama import DenseCausalAttention

    base = load_model(tiny_llama_dir)[0]
    head_dir = save_eagle3(init_eagle3(base, torch.arange(0, 512, 2), (0, 1, 2)), tmp_path / "head")
    w4 = api.quantize(str(head_dir), "weight_only_int4", tmp_path / "w4", group_size=16)
    table = draft_quant.main(["--model", str(tiny_llama_dir), "--heads", f"{head_dir},{w4},{head_dir}",
                              "--windows", "2", "--seq-len", "32", "--depths", "2", "--threads", "1"])
    out = capsys.readouterr().out
    assert len(table) == 3 and all(len(row) == 2 and all(0 <= x <= 1 for x in row) for row in table)
    assert table[2] == table[0] and "+0.0 +0.0 |" in out.splitlines()[-1]
    # depth 1 from scratch: the head at position p reads fc(features p) and token p + 1, attends
    # causally, and drafts the token after p + 1; the base's own choice there is its argmax
    head = load_eagle3(head_dir).bind_embedding(base.model.embed_tokens)
    hits = rows = 0
    for ids in draft_quant.windows(tiny_llama_dir, 2, 32):
        S = ids.numel()
        hidden, streams = base(ids, torch.arange(S), DenseCausalAttention.of(base.args, 1, S), capture=(0, 1, 2))
        nxt = base.compute_logits(hidden).argmax(-1)
        h = head(ids[1:], head.fuse(torch.cat(streams, -1)[:-1]), torch.arange(S - 1), causal_attend)
        draft = head.target_ids(head.logits(h[:S - 2]).argmax(-1))
        hits += int((draft == nxt[1:S - 1]).sum())
        rows += S - 2
    assert table[0][0] == pytest.approx(hits / rows)
