"""Quantizing from a quantized checkpoint (`quant.decompressed`): `quantize` and `calibrate` read
a compressed-tensors artifact, transformers' own block-FP8 checkpoint or ModelOpt's NVFP4 as the
float checkpoint it decompresses to. The reference is independent of quantspec's reader:
compressed-tensors' own compressors (`ct_decompressed`) or the FP8 writer's own dequantized
weights, written as a float checkpoint that quantspec quantizes with the same options; both
artifacts must be the same tensors."""

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from quantspec import api
from quantspec.errors import QuantSpecError
from quantspec.model_zoo.checkpoint import CheckpointReader
from quantspec.model_zoo.tiny import TINY_CORPUS, build_tiny_model
from quantspec.quant.artifact import load_safetensors, read_provenance
from quantspec.quant.decompressed import DecompressedReader

_HERE = Path(__file__).parent


def _helpers(name: str):
    spec = importlib.util.spec_from_file_location(f"quantspec_test_helpers_{name}", _HERE / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


_transformers = _helpers("test_interop_transformers")
_modelopt = _helpers("test_interop_modelopt")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_text(TINY_CORPUS * 2)
    return path


@pytest.fixture(scope="module")
def tiny_moe_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny_moe"), "qwen3_moe", num_layers=2)


def _with_tokenizer(dense: Path, src: Path) -> Path:
    for f in _TOKENIZER_FILES:
        if (src / f).is_file():
            shutil.copy(src / f, dense / f)
    return dense


def _dense_of_hf_fp8(model: Path, fp8: Path, out: Path, dense: dict) -> Path:
    """`model`'s checkpoint with each Linear's weight replaced by the FP8 writer's dequantized one."""
    shutil.copytree(model, out)
    tensors = load_safetensors(model)
    tensors.update({f"{n}.weight": w for n, w in dense.items()})
    save_file(tensors, str(out / "model.safetensors"))
    return out


def _same_artifacts(a: Path, b: Path) -> None:
    ta, tb = load_safetensors(a), load_safetensors(b)
    assert sorted(ta) == sorted(tb)
    for k in ta:
        assert ta[k].dtype == tb[k].dtype and torch.equal(ta[k], tb[k]), k
    qa, qb = (json.loads((p / "config.json").read_text())["quantization_config"] for p in (a, b))
    assert qa == qb


@pytest.mark.parametrize("quant_type, options", [
    ("weight_only_int8", {}),
    ("weight_only_int4", {"group_size": 32, "symmetric": False}),
    ("a8w8", {}),
    ("a8w8_fp8", {"weight_block": 32}),
    ("weight_only_nvfp4", {}),
    ("weight_only_mxfp4", {"target": "vllm"}),
])
def test_reader_decompresses_as_compressed_tensors_does(tiny_llama_dir, calibration_table, tmp_path, quant_type,
                                                        options, ct_decompressed):
    """The reader shows the float checkpoint's names and shapes, and each quantized Linear's weight
    as compressed-tensors' own compressor decompresses it, bitwise."""
    calib = calibration_table(tiny_llama_dir) if quant_type == "a8w8" else None
    art = api.quantize(str(tiny_llama_dir), quant_type, tmp_path / "art", calib=calib, **options)
    dense, names = ct_decompressed(art, tmp_path / "dense")
    reader = DecompressedReader(art)
    assert reader.shapes == CheckpointReader(tiny_llama_dir).shapes
    assert set(reader.view.weights) == {f"{n}.weight" for n in names} and len(names) == 7 * 2
    ref = load_safetensors(dense)
    for n in names:
        ours = reader.read([f"{n}.weight"])[f"{n}.weight"]
        assert ours.dtype == torch.float32
        assert torch.equal(ours, ref[f"{n}.weight"]), n
    norm = "model.layers.0.input_layernorm.weight"
    assert norm in reader.ranges and torch.equal(reader.read([norm])[norm], ref[norm])  # kept as stored


def _float_reference(kind: str, model: Path, tmp_path: Path, ct_decompressed, calibration_table) -> tuple[Path, Path]:
    """(a quantized source of `kind` made from `model`, the float checkpoint it decompresses to by
    a reader other than quantspec's)."""
    if kind == "hf_fp8":
        dense = _transformers._write_hf_fp8(model, tmp_path / "src", (32, 32))
        return tmp_path / "src", _dense_of_hf_fp8(model, tmp_path / "src", tmp_path / "dense", dense)
    if kind == "modelopt":  # NVFP4 weights and inputs, an FP8 KV cache, a Linear left float by a wildcard
        art = api.quantize(str(model), "nvfp4", tmp_path / "art", calib=str(calibration_table(model)),
                           kv_cache="fp8", ignore=(_modelopt.FLOAT,))
        _modelopt._to_modelopt(art, tmp_path / "src", sidecar=False)
        return tmp_path / "src", _with_tokenizer(ct_decompressed(art, tmp_path / "dense")[0], model)
    src = api.quantize(str(model), kind, tmp_path / "src", group_size=32)
    return src, _with_tokenizer(ct_decompressed(src, tmp_path / "dense")[0], model)


@pytest.mark.parametrize("model, kind, quant_type, options", [
    ("tiny_llama_dir", "weight_only_int8", "weight_only_int4", {"method": "gptq", "group_size": 32}),
    ("tiny_llama_dir", "hf_fp8", "weight_only_int4", {"method": "awq", "group_size": 32}),
    ("tiny_llama_dir", "hf_fp8", "a8w8", {"kv_cache": "int8", "target": "quantspec"}),
    ("tiny_llama_dir", "modelopt", "weight_only_int8", {}),
    ("tiny_phi3_dir", "weight_only_int8", "weight_only_int4", {"method": "gptq", "group_size": 32}),
    ("tiny_moe_dir", "weight_only_int4", "weight_only_int8", {"method": "gptq"}),
])
def test_quantizing_a_quantized_source_equals_quantizing_its_float_checkpoint(request, tmp_path, corpus, model, kind,
                                                                              quant_type, options, ct_decompressed,
                                                                              calibration_table):
    """GPTQ, AWQ, RTN and the calibrated a8w8 recipe (its table calibrated on the quantized source)
    on an int8 / int4 artifact, a block-FP8 checkpoint in transformers' format, a ModelOpt NVFP4
    one, a fused (Phi-3) and a mixture-of-experts one: the same artifact as from the float
    checkpoint the source decompresses to, and its provenance says what the source was."""
    model = request.getfixturevalue(model)
    src, dense = _float_reference(kind, model, tmp_path, ct_decompressed, calibration_table)
    if options.get("method") in ("gptq", "awq"):
        options = {**options, "dataset": str(corpus), "num_samples": 4, "seq_len": 32}
    said = []
    made = []
    for source in (src, dense):
        calib = calibration_table(source) if quant_type == "a8w8" else None
        made.append(api.quantize(str(source), quant_type, tmp_path / f"out_{len(made)}", calib=calib,
                                 on_status=said.append, **options))
    if quant_type == "a8w8":  # the tables measured on the source and on its float checkpoint agree
        t_src, t_dense = (load_safetensors(calibration_table(s)) for s in (src, dense))
        assert sorted(t_src) == sorted(t_dense) and all(torch.equal(t_src[k], t_dense[k]) for k in t_src)
    _same_artifacts(*made)
    was = read_provenance(made[0])["provenance"]["source_quantization"]
    assert was["quant_method"] == {"hf_fp8": "fp8", "modelopt": "modelopt"}.get(kind, "compressed-tensors")
    assert was["quant_type"] == {"hf_fp8": "a8w8_fp8", "modelopt": "nvfp4"}.get(kind, kind)
    assert read_provenance(made[1])["provenance"]["source_quantization"] is None
    assert [m for m in said if "decompressing" in m] == [
        f"decompressing the checkpoint's {was['quant_type']} weights ({was['quant_method']}) a layer at a time"]


def test_requantizing_to_the_source_scheme_keeps_its_codes(tiny_llama_dir, tmp_path, calibration_table):
    """A block-FP8 checkpoint in transformers' format re-quantized to FP8 blocks of the same size
    (compressed-tensors' FP8_BLOCK) with FP8 KV-cache scales calibrated on it: the same E4M3 codes,
    each block's scale to fp32 rounding, and the KV scales the release lacked."""
    _transformers._write_hf_fp8(tiny_llama_dir, tmp_path / "src", (32, 32))
    art = api.quantize(str(tmp_path / "src"), "a8w8_fp8", tmp_path / "art", weight_block=32,
                       calib=str(calibration_table(tmp_path / "src")), kv_cache="fp8")
    src, out = load_safetensors(tmp_path / "src"), load_safetensors(art)
    assert all(f"model.layers.{i}.self_attn.{k}" in out for i in range(2) for k in ("k_scale", "v_scale"))
    assert api.inspect(art)["engines"]["vllm"]["status"] == "loads"
    linears = [k[:-len(".weight_scale_inv")] for k in src if k.endswith(".weight_scale_inv")]
    assert len(linears) == 14
    for n in linears:
        assert out[f"{n}.weight"].dtype == torch.float8_e4m3fn
        assert torch.equal(out[f"{n}.weight"].float(), src[f"{n}.weight"].float()), n
        torch.testing.assert_close(out[f"{n}.weight_scale"].float(), src[f"{n}.weight_scale_inv"].float(),
                                   rtol=1e-6, atol=0)


def test_a_source_whose_tensors_disagree_with_its_config_is_refused_before_any_work(tiny_llama_dir, tmp_path):
    art = api.quantize(str(tiny_llama_dir), "weight_only_int4", tmp_path / "art", group_size=32)
    tensors = load_safetensors(art)
    del tensors["model.layers.1.mlp.up_proj.weight_scale"]
    save_file(tensors, str(art / "model.safetensors"))
    with pytest.raises(QuantSpecError, match="up_proj.weight_scale") as e:
        api.quantize(str(art), "weight_only_int8", tmp_path / "out")
    assert "\n" not in str(e.value) and not (tmp_path / "out").exists()


def test_inspect_says_what_the_source_was(tiny_llama_dir, tmp_path):
    from click.testing import CliRunner

    from quantspec.cli import main

    _transformers._write_hf_fp8(tiny_llama_dir, tmp_path / "src", (32, 32))
    run = CliRunner().invoke(main, ["quantize", "--model", str(tmp_path / "src"), "--quant-type", "weight_only_int4",
                                    "--group-size", "32", "--out", str(tmp_path / "w4")], catch_exceptions=False)
    assert run.exit_code == 0, run.output
    assert api.inspect(tmp_path / "w4")["source_quantization"] == {
        "quant_method": "fp8", "format": "float-quantized", "quant_type": "a8w8_fp8"}
    shown = CliRunner().invoke(main, ["inspect", str(tmp_path / "w4")], catch_exceptions=False)
    assert "quantized from" in shown.output and "a8w8_fp8 (fp8)" in shown.output
    assert api.inspect(api.quantize(str(tiny_llama_dir), "weight_only_int8", tmp_path / "w8"))["source_quantization"] \
        is None


def _kv_keep(source: Path, table: Path, out: Path, **options) -> Path:
    return api.quantize(str(source), "keep", out, calib=str(table), **{"kv_cache": "fp8", **options})


def test_keep_adds_kv_scales_and_copies_every_weight_byte(tiny_llama_dir, tmp_path, calibration_table):
    """`--quant-type keep`: a weight-only artifact written without KV-cache scales gets the fp8 ones
    of a table calibrated on the artifact itself; every other tensor is the source's, byte for
    byte; both engines load it with those scales, and quantspec runs an FP8 KV cache with them."""
    from quantspec.calib.tables import read_table
    from quantspec.infer.loader import load_for_inference

    src = api.quantize(str(tiny_llama_dir), "weight_only_int4", tmp_path / "w4", group_size=32)
    table = calibration_table(src)
    art = _kv_keep(src, table, tmp_path / "w4kv")
    before, after = load_safetensors(src), load_safetensors(art)
    kv = {k for k in after if k.endswith((".k_scale", ".v_scale"))}
    assert len(kv) == 4 and set(after) - kv == set(before)
    assert all(after[k].dtype == before[k].dtype and torch.equal(after[k], before[k]) for k in before)
    want = read_table(table, model_dir=src).kv_artifact_tensors("fp8", "tensor")
    assert all(torch.equal(after[k], want[k]) for k in kv)
    cfg_src, cfg = (json.loads((p / "config.json").read_text())["quantization_config"] for p in (src, art))
    assert cfg == {**cfg_src, "kv_cache_scheme": cfg["kv_cache_scheme"]}
    assert cfg["kv_cache_scheme"]["type"] == "float" and cfg["kv_cache_scheme"]["strategy"] == "tensor"
    info = api.inspect(art)
    assert info["engines"]["vllm"]["status"] == info["engines"]["sglang"]["status"] == "loads"
    assert info["quant_type"] == "weight_only_int4" and info["method"] == "rtn"
    prov = read_provenance(art)["provenance"]
    assert prov["kv_cache"] == "fp8" and prov["kv_calibration"]["calib"] == str(table)
    lm = load_for_inference(art, tokenizer=False)
    k = torch.stack([want[f"model.layers.{i}.self_attn.k_scale"].float().reshape(1).expand(lm.args.num_kv_heads)
                     for i in range(2)])
    assert lm.kv_cache_dtype == "fp8" and torch.equal(lm.k_scale, k)


def test_keep_measures_its_table_on_the_artifact_in_one_shot(tiny_llama_dir, tmp_path):
    """`--quant-type keep --kv-cache fp8 --dataset D` (no --calib): the KV scales of the table that
    `calibrate --model ARTIFACT` measures on the same data; nothing is left beside the artifact."""
    from quantspec.model_zoo.tiny import TINY_CORPUS

    data = tmp_path / "calib.txt"
    data.write_text(TINY_CORPUS)
    src = api.quantize(str(tiny_llama_dir), "weight_only_int4", tmp_path / "w4", group_size=32)
    art = api.quantize(str(src), "keep", tmp_path / "w4kv", kv_cache="fp8", dataset=str(data), num_samples=4,
                       seq_len=32)
    table = api.calibrate(str(src), str(data), tmp_path / "table", num_samples=4, seq_len=32).path
    want = load_safetensors(_kv_keep(src, table, tmp_path / "w4kv2"))
    got = load_safetensors(art)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got)
    assert read_provenance(art)["provenance"]["kv_calibration"]["calib"] is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["calib.txt", "table", "w4", "w4kv", "w4kv2"]
    with pytest.raises(QuantSpecError, match="drop one"):
        _kv_keep(src, table, tmp_path / "out", dataset=str(data))


