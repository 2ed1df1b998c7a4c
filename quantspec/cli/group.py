"""The `quantspec` group and what every command shares: one-line errors, `--threads`, SIGTERM.

Each command parses flags into one config object, calls one API function and renders the result
with rich. A `QuantSpecError` (bad input) prints as one red line and exits with status 2; any other
exception is a bug and keeps its traceback.
"""

from __future__ import annotations

import functools
import signal
import sys
import threading

import click

from quantspec import __version__
from quantspec.errors import QuantSpecError, Terminated

__all__ = ["EXIT_BAD_INPUT", "main", "one_line_errors", "rotate_option", "threads_option"]


EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT
EXIT_TERMINATED = 143  # 128 + SIGTERM


def one_line_errors(fn):
    """Turn QuantSpecError (and Ctrl-C / SIGTERM) into one line on stderr and a non-zero exit."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except QuantSpecError as e:
            click.secho(f"error: {e}", fg="red", err=True)
            sys.exit(EXIT_BAD_INPUT)
        except Terminated:
            click.secho("terminated; nothing partial was left behind", fg="yellow", err=True)
            sys.exit(EXIT_TERMINATED)
        except KeyboardInterrupt:
            click.secho("interrupted; nothing partial was left behind", fg="yellow", err=True)
            sys.exit(EXIT_INTERRUPTED)

    return wrapper


def threads_option(fn):
    """Add `--threads N` to a command that computes and apply it (quantspec.threads.configure)
    before the command runs; place it under `one_line_errors`, so a bad count is one line."""

    @click.option("--threads", type=int, default=None,
                  help="CPU threads [default: OMP_NUM_THREADS if set, else the CPUs this process may use].")
    @functools.wraps(fn)
    def wrapper(*args, threads=None, **kwargs):
        from quantspec.threads import configure

        configure(threads)
        return fn(*args, **kwargs)

    return wrapper


rotate_option = click.option(
    "--rotate", default=None, metavar="R1|R1,R2|R1,R2,R4|R4",
    help="fuse rotations into the weights before quantizing (SpinQuant's R1: the residual stream, R2: each "
         "head's values; random Hadamard matrices with signs from --seed): the same model, whose outliers "
         "the quantizers see spread; the artifact unties a tied embedding, and `calibrate` takes the same "
         "--rotate / --seed for its table. R4 turns each down_proj's input by a block Hadamard transform at "
         "run time (vLLM and quantspec run it; a table for static input scales is calibrated with it too)")


def _raise_terminated(signum, frame):
    raise Terminated()


class _Main(click.Group):
    """The `quantspec` group: click's usage errors as one line, SIGTERM unwinding like Ctrl-C, and
    the libraries below kept quiet."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        from quantspec.console import quiet_libraries

        quiet_libraries()
        in_main_thread = threading.current_thread() is threading.main_thread()
        previous = signal.signal(signal.SIGTERM, _raise_terminated) if in_main_thread else None
        try:
            if not standalone_mode:
                return super().main(args, prog_name, complete_var, standalone_mode, **extra)
            try:
                rv = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
            except click.exceptions.Abort:
                click.secho("interrupted; nothing partial was left behind", fg="yellow", err=True)
                sys.exit(EXIT_INTERRUPTED)
            except click.ClickException as e:
                hint = ""
                if isinstance(e, click.UsageError) and e.ctx is not None:
                    hint = f" (see '{e.ctx.command_path} --help')"
                message = " ".join(e.format_message().split())
                click.secho(f"error: {message}{hint}", fg="red", err=True)
                sys.exit(e.exit_code)
            sys.exit(rv if isinstance(rv, int) else 0)
        finally:
            if in_main_thread:
                signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)


@click.group(cls=_Main, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="quantspec")
def main():
    """Quantize, calibrate, run with speculative decoding, and report on decoder LLMs."""
