"""quant.args, quant.scheme, quant.config, quant.presets: validation, compressed-tensors JSON both ways, presets, target matching."""

import json

import pytest
import torch

from quantspec.errors import QuantSpecError
from quantspec.quant import (QuantArgs, QuantConfig, QuantType, preset,
                             resolve_group_size)

ctq = pytest.importorskip("compressed_tensors.quantization")
from compressed_tensors.utils.match import match_targets  # noqa: E402


def _ct_dump(preset_name, **kw):
    cfg = ctq.QuantizationConfig(
        config_groups={"group_0": ctq.preset_name_to_scheme(preset_name, ["Linear"])},
        ignore=["lm_head"], quantization_status="compressed", **kw)
    return json.loads(json.dumps(cfg.model_dump(), default=str))


@pytest.mark.parametrize("name,fmt,qt", [
    ("W8A16", "pack-quantized", QuantType.WEIGHT_ONLY_INT8),
    ("W4A16", "pack-quantized", QuantType.WEIGHT_ONLY_INT4),
    ("W4A16_ASYM", "pack-quantized", QuantType.WEIGHT_ONLY_INT4),
    ("W8A8", "int-quantized", QuantType.A8W8),
    ("FP8", "float-quantized", QuantType.A8W8_FP8),
    ("W4A8", "int-quantized", QuantType.A8W4),
    ("W4AFP8", "int-quantized", QuantType.A8W4_FP8),
    ("FP8_BLOCK", "float-quantized", QuantType.A8W8_FP8),
    ("NVFP4A16", "nvfp4-pack-quantized", QuantType.WEIGHT_ONLY_NVFP4),
    ("NVFP4", "nvfp4-pack-quantized", QuantType.NVFP4),
    ("MXFP4A16", "mxfp4-pack-quantized", QuantType.WEIGHT_ONLY_MXFP4),
    ("MXFP4", "mxfp4-pack-quantized", QuantType.MXFP4),
    ("MXFP4XFP8", "mxfp4-pack-quantized", QuantType.A8W4_MXFP4),
])
def test_reads_compressed_tensors_presets(name, fmt, qt):
    d = _ct_dump(name, format=fmt)
    cfg = QuantConfig.from_dict(d)
    assert cfg.quant_type is qt and cfg.format == fmt and cfg.ignore == ("lm_head",)
    ct_w = ctq.preset_name_to_scheme(name, ["Linear"]).weights
    w = cfg.config_groups["group_0"].weights
    assert (w.num_bits, w.type, w.symmetric, w.strategy, w.group_size) == (
        ct_w.num_bits, ct_w.type, ct_w.symmetric, ct_w.strategy, ct_w.group_size)
    assert w.block_structure == (None if ct_w.block_structure is None else tuple(ct_w.block_structure))
    # writing it back gives compressed-tensors' JSON, with the per-group format filled in
    assert d["config_groups"]["group_0"]["format"] is None
    d["config_groups"]["group_0"]["format"] = fmt
    assert cfg.to_dict() == d


@pytest.mark.parametrize("qt", list(QuantType))
@pytest.mark.parametrize("kv", [None, "int8", "fp8"])
def test_to_dict_is_compressed_tensors_json(qt, kv):
    ours = preset(qt, group_size=64, kv_cache=kv).to_dict()
    theirs = ctq.QuantizationConfig.model_validate(ours)  # pydantic validation, extra="forbid"
    assert json.loads(json.dumps(theirs.model_dump(), default=str)) == ours
    assert ours["quant_method"] == "compressed-tensors"
    assert ours["quantization_status"] == "compressed"
    # integer weight-only schemes are pack-quantized at 8 bits too (compressed-tensors' W8A16), and
    # int4 weights with 8-bit inputs too (vLLM's W4A8 schemes read `weight_packed`)
    want_fmt = {"weight_only_int8": "pack-quantized", "weight_only_int4": "pack-quantized",
                "a8w8": "int-quantized", "a8w8_fp8": "float-quantized", "weight_only_fp8": "float-quantized",
                "a8w4": "pack-quantized", "a8w4_fp8": "pack-quantized",
                "weight_only_nvfp4": "nvfp4-pack-quantized", "nvfp4": "nvfp4-pack-quantized",
                "weight_only_mxfp4": "mxfp4-pack-quantized", "mxfp4": "mxfp4-pack-quantized",
                "a8w4_mxfp4": "mxfp4-pack-quantized",
                "weight_only_mxfp8": "mxfp8-quantized", "mxfp8": "mxfp8-quantized"}[qt.value]
    assert ours["format"] == want_fmt and ours["config_groups"]["group_0"]["format"] == want_fmt
    assert QuantConfig.from_dict(ours).to_dict() == ours


