"""The engine against transformers' greedy `generate`, across batch shapes and block boundaries."""

import dataclasses

import numpy as np
import pytest
import torch

from quantspec.errors import QuantSpecError
from quantspec.infer.engine import Engine, EngineConfig
from quantspec.infer import kv_cache
from quantspec.infer.kv_cache import AttentionMetadata, BlockAllocator, grouped_attention
from quantspec.infer.sampler import SamplingParams
from quantspec.model_zoo.checkpoint import load_model


@pytest.fixture(scope="module")
def llama(tiny_llama_dir, hf_tiny_llama):
    model, _ = load_model(tiny_llama_dir)
    return model, hf_tiny_llama


def _hf_greedy(hf, prompt, n):
    ids = torch.tensor([prompt])
    out = hf.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None,
                      pad_token_id=0)
    return out[0, len(prompt):].tolist()


def _engine_greedy(model, prompts, n, *, batch, block_size=16, runtime=None):
    eng = Engine(model, EngineConfig(block_size=block_size, max_batch_size=batch, max_length=256),
                 eos_token_ids=[], runtime=runtime)
    seqs = [eng.add_request(p, SamplingParams(max_new_tokens=n)) for p in prompts]
    eng.run()
    return [s.output_ids for s in seqs]


def _prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 500, (n,), generator=g).tolist() for n in lengths]


def test_greedy_matches_transformers_generate(llama):
    model, hf = llama
    prompts = _prompts([5, 23, 40])
    ours = _engine_greedy(model, prompts, 24, batch=1)
    for p, o in zip(prompts, ours):
        assert o == _hf_greedy(hf, p, 24)


@pytest.mark.parametrize("block_size", [4, 16])
def test_mixed_batch_equals_each_prompt_alone(llama, block_size):
    model, _ = llama
    # lengths straddle block boundaries: block_size - 1, block_size, block_size + 1, ...
    prompts = _prompts([block_size - 1, block_size, block_size + 1, 2 * block_size, 3, 50], seed=1)
    alone = _engine_greedy(model, prompts, 20, batch=1, block_size=block_size)
    together = _engine_greedy(model, prompts, 20, batch=4, block_size=block_size)  # continuous batching
    assert together == alone


def test_prompt_ending_on_block_boundary_matches_transformers(llama):
    model, hf = llama
    for n in (15, 16, 17, 32):
        (p,) = _prompts([n], seed=n)
        assert _engine_greedy(model, [p], 18, batch=1)[0] == _hf_greedy(hf, p, 18)


def test_grouped_attention_matches_sdpa():
    g = torch.Generator().manual_seed(0)
    B, Q, H, KV, L, hd = 3, 4, 6, 2, 9, 8
    q, k, v = torch.randn(B, Q, H, hd, generator=g), torch.randn(B, L, KV, hd, generator=g), torch.randn(B, L, KV, hd, generator=g)
    keep = torch.rand(B, 1, Q, L, generator=g) > 0.3
    keep[..., 0] = True
    bias = torch.zeros(keep.shape).masked_fill(~keep, float("-inf"))
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=keep, enable_gqa=True).transpose(1, 2)
    torch.testing.assert_close(grouped_attention(q, k, v, bias), ref, atol=1e-5, rtol=1e-5)


