"""`quantspec quantize / inspect / eval` end to end on the tiny model, and their bad input."""

import json

import pytest
import torch
from click.testing import CliRunner

from quantspec import api
from quantspec.cli import main
from quantspec.errors import QuantSpecError
from quantspec.model_zoo.tiny import TINY_CORPUS
from quantspec.quant.artifact import read_quant_config

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def corpus_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("data")
    paras = [p for p in TINY_CORPUS.split("\n") if p.strip()]
    with open(d / "calib.jsonl", "w") as f:
        for p in paras:
            f.write(json.dumps({"text": p, "n": 1}) + "\n")
    (d / "heldout.txt").write_text(TINY_CORPUS)
    (d / "empty.jsonl").write_text("")
    return d


def _run(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def test_method_choices_are_the_pipelines():
    """The CLI (which imports no torch) lists the methods quantize runs."""
    from quantspec.quant.presets import METHODS

    for command in ("quantize", "report"):
        option = next(p for p in main.commands[command].params if p.name in ("method", "quant_method"))
        assert tuple(option.type.choices) == METHODS


@pytest.mark.parametrize("method", ["gptq", "awq", "awq+gptq", "autoround"])
def test_quantize_inspect_eval_with_data(method, tiny_llama_dir, corpus_files, tmp_path):
    out = tmp_path / "w4"
    r = _run("quantize", "--model", tiny_llama_dir, "--quant-type", "weight_only_int4", "--method", method,
             "--group-size", "128", "--dataset", corpus_files / "calib.jsonl", "--num-samples", "4",
             "--seq-len", "32", "--out", out)
    assert r.exit_code == 0, r.output
    cfg = json.loads((out / "config.json").read_text())
    qc = cfg["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "pack-quantized"
    assert qc["ignore"] == ["lm_head"]
    assert cfg["num_hidden_layers"] == 2  # the source config is kept
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "quantspec.json"):
        assert (out / f).is_file(), f
    q = read_quant_config(out)
    assert q.weight_args_for("model.layers.0.self_attn.q_proj").group_size == 64  # K = 64
    assert q.weight_args_for("model.layers.0.mlp.down_proj").group_size == 128
    prov = q.provenance
    assert prov["method"] == method and prov["calibration"]["num_samples"] == 4
    assert all(prov["ptq"][f"{m}_loss_total"] > 0 for m in method.split("+"))
    assert prov["ptq"]["calibration_tokens"] == 4 * 32
    info = api.inspect(out)
    assert info["layers"]["model.layers.1.mlp.down_proj"]["bits"] == 4
    assert len(info["layers"]) == 14
    assert 1.0 < info["compression_ratio"]  # smaller than the fp32 source
    r = _run("inspect", out)
    assert r.exit_code == 0 and "group 64" in r.output and "compression" in r.output
    # eval: the artifact is a bit worse than the source, not broken
    base = json.loads(_run("eval", "--model", tiny_llama_dir, "--text-file", corpus_files / "heldout.txt",
                           "--seq-len", "64", "--max-windows", "6", "--json").stdout)
    quant = json.loads(_run("eval", "--model", out, "--text-file", corpus_files / "heldout.txt",
                            "--seq-len", "64", "--max-windows", "6", "--json").stdout)
    assert base["num_windows"] == 6
    assert base["perplexity"] < quant["perplexity"] < 2 * base["perplexity"]


def test_quantize_int8_matches_fake_quant_eval(tiny_llama_dir, corpus_files, tmp_path):
    out = api.quantize(tiny_llama_dir, "weight_only_int8", tmp_path / "w8")
    base = api.evaluate(tiny_llama_dir, text_file=corpus_files / "heldout.txt", seq_len=64, max_windows=4)
    q = api.evaluate(out, text_file=corpus_files / "heldout.txt", seq_len=64, max_windows=4)
    assert q["perplexity"] != base["perplexity"]
    assert abs(q["perplexity"] / base["perplexity"] - 1) < 0.02


def test_quantize_asym_float_zero_points(tiny_llama_dir, corpus_files, tmp_path):
    from quantspec.quant.artifact import load_safetensors

    out = tmp_path / "fzp"
    r = _run("quantize", "--model", tiny_llama_dir, "--quant-type", "weight_only_int4",
             "--group-size", "32", "--asym", "--zp-dtype", "float16", "--target", "quantspec", "--out", out)
    assert r.exit_code == 0, r.output
    w = json.loads((out / "config.json").read_text())["quantization_config"]["config_groups"][
        "group_0"]["weights"]
    assert w["symmetric"] is False and w["zp_dtype"] == "torch.float16"
    t = load_safetensors(out)
    zp = t["model.layers.0.mlp.down_proj.weight_zero_point"]
    scale = t["model.layers.0.mlp.down_proj.weight_scale"]
    assert zp.dtype == torch.float16 and zp.shape == scale.shape  # unpacked [N, K/32]
    assert read_quant_config(out).provenance["args"]["zp_dtype"] == "float16"
    info = api.inspect(out)
    assert {d["zp_dtype"] for d in info["layers"].values()} == {"float16"}
    r = _run("inspect", out)
    assert r.exit_code == 0 and "float16" in r.output and "zero point" in r.output
    ev = json.loads(_run("eval", "--model", out, "--text-file", corpus_files / "heldout.txt",
                         "--seq-len", "64", "--max-windows", "2", "--json").stdout)
    assert ev["perplexity"] > 1
    # integer zero points are the default and say so
    assert api.inspect(api.quantize(tiny_llama_dir, "weight_only_int4", tmp_path / "izp",
                                    symmetric=False))["layers"][
        "model.layers.0.mlp.down_proj"]["zp_dtype"] == "int"


def test_quantize_fp8_blocks(tiny_qwen2_dir, tmp_path):
    """`--weight-block 128` on a model too small for 128: every Linear gets the largest power-of-two
    block that tiles it and its fused unit (q/k/v, gate/up: one block), inputs in groups of the
    block's width; the scales are per block; inspect and the engines' verdicts say so."""
    from quantspec.quant.artifact import load_safetensors
    from quantspec.quant.engines import FUSED_LAYERS

    out = tmp_path / "blocks"
    r = _run("quantize", "--model", tiny_qwen2_dir, "--quant-type", "a8w8_fp8", "--weight-block", "128", "--out", out)
    assert r.exit_code == 0, r.output
    qc, t = read_quant_config(out), load_safetensors(out)
    info = api.inspect(out)
    assert info["layers"] and all(d["strategy"] == "block" for d in info["layers"].values())
    for name, d in info["layers"].items():
        side = d["block"][0]
        N, K = t[f"{name}.weight"].shape
        assert d["block"] == [side, side] and N % side == 0 and K % side == 0, (name, d, N, K)
        assert t[f"{name}.weight_scale"].shape == (N // side, K // side)
        ia = qc.scheme_for(name).input_activations
        assert (ia.strategy, ia.group_size, ia.dynamic) == ("group", side, True)
    units = [[n] for n in info["layers"] if not n.endswith(tuple(s for ss in FUSED_LAYERS.values() for s in ss))]
    units += [[f"model.layers.{i}.{'self_attn' if 'q_proj' in ss else 'mlp'}.{s}" for s in ss]
              for i in range(2) for ss in FUSED_LAYERS.values()]
    for unit in units:  # one block per unit: the largest that tiles every member
        dims = [d for n in unit for d in t[f"{n}.weight"].shape]
        want = max(b for b in (16, 32, 64, 128) if all(d % b == 0 for d in dims))
        assert {info["layers"][n]["block"][0] for n in unit} == {want}, (unit, want)
    assert all(v["status"] == "loads" for v in info["engines"].values()), info["engines"]
    r = _run("inspect", out)
    assert r.exit_code == 0 and "block 32×32" in r.output


def test_quantize_nvfp4(tiny_llama_dir, calibration_table, corpus_files, tmp_path):
    """`--quant-type nvfp4 --calib T`: NVFP4 weights with one weight global scale per fused unit
    (the largest of its weights' ranges: 448 · 6 / max |w|), each input's global scale 448 · 6 /
    its calibrated absmax; inspect shows the groups of 16; the artifact runs."""
    from quantspec.calib.tables import read_table
    from quantspec.quant.artifact import load_safetensors
    from quantspec.quant.fp4 import global_scale_from_absmax

    table = calibration_table(tiny_llama_dir)
    out = tmp_path / "nvfp4"
    r = _run("quantize", "--model", tiny_llama_dir, "--quant-type", "nvfp4", "--calib", table, "--out", out)
    assert r.exit_code == 0, r.output
    t, absmax = load_safetensors(out), read_table(table)
    src = load_safetensors(tiny_llama_dir)
    for unit in (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"), ("o_proj",), ("down_proj",)):
        part = "self_attn" if unit[0] in ("q_proj", "o_proj") else "mlp"
        names = [f"model.layers.1.{part}.{u}" for u in unit]
        want = global_scale_from_absmax(torch.stack([src[f"{n}.weight"].float().abs().amax() for n in names]))
        for n in names:
            assert torch.equal(t[f"{n}.weight_global_scale"], want), n
            assert torch.equal(t[f"{n}.input_global_scale"], global_scale_from_absmax(absmax.input_absmax(n)))
            N, K = src[f"{n}.weight"].shape
            assert t[f"{n}.weight_packed"].shape == (N, K // 2) and t[f"{n}.weight_scale"].shape == (N, K // 16)
    info = api.inspect(out)
    assert info["quant_type"] == "nvfp4" and info["format"] == "nvfp4-pack-quantized"
    assert {(d["strategy"], d["group_size"]) for d in info["layers"].values()} == {("tensor_group", 16)}
    r = _run("inspect", out)
    assert r.exit_code == 0 and "tensor_group 16" in r.output
    ev = json.loads(_run("eval", "--model", out, "--text-file", corpus_files / "heldout.txt",
                         "--seq-len", "64", "--max-windows", "2", "--json").stdout)
    assert ev["perplexity"] > 1
    # GPTQ rounds NVFP4 too: the same global scales, other codes, recorded as the method
    gq = tmp_path / "nvfp4_gptq"
    r = _run("quantize", "--model", tiny_llama_dir, "--quant-type", "nvfp4", "--calib", table, "--method", "gptq",
             "--dataset", corpus_files / "calib.jsonl", "--num-samples", "4", "--seq-len", "32", "--out", gq)
    assert r.exit_code == 0, r.output
    g = load_safetensors(gq)
    assert all(torch.equal(g[k], t[k]) for k in t if k.endswith("global_scale"))
    assert not torch.equal(g["model.layers.1.mlp.down_proj.weight_packed"], t["model.layers.1.mlp.down_proj.weight_packed"])
    assert api.inspect(gq)["method"] == "gptq"


@pytest.mark.parametrize("quant_type", ["weight_only_mxfp4", "mxfp4", "a8w4_mxfp4", "weight_only_mxfp8", "mxfp8"])
def test_quantize_mx(tiny_llama_dir, corpus_files, tmp_path, quant_type):
    """`--quant-type weight_only_mxfp4 | mxfp4 | a8w4_mxfp4 | weight_only_mxfp8 | mxfp8`: E2M1 codes
    two a byte (E4M3 codes a byte) and one E8M0 exponent per group of 32 — compressed-tensors'
    power-of-two rule on the source weights, no global scale and nothing calibrated; inspect shows
    the groups of 32; a8w4_mxfp4's FP8 input groups of 128 shrink to tile each layer's K; GPTQ
    rounds them too; the artifact runs."""
    from quantspec.quant.artifact import load_safetensors
    from quantspec.quant.fp4 import mx_exponents, pack_fp4, round_to_e2m1

    fp8 = quant_type.endswith("mxfp8")
    out = tmp_path / quant_type
    target = "vllm" if fp8 else "quantspec"
    r = _run("quantize", "--model", tiny_llama_dir, "--quant-type", quant_type, "--target", target, "--out", out)
    assert r.exit_code == 0, r.output
    t, src = load_safetensors(out), load_safetensors(tiny_llama_dir)
    assert not any(k.endswith(("global_scale", "input_scale")) for k in t)
    n = "model.layers.1.mlp.down_proj"
    W = src[f"{n}.weight"]
    Wg = W.unflatten(-1, (-1, 32))
    e = mx_exponents(Wg.abs().amax(-1), 8 if fp8 else 2)
    assert t[f"{n}.weight_scale"].dtype == torch.uint8 and torch.equal(t[f"{n}.weight_scale"], e)
    s = (2.0 ** (e.float() - 127)).to(W.dtype).unsqueeze(-1)
    codes = f"{n}.weight" if fp8 else f"{n}.weight_packed"
    want = (Wg / s).clamp(-448, 448).to(torch.float8_e4m3fn).flatten(1).view(torch.uint8) if fp8 else \
        pack_fp4(round_to_e2m1((Wg / s).clamp(-6, 6)).flatten(1))
    assert torch.equal(t[codes].view(torch.uint8), want)
    info = api.inspect(out)
    assert info["quant_type"] == quant_type
    assert info["format"] == ("mxfp8-quantized" if fp8 else "mxfp4-pack-quantized")
    assert {(d["strategy"], d["group_size"]) for d in info["layers"].values()} == {("group", 32)}
    if quant_type in ("mxfp4", "mxfp8"):  # the inputs' groups: the weights' own
        assert {d["input_activations"] for d in info["layers"].values()} == {f"float{8 if fp8 else 4} group 32 dynamic"}
    if quant_type == "a8w4_mxfp4":
        qc = read_quant_config(out)
        for name, w in src.items():
            ia = qc.scheme_for(name[:-len(".weight")]).input_activations if name.endswith("proj.weight") else None
            if ia is not None:
                K = w.shape[1]
                assert (ia.type, ia.strategy, ia.dynamic) == ("float", "group", True)
                assert ia.group_size == next(g for g in (128, 64, 32) if K % g == 0), (name, K, ia)
                layer = info["layers"][name[:-len(".weight")]]
                assert layer["input_activations"] == f"float8 group {ia.group_size} dynamic", layer
    ev = json.loads(_run("eval", "--model", out, "--text-file", corpus_files / "heldout.txt",
                         "--seq-len", "64", "--max-windows", "2", "--json").stdout)
    assert ev["perplexity"] > 1
    gq = tmp_path / f"{quant_type}_gptq"
    r = _run("quantize", "--model", tiny_llama_dir, "--quant-type", quant_type, "--method", "gptq", "--target", target,
             "--dataset", corpus_files / "calib.jsonl", "--num-samples", "4", "--seq-len", "32", "--out", gq)
    assert r.exit_code == 0, r.output
    assert not torch.equal(load_safetensors(gq)[codes].view(torch.uint8), t[codes].view(torch.uint8))


@pytest.mark.parametrize("quant_type,group", [("weight_only_nvfp4", 16), ("weight_only_mxfp4", 32),
                                              ("weight_only_mxfp8", 32)])
def test_fp4_layer_whose_k_takes_no_group_is_one_line(tmp_path, quant_type, group):
    from quantspec.model_zoo.tiny import build_tiny_model

    model = build_tiny_model(tmp_path / "k72", "llama", hidden=72, heads=4, kv_heads=2, intermediate=128)
    with pytest.raises(QuantSpecError, match=rf"groups of {group} do not tile K=72; add --ignore model\.layers\.0\.self_attn\.q_proj"):
        api.quantize(str(model), quant_type, tmp_path / "out", target="quantspec")
    assert not (tmp_path / "out").exists()


def test_quantize_mse_weight_observer(tiny_llama_dir, corpus_files, tmp_path):
    """--weight-observer mse: recorded as the weights' observer, the stored scales are the MSE
    search's on each weight (never worse than min/max on its error), and the artifact runs."""
    from quantspec.model_zoo.checkpoint import load_model
    from quantspec.quant.artifact import load_safetensors
    from quantspec.quant.primitives import fake_quantize, mse_qparams

    out = tmp_path / "mse"
    r = _run("quantize", "--model", tiny_llama_dir, "--quant-type", "weight_only_int4",
             "--group-size", "32", "--weight-observer", "mse", "--out", out)
    assert r.exit_code == 0, r.output
    qc = read_quant_config(out)
    w_args = next(iter(qc.config_groups.values())).weights
    assert w_args.observer == "mse" and qc.provenance["args"]["weight_observer"] == "mse"
    model, _ = load_model(tiny_llama_dir)
    w = model.model.layers[0].mlp.down_proj.weight.detach()
    s, z = mse_qparams(w, w_args)
    stored = load_safetensors(out)["model.layers.0.mlp.down_proj.weight_scale"]
    torch.testing.assert_close(stored.float(), s.to(stored.dtype).float(), rtol=0, atol=0)
    plain = w_args.replace(observer=None)
    from quantspec.quant import choose_qparams

    s0, z0 = choose_qparams(w, plain)
    e = lambda sc, zp: float((fake_quantize(w, sc, zp, plain) - w).abs().pow(2.4).sum())
    assert e(s, z) < e(s0, z0)
    ev = json.loads(_run("eval", "--model", out, "--text-file", corpus_files / "heldout.txt",
                         "--seq-len", "64", "--max-windows", "1", "--json").stdout)
    assert ev["perplexity"] > 1 and ev["perplexity"] != float("inf")
    bad = CliRunner().invoke(main, ["quantize", "--model", str(tiny_llama_dir), "--quant-type",
                                    "weight_only_int8", "--weight-observer", "median", "--out",
                                    str(tmp_path / "x")])
    assert bad.exit_code == 2 and "median" in bad.output
    with pytest.raises(QuantSpecError, match="unknown --weight-observer"):
        api.quantize(tiny_llama_dir, "weight_only_int8", tmp_path / "y", weight_observer="median")


def test_bad_input_one_line(tiny_llama_dir, corpus_files, tmp_path):
    r = _run("quantize", "--model", tiny_llama_dir, "--quant-type", "int3", "--out", tmp_path / "x")
    assert r.exit_code == 2 and "weight_only_int8" in r.output and "Traceback" not in r.output
    r = _run("quantize", "--model", tiny_llama_dir, "--quant-type", "weight_only_int4", "--method", "gptq",
             "--out", tmp_path / "x")
    assert r.exit_code == 2 and "--dataset" in r.output
    r = _run("quantize", "--model", tiny_llama_dir, "--quant-type", "weight_only_int4", "--method", "gptq",
             "--dataset", corpus_files / "empty.jsonl", "--out", tmp_path / "x")
    assert r.exit_code == 2 and "empty" in r.output
    r = _run("quantize", "--model", tiny_llama_dir, "--quant-type", "weight_only_int4", "--method", "gptq",
             "--dataset", corpus_files / "calib.jsonl", "--text-field", "body", "--out", tmp_path / "x")
    assert r.exit_code == 2 and "body" in r.output and "text" in r.output
    r = _run("quantize", "--model", tiny_llama_dir, "--quant-type", "a8w8", "--out", tmp_path / "x")
    assert r.exit_code == 2 and "calibrate" in r.output
    r = _run("quantize", "--model", tiny_llama_dir, "--quant-type", "weight_only_int4",
             "--zp-dtype", "float16", "--out", tmp_path / "x")
    assert r.exit_code == 2 and "--asym" in r.output and len(r.output.strip().splitlines()) == 1
    r = _run("quantize", "--model", tiny_llama_dir, "--quant-type", "weight_only_int8", "--asym",
             "--zp-dtype", "float16", "--out", tmp_path / "x")
    assert r.exit_code == 2 and "weight_only_int4 only" in r.output
    r = _run("quantize", "--model", tiny_llama_dir, "--quant-type", "weight_only_int4", "--asym",
             "--zp-dtype", "float64", "--out", tmp_path / "x")
    assert r.exit_code == 2 and "float16" in r.output and "Traceback" not in r.output
    assert not (tmp_path / "x").exists()
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep.txt").write_text("mine")
    r = _run("quantize", "--model", tiny_llama_dir, "--quant-type", "weight_only_int8", "--out", busy)
    assert r.exit_code == 2 and "--overwrite" in r.output
    assert (busy / "keep.txt").read_text() == "mine"
    r = _run("eval", "--model", tiny_llama_dir)
    assert r.exit_code == 2 and "--text-file" in r.output


def test_crash_midway_leaves_destination_untouched(tiny_llama_dir, tmp_path):
    out = api.quantize(tiny_llama_dir, "weight_only_int8", tmp_path / "art")
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def boom(i, n, phase):
        if i == 1:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        api.quantize(tiny_llama_dir, "weight_only_int4", out, overwrite=True, progress=boom)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert [p.name for p in tmp_path.iterdir()] == ["art"]  # no temp dirs left behind
    # and the overwrite does replace it when it completes
    api.quantize(tiny_llama_dir, "weight_only_int4", out, overwrite=True)
    assert read_quant_config(out).quant_type.value == "weight_only_int4"
    with pytest.raises(QuantSpecError, match="not empty"):
        api.quantize(tiny_llama_dir, "weight_only_int8", out)


@pytest.mark.slow
def test_default_model_int8_smoke(tmp_path):
    """SmolLM2-135M: int8 RTN artifact evaluates within 2% of fp32 on one 256-token window."""
    from pathlib import Path

    text = Path(__file__).parents[1] / "bench" / "data" / "heldout.txt"
    out = api.quantize("smollm2-135m", "weight_only_int8", tmp_path / "w8")
    info = api.inspect(out)
    assert 2.0 < info["compression_ratio"] < 3.0  # fp32 embeddings stay; linears 4x smaller
    base = api.evaluate("smollm2-135m", text_file=text, seq_len=256, max_windows=1)
    q = api.evaluate(out, text_file=text, seq_len=256, max_windows=1)
    assert q["perplexity"] != base["perplexity"]
    assert abs(q["perplexity"] / base["perplexity"] - 1) < 0.02


def test_quantize_an_mtp_module_on_its_own(tiny_llama_dir, tmp_path):
    """`quantspec quantize --model smol.mtp/ --quant-type weight_only_int8` (issue: the draft or MTP
    module is quantized independently); AWQ, which folds factors into the base's layers, is refused."""
    from quantspec.infer.spec.mtp import load_mtp_for_inference
    from quantspec.model_zoo.checkpoint import load_model
    from quantspec.model_zoo.mtp import save_mtp
    from quantspec.model_zoo.mtp_train import init_mtp

    base, _ = load_model(tiny_llama_dir)
    mtp_dir = tmp_path / "mtp"
    save_mtp(init_mtp(base, torch.arange(base.args.vocab_size), seed=0), mtp_dir)
    res = CliRunner().invoke(main, ["quantize", "--model", str(mtp_dir), "--quant-type", "weight_only_int8",
                                    "--target", "quantspec", "--out", str(tmp_path / "mtp.w8")])
    assert res.exit_code == 0, res.output
    qc = read_quant_config(tmp_path / "mtp.w8")
    assert qc.scheme_for("model.layers.0.mlp.down_proj") is not None
    mtp = load_mtp_for_inference(str(tmp_path / "mtp.w8"), base)
    assert type(mtp.model.layers[0].mlp.down_proj).__name__ == "QuantLinear"
    res = CliRunner().invoke(main, ["quantize", "--model", str(mtp_dir), "--quant-type", "weight_only_int4",
                                    "--target", "quantspec", "--method", "awq", "--dataset", str(tmp_path),
                                    "--out", str(tmp_path / "g")])
    assert res.exit_code == 2
    assert "is an MTP module: quantize it with --method rtn or gptq" in res.output


def test_inspect_judges_the_serving_gpu(tiny_llama_dir, tmp_path):
    """`inspect --compute-capability`: the engines' verdicts for that GPU. FP8 inputs below 8.9 run as
    FP8 weights alone in both engines (the inputs' quantization set aside), SGLang's FP8 weight-only
    layers need Ampere; the default is Hopper (9.0)."""
    art = api.quantize(str(tiny_llama_dir), "a8w8_fp8", tmp_path / "fp8", activations="dynamic")
    status = {cap: {e: v["status"] for e, v in api.inspect(art, compute_capability=cap)["engines"].items()}
              for cap in (None, "9.0", "8.0", "7.5")}
    assert status[None] == status["9.0"] and status["9.0"]["vllm"] == status["9.0"]["sglang"] == "loads"
    assert status["8.0"]["vllm"] == status["8.0"]["sglang"] == "ignores"
    assert (status["7.5"]["vllm"], status["7.5"]["sglang"]) == ("ignores", "refused")
    r = _run("inspect", art, "--compute-capability", "8.0")
    assert r.exit_code == 0 and "compute capability 8.0" in r.output and "FP8 input quantization" in r.output
    assert api.inspect(art)["compute_capability"] == "9.0"


@pytest.mark.parametrize("args,gpu,own,refusal,fix", [
    (("a8w8_fp8", "--activations", "dynamic", "--target", "sglang"), "8.0", "9.0",
     "ignores FP8 input quantization below compute capability 8.9", "--quant-type weight_only_fp8"),
    (("weight_only_fp8",), "7.5", "8.0", "SGLang refused because FP8 weights below compute capability 8.0",
     "--target vllm"),
    (("weight_only_mxfp8", "--target", "vllm"), "10.0", "9.0", "vLLM's MXFP8 code asks for MXFP8 inputs",
     "--quant-type mxfp8"),
    (("mxfp8", "--target", "vllm"), "9.0", "10.0", "MXFP8 input quantization below compute capability 10.0",
     "--quant-type weight_only_mxfp8"),
    (("a8w4_mxfp4", "--target", "vllm"), "8.0", "8.9", "FP8 inputs to MXFP4 weights below compute capability 8.9",
     "--quant-type weight_only_mxfp4"),
])
def test_quantize_target_judges_the_serving_gpu(tiny_llama_dir, tmp_path, args, gpu, own, refusal, fix):
    """`quantize --compute-capability X.Y`: `--target` is judged for that GPU before any work, the
    refusal naming it and the type that writes what its kernels run; the same options pass on a GPU
    whose kernels run them as written (`own`), which the provenance records."""
    out = tmp_path / "q"
    r = _run("quantize", "--model", tiny_llama_dir, "--quant-type", *args, "--compute-capability", gpu, "--out", out)
    assert r.exit_code == 2 and refusal in r.output and fix in r.output, r.output
    assert f"on compute capability {gpu}" in r.output and len(r.output.strip().splitlines()) == 1
    assert not out.exists()
    r = _run("quantize", "--model", tiny_llama_dir, "--quant-type", *args, "--compute-capability", own, "--out", out)
    assert r.exit_code == 0, r.output
    assert read_quant_config(out).provenance["args"]["compute_capability"] == own
