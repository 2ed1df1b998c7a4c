"""The `quantspec` command line: a thin click layer over `quantspec.api`.

Each command parses flags into one config object, calls one API function and renders the result
with rich. A `QuantSpecError` (bad input) prints as one red line and exits with status 2; any other
exception is a bug and keeps its traceback. `group.py` holds the `quantspec` group and what every
command shares; each other module adds one family of verbs to it.
"""

from quantspec.cli.group import main
from quantspec.cli import evaluate, generate, quantize, zoo  # noqa: F401  (each adds its commands to `main`)

__all__ = ["main"]
