"""Tests for quantspec/infer/spec/types.py: SpecProposal validation and helpers."""

import pytest
import torch

from quantspec.errors import QuantSpecError
from quantspec.infer.spec.types import SpecProposal


def test_from_token_lists_and_helpers():
    proposal = SpecProposal.from_token_lists([[4, 2], [], [7]])
    assert proposal.batch_size == 3
    assert proposal.num_draft_tokens == [2, 0, 1]
    assert proposal.draft_probs is None and proposal.probs_of(0) is None
    assert proposal.draft_token_ids[1].dtype == torch.int64


def test_mixed_draft_probs():
    q = torch.softmax(torch.zeros(2, 5), -1)
    proposal = SpecProposal([torch.tensor([1, 2]), torch.tensor([3])], [q, None])
    assert proposal.probs_of(0) is q and proposal.probs_of(1) is None


@pytest.mark.parametrize(
    "ids, probs, match",
    [
        ([torch.tensor([1.0, 2.0])], None, "int64"),
        ([torch.tensor([[1, 2]])], None, "1-D"),
        ([[1, 2]], None, "draft_token_ids"),
        ([torch.tensor([1, 2])], [], "entries"),
        ([torch.tensor([1, 2])], [torch.zeros(3, 5)], "k_b=2"),
        ([torch.tensor([1, 2])], [torch.zeros(2, 5, dtype=torch.long)], "float"),
        (
            [torch.tensor([1]), torch.tensor([2])],
            [torch.zeros(1, 5), torch.zeros(1, 6)],
            "vocab",
        ),
    ],
)
def test_rejects_inconsistent_proposals(ids, probs, match):
    with pytest.raises(QuantSpecError, match=match):
        SpecProposal(ids, probs)
