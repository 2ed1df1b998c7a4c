"""The engine end to end on CUDA (`-m gpu`): each quant type's artifact tensors loaded on the GPU
(Triton linears, the Triton paged attention) give the CPU engine's greedy tokens in fp32, track
the fp32 reference forward in bf16, and stay lossless under n-gram speculation."""

import pytest
import torch

from quantspec.calib.ptq import quantize_model
from quantspec.infer.backend import prepare
from quantspec.infer.dispatch import DispatchPolicy
from quantspec.infer.engine import Engine, EngineConfig
from quantspec.infer.loader import quantized_model
from quantspec.infer.sampler import SamplingParams
from quantspec.infer.spec.proposers import ReferenceProposer
from quantspec.model_zoo.checkpoint import load_model
from quantspec.model_zoo.llama import DenseCausalAttention
from quantspec.model_zoo.tiny import build_tiny_model
from quantspec.quant.presets import preset

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

QUANTS = ["weight_only_int4", "weight_only_int8", "a8w8", "a8w8_fp8", "weight_only_fp8"]
NEW = 16


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny Llama with head_dim 64 (what the Triton attention takes) and its input abs-max."""
    d = build_tiny_model(tmp_path_factory.mktemp("tiny") / "m", hidden=128, heads=2, kv_heads=1,
                         intermediate=256, num_layers=2)
    net, _ = load_model(d)
    amax: dict[str, float] = {}
    hooks = [m.register_forward_hook(lambda m, i, o, n=n: amax.__setitem__(n, max(amax.get(n, 0.0), float(i[0].abs().max()))))
             for n, m in net.named_modules() if isinstance(m, torch.nn.Linear) and n.startswith("model.layers.")]
    ids = torch.randint(net.args.vocab_size, (2 * 32,), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        net(ids, torch.arange(32).repeat(2), DenseCausalAttention(2, 32))
    for h in hooks:
        h.remove()
    return d, amax


def _tensors(tiny, qt):
    d, amax = tiny
    net, _ = load_model(d)
    scales = None
    if qt in ("a8w8", "a8w8_fp8"):
        qmax = 127.0 if qt == "a8w8" else 448.0
        scales = {n: torch.tensor(a / qmax) for n, a in amax.items()}
    res = quantize_model(net, preset(qt, group_size=64, weight_observer="minmax"), "rtn", input_scales=scales)
    return res, net.args


def _engine_tokens(res, args, device, dtype, prompts, *, policy=None, proposer=None, k=0, kv=None,
                   max_length=128):
    net, _, _ = quantized_model(res.tensors, args, res.config, dtype=dtype, device=torch.device(device),
                                policy=policy)
    runtime = prepare(net, device, policy=policy)
    kv_dtype, ks, vs = kv or ("auto", None, None)
    eng = Engine(net, EngineConfig(max_batch_size=len(prompts), max_length=max_length, kv_cache_dtype=kv_dtype,
                                   spec_max_draft_tokens=k),
                 eos_token_ids=[], k_scale=ks, v_scale=vs, proposer=proposer, runtime=runtime)
    seqs = [eng.add_request(p, SamplingParams(max_new_tokens=NEW)) for p in prompts]
    eng.run()
    return [list(s.output_ids) for s in seqs], net


def _prompts(vocab, n=3):
    gen = torch.Generator().manual_seed(5)
    seg = [torch.randint(vocab, (12,), generator=gen).tolist() for _ in range(n)]
    return [(s * 4)[: 20 + 7 * i] for i, s in enumerate(seg)]  # repeating: n-gram drafts match


@pytest.mark.parametrize("qt", QUANTS)
def test_cuda_engine_equals_cpu_engine_fp32(tiny, qt):
    if qt == "a8w8_fp8" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 kernels need compute capability >= 8.9")
    res, args = _tensors(tiny, qt)
    prompts = _prompts(args.vocab_size)
    cpu, _ = _engine_tokens(res, args, "cpu", torch.float32, prompts)
    cuda, _ = _engine_tokens(res, args, "cuda", torch.float32, prompts)
    assert cuda == cpu


@pytest.mark.parametrize("kv", ["int8", "fp8"])
def test_cuda_quantized_kv_cache_equals_cpu_fp32(tiny, kv):
    res, args = _tensors(tiny, "weight_only_int4")
    prompts = _prompts(args.vocab_size)
    scale = torch.full((args.num_layers, args.num_kv_heads), 4.0 / (127.0 if kv == "int8" else 448.0))
    cpu, _ = _engine_tokens(res, args, "cpu", torch.float32, prompts, kv=(kv, scale, scale))
    cuda, _ = _engine_tokens(res, args, "cuda", torch.float32, prompts, kv=(kv, scale, scale))
    assert cuda == cpu


@pytest.mark.parametrize("qt", ["weight_only_int4", "a8w8"])
def test_cuda_bf16_tracks_fp32_reference(tiny, qt):
    """Each bf16 greedy token is the fp32 reference's argmax or within 3% of the row's largest
    |logit| of it (bf16 activations, and for a8w8 their int8 codes, round differently)."""
    res, args = _tensors(tiny, qt)
    prompts = _prompts(args.vocab_size)
    outs, _ = _engine_tokens(res, args, "cuda", torch.bfloat16, prompts)
    ref, _, _ = quantized_model(res.tensors, args, res.config, dtype=torch.float32, device=torch.device("cpu"),
                                policy=DispatchPolicy(fast=False))
    for p, o in zip(prompts, outs):
        ids = torch.tensor(p + o)
        with torch.inference_mode():
            logits = ref.compute_logits(ref(ids, torch.arange(len(ids)), DenseCausalAttention(1, len(ids))))
        for i, tok in enumerate(o):
            row = logits[len(p) - 1 + i]
            assert float(row.max() - row[tok]) <= 0.03 * float(row.abs().max()), (i, tok, int(row.argmax()))


def test_cuda_ngram_speculation_is_lossless(tiny):
    res, args = _tensors(tiny, "weight_only_int4")
    prompts = _prompts(args.vocab_size)
    plain, _ = _engine_tokens(res, args, "cuda", torch.float32, prompts)
    spec, _ = _engine_tokens(res, args, "cuda", torch.float32, prompts, proposer=ReferenceProposer(2, 4), k=4)
    assert spec == plain


def test_cuda_split_kv_attention_gives_the_cpu_tokens(tiny):
    """With `DispatchPolicy.cuda_split_kv` prompts longer than a chunk (300–314 keys, two
    splits) give the CPU engine's fp32 tokens, and n-gram speculation over them stays lossless
    (a verification row is its decode step's, split alike)."""
    from quantspec.infer.cuda.attention import kv_split

    res, args = _tensors(tiny, "weight_only_int4")
    prompts = [(p * 30)[: 300 + 7 * i] for i, p in enumerate(_prompts(args.vocab_size))]
    policy = DispatchPolicy(cuda_split_kv=True)
    assert kv_split(400 + 4 + 1) == (256, 2)
    cpu, _ = _engine_tokens(res, args, "cpu", torch.float32, prompts, max_length=400)
    cuda, _ = _engine_tokens(res, args, "cuda", torch.float32, prompts, policy=policy, max_length=400)
    spec, _ = _engine_tokens(res, args, "cuda", torch.float32, prompts, policy=policy, max_length=400,
                             proposer=ReferenceProposer(2, 4), k=4)
    assert cuda == cpu and spec == cuda


def test_cuda_runtime_takes_the_triton_attention(tiny):
    from quantspec.infer.cuda.attention import TritonAttention

    res, args = _tensors(tiny, "weight_only_int8")
    _, net = _engine_tokens(res, args, "cuda", torch.bfloat16, _prompts(args.vocab_size, 1))
    eng = Engine(net, EngineConfig(max_batch_size=1, max_length=64), runtime=prepare(net, "cuda", fuse=False))
    assert isinstance(eng.cache.kernel, TritonAttention)


def _graph_tokens(net, prompts, *, graphs: bool, proposer=None, k=0, **policy):
    """Greedy tokens of `net` on CUDA with decode steps replayed from CUDA graphs or launched
    eagerly (and `policy`'s other `DispatchPolicy` fields), and the runtime's graph runner."""
    runtime = prepare(net, "cuda", policy=DispatchPolicy(cuda_graphs=graphs, **policy))
    eng = Engine(net, EngineConfig(max_batch_size=len(prompts), max_length=128, spec_max_draft_tokens=k),
                 eos_token_ids=[], proposer=proposer, runtime=runtime)
    seqs = [eng.add_request(p, SamplingParams(max_new_tokens=NEW)) for p in prompts]
    eng.run()
    return [list(s.output_ids) for s in seqs], runtime.stack


@pytest.mark.parametrize("qt", ["weight_only_int4", "weight_only_int8", "a8w8", "float"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_graphs_give_the_eager_tokens(tiny, qt, dtype):
    """Decode steps replayed from CUDA graphs (3 sequences in the graph of 4: one padding row)
    give the tokens of the eager launches."""
    prompts = _prompts(load_model(tiny[0])[0].args.vocab_size)

    def build():
        if qt == "float":
            net, _ = load_model(tiny[0], dtype=dtype, device="cuda")
            return net
        res, args = _tensors(tiny, qt)
        return quantized_model(res.tensors, args, res.config, dtype=dtype, device=torch.device("cuda"))[0]

    eager, none = _graph_tokens(build(), prompts, graphs=False)
    graphed, runner = _graph_tokens(build(), prompts, graphs=True)
    assert (none is None or not none.use_graphs and none.replays == 0) and runner.replays >= NEW - 1
    assert {(bp, q) for bp, q, _ in runner.graphs} == {(4, 1)}
    assert graphed == eager


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
                    reason="programmatic dependent launches need compute capability 9.0")
@pytest.mark.parametrize("qt", ["weight_only_int4", "a8w8", "float"])
def test_programmatic_launches_give_the_same_tokens(tiny, qt):
    """With `DispatchPolicy.cuda_pdl` the stack's kernels start while the one before them ends
    and wait for its writes: graphed and eager steps, plain and verifying three sequences, give
    the tokens of ordinary launches (a kernel reading before its predecessor's writes land would
    change them)."""
    if qt == "float":
        net = load_model(tiny[0], dtype=torch.bfloat16, device="cuda")[0]
    else:
        res, args = _tensors(tiny, qt)
        net = quantized_model(res.tensors, args, res.config, dtype=torch.bfloat16, device=torch.device("cuda"))[0]
    prompts = _prompts(net.args.vocab_size)
    for graphs, k in ((True, 0), (False, 0), (True, 4)):
        def tokens(pdl: bool):
            return _graph_tokens(net, prompts, graphs=graphs, cuda_pdl=pdl, k=k,
                                 proposer=ReferenceProposer(2, k) if k else None)
        (ordinary, _), (overlapped, runner) = tokens(False), tokens(True)
        assert runner.pdl and (runner.replays >= NEW - 1 if graphs else runner.replays == 0)
        assert overlapped == ordinary, (graphs, k)


def test_cuda_graphs_take_uniform_verification_steps(tiny):
    """Verification steps whose sequences bring the same number of drafts (one sequence: every
    step) replay graphs of their own, and speculation stays lossless: the tokens of plain
    decoding, and of the same speculation launched eagerly."""
    res, args = _tensors(tiny, "weight_only_int4")
    net = quantized_model(res.tensors, args, res.config, dtype=torch.float32, device=torch.device("cuda"))[0]
    prompts = _prompts(args.vocab_size, 1)
    plain, _ = _graph_tokens(net, prompts, graphs=True)
    spec, runner = _graph_tokens(net, prompts, graphs=True, proposer=ReferenceProposer(2, 4), k=4)
    eager, _ = _graph_tokens(net, prompts, graphs=False, proposer=ReferenceProposer(2, 4), k=4)
    assert spec == plain == eager
    assert any(q > 1 for _, q, _ in runner.graphs)


def test_cuda_graphs_step_aside_for_hooks_and_speculation(tiny):
    """Speculation over sequences with different numbers of drafts replays the graph of the
    longest (each sequence's rows padded to it) and stays lossless; a forward hook on a layer
    sends every step back to the eager path, where it runs."""
    res, args = _tensors(tiny, "weight_only_int4")
    net = quantized_model(res.tensors, args, res.config, dtype=torch.float32, device=torch.device("cuda"))[0]
    lone = torch.randperm(args.vocab_size, generator=torch.Generator().manual_seed(9))[:30].tolist()
    prompts = _prompts(args.vocab_size) + [lone]  # three that repeat themselves, one that does not
    plain, runner = _graph_tokens(net, prompts, graphs=True)
    spec, spec_runner = _graph_tokens(net, prompts, graphs=True, proposer=ReferenceProposer(2, 4), k=4)
    assert spec == plain and runner.replays > 0
    assert any(q > 1 for bp, q, _ in spec_runner.graphs if bp == 4)
    calls = []
    handle = net.model.layers[0].register_forward_hook(lambda *a: calls.append(1))
    try:
        hooked, runner = _graph_tokens(net, prompts, graphs=True)
    finally:
        handle.remove()
    assert hooked == plain and runner.replays == 0 and len(calls) >= NEW



def test_cuda_prefix_caching_gives_the_cpu_tokens(tiny):
    """Prompts that start on cached blocks (the attention reading a block table whose first blocks
    another sequence filled) give the uncached CPU engine's fp32 tokens."""
    res, args = _tensors(tiny, "weight_only_int4")
    shared = (_prompts(args.vocab_size)[0] * 5)[:100]
    prompts = [shared + p[:9] for p in _prompts(args.vocab_size)]
    cpu, _ = _engine_tokens(res, args, "cpu", torch.float32, prompts, max_length=160)
    net, _, _ = quantized_model(res.tensors, args, res.config, dtype=torch.float32, device=torch.device("cuda"))
    eng = Engine(net, EngineConfig(max_batch_size=1, max_length=160, block_size=16, prefix_caching=True),
                 eos_token_ids=[], runtime=prepare(net, "cuda"))
    outs, cached = [], []
    for p in prompts:
        seq = eng.add_request(p, SamplingParams(max_new_tokens=NEW))
        eng.run()
        outs.append(list(seq.output_ids))
        cached.append(seq.stats.cached_tokens)
    assert outs == cpu and cached == [0, 96, 96]


def test_cuda_cache_cut_to_the_memory_budget_preempts_and_gives_the_cpu_tokens(tiny):
    """A default-size cache bigger than --gpu-memory-utilization leaves is cut to what fits, and
    the sequences it cannot hold at once are preempted and recomputed: the CPU engine's tokens."""
    from quantspec.devices import device_memory_budget
    from quantspec.infer.kv_cache import kv_block_bytes

    res, args = _tensors(tiny, "weight_only_int4")
    prompts = _prompts(args.vocab_size, n=6)
    cpu, _ = _engine_tokens(res, args, "cpu", torch.float32, prompts, max_length=160)
    net, _, _ = quantized_model(res.tensors, args, res.config, dtype=torch.float32, device=torch.device("cuda"))
    block = kv_block_bytes(num_layers=args.num_layers, block_size=16, num_kv_heads=args.num_kv_heads,
                           head_dim=args.head_dim, dtype=torch.float32)
    runtime = prepare(net, "cuda")
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    headroom = max(2**30, int(0.04 * total))
    util = (total - free + headroom + 20 * block) / total  # about 20 blocks: one sequence (11) and some more
    eng = Engine(net, EngineConfig(max_batch_size=6, max_length=160, block_size=16, gpu_memory_utilization=util),
                 eos_token_ids=[], runtime=runtime)
    assert eng.scheduler.bounded and 12 <= eng.cache.num_blocks <= 20 and device_memory_budget("cuda", util) > 0
    seqs = [eng.add_request(p, SamplingParams(max_new_tokens=NEW)) for p in prompts]
    eng.run()
    assert [list(s.output_ids) for s in seqs] == cpu and eng.scheduler.num_preemptions > 0


def test_cuda_engine_runs_quip_transforms_as_the_cpu(tiny, tmp_path):
    """A QuIP artifact (`quantize --quip v,u`): the CUDA engine's tokens, its transforms' block
    Linears on the GPU, are the CPU engine's (fp32), with and without n-gram speculation."""
    pytest.importorskip("compressed_tensors", reason="--quip writes its transform_config with compressed-tensors")
    from quantspec import api
    from quantspec.infer.loader import load_for_inference
    from quantspec.infer.spec.proposers import ReferenceProposer

    art = api.quantize(str(tiny[0]), "weight_only_int4", tmp_path / "quip", group_size=64, quip="v,u", target="vllm")
    prompts = _prompts(load_model(tiny[0])[0].args.vocab_size)
    out = {}
    for device, k in (("cpu", 0), ("cuda", 0), ("cuda", 4)):
        lm = load_for_inference(art, tokenizer=False, device=device, dtype=torch.float32)
        eng = Engine(lm.model, EngineConfig(max_batch_size=len(prompts), max_length=128, spec_max_draft_tokens=k),
                     eos_token_ids=[], proposer=ReferenceProposer(3, k) if k else None, runtime=lm.runtime)
        seqs = [eng.add_request(p, SamplingParams(max_new_tokens=NEW)) for p in prompts]
        eng.run()
        out[(device, k)] = [list(s.output_ids) for s in seqs]
    assert out[("cuda", 0)] == out[("cpu", 0)] == out[("cuda", 4)]
