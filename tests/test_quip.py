"""QuIP's run-time transforms (`quantize --quip`, `calib.quip`; read by `quant.transforms`, run by
`infer.transformed`).

The references are compressed-tensors' own: its `HadamardTransform` for the semantics of one
transform (location, `inverse`, normalization, block-diagonal `head_dim`), and its
`apply_transform_config` for whole models — transformers runs a quantspec QuIP artifact (which it
loads without the transforms) with compressed-tensors' hooks added for the run-time half, and
that must give quantspec's logits; transformers' float model with compressed-tensors' fused half
applied must give the weights the artifact quantized."""

import json

import pytest
import torch
from torch import nn

from quantspec import api
from quantspec.errors import QuantSpecError
from quantspec.model_zoo.checkpoint import read_config
from quantspec.model_zoo.llama import ModelArgs
from quantspec.model_zoo.tiny import TINY_CORPUS, build_tiny_model
from quantspec.calib.quip import fwht
from quantspec.quant.transforms import OnlineTransform, online_transforms, read_transform_config, sylvester

IDS = torch.tensor([1, 17, 254, 90, 3, 411, 77, 8, 150, 299, 42, 5])
VLLM = {"target": "vllm"}


def _online_only(tc: dict):
    """`tc` (a dumped `transform_config`) with only its run-time transforms, as compressed-tensors'
    own classes."""
    from compressed_tensors.transform import TransformConfig

    groups = {}
    for name, g in tc["config_groups"].items():
        apply = [a for a in g["apply"] if a["location"] in ("input", "output")]
        if apply:
            groups[name] = {**g, "apply": apply}
    return TransformConfig.model_validate({"config_groups": groups})


def _transformers_with_hooks(art):
    """transformers' model of `art` (which loads no transform) with compressed-tensors' hooks for
    the artifact's run-time transforms, their matrices compressed-tensors' own."""
    from compressed_tensors.transform import apply_transform_config
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(art), dtype=torch.float32).eval()
    apply_transform_config(model, _online_only(read_config(art)["quantization_config"]["transform_config"]))
    return model


def _quantspec_logits(art, **kw):
    from quantspec.infer.loader import load_for_inference
    from quantspec.model_zoo.llama import DenseCausalAttention

    net = load_for_inference(art, tokenizer=False, **kw).model
    T = IDS.numel()
    with torch.no_grad():
        return net.compute_logits(net(IDS, torch.arange(T), DenseCausalAttention.of(net.args, 1, T)))


def _apply(t: OnlineTransform, x: torch.Tensor) -> torch.Tensor:
    return (x.double().unflatten(-1, (-1, t.size)) @ t.dense()).flatten(-2).float()


# ---- one transform -------------------------------------------------------------------------------
def test_fwht_is_sylvesters_matrix_by_blocks():
    x = torch.randn(5, 3 * 32, dtype=torch.float64)
    ref = (x.unflatten(-1, (-1, 32)) @ sylvester(32).double()).flatten(-2) / 32 ** 0.5
    torch.testing.assert_close(fwht(x, 32), ref)
    torch.testing.assert_close(fwht(fwht(x, 32), 32), x)


@pytest.mark.parametrize("kind", ["hadamard", "random-hadamard"])
@pytest.mark.parametrize("location,inverse", [("input", False), ("input", True), ("output", True)])
@pytest.mark.parametrize("head_dim", [None, 16])
def test_one_transform_as_compressed_tensors_applies_it(kind, location, inverse, head_dim):
    from compressed_tensors.transform import TransformArgs, TransformConfig, TransformScheme
    from compressed_tensors.transform.factory.hadamard import HadamardTransform
    from compressed_tensors.transform.utils.hadamard import random_hadamard_matrix

    lin = nn.Linear(64, 64)
    size = head_dim or 64
    w = sylvester(size) if kind == "hadamard" else random_hadamard_matrix(size, torch.float32,
                                                                         gen=torch.Generator().manual_seed(0))
    scheme = TransformScheme(type=kind, head_dim=head_dim, apply=[
        TransformArgs(targets=["Linear"], location=location, inverse=inverse)])
    theirs = HadamardTransform(nn.Parameter(w.double(), requires_grad=False), None, scheme, scheme.apply[0],
                               nn.Linear)
    tc = json.loads(json.dumps(TransformConfig(config_groups={"t": scheme}).model_dump()))
    stored = {} if kind == "hadamard" else {f"lin.t_{location}.weight": w}
    plan, used = online_transforms(read_transform_config(tc, "x"), nn.ModuleDict({"lin": lin}), stored, "x")
    mine = plan["lin"][location]
    assert used == set(stored) and (mine.matrix is None) == (kind == "hadamard")
    x = torch.randn(3, 64)
    torch.testing.assert_close(_apply(mine, x), theirs(x), rtol=1e-5, atol=1e-5)


