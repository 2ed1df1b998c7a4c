"""bench/contention.py runs end to end on the tiny model (one round, a few tokens) and prints a
row per worker with every number filled; no timing is asserted."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.bench

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench" / "contention.py"


def _bench(*args) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, str(BENCH), *map(str, args)], env=env, capture_output=True,
                          text=True, timeout=300)


def test_prints_both_policies_quiet_and_busy(tiny_llama_dir):
    out = _bench("--model", tiny_llama_dir, "--rounds", 1, "--new-tokens", 2, "--prompt-tokens", 4,
                 "--threads", 1, "--settle", 0, "--max-others", 99)
    assert out.returncode == 0, out.stderr
    rows = [ln for ln in out.stdout.splitlines() if ln.startswith(("| quantspec's default", "| OpenMP's default"))]
    assert len(rows) == 2, out.stdout
    for ln in rows:
        cells = [c.strip().rstrip("x") for c in ln.strip("|").split("|")[2:]]
        assert len(cells) == 3 and all(float(c) > 0 for c in cells)
    assert "GOMP_SPINCOUNT=" in rows[0] and "| spin (" in rows[1]
    assert re.search(r"quantspec / spin: quiet [\d.]+x, busy [\d.]+x", out.stdout)


def test_bad_input_is_one_line():
    out = _bench("--rounds", 0)
    assert out.returncode != 0 and out.stderr.strip() == "--rounds 0: give 1 or more"
