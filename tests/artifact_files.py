"""Helpers the quantized head and embedding tests share: an artifact's tensors, and transformers'
logits on a checkpoint."""

from pathlib import Path

import torch
from safetensors.torch import load_file


def tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the one-file checkpoint at `path`."""
    return load_file(str(path / "model.safetensors"))


def hf_logits(path: Path, ids: torch.Tensor) -> torch.Tensor:
    """transformers' fp32 logits of `ids` [1, S] on the checkpoint at `path`, [S, V]."""
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    with torch.no_grad():
        return m(ids).logits[0]
