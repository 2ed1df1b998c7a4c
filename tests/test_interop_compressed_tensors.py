"""quantspec loads and runs the schemes compressed-tensors writes for a Llama, or refuses one in
one line that names it.

Every checkpoint here is written through compressed-tensors' OWN API on a tiny transformers
Llama: a preset (`preset_name_to_scheme`) or a `QuantizationScheme`, and a `kv_cache_scheme`,
applied with `apply_quantization_config`; weight qparams from its `calculate_qparams` on each
weight's min/max; static activation and K/V scales from `calculate_qparams` on the min/max that a
float forward of the test ids saw (the scales any observer would give; no calibration data);
then `ModelCompressor.compress_model` + `save_pretrained` + `update_config`.

The reference is compressed-tensors' own forward of the compressed model in memory: it
decompresses the weights on its first call and fake-quantizes the input activations (per token
when dynamic, with `input_scale` when static) and K / V (with `k_scale` / `v_scale`, through its
`QuantizedKVCache`) by `forward_quantize`. quantspec (`load_for_inference`, one prefill through
its paged cache running the artifact's KV cache) matches it within 1e-4 (measured ≤ 1.3e-5 on
logits of magnitude ~10), every `QuantLinear` dequantizes to exactly compressed-tensors'
decompressed weight, and the same model with activation / KV quantization switched off is
> 1e-3 away from the reference (the comparison has teeth), as is quantspec's float KV cache
for a KV-quantized one.

W4A16 (sym / asym, g32) and W8A16 (which compressed-tensors writes as 8-bit `pack-quantized`)
on the hidden-64 tiny Llama are also checked against transformers' own forward of the saved
checkpoint (for asymmetric W4A16, whose reload transformers 5.x refuses — packed zero points vs
its init shapes — against the in-memory forward), fused (q/k/v, gate/up) and in bf16.
"""

import importlib.util
import shutil
import types
from pathlib import Path

import pytest
import torch

from quantspec.errors import QuantSpecError
from quantspec.infer.loader import load_for_inference
from quantspec.infer.quant_linear import QuantLinear

ct_q = pytest.importorskip("compressed_tensors.quantization",
                           reason="compressed-tensors is not installed (pip install "
                                  "quantspec[dev])")
transformers = pytest.importorskip("transformers")

_spec = importlib.util.spec_from_file_location(
    "quantspec_test_interop_helpers", Path(__file__).parent / "test_interop_transformers.py")
_helpers = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_helpers)
IDS, TOL, logits = _helpers.IDS, _helpers.TOL, _helpers.logits
paged_logits, hf_logits = _helpers._paged_logits, _helpers._hf_logits

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def tiny_llama_128(tmp_path_factory) -> Path:
    """The tiny Llama at hidden 128 / intermediate 256: group sizes 32, 64 and 128 divide every K."""
    from quantspec.model_zoo.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny_llama_128"), "llama", hidden=128,
                            intermediate=256)


def _attention_takes_past_key_values(model) -> None:
    """compressed-tensors (0.20) quantizes K / V of attention modules whose forward takes
    `past_key_values`; transformers 5.x names that argument `cache`. Each attention gets a forward
    with the old name, so that compressed-tensors' own `QuantizedKVCache` hooks run on it."""
    def forward(self, hidden_states, position_embeddings=None, attention_mask=None,
                past_key_values=None, **kw):
        cache = kw.pop("cache", None)
        if past_key_values is not None and cache is not None:
            past_key_values.add_past_key_values(cache)  # the quantizing wrapper keeps caching
        return type(self).forward(self, hidden_states, position_embeddings, attention_mask,
                                  cache=past_key_values, **kw)

    for mod in model.modules():
        if type(mod).__name__ == "LlamaAttention":
            mod.forward = types.MethodType(forward, mod)


