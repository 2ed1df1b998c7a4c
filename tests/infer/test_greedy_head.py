"""Exact greedy ids from a bf16 screen of the fp32 head (`infer/greedy_head.py`): always the
argmax of the logits `packed_gemm` gives, ties to the lowest index, including where the bf16
approximation orders two tokens the other way."""

import pytest
import torch

from quantspec.infer.greedy_head import PAIR_ABS_ERR, GreedyHead, pack_pairs, row_norms_up, screen_bound
from quantspec.infer.sampler import greedy_ids
from quantspec.kernels.cpu import cpu_kernels, pack_dense, packed_gemm

pytestmark = pytest.mark.skipif(cpu_kernels() is None, reason="quantspec's CPU kernels are not built here")


PATHS = ["rows"] + (["pairs"] if cpu_kernels() is not None and cpu_kernels().has_bf16_dot() else [])


def _screen(x, w, rel=None, path="rows"):
    row_norm = row_norms_up(w)
    k = cpu_kernels()
    if path == "pairs":
        rel = screen_bound(w.shape[1], bf16_x=True) if rel is None else rel
        return k.screened_argmax_pairs(x.contiguous(), pack_pairs(w), pack_dense(w), row_norm, w.shape[0], rel,
                                       PAIR_ABS_ERR if rel else 0.0).tolist()
    rel = screen_bound(w.shape[1]) if rel is None else rel
    return k.screened_argmax(x.contiguous(), w.to(torch.bfloat16).contiguous(), pack_dense(w),
                             row_norm, w.shape[0], rel).tolist()


def _want(x, w):
    return greedy_ids(packed_gemm(x, pack_dense(w), w.shape[0]))


@pytest.mark.parametrize("path", PATHS)
def test_random_heads_and_rows(path):
    g = torch.Generator().manual_seed(0)
    # row counts around the pair screen's 12-row tile; output counts with a partial 8-lane tail
    for n, k, rows in ((1000, 64, 7), (4099, 576, 3), (77, 208, 16), (4099, 576, 11), (517, 64, 12), (93, 64, 13)):
        w = torch.randn(n, k, generator=g) * 0.05
        x = torch.randn(rows, k, generator=g) * 4
        assert _screen(x, w, path=path) == _want(x, w)


@pytest.mark.parametrize("path", PATHS)
def test_near_ties_exact_ties_and_bf16_misorderings(path):
    g = torch.Generator().manual_seed(1)
    k = 128
    w = torch.randn(300, k, generator=g) * 0.05
    x = torch.randn(40, k, generator=g)
    best = _want(x, w)
    for r, n in enumerate(best):  # a rival of every row's winner, a few ulps either side
        w[(n + 1 + r) % 300] = w[n] * (1 + (r - 20) * 2.0 ** -23)
    w[299] = w[best[0]]  # an exact duplicate of row 0's winner after it: the lower index wins
    assert _screen(x, w, path=path) == _want(x, w)

    # two rows that bf16 orders one way and fp32 the other (u = bf16's step in [1, 2)):
    # a = (1 + .49u, 1 + .49u) rounds to (1, 1); b = (1, 1 + .51u) rounds to (1, 1 + u), so x = (1, 1)
    # scores a above b exactly (2 + .98u > 2 + .51u) and below it in bf16 (2 < 2 + u). With the
    # proven bound the exact winner; screening by the approximation alone (rel = 0) is wrong
    u = 2.0 ** -7
    wt = torch.zeros(2, 16)
    wt[0, :2] = torch.tensor([1.0, 1 + 0.51 * u])  # b
    wt[1, :2] = torch.tensor([1 + 0.49 * u, 1 + 0.49 * u])  # a
    x2 = torch.zeros(1, 16)
    x2[0, :2] = 1.0
    assert _want(x2, wt) == [1]
    assert _screen(x2, wt, path=path) == [1]
    assert _screen(x2, wt, rel=0.0, path=path) == [0]


