"""Rotations fused into the weights (`calib.rotate`, `quantize --rotate`, `calibrate --rotate`).

The reference is transformers' own model of the source checkpoint: the rotated checkpoint, loaded
by transformers' own class, must compute its logits (the rotation changes the basis, not the
function), and a rotated artifact must run in transformers to quantspec's logits. What the
rotations are recorded as is read back by compressed-tensors' own `TransformConfig`."""

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from quantspec import api
from quantspec.errors import QuantSpecError
from quantspec.model_zoo.checkpoint import CheckpointReader, build_model, read_config
from quantspec.model_zoo.layout import fuse_tensors
from quantspec.model_zoo.llama import ModelArgs
from quantspec.model_zoo.tiny import TINY_CORPUS, build_tiny_model
from quantspec.quant.config import QuantConfig
from quantspec.calib.rotate import ROTATION_KEY, RotatedReader, Rotation
from quantspec.quant.transforms import read_transform_config

IDS = torch.tensor([1, 17, 254, 90, 3, 411, 77, 8, 150, 299, 42, 5])
# (arch, build options): tied and untied heads, biases, q/k norms, fused layouts, experts, multipliers
ARCHS = [("llama", {"tie_word_embeddings": True}), ("qwen2", {}), ("qwen3", {}), ("phi3", {}),
         ("qwen2_moe", {}), ("mixtral", {}), ("granite", {}), ("smollm3", {})]


def _rotated_checkpoint(src: Path, out: Path, rotation: Rotation) -> Path:
    """`src` written as the float checkpoint `RotatedReader` reads (config untied, as `quantize` writes it)."""
    shutil.copytree(src, out)
    cfg = {**read_config(src), "tie_word_embeddings": False}
    net = build_model(ModelArgs.from_hf_config(cfg), "meta")
    reader = RotatedReader(CheckpointReader(src), net, rotation)
    tensors = fuse_tensors(net.args, reader.read(sorted(reader.shapes)))  # Phi-3's units stored whole
    for f in out.glob("*.safetensors*"):
        f.unlink()
    save_file({k: v.contiguous() for k, v in tensors.items()}, out / "model.safetensors")
    raw = json.loads((src / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**raw, "tie_word_embeddings": False}))
    return out


def _uneven_norms(src: Path) -> Path:
    """`src` with every norm's weight drawn per channel from U(0.5, 1.5) (the tiny models' layer
    norms are ones, which a fold that took the wrong axis would pass unnoticed)."""
    from safetensors.torch import load_file

    g = torch.Generator().manual_seed(1)
    files = sorted(src.glob("*.safetensors"))
    for f in files:
        t = load_file(str(f))
        t = {k: (torch.rand(v.shape, generator=g) + 0.5).to(v.dtype) if k.endswith("norm.weight") else v
             for k, v in t.items()}
        save_file(t, str(f), metadata={"format": "pt"})
    return src


@pytest.mark.parametrize("arch,options", ARCHS, ids=[a for a, _ in ARCHS])
def test_rotated_checkpoint_computes_the_source(tmp_path, logits_of, arch, options):
    src = _uneven_norms(build_tiny_model(tmp_path / "src", arch, **options))
    rot = _rotated_checkpoint(src, tmp_path / "rot", Rotation(("R1", "R2"), seed=3))
    torch.testing.assert_close(logits_of(rot, IDS), logits_of(src, IDS), rtol=1e-4, atol=1e-4)
    a = CheckpointReader(src).read(["model.layers.0.mlp.down_proj.weight"] if arch not in ("qwen2_moe", "mixtral")
                                   else ["model.embed_tokens.weight"])
    b = CheckpointReader(rot).read(list(a))
    assert all((a[k] - b[k]).abs().max() > 1e-2 for k in a)  # the weights did turn


def test_rotated_rows_are_the_rotated_table(tied_llama_dir):
    cfg = {**read_config(tied_llama_dir), "tie_word_embeddings": False}
    net = build_model(ModelArgs.from_hf_config(cfg), "meta")
    reader = RotatedReader(CheckpointReader(tied_llama_dir), net, Rotation(("R1",)))
    table = reader.read(["model.embed_tokens.weight"])["model.embed_tokens.weight"]
    torch.testing.assert_close(reader.rows("model.embed_tokens.weight", IDS[None]), table[IDS][None])
    assert "lm_head.weight" in reader.shapes and "model.norm.weight" not in reader.ranges
    ones = reader.read(["model.norm.weight"])["model.norm.weight"]
    assert torch.equal(ones, torch.ones_like(ones))


