"""Sliding-window attention (Mistral v0.1, Mixtral, Phi-3: every layer attends within
`sliding_window`): past the window quantspec computes what transformers computes (logits, greedy
generation, perplexity), on every attention path of the engine (fresh prompts, chunked prefill,
decode, the batched path, speculative verification as chains and trees, in fp32 and bf16), each
equal to plain decoding; families that pick their sliding layers one by one still bound the
context by the window."""

import json

import pytest
import torch

from quantspec.errors import QuantSpecError
from quantspec.model_zoo.checkpoint import load_model
from quantspec.model_zoo.llama import DenseCausalAttention, ModelArgs
from quantspec.model_zoo.tiny import build_tiny_model
from window_paths import assert_every_path_is_plain_decoding, decode as _run, random_prompts as _ids

torch.set_num_threads(1)
WINDOW = 16


@pytest.fixture(scope="module")
def mistral_dir(tmp_path_factory):
    d = build_tiny_model(tmp_path_factory.mktemp("swa") / "m", "mistral")
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "sliding_window": WINDOW}))
    return d


@pytest.fixture(scope="module")
def hf(mistral_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(mistral_dir, dtype=torch.float32)
    assert model.config.sliding_window == WINDOW
    return model.eval()


def test_the_window_is_run_not_refused(mistral_dir):
    args = ModelArgs.from_hf_config(json.loads((mistral_dir / "config.json").read_text()))
    assert (args.sliding_window, args.attention_window, args.context_limit()) == (WINDOW, WINDOW, None)
    args.check_context(100, "--max-length")  # no refusal: the engine slides


def test_logits_past_the_window_equal_transformers(mistral_dir, hf):
    model = load_model(mistral_dir)[0]
    ids = torch.tensor(_ids([50, 50], seed=1))
    with torch.no_grad():
        theirs = hf(ids).logits
        ours = model.compute_logits(model(ids.reshape(-1), torch.arange(50).repeat(2),
                                          DenseCausalAttention(2, 50, window=WINDOW))).view(2, 50, -1)
        full = model.compute_logits(model(ids.reshape(-1), torch.arange(50).repeat(2),
                                          DenseCausalAttention(2, 50))).view(2, 50, -1)
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)
    assert (full - theirs)[:, WINDOW:].abs().max() > 1e-2  # the window matters past it


def test_greedy_past_the_window_equals_transformers_generate(mistral_dir, hf):
    model = load_model(mistral_dir)[0]
    prompts = _ids([5, 30], seed=2)
    ours = _run(model, prompts, new=30)
    for p, got in zip(prompts, ours):
        with torch.no_grad():
            out = hf.generate(torch.tensor([p]), max_new_tokens=30, do_sample=False, pad_token_id=0)
        assert got == out[0, len(p):].tolist()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_attention_path_equals_plain_decoding(mistral_dir, dtype):
    assert_every_path_is_plain_decoding(load_model(mistral_dir, dtype=dtype)[0], dtype)


def test_perplexity_past_the_window_is_transformers(mistral_dir, hf):
    """`eval`'s paged path over windows of 48 tokens (three sliding windows each)."""
    from quantspec.infer.evaluate import perplexity

    ids = torch.tensor(_ids([96], seed=4)[0])
    res = perplexity(load_model(mistral_dir)[0], ids, seq_len=48, batch_size=2)
    with torch.no_grad():
        logp = torch.log_softmax(hf(ids.view(2, 48)).logits[:, :-1].float(), dim=-1)
    nll = -logp.gather(2, ids.view(2, 48)[:, 1:, None]).mean().item()
    assert res.num_windows == 2 and res.nll == pytest.approx(nll, abs=1e-5)


def test_qwen_sliding_layers_still_bound_the_context():
    """Qwen's `use_sliding_window` slides some layers only (family by family rules): the context
    stays within the window, where full attention is the model's."""
    base = {"architectures": ["Qwen2ForCausalLM"], "vocab_size": 10, "hidden_size": 8, "intermediate_size": 8,
            "num_hidden_layers": 1, "num_attention_heads": 2, "sliding_window": 32, "use_sliding_window": True}
    args = ModelArgs.from_hf_config(base)
    assert (args.sliding_window, args.attention_window, args.context_limit()) == (32, None, 32)
    with pytest.raises(QuantSpecError, match="--max-length 64 is over this model's sliding window of 32"):
        args.check_context(64, "--max-length")
    assert ModelArgs.from_hf_config({**base, "use_sliding_window": False}).sliding_window is None
    assert ModelArgs.from_hf_config({**base, "architectures": ["LlamaForCausalLM"]}).sliding_window is None


def test_default_length_is_not_lowered_to_a_window_the_engine_runs(mistral_dir):
    from quantspec.infer.predictor import InferConfig, Predictor

    assert Predictor(InferConfig(model=str(mistral_dir), max_new_tokens=4)).config.max_length == 2048
    Predictor(InferConfig(model=str(mistral_dir), max_length=64, max_new_tokens=4))


def test_calibration_runs_the_window(mistral_dir, hf):
    """The calibration runner's layer-by-layer forward (what calibrate, GPTQ and SmoothQuant see)
    slides too: its last hidden state is transformers' past the window."""
    from quantspec.calib.runner import run_layers

    model = load_model(mistral_dir)[0]
    ids = torch.tensor(_ids([40, 40], seed=5))
    with torch.no_grad():
        theirs = hf(ids, output_hidden_states=True).hidden_states[-1]  # after the final norm
        ours = model.model.norm(run_layers(model, ids, batch_size=2))
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)


