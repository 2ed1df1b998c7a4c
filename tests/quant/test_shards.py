"""ShardWriter: parts in, HF-named shards out — grouped as a whole-dict writer groups them, readable
by safetensors itself, and continued from its state after a kill."""

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from quantspec.errors import QuantSpecError
from quantspec.model_zoo.checkpoint import CheckpointReader
from quantspec.quant.shards import ShardWriter, write_safetensors


def _tensors(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {
        "a.weight": torch.randn(16, 8, generator=g),  # 512 B
        "a.weight_scale": torch.randn(16, 1, generator=g).to(torch.bfloat16),
        "b.weight": torch.randint(-128, 127, (24, 8), generator=g, dtype=torch.int8),
        "b.weight_packed": torch.randint(0, 2**31 - 1, (24, 1), generator=g, dtype=torch.int32),
        "b.weight_shape": torch.tensor([24, 8]),
        "c.fp8": torch.randn(5, 3, generator=g).to(torch.float8_e4m3fn),
        "c.half": torch.randn(7, generator=g).half(),
        "d.empty": torch.zeros(0, 4),
        "e.big": torch.randn(40, 10, generator=g),  # 1600 B: larger than a shard
    }


def _equal(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _greedy(sizes, max_bytes):
    """The grouping of a writer that sees the whole dict: a shard closes before the tensor that
    would take it over max_bytes."""
    shards, size = [[]], 0
    for name, b in sizes:
        if shards[-1] and size + b > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += b
    return shards


def test_write_safetensors_round_trips_every_dtype(tmp_path):
    t = _tensors()
    write_safetensors(tmp_path / "x.safetensors", t)
    back = load_file(str(tmp_path / "x.safetensors"))
    assert set(back) == set(t) and all(_equal(back[k], t[k]) for k in t)


@pytest.mark.parametrize("max_bytes", [64, 600, 2000, 10**9])
def test_parts_become_the_shards_a_whole_dict_writer_makes(tmp_path, max_bytes):
    t = _tensors()
    names = list(t)
    parts = [names[:2], names[2:5], names[5:6], names[6:]]
    w = ShardWriter(tmp_path / "w", max_bytes)
    for i, p in enumerate(parts):
        w.add(f"p{i}", {k: t[k] for k in p})
    out = tmp_path / "out"
    out.mkdir()
    weight_map = w.finish(out)
    want = _greedy([(k, t[k].numel() * t[k].element_size()) for k in names], max_bytes)
    n = len(want)
    files = [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)] if n > 1 else ["model.safetensors"]
    assert {k: weight_map[k] for k in names} == {k: files[i] for i, grp in enumerate(want) for k in grp}
    got = {}
    for f in files:
        with safe_open(str(out / f), framework="pt") as h:  # safetensors' own reader
            got.update({k: h.get_tensor(k) for k in h.keys()})
    assert set(got) == set(t) and all(_equal(got[k], t[k]) for k in t)
    if n > 1:
        index = json.loads((out / "model.safetensors.index.json").read_text())
        assert index["weight_map"] == weight_map
        assert index["metadata"]["total_size"] == sum(v.numel() * v.element_size() for v in t.values())
    else:
        assert not (out / "model.safetensors.index.json").exists()


def test_a_reopened_writer_continues_and_tidies_what_a_killed_run_left(tmp_path):
    t = _tensors()
    names = list(t)
    ref = ShardWriter(tmp_path / "ref", 600)
    for i in range(0, len(names), 2):
        ref.add(f"p{i}", {k: t[k] for k in names[i:i + 2]}, meta={"upto": i})
    (tmp_path / "ref_out").mkdir()
    ref_map = ref.finish(tmp_path / "ref_out")

    w = ShardWriter(tmp_path / "w", 600)
    for i in range(0, 4, 2):
        w.add(f"p{i}", {k: t[k] for k in names[i:i + 2]}, meta={"upto": i})
    # a run killed mid-write leaves a half-written temporary and a part its state never recorded
    (w.dir / "part-00002.safetensors.tmp").write_bytes(b"half")
    save_file({"x": torch.zeros(3)}, str(w.dir / "part-00009.safetensors"))
    w = ShardWriter(tmp_path / "w", 10**9)  # the state's shard size wins
    assert w.parts == ["p0", "p2"] and w.meta == {"upto": 2} and w.max_shard_bytes == 600
    assert not (w.dir / "part-00002.safetensors.tmp").exists() and not (w.dir / "part-00009.safetensors").exists()
    with pytest.raises(QuantSpecError, match="written already"):
        w.add("p2", {"y": torch.zeros(1)})
    for i in range(4, len(names), 2):
        w.add(f"p{i}", {k: t[k] for k in names[i:i + 2]}, meta={"upto": i})
    (tmp_path / "out").mkdir()
    assert w.finish(tmp_path / "out") == ref_map
    for f in sorted(set(ref_map.values())):
        assert (tmp_path / "out" / f).read_bytes() == (tmp_path / "ref_out" / f).read_bytes()


def test_parts_are_deleted_once_in_a_shard(tmp_path):
    w = ShardWriter(tmp_path / "w", 100)
    for i in range(5):
        w.add(f"p{i}", {f"t{i}": torch.zeros(20)})  # 80 B each: every part closes the one before
    parts = sorted(p.name for p in w.dir.glob("part-*"))
    assert parts == ["part-00004.safetensors"]  # only the open shard's part is on disk
    assert len(list(w.dir.glob("shard-*"))) == 4


def test_file_ranges_are_copied_without_loading(tmp_path, tiny_llama_dir):
    reader = CheckpointReader(tiny_llama_dir)
    name = "model.embed_tokens.weight"
    write_safetensors(tmp_path / "x.safetensors", {name: reader.ranges[name], "y": torch.ones(2)})
    back = load_file(str(tmp_path / "x.safetensors"))
    assert torch.equal(back[name], reader.read([name])[name]) and torch.equal(back["y"], torch.ones(2))
