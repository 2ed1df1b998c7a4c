"""Static scales of draft modules (`calib.draft_scales`): `calibrate --model HEAD` measures the
ranges each module reads while it drafts on its base (transformers' hidden states and rotary
embedding of the base as the reference), `quantize --quant-type a8w8 --calib` writes them as the
table holds them, an EAGLE-3 head's `--kv-cache` scales become its drafting cache's (int8 / fp8
codes), and speculation with such a head stays lossless."""

import json

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from quantspec import api
from quantspec.cli import main
from quantspec.errors import QuantSpecError
from quantspec.model_zoo.tiny import TINY_CORPUS
from quantspec.quant.primitives import scale_from_absmax

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    from test_awq import _outlier_model

    return _outlier_model(tmp_path_factory.mktemp("outlier"))


@pytest.fixture(scope="module")
def base(base_dir):
    from quantspec.model_zoo.checkpoint import load_model

    return load_model(base_dir)[0]


@pytest.fixture(scope="module")
def modules(base, base_dir, tmp_path_factory):
    from test_draft_calib import draft_modules

    return draft_modules(base, base_dir, tmp_path_factory.mktemp("drafts"))


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "calib.txt"
    path.write_text(TINY_CORPUS)
    return path


@pytest.fixture(scope="module")
def tables(modules, base_dir, data, tmp_path_factory):
    """kind → the table `calibrate` writes for it (minmax for K/V too), on its base."""
    root = tmp_path_factory.mktemp("tables")
    return {k: api.calibrate(str(path), str(data), root / k, num_samples=3, seq_len=24, kv_observer="minmax",
                             base=str(base_dir)).path for k, (path, _) in modules.items()}


def _windows(data, base_dir, n=3, seq_len=24):
    from transformers import AutoTokenizer

    from quantspec.calib.data import build_calibration_batches, load_calibration_texts

    tok = AutoTokenizer.from_pretrained(str(base_dir))
    return build_calibration_batches(load_calibration_texts(str(data)), tok, n, seq_len, 0)


def _absmax(xs):
    x = torch.cat([t.reshape(-1, t.shape[-1]) for t in xs])
    return x.abs().amax(0)


