"""quantspec/threads.py and the CLI's `--threads`: the thread count follows the CPUs the process
may use, `--threads N` reaches torch on every command that computes, the user's OpenMP variables
are kept, and OpenMP's idle threads spin only briefly before they sleep by default."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from quantspec import api, threads
from quantspec.cli import main
from quantspec.errors import QuantSpecError
from quantspec.model_zoo.tiny import TINY_CORPUS

ROOT = Path(__file__).resolve().parents[1]
USER_VARS = threads.WAIT_VARS + threads.COUNT_VARS


@pytest.fixture
def no_user_vars(monkeypatch):
    for var in USER_VARS:
        monkeypatch.delenv(var, raising=False)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "text.jsonl"
    path.write_text("\n".join(json.dumps({"text": p}) for p in TINY_CORPUS.split("\n\n") if p.strip()))
    return path


def test_allowed_cpus_is_the_affinity_mask(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 3, 5})
    assert threads.allowed_cpus() == 3


def test_default_count_follows_the_affinity_mask(monkeypatch, no_user_vars):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {2})
    torch.set_num_threads(2)
    assert threads.configure() == 1 and torch.get_num_threads() == 1
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2})
    assert threads.configure() == 3 and torch.get_num_threads() == 3


def test_users_thread_count_is_kept_unless_a_count_is_given(monkeypatch, no_user_vars):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2})
    torch.set_num_threads(1)
    assert threads.configure() == 1 and torch.get_num_threads() == 1
    assert threads.configure(2) == 2 and torch.get_num_threads() == 2


@pytest.mark.parametrize("bad", [0, -2, 1.5, True])
def test_bad_count_names_the_flag(bad):
    with pytest.raises(QuantSpecError, match="--threads must be a positive whole number"):
        threads.configure(bad)


def _spy(monkeypatch, name: str, call_through: bool = True) -> list[int]:
    """Replace `api.<name>` by a wrapper that records torch's thread count when the CLI calls it
    (and calls the real function, or stops the command with a QuantSpecError)."""
    seen, real = [], getattr(api, name)

    def spy(*args, **kwargs):
        seen.append(torch.get_num_threads())
        if not call_through:
            raise QuantSpecError("stopped by the test")
        return real(*args, **kwargs)

    monkeypatch.setattr(api, name, spy)
    return seen


def _command(name: str, model: Path, corpus: Path, out: Path) -> list[str]:
    """The arguments of a small real run of `name` on the tiny model."""
    return {
        "infer": ["infer", "--model", model, "--prompt", "the quick brown fox", "--no-chat-template",
                  "--max-new-tokens", 4],
        "quantize": ["quantize", "--model", model, "--quant-type", "weight_only_int8", "--out", out],
        "calibrate": ["calibrate", "--model", model, "--dataset", corpus, "--num-samples", 2, "--seq-len", 16,
                      "--out", out],
        "evaluate": ["eval", "--model", model, "--dataset", corpus, "--split", "train", "--seq-len", 16,
                     "--max-windows", 2],
        "train_mtp": ["zoo", "train-mtp", "--model", model, "--dataset", corpus, "--steps", 1, "--seq-len", 16,
                      "--batch-size", 1, "--num-samples", 2, "--no-self-distill", "--out", out],
        "report": ["report", "--model", model, "--out", out],
    }[name]


COMMANDS = ["infer", "quantize", "calibrate", "evaluate", "train_mtp", "report"]


@pytest.mark.parametrize("name", COMMANDS)
def test_threads_flag_reaches_torch(name, monkeypatch, tiny_llama_dir, corpus, tmp_path):
    # report builds and times a matrix of artifacts (minutes): its API call is stopped once seen
    seen = _spy(monkeypatch, name, call_through=name != "report")
    torch.set_num_threads(1)
    args = [str(a) for a in _command(name, tiny_llama_dir, corpus, tmp_path / "out")] + ["--threads", "2"]
    res = CliRunner().invoke(main, args)
    assert seen == [2], res.output
    assert res.exit_code == (2 if name == "report" else 0), res.output


def test_cli_default_is_the_affinity_count_or_the_users(monkeypatch, no_user_vars, tiny_llama_dir):
    seen = _spy(monkeypatch, "infer", call_through=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2})
    torch.set_num_threads(1)
    args = [str(a) for a in _command("infer", tiny_llama_dir, Path(), Path())]
    CliRunner().invoke(main, args)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    CliRunner().invoke(main, args)
    assert seen == [3, 1]


@pytest.mark.parametrize("name", COMMANDS)
def test_threads_zero_is_one_line_exit_2(name, monkeypatch, tiny_llama_dir, corpus, tmp_path):
    seen = _spy(monkeypatch, name, call_through=False)
    args = [str(a) for a in _command(name, tiny_llama_dir, corpus, tmp_path / "out")] + ["--threads", "0"]
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 2 and seen == []
    assert res.stderr.strip().splitlines() == ["error: --threads must be a positive whole number, got 0"]


def _python(code: str, **env_vars) -> subprocess.CompletedProcess:
    """Run `code` in a fresh interpreter on this checkout, without the user's OpenMP variables
    (plus `env_vars`), with OpenMP displaying the settings it read when it was loaded."""
    env = {k: v for k, v in os.environ.items() if k not in USER_VARS}
    env.update(PYTHONPATH=str(ROOT), OMP_DISPLAY_ENV="verbose", **env_vars)
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)


def _spin_count(res: subprocess.CompletedProcess) -> str:
    """GOMP_SPINCOUNT as libgomp displayed it (skips where the OpenMP runtime is not libgomp)."""
    for line in res.stderr.splitlines():
        if line.strip().startswith("GOMP_SPINCOUNT"):
            return line.split("=")[1].strip().strip("'")
    pytest.skip(f"torch's OpenMP runtime displayed no GOMP_SPINCOUNT: {res.stderr[-300:]}")


REPORT = ("import os, quantspec.threads as t; print(t.wait_policy()); "
          "print(os.environ.get('OMP_WAIT_POLICY'), os.environ.get('GOMP_SPINCOUNT'))")
OURS = str(threads.SPIN_COUNT)


def test_importing_quantspec_first_limits_the_spin():
    res = _python(f"import quantspec.api, torch; torch.ones(1); {REPORT}")
    assert res.returncode == 0, res.stderr
    assert res.stdout.splitlines() == [f"GOMP_SPINCOUNT={OURS} (quantspec's)", f"None {OURS}"]
    assert _spin_count(res) == OURS


def test_the_cli_runs_with_the_limited_spin():
    res = _python("import sys; from quantspec.cli import main; sys.argv = ['quantspec', 'infer', '--threads', '0']; main()")
    assert res.returncode == 2 and "--threads" in res.stderr
    assert _spin_count(res) == OURS


@pytest.mark.parametrize("var,value,spin", [("OMP_WAIT_POLICY", "passive", "0"),
                                            ("OMP_WAIT_POLICY", "active", "30000000000"),
                                            ("GOMP_SPINCOUNT", "50", "50")])
def test_users_wait_variables_are_kept(var, value, spin):
    res = _python(f"import quantspec, torch; {REPORT}", **{var: value})
    assert res.returncode == 0, res.stderr
    assert res.stdout.splitlines()[0] == f"{var}={value} (the user's)"
    assert value in res.stdout.splitlines()[1].split()  # and quantspec set nothing beside it
    assert "None" in res.stdout.splitlines()[1].split()
    assert _spin_count(res) == spin


def test_torch_imported_first_spins_and_configure_says_so():
    res = _python(f"import torch, quantspec.threads; quantspec.threads.configure(); {REPORT}")
    assert res.returncode == 0, res.stderr
    assert res.stdout.splitlines() == ["spin (OpenMP was loaded before quantspec)", "None None"]
    assert f"import quantspec first or set GOMP_SPINCOUNT={OURS}" in res.stderr
    assert int(_spin_count(res)) == 300000  # libgomp's default
