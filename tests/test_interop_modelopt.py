"""NVFP4 and FP8 checkpoints in NVIDIA ModelOpt's own format (`quant.modelopt`), FP8 ones in AMD
Quark's (`quant.quark`) and FBGEMM's (`quant.fbgemm`); the FP8 ones renamed from compressed-tensors'
own checkpoints of the same scheme, which they must run as. The NVFP4 ones are written here with plain
torch from a quantspec NVFP4 artifact by compressed-tensors' conversion rules read backwards
(`weight_packed` → `weight`, the global scales → their reciprocals `weight_scale_2` /
`input_scale`, `self_attn.k_scale` → `self_attn.k_proj.k_scale`): config.json's
`quant_method: "modelopt"` block and the older `hf_quant_config.json`. quantspec runs them with
the artifact's numbers and honours `exclude_modules` wildcards (`quantize` reads them as the float
checkpoint they decompress to: tests/test_quantize_from_quantized.py)."""

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from quantspec import api
from quantspec.errors import QuantSpecError
from quantspec.infer.loader import load_for_inference
from quantspec.infer.quant_linear import QuantLinear
from quantspec.quant.artifact import load_safetensors

_spec = importlib.util.spec_from_file_location(
    "quantspec_test_interop_helpers_mo", Path(__file__).parent / "test_interop_transformers.py")
_helpers = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_helpers)
FLOAT = "model.layers.1.mlp.down_proj"  # left float: a ModelOpt wildcard names it


def _to_modelopt(art: Path, out: Path, sidecar: bool) -> None:
    shutil.copytree(art, out)
    (out / "quantspec.json").unlink()
    t = load_safetensors(art)
    mo = {}
    for k, v in t.items():
        module, _, leaf = k.rpartition(".")
        if leaf == "weight_packed":
            mo[f"{module}.weight"] = v
        elif leaf in ("weight_global_scale", "input_global_scale"):
            mo[f"{module}.{'weight_scale_2' if leaf.startswith('weight') else 'input_scale'}"] = (1.0 / v).reshape(())
        elif leaf in ("k_scale", "v_scale"):
            mo[f"{module}.{leaf[0]}_proj.{leaf}"] = v.float().reshape(())
        else:
            mo[k] = v
    (out / "model.safetensors").unlink()
    save_file(mo, str(out / "model.safetensors"))
    cfg = json.loads((out / "config.json").read_text())
    del cfg["quantization_config"]
    exclude = ["lm_head", "model.layers.1.mlp.down*"]
    if sidecar:
        (out / "hf_quant_config.json").write_text(json.dumps({
            "producer": {"name": "modelopt", "version": "0.29.0"},
            "quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": "FP8", "group_size": 16,
                             "exclude_modules": exclude}}))
    else:
        cfg["quantization_config"] = {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16,
                                      "ignore": exclude, "kv_cache_scheme": {"num_bits": 8, "type": "float",
                                                                            "dynamic": False}}
    (out / "config.json").write_text(json.dumps(cfg))


@pytest.fixture(scope="module")
def nvfp4_artifact(tiny_llama_dir, calibration_table, tmp_path_factory) -> Path:
    return api.quantize(str(tiny_llama_dir), "nvfp4", tmp_path_factory.mktemp("mo") / "nvfp4",
                        calib=str(calibration_table(tiny_llama_dir)), kv_cache="fp8", ignore=(FLOAT,))


def _logits(path: Path):
    """(logits of one prefill through the paged cache running the checkpoint's FP8 KV cache, the model)."""
    lm = load_for_inference(path, tokenizer=False)
    return _helpers._paged_logits(lm), lm


@pytest.mark.parametrize("sidecar", [False, True])
def test_we_run_modelopt_nvfp4(nvfp4_artifact, tmp_path, sidecar):
    out = tmp_path / "modelopt"
    _to_modelopt(nvfp4_artifact, out, sidecar)
    ours, lm_art = _logits(nvfp4_artifact)
    theirs, lm = _logits(out)
    assert lm.kv_cache_dtype == lm_art.kv_cache_dtype == "fp8"
    assert torch.allclose(lm.k_scale, lm_art.k_scale) and torch.allclose(lm.v_scale, lm_art.v_scale)
    layers = {n: m for n, m in lm.model.named_modules() if isinstance(m, QuantLinear)}
    assert layers and all(m.weight_args.is_fp4 and m.input_args.is_fp4 for m in layers.values())
    assert not any(FLOAT in n for n in layers)  # the wildcard left it float
    torch.testing.assert_close(theirs, ours, rtol=1e-4, atol=1e-4)
    info = api.inspect(out)
    assert info["format"].startswith("modelopt NVFP4") and info["quant_type"] == "nvfp4"


