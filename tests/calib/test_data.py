"""Tests for quantspec.calib.data with small files in tmp_path and the tiny tokenizer."""

import json

import pytest
import torch
from transformers import AutoTokenizer

from quantspec.calib.data import (build_calibration_batches, calibration_windows, load_calibration_texts,
                                  load_text_file_for_eval)
from quantspec.errors import QuantSpecError
from quantspec.model_zoo.tiny import TINY_CORPUS


@pytest.fixture(scope="module")
def tok(tiny_tokenizer_dir):
    return AutoTokenizer.from_pretrained(tiny_tokenizer_dir)


def _jsonl(path, rows):
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def test_load_jsonl_json_txt_parquet(tmp_path):
    rows = [{"text": "first doc", "id": 1}, {"text": "   ", "id": 2}, {"text": "third doc", "id": 3}]
    assert load_calibration_texts(str(_jsonl(tmp_path / "a.jsonl", rows))) == ["first doc", "third doc"]

    (tmp_path / "b.json").write_text(json.dumps([{"content": "x y"}, {"content": "z"}]))
    assert load_calibration_texts(str(tmp_path / "b.json"), text_field="content") == ["x y", "z"]

    (tmp_path / "c.txt").write_text("line one\n\nline two\n")
    assert load_calibration_texts(str(tmp_path / "c.txt")) == ["line one", "line two"]

    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": ["p1", "p2"], "n": [1, 2]}), tmp_path / "d.parquet")
    assert load_calibration_texts(str(tmp_path / "d.parquet")) == ["p1", "p2"]


def test_load_errors(tmp_path):
    with pytest.raises(QuantSpecError, match="does not exist"):
        load_calibration_texts(str(tmp_path / "missing.jsonl"))
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(QuantSpecError, match="is empty"):
        load_calibration_texts(str(tmp_path / "empty.jsonl"))
    (tmp_path / "x.csv").write_text("text\nhello\n")
    with pytest.raises(QuantSpecError, match="extension '.csv'"):
        load_calibration_texts(str(tmp_path / "x.csv"))
    f = _jsonl(tmp_path / "f.jsonl", [{"content": "a", "meta": 1}])
    with pytest.raises(QuantSpecError, match="no field 'text'; fields are: content, meta") as e:
        load_calibration_texts(str(f))
    assert "\n" not in str(e.value)
    with pytest.raises(QuantSpecError, match="holds int"):
        load_calibration_texts(str(f), text_field="meta")
    blank = _jsonl(tmp_path / "blank.jsonl", [{"text": ""}, {"text": "  \n"}])
    with pytest.raises(QuantSpecError, match="only blank"):
        load_calibration_texts(str(blank))
    with pytest.raises(QuantSpecError, match="directory"):
        load_calibration_texts(str(tmp_path))


def test_batches_shape_content_and_eos(tok):
    text = TINY_CORPUS[:2000]
    ids = tok(text, add_special_tokens=False)["input_ids"]
    seq_len = 16
    n = (len(ids) + 1) // seq_len
    out = build_calibration_batches([text], tok, num_samples=n, seq_len=seq_len, seed=0)
    assert out.dtype == torch.long and out.shape == (n, seq_len)
    stream = ids + [tok.eos_token_id]
    assert out.flatten().tolist() == stream[: n * seq_len]


def test_batches_shuffle_deterministic_by_seed(tok):
    texts = [f"document number {i} says hello" for i in range(6)]
    a = build_calibration_batches(texts, tok, 4, 8, seed=1)
    assert torch.equal(a, build_calibration_batches(texts, tok, 4, 8, seed=1))
    outs = {tuple(build_calibration_batches(texts, tok, 4, 8, seed=s).flatten().tolist()) for s in range(6)}
    assert len(outs) > 1  # the seed changes the document order
    # whatever the order, documents are joined by eos: the stream is a concatenation of docs + eos
    eos = tok.eos_token_id
    docs = {tuple(tok(t, add_special_tokens=False)["input_ids"]) for t in texts}
    flat = a.flatten().tolist()
    first = tuple(flat[: flat.index(eos)])
    assert first in docs


