"""Interop both ways with transformers + compressed-tensors, on the tiny Llama, in fp32.

(a) transformers (`AutoModelForCausalLM.from_pretrained`, compressed-tensors decompressing) loads
    OUR artifacts — int8, int4, FP8 weights alone, a8w8 and a8w8_fp8, the last two also with a static KV-cache
    scheme — and its logits equal quantspec's (`load_for_inference`) within 1e-4 (≤ 5e-6 on
    logits of magnitude ~11). transformers ignores `k_scale` / `v_scale` (its load report lists
    them as unexpected) and runs a float KV cache, so a KV-quantized artifact is compared with
    quantspec's float-KV path, and the scales are checked to be in the file.
(b) quantspec loads checkpoints written through compressed-tensors' OWN API: see
    tests/test_interop_compressed_tensors.py.
"""

import importlib.util
from pathlib import Path

import pytest
import torch

from quantspec.infer.dispatch import DispatchPolicy
from quantspec.infer.kv_cache import AttentionMetadata, PagedAttention, PagedKVCache
from quantspec.infer.loader import load_for_inference
from quantspec.quant.artifact import read_quant_config

ct_q = pytest.importorskip("compressed_tensors.quantization",
                           reason="compressed-tensors is not installed (pip install "
                                  "quantspec[dev])")
transformers = pytest.importorskip("transformers")

torch.set_num_threads(1)

_spec = importlib.util.spec_from_file_location(
    "quantspec_test_loader_helpers", Path(__file__).parent / "infer" / "test_loader.py")
_helpers = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_helpers)
write_quantized_artifact, logits = _helpers.write_quantized_artifact, _helpers.logits

IDS = torch.tensor([[7, 300, 41, 12, 99, 5, 260, 17, 33, 2, 150, 8, 71]])
TOL = dict(rtol=1e-4, atol=1e-4)


def _hf_logits(path: Path) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    with torch.no_grad():
        return m(IDS).logits[0]  # [T, V]


