"""Which kind of step the engine is running: decode / verification rows, or a prefill.

Speculation is lossless only if a sequence's row gets bitwise the same numbers in a 1-row decode
step and in a (1 + k)-row verification step, whatever else the batch holds. quantspec's CPU
kernels give every row the same numbers for any number of rows, torch's ops do not (their
blocking depends on M). So the engine runs prefills in steps of their own, and marks the other
steps with `decode_step()`: there the layers take the row-invariant kernels for every M, while a
prefill (or any call outside the engine) keeps the usual M-based dispatch.
"""

from __future__ import annotations

import contextvars
from contextlib import contextmanager
from typing import Iterator

__all__ = ["decode_step", "in_decode_step"]

_DECODE = contextvars.ContextVar("quantspec_decode_step", default=False)


@contextmanager
def decode_step() -> Iterator[None]:
    token = _DECODE.set(True)
    try:
        yield
    finally:
        _DECODE.reset(token)


def in_decode_step() -> bool:
    return _DECODE.get()