@pytest.mark.parametrize("quant_type,options", [("weight_only_int8", {}), ("weight_only_int4", {"group_size": 32})])
def test_rotated_artifact_runs_as_in_transformers(tmp_path, tied_llama_dir, artifact_runs_as_in_transformers,
                                                  logits_of, quant_type, options):
    art = artifact_runs_as_in_transformers(tied_llama_dir, quant_type, tmp_path / "art", IDS[:8], rotate="R1,R2",
                                           **options)
    cfg = read_config(art)
    assert cfg["tie_word_embeddings"] is False and cfg[ROTATION_KEY] == {"rotations": ["R1", "R2"],
                                                                         "type": "random-hadamard", "seed": 0}
    from compressed_tensors.transform import TransformConfig

    tc = TransformConfig.model_validate(cfg["quantization_config"]["transform_config"])
    assert {a.location for s in tc.config_groups.values() for a in s.apply} == {"weight_input", "weight_output"}
    assert tc.config_groups["R2"].head_dim == ModelArgs.from_hf_config(cfg).head_dim
    assert api.inspect(art)["rotation"] == "R1,R2 random-hadamard seed 0"
    if "int4" not in quant_type:  # 8 bits: the float model's function, up to a small quantization error
        ref = logits_of(tied_llama_dir, IDS)
        assert (logits_of(art, IDS) - ref).abs().max() < 0.1 * ref.abs().max()


def test_static_scales_from_a_table_of_the_rotated_model(tmp_path, tiny_llama_dir, logits_of):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TINY_CORPUS)
    plain = api.calibrate(str(tiny_llama_dir), str(corpus), tmp_path / "t0", num_samples=4, seq_len=32,
                          dtype="float32").path
    rotated = api.calibrate(str(tiny_llama_dir), str(corpus), tmp_path / "t1", num_samples=4, seq_len=32,
                            dtype="float32", rotate="R1,R2", seed=1).path
    assert json.loads((rotated / "calibration.json").read_text())["rotation"]["seed"] == 1
    opts = dict(smoothquant_alpha="none", fallback_layers=0)
    with pytest.raises(QuantSpecError, match="calibrated without --rotate.*calibrate with --rotate R1,R2 --seed 1"):
        api.quantize(str(tiny_llama_dir), "a8w8", tmp_path / "x", calib=str(plain), rotate="R1,R2", seed=1, **opts)
    with pytest.raises(QuantSpecError, match="calibrated with --rotate R1,R2 --seed 1.*calibrate without --rotate"):
        api.quantize(str(tiny_llama_dir), "a8w8", tmp_path / "x", calib=str(rotated), **opts)
    with pytest.raises(QuantSpecError, match="--seed 2"):
        api.quantize(str(tiny_llama_dir), "a8w8", tmp_path / "x", calib=str(rotated), rotate="R1,R2", seed=2, **opts)
    assert not (tmp_path / "x").exists()
    art = api.quantize(str(tiny_llama_dir), "a8w8", tmp_path / "art", calib=str(rotated), rotate="R1,R2", seed=1,
                       **opts)
    from quantspec.infer.loader import load_for_inference

    mine = logits_of(load_for_inference(art, tokenizer=False).model, IDS)
    torch.testing.assert_close(mine, logits_of(art, IDS), rtol=1e-4, atol=1e-4)


def test_requantizing_a_rotated_artifact_keeps_its_record(tmp_path, tiny_llama_dir, logits_of):
    art = api.quantize(str(tiny_llama_dir), "weight_only_int8", tmp_path / "w8", rotate="R1")
    again = api.quantize(str(art), "weight_only_int4", tmp_path / "w4", group_size=32)
    a, b = read_config(art), read_config(again)
    assert b[ROTATION_KEY] == a[ROTATION_KEY]
    assert b["quantization_config"]["transform_config"] == a["quantization_config"]["transform_config"]
    with pytest.raises(QuantSpecError, match="already has rotations fused.*drop --rotate"):
        api.quantize(str(art), "weight_only_int4", tmp_path / "x", rotate="R1")
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("arch", ["gemma2", "olmo2"])
def test_models_whose_norms_do_not_fold_are_refused(tmp_path, arch):
    src = build_tiny_model(tmp_path / arch, arch)
    with pytest.raises(QuantSpecError, match=f"a {arch} model normalizes each block's output.*without --rotate"):
        api.quantize(str(src), "weight_only_int8", tmp_path / "out", rotate="R1,R2")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("spec,match", [("R3", "use R1 or R1,R2"), ("R1,R1", "use R1 or R1,R2"),
                                        ("R2", "goes with R1")])