def _observe(model) -> dict[str, torch.Tensor]:
    """{Linear name: its inputs, attention name + '.k' / '.v': its post-RoPE keys / values} of
    one float forward of IDS (compressed-tensors' quantization switched off), for static scales."""
    from compressed_tensors.modeling import register_key_hook, register_value_hook
    from compressed_tensors.quantization.lifecycle import disable_quantization, enable_quantization

    seen, hooks = {}, []
    for name, mod in model.named_modules():
        scheme = getattr(mod, "quantization_scheme", None)
        if scheme is None:
            continue
        if hasattr(mod, "kv_cache"):
            hooks.append(register_key_hook(mod, lambda m, k, n=name: seen.setdefault(f"{n}.k", k)))
            hooks.append(register_value_hook(mod, lambda m, v, n=name: seen.setdefault(f"{n}.v", v)))
        elif scheme.input_activations is not None and scheme.input_activations.dynamic in (False, "local"):
            hooks.append(mod.register_forward_pre_hook(
                lambda m, a, n=name: seen.setdefault(n, a[0].detach())))
    model.apply(disable_quantization)
    with torch.no_grad():
        model(IDS)
    model.apply(enable_quantization)
    for h in hooks:
        h.remove()
    return seen


def _minmax_qparams(x: torch.Tensor, args, dims: tuple[int, ...] | None):
    """compressed-tensors' `calculate_qparams` on x's min / max, reduced over `dims` (None: all)."""
    from compressed_tensors.quantization.utils import calculate_qparams

    if dims is None:
        return calculate_qparams(x.min().reshape(1), x.max().reshape(1), args)
    return calculate_qparams(x.amin(dims), x.amax(dims), args)


def _set_qparams(model, seen: dict[str, torch.Tensor]) -> None:
    """Weight scales / zero points per strategy, static input scales, K / V scales per tensor or
    per head, each into the parameter compressed-tensors initialized for it."""
    for name, mod in model.named_modules():
        scheme = getattr(mod, "quantization_scheme", None)
        if scheme is None:
            continue
        if hasattr(mod, "kv_cache"):
            args = scheme.input_activations
            for kv in ("k", "v"):
                x = seen[f"{name}.{kv}"]  # (B, H_kv, T, D)
                scale, _ = _minmax_qparams(x, args, (0, 2, 3) if args.strategy == "attn_head" else None)
                p = getattr(mod, f"{kv}_scale")
                p.data.copy_(scale.reshape(p.shape))
            continue
        args, W = scheme.weights, mod.weight.data  # [N, K]
        if args.strategy == "tensor_group":  # NVFP4: group scales under the tensor's global scale
            _set_nvfp4_qparams(mod, scheme, W, seen.get(name))
            continue
        if args.strategy == "group":
            scale, zp = _minmax_qparams(W.unflatten(-1, (-1, args.group_size)), args, (-1,))
        elif args.strategy == "channel":
            scale, zp = _minmax_qparams(W, args, (-1,))
            scale, zp = scale[:, None], zp[:, None]
        elif args.strategy == "block":  # zero-padded to whole blocks, as compressed-tensors pads
            bn, bk = args.block_structure
            Wp = torch.nn.functional.pad(W, (0, -W.shape[1] % bk, 0, -W.shape[0] % bn))
            scale, zp = _minmax_qparams(Wp.unflatten(1, (-1, bk)).unflatten(0, (-1, bn)), args, (1, 3))
        else:
            scale, zp = _minmax_qparams(W, args, None)
        mod.weight_scale.data.copy_(scale.reshape(mod.weight_scale.shape))
        if hasattr(mod, "weight_zero_point"):
            mod.weight_zero_point.data.copy_(zp.reshape(mod.weight_zero_point.shape))
        if name in seen:
            scale, _ = _minmax_qparams(seen[name], scheme.input_activations, None)
            mod.input_scale.data.copy_(scale.reshape(mod.input_scale.shape))


def _set_nvfp4_qparams(mod, scheme, W: torch.Tensor, x: torch.Tensor | None) -> None:
    """compressed-tensors' `generate_gparam` on the weight's (and the seen input's) min / max, and
    `calculate_qparams` per group of 16 under the weight's global scale (each Linear its own: a
    checkpoint whose fused shards' global scales differ)."""
    from compressed_tensors.quantization.utils import calculate_qparams
    from compressed_tensors.quantization.utils.helpers import generate_gparam

    g = generate_gparam(W.min(), W.max())
    Wg = W.unflatten(-1, (-1, scheme.weights.group_size))
    scale, _ = calculate_qparams(Wg.amin(-1), Wg.amax(-1), scheme.weights, global_scale=g)
    mod.weight_global_scale.data.copy_(g)
    mod.weight_scale.data.copy_(scale.reshape(mod.weight_scale.shape))
    if x is not None:
        mod.input_global_scale.data.copy_(generate_gparam(x.min(), x.max()))


