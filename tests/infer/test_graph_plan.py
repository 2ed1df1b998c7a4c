"""Which CUDA graph a step replays (`infer/cuda/graphs.py`), checked without a GPU: the batch
buckets, a graph per (bucket, rows per sequence), a step whose sequences bring different numbers
of rows in the graph of the longest with each sequence's rows at the start of its own, the least
recently replayed graph dropped first, another cache's graphs dropped, oversized steps and steps
that capture residual streams left to the eager path."""

import pytest
import torch


@pytest.mark.parametrize("max_batch,want", [(1, [1]), (3, [1, 2, 3]), (8, [1, 2, 4, 8]),
                                            (30, [1, 2, 4, 8, 16, 24, 30]), (32, [1, 2, 4, 8, 16, 24, 32])])
def test_graph_buckets_cover_every_batch_once(max_batch, want):
    """The padded batch sizes: every batch up to `max_batch` has a bucket at most 2× its size."""
    from quantspec.infer.cuda.graphs import batch_buckets

    got = batch_buckets(max_batch)
    assert got == want
    assert all(min(b for b in got if b >= n) <= 2 * n for n in range(1, max_batch + 1))


class _FakeGraph:
    def __init__(self, bp, q):
        self.bp, self.q, self.filled = bp, q, 0
        self.graph = type("G", (), {"replay": lambda self: None})()
        self.out = torch.arange(bp * q, dtype=torch.float32)[:, None].expand(bp * q, 3)

    def fill(self, x, cos, sin, slots, seq, tables, rows=None):
        self.filled += 1
        self.rows, self.seq = rows, seq


class _Planner:
    """`DecodeGraphs` with capture and the step test replaced (no GPU): what is left is which graph
    a step replays, and which graphs are kept."""

    @staticmethod
    def make(max_graphs):
        from quantspec.infer.cuda.graphs import DecodeGraphs

        class Plan(DecodeGraphs):
            def _step_shape(self, x, attn):
                return attn.shape

            def _capture(self, bp, q, x, cos, cache, row_invariant):
                self.captured.append((bp, q))
                g = self.graphs[(bp, q, row_invariant)] = _FakeGraph(bp, q)
                return g

        p = Plan(torch.nn.ModuleList([torch.nn.Linear(2, 2)]), max_batch=64, max_graphs=max_graphs)
        p.captured = []
        return p


class _Kernel:
    @staticmethod
    def _step_args(meta):
        return None, None, torch.zeros(1, 1), 1


def _step(plan, cache, B, q, capture=(), q_lens=None, seq_lens=None, out_rows=None):
    q_lens = q_lens or [q] * B
    attn = type("A", (), {})()
    attn.shape, attn.cache = (q_lens, max(q_lens)), cache
    attn.meta = type("M", (), {"slot_mapping": None, "seq_lens": seq_lens})()
    rows = sum(q_lens)
    return plan(torch.zeros(rows, 3), torch.zeros(rows, 2), None, attn, out_rows, False, capture)


def test_steps_replay_their_bucket_and_the_least_recent_graph_goes():
    from quantspec.infer.cuda.graphs import MAX_GRAPH_ROWS

    cache = type("C", (), {"kernel": _Kernel()})()
    plan = _Planner.make(max_graphs=2)
    out = _step(plan, cache, 3, 1)  # bucket 4: the first 3 of its 4 rows
    assert plan.captured == [(4, 1)] and out.shape == (3, 3) and out[:, 0].tolist() == [0, 1, 2]
    _step(plan, cache, 4, 1)  # the same graph again
    _step(plan, cache, 1, 5)  # a verification step of 4 drafts: a graph of its own
    assert plan.captured == [(4, 1), (1, 5)] and plan.replays == 3
    _step(plan, cache, 3, 1)  # (4, 1) is now the most recent
    _step(plan, cache, 9, 1)  # bucket 16: the third graph drops (1, 5), the least recent
    assert list(k[:2] for k in plan.graphs) == [(4, 1), (16, 1)]
    assert _step(plan, cache, 64, MAX_GRAPH_ROWS // 64 + 1) is None  # too many rows: eager
    assert _step(plan, cache, 4, 1, capture=(2, 0)) is None  # EAGLE-3's features: the modules keep them
    other = type("C", (), {"kernel": _Kernel()})()
    _step(plan, other, 1, 1)  # another cache: the graphs of the first are dropped
    assert list(k[:2] for k in plan.graphs) == [(1, 1)]


def test_uneven_verification_steps_replay_the_graph_of_their_longest_sequence():
    """Sequences bringing 1, 4 and 2 rows run in the graph of (4 sequences, 4 rows each): each
    one's rows are the first of its 4, its context as long as 4 rows make it, and the output rows
    come back in the step's order (all of them, or the scored ones)."""
    cache = type("C", (), {"kernel": _Kernel()})()
    plan = _Planner.make(max_graphs=4)
    out = _step(plan, cache, 3, 0, q_lens=[1, 4, 2], seq_lens=[10, 20, 7])
    assert plan.captured == [(4, 4)] and plan.replays == 1
    g = plan.graphs[(4, 4, False)]
    assert g.rows.tolist() == [0, 4, 5, 6, 7, 8, 9] and g.seq.tolist() == [13, 20, 9]
    assert out[:, 0].tolist() == [0, 4, 5, 6, 7, 8, 9]
    scored = _step(plan, cache, 3, 0, q_lens=[2, 1, 4], seq_lens=[5, 6, 7], out_rows=torch.tensor([1, 2, 5]))
    assert plan.captured == [(4, 4)] and scored[:, 0].tolist() == [1, 4, 10]
