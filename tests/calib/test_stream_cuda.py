"""Streamed quantization and calibration with the layer under work on the GPU (`--device cuda`,
`-m gpu`) against the same streamed run on the CPU: RTN int8 bitwise (its rounding is elementwise
IEEE arithmetic), GPTQ and the a8w8 recipe within the drift of a different summation order,
calibration tables within float tolerance.

Where `datasets` is not installed (a bare GPU image), both runs of a comparison read the
calibration texts as the lines of the file instead (what `datasets`' text builder gives, checked
below on any machine that has it): the comparison is of the devices' arithmetic, not of reading."""

import importlib.util
from pathlib import Path

import pytest
import torch

from quantspec import api
from quantspec.calib.tables import read_table
from quantspec.model_zoo.tiny import TINY_CORPUS
from quantspec.quant.artifact import load_safetensors, read_artifact_config

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

SMALL = dict(num_samples=4, seq_len=32)


def _lines(dataset, *, split="train", text_field="text") -> list[str]:
    """The non-blank lines of a local text file, as `load_calibration_texts` reads it."""
    return [line for line in Path(dataset).read_text(encoding="utf-8").splitlines() if line.strip()]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    f = tmp_path_factory.mktemp("data") / "calib.txt"
    f.write_text(TINY_CORPUS)
    if importlib.util.find_spec("datasets") is not None:
        yield f
        return
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("quantspec.calib.data.load_calibration_texts", _lines)
        yield f


@pytest.mark.skipif(importlib.util.find_spec("datasets") is None, reason="compares with the datasets package")
def test_the_stand_in_reader_gives_the_datasets_texts(tmp_path):
    from quantspec.calib.data import load_calibration_texts

    f = tmp_path / "calib.txt"
    f.write_text(TINY_CORPUS)
    assert _lines(f) == load_calibration_texts(str(f))


def _pair(src, tmp_path, **kw):
    """(config, tensors) of the streamed artifact made on the CPU and on the GPU."""
    out = []
    for device in ("cpu", "cuda"):
        path = api.quantize(str(src), out=tmp_path / device, device=device, **kw)
        out.append((read_artifact_config(path)["quantization_config"], load_safetensors(path)))
    return out


def _codes_differ(a: torch.Tensor, b: torch.Tensor) -> float:
    """The fraction of elements (packed words) that differ."""
    return float((a.view(torch.uint8) != b.view(torch.uint8)).float().mean()) if a.numel() else 0.0


def _assert_alike(ta: dict, tb: dict, *, rtol: float, atol: float, codes: float) -> None:
    """The CPU's and the GPU's artifact tensors: the same names, dtypes and shapes, float tensors
    within rtol / atol, and integer codes (packed words) differing in under a `codes` fraction."""
    assert sorted(ta) == sorted(tb)
    for k in ta:
        assert ta[k].dtype == tb[k].dtype and ta[k].shape == tb[k].shape, k
        if ta[k].dtype.is_floating_point:
            torch.testing.assert_close(tb[k].float(), ta[k].float(), rtol=rtol, atol=atol, msg=k)
        else:
            assert _codes_differ(ta[k], tb[k]) < codes, k


@pytest.mark.gpu
@needs_cuda
def test_rtn_int8_on_the_gpu_is_the_cpu_artifact_bitwise(tiny_llama_dir, tmp_path):
    (ca, ta), (cb, tb) = _pair(tiny_llama_dir, tmp_path, quant_type="weight_only_int8")
    assert ca == cb and sorted(ta) == sorted(tb)
    for k in ta:
        assert ta[k].dtype == tb[k].dtype and ta[k].shape == tb[k].shape, k
        assert torch.equal(ta[k].view(torch.uint8), tb[k].view(torch.uint8)), k


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("kw", [dict(quant_type="weight_only_int4", group_size=32, method="gptq"),
                                dict(quant_type="a8w8", smoothquant_alpha=0.5, fallback_layers=0)],
                         ids=["int4-gptq", "a8w8"])
def test_data_recipes_on_the_gpu_match_the_cpu(kw, tiny_llama_dir, data, tmp_path):
    if kw["quant_type"] == "a8w8":
        kw = dict(kw, calib=str(api.calibrate(str(tiny_llama_dir), str(data), tmp_path / "table", device="cpu",
                                              **SMALL).path), search_samples=2, holdout_samples=2, seq_len=32)
    else:
        kw = dict(kw, dataset=str(data), **SMALL)
    (ca, ta), (cb, tb) = _pair(tiny_llama_dir, tmp_path, **kw)
    assert ca == cb
    _assert_alike(ta, tb, rtol=2e-3, atol=1e-6, codes=0.05)


@pytest.mark.gpu
@needs_cuda
def test_calibration_on_the_gpu_matches_the_cpu(tiny_llama_dir, data, tmp_path):
    tables = [read_table(api.calibrate(str(tiny_llama_dir), str(data), tmp_path / d, device=d, dtype="float32",
                                       **SMALL).path) for d in ("cpu", "cuda")]
    assert sorted(tables[0].tensors) == sorted(tables[1].tensors)
    for k, t in tables[0].tensors.items():
        torch.testing.assert_close(tables[1].tensors[k].float(), t.float(), rtol=1e-3, atol=1e-5, msg=k)


@pytest.mark.gpu
@needs_cuda
def test_rotations_on_the_gpu_match_the_cpu(tied_llama_dir, tmp_path):
    """`--rotate` turns each tensor on the device its layer runs on (float64 either way): the
    rotated float tensors agree to rounding, the int8 codes but for the odd tie."""
    pytest.importorskip("compressed_tensors", reason="--rotate takes its Hadamard matrices from compressed-tensors, "
                                                     "which a bare GPU image may lack")
    (ca, ta), (cb, tb) = _pair(tied_llama_dir, tmp_path, quant_type="weight_only_int8", rotate="R1,R2")
    assert ca == cb and "lm_head.weight" in ta
    _assert_alike(ta, tb, rtol=1e-5, atol=1e-7, codes=0.01)


@pytest.mark.gpu
@needs_cuda
def test_quip_on_the_gpu_matches_the_cpu(tiny_llama_dir, data, tmp_path):
    """`--quip` turns each weight and Hessian on the device its layer runs on: GPTQ in the turned
    basis gives the CPU's artifact within the drift of a different summation order."""
    pytest.importorskip("compressed_tensors", reason="--quip writes its transform_config with compressed-tensors")
    (ca, ta), (cb, tb) = _pair(tiny_llama_dir, tmp_path, quant_type="weight_only_int4", group_size=32, method="gptq",
                               dataset=str(data), quip="v,u", target="vllm", **SMALL)
    assert ca == cb and ca["transform_config"]["config_groups"].keys() == {"v", "u"}
    _assert_alike(ta, tb, rtol=2e-3, atol=1e-6, codes=0.05)