def _paged_logits(lm) -> torch.Tensor:
    """One prefill through the paged cache (the artifact's KV cache: int8/fp8 with its static
    scales, else float)."""
    a, T = lm.args, IDS.shape[1]
    bs = 16
    cache = PagedKVCache(num_layers=a.num_layers, num_blocks=2 + T // bs, block_size=bs,
                         num_kv_heads=a.num_kv_heads, head_dim=a.head_dim, dtype=torch.float32,
                         kv_dtype=lm.kv_cache_dtype or "auto", k_scale=lm.k_scale, v_scale=lm.v_scale)
    meta = AttentionMetadata.build([T], [T], [list(range(1, 2 + T // bs))], bs, "cpu")
    with torch.no_grad():
        return lm.model.compute_logits(lm.model(IDS[0], torch.arange(T), PagedAttention(cache, meta)))


def _same_op_order(quant_type: str) -> DispatchPolicy | None:
    """quantspec's reference path (compressed-tensors' order: dequantize x and w, then matmul) for
    static fp8 activations. Its CPU kernel (fp8 codes × codes, scales after the sum) agrees per
    layer to ~1e-6, but that can round one E4M3 activation code of the next layer the other way (a
    step of 6–12% of the value; one code in 6144 on the conformance model moves the logits by
    7e-4): equal numbers need the same order."""
    return DispatchPolicy(fast=False) if quant_type == "a8w8_fp8" else None


@pytest.mark.parametrize("name,spec", [
    ("int8", dict(quant_type="weight_only_int8")),
    ("int8_g32", dict(quant_type="weight_only_int8", group_size=32)),  # llm-compressor's W8A16 layout
    ("int4", dict(quant_type="weight_only_int4", group_size=32)),
    ("a8w8", dict(quant_type="a8w8")),
    ("a8w8_kv8", dict(quant_type="a8w8", kv_cache="int8")),
    ("fp8_kvfp8", dict(quant_type="a8w8_fp8", kv_cache="fp8")),
    ("fp8_weights", dict(quant_type="weight_only_fp8")),
    # one FP8 weight scale per Linear, each shard of a fused unit its own (llm-compressor's FP8 scheme)
    ("fp8_tensor_kvfp8", dict(quant_type="a8w8_fp8", weight_strategy="tensor", kv_cache="fp8")),
    ("fp8_weights_tensor", dict(quant_type="weight_only_fp8", weight_strategy="tensor")),
])
def test_transformers_loads_our_artifact(tiny_llama_dir, tmp_path, name, spec):
    art = write_quantized_artifact(tiny_llama_dir, tmp_path / name, **spec)
    theirs = _hf_logits(art)
    lm = load_for_inference(art, tokenizer=False, policy=_same_op_order(spec["quant_type"]))
    torch.testing.assert_close(logits(lm.model, IDS), theirs, **TOL)  # float KV on both sides
    if spec.get("kv_cache"):
        from quantspec.quant.artifact import load_safetensors

        stored = load_safetensors(art)
        for i in range(lm.args.num_layers):
            for kv, want in (("k_scale", lm.k_scale[i]), ("v_scale", lm.v_scale[i])):
                got = stored[f"model.layers.{i}.self_attn.{kv}"]
                torch.testing.assert_close(got.float().reshape(-1), want.float(), rtol=0, atol=0)
        # quantspec's quantized-KV path runs the scales: it differs from transformers' float KV
        assert (_paged_logits(lm) - theirs).abs().max() > 1e-3
    # the comparison has teeth: the unquantized model is far from both
    fp32 = logits(load_for_inference(tiny_llama_dir, tokenizer=False).model, IDS)
    assert (fp32 - theirs).abs().max() > 1e-3


def test_float_zero_point_artifact(tiny_llama_dir, tmp_path):
    """A float-zp_dtype int4 artifact (`weight_zero_point` unpacked in fp16): compressed-tensors
    (≤ 0.20) cannot decompress it — its pack-quantized decompressor unpacks every group/channel
    zero point from int32 — so transformers fails on the first forward. quantspec loads it, and
    its logits equal transformers' own forward of the source model with every quantized weight
    replaced by quantspec's fake-quantized weight (choose_qparams + fake_quantize on the source
    weight, computed here independently of the artifact), within 1e-4."""
    from transformers import AutoModelForCausalLM

    from quantspec.quant import choose_qparams, fake_quantize, read_quant_config

    art = write_quantized_artifact(tiny_llama_dir, tmp_path / "fzp", "weight_only_int4",
                                   group_size=32, symmetric=False, zp_dtype="float16")
    qc = read_quant_config(art)
    m = AutoModelForCausalLM.from_pretrained(str(art), dtype=torch.float32)
    with pytest.raises(ValueError, match="Expected torch.int32 but got torch.float16"):
        with torch.no_grad():
            m(IDS)
    ref = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32)
    n_fq = 0
    for name, mod in ref.named_modules():
        args = qc.weight_args_for(name) if isinstance(mod, torch.nn.Linear) else None
        if args is None:
            continue
        assert args.zp_dtype == "float16"
        s, z = choose_qparams(mod.weight.data, args)
        mod.weight.data = fake_quantize(mod.weight.data, s, z, args)
        n_fq += 1
    assert n_fq == 7 * ref.config.num_hidden_layers
    with torch.no_grad():
        want = ref(IDS).logits[0]
    lm = load_for_inference(art, tokenizer=False)
    torch.testing.assert_close(logits(lm.model, IDS), want, **TOL)
    fp32 = logits(load_for_inference(tiny_llama_dir, tokenizer=False).model, IDS)
    assert (fp32 - want).abs().max() > 1e-3


@pytest.mark.parametrize("quant_type,method", [("a8w8_fp8", "rtn"), ("weight_only_fp8", "rtn"), ("a8w8_fp8", "gptq")])
def test_transformers_loads_our_fp8_block_artifact(tiny_llama_dir, tmp_path, quant_type, method):
    """`quantize --quant-type a8w8_fp8 | weight_only_fp8 --weight-block 128 [--method gptq]` (FP8
    block weights, blocks fitted per layer; for a8w8_fp8 inputs quantized per token and group at
    run time): transformers (compressed-tensors decompressing) gives quantspec's logits; GPTQ's
    block scales are each fused unit's own, sliced at its shards' seams."""
    from quantspec import api
    from quantspec.infer.quant_linear import QuantLinear
    from quantspec.model_zoo.tiny import TINY_CORPUS

    data = tmp_path / "calib.txt"
    data.write_text(TINY_CORPUS)
    gptq = dict(method="gptq", dataset=str(data), num_samples=4, seq_len=64) if method == "gptq" else {}
    art = api.quantize(str(tiny_llama_dir), quant_type, tmp_path / "fp8_block", weight_block=128,
                       target="vllm" if quant_type == "weight_only_fp8" else "portable", **gptq)
    if method == "gptq":  # GPTQ's codes, on RTN's block grid
        rtn = api.quantize(str(tiny_llama_dir), quant_type, tmp_path / "rtn", weight_block=128)
        ours, theirs_rtn = _safetensors(art), _safetensors(rtn)
        assert {k: v.shape for k, v in ours.items()} == {k: v.shape for k, v in theirs_rtn.items()}
        assert any(not torch.equal(ours[k].float(), theirs_rtn[k].float()) for k in ours if k.endswith("proj.weight"))
    theirs = _hf_logits(art)
    lm = load_for_inference(art, tokenizer=False)
    layers = [m for m in lm.model.modules() if isinstance(m, QuantLinear)]
    assert layers and all(m.weight_args.strategy == "block" for m in layers)
    assert all((m.input_args is None) == (quant_type == "weight_only_fp8") for m in layers)
    torch.testing.assert_close(logits(lm.model, IDS), theirs, **TOL)
    # teeth: the float model is far from it, and so are the same weights with float inputs
    fp32 = logits(load_for_inference(tiny_llama_dir, tokenizer=False).model, IDS)
    assert (fp32 - theirs).abs().max() > 1e-3
    if quant_type == "a8w8_fp8":
        for m in layers:
            m.input_args = None
        assert (logits(lm.model, IDS) - theirs).abs().max() > 1e-3


@pytest.mark.parametrize("quant_type,method", [("a8w8_fp8", "rtn"), ("weight_only_fp8", "rtn"), ("a8w8_fp8", "gptq")])
def test_our_per_tensor_fp8_artifact(tiny_llama_dir, calibration_table, tmp_path, quant_type, method):
    """`quantize --weight-strategy tensor` (compressed-tensors' FP8 scheme): one E4M3 weight scale per
    Linear, the same for a fused unit's shards (q / k / v, gate / up) — the largest |w| of the unit
    over 448, which the engines' requantization of a fused layer to its shards' largest scale leaves
    as it is — and transformers gives quantspec's logits."""
    from quantspec import api
    from quantspec.infer.quant_linear import QuantLinear
    from quantspec.model_zoo.tiny import TINY_CORPUS

    data = tmp_path / "calib.txt"
    data.write_text(TINY_CORPUS)
    opts = dict(method="gptq", dataset=str(data), num_samples=4, seq_len=64) if method == "gptq" else {}
    if quant_type == "a8w8_fp8":
        opts.update(calib=str(calibration_table(tiny_llama_dir)), smoothquant_alpha="none", fallback_layers=0)
    art = api.quantize(str(tiny_llama_dir), quant_type, tmp_path / "pt", weight_strategy="tensor", **opts)
    stored, source = _safetensors(art), _safetensors(tiny_llama_dir)
    for i in range(2):
        for part, units in (("self_attn", ("q_proj", "k_proj", "v_proj")), ("self_attn", ("o_proj",)),
                            ("mlp", ("gate_proj", "up_proj")), ("mlp", ("down_proj",))):
            names = [f"model.layers.{i}.{part}.{u}" for u in units]
            scales = [stored[f"{n}.weight_scale"] for n in names]
            assert all(s.shape == (1,) and torch.equal(s, scales[0]) for s in scales)
            top = max(source[f"{n}.weight"].float().abs().max() for n in names)
            torch.testing.assert_close(scales[0].float(), (top / 448).reshape(1), rtol=1e-6, atol=0)
    theirs = _hf_logits(art)
    lm = load_for_inference(art, tokenizer=False, policy=_same_op_order(quant_type))
    layers = [m for m in lm.model.modules() if isinstance(m, QuantLinear)]
    assert layers and all((m.input_args is None) == (quant_type == "weight_only_fp8") for m in layers)
    torch.testing.assert_close(logits(lm.model, IDS), theirs, **TOL)
    fp32 = logits(load_for_inference(tiny_llama_dir, tokenizer=False).model, IDS)
    assert (fp32 - theirs).abs().max() > 1e-3  # teeth: the float model is far from it


def _safetensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


def _write_hf_fp8(src: Path, out: Path, block: tuple[int, int]) -> dict[str, torch.Tensor]:
    """`src` as transformers' fine-grained FP8 checkpoint (`quant_method: "fp8"`, E4M3 weights,
    `weight_scale_inv` per [bn, bk] block, zero-padded at the edges), written with plain torch →
    {Linear: its dequantized weight}."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, out)
    tensors, dense = load_file(str(out / "model.safetensors")), {}
    for k in [k for k in tensors if k.endswith("_proj.weight")]:
        w = tensors[k].float()
        N, K = w.shape
        bn, bk = block
        nb, kb = -(-N // bn), -(-K // bk)
        blocks = torch.nn.functional.pad(w, (0, kb * bk - K, 0, nb * bn - N)).reshape(nb, bn, kb, bk)
        scale = blocks.abs().amax(dim=(1, 3)) / 448.0  # [nb, kb]
        s = scale.repeat_interleave(bn, 0).repeat_interleave(bk, 1)[:N, :K]
        q = (w / s).clamp(-448, 448).to(torch.float8_e4m3fn)
        tensors[k], tensors[k[:-len("weight")] + "weight_scale_inv"] = q, scale
        dense[k[:-len(".weight")]] = q.float() * s
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": list(block)}
    (out / "config.json").write_text(json.dumps(cfg))
    return dense


@pytest.mark.parametrize("block", [(32, 32), (48, 32)])  # 48 rows: partial edge blocks
def test_we_load_transformers_fp8_checkpoint(tiny_llama_dir, tmp_path, block):
    """A fine-grained FP8 checkpoint in transformers' own format (Qwen3-*-FP8's, DeepSeek-V3's):
    quantspec's dequantized weights equal the writer's, and where the blocks tile the weights
    transformers' (which dequantizes without a GPU, and refuses partial edge blocks), and so do
    the logits with float inputs; quantspec quantizes the inputs per token and group as vLLM
    does, which moves them."""
    from transformers import AutoModelForCausalLM

    from quantspec.infer.quant_linear import QuantLinear

    dense = _write_hf_fp8(tiny_llama_dir, tmp_path / "fp8", block)
    lm = load_for_inference(tmp_path / "fp8", tokenizer=False, fuse=False)
    layers = {n: m for n, m in lm.model.named_modules() if isinstance(m, QuantLinear)}
    assert len(layers) == len(dense) == 7 * lm.args.num_layers
    for name, m in layers.items():
        assert m.weight_args.block_structure == block and m.input_args.group_size == block[1]
        assert torch.equal(m.dequantized_weight(torch.float32), dense[name]), name
    if any(d % b for w in dense.values() for d, b in zip(w.shape, block)):
        with pytest.raises(RuntimeError, match="CONVERSION"):
            AutoModelForCausalLM.from_pretrained(str(tmp_path / "fp8"), dtype=torch.float32)
        return
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "fp8"), dtype=torch.float32)
    with torch.no_grad():
        theirs = hf(IDS).logits[0]
    for name in layers:
        assert torch.equal(hf.get_submodule(name).weight.float(), dense[name]), name
    quantized_inputs = logits(lm.model, IDS)
    for m in layers.values():
        m.input_args = None
    torch.testing.assert_close(logits(lm.model, IDS), theirs, **TOL)
    assert (quantized_inputs - theirs).abs().max() > 1e-3


def test_fp8_checkpoint_whose_groups_do_not_divide_k_is_one_line(tiny_llama_dir, tmp_path):
    """128-wide blocks on a 64-wide model: the inputs' groups (a block's width) cannot tile K, as
    in vLLM; refused at load in one line."""
    from quantspec.errors import QuantSpecError

    _write_hf_fp8(tiny_llama_dir, tmp_path / "fp8", (128, 128))
    with pytest.raises(QuantSpecError, match=r"input groups of 128 do not divide K=64") as e:
        load_for_inference(tmp_path / "fp8", tokenizer=False)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("quant_type", ["weight_only_nvfp4", "nvfp4", "weight_only_mxfp4", "mxfp4", "a8w4_mxfp4",
                                        "weight_only_mxfp8", "mxfp8"])
def test_transformers_loads_our_fp4_artifact(tiny_llama_dir, calibration_table, tmp_path, quant_type):
    """NVFP4 / MXFP4 / MXFP8 (`nvfp4-` / `mxfp4-pack-quantized`, `mxfp8-quantized`), where
    compressed-tensors decompresses to bf16 only, so both run in bf16: the weight-only types give
    quantspec's logits; for nvfp4 transformers holds the stored input global scales, for mxfp4 /
    mxfp8 (a8w4_mxfp4) it quantizes the inputs per group of 32 (as FP8 per stored group) at run time (in bf16, quantspec in fp32 as vLLM's kernels do: the fp32 numbers are
    compressed-tensors' own, tests/test_interop_compressed_tensors.py). NVFP4's q/k/v and gate/up
    share their weight global scale, as the engines' fused layers need."""
    from transformers import AutoModelForCausalLM

    from quantspec import api
    from quantspec.infer.quant_linear import QuantLinear
    from quantspec.quant.artifact import load_safetensors

    calib = str(calibration_table(tiny_llama_dir)) if quant_type == "nvfp4" else None
    art = api.quantize(str(tiny_llama_dir), quant_type, tmp_path / quant_type, calib=calib, target="transformers")
    stored = load_safetensors(art)
    for part, units in (("self_attn", ("q_proj", "k_proj", "v_proj")), ("mlp", ("gate_proj", "up_proj"))):
        g = [stored.get(f"model.layers.0.{part}.{u}.weight_global_scale") for u in units]
        assert all(x is None if "mx" in quant_type else torch.equal(x, g[0]) for x in g)
    hf = AutoModelForCausalLM.from_pretrained(str(art), dtype=torch.bfloat16)
    with torch.no_grad():
        theirs = hf(IDS).logits[0].float()
    # the weights dequantized to bf16, as transformers does (without quantspec's CPU FP4 kernel,
    # whose weights stay fp32)
    lm = load_for_inference(art, tokenizer=False, dtype=torch.bfloat16, policy=DispatchPolicy(cpu_kernels=False))
    layers = [m for m in lm.model.modules() if isinstance(m, QuantLinear)]
    assert layers and all(m.weight_args.is_fp4 or m.weight_args.is_mx for m in layers)
    ours = logits(lm.model, IDS).float()
    fp32 = logits(load_for_inference(tiny_llama_dir, tokenizer=False).model, IDS)
    if quant_type.startswith("weight_only"):
        torch.testing.assert_close(ours, theirs, **TOL)
        assert (fp32 - theirs).abs().max() > 1e-3  # teeth: the float model is far from both
        kernel = logits(load_for_inference(art, tokenizer=False, dtype=torch.bfloat16).model, IDS).float()
        assert (kernel - theirs).abs().max() < 0.02 * theirs.abs().max() < (fp32 - theirs).abs().max()
        return
    q = hf.model.layers[0].self_attn.q_proj
    if quant_type in ("mxfp4", "mxfp8", "a8w4_mxfp4"):
        ia = q.quantization_scheme.input_activations
        ours_ia = read_quant_config(art).scheme_for("model.layers.0.self_attn.q_proj").input_activations
        assert (ia.dynamic, ia.strategy, ia.group_size, ia.num_bits) == (True, "group", ours_ia.group_size, ours_ia.num_bits)
        assert ours_ia.group_size == 32 if quant_type != "a8w4_mxfp4" else q.in_features % ours_ia.group_size == 0
        assert (ours - theirs).abs().max() < 0.05 * theirs.abs().max() < (fp32 - theirs).abs().max()
        return
    assert torch.equal(q.input_global_scale.data.reshape(-1), stored["model.layers.0.self_attn.q_proj.input_global_scale"])
    assert q.quantization_scheme.input_activations.dynamic == "local"