def test_bad_rotate_spec(tmp_path, spec, match):
    with pytest.raises(QuantSpecError, match=match):
        api.quantize("smollm2-135m", "weight_only_int8", tmp_path / "out", rotate=spec)


def test_keep_takes_no_rotation(tmp_path, tiny_llama_dir):
    art = api.quantize(str(tiny_llama_dir), "weight_only_int8", tmp_path / "w8")
    with pytest.raises(QuantSpecError, match="--rotate does not apply"):
        api.quantize(str(art), "keep", tmp_path / "x", rotate="R1", kv_cache="fp8", calib="t")


def _transform_config(location: str) -> dict:
    return {"config_groups": {"R4": {"type": "hadamard", "apply": [
        {"targets": ["re:.*down_proj$"], "location": location}]}}}


def test_transforms_on_attention_are_refused_in_one_line():
    assert read_transform_config(_transform_config("weight_input"), "q")["config_groups"]["R4"]["type"] == "hadamard"
    assert read_transform_config(_transform_config("input"), "q")  # a Linear's, at run time: `tests/test_quip.py`
    with pytest.raises(QuantSpecError, match=r"applies a hadamard transform at 'k_cache'"):
        read_transform_config(_transform_config("k_cache"), "q")
    with pytest.raises(QuantSpecError, match="transform_config is malformed"):
        read_transform_config({"config_groups": {"R1": {"apply": []}}}, "q")
    qc = QuantConfig.from_dict({"config_groups": {"g": {"targets": ["Linear"], "weights": {
        "num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"}}},
        "format": "pack-quantized", "transform_config": _transform_config("weight_output")})
    assert QuantConfig.from_dict(qc.to_dict()).transform_config == qc.transform_config


def test_heads_of_another_rotation_are_refused(tiny_llama_dir):
    from quantspec.model_zoo.eagle3 import Eagle3Args, check_eagle3_matches_base
    from quantspec.model_zoo.medusa import MedusaArgs, check_medusa_matches_base
    from quantspec.model_zoo.mtp import base_fingerprint

    plain = ModelArgs.from_hf_config(read_config(tiny_llama_dir))
    rotated = ModelArgs.from_hf_config({**read_config(tiny_llama_dir), ROTATION_KEY: Rotation(("R1",)).to_meta()})
    assert rotated.rotation == "R1 random-hadamard seed 0" and plain.rotation == ""
    assert base_fingerprint(plain) != base_fingerprint(rotated)
    heads = MedusaArgs(2, 1, plain.hidden_size, plain.vocab_size)
    check_medusa_matches_base(heads, plain)
    with pytest.raises(QuantSpecError, match="without rotations, and this base is rotated by R1"):
        check_medusa_matches_base(heads, rotated)
    check_medusa_matches_base(MedusaArgs(2, 1, plain.hidden_size, plain.vocab_size, base_rotation=rotated.rotation),
                              rotated)
    head = Eagle3Args.for_base(plain, 64, aux_layer_ids=(0, 1, 2))
    check_eagle3_matches_base(head, plain)
    with pytest.raises(QuantSpecError, match="fingerprint .* rotations"):
        check_eagle3_matches_base(head, rotated)
    with pytest.raises(QuantSpecError, match="records no base, and this base has rotations"):
        check_eagle3_matches_base(replace(head, base_fingerprint=None), rotated)


