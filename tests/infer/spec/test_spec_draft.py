"""The draft-model proposer through the engine: greedy output identical to the engine without
speculation (batch 1, mixed batches, 128 prompts), sampled drafts with their q verified so the
output follows the target's exact distribution (chi-square, with a draft whose q differs from p),
the draft's own KV cache kept in step, and the compatibility checks (tokenizer refused, padding
rows accepted)."""

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from quantspec.errors import QuantSpecError
from quantspec.infer.engine import Engine, EngineConfig
from quantspec.infer.sampler import SamplingParams, logits_to_probs, sampling_tensors
from quantspec.infer.spec.draft import DraftModelProposer, check_draft_compatible, common_vocab_size
from quantspec.infer.spec.proposers import AdaptiveDraftLength, SpecCost
from quantspec.model_zoo.checkpoint import load_model
from quantspec.model_zoo.llama import DenseCausalAttention
from quantspec.model_zoo.tiny import build_tiny_model

torch.set_num_threads(1)

FAR_NOISE = 0.2  # relative weight noise of the "far" draft (q far from p, same likely tokens)


@pytest.fixture(scope="module")
def base(tiny_llama_dir):
    return load_model(tiny_llama_dir)[0]


@pytest.fixture(scope="module")
def padded_other_dir(tmp_path_factory):
    """Same tokenizer, different weights (seed 1), vocab padded 512 → 576."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny_pad"), "llama", seed=1, vocab_pad_to=96)


@pytest.fixture(scope="module")
def far_draft(tiny_llama_dir, padded_other_dir):
    """The base's weights with heavy noise, in a model with 64 padding vocab rows: its top-k
    overlaps the base's, but its distribution q is far from the base's p."""
    base, _ = load_model(tiny_llama_dir)
    model, _ = load_model(padded_other_dir)
    src = dict(base.named_parameters())
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, p in model.named_parameters():
            w = src[name]
            p[: w.shape[0]] = w + FAR_NOISE * w.std() * torch.randn(w.shape, generator=g)
    return model


def _prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 500, (n,), generator=g).tolist() for n in lengths]


def _proposer(draft, base, *, k=4, batch=1, max_length=256, policy=None, block_size=16):
    return DraftModelProposer(draft, vocab_size=512, target_vocab_size=base.args.vocab_size, max_draft_tokens=k,
                              max_batch_size=batch, max_length=max_length, block_size=block_size, policy=policy)


def _run(model, prompts, params, *, proposer=None, batch=1, k=4, block_size=16, max_length=256, offset=0):
    eng = Engine(model, EngineConfig(block_size=block_size, max_batch_size=batch, max_length=max_length,
                                     spec_max_draft_tokens=k if proposer is not None else 0),
                 eos_token_ids=[], proposer=proposer)
    seqs = [eng.add_request(p, params, request_index=offset + i) for i, p in enumerate(prompts)]
    eng.run()
    return seqs


def _ids(seqs):
    return [s.output_ids for s in seqs]


# -- greedy: identical output ---------------------------------------------------------------------


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("adaptive", [False, True])
def test_draft_greedy_identical_to_plain(base, close_draft, batch, adaptive):
    prompts = _prompts([5, 17, 30, 2], seed=0)
    params = SamplingParams(max_new_tokens=40)
    plain = _ids(_run(base, prompts, params))
    policy = AdaptiveDraftLength(4, SpecCost(draft_per_token=0.3)) if adaptive else None
    prop = _proposer(close_draft, base, batch=batch, policy=policy)
    free = prop.cache.allocator.num_free
    seqs = _run(base, prompts, params, proposer=prop, batch=batch)
    assert _ids(seqs) == plain
    drafted = sum(s.stats.drafted for s in seqs)
    accepted = sum(s.stats.accepted for s in seqs)
    assert 0 < accepted < drafted  # some drafts accepted, some rejected
    assert len({s.stats.accepted for s in seqs}) > 1  # sequences accepted different counts
    assert any(s.stats.accepted_per_position[-1] > 0 for s in seqs)  # some steps accepted all
    assert prop.cache.allocator.num_free == free and not prop._seqs  # finished sequences released


def test_self_draft_accepts_everything(base, tiny_llama_dir):
    """The base drafting for itself: every draft is accepted, each step emits k + 1 tokens, and the
    draft cache's catch-up (last draft + bonus after a fully accepted step) stays exact."""
    twin, _ = load_model(tiny_llama_dir)
    prompts = _prompts([7, 19], seed=1)
    params = SamplingParams(max_new_tokens=33)
    plain = _ids(_run(base, prompts, params))
    seqs = _run(base, prompts, params, proposer=_proposer(twin, base, k=4, batch=2), batch=2)
    assert _ids(seqs) == plain
    for s in seqs:
        assert s.stats.accepted == s.stats.drafted > 0
        assert s.stats.target_forwards == -(-(len(s.output_ids) - 1) // 5)  # 5 tokens per forward


def test_draft_stops_at_eos_inside_accepted_drafts(base, tiny_llama_dir):
    """An eos among accepted drafts ends the sequence there (later drafts and the bonus dropped),
    exactly where plain decoding stops; the draft's cache is released."""
    twin, _ = load_model(tiny_llama_dir)  # accepts everything, so eos arrives inside a draft run
    prompts = _prompts([9, 14], seed=8)
    free = _ids(_run(base, prompts, SamplingParams(max_new_tokens=30)))
    eos = free[0][7]

    def run(proposer):
        eng = Engine(base, EngineConfig(block_size=16, max_batch_size=2, max_length=256,
                                        spec_max_draft_tokens=4 if proposer else 0),
                     eos_token_ids=[eos], proposer=proposer)
        seqs = [eng.add_request(p, SamplingParams(max_new_tokens=30)) for p in prompts]
        eng.run()
        return seqs

    prop = _proposer(twin, base, k=4, batch=2)
    plain, spec = run(None), run(prop)
    assert _ids(spec) == _ids(plain) and spec[0].output_ids[-1] == eos and spec[0].finish_reason == "eos"
    assert not prop._seqs


def test_draft_tiny_blocks_and_length_caps(base, close_draft):
    prompts = _prompts([3, 4, 9], seed=2)
    for params, max_length in ((SamplingParams(max_new_tokens=23), 256), (SamplingParams(max_new_tokens=200), 45)):
        plain = _ids(_run(base, prompts, params, block_size=4, max_length=max_length))
        prop = _proposer(close_draft, base, k=6, batch=2, block_size=4, max_length=max_length)
        spec = _run(base, prompts, params, proposer=prop, batch=2, k=6, block_size=4, max_length=max_length)
        assert _ids(spec) == plain


def test_draft_batch_of_128_equals_batch_1(base, close_draft):
    prompts = _prompts([2 + i % 9 for i in range(128)], seed=3)
    params = SamplingParams(max_new_tokens=8)
    plain = _ids(_run(base, prompts, params, max_length=32))
    many = _run(base, prompts, params, proposer=_proposer(close_draft, base, k=3, batch=128, max_length=32),
                batch=128, k=3, max_length=32)
    assert _ids(many) == plain
    assert sum(s.stats.accepted for s in many) > 0
    one = _run(base, prompts[:16], params, proposer=_proposer(close_draft, base, k=3, max_length=32), k=3,
               max_length=32)
    assert _ids(one) == plain[:16]


# -- sampling: lossless -----------------------------------------------------------------------------


def _next_probs(model, params):
    """ids → the next token's probabilities under `model` with `params` (the shared 512 tokens)."""
    tensors = sampling_tensors([params])

    def next_probs(ids):
        h = model(torch.tensor(ids), torch.arange(len(ids)), DenseCausalAttention(1, len(ids)))
        return logits_to_probs(model.compute_logits(h[-1:])[:, :512], *tensors)[0]

    return next_probs


def _sampled_counts(base, draft, prompt, params, rounds=12):
    """{continuation: count} of 128 × `rounds` sampled answers to `prompt` with `draft` proposing 2
    sampled drafts a step, and the drafts verified and accepted in all."""
    counts, drafted, accepted = {}, 0, 0
    for rnd in range(rounds):
        prop = _proposer(draft, base, k=2, batch=128, max_length=32)
        seqs = _run(base, [prompt] * 128, params, proposer=prop, batch=128, k=2, max_length=32, offset=rnd * 128)
        for s in seqs:
            counts[tuple(s.output_ids)] = counts.get(tuple(s.output_ids), 0) + 1
            drafted += s.stats.drafted
            accepted += s.stats.accepted
    return counts, drafted, accepted


@pytest.mark.parametrize("filters", [{"top_k": 3}, {"min_p": 0.3}])
def test_sampled_drafts_reproduce_the_target_distribution(base, far_draft, sequence_law, pooled_chisquare, filters):
    """Chi-square over the first 4 sampled tokens (token 1 from prefill, tokens 2-3 drafted and
    verified, token 4 the bonus or a plain step): speculation with a draft of different weights
    (q != p) reproduces the base's exact joint distribution, and not the draft's, under top-k or
    min-p."""
    draft = far_draft  # vocab 576 → sliced to the shared 512
    params = SamplingParams(decode_strategy="sampling", temperature=1.5, seed=5, max_new_tokens=4, **filters)
    (prompt,) = _prompts([8], seed=4)
    exact = sequence_law(_next_probs(base, params), prompt, 4)
    exact_draft = sequence_law(_next_probs(draft, params), prompt, 4)
    tv = 0.5 * sum(abs(exact.get(c, 0) - exact_draft.get(c, 0)) for c in set(exact) | set(exact_draft))
    assert tv > 0.4  # q really differs from p

    counts, drafted, accepted = _sampled_counts(base, draft, prompt, params)
    n = sum(counts.values())
    assert drafted >= 2 * n and 0 < accepted < drafted  # every sequence verified sampled drafts
    assert set(counts) <= set(exact)  # nothing outside the filtered support
    assert pooled_chisquare(counts, exact, n) > 1e-3
    draft_counts_fit = {c: v for c, v in counts.items() if c in exact_draft}
    assert sum(draft_counts_fit.values()) < n or pooled_chisquare(counts, exact_draft, n) < 1e-6


def test_sampled_drafts_reproducible_and_batch_invariant(tiny_llama_dir, padded_other_dir):
    """Seeded sampling with a draft model gives the same tokens in any batch (the draft's random
    stream is the request's own); here the base has padding rows, so q is padded with zeros."""
    base, _ = load_model(padded_other_dir)  # vocab 576, tokenizer 512
    draft, _ = load_model(tiny_llama_dir)
    prompts = _prompts([6, 15, 11], seed=6)
    params = SamplingParams(decode_strategy="sampling", temperature=0.8, top_p=0.9, seed=3, max_new_tokens=25)

    def run(batch):
        policy = AdaptiveDraftLength(3, SpecCost(draft_per_token=0.3))
        return _run(base, prompts, params, proposer=_proposer(draft, base, k=3, batch=batch, policy=policy),
                    batch=batch, k=3)

    one, three = run(1), run(3)
    assert _ids(one) == _ids(three)
    assert sum(s.stats.drafted for s in one) > 0
    assert all(len(s.output_ids) == 25 and max(s.output_ids) < 512 for s in one)


# -- compatibility ----------------------------------------------------------------------------------


def test_tokenizer_mismatch_is_refused(tiny_llama_dir, tmp_path):
    from transformers import AutoTokenizer

    other = build_tiny_model(tmp_path / "other_tok", "llama", tokenizer_variant=1)
    with pytest.raises(QuantSpecError) as e:
        check_draft_compatible(AutoTokenizer.from_pretrained(tiny_llama_dir), AutoTokenizer.from_pretrained(other),
                               "BASE_NAME", "DRAFT_NAME")
    msg = str(e.value)
    assert "\n" not in msg and "BASE_NAME" in msg and "DRAFT_NAME" in msg and "tokenizer" in msg


def test_special_token_mismatch_is_refused(tiny_llama_dir):
    from transformers import AutoTokenizer

    base_tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    draft_tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    check_draft_compatible(base_tok, draft_tok, "a", "b")  # identical: fine
    draft_tok.eos_token = "<|endoftext|>"
    with pytest.raises(QuantSpecError, match="special tokens"):
        check_draft_compatible(base_tok, draft_tok, "a", "b")


def test_padding_only_vocab_difference_is_accepted(tiny_llama_dir, padded_other_dir, close_draft):
    """A base with 64 padding rows and an unpadded draft: same tokenizer, accepted; greedy output
    identical to plain decoding of the padded base."""
    from transformers import AutoTokenizer

    tok_a, tok_b = AutoTokenizer.from_pretrained(tiny_llama_dir), AutoTokenizer.from_pretrained(padded_other_dir)
    check_draft_compatible(tok_a, tok_b, "base", "draft")
    assert common_vocab_size(tok_a, 576, 512, "base", "draft") == 512
    with pytest.raises(QuantSpecError, match="vocabulary rows"):
        common_vocab_size(tok_a, 576, 500, "base", "draft")
    padded, _ = load_model(padded_other_dir)
    prompts = _prompts([5, 12], seed=7)
    params = SamplingParams(max_new_tokens=30)
    plain = _ids(_run(padded, prompts, params))
    seqs = _run(padded, prompts, params, proposer=_proposer(close_draft, padded, batch=2), batch=2)
    assert _ids(seqs) == plain and sum(s.stats.drafted for s in seqs) > 0


def test_build_proposer_loads_and_checks_the_draft(tiny_llama_dir, padded_other_dir, tmp_path):
    """Through `build_proposer` (loading the draft with `load_for_inference`): a padded draft is accepted, a draft with a
    different tokenizer is refused naming both models."""
    loader = pytest.importorskip("quantspec.infer.loader")
    from quantspec.infer.predictor import InferConfig
    from quantspec.infer.spec.proposers import build_proposer

    loaded = loader.load_for_inference(str(tiny_llama_dir))
    cfg = InferConfig(model=str(tiny_llama_dir), speculate_method="draft", draft_model=str(padded_other_dir),
                      speculate_max_draft_token_num=3, max_length=64)
    prop, k = build_proposer(cfg, loaded)
    assert isinstance(prop, DraftModelProposer) and k == 3 and prop.vocab_size == 512
    from quantspec.kernels.cpu import cpu_kernels

    # drafts are scored by the int8 draft head by default (where the CPU kernels are built) ...
    assert (type(prop.head).__name__ == "PackedInt8Linear") is (cpu_kernels() is not None)
    # ... and by the artifact's own head on request
    assert build_proposer(dataclasses.replace(cfg, speculate_draft_head="artifact"), loaded)[0].head is None
    other = build_tiny_model(tmp_path / "other_tok", "llama", tokenizer_variant=1)
    cfg.draft_model = str(other)
    with pytest.raises(QuantSpecError) as e:
        build_proposer(cfg, loaded)
    assert str(other) in str(e.value) and str(tiny_llama_dir) in str(e.value)


# -- the int8 draft head (--speculate-draft-head) -----------------------------------------------


def test_int8_draft_head_is_lossless_and_drafts_with_its_codes(base, close_draft, padded_other_dir):
    """A draft scored by `int8_draft_head`: greedy output identical to plain decoding (batch 1 and a
    mixed batch), drafts that are the argmax of norm(h) @ (codes × scales)ᵀ over the common
    vocabulary (padding rows dropped), and a head that differs from the draft's own."""
    from quantspec.infer.cpu.linears import PackedInt8Linear
    from quantspec.infer.spec.draft import int8_draft_head
    from quantspec.kernels.cpu import cpu_kernels

    if cpu_kernels() is None:
        pytest.skip("quantspec's CPU kernels are not built here")
    padded, _ = load_model(padded_other_dir)  # 576 vocab rows, 512 usable
    head = int8_draft_head(padded, 512)
    assert type(head) is PackedInt8Linear and head.out_features == 512
    deq = head.dense_weight()
    own = padded.head_weight()[:512]
    step = own.abs().amax(dim=1, keepdim=True) / 127
    assert ((deq - own).abs() <= step / 2 + 1e-7).all() and not torch.equal(deq, own)

    head = int8_draft_head(close_draft, 512)
    prompts = _prompts([5, 17, 30, 2], seed=3)
    params = SamplingParams(max_new_tokens=40)
    plain = _ids(_run(base, prompts, params))
    for batch in (1, 3):
        prop = DraftModelProposer(close_draft, vocab_size=512, target_vocab_size=base.args.vocab_size,
                                  max_draft_tokens=4, max_batch_size=batch, max_length=256, block_size=16, head=head)
        seqs = _run(base, prompts, params, proposer=prop, batch=batch)
        assert _ids(seqs) == plain
        assert 0 < sum(s.stats.accepted for s in seqs) < sum(s.stats.drafted for s in seqs)
    # the drafts are the int8 head's argmax
    x = torch.randn(6, close_draft.args.hidden_size)
    with torch.inference_mode():
        want = (close_draft.model.norm(x) @ head.dense_weight().t()).argmax(-1)
        got = prop._choose(prop.head(close_draft.model.norm(x)).float(), [SimpleNamespace(params=params)] * 6,
                           [None] * 6)[0]
    assert got == want.tolist()
    with pytest.raises(QuantSpecError, match="fewer than vocab_size"):
        DraftModelProposer(close_draft, vocab_size=512, target_vocab_size=512, max_draft_tokens=4, max_batch_size=1,
                           max_length=64, head=int8_draft_head(close_draft, 100))


def test_draft_head_option_is_checked():
    from quantspec.infer.predictor import InferConfig

    with pytest.raises(QuantSpecError, match="--speculate-draft-head 'fp16' is not one of int8, artifact"):
        InferConfig(model="m", speculate_method="draft", draft_model="d", speculate_draft_head="fp16")
    with pytest.raises(QuantSpecError, match="applies to --speculate-method draft only"):
        InferConfig(model="m", speculate_method="inference_with_reference", speculate_draft_head="int8")
    assert InferConfig(model="m", speculate_method="draft", draft_model="d", speculate_draft_head="artifact")


# -- structured outputs: drafts verified under the grammar ------------------------------------------


def _guide(tiny_tokenizer_dir, pattern):
    pytest.importorskip("xgrammar")
    from transformers import AutoTokenizer

    from quantspec.infer.structured import Guide, GuideCompiler

    tok = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    return tok, GuideCompiler(tok, 512, [2]).compile(Guide("regex", pattern))


def test_guided_greedy_with_drafts_equals_guided_plain(base, close_draft, tiny_tokenizer_dir):
    """A draft model proposes freely; the grammar cuts what it rules out and the rows are verified
    under its masks: the guided greedy answers are those of guided decoding without drafts."""
    tok, guide = _guide(tiny_tokenizer_dir, "[a-z ]{4,60}")
    prompts = _prompts([5, 17, 30], seed=0)
    params = SamplingParams(max_new_tokens=30, guide=guide)
    plain = _ids(_run(base, prompts, params))
    seqs = _run(base, prompts, params, proposer=_proposer(close_draft, base, batch=3), batch=3)
    assert _ids(seqs) == plain
    assert all(s.speculate for s in seqs) and sum(s.stats.accepted for s in seqs) > 0
    for s in seqs:
        text = tok.decode(s.output_ids, skip_special_tokens=True)
        assert 4 <= len(text) <= 60 and set(text) <= set("abcdefghijklmnopqrstuvwxyz ")


def _guided_next_probs(model, params, guide, prompt_len):
    """ids → the next token's probabilities under `model`, `params` and the guide's mask after the
    answer so far (a fresh matcher fed the answer: no drafts, no rollback)."""
    from quantspec.infer.structured import guide_matcher, mask_logits

    tensors = sampling_tensors([params])

    def next_probs(ids):
        matcher = guide_matcher(guide)
        for t in ids[prompt_len:]:
            assert matcher.accept_token(t)
        h = model(torch.tensor(ids), torch.arange(len(ids)), DenseCausalAttention(1, len(ids)))
        logits = model.compute_logits(h[-1:])[:, :512].float()
        mask_logits(matcher, logits[0])
        return logits_to_probs(logits, *tensors)[0]

    return next_probs


def test_guided_sampled_drafts_reproduce_the_guided_distribution(base, far_draft, tiny_tokenizer_dir, sequence_law,
                                                                 pooled_chisquare):
    """Chi-square over 4 sampled tokens: sampled drafts of a different model (q ignores the
    grammar), verified under the grammar's masks, reproduce guided sampling's exact law."""
    _, guide = _guide(tiny_tokenizer_dir, "[a-z]{40,}")  # no end within 4 tokens
    params = SamplingParams(decode_strategy="sampling", temperature=1.5, seed=5, max_new_tokens=4, top_k=3,
                            guide=guide)
    (prompt,) = _prompts([8], seed=4)
    exact = sequence_law(_guided_next_probs(base, params, guide, len(prompt)), prompt, 4)
    counts, drafted, accepted = _sampled_counts(base, far_draft, prompt, params)
    n = sum(counts.values())
    assert drafted >= n and 0 < accepted < drafted
    assert set(counts) <= set(exact)  # nothing the grammar or top-k rules out
    assert pooled_chisquare(counts, exact, n) > 1e-3


def _penalized_next_probs(model, params, prompt_len):
    """ids → the next token's probabilities under `model` and `params`, with OpenAI's presence and
    frequency penalties over the answer so far written out (mu[j] - c[j] * frequency - presence)."""
    tensors = sampling_tensors([params])

    def next_probs(ids):
        h = model(torch.tensor(ids), torch.arange(len(ids)), DenseCausalAttention(1, len(ids)))
        logits = model.compute_logits(h[-1:])[:, :512].float()
        out = ids[prompt_len:]
        for j in set(out):
            logits[0, j] -= out.count(j) * params.frequency_penalty + params.presence_penalty
        return logits_to_probs(logits, *tensors)[0]

    return next_probs


def test_penalized_sampled_drafts_reproduce_the_penalized_distribution(base, far_draft, sequence_law,
                                                                       pooled_chisquare):
    """Chi-square over 4 sampled tokens: sampled drafts of a different model, each row verified
    with the penalties of the answer and the drafts before it, reproduce penalized sampling's
    exact law."""
    params = SamplingParams(decode_strategy="sampling", temperature=1.5, seed=5, max_new_tokens=4, top_k=3,
                            presence_penalty=-2.0, frequency_penalty=-1.5)  # repeats favoured: a law apart
    (prompt,) = _prompts([8], seed=4)
    exact = sequence_law(_penalized_next_probs(base, params, len(prompt)), prompt, 4)
    plain = sequence_law(_next_probs(base, dataclasses.replace(params, presence_penalty=0, frequency_penalty=0)),
                         prompt, 4)
    assert 0.5 * sum(abs(exact.get(c, 0) - plain.get(c, 0)) for c in set(exact) | set(plain)) > 0.1
    counts, drafted, accepted = _sampled_counts(base, far_draft, prompt, params)
    n = sum(counts.values())
    assert drafted >= n and 0 < accepted < drafted
    assert set(counts) <= set(exact)
    assert pooled_chisquare(counts, exact, n) > 1e-3