def test_keep_replaces_an_earlier_kv_scheme(tiny_llama_dir, tmp_path, calibration_table):
    table = calibration_table(tiny_llama_dir)
    src = api.quantize(str(tiny_llama_dir), "weight_only_int8", tmp_path / "w8", calib=str(table), kv_cache="int8",
                       target="quantspec")
    art = _kv_keep(src, calibration_table(src), tmp_path / "w8fp8")
    cfg = json.loads((art / "config.json").read_text())["quantization_config"]
    assert cfg["kv_cache_scheme"]["type"] == "float"
    assert load_safetensors(art)["model.layers.1.self_attn.v_scale"].shape == (1,)  # per tensor, not per head


@pytest.mark.parametrize("options, named", [
    ({"method": "gptq"}, "--method"),
    ({"group_size": 32}, "--group-size"),
    ({"kv_cache": None}, "--kv-cache"),
    ({"kv_cache": "int8"}, "--target portable"),
])
def test_keep_refuses_what_it_cannot_honour(tiny_llama_dir, tmp_path, calibration_table, options, named):
    src = api.quantize(str(tiny_llama_dir), "weight_only_int8", tmp_path / "w8")
    with pytest.raises(QuantSpecError, match=named) as e:
        _kv_keep(src, calibration_table(tiny_llama_dir), tmp_path / "out", **options)
    assert "\n" not in str(e.value) and not (tmp_path / "out").exists()


def test_keep_refuses_a_float_model_and_another_tool_s_format(tiny_llama_dir, tmp_path, calibration_table):
    table = calibration_table(tiny_llama_dir)
    with pytest.raises(QuantSpecError, match="not quantized"):
        _kv_keep(tiny_llama_dir, table, tmp_path / "out")
    _transformers._write_hf_fp8(tiny_llama_dir, tmp_path / "fp8", (32, 32))
    with pytest.raises(QuantSpecError, match="a8w8_fp8 --weight-block"):
        _kv_keep(tmp_path / "fp8", table, tmp_path / "out")
    assert not (tmp_path / "out").exists()
