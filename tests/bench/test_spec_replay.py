"""`bench/spec_replay.py`: its replay of the n-gram policy is what the engine does, step for step
(the same drafted, accepted and forward counts), and its ceilings bound the policy."""

import json

import numpy as np
import pytest

from quantspec.infer.predictor import InferConfig, Predictor
from quantspec.infer.spec.proposers import SpecCost

pytestmark = pytest.mark.bench

PROMPTS = ["a b c a b c a b c a b", "the cat sat on the mat and the cat sat on", "1 2 3 4 1 2 3 4 1 2",
           "x y z w v u t x y z w v"]


def test_longest_copy_on_literal_arrays(spec_replay):
    ctx = np.array([5, 1, 2, 3, 9, 1, 2, 7])
    assert spec_replay.longest_copy(ctx, np.array([1, 2, 3, 4])) == 3  # from position 1
    assert spec_replay.longest_copy(ctx, np.array([1, 2, 7, 7])) == 3  # the later occurrence is longer
    assert spec_replay.longest_copy(ctx, np.array([2, 7, 5])) == 2  # a run stops at the context's end
    assert spec_replay.longest_copy(ctx, np.array([4, 1])) == 0
    assert spec_replay.longest_copy(ctx, np.array([], dtype=np.int64)) == 0


@pytest.mark.parametrize("max_new_tokens", [24, 40])
def test_policy_replay_matches_the_engine(spec_replay, tiny_llama_dir, max_new_tokens):
    cfg = InferConfig(model=str(tiny_llama_dir), device="cpu", batch_size=1, max_new_tokens=max_new_tokens,
                      max_length=256, speculate_method="inference_with_reference",
                      speculate_max_draft_token_num=6, speculate_max_ngram_size=3)
    pred = Predictor(cfg)
    pred.engine.eos = set()  # answers run to max_new_tokens: the replay knows where they end
    cost = pred.engine.proposer.policy.cost
    drafted = 0
    for src in PROMPTS:
        out = pred.generate([src])[0]
        prompt = pred.encode(src)[0]
        r = spec_replay.replay("policy", prompt, out.token_ids, max_draft_tokens=6, ngram=3, cost=cost,
                               max_new_tokens=max_new_tokens, max_length=256, like=pred.engine.proposer)
        assert (r.forwards, r.drafted, r.accepted) == (out.target_forwards, out.drafted, out.accepted), src
        assert r.tokens == len(out.token_ids) - 1
        hind = spec_replay.replay("hindsight", prompt, out.token_ids, max_draft_tokens=6, ngram=3, cost=cost,
                                  max_new_tokens=max_new_tokens, max_length=256)
        copier = spec_replay.replay("copier", prompt, out.token_ids, max_draft_tokens=6, ngram=3, cost=cost,
                                    max_new_tokens=max_new_tokens, max_length=256)
        # hindsight drafts only what is accepted; a perfect copier needs no more forwards than either
        assert hind.accepted == hind.drafted and copier.accepted == copier.drafted
        assert copier.forwards <= min(hind.forwards, r.forwards)
        drafted += r.drafted
    assert drafted > 0  # the prompts repeat themselves: the n-gram drafted


def test_main_prints_every_drafter(spec_replay, tiny_llama_dir, tmp_path, capsys):
    data = tmp_path / "p.jsonl"
    data.write_text("".join(json.dumps({"kind": k, "src": s}) + "\n" for k in ("code_edit", "chat") for s in PROMPTS[:2]))
    res = spec_replay.main(["--model", str(tiny_llama_dir), "--data", str(data), "--new-tokens", "16",
                            "--threads", "1", "--cost", "0,0.1", "--json", str(tmp_path / "rows.json")])
    assert res["cost"] == SpecCost(0.0, 0.1)
    kinds = {(r["kind"], r["drafter"]) for r in res["rows"]}
    assert {("code_edit", d) for d in spec_replay.DRAFTERS} <= kinds and {("chat", d) for d in spec_replay.DRAFTERS} <= kinds
    for r in res["rows"]:
        assert r["end_to_end"] <= r["decode_speedup"] + 1e-9 or r["decode_speedup"] < 1  # the prefill dilutes it
    assert json.loads((tmp_path / "rows.json").read_text()) == res["rows"]
    assert "| chat | copier |" in capsys.readouterr().out


def test_bad_input_is_one_line(spec_replay, tiny_llama_dir, tmp_path):
    with pytest.raises(SystemExit, match="FIXED,PER_TOKEN"):
        spec_replay.main(["--cost", "0.05"])
    with pytest.raises(SystemExit, match="FIXED,PER_TOKEN"):
        spec_replay.main(["--cost", "0,-1"])
    with pytest.raises(SystemExit, match="1..16"):
        spec_replay.main(["--draft-tokens", "17"])
    with pytest.raises(SystemExit, match="no such file"):
        spec_replay.main(["--data", str(tmp_path / "missing.jsonl")])
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(SystemExit, match="no prompts"):
        spec_replay.main(["--data", str(empty)])
    data = tmp_path / "p.jsonl"
    data.write_text(json.dumps({"kind": "chat", "src": "hi"}) + "\n")
    with pytest.raises(SystemExit, match="does not exist"):
        spec_replay.main(["--model", str(tmp_path / "missing"), "--data", str(data)])
    with pytest.raises(SystemExit, match="--prompts >= 0"):
        spec_replay.main(["--prompts", "-1"])
    with pytest.raises(SystemExit, match="no room for a prompt"):
        spec_replay.main(["--max-length", "128", "--new-tokens", "128"])
    data.write_text(json.dumps({"kind": "chat", "src": "word " * 200}) + "\n")
    with pytest.raises(SystemExit, match="chat prompt 'word.*over --src-length"):
        spec_replay.main(["--model", str(tiny_llama_dir), "--data", str(data), "--max-length", "64",
                          "--new-tokens", "8", "--threads", "1"])