_ct_spec = importlib.util.spec_from_file_location(
    "quantspec_test_interop_helpers_ct", Path(__file__).parent / "test_interop_compressed_tensors.py")
_ct = importlib.util.module_from_spec(_ct_spec)
_ct_spec.loader.exec_module(_ct)


def _fp8_to_modelopt(ct: Path, out: Path, algo: str, kv: bool) -> None:
    """compressed-tensors' FP8 checkpoint at `ct` as ModelOpt stores it: per-tensor scales as 0-d
    scalars, per-channel ones as [N], KV scales on k_proj / v_proj, the `quant_algo` block."""
    shutil.copytree(ct, out)
    mo = {}
    for k, v in load_safetensors(ct).items():
        module, _, leaf = k.rpartition(".")
        if leaf in ("k_scale", "v_scale"):
            mo[f"{module}.{leaf[0]}_proj.{leaf}"] = v.float().reshape(())
        elif leaf in ("weight_scale", "input_scale") and algo == "FP8":
            mo[k] = v.reshape(())
        elif leaf == "weight_scale" and algo == "FP8_PER_CHANNEL_PER_TOKEN":
            mo[k] = v.reshape(-1)
        else:
            mo[k] = v
    for f in out.glob("*.safetensors"):
        f.unlink()
    save_file(mo, str(out / "model.safetensors"))
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "modelopt", "quant_algo": algo, "ignore": ["lm_head"],
                                  **({"kv_cache_scheme": {"num_bits": 8, "type": "float", "dynamic": False}}
                                     if kv else {})}
    (out / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("algo, preset, kv", [
    ("FP8", "FP8", True),
    ("FP8_PER_CHANNEL_PER_TOKEN", "FP8_DYNAMIC", False),
    ("FP8_PB_WO", "FP8_BLOCK", False),
])
def test_we_run_modelopt_fp8(tmp_path, algo, preset, kv):
    """ModelOpt's FP8 checkpoints (the `nvidia/*-FP8` releases' "FP8": static per-tensor inputs and
    an FP8 KV cache; per-channel weights with inputs per token; 128 × 128 weight blocks) run with
    the numbers of compressed-tensors' own checkpoint of the same scheme, which they are renamed from."""
    from quantspec.model_zoo.tiny import build_tiny_model

    src = build_tiny_model(tmp_path / "src", "llama", hidden=128, intermediate=256)
    kv_scheme = _ct._args(**_ct.FP8, strategy="tensor") if kv else None
    _ct.write_with_compressed_tensors(src, tmp_path / "ct", _ct._preset(preset), kv_scheme)
    _fp8_to_modelopt(tmp_path / "ct", tmp_path / "mo", algo, kv)
    (ours, lm_ct), (theirs, lm) = _logits(tmp_path / "ct"), _logits(tmp_path / "mo")
    assert lm.kv_cache_dtype == lm_ct.kv_cache_dtype == ("fp8" if kv else None)
    layers = {n: m for n, m in lm.model.named_modules() if isinstance(m, QuantLinear)}
    assert sorted(layers) == sorted(n for n, m in lm_ct.model.named_modules() if isinstance(m, QuantLinear))
    assert all(m.weight_args == lm_ct.quant_config.scheme_for(n).weights for n, m in layers.items())
    assert torch.equal(theirs, ours)
    assert (theirs - _logits(src)[0]).abs().max() > 1e-3  # teeth: the float model's differ
    info = api.inspect(tmp_path / "mo")
    assert info["format"].startswith("modelopt") and info["quant_type"] == "a8w8_fp8"


def _fp8_to_quark(ct: Path, out: Path, dynamic: bool) -> None:
    """compressed-tensors' FP8 checkpoint at `ct` as AMD Quark exports it: scales per tensor as
    scalars, KV scales as k_proj / v_proj `output_scale`, its config's global and per-layer blocks."""
    shutil.copytree(ct, out)
    q, kv = {}, False
    for k, v in load_safetensors(ct).items():
        module, _, leaf = k.rpartition(".")
        if leaf in ("k_scale", "v_scale"):
            q[f"{module}.{leaf[0]}_proj.output_scale"], kv = v.float().reshape(()), True
        else:
            # per tensor: a scalar; per channel: [N] (vLLM's Quark scheme's parameter)
            q[k] = v.reshape(() if v.numel() == 1 else -1) if leaf in ("weight_scale", "input_scale") else v
    for f in out.glob("*.safetensors"):
        f.unlink()
    save_file(q, str(out / "model.safetensors"))
    fp8 = {"dtype": "fp8_e4m3", "is_dynamic": False, "symmetric": True, "ch_axis": None, "group_size": None,
           "round_method": "half_even", "scale_type": "float", "observer_cls": "PerTensorMinMaxObserver"}
    weight = {**fp8, "qscheme": "per_channel" if dynamic else "per_tensor"}
    inputs = {**fp8, "qscheme": "per_channel", "is_dynamic": True} if dynamic else {**fp8, "qscheme": "per_tensor"}
    layer = {"weight": weight, "input_tensors": inputs, "output_tensors": {**fp8, "qscheme": "per_tensor"}, "bias": None}
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"] = {
        "quant_method": "quark", "exclude": ["lm_head"], "algo_config": None, "quant_mode": "eager_mode",
        "global_quant_config": {"weight": weight, "input_tensors": inputs, "output_tensors": None, "bias": None},
        "layer_quant_config": {"*k_proj": layer, "*v_proj": layer} if kv else {}, "layer_type_quant_config": {},
        "export": {"kv_cache_group": ["*k_proj", "*v_proj"] if kv else [], "pack_method": "reorder",
                   "weight_format": "real_quantized", "min_kv_scale": 0.0}}
    (out / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("preset, kv", [("FP8", True), ("FP8_DYNAMIC", False)])
def test_we_run_quark_fp8(tmp_path, preset, kv):
    """AMD Quark's FP8 exports (the `amd/*-FP8-KV` releases: per-tensor weights, static inputs, an
    FP8 KV cache whose scales sit on k_proj / v_proj; per-channel weights with inputs per token) run
    with the numbers of compressed-tensors' own checkpoint of the same scheme, and a Quark config
    quantspec does not read is one line."""
    from quantspec.model_zoo.tiny import build_tiny_model

    src = build_tiny_model(tmp_path / "src", "llama", hidden=128, intermediate=256)
    kv_scheme = _ct._args(**_ct.FP8, strategy="tensor") if kv else None
    _ct.write_with_compressed_tensors(src, tmp_path / "ct", _ct._preset(preset), kv_scheme)
    _fp8_to_quark(tmp_path / "ct", tmp_path / "quark", dynamic=preset == "FP8_DYNAMIC")
    (ours, lm_ct), (theirs, lm) = _logits(tmp_path / "ct"), _logits(tmp_path / "quark")
    assert lm.kv_cache_dtype == lm_ct.kv_cache_dtype == ("fp8" if kv else None)
    if kv:
        assert torch.equal(lm.k_scale, lm_ct.k_scale) and torch.equal(lm.v_scale, lm_ct.v_scale)
    assert sorted(n for n, m in lm.model.named_modules() if isinstance(m, QuantLinear)) == \
        sorted(n for n, m in lm_ct.model.named_modules() if isinstance(m, QuantLinear))
    assert torch.equal(theirs, ours)
    assert api.inspect(tmp_path / "quark")["format"].startswith("quark")
    cfg = json.loads((tmp_path / "quark" / "config.json").read_text())
    cfg["quantization_config"]["layer_type_quant_config"] = {"Linear": cfg["quantization_config"]["global_quant_config"]}
    (tmp_path / "quark" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(QuantSpecError, match="layer_type_quant_config") as e:
        load_for_inference(tmp_path / "quark", tokenizer=False)
    assert "\n" not in str(e.value)


def test_we_run_fbgemm_fp8(tmp_path):
    """FBGEMM's FP8 checkpoints (Meta's Llama-3.1-*-FP8): per-channel E4M3 weights, inputs FP8 per
    token under `activation_scale_ub`. With a bound no token reaches, the logits of
    compressed-tensors' own FP8_DYNAMIC checkpoint it is renamed from (bitwise); each Linear gives
    vLLM's `scaled_fp8_quant(scale_ub=...)` numbers (the token's maximum taken as at most the bound,
    the values beyond it saturating), written out here with torch; a bound tokens reach moves the
    logits; `modules_to_not_convert` stay float."""
    from quantspec.model_zoo.tiny import build_tiny_model
    from quantspec.quant.fbgemm import config_from_fbgemm

    src = build_tiny_model(tmp_path / "src", "llama", hidden=128, intermediate=256)
    _ct.write_with_compressed_tensors(src, tmp_path / "ct", _ct._preset("FP8_DYNAMIC"))

    def fbgemm(out: Path, bound: float) -> Path:
        shutil.copytree(tmp_path / "ct", out, dirs_exist_ok=True)
        tensors = load_safetensors(tmp_path / "ct")
        tensors.update({k.replace(".weight_scale", ".input_scale_ub"): torch.tensor(bound)
                        for k in list(tensors) if k.endswith(".weight_scale")})  # some exports store it
        for f in out.glob("*.safetensors"):
            f.unlink()
        save_file(tensors, str(out / "model.safetensors"))
        cfg = json.loads((out / "config.json").read_text())
        cfg["quantization_config"] = {"quant_method": "fbgemm_fp8", "activation_scale_ub": bound,
                                      "modules_to_not_convert": []}
        (out / "config.json").write_text(json.dumps(cfg))
        return out

    (ours, _), (wide, lm) = _logits(tmp_path / "ct"), _logits(fbgemm(tmp_path / "wide", 1200.0))
    assert torch.equal(wide, ours)
    assert api.inspect(tmp_path / "wide")["format"].startswith("fbgemm_fp8")
    narrow, lm = _logits(fbgemm(tmp_path / "narrow", 0.05))
    assert (narrow - ours).abs().max() > 1e-3
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(0))
    x[:, 7] *= 40  # outliers beyond the bound
    for name, m in lm.model.named_modules():
        if isinstance(m, QuantLinear) and m.in_features == 128:
            s = x.abs().amax(-1, keepdim=True).clamp(max=0.05) / 448.0
            q = (x / s).clamp(-448, 448).to(torch.float8_e4m3fn).float()
            torch.testing.assert_close(m(x), (q * s) @ m.dequantized_weight(torch.float32).t(), rtol=1e-5, atol=1e-5)
    assert config_from_fbgemm({"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0,
                               "modules_to_not_convert": ["model.layers.0.mlp.down_proj"]}
                              ).scheme_for("model.layers.0.mlp.down_proj") is None


def test_we_run_modelopt_mixed_precision(tiny_llama_dir, tmp_path):
    """quant_algo MIXED_PRECISION: each module its own algo (`quantized_layers`: NVFP4 weights in the
    MLPs, FP8 per channel with inputs per token in the attention, one MLP left out and so float),
    run with the numbers of the quantspec artifact it is renamed from."""
    art = api.quantize(str(tiny_llama_dir), "weight_only_nvfp4", tmp_path / "art", target="quantspec",
                       layer_quant_types=("re:.*self_attn.*=a8w8_fp8",), ignore=(FLOAT,))
    shutil.copytree(art, tmp_path / "mo")
    tensors, mo, layers = load_safetensors(art), {}, {}
    for k, v in tensors.items():
        module, _, leaf = k.rpartition(".")
        if leaf == "weight_packed":
            mo[f"{module}.weight"], layers[module] = v, {"quant_algo": "W4A16_NVFP4", "group_size": 16}
        elif leaf == "weight_global_scale":
            mo[f"{module}.weight_scale_2"] = (1.0 / v).reshape(())
        elif leaf == "weight_scale" and v.dtype != torch.float8_e4m3fn:  # FP8 per channel: [N]
            mo[k], layers[module] = v.reshape(-1), {"quant_algo": "FP8_PER_CHANNEL_PER_TOKEN"}
        else:
            mo[k] = v
    (tmp_path / "mo" / "model.safetensors").unlink()
    save_file(mo, str(tmp_path / "mo" / "model.safetensors"))
    cfg = json.loads((tmp_path / "mo" / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "modelopt", "quant_algo": "MIXED_PRECISION",
                                  "quantized_layers": layers}
    (tmp_path / "mo" / "config.json").write_text(json.dumps(cfg))
    (ours, lm_art), (theirs, lm) = _logits(art), _logits(tmp_path / "mo")
    kinds = {n: (m.weight_args.type, m.weight_args.num_bits) for n, m in lm.model.named_modules()
             if isinstance(m, QuantLinear)}
    assert kinds == {n: (m.weight_args.type, m.weight_args.num_bits) for n, m in lm_art.model.named_modules()
                     if isinstance(m, QuantLinear)}
    assert {k for k in kinds.values()} == {("float", 4), ("float", 8)} and not any(FLOAT in n for n in kinds)
    assert torch.equal(theirs, ours)


def test_modelopt_algorithms_quantspec_does_not_run_are_one_line(nvfp4_artifact, tmp_path):
    out = tmp_path / "modelopt"
    _to_modelopt(nvfp4_artifact, out, sidecar=False)
    cfg = json.loads((out / "config.json").read_text())
    for algo, named in (("W4A8_AWQ", "quant_algo 'W4A8_AWQ'"), ("MIXED_PRECISION", "needs quantized_layers")):
        cfg["quantization_config"]["quant_algo"] = algo
        (out / "config.json").write_text(json.dumps(cfg))
        with pytest.raises(QuantSpecError, match=named) as e:
            load_for_inference(out, tokenizer=False)
        assert "\n" not in str(e.value)
