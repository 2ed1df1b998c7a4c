"""Building and loading quantspec's CPU extension: one module compiled from every C++ source of
the package (`kernels/csrc/*.cpp`, and the `csrc/` folders of the rooms that keep model- or
method-shaped C++ beside their Python), each binding its ops into it (`kernels/csrc/cpu.h`).

The extension is compiled at first use with `torch.utils.cpp_extension` (the machine's C++
compiler, `-march=native`) into `paths.cache_dir() / "ext"`, keyed by the sources, the flags,
torch's and Python's versions and the CPU; a later process loads it in milliseconds, and every
checkout with the same sources shares one build. Without a compiler, without AVX-512 (a CPU
whose /proc/cpuinfo lacks it is not compiled for), or with `QUANTSPEC_CPU_KERNELS=0`,
`cpu_kernels()` returns None and callers keep torch's ops; the first two say so once.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import sys
import threading
import time
from pathlib import Path
from types import ModuleType

import torch

__all__ = ["ENV_SWITCH", "cpu_kernels", "cpu_kernels_error", "need", "pair_path_available", "sources"]

ENV_SWITCH = "QUANTSPEC_CPU_KERNELS"  # "0": never build or use them

_PACKAGE = Path(__file__).resolve().parents[2]  # quantspec/
_HEADERS = ("kernels/csrc/cpu.h",)
# no fused multiply-adds the compiler picks per call site: a row's numbers must not depend on
# how many rows a tile holds
_CFLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=off"]
_STALE_LOCK_S = 600  # a build takes a few minutes: a lock older than this belongs to a killed build
_log = logging.getLogger("quantspec")
_lock = threading.Lock()
_state: dict = {"tried": False, "module": None, "error": None}
_NO_AVX512 = "this CPU has no AVX-512 (F + BW)"


def sources() -> list[Path]:
    """The extension's C++ sources and headers: every `csrc/*.cpp` below the package, sorted."""
    cpp = sorted(_PACKAGE.glob("**/csrc/*.cpp"), key=lambda p: p.relative_to(_PACKAGE).as_posix())
    return [_PACKAGE / h for h in _HEADERS] + cpp


def _cpuinfo() -> list[str] | None:
    """The first CPU's "model name" and "flags" lines of /proc/cpuinfo (None where it cannot be read)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return None
    return [ln for ln in lines if ln.startswith(("model name", "flags"))][:2]


def _cpu_signature() -> str:
    """The CPU's model and flags (what -march=native compiles for)."""
    lines = _cpuinfo()
    return platform.processor() or platform.machine() if lines is None else "\n".join(lines)


def _lacks_avx512() -> bool:
    """Whether /proc/cpuinfo shows a CPU without AVX-512 F + BW (False where it cannot be read:
    the built module's own check decides there)."""
    flags = next((ln for ln in _cpuinfo() or () if ln.startswith("flags")), None)
    return flags is not None and not {"avx512f", "avx512bw"} <= set(flags.split(":", 1)[-1].split())


def _build_key(files: list[Path]) -> str:
    h = hashlib.sha256()
    for f in files:
        h.update(f.relative_to(_PACKAGE).as_posix().encode())
        h.update(f.read_bytes())
    for part in (" ".join(_CFLAGS), torch.__version__, sys.version, _cpu_signature()):
        h.update(part.encode())
    return h.hexdigest()[:16]


def _build() -> ModuleType:
    from torch.utils.cpp_extension import load

    from quantspec.outputs import write_text
    from quantspec.paths import cache_dir

    files = sources()
    names = [f.name for f in files]
    if len(set(names)) != len(names):
        raise RuntimeError(f"two C++ sources share a file name: {sorted(names)}")
    key = _build_key(files)
    build_dir = cache_dir() / "ext" / f"cpu-{key}"
    build_dir.mkdir(parents=True, exist_ok=True)
    # compile copies inside the build directory: the build is keyed by the sources' content, and
    # every checkout or install with that content then shares one build (ninja would rebuild
    # whenever a source's path changed)
    for f in files:
        copy = build_dir / f.name
        if not copy.is_file() or copy.read_bytes() != f.read_bytes():
            write_text(copy, f.read_text())
    lock = build_dir / "lock"  # torch's build lock: a build killed midway leaves it behind forever
    if lock.exists() and time.time() - lock.stat().st_mtime > _STALE_LOCK_S:
        lock.unlink(missing_ok=True)
    if not any(build_dir.glob("*.so")):
        _log.warning("quantspec: compiling the CPU kernels for this machine (once, a few minutes)")
    return load(name=f"quantspec_cpu_{key}", sources=[str(build_dir / f.name) for f in files if f.suffix == ".cpp"],
                extra_cflags=_CFLAGS, extra_ldflags=["-fopenmp"], extra_include_paths=[str(build_dir)],
                build_directory=str(build_dir), verbose=False)


def cpu_kernels() -> ModuleType | None:
    """The compiled extension, or None where it cannot run (the reason: `cpu_kernels_error()`)."""
    if _state["tried"]:
        return _state["module"]
    with _lock:
        if _state["tried"]:
            return _state["module"]
        module, error = None, None
        if os.environ.get(ENV_SWITCH, "1") == "0":
            error = f"disabled by {ENV_SWITCH}=0"
        elif platform.machine().lower() not in ("x86_64", "amd64"):
            error = f"needs an x86-64 CPU with AVX-512, this is {platform.machine()}"
        elif _lacks_avx512():  # known before a build of minutes that could not run here
            error = _NO_AVX512
        else:
            try:
                module = _build()
                if not module.has_avx512():
                    module, error = None, _NO_AVX512
            except Exception as e:  # no compiler, failed build: torch's ops still work
                error = f"could not build them: {str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__}"
                _log.warning("quantspec: CPU kernels unavailable (%s); using torch's ops "
                             "(set %s=0 to skip the build)", error, ENV_SWITCH)
        if error == _NO_AVX512:
            _log.warning("quantspec: CPU kernels unavailable (%s); using torch's ops", error)
        _state.update(tried=True, module=module, error=error)
        return module


def cpu_kernels_error() -> str | None:
    """Why `cpu_kernels()` is None (None when it is available or was not asked for yet)."""
    return _state["error"]


def need() -> ModuleType:
    """The extension; raises where it is unavailable."""
    mod = cpu_kernels()
    if mod is None:
        raise RuntimeError(f"quantspec CPU kernels unavailable: {cpu_kernels_error()}")
    return mod


def pair_path_available() -> bool:
    """Whether the kernels can run bf16 x through AVX512-BF16's dot product here
    (`packed_pairs_gemm`, the `pairs` path of the int8 / int4 GEMMs and of `paged_attention`)."""
    mod = cpu_kernels()
    return mod is not None and mod.has_bf16_dot()