def test_a_permuted_transform_and_the_refusals():
    from compressed_tensors.transform import TransformArgs, TransformConfig, TransformScheme
    from compressed_tensors.transform.factory.hadamard import HadamardTransform

    lin = nn.ModuleDict({"lin": nn.Linear(32, 32), "emb": nn.Embedding(8, 32)})
    scheme = TransformScheme(type="hadamard", randomize=True, apply=[TransformArgs(targets=["re:lin"], location="input")])
    tc = json.loads(json.dumps(TransformConfig(config_groups={"v": scheme}).model_dump()))
    perm = torch.randperm(32, generator=torch.Generator().manual_seed(0))
    plan, _ = online_transforms(tc, lin, {"lin.v_input.weight": sylvester(32), "lin.v_input.perm": perm}, "x")
    theirs = HadamardTransform(nn.Parameter(sylvester(32).double()), nn.Parameter(perm, requires_grad=False), scheme,
                               scheme.apply[0], nn.Linear)
    x = torch.randn(2, 32)
    torch.testing.assert_close(_apply(plan["lin"]["input"], x), theirs(x), rtol=1e-5, atol=1e-5)
    with pytest.raises(QuantSpecError, match=r"lacks lin\.v_input\.weight.*incomplete"):
        online_transforms(tc, lin, {}, "x")  # randomized: its permutation is the checkpoint's
    bad = {"lin.v_input.weight": torch.ones(16, 16), "lin.v_input.perm": perm}
    with pytest.raises(QuantSpecError, match=r"has shape \(16, 16\) where .* needs \(32, 32\)"):
        online_transforms(tc, lin, bad, "x")
    emb = {"config_groups": {"v": {"type": "hadamard", "apply": [{"targets": ["Embedding"], "location": "output"}]}}}
    with pytest.raises(QuantSpecError, match="transforms the embedding emb at run time"):
        online_transforms(emb, lin, {}, "x")
    attn = {"config_groups": {"R3": {"type": "hadamard", "head_dim": 16, "apply": [
        {"targets": ["re:.*self_attn$"], "location": "q_attn"}]}}}
    with pytest.raises(QuantSpecError, match=r"at 'q_attn'.*transforms of Linears only"):
        read_transform_config(attn, "cfg")


# ---- whole models -------------------------------------------------------------------------------
@pytest.mark.parametrize("quant_type,quip,options", [
    ("weight_only_int8", "v,u", {}),
    ("weight_only_int4", "v", {"group_size": 32}),
    ("weight_only_int4", "v,u", {"group_size": -1, "quip_block_size": 16}),
    ("a8w8", "v,u", {"activations": "dynamic"}),
])
def test_quip_artifact_runs_as_compressed_tensors_runs_it(tmp_path, tiny_llama_dir, quant_type, quip, options):
    art = api.quantize(str(tiny_llama_dir), quant_type, tmp_path / "art", quip=quip, **VLLM, **options)
    mine = _quantspec_logits(art)
    with torch.no_grad():
        theirs = _transformers_with_hooks(art)(IDS[None]).logits[0]
        from transformers import AutoModelForCausalLM

        skipped = AutoModelForCausalLM.from_pretrained(str(art), dtype=torch.float32)(IDS[None]).logits[0]
    torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-4)
    assert (skipped - theirs).abs().max() > 1e-2  # without the transforms (SGLang, transformers): another model
    torch.testing.assert_close(_quantspec_logits(art, fuse=False), mine, rtol=1e-5, atol=1e-5)
    if quant_type == "weight_only_int8":  # 8 bits: the float model's function, up to a small quantization error
        ref = _quantspec_logits(tiny_llama_dir)
        assert (mine - ref).abs().max() < 0.05 * ref.abs().max()


