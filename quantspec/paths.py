"""Where quantspec keeps what it builds and converts: the cache directory.

`$QUANTSPEC_CACHE`, else `~/.cache/quantspec`. Below it, `models/` holds converted zoo models
(`model_zoo.default`) and `ext/` the compiled CPU kernels (`kernels.cpu`).
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["cache_dir"]


def cache_dir() -> Path:
    """The root of quantspec's cache (not created here)."""
    root = os.environ.get("QUANTSPEC_CACHE") or Path.home() / ".cache" / "quantspec"
    return Path(root)
