"""Every artifact type against the engines' own code: vLLM's and SGLang's compressed-tensors
decisions (lifted from their pinned wheels, `lift.py`), transformers loading and running it, and
compressed-tensors' decompression at every release the engines pin — each compared with
`quant.engines.engine_verdicts`, the one function `inspect` and `quantize --target` use.

Lifted answer → verdict: a parse error, a scheme-selection error, a `create_weights` error, a
shard its parameters refuse to load, or a float tensor its loader copies into an integer parameter
(a silent lossy cast: the layer cannot run as quantized) is "refused"; a layer whose scheme the engine picks but whose
parameters the checkpoint leaves unloaded (e.g. an ignored fallback's missing `input_scale`), or a
`kv_cache_scheme` the engine sets aside, is "ignores"; else "loads" with the scheme it picked.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from quantspec.model_zoo.checkpoint import read_config
from quantspec.quant.artifact import linear_from_tensors, load_safetensors, read_quant_config
from quantspec.quant.engines import ENGINE_VERSIONS, FUSED_LAYERS, LAYER_CLASSES
from quantspec.quant.primitives import dequantize

from . import engines as eng
from .conftest import ARTIFACTS, MEDUSA_ARTIFACT, MTP_ARTIFACT, OTHER_LAYOUTS
from .requests import artifact_verdicts, lifted_status

NAMES = list(ARTIFACTS) + list(OTHER_LAYOUTS)
PORTABLE = [n for n, o in ARTIFACTS.items() if o.get("target", "portable") == "portable"]
TABLE = Path(__file__).parents[2] / "docs" / "engines.md"


def _lifted(lifted, engine, name):
    ans = lifted[engine]
    if isinstance(ans, str):
        pytest.skip(ans)
    return ans["result"][name]


def test_pins_are_the_verdicts_versions():
    assert eng.pins_agree(), (eng.ENGINE_PINS, ENGINE_VERSIONS)


@pytest.mark.parametrize("engine", list(eng.ENGINE_PINS))
def test_engine_layout_is_the_one_verdicts_assume(engine_sources, engine):
    """The fused layers and layer classes `engine_verdicts` assumes are the engine's Llama's."""
    src = engine_sources[engine]
    if isinstance(src, str):
        pytest.skip(src)
    classes = eng.layer_classes(src.model_source())
    for attr, cls in LAYER_CLASSES.items():
        assert classes.get(attr) == cls, (attr, classes.get(attr))
    mapping = src.packed_modules_mapping()
    if engine == "vllm":
        assert {k: tuple(v) for k, v in mapping.items()} == FUSED_LAYERS
    else:  # SGLang's Llama declares none: fused shards are matched by the fused name only
        assert mapping == {}


@pytest.mark.parametrize("engine", list(eng.ENGINE_PINS))
@pytest.mark.parametrize("name", NAMES)
def test_verdict_matches_engine_code(artifacts, lifted, engine, name):
    res = _lifted(lifted, engine, name)
    v = artifact_verdicts(artifacts[name])[engine]
    status, per_layer = lifted_status(res)
    assert v.status == status, (v.line(), json.dumps(res, indent=1)[:3000])
    for layer, got in per_layer.items():
        lv = v.layers[layer]
        want = "refused" if lv.scheme is None and lv.problem else "ignores" if lv.problem else "loads"
        assert want == got, (layer, lv, res["layers"][layer])
        r = res["layers"][layer]
        if got == "loads":
            assert r["scheme"] == lv.scheme, (layer, r, lv)
            args = r["args"]
            if "num_bits" in args:
                assert args["num_bits"] == lv.num_bits
            if "group_size" in args and lv.scheme == "WNA16":
                assert (None if args["group_size"] == -1 else args["group_size"]) == lv.group_size
            if "symmetric" in args:
                assert args["symmetric"] == lv.symmetric
            if "is_static_input_scheme" in args:
                assert bool(args["is_static_input_scheme"]) == (lv.input_activations or "").endswith("static")
    if res["kv"] is not None:
        assert (v.kv_cache is not None) == (res["kv"]["method"] is not None and not res["kv"]["error"])


@pytest.mark.parametrize("name", PORTABLE)
def test_default_target_loads_as_intended(artifacts, lifted, name):
    """What `quantize` writes by default: both engines pick, for every layer, the scheme it was
    quantized with (bits, group size, zero points, static activations) — except where the verdict
    names an engine bug on valid compressed-tensors (SGLang's static int8 layers), which the
    engine's code then refuses outright: never a silent mis-run."""
    path = artifacts[name]
    qc = read_quant_config(path)
    if _fp4_inputs(qc):
        pytest.skip("NVFP4 inputs run on FP4 tensor cores: test_nvfp4_verdicts_by_capability_match_engine_code")
    verdicts = artifact_verdicts(path)
    for engine in eng.ENGINE_PINS:
        res = _lifted(lifted, engine, name)
        if verdicts[engine].defect:
            assert lifted_status(res)[0] == "refused", (engine, res)
            continue
        assert lifted_status(res)[0] == "loads", (engine, res)
        for layer, r in res["layers"].items():
            shard = next(s for s in _shards(layer))
            s = qc.scheme_for(shard)
            args = r["args"]
            if r["scheme"] == "WNA16":
                assert args["num_bits"] == s.weights.num_bits and args["symmetric"] == s.weights.symmetric
                g = s.weights.group_size if s.weights.strategy == "group" else -1
                assert args["group_size"] == g, (engine, layer, args, g)
            else:
                ia = s.input_activations
                assert bool(args.get("is_static_input_scheme")) == (ia is not None and not ia.dynamic)


@pytest.mark.parametrize("engine", list(eng.ENGINE_PINS))
@pytest.mark.parametrize("name", NAMES)
def test_engine_loads_the_artifacts_scales(artifacts, lifted, engine, name):
    """Per layer the engine loads, its parameters hold the artifact's scales and zero points
    (in the parameter's dtype: the engines keep weight-only scales in the activations' dtype,
    bf16 here) after its own loaders ran: a fused layer's per-shard values in shard order, or —
    where the engine keeps one value for the layer (a static input_scale) — every shard's value,
    so no shard runs with another's scale."""
    res = _lifted(lifted, engine, name)
    tensors = load_safetensors(artifacts[name])
    status, per_layer = lifted_status(res)
    checked = 0
    for layer, r in res["layers"].items():
        if per_layer.get(layer) == "refused":
            continue
        for leaf, loaded in r["values"].items():
            dtype = getattr(torch, loaded["dtype"])
            want = torch.cat([tensors[f"{s}.{leaf}"].to(dtype).float().reshape(-1) for s in _shards(layer)])
            got = torch.tensor(loaded["data"])
            if got.numel() == 1 and want.numel() > 1:
                assert torch.all(want == got), (layer, leaf, got, want)
            else:
                assert torch.equal(got, want), (layer, leaf, got[:8], want[:8])
            checked += 1
    assert checked or status == "refused", res


@pytest.mark.parametrize("name", [n for n, o in ARTIFACTS.items() if any(
    t.startswith("model.embed_tokens=") for t in o.get("layer_quant_types", ()))])
def test_vllm_looks_up_the_embedding_rows_quantspec_does(artifacts, lifted, name):
    """vLLM's own lookup (`CompressedTensorsEmbeddingWNA16Int.embedding`, its Triton kernel run in
    Triton's interpreter, a float32 model's parameters) of rows `EMBEDDING_IDS` from the
    artifact's codes gives quantspec's rows exactly: the same codes times the same scales."""
    from quantspec.infer.loader import load_for_inference

    from .requests import EMBEDDING_IDS

    r = _lifted(lifted, "vllm", name)["layers"]["model.embed_tokens"]
    assert "rows" in r, r.get("rows_error") or r
    emb = load_for_inference(artifacts[name], tokenizer=False, dtype=torch.float32).model.model.embed_tokens
    want = emb(torch.tensor(EMBEDDING_IDS))
    assert want.abs().amax() > 0 and torch.equal(torch.tensor(r["rows"]), want)


def test_fp8_verdicts_below_sm89_match_engine_code(artifacts, engine_sources, tmp_path):
    """On a GPU without FP8 MMA (capability 8.0) both engines fall back to FP8 weight-only, the
    inputs' quantization set aside ("ignores"): per channel in both, blocks in vLLM only (SGLang's
    W8A16Fp8 refuses them in `create_weights`)."""
    from .requests import build_request

    names = ["a8w8_fp8_dynamic", "a8w8_fp8_block"]
    sub = {n: artifacts[n] for n in names}
    answers = eng.run_engines(engine_sources, lambda src: build_request(src, sub, 80), tmp_path)
    for engine in eng.ENGINE_PINS:
        if isinstance(answers[engine], str):
            pytest.skip(answers[engine])
        for name in names:
            res = answers[engine]["result"][name]
            v = artifact_verdicts(artifacts[name], capability=80)[engine]
            status, per_layer = lifted_status(res)
            assert v.status == status, (engine, name, v.line(), json.dumps(res)[:2000])
            for layer, r in res["layers"].items():
                if per_layer[layer] != "refused":
                    assert per_layer[layer] == "ignores", (engine, name, layer)
                    assert r["scheme"] == v.layers[layer].scheme == "W8A16Fp8", (engine, name, layer)
        assert (lifted_status(answers[engine]["result"]["a8w8_fp8_block"])[0] == "refused") == (engine == "sglang")


def test_fp8_weight_only_verdicts_by_capability_match_engine_code(artifacts, engine_sources, tmp_path):
    """FP8 weights alone (W8A16 FP8, and a8w8_fp8's fallback to it) on Turing (7.5), Ampere (8.0) and
    Hopper (9.0): each verdict is what the engines' own code answers (`_by_capability`). vLLM runs
    per-channel and block FP8 weights on all three; SGLang's weight-only FP8 needs Ampere and takes no
    blocks."""
    names = ["weight_only_fp8", "weight_only_fp8_block", "a8w8_fp8_dynamic"]
    seen = {(cap, engine, name): status for cap, engine, name, _res, _v, status, _per in _by_capability(
        artifacts, engine_sources, tmp_path, names, (75, 80, 90))}
    assert len(seen) == 3 * len(names) * len(eng.ENGINE_PINS)
    assert all(seen[cap, "vllm", name] == "loads" for cap in (75, 80, 90) for name in names[:2])
    assert [seen[cap, "sglang", "weight_only_fp8"] for cap in (75, 80, 90)] == ["refused", "loads", "loads"]
    # FP8 inputs below 8.9: the FP8 weights run alone (W8A16Fp8), the input quantization set aside
    assert [seen[cap, "vllm", "a8w8_fp8_dynamic"] for cap in (75, 80, 90)] == ["ignores", "ignores", "loads"]
    assert [seen[cap, "sglang", "a8w8_fp8_dynamic"] for cap in (75, 80, 90)] == ["refused", "ignores", "loads"]


def test_mxfp8_verdicts_by_capability_match_engine_code(artifacts, engine_sources, tmp_path):
    """MXFP8 below Turing (7.0), on Hopper (9.0) and on Blackwell (10.0, 12.0): vLLM's one MXFP8
    scheme asks for 7.5; its registry takes FlashInfer's MXFP8 GEMM from 10.0 (the inputs quantized
    at run time, a weight-only checkpoint's too) and FP8 Marlin below (weight-only, MXFP8 inputs set
    aside). SGLang has no MXFP8 scheme at all. Each verdict is what the engines' code answers."""
    names, caps = ["weight_only_mxfp8", "mxfp8"], (70, 90, 100, 120)
    seen = {(cap, engine, name): status for cap, engine, name, _res, _v, status, _per in _by_capability(
        artifacts, engine_sources, tmp_path, names, caps)}
    assert [seen[c, "vllm", "weight_only_mxfp8"] for c in caps] == ["refused", "loads", "ignores", "ignores"]
    assert [seen[c, "vllm", "mxfp8"] for c in caps] == ["refused", "ignores", "loads", "loads"]
    assert all(seen[c, "sglang", n] == "refused" for c in caps for n in names)


def _fp4_inputs(qc) -> bool:
    return any(g.input_activations is not None and g.input_activations.is_fp4 for g in qc.config_groups.values())


def _by_capability(artifacts, engine_sources, tmp_path, names, caps):
    """The engines' own answers for artifacts `names` on GPUs of compute capabilities `caps`, each
    checked against the verdict's status: (cap, engine, name, the engine's answer, the verdict,
    status, per-layer status) per artifact."""
    from .requests import build_request

    sub = {n: artifacts[n] for n in names}
    for cap in caps:
        (tmp_path / str(cap)).mkdir()
        answers = eng.run_engines(engine_sources, lambda src: build_request(src, sub, cap), tmp_path / str(cap))
        for engine in eng.ENGINE_PINS:
            if isinstance(answers[engine], str):
                pytest.skip(answers[engine])
            for name in names:
                res = answers[engine]["result"][name]
                v = artifact_verdicts(artifacts[name], capability=cap)[engine]
                status, per_layer = lifted_status(res)
                assert v.status == status, (cap, engine, name, v.line(), json.dumps(res)[:2000])
                yield cap, engine, name, res, v, status, per_layer


def test_nvfp4_verdicts_by_capability_match_engine_code(artifacts, engine_sources, tmp_path):
    """NVFP4 on Blackwell (10.0): both engines run W4A4 (NVFP4 inputs) and weight-only NVFP4 with
    every scale loaded as stored — what `quantize --target portable` probes for nvfp4; below 10.0
    (9.0: the suite's other tests) W4A4 runs weight-only; on Turing (7.5) vLLM still runs FP4
    Marlin and SGLang refuses (its weight-only NVFP4 asks for 8.0)."""
    for cap, engine, name, res, v, status, per_layer in _by_capability(
            artifacts, engine_sources, tmp_path, ["weight_only_nvfp4", "nvfp4"], (100, 75)):
        for layer, r in res["layers"].items():
            if per_layer[layer] == "loads":
                assert r["scheme"] == v.layers[layer].scheme, (cap, engine, layer, r)
                assert r["args"].get("kernel", "CutlassNvFp4LinearKernel") != "MarlinNvFp4LinearKernel" \
                    or name == "weight_only_nvfp4", (cap, engine, layer, r)
        if cap == 100:
            assert status == "loads", (engine, name, res)
            for layer, r in res["layers"].items():  # every shard's global scales, as stored
                assert {"weight_global_scale", *(["input_global_scale"] if name == "nvfp4" else [])} \
                    <= set(r["values"]), (engine, layer, r["values"].keys())
        if cap == 75 and name == "weight_only_nvfp4":
            assert status == ("refused" if engine == "sglang" else "loads")


# vLLM's MXFP4 kernels by compute capability (`lift._mxfp4_kernel_oracle`): none at 7.5 (its scheme asks
# for 8.0), FP4 Marlin below 10.0, FlashInfer's W4A4 kernel from 10.0
MXFP4_KERNELS = {75: None, 80: "MarlinMxFp4LinearKernel", 100: "FlashInferMxFp4LinearKernel"}


def test_mxfp4_verdicts_by_capability_match_engine_code(artifacts, engine_sources, tmp_path):
    """MXFP4 where vLLM's kernel choice changes (9.0: the suite's other tests): on Turing (7.5) its
    MXFP4 scheme refuses to run; from 8.0 it runs FP4 Marlin, weight-only (an `mxfp4` artifact's
    input quantization set aside); from 10.0 FlashInfer's W4A4 kernel, which quantizes the inputs
    to MXFP4 whatever the checkpoint says (a `weight_only_mxfp4` artifact's too) — every layer's
    E8M0 scales loaded as stored. SGLang has no MXFP4 Linear scheme on any GPU."""
    for cap, engine, name, res, v, status, per_layer in _by_capability(
            artifacts, engine_sources, tmp_path, ["weight_only_mxfp4", "mxfp4"], MXFP4_KERNELS):
        kernel = MXFP4_KERNELS[cap]
        want = "refused" if engine == "sglang" or kernel is None else \
            "loads" if (name == "mxfp4") == (cap >= 100) else "ignores"
        assert status == want, (cap, engine, name, v.line())
        for layer, r in res["layers"].items():
            if per_layer[layer] != "refused":
                assert r["scheme"] == v.layers[layer].scheme == "W4A4Mxfp4", (cap, engine, layer, r)
                assert r["args"]["kernel"] == kernel and "weight_scale" in r["values"], (cap, layer, r)


def test_mxfp4_fp8_verdicts_by_capability_match_engine_code(artifacts, engine_sources, tmp_path):
    """MXFP4 weights with FP8 inputs per group (a8w4_mxfp4): vLLM's `CompressedTensorsW4A8Mxfp4`
    (from 8.0) asks its MXFP4 registry for the FP8 inputs, which Humming's kernel keeps; Humming
    runs FP8 activations from 8.9, so on Ampere (8.0) the layer fails to load, and from 8.9 on
    (9.0, 10.0) every layer runs its FP8 inputs with its E8M0 scales loaded as stored. SGLang has no
    MXFP4 Linear scheme."""
    caps = (75, 80, 90, 100)
    for cap, engine, name, res, v, status, per_layer in _by_capability(
            artifacts, engine_sources, tmp_path, ["a8w4_mxfp4"], caps):
        assert status == ("loads" if engine == "vllm" and cap >= 89 else "refused"), (cap, engine, v.line())
        for layer, r in res["layers"].items():
            if per_layer[layer] == "loads":
                assert r["scheme"] == v.layers[layer].scheme == "W4A8Mxfp4", (cap, layer, r)
                assert r["args"]["kernel"] == "HummingMxFp4LinearKernel" and "weight_scale" in r["values"], r
                assert r["inputs"] and v.layers[layer].input_activations == "fp8 dynamic", (layer, r)


def test_sglang_refuses_fused_static_int8_where_the_verdict_says(artifacts, lifted):
    """SGLang's refusal of a static int8 artifact is the code path its verdict names: each fused
    layer's only load errors are the k/v (up) shards' input_scale raising IndexError in
    `PerTensorScaleParameter._load_into_shard_id`, after `create_weights` made a one-element
    input_scale; every other layer loads."""
    for name in ("a8w8", "a8w8_fallback"):
        res = _lifted(lifted, "sglang", name)
        v = artifact_verdicts(artifacts[name])["sglang"]
        assert v.status == "refused" and v.defect, v.line()
        assert "_load_into_shard_id" in v.line() and f"SGLang {eng.ENGINE_PINS['sglang']}" in v.line()
        refused = 0
        for layer, r in res["layers"].items():
            if v.layers[layer].scheme is not None:
                assert not r["load_errors"] and not r["error"], (layer, r)
                continue
            refused += 1
            assert r["scheme"] == "W8A8Int8" and r["args"]["is_static_input_scheme"], (layer, r)
            assert len(r["values"]["input_scale"]["data"]) == 1, (layer, r)
            assert r["load_errors"] and all(
                e.startswith("input_scale: IndexError at _load_into_shard_id") for e in r["load_errors"]), r
            assert len(r["load_errors"]) == len(_shards(layer)) - 1, (layer, r["load_errors"])
        assert refused, name


def _shards(layer: str):
    prefix, _, leaf = layer.rpartition(".")
    return [f"{prefix}.{s}" if prefix else s for s in FUSED_LAYERS.get(leaf, (leaf,))]


@pytest.mark.parametrize("name", NAMES)
def test_transformers_verdict(artifacts, name, torch_threads):
    """transformers (through compressed-tensors) loads and runs the artifact iff the verdict
    says so, and sets KV-cache scales aside iff the verdict says it ignores them."""
    from transformers import AutoModelForCausalLM

    path = artifacts[name]
    v = artifact_verdicts(path)["transformers"]
    # compressed-tensors decompresses FP4 (NVFP4, MXFP4) and MXFP8 weights to bf16 only: such a model runs in bf16
    fp4 = any(s.weights.is_fp4 or s.weights.is_mx for s in read_quant_config(path).config_groups.values())
    dtype = torch.bfloat16 if fp4 else torch.float32
    try:
        m, info = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, output_loading_info=True)
        with torch.no_grad():
            m(torch.tensor([[1, 5, 9, 2]]))
        ok = True
    except Exception:  # noqa: BLE001 — its refusal is the answer
        ok = False
    assert ok == (v.status != "refused"), v.line()
    if ok and read_quant_config(path).kv_cache_scheme is not None:
        assert v.status == "ignores" and any(k.endswith("k_scale") for k in info["unexpected_keys"])