def test_preset_contents():
    w4 = preset("weight_only_int4", group_size=64, symmetric=False).config_groups["group_0"]
    # int4 weights default to the MSE range search (recorded as compressed-tensors' `observer`)
    assert w4.weights == QuantArgs(num_bits=4, symmetric=False, strategy="group", group_size=64,
                                   observer="mse")
    plain = preset("weight_only_int4", group_size=64, weight_observer="minmax")
    assert plain.config_groups["group_0"].weights.observer is None
    assert preset("weight_only_int8").config_groups["group_0"].weights.observer is None
    with pytest.raises(QuantSpecError, match="unknown --weight-observer"):
        preset("weight_only_int8", weight_observer="median")
    a8 = preset("a8w8").config_groups["group_0"]
    assert a8.weights.strategy == "channel" and a8.input_activations.strategy == "tensor"
    assert a8.input_activations.dynamic is False
    kv = preset("a8w8_fp8", kv_cache="fp8").kv_cache_scheme
    assert (kv.type, kv.strategy, kv.num_bits) == ("float", "attn_head", 8)


@pytest.mark.parametrize("kw,field", [
    (dict(strategy="group"), "group_size"),
    (dict(type="float", num_bits=6), "num_bits"),
    (dict(type="float", num_bits=4), "tensor_group"),
    (dict(type="float", num_bits=4, strategy="group", group_size=32), "MXFP4"),
    (dict(type="float", num_bits=4, strategy="group", group_size=16, scale_dtype="uint8"), "group_size 32"),
    (dict(type="float", num_bits=4, strategy="tensor_group", group_size=32), "group_size 16"),
    (dict(num_bits=4, strategy="tensor_group", group_size=16), "NVFP4"),
    (dict(type="float", num_bits=4, strategy="tensor_group", group_size=16, scale_dtype="uint8"), "scale_dtype"),
    (dict(strategy="group", group_size=16, dynamic="local"), "tensor_group"),
    (dict(num_bits=4, group_size=64, strategy="channel"), "group_size"),
    (dict(type="fp4"), "type"),
    (dict(strategy="token"), "dynamic"),
    (dict(strategy="block"), "block_structure"),
    (dict(strategy="channel", block_structure=(64, 64)), "block_structure"),
    (dict(type="float", strategy="block", block_structure=(0, 64)), "block_structure"),
    (dict(group_size=0), "group_size"),
])
def test_illegal_args_name_the_field(kw, field):
    with pytest.raises(QuantSpecError, match=field):
        QuantArgs(**kw)


@pytest.mark.parametrize("qt,ct_name", [("nvfp4", "NVFP4"), ("weight_only_nvfp4", "NVFP4A16"),
                                        ("mxfp4", "MXFP4"), ("weight_only_mxfp4", "MXFP4A16"),
                                        ("a8w4_mxfp4", "MXFP4XFP8"),
                                        ("mxfp8", "MXFP8"), ("weight_only_mxfp8", "MXFP8A16")])
def test_microscaled_presets_are_compressed_tensors_own(qt, ct_name):
    """quantspec's FP4 and MXFP8 types write compressed-tensors' own NVFP4 / NVFP4A16 / MXFP4 /
    MXFP4A16 / MXFP4XFP8 / MXFP8 / MXFP8A16 schemes, and read the JSON llm-compressor writes for
    them; MXFP4 weights with other inputs (int8 per token, static FP8) and MXFP6 are refused in one
    line."""
    ours = preset(qt).config_groups["group_0"]
    theirs = ctq.preset_name_to_scheme(ct_name, ["Linear"])
    for field in ("weights", "input_activations"):
        a, b = getattr(ours, field), getattr(theirs, field)
        assert (a is None) == (b is None)
        if a is not None:
            # (the JSON: compressed-tensors leaves zp_dtype out of it, and MXFP4's default differs from its preset's)
            assert ctq.QuantizationArgs.model_validate(a.to_dict()).model_dump() == b.model_dump()
            assert QuantArgs.from_dict(json.loads(json.dumps(b.model_dump(), default=str))) == a
    assert ours.format == ("mxfp8-quantized" if "MXFP8" in ct_name else f"{ct_name[:5].lower()}-pack-quantized")
    for other in (QuantArgs(num_bits=8, strategy="token", dynamic=True),
                  QuantArgs(num_bits=8, type="float", strategy="tensor", dynamic=False)):
        d = _ct_dump("MXFP4XFP8", format="mxfp4-pack-quantized")
        d["config_groups"]["group_0"]["input_activations"] = other.to_dict()
        with pytest.raises(QuantSpecError, match="inputs go with weights of their kind"):
            QuantConfig.from_dict(d)
    with pytest.raises(QuantSpecError, match="MXFP6"):
        QuantConfig.from_dict(_ct_dump("MXFP6A16", format="mixed-precision"))