def write_with_compressed_tensors(src: Path, out: Path, scheme, kv_cache_scheme=None):
    """`src` quantized by compressed-tensors' own lifecycle and compressor with `scheme` (a
    `QuantizationScheme` targeting Linear) and `kv_cache_scheme`, saved at `out` with the
    tokenizer; returns the in-memory compressed model (its forward: compressed-tensors' numbers)."""
    from compressed_tensors.compressors import ModelCompressor
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)
    if kv_cache_scheme is not None:
        _attention_takes_past_key_values(model)
    cfg = ct_q.QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"],
                                  kv_cache_scheme=kv_cache_scheme)
    ct_q.apply_quantization_config(model, cfg)
    _set_qparams(model, _observe(model))
    seen = _layer_io(model)
    with torch.no_grad():  # its fake-quantized forward (NVFP4's compressed one decompresses to bf16 only)
        model.fake_quantized_logits = model(IDS).logits[0]
    model.fake_quantized_io = dict(seen)  # (a copy: the hooks fill `seen` again on every forward)
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.save_pretrained(str(out))
    compressor.update_config(str(out))
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (src / f).is_file():
            shutil.copy(src / f, out / f)
    return model


def _ct_decompressed(path: Path, name: str, scheme) -> torch.Tensor:
    """compressed-tensors' NVFP4 / MXFP4 / MXFP8 decompressor on Linear `name`'s tensors as saved (bf16)."""
    from compressed_tensors.compressors.mxfp4 import MXFP4PackedCompressor
    from compressed_tensors.compressors.mxfp8 import MXFP8QuantizationCompressor
    from compressed_tensors.compressors.nvfp4 import NVFP4PackedCompressor

    from quantspec.quant.artifact import load_safetensors

    stored = load_safetensors(path)
    state = {k.removeprefix(name + "."): v for k, v in stored.items() if k.startswith(name + ".")}
    w = scheme.weights
    compressor = NVFP4PackedCompressor if w.strategy != "group" else \
        MXFP4PackedCompressor if w.num_bits == 4 else MXFP8QuantizationCompressor
    return compressor.decompress(state, scheme)["weight"]


def _args(**kw):
    return ct_q.QuantizationArgs(**kw)


def _preset(name: str):
    from compressed_tensors.quantization.quant_scheme import preset_name_to_scheme

    return preset_name_to_scheme(name, ["Linear"])


def _scheme(weights: dict, acts: dict | None = None):
    return ct_q.QuantizationScheme(targets=["Linear"], weights=_args(**weights),
                                   input_activations=None if acts is None else _args(**acts))


INT8_CHANNEL = dict(num_bits=8, type="int", strategy="channel")
FP8 = dict(num_bits=8, type="float")
INT8_STATIC = dict(num_bits=8, type="int", strategy="tensor", dynamic=False)
FP8_STATIC = dict(FP8, strategy="tensor", dynamic=False)
FP8_DYNAMIC = dict(FP8, strategy="token", dynamic=True)

