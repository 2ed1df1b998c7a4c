"""Smoke tests of the `bench/` scripts: they run with tiny settings and check what they print,
never how fast anything is. Every module here sets `pytestmark = pytest.mark.bench`, which the unit run leaves
out (`pytest -m bench` runs them; the README's test command runs both).

The bench scripts (`bench/spec_*.py`) are loaded once per test module."""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

BENCH_DIR = Path(__file__).resolve().parents[2] / "bench"


def _bench(name: str):
    """Load `bench/<name>.py` as a module; after the tests, restore torch's thread count (its `main`
    sets --threads for the process) and unregister it."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH_DIR / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses resolve their annotations through it
    spec.loader.exec_module(mod)
    threads = torch.get_num_threads()
    yield mod
    torch.set_num_threads(threads)
    sys.modules.pop(spec.name, None)


@pytest.fixture(scope="module")
def moe_bench():
    yield from _bench("moe")


@pytest.fixture(scope="module")
def spec_cost():
    yield from _bench("spec_cost")


@pytest.fixture(scope="module")
def spec_replay():
    yield from _bench("spec_replay")


@pytest.fixture(scope="module")
def spec_bases():
    yield from _bench("spec_bases")



@pytest.fixture(scope="module")
def big_model():
    sys.path.insert(0, str(BENCH_DIR))  # its `from mdtable import ...`
    yield from _bench("big_model")
    sys.path.remove(str(BENCH_DIR))


@pytest.fixture(scope="module")
def rotate_bench():
    sys.path.insert(0, str(BENCH_DIR))  # its `from mdtable import ...`
    yield from _bench("rotate")
    sys.path.remove(str(BENCH_DIR))


@pytest.fixture(scope="module")
def serve_bench():
    yield from _bench("serve")


@pytest.fixture(scope="module")
def draft_quant():
    yield from _bench("draft_quant")
