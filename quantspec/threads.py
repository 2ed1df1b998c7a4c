"""How quantspec's CPU threads share the machine: how idle OpenMP threads wait, and how many run.

torch's intra-op threads, MKL's, oneDNN's and quantspec's own kernels (`kernels/csrc/cpu.cpp`,
through ATen's `parallel_for`) all run on one OpenMP runtime: the libgomp that torch's Linux wheels
ship (the extension's `libgomp.so.1` resolves to it). After each parallel region libgomp's idle
threads spin for 300,000 iterations (milliseconds) before they sleep. Beside another busy process
those spinning threads compete with it for the cores as if they were working, the scheduler
shares a core between them in whole time slices, and every parallel region waits for a thread
that is off its core: one busy process on 2 cores leaves a decode step a fraction of its fair
share. Sleeping at once (`OMP_WAIT_POLICY=passive`) costs a wake-up per region instead (a decode
step has hundreds), ~0.7x the quiet speed here. A short spin keeps both: the gaps between a step's
regions are shorter than it, and a thread idle for longer sleeps, so that a waking thread takes
its core back at once (`bench/contention.py`).

The policy:

- **wait**: `GOMP_SPINCOUNT` (`SPIN_COUNT` iterations, tens of microseconds) is put into the
  environment when quantspec is imported (`limit_spin_wait`, called by `quantspec/__init__.py`),
  unless the user set `OMP_WAIT_POLICY` or `GOMP_SPINCOUNT` or an OpenMP runtime is already
  loaded. libgomp reads these variables once, when it is loaded, i.e. when torch is imported:
  Python users import quantspec (any module of it) before torch, or set a variable themselves.
  `wait_policy()` says which one this process runs with.
- **count**: `configure(threads)` sets torch's intra-op thread count once per process, for torch's
  ops and quantspec's kernels alike: `threads` when given, else the user's `OMP_NUM_THREADS` /
  `MKL_NUM_THREADS` (torch has read them), else the CPUs this process may run on
  (`os.sched_getaffinity`, which a container's or `taskset`'s CPU set restricts). The CLI's
  `--threads N` calls it before each command that computes.
"""

from __future__ import annotations

import logging
import os
import sys

from quantspec.errors import QuantSpecError

__all__ = ["SPIN_COUNT", "allowed_cpus", "configure", "limit_spin_wait", "wait_policy"]

# libgomp's spin iterations before an idle thread sleeps, where the user did not choose: longer
# than the gaps between a decode step's parallel regions (fewer hurt quiet speed: 300 ~0.85x),
# short enough that a thread beside a busy process sleeps and is woken (more hurt it: 10,000
# ~0.25x its quiet speed); libgomp's own is 300,000
SPIN_COUNT = 1000
WAIT_VARS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")  # the user's choice of how threads wait
COUNT_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")  # the user's choice of how many (torch reads both)
_OPENMP_LIBS = ("libgomp", "libiomp", "libomp")

_log = logging.getLogger("quantspec")
_wait: dict = {"policy": None}  # filled once, by the first limit_spin_wait()


def _openmp_loaded() -> bool:
    """Whether an OpenMP runtime is mapped into this process (it has read its environment)."""
    if "torch" in sys.modules:
        return True
    try:
        with open("/proc/self/maps") as f:
            return any(lib in line for line in f for lib in _OPENMP_LIBS)
    except OSError:  # no /proc: torch not imported is the best sign left
        return False


def limit_spin_wait() -> str:
    """Ask OpenMP's idle threads to spin only briefly before they sleep, where that is still
    possible and the user made no choice; → the policy this process runs with (`wait_policy`)."""
    if _wait["policy"] is None:
        user = [f"{v}={os.environ[v]}" for v in WAIT_VARS if v in os.environ]
        if user:
            _wait["policy"] = f"{', '.join(user)} (the user's)"
        elif _openmp_loaded():
            _wait["policy"] = "spin (OpenMP was loaded before quantspec)"
        else:
            os.environ["GOMP_SPINCOUNT"] = str(SPIN_COUNT)
            _wait["policy"] = f"GOMP_SPINCOUNT={SPIN_COUNT} (quantspec's)"
    return _wait["policy"]


def wait_policy() -> str:
    """How this process's OpenMP threads wait: quantspec's spin count, the user's variables, or
    "spin (...)" where torch was imported before quantspec and no variable was set."""
    return limit_spin_wait()


def allowed_cpus() -> int:
    """How many CPUs this process may run on (its affinity mask; `os.cpu_count()` where the
    platform has no affinity)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def configure(threads: int | None = None) -> int:
    """Set torch's intra-op thread count (quantspec's kernels use the same threads) → the count.

    `threads`: a positive count; None keeps the user's `OMP_NUM_THREADS` / `MKL_NUM_THREADS`
    where one is set, else takes `allowed_cpus()`. Warns once where OpenMP spin-waits without the
    user having asked for it (torch imported before quantspec)."""
    import torch

    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        raise QuantSpecError(f"--threads must be a positive whole number, got {threads!r}")
    if wait_policy().startswith("spin") and not _wait.get("warned"):
        _wait["warned"] = True
        _log.warning("quantspec: torch was imported before quantspec, so OpenMP threads spin-wait "
                     "(slow beside other busy processes); import quantspec first or set "
                     "GOMP_SPINCOUNT=%d", SPIN_COUNT)
    if threads is None:
        if any(os.environ.get(v) for v in COUNT_VARS):
            return torch.get_num_threads()
        threads = allowed_cpus()
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    return threads