def test_from_dict_rejects_unknown_and_unsupported():
    d = _ct_dump("W4A16", format="pack-quantized")
    d["config_groups"]["group_0"]["weights"]["bogus"] = 1
    with pytest.raises(QuantSpecError, match="bogus"):
        QuantConfig.from_dict(d)
    for fmt in ("marlin-24", "mxfp6-pack-quantized", "sparse-24-bitmask"):
        with pytest.raises(QuantSpecError, match=f"format '{fmt}' is unsupported"):
            QuantConfig.from_dict(_ct_dump("W4A16", format=fmt))
    with pytest.raises(QuantSpecError, match="quant_method"):
        QuantConfig.from_dict({"quant_method": "gptq", "config_groups": {}})
    d = _ct_dump("FP8_BLOCK", format="float-quantized")
    d["config_groups"]["group_0"]["weights"]["block_structure"] = [128]
    with pytest.raises(QuantSpecError, match=r"block_structure \[rows, columns\]"):
        QuantConfig.from_dict(d)


@pytest.mark.parametrize("K,req,want", [(576, 128, 64), (1536, 128, 128), (576, 64, 64),
                                        (576, 32, 32), (100, 128, -1), (48, 128, 16),
                                        (4096, 256, 256), (576, -1, -1), (576, 100, 64)])
def test_resolve_group_size(K, req, want):
    assert resolve_group_size(K, req) == want


def test_resolve_group_size_rejects_tiny():
    with pytest.raises(QuantSpecError, match="too small"):
        resolve_group_size(576, 8)


def _ct_scheme_for(cfg_dict, name, module):
    """compressed-tensors' own choice (apply_quantization_config's matching), as a group name."""
    cfg = ctq.QuantizationConfig.model_validate(cfg_dict)
    from compressed_tensors.utils.match import is_match
    if is_match(name, module, cfg.ignore):
        return None
    target_to_group = {}
    for gname, scheme in cfg.config_groups.items():
        for t in scheme.targets:
            target_to_group[t] = gname
    matched = match_targets(name, module, target_to_group)
    return target_to_group[matched[0]] if matched else None


def test_scheme_for_matches_compressed_tensors():
    base = preset("weight_only_int4", group_size=128, ignore=("lm_head", "re:.*mlp.gate$"))
    cfg = base.with_layer_group_sizes({
        "model.layers.0.self_attn.q_proj": 64,
        "model.layers.0.mlp.down_proj": -1,
        "model.layers.1.self_attn.q_proj": 64,
        "model.layers.1.mlp.up_proj": 128,  # same as base: no override group
    })
    groups = QuantConfig.from_dict(cfg.to_dict()).config_groups
    assert len(groups) == 3
    d = cfg.to_dict()
    d["config_groups"]["group_3"] = {"targets": ["re:.*layers\\.2\\..*"], "weights":
                                     QuantArgs(num_bits=4, group_size=32).to_dict(),
                                     "input_activations": None, "output_activations": None,
                                     "format": "pack-quantized"}
    cfg = QuantConfig.from_dict(d)
    linear, emb = torch.nn.Linear(2, 2), torch.nn.Embedding(2, 2)
    names = ["model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj",
             "model.layers.0.mlp.down_proj", "model.layers.1.self_attn.q_proj",
             "model.layers.1.mlp.up_proj", "model.layers.2.self_attn.q_proj", "lm_head",
             "model.layers.3.mlp.gate"]
    for name in names:
        ours = cfg.scheme_for(name, ("Linear", "Module"))
        ours_name = None if ours is None else next(n for n, s in cfg.config_groups.items()
                                                   if s is ours)
        assert ours_name == _ct_scheme_for(d, name, linear), name
    assert cfg.scheme_for("model.embed_tokens", ("Embedding", "Module")) is None
    assert _ct_scheme_for(d, "model.embed_tokens", emb) is None
    assert cfg.weight_args_for("model.layers.0.self_attn.q_proj").group_size == 64
    assert cfg.weight_args_for("model.layers.0.mlp.down_proj").strategy == "channel"
    assert cfg.weight_args_for("model.layers.2.mlp.up_proj").group_size == 32


