"""Exact greedy ids from a bf16 or int8 screen of the head (`infer/cpu/greedy.py`, the screens of
`kernels/cpu/greedy.py`): always the
argmax of the logits the head's own kernel gives (`packed_gemm` for an fp32 head, bf16-rounded
`packed_pairs_gemm` for a quantized artifact's bf16 head), ties to the lowest index, including
where the approximation orders two tokens the other way."""

import dataclasses

import pytest
import torch

from quantspec.infer.cpu.greedy import GreedyHead
from quantspec.infer.sampler import greedy_ids
from quantspec.kernels.cpu import (PAIR_ABS_ERR, PairRows, cpu_kernels, int8_screen_tables, pack_dense, pack_pairs, pack_w8_pairs,
                                   packed_gemm, packed_pairs_gemm, row_norms_up, screen_bound, screened_argmax_pairs,
                                   unpack_w8_pairs)

pytestmark = pytest.mark.skipif(cpu_kernels() is None, reason="quantspec's CPU kernels are not built here")


BF16_DOT = cpu_kernels() is not None and cpu_kernels().has_bf16_dot()
I8 = cpu_kernels() is not None and cpu_kernels().has_int8_screen()  # AVX512-VNNI and -BF16
PATHS = ["rows"] + (["pairs"] if BF16_DOT else []) + (["i8"] if I8 else [])


def _i8(x, w, exact, rel=None):
    """screened_argmax_i8 over head w (fp32 x: exact = packed fp32; bf16 x: the pair-packed head);
    rel=0 drops the whole bound (the approximation alone decides)"""
    q, scale, u, t, r, abs_err = int8_screen_tables(w)
    if rel == 0.0:
        u, t, r, abs_err = torch.zeros_like(u), torch.zeros_like(t), 0.0, 0.0
    return cpu_kernels().screened_argmax_i8(x.contiguous(), q, scale, u, t, exact, w.shape[0], r, abs_err).tolist()


def _screen(x, w, rel=None, path="rows", prefetch=True):
    row_norm = row_norms_up(w)
    k = cpu_kernels()
    if path == "i8":
        return _i8(x, w, pack_dense(w), rel)
    if path == "pairs":
        rel = screen_bound(w.shape[1], bf16_x=True) if rel is None else rel
        return screened_argmax_pairs(x.contiguous(), pack_pairs(w), pack_dense(w), row_norm, w.shape[0], rel,
                                     PAIR_ABS_ERR if rel else 0.0, prefetch=prefetch).tolist()
    rel = screen_bound(w.shape[1]) if rel is None else rel
    return k.screened_argmax(x.contiguous(), w.to(torch.bfloat16).contiguous(), pack_dense(w),
                             row_norm, w.shape[0], rel).tolist()


def _want(x, w):
    return greedy_ids(packed_gemm(x, pack_dense(w), w.shape[0]))


def test_int8_tables_of_a_bf16_head_read_from_its_packed_rows():
    """A bf16 head's int8 screen tables from its pair-packed copy, a slice of rows at a time
    (`PairRows`; 1000 rows of K = 3000 read in chunks of 349 that cross the 32-row blocks), are
    those of the unpacked weight."""
    w = (torch.randn(1000, 3000, generator=torch.Generator().manual_seed(0)) * 0.05).bfloat16()
    rows = PairRows(pack_pairs(w), 1000)
    assert rows.shape == (1000, 3000)
    for a, b in ((0, 1000), (5, 40), (33, 34), (990, 1000), (7, 7)):
        assert torch.equal(rows[a:b], w[a:b])
    for got, want in zip(int8_screen_tables(rows), int8_screen_tables(w)):
        assert torch.equal(got, want) if isinstance(want, torch.Tensor) else got == want


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
    if path != "i8":  # the int8 copy's own misordering: test_int8_bound_is_needed
        assert _screen(x2, wt, rel=0.0, path=path) == [0]


@pytest.mark.parametrize("path", PATHS)
def test_non_finite_rows_are_left_to_the_logits(path):
    w = torch.randn(100, 64) * 0.1
    x = torch.randn(3, 64)
    x[1, 5] = float("nan")
    got = _screen(x, w, path=path)
    assert got[1] == -1 and [got[0], got[2]] == [_want(x[[0]], w)[0], _want(x[[2]], w)[0]]