SCHEMES = {  # name → (scheme, kv_cache_scheme)
    "w8a8_int8_dynamic_token": (lambda: _preset("W8A8"), None),
    "w8a8_int8_static_tensor": (lambda: _scheme(INT8_CHANNEL, INT8_STATIC), None),
    "fp8_static_tensor_weights": (lambda: _preset("FP8"), None),
    "fp8_static_channel_weights": (lambda: _scheme(dict(FP8, strategy="channel"), FP8_STATIC), None),
    "fp8_dynamic_channel_weights": (lambda: _preset("FP8_DYNAMIC"), None),
    "fp8_dynamic_tensor_weights": (lambda: _scheme(dict(FP8, strategy="tensor"), FP8_DYNAMIC), None),
    "fp8_block": (lambda: _preset("FP8_BLOCK"), None),  # 128 × 128: k/v's rows end mid-block
    "fp8_block_64": (lambda: _scheme(dict(FP8, strategy="block", block_structure=[64, 64]),
                                     dict(FP8, strategy="group", group_size=64, dynamic=True)), None),
    "w4a16_g32": (lambda: _scheme(dict(num_bits=4, strategy="group", group_size=32)), None),
    "w4a16_g64": (lambda: _scheme(dict(num_bits=4, strategy="group", group_size=64)), None),
    "w4a16_g128": (lambda: _preset("W4A16"), None),
    "w4a16_channel": (lambda: _scheme(dict(num_bits=4, strategy="channel")), None),
    "fp8_kv_per_tensor": (lambda: _preset("FP8"), lambda: _args(**FP8, strategy="tensor")),
    "fp8_kv_per_head": (lambda: _preset("FP8_DYNAMIC"), lambda: _args(**FP8, strategy="attn_head")),
    "nvfp4a16": (lambda: _preset("NVFP4A16"), None),
    "nvfp4": (lambda: _preset("NVFP4"), None),
    "mxfp4a16": (lambda: _preset("MXFP4A16"), None),
    "mxfp4": (lambda: _preset("MXFP4"), None),
    "mxfp4xfp8": (lambda: _preset("MXFP4XFP8"), None),  # MXFP4 weights, FP8 inputs per group of 128
    "mxfp8a16": (lambda: _preset("MXFP8A16"), None),
    "mxfp8": (lambda: _preset("MXFP8"), None),
    # int4 weights with 8-bit inputs per token (stored int-quantized: one code an int8)
    "w4a8": (lambda: _preset("W4A8"), None),
    "w4afp8": (lambda: _preset("W4AFP8"), None),
    "w4a8_g32_asym": (lambda: _scheme(dict(num_bits=4, strategy="group", group_size=32, symmetric=False),
                                      dict(num_bits=8, type="int", strategy="token", dynamic=True)), None),
}


@pytest.mark.parametrize("name,weights,reload", [
    ("w4a16_sym", dict(num_bits=4, symmetric=True, strategy="group", group_size=32), True),
    ("w4a16_asym", dict(num_bits=4, symmetric=False, strategy="group", group_size=32), False),
    ("w8a16", dict(num_bits=8, symmetric=True, strategy="channel"), True),
])
def test_we_load_compressed_tensors_checkpoint(tiny_llama_dir, tmp_path, name, weights, reload):
    out = tmp_path / name
    model = write_with_compressed_tensors(tiny_llama_dir, out, _scheme(dict(type="int", **weights)))
    if reload:
        theirs = hf_logits(out)
    else:
        with torch.no_grad():
            theirs = model(IDS).logits[0]
    lm = load_for_inference(out)
    assert lm.tokenizer is not None
    qmods = [m for m in lm.model.modules() if isinstance(m, QuantLinear)]
    assert len(qmods) == 4 * lm.args.num_layers  # q/k/v and gate/up fused (infer/fuse.py)
    assert all(m.weight_args.num_bits == weights["num_bits"] for m in qmods)
    torch.testing.assert_close(logits(lm.model, IDS), theirs, **TOL)
    # and the bf16 packed CPU path runs it close to the fp32 numbers
    lm16 = load_for_inference(out, dtype=torch.bfloat16, tokenizer=False)
    step = logits(lm16.model, IDS[:, :1])
    assert (step - theirs[:1]).abs().max() < 0.05 * theirs[:1].abs().max()


