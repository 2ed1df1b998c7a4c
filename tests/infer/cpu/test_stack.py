"""The decoder stack in one C++ call (`infer/cpu/stack.py`): bitwise the module path's hidden
states in prefill, decode and verification steps, for fp32, int8 and int4 models; the modules
run wherever the plan would not compute what they compute."""

import pytest
import torch
from torch import nn

from quantspec.infer.cpu.stack import ENV_SWITCH, CpuLayerStack
from quantspec.infer.kv_cache import AttentionMetadata, PagedAttention, PagedKVCache
from quantspec.infer.loader import load_for_inference
from quantspec.kernels.cpu import cpu_kernels

pytestmark = pytest.mark.skipif(cpu_kernels() is None, reason="quantspec's CPU kernels are not built here")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """head_dim 64 (the CPU attention kernel's size): a Llama, a Qwen2 (q/k/v biases), a Qwen3
    (per-head q / k norms, which the plans do not compute), a Phi-3 (fused checkpoint), one with a
    half-head rotary embedding, a SmolLM3 (a NoPE layer), a Granite (multipliers), and the Llama's
    int8 and int4 (group 32, asymmetric) artifacts."""
    from quantspec import api
    from quantspec.model_zoo.tiny import build_tiny_model

    root = tmp_path_factory.mktemp("fused")
    llama = build_tiny_model(root / "llama", "llama", hidden=256, heads=4, kv_heads=2, intermediate=256,
                             num_layers=3, seed=5)
    qwen2 = build_tiny_model(root / "qwen2", "qwen2", hidden=256, heads=4, kv_heads=2, intermediate=256, seed=6)
    qwen3 = build_tiny_model(root / "qwen3", "qwen3", hidden=256, heads=4, kv_heads=2, intermediate=256, seed=7)
    phi3 = build_tiny_model(root / "phi3", "phi3", hidden=256, heads=4, kv_heads=2, intermediate=256, seed=8)
    partial = build_tiny_model(root / "partial", "phi3", hidden=256, heads=4, kv_heads=2, intermediate=256, seed=9,
                               rope_scaling={"partial_rotary_factor": 0.5})
    smollm3 = build_tiny_model(root / "smollm3", "smollm3", hidden=256, heads=4, kv_heads=2, intermediate=256, seed=10)
    granite = build_tiny_model(root / "granite", "granite", hidden=256, heads=4, kv_heads=2, intermediate=256, seed=11)
    return {"llama": llama, "qwen2": qwen2, "qwen3": qwen3, "phi3": phi3, "phi3_partial": partial, "smollm3": smollm3,
            "granite": granite,
            "int8": api.quantize(llama, "weight_only_int8", root / "w8"),
            "int4": api.quantize(llama, "weight_only_int4", root / "w4", group_size=32, symmetric=False),
            "nvfp4": api.quantize(llama, "weight_only_nvfp4", root / "nv4"),
            "mxfp4": api.quantize(llama, "weight_only_mxfp4", root / "mx4", target="quantspec"),
            "mxfp4 inputs": api.quantize(llama, "mxfp4", root / "mx4a4", target="quantspec"),
            # SpinQuant's R4: each down_proj's input turned at run time (the plans run it), and QuIP's
            # output transforms (they do not)
            "int4 R4": api.quantize(llama, "weight_only_int4", root / "w4r4", group_size=32, rotate="R4",
                                    target="quantspec"),
            "quip v,u": api.quantize(llama, "weight_only_int8", root / "quip", quip="v,u", target="quantspec")}


# rows `_steps(..., pick=True)` asks for in each step (of 57, 2, 5, 8): each prompt's last row and
# one inside a prompt; the decode rows in reverse; one row of each sequence; all but the first
_PICKS = ([36, 3, 56], [1, 0], [3, 4], [1, 2, 3, 4, 5, 6, 7])