class _RepeatDrafter:
    """Drafts the sequence's last `max_draft_tokens` tokens again every step (its budget allowing):
    verification steps of 1 + k rows whether or not the drafts are right."""

    needs_hidden = False

    def __init__(self, max_draft_tokens: int):
        self.max_draft_tokens = max_draft_tokens

    def propose(self, seqs, budgets):
        from quantspec.infer.spec.types import SpecProposal

        drafts = []
        for seq, b in zip(seqs, budgets):
            toks = list(seq.prompt_ids) + list(seq.output_ids)
            drafts.append(toks[-min(b, self.max_draft_tokens):] if b > 0 else [])
        return SpecProposal.from_token_lists(drafts)

    def release(self, seq) -> None:
        pass


def _greedy_run(lm, head, proposer) -> list[int]:
    """30 greedy tokens of a repetitive prompt with `head` as the runtime's greedy picker (None:
    the logits), plain or with `proposer` (up to its max_draft_tokens drafts a step)."""
    from quantspec.infer.engine import Engine, EngineConfig
    from quantspec.infer.sampler import SamplingParams

    drafts = proposer.max_draft_tokens if proposer is not None else 6
    eng = Engine(lm.model, EngineConfig(block_size=16, max_length=128, spec_max_draft_tokens=drafts),
                 eos_token_ids=[], proposer=proposer, runtime=dataclasses.replace(lm.runtime, greedy=head))
    seq = eng.add_request([5, 9, 300, 41, 7, 5, 9, 300, 41, 7, 5, 9, 300], SamplingParams(max_new_tokens=30))
    eng.run()
    return seq.output_ids


def test_engine_greedy_runs_are_unchanged(tmp_path):
    """Plain greedy decoding and n-gram speculation give the same tokens with the screen as with
    the logits, and the screen really picked (decode rows and verifications of up to 10 drafts:
    the int8 screen up to 8 rows, the bf16 pair screen above, where the CPU has them)."""
    from quantspec.infer.loader import load_for_inference
    from quantspec.infer.spec.proposers import ReferenceProposer
    from quantspec.model_zoo.tiny import build_tiny_model

    src = build_tiny_model(tmp_path / "m", "llama", hidden=128, heads=2, kv_heads=1, intermediate=128, seed=2)
    lm = load_for_inference(src, tokenizer=False)
    model, head = lm.model, lm.runtime.greedy
    assert isinstance(head, GreedyHead)
    calls, declined = [], []  # the rows of the steps the screen picked for, of those it left to the logits

    def head_spy(h):
        ids = head(h)
        (declined if ids is None else calls).append(h.shape[0])
        return ids

    for proposer in (None, ReferenceProposer(2, 6), _RepeatDrafter(10)):
        assert _greedy_run(lm, head_spy, proposer) == _greedy_run(lm, None, proposer)
    assert calls and min(calls) == 1 and max(calls) <= head.max_rows
    assert all(r > head.max_rows for r in declined)  # beyond its rows only (11: the screens without AVX512-BF16)
    if head.i8 is not None:  # both screens served this run
        assert any(c <= head.i8_rows for c in calls) and any(c > head.i8_rows for c in calls)
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
        lm = load_for_inference(src, tokenizer=False)
        h = torch.randn(2, 128)
        assert lm.runtime.greedy(h) == greedy_ids(lm.model.compute_logits(h))


