"""load_for_inference: plain HF dirs and quantized artifacts (written here directly with quant/
functions), logits vs an independently built reference model, KV scales, eos ids, tied
embeddings, bad input, and greedy output stable across batch sizes in the engine."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from torch import nn

from quantspec.errors import QuantSpecError
from quantspec.infer.engine import Engine, EngineConfig
from quantspec.infer.loader import load_for_inference
from quantspec.infer.cpu.linears import PackedEmbedding, PackedLinear
from quantspec.infer.dispatch import DispatchPolicy, KernelPath
from quantspec.infer.quant_linear import QuantLinear
from quantspec.infer.sampler import SamplingParams
from quantspec.model_zoo.checkpoint import (build_model, load_checkpoint_tensors, load_model,
                                            read_config)
from quantspec.model_zoo.llama import DenseCausalAttention, ModelArgs
from quantspec.model_zoo.tiny import build_tiny_model
from quantspec.quant import (choose_qparams, dequantize, fake_quantize, kv_scale_tensors,
                             linear_from_tensors, linear_to_tensors, load_safetensors, preset,
                             read_quant_config, resolve_group_size, rtn_quantize, write_artifact)

torch.set_num_threads(1)

_EXTRA_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json",
                "special_tokens_map.json", "chat_template.jinja")
CALIB_IDS = torch.arange(3, 3 + 2 * 24).remainder(500).reshape(2, 24)  # [B, S]


def write_quantized_artifact(src: Path, out: Path, quant_type: str, *, group_size: int = 32,
                             symmetric: bool = True, kv_cache: str | None = None,
                             zp_dtype: str | None = None, weight_strategy: str | None = None) -> Path:
    """Quantize every Linear but lm_head of a HF checkpoint with RTN into a quantspec artifact,
    each Linear on its own (per-tensor scales: one per shard of a fused unit, as llm-compressor writes them).

    Static input / KV scales come from a min/max pass of the fp32 model over `CALIB_IDS`.
    """
    cfg = read_config(src)
    args = ModelArgs.from_hf_config(cfg)
    tensors = load_checkpoint_tensors(src)
    qc = preset(quant_type, group_size=group_size, symmetric=symmetric, kv_cache=kv_cache,
                zp_dtype=zp_dtype, weight_strategy=weight_strategy)
    linears = {n: m for n, m in build_model(args).named_modules() if isinstance(m, nn.Linear)}
    w_args = qc.config_groups["group_0"].weights
    if w_args.strategy == "group":
        sizes = {n: resolve_group_size(m.in_features, group_size) for n, m in linears.items()
                 if qc.scheme_for(n) is not None}
        qc = qc.with_layer_group_sizes(sizes)
    acts: dict[str, torch.Tensor] = {}
    kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    if qc.config_groups["group_0"].input_activations is not None or kv_cache:
        net, _ = load_model(src)
        hooks = [m.register_forward_pre_hook(lambda m, a, n=n: acts.__setitem__(n, a[0]))
                 for n, m in net.named_modules() if isinstance(m, nn.Linear)]
        B, S = CALIB_IDS.shape
        attn = DenseCausalAttention(B, S, kv_hook=lambda i, k, v: kv.__setitem__(
            i, (k.transpose(1, 2), v.transpose(1, 2))))  # [B, KV, S, hd]
        with torch.no_grad():
            net(CALIB_IDS.reshape(-1), torch.arange(S).repeat(B), attn)
        for h in hooks:
            h.remove()
    out_t = dict(tensors)
    for name in linears:
        scheme = qc.scheme_for(name)
        if scheme is None:
            continue
        r = rtn_quantize(out_t.pop(f"{name}.weight"), scheme.weights)
        ia = scheme.input_activations
        in_scale = choose_qparams(acts[name], ia)[0] if ia is not None else None
        out_t.update(linear_to_tensors(name, r.q, r.scale, None if scheme.weights.symmetric
                                       else r.zero_point, scheme.weights, input_scale=in_scale))
    if kv_cache:
        for i, (k, v) in kv.items():
            ks, _ = choose_qparams(k, qc.kv_cache_scheme)
            vs, _ = choose_qparams(v, qc.kv_cache_scheme)
            out_t.update(kv_scale_tensors(f"model.layers.{i}.self_attn", ks, vs,
                                          qc.kv_cache_scheme))
    config = dict(cfg, quantization_config=qc.to_dict())
    extra = {f: src / f for f in _EXTRA_FILES if (src / f).is_file()}
    return write_artifact(out, out_t, config, extra_files=extra,
                          provenance=qc.quantspec_metadata())


def reference_model(src: Path, artifact: Path):
    """The fp32 source model with each quantized weight replaced by `dequantize` of the
    artifact's codes (read with quant/artifact's own reader) and, for static activation schemes,
    its inputs fake-quantized with `input_scale` — built without infer/."""
    net, _ = load_model(src)
    qc = read_quant_config(artifact)
    tensors = load_safetensors(artifact)
    for name, mod in net.named_modules():
        if not isinstance(mod, nn.Linear) or qc.scheme_for(name) is None:
            continue
        lq = linear_from_tensors(tensors, name, qc)
        mod.weight = nn.Parameter(dequantize(lq.q, lq.scale.float(), lq.zero_point, lq.args))
        ia = qc.scheme_for(name).input_activations
        if ia is not None:
            s = lq.input_scale.float()
            mod.register_forward_pre_hook(
                lambda m, a, s=s, ia=ia: (fake_quantize(a[0].float(), s, None, ia),))
    return net


def logits(net, ids: torch.Tensor) -> torch.Tensor:
    B, S = ids.shape
    with torch.no_grad():
        h = net(ids.reshape(-1), torch.arange(S).repeat(B), DenseCausalAttention(B, S))
        return net.compute_logits(h)  # [B*S, V]


IDS = torch.tensor([[7, 300, 41, 12, 99, 5, 260, 17, 33, 2, 150, 8, 71]])


@pytest.fixture(scope="module")
def artifacts(tiny_llama_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("artifacts")
    specs = {
        "int8": dict(quant_type="weight_only_int8"),
        "int4": dict(quant_type="weight_only_int4", group_size=32),
        "int4_asym_g64": dict(quant_type="weight_only_int4", group_size=64, symmetric=False),
        "int4_asym_g32_fzp": dict(quant_type="weight_only_int4", group_size=32, symmetric=False,
                                  zp_dtype="float16"),
        "a8w8_kv8": dict(quant_type="a8w8", kv_cache="int8"),
        "fp8": dict(quant_type="a8w8_fp8", kv_cache="fp8"),
    }
    return {k: write_quantized_artifact(tiny_llama_dir, root / k, **v) for k, v in specs.items()}


@pytest.mark.parametrize("fuse", [True, False])
@pytest.mark.parametrize("name", ["int8", "int4", "int4_asym_g64", "int4_asym_g32_fzp",
                                  "a8w8_kv8", "fp8"])
def test_artifact_logits_match_reference(artifacts, tiny_llama_dir, name, fuse):
    lm = load_for_inference(artifacts[name], fuse=fuse)
    assert lm.is_quantized and lm.quant_config.quant_type is not None
    qlinears = [m for m in lm.model.modules() if isinstance(m, QuantLinear)]
    # every Linear but lm_head; fused: qkv, o, gate_up, down
    assert len(qlinears) == (4 if fuse else 7) * lm.args.num_layers
    assert isinstance(lm.model.lm_head, (nn.Linear, PackedLinear))  # the float head
    got = logits(lm.model, IDS)
    want = logits(reference_model(tiny_llama_dir, artifacts[name]), IDS)
    fp32 = logits(load_model(tiny_llama_dir)[0], IDS)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert (got - fp32).abs().max() > 1e-3  # the quantization is really applied


def test_bf16_artifact_runs_packed_ops(artifacts, tiny_llama_dir):
    """bf16 loading takes packed CPU ops for decode-sized M (quantspec's kernels where they are
    built, else torch's) and stays close to fp32."""
    from quantspec.kernels.cpu import cpu_kernels

    from quantspec.kernels.cpu import pair_path_available

    ours = cpu_kernels() is not None
    int8_path = KernelPath.CPU_GEMV_INT8 if ours else KernelPath.CPU_INT8PACK
    # int4: quantspec's pair path (bf16 x through AVX512-BF16) where this CPU has it, else torch's op
    int4_path = KernelPath.CPU_GEMV_INT4 if ours and pair_path_available() else KernelPath.CPU_INT4PACK
    for name, path in (("int8", int8_path), ("int4", int4_path), ("int4_asym_g32_fzp", int4_path)):
        lm = load_for_inference(artifacts[name], dtype=torch.bfloat16, tokenizer=False)
        q = lm.model.model.layers[0].mlp.down_proj
        assert q.kernel_for(torch.zeros(1, q.in_features, dtype=torch.bfloat16)) is path
        assert q.traits.cpu_pairs == (ours and pair_path_available())
        got = logits(lm.model, IDS[:, :1])
        want = logits(reference_model(tiny_llama_dir, artifacts[name]), IDS[:, :1])
        assert (got - want).abs().max() < 0.05 * want.abs().max()


def test_kv_scales_and_metadata(artifacts, tiny_llama_dir):
    lm = load_for_inference(artifacts["a8w8_kv8"])
    L, KV = lm.args.num_layers, lm.args.num_kv_heads
    assert lm.k_scale.shape == lm.v_scale.shape == (L, KV) and lm.k_scale.dtype == torch.float32
    t = load_safetensors(artifacts["a8w8_kv8"])
    for i in range(L):
        assert torch.equal(lm.k_scale[i], t[f"model.layers.{i}.self_attn.k_scale"].reshape(-1))
        assert torch.equal(lm.v_scale[i], t[f"model.layers.{i}.self_attn.v_scale"].reshape(-1))
    assert lm.kv_cache_dtype == "int8"
    assert load_for_inference(artifacts["fp8"], tokenizer=False).kv_cache_dtype == "fp8"
    assert lm.tokenizer is not None and lm.tokenizer.eos_token_id in lm.eos_token_ids
    gen = json.loads((tiny_llama_dir / "generation_config.json").read_text())["eos_token_id"]
    assert set([gen] if isinstance(gen, int) else gen) <= set(lm.eos_token_ids)
    assert lm.provenance.get("quant_type") == "a8w8"
    assert load_for_inference(artifacts["int8"]).k_scale is None


def test_per_tensor_kv_scale_broadcasts_to_heads(artifacts, tmp_path):
    art = tmp_path / "a"
    shutil.copytree(artifacts["a8w8_kv8"], art)
    cfg = json.loads((art / "config.json").read_text())
    cfg["quantization_config"]["kv_cache_scheme"]["strategy"] = "tensor"
    (art / "config.json").write_text(json.dumps(cfg))
    t = load_safetensors(art)
    for k in [k for k in t if k.endswith(("k_scale", "v_scale"))]:
        t[k] = torch.tensor([0.25 if k.endswith("k_scale") else 0.5])
    from safetensors.torch import save_file

    save_file(t, str(art / "model.safetensors"))
    lm = load_for_inference(art, tokenizer=False)
    assert torch.equal(lm.k_scale, torch.full((2, 2), 0.25))
    assert torch.equal(lm.v_scale, torch.full((2, 2), 0.5))


def test_plain_hf_dir_loads_unquantized(tiny_llama_dir):
    lm = load_for_inference(tiny_llama_dir)
    assert lm.quant_config is None and lm.k_scale is None and lm.provenance == {}
    assert not any(isinstance(m, QuantLinear) for m in lm.model.modules())
    torch.testing.assert_close(logits(lm.model, IDS), logits(load_model(tiny_llama_dir)[0], IDS))


def test_tied_embeddings_stay_tied(tmp_path):
    src = build_tiny_model(tmp_path / "src", "llama", tie_word_embeddings=True)
    art = write_quantized_artifact(src, tmp_path / "w4", "weight_only_int4", group_size=32)
    lm = load_for_inference(art, tokenizer=False, policy=DispatchPolicy(cpu_kernels=False))
    assert lm.model.lm_head.weight is lm.model.model.embed_tokens.weight
    torch.testing.assert_close(logits(lm.model, IDS), logits(reference_model(src, art), IDS),
                               rtol=1e-4, atol=1e-4)
    lm = load_for_inference(art, tokenizer=False)
    head, emb = lm.model.lm_head, lm.model.model.embed_tokens
    if isinstance(head, PackedLinear):  # quantspec's kernels built: one table, in the packed head
        assert isinstance(emb, PackedEmbedding)
        assert torch.equal(emb(torch.arange(head.out_features)), head.dense_weight())
    else:
        assert head.weight is emb.weight
    torch.testing.assert_close(logits(lm.model, IDS), logits(reference_model(src, art), IDS),
                               rtol=1e-4, atol=1e-4)


def test_qwen2_biases_in_quantized_linears(tiny_qwen2_dir, tmp_path):
    art = write_quantized_artifact(tiny_qwen2_dir, tmp_path / "w8", "weight_only_int8")
    lm = load_for_inference(art, tokenizer=False, fuse=False)
    q = lm.model.model.layers[1].self_attn.q_proj
    assert isinstance(q, QuantLinear) and q.bias is not None
    torch.testing.assert_close(logits(lm.model, IDS),
                               logits(reference_model(tiny_qwen2_dir, art), IDS),
                               rtol=1e-4, atol=1e-4)
    lm = load_for_inference(art, tokenizer=False)  # fused q/k/v carry the stacked biases
    qkv = lm.model.model.layers[1].self_attn.qkv_proj
    assert isinstance(qkv, QuantLinear) and qkv.bias is not None
    assert qkv.out_features == lm.args.q_size + 2 * lm.args.kv_size
    torch.testing.assert_close(logits(lm.model, IDS),
                               logits(reference_model(tiny_qwen2_dir, art), IDS),
                               rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------- bad input


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit_config(art: Path, fn) -> None:
    cfg = json.loads((art / "config.json").read_text())
    fn(cfg)
    (art / "config.json").write_text(json.dumps(cfg))


def _edit_tensors(art: Path, fn) -> None:
    from safetensors.torch import save_file

    t = load_safetensors(art)
    fn(t)
    save_file(t, str(art / "model.safetensors"))


def test_unsupported_format_and_method(artifacts, tmp_path):
    art = _copy(artifacts["int4"], tmp_path / "a")
    _edit_config(art, lambda c: c["quantization_config"].update(format="marlin-24"))
    with pytest.raises(QuantSpecError, match="'marlin-24' is unsupported.*pack-quantized"):
        load_for_inference(art)
    _edit_config(art, lambda c: c.__setitem__("quantization_config", {"quant_method": "hqq", "nbits": 4}))
    with pytest.raises(QuantSpecError, match="quant_method 'hqq' is unsupported"):
        load_for_inference(art)
    _edit_config(art, lambda c: c.__setitem__("quantization_config",
                                              {"quant_method": "bitsandbytes", "load_in_4bit": True}))
    with pytest.raises(QuantSpecError, match="bitsandbytes checkpoints have no kernel here.*quantspec quantize"):
        load_for_inference(art)


def test_missing_input_scale_says_calibrate(artifacts, tmp_path):
    art = _copy(artifacts["a8w8_kv8"], tmp_path / "a")
    _edit_tensors(art, lambda t: t.pop("model.layers.1.mlp.down_proj.input_scale"))
    with pytest.raises(QuantSpecError, match="down_proj has no input_scale.*--calib"):
        load_for_inference(art)


def test_missing_and_unexpected_and_misshaped_tensors(artifacts, tmp_path):
    art = _copy(artifacts["int4"], tmp_path / "a")
    _edit_tensors(art, lambda t: t.pop("model.layers.0.self_attn.o_proj.weight_packed"))
    with pytest.raises(QuantSpecError, match="o_proj.weight_packed' is missing"):
        load_for_inference(art)
    art = _copy(artifacts["int4"], tmp_path / "b")
    _edit_tensors(art, lambda t: t.pop("model.norm.weight"))
    with pytest.raises(QuantSpecError, match="lacks model.norm.weight"):
        load_for_inference(art)
    art = _copy(artifacts["int4"], tmp_path / "c")
    _edit_tensors(art, lambda t: t.__setitem__("model.layers.0.mlp.up_proj.extra", torch.ones(1)))
    with pytest.raises(QuantSpecError, match="unexpected tensor model.layers.0.mlp.up_proj.extra"):
        load_for_inference(art)
    art = _copy(artifacts["int4"], tmp_path / "d")
    _edit_tensors(art, lambda t: t.__setitem__("model.layers.0.mlp.up_proj.weight_scale",
                                               torch.ones(128, 3)))
    with pytest.raises(QuantSpecError, match=r"up_proj.weight_scale has shape \(128, 3\)"):
        load_for_inference(art)
    art = _copy(artifacts["a8w8_kv8"], tmp_path / "e")
    _edit_tensors(art, lambda t: t.pop("model.layers.1.self_attn.v_scale"))
    with pytest.raises(QuantSpecError, match="lacks model.layers.1.self_attn.v_scale"):
        load_for_inference(art)


# ---------------------------------------------------------------- engine


# fp32 activations: in bf16 the packed CPU ops (M <= 16 rows) and dequantize + matmul (more rows)
# round differently, so a batch's prefill can flip a near-tie on a random tiny model.
@pytest.mark.parametrize("name,dtype", [("int4", torch.float32), ("int8", torch.float32)])
def test_greedy_output_same_across_batch_sizes(artifacts, name, dtype):
    lm = load_for_inference(artifacts[name], dtype=dtype)
    prompts = [lm.tokenizer.encode(t) for t in
               ("def add(a, b):", "The quick brown fox", "Hello", "A longer prompt about weather")]

    def run(batch):
        eng = Engine(lm.model, EngineConfig(max_batch_size=batch, max_length=64, block_size=16),
                     eos_token_ids=[])
        seqs = [eng.add_request(p, SamplingParams(max_new_tokens=12)) for p in prompts]
        eng.run()
        return [s.output_ids for s in seqs]

    one, four = run(1), run(4)
    assert all(len(o) == 12 for o in one)
    assert one == four
    assert len({tuple(o) for o in one}) > 1  # not a degenerate constant output


@pytest.mark.slow
def test_default_model_int4_artifact_smoke(tmp_path):
    """SmolLM2-135M (K=576: group 128 falls back to 64 for those layers) as an int4 artifact:
    loads, matches the dequantized reference, and bf16 decoding takes a packed CPU op (quantspec's
    pair path where the CPU has AVX512-BF16, else torch's)."""
    from quantspec.model_zoo.checkpoint import resolve_model_dir

    src = resolve_model_dir("smollm2-135m")
    art = write_quantized_artifact(src, tmp_path / "w4", "weight_only_int4", group_size=128)
    lm = load_for_inference(art)
    gs = {m.weight_args.group_size for m in lm.model.modules() if isinstance(m, QuantLinear)}
    assert gs == {64, 128}
    ids = torch.tensor([lm.tokenizer.encode("The capital of France is")])
    torch.testing.assert_close(logits(lm.model, ids), logits(reference_model(src, art), ids),
                               rtol=1e-3, atol=1e-3)
    lm16 = load_for_inference(art, dtype=torch.bfloat16)
    down = lm16.model.model.layers[0].mlp.down_proj
    from quantspec.kernels.cpu import pair_path_available

    want = KernelPath.CPU_GEMV_INT4 if down.traits.cpu_gemv and pair_path_available() else KernelPath.CPU_INT4PACK
    assert down.kernel_for(torch.zeros(1, 1536, dtype=torch.bfloat16)) is want
    eng = Engine(lm16.model, EngineConfig(max_batch_size=1, max_length=64), eos_token_ids=[], runtime=lm16.runtime)
    seq = eng.add_request(ids[0].tolist(), SamplingParams(max_new_tokens=4))
    eng.run()
    assert len(seq.output_ids) == 4


# ---------------------------------------------------------------- fused projections (infer/fuse.py)

@pytest.mark.parametrize("which", ["llama", "qwen2"])
def test_fused_float_model_matches_unfused(tiny_llama_dir, tiny_qwen2_dir, which):
    src = tiny_llama_dir if which == "llama" else tiny_qwen2_dir  # qwen2: q/k/v biases
    fused = load_for_inference(src, tokenizer=False)
    attn, mlp = fused.model.model.layers[0].self_attn, fused.model.model.layers[0].mlp
    assert attn.q_proj is None and attn.qkv_proj is not None and mlp.gate_up_proj is not None
    want = logits(load_model(src)[0], IDS)
    torch.testing.assert_close(logits(fused.model, IDS), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits(load_for_inference(src, tokenizer=False, fuse=False).model, IDS), want,
                               rtol=1e-5, atol=1e-5)


def test_unequal_input_scales_are_not_fused(artifacts, tiny_llama_dir, tmp_path):
    """a8w8's q/k/v share a static input scale only if calibration gave them one; a k_proj with
    its own scale keeps layer 0's projections separate (and the numbers right)."""
    art = _copy(artifacts["a8w8_kv8"], tmp_path / "a")
    name = "model.layers.0.self_attn.k_proj.input_scale"
    _edit_tensors(art, lambda t: t.__setitem__(name, t[name] * 2))
    lm = load_for_inference(art, tokenizer=False)
    l0, l1 = lm.model.model.layers[0].self_attn, lm.model.model.layers[1].self_attn
    assert l0.qkv_proj is None and isinstance(l0.k_proj, QuantLinear)
    assert isinstance(l1.qkv_proj, QuantLinear) and l1.q_proj is None
    torch.testing.assert_close(logits(lm.model, IDS), logits(reference_model(tiny_llama_dir, art), IDS),
                               rtol=1e-4, atol=1e-4)


# in a fresh process, loads the tiny checkpoint argv[2] (so that every library the loader maps is
# resident), then the checkpoint argv[1] with --dtype auto; prints the dtype it chose, the
# checkpoint's bytes and how far loading it raised the peak resident memory above what it was
_PEAK_CHILD = """
import json, sys
from pathlib import Path
import torch
from quantspec.infer.loader import auto_dtype, load_for_inference

def status(key):
    return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith(key))

load_for_inference(sys.argv[2], dtype=torch.bfloat16, tokenizer=False)
ckpt = Path(sys.argv[1])
dtype = auto_dtype(ckpt)
before = status("VmRSS")
loaded = load_for_inference(ckpt, dtype=dtype, tokenizer=False)
print(json.dumps({"dtype": str(loaded.model.model.norm.weight.dtype), "ckpt": sum(
    f.stat().st_size for f in ckpt.glob("*.safetensors")), "peak_rise": status("VmHWM") - before}))
"""


@pytest.mark.skipif(not Path("/proc/self/status").is_file(), reason="reads VmHWM from /proc")
def test_bf16_sharded_checkpoint_loads_without_a_second_copy(tiny_llama_dir, tmp_path):
    """A bf16 sharded checkpoint loads as stored (auto: bfloat16, no float32 upcast), one tensor
    at a time: loading raises the peak resident memory by the checkpoint plus a fixed allowance,
    never by a second copy of the weights."""
    import subprocess
    import sys

    ckpt = build_tiny_model(tmp_path / "bf16", "llama", num_layers=12, hidden=768, heads=12, kv_heads=4,
                            intermediate=3072, dtype=torch.bfloat16, sharded=True)
    assert (ckpt / "model.safetensors.index.json").is_file()
    env = dict(__import__("os").environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    proc = subprocess.run([sys.executable, "-c", _PEAK_CHILD, str(ckpt), str(tiny_llama_dir)], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["dtype"] == "torch.bfloat16"
    assert r["ckpt"] > 150e6
    assert r["peak_rise"] <= 1.25 * r["ckpt"] + 100e6, r
