"""The CPU kernels' RMSNorm falls back to the module for rows its kernel does not take, with
the module's own arithmetic (no kernels needed to check it)."""

import torch

from quantspec.infer.cpu.layers import CpuRMSNorm
from quantspec.model_zoo.llama import RMSNorm


def test_kernel_norm_falls_back_to_the_llama_module():
    norm = RMSNorm(8, 1e-5)
    norm.weight.data = torch.rand(8) + 0.5
    x = torch.randn(2, 3, 8)  # 3-D: never the kernel's
    assert torch.equal(CpuRMSNorm(norm)(x), norm(x))