def test_mtp_module_verdict(mtp_artifact, conformance_model, engine_sources):
    """An MTP module: quantspec runs it; vLLM, SGLang and transformers have no model class for
    its architecture (the engines' model registries in their wheels, transformers' Auto classes),
    so each is refused, and the verdict says so."""
    from transformers import AutoModelForCausalLM

    from quantspec.infer.spec.mtp import load_mtp_for_inference
    from quantspec.model_zoo.checkpoint import load_model

    verdicts = artifact_verdicts(mtp_artifact)
    assert verdicts["quantspec"].status == "loads"
    for engine in ("vllm", "sglang", "transformers"):
        assert verdicts[engine].status == "refused" and "no model class" in verdicts[engine].line()
    arch = read_config(mtp_artifact)["architectures"][0]
    with pytest.raises(Exception):  # noqa: B017 — its refusal is the answer
        AutoModelForCausalLM.from_pretrained(str(mtp_artifact))
    mtp = load_mtp_for_inference(str(mtp_artifact), load_model(conformance_model)[0])
    assert type(mtp.model.layers[0].mlp.down_proj).__name__ == "QuantLinear"
    missing = [src for src in engine_sources.values() if isinstance(src, str)]
    for src in engine_sources.values():
        if not isinstance(src, str):
            archs = src.architectures()
            assert "LlamaForCausalLM" in archs and arch not in archs, src.engine
    if missing:
        pytest.skip("; ".join(missing))


