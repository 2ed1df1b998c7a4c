"""Sharded safetensors written part by part: bounded memory, and a state a killed run resumes from.

An artifact's tensors arrive in parts (one decoder layer's at a time). `ShardWriter.add(key,
tensors)` writes the part to a safetensors file of its own in the writer's directory; whenever
the tensors not yet in a shard overflow `max_shard_bytes`, their bytes are copied (no tensor is
loaded) into the next shard and the parts they came from are deleted. `finish(out_dir)` closes
the last shard and links the shards into `out_dir` under the names transformers writes:
`model.safetensors` for one shard, else `model-0000i-of-0000n.safetensors` with
`model.safetensors.index.json` (`{"metadata": {"total_size": bytes}, "weight_map": {tensor:
file}}`). Memory: one part; disk: the output plus at most one shard's worth of parts.

Shards are grouped as a writer of the whole dict would group the same tensors in the same order:
a shard closes before the tensor that would take it over `max_shard_bytes` (a larger tensor is a
shard of its own). Within a shard, tensors are stored largest element size first, so each one's
data is aligned to its element size (the header is padded to 8 bytes), as safetensors stores them.

The writer's state (`shards.json`: the keys of the parts added, the tensors waiting for a shard,
the shards closed, and the caller's `meta` of the last part) is replaced atomically after each
part. A writer opened on a directory continues from that state; files a killed run wrote after
its last state are removed.
"""

from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path
from typing import Any, Mapping

import torch

from quantspec.errors import QuantSpecError
from quantspec.model_zoo.checkpoint import FileRange, safetensors_header

__all__ = ["DEFAULT_MAX_SHARD_BYTES", "SAFETENSORS_DTYPES", "SAFETENSORS_NAME", "SAFETENSORS_INDEX_NAME",
           "FileRange", "ShardWriter",
           "prepare_tensors", "write_safetensors"]

SAFETENSORS_NAME = "model.safetensors"
SAFETENSORS_INDEX_NAME = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_BYTES = 2 * 1024**3
STATE_NAME = "shards.json"
_PART, _SHARD, _TMP = "part-", "shard-", ".tmp"
_COPY_BLOCK = 16 * 2**20
# torch dtype → its safetensors name
SAFETENSORS_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
                torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
                torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}


def prepare_tensors(tensors: Mapping[str, torch.Tensor | FileRange]) -> dict[str, torch.Tensor | FileRange]:
    """Contiguous CPU tensors with no shared storage (safetensors refuses aliases); file ranges
    as they are."""
    out, seen = {}, set()
    for name, t in tensors.items():
        if isinstance(t, FileRange):
            out[name] = t
            continue
        if not isinstance(t, torch.Tensor):
            raise QuantSpecError(f"tensor {name!r} is a {type(t).__name__}, not a torch.Tensor")
        t = t.detach().to("cpu").contiguous()
        key = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        if t.numel() and key in seen:
            t = t.clone()
        seen.add(key)
        out[name] = t
    return out


def _itemsize(entry: dict) -> int:
    numel = math.prod(entry["shape"])
    return entry["nbytes"] // numel if numel else 1


def _entry(name: str, t: torch.Tensor | FileRange) -> dict:
    if isinstance(t, FileRange):
        return {"name": name, "dtype": t.dtype, "shape": list(t.shape), "nbytes": t.nbytes}
    if t.dtype not in SAFETENSORS_DTYPES:
        raise QuantSpecError(f"tensor {name!r} has dtype {t.dtype}, which safetensors does not store")
    return {"name": name, "dtype": SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape), "nbytes": t.numel() * t.element_size()}


def _write_file(path: Path, entries: list[dict], write_data) -> list[dict]:
    """A safetensors file of `entries` (largest element size first), each one's data written by
    `write_data(fd, entry)`; atomically (a temporary name, then renamed). Returns the entries
    in file order with `offset` = where their data starts in the file."""
    order = sorted(entries, key=lambda e: (-_itemsize(e), e["name"]))
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    off = 0
    for e in order:
        header[e["name"]] = {"dtype": e["dtype"], "shape": e["shape"], "data_offsets": [off, off + e["nbytes"]]}
        off += e["nbytes"]
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    tmp = path.with_name(path.name + _TMP)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
    try:
        os.write(fd, struct.pack("<Q", len(head)) + head)
        for e in order:
            write_data(fd, e)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    start = 8 + len(head)
    return [dict(e, offset=start + header[e["name"]]["data_offsets"][0]) for e in order]


def _write_all(fd: int, data: memoryview) -> None:
    while data:
        data = data[os.write(fd, data):]


def write_safetensors(path: str | os.PathLike, tensors: Mapping[str, torch.Tensor | FileRange]) -> None:
    """Write `tensors` to the safetensors file `path` (atomically), straight from their memory
    (no copy of the data) or, for a `FileRange`, from their file."""
    tensors = prepare_tensors(tensors)

    def data(fd: int, e: dict) -> None:
        t = tensors[e["name"]]
        if isinstance(t, FileRange):
            src = os.open(t.path, os.O_RDONLY)
            try:
                _copy_range(src, fd, t.offset, t.nbytes)
            finally:
                os.close(src)
        elif t.numel():
            _write_all(fd, memoryview(t.reshape(-1).view(torch.uint8).numpy()))

    _write_file(Path(path), [_entry(n, t) for n, t in tensors.items()], data)


