"""Fixtures of the engine's tests."""

import pytest
import torch

from quantspec.model_zoo.checkpoint import load_model

NOISE = 0.01  # weight noise of the "close" draft: acceptance ~60%, different per sequence


@pytest.fixture(scope="module")
def close_draft(tiny_llama_dir):
    """The tiny Llama with a little weight noise: a draft model that agrees with it most of the
    time, not always."""
    model, _ = load_model(tiny_llama_dir)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(NOISE * torch.randn(p.shape, generator=g))
    return model