@pytest.mark.skipif("pairs" not in PATHS, reason="no AVX512-BF16 here")
def test_screen_with_and_without_prefetch():
    """The pair screen's tiles of 8 or more rows prefetch the next block of the bf16 copy
    (`prefetch=`; `bench/spec_cost.py --prefetch-ab` measures what it saves): on or
    off, the exact ids. The prefetching tiles are handed the next block's address beside their
    own; a tile that read it in place of its own would show here (where a prefetch goes cannot
    change an id; the bench shows whether it pays)."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(4099, 576, generator=g) * 0.05
    for rows in (8, 11, 12, 13):  # 13: two tiles a block, which do not prefetch
        x = torch.randn(rows, 576, generator=g) * 4
        off = _screen(x, w, path="pairs", prefetch=False)
        on = _screen(x, w, path="pairs", prefetch=True)
        assert on == off == _want(x, w)


# ---- the int8 screen of a bf16 head (a quantized artifact's): bf16 logits, ties to the lowest index


def _want_bf16(x, w):
    """argmax of the bf16 logits `packed_pairs_gemm` gives (what compute_logits' argmax picks)."""
    return greedy_ids(packed_pairs_gemm(x.contiguous(), pack_pairs(w), w.shape[0]).float())


@pytest.mark.skipif(not I8, reason="no AVX512-VNNI / AVX512-BF16 here")
def test_bf16_head_random_rows_and_rounded_ties():
    g = torch.Generator().manual_seed(4)
    for n, k, rows in ((1000, 64, 7), (4099, 576, 3), (77, 208, 16), (517, 64, 12), (93, 64, 13), (4099, 576, 1)):
        w = (torch.randn(n, k, generator=g) * 0.05).bfloat16()
        x = (torch.randn(rows, k, generator=g) * 4).bfloat16()
        assert _i8(x, w, pack_pairs(w)) == _want_bf16(x, w)
    # logits whose bf16 values tie while their fp32 sums differ: the lowest index among the
    # rounded maxima wins, not the larger fp32 sum. Row 7's weights = row 3's, then a few ulps of
    # bf16 on one element of row 7: its fp32 logit is a little larger, its bf16 logit the same
    k = 64
    w = (torch.randn(50, k, generator=g) * 0.05).bfloat16()
    x = (torch.randn(1, k, generator=g) * 4).bfloat16()
    best = _want_bf16(x, w)[0]
    rival = (best + 7) % 50
    w[rival] = w[best]
    j = int(x[0].float().abs().argmax())
    bits = w[best, j:j + 1].view(torch.int16)  # one bf16 ulp of w[best, j] towards x_j's sign
    w[rival, j:j + 1] = (bits + (1 if (w[best, j] > 0) == (x[0, j] > 0) else -1)).view(torch.bfloat16)
    exact = x.float() @ w.float().t()
    assert exact[0, rival] > exact[0, best]  # fp32 orders the rival first...
    logits = packed_pairs_gemm(x, pack_pairs(w), 50).float()
    assert logits[0, rival] == logits[0, best]  # ...bf16 rounds them equal
    assert _i8(x, w, pack_pairs(w)) == _want_bf16(x, w) == [min(best, rival)]


@pytest.mark.skipif(not I8, reason="no AVX512-VNNI / AVX512-BF16 here")
def test_int8_bound_is_needed():
    """Two outputs the int8 copy orders one way and the exact dot product the other: with the
    proven bound the exact winner, by the approximation alone (no bound) the wrong one. Both rows
    have max |w| = 1 (scale s = 1/127); a = (1, 125.45 s, 0.45 s) has codes (127, 125, 0),
    b = (1, 125.8 s) codes (127, 126), so x = (1, 1, 1) scores a above b exactly (1 + 125.9 s vs
    1 + 125.8 s) and below it from the copy (1 + 125 s vs 1 + 126 s)."""
    s = 1.0 / 127
    w = torch.zeros(2, 16)
    w[0, :2] = torch.tensor([1.0, 125.8 * s])  # b
    w[1, :3] = torch.tensor([1.0, 125.45 * s, 0.45 * s])  # a
    x = torch.zeros(1, 16)
    x[0, :3] = 1.0
    assert _want(x, w) == [1]
    assert _i8(x, w, pack_dense(w)) == [1]
    assert _i8(x, w, pack_dense(w), rel=0.0) == [0]


@pytest.mark.skipif(not I8, reason="no AVX512-VNNI / AVX512-BF16 here")
def test_int8_bound_covers_the_rounding_of_x():
    """The screen rounds x to integers on a grid of σ = max|x| / 16383: with one large element the
    small ones round coarsely. Outputs a = (0, 1, 0, 0) and b = (0, 0, 76/127, 1) (int8 codes exact,
    so the copy's own residual is ~0) against x = (16383, 0.4, 0.6, 0): exactly a scores 0.4 and
    b 0.359, on the grid (σ = 1) a scores 0 and b 0.598. The bound's ‖x − σ xq‖ term keeps a."""
    w = torch.zeros(2, 4)
    w[0, 1] = 1.0  # a
    w[1, 2], w[1, 3] = 76 / 127, 1.0  # b
    x = torch.tensor([[16383.0, 0.4, 0.6, 0.0]])
    assert _want(x, w) == [0]
    q, scale, *_ = int8_screen_tables(w)
    xq = torch.round(x / 1.0)  # σ = 16383 / 16383
    approx = (xq @ (unpack_w8_pairs(q, 2).float() * scale[:, None]).t())[0]
    assert approx[1] > approx[0]  # the grid alone picks b
    assert _i8(x, w, pack_dense(w)) == [0]
    assert _i8(x, w, pack_dense(w), rel=0.0) == [1]
    assert _i8(x.bfloat16(), w.bfloat16(), pack_pairs(w.bfloat16())) == _want_bf16(x.bfloat16(), w.bfloat16()) == [0]


@pytest.mark.skipif(not I8, reason="no AVX512-VNNI / AVX512-BF16 here")
def test_int8_screen_wide_rows_and_outliers():
    """K = 2048 narrows x's integer grid (|xq| ≤ (2^31 − 1) / (127 K) = 8256, so no int32 sum can
    overflow) and rows with a 1000x outlier put most elements within a few grid steps: the ids
    stay the head's own argmax."""
    g = torch.Generator().manual_seed(5)
    w = torch.randn(300, 2048, generator=g) * 0.05
    x = torch.randn(6, 2048, generator=g)
    x[:3, 17] = 1000.0
    x[3, :] = torch.randn(2048, generator=g) * 1e-37  # subnormal products (and a subnormal σ)
    x[4, :] = 0.0  # every output ties at 0: the lowest index
    assert _i8(x, w, pack_dense(w)) == _want(x, w)
    assert _want(x, w)[4] == 0
    xb, wb = x.bfloat16(), w.bfloat16()
    assert _i8(xb, wb, pack_pairs(wb)) == _want_bf16(xb, wb)


def test_pack_w8_pairs_layout():
    g = torch.Generator().manual_seed(6)
    q = torch.randint(-127, 128, (70, 10), generator=g, dtype=torch.int8)
    p = pack_w8_pairs(q)
    assert p.shape == (3, 5, 64) and p.dtype == torch.int8
    for n, k in ((0, 0), (35, 4), (69, 9), (33, 7)):  # byte 2j + e of block b, pair p = q[32 b + j, 2 p + e]
        assert p[n // 32, k // 2, 2 * (n % 32) + k % 2] == q[n, k]
    assert (p[2, :, 2 * 6:] == 0).all()  # rows 70..95 padded with zeros
    assert torch.equal(unpack_w8_pairs(p, 70), q)
    with pytest.raises(ValueError, match="must be even"):
        pack_w8_pairs(q[:, :9])


@pytest.mark.skipif(not I8, reason="no AVX512-VNNI / AVX512-BF16 here")
def test_int8_screen_bad_input():
    w = torch.randn(100, 64) * 0.1
    q, scale, u, t, rel, abs_err = int8_screen_tables(w)
    k = cpu_kernels()
    x = torch.randn(2, 64)
    with pytest.raises(RuntimeError, match="for float32 x, exact must be the packed fp32 head"):
        k.screened_argmax_i8(x, q, scale, u, t, pack_pairs(w), 100, rel, abs_err)
    with pytest.raises(RuntimeError, match="for bf16 x, exact must be the pair-packed bf16 head"):
        k.screened_argmax_i8(x.bfloat16(), q, scale, u, t, pack_dense(w), 100, rel, abs_err)
    with pytest.raises(RuntimeError, match="scale must be a contiguous float32 tensor of 100 values"):
        k.screened_argmax_i8(x, q, scale[:50], u, t, pack_dense(w), 100, rel, abs_err)
    with pytest.raises(RuntimeError, match="rel and abs_err must be >= 0"):
        k.screened_argmax_i8(x, q, scale, u, t, pack_dense(w), 100, -1.0, abs_err)
    with pytest.raises(RuntimeError, match=r"q must be contiguous int8 \[NB, K/2, 64\] \(pack_w8_pairs\)"):
        k.screened_argmax_i8(x, pack_dense(w).to(torch.int8), scale, u, t, pack_dense(w), 100, rel, abs_err)


@pytest.mark.skipif(not I8, reason="no AVX512-VNNI / AVX512-BF16 here")
def test_quantized_artifact_greedy_runs_are_unchanged(tmp_path):
    """A weight-only int8 artifact (bf16 head) gets the int8 screen: plain greedy and n-gram
    speculation give the same tokens with it as with the bf16 logits, and it really picked."""
    from quantspec import api
    from quantspec.infer.loader import load_for_inference
    from quantspec.infer.spec.proposers import ReferenceProposer
    from quantspec.model_zoo.tiny import build_tiny_model

    src = build_tiny_model(tmp_path / "m", "llama", hidden=128, heads=2, kv_heads=1, intermediate=128, seed=5)
    api.quantize(str(src), "weight_only_int8", tmp_path / "q")
    lm = load_for_inference(tmp_path / "q", dtype=torch.bfloat16, tokenizer=False)  # as --dtype auto on CPU
    model, head = lm.model, lm.runtime.greedy
    assert isinstance(head, GreedyHead) and head.bf16 and head.i8 is not None
    calls = []
    spy = lambda h: calls.append(h.shape[0]) or head(h)  # noqa: E731
    for proposer in (None, ReferenceProposer(2, 6), _RepeatDrafter(10)):
        assert _greedy_run(lm, spy, proposer) == _greedy_run(lm, None, proposer)
    assert calls and min(calls) == 1 and max(calls) > 7  # the int8 screen at 8-11 rows too
    h = torch.randn(3, 128).bfloat16()
    assert head(h) == greedy_ids(model.compute_logits(h))
    assert head(torch.randn(head.max_rows + 1, 128).bfloat16()) is None  # beyond its rows: the logits