def test_the_quantized_weights_are_compressed_tensors_turned_weights(tmp_path, tiny_llama_dir):
    """The fused half: compressed-tensors applies the artifact's config to transformers' float
    model; each turned weight, rounded per channel to int8, is what the artifact stores (within
    one step where float order differs at a rounding boundary)."""
    from compressed_tensors.transform import TransformConfig, apply_transform_config
    from transformers import AutoModelForCausalLM

    from quantspec.model_zoo.checkpoint import CheckpointReader, CheckpointTensors
    from quantspec.quant.compressed import read_quantized_linear
    from quantspec.quant.config import QuantConfig

    art = api.quantize(str(tiny_llama_dir), "weight_only_int8", tmp_path / "art", quip="v,u", **VLLM)
    tc = read_config(art)["quantization_config"]["transform_config"]
    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32)
    apply_transform_config(model, TransformConfig.model_validate(tc))
    stored, qc = CheckpointTensors(CheckpointReader(art)), QuantConfig.from_dict(read_config(art)["quantization_config"])
    turned = 0
    for name, mod in model.named_modules():
        if isinstance(mod, nn.Linear) and name.startswith("model.layers."):
            w = mod.weight.detach()
            got = read_quantized_linear(stored, name, qc.scheme_for(name), *w.shape)
            codes, scale = got.q.float(), got.scale.float()
            assert (codes * scale - w).abs().max() <= scale.max() * 0.51 + 1e-6
            assert (codes - torch.round(w / scale).clamp(-128, 127)).abs().max() <= 1
            turned += 1
    assert turned == 14 and "v_input" in dict(model.named_modules())["model.layers.0.self_attn.q_proj"]._modules
    a = [stored[n] for n in ("model.layers.0.self_attn.q_proj.v_input.weight",
                             "model.layers.0.mlp.down_proj.u_output.weight")]
    assert all(torch.equal(t.abs(), torch.ones_like(t)) for t in a)  # ±1, where vLLM reads them


def test_gptq_in_the_turned_basis(tmp_path, tiny_llama_dir):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TINY_CORPUS)
    opts = dict(method="gptq", dataset=str(corpus), num_samples=4, seq_len=32, group_size=32)
    art = api.quantize(str(tiny_llama_dir), "weight_only_int4", tmp_path / "art", quip="v", **VLLM, **opts)
    with torch.no_grad():
        theirs = _transformers_with_hooks(art)(IDS[None]).logits[0]
    torch.testing.assert_close(_quantspec_logits(art), theirs, rtol=1e-4, atol=1e-4)
    info = api.inspect(art)
    assert info["run_time_transforms"] == "v: hadamard 64, input"
    assert info["engines"]["vllm"]["status"] == "loads"
    for engine in ("sglang", "transformers"):
        assert "ignores the run-time transforms" in info["engines"][engine]["verdict"]
        assert any("vLLM or quantspec" in f for f in info["engines"][engine]["fixes"])
    args = ModelArgs.from_hf_config(read_config(art))
    assert args.rotation == ""  # the hidden states are the model's: draft heads stay matched


