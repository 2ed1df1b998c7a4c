"""Memory sizes as users write them on the command line ("4GiB", "512MiB", "1.5GB") and as
commands print them.

Binary units (KiB, MiB, GiB, TiB, and the bare K, M, G, T) count powers of 1024, decimal ones
(KB, MB, GB, TB) powers of 1000; B is bytes. A number needs its unit: "4" could mean bytes or
gibibytes, and a cache sized a billion times off is not an answer.

>>> parse_size("4GiB", "--kv-cache-memory")
4294967296
>>> parse_size("1.5 GB", "--kv-cache-memory")
1500000000
>>> format_size(3 * 2**29)
'1.5 GiB'
"""

from __future__ import annotations

import re

from quantspec.errors import QuantSpecError

__all__ = ["format_size", "parse_size"]

_UNITS = {"b": 1, "k": 2**10, "kib": 2**10, "kb": 10**3, "m": 2**20, "mib": 2**20, "mb": 10**6,
          "g": 2**30, "gib": 2**30, "gb": 10**9, "t": 2**40, "tib": 2**40, "tb": 10**12}
_SIZE = re.compile(r"\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-zA-Z]+)\s*")


def parse_size(text: str, flag: str) -> int:
    """`text` ("4GiB", "512 MiB", "1.5GB") → bytes; anything else is an error naming `flag`."""
    m = _SIZE.fullmatch(str(text))
    unit = _UNITS.get(m.group(2).lower()) if m else None
    if unit is None:
        raise QuantSpecError(f"{flag} {text!r} is not a size; give a number and a unit, e.g. 4GiB or 512MiB")
    n = int(float(m.group(1)) * unit)
    if n < 1:
        raise QuantSpecError(f"{flag} {text!r} must be more than zero bytes")
    return n


def format_size(n: int) -> str:
    """Bytes in the largest binary unit that keeps the number at least 1 ("1.5 GiB", "640 B")."""
    for name, unit in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= unit:
            return f"{n / unit:.3g} {name}"
    return f"{n} B"
