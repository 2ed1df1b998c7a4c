"""Calibration and evaluation data: a dataset -> texts -> packed token batches.

This file owns:
- `load_calibration_texts`: read the texts of a dataset with `datasets`. A local file is read with
  the builder for its extension (.txt -> "text", one row per line; .json/.jsonl -> "json";
  .parquet -> "parquet"); anything else that is not an existing path is a hub dataset id (needs a
  network). Blank texts are dropped.
- `build_calibration_batches`: pack texts into a LongTensor [num_samples, seq_len]: documents are
  shuffled deterministically by `seed`, tokenized without special tokens, joined with the eos id
  after each document, and cut into consecutive `seq_len` windows (the tail is dropped).
- `calibration_windows`: windows `start`, `start + 1`, ... of that same packing, e.g. the windows
  past the ones a scale table was calibrated on (held back for measuring a quantized model).
- `TableWindows`: those windows for a scale table — its own, the α search's, the held-back ones —
  from the dataset its calibration.json names (or one given instead).
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
    "calibration_windows",
    "TableWindows",
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


def _check_texts(texts) -> None:
    if isinstance(texts, str) or not isinstance(texts, Sequence):
        raise QuantSpecError("texts must be a list of strings (see load_calibration_texts)")
    if len(texts) == 0:
        raise QuantSpecError("texts is empty; pass at least one calibration text")
    bad = next((i for i, t in enumerate(texts) if not isinstance(t, str)), None)
    if bad is not None:
        raise QuantSpecError(f"texts[{bad}] is {type(texts[bad]).__name__}, not str; pass a list of strings")


def _packed_stream(texts: Sequence[str], tokenizer, need: int, seed: int) -> list[int]:
    """The token stream of the documents in seeded random order, eos after each, until it holds
    at least `need` tokens (or the documents run out)."""
    eos = getattr(tokenizer, "eos_token_id", None)
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
    return stream


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
    _check_texts(texts)
    stream = _packed_stream(texts, tokenizer, num_samples * seq_len, seed)
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


def calibration_windows(texts: Sequence[str], tokenizer, seq_len: int, seed: int, start: int,
                        count: int) -> torch.Tensor:
    """Windows start .. start + count - 1 of the packing `build_calibration_batches(texts,
    tokenizer, n, seq_len, seed)` makes for any n > start: LongTensor [m, seq_len], m ≤ count
    (fewer, down to 0, where the data runs out).

    Example: with `build_calibration_batches(texts, tok, 64, 512, 0)` as a table's windows,
    `calibration_windows(texts, tok, 512, 0, 64, 4)` are the next four, which it never saw.
    """
    seq_len = positive_int("seq_len", seq_len)
    count = positive_int("count", count)
    if isinstance(start, bool) or not isinstance(start, int) or start < 0:
        raise QuantSpecError(f"start={start!r} must be an int >= 0")
    _check_texts(texts)
    stream = _packed_stream(texts, tokenizer, (start + count) * seq_len, seed)
    m = max(0, min(count, len(stream) // seq_len - start))
    out = torch.tensor(stream[start * seq_len : (start + m) * seq_len], dtype=torch.long)
    return out.view(m, seq_len)  # [m, seq_len]


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


class TableWindows:
    """Calibration windows for a8w8's measured choices, at a scale table's seq_len (`seq_len` for
    a table that names none): of `dataset` if given, else of the dataset the table's
    calibration.json (`meta`) names, with its split, text field and seed.

    The table's own windows are the first `num_samples` of that data, packed with the table's
    seed. The α search reads the first few (of the table's own, on its data); the held-back
    windows come after every window read so far, so neither the scales nor the α search saw
    them. Missing or unreadable data is one line naming --dataset.
    """

    def __init__(self, meta: dict | None, model_dir, dataset: str | None = None, *,
                 split: str = "train", text_field: str = "text", seq_len: int = 512, seed: int = 0):
        meta = meta or {}
        self.model_dir, self.given = model_dir, dataset is not None
        self.seq_len = int(meta.get("seq_len") or seq_len)
        self.table_samples = int(meta.get("num_samples") or 0)
        table_path = meta.get("dataset_path")
        self.own = dataset is None or str(dataset) in (meta.get("dataset"), table_path) or (
            table_path is not None and Path(str(dataset)).expanduser().resolve() == Path(table_path))
        if dataset is None:
            self.src = table_path or meta.get("dataset")
            split, text_field = meta.get("split", split), meta.get("text_field", text_field)
        else:
            self.src = str(dataset)
        self.split, self.text_field = split, text_field
        self.seed = int(meta.get("seed", seed)) if self.own else seed
        self.used = self.table_samples if self.own else 0  # windows something has already read
        self.held_back_start: int | None = None
        self._texts = self._tok = None

    def _windows(self, start: int, count: int) -> torch.Tensor:
        from transformers import AutoTokenizer

        if self._texts is None:
            if self.src is None:
                raise QuantSpecError("the a8w8 recipe measures on calibration text and the table's "
                                     "calibration.json names no dataset; pass --dataset FILE")
            try:
                self._texts = load_calibration_texts(self.src, split=self.split, text_field=self.text_field)
            except QuantSpecError as e:
                if self.given:
                    raise
                raise QuantSpecError(f"the table's dataset cannot be read ({e}); pass --dataset "
                                     "FILE") from None
            self._tok = AutoTokenizer.from_pretrained(str(self.model_dir))
        return calibration_windows(self._texts, self._tok, self.seq_len, self.seed, start, count)

    def search_windows(self, n: int) -> torch.Tensor:
        """The first n windows [≤ n, S] (at most the table's own, on its data)."""
        ids = self._windows(0, min(n, self.table_samples) if self.own and self.table_samples else n)
        if ids.shape[0] == 0:
            raise QuantSpecError(f"the calibration data {self.src} holds no window of "
                                 f"{self.seq_len} tokens; pass --dataset with more text")
        self.used = max(self.used, int(ids.shape[0]))
        return ids

    def table_windows(self) -> torch.Tensor:
        """The windows the table was calibrated on (on another dataset: as many, from its start)."""
        return self.search_windows(self.table_samples or 1)

    def held_back_windows(self, n: int) -> torch.Tensor:
        """Up to n windows [≤ n, S] past every window read so far; data with none left is refused."""
        ids = self._windows(self.used, n)
        if ids.shape[0] == 0:
            raise QuantSpecError(f"the calibration data {self.src} has no {self.seq_len}-token window "
                                 f"past the {self.used} already used to hold back for the error budget; "
                                 "pass --dataset with more text, or choose --a8w8-fallback-layers N")
        self.held_back_start = self.used
        return ids

    def describe(self, start: int, count: int) -> dict:
        """JSON-able provenance of `count` windows from `start`."""
        return {"dataset": None if self.src is None else str(self.src), "split": self.split,
                "text_field": self.text_field, "seed": self.seed, "first_window": start,
                "windows": int(count), "seq_len": self.seq_len}