def test_metadata_positions_and_slots(monkeypatch):
    # seq 0: 3 cached + 2 new; seq 1: fresh prompt of 3, block size 4
    args = ([2, 3], [5, 3], [[7, 9], [2]], 4, "cpu")
    meta = AttentionMetadata.build(*args)
    assert meta.slot_mapping.tolist() == [7 * 4 + 3, 9 * 4 + 0, 2 * 4 + 0, 2 * 4 + 1, 2 * 4 + 2]
    # per-sequence path: blocks 7, 9 are not a run (gathered); block 2 is (read as a view)
    assert meta.bias is None and meta.spans == [None, (2, 1)]
    assert meta.masks[0].tolist() == [[True] * 4 + [False], [True] * 5]  # positions 3 and 4
    assert meta.masks[1].tolist() == [[True, False, False], [True, True, False], [True, True, True]]
    # batched path (many sequences): one additive mask over the padded [B, Qmax, L]
    monkeypatch.setattr(kv_cache, "PER_SEQUENCE_MAX_BATCH", 1)
    meta = AttentionMetadata.build(*args)
    allowed = (meta.bias == 0)[:, 0]  # [B, Qmax, L]
    assert allowed[0, 0].nonzero().squeeze(1).tolist() == [0, 1, 2, 3]  # position 3 sees keys 0..3
    assert allowed[0, 1].nonzero().squeeze(1).tolist() == [0, 1, 2, 3, 4]
    assert allowed[1, 2].nonzero().squeeze(1).tolist() == [0, 1, 2]


def test_allocator_prefers_runs():
    a = BlockAllocator(12)
    assert a.allocate(3) == [1, 2, 3] and a.allocate(2) == [4, 5]
    assert a.allocate(1, after=3) == [6]  # 4 is taken: the lowest free run instead
    a.free([2, 3])
    assert a.allocate(2) == [2, 3] and a.allocate(3) == [7, 8, 9]
    a.free([1, 5, 9])
    assert a.allocate(1, after=8) == [9] and a.allocate(3) == [1, 5, 10]  # no run of 3: lowest ids
    assert a.num_free == 1
    with pytest.raises(QuantSpecError, match="KV cache is full"):
        a.allocate(2)


def _scattered_allocate(self, n, after=None):
    """BlockAllocator.allocate handing out blocks from the top down: never a run."""
    ids = [i for i in range(self.num_blocks - 1, 0, -1) if self._free[i]][:n]
    for i in ids:
        self._free[i] = False
    self._num_free -= n
    return ids


@pytest.mark.parametrize("path", ["per_sequence_views", "per_sequence_gathered", "batched"])
def test_attention_paths_agree(llama, monkeypatch, path):
    """Every way of reading the cache (views of block runs, gathered blocks, one padded batch)
    gives the greedy tokens of transformers, for a mixed batch that decodes and prefills."""
    model, hf = llama
    prompts = _prompts([5, 17, 33, 9], seed=21)
    if path == "batched":
        monkeypatch.setattr(kv_cache, "PER_SEQUENCE_MAX_BATCH", 0)
    if path == "per_sequence_gathered":  # hand out blocks from the top down: never a run
        monkeypatch.setattr(BlockAllocator, "allocate", _scattered_allocate)
    got = _engine_greedy(model, prompts, 12, batch=2)
    assert got == [_hf_greedy(hf, p, 12) for p in prompts]


def test_stop_conditions(llama):
    model, _ = llama
    (p,) = _prompts([10], seed=3)
    free = _engine_greedy(model, [p], 12, batch=1)[0]
    eos = free[5]
    eng = Engine(model, EngineConfig(block_size=16, max_batch_size=1, max_length=256), eos_token_ids=[eos])
    seq = eng.add_request(p, SamplingParams(max_new_tokens=12))
    eng.run()
    assert seq.output_ids == free[: free.index(eos) + 1] and seq.finish_reason == "eos"
    eng = Engine(model, EngineConfig(block_size=16, max_batch_size=1, max_length=len(p) + 4), eos_token_ids=[])
    seq = eng.add_request(p, SamplingParams(max_new_tokens=12))
    eng.run()
    assert seq.output_ids == free[:4] and seq.finish_reason == "max_length"


def test_sampling_is_seeded_and_batch_invariant(llama):
    model, _ = llama
    prompts = _prompts([7, 19, 4], seed=5)
    params = SamplingParams(decode_strategy="sampling", temperature=0.8, top_p=0.9, seed=11, max_new_tokens=15)

    def run(batch):
        eng = Engine(model, EngineConfig(block_size=8, max_batch_size=batch, max_length=128), eos_token_ids=[])
        seqs = [eng.add_request(p, params, request_index=i) for i, p in enumerate(prompts)]
        eng.run()
        return [s.output_ids for s in seqs]

    one, three = run(1), run(3)
    assert one == three
    greedy = _engine_greedy(model, prompts, 15, batch=1)
    assert one != greedy  # sampling actually sampled