def test_eagle3_table_is_of_the_states_the_head_reads(modules, tables, base, base_dir, data):
    """From transformers' forward of the base: fc reads the aux streams side by side, lm_head each
    draft's normed output, and the head's cache the keys transformers' rotary embedding gives its
    k_proj outputs at the drafts' positions (row p of draft s at p + s) and the v_proj outputs."""
    from test_draft_calib import _hf_streams
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    from quantspec.model_zoo.eagle3_train import ttt_outputs

    path, load = modules["eagle3"]
    head = load(path).bind_embedding(base.model.embed_tokens)
    windows = _windows(data, base_dir)
    feats = [torch.cat([*entering, last], dim=-1)[:-1] for entering, last, _ in _hf_streams(base_dir, windows)]
    attn, seen = head.midlayer.self_attn, {"k": [], "v": []}
    hooks = [getattr(attn, f"{n}_proj").register_forward_hook(lambda _m, _a, out, n=n: seen[n].append(out))
             for n in "kv"]
    with torch.no_grad():
        drafts = [head.norm(h) for w, f in zip(windows, feats) for h in ttt_outputs(head, w, f, 4)]
    for h in hooks:
        h.remove()
    cfg = LlamaConfig(**json.loads((path / "config.json").read_text()))
    rope, KV, hd = LlamaRotaryEmbedding(cfg), attn.num_kv_heads, attn.head_dim
    keys = []
    for i, k in enumerate(seen["k"]):  # per window, 4 drafts: positions p + s
        n, s = k.shape[0], i % 4
        cos, sin = rope(k, torch.arange(n)[None] + s)
        k4 = k.view(1, n, KV, hd).transpose(1, 2)
        keys.append(apply_rotary_pos_emb(k4, k4, cos, sin)[0][0].transpose(0, 1))
    t = load_file(str(tables["eagle3"] / "scales.safetensors"))
    meta = json.loads((tables["eagle3"] / "calibration.json").read_text())
    assert meta["draft"]["kind"] == "eagle3" and meta["draft"]["base"] == str(base_dir)
    want = {"fc": _absmax(feats), "lm_head": _absmax(drafts)}
    for name, ch in want.items():
        torch.testing.assert_close(t[f"{name}.input_channel_absmax"], ch, rtol=1e-4, atol=1e-5, msg=name)
        torch.testing.assert_close(t[f"{name}.input_absmax"], ch.amax(), rtol=1e-4, atol=1e-5, msg=name)
    k_ref = torch.stack([k.abs().amax(dim=(0, 2)) for k in keys]).amax(0)
    v_ref = torch.stack([v.view(v.shape[0], KV, hd).abs().amax(dim=(0, 2)) for v in seen["v"]]).amax(0)
    torch.testing.assert_close(t["midlayer.self_attn.k_absmax"], k_ref, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(t["midlayer.self_attn.v_absmax"], v_ref, rtol=1e-4, atol=1e-5)
    assert torch.equal(t["midlayer.self_attn.q_proj.input_absmax"], t["midlayer.self_attn.v_proj.input_absmax"])


def test_medusa_and_mtp_tables_are_of_their_inputs(modules, tables, base, base_dir, data):
    """Each Medusa head's first ResBlock reads the final-normed states; an MTP module's eh_proj the
    normed next-token embedding beside the normed pre-norm state, then beside its own output.
    Neither has K/V entries: neither keeps a KV cache."""
    from test_draft_calib import _hf_streams, mtp_eh_inputs

    windows = _windows(data, base_dir)
    hf = _hf_streams(base_dir, windows)
    mtp = modules["mtp"][1](modules["mtp"][0])
    ins = mtp_eh_inputs(mtp, base, windows, hf)
    medusa = load_file(str(tables["medusa"] / "scales.safetensors"))
    torch.testing.assert_close(medusa["medusa_head.0.0.linear.input_channel_absmax"], _absmax([n for *_, n in hf]),
                               rtol=1e-4, atol=1e-5)
    assert torch.equal(medusa["medusa_head.1.0.linear.input_absmax"], medusa["medusa_head.0.0.linear.input_absmax"])
    got = load_file(str(tables["mtp"] / "scales.safetensors"))
    torch.testing.assert_close(got["model.eh_proj.input_channel_absmax"], _absmax(ins), rtol=1e-4, atol=1e-5)
    assert not any(k.endswith(("k_absmax", "v_absmax")) for k in [*medusa, *got])


def _static_errors(module, base, windows, table, kind):
    """Each Linear's static-input error, from scratch: mean over the tokens it reads while drafting
    of ||q(x)·Ŵᵀ − x·Ŵᵀ||² / ||x·Ŵᵀ||², q per tensor at the table's scale, Ŵ per output channel."""
    from quantspec.calib.draft_calib import draft_passes

    xs = {}
    hooks = [m.register_forward_pre_hook(lambda _m, a, n=n: xs.setdefault(n, []).append(a[0].reshape(-1, a[0].shape[-1])))
             for n, m in module.named_modules() if isinstance(m, torch.nn.Linear)]
    with torch.no_grad():
        for _ in draft_passes(module, base, windows):
            pass
    for h in hooks:
        h.remove()
    top = 127.5 if kind == "int8" else 448.0  # absmax / top: the scale of an 8-bit grid (`scale_from_absmax`)

    def q(t, s):
        t = t / s
        return (t.round().clamp(-128, 127) if kind == "int8" else t.clamp(-448, 448).to(torch.float8_e4m3fn).float()) * s

    out = {}
    for n, parts in xs.items():
        x, w = torch.cat(parts).float(), module.get_submodule(n).weight.detach().float()
        wq = q(w, w.abs().amax(1, keepdim=True) / top)
        s = table[f"{n}.input_absmax"] / top
        y = x @ wq.T
        out[n] = float((((q(x, s) @ wq.T - y) ** 2).sum(1) / (y ** 2).sum(1).clamp_min(1e-30)).mean())
    return out


@pytest.mark.parametrize("kind,quant_type", [("eagle3", "a8w8"), ("medusa", "a8w8_fp8"), ("mtp", "a8w8")])
def test_static_artifact_holds_the_table_scales(modules, tables, base, tmp_path, kind, quant_type):
    """Every static Linear's input_scale is its table absmax on the type's grid (q / k / v alike:
    the engines fuse them); the units whose static inputs cost more than the threshold (here the
    median of the errors measured from scratch on the table's windows) keep float inputs, whole;
    the artifact loads for inference."""
    from quantspec.calib.static_plan import fused_unit

    path, load = modules[kind]
    table = load_file(str(tables[kind] / "scales.safetensors"))
    grid = "fp8" if quant_type == "a8w8_fp8" else "int8"
    meta = json.loads((tables[kind] / "calibration.json").read_text())
    base_dir = meta["draft"]["base"]
    errors = _static_errors(load(path), base, _windows(meta["dataset"], base_dir, 3, 24), table, grid)
    if kind == "eagle3":
        errors.pop("lm_head")  # float in an EAGLE-3 head: the engines' heads are
    ranked = sorted(errors.values())
    threshold = (ranked[len(ranked) // 2 - 1] + ranked[len(ranked) // 2]) / 2  # between two: no near-ties
    out = api.quantize(str(path), quant_type, tmp_path / "q", calib=str(tables[kind]), target="quantspec",
                       fallback_threshold=threshold, search_samples=3, smoothquant_alpha="none")
    plan = json.loads((out / "quantspec.json").read_text())["provenance"]["calibration"]["static_plan"]
    for n, e in errors.items():
        assert plan["sensitivity"][n] == pytest.approx(e, rel=1e-3, abs=1e-6), n
    want = {m for n, e in errors.items() if e > threshold for m in fused_unit(n)}
    assert want and set(plan["fallback_layers"]) == want and len(want) < len(errors)
    t = load_file(str(out / "model.safetensors"))
    scales = {k[: -len(".input_scale")]: v for k, v in t.items() if k.endswith(".input_scale")}
    assert set(scales) == set(errors) - want
    for name, s in scales.items():
        torch.testing.assert_close(s.float().reshape(()), scale_from_absmax(table[f"{name}.input_absmax"], grid)
                                   .reshape(()), msg=name)
    prov = json.loads((out / "quantspec.json").read_text())["provenance"]
    assert prov["calibration"]["calibration"]["draft"]["kind"] == kind
    assert not any(k.endswith(("k_scale", "v_scale")) for k in t)
    r = CliRunner().invoke(main, ["inspect", str(out)])
    assert r.exit_code == 0 and "fallback (weight-only)" in r.output, r.output


def test_inspect_names_every_fallback_unit_of_a_head(modules, tables, tmp_path):
    """Every unit above a threshold of 0 keeps float inputs: `inspect` names each, `fc` (a Linear
    outside the head's layer) as it is."""
    out = api.quantize(str(modules["eagle3"][0]), "a8w8", tmp_path / "q", calib=str(tables["eagle3"]),
                       target="vllm", fallback_threshold=0.0)
    r = CliRunner(env={"COLUMNS": "400"}).invoke(main, ["inspect", str(out)])
    assert r.exit_code == 0, r.output
    assert "fc (" in r.output and "midlayer.self_attn.q_proj/k_proj/v_proj (" in r.output


@pytest.mark.parametrize("kind,groups", [("eagle3", (("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj")),)),
                                         ("mtp", (("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj",
                                                                       "self_attn.v_proj")),
                                                  ("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj"))))])