def _copy_range(src: int, dst: int, offset: int, count: int) -> None:
    """Copy `count` bytes at `offset` of the file `src` to the end of `dst` (file descriptors)."""
    while count > 0:
        try:
            n = os.copy_file_range(src, dst, min(count, 1 << 30), offset)
        except (AttributeError, OSError):  # no copy_file_range here: through a buffer
            buf = os.pread(src, min(count, _COPY_BLOCK), offset)
            n = os.write(dst, buf)
        if n <= 0:
            raise QuantSpecError(f"a part file ended early while writing a shard (fd {src}); start over")
        offset += n
        count -= n


def _link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:  # a filesystem without hard links
        import shutil

        shutil.copyfile(src, dst)


class ShardWriter:
    """Writes an artifact's tensors part by part into `directory` (module docstring)."""

    def __init__(self, directory: str | os.PathLike, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        state = self.dir / STATE_NAME
        self.state: dict[str, Any] = json.loads(state.read_text()) if state.is_file() else {
            "max_shard_bytes": int(max_shard_bytes), "parts": [], "pending": [], "shards": [], "meta": None}
        self.max_shard_bytes = int(self.state["max_shard_bytes"])
        self._tidy()

    @property
    def parts(self) -> list[str]:
        """The keys of the parts added, in order."""
        return list(self.state["parts"])

    @property
    def meta(self) -> Any:
        """The `meta` given with the last part (None before any)."""
        return self.state["meta"]

    def add(self, key: str, tensors: Mapping[str, torch.Tensor], meta: Any = None) -> None:
        """Write the part `key` (once per key); `meta` (JSON) is kept with the state."""
        if key in self.state["parts"]:
            raise QuantSpecError(f"part {key!r} is written already")
        f = self.dir / f"{_PART}{len(self.state['parts']):05d}.safetensors"
        write_safetensors(f, tensors)
        start, header = safetensors_header(f)
        for name in tensors:  # in the order given: shards are grouped in that order
            e = header[name]
            b, end = e["data_offsets"]
            self.state["pending"].append({"name": name, "file": f.name, "dtype": e["dtype"],
                                          "shape": e["shape"], "offset": start + b, "nbytes": end - b})
        self.state["parts"].append(key)
        self.state["meta"] = meta
        self._close_shards(final=False)
        self._save()
        self._tidy()

    def finish(self, out_dir: str | os.PathLike) -> dict[str, str]:
        """Close the last shard and link every shard into `out_dir` (module docstring); returns
        {tensor: file name}."""
        self._close_shards(final=True)
        self._save()
        self._tidy()
        out_dir = Path(out_dir)
        shards = self.state["shards"]
        n = len(shards)
        names = [SAFETENSORS_NAME] if n == 1 else [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
        weight_map = {}
        for shard, name in zip(shards, names):
            _link_or_copy(self.dir / shard["file"], out_dir / name)
            weight_map.update({t: name for t in shard["tensors"]})
        if n > 1:
            index = {"metadata": {"total_size": sum(s["bytes"] for s in shards)}, "weight_map": weight_map}
            (out_dir / SAFETENSORS_INDEX_NAME).write_text(json.dumps(index, indent=2))
        return weight_map

    # ---- internals ---------------------------------------------------------------------------
    def _close_shards(self, final: bool) -> None:
        pending = self.state["pending"]
        if final and not pending and not self.state["shards"]:
            self._write_shard([])  # no tensors at all: one empty file
        while pending:
            size, k = 0, 0
            while k < len(pending) and (k == 0 or size + pending[k]["nbytes"] <= self.max_shard_bytes):
                size += pending[k]["nbytes"]
                k += 1
            if k == len(pending) and not final:
                return  # the open shard may take more
            self._write_shard(pending[:k])
            del pending[:k]

    def _write_shard(self, entries: list[dict]) -> None:
        f = self.dir / f"{_SHARD}{len(self.state['shards']) + 1:05d}.safetensors"
        fds: dict[str, int] = {}

        def data(fd: int, e: dict) -> None:
            if e["file"] not in fds:
                fds[e["file"]] = os.open(self.dir / e["file"], os.O_RDONLY)
            _copy_range(fds[e["file"]], fd, e["offset"], e["nbytes"])

        try:
            order = _write_file(f, entries, data)
        finally:
            for fd in fds.values():
                os.close(fd)
        self.state["shards"].append({"file": f.name, "tensors": [e["name"] for e in order],
                                     "bytes": sum(e["nbytes"] for e in order)})

    def _save(self) -> None:
        tmp = self.dir / (STATE_NAME + _TMP)
        tmp.write_text(json.dumps(self.state))
        os.replace(tmp, self.dir / STATE_NAME)

    def _tidy(self) -> None:
        """Remove the files the state does not reference (consumed parts, a killed run's last)."""
        keep = {STATE_NAME} | {e["file"] for e in self.state["pending"]} | {s["file"] for s in self.state["shards"]}
        for p in self.dir.iterdir():
            if p.name.startswith((_PART, _SHARD)) or p.name.endswith(_TMP):
                if p.name not in keep:
                    p.unlink()
