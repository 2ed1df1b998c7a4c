"""Shared session-scoped fixtures: tiny offline HF checkpoints and the tiny tokenizer.

Each fixture builds once per test session under pytest's `tmp_path_factory` (fast: < 2 s each)
and yields the directory path. Tests must not modify these directories; build a private one with
`quantspec.model_zoo.tiny.build_tiny_model(tmp_path, ...)` when a test needs other options.
"""

from pathlib import Path

import pytest
import torch

from quantspec.model_zoo.tiny import build_tiny_model, build_tiny_tokenizer


@pytest.fixture(autouse=True)
def _torch_threads_kept():
    """Each test leaves torch's thread count as it found it: the CLI's commands set it for the
    process (`--threads`, quantspec/threads.py), and test modules choose their own."""
    count = torch.get_num_threads()
    yield
    if torch.get_num_threads() != count:
        torch.set_num_threads(count)


@pytest.fixture(autouse=True)
def _quiet_start_outlasts_a_test(monkeypatch):
    """Plain progress prints nothing during a command's first `QUIET_S` seconds, so a command
    that fails on its input prints only its error line; tests assert that one line, and on a
    loaded machine a command can take longer than that to fail: the quiet start outlasts a test."""
    monkeypatch.setattr("quantspec.console.QUIET_S", 600.0)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    """2-layer Llama, hidden 64, 4 heads / 2 KV heads, vocab 512, untied, fp32, seed 0."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny_llama"), "llama")


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory) -> Path:
    """2-layer Qwen2 (q/k/v bias), hidden 64, 4 heads / 2 KV heads, vocab 512, untied, seed 0."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny_qwen2"), "qwen2")


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory) -> Path:
    """The tiny byte-level BPE tokenizer (variant 0, vocab 512), saved with save_pretrained."""
    out = tmp_path_factory.mktemp("tiny_tokenizer")
    build_tiny_tokenizer(out)
    return out


@pytest.fixture(scope="module")
def tiny_llama_model(tiny_llama_dir):
    """The tiny Llama loaded as a `model_zoo` Transformer (torch's modules, fp32), one per test
    module; tests must not change its weights."""
    from quantspec.model_zoo.checkpoint import load_model

    return load_model(tiny_llama_dir)[0]
