"""Token trees (`infer/spec/tree.py`): the spec, pruning and walks on literal arrays, chi-square
tests that multi-candidate rejection sampling is lossless, the tree mask of the attention (the
CPU kernel's slot tables against SDPA's masks), and trees through the engine: greedy output
identical to plain decoding, with the CPU kernel and stack runner and with SDPA."""

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from quantspec.errors import QuantSpecError
from quantspec.infer.engine import Engine, EngineConfig
from quantspec.infer.kv_cache import AttentionMetadata, PagedAttention, PagedKVCache, ancestor_rows
from quantspec.infer.sampler import SamplingParams
from quantspec.infer.spec.tree import (TreeSpec, best_paths, caterpillar, depths, greedy_walk, parse_tree_spec, prune,
                                       row_paths, sampling_walk, verify_trees)
from quantspec.infer.spec.types import SpecProposal
from quantspec.infer.spec.verify import verify_greedy_ids

torch.set_num_threads(1)


# -- pure functions -------------------------------------------------------------------------------


def test_parse_tree_spec():
    assert parse_tree_spec("4x2") == TreeSpec(4, 2)
    assert parse_tree_spec(" 3X1 ").num_nodes == 3
    assert parse_tree_spec(None) is None and parse_tree_spec("") is None
    assert parse_tree_spec("4x4:8") == TreeSpec(4, 4, 8)
    assert parse_tree_spec("4x4:8").num_nodes == 8 and parse_tree_spec("4x4:8").dynamic
    assert not parse_tree_spec("4x2").dynamic
    assert parse_tree_spec("4x2:30").num_nodes == 30  # the full tree: 2 + 4 + 8 + 16
    for bad in ("4", "4x", "x2", "4x2x1", "0x2", "40x2", "a", "4x2:", "4x2:0", "4x2:a", "4x4:65", "4x2:31"):
        with pytest.raises(QuantSpecError, match="--speculate-tree"):
            parse_tree_spec(bad)


@pytest.mark.parametrize("D,K,n", [(1, 3, 2), (3, 2, 5), (3, 3, 14), (4, 2, 30), (2, 4, 20)])
def test_best_paths_are_the_n_best_of_every_path(D, K, n):
    """Against enumerating every path: the n best by summed log-probability (ties: shallower,
    then earlier choices), each node's parent its prefix, every prefix a tree."""
    import itertools

    g = torch.Generator().manual_seed(D * 100 + K * 10 + n)
    lp = torch.log_softmax(torch.randn(D, K, generator=g) * 2, dim=-1).tolist()
    lp[0][1] = lp[0][0]  # one exact tie
    every = [p for d in range(1, D + 1) for p in itertools.product(range(K), repeat=d)]
    want = sorted(every, key=lambda p: (-sum(lp[d][c] for d, c in enumerate(p)), len(p), p))[:n]
    nodes, parents = best_paths(lp, n)
    assert nodes == want
    rank = {p: r for r, p in enumerate(nodes, start=1)}
    assert parents == [rank.get(p[:-1], 0) for p in nodes]
    assert all(par <= j for j, par in enumerate(parents))


def test_caterpillar_depths_mask_prune():
    tokens, parents = caterpillar([[5, 6], [7, 8], [9]])
    assert tokens == [5, 6, 7, 8, 9] and parents == [0, 0, 1, 1, 3]
    assert depths(parents) == [0, 1, 1, 2, 2, 3]
    m = ancestor_rows(parents, 6)
    assert m[5].nonzero().flatten().tolist() == [0, 1, 3, 5]
    assert m[2].nonzero().flatten().tolist() == [0, 2]
    assert torch.equal(ancestor_rows(None, 3), torch.ones(3, 3, dtype=torch.bool).tril())
    assert prune(parents, 5, 2) == ([0, 1, 2, 3], [0, 0, 1, 1])
    assert prune(parents, 3, 9) == ([0, 1, 2], [0, 0, 1])
    assert prune([0, 1, 0], 3, 1) == ([0, 2], [0, 0])


def test_greedy_walk_takes_any_matching_child_and_chains_agree():
    tokens, parents = caterpillar([[5, 6], [7, 8]])
    assert greedy_walk(tokens, parents, [6, 0, 1, 2, 3]) == ([0, 2], [6, 1])
    assert greedy_walk(tokens, parents, [5, 8, 0, 0, 4]) == ([0, 1, 4], [5, 8, 4])
    assert greedy_walk(tokens, parents, [9, 0, 0, 0, 0]) == ([0], [9])
    # a chain is a tree: the same tokens as the chain verifier
    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        k = int(torch.randint(0, 5, (1,), generator=g))
        drafts = torch.randint(0, 3, (k,), generator=g).tolist()
        target = torch.randint(0, 3, (k + 1,), generator=g).tolist()
        chain = verify_greedy_ids([torch.tensor(drafts, dtype=torch.int64)], target)
        assert greedy_walk(drafts, list(range(k)), target)[1] == chain.output_tokens[0]


