"""`bench/gpu_check.sh --cpu`: the GPU check's every step on the CPU (tiny shapes, Triton's
interpreter), so that the script a lent GPU runs cannot rot between GPU sessions."""

import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.bench

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "gpu_check.sh"


def test_every_step_runs_and_writes_benchmarks_md(tmp_path):
    r = subprocess.run(["bash", str(SCRIPT), "--cpu", str(tmp_path)], capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    steps = dict(line.split("\t")[:2] for line in (tmp_path / "steps.tsv").read_text().splitlines())
    assert steps == {"gpu_tests": "0", "kernels": "0", "e2e": "0", "sweep": "0", "report": "0"}
    md = (tmp_path / "BENCHMARKS.md").read_text()
    for section in ("## Machine", "## Steps", "## GPU tests", "#### W4A16", "#### FP8", "## End to end",
                    "## Launch-config sweep"):
        assert section in md, section
    rows = [line for line in (tmp_path / "e2e.jsonl").read_text().splitlines() if line]
    assert rows and not any('"error"' in line for line in rows)


def test_without_cuda_it_says_so_in_one_line(tmp_path):
    """Without --cpu on a machine without CUDA: one line on stderr, a non-zero exit, nothing run."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    r = subprocess.run(["bash", str(SCRIPT), str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and len(r.stderr.strip().splitlines()) == 1 and "no CUDA GPU" in r.stderr
    assert not (tmp_path / "steps.tsv").exists()
