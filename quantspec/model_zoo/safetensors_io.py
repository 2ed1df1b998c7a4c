"""A safetensors file read without a library's mapping: its header, a tensor's byte range, and
the tensor read with plain file reads (`read_file_range`), so the only copy resident is the
caller's. Errors on a missing, truncated or corrupt file are one line naming it."""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch

from quantspec.errors import QuantSpecError

__all__ = ["FILE_DTYPES", "FLOAT_DTYPES", "FileRange", "read_file_range", "reading_safetensors", "safetensors_header",
           "safetensors_keys"]


@contextlib.contextmanager
def reading_safetensors(f: str | os.PathLike) -> Iterator[None]:
    """Read the safetensors file `f` inside the block: a missing, truncated or corrupt file is one
    line naming it."""
    from safetensors import SafetensorError

    f = Path(f)
    if not f.is_file():
        raise QuantSpecError(f"{f} is missing; re-download or re-create it")
    try:
        yield
    except (SafetensorError, OSError, RuntimeError, ValueError) as e:
        reason = str(e).splitlines()[0][:160] if str(e) else type(e).__name__
        raise QuantSpecError(f"{f} is truncated or corrupt ({reason}); re-download or re-create it") from None


def safetensors_keys(f: str | os.PathLike) -> list[str]:
    """The tensor names of one safetensors file, from its header (the file must cover every
    tensor the header lists: a truncated file is refused without reading its data)."""
    from safetensors import safe_open

    with reading_safetensors(f), safe_open(str(f), framework="pt") as h:
        return list(h.keys())


def safetensors_header(f: str | os.PathLike) -> tuple[int, dict]:
    """(offset of the data, header dict) of the safetensors file `f` (its first 8 bytes: the
    header's length, little-endian; then the header: JSON)."""
    with reading_safetensors(f), open(f, "rb") as fh:
        n = int.from_bytes(fh.read(8), "little")
        return 8 + n, json.loads(fh.read(n))


@dataclass(frozen=True)
class FileRange:
    """A tensor's bytes as they lie in a safetensors file, to be copied without loading them.
    dtype: the safetensors name (F32, BF16, ...)."""

    path: Path
    offset: int
    nbytes: int
    dtype: str
    shape: tuple[int, ...]


# safetensors' dtype names of the float types a checkpoint's weights come in
FLOAT_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64}
# every safetensors dtype `CheckpointReader.read` reads with plain file reads
FILE_DTYPES = {**FLOAT_DTYPES, "I8": torch.int8, "U8": torch.uint8, "I16": torch.int16, "I32": torch.int32,
               "I64": torch.int64, "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn,
               "F8_E5M2": torch.float8_e5m2}
_READ_BLOCK_BYTES = 16 * 2**20  # a tensor is read (and converted) this many bytes at a time


def read_file_range(r: "FileRange", dtype: torch.dtype | None = None) -> torch.Tensor:
    """The tensor at `r`, read with plain file reads (no mapping: the only copy resident is the
    result's) and converted to `dtype` a block of rows at a time."""
    src = FILE_DTYPES[r.dtype]
    out = torch.empty(r.shape, dtype=dtype or src)
    flat = out.view(-1)
    item = src.itemsize
    per = max(1, _READ_BLOCK_BYTES // item)  # elements a block
    with open(r.path, "rb") as f:
        f.seek(r.offset)
        for a in range(0, flat.numel(), per):
            n = min(per, flat.numel() - a)
            if out.dtype == src:  # straight into the result
                buf = flat[a:a + n].view(torch.uint8)
            else:
                buf = torch.empty(n * item, dtype=torch.uint8)
            if f.readinto(memoryview(buf.numpy())) != n * item:
                raise QuantSpecError(f"{r.path} is truncated; re-download or re-create it")
            if out.dtype != src:
                flat[a:a + n] = buf.view(src).to(out.dtype)
    return out