def test_prompt_over_max_length_is_refused(llama):
    model, _ = llama
    eng = Engine(model, EngineConfig(max_length=8), eos_token_ids=[])
    with pytest.raises(Exception, match="max_length is 8"):
        eng.add_request(list(range(3, 20)), SamplingParams())


@pytest.fixture(scope="module")
def hd64_dir(tmp_path_factory):
    """A tiny Llama with head_dim 64 (the CPU attention kernel's size), 2 query heads per KV head."""
    from quantspec.model_zoo.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny_hd64"), "llama", hidden=256, heads=4,
                            kv_heads=2, intermediate=256, seed=3)


needs_cpu_kernels = pytest.mark.skipif(
    "__import__('quantspec.kernels.cpu', fromlist=['x']).cpu_kernels() is None",
    reason="quantspec's CPU kernels are not built here")


@needs_cpu_kernels
@pytest.mark.parametrize("dtype,pairs", [(torch.float32, None), (torch.bfloat16, False), (torch.bfloat16, True)])
def test_cpu_attention_kernel_serves_decode_and_matches_torch_path(hd64_dir, monkeypatch, dtype, pairs):
    """Decode steps of a mixed, continuously batched run go through quantspec's CPU attention
    (reading the cache through scattered block tables too) and give transformers' greedy tokens
    (fp32), and the torch path's tokens in bf16 on the kernel's fp32 chain. On its AVX512-BF16 pair
    path (softmax weights rounded to bf16 before the value product, as torch's own bf16 attention
    does, in another order) a near tie of this random model may fall the other way: there the
    tokens must agree on nearly all positions."""
    from transformers import AutoModelForCausalLM

    from quantspec.infer.dispatch import DispatchPolicy
    from quantspec.infer.loader import load_for_inference
    from quantspec.kernels import cpu as cpu_kernels

    if pairs and not cpu_kernels.pair_path_available():
        pytest.skip("needs AVX512-BF16")
    policy = DispatchPolicy(cpu_pairs=bool(pairs)) if pairs is not None else DispatchPolicy()
    lm = load_for_inference(hd64_dir, dtype=dtype, tokenizer=False, policy=policy)
    model = lm.model
    # the module path, which calls the kernel from Python (tests/infer/cpu/test_stack.py)
    runtime = dataclasses.replace(lm.runtime, stack=None)
    calls = []
    real = cpu_kernels.paged_attention
    monkeypatch.setattr(cpu_kernels, "paged_attention", lambda *a, **kw: calls.append(len(a[7])) or real(*a, **kw))
    prompts = _prompts([5, 17, 33, 9, 64], seed=8)
    got = _engine_greedy(model, prompts, 16, batch=3, block_size=16, runtime=runtime)
    assert calls and max(calls) == 3  # whole batches of decode rows in one call per layer
    orig = BlockAllocator.allocate
    monkeypatch.setattr(BlockAllocator, "allocate", _scattered_allocate)
    assert _engine_greedy(model, prompts, 16, batch=3, block_size=16, runtime=runtime) == got
    monkeypatch.setattr(BlockAllocator, "allocate", orig)
    if dtype == torch.float32:
        hf = AutoModelForCausalLM.from_pretrained(hd64_dir, dtype=torch.float32)
        assert got == [_hf_greedy(hf, p, 16) for p in prompts]
    monkeypatch.setattr(kv_cache.PagedKVCache, "__init__", _without_kernel(kv_cache.PagedKVCache.__init__))
    n = len(calls)
    torch_path = _engine_greedy(model, prompts, 16, batch=3, block_size=16, runtime=runtime)
    assert len(calls) == n  # the torch path really ran
    if pairs:
        same = sum(a == b for g, t in zip(got, torch_path) for a, b in zip(g, t))
        assert same >= 0.9 * sum(map(len, got)), (got, torch_path)
    else:
        assert torch_path == got


