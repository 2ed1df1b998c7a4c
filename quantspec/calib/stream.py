"""A streamed run's working directory: the parts written so far, and what a resumed run needs.

`quantize` and `calibrate` write their output one decoder layer at a time into a working
directory beside `--out`, and build `--out` from it at the end (atomically, `outputs.atomic_dir`):

- a small run works in `.NAME.tmp-PID-XXXXXXXX`, removed when the run ends however it ends (and,
  after a SIGKILL, by the next run: `outputs.remove_leftovers`);
- a resumable run (by default one whose checkpoint holds at least `RESUMABLE_MIN_BYTES`) works in
  `.NAME.resume-KEY` (`outputs.state_dir`), KEY a digest of everything the output depends on
  (checkpoint, table, data, options, version, device kind). It is removed when the run completes
  and kept otherwise — Ctrl-C, SIGTERM, an error, a kill — so the next run with the same inputs
  and options continues from the last finished layer; `restart=True` (`--restart`) removes it
  and starts over. States of other KEYs beside the same `--out` are removed when a run starts
  (their output would be replaced anyway), unless their run is still alive.

`Run.sink()` is the `calib.ptq.PartSink` quantize writes through: each part goes to a
`quant.shards.ShardWriter` (whose state says which parts are done) and, for GPTQ and AWQ in a
resumable run, the next layer's inputs [n, S, D] go beside it (`inputs-<part>.safetensors`), named in the
same atomic state update as the part, so a killed run always restarts from a layer whose inputs
are on disk. `Run.save` / `Run.load` keep other results a resumed run reuses (the a8w8 plan, a
calibration's table entries).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any, Iterator

import torch

from quantspec.calib.ptq import PartSink, layer_key, quantized_linears
from quantspec.errors import QuantSpecError
from quantspec.outputs import pid_alive, state_dir, state_dirs, temporary_sibling
from quantspec.quant.config import resolve_group_size
from quantspec.quant.shards import DEFAULT_MAX_SHARD_BYTES, ShardWriter, write_safetensors

__all__ = ["RESUMABLE_MIN_BYTES", "Run", "StreamSink", "artifact_bytes", "check_disk", "file_stats", "notice", "open_run",
           "run_identity", "run_key", "say_resume", "working_bytes"]

# a run over a checkpoint this large keeps a resumable state (smaller ones redo their few minutes)
RESUMABLE_MIN_BYTES = 2**30
# the artifact's shards are at most this large (a larger tensor is a shard of its own)
MAX_SHARD_BYTES = DEFAULT_MAX_SHARD_BYTES
_OWNER = "owner"
_INPUTS = "inputs-"
_log = logging.getLogger("quantspec")  # notices on stderr that no quiet start may hold back


def run_key(identity: dict) -> str:
    """16 hex digits of a sha256 over `identity` (JSON; everything the output depends on)."""
    return hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()[:16]


class StreamSink(PartSink):
    """A `PartSink` that writes each part to the run's `ShardWriter` (module docstring)."""

    def __init__(self, writer: ShardWriter, keep_inputs: bool):
        super().__init__()
        self.writer, self.keep_inputs = writer, keep_inputs
        meta = writer.meta or {}
        self.done = set(writer.parts)
        self.losses = dict(meta.get("losses") or {})
        self._inputs = meta.get("inputs")  # [file, the part whose outputs they are] or None

    def write(self, key: str, tensors: dict, losses: dict[str, float], inputs: torch.Tensor | None = None) -> None:
        self.losses.update(losses)
        old, new = self._inputs, None
        if inputs is not None and self.keep_inputs:
            new = [f"{_INPUTS}{key}.safetensors", key]
            write_safetensors(self.writer.dir.parent / new[0], {"inputs": inputs})
        self.writer.add(key, tensors, {"losses": self.losses, "inputs": new})
        self._inputs = new
        self.done.add(key)
        if old is not None and old != new:
            (self.writer.dir.parent / old[0]).unlink(missing_ok=True)

    def inputs_for(self, layer: int) -> torch.Tensor | None:
        from safetensors.torch import load_file

        if self._inputs is None or self._inputs[1] != layer_key(layer - 1):
            return None
        return load_file(str(self.writer.dir.parent / self._inputs[0]))["inputs"]


