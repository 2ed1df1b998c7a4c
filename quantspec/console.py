"""Terminal output of the CLI: consoles, progress on stderr, and the quiet of the libraries below.

- Results (tables, JSON, generated text) go to stdout; progress, status and errors to stderr.
- Tables are never cut to 80 columns when stdout is not a terminal: a console that writes to a
  file or a pipe is as wide as its widest line.
- `Progress` shows a rich progress bar on a terminal; on a pipe or log file (CI, `2> log`) it
  prints plain lines, one per phase and at most one every `PLAIN_EVERY_S` seconds, after a quiet
  start, so long work is never silent, a log is never flooded, and a command that fails on its
  input prints only its error line.
- `quiet_libraries` turns off the progress bars and info logs of transformers, datasets and
  huggingface_hub, which would otherwise interleave with quantspec's own lines.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time

from rich.console import Console

__all__ = ["PLAIN_EVERY_S", "QUIET_S", "Progress", "err_console", "out_console", "quiet_libraries", "stream_to_stdout"]

PLAIN_EVERY_S = 10.0  # plain (non-terminal) progress: at most one line this often within a phase
QUIET_S = 2.0  # plain progress: nothing during a command's first seconds
_WIDE = 10_000  # the width of a console that does not write to a terminal

_QUIET_ENV = {
    "TRANSFORMERS_VERBOSITY": "error",
    "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1",
    "DATASETS_VERBOSITY": "error",
    "HF_DATASETS_DISABLE_PROGRESS_BARS": "1",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
}


def _console(file) -> Console:
    terminal = hasattr(file, "isatty") and file.isatty()
    return Console(file=file, log_path=False, width=None if terminal else _WIDE,
                   soft_wrap=not terminal)


def out_console() -> Console:
    """stdout: results and tables."""
    return _console(sys.stdout)


def err_console() -> Console:
    """stderr: progress, status lines and errors."""
    return _console(sys.stderr)


def quiet_libraries() -> None:
    """Silence the libraries' own progress bars and info logs (a user's settings win).

    Environment variables cover libraries imported later; those already imported are set
    through their logging APIs.
    """
    for key, value in _QUIET_ENV.items():
        os.environ.setdefault(key, value)
    if "transformers" in sys.modules and os.environ.get("TRANSFORMERS_VERBOSITY") == "error":
        from transformers.utils import logging as tlog

        tlog.set_verbosity_error()
        tlog.disable_progress_bar()
    if "datasets" in sys.modules and os.environ.get("DATASETS_VERBOSITY") == "error":
        import datasets

        datasets.logging.set_verbosity_error()
        datasets.disable_progress_bars()
    logging.getLogger("huggingface_hub").setLevel(logging.ERROR)


class Progress:
    """Progress of one command on stderr: `layer(i, n, phase)` callbacks (phase "start" / "done"),
    `fraction(done, total)` for other passes, and `status(message)` lines, under a
    `description` that names the work.

    On a terminal: a transient rich bar with the status lines above it. Elsewhere (a pipe, a log
    file): plain lines, none during the first `QUIET_S` seconds (a command that ends or fails by
    then prints only its result or its one error line), then the latest one and at most one per
    `PLAIN_EVERY_S` within a phase. Use as a context manager; hand `layer` / `fraction` /
    `status` to the API as its `progress=` / `on_status=` callbacks.
    """

    def __init__(self, description: str):
        self.description = description
        self.console = err_console()
        self.terminal = self.console.is_terminal
        self._bar = self._task = None
        self._phase: str | None = None
        self._last_plain = 0.0
        self._pending: str | None = None
        self._timer: threading.Timer | None = None
        self._lock = threading.Lock()
        self._t0 = time.perf_counter()

    def __enter__(self) -> "Progress":
        if self.terminal:
            from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
            from rich.progress import Progress as _Bar

            self._bar = _Bar(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                             TimeElapsedColumn(), console=self.console, transient=True)
            self._bar.__enter__()
            self._task = self._bar.add_task(self.description, total=None)
        else:
            self._timer = threading.Timer(QUIET_S, self._flush)
            self._timer.daemon = True
            self._timer.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            self._bar.__exit__(*exc)
        if self._timer is not None:
            self._timer.cancel()
        with self._lock:
            self._pending = None

    def _elapsed(self) -> float:
        return time.perf_counter() - self._t0

    def _flush(self) -> None:
        with self._lock:
            msg, self._pending = self._pending, None
            if msg is not None:
                self._last_plain = self._elapsed()
                self.console.print(msg, highlight=False)

    def _plain(self, msg: str, *, new_phase: bool) -> None:
        """Print `msg` now, hold it through the quiet start, or drop it as too soon after the
        last line of the same phase."""
        with self._lock:
            now = self._elapsed()
            if now < QUIET_S:
                self._pending = msg
                return
            if new_phase or now - self._last_plain >= PLAIN_EVERY_S:
                self._pending, self._last_plain = None, now
                self.console.print(msg, highlight=False)

    def layer(self, i: int, n: int, phase: str = "done", what: str | None = None) -> None:
        """Layer `i` of `n` reached `phase`; `what` names the pass (e.g. "GPTQ", "α search")."""
        label = f"{self.description}{f' · {what}' if what else ''}"
        done = i + 1 if phase == "done" else i
        if self._bar is not None:
            self._bar.update(self._task, total=n, completed=done, description=f"{label} layer {done}/{n}")
            return
        new_phase, self._phase = label != self._phase, label
        self._plain(f"{label}: layer {done}/{n} ({self._elapsed():.0f} s)", new_phase=new_phase or done == n)

    def fraction(self, done: int, total: int, note: str | None = None) -> None:
        """`done` of `total` units of one pass (evaluation windows, training steps), with an
        optional `note` (e.g. the loss)."""
        label = f"{self.description}{f' {note}' if note else ''}"
        if self._bar is not None:
            self._bar.update(self._task, total=total, completed=done, description=label)
            return
        self._plain(f"{label}: {done}/{total} ({self._elapsed():.0f} s)", new_phase=done == total)

    def status(self, message: str) -> None:
        """One status line: above the bar on a terminal, a plain line elsewhere."""
        if self._bar is not None:
            self.console.print(message, highlight=False)
            return
        self._plain(message, new_phase=True)


def stream_to_stdout(text: str) -> None:
    """Write a piece of generated text to stdout as it arrives (`infer --prompt`)."""
    sys.stdout.write(text)
    sys.stdout.flush()