@needs_cpu_kernels
def test_cpu_attention_kernel_serves_multi_query_models(tmp_path, monkeypatch):
    """A KV head serving 20 query heads (a multi-query Llama; the kernel computes them in chunks
    of up to 4) decodes through quantspec's CPU attention and gives transformers' greedy tokens."""
    from transformers import AutoModelForCausalLM

    from quantspec.infer.loader import load_for_inference
    from quantspec.kernels import cpu as cpu_kernels
    from quantspec.model_zoo.tiny import build_tiny_model

    d = build_tiny_model(tmp_path / "mqa", "llama", hidden=1280, heads=20, kv_heads=1, intermediate=128, seed=5)
    lm = load_for_inference(d, dtype=torch.float32, tokenizer=False)
    model = lm.model
    assert model.args.num_heads // model.args.num_kv_heads == 20 and model.args.head_dim == 64
    modules = dataclasses.replace(lm.runtime, stack=None)  # the module path, whose kernel calls can be counted
    calls = []
    real = cpu_kernels.paged_attention
    monkeypatch.setattr(cpu_kernels, "paged_attention", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    prompts = _prompts([7, 19], seed=4)
    got = _engine_greedy(model, prompts, 8, batch=2, block_size=16, runtime=modules)
    assert calls
    hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    assert got == [_hf_greedy(hf, p, 8) for p in prompts]
    fused = load_for_inference(d, dtype=torch.float32, tokenizer=False)  # the one-call stack
    assert _engine_greedy(fused.model, prompts, 8, batch=2, block_size=16, runtime=fused.runtime) == got


def _without_kernel(init):
    def wrapped(self, *a, **kw):
        init(self, *a, **kw)
        self.kernel = None
    return wrapped


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("which", ["tiny_llama_dir", "hd64_dir"])  # hd64: the CPU kernels' path
def test_verify_rows_equal_decode_rows_bitwise(request, which, dtype):
    """Feeding 4 tokens in one step (speculative verification) gives each position the hidden
    state that 4 one-token decode steps give, bit for bit in bf16 (where one masked attention call
    would round differently and flip greedy picks), within fp32 rounding in fp32."""
    from quantspec.infer.loader import load_for_inference
    from quantspec.infer.kv_cache import PagedAttention, PagedKVCache

    lm = load_for_inference(request.getfixturevalue(which), dtype=dtype, tokenizer=False)
    model, runtime = lm.model, lm.runtime
    a = model.args
    prompt, cont = _prompts([300], seed=4)[0], [7, 99, 3, 250]  # long enough for SDPA's key blocking

    def run(chunks):
        cache = PagedKVCache(num_layers=a.num_layers, num_blocks=24, block_size=16, num_kv_heads=a.num_kv_heads,
                             head_dim=a.head_dim, dtype=dtype, kernel=runtime.attention)
        table = cache.allocator.allocate(20)
        outs, start = [], 0
        for ids in chunks:
            meta = AttentionMetadata.build([len(ids)], [start + len(ids)], [table], 16, "cpu", cache.kernel)
            with torch.no_grad():
                outs.append(model(torch.tensor(ids), torch.arange(start, start + len(ids)), PagedAttention(cache, meta),
                                  stack=runtime.stack))
            start += len(ids)
        return torch.cat(outs)[len(prompt):]

    one_by_one = run([prompt] + [[t] for t in cont])
    together = run([prompt, cont])
    if dtype == torch.bfloat16:
        assert torch.equal(one_by_one, together)
    else:
        torch.testing.assert_close(one_by_one, together, rtol=1e-5, atol=1e-5)


@needs_cpu_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_speculation_through_the_cpu_kernels_is_lossless(hd64_dir, dtype):
    """n-gram speculation on a model whose attention and linears run quantspec's CPU kernels
    (bf16: the head too) gives exactly the plain greedy tokens, with drafts accepted and rejected."""
    from quantspec.infer.loader import load_for_inference
    from quantspec.infer.spec.proposers import ReferenceProposer

    lm = load_for_inference(hd64_dir, dtype=dtype, tokenizer=False)
    model = lm.model
    prompts = _prompts([12, 30, 7], seed=9)
    prompts.append(prompts[1] * 3)
    plain = _engine_greedy(model, prompts, 60, batch=2, runtime=lm.runtime)
    eng = Engine(model, EngineConfig(block_size=16, max_batch_size=2, max_length=256, spec_max_draft_tokens=5),
                 eos_token_ids=[], proposer=ReferenceProposer(2, 5), runtime=lm.runtime)
    seqs = [eng.add_request(p, SamplingParams(max_new_tokens=60)) for p in prompts]
    eng.run()
    assert [s.output_ids for s in seqs] == plain
    assert 0 < sum(s.stats.accepted for s in seqs) < sum(s.stats.drafted for s in seqs)


def test_prefills_run_alone_and_decode_steps_are_marked(llama, monkeypatch):
    """A newly admitted prompt is prefilled in a step of its own; every other step is a decode
    step, whose forward asks for row-invariant rows, so decode rows never take prefill-sized paths."""
    model, _ = llama
    steps = []
    real = type(model).forward

    def spy(self, input_ids, positions, attn, out_rows=None, **kw):
        steps.append((kw["row_invariant"], attn.meta.q_lens, attn.meta.seq_lens))
        return real(self, input_ids, positions, attn, out_rows, **kw)

    monkeypatch.setattr(type(model), "forward", spy)
    prompts = _prompts([6, 11, 4], seed=12)
    outs = _engine_greedy(model, prompts, 5, batch=2)
    monkeypatch.undo()
    assert outs == _engine_greedy(model, prompts, 5, batch=1)
    for decode, q_lens, seq_lens in steps:
        fresh = [q == s for q, s in zip(q_lens, seq_lens)]
        assert all(fresh) != decode and (all(fresh) or not any(fresh))
    assert sum(not d for d, _, _ in steps) == 2  # prompts 1+2 together, then prompt 3 alone


@pytest.mark.parametrize("all_rows", [False, True])
def test_a_prefill_asks_the_forward_for_each_prompt_s_last_row(llama, monkeypatch, all_rows):
    """A prefill step's forward returns only each prompt's last row (`out_rows`), decode steps'
    every row; with `all_hidden_rows` every forward returns every row (what train-mtp's hook
    reads). The outputs are the same either way."""
    model, _ = llama
    calls = []
    real = type(model).forward

    def spy(self, input_ids, positions, attn, out_rows=None, **kw):
        out = real(self, input_ids, positions, attn, out_rows, **kw)
        calls.append((list(attn.meta.q_lens), None if out_rows is None else out_rows.tolist(), out.shape[0]))
        return out

    prompts = _prompts([9, 14, 5], seed=3)
    want = _engine_greedy(model, prompts, 4, batch=2)
    monkeypatch.setattr(type(model), "forward", spy)
    eng = Engine(model, EngineConfig(block_size=16, max_batch_size=2, max_length=256, all_hidden_rows=all_rows),
                 eos_token_ids=[])
    seqs = [eng.add_request(p, SamplingParams(max_new_tokens=4)) for p in prompts]
    eng.run()
    assert [s.output_ids for s in seqs] == want
    prefills = [c for c in calls if c[0][0] > 1]
    assert [c[0] for c in prefills] == [[9, 14], [5]]
    for q_lens, out_rows, n_out in calls:
        if all_rows or q_lens in ([1], [1, 1]):
            assert out_rows is None and n_out == sum(q_lens)
        else:
            assert out_rows == list(np.cumsum(q_lens) - 1) and n_out == len(q_lens)


def test_prefill_steps_take_at_most_the_token_budget(llama, monkeypatch):
    """Admitted prompts prefill in order, up to `prefill_tokens` prompt tokens per forward (a
    longer prompt alone); the tokens are those of a batch prefilled at once."""
    model, _ = llama
    prompts = _prompts([30, 25, 70, 10, 12], seed=21)
    want = _engine_greedy(model, prompts, 6, batch=5)
    sizes = []
    real = type(model).forward

    def spy(self, input_ids, positions, attn, out_rows=None, **kw):
        if not attn.meta.q_lens or attn.meta.q_lens[0] == attn.meta.seq_lens[0]:
            sizes.append(list(attn.meta.q_lens))
        return real(self, input_ids, positions, attn, out_rows, **kw)

    monkeypatch.setattr(type(model), "forward", spy)
    eng = Engine(model, EngineConfig(block_size=16, max_batch_size=5, max_length=256, prefill_tokens=60),
                 eos_token_ids=[])
    seqs = [eng.add_request(p, SamplingParams(max_new_tokens=6)) for p in prompts]
    eng.run()
    assert [s.output_ids for s in seqs] == want
    assert sizes == [[30, 25], [70], [10, 12]]


@pytest.mark.parametrize("chunk", [1, 7, 16])
def test_chunked_prefill_gives_the_same_tokens_and_lets_decode_steps_through(llama, monkeypatch, chunk):
    """With `prefill_chunk` a prompt is fed in chunks cut at multiples of the chunk, one chunk per
    prompt per step and several prompts' chunks up to the step's token budget, prefill steps
    alternate with decode steps while sequences decode, and the outputs are the unchunked ones."""
    model, _ = llama
    prompts = _prompts([40, 5, 33, 17], seed=5)
    want = _engine_greedy(model, prompts, 8, batch=1)
    steps, engines = [], []
    real = type(model).forward

    def spy(self, input_ids, positions, attn, out_rows=None, **kw):
        decoding = any(s.output_ids for s in engines[0].running)
        steps.append((kw["row_invariant"], list(attn.meta.q_lens), list(attn.meta.seq_lens), decoding))
        return real(self, input_ids, positions, attn, out_rows, **kw)

    monkeypatch.setattr(type(model), "forward", spy)
    budget = 2 * chunk + 3
    engines.append(eng := Engine(model, EngineConfig(block_size=16, max_batch_size=4, max_length=256, prefill_chunk=chunk,
                                                     prefill_tokens=budget), eos_token_ids=[]))
    seqs = [eng.add_request(p, SamplingParams(max_new_tokens=8)) for p in prompts]
    eng.run()
    assert [s.output_ids for s in seqs] == want
    for i, (decode, q_lens, seq_lens, decoding) in enumerate(steps):
        if not decode:
            assert sum(q_lens) <= budget and max(q_lens) <= chunk
            assert all((s - q) % chunk == 0 for q, s in zip(q_lens, seq_lens))  # chunks start at multiples
            if i and not steps[i - 1][0]:  # two prefill steps in a row only while nothing decodes
                assert not decoding
    assert sum(d for d, *_ in steps) > 8  # decode steps ran between the chunks


def test_abort_frees_the_blocks_and_leaves_the_others_alone(llama):
    model, _ = llama
    prompts = _prompts([20, 9], seed=8)
    want = _engine_greedy(model, prompts[1:], 10, batch=1)
    eng = Engine(model, EngineConfig(block_size=16, max_batch_size=2, max_length=256), eos_token_ids=[])
    free = eng.cache.allocator.num_free
    a, b = (eng.add_request(p, SamplingParams(max_new_tokens=10)) for p in prompts)
    eng.step()
    eng.step()
    eng.abort(a)
    assert a.finished and a.finish_reason == "abort" and not a.block_table
    eng.run()
    assert b.output_ids == want[0] and eng.cache.allocator.num_free == free
    queued = eng.add_request(prompts[0], SamplingParams(max_new_tokens=3))
    eng.abort(queued)  # never admitted
    assert not eng.has_work()
