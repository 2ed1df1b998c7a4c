"""What quantspec leaves on disk: modes under the user's umask, no partial output on SIGTERM,
leftovers of killed runs removed by the next run, and output checks before any work."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from quantspec import api
from quantspec.errors import QuantSpecError
from quantspec.model_zoo.tiny import TINY_CORPUS
from quantspec.outputs import atomic_dir, atomic_file, check_output_dir, check_output_file, remove_leftovers


def _dead_pid() -> int:
    """A PID that no process has right now."""
    pid = 4_000_000
    while True:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return pid
        except PermissionError:
            pass
        pid -= 1


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def _modes(root: Path) -> set[tuple[str, int]]:
    return {("d" if p.is_dir() else "f", stat.S_IMODE(p.stat().st_mode)) for p in [root, *root.rglob("*")]}


def test_artifact_and_table_modes_follow_the_umask(tiny_llama_dir, tmp_path, umask_022):
    data = tmp_path / "calib.txt"
    data.write_text(TINY_CORPUS)
    art = api.quantize(str(tiny_llama_dir), "weight_only_int8", tmp_path / "art")
    table = api.calibrate(str(tiny_llama_dir), str(data), tmp_path / "calib", num_samples=2, seq_len=16).path
    for root in (art, table):
        assert _modes(root) == {("d", 0o755), ("f", 0o644)}, root
    with atomic_file(tmp_path / "x.jsonl") as tmp:
        tmp.write_text("{}\n")
    assert stat.S_IMODE((tmp_path / "x.jsonl").stat().st_mode) == 0o644
    os.umask(0o077)
    with atomic_dir(tmp_path / "private") as tmp:
        (tmp / "a").write_text("x")
    assert _modes(tmp_path / "private") == {("d", 0o700), ("f", 0o600)}


def test_leftovers_of_dead_runs_are_removed_live_ones_kept(tiny_llama_dir, tmp_path, caplog):
    dead, live = _dead_pid(), os.getppid()
    stale_tmp = tmp_path / f".art.tmp-{dead}-0123abcd"
    stale_old = tmp_path / f".art.old-{dead}-89abcdef"
    running = tmp_path / f".art.tmp-{live}-00000000"
    other = tmp_path / f".other.tmp-{dead}-00000000"  # another target's: not ours to remove
    for d in (stale_tmp, stale_old, running, other):
        d.mkdir()
        (d / "model.safetensors").write_bytes(b"\0" * 64)
    with caplog.at_level("WARNING", logger="quantspec"):
        api.quantize(str(tiny_llama_dir), "weight_only_int8", tmp_path / "art")
    assert not stale_tmp.exists() and not stale_old.exists()
    assert running.exists() and other.exists()
    assert "removed 2 leftover(s) of an interrupted run" in caplog.text
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["art", running.name, other.name])
    assert remove_leftovers(tmp_path / "art") == []


def _run_cli_killed(tmp_path: Path, model: Path, out: Path, sig: int) -> subprocess.CompletedProcess:
    """Run `quantspec quantize` in a subprocess that sends itself `sig` while the artifact's
    weights are being written (the shard writer's file writer, patched to signal after a part)."""
    script = textwrap.dedent(f"""
        import os, signal, sys
        import quantspec.quant.shards as shards
        real = shards.write_safetensors
        def write_safetensors(path, tensors):
            real(path, tensors)  # a part exists: the kill lands mid-write
            os.kill(os.getpid(), {int(sig)})
            signal.pause()
        shards.write_safetensors = write_safetensors
        from quantspec.cli import main
        sys.argv = ["quantspec", "quantize", "--model", {str(model)!r}, "--quant-type", "weight_only_int8",
                    "--out", {str(out)!r}]
        main()
    """)
    env = {**os.environ, "QUANTSPEC_CPU_KERNELS": "0"}
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          cwd=tmp_path, env=env)


def test_sigterm_leaves_nothing_and_exits_143(tiny_llama_dir, tmp_path):
    out = tmp_path / "w8"
    r = _run_cli_killed(tmp_path, tiny_llama_dir, out, signal.SIGTERM)
    assert r.returncode == 143, r.stderr
    assert r.stderr.strip().splitlines()[-1] == "terminated; nothing partial was left behind", r.stderr
    assert "Traceback" not in r.stderr
    assert list(tmp_path.iterdir()) == []


def test_sigkill_leftover_is_removed_by_the_next_run(tiny_llama_dir, tmp_path):
    out = tmp_path / "w8"
    r = _run_cli_killed(tmp_path, tiny_llama_dir, out, signal.SIGKILL)
    assert r.returncode == -signal.SIGKILL
    left = [p.name for p in tmp_path.iterdir()]
    assert len(left) == 1 and left[0].startswith(".w8.tmp-"), left
    api.quantize(str(tiny_llama_dir), "weight_only_int8", out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["w8"]


def test_output_checks_create_nothing(tmp_path):
    target = tmp_path / "new" / "deeper" / "out.jsonl"
    assert check_output_file(target, "--output-file") == target
    assert check_output_dir(tmp_path / "a" / "b", "--out") == tmp_path / "a" / "b"
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "file").write_text("x")
    with pytest.raises(QuantSpecError, match=r"--out .*file is not a directory"):
        check_output_dir(tmp_path / "file" / "sub", "--out")
    with pytest.raises(QuantSpecError, match=r"--output-file .* is a directory"):
        check_output_file(tmp_path, "--output-file")
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "x").write_text("x")
    with pytest.raises(QuantSpecError, match="pass --overwrite"):
        check_output_dir(busy, "--out")
    check_output_dir(busy, "--out", overwrite=True)


def test_failed_write_keeps_the_previous_file(tmp_path):
    target = tmp_path / "out.jsonl"
    target.write_text("previous\n")
    with pytest.raises(RuntimeError):
        with atomic_file(target) as tmp:
            tmp.write_text("half")
            raise RuntimeError("crash midway")
    assert target.read_text() == "previous\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.jsonl"]