@pytest.mark.parametrize("options,match", [
    ({"quip": "v"}, "--quip writes transforms that run at run time, which SGLang skips.*--target vllm"),
    ({"quip": "w", **VLLM}, "--quip 'w': use v"),
    ({"quip": "v", "quip_block_size": 24, **VLLM}, "--quip-block-size 24: use a power of two"),
    ({"quip": "v", "quip_block_size": 256, **VLLM}, "--quip-block-size 256 does not divide"),
    ({"quip_block_size": 64}, "--quip-block-size sizes the transforms of --quip"),
    ({"quip": "v", "method": "awq", "dataset": "d.txt", **VLLM}, "--quip: AWQ's search"),
])
def test_bad_quip_requests(tmp_path, tiny_llama_dir, options, match):
    with pytest.raises(QuantSpecError, match=match):
        api.quantize(str(tiny_llama_dir), "weight_only_int4", tmp_path / "out", **options)
    assert not (tmp_path / "out").exists()


def test_recipes_quip_cannot_go_with(tmp_path, tiny_llama_dir, tiny_qwen2_dir, calibration_table):
    with pytest.raises(QuantSpecError, match="--quip: static input scales"):
        api.quantize(str(tiny_llama_dir), "a8w8", tmp_path / "x", quip="v", calib=calibration_table(tiny_llama_dir),
                     **VLLM)
    with pytest.raises(QuantSpecError, match="--quip u: model.layers.0.self_attn.q_proj has a bias.*use --quip v"):
        api.quantize(str(tiny_qwen2_dir), "weight_only_int8", tmp_path / "x", quip="v,u", **VLLM)
    moe = build_tiny_model(tmp_path / "moe", "mixtral")
    with pytest.raises(QuantSpecError, match="--quip: vLLM's fused experts"):
        api.quantize(str(moe), "weight_only_int8", tmp_path / "x", quip="v", **VLLM)
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("which", ["qwen2-v", "llama-v,u"])
def test_a_quip_checkpoint_reads_as_the_float_model_it_computes(tmp_path, tiny_llama_dir, tiny_qwen2_dir, logits_of,
                                                                which):
    """As a source (`quantize` / `calibrate --model`), a QuIP checkpoint decompresses to the float
    model its engine runs: the transforms undone into each weight (and a biased Linear's bias),
    its `transform_config` gone with them; transformers runs that float checkpoint to quantspec's
    logits of the QuIP artifact."""
    from safetensors.torch import save_file

    from quantspec.quant.decompressed import DecompressedReader

    src, quip = (tiny_qwen2_dir, "v") if which.startswith("qwen2") else (tiny_llama_dir, "v,u")
    art = api.quantize(str(src), "weight_only_int4", tmp_path / "art", quip=quip, group_size=32, **VLLM)
    reader = DecompressedReader(art)
    assert reader.source.transform_config is None
    flat = tmp_path / "float"
    flat.mkdir()
    save_file(reader.read(sorted(reader.shapes)), str(flat / "model.safetensors"), metadata={"format": "pt"})
    cfg = {k: v for k, v in read_config(art).items() if k != "quantization_config"}
    (flat / "config.json").write_text(json.dumps(cfg))
    torch.testing.assert_close(logits_of(flat, IDS), _quantspec_logits(art), rtol=1e-4, atol=1e-4)
    again = api.quantize(str(art), "weight_only_int8", tmp_path / "again")  # any target: nothing runs at run time
    assert "transform_config" not in read_config(again)["quantization_config"]


def test_cli_quip_and_inspect(tmp_path, tiny_llama_dir):
    from click.testing import CliRunner

    from quantspec.cli import main

    out = tmp_path / "art"
    r = CliRunner().invoke(main, ["quantize", "--model", str(tiny_llama_dir), "--quant-type", "weight_only_int8",
                                  "--quip", "v,u", "--quip-block-size", "16", "--target", "vllm", "--out", str(out)])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(main, ["inspect", str(out)])
    assert "run-time transforms" in r.output and "v: hadamard 16, input" in r.output
    prov = json.loads((out / "quantspec.json").read_text())["provenance"]["args"]
    assert prov["quip"] == "v,u" and prov["quip_block_size"] == 16