def _steps(model, runtime, *, stack=True, kv_dtype="auto", pick=False, capture=()):
    """A scripted run on a fresh cache (its attention kernel from `runtime`): two prompts
    prefilled together, a decode step, and two verification steps where the sequences bring
    different numbers of rows → all hidden states (`pick`: only the rows `_PICKS` asks for,
    through the forward's `out_rows`); `stack`: through the runtime's stack runner (else the
    modules); `capture`: (those, each captured stream over every step's rows)."""
    a = model.args
    scales = {} if kv_dtype == "auto" else {"k_scale": torch.full((a.num_layers, a.num_kv_heads), 0.05),
                                             "v_scale": torch.full((a.num_layers, a.num_kv_heads), 0.05)}
    cache = PagedKVCache(num_layers=a.num_layers, num_blocks=16, block_size=16, num_kv_heads=a.num_kv_heads,
                         head_dim=a.head_dim, dtype=model.model.norm.weight.dtype, kv_dtype=kv_dtype, **scales,
                         kernel=runtime.attention)
    tables = [cache.allocator.allocate(7), cache.allocator.allocate(7)]
    g = torch.Generator().manual_seed(0)
    lens = [0, 0]
    outs = []
    for step, news in enumerate(([37, 20], [1, 1], [4, 1], [2, 6])):
        ids = torch.randint(3, a.vocab_size, (sum(news),), generator=g)
        positions = torch.cat([torch.arange(lens[b], lens[b] + n) for b, n in enumerate(news)])
        seq_lens = [lens[b] + n for b, n in enumerate(news)]
        meta = AttentionMetadata.build(news, seq_lens, tables, 16, "cpu", cache.kernel)
        rows = torch.tensor(_PICKS[step]) if pick else None
        with torch.no_grad():
            outs.append(model(ids, positions, PagedAttention(cache, meta), rows, row_invariant=step > 0,
                              stack=runtime.stack if stack else None, capture=capture))
        lens = seq_lens
    if capture:
        return torch.cat([o[0] for o in outs]), tuple(torch.cat(s) for s in zip(*(o[1] for o in outs)))
    return torch.cat(outs)


def _picked(full: torch.Tensor) -> torch.Tensor:
    """The `_PICKS` rows of a full `_steps` result."""
    starts = [0, 57, 59, 64]
    return torch.cat([full[start + torch.tensor(p)] for start, p in zip(starts, _PICKS)])


def _three_rows(model, runtime):
    """A fresh fp32 cache (the runtime's attention kernel) and the metadata of a 3-row prompt."""
    a = model.args
    cache = PagedKVCache(num_layers=a.num_layers, num_blocks=4, block_size=16, num_kv_heads=a.num_kv_heads,
                         head_dim=a.head_dim, dtype=torch.float32, kernel=runtime.attention)
    return cache, AttentionMetadata.build([3], [3], [cache.allocator.allocate(1)], 16, "cpu", cache.kernel)


def _spy(runner):
    served = []
    real = runner.serves
    runner.serves = lambda x, attn, row_invariant: served.append(real(x, attn, row_invariant)) or served[-1]
    return served


@pytest.mark.parametrize("name,dtype", [("llama", torch.float32), ("qwen2", torch.float32),
                                        ("int8", torch.float32), ("int4", torch.float32),
                                        # bf16 weights packed in k-pairs (where the CPU has AVX512-BF16)
                                        ("llama", torch.bfloat16),
                                        # bf16 activations: int8 on quantspec's kernel, int4 on its
                                        # pair path where the CPU has AVX512-BF16, and on torch's
                                        # packed op (the path without it)
                                        ("int8", torch.bfloat16), ("int4", torch.bfloat16),
                                        ("int4 torch op", torch.bfloat16),
                                        # FP4 weights on quantspec's FP4 kernel (E2M1 nibbles)
                                        ("nvfp4", torch.float32), ("mxfp4", torch.bfloat16),
                                        # R4's input transform before each down_proj
                                        ("int4 R4", torch.float32), ("int4 R4", torch.bfloat16)])
def test_fused_stack_equals_the_modules_bitwise(models, name, dtype, monkeypatch):
    from quantspec.infer.dispatch import KernelPath
    from quantspec.kernels import cpu as cg

    pairs = cg.pair_path_available()
    if name == "int4 torch op":
        monkeypatch.setattr(cg, "pair_path_available", lambda: False)
        name, pairs = "int4", False
    if name in ("llama", "int4 R4") and dtype == torch.bfloat16 and not pairs:  # (R4's block linear is float)
        pytest.skip("bf16 float linears are packed in k-pairs only where the CPU has AVX512-BF16")
    lm = load_for_inference(models[name], dtype=dtype, tokenizer=False)
    model, runtime = lm.model, lm.runtime
    runner = runtime.stack
    assert isinstance(runner, CpuLayerStack)
    if name == "int4" and dtype == torch.bfloat16:
        want = KernelPath.CPU_GEMV_INT4 if pairs else KernelPath.CPU_INT4PACK
        assert model.model.layers[0].mlp.down_proj.prepared.row_path is want
    if name.endswith("fp4"):
        assert model.model.layers[0].mlp.down_proj.prepared.row_path is KernelPath.CPU_GEMV_FP4
    if name.endswith("R4"):
        assert type(model.model.layers[0].mlp.down_proj).__name__ == "TransformedLinear"
    served = _spy(runner)
    fused = _steps(model, runtime)
    assert served == [True] * 4  # prefill (37 + 20 rows), decode, both verification steps
    modules = _steps(model, runtime, stack=False)
    assert torch.equal(fused, modules)
    assert fused.abs().sum() > 0