def test_proposal_checks_parents():
    SpecProposal([torch.tensor([1, 2], dtype=torch.int64)], parents=[[0, 0]])
    with pytest.raises(QuantSpecError, match="parents"):
        SpecProposal([torch.tensor([1, 2], dtype=torch.int64)], parents=[[0, 2]])


# -- sampling: lossless (chi-square) -------------------------------------------------------------

# root row, then rows of drafts 0..2 (tree: 0 and 1 under the root, 2 under draft 0)
P = np.array([[0.30, 0.25, 0.20, 0.12, 0.08, 0.05],
              [0.05, 0.10, 0.40, 0.20, 0.15, 0.10],
              [0.15, 0.15, 0.10, 0.30, 0.20, 0.10],
              [0.10, 0.30, 0.10, 0.20, 0.10, 0.20]])
Q = np.array([0.10, 0.15, 0.20, 0.25, 0.15, 0.15])
N = 20000


def _pvalue(tokens, p):
    counts = np.bincount(np.asarray(tokens), minlength=p.size)
    if counts[p == 0].any():
        return 0.0
    return chisquare(counts[p > 0], counts.sum() * p[p > 0]).pvalue


@pytest.mark.parametrize("kind", ["deterministic", "random_q"])
def test_sampling_walk_is_target_distributed(kind):
    rng = np.random.default_rng(0)
    g = torch.Generator().manual_seed(0)
    p_rows = torch.tensor(P, dtype=torch.float64)
    q_rows = torch.tensor(np.stack([Q, Q, P[1] * 0 + 1 / 6]), dtype=torch.float64) if kind == "random_q" else None
    outs = []
    for _ in range(N):
        if kind == "random_q":  # siblings drawn i.i.d. from Q, the grandchild from uniform
            tokens = [int(rng.choice(6, p=Q)), int(rng.choice(6, p=Q)), int(rng.integers(6))]
        else:
            tokens = [0, 2, 3]
        outs.append(sampling_walk(tokens, [0, 0, 1], p_rows, q_rows, g)[1])
    first = np.array([o[0] for o in outs])
    assert _pvalue(first, P[0]) > 1e-3
    if kind == "deterministic":  # after draft 0 (token 0) the next token follows row 1; after 2, row 2
        assert _pvalue([o[1] for o in outs if o[0] == 0], P[1]) > 1e-3
        assert _pvalue([o[1] for o in outs if o[0] == 2], P[2]) > 1e-3
        assert _pvalue([o[2] for o in outs if o[:2] == [0, 3]], P[3]) > 1e-3
        # wrong rule: resampling from p itself after rejections is not target distributed
        assert _pvalue(np.where(first == 0, 0, rng.choice(6, N, p=P[0])), P[0]) < 1e-6


def test_verify_trees_mixes_greedy_and_sampling():
    logits = torch.log(torch.tensor(np.concatenate([P, P[:2]]), dtype=torch.float32))  # [6, 6]
    trees = [([0, 2, 3], [0, 0, 1]), ([0], [0])]
    params = [SamplingParams(), SamplingParams(temperature=1.0, decode_strategy="sampling")]
    paths, outs = verify_trees(trees, [None, None], logits, params, [None, torch.Generator().manual_seed(1)])
    assert paths[0] == [0, 1] and outs[0] == [0, 2]  # argmax row 0 = 0 (draft 0), row 1 → 2 (no child)
    assert len(outs[1]) == len(paths[1])


# -- attention: the kernel's slot tables agree with SDPA's tree masks ----------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tree_attention_kernel_matches_masked_sdpa(dtype):
    from quantspec.infer.cpu.attention import CpuAttention

    kv, hd, layers = 2, 64, 1
    cache = PagedKVCache(num_layers=layers, num_blocks=12, block_size=16, num_kv_heads=kv, head_dim=hd, dtype=dtype,
                         kernel=CpuAttention.for_cache)
    if cache.kernel is None:
        pytest.skip("quantspec's CPU kernels are not built here")
    tables = [cache.allocator.allocate(4), cache.allocator.allocate(4)]
    g = torch.Generator().manual_seed(0)
    _, parents = caterpillar([[1, 2], [3, 4], [5, 6]])
    trees = [parents, None]
    q_lens, seq_lens = [7, 3], [7 + 20, 3 + 33]
    for b in range(2):  # the context
        ctx = seq_lens[b] - q_lens[b]
        meta = AttentionMetadata.build([ctx], [ctx], [tables[b]], 16, "cpu")
        PagedAttention(cache, meta)(0, *(torch.randn(ctx, n, hd, generator=g).to(dtype) for n in (4, kv, kv)))
    q = torch.randn(10, 4, hd, generator=g).to(dtype)
    k, v = (torch.randn(10, kv, hd, generator=g).to(dtype) for _ in range(2))
    fast = AttentionMetadata.build(q_lens, seq_lens, tables, 16, "cpu", cache.kernel, trees=trees)
    slow = AttentionMetadata.build(q_lens, seq_lens, tables, 16, "cpu", None, trees=trees)
    assert fast.kernel and fast.block_size == 1 and not slow.kernel
    a = PagedAttention(cache, fast)(0, q, k, v)
    b = PagedAttention(cache, slow)(0, q, k, v)
    torch.testing.assert_close(a.float(), b.float(), atol=2e-2 if dtype == torch.bfloat16 else 1e-5, rtol=0)


