"""Medusa heads (the authors' layout, `model_zoo/medusa.py`), unquantized and quantized on their
own, against the engines: the verdicts `inspect` prints and `quantize --target` refuses by are
checked against the engines' own code (their model registries, the speculative methods their
configs accept, and whether any file of their wheels reads a Medusa layout at all), transformers
loading it, and quantspec running it."""

from __future__ import annotations

import json

import pytest

from quantspec import api
from quantspec.model_zoo.checkpoint import load_model, read_config
from quantspec.quant.engines import DRAFT_REFUSALS

from . import engines as eng


@pytest.fixture(params=["fp", "int8"])
def medusa_path(request, medusa_source, medusa_artifact):
    return medusa_source if request.param == "fp" else medusa_artifact


def test_medusa_verdicts(medusa_path, conformance_model):
    """quantspec loads the heads (the int8 ones as quantized linears); vLLM, SGLang and
    transformers are refused, each for the reason its code gives (below)."""
    from click.testing import CliRunner
    from transformers import AutoModelForCausalLM

    from quantspec.cli import main
    from quantspec.infer.spec.medusa import load_medusa_for_inference

    res = CliRunner().invoke(main, ["inspect", str(medusa_path), "--json"])
    assert res.exit_code == 0, res.output
    verdicts = json.loads(res.output)["engines"]
    assert verdicts == api.inspect(medusa_path)["engines"]
    assert verdicts["quantspec"]["status"] == "loads", verdicts["quantspec"]
    for engine in ("vllm", "sglang", "transformers"):
        v = verdicts[engine]
        assert v["status"] == "refused" and v["verdict"] == f"refused because {DRAFT_REFUSALS['medusa'][engine]}"
    with pytest.raises(Exception):  # noqa: B017 — its refusal is the answer
        AutoModelForCausalLM.from_pretrained(str(medusa_path))
    heads = load_medusa_for_inference(str(medusa_path), load_model(conformance_model)[0])
    kind = type(heads.projections()[0]).__name__
    assert kind == ("QuantLinear" if read_config(medusa_path).get("quantization_config") else "Linear")


@pytest.mark.parametrize("engine", list(eng.ENGINE_PINS))
def test_engines_have_no_medusa(engine_sources, medusa_source, engine):
    """What the vLLM / SGLang refusals say: the architecture quantspec writes is not in the
    engine's model registry, no speculative method of its config is Medusa, and no file of the
    wheel mentions Medusa — no loader, config class or weight-name mapping that a change to the
    artifact's names or config keys could reach."""
    src = engine_sources[engine]
    if isinstance(src, str):
        pytest.skip(src)
    arch = read_config(medusa_source)["architectures"]
    assert arch == ["MedusaModel"]
    assert "LlamaForCausalLM" in src.architectures() and not set(arch) & src.architectures()
    methods = {m.lower() for m in src.speculative_methods()}
    assert {"eagle3", "ngram"} <= methods and "medusa" not in methods
    assert src.files_mentioning("medusa") == []
    where = {"vllm": "SpeculativeConfig.method", "sglang": "SpeculativeAlgorithm"}[engine]
    assert where in DRAFT_REFUSALS["medusa"][engine] and f"{src.version} " in DRAFT_REFUSALS["medusa"][engine]


@pytest.mark.parametrize("target", ["portable", "vllm", "sglang", "transformers"])
def test_medusa_needs_target_quantspec(medusa_source, tmp_path, target):
    """`quantize --target T` of Medusa heads is one line naming the engine's reason and
    `--target quantspec`, before any work."""
    from click.testing import CliRunner

    from quantspec.cli import main

    args = ["quantize", "--model", str(medusa_source), "--quant-type", "weight_only_int8",
            "--out", str(tmp_path / "out")]
    res = CliRunner().invoke(main, args + ([] if target == "portable" else ["--target", target]))
    assert res.exit_code == 2, res.output
    line = res.output.strip()
    engine = "vllm" if target == "portable" else target
    assert "\n" not in line and "is Medusa heads" in line and DRAFT_REFUSALS["medusa"][engine] in line
    assert line.endswith("pass --target quantspec") and not (tmp_path / "out").exists()