def test_smoothquant_on_a_head_folds_the_table_factors(modules, tables, tmp_path, kind, groups):
    """At the default α (0.5) for int8 inputs, from scratch: s_j = max|X_j|^α / max|W_j|^(1-α) over
    the group's Linears (the table's per-channel ranges); the norm before the group holds γ / s, and
    each static Linear's input scale is max_j(max|X_j| / s_j) on the int8 grid."""
    path, load = modules[kind]
    module = load(path)
    prefix = "midlayer" if kind == "eagle3" else "model.layers.0"
    table = load_file(str(tables[kind] / "scales.safetensors"))
    out = api.quantize(str(path), "a8w8", tmp_path / "q", calib=str(tables[kind]), target="quantspec",
                       fallback_threshold=1e9)  # every unit static: each scale is checked
    t = load_file(str(out / "model.safetensors"))
    plan = json.loads((out / "quantspec.json").read_text())["provenance"]["calibration"]["static_plan"]
    assert plan["smoothquant_alphas"] == {"*": 0.5}
    layer = module.get_submodule(prefix)
    for norm, names in groups:
        x = table[f"{prefix}.{names[0]}.input_channel_absmax"]
        w = torch.stack([layer.get_submodule(n).weight.detach().abs().amax(0) for n in names]).amax(0)
        s = (x.clamp_min(1e-5) ** 0.5 / w.clamp_min(1e-5) ** 0.5).clamp_min(1e-5)
        torch.testing.assert_close(t[f"{prefix}.{norm}.weight"], getattr(layer, norm).weight.detach() / s,
                                   rtol=1e-4, atol=1e-6)
        for n in names:
            torch.testing.assert_close(t[f"{prefix}.{n}.input_scale"].reshape(()),
                                       scale_from_absmax((x / s).amax(), "int8").reshape(()), rtol=1e-5, atol=0)