# -- the engine ----------------------------------------------------------------------------------


class _TreeOracle:
    """A caterpillar tree around a known greedy answer: at each depth `width` candidates, the
    right token among them (first, elsewhere or missing) at random."""

    needs_hidden = False

    def __init__(self, answers, depth=3, width=2, seed=0):
        self.answers, self.depth, self.width = answers, depth, width
        self.g = torch.Generator().manual_seed(seed)

    def propose(self, seqs, budgets):
        ids, parents = [], []
        for s, b in zip(seqs, budgets):
            cands = []
            for d in range(min(self.depth, b)):
                pos = len(s.output_ids) + d
                right = self.answers[s.seq_id][pos] if pos < len(self.answers[s.seq_id]) else 0
                c = torch.randint(3, 500, (self.width,), generator=self.g).tolist()
                slot = int(torch.randint(0, self.width + 1, (1,), generator=self.g))
                if slot < self.width:
                    c[slot] = right
                cands.append(c)
            tokens, par = caterpillar(cands)
            ids.append(torch.tensor(tokens, dtype=torch.int64))
            parents.append(par)
        return SpecProposal(ids, parents=parents)

    def release(self, seq):
        pass


def _engine_run(model, prompts, *, proposer=None, k=0, runtime=None, params=None, kv=None):
    a = model.args
    scales = {} if kv is None else {"k_scale": torch.full((a.num_layers, a.num_kv_heads), 0.05),
                                    "v_scale": torch.full((a.num_layers, a.num_kv_heads), 0.05)}
    eng = Engine(model, EngineConfig(block_size=16, max_batch_size=len(prompts), max_length=200,
                                     spec_max_draft_tokens=k, kv_cache_dtype=kv or "auto"),
                 eos_token_ids=[], proposer=proposer, runtime=runtime, **scales)
    seqs = [eng.add_request(p, params or SamplingParams(max_new_tokens=60), request_index=i)
            for i, p in enumerate(prompts)]
    eng.run()
    return seqs


def _check_tree_greedy(model, runtime=None, lengths=(9, 30, 17), kv=None):
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in lengths]
    plain = [s.output_ids for s in _engine_run(model, prompts, runtime=runtime, kv=kv)]
    proposer = _TreeOracle(plain, depth=3, width=2)
    seqs = _engine_run(model, prompts, proposer=proposer, k=6, runtime=runtime, kv=kv)
    assert [s.output_ids for s in seqs] == plain
    assert sum(s.stats.accepted for s in seqs) > 0
    for s in seqs:  # every accepted draft saved a base forward
        assert s.stats.target_forwards == len(s.output_ids) - 1 - s.stats.accepted
        assert len(s.stats.drafted_per_position) == 3


def test_tree_greedy_identical_to_plain_sdpa(tiny_llama_model):
    _check_tree_greedy(tiny_llama_model)


def test_tree_greedy_identical_to_plain_batched_and_int8_kv(tiny_llama_model):
    _check_tree_greedy(tiny_llama_model, lengths=[5 + i for i in range(20)])  # > 16 sequences: one masked SDPA
    _check_tree_greedy(tiny_llama_model, kv="int8")  # the accepted path's int8 keys / values move


def test_tree_greedy_identical_to_plain_cpu_kernel(tmp_path):
    from quantspec.infer.loader import load_for_inference
    from quantspec.kernels.cpu import cpu_kernels
    from quantspec.model_zoo.tiny import build_tiny_model

    if cpu_kernels() is None:
        pytest.skip("quantspec's CPU kernels are not built here")
    path = build_tiny_model(tmp_path / "llama", "llama", hidden=256, heads=4, kv_heads=2, intermediate=256,
                            num_layers=3, seed=5)
    loaded = load_for_inference(path)
    assert loaded.runtime.stack is not None
    _check_tree_greedy(loaded.model, loaded.runtime)


def test_tree_sampling_through_the_engine_is_reproducible(tiny_llama_model):
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (8, 13)]
    params = SamplingParams(max_new_tokens=40, decode_strategy="sampling", temperature=0.8, seed=7)
    greedy = [s.output_ids for s in _engine_run(tiny_llama_model, prompts)]
    runs = [[s.output_ids for s in _engine_run(tiny_llama_model, prompts, proposer=_TreeOracle(greedy), k=6,
                                                params=params)] for _ in range(2)]
    assert runs[0] == runs[1] and all(len(o) == 40 for o in runs[0])


def test_row_paths_are_the_drafts_from_the_root():
    tokens, parents = caterpillar([[10, 11], [20, 21], [30, 31]])
    assert row_paths(tokens, parents) == [[], [10], [11], [10, 20], [10, 21], [10, 20, 30], [10, 20, 31]]
    assert row_paths([5, 6, 7], None) == [[], [5], [5, 6], [5, 6, 7]] == row_paths([5, 6, 7], [0, 1, 2])
