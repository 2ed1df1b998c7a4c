"""CheckpointReader: one module at a time from single-file and sharded checkpoints, against the
whole-checkpoint load; bad checkpoints refused when the reader opens them."""

import json

import pytest
import torch
from safetensors.torch import save_file

import quantspec.model_zoo.checkpoint as ckpt
from quantspec.model_zoo import safetensors_io
from quantspec.errors import QuantSpecError
from quantspec.model_zoo.checkpoint import (CheckpointReader, build_model, load_checkpoint_tensors, load_model,
                                            resident)
from quantspec.model_zoo.llama import ModelArgs


def _shard(src, dst, per_file=5):
    """A copy of checkpoint `src` split into files of `per_file` tensors, with an index."""
    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    tensors = load_checkpoint_tensors(src)
    names = sorted(tensors)
    chunks = [names[i:i + per_file] for i in range(0, len(names), per_file)]
    weight_map = {}
    for i, chunk in enumerate(chunks, 1):
        f = f"model-{i:05d}-of-{len(chunks):05d}.safetensors"
        save_file({k: tensors[k].to(torch.bfloat16) for k in chunk}, str(dst / f))
        weight_map.update({k: f for k in chunk})
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return dst


def test_reads_what_the_whole_load_reads(tiny_llama_dir, tmp_path):
    for d in (tiny_llama_dir, _shard(tiny_llama_dir, tmp_path / "sharded")):
        whole = load_checkpoint_tensors(d)
        r = CheckpointReader(d)
        assert set(r.shapes) == set(whole)
        assert r.nbytes() == sum(t.numel() * t.element_size() for t in whole.values())
        names = ["model.layers.1.mlp.up_proj.weight", "model.norm.weight"]
        got = r.read(names, dtype=torch.float32)
        assert all(torch.equal(got[n], whole[n].float()) for n in names)
        assert r.read(names)[names[0]].dtype == whole[names[0]].dtype  # the checkpoint's dtype


@pytest.mark.parametrize("block", [7, 64, 1 << 20])
def test_file_reads_equal_safetensors_own(tmp_path, monkeypatch, block):
    """`read` takes each tensor with plain file reads, in blocks of any size: every dtype it
    reads, as it is and converted, equals safetensors' own load (its mapped view converted)."""
    monkeypatch.setattr(safetensors_io, "_READ_BLOCK_BYTES", block)
    g = torch.Generator().manual_seed(0)
    tensors = {"f32": torch.randn(5, 13, generator=g), "bf16": torch.randn(33, 7, generator=g).bfloat16(),
               "f16": torch.randn(3, 3, 3, generator=g).half(), "i8": torch.randint(-128, 128, (9, 11), dtype=torch.int8),
               "i32": torch.randint(-2**31, 2**31 - 1, (6,), dtype=torch.int32),
               "fp8": torch.randn(4, 10, generator=g).to(torch.float8_e4m3fn), "scalar": torch.tensor(2.5),
               "empty": torch.zeros(0, 4)}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text("{}")
    r = CheckpointReader(tmp_path)
    got = r.read(list(tensors))
    for k, t in tensors.items():
        assert got[k].dtype == t.dtype and got[k].shape == t.shape, k
        assert torch.equal(got[k].reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)), k
    conv = r.read(["f32", "bf16", "f16", "i8"], dtype=torch.float32)
    for k in conv:
        assert torch.equal(conv[k], tensors[k].float()), k


def test_rows_are_the_embedding_lookup_in_any_block_size(tiny_llama_dir, monkeypatch):
    r = CheckpointReader(tiny_llama_dir)
    emb = load_checkpoint_tensors(tiny_llama_dir)["model.embed_tokens.weight"]
    ids = torch.randint(0, emb.shape[0], (3, 11), generator=torch.Generator().manual_seed(0))
    for block in (10**9, emb[0].numel() * 4 * 7, 1):  # whole table, 7 rows, one row per block
        monkeypatch.setattr(ckpt, "_ROW_BLOCK_BYTES", block)
        assert torch.equal(r.rows("model.embed_tokens.weight", ids), emb[ids])


def test_load_release_and_resident(tiny_llama_dir):
    full, _ = load_model(tiny_llama_dir)
    args = ModelArgs.from_hf_config(json.loads((tiny_llama_dir / "config.json").read_text()))
    meta = build_model(args, "meta")
    r = CheckpointReader(tiny_llama_dir)
    layer = meta.model.layers[1]
    with resident(layer, "model.layers.1", r) as m:
        assert all(torch.equal(a, b) for a, b in zip(m.state_dict().values(),
                                                      full.model.layers[1].state_dict().values()))
    assert all(p.device.type == "meta" for p in layer.parameters())
    with resident(full.model.layers[0], "model.layers.0", None) as m:  # materialised: as it is
        assert m is full.model.layers[0]
    with pytest.raises(QuantSpecError, match="meta device"):
        with resident(layer, "model.layers.1", None):
            pass


def test_bad_checkpoints_fail_when_opened(tiny_llama_dir, tmp_path):
    d = _shard(tiny_llama_dir, tmp_path / "missing")
    (d / "model-00002-of-00005.safetensors").unlink()
    with pytest.raises(QuantSpecError, match="model-00002-of-00005.safetensors"):
        CheckpointReader(d)
    d = _shard(tiny_llama_dir, tmp_path / "truncated")
    f = d / "model-00003-of-00005.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(QuantSpecError, match=r"model-00003-of-00005\.safetensors is truncated"):
        CheckpointReader(d)
