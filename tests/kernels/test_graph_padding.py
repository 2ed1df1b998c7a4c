"""The padded layout of `infer/cuda/graphs.DecodeGraphs` computed for real on a machine without
a GPU: the graph runner with its capture replaced by running the captured function (the Triton
paged attention, which the graphs require, and the fused layers under the interpreter), so that
what a replay reads from the static buffers — padding sequences, and sequences bringing fewer
rows than the longest — is checked against the eager step over the same rows."""

import types

import pytest
import torch

from quantspec.infer.cuda.graphs import DecodeGraphs


class _Replayed(DecodeGraphs):
    """`DecodeGraphs` on the CPU: a "graph" reruns the stack over its static buffers at each
    replay; every graphed step is also run eagerly (after the replay, so the eager step's keys
    are the ones later steps read) and the largest difference kept."""

    def _graphable(self, x):
        return True

    def _record(self, g, run):
        g.out = run()
        g.graph = types.SimpleNamespace(replay=lambda: g.out.copy_(run()))

    def __call__(self, x, cos, sin, attn, out_rows, row_invariant, capture=()):
        shape = self._step_shape(x, attn)
        out = super().__call__(x, cos, sin, attn, out_rows, row_invariant, capture)
        if shape is not None and out is not None:
            ref = self._stack(x, cos, sin, attn, row_invariant)
            ref = ref if out_rows is None else ref[out_rows]
            self.worst = max(getattr(self, "worst", 0.0), float((out - ref).abs().max() / ref.abs().max()))
            self.shapes.append(list(attn.meta.q_lens))
        return out


def _engine(model_dir, proposer=None, k=0, graphs=True):
    """An engine over the CUDA backend's runtime on the CPU, its stack `_Replayed`."""
    from dataclasses import replace

    from quantspec.infer.cuda import prepare
    from quantspec.infer.cuda.attention import TritonAttention
    from quantspec.infer.dispatch import DispatchPolicy
    from quantspec.infer.engine import Engine, EngineConfig
    from quantspec.model_zoo.checkpoint import load_model

    net, _ = load_model(model_dir)
    runtime = prepare(net, torch.device("cpu"), DispatchPolicy(cuda_fused_ops=True))
    stack = _Replayed(net.model.layers, max_batch=4, graphs=graphs, fused=True)
    stack.shapes = []
    runtime = replace(runtime, stack=stack, attention=TritonAttention)
    eng = Engine(net, EngineConfig(max_batch_size=3, max_length=96, spec_max_draft_tokens=k),
                 eos_token_ids=[], proposer=proposer, runtime=runtime)
    return eng, stack


needs_no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU stand-in for a GPU's graphs")


@needs_no_gpu
def test_padded_graph_rows_are_the_eager_rows(tmp_path):
    """n-gram speculation over three sequences (each step: different numbers of drafts, three
    sequences in the graph of four) through the replayed graphs gives the eager step's rows
    (fp32, within MKL's row-count rounding) and the tokens of plain decoding; an engine warmed up
    before its requests captures no graph while they run."""
    from quantspec.infer.sampler import SamplingParams
    from quantspec.infer.spec.proposers import ReferenceProposer
    from quantspec.model_zoo.tiny import build_tiny_model

    d = build_tiny_model(tmp_path / "m", hidden=128, heads=2, kv_heads=1, intermediate=256, num_layers=2)
    gen = torch.Generator().manual_seed(5)
    seg = [torch.randint(200, (12,), generator=gen).tolist() for _ in range(2)]
    # two that repeat themselves (n-gram drafts match) and one that does not (no drafts)
    prompts = [(s * 4)[: 20 + 7 * i] for i, s in enumerate(seg)] + [torch.randperm(200, generator=gen)[:30].tolist()]

    def tokens(proposer=None, k=0, graphs=True):
        eng, stack = _engine(d, proposer, k, graphs)
        seqs = [eng.add_request(p, SamplingParams(max_new_tokens=10)) for p in prompts]
        eng.run()
        return [list(s.output_ids) for s in seqs], stack

    plain, _ = tokens(graphs=False)
    graphed, stack = tokens()
    assert graphed == plain and stack.replays >= 9 and {k[:2] for k in stack.graphs} == {(4, 1)}
    eng, stack = _engine(d)
    eng.warm_up()  # what `quantspec serve` does first: the decode graphs of batches of 1 to 3 (buckets 1, 2, 4)
    assert {k[:2] for k in stack.graphs} == {(1, 1), (2, 1), (4, 1)} and stack.captures == 3
    seqs = [eng.add_request(p, SamplingParams(max_new_tokens=10)) for p in prompts]
    eng.run()
    assert [list(s.output_ids) for s in seqs] == plain and stack.captures == 3  # no step waited on a capture
    spec, stack = tokens(ReferenceProposer(2, 4), k=4)
    assert spec == plain
    uneven = [q for q in stack.shapes if len(set(q)) > 1]
    assert uneven and any(max(q) > 1 for q in uneven)  # the steps this layout exists for were taken
    assert stack.worst <= 1e-5
    assert stack.captures == len(stack.graphs) and all(bp == 4 for bp, _, _ in stack.graphs)


@needs_no_gpu
def test_step_cost_seeding_times_the_steps_graphs_take(tmp_path):
    """The load-aware policy's start-up timings (`measure_step_costs`) run decode-like steps, each
    sequence after a cached context: the graphs of decode steps and of uneven verification steps
    (more rows than sequences), so that they time replays, as the engine's steps run."""
    from quantspec.infer.spec.load import measure_step_costs
    from quantspec.model_zoo.tiny import build_tiny_model

    d = build_tiny_model(tmp_path / "m", hidden=128, heads=2, kv_heads=1, intermediate=256, num_layers=2)
    eng, stack = _engine(d)
    free = eng.cache.allocator.num_free
    costs = measure_step_costs(eng, 7, repeats=1)
    assert sorted(costs._seconds) == [1, 2, 3, 4, 6, 7]
    assert {k[:2] for k in stack.graphs} == {(1, 1), (2, 1), (4, 1), (4, 2), (4, 3)}
    assert stack.replays == 2 * 6 and stack.worst <= 1e-5  # each row count: an untimed forward, a timed one
    assert eng.cache.allocator.num_free == free  # the timing's blocks went back
