"""The batch buckets the CUDA backend captures decode graphs for (`infer/cuda/graphs.py`): a pure
function, checked without a GPU."""

import pytest


@pytest.mark.parametrize("max_batch,want", [(1, [1]), (3, [1, 2, 3]), (8, [1, 2, 4, 8]),
                                            (30, [1, 2, 4, 8, 16, 24, 30]), (32, [1, 2, 4, 8, 16, 24, 32])])
def test_graph_buckets_cover_every_batch_once(max_batch, want):
    """The padded batch sizes: every batch up to `max_batch` has a bucket at most 2× its size."""
    from quantspec.infer.cuda.graphs import batch_buckets

    got = batch_buckets(max_batch)
    assert got == want
    assert all(min(b for b in got if b >= n) <= 2 * n for n in range(1, max_batch + 1))