@pytest.mark.parametrize("target", ["portable", "vllm", "sglang", "transformers"])
def test_mtp_module_needs_target_quantspec(mtp_source, tmp_path, target):
    """`quantize --target T` of an MTP module is one line naming `--target quantspec`, before
    any work (the default target, portable, included)."""
    from click.testing import CliRunner

    from quantspec.cli import main

    args = ["quantize", "--model", str(mtp_source), "--quant-type", "weight_only_int8",
            "--out", str(tmp_path / "out")]
    res = CliRunner().invoke(main, args + ([] if target == "portable" else ["--target", target]))
    assert res.exit_code == 2, res.output
    line = res.output.strip()
    assert "\n" not in line and "is an MTP module" in line and f"--target {target}" in line
    assert line.endswith("pass --target quantspec") and not (tmp_path / "out").exists()


def _ct_versions(engine_sources) -> list[tuple[str, Path | None]]:
    import compressed_tensors

    out = [(compressed_tensors.__version__, None)]
    for src in engine_sources.values():
        if not isinstance(src, str) and src.ct_version not in [v for v, _ in out]:
            out.append((src.ct_version, src.ct_dir))
    return out


@pytest.fixture(scope="module")
def decompressed(artifacts, engine_sources, tmp_path_factory) -> dict:
    """compressed-tensors version → (its JSON report, the folder of dense weights per artifact):
    one fresh interpreter per release (`decompress.py`) for every artifact."""
    import compressed_tensors

    script = Path(__file__).with_name("decompress.py")
    out = {}
    for version, ct_dir in _ct_versions(engine_sources):
        ct_dir = ct_dir or Path(compressed_tensors.__file__).parents[1]
        folder = tmp_path_factory.mktemp(f"ct-{version}")
        r = subprocess.run([sys.executable, str(script), str(ct_dir), str(folder),
                            *[str(artifacts[n]) for n in NAMES]], capture_output=True, text=True,
                           timeout=600, env={**os.environ, "PYTHONNOUSERSITE": "1"})
        assert r.returncode == 0, r.stderr[-2000:]
        out[version] = (json.loads(r.stdout.strip().splitlines()[-1]), folder)
    return out


