"""The one exception type users see: a single line that names the problem and the fix.

The CLI catches `QuantSpecError` and prints its message without a traceback; anything else is a
bug and keeps its traceback.
"""

__all__ = ["QuantSpecError"]


class QuantSpecError(ValueError):
    """Bad input or an unsupported request, explained in one line (problem + how to fix it)."""