@pytest.mark.parametrize("name,dtype", [("llama", torch.float32), ("qwen2", torch.float32),
                                        ("int8", torch.float32), ("int4", torch.bfloat16),
                                        ("int4 torch op", torch.bfloat16)])
def test_out_rows_are_bitwise_the_full_result_s_rows(models, name, dtype, monkeypatch):
    """`out_rows`: the plan runs the last layer's o projection and MLP on the rows asked for alone
    and returns them, bitwise those rows of the full result, in the order asked; every row still
    writes its keys / values (the later steps, which read them, agree too). The modules give the
    same rows."""
    from quantspec.kernels import cpu as cg

    if name == "int4 torch op":  # torch's packed int4 op (a CPU without AVX512-BF16) is row-invariant too
        monkeypatch.setattr(cg, "pair_path_available", lambda: False)
        name = "int4"
    lm = load_for_inference(models[name], dtype=dtype, tokenizer=False)
    model, runtime = lm.model, lm.runtime
    served = _spy(runtime.stack)
    full = _steps(model, runtime)
    picked = _steps(model, runtime, pick=True)
    assert served == [True] * 8
    assert picked.shape == (sum(map(len, _PICKS)), model.args.hidden_size)
    assert torch.equal(picked, _picked(full))
    assert torch.equal(_steps(model, runtime, stack=False, pick=True), picked)


@pytest.mark.parametrize("name,dtype", [("llama", torch.float32), ("qwen2", torch.float32),
                                        ("int8", torch.bfloat16), ("int4", torch.bfloat16)])
@pytest.mark.parametrize("capture,pick", [((1, 0, "L"), False), ((1,), True), (("L", 1), True)])
def test_captured_streams_equal_the_modules_bitwise(models, name, dtype, capture, pick):
    """`capture` (EAGLE-3's aux features): the plans run the layers in segments cut at the ids;
    the streams and the output (with `out_rows` too; id L: every row of the last output) are
    bitwise the modules', and the segments' plans are kept per segment."""
    lm = load_for_inference(models[name], dtype=dtype, tokenizer=False)
    model, runtime = lm.model, lm.runtime
    capture = tuple(model.args.num_layers if i == "L" else i for i in capture)  # L: the last output
    served = _spy(runtime.stack)
    fused, streams = _steps(model, runtime, pick=pick, capture=capture)
    assert served == [True] * 4
    modules, want = _steps(model, runtime, stack=False, pick=pick, capture=capture)
    assert torch.equal(fused, modules) and len(streams) == len(capture)
    for got, ref in zip(streams, want):
        assert got.shape == (sum((57, 2, 5, 8)), model.args.hidden_size) and torch.equal(got, ref)
    assert torch.equal(fused, _steps(model, runtime, pick=pick))  # the one-plan path's rows


def test_segment_plans_are_kept_per_segment(models):
    lm = load_for_inference(models["llama"], tokenizer=False)
    model, runtime = lm.model, lm.runtime
    cache, meta = _three_rows(model, runtime)
    with torch.no_grad():
        for capture in ((), (1,), (1,), (1, 2), (3,)):
            model(torch.tensor([5, 6, 7]), torch.arange(3), PagedAttention(cache, meta), stack=runtime.stack,
                  capture=capture)
    plans = cache.kernel.plans[runtime.stack]
    assert sorted(plans) == [(16, 0, 1), (16, 0, 3), (16, 1, 2), (16, 1, 3), (16, 2, 3)]
    assert [plans[k].num_layers() for k in sorted(plans)] == [1, 3, 1, 2, 1]