@pytest.mark.parametrize("name", NAMES)
def test_compressed_tensors_decompression_equals_ours(artifacts, decompressed, name):
    """compressed-tensors' own decompression, at the installed release and at each release an
    engine pins, gives exactly quantspec's `dequantize` for every Linear it decompresses; the
    Linears it refuses are the ones the transformers verdict refuses."""
    path = artifacts[name]
    qc = read_quant_config(path)
    tensors = load_safetensors(path)
    verdict = artifact_verdicts(path)["transformers"]
    refuses = verdict.status == "refused" and "float zero points" in " ".join(verdict.reasons)
    for version, (rep, folder) in decompressed.items():
        assert rep["version"] == version
        errors = rep["errors"][path.name]
        assert bool(errors) == refuses, errors
        theirs = load_safetensors(folder / f"{path.name}.safetensors")
        for lin, w in theirs.items():
            lq = linear_from_tensors(tensors, lin, qc)
            args = lq.args
            if args.strategy == "block" and _release(version) < (0, 20) and \
                    any(d % b for d, b in zip(lq.q.shape, args.block_structure)):
                # releases before 0.20 decompress without the args, taking the block from the
                # scale's shape (rows // scale rows): wrong where an edge block is partial
                args = args.replace(block_structure=tuple(d // s for d, s in zip(lq.q.shape, lq.scale.shape)))
                assert args != lq.args
            if args.is_fp4 or args.is_mx:  # compressed-tensors decompresses NVFP4, MXFP4 and MXFP8 to bf16
                ours = dequantize(lq.q, lq.scale, None, args, dtype=w.dtype, global_scale=lq.global_scale)
            else:
                ours = dequantize(lq.q, lq.scale, lq.zero_point, args)
            assert w.dtype == ours.dtype and torch.equal(w, ours), (version, lin)


def _release(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in version.split(".")[:2])


def test_engine_table_is_current(artifacts, mtp_artifact, medusa_artifact, eagle3_artifacts):
    """docs/engines.md is the table of the verdicts this suite checks (QUANTSPEC_WRITE_ENGINE_TABLE=1
    rewrites it). It needs no engine wheel, so a stale table fails wherever the tests run."""
    from .table import render

    text = render({**{n: artifact_verdicts(artifacts[n]) for n in ARTIFACTS},
                   MTP_ARTIFACT[0]: artifact_verdicts(mtp_artifact), MEDUSA_ARTIFACT[0]: artifact_verdicts(medusa_artifact),
                   **{n: artifact_verdicts(p) for n, p in eagle3_artifacts.items()},
                   **{n: artifact_verdicts(artifacts[n]) for n in OTHER_LAYOUTS}})
    if os.environ.get("QUANTSPEC_WRITE_ENGINE_TABLE"):
        TABLE.write_text(text)
    assert TABLE.is_file() and TABLE.read_text() == text, \
        "docs/engines.md is stale: rerun with QUANTSPEC_WRITE_ENGINE_TABLE=1"
