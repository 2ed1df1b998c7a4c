"""BENCHMARKS.md from what `bench/gpu_check.sh` wrote into a folder: the machine (date, GPU,
driver, CUDA, torch, triton), each step's status and time, the GPU tests' outcome, the kernel
tables and targets, the launch-config sweep and the end-to-end tables.

    python bench/gpu_report.py DIR        # writes DIR/BENCHMARKS.md
"""

from __future__ import annotations

import datetime
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path


def machine() -> list[str]:
    import torch

    lines = [f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
             f"- torch {torch.__version__}, CUDA {torch.version.cuda}"]
    try:
        import triton

        lines[-1] += f", triton {triton.__version__}"
    except ImportError:
        lines[-1] += ", triton: not installed"
    if torch.cuda.is_available():
        cc = torch.cuda.get_device_capability()
        lines.append(f"- GPU: {torch.cuda.get_device_name()} (compute capability {cc[0]}.{cc[1]})")
        try:
            drv = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=20).stdout.strip()
            lines.append(f"- driver: {drv or 'unknown'}")
        except (OSError, subprocess.SubprocessError):
            lines.append("- driver: unknown (no nvidia-smi)")
    else:
        lines.append("- no GPU: the CPU run of the script (tiny shapes, Triton's interpreter)")
    return lines


def steps(d: Path) -> list[str]:
    out = ["| step | exit status | seconds |", "|---|---|---|"]
    f = d / "steps.tsv"
    for line in (f.read_text().splitlines() if f.exists() else []):
        name, rc, secs = line.split("\t")
        status = "ok" if rc == "0" else ("timed out" if rc in ("124", "137") else f"failed ({rc})")
        out.append(f"| {name} | {status} | {secs} |")
    return out


def tests(xml: Path) -> list[str]:
    if not xml.exists():
        return [f"- {xml.name}: no results (the step did not finish)"]
    root = ET.parse(xml).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    a = suite.attrib
    lines = [f"- {xml.stem}: {a.get('tests')} tests, {a.get('failures')} failures, {a.get('errors')} errors, "
             f"{a.get('skipped')} skipped, {float(a.get('time', 0)):.0f} s"]
    for case in suite.iter("testcase"):
        bad = case.find("failure") if case.find("failure") is not None else case.find("error")
        if bad is not None:
            msg = (bad.get("message") or "").splitlines()[0][:160] if bad.get("message") else ""
            lines.append(f"  - FAILED {case.get('classname')}::{case.get('name')}: {msg}")
    return lines


def main(argv=None) -> int:
    d = Path((argv or sys.argv[1:] or ["out/gpu_check"])[0])
    parts = ["# BENCHMARKS", "",
             "What `bench/gpu_check.sh` measured on a GPU: quantspec's Triton kernels against torch's "
             "matmul, and the engine end to end on a random-weight Llama-3-8B-shaped model. "
             "Regenerate with `bench/gpu_check.sh` on a CUDA machine.", "", "## Machine", "", *machine(),
             "", "## Steps", "", *steps(d), "", "## GPU tests", ""]
    ran = {line.split("\t")[0] for line in ((d / "steps.tsv").read_text().splitlines()
                                             if (d / "steps.tsv").exists() else [])}
    for name in ("gpu_tests", "kernel_tests"):
        if name in ran:  # a step not run (the quick check) has no line
            parts += tests(d / f"{name}.xml")
    parts.append("")
    for name, title in (("kernels_fp16.md", "## Kernels, fp16"), ("kernels_bf16.md", "## Kernels, bf16"),
                        ("kernels_fp32.md", "## Kernels, fp32"), ("e2e.md", "## End to end"),
                        ("kernels_sweep.md", "## Launch-config sweep")):
        f = d / name
        if f.exists():
            parts += [title, "", f.read_text(), ""]
    (d / "BENCHMARKS.md").write_text("\n".join(parts))
    print(f"wrote {d / 'BENCHMARKS.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