def _eagle_recorder(plain):
    """An EAGLE proposer that drafts the plain run's tokens (wrong at depth 3, so some drafts are
    accepted and some not) and records the head's state at each draft: (rows, last output)."""
    from quantspec.infer.spec.eagle import EagleProposer

    class Recorder(EagleProposer):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            self.seen = []

        def _catch_up(self, seq, st):
            self._current = (seq.seq_id, len(seq.output_ids))
            return super()._catch_up(seq, st)

        def _draft(self, st, depth):
            self.seen.append((st.n, st.last.clone(), super()._draft(st, depth)))
            sid, done = self._current
            want = [plain[sid][min(done + d, len(plain[sid]) - 1)] for d in range(depth)]
            return [[(t + 7) % 500 if d == 2 else t] + [(t + 1) % 500] * (self.width - 1) for d, t in enumerate(want)]

    return Recorder


@pytest.mark.parametrize("name,dtype", [("llama", torch.float32), ("int8", torch.bfloat16)])
def test_eagle_on_the_fused_stack_equals_the_modules(models, tmp_path, name, dtype):
    """EAGLE-3 (a chain and a 2x2 tree) over a base whose every step the one-call stack serves,
    aux features included: greedy output identical to plain decoding, and the head's states and
    drafts bitwise those of the same run on the modules."""
    import dataclasses

    from quantspec.infer.engine import Engine, EngineConfig
    from quantspec.infer.sampler import SamplingParams
    from quantspec.infer.spec.eagle import load_eagle3_for_inference
    from quantspec.infer.spec.tree import TreeSpec
    from quantspec.model_zoo.checkpoint import load_model
    from quantspec.model_zoo.eagle3 import save_eagle3
    from quantspec.model_zoo.eagle3_train import init_eagle3

    head_dir = save_eagle3(init_eagle3(load_model(models["llama"])[0], torch.arange(0, 512, 2), (0, 1, 3)),
                           tmp_path / "head")
    lm = load_for_inference(models[name], dtype=dtype, tokenizer=False)
    served = _spy(lm.runtime.stack)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (9, 21)]

    def run(proposer, runtime=lm.runtime):
        eng = Engine(lm.model, EngineConfig(block_size=16, max_batch_size=2, max_length=128, spec_max_draft_tokens=4),
                     eos_token_ids=[], proposer=proposer, runtime=runtime)
        seqs = [eng.add_request(p, SamplingParams(max_new_tokens=32)) for p in prompts]
        eng.run()
        return [s.output_ids for s in seqs], sum(s.stats.accepted for s in seqs)

    plain = dict(enumerate(run(None)[0]))
    head = load_eagle3_for_inference(head_dir, lm.model)
    recorder = _eagle_recorder(plain)
    for tree in (None, TreeSpec(2, 2)):
        fused, modules = recorder(head, tree=tree, max_draft_tokens=4), recorder(head, tree=tree, max_draft_tokens=4)
        served.clear()
        out, accepted = run(fused)
        assert out == list(plain.values()) and accepted > 10
        assert len(served) > 10 and all(served)  # every step, prefill included, on the plans
        assert run(modules, dataclasses.replace(lm.runtime, stack=None))[0] == out
        assert len(fused.seen) == len(modules.seen) > 10
        for (n, last, drafts), (n2, last2, drafts2) in zip(fused.seen, modules.seen):
            assert n == n2 and torch.equal(last, last2) and drafts == drafts2


@pytest.mark.parametrize("name", ["llama", "phi3"])
def test_greedy_and_speculative_generation_match_transformers(models, name):
    """Through the engine (prefill, decode, n-gram verification) the fused stack gives
    transformers' greedy tokens (a Llama; a Phi-3, whose checkpoint fuses q/k/v and gate/up)."""
    from transformers import AutoModelForCausalLM

    from quantspec.infer.engine import Engine, EngineConfig
    from quantspec.infer.sampler import SamplingParams
    from quantspec.infer.spec.proposers import ReferenceProposer

    lm = load_for_inference(models[name], tokenizer=False)
    model = lm.model
    served = _spy(lm.runtime.stack)
    prompt = [5, 9, 300, 41, 7, 5, 9, 300, 41, 7, 5, 9]
    hf = AutoModelForCausalLM.from_pretrained(models[name], dtype=torch.float32)
    with torch.no_grad():
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False)[0, len(prompt):].tolist()
    for proposer in (None, ReferenceProposer(2, 4)):
        eng = Engine(model, EngineConfig(block_size=16, max_length=128, spec_max_draft_tokens=4),
                     eos_token_ids=[], proposer=proposer, runtime=lm.runtime)
        seq = eng.add_request(prompt, SamplingParams(max_new_tokens=24))
        eng.run()
        assert seq.output_ids == want
    assert served and all(served)