def _greedy(base, prompts, proposer=None, k=0):
    from quantspec.infer.engine import Engine, EngineConfig
    from quantspec.infer.sampler import SamplingParams

    eng = Engine(base, EngineConfig(block_size=16, max_batch_size=len(prompts), max_length=96,
                                    spec_max_draft_tokens=k), eos_token_ids=[], proposer=proposer)
    seqs = [eng.add_request(p, SamplingParams(max_new_tokens=24)) for p in prompts]
    eng.run()
    return seqs


@pytest.mark.parametrize("kv", ["int8", "fp8"])
def test_eagle3_kv_cache_scales_are_the_tables_and_drafting_reads_codes(modules, tables, base, tmp_path, kv):
    """`quantize --model HEAD --quant-type a8w8 --calib T --kv-cache KV` (the CLI): k_scale / v_scale
    per KV head from the table; the loaded head's cache holds KV codes at those scales (what its
    attention reads is their dequantized values), and greedy output with it is plain decoding's."""
    from quantspec.infer.spec.eagle import EagleProposer, _HeadState, load_eagle3_for_inference
    from quantspec.quant.primitives import dequantize_kv, quantize_kv

    out = tmp_path / "h"
    r = CliRunner().invoke(main, ["quantize", "--model", str(modules["eagle3"][0]), "--quant-type", "a8w8",
                                  "--calib", str(tables["eagle3"]), "--kv-cache", kv, "--target", "quantspec",
                                  "--out", str(out)])
    assert r.exit_code == 0, r.output
    t, table = load_file(str(out / "model.safetensors")), load_file(str(tables["eagle3"] / "scales.safetensors"))
    for n in "kv":
        torch.testing.assert_close(t[f"midlayer.self_attn.{n}_scale"].reshape(-1),
                                   scale_from_absmax(table[f"midlayer.self_attn.{n}_absmax"], kv))
    head = load_eagle3_for_inference(str(out), base)
    assert head.kv_cache.kind == kv
    proposer, read = EagleProposer(head, max_draft_tokens=3), []
    sdpa = proposer._sdpa
    proposer._sdpa = lambda st, q, end, mask: read.append(st.k.dtype) or sdpa(st, q, end, mask)
    # what a write stores: the codes of k / v at the artifact's scales, read back dequantized
    a = head.args.layer
    st = _HeadState(torch.empty(0, a.num_kv_heads, a.head_dim, dtype=head.kv_cache.dtype),
                    torch.empty(0, a.num_kv_heads, a.head_dim, dtype=head.kv_cache.dtype))
    k, v = torch.randn(2, 5, a.num_kv_heads, a.head_dim).unbind(0)
    proposer._write(st, 0, k, v)
    assert torch.equal(st.k[:5].float(), quantize_kv(k, head.kv_cache.k_scale, kv).float())
    torch.testing.assert_close(head.kv_cache.load(st.k[:5], st.v[:5], torch.float32)[1],
                               dequantize_kv(quantize_kv(v, head.kv_cache.v_scale, kv), head.kv_cache.v_scale))
    prompts = torch.randint(3, 500, (2, 12), generator=torch.Generator().manual_seed(3)).tolist()
    seqs = _greedy(base, prompts, proposer, proposer.max_rows)
    assert [s.output_ids for s in seqs] == [s.output_ids for s in _greedy(base, prompts)]
    assert sum(s.stats.drafted for s in seqs) > 0
    assert read and set(read) == {torch.int8 if kv == "int8" else torch.float8_e4m3fn}