@pytest.mark.parametrize("path", PATHS)
def test_non_finite_rows_are_left_to_the_logits(path):
    w = torch.randn(100, 64) * 0.1
    x = torch.randn(3, 64)
    x[1, 5] = float("nan")
    got = _screen(x, w, path=path)
    assert got[1] == -1 and [got[0], got[2]] == [_want(x[[0]], w)[0], _want(x[[2]], w)[0]]


def test_engine_greedy_runs_are_unchanged(tmp_path):
    """Plain greedy decoding and n-gram speculation give the same tokens with the screen as with
    the logits, and the screen really picked (decode rows and verifications of up to 6 drafts)."""
    from quantspec.infer.engine import Engine, EngineConfig
    from quantspec.infer.loader import load_for_inference
    from quantspec.infer.sampler import SamplingParams
    from quantspec.infer.spec.proposers import ReferenceProposer
    from quantspec.model_zoo.tiny import build_tiny_model

    src = build_tiny_model(tmp_path / "m", "llama", hidden=128, heads=2, kv_heads=1, intermediate=128, seed=2)
    model = load_for_inference(src, tokenizer=False).model
    head = model.greedy_head
    assert isinstance(head, GreedyHead)
    calls = []
    real = head.__call__
    head_spy = lambda h: calls.append(h.shape[0]) or real(h)  # noqa: E731
    prompt = [5, 9, 300, 41, 7, 5, 9, 300, 41, 7, 5, 9, 300]

    def run(proposer, use_head):
        model.greedy_head = head_spy if use_head else None
        eng = Engine(model, EngineConfig(block_size=16, max_length=128, spec_max_draft_tokens=6),
                     eos_token_ids=[], proposer=proposer)
        seq = eng.add_request(prompt, SamplingParams(max_new_tokens=30))
        eng.run()
        return seq.output_ids

    for proposer in (None, ReferenceProposer(2, 6)):
        assert run(proposer, True) == run(proposer, False)
    assert calls and max(calls) <= head.max_rows
    model.greedy_head = head
    h = torch.randn(1, 128)
    assert head(h) is not None
    with torch.no_grad():
        model.lm_head.packed[0, 0, 0] += 1.0  # changed in place: the bf16 copy is stale
    assert head(h) is None
    model.lm_head = torch.nn.Linear(128, model.args.vocab_size, bias=False)  # swapped: no screen
    assert head(h) is None


def test_a_model_loaded_under_inference_mode(tmp_path):
    from quantspec.infer.loader import load_for_inference
    from quantspec.model_zoo.tiny import build_tiny_model

    src = build_tiny_model(tmp_path / "m", "llama", hidden=128, heads=2, kv_heads=1, intermediate=128, seed=2)
    with torch.inference_mode():
        model = load_for_inference(src, tokenizer=False).model
        h = torch.randn(2, 128)
        assert model.greedy_head(h) == greedy_ids(model.compute_logits(h))


@pytest.mark.skipif("pairs" not in PATHS, reason="no AVX512-BF16 here")
def test_screen_with_and_without_prefetch():
    """The pair screen's tiles of 8 or more rows prefetch the next block of the bf16 copy
    (`kernels.cpu.prefetch`; `bench/spec_cost.py --prefetch-ab` measures what it saves): on or
    off, the exact ids. The prefetching tiles are handed the next block's address beside their
    own; a tile that read it in place of its own would show here (where a prefetch goes cannot
    change an id; the bench shows whether it pays)."""
    from quantspec.kernels.cpu import prefetch

    g = torch.Generator().manual_seed(3)
    w = torch.randn(4099, 576, generator=g) * 0.05
    for rows in (8, 11, 12, 13):  # 13: two tiles a block, which do not prefetch
        x = torch.randn(rows, 576, generator=g) * 4
        with prefetch(False):
            off = _screen(x, w, path="pairs")
        with prefetch(True):
            on = _screen(x, w, path="pairs")
        assert on == off == _want(x, w)