def test_the_modules_run_where_the_plan_would_not_be_their_computation(models):
    lm = load_for_inference(models["llama"], tokenizer=False)
    model, runtime = lm.model, lm.runtime
    served = _spy(runtime.stack)
    want = _steps(model, runtime)
    assert all(served)

    # a forward hook observes the modules: they run (and the result is the same)
    seen = []
    handle = model.model.layers[1].mlp.register_forward_hook(lambda m, i, o: seen.append(o.shape))
    served.clear()
    assert torch.equal(_steps(model, runtime), want)
    assert served == [False] * 4 and len(seen) == 4
    handle.remove()
    handle = nn.modules.module.register_module_forward_hook(lambda m, i, o: None)  # on every module
    served.clear()
    assert torch.equal(_steps(model, runtime), want)
    assert served == [False] * 4
    handle.remove()

    # a module swapped after loading: the plan no longer describes the model
    down = model.model.layers[0].mlp.down_proj
    plain = nn.Linear(down.in_features, down.out_features, bias=False)
    plain.weight = nn.Parameter(down.dense_weight())
    model.model.layers[0].mlp.down_proj = plain
    served.clear()
    got = _steps(model, runtime)
    assert served == [False] * 4
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)  # torch's linear: another summation order
    assert CpuLayerStack.build(model) is None  # an unpacked linear: no plan
    model.model.layers[0].mlp.down_proj = down
    assert CpuLayerStack.build(model) is not None

    # a quantized KV cache: attention is not the CPU kernel's
    served.clear()
    _steps(model, runtime, kv_dtype="int8")
    assert served == [False] * 4


def test_no_plan_where_a_layer_is_not_all_kernels(models, monkeypatch):
    assert load_for_inference(models["llama"], tokenizer=False, fuse=False).runtime.stack is None
    assert load_for_inference(models["quip v,u"], tokenizer=False).runtime.stack is None  # output transforms
    assert load_for_inference(models["qwen3"], tokenizer=False).runtime.stack is None  # q / k norms: the modules
    # a rotary embedding over part of each head: the plans turn whole heads
    assert load_for_inference(models["phi3_partial"], tokenizer=False).runtime.stack is None
    assert load_for_inference(models["smollm3"], tokenizer=False).runtime.stack is None  # a layer without rotary
    assert load_for_inference(models["granite"], tokenizer=False).runtime.stack is None  # Granite's multipliers
    # MXFP4 inputs are quantized per row and group before the FP4 kernel: the modules do that
    assert load_for_inference(models["mxfp4 inputs"], tokenizer=False).runtime.stack is None
    monkeypatch.setenv(ENV_SWITCH, "0")
    assert load_for_inference(models["llama"], tokenizer=False).runtime.stack is None


def test_draft_step_cost_is_measured_on_the_engines_path(models):
    """`measure_step_cost` times a paged decode step, so the one-call stack is what it measures."""
    from quantspec.infer.spec.draft import measure_step_cost

    lm = load_for_inference(models["llama"], tokenizer=False)
    served = _spy(lm.runtime.stack)
    rt = lm.runtime
    assert 0.5 <= measure_step_cost(lm.model, lm.model, draft_runtime=rt, base_runtime=rt) <= 2.0  # ~1 (rounded to 0.05)
    assert served and all(served)


def test_a_discarded_cache_is_freed(models):
    """The plan over a cache's tensors lives with the cache's kernel, not with the model's runner."""
    import gc
    import weakref

    lm = load_for_inference(models["llama"], tokenizer=False)
    model, runtime = lm.model, lm.runtime
    cache, meta = _three_rows(model, runtime)
    with torch.no_grad():
        model(torch.tensor([5, 6, 7]), torch.arange(3), PagedAttention(cache, meta), stack=runtime.stack)
    assert len(cache.kernel.plans) == 1
    k = weakref.ref(cache.k)
    del cache, meta
    gc.collect()
    assert k() is None