def test_refusals(modules, tables, base_dir, data, tmp_path):
    """A table of another module, --kv-cache on a module with no KV cache, SmoothQuant's α search
    or Medusa heads smoothed (no norm), a perplexity budget, --base on a base model, --rotate on a
    head: one line each, nothing written."""
    e3, medusa = str(modules["eagle3"][0]), str(modules["medusa"][0])
    cases = [
        (dict(model=medusa, quant_type="a8w8", calib=str(tables["eagle3"])), "calibration table .* was made for"),
        (dict(model=medusa, quant_type="a8w8", calib=str(tables["medusa"]), kv_cache="int8"), "--kv-cache"),
        (dict(model=e3, quant_type="a8w8", calib=str(tables["eagle3"]), smoothquant_alpha="auto"),
         "--smoothquant-alpha"),
        (dict(model=medusa, quant_type="a8w8", calib=str(tables["medusa"]), smoothquant_alpha=0.5), "no norm"),
        (dict(model=e3, quant_type="a8w8", calib=str(tables["eagle3"]), fallback_budget=1.0),
         "--a8w8-fallback-budget"),
        (dict(model=str(base_dir), quant_type="a8w8", calib=str(tables["eagle3"])), "calibration table .* was made for"),
    ]
    for i, (kw, match) in enumerate(cases):
        with pytest.raises(QuantSpecError, match=match):
            api.quantize(kw.pop("model"), kw.pop("quant_type"), tmp_path / f"q{i}", target="quantspec", **kw)
        assert not (tmp_path / f"q{i}").exists()
    with pytest.raises(QuantSpecError, match="--rotate"):
        api.calibrate(e3, str(data), tmp_path / "t1", num_samples=2, seq_len=16, rotate="R1")
    with pytest.raises(QuantSpecError, match="drop --base"):
        api.calibrate(str(base_dir), str(data), tmp_path / "t2", num_samples=2, seq_len=16, base=str(base_dir))
    assert not (tmp_path / "t1").exists() and not (tmp_path / "t2").exists()


def test_a_kv_cache_scheme_on_a_module_without_a_cache_is_refused_at_load(modules, tables, base, tmp_path):
    """Medusa heads keep no KV cache: an artifact that says otherwise is refused, not run."""
    from quantspec.infer.spec.medusa import load_medusa_for_inference

    out = api.quantize(str(modules["medusa"][0]), "a8w8", tmp_path / "m", calib=str(tables["medusa"]),
                       target="quantspec")
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"]["kv_cache_scheme"] = {"num_bits": 8, "type": "float", "symmetric": True,
                                                     "strategy": "tensor", "dynamic": False}
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(QuantSpecError, match="keep no KV cache"):
        load_medusa_for_inference(out, base)


@pytest.mark.parametrize("kind,quant_type,options", [("eagle3", "a8w8_fp8", dict(kv_cache="fp8", target="vllm")),
                                                     ("mtp", "a8w8", dict(target="quantspec"))])
def test_a_draft_module_calibrates_in_the_quantize_run(modules, base_dir, data, tmp_path, kind, quant_type, options):
    """`quantize --model HEAD --dataset D` without --calib (`calib.oneshot`): the module's table measured as it
    drafts on its base, the artifact of `calibrate --model HEAD` then `quantize --calib`."""
    path = str(modules[kind][0])
    opts = dict(options, num_samples=3, seq_len=24, base=str(base_dir), search_samples=3)
    one = api.quantize(path, quant_type, tmp_path / "one", dataset=str(data), **opts)
    table = api.calibrate(path, str(data), tmp_path / "table", num_samples=3, seq_len=24, base=str(base_dir)).path
    two = api.quantize(path, quant_type, tmp_path / "two", calib=str(table), dataset=str(data), **opts)
    a, b = load_file(str(one / "model.safetensors")), load_file(str(two / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not (one / "recipe.yaml").exists()  # llm-compressor has no draft modules