def test_float_zp_dtype_json_both_ways():
    cfg = preset("weight_only_int4", group_size=32, symmetric=False, zp_dtype="float16")
    w = cfg.config_groups["group_0"].weights
    assert w.zp_dtype == "float16"
    ours = cfg.to_dict()
    assert ours["config_groups"]["group_0"]["weights"]["zp_dtype"] == "torch.float16"
    theirs = ctq.QuantizationConfig.model_validate(ours)
    assert theirs.config_groups["group_0"].weights.zp_dtype == torch.float16
    assert json.loads(json.dumps(theirs.model_dump(), default=str)) == ours
    assert QuantConfig.from_dict(ours).to_dict() == ours
    # compressed-tensors' own args with a float zp_dtype read back the same, either spelling
    ct_w = ctq.QuantizationArgs(num_bits=4, symmetric=False, strategy="group", group_size=32,
                                zp_dtype=torch.bfloat16).model_dump()
    assert QuantArgs.from_dict(ct_w).zp_dtype == "bfloat16"
    assert QuantArgs.from_dict(dict(ct_w, zp_dtype="float32")).zp_dtype == "float32"
    # integer zero points stay the default: no key written, and an int zp_dtype reads as None
    assert "zp_dtype" not in preset("weight_only_int4", symmetric=False).to_dict()[
        "config_groups"]["group_0"]["weights"]
    for spelling in ("torch.int8", "int8", "torch.int32"):
        assert QuantArgs.from_dict(dict(ct_w, zp_dtype=spelling)).zp_dtype is None
    # symmetric args have no zero points: a stray zp_dtype is ignored
    assert QuantArgs.from_dict(dict(ct_w, symmetric=True, zp_dtype="torch.float16")).zp_dtype is None
    with pytest.raises(QuantSpecError, match="zp_dtype 'torch.float8_e4m3fn' is unsupported"):
        QuantArgs.from_dict(dict(ct_w, zp_dtype="torch.float8_e4m3fn"))


def test_float_zp_dtype_validation():
    a = QuantArgs(num_bits=4, symmetric=False, group_size=32, zp_dtype="torch.float16")
    assert a.zp_dtype == "float16" and QuantArgs(num_bits=4, symmetric=False,
                                                 zp_dtype=torch.float32).zp_dtype == "float32"
    with pytest.raises(QuantSpecError, match="zp_dtype 'float64' unsupported; use one of float16"):
        QuantArgs(num_bits=4, symmetric=False, zp_dtype="float64")
    with pytest.raises(QuantSpecError, match="symmetric=False"):
        QuantArgs(num_bits=4, zp_dtype="float16")
    with pytest.raises(QuantSpecError, match="asymmetric int"):
        QuantArgs(num_bits=8, type="float", zp_dtype="float16")
    with pytest.raises(QuantSpecError, match="--asym"):
        preset("weight_only_int4", zp_dtype="float16")
    with pytest.raises(QuantSpecError, match="weight_only_int4 only"):
        preset("weight_only_int8", symmetric=False, zp_dtype="float16")
    cfg = preset("weight_only_int4", group_size=128, symmetric=False, zp_dtype="float32")
    cfg = cfg.with_layer_group_sizes({"model.layers.0.self_attn.q_proj": 64})
    assert cfg.weight_args_for("model.layers.0.self_attn.q_proj").zp_dtype == "float32"


def test_weight_block_preset_is_compressed_tensors_fp8_block():
    """`preset("a8w8_fp8", weight_block=128, activations="dynamic")` is compressed-tensors'
    FP8_BLOCK scheme, JSON for JSON; other sides change the block and the input groups alike."""
    ours = preset("a8w8_fp8", activations="dynamic", weight_block=128).to_dict()
    assert ours["config_groups"]["group_0"] == _ct_dump("FP8_BLOCK", format="float-quantized")[
        "config_groups"]["group_0"] | {"format": "float-quantized"}
    g = preset("a8w8_fp8", activations="dynamic", weight_block=64).config_groups["group_0"]
    assert g.weights.block_structure == (64, 64) and g.input_activations.group_size == 64


