"""Calibration and evaluation data: a dataset -> texts -> packed token batches.

This file owns:
- `load_calibration_texts`: read the texts of a dataset with `datasets`. A local file is read with
  the builder for its extension (.txt -> "text", one row per line; .json/.jsonl -> "json";
  .parquet -> "parquet"); anything else that is not an existing path is a hub dataset id (needs a
  network). Blank texts are dropped.
- `build_calibration_batches`: pack texts into a LongTensor [num_samples, seq_len]: documents are
  shuffled deterministically by `seed`, tokenized without special tokens, joined with the eos id
  after each document, and cut into consecutive `seq_len` windows (the tail is dropped).
- `load_text_file_for_eval`: the text of a local file for perplexity evaluation.

`datasets` is imported lazily inside the functions: it is not installed on the GPU machine, where
only pre-built batches are used.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Sequence

import torch

from quantspec.errors import QuantSpecError, positive_int

__all__ = [
    "LOCAL_BUILDERS",
    "load_calibration_texts",
    "build_calibration_batches",
    "load_text_file_for_eval",
]

# file extension -> `datasets` packaged builder
LOCAL_BUILDERS = {".txt": "text", ".json": "json", ".jsonl": "json", ".parquet": "parquet"}
# documents tokenized per tokenizer call while packing
_TOKENIZE_CHUNK = 256


def _is_local(dataset: str) -> bool:
    p = Path(dataset)
    return p.exists() or p.suffix.lower() in LOCAL_BUILDERS or dataset.startswith((".", "/", "~"))


def _check_local_file(path: Path) -> str:
    """Return the `datasets` builder for a local file, or raise one line on a bad path."""
    if not path.exists():
        raise QuantSpecError(f"dataset file {str(path)!r} does not exist; check the path")
    if path.is_dir():
        raise QuantSpecError(
            f"dataset {str(path)!r} is a directory; pass one file ({', '.join(LOCAL_BUILDERS)})"
        )
    builder = LOCAL_BUILDERS.get(path.suffix.lower())
    if builder is None:
        raise QuantSpecError(
            f"dataset file {str(path)!r} has extension {path.suffix!r}; use one of {', '.join(LOCAL_BUILDERS)}"
        )
    if path.stat().st_size == 0:
        raise QuantSpecError(f"dataset file {str(path)!r} is empty; pass a file with text in it")
    if builder in ("text", "json"):
        _check_text_file(path, jsonl=path.suffix.lower() == ".jsonl")
    return builder


def _check_text_file(path: Path, *, jsonl: bool) -> None:
    """One line naming the first line of `path` that is not UTF-8 (or, for jsonl, not JSON):
    `datasets` reports either as a generation error without a place."""
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise QuantSpecError(f"dataset file {str(path)!r} line {lineno} is not UTF-8 (byte "
                                     f"0x{raw[e.start]:02x}); save the file as UTF-8") from None
            if jsonl and line.strip():
                try:
                    json.loads(line)
                except json.JSONDecodeError as e:
                    raise QuantSpecError(f"dataset file {str(path)!r} line {lineno}: malformed JSON at column "
                                         f"{e.colno} ({e.msg.lower()}); fix that line") from None


def _first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0] if lines else ''}"


def load_calibration_texts(dataset: str, *, split: str = "train", text_field: str = "text") -> list[str]:
    """The non-blank texts in `text_field` of `dataset` (a local file or a hub id), in file order.

    Raises QuantSpecError when the file is missing/empty, the field does not exist (the message
    lists the fields that do), the field is not text, or no non-blank text is found.
    """
    if not isinstance(dataset, (str, Path)) or not str(dataset):
        raise QuantSpecError(f"dataset={dataset!r} must be a file path or a hub dataset id")
    dataset = str(dataset)
    import datasets  # lazy: absent on the GPU machine

    if _is_local(dataset):
        path = Path(dataset).expanduser()
        builder = _check_local_file(path)
        try:
            ds = datasets.load_dataset(builder, data_files={split: str(path)}, split=split)
        except Exception as e:  # a malformed file: one line, not a datasets traceback
            raise QuantSpecError(
                f"could not read {str(path)!r} as {builder} ({_first_line(e)}); fix the file"
            ) from None
    else:
        try:
            ds = datasets.load_dataset(dataset, split=split)
        except Exception as e:
            raise QuantSpecError(
                f"could not load hub dataset {dataset!r} split {split!r} ({_first_line(e)}); "
                f"check the id/split or pass a local {'/'.join(LOCAL_BUILDERS)} file"
            ) from None

    if len(ds) == 0:
        raise QuantSpecError(f"dataset {dataset!r} split {split!r} has no rows; pass a dataset with text")
    if text_field not in ds.column_names:
        raise QuantSpecError(
            f"dataset {dataset!r} has no field {text_field!r}; fields are: {', '.join(ds.column_names)} "
            f"(pass --text-field)"
        )
    texts = []
    for i, t in enumerate(ds[text_field]):
        if t is None:
            continue
        if not isinstance(t, str):
            raise QuantSpecError(
                f"dataset {dataset!r} field {text_field!r} row {i} holds {type(t).__name__}, not text; "
                f"pass a --text-field with strings"
            )
        if t.strip():
            texts.append(t)
    if not texts:
        raise QuantSpecError(f"dataset {dataset!r} field {text_field!r} has only blank texts; pass real text")
    return texts


def build_calibration_batches(
    texts: Sequence[str],
    tokenizer,
    num_samples: int,
    seq_len: int,
    seed: int = 0,
    allow_fewer: bool = False,
) -> torch.Tensor:
    """Pack `texts` into calibration windows: LongTensor [num_samples, seq_len].

    Steps: permute the documents with `torch.randperm(len(texts), generator=manual_seed(seed))`;
    tokenize them in that order (no special tokens), appending `tokenizer.eos_token_id` after each
    (no separator if the tokenizer has no eos); stop once num_samples * seq_len tokens exist; cut
    the stream into consecutive windows. Same inputs -> same batches.

    Too few tokens raises QuantSpecError (how many samples were found, and to lower
    --num-samples or --seq-len); with `allow_fewer=True` the windows that exist are returned with
    a warning (at least one window is still required).
    """
    num_samples = positive_int("num_samples", num_samples)
    seq_len = positive_int("seq_len", seq_len)
    if isinstance(texts, str) or not isinstance(texts, Sequence):
        raise QuantSpecError("texts must be a list of strings (see load_calibration_texts)")
    if len(texts) == 0:
        raise QuantSpecError("texts is empty; pass at least one calibration text")
    bad = next((i for i, t in enumerate(texts) if not isinstance(t, str)), None)
    if bad is not None:
        raise QuantSpecError(f"texts[{bad}] is {type(texts[bad]).__name__}, not str; pass a list of strings")

    eos = getattr(tokenizer, "eos_token_id", None)
    need = num_samples * seq_len
    gen = torch.Generator().manual_seed(int(seed))
    order = torch.randperm(len(texts), generator=gen).tolist()

    stream: list[int] = []
    for start in range(0, len(order), _TOKENIZE_CHUNK):
        chunk = [texts[i] for i in order[start : start + _TOKENIZE_CHUNK]]
        for ids in tokenizer(chunk, add_special_tokens=False)["input_ids"]:
            stream.extend(ids)
            if eos is not None:
                stream.append(eos)
        if len(stream) >= need:
            break

    found = min(num_samples, len(stream) // seq_len)
    if found < num_samples:
        msg = (
            f"calibration data has {len(stream)} tokens: only {found} samples of --seq-len {seq_len}, "
            f"but --num-samples {num_samples} were asked; use a lower --num-samples or --seq-len, "
            f"or more data"
        )
        if not allow_fewer or found == 0:
            raise QuantSpecError(msg)
        warnings.warn(msg + f" (continuing with {found} samples)", stacklevel=2)
    out = torch.tensor(stream[: found * seq_len], dtype=torch.long)
    return out.view(found, seq_len)  # [num_samples, seq_len]


def load_text_file_for_eval(path: str | Path) -> str:
    """The text of a local file for perplexity evaluation.

    A .json/.jsonl/.parquet file is read with `load_calibration_texts` (field "text") and its
    texts joined with blank lines; any other file is read whole as UTF-8.
    """
    p = Path(path).expanduser()
    if not p.exists():
        raise QuantSpecError(f"eval file {str(p)!r} does not exist; check the path")
    if p.is_dir():
        raise QuantSpecError(f"eval file {str(p)!r} is a directory; pass a text file")
    if LOCAL_BUILDERS.get(p.suffix.lower()) in ("json", "parquet"):
        return "\n\n".join(load_calibration_texts(str(p)))
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise QuantSpecError(f"eval file {str(p)!r} is not UTF-8 text; convert it to UTF-8") from None
    if not text.strip():
        raise QuantSpecError(f"eval file {str(p)!r} is empty; pass a file with text in it")
    return text