def test_a_quip_transform_on_an_online_transform_wrapped_model_is_one_per_place():
    tc = {"config_groups": {g: {"type": "hadamard", "apply": [{"targets": ["Linear"], "location": "input"}]}
                            for g in ("a", "b")}}
    with pytest.raises(QuantSpecError, match="has two input transforms"):
        online_transforms(tc, nn.ModuleDict({"lin": nn.Linear(16, 16)}), {}, "x")
    assert OnlineTransform("v", "input", 16).describe() == "v:input hadamard 16"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_speculation_on_a_quip_artifact_is_lossless(tmp_path, tiny_llama_dir, dtype):
    """The transforms' numbers for a row do not depend on the other rows (verification steps run
    k + 1 rows, plain decoding one): n-gram speculation gives plain decoding's greedy ids."""
    from quantspec.infer.engine import Engine, EngineConfig
    from quantspec.infer.loader import load_for_inference
    from quantspec.infer.sampler import SamplingParams
    from quantspec.infer.spec.proposers import ReferenceProposer

    art = api.quantize(str(tiny_llama_dir), "weight_only_int4", tmp_path / "art", quip="v,u", group_size=32, **VLLM)
    lm = load_for_inference(art, tokenizer=False, dtype=dtype)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (5, 17, 30)]
    prompts.append(prompts[1] * 3)

    def run(proposer, batch):
        eng = Engine(lm.model, EngineConfig(block_size=16, max_batch_size=batch, max_length=256,
                                            spec_max_draft_tokens=5 if proposer else 0),
                     eos_token_ids=[], proposer=proposer, runtime=lm.runtime)
        seqs = [eng.add_request(p, SamplingParams(max_new_tokens=60), request_index=i) for i, p in enumerate(prompts)]
        eng.run()
        return [s.output_ids for s in seqs], sum(s.stats.accepted for s in seqs)

    plain, _ = run(None, 1)
    spec, accepted = run(ReferenceProposer(3, 5), 3)
    assert spec == plain and accepted > 0


def test_experts_take_no_run_time_transform_and_other_types_are_refused(tmp_path):
    """As vLLM: its fused experts run no transform (a config targeting `Linear` wraps the attention's
    and the shared parts', not an expert's), and its transform module runs the Hadamard types only."""
    from quantspec.model_zoo.checkpoint import build_model

    net = build_model(ModelArgs.from_hf_config(read_config(build_tiny_model(tmp_path / "moe", "qwen2_moe"))), "meta")
    tc = {"config_groups": {"v": {"type": "hadamard", "head_dim": 16, "apply": [
        {"targets": ["Linear"], "ignore": ["lm_head"], "location": "input"}]}}}
    plan, _ = online_transforms(tc, net, {}, "x")
    assert "model.layers.0.self_attn.q_proj" in plan and "model.layers.0.mlp.shared_expert.down_proj" in plan
    assert not any(".experts." in n for n in plan) and "lm_head" not in plan
    matrix = {"config_groups": {"m": {"type": "random-matrix", "apply": [{"targets": ["Linear"], "location": "input"}]}}}
    with pytest.raises(QuantSpecError, match="runs a random-matrix transform at run time; vLLM runs hadamard"):
        read_transform_config(matrix, "cfg")


# ---- SpinQuant's R4 (`quantize --rotate R4`, alone or after R1 / R2): each MLP's down_proj turned at
# run time, as llm-compressor's SpinQuantModifier writes it (`calib.quip.Quip.r4`); compressed-tensors
# builds its own Sylvester matrices for the reference's hooks.

def _logits_both_ways(art):
    from transformers import AutoModelForCausalLM

    with torch.no_grad():
        theirs = _transformers_with_hooks(art)(IDS[None]).logits[0]
        skipped = AutoModelForCausalLM.from_pretrained(str(art), dtype=torch.float32)(IDS[None]).logits[0]
    return _quantspec_logits(art), theirs, skipped


