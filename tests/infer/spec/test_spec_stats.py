"""The speculation figures of `infer --benchmark` / `--stats-file` (`predictor.speculation_stats`)
against hand-counted runs: a scripted drafter whose drafts are right up to a chosen position,
as chains and as token trees, through the predictor the CLI runs."""

import pytest
import torch

from quantspec.infer.predictor import InferConfig, Predictor
from quantspec.infer.spec.tree import caterpillar
from quantspec.infer.spec.types import SpecProposal

torch.set_num_threads(1)
PROMPT = "the quick brown fox jumps over the lazy dog"
VOCAB = 512  # the tiny Llama's


def _wrong(t: int, i: int = 1) -> int:
    """A token other than t (i = 1, 2: two different ones)."""
    return (t + i) % VOCAB


class ScriptedDrafter:
    """Step s of the (single) sequence drafts by `script[s]`, against the plain greedy answer
    `ref`. A chain step is (k, a): k drafts, the first a right. A tree step is a list per depth
    of which candidate is right (0: the top-1, on the path to the next depth; 1: the second, a
    leaf; None: neither), drafted as a `Dx2` caterpillar. Past the script: no drafts."""

    needs_hidden = False

    def __init__(self, ref: list[int], script: list):
        self.ref, self.script, self.step = ref, script, 0

    def _candidates(self, n: int, entry) -> tuple[list[int], list[int] | None]:
        if isinstance(entry, tuple):
            k, a = entry
            return [_wrong(self.ref[n + j]) if j >= a else self.ref[n + j] for j in range(k)], None
        cands = []
        for d, right in enumerate(entry):
            t = self.ref[n + d]
            cands.append([t if right == 0 else _wrong(t), t if right == 1 else _wrong(t, 2)])
        return caterpillar(cands)

    def propose(self, seqs: list, budgets: list[int]) -> SpecProposal:
        (seq,) = seqs
        entry = self.script[self.step] if self.step < len(self.script) else (0, 0)
        self.step += 1
        tokens, parents = self._candidates(len(seq.output_ids), entry)
        return SpecProposal([torch.tensor(tokens, dtype=torch.int64)], parents=[parents])

    def release(self, seq) -> None:
        pass


def _run(model_dir, new_tokens: int, script=None, ref=None):
    cfg = InferConfig(model=str(model_dir), max_new_tokens=new_tokens, max_length=256, chat_template=False,
                      speculate_method="inference_with_reference" if script else "none",
                      speculate_max_draft_token_num=4)
    p = Predictor(cfg)
    if script:
        p.engine.proposer = ScriptedDrafter(ref, script)
    outs, stats = p.run([PROMPT])
    return outs[0].token_ids, stats


# chain: (drafts, of which right) per step — drafted 3+3+2+3+0+1 = 12, accepted 3+0+1+2+0+1 = 7
# in 5 steps with drafts; position 1 drafted in 5 steps, right in 4 (steps 1, 3, 4, 6);
# position 2 in 4, right in 2 (steps 1, 4); position 3 in 3, right in 1 (step 1). Tokens after
# the prefill: 4+1+2+3+1+2 = 13 in 6 forwards, then 6 plain ones to 20 tokens: 19 / 12.
CHAIN = ([(3, 3), (3, 0), (2, 1), (3, 2), (0, 0), (1, 1)], 20,
         dict(drafted_tokens=12, accepted_tokens=7, acceptance_rate=7 / 12, draft_steps=5,
              accepted_per_draft_step=7 / 5, acceptance_per_position=[4 / 5, 2 / 4, 1 / 3],
              mean_accepted_length=19 / 12))
# 2x2 trees (4 rows a step): accepted paths 2, 1 (a leaf), 0, 1, 2 (a leaf at depth 2) = 6 of
# 20 rows in 5 steps; depth 1 reached in 4 of 5, depth 2 in 2 of 5. Tokens after the prefill:
# 3+2+1+2+3 = 11 in 5 forwards, then 4 plain ones to 16 tokens: 15 / 9.
TREE = ([[0, 0], [1, None], [None, None], [0, None], [0, 1]], 16,
        dict(drafted_tokens=20, accepted_tokens=6, acceptance_rate=6 / 20, draft_steps=5,
             accepted_per_draft_step=6 / 5, acceptance_per_position=[4 / 5, 2 / 5],
             mean_accepted_length=15 / 9))


@pytest.mark.parametrize("case", [CHAIN, TREE], ids=["chain", "tree"])
def test_speculation_stats_equal_a_hand_count(tiny_llama_dir, case):
    script, new_tokens, want = case
    ref, _ = _run(tiny_llama_dir, new_tokens)
    assert len(ref) == new_tokens  # no EOS before the end: every step of the script runs
    ids, stats = _run(tiny_llama_dir, new_tokens, script, ref + [0] * 8)
    assert ids == ref
    for key, value in want.items():
        assert stats[key] == pytest.approx(value), key