def test_cli_rotates_and_inspect_says_so(tmp_path, tiny_llama_dir):
    from click.testing import CliRunner

    from quantspec.cli import main

    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TINY_CORPUS)
    run = CliRunner()
    r = run.invoke(main, ["calibrate", "--model", str(tiny_llama_dir), "--dataset", str(corpus), "--num-samples", "4",
                          "--seq-len", "32", "--dtype", "float32", "--rotate", "r1", "--seed", "5",
                          "--out", str(tmp_path / "t")], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    r = run.invoke(main, ["quantize", "--model", str(tiny_llama_dir), "--quant-type", "a8w8", "--calib", str(tmp_path / "t"),
                          "--smoothquant-alpha", "none", "--a8w8-fallback-layers", "0", "--rotate", "R1", "--seed", "5",
                          "--out", str(tmp_path / "q")], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    assert read_config(tmp_path / "q")[ROTATION_KEY] == {"rotations": ["R1"], "type": "random-hadamard", "seed": 5}
    r = run.invoke(main, ["inspect", str(tmp_path / "q")], env={"COLUMNS": "200"})
    assert "rotations fused" in r.output and "R1 random-hadamard seed 5" in r.output


@pytest.mark.parametrize("variant", [{}, {"norm_before_fc": True}, {"fc_norm": True}, "llama-two-aux-fc-norm",
                                     "qwen3-fc-norm-out"],
                         ids=["plain", "input_norm", "fc_norm", "speculators-fc-norm", "speculators-qwen3"])
def test_an_eagle3_head_turned_for_the_rotated_base_drafts_the_same(tmp_path, tiny_llama_dir, variant):
    """Plain-layout heads of each variant, and speculators-format ones (their own embedding copy
    left out of the turned head, which then reads the rotated base's)."""
    import sys

    from quantspec.infer.loader import load_for_inference
    from quantspec.model_zoo.eagle3 import Eagle3Args, Eagle3Head, load_eagle3, save_eagle3
    from quantspec.model_zoo.eagle3_train import ttt_outputs
    from quantspec.model_zoo.llama import DenseCausalAttention

    rotated = _rotated_checkpoint(tiny_llama_dir, tmp_path / "base.rot", Rotation(("R1", "R2"), seed=4))
    cfg = json.loads((rotated / "config.json").read_text())
    (rotated / "config.json").write_text(json.dumps({**cfg, ROTATION_KEY: Rotation(("R1", "R2"), 4).to_meta()}))
    base_a = load_for_inference(tiny_llama_dir, tokenizer=False).model
    base_b = load_for_inference(rotated, tokenizer=False).model
    if isinstance(variant, str):  # a speculators-format head (RedHatAI's layout)
        sys.path.insert(0, str(Path(__file__).parent))
        from speculators_heads import VARIANTS, write_speculators_head

        aux = VARIANTS[variant][2]
        write_speculators_head(tmp_path / "head", base_a.model.embed_tokens.weight.detach(), variant)
    else:
        aux = (0, 1, 2)
        g = torch.Generator().manual_seed(0)
        head = Eagle3Head(replace(Eagle3Args.for_base(base_a.args, 64, aux), **variant))
        with torch.no_grad():
            for name, p in head.named_parameters():  # norms away from ones: the fold has something to fold
                p.copy_(torch.rand(p.shape, generator=g) + 0.5 if p.ndim == 1 else torch.randn(p.shape, generator=g) * 0.2)
        head.set_draft_vocab(torch.arange(0, 128, 2))
        save_eagle3(head, tmp_path / "head")
    api.rotate_eagle3_head(str(tmp_path / "head"), str(rotated), str(tmp_path / "head.rot"))
    ids = torch.tensor([1, 9, 77, 130, 5, 260, 41, 3, 99, 12])

    def logits(base, head_dir):
        n = ids.numel()
        _, feats = base(ids, torch.arange(n), DenseCausalAttention.of(base.args, 1, n), capture=aux)
        h = load_eagle3(head_dir, base.args).bind_embedding(base.model.embed_tokens)
        with torch.no_grad():
            return [h.logits(o) for o in ttt_outputs(h, ids, torch.cat(feats, dim=-1), 3)]

    with torch.no_grad():
        want, got = logits(base_a, tmp_path / "head"), logits(base_b, tmp_path / "head.rot")
    for a, b in zip(want, got):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
    with pytest.raises(QuantSpecError, match="(fingerprint|records no base).*quantspec zoo rotate-head"):  # unturned
        load_eagle3(tmp_path / "head", base_b.args)
    with pytest.raises(QuantSpecError, match="made for this rotated base already"):
        api.rotate_eagle3_head(str(tmp_path / "head.rot"), str(rotated), str(tmp_path / "again"))
    with pytest.raises(QuantSpecError, match="no rotations quantspec fused"):
        api.rotate_eagle3_head(str(tmp_path / "head"), str(tiny_llama_dir), str(tmp_path / "again"))
    assert not (tmp_path / "again").exists()