@pytest.mark.parametrize("name", list(SCHEMES))
def test_we_run_compressed_tensors_scheme(tiny_llama_128, tmp_path, name):
    from compressed_tensors.quantization.lifecycle import disable_quantization

    scheme, kv = (f() if f is not None else None for f in SCHEMES[name])
    model = write_with_compressed_tensors(tiny_llama_128, tmp_path / name, scheme, kv)
    # FP4 and MXFP8 (microscaled): decompressed to bf16 only
    fp4 = scheme.weights.type == "float" and (scheme.weights.num_bits == 4 or scheme.weights.group_size == 32)
    # (MXFP4 weights beside FP8 inputs per group: the fake-quantized forward's layers, in fp32)
    seen = _layer_io(model) if name.startswith("w4a8") else model.fake_quantized_io if name == "mxfp4xfp8" else None
    if fp4:  # decompressed to bf16 only: its fp32 numbers are its forward before compression
        theirs = model.fake_quantized_logits
    else:
        with torch.no_grad():
            theirs = model(IDS).logits[0]  # [T, V]: decompresses, fake-quantizes activations and K/V
    lm = load_for_inference(tmp_path / name, tokenizer=False, fuse=False)
    assert lm.kv_cache_dtype == (None if kv is None else "fp8")
    linears = {n: m for n, m in lm.model.named_modules() if isinstance(m, QuantLinear)}
    if seen is None:
        torch.testing.assert_close(paged_logits(lm), theirs, **TOL)
    else:  # int4 / FP4 kernels beside 8-bit inputs per token / group: layer by layer (`_layer_io`)
        assert sorted(seen) == sorted(linears)
        for n, (x, y) in seen.items():
            torch.testing.assert_close(linears[n](x), y, rtol=1e-5, atol=1e-6)
    assert len(linears) == 7 * lm.args.num_layers
    for n, ql in linears.items():
        want = model.get_submodule(n).weight.data if not fp4 else _ct_decompressed(tmp_path / name, n, scheme)
        assert torch.equal(ql.dequantized_weight(want.dtype), want), n
    if kv is not None:  # teeth: quantspec's float KV cache is far from it
        assert (logits(lm.model, IDS) - theirs).abs().max() > 1e-3
    if fp4 and scheme.input_activations is not None:  # teeth: the same weights with float inputs
        for ql in linears.values():
            ql.input_args = None
        assert (logits(lm.model, IDS) - theirs).abs().max() > 1e-3
    elif scheme.input_activations is not None or kv is not None:
        model.apply(disable_quantization)  # the same weights, float activations and K / V
        with torch.no_grad():
            floats = (model(IDS).logits[0] - theirs).abs().max()
        assert floats > 1e-3
        if seen is not None:  # end to end, much closer to transformers than float inputs are
            assert (paged_logits(lm) - theirs).abs().max() < 0.5 * floats


def _layer_io(model) -> dict:
    """{Linear name: (its input, its output)} of `model`'s next forward, filled by hooks. Where
    int4 weights meet int8 / FP8 inputs quantized per token, or MXFP4 weights FP8 inputs per group,
    the layers are compared, not the logits: quantspec's int4 / FP4 kernels sum in another order
    than the dequantized matmul, and one input code rounded the other way downstream (on some CPUs,
    not others) moves a whole run's logits by ~1e-2."""
    seen = {}
    for n, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear) and n != "lm_head":
            mod.register_forward_hook(lambda m, a, o, n=n: seen.__setitem__(n, (a[0][0].detach(), o[0].detach())))
    return seen


@pytest.mark.parametrize("preset,named", [
    ("W3A16", "3-bit"),
    ("MXFP6A16", "mxfp6-pack-quantized"),
])
def test_scheme_we_do_not_run_is_one_line(tiny_llama_128, tmp_path, preset, named):
    """compressed-tensors' checkpoint of a scheme quantspec does not run (scales filled with a
    constant: the refusal comes from the config, before any number is read)."""
    from compressed_tensors.compressors import ModelCompressor
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama_128), dtype=torch.float32)
    ct_q.apply_quantization_config(model, ct_q.QuantizationConfig(
        config_groups={"group_0": _preset(preset)}, ignore=["lm_head"]))
    for n, p in model.named_parameters():
        if n.endswith("_scale"):
            p.data.fill_(0.01 if p.dtype.is_floating_point else 1)
        elif n.endswith("_zero_point"):
            p.data.zero_()
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.save_pretrained(str(tmp_path / preset))
    compressor.update_config(str(tmp_path / preset))
    with pytest.raises(QuantSpecError) as e:
        load_for_inference(tmp_path / preset, tokenizer=False)
    assert named in str(e.value) and "\n" not in str(e.value)
