"""Output locations: checked before work starts, written atomically, readable by other users.

Every file or directory quantspec writes (artifacts, calibration tables, jsonl outputs, reports,
the model cache) goes through this module:

- `check_output_file` / `check_output_dir` run before any work: the nearest existing ancestor of
  the path must be a writable directory (a probe file is created and removed there), so a
  read-only filesystem or a file in the way is one line naming the flag, not a traceback after
  minutes of work. Nothing is created by a check.
- `atomic_file` / `atomic_dir` write into a temporary sibling named `.NAME.tmp-PID-XXXXXXXX` and
  rename it into place only when complete; on an exception, Ctrl-C or SIGTERM (the CLI turns it
  into `Terminated`) the temporary is removed and the target is left as it was.
- A run killed outright (SIGKILL, power loss) leaves its temporary behind; the next run that
  writes the same target removes every `.NAME.tmp-PID-*` / `.NAME.old-PID-*` whose process is
  gone and says so (`remove_leftovers`).
- A resumable run (a big quantize or calibrate) keeps its work in `.NAME.resume-KEY` instead,
  KEY a digest of its inputs and options (`state_dir`): no PID in the name, so leftover-cleaning
  never takes it; the next run with the same inputs and options finds it by KEY and resumes.
- Directories are created with mode 0777 and files with 0666, both less the process umask (0755 /
  0644 under the usual 022), so a server running as another user can read what was written.
"""

from __future__ import annotations

import contextlib
import errno
import glob
import json
import logging
import os
import re
import secrets
import shutil
from pathlib import Path
from typing import Iterator

from quantspec.errors import QuantSpecError

__all__ = ["atomic_dir", "atomic_file", "check_output_dir", "check_output_file", "pid_alive",
           "remove_leftovers", "replace_directory", "state_dir", "state_dirs", "temporary_sibling", "umask",
           "write_json", "write_text"]

_log = logging.getLogger("quantspec")
_TMP, _OLD, _STATE = "tmp", "old", "resume"
# `.NAME.tmp-PID-XXXXXXXX` / `.NAME.old-PID-XXXXXXXX`: the PID tells a live writer from a dead one
_LEFTOVER = re.compile(r"^\.(?P<name>.+)\.(?:tmp|old)-(?P<pid>\d+)-[0-9a-f]{8}$")


def umask() -> int:
    """The process umask (read without changing it for longer than one call)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _sibling(target: Path, kind: str) -> Path:
    return target.with_name(f".{target.name}.{kind}-{os.getpid()}-{secrets.token_hex(4)}")


def temporary_sibling(target: str | os.PathLike) -> Path:
    """A fresh `.NAME.tmp-PID-XXXXXXXX` path beside `target` (created by the caller)."""
    return _sibling(Path(target), _TMP)


def state_dir(target: str | os.PathLike, key: str) -> Path:
    """Where a resumable run writing `target` keeps its state: `.NAME.resume-KEY` beside it."""
    target = Path(target)
    return target.with_name(f".{target.name}.{_STATE}-{key}")


def state_dirs(target: str | os.PathLike) -> list[Path]:
    """Every resumable state beside `target` (any KEY)."""
    target = Path(target)
    if not target.parent.is_dir():
        return []
    return sorted(target.parent.glob(f".{glob.escape(target.name)}.{_STATE}-*"))


def pid_alive(pid: int) -> bool:
    """Whether the process `pid` exists (this one, or another user's, counts)."""
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def remove_leftovers(target: str | os.PathLike) -> list[Path]:
    """Remove the temporaries that killed runs left beside `target`; returns what was removed.

    Only entries named for `target` whose writer process no longer exists are touched: a run
    writing the same target at this moment keeps its temporary.
    """
    target = Path(target)
    parent = target.parent
    if not parent.is_dir():
        return []
    removed = []
    prefix = f".{target.name}."
    try:
        entries = [p for p in parent.iterdir() if p.name.startswith(prefix)]
    except OSError:
        return []
    for p in entries:
        m = _LEFTOVER.match(p.name)
        if m is None or m["name"] != target.name or pid_alive(int(m["pid"])):
            continue
        try:
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p)
            else:
                p.unlink()
        except OSError:
            continue
        removed.append(p)
    if removed:
        _log.warning("quantspec: removed %d leftover(s) of an interrupted run beside %s: %s", len(removed),
                     target, ", ".join(p.name for p in removed))
    return removed


def _nearest_existing(path: Path) -> Path:
    p = path
    while not p.exists() and not p.is_symlink():
        if p.parent == p:
            break
        p = p.parent
    return p