def test_batches_too_few_tokens(tok):
    texts = ["a short text", "another one"]
    total = sum(len(tok(t, add_special_tokens=False)["input_ids"]) + 1 for t in texts)
    seq_len = 4
    found = total // seq_len
    with pytest.raises(QuantSpecError, match=rf"only {found} samples.*--num-samples or --seq-len"):
        build_calibration_batches(texts, tok, num_samples=found + 5, seq_len=seq_len, seed=0)
    with pytest.warns(UserWarning, match=f"continuing with {found} samples"):
        out = build_calibration_batches(texts, tok, found + 5, seq_len, seed=0, allow_fewer=True)
    assert out.shape == (found, seq_len)
    with pytest.raises(QuantSpecError, match="only 0 samples"):
        build_calibration_batches(texts, tok, 2, 10_000, seed=0, allow_fewer=True)


def test_batches_bad_args(tok):
    with pytest.raises(QuantSpecError, match="--num-samples"):
        build_calibration_batches(["x"], tok, 0, 8, seed=0)
    with pytest.raises(QuantSpecError, match="--seq-len"):
        build_calibration_batches(["x"], tok, 1, -1, seed=0)
    with pytest.raises(QuantSpecError, match="empty"):
        build_calibration_batches([], tok, 1, 8, seed=0)
    with pytest.raises(QuantSpecError, match="list of strings"):
        build_calibration_batches("just a string", tok, 1, 8, seed=0)
    with pytest.raises(QuantSpecError, match=r"texts\[1\]"):
        build_calibration_batches(["ok", 3], tok, 1, 8, seed=0)


def test_calibration_windows_continue_the_packing(tok):
    """Windows start.. of the same seeded packing: the hand-built stream (documents in the seed's
    order, eos after each) cut at start * seq_len; fewer, down to none, where the text ends."""
    texts = [p for p in TINY_CORPUS.split("\n") if p.strip()]
    seq_len, seed = 16, 3
    order = torch.randperm(len(texts), generator=torch.Generator().manual_seed(seed)).tolist()
    stream = [t for i in order for t in tok(texts[i], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]]
    total = len(stream) // seq_len
    got = calibration_windows(texts, tok, seq_len, seed, 5, 3)
    assert got.flatten().tolist() == stream[5 * seq_len: 8 * seq_len]
    assert torch.equal(build_calibration_batches(texts, tok, 8, seq_len, seed)[5:], got)
    assert calibration_windows(texts, tok, seq_len, seed, total - 2, 10).shape == (2, seq_len)
    assert calibration_windows(texts, tok, seq_len, seed, total, 4).shape == (0, seq_len)
    with pytest.raises(QuantSpecError, match="start"):
        calibration_windows(texts, tok, seq_len, seed, -1, 4)


def test_load_text_file_for_eval(tmp_path):
    (tmp_path / "e.txt").write_text("hello\nworld\n")
    assert load_text_file_for_eval(tmp_path / "e.txt") == "hello\nworld\n"
    _jsonl(tmp_path / "e.jsonl", [{"text": "one"}, {"text": "two"}])
    assert load_text_file_for_eval(str(tmp_path / "e.jsonl")) == "one\n\ntwo"
    with pytest.raises(QuantSpecError, match="does not exist"):
        load_text_file_for_eval(tmp_path / "nope.txt")
    (tmp_path / "bin.txt").write_bytes(b"\xff\xfe\x00bad")
    with pytest.raises(QuantSpecError, match="UTF-8"):
        load_text_file_for_eval(tmp_path / "bin.txt")
    (tmp_path / "ws.txt").write_text("  \n")
    with pytest.raises(QuantSpecError, match="empty"):
        load_text_file_for_eval(tmp_path / "ws.txt")