@pytest.mark.parametrize("quant_type,rotate,options", [
    ("weight_only_int8", "R4", {}),
    ("weight_only_int4", "R1,R4", {"group_size": 32}),
    ("a8w8", "R1,R2,R4", {"activations": "dynamic"}),
])
def test_r4_artifact_runs_as_compressed_tensors_runs_it(tmp_path, tiny_llama_dir, quant_type, rotate, options):
    art = api.quantize(str(tiny_llama_dir), quant_type, tmp_path / "art", rotate=rotate, **VLLM, **options)
    mine, theirs, skipped = _logits_both_ways(art)
    torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-4)
    assert (skipped - theirs).abs().max() > 1e-2  # without the transform (SGLang, transformers): another model
    cfg = read_config(art)
    groups = cfg["quantization_config"]["transform_config"]["config_groups"]
    fused = [r for r in ("R1", "R2") if r in rotate]
    assert sorted(groups) == sorted(fused + ["R4"])
    r4 = groups["R4"]
    assert r4["type"] == "hadamard" and r4["head_dim"] == 128  # the tiny model's intermediate size, ≤ 128
    assert [(a["location"], a["inverse"], a["targets"]) for a in r4["apply"]] == [
        ("input", False, [r"re:.*mlp\.down_proj$"]), ("weight_input", True, [r"re:.*mlp\.down_proj$"])]
    from safetensors import safe_open

    with safe_open(str(art / "model.safetensors"), framework="pt") as h:
        matrices = [k for k in h.keys() if "R4" in k]
    assert sorted(matrices) == [f"model.layers.{i}.mlp.down_proj.R4_input.weight" for i in range(2)]
    # the hidden states are the fused rotations' model's: R4 is no part of a draft head's base
    assert ModelArgs.from_hf_config(cfg).rotation == (f"{','.join(fused)} random-hadamard seed 0" if fused else "")
    assert (cfg.get("quantspec_rotation") or {}).get("rotations", []) == fused


def test_gptq_in_r4s_turned_basis_and_inspect(tmp_path, tiny_llama_dir):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TINY_CORPUS)
    opts = dict(method="gptq", dataset=str(corpus), num_samples=4, seq_len=32, group_size=32)
    art = api.quantize(str(tiny_llama_dir), "weight_only_int4", tmp_path / "art", rotate="R4", **VLLM, **opts)
    mine, theirs, _ = _logits_both_ways(art)
    torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-4)
    info = api.inspect(art)
    assert info["run_time_transforms"] == "R4: hadamard 128, input"
    assert info["engines"]["vllm"]["status"] == "loads"
    verdict = info["engines"]["sglang"]
    assert "ignores the run-time transforms" in verdict["verdict"] and "(down_proj ×2)" in verdict["verdict"]
    assert any("R4 in --rotate" in f for f in verdict["fixes"])
    assert json.loads((art / "quantspec.json").read_text())["provenance"]["args"]["rotate"] == "R4"


def test_r4_on_fused_projections(tmp_path):
    """Phi-3 stores gate / up fused: QuIP's per-Linear transforms are refused there, R4's down_proj
    is a Linear of its own."""
    src = build_tiny_model(tmp_path / "phi3", "phi3")
    with pytest.raises(QuantSpecError, match="stores its projections fused"):
        api.quantize(str(src), "weight_only_int8", tmp_path / "quip", quip="v", **VLLM)
    art = api.quantize(str(src), "weight_only_int8", tmp_path / "art", rotate="R4", **VLLM)
    mine, theirs, _ = _logits_both_ways(art)
    torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("options,match", [
    ({"rotate": "R4"}, r"--rotate R4 writes transforms that run at run time, which SGLang skips.*--target vllm"),
    ({"rotate": "R4", "quip": "v", **VLLM}, "--rotate R4 and --quip both turn Linears at run time"),
    ({"rotate": "R4,R1,r4", **VLLM}, "names R4 twice"),
    ({"rotate": "R2,R4", **VLLM}, "R2 turns the values inside attention and goes with R1"),
    ({"rotate": "R1,R4", "method": "awq", "dataset": "d.txt", **VLLM}, "--rotate R4: AWQ's search"),
    ({"rotate": "R4", "quip_block_size": 64, **VLLM}, "--quip-block-size sizes the transforms of --quip"),
])
def test_bad_r4_requests(tmp_path, tiny_llama_dir, options, match):
    with pytest.raises(QuantSpecError, match=match):
        api.quantize(str(tiny_llama_dir), "weight_only_int4", tmp_path / "out", **options)
    assert not (tmp_path / "out").exists()


