"""bench/kernels_cpu.py's attention table runs (one layer, short context) and prints a row per
number of query rows with every column filled."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from quantspec.kernels import cpu as cg

pytestmark = pytest.mark.bench

BENCH = Path(__file__).resolve().parents[2] / "bench" / "kernels_cpu.py"


@pytest.mark.skipif(cg.cpu_kernels() is None, reason="quantspec's CPU kernels are not built here")
def test_attention_table_prints_a_row_per_query_count():
    out = subprocess.run([sys.executable, str(BENCH), "--threads", "1", "--kinds", "", "--rate-rows", "",
                          "--prefill-rows", "", "--pair-rows", "", "--layers", "2", "--attention-rows", "1,3,20",
                          "--context", "37"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    rows = [ln for ln in out.stdout.splitlines() if re.match(r"\| \d+ \| \d+ \|", ln)]
    assert [ln.split("|")[1:3] for ln in rows] == [[" 1 ", " 37 "], [" 3 ", " 37 "], [" 20 ", " 20 "]]
    for ln in rows:  # six timings and four ratios, all positive
        cells = [c.strip().rstrip("x") for c in ln.strip("|").split("|")[2:]]
        assert len(cells) == 10 and all(float(c) > 0 for c in cells)


@pytest.mark.parametrize("args,message", [(["--attention-rows", "1,x"], "--attention-rows '1,x': give comma-separated"),
                                          (["--rows", "0"], "--rows '0': give comma-separated"),
                                          (["--context", "0"], "--context 0: give 1 or more")])
def test_bad_input_is_one_line(args, message):
    out = subprocess.run([sys.executable, str(BENCH), *args], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and out.stderr.strip().splitlines() == [out.stderr.strip()]
    assert message in out.stderr
