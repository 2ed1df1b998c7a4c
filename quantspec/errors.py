"""The one exception type users see: a single line that names the problem and the fix.

The CLI catches `QuantSpecError` and prints its message without a traceback; anything else is a
bug and keeps its traceback.
"""

import contextlib
from typing import Iterator

__all__ = ["QuantSpecError", "Terminated", "about", "flag", "positive_int"]


class QuantSpecError(ValueError):
    """Bad input or an unsupported request, explained in one line (problem + how to fix it)."""


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread by the CLI's handler so that it unwinds like Ctrl-C:
    temporary files are removed and nothing partial is left behind."""


def flag(name: str) -> str:
    """The CLI flag of a Python parameter name (`batch_size` → `--batch-size`): messages name the
    flag, which Python users read as the keyword of the same name."""
    return "--" + name.replace("_", "-")


def positive_int(name: str, v) -> int:
    """`v` if it is an int ≥ 1 (not a bool), else a `QuantSpecError` naming `flag(name)`."""
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise QuantSpecError(f"{flag(name)} {v!r} must be a positive integer")
    return v


@contextlib.contextmanager
def about(flag_name: str) -> Iterator[None]:
    """Errors raised inside the block are about the input given by `flag_name` (e.g. a model
    directory that fails to load is about `--model`): their message is prefixed with it, unless
    it names it already."""
    try:
        yield
    except QuantSpecError as e:
        if flag_name in str(e):
            raise
        raise QuantSpecError(f"{flag_name}: {e}") from None