def test_recipes_r4_cannot_go_with(tmp_path, tiny_llama_dir, calibration_table):
    with pytest.raises(QuantSpecError, match="calibrated without --rotate.*calibrate with --rotate R4"):
        api.quantize(str(tiny_llama_dir), "a8w8", tmp_path / "x", rotate="R4", calib=calibration_table(tiny_llama_dir),
                     **VLLM)
    with pytest.raises(QuantSpecError, match="--rotate R4: NVFP4's input global scales"):
        api.quantize(str(tiny_llama_dir), "nvfp4", tmp_path / "x", rotate="R4", calib=calibration_table(tiny_llama_dir),
                     **VLLM)
    moe = build_tiny_model(tmp_path / "moe", "mixtral")
    with pytest.raises(QuantSpecError, match="--rotate R4: vLLM's fused experts"):
        api.quantize(str(moe), "weight_only_int8", tmp_path / "x", rotate="R4", **VLLM)
    (tmp_path / "c.txt").write_text(TINY_CORPUS)
    with pytest.raises(QuantSpecError, match="--rotate R4: vLLM's fused experts"):
        api.calibrate(str(moe), str(tmp_path / "c.txt"), tmp_path / "t", rotate="R4", num_samples=2, seq_len=16)
    assert not (tmp_path / "x").exists() and not (tmp_path / "t").exists()


def _down_inputs(model_dir, ids) -> list[torch.Tensor]:
    """Each layer's down_proj input [T, I] in transformers' float model of `model_dir`."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    seen = []
    for layer in model.model.layers:
        layer.mlp.down_proj.register_forward_pre_hook(
            lambda _m, args: seen.append(args[0].reshape(-1, args[0].shape[-1])))
    with torch.no_grad():
        model(ids)
    return seen


def test_a_table_calibrated_with_r4_holds_the_turned_down_proj_inputs(tmp_path, tiny_llama_dir):
    """`calibrate --rotate R4`: each down_proj's ranges are those of its input turned by
    compressed-tensors' own Hadamard matrix (what vLLM quantizes); every other Linear's and the KV
    cache's are the plain table's."""
    from compressed_tensors.transform.utils.hadamard import deterministic_hadamard_matrix

    from quantspec.calib.data import TableWindows
    from quantspec.calib.tables import read_table

    (tmp_path / "c.txt").write_text(TINY_CORPUS)
    opts = dict(num_samples=4, seq_len=32, dtype="float32")
    turned = read_table(api.calibrate(str(tiny_llama_dir), str(tmp_path / "c.txt"), tmp_path / "r4", rotate="R4",
                                      **opts).path)
    plain = read_table(api.calibrate(str(tiny_llama_dir), str(tmp_path / "c.txt"), tmp_path / "plain", **opts).path)
    assert turned.meta["run_time_rotation"] == {"rotations": ["R4"], "type": "hadamard", "head_dim": 128}
    assert plain.meta["run_time_rotation"] is None
    ids = TableWindows(turned.meta, tiny_llama_dir, None, seq_len=32).table_windows()
    h = deterministic_hadamard_matrix(128, torch.float64) / 128 ** 0.5
    for i, x in enumerate(_down_inputs(tiny_llama_dir, ids)):
        name = f"model.layers.{i}.mlp.down_proj"
        v = (x.double().unflatten(-1, (-1, 128)) @ h).flatten(-2)
        torch.testing.assert_close(turned.input_channel_absmax(name).double(), v.abs().amax(0), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(plain.input_channel_absmax(name).double(), x.double().abs().amax(0), rtol=1e-5,
                                   atol=1e-6)
        assert float(turned.input_absmax(name)) < float(plain.input_absmax(name))  # the outliers spread
        for other in ("self_attn.q_proj", "mlp.up_proj", "self_attn.o_proj"):
            torch.testing.assert_close(turned.input_channel_absmax(f"model.layers.{i}.{other}"),
                                       plain.input_channel_absmax(f"model.layers.{i}.{other}"))


@pytest.mark.parametrize("quant_type,rotate", [("a8w8", "R1,R2,R4"), ("a8w8_fp8", "R4")])
def test_static_r4_artifact_runs_as_compressed_tensors_runs_it(tmp_path, tiny_llama_dir, quant_type, rotate):
    """The default static recipe (α search, fallback budget) under R4: measured on the turned
    model, down_proj's group left unsmoothed, its static scale the table's turned range; vLLM's
    order (turn, then quantize the input with its static scale) is compressed-tensors'."""
    from safetensors import safe_open

    from quantspec.calib.tables import read_table

    (tmp_path / "c.txt").write_text(TINY_CORPUS)
    table = api.calibrate(str(tiny_llama_dir), str(tmp_path / "c.txt"), tmp_path / "t", num_samples=4, seq_len=32,
                          dtype="float32", rotate=rotate).path
    art = api.quantize(str(tiny_llama_dir), quant_type, tmp_path / "art", rotate=rotate, calib=str(table), **VLLM)
    mine, theirs, skipped = _logits_both_ways(art)
    torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-4)
    assert (skipped - theirs).abs().max() > 1e-2
    plan = json.loads((art / "quantspec.json").read_text())["provenance"]["calibration"]["static_plan"]
    assert plan["smoothquant_alphas"] and not any("down_proj" in n for n in plan["smoothquant_alphas"])
    t = read_table(table)
    with safe_open(str(art / "model.safetensors"), framework="pt") as f:
        for i in range(2):
            name = f"model.layers.{i}.mlp.down_proj"
            if f"{name}.input_scale" in f.keys():  # not a fallback unit
                limit = 127.5 if quant_type == "a8w8" else 448.0
                torch.testing.assert_close(f.get_tensor(f"{name}.input_scale").float().reshape(()),
                                           t.input_absmax(name).float() / limit, rtol=1e-3, atol=0)
    with pytest.raises(QuantSpecError, match=f"calibrated with --rotate {rotate}.*calibrate without --rotate"):
        api.quantize(str(tiny_llama_dir), quant_type, tmp_path / "x", calib=str(table))


