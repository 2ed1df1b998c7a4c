"""Session fixtures of the conformance suite: every artifact type, written by `quantspec quantize`
(`api.quantize`) from a tiny Llama whose shapes give mixed group sizes (hidden 192: K=192 takes
g64 at --group-size 128, the MLP's K=512 takes g128), and the engines' lifted code (fetched and
cached by `engines.py`; an engine that cannot be fetched skips its cases with the reason)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from quantspec import api
from quantspec.model_zoo.tiny import build_tiny_model

from . import engines as eng

TEXT = ("The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs. "
        "How vexingly quick daft zebras jump! ") * 40

# name → (quantize options, what it stands for); target portable unless named
ARTIFACTS = {
    "weight_only_int8": dict(quant_type="weight_only_int8"),
    "weight_only_int8_asym": dict(quant_type="weight_only_int8", symmetric=False),
    "weight_only_int8_g128": dict(quant_type="weight_only_int8", group_size=128),  # llm-compressor's W8A16
    "weight_only_int4": dict(quant_type="weight_only_int4", group_size=128),
    "weight_only_int4_asym": dict(quant_type="weight_only_int4", group_size=128, symmetric=False),
    "weight_only_int4_float_zp": dict(quant_type="weight_only_int4", group_size=128, symmetric=False,
                                      zp_dtype="float16", target="quantspec"),
    "a8w8": dict(quant_type="a8w8", smoothquant_alpha="none", fallback_layers=0),
    "a8w8_fallback": dict(quant_type="a8w8", smoothquant_alpha="none", fallback_layers=1),
    "a8w8_fp8_kv_fp8": dict(quant_type="a8w8_fp8", smoothquant_alpha="none", fallback_layers=0,
                            kv_cache="fp8"),
    "a8w8_fp8_kv_fp8_head": dict(quant_type="a8w8_fp8", smoothquant_alpha="none", fallback_layers=0,
                                 kv_cache="fp8", kv_strategy="head", target="vllm"),
    "a8w8_kv_int8": dict(quant_type="a8w8", smoothquant_alpha="none", fallback_layers=0,
                         kv_cache="int8", target="quantspec"),
    # FP8 weights with one scale per Linear (`--weight-strategy tensor`, compressed-tensors' FP8 scheme), shared by a
    # fused unit's shards: static inputs and KV scales (llm-compressor's FP8 KV-cache example; the unit whose static
    # inputs cost most kept float, a per-tensor W8A16 FP8 group), per-token inputs, float inputs
    "a8w8_fp8_tensor_kv_fp8": dict(quant_type="a8w8_fp8", weight_strategy="tensor", smoothquant_alpha="none",
                                   fallback_layers=1, kv_cache="fp8"),
    "a8w8_fp8_tensor_dynamic": dict(quant_type="a8w8_fp8", weight_strategy="tensor", activations="dynamic"),
    "weight_only_fp8_tensor": dict(quant_type="weight_only_fp8", weight_strategy="tensor"),
    "a8w8_dynamic": dict(quant_type="a8w8", activations="dynamic"),
    "a8w8_fp8_dynamic": dict(quant_type="a8w8_fp8", activations="dynamic"),
    # FP8 weights with float inputs (W8A16 FP8): per channel (both engines), in blocks (vLLM only)
    "weight_only_fp8": dict(quant_type="weight_only_fp8"),
    "weight_only_fp8_block": dict(quant_type="weight_only_fp8", weight_block=128, target="vllm"),
    # int4 weights with 8-bit inputs per token at run time (W4A8 / W4AFP8): vLLM picks
    # CompressedTensorsWNA8Int / W4A8Fp8 (Hopper), SGLang has no Linear scheme for them
    "a8w4": dict(quant_type="a8w4", group_size=128, target="quantspec"),
    "a8w4_fp8": dict(quant_type="a8w4_fp8", group_size=128, target="quantspec"),
    # FP8_BLOCK at 128: shrunk per fused unit to blocks that tile it (q/k/v 32, the rest 64), so
    # a class group and a name-targeted group of other blocks, merged q/k/v block scales
    "a8w8_fp8_block": dict(quant_type="a8w8_fp8", weight_block=128),
    # NVFP4: one weight global scale per fused unit; W4A4 runs weight-only below sm_100 (Hopper)
    "weight_only_nvfp4": dict(quant_type="weight_only_nvfp4"),
    "nvfp4": dict(quant_type="nvfp4"),
    # MXFP4: E2M1 in groups of 32 with power-of-two (E8M0) scales; SGLang has no MXFP4 Linear
    # scheme, so --target vllm
    "weight_only_mxfp4": dict(quant_type="weight_only_mxfp4", target="vllm"),
    "mxfp4": dict(quant_type="mxfp4", target="vllm"),
    # MXFP4 weights with FP8 inputs per token and group (MXFP4XFP8): vLLM's W4A8Mxfp4 through Humming
    "a8w4_mxfp4": dict(quant_type="a8w4_mxfp4", target="vllm"),
    # MXFP8: E4M3 in groups of 32 with E8M0 scales (mxfp8-quantized); SGLang has no MXFP8 scheme
    "weight_only_mxfp8": dict(quant_type="weight_only_mxfp8", target="vllm"),
    "mxfp8": dict(quant_type="mxfp8", target="vllm"),
    # mixed precision (--layer-quant-type): int4 g128, int8 down_proj, NVFP4 q / k / v (config
    # format mixed-precision, a config group per type)
    "weight_only_mixed": dict(quant_type="weight_only_int4", group_size=128,
                              layer_quant_types=(r"re:.*mlp\.down_proj$=weight_only_int8",
                                                 r"re:.*self_attn\.[qkv]_proj$=weight_only_nvfp4")),
    # ... with FP8_DYNAMIC attention (inputs quantized per token at run time) beside int4 MLPs
    "mixed_fp8_dynamic": dict(quant_type="weight_only_int4", group_size=128,
                              layer_quant_types=(r"re:.*self_attn\.[qkvo]_proj$=a8w8_fp8",)),
    # a quantized output head (a `ParallelLMHead` in both engines, its scheme taken by name): int8
    # per channel beside int4 layers, and FP8 per token beside FP8_DYNAMIC layers
    "head_int8": dict(quant_type="weight_only_int4", group_size=128, layer_quant_types=("lm_head=weight_only_int8",)),
    "head_fp8_dynamic": dict(quant_type="a8w8_fp8", activations="dynamic", layer_quant_types=("lm_head=a8w8_fp8",)),
    "head_fp8_weights": dict(quant_type="weight_only_int4", group_size=128,
                             layer_quant_types=("lm_head=weight_only_fp8",)),
    # ... and with FP8 block scales, which neither engine's head loader takes
    "head_fp8_block": dict(quant_type="a8w8_fp8", weight_block=128, layer_quant_types=("lm_head=a8w8_fp8",),
                           target="quantspec"),
    # a quantized input embedding (vLLM's `CompressedTensorsEmbeddingWNA16Int`; SGLang and
    # transformers load none): int4 groups beside int4 layers, int8 rows beside an int8 head
    "embed_int4": dict(quant_type="weight_only_int4", group_size=128, target="vllm",
                       layer_quant_types=("model.embed_tokens=weight_only_int4",)),
    "embed_int8_head_int8": dict(quant_type="weight_only_int8", target="vllm",
                                 layer_quant_types=("model.embed_tokens=weight_only_int8", "lm_head=weight_only_int8")),
    # SpinQuant's R1 and R2 fused into the weights before quantizing: a transform_config whose every
    # transform is fused, which vLLM validates and runs around nothing (SGLang does not read it)
    "weight_only_int4_rotated": dict(quant_type="weight_only_int4", group_size=128, rotate="R1,R2"),
    # QuIP's run-time transforms: each Linear's weight stored turned, V on its input and U on its
    # output at run time (vLLM's transform method wraps the Linear; SGLang and transformers skip them)
    "weight_only_int4_quip": dict(quant_type="weight_only_int4", group_size=128, quip="v,u", target="vllm"),
    # SpinQuant's R4 after R1 / R2: each down_proj's input turned at run time, as QuIP's V on it alone
    "weight_only_int4_r4": dict(quant_type="weight_only_int4", group_size=128, rotate="R1,R2,R4", target="vllm"),
}
# an MTP module (quantspec's own model class) quantized on its own, as a draft is
MTP_ARTIFACT = ("mtp_module_int8", dict(quant_type="weight_only_int8", target="quantspec"))
# Medusa heads (the authors' layout) quantized on their own, as a draft is
MEDUSA_ARTIFACT = ("medusa_heads_int8", dict(quant_type="weight_only_int8", target="quantspec"))
# an EAGLE-3 head (the layout vLLM and SGLang load) quantized on its own: by default (fc float,
# per-layer group sizes at K = 192) and for vLLM alone (fc quantized too)
EAGLE3_ARTIFACTS = {"eagle3_head_int4": dict(quant_type="weight_only_int4", group_size=128),
                    "eagle3_head_fp8_dynamic": dict(quant_type="a8w8_fp8", activations="dynamic"),
                    "eagle3_head_fp8_block": dict(quant_type="a8w8_fp8", weight_block=128),
                    "eagle3_head_fp8_weights": dict(quant_type="weight_only_fp8"),
                    "eagle3_head_nvfp4a16": dict(quant_type="weight_only_nvfp4"),
                    "eagle3_head_int8_vllm": dict(quant_type="weight_only_int8", target="vllm"),
                    "eagle3_head_mxfp4a16_vllm": dict(quant_type="weight_only_mxfp4", target="vllm"),
                    # static FP8 inputs and an FP8 KV cache, from the head's own table (`calibrate --model HEAD`, written
                    # to head.calib/ by the fixture)
                    "eagle3_head_fp8_static_kv_vllm": dict(quant_type="a8w8_fp8", kv_cache="fp8", target="vllm",
                                                           calib="head.calib/"),
                    # static int8 inputs with the unit they hurt most kept float (a group named as the engines name it)
                    "eagle3_head_int8_static_fallback_vllm": dict(quant_type="a8w8", fallback_layers=1, target="vllm",
                                                                  calib="head.calib/")}
EAGLE3_AUX = (0, 1, 2)  # the conformance model has 2 layers: explicit ids
# valid compressed-tensors layouts quantspec reads but does not write, rebuilt from the artifacts
# above (see `_other_layout`): what other tools write, and what the engines mishandle
OTHER_LAYOUTS = ("w8a16_int_quantized", "w4a16_shard_named_groups", "a8w8_shard_named_fallback",
                 "fp8_block64_every_layer", "w4a8_int_quantized")


@pytest.fixture(scope="session")
def conformance_model(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("conf_llama"), "llama", hidden=192, heads=4,
                            kv_heads=2, intermediate=512)


@pytest.fixture(scope="session")
def artifacts(conformance_model, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("conf_artifacts")
    data = root / "calib.txt"
    data.write_text(TEXT)
    calib = api.calibrate(str(conformance_model), str(data), root / "calib", num_samples=4,
                          seq_len=32).path
    out = {}
    for name, opts in ARTIFACTS.items():
        opts = dict(opts)
        qt = opts.pop("quant_type")
        if (qt.startswith("a8w8") and opts.get("activations") != "dynamic" and "weight_block" not in opts) \
                or opts.get("kv_cache") or qt == "nvfp4":
            opts.update(calib=str(calib), dataset=str(data), seq_len=32, holdout_samples=2,
                        search_samples=2)
        out[name] = api.quantize(str(conformance_model), qt, root / name, **opts)
    for name in OTHER_LAYOUTS:
        out[name] = _other_layout(name, out, root / name)
    return out


@pytest.fixture(scope="session")
def mtp_source(conformance_model, tmp_path_factory) -> Path:
    """An (untrained) MTP module of the conformance model, as `zoo train-mtp` saves one."""
    from quantspec.model_zoo.checkpoint import load_model
    from quantspec.model_zoo.mtp import save_mtp
    from quantspec.model_zoo.mtp_train import init_mtp

    base, _ = load_model(conformance_model)
    out = tmp_path_factory.mktemp("conf_mtp") / "mtp"
    save_mtp(init_mtp(base, torch.arange(base.args.vocab_size), seed=0), out)
    return out


@pytest.fixture(scope="session")
def mtp_artifact(mtp_source) -> Path:
    name, opts = MTP_ARTIFACT
    opts = dict(opts)
    return api.quantize(str(mtp_source), opts.pop("quant_type"), mtp_source.parent / name, **opts)


@pytest.fixture(scope="session")
def medusa_source(conformance_model, tmp_path_factory) -> Path:
    """Medusa heads of the conformance model (two heads of one ResBlock, a draft vocabulary), as
    `zoo train-draft-head --kind medusa` saves them."""
    from quantspec.model_zoo.checkpoint import load_model
    from quantspec.model_zoo.medusa import save_medusa
    from quantspec.model_zoo.medusa_train import init_medusa

    base, _ = load_model(conformance_model)
    heads = init_medusa(base, torch.arange(0, base.args.vocab_size, 2), num_heads=2)
    return save_medusa(heads, tmp_path_factory.mktemp("conf_medusa") / "heads")


@pytest.fixture(scope="session")
def medusa_artifact(medusa_source) -> Path:
    name, opts = MEDUSA_ARTIFACT
    opts = dict(opts)
    return api.quantize(str(medusa_source), opts.pop("quant_type"), medusa_source.parent / name, **opts)


@pytest.fixture(scope="session")
def eagle3_head(conformance_model, tmp_path_factory):
    """(directory, head, the base's args): a head for the conformance model with a draft
    vocabulary of every third token, as `zoo train-draft-head --kind eagle3` saves one."""
    from quantspec.model_zoo.checkpoint import load_model
    from quantspec.model_zoo.eagle3 import save_eagle3
    from quantspec.model_zoo.eagle3_train import init_eagle3

    base = load_model(conformance_model)[0]
    head = init_eagle3(base, torch.arange(1, base.args.vocab_size, 3), EAGLE3_AUX)
    return save_eagle3(head, tmp_path_factory.mktemp("eagle3") / "head"), head, base.args


@pytest.fixture(scope="session")
def eagle3_artifacts(eagle3_head, conformance_model) -> dict[str, Path]:
    path = eagle3_head[0]
    data = path.parent / "calib.txt"
    data.write_text(TEXT)
    table = api.calibrate(str(path), str(data), path.parent / "head.calib", num_samples=4, seq_len=32,
                          base=str(conformance_model)).path  # measured on the base it drafts for
    out = {}
    for name, opts in EAGLE3_ARTIFACTS.items():
        opts = dict(opts)
        if "calib" in opts:
            opts["calib"] = str(table)
        out[name] = api.quantize(str(path), opts.pop("quant_type"), path.parent / name, **opts)
    return out


def _other_layout(name: str, arts: dict[str, Path], dst: Path) -> Path:
    """W8A16 as `int-quantized`, and W4A8 (compressed-tensors' default for its W4A8 preset: a code
    per int8); mixed int4 group sizes with exact names for every shard; an a8w8
    fallback named shard by shard as an `int-quantized` weight-only group; FP8 64 × 64 blocks on
    every layer (a tool that does not fit blocks per layer: k_proj's 96 rows end mid-block)."""
    from safetensors.torch import load_file, save_file

    from quantspec.quant.packing import unpack_int32

    src = arts[{"w8a16_int_quantized": "weight_only_int8",
                "w4a16_shard_named_groups": "weight_only_int4",
                "a8w8_shard_named_fallback": "a8w8",
                "fp8_block64_every_layer": "a8w8_fp8_block", "w4a8_int_quantized": "a8w4"}[name]]
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    qc = cfg["quantization_config"]
    t = load_file(str(dst / "model.safetensors"))
    groups = qc["config_groups"]
    if name in ("w8a16_int_quantized", "w4a8_int_quantized"):
        bits = 8 if name == "w8a16_int_quantized" else 4
        for k in [k for k in t if k.endswith(".weight_packed")]:
            p = k.rsplit(".", 1)[0]
            shape = tuple(t.pop(f"{p}.weight_shape").tolist())
            t[f"{p}.weight"] = unpack_int32(t.pop(k), bits, shape)
        for g in groups.values():
            g["format"] = "int-quantized"
        qc["format"] = "int-quantized"
    elif name == "w4a16_shard_named_groups":
        base = groups["group_0"]
        names = sorted({k.rsplit(".", 1)[0] for k in t if k.endswith(".weight_scale")})
        small = [n for n in names if not n.endswith("down_proj")]
        g64, g128 = json.loads(json.dumps(base)), base
        g64["targets"] = small
        g128["weights"]["group_size"] = 128
        qc["config_groups"] = {"group_0": g128, "group_1": g64}
    elif name == "fp8_block64_every_layer":
        _reblock(t, qc, 64)
    else:  # fall back q/k/v of layer 0, named shard by shard
        shards = [f"model.layers.0.self_attn.{s}_proj" for s in "qkv"]
        for s in shards:
            t.pop(f"{s}.input_scale")
        fb = json.loads(json.dumps(groups["group_0"]))
        fb.update(targets=shards, input_activations=None, format="int-quantized")
        groups["fallback_w8a16"] = fb
        qc["format"] = "int-quantized"
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    save_file(t, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def _reblock(t: dict, qc: dict, side: int) -> None:
    """Every FP8 block Linear of `t` re-quantized at side × side blocks under one class group."""
    from quantspec.quant.args import QuantArgs
    from quantspec.quant.config import QuantConfig
    from quantspec.quant.primitives import choose_qparams, dequantize, quantize

    config = QuantConfig.from_dict(qc)
    args = QuantArgs(type="float", strategy="block", block_structure=(side, side))
    for k in [k for k in t if k.endswith(".weight_scale")]:
        p = k.rsplit(".", 1)[0]
        w = dequantize(t[f"{p}.weight"], t[k], None, config.weight_args_for(p))
        t[k], _ = choose_qparams(w, args)
        t[f"{p}.weight"] = quantize(w, t[k], None, args)
    group = qc["config_groups"]["group_0"]
    group["weights"]["block_structure"] = [side, side]
    group["input_activations"]["group_size"] = side
    qc["config_groups"] = {"group_0": group}


@pytest.fixture(scope="session")
def engine_sources() -> dict:
    """engine → `EngineSource`, or the reason it is unavailable (a string)."""
    out = {}
    for engine in eng.ENGINE_PINS:
        try:
            out[engine] = eng.EngineSource(engine)
        except eng.Unavailable as e:
            out[engine] = f"{engine} {eng.ENGINE_PINS[engine]} unavailable here: {e}"
    return out


@pytest.fixture(scope="session")
def lifted(engine_sources, artifacts, tmp_path_factory) -> dict:
    """engine → `lift.py`'s answer for every artifact (or the skip reason)."""
    from .requests import build_request

    return eng.run_engines(engine_sources, lambda src: build_request(src, artifacts, 90),
                       tmp_path_factory.mktemp("conf_lift"))


@pytest.fixture(scope="session")
def torch_threads():
    torch.set_num_threads(2)