def _check_writable_parent(path: Path, flag: str) -> None:
    """The nearest existing ancestor of `path` is a directory this process can create files in."""
    anchor = _nearest_existing(path.parent)
    if not anchor.is_dir():
        raise QuantSpecError(f"cannot write {flag} {path}: {anchor} is not a directory; choose another {flag}")
    probe = anchor / f".quantspec-probe-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        fd = os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    except OSError as e:
        why = {errno.EROFS: "read-only file system", errno.EACCES: "permission denied",
               errno.EPERM: "permission denied", errno.ENOSPC: "no space left on device",
               errno.EDQUOT: "disk quota exceeded"}.get(e.errno, e.strerror or type(e).__name__)
        raise QuantSpecError(f"cannot write {flag} {path}: {anchor} is not writable ({why}); "
                             f"choose a writable {flag}") from None
    os.close(fd)
    os.unlink(probe)


def check_output_file(path: str | os.PathLike, flag: str) -> Path:
    """Check, before any work, that the file `path` (given by `flag`) can be written; returns it.

    Missing parent directories are fine (the write creates them); nothing is created here.
    """
    path = Path(path)
    if path.is_dir():
        raise QuantSpecError(f"{flag} {path} is a directory; give a file path")
    _check_writable_parent(path, flag)
    return path


def check_output_dir(path: str | os.PathLike, flag: str, *, overwrite: bool = False,
                     overwrite_flag: str = "--overwrite") -> Path:
    """Check, before any work, that the directory `path` (given by `flag`) can be written.

    An existing non-empty directory is refused unless `overwrite` (the error names
    `overwrite_flag`); nothing is created here.
    """
    path = Path(path)
    _refuse_existing(path, flag, overwrite, overwrite_flag)
    _check_writable_parent(path, flag)
    return path


def _refuse_existing(path: Path, flag: str, overwrite: bool, overwrite_flag: str) -> None:
    if path.exists() and not path.is_dir():
        raise QuantSpecError(f"{flag} {path} exists and is not a directory; choose another {flag}")
    if path.is_dir() and any(path.iterdir()) and not overwrite:
        raise QuantSpecError(f"{flag} {path} already exists and is not empty; choose another {flag} "
                             f"or pass {overwrite_flag}")


def _apply_umask(path: Path) -> None:
    """Give `path` (and, for a directory, everything in it) the modes of a plain `open` /
    `mkdir` under the umask: writers such as safetensors create their files 0600."""
    mask = umask()
    for p in [path, *(path.rglob("*") if path.is_dir() else ())]:
        if not p.is_symlink():
            os.chmod(p, (0o777 if p.is_dir() else 0o666) & ~mask)


def _mkdirs(path: Path) -> None:
    """`mkdir -p` (mode 0777 less the umask, as the shell's)."""
    path.mkdir(parents=True, exist_ok=True)


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside `path` to write the file to; it replaces `path` when the
    block completes and is removed when it raises (the old `path`, if any, stays)."""
    path = Path(path)
    _mkdirs(path.parent)
    remove_leftovers(path)
    tmp = _sibling(path, _TMP)
    try:
        yield tmp
        if not tmp.exists():
            raise QuantSpecError(f"nothing was written for {path}")
        _apply_umask(tmp)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def write_text(path: str | os.PathLike, text: str) -> Path:
    """Write `text` (UTF-8) to `path` atomically."""
    with atomic_file(path) as tmp:
        tmp.write_text(text, encoding="utf-8")
    return Path(path)


def write_json(path: str | os.PathLike, data) -> Path:
    """Write `data` as indented JSON to `path` atomically (non-JSON values as their str)."""
    return write_text(path, json.dumps(data, indent=2, default=str) + "\n")


@contextlib.contextmanager
def atomic_dir(out: str | os.PathLike, *, overwrite: bool = False, flag: str = "--out") -> Iterator[Path]:
    """Yield an empty temporary directory beside `out` to fill; it replaces `out` when the block
    completes (`replace_directory`) and is removed when it raises, leaving `out` as it was.

    An existing non-empty `out` is refused unless `overwrite` (the error names `flag`).
    """
    out = Path(out)
    _refuse_existing(out, flag, overwrite, "--overwrite")
    _mkdirs(out.parent)
    remove_leftovers(out)
    tmp = _sibling(out, _TMP)
    tmp.mkdir()
    try:
        yield tmp
        _apply_umask(tmp)
        replace_directory(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def replace_directory(tmp: Path, out: Path) -> None:
    """Move the finished directory `tmp` to `out` by renames only; an existing `out` is swapped
    out and restored if the final rename fails, so a reader never sees a half-written `out`."""
    if out.exists():
        old = _sibling(out, _OLD)
        os.rename(out, old)
        try:
            os.rename(tmp, out)
        except BaseException:
            os.rename(old, out)  # put the original back
            raise
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, out)