def test_a_weight_only_r4_run_takes_a_table_for_its_kv_cache(tmp_path, tiny_llama_dir, calibration_table):
    """A table measured with the fused rotations alone scales the KV cache of an R1,R2,R4 artifact,
    and one measured with R4 an R1,R2 artifact's: R4 changes no value the cache holds."""
    (tmp_path / "c.txt").write_text(TINY_CORPUS)
    table = api.calibrate(str(tiny_llama_dir), str(tmp_path / "c.txt"), tmp_path / "t", num_samples=4, seq_len=32,
                          dtype="float32", rotate="R1,R2").path
    art = api.quantize(str(tiny_llama_dir), "weight_only_int8", tmp_path / "art", rotate="R1,R2,R4", calib=table,
                       kv_cache="fp8", **VLLM)
    assert read_config(art)["quantization_config"]["kv_cache_scheme"]["type"] == "float"
    with pytest.raises(QuantSpecError, match="calibrated without --rotate, and this run quantizes with --rotate "
                                             "R1,R2,R4 --seed 0"):
        api.quantize(str(tiny_llama_dir), "weight_only_int8", tmp_path / "x", rotate="R1,R2,R4",
                     calib=calibration_table(tiny_llama_dir), kv_cache="fp8", **VLLM)
    # and the reverse: a table calibrated with R4 scales the KV cache of a run without it
    turned = api.calibrate(str(tiny_llama_dir), str(tmp_path / "c.txt"), tmp_path / "t4", num_samples=4, seq_len=32,
                           dtype="float32", rotate="R1,R2,R4").path
    art = api.quantize(str(tiny_llama_dir), "weight_only_int8", tmp_path / "art2", rotate="R1,R2", calib=turned,
                       kv_cache="fp8")
    assert read_config(art)["quantization_config"]["kv_cache_scheme"]["type"] == "float"