class Run:
    """A run's working directory (module docstring)."""

    def __init__(self, directory: Path, resumable: bool, max_shard_bytes: int | None = None):
        self.dir, self.resumable = directory, resumable
        self.writer = ShardWriter(directory / "shards", max_shard_bytes or MAX_SHARD_BYTES)

    def sink(self, keep_inputs: bool) -> StreamSink:
        """The sink quantize writes its parts through (`keep_inputs`: GPTQ's next-layer inputs
        are kept for a resumed run)."""
        return StreamSink(self.writer, keep_inputs and self.resumable)

    def save(self, name: str, obj: Any) -> None:
        """Keep `obj` (tensors, numbers, strings in dicts / lists) for a resumed run."""
        if self.resumable:
            tmp = self.dir / f"{name}.pt.tmp"
            torch.save(obj, tmp)
            os.replace(tmp, self.dir / f"{name}.pt")

    def load(self, name: str) -> Any | None:
        """What `save(name, ...)` kept in an earlier run (None: nothing)."""
        f = self.dir / f"{name}.pt"
        return torch.load(f, weights_only=True) if f.is_file() else None

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor written (by this run and an earlier one of this state), loaded: for a
        small output (a calibration table)."""
        from quantspec.quant.artifact import load_safetensors

        d = self.dir / "all"
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir()
        self.writer.finish(d)
        return load_safetensors(d)


def file_stats(path) -> list:
    """[[name, size, mtime]] of the file `path` or of the files in the directory `path` ([]: no
    such path, e.g. a hub id): what a run key takes of an input."""
    p = Path(path).expanduser() if path is not None else None
    if p is None or not p.exists():
        return []
    files = [p] if p.is_file() else sorted(q for q in p.iterdir() if q.is_file())
    return [[f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in files]


def say_resume(sink: StreamSink, num_layers: int) -> None:
    """On stderr, when `sink` holds parts of an earlier run: the layer this one goes on from."""
    if sink.done:
        nxt = next((i for i in range(num_layers) if layer_key(i) not in sink.done), num_layers)
        where = f"layer {nxt + 1}/{num_layers}" if nxt < num_layers else "the end"
        notice(f"resuming at {where} from the state of an interrupted run ({sink.writer.dir.parent.name})")


def artifact_bytes(model, qconfig, dtype: torch.dtype) -> int:
    """The artifact's tensor bytes, estimated from the model's shapes (on `meta`) and the
    scheme: quantized weights at their bits plus their scales and zero points, the rest in
    `dtype`."""
    elem = torch.tensor([], dtype=dtype).element_size()
    linears = quantized_linears(model, qconfig)
    total = 0
    for name, t in model.state_dict().items():
        mod = name.rsplit(".", 1)[0]
        if name.endswith(".weight") and mod in linears:
            args = qconfig.weight_args_for(mod)
            N, K = t.shape
            groups = K // resolve_group_size(K, args.group_size) if args.strategy in ("group", "tensor_group") else 1
            total += N * K * args.num_bits // 8 + N * groups * elem * (1 if args.symmetric else 2)
        else:
            total += t.numel() * elem
    return total


def working_bytes(d: Path) -> int:
    """The bytes of the files under `d` (0 when there is none): work a resumed run need not redo."""
    return sum(f.stat().st_size for f in d.rglob("*") if f.is_file()) if d.is_dir() else 0


def _owner(d: Path) -> int | None:
    try:
        return int((d / _OWNER).read_text())
    except (OSError, ValueError):
        return None


def notice(message: str) -> None:
    """A line on stderr, always shown (resuming, a state kept or removed)."""
    _log.warning("quantspec: %s", message)


def _take_state(out: Path, key: str, restart: bool) -> Path:
    """The state directory of this run: stale ones (other KEYs, dead runs) removed; this KEY's
    kept (resumed) unless `restart`."""
    mine = state_dir(out, key)
    for d in state_dirs(out):
        pid = _owner(d)
        if pid is not None and pid != os.getpid() and pid_alive(pid):
            if d == mine:
                raise QuantSpecError(f"another quantspec run (PID {pid}) is writing --out {out} with the same "
                                     "inputs; wait for it to finish, or stop it")
            continue
        if d != mine or restart:
            shutil.rmtree(d, ignore_errors=True)
            notice(f"removed the state of an interrupted run beside {out} ({d.name}; "
                   + ("--restart)" if d == mine else "its inputs or options differ)"))
    mine.mkdir(parents=True, exist_ok=True)
    (mine / _OWNER).write_text(str(os.getpid()))
    return mine


def _remove_empty(d: Path, top: Path | None) -> None:
    """Remove `d` and its parents up to `top` (the directories a run made), those left empty."""
    while top is not None and d.is_relative_to(top):
        try:
            d.rmdir()
        except OSError:
            return
        d = d.parent


@contextlib.contextmanager
def open_run(out: str | os.PathLike, key: str, *, resumable: bool, restart: bool = False,
             max_shard_bytes: int | None = None) -> Iterator[Run]:
    """The working directory of a run writing `out` (module docstring); removed when the block
    completes, kept on any exit of a resumable run that did not."""
    out = Path(out)
    top = out.parent  # the topmost directory this run creates (None: they all exist)
    while not top.parent.exists():
        top = top.parent
    top = None if top.exists() else top
    out.parent.mkdir(parents=True, exist_ok=True)
    if resumable:
        d = _take_state(out, key, restart)
    else:
        d = temporary_sibling(out)
        d.mkdir()
    try:
        yield Run(d, resumable, max_shard_bytes)
    except BaseException:
        if resumable:
            notice(f"kept this run's state in {d}: the same command resumes it, --restart starts over")
        else:
            shutil.rmtree(d, ignore_errors=True)
            _remove_empty(out.parent, top)
        raise
    shutil.rmtree(d, ignore_errors=True)


def run_identity(config, src, device: str) -> tuple[bool, str]:
    """(whether the quantize run of `config` (`calib.quantize.QuantizeConfig`) on `src` (its
    source) keeps a state to resume from, the key of everything its output depends on: the
    checkpoint's files, the table's, the data file's, the options, the version, the device)."""
    from dataclasses import fields

    from quantspec import __version__

    skip = {"out", "overwrite", "restart", "resumable", "device"}
    identity = {"options": {f.name: getattr(config, f.name) for f in fields(config) if f.init and f.name not in skip},
                "model": file_stats(src.model_dir), "calib": file_stats(config.calib),
                "dataset": file_stats(config.dataset), "base": file_stats(src.base_dir),
                "version": __version__, "device": torch.device(device).type}
    resumable = config.resumable
    if resumable is None:
        resumable = src.reader is not None and src.reader.nbytes() >= RESUMABLE_MIN_BYTES
    return bool(resumable), run_key(identity)


def check_disk(config, src, model, out: Path, key: str) -> None:
    """Refuse, before any work, an `out` whose filesystem lacks room for the quantize run's
    artifact (estimated from the checkpoint's shapes and the scheme) and its working files."""
    need = artifact_bytes(model, src.quant_config, src.dtype)
    need += min(need, DEFAULT_MAX_SHARD_BYTES)  # parts waiting for their shard
    if config.method != "rtn" and src.reader is not None:  # a run keeps the next layer's inputs (two while replacing)
        streams = 2 if config.method == "autoround" else 1  # AutoRound's: the float model's too
        need += 2 * streams * config.num_samples * config.seq_len * model.args.hidden_size * 4
    anchor = out
    while not anchor.exists() and anchor.parent != anchor:
        anchor = anchor.parent
    free = shutil.disk_usage(anchor).free + working_bytes(state_dir(out, key))
    if free < need:
        raise QuantSpecError(f"not enough disk space for --out {out}: the artifact and its working files need "
                             f"about {need / 1e9:.1f} GB and {free / 1e9:.1f} GB are free there; free some "
                             "space or choose another --out")