BOUNDED_PROMPTS = _ids([10, 14, 7, 12], seed=5)
BOUNDED_PROMPTS[0] = (BOUNDED_PROMPTS[0][:5] * 3)[:10]  # repeats: the n-gram drafter finds matches


@pytest.fixture(scope="module")
def plain_72(mistral_dir):
    model = load_model(mistral_dir)[0]
    return [_run(model, [p], new=72)[0] for p in BOUNDED_PROMPTS]


@pytest.mark.parametrize("kw", [{}, {"prefill_chunk": 8}, {"prefix_caching": True}, {"ngram": True},
                                {"tree": True}])
def test_a_bounded_cache_gives_back_the_blocks_behind_the_window(mistral_dir, plain_72, kw):
    """Every layer slides: in a cache too small for the batch's full lengths (4 sequences of 86
    positions, 22 blocks of 4 each, in 48 blocks), the blocks a sequence's window has passed go
    back before each step, so the batch runs without a preemption, every answer is plain
    decoding's (chunked prefill, prefix caching, n-gram chains and EAGLE-3 trees too), no step
    reads a given-back entry (the padding block they point at holds NaN), and every block is free
    at the end. Without giving them back (the teeth), the same batch preempts."""
    from quantspec.infer.engine import Engine, EngineConfig
    from quantspec.infer.kv_cache import PAD_BLOCK, kv_block_bytes
    from quantspec.infer.sampler import SamplingParams
    from quantspec.infer.spec.eagle import EagleProposer
    from quantspec.infer.spec.proposers import ReferenceProposer
    from quantspec.infer.spec.tree import TreeSpec
    from quantspec.model_zoo.eagle3_train import init_eagle3

    model = load_model(mistral_dir)[0]
    a = model.args
    block = kv_block_bytes(num_layers=a.num_layers, block_size=4, num_kv_heads=a.num_kv_heads, head_dim=a.head_dim,
                           dtype=torch.float32)
    kw = dict(kw)
    proposer, k = None, 0
    if kw.pop("ngram", False):
        proposer, k = ReferenceProposer(2, 3), 3
    if kw.pop("tree", False):
        head = init_eagle3(model, torch.arange(0, 512, 2), (0, 1, 2)).bind_embedding(model.model.embed_tokens)
        proposer = EagleProposer(head, tree=TreeSpec(2, 2))
        k = proposer.max_rows

    def serve(slide: bool):
        eng = Engine(model, EngineConfig(block_size=4, max_batch_size=4, max_length=86, spec_max_draft_tokens=k,
                                         kv_cache_memory=48 * block, **kw), eos_token_ids=[], proposer=proposer)
        assert eng.scheduler.bounded and eng.scheduler.window == WINDOW
        if not slide:
            eng.scheduler.window = None
        for t in (eng.cache.k, eng.cache.v):  # the padding block, where given-back entries point: never read
            t[:, PAD_BLOCK] = float("nan")
        seqs = [eng.add_request(p, SamplingParams(max_new_tokens=72), request_index=i)
                for i, p in enumerate(BOUNDED_PROMPTS)]
        eng.run()
        return eng, [s.output_ids for s in seqs]

    eng, got = serve(slide=True)
    assert got == plain_72
    assert eng.scheduler.num_preemptions == 0 and eng.scheduler.num_slid_blocks >= 4 * 12
    assert eng.cache.allocator.num_free == eng.cache.num_blocks - 1
    if not kw and proposer is None:
        held, got = serve(slide=False)
        assert held.scheduler.num_preemptions > 0 and got == plain_72


def test_a_window_reads_its_keys_from_its_first_block_on():
    """A decode row at position 23 with a window of 10 attends keys 14..23: the sequence's keys are
    read from its block holding 14 on, as a view where those blocks are consecutive, and its blocks
    before it (given back: the padding block) are not gathered."""
    from quantspec.infer.kv_cache import PAD_BLOCK, AttentionMetadata, PagedKVCache

    cache = PagedKVCache(num_layers=1, num_blocks=10, block_size=4, num_kv_heads=2, head_dim=8, dtype=torch.float32,
                         window=10)
    cache.k.normal_(), cache.v.normal_()
    table = [PAD_BLOCK, PAD_BLOCK, PAD_BLOCK, 5, 6, 7]
    meta = AttentionMetadata.build([1], [24], [table], 4, "cpu", window=10)
    assert (meta.lows, meta.starts, meta.spans) == ([14], [12], [(5, 3)])
    k, v = cache.sequence_kv(0, meta.block_tables[0], meta.spans[0], 24, 12)
    gk, gv = cache.sequence_kv(0, meta.block_tables[0], None, 24, 12)  # the same blocks, gathered
    assert k.shape == (12, 2, 8) and torch.equal(k, gk) and torch.equal(v, gv)
    assert torch.equal(k, cache.k[0, 5:8].reshape(12, 2, 8))
    scattered = AttentionMetadata.build([1], [24], [[PAD_BLOCK, PAD_BLOCK, PAD_BLOCK, 5, 8, 7]], 4, "cpu", window=10)
    assert scattered.spans == [None] and scattered.starts == [12]