@pytest.mark.parametrize("kw,named", [
    (dict(quant_type="weight_only_int8", weight_block=128), "--weight-block is for a8w8_fp8"),
    (dict(quant_type="a8w8_fp8", weight_block=128), "--activations dynamic"),
    (dict(quant_type="a8w8_fp8", weight_block=96, activations="dynamic"), "power of two"),
    (dict(quant_type="a8w8_fp8", weight_block=8, activations="dynamic"), "power of two"),
    (dict(quant_type="a8w8_fp8", weight_block=128, activations="dynamic", weight_observer="mse"), "minmax"),
])
def test_weight_block_refusals_name_the_flag(kw, named):
    with pytest.raises(QuantSpecError, match=named):
        preset(**kw)


@pytest.mark.parametrize("K,N,req,want", [(576, 576, 128, 64), (576, 192, 128, 64), (1536, 4096, 128, 128),
                                          (192, 96, 128, 32), (4096, 1024, 64, 64), (100, 128, 128, -1),
                                          (256, 128, (64, 128), 64)])
def test_resolve_block_size(K, N, req, want):
    from quantspec.quant.config import resolve_block_size

    assert resolve_block_size(K, N, req if isinstance(req, tuple) else (req, req)) == want


def test_block_sizes_per_layer_keep_inputs_in_step():
    """Per-layer block sizes: the base group takes the fused shards' block, others are
    name-targeted, each with its input groups at the block's width; -1 falls back to per-channel
    weights with per-token inputs."""
    base = preset("a8w8_fp8", activations="dynamic", weight_block=128)
    names = {f"model.layers.0.{n}": 32 for n in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")}
    names |= {"model.layers.0.mlp.down_proj": 64, "model.layers.0.self_attn.o_proj": -1}
    qc = base.with_group_sizes(names)
    for n, side in names.items():
        s = qc.scheme_for(n)
        if side > 0:
            assert s.weights.block_structure == (side, side) and s.input_activations.group_size == side, n
        else:
            assert s.weights.strategy == "channel" and s.input_activations.strategy == "token", n
    assert qc.config_groups["group_0"].weights.block_structure == (32, 32)
    QuantConfig.from_dict(qc.to_dict())  # valid compressed-tensors JSON, read back
    ctq.QuantizationConfig.model_validate(qc.to_dict())


def test_reads_transformers_fp8_configs():
    """`quant_method: "fp8"` configs (transformers' fine-grained FP8, vLLM's per-tensor FP8) as
    the compressed-tensors schemes they are; their skipped modules as transformers matches them."""
    from transformers.quantizers.quantizers_utils import should_convert_module

    skip = ["mlp.gate", "model.layers.1", "model.layers.2.*attn"]
    fine = QuantConfig.from_dict({"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": [128, 128], "modules_to_not_convert": skip})
    g = fine.config_groups["group_0"]
    assert g.weights.block_structure == (128, 128) and g.weights.type == "float"
    assert (g.input_activations.strategy, g.input_activations.group_size, g.input_activations.dynamic) == \
        ("group", 128, True)
    assert fine.tensor_names == {"weight_scale": "weight_scale_inv"} and fine.quant_type is QuantType.A8W8_FP8
    assert fine.scheme_for("lm_head") is None
    for i in (0, 1, 2, 11):
        for m in ("mlp.gate", "mlp.gate_proj", "mlp.up_proj", "self_attn.q_proj"):
            name = f"model.layers.{i}.{m}"
            assert (fine.scheme_for(name) is g) == should_convert_module(name, skip), name
    static = QuantConfig.from_dict({"quant_method": "fp8", "activation_scheme": "static"})
    s = static.config_groups["group_0"]
    assert (s.weights.strategy, s.input_activations.strategy, s.input_activations.dynamic) == ("tensor", "tensor", False)
    assert static.tensor_names == {}
    dynamic = QuantConfig.from_dict({"quant_method": "fp8", "activation_scheme": "dynamic"}).config_groups["group_0"]
    assert (dynamic.input_activations.strategy, dynamic.input_activations.dynamic) == ("token", True)


@pytest.mark.parametrize("cfg,named", [
    ({"fmt": "e5m2"}, "fmt 'e5m2'"),
    ({"weight_block_size": [128, 128], "activation_scheme": "static"}, "activation_scheme 'dynamic'"),
    ({"weight_block_size": [128]}, "weight_block_size"),
    ({"activation_scheme": "mixed"}, "activation_scheme 'mixed'"),
    ({"bogus": 1}, "bogus"),
])
def test_transformers_fp8_config_refusals_name_the_field(cfg, named):
    with pytest.raises(QuantSpecError, match=named) as e:
        QuantConfig.from_dict({"quant_method": "fp8", **cfg})
    assert "\n" not in str(e.value)
